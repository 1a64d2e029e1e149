"""The census's cases of sentence-transformers 6.2.0: ``MultipleNegativesRankingLoss`` and its
cached variant, in one direction or two, with ``gather_across_devices`` off and on."""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path
from typing import Any

import torch
from public_code import as_imported, load, synthetic
from torch import nn

from census_cases.common import Case, NotRun, flags_text, root_of, shim, unused

SBERT = "6.2.0"
SBERT_UTIL = (  # the files of sentence_transformers.util the losses use, their imports first
    "sentence_transformers/util/environment.py",
    "sentence_transformers/util/tensor.py",
    "sentence_transformers/util/similarity.py",
    "sentence_transformers/util/distributed.py",
)
SBERT_LOSSES = (
    "sentence_transformers/sentence_transformer/losses/multiple_negatives_ranking.py",
    "sentence_transformers/sentence_transformer/losses/cached_multiple_negatives_ranking.py",
)
NO_TRANSFORMERS = "transformers is not installed here"


class _Logger(logging.LoggerAdapter):
    """transformers' logger as these files use it: a standard logger with ``warning_once``."""

    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        self.warning(*args, **kwargs)


def sbert_modules(root: str | Path | None) -> types.ModuleType:
    """sentence-transformers' released ``multiple_negatives_ranking.py`` and
    ``cached_multiple_negatives_ranking.py`` (the last returned, the first its attribute chain),
    with the four files of ``sentence_transformers.util`` they use: ``distributed.py`` (the
    gather: ``all_gather_with_grad``, ``get_rank``), ``similarity.py`` (``cos_sim``),
    ``tensor.py`` and ``environment.py``. The package's ``__init__`` needs transformers, absent
    here; stubbed: ``transformers`` (``is_torch_npu_available`` False, ``utils.logging`` a
    standard logger, ``is_torchdynamo_compiling`` False), ``util.misc`` (``disable_logging``,
    ``similarity_fct_name``: for objects and config dicts, unused by the loss),
    ``base.losses.merged_forward`` (``embed_columns``: runs the model, which gatherlab's MLP
    replaces), ``sentence_transformer.model`` (the model's class, an annotation),
    ``base.losses.gradcache`` (GradCache's mini-batching through the model, which
    ``calculate_loss`` on given embeddings does not use: ``CachedLossMixin`` an empty class,
    ``has_static_embedding_input`` False, the token check a no-op)."""
    root = root_of(root, "sentence-transformers", SBERT)
    utils = types.SimpleNamespace(
        logging=types.SimpleNamespace(get_logger=lambda name: _Logger(logging.getLogger(name))),
        is_torchdynamo_compiling=lambda: False,
    )
    transformers = shim("transformers", NO_TRANSFORMERS, is_torch_npu_available=lambda: False)
    transformers.utils = shim("transformers.utils", NO_TRANSFORMERS, **vars(utils))
    absent = {"transformers": transformers, "transformers.utils": transformers.utils}
    misc = shim(
        "sentence_transformers.util.misc", "unused by the loss",
        disable_logging=unused("disable_logging", "unused by the loss"),
        similarity_fct_name=unused("similarity_fct_name", "for config dicts"),
    )  # fmt: skip
    prefix = synthetic(root)  # the util files import misc relatively, by its loaded name
    sys.modules[f"{prefix}.sentence_transformers.util.misc"] = misc
    with as_imported(absent, []):  # top-level stubs, which load does not take
        distributed = load(root, SBERT_UTIL, {"sentence_transformers.util.misc": misc})
    similarity = sys.modules[f"{prefix}.sentence_transformers.util.similarity"]
    util = shim(
        "sentence_transformers.util", "only what the losses import is loaded",
        all_gather_with_grad=distributed.all_gather_with_grad, get_rank=distributed.get_rank,
        cos_sim=similarity.cos_sim, similarity_fct_name=misc.similarity_fct_name,
    )  # fmt: skip
    why = "it runs or describes the model, which gatherlab's MLP replaces"
    gradcache = shim(
        "sentence_transformers.base.losses.gradcache", why,
        CachedLossMixin=type("CachedLossMixin", (), {}),
        RandContext=None, _create_minibatch=None, _get_batch_size=None,
        _validate_mini_batch_num_tokens=lambda value: None,
        has_static_embedding_input=lambda model: False,
    )  # fmt: skip
    stubs = {
        "sentence_transformers.util": util,
        "sentence_transformers.base": shim("sentence_transformers.base", why),
        "sentence_transformers.base.losses": shim("sentence_transformers.base.losses", why),
        "sentence_transformers.base.losses.merged_forward": shim(
            "sentence_transformers.base.losses.merged_forward", why, embed_columns=None
        ),
        "sentence_transformers.base.losses.gradcache": gradcache,
        "sentence_transformers.sentence_transformer.model": shim(
            "sentence_transformers.sentence_transformer.model", why, SentenceTransformer=None
        ),
    }
    with as_imported(absent, []):
        return load(root, SBERT_LOSSES, stubs)


