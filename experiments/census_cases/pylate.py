"""The census's cases of pylate 1.6.0: ``Contrastive``, the late-interaction (ColBERT) contrastive
loss, and ``CachedContrastive``, its GradCache variant, each with ``gather_across_devices`` off and
on; ``Distillation``, the KL divergence to a teacher's scores, which has no distributed flag."""

from __future__ import annotations

import importlib
import types
from pathlib import Path

import torch
from torch import nn

from census_cases.common import Case, Fix, NotRun, hand_model, importable, root_of

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
    Nothing is stubbed; the model the losses are given is `_TokenModel` (the check's embeddings
    as given), or for the cached loss, which calls the model itself, `_ColumnEncoder` (the
    check's MLP)."""
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


class _ColumnEncoder(nn.Module):
    """The model a pylate loss that calls it is handed, written here: a ColBERT stand-in whose
    forward reads each row of a tokenized column (``features["view"]``, the check's view of the
    sample, with its ``input_ids`` and ``attention_mask``) through ``encoder``, the check's MLP,
    and returns its 16 dimensions as the row's 2 token embeddings of 8; no skiplist, no query
    expansion."""

    skiplist: tuple[int, ...] = ()
    do_query_expansion = False

    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.encoder = encoder

    def forward(self, features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        embedded = self.encoder(features["view"])
        return {"token_embeddings": embedded.reshape(len(embedded), TOKENS, DIM)}


def _view_column(view: torch.Tensor) -> dict[str, torch.Tensor]:
    """One tokenized column of the check's views: each row's view (``view``) and its 2 token
    ids (1, 2) with attention mask 1, every token kept."""
    ids = torch.arange(1, TOKENS + 1, device=view.device).repeat(len(view), 1)
    return {"view": view, "input_ids": ids, "attention_mask": torch.ones_like(ids)}


class PylateCachedContrastive(nn.Module):
    """pylate's released ``CachedContrastive(model, mini_batch_size=4, **flags)`` through its own
    ``forward`` and the backward of what it returns, the path training takes: it calls the model
    itself (`gatherlab.runs.loss.calls_model`). ``model_for`` builds the model the loss is given,
    `_ColumnEncoder` around the check's MLP, and the loss with it, as a user does; the check wraps
    that model in DDP on real ranks, and `common.hand_model` puts the wrapper in the loss, as the
    trainer does. The loss is called on two columns, the queries (view 0) and their positive
    documents (view 1), each row embedded by the MLP and read as 2 tokens of 8. Its forward
    embeds every mini-batch of 4 rows without gradient, computes the loss (the documents
    gathered when ``gather_across_devices``), backpropagates it to the embeddings chunk by chunk
    of queries and caches their gradients, and returns the loss detached with a hook; the
    backward of the returned loss runs the hook, which embeds each mini-batch again through the
    wrapped model and backpropagates the cached gradient into its parameters. The gradient the
    check reads is the one the model's parameters get from that replay, after DDP's average."""

    def __init__(self, root: str | None = None, **flags):
        super().__init__()
        self.losses, self.flags = pylate_losses(root), flags

    def model_for(self, encoder: nn.Module) -> nn.Module:
        model = _ColumnEncoder(encoder)
        self.loss = self.losses.CachedContrastive(model, mini_batch_size=MINI_BATCH, **self.flags)
        return model

    def forward(self, model: nn.Module, view0: torch.Tensor, view1: torch.Tensor) -> torch.Tensor:
        hand_model(self.loss, model)
        return self.loss([_view_column(view0), _view_column(view1)])


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
CACHED_VALUE = Fix(
    "divide the returned loss by W when gather_across_devices, not the cached gradients: their "
    "×W (each query chunk's cross-entropy times W) is what DDP's average takes back",
    "pylate/cached_contrastive_value.patch",
)
TIMES_W_REMARK = (
    "the documents are gathered with `torch.distributed.nn`'s `all_gather`, whose backward sums "
    "the ranks' gradients, and the loss is then multiplied by W (contrastive.py:231) as if it "
    "did not: the loss is W times one device's and so is its gradient after DDP's average"
)
CACHED_TIMES_W_REMARK = (
    "checked through its released `forward` and the backward of the loss it returns, the path "
    "training takes (the model the loss calls is the check's MLP, in DDP): each query chunk's "
    "summed cross-entropy is multiplied by W (cached_contrastive.py:317), backpropagated to the "
    "embeddings chunk by chunk inside the forward (line 322), and the cached gradients are "
    "replayed through the model by the hook on the returned loss. The returned loss, what a "
    "trainer logs, is W times one device's (`loss scaled`); the gradient the model gets is one "
    "device's: the documents' gather sums every rank's gradient, and the W that multiplies the "
    "cached gradients is the one DDP's average divides by. Removing the ×W, the fix the census "
    "published before (it differentiated the value `calculate_loss` returns on given embeddings, "
    "a path training never takes, and read the gradient as W times one device's), makes that "
    "gradient 1/W of one device's (norm ratio 0.5, 0.25, 0.125 at W = 2, 4, 8, in "
    "`pylate_cached_contrastive.py` and on the release with that line removed): harmful. The fix "
    "divides the value alone (cached_contrastive_value.patch). Not about W: the gradient the "
    "forward hands the model is that of the cross-entropy summed over the batch, B times that of "
    "the mean it returns (size_average=True; B the global batch, 16 here, on one device and on W "
    "ranks alike: `pylate_cached_contrastive.py` measures it), where pylate's `Contrastive` "
    "trains with the mean's: under SGD a learning rate B times larger, under Adam and AdamW "
    "mostly cancelled. Without gathering (the row above) the same sum makes the gradient's norm "
    "ratio about 1/W (0.484, 0.191 where the plain `Contrastive`'s is 0.967, 0.763): DDP averages"
    " the W ranks' sums over their own rows where one device sums all rows"
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
         PylateCachedContrastive, {"gather_across_devices": True}, fix=CACHED_VALUE,
         repro="pylate_cached_contrastive.py", remark=CACHED_TIMES_W_REMARK),
    Case("pylate", PYLATE, "Distillation", "defaults (no distributed flag)", PylateDistillation,
         inputs=teacher_scores),
]  # fmt: skip
NOT_RUN: list[NotRun] = []
