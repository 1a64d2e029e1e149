"""The census's cases of pylate 1.6.0: ``Contrastive``, the late-interaction (ColBERT) contrastive
loss, with ``gather_across_devices`` off and on."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from public_code import load, synthetic
from torch import nn

from census_cases.common import Case, Fix, NotRun, root_of, shim

PYLATE = "1.6.0"
TOKENS, DIM = 2, 8  # each 16-dimensional embedding read as 2 tokens of 8 dimensions


def pylate_module(root: str | Path | None):
    """pylate's released ``losses/contrastive.py`` with what it uses: ``utils/distributed.py``
    (``all_gather``, ``all_gather_with_gradients``, ``get_rank``, ``get_world_size``),
    ``utils/tensor.py`` and ``scores/colbert.py`` with its two kernel backends (``ColBERTScores``,
    the MaxSim scores, on the torch path on the CPU). Stubbed: ``pylate.models`` (the ColBERT
    model, which imports sentence-transformers and transformers, absent here): its ``ColBERT``
    holds only ``skiplist_mask``, written here (a token is kept unless its id is in the
    skiplist), which the loss calls for the documents' masks."""
    root = root_of(root, "pylate", PYLATE)
    prefix = synthetic(root)  # the files import each other relatively, by their loaded names
    tensor = load(root, ("pylate/utils/tensor.py",), {})
    distributed = load(root, ("pylate/utils/distributed.py",), {})
    utils = shim(
        "pylate.utils", "only what the loss imports is loaded",
        all_gather=distributed.all_gather,
        all_gather_with_gradients=distributed.all_gather_with_gradients,
        get_rank=distributed.get_rank, get_world_size=distributed.get_world_size,
        convert_to_tensor=tensor.convert_to_tensor, tensor=tensor,
    )  # fmt: skip
    sys.modules[f"{prefix}.pylate.utils"] = utils
    colbert = load(
        root,
        ("pylate/scores/_flash_backend.py", "pylate/scores/_lik_backend.py",
         "pylate/scores/colbert.py"),
        {"pylate.utils": utils, "pylate.utils.tensor": tensor},
    )  # fmt: skip
    scores = shim("pylate.scores", "only the ColBERT scores are loaded",
                  ColBERTScores=colbert.ColBERTScores)  # fmt: skip
    models = shim("pylate.models", "it imports sentence-transformers and transformers",
                  ColBERT=_ColBERT)  # fmt: skip
    sys.modules[f"{prefix}.pylate.scores"] = scores
    sys.modules[f"{prefix}.pylate.models"] = models
    return load(
        root, ("pylate/losses/contrastive.py",),
        {"pylate.utils": utils, "pylate.scores": scores, "pylate.models": models},
    )  # fmt: skip


class _ColBERT:
    """What the loss asks of pylate's ColBERT class itself: the skiplist mask of token ids."""

    @staticmethod
    def skiplist_mask(input_ids: torch.Tensor, skiplist: list[int]) -> torch.Tensor:
        mask = torch.ones_like(input_ids, dtype=torch.bool)
        for token in skiplist:
            mask &= input_ids != token
        return mask


class _TokenModel(nn.Module):
    """The model the loss runs on each tokenized column: here the columns carry their token
    embeddings already (gatherlab's MLP made them), which it returns; no skiplist, no query
    expansion."""

    skiplist: tuple[int, ...] = ()
    do_query_expansion = False

    def forward(self, features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"token_embeddings": features["token_embeddings"]}


class PylateContrastive(nn.Module):
    """pylate's released ``Contrastive(model, **flags)`` on two columns, the queries (z0) and
    their positive documents (z1), each row's 16 dimensions read as 2 tokens of 8, every token
    kept (ids 1, 2; attention mask 1). The loss normalises each token, scores every query against
    every document by MaxSim, and takes the cross-entropy to the own document."""

    def __init__(self, root: str | None = None, **flags):
        super().__init__()
        self.loss = pylate_module(root).Contrastive(_TokenModel(), **flags)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        ids = torch.arange(1, TOKENS + 1).repeat(len(z0), 1)
        columns = [
            {"token_embeddings": z.view(len(z), TOKENS, DIM), "input_ids": ids,
             "attention_mask": torch.ones_like(ids)}
            for z in (z0, z1)
        ]  # fmt: skip
        return self.loss(columns)


NO_TIMES_W = Fix(
    "return the loss without `loss *= get_world_size()` when gather_across_devices: the "
    "documents' gather (torch.distributed.nn's all_gather) already sums every rank's gradient",
    "pylate/contrastive_no_times_w.patch",
)
TIMES_W_REMARK = (
    "the documents are gathered with `torch.distributed.nn`'s `all_gather`, whose backward sums "
    "the ranks' gradients, and the loss is then multiplied by W (contrastive.py:231) as if it "
    "did not: the loss is W times one device's and so is its gradient after DDP's average"
)
CASES = [
    Case("pylate", PYLATE, "Contrastive", "defaults (gather_across_devices=False)",
         PylateContrastive, note="gather_across_devices=True (next row)"),
    Case("pylate", PYLATE, "Contrastive", "gather_across_devices=True", PylateContrastive,
         {"gather_across_devices": True}, fix=NO_TIMES_W, repro="pylate_contrastive.py",
         remark=TIMES_W_REMARK),
]  # fmt: skip
NOT_RUN = [
    NotRun("pylate", PYLATE, "CachedContrastive, Distillation",
           "not checked yet: CachedContrastive runs the model itself in mini-batches (GradCache); "
           "Distillation takes teacher scores"),
]  # fmt: skip
