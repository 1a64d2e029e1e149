"""The census's cases of pylate 1.6.0: ``Contrastive``, the late-interaction (ColBERT) contrastive
loss, and ``CachedContrastive``, its GradCache variant, each with ``gather_across_devices`` off and
on; ``Distillation``, the KL divergence to a teacher's scores, which has no distributed flag."""

from __future__ import annotations

import importlib
import types
from pathlib import Path

import torch
from torch import nn

from census_cases.common import Case, Fix, NotRun, importable, root_of

PYLATE = "1.6.0"
TOKENS, DIM = 2, 8  # each 16-dimensional embedding read as 2 tokens of 8 dimensions
MINI_BATCH = 4  # CachedContrastive's mini-batch: 8 rows at W = 2 are two of them, 16 four
WAYS = 4  # Distillation's documents per query: z1's row read as 4 one-token documents of 4 dims


def pylate_losses(root: str | Path | None) -> types.ModuleType:
    """pylate's released ``pylate.losses`` (``contrastive.py``, ``cached_contrastive.py``,
    ``distillation.py``), the package imported whole from the release's folder as its users
    import it (`importable`): its imports (``pylate.models``, the ColBERT model, which imports
    sentence-transformers and transformers, both installed here; ``pylate.scores`` with its
    torch backend on the CPU; ``pylate.utils.distributed``, the gathers) are the released ones.
    Nothing is stubbed; the model the losses are given is `_TokenModel`."""
    importable(root_of(root, "pylate", PYLATE), "pylate")
    return importlib.import_module("pylate.losses")


class _TokenModel(nn.Module):
    """The model the losses run on each tokenized column: here the columns carry their token
    embeddings already (gatherlab's MLP made them), which it returns; no skiplist, no query
    expansion."""

    skiplist: tuple[int, ...] = ()
    do_query_expansion = False

    def forward(self, features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"token_embeddings": features["token_embeddings"]}


def _column(z: torch.Tensor, tokens: int = TOKENS, dim: int = DIM) -> dict[str, torch.Tensor]:
    """One tokenized column of the embeddings ``z``: each row read as ``tokens`` tokens of
    ``dim`` dimensions, every token kept (ids 1, 2, …; attention mask 1)."""
    ids = torch.arange(1, tokens + 1).repeat(len(z), 1)
    return {"token_embeddings": z.reshape(len(z), tokens, dim), "input_ids": ids,
            "attention_mask": torch.ones_like(ids)}  # fmt: skip


class PylateContrastive(nn.Module):
    """pylate's released ``Contrastive(model, **flags)`` on two columns, the queries (z0) and
    their positive documents (z1), each row's 16 dimensions read as 2 tokens of 8, every token
    kept (ids 1, 2; attention mask 1). The loss normalises each token, scores every query against
    every document by MaxSim, and takes the cross-entropy to the own document."""

    def __init__(self, root: str | None = None, **flags):
        super().__init__()
        self.loss = pylate_losses(root).Contrastive(_TokenModel(), **flags)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        return self.loss([_column(z0), _column(z1)])


class PylateCachedContrastive(nn.Module):
    """pylate's released ``CachedContrastive(model, mini_batch_size=4, **flags)`` on the columns
    of `PylateContrastive` (the queries z0, their positive documents z1, 2 tokens of 8 each),
    through what its GradCache computes: the masks by the released ``extract_skiplist_mask``,
    each column embedded in mini-batches of 4 rows by its ``embed_minibatch_iter`` (with
    gradients: the model, here `_TokenModel`, and the normalisation of each token), then its
    ``calculate_loss`` on those chunks (the documents gathered when ``gather_across_devices``,
    the scores and the summed cross-entropy over query chunks of 4, divided by the rank's batch).
    Its ``forward`` computes the same loss with the chunks detached, backpropagates it to them
    inside the forward and replays the cached gradients through the model in a hook of the
    returned loss; that gradient is the one of this graph, which the check differentiates
    directly (the model is gatherlab's MLP, run before the loss)."""

    def __init__(self, root: str | None = None, **flags):
        super().__init__()
        losses = pylate_losses(root)
        self.loss = losses.CachedContrastive(_TokenModel(), mini_batch_size=MINI_BATCH, **flags)
        self.masks = importlib.import_module("pylate.losses.contrastive").extract_skiplist_mask

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        columns = [_column(z0), _column(z1)]
        masks = self.masks(sentence_features=columns, skiplist=self.loss.model.skiplist)
        reps = [
            [chunk for chunk, _ in self.loss.embed_minibatch_iter(
                sentence_feature=column, with_grad=True, copy_random_state=False)]
            for column in columns
        ]  # fmt: skip
        return self.loss.calculate_loss(reps, masks)


