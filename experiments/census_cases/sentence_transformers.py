"""The census's cases of sentence-transformers 6.2.0, the package imported whole from its wheel
(with transformers 5.23, the project's lock): ``MultipleNegativesRankingLoss`` and its cached
variant, in one direction or two; the deprecated ``(Cached)MultipleNegativesSymmetricRankingLoss``
themselves; ``GISTEmbedLoss`` and ``CachedGISTEmbedLoss`` with a real guide (a small
``SentenceTransformer`` of random weights); the multi-vector
``(Cached)MultiVectorMultipleNegativesRankingLoss``, the sparse
``SparseMultipleNegativesRankingLoss`` and the cross-encoder
``(Cached)MultipleNegativesRankingLoss`` (each with ``gather_across_devices`` off and on where it
has the flag; the cross-encoder losses have none). The plain losses are checked on the check's
embeddings; the cached ones (GradCache) through their forward and the replay of its backward,
the path training takes (`_Cached`)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from census_cases.common import (
    Case,
    Fix,
    NotRun,
    flags_text,
    hand_model,
    importable,
    root_of,
)

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
    model has embedded the two columns (z0 the anchors, z1 the positives). The model
    (`_GivenModel`) is never called."""

    def __init__(self, root=None, loss="", **flags):
        super().__init__()
        sbert(root)
        from sentence_transformers.sentence_transformer import losses

        built = getattr(losses, loss or "MultipleNegativesRankingLoss")
        self.loss = built(_GivenModel(), **flags)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        return self.loss.compute_loss_from_embeddings([z0, z1], None)


# --- the cached (GradCache) losses, through their forward and its replay -------------------------


class _SentenceEncoder(nn.Sequential):
    """The model a cached loss is handed, written here in place of a ``SentenceTransformer``: a
    sequence of one module, the check's MLP (the losses look at ``model[0]``, a StaticEmbedding
    or not), whose forward embeds each row's view (``features["view"]``) and returns it as the
    row's ``sentence_embedding`` beside the features; with a guide's ``tokenizer`` and
    ``max_seq_length`` when there is a guide (so that GIST finds the same vocabulary and does not
    re-tokenize)."""

    def __init__(self, encoder: nn.Module, tokenizer: Any = None, max_seq_length: int = 16):
        super().__init__(encoder)
        self.tokenizer, self.max_seq_length = tokenizer, max_seq_length

    def forward(self, features: dict[str, Any]) -> dict[str, Any]:
        return {**features, "sentence_embedding": self[0](features["view"])}


class _Cached(nn.Module):
    """A released cached loss through its own ``forward`` and the backward of what it returns,
    the path training takes: it calls the model itself (`gatherlab.runs.loss.calls_model`).
    ``model_for`` builds the model the loss is handed (`model_around`, around the check's MLP)
    and the loss with it (`built`), as a user does; the check wraps that model in DDP on real
    ranks and `common.hand_model` puts the wrapper in the loss, as sentence-transformers'
    trainer does. The loss's forward embeds every mini-batch of 4 rows without gradient,
    computes the loss, backpropagates it to the embeddings and caches their gradients, and
    returns the loss detached with a hook; the backward of the returned loss runs the hook
    (``base/losses/gradcache.py``'s ``_backward_hook``), which embeds each mini-batch again
    through the wrapped model (under DDP's ``no_sync`` but for the last) and backpropagates the
    cached gradient into its parameters. The gradient the check reads is the one the model's
    parameters get from that replay, after DDP's average."""

    def model_around(self, encoder: nn.Module) -> nn.Module:
        return _SentenceEncoder(encoder)

    def built(self, model: nn.Module) -> nn.Module:
        raise NotImplementedError

    def model_for(self, encoder: nn.Module) -> nn.Module:
        model = self.model_around(encoder)
        self.loss = self.built(model)
        return model

    def columns(self, view0: torch.Tensor, view1: torch.Tensor, *inputs: Any) -> list[Any]:
        return [{"view": view0}, {"view": view1}]

    def forward(self, model: nn.Module, view0: torch.Tensor, view1: torch.Tensor,
                *inputs: Any) -> torch.Tensor:  # fmt: skip
        hand_model(self.loss, model)
        return self.loss(self.columns(view0, view1, *inputs), None)


