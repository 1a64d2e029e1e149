"""The census's cases of sentence-transformers 6.2.0, the package imported whole from its wheel
(with transformers 5.23, the project's lock): ``MultipleNegativesRankingLoss`` and its cached
variant, in one direction or two; the deprecated ``(Cached)MultipleNegativesSymmetricRankingLoss``
themselves; ``GISTEmbedLoss`` and ``CachedGISTEmbedLoss`` with a real guide (a small
``SentenceTransformer`` of random weights); the multi-vector
``(Cached)MultiVectorMultipleNegativesRankingLoss``, the sparse
``SparseMultipleNegativesRankingLoss`` and the cross-encoder
``(Cached)MultipleNegativesRankingLoss`` (each with ``gather_across_devices`` off and on where it
has the flag; the cross-encoder losses have none)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from census_cases.common import Case, Fix, NotRun, flags_text, importable, root_of

SBERT = "6.2.0"
ST = "sentence-transformers"


def sbert(root: str | Path | None) -> Path:
    """The release at ``root`` (by default the census's unpacked wheel) first on the import path:
    ``import sentence_transformers`` is then the released package, ``__init__`` and all (its
    imports, transformers and tokenizers among them, are the venv's)."""
    root = root_of(root, ST, SBERT)
    importable(root, "sentence_transformers")
    return root


class _Given(nn.Module):
    """The model's one module: the embedding each row of a column carries (``features
    ["embedding"]``: the check's z0 or z1, gatherlab's MLP's output) as its
    ``sentence_embedding``, in place of a transformer and pooling."""

    def forward(self, features: dict[str, Any]) -> dict[str, Any]:
        return {**features, "sentence_embedding": features["embedding"]}


class _GivenModel(nn.Sequential):
    """The trained model as a loss asks for it, written here: a sequence of modules (the losses
    look at ``model[0]``, a StaticEmbedding or not) whose forward returns the embeddings the
    check gives; with the guide's tokenizer and ``max_seq_length`` when there is a guide (so
    that GIST finds the same vocabulary and does not re-tokenize)."""

    def __init__(self, tokenizer: Any = None, max_seq_length: int = 16):
        super().__init__(_Given())
        self.tokenizer, self.max_seq_length = tokenizer, max_seq_length


# --- MultipleNegativesRankingLoss and its cached and symmetric forms -----------------------------


class SbertMNRL(nn.Module):
    """sentence-transformers' released ``MultipleNegativesRankingLoss(model, **flags)`` (or
    ``loss=`` another class of ``sentence_transformers.sentence_transformer.losses`` built the
    same way: ``MultipleNegativesSymmetricRankingLoss``) through
    ``compute_loss_from_embeddings([z0, z1], labels=None)``, what its ``forward`` calls once the
    model has embedded the two columns (z0 the anchors, z1 the positives); with ``cached=True``
    ``CachedMultipleNegativesRankingLoss(model, mini_batch_size=4, **flags)`` (or
    ``CachedMultipleNegativesSymmetricRankingLoss``) through ``calculate_loss([[z0], [z1]])``, its
    loss over mini-batches of 4 rows of the score matrix (GradCache's recomputation of the model
    is not what is checked: the embeddings are given). The model (`_GivenModel`) is never called;
    the cached losses' constructors look at its first module."""

    def __init__(self, root=None, cached=False, loss="", **flags):
        super().__init__()
        sbert(root)
        from sentence_transformers.sentence_transformer import losses

        self.cached = cached
        if cached:
            built = getattr(losses, loss or "CachedMultipleNegativesRankingLoss")
            self.loss = built(_GivenModel(), mini_batch_size=4, **flags)
        else:
            built = getattr(losses, loss or "MultipleNegativesRankingLoss")
            self.loss = built(_GivenModel(), **flags)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        if self.cached:
            return self.loss.calculate_loss([[z0], [z1]])
        return self.loss.compute_loss_from_embeddings([z0, z1], None)


# --- GISTEmbedLoss and CachedGISTEmbedLoss, with a guide --------------------------------------

WORDS = ("red", "blue", "green", "cat", "dog", "bird", "runs", "sleeps", "sings", "fast", "slow",
         "today", "here", "there", "small", "big")  # fmt: skip
TEXT_WORDS = 4  # words per text
GUIDE_SEED = 1234  # the guide's weights
TEXT_SEED = 2024  # the texts


def gist_texts(global_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's anchor and positive text as indices into `WORDS`, (N, 4) integers each: a row
    per sample, split over the ranks as the views are. Drawn from a generator of their own
    (`TEXT_SEED`); a positive shares its anchor's first two words, so the guide's similarities
    vary, and some in-batch candidates lie closer to an anchor than its positive does."""
    generator = torch.Generator().manual_seed(TEXT_SEED)
    words = torch.randint(0, len(WORDS), (global_batch_size, 6), generator=generator)
    return words[:, :TEXT_WORDS], torch.cat((words[:, :2], words[:, TEXT_WORDS:]), 1)


def _guide(directory: str):
    """The guide, a ``SentenceTransformer``: a 2-layer BERT (hidden size 32, 2 heads, random
    weights drawn from `GUIDE_SEED`, dropout off) and mean pooling, in float64, with a
    ``tokenizers`` WordLevel tokenizer over `WORDS` and BERT's special tokens, built in
    ``directory``: no download, the same on every rank and on one device."""
    from safetensors.torch import save_file
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    vocabulary = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3}
    vocabulary |= {word: i + len(vocabulary) for i, word in enumerate(WORDS)}
    words = Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
        sep_token="[SEP]",
    ).save_pretrained(directory)  # fmt: skip
    config = BertConfig(vocab_size=len(vocabulary), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(GUIDE_SEED)
        weights = BertModel(config).state_dict()
    # written by hand: save_pretrained writes on rank 0 only once a process group exists
    config.to_json_file(str(Path(directory, "config.json")))
    save_file(weights, str(Path(directory, "model.safetensors")))
    hf_logging.disable_progress_bar()  # its weights' loading bar, in every rank
    modules = [Transformer(directory, max_seq_length=16), Pooling(32)]
    guide = SentenceTransformer(modules=modules, device="cpu").double()
    return guide.eval().requires_grad_(False)


class SbertGIST(nn.Module):
    """sentence-transformers' released ``GISTEmbedLoss(model, guide, **flags)``, or with
    ``cached=True`` ``CachedGISTEmbedLoss(model, guide, mini_batch_size=4, **flags)``, the guide
    a real ``SentenceTransformer`` (`_guide`, frozen) and the model `_GivenModel` (the check's
    embeddings, with the guide's tokenizer). Besides z0 (the anchors) and z1 (the positives) the
    loss takes each row's two texts (`gist_texts`, the case's inputs: each rank its rows), which
    the adapter writes out as words and tokenizes with the guide's ``preprocess``: one column's
    features per view, carrying its embeddings. ``GISTEmbedLoss`` runs its ``forward`` on those
    columns: the model gives the check's embeddings, the guide embeds the texts (no gradient),
    and its scores mask the candidates closer to an anchor than its positive.
    ``CachedGISTEmbedLoss`` runs ``calculate_loss`` on the embeddings and the guide's
    embeddings of the same texts (its loss over mini-batches of 4 anchors; GradCache's
    recomputation of the model is not what is checked). The guide's weights are random: the
    distributed path (which candidates are gathered, which terms are masked) does not depend on
    what the guide has learnt, only on its scores being the same on W ranks and on one device."""

    def __init__(self, root=None, cached=False, **flags):
        super().__init__()
        sbert(root)
        from sentence_transformers.sentence_transformer import losses

        with tempfile.TemporaryDirectory() as directory:
            guide = _guide(directory)
        model = _GivenModel(guide.tokenizer, guide.max_seq_length)
        self.cached = cached
        if cached:
            self.loss = losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=4, **flags)
        else:
            self.loss = losses.GISTEmbedLoss(model, guide, **flags)

    def _column(self, words: torch.Tensor, embedding: torch.Tensor) -> dict[str, Any]:
        texts = [" ".join(WORDS[i] for i in row) for row in words.tolist()]
        return {**self.loss.guide.preprocess(texts), "embedding": embedding}

    def forward(self, z0: torch.Tensor, z1: torch.Tensor, anchor_words: torch.Tensor,
                positive_words: torch.Tensor) -> torch.Tensor:  # fmt: skip
        columns = [self._column(anchor_words, z0), self._column(positive_words, z1)]
        if not self.cached:
            return self.loss(columns, None)
        with torch.no_grad():
            guided = [self.loss.guide(dict(column))["sentence_embedding"] for column in columns]
        return self.loss.calculate_loss([[z0], [z1]], [[guided[0]], [guided[1]]])


# --- the multi-vector, sparse and cross-encoder variants --------------------------------------

PAIRS = 256  # the cross-encoder's pairs with every in-batch negative, 16 · 16 on one device
TOKENS, DIM = 2, 8  # a multi-vector row: its 16 dimensions read as 2 tokens of 8


class _TokenModel(nn.Module):
    """The multi-vector model, written here: each column's features carry their token embeddings
    already (the check's z0 or z1, 2 tokens of 8), which it returns with their attention mask
    (every token kept), whatever the task (query or document)."""

    def forward(self, features: dict[str, Any], task: str | None = None) -> dict[str, Any]:
        return {"token_embeddings": features["token_embeddings"],
                "attention_mask": features["attention_mask"]}  # fmt: skip


class SbertMultiVector(nn.Module):
    """sentence-transformers' released ``MultiVectorMultipleNegativesRankingLoss(model,
    **flags)`` on two columns, the queries (z0) and their documents (z1), each row's 16
    dimensions read as 2 tokens of 8 (ids 1, 2; attention mask 1), through its ``forward``: the
    model (`_TokenModel`) returns the tokens, the loss scores every query against every document
    by ColBERT's MaxSim (``colbert_scores``) and takes the cross-entropy to the own document.
    With ``cached=True`` ``CachedMultiVectorMultipleNegativesRankingLoss(model,
    mini_batch_size=4, **flags)`` through ``calculate_loss([[q], [d]], [[mask], [mask]])``, its
    loss over score mini-batches of 4 queries (GradCache's recomputation of the model is not
    what is checked)."""

    def __init__(self, root=None, cached=False, **flags):
        super().__init__()
        sbert(root)
        from sentence_transformers.multi_vector_encoder import losses

        self.cached = cached
        if cached:
            self.loss = losses.CachedMultiVectorMultipleNegativesRankingLoss(
                _TokenModel(), mini_batch_size=4, **flags
            )
        else:
            self.loss = losses.MultiVectorMultipleNegativesRankingLoss(_TokenModel(), **flags)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        tokens = [z.view(len(z), TOKENS, DIM) for z in (z0, z1)]
        mask = torch.ones(len(z0), TOKENS, dtype=torch.long, device=z0.device)
        if self.cached:
            return self.loss.calculate_loss([[t] for t in tokens], [[mask.bool()]] * 2)
        ids = torch.arange(1, TOKENS + 1, device=z0.device).repeat(len(z0), 1)
        columns = [{"input_ids": ids, "attention_mask": mask, "token_embeddings": t}
                   for t in tokens]  # fmt: skip
        return self.loss(columns)


class SbertSparse(nn.Module):
    """sentence-transformers' released ``SparseMultipleNegativesRankingLoss(model, **flags)``
    (dot-product scores, scale 1) through ``compute_loss_from_embeddings([z0, z1], None)``,
    what ``SpladeLoss`` and ``CSRLoss`` call on the sparse model's embeddings (its own
    ``forward`` refuses to run alone); the embeddings are the check's z0, z1 as given, dense:
    the loss's distributed path does not depend on their zeros. The regularizers SpladeLoss adds
    (FLOPS) are not part of the row."""

    def __init__(self, root=None, **flags):
        super().__init__()
        sbert(root)
        from sentence_transformers.sparse_encoder.losses import (
            SparseMultipleNegativesRankingLoss,
        )

        self.loss = SparseMultipleNegativesRankingLoss(_GivenModel(), **flags)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        return self.loss.compute_loss_from_embeddings([z0, z1], None)


def _pair_scorer():
    """The cross-encoder, written here as a subclass of the released ``CrossEncoder`` (the
    losses accept no other class) that holds no transformer: a pair of texts ``("i", "j")`` is
    row i of the rank's anchors (z0) against row j of its candidates (z1), scored by the cosine
    of their embeddings. It replaces the transformer that would read the two texts together;
    the loss's scores are then a function of the check's embeddings."""
    from sentence_transformers.cross_encoder import CrossEncoder

    class PairScorer(CrossEncoder):
        num_labels = 1
        device = torch.device("cpu")

        def __init__(self):
            nn.Module.__init__(self)
            self.columns: tuple[torch.Tensor, torch.Tensor] | None = None

        def preprocess(self, pairs, prompt=None, task=None) -> dict[str, torch.Tensor]:
            return {"pairs": torch.tensor([[int(a), int(b)] for a, b in pairs])}

        def forward(self, features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            anchors, candidates = self.columns
            a, b = features["pairs"].T
            return {"scores": F.cosine_similarity(anchors[a], candidates[b], dim=-1)[:, None]}

    return PairScorer()


class SbertCrossEncoder(nn.Module):
    """sentence-transformers' released cross-encoder ``MultipleNegativesRankingLoss(model,
    **flags)`` (or with ``cached=True`` ``CachedMultipleNegativesRankingLoss(model,
    mini_batch_size=256, **flags)``, GradCache's two passes through the model included) through
    its ``forward`` on two columns of texts, the rank's anchors ``"0"``, …, ``"B-1"`` and their
    positives likewise: it pairs each anchor with its positive and with in-batch negatives, has
    the model score the pairs (`_pair_scorer`: the cosine of the check's z0 and z1 rows), and
    takes the cross-entropy to the positive after a sigmoid and scale 10. The cached loss's
    mini-batch holds every pair (16 · 16 on one device): its second pass back-propagates each
    mini-batch's cached gradient through the model once, and the stand-in's scores hang on the
    check's one graph of z0 and z1, which a second mini-batch would traverse again."""

    def __init__(self, root=None, cached=False, **flags):
        super().__init__()
        sbert(root)
        from sentence_transformers.cross_encoder import losses

        if cached:
            built = losses.CachedMultipleNegativesRankingLoss(
                _pair_scorer(), mini_batch_size=PAIRS, **flags
            )
        else:
            built = losses.MultipleNegativesRankingLoss(_pair_scorer(), **flags)
        self.loss = built

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        self.loss.model.columns = (z0, z1)
        rows = [str(i) for i in range(len(z0))]
        return self.loss([rows, list(rows)], None)


# --- the cases ---------------------------------------------------------------------------------

GATHER_ACROSS = "gather_across_devices=True (next row)"


def _sbert(loss: str, factory: Any, kwargs: dict[str, Any], on: dict[str, Any] | None = None,
           both: dict[str, Any] | None = None, remark: str = "",
           **flags: Any) -> list[Case]:  # fmt: skip
    """A loss with ``gather_across_devices`` off (a "no gathering" row, with ``remark``) and on;
    ``on``: the second row's further fields (its fix), ``both``: both rows' (inputs, patch)."""
    gathered = {**flags, "gather_across_devices": True}
    return [
        Case(ST, SBERT, loss, flags_text(flags) + " (no gathering)", factory,
             {**kwargs, **flags}, note=GATHER_ACROSS, remark=remark, **(both or {})),
        Case(ST, SBERT, loss, flags_text(gathered), factory, {**kwargs, **gathered},
             **(both or {}), **(on or {})),
    ]  # fmt: skip


MAXSIM_FLOAT64 = Fix(
    "MaxSim's query-token maxima kept in float64 (`.float()` made `promote_types(dtype, "
    "float32)`): cast to float32, the scores and the loss are float32 on the check's float64",
    "sentence_transformers/maxsim_float64.patch",
)
MAXSIM_REMARK = (
    "`util/similarity.py:500` casts MaxSim's query-token maxima to float32 (`.float()`), so the "
    "loss runs in float32 whatever its input: the row is of the release with that cast made "
    "`promote_types(dtype, float32)` (patch maxsim_float64.patch), the check's float64 kept"
)
MULTI_VECTOR = {"patch": MAXSIM_FLOAT64}
NO_FLAG = (
    "no gathering: the loss has no gather_across_devices; a rank's in-batch negatives are its "
    "own rows"
)
CROSS_REMARK = (
    "the cross-encoder losses have no distributed flag: each rank pairs its anchors with its "
    "own rows only. Run with num_negatives=None (every in-batch negative); the default, 4 drawn "
    "at random per anchor (torch.multinomial), draws them from the rank's rows as well"
)


def _cross(loss: str, cached: bool) -> Case:
    return Case(ST, SBERT, f"cross_encoder.{loss}", "num_negatives=None (no gathering)",
                SbertCrossEncoder, {"cached": cached, "num_negatives": None}, note=NO_FLAG,
                remark=CROSS_REMARK if not cached else "")  # fmt: skip


SYMMETRIC = ("query_to_doc", "doc_to_query")  # MultipleNegativesSymmetricRankingLoss's directions
MNSRL = "MultipleNegativesSymmetricRankingLoss"
GIST = {"inputs": gist_texts}
GUIDE_REMARK = (
    "the guide (GISTEmbedLoss and CachedGISTEmbedLoss) is a real SentenceTransformer, a 2-layer "
    "BERT of hidden size 32 with random weights (seeded, the same on every rank) and a WordLevel "
    "tokenizer, embedding each row's own texts (4 words each, the case's inputs); the "
    "distributed path, which candidates are gathered and masked, does not depend on trained "
    "weights"
)
GIST_REPRO = "sbert_gist.py"
GIST_REMARK = (
    "with gather_across_devices=True GIST gathers the positives and the guide's positive "
    "embeddings (gist_embed.py:180), so its anchor-positive and positive-positive scores of a "
    "rank's rows are one device's; its anchor-anchor term (contrast_anchors=True, the default) "
    "scores the rank's anchors against its own anchors only (gist_embed.py:223, "
    "cached_gist_embed.py:326): the other ranks' anchors are missing from each anchor's "
    "softmax. With contrast_anchors=False (and contrast_positives on or off) both losses are "
    "exact (the rows after each)"
)
GIST_FIX = Fix(
    "the anchor-anchor term against every rank's anchors (`all_gather_with_grad`, as the "
    "positives are) when gather_across_devices",
    "sentence_transformers/gist_anchors.patch",
)
CACHED_GIST_FIX = Fix(GIST_FIX.summary, "sentence_transformers/cached_gist_anchors.patch")


def _gist(loss: str, cached: bool) -> list[Case]:
    """GIST gathered with its anchor-anchor term off, and with both same-column terms off."""
    rows = [{"contrast_anchors": False}, {"contrast_anchors": False, "contrast_positives": False}]
    return [
        Case(ST, SBERT, loss, flags_text({**flags, "gather_across_devices": True}), SbertGIST,
             {"cached": cached, **flags, "gather_across_devices": True}, **GIST)
        for flags in rows
    ]  # fmt: skip


CASES = [
    *_sbert("MultipleNegativesRankingLoss", SbertMNRL, {"cached": False}),
    *_sbert("MultipleNegativesRankingLoss", SbertMNRL, {"cached": False}, directions=SYMMETRIC),
    *_sbert("CachedMultipleNegativesRankingLoss", SbertMNRL, {"cached": True}),
    *_sbert("CachedMultipleNegativesRankingLoss", SbertMNRL, {"cached": True},
            directions=SYMMETRIC),
    *_sbert(MNSRL, SbertMNRL, {"cached": False, "loss": MNSRL}),
    *_sbert(f"Cached{MNSRL}", SbertMNRL, {"cached": True, "loss": f"Cached{MNSRL}"}),
    *_sbert("GISTEmbedLoss", SbertGIST, {"cached": False}, both=GIST, remark=GUIDE_REMARK,
            on={"fix": GIST_FIX, "repro": GIST_REPRO, "remark": GIST_REMARK}),
    *_gist("GISTEmbedLoss", False),
    *_sbert("CachedGISTEmbedLoss", SbertGIST, {"cached": True}, both=GIST,
            on={"fix": CACHED_GIST_FIX, "repro": GIST_REPRO}),
    *_gist("CachedGISTEmbedLoss", True),
    *_sbert("MultiVectorMultipleNegativesRankingLoss", SbertMultiVector, {"cached": False},
            both=MULTI_VECTOR, remark=MAXSIM_REMARK),
    *_sbert("CachedMultiVectorMultipleNegativesRankingLoss", SbertMultiVector, {"cached": True},
            both=MULTI_VECTOR),
    *_sbert("SparseMultipleNegativesRankingLoss", SbertSparse, {}),
    _cross("MultipleNegativesRankingLoss", False),
    _cross("CachedMultipleNegativesRankingLoss", True),
]  # fmt: skip
NOT_RUN: list[NotRun] = []  # every loss of the module is run
