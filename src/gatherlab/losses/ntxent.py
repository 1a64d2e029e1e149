"""NT-Xent, the contrastive loss of SimCLR (Chen et al., 2020, "A Simple Framework for
Contrastive Learning of Visual Representations")."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gatherlab.gather import GatherFn, resolve
from gatherlab.losses._common import (
    DEFAULT_GATHER,
    check_positive,
    check_views,
    gather_views,
    local_offset,
    own_columns,
)


def ntxent(
    rows0: torch.Tensor,
    rows1: torch.Tensor,
    columns0: torch.Tensor,
    columns1: torch.Tensor,
    first_row: int,
    temperature: float,
) -> torch.Tensor:
    """Mean NT-Xent over the rows of both views, against every column but the row's own.

    ``rows*`` are L2-normalised embeddings of samples ``first_row .. first_row + len(rows) - 1`` of
    the batch whose embeddings are ``columns*`` (the gathered batch). Row i of view 0 has its
    positive at column ``first_row + i`` of view 1, and its negatives at every other column of both
    views except itself; likewise for view 1.
    """
    own_column = own_columns(first_row, rows0.shape[0], rows0.device)
    is_self = F.one_hot(own_column, num_classes=columns0.shape[0]).bool()
    logits_01 = rows0 @ columns1.T / temperature
    logits_10 = rows1 @ columns0.T / temperature
    logits_00 = (rows0 @ columns0.T / temperature).masked_fill(is_self, float("-inf"))
    logits_11 = (rows1 @ columns1.T / temperature).masked_fill(is_self, float("-inf"))
    logits = torch.cat(
        [torch.cat([logits_01, logits_00], dim=1), torch.cat([logits_10, logits_11], dim=1)]
    )
    return F.cross_entropy(logits, own_column.repeat(2))


class _NTXentBase(nn.Module):
    layout_invariant = True  # docs/design.md §3: predicted with an exact gather

    def __init__(self, temperature: float = 0.5, gather: str | GatherFn | None = DEFAULT_GATHER):
        super().__init__()
        self.temperature = check_positive("temperature", temperature)
        self.gather = resolve(gather)


class NTXentLoss(_NTXentBase):
    """NT-Xent (SimCLR), local-loss style as in lightly's ``NTXentLoss``.

    Embeddings are L2-normalised. Each rank gathers both views of the global batch and computes the
    loss of its own B samples only, against all 2N − 1 other embeddings: rank r's positives sit at
    columns r·B + i of the gathered batch. The loss is the mean over the rank's 2B rows, so the mean
    over ranks equals the single-device loss over 2N rows. Parameter gradients are exact only if the
    gather's backward returns every rank's gradient of the local slice (``fixed``).
    """

    style = "local"  # how it splits over ranks (docs/design.md §1)

    def forward(self, out0: torch.Tensor, out1: torch.Tensor) -> torch.Tensor:
        check_views(out0, out1)
        out0, out1 = F.normalize(out0, dim=1), F.normalize(out1, dim=1)
        columns0, columns1 = gather_views(self.gather, out0, out1)
        first = local_offset(out0, columns0)
        return ntxent(out0, out1, columns0, columns1, first, self.temperature)


class NTXentGlobalLoss(_NTXentBase):
    """NT-Xent (SimCLR), global-loss style: every rank computes the full 2N × 2N loss.

    Both views are gathered and every rank computes the same single-device loss over all 2N rows
    (as many SimCLR ports do). Every rank's loss depends on every slice, so the gather's backward
    must sum the ranks' gradients (``fixed``); one that keeps only the own slice's gradient
    (``old``) yields exactly 1/W of the single-device gradient.
    """

    style = "global"  # how it splits over ranks (docs/design.md §1)

    def forward(self, out0: torch.Tensor, out1: torch.Tensor) -> torch.Tensor:
        check_views(out0, out1)
        out0, out1 = F.normalize(out0, dim=1), F.normalize(out1, dim=1)
        columns0, columns1 = gather_views(self.gather, out0, out1)
        return ntxent(columns0, columns1, columns0, columns1, 0, self.temperature)