class SbertCachedMNRL(_Cached):
    """sentence-transformers' released ``CachedMultipleNegativesRankingLoss(model,
    mini_batch_size=4, **flags)`` (or ``loss=`` another cached class of
    ``sentence_transformers.sentence_transformer.losses`` built the same way:
    ``CachedMultipleNegativesSymmetricRankingLoss``) on two columns, the anchors (view 0) and
    their positives (view 1), each row embedded by the check's MLP (`_SentenceEncoder`), through
    its forward and the replay of its backward (`_Cached`)."""

    def __init__(self, root=None, loss="", **flags):
        super().__init__()
        sbert(root)
        from sentence_transformers.sentence_transformer import losses

        self.loss_class = getattr(losses, loss or "CachedMultipleNegativesRankingLoss")
        self.flags = flags

    def built(self, model: nn.Module) -> nn.Module:
        return self.loss_class(model, mini_batch_size=4, **self.flags)


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


def _texts(words: torch.Tensor) -> list[str]:
    """Each row's text, its word indices (`gist_texts`) written out as words."""
    return [" ".join(WORDS[i] for i in row) for row in words.tolist()]


class SbertGIST(nn.Module):
    """sentence-transformers' released ``GISTEmbedLoss(model, guide, **flags)``, the guide a real
    ``SentenceTransformer`` (`_guide`, frozen) and the model `_GivenModel` (the check's
    embeddings, with the guide's tokenizer). Besides z0 (the anchors) and z1 (the positives) the
    loss takes each row's two texts (`gist_texts`, the case's inputs: each rank its rows), which
    the adapter writes out as words and tokenizes with the guide's ``preprocess``: one column's
    features per view, carrying its embeddings. The loss runs its ``forward`` on those columns:
    the model gives the check's embeddings, the guide embeds the texts (no gradient), and its
    scores mask the candidates closer to an anchor than its positive. The guide's weights are
    random: the distributed path (which candidates are gathered, which terms are masked) does
    not depend on what the guide has learnt, only on its scores being the same on W ranks and on
    one device."""

    def __init__(self, root=None, **flags):
        super().__init__()
        sbert(root)
        from sentence_transformers.sentence_transformer import losses

        with tempfile.TemporaryDirectory() as directory:
            guide = _guide(directory)
        model = _GivenModel(guide.tokenizer, guide.max_seq_length)
        self.loss = losses.GISTEmbedLoss(model, guide, **flags)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor, anchor_words: torch.Tensor,
                positive_words: torch.Tensor) -> torch.Tensor:  # fmt: skip
        columns = [{**self.loss.guide.preprocess(_texts(words)), "embedding": z}
                   for words, z in ((anchor_words, z0), (positive_words, z1))]  # fmt: skip
        return self.loss(columns, None)


class SbertCachedGIST(_Cached):
    """sentence-transformers' released ``CachedGISTEmbedLoss(model, guide, mini_batch_size=4,
    **flags)`` through its forward and the replay of its backward (`_Cached`), the guide
    `SbertGIST`'s and the model `_SentenceEncoder` around the check's MLP, with the guide's
    tokenizer. Each column is a view's rows (``view``, which the model embeds) with their texts
    (`gist_texts`, the case's inputs) tokenized by the guide's ``preprocess``, which the guide
    embeds in the loss's first pass (no gradient) to mask the candidates closer to an anchor
    than its positive."""

    def __init__(self, root=None, **flags):
        super().__init__()
        sbert(root)
        with tempfile.TemporaryDirectory() as directory:
            self.guide = _guide(directory)
        self.flags = flags

    def model_around(self, encoder: nn.Module) -> nn.Module:
        return _SentenceEncoder(encoder, self.guide.tokenizer, self.guide.max_seq_length)

    def built(self, model: nn.Module) -> nn.Module:
        from sentence_transformers.sentence_transformer import losses

        return losses.CachedGISTEmbedLoss(model, self.guide, mini_batch_size=4, **self.flags)

    def columns(self, view0: torch.Tensor, view1: torch.Tensor, anchor_words: torch.Tensor,
                positive_words: torch.Tensor) -> list[Any]:  # fmt: skip
        return [{**self.guide.preprocess(_texts(words)), "view": view}
                for words, view in ((anchor_words, view0), (positive_words, view1))]  # fmt: skip


# --- the multi-vector, sparse and cross-encoder variants --------------------------------------