class SbertMNRL(nn.Module):
    """sentence-transformers' released ``MultipleNegativesRankingLoss(model=None, **flags)``
    through ``compute_loss_from_embeddings([z0, z1], labels=None)``, what its ``forward`` calls
    once the model has embedded the two columns (z0 the anchors, z1 the positives); with
    ``cached=True`` ``CachedMultipleNegativesRankingLoss(model=None, mini_batch_size=4,
    **flags)`` through ``calculate_loss([[z0], [z1]])``, its loss over mini-batches of 4 rows of
    the score matrix (GradCache's recomputation of the model is not what is checked: the
    embeddings are given)."""

    def __init__(self, root=None, cached=False, **flags):
        super().__init__()
        module = sbert_modules(root)
        self.cached = cached
        if cached:
            self.loss = module.CachedMultipleNegativesRankingLoss(None, mini_batch_size=4, **flags)
        else:
            ranking = sys.modules[synthetic(root_of(root, "sentence-transformers", SBERT))
                                  + ".sentence_transformers.sentence_transformer.losses"
                                  + ".multiple_negatives_ranking"]  # fmt: skip
            self.loss = ranking.MultipleNegativesRankingLoss(None, **flags)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        if self.cached:
            return self.loss.calculate_loss([[z0], [z1]])
        return self.loss.compute_loss_from_embeddings([z0, z1], None)


GATHER_ACROSS = "gather_across_devices=True (next row)"


def _sbert(loss: str, cached: bool, **flags: Any) -> list[Case]:
    on = {**flags, "gather_across_devices": True}
    return [
        Case("sentence-transformers", SBERT, loss, flags_text(flags) + " (no gathering)",
             SbertMNRL, {"cached": cached, **flags}, note=GATHER_ACROSS),
        Case("sentence-transformers", SBERT, loss, flags_text(on), SbertMNRL,
             {"cached": cached, **on}),
    ]  # fmt: skip


SYMMETRIC = ("query_to_doc", "doc_to_query")  # MultipleNegativesSymmetricRankingLoss's directions
CASES = [
    *_sbert("MultipleNegativesRankingLoss", False),
    *_sbert("MultipleNegativesRankingLoss", False, directions=SYMMETRIC),
    *_sbert("CachedMultipleNegativesRankingLoss", True),
    *_sbert("CachedMultipleNegativesRankingLoss", True, directions=SYMMETRIC),
]
NOT_RUN = [
    NotRun("sentence-transformers", SBERT, "GISTEmbedLoss, CachedGISTEmbedLoss",
           "not run: besides the model, its forward encodes the texts with a second, guide model "
           "whose scores decide which negatives are masked; a stand-in guide would make the row "
           "a check of the stand-in, and the released guide (a SentenceTransformer) needs "
           "transformers, absent here"),
    NotRun("sentence-transformers", SBERT, "the multi-vector, sparse and cross-encoder "
           "MultipleNegativesRankingLoss variants", "not run: each calls its own multi-vector, "
           "sparse or cross-encoder model on the tokenized texts (transformers, absent here)"),
    NotRun("sentence-transformers", SBERT, "(Cached)MultipleNegativesSymmetricRankingLoss",
           "deprecated wrappers of the losses above with directions (query_to_doc, "
           "doc_to_query): those rows"),
]  # fmt: skip
