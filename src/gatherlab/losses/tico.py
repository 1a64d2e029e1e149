"""TiCo (Zhu et al., 2022, "TiCo: Transformation Invariance and Covariance Contrast for
Self-Supervised Visual Representation Learning")."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gatherlab.gather import GatherFn, resolve
from gatherlab.losses._common import (
    DEFAULT_GATHER,
    check_non_negative,
    check_views,
    gather_views,
)


class TiCoLoss(nn.Module):
    """TiCo as lightly's ``TiCoLoss``: global-loss style with a running covariance.

    Embeddings are L2-normalised and both views gathered; on the global batch Z (N × D) every rank
    computes C_t = β·C_{t−1} + (1 − β)·Z_aᵀZ_a / N and the loss −mean_i ⟨z_a,i, z_b,i⟩ +
    ρ·mean_i z_a,iᵀ C_t z_a,i. C_{t−1} is kept without gradient between steps. Every rank sees the
    same global batch, so every rank keeps the same C and the loss is invariant with ``fixed``.
    """

    style = "global"  # how it splits over ranks (docs/design.md §1)
    layout_invariant = True  # docs/design.md §3: predicted with an exact gather

    def __init__(
        self,
        beta: float = 0.9,
        rho: float = 20.0,
        gather: str | GatherFn | None = DEFAULT_GATHER,
    ):
        super().__init__()
        if not isinstance(beta, int | float) or not 0 <= beta < 1:
            raise ValueError(f"beta must be a number in [0, 1), got {beta!r}")
        self.beta = float(beta)
        self.rho = check_non_negative("rho", rho)
        self.gather = resolve(gather)
        self.covariance: torch.Tensor | None = None

    def forward(self, out0: torch.Tensor, out1: torch.Tensor) -> torch.Tensor:
        check_views(out0, out1)
        out0, out1 = F.normalize(out0, dim=1), F.normalize(out1, dim=1)
        columns0, columns1 = gather_views(self.gather, out0, out1)
        previous = self.covariance
        if previous is None:
            previous = columns0.new_zeros(columns0.shape[1], columns0.shape[1])
        batch_covariance = columns0.T @ columns0 / columns0.shape[0]
        covariance = self.beta * previous + (1 - self.beta) * batch_covariance
        if self.training:
            self.covariance = covariance.detach()
        invariance = -(columns0 * columns1).sum(dim=1).mean()
        contrast = ((columns0 @ covariance) * columns0).sum(dim=1).mean()
        return invariance + self.rho * contrast
