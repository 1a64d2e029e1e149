"""Barlow Twins (Zbontar et al., 2021, "Barlow Twins: Self-Supervised Learning via Redundancy
Reduction")."""

from __future__ import annotations

import torch
from torch import nn

from gatherlab.gather import GatherFn, resolve
from gatherlab.losses._common import (
    DEFAULT_GATHER,
    check_non_negative,
    check_views,
    gather_views,
    off_diagonal,
)


def standardise(z: torch.Tensor) -> torch.Tensor:
    """Each dimension to zero mean and unit (unbiased) standard deviation along the batch."""
    return (z - z.mean(dim=0)) / z.std(dim=0)


def redundancy_reduction(correlation: torch.Tensor, lambda_param: float) -> torch.Tensor:
    """Σ_i (1 − C_ii)² + λ Σ_{i≠j} C_ij²: the cross-correlation pulled towards the identity."""
    on_diagonal = (torch.diagonal(correlation) - 1).pow(2).sum()
    return on_diagonal + lambda_param * off_diagonal(correlation).pow(2).sum()


class _BarlowTwinsBase(nn.Module):
    def __init__(self, lambda_param: float = 5e-3, gather: str | GatherFn | None = DEFAULT_GATHER):
        super().__init__()
        self.lambda_param = check_non_negative("lambda_param", lambda_param)
        self.gather = resolve(gather)


class BarlowTwinsLoss(_BarlowTwinsBase):
    """Barlow Twins as lightly's ``BarlowTwinsLoss``: per-rank standardisation (local statistics).

    Each rank standardises its own B embeddings per dimension with their own mean and standard
    deviation, forms the cross-correlation C_r = z̃_aᵀ z̃_b / B, and the ranks average their C_r (a
    gather of the D × D matrices, so its backward is the gather's). The loss of the averaged
    matrix is the same on every rank. It is not the single-device loss: statistics over B/W samples
    are not statistics over N, so layouts differ whatever the gather. ``BarlowTwinsGlobalLoss``
    standardises with the global batch's statistics.
    """

    style = "global"  # how it splits over ranks (docs/design.md §1)
    layout_invariant = False  # docs/design.md §3: predicted with an exact gather

    def forward(self, out0: torch.Tensor, out1: torch.Tensor) -> torch.Tensor:
        check_views(out0, out1, min_rows=2)
        local = standardise(out0).T @ standardise(out1) / out0.shape[0]
        correlation = self.gather(local[None]).mean(dim=0)
        return redundancy_reduction(correlation, self.lambda_param)


class BarlowTwinsGlobalLoss(_BarlowTwinsBase):
    """Barlow Twins with global statistics: both views are gathered and every rank computes the
    single-device loss of the whole global batch (global-loss style). Invariant with ``fixed``."""

    style = "global"  # how it splits over ranks (docs/design.md §1)
    layout_invariant = True

    def forward(self, out0: torch.Tensor, out1: torch.Tensor) -> torch.Tensor:
        check_views(out0, out1)
        columns0, columns1 = gather_views(self.gather, out0, out1)
        if columns0.shape[0] < 2:
            raise ValueError("Barlow Twins needs at least 2 samples in the global batch")
        correlation = standardise(columns0).T @ standardise(columns1) / columns0.shape[0]
        return redundancy_reduction(correlation, self.lambda_param)