PAIRS = 32  # the cached cross-encoder's mini-batch of pairs: 16 · 16 pairs are 8 on one device
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
    by ColBERT's MaxSim (``colbert_scores``) and takes the cross-entropy to the own document."""

    def __init__(self, root=None, **flags):
        super().__init__()
        sbert(root)
        from sentence_transformers.multi_vector_encoder import losses

        self.loss = losses.MultiVectorMultipleNegativesRankingLoss(_TokenModel(), **flags)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        columns = [{**_token_column(z), "token_embeddings": z.view(len(z), TOKENS, DIM)}
                   for z in (z0, z1)]  # fmt: skip
        return self.loss(columns)


def _token_column(rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """A multi-vector column's token ids (1, 2) and attention mask (1: every token kept)."""
    ids = torch.arange(1, TOKENS + 1, device=rows.device).repeat(len(rows), 1)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


class _TokenEncoder(nn.Module):
    """The multi-vector model a cached loss is handed, written here: each row's view
    (``features["view"]``) through the check's MLP, its 16 dimensions returned as 2 token
    embeddings of 8 with the column's attention mask, whatever the task (query or document)."""

    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.encoder = encoder

    def forward(self, features: dict[str, Any], task: str | None = None) -> dict[str, Any]:
        embedded = self.encoder(features["view"])
        return {"token_embeddings": embedded.view(len(embedded), TOKENS, DIM),
                "attention_mask": features["attention_mask"]}  # fmt: skip


class SbertCachedMultiVector(_Cached):
    """sentence-transformers' released ``CachedMultiVectorMultipleNegativesRankingLoss(model,
    mini_batch_size=4, **flags)`` on two columns, the queries (view 0) and their documents (view
    1), each row embedded by the check's MLP and read as 2 tokens of 8 (`_TokenEncoder`; ids 1,
    2, attention mask 1), through its forward and the replay of its backward (`_Cached`)."""

    def __init__(self, root=None, **flags):
        super().__init__()
        sbert(root)
        self.flags = flags

    def model_around(self, encoder: nn.Module) -> nn.Module:
        return _TokenEncoder(encoder)

    def built(self, model: nn.Module) -> nn.Module:
        from sentence_transformers.multi_vector_encoder import losses

        return losses.CachedMultiVectorMultipleNegativesRankingLoss(
            model, mini_batch_size=4, **self.flags
        )

    def columns(self, view0: torch.Tensor, view1: torch.Tensor, *inputs: Any) -> list[Any]:
        return [{**_token_column(view), "view": view} for view in (view0, view1)]


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


def _pair_scorer(encoder: nn.Module | None = None):
    """The cross-encoder, written here as a subclass of the released ``CrossEncoder`` (the
    losses accept no other class) that holds no transformer: a pair of texts ``("i", "j")`` is
    row i of the rank's anchors against row j of its candidates (``columns``), scored by the
    cosine of their embeddings. It replaces the transformer that would read the two texts
    together. Without ``encoder`` the columns are the check's embeddings (z0, z1) and the scores
    a function of them; with it, the columns are the check's views and each pair's two rows are
    embedded by ``encoder`` (the check's MLP) whenever the pair is scored."""
    from sentence_transformers.cross_encoder import CrossEncoder

    class PairScorer(CrossEncoder):
        num_labels = 1
        device = torch.device("cpu")

        def __init__(self):
            nn.Module.__init__(self)
            self.encoder = encoder if encoder is not None else nn.Identity()
            self.columns: tuple[torch.Tensor, torch.Tensor] | None = None

        def preprocess(self, pairs, prompt=None, task=None) -> dict[str, torch.Tensor]:
            return {"pairs": torch.tensor([[int(a), int(b)] for a, b in pairs])}

        def forward(self, features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            anchors, candidates = self.columns
            a, b = features["pairs"].T
            scores = F.cosine_similarity(self.encoder(anchors[a]), self.encoder(candidates[b]), -1)
            return {"scores": scores[:, None]}

    return PairScorer()


def _rows(count: int) -> list[list[str]]:
    """The cross-encoder losses' two columns of texts: the rank's anchors "0", …, "B-1" and their
    positives likewise (a text names its row)."""
    rows = [str(i) for i in range(count)]
    return [rows, list(rows)]


class SbertCrossEncoder(nn.Module):
    """sentence-transformers' released cross-encoder ``MultipleNegativesRankingLoss(model,
    **flags)`` through its ``forward`` on two columns of texts (`_rows`): it pairs each anchor
    with its positive and with in-batch negatives, has the model score the pairs
    (`_pair_scorer`: the cosine of the check's z0 and z1 rows), and takes the cross-entropy to
    the positive after a sigmoid and scale 10."""

    def __init__(self, root=None, **flags):
        super().__init__()
        sbert(root)
        from sentence_transformers.cross_encoder import losses

        self.loss = losses.MultipleNegativesRankingLoss(_pair_scorer(), **flags)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        self.loss.model.columns = (z0, z1)
        return self.loss(_rows(len(z0)), None)


class SbertCachedCrossEncoder(_Cached):
    """sentence-transformers' released cross-encoder ``CachedMultipleNegativesRankingLoss(model,
    mini_batch_size=32, **flags)`` through its forward and the replay of its backward
    (`_Cached`), on `SbertCrossEncoder`'s columns of texts; the model `_pair_scorer` around the
    check's MLP, given the views: every mini-batch of 32 pairs embeds its pairs' rows through
    the MLP, in the first pass and again in the replay."""

    def __init__(self, root=None, **flags):
        super().__init__()
        sbert(root)
        self.flags = flags

    def model_around(self, encoder: nn.Module) -> nn.Module:
        return _pair_scorer(encoder)

    def built(self, model: nn.Module) -> nn.Module:
        from sentence_transformers.cross_encoder import losses

        return losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=PAIRS, **self.flags)

    def forward(self, model: nn.Module, view0: torch.Tensor, view1: torch.Tensor) -> torch.Tensor:
        bare = model.module if isinstance(model, DistributedDataParallel) else model
        bare.columns = (view0, view1)  # the views the pairs' rows are read from
        hand_model(self.loss, model)
        return self.loss(_rows(len(view0)), None)


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
    factory = SbertCachedCrossEncoder if cached else SbertCrossEncoder
    return Case(ST, SBERT, f"cross_encoder.{loss}", "num_negatives=None (no gathering)",
                factory, {"num_negatives": None}, note=NO_FLAG,
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
    "cached_gist_embed.py:326): the other ranks' anchors are missing from each anchor's softmax. "
    "With contrast_anchors=False (and contrast_positives on or off) both losses are exact (the "
    "rows after each). CachedGISTEmbedLoss, like every cached loss of the table, is checked "
    "through its forward and the replay of its cached gradients through the model in DDP, the "
    "path training takes; its `where` names the guide's first operation (transformers' "
    "modeling_bert.py) on a rank's mini-batch, which the trace cannot set against one device's "
    "mini-batches, not the cause"
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
        Case(ST, SBERT, loss, flags_text({**flags, "gather_across_devices": True}),
             SbertCachedGIST if cached else SbertGIST, {**flags, "gather_across_devices": True},
             **GIST)
        for flags in rows
    ]  # fmt: skip


CASES = [
    *_sbert("MultipleNegativesRankingLoss", SbertMNRL, {}),
    *_sbert("MultipleNegativesRankingLoss", SbertMNRL, {}, directions=SYMMETRIC),
    *_sbert("CachedMultipleNegativesRankingLoss", SbertCachedMNRL, {}),
    *_sbert("CachedMultipleNegativesRankingLoss", SbertCachedMNRL, {},
            directions=SYMMETRIC),
    *_sbert(MNSRL, SbertMNRL, {"loss": MNSRL}),
    *_sbert(f"Cached{MNSRL}", SbertCachedMNRL, {"loss": f"Cached{MNSRL}"}),
    *_sbert("GISTEmbedLoss", SbertGIST, {}, both=GIST, remark=GUIDE_REMARK,
            on={"fix": GIST_FIX, "repro": GIST_REPRO, "remark": GIST_REMARK}),
    *_gist("GISTEmbedLoss", False),
    *_sbert("CachedGISTEmbedLoss", SbertCachedGIST, {}, both=GIST,
            on={"fix": CACHED_GIST_FIX, "repro": GIST_REPRO}),
    *_gist("CachedGISTEmbedLoss", True),
    *_sbert("MultiVectorMultipleNegativesRankingLoss", SbertMultiVector, {},
            both=MULTI_VECTOR, remark=MAXSIM_REMARK),
    *_sbert("CachedMultiVectorMultipleNegativesRankingLoss", SbertCachedMultiVector, {},
            both=MULTI_VECTOR),
    *_sbert("SparseMultipleNegativesRankingLoss", SbertSparse, {}),
    _cross("MultipleNegativesRankingLoss", False),
    _cross("CachedMultipleNegativesRankingLoss", True),
]  # fmt: skip
NOT_RUN: list[NotRun] = []  # every loss of the module is run
