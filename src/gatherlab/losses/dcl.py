"""Decoupled contrastive learning (Yeh et al., 2022, "Decoupled Contrastive Learning"), with and
without its von Mises-Fisher weighting of the positives (DCLW)."""

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


def dcl(
    rows0: torch.Tensor,
    rows1: torch.Tensor,
    columns0: torch.Tensor,
    columns1: torch.Tensor,
    first_row: int,
    temperature: float,
    positive_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean DCL over the rows of both views against the gathered batch ``columns*``.

    Row i (sample ``first_row + i``) of view 0 contributes −w_i·s(z_i, z'_i)/τ + log Σ_{k≠i}
    [exp(s(z_i, z_k)/τ) + exp(s(z_i, z'_k)/τ)]: unlike NT-Xent, the positive is not in the
    denominator. View 1 likewise, with the views swapped; w_i = 1 unless ``positive_weights``.
    """
    own_column = own_columns(first_row, rows0.shape[0], rows0.device)
    is_self = F.one_hot(own_column, num_classes=columns0.shape[0]).bool()
    weights = 1.0 if positive_weights is None else positive_weights

    def anchored(rows: torch.Tensor, same: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        logits_same = (rows @ same.T / temperature).masked_fill(is_self, float("-inf"))
        logits_other = rows @ other.T / temperature
        positive = logits_other.gather(1, own_column[:, None]).squeeze(1)
        negatives = torch.cat([logits_same, logits_other.masked_fill(is_self, float("-inf"))], 1)
        return -weights * positive + torch.logsumexp(negatives, dim=1)

    return torch.cat(
        [anchored(rows0, columns0, columns1), anchored(rows1, columns1, columns0)]
    ).mean()


def von_mises_fisher_weights(out0: torch.Tensor, out1: torch.Tensor, sigma: float) -> torch.Tensor:
    """DCLW's positive weights 2 − n·softmax_i(s(z_i, z'_i)/σ) over the n rows given (no gradient).

    The weights of a sample depend on every other sample it is normalised with: over the local
    batch (as lightly) they change with the number of devices, over the global batch they do not.
    """
    similarity = (out0.detach() * out1.detach()).sum(dim=1) / sigma
    return 2 - out0.shape[0] * torch.softmax(similarity, dim=0)


class DCLLoss(nn.Module):
    """Decoupled contrastive loss (DCL), local-loss style as lightly's ``DCLLoss``.

    NT-Xent without the positive pair in the denominator. Embeddings are L2-normalised; each rank
    gathers both views and computes the loss of its own B samples against all 2N embeddings, so the
    mean over ranks is the single-device loss. Exact across layouts with a gather whose backward
    sums every rank's gradient (``fixed``).
    """

    style = "local"  # how it splits over ranks (docs/design.md §1)
    layout_invariant = True  # docs/design.md §3: predicted with an exact gather

    def __init__(self, temperature: float = 0.1, gather: str | GatherFn | None = DEFAULT_GATHER):
        super().__init__()
        self.temperature = check_positive("temperature", temperature)
        self.gather = resolve(gather)

    def _weights(
        self, out0: torch.Tensor, out1: torch.Tensor, columns0: torch.Tensor,
        columns1: torch.Tensor, first: int,
    ) -> torch.Tensor | None:  # fmt: skip
        return None

    def forward(self, out0: torch.Tensor, out1: torch.Tensor) -> torch.Tensor:
        check_views(out0, out1)
        out0, out1 = F.normalize(out0, dim=1), F.normalize(out1, dim=1)
        columns0, columns1 = gather_views(self.gather, out0, out1)
        first = local_offset(out0, columns0)
        weights = self._weights(out0, out1, columns0, columns1, first)
        return dcl(out0, out1, columns0, columns1, first, self.temperature, weights)


class DCLWLoss(DCLLoss):
    """Weighted DCL (DCLW) as lightly's ``DCLWLoss``: positive weights over the **local** batch.

    Each positive is weighted by 2 − B·softmax(s(z_i, z'_i)/σ) with the softmax over the rank's own
    B samples. The weights therefore depend on how the global batch is split: 2 × B/2 weights
    differently from 1 × B, and no gather makes the layouts agree. ``DCLWGlobalLoss`` takes the
    softmax over the gathered batch instead.
    """

    layout_invariant = False

    def __init__(
        self,
        temperature: float = 0.1,
        sigma: float = 0.5,
        gather: str | GatherFn | None = DEFAULT_GATHER,
    ):
        super().__init__(temperature, gather)
        self.sigma = check_positive("sigma", sigma)

    def _weights(self, out0, out1, columns0, columns1, first):
        return von_mises_fisher_weights(out0, out1, self.sigma)


class DCLWGlobalLoss(DCLWLoss):
    """Weighted DCL with positive weights over the **global** batch: 2 − N·softmax over all N
    gathered samples, of which each rank uses its own B. Invariant across layouts with ``fixed``."""

    layout_invariant = True

    def _weights(self, out0, out1, columns0, columns1, first):
        weights = von_mises_fisher_weights(columns0, columns1, self.sigma)
        return weights[first : first + out0.shape[0]]