def teacher_scores(global_batch_size: int) -> torch.Tensor:
    """Distillation's ``labels``, the teacher's scores of each query's `WAYS` documents: a fixed
    tensor drawn from its own seed for the global batch (the check gives each rank its rows)."""
    generator = torch.Generator().manual_seed(1)
    return torch.randn(global_batch_size, WAYS, generator=generator, dtype=torch.float64)


class PylateDistillation(nn.Module):
    """pylate's released ``Distillation(model, **flags)`` through its own ``forward`` on two
    columns and the teacher's scores (``labels``, the case's ``inputs``: `teacher_scores`, each
    rank given its rows): the queries, z0's rows read as 4 tokens of 4 dimensions, and their
    documents, each z1 row read as `WAYS` documents of one token of 4 dimensions (4 per query,
    so that the loss's min-max normalisation of each query's scores leaves two of them free;
    with 2 they would be 0 and 1), every token kept. The loss normalises each token, scores each
    query against its own documents by MaxSim, min-max normalises each query's scores and takes
    the KL divergence of their softmax to the teacher's, averaged over the rank's queries."""

    def __init__(self, root: str | None = None, **flags):
        super().__init__()
        self.loss = pylate_losses(root).Distillation(_TokenModel(), **flags)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        documents = z1.reshape(len(z1) * WAYS, z1.shape[1] // WAYS)
        columns = [_column(z0, WAYS, z0.shape[1] // WAYS), _column(documents, 1, len(documents[0]))]
        return self.loss(columns, labels)


NO_TIMES_W = Fix(
    "return the loss without `loss *= get_world_size()` when gather_across_devices: the "
    "documents' gather (torch.distributed.nn's all_gather) already sums every rank's gradient",
    "pylate/contrastive_no_times_w.patch",
)
CACHED_NO_TIMES_W = Fix(
    "sum the query chunks' cross-entropy without `loss_mbatch *= get_world_size()` when "
    "gather_across_devices: the documents' gather (torch.distributed.nn's all_gather) already "
    "sums every rank's gradient",
    "pylate/cached_contrastive_no_times_w.patch",
)
TIMES_W_REMARK = (
    "the documents are gathered with `torch.distributed.nn`'s `all_gather`, whose backward sums "
    "the ranks' gradients, and the loss is then multiplied by W (contrastive.py:231) as if it "
    "did not: the loss is W times one device's and so is its gradient after DDP's average"
)
CACHED_TIMES_W_REMARK = (
    "as `Contrastive`'s: the documents are gathered with `torch.distributed.nn`'s `all_gather`, "
    "whose backward sums the ranks' gradients, and each query chunk's cross-entropy is then "
    "multiplied by W (cached_contrastive.py:317; the check names the division by the rank's "
    "batch that ends the sum, line 328, the first value it can set against one device's): the "
    "loss is W times one device's and so is its gradient after DDP's average. Checked on given "
    "embeddings (`calculate_loss` on the chunks of the released `embed_minibatch_iter`), the "
    "loss whose gradient its GradCache caches"
)
GATHER_ACROSS = "gather_across_devices=True (next row)"
CASES = [
    Case("pylate", PYLATE, "Contrastive", "defaults (gather_across_devices=False)",
         PylateContrastive, note=GATHER_ACROSS),
    Case("pylate", PYLATE, "Contrastive", "gather_across_devices=True", PylateContrastive,
         {"gather_across_devices": True}, fix=NO_TIMES_W, repro="pylate_contrastive.py",
         remark=TIMES_W_REMARK),
    Case("pylate", PYLATE, "CachedContrastive", "defaults (gather_across_devices=False)",
         PylateCachedContrastive, note=GATHER_ACROSS),
    Case("pylate", PYLATE, "CachedContrastive", "gather_across_devices=True",
         PylateCachedContrastive, {"gather_across_devices": True}, fix=CACHED_NO_TIMES_W,
         repro="pylate_cached_contrastive.py", remark=CACHED_TIMES_W_REMARK),
    Case("pylate", PYLATE, "Distillation", "defaults (no distributed flag)", PylateDistillation,
         inputs=teacher_scores),
]  # fmt: skip
NOT_RUN: list[NotRun] = []
