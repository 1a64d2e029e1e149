"""VICReg (Bardes et al., 2022, "VICReg: Variance-Invariance-Covariance Regularization for
Self-Supervised Learning")."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gatherlab.gather import GatherFn, resolve
from gatherlab.losses._common import (
    DEFAULT_GATHER,
    check_non_negative,
    check_positive,
    check_views,
    gather_views,
    off_diagonal,
)


def variance_term(z: torch.Tensor, eps: float) -> torch.Tensor:
    """Mean over dimensions of max(0, 1 − sqrt(Var(z_d) + ε)): keeps every dimension spread."""
    return F.relu(1 - torch.sqrt(z.var(dim=0) + eps)).mean()


def covariance_term(z: torch.Tensor) -> torch.Tensor:
    """Σ_{i≠j} Cov(z)_ij² / D: decorrelates the dimensions."""
    centred = z - z.mean(dim=0)
    covariance = centred.T @ centred / (z.shape[0] - 1)
    return off_diagonal(covariance).pow(2).sum() / z.shape[1]


class VICRegLoss(nn.Module):
    """VICReg as lightly's ``VICRegLoss``: mixed distributed semantics.

    λ·invariance + μ·variance + ν·covariance. The invariance term (mean squared distance of the two
    views) is computed on the rank's own pairs, so its mean over ranks is the single-device term
    (local-loss style); both views are then gathered and the variance and covariance terms are
    computed on the whole global batch on every rank (global-loss style). Invariant across layouts
    with ``fixed``; with a gather that drops other ranks' gradients only the invariance term's
    gradient survives intact, which changes the direction of the total.
    """

    style = "mixed"  # how it splits over ranks (docs/design.md §1)
    layout_invariant = True  # docs/design.md §3: predicted with an exact gather

    def __init__(
        self,
        lambda_param: float = 25.0,
        mu_param: float = 25.0,
        nu_param: float = 1.0,
        eps: float = 1e-4,
        gather: str | GatherFn | None = DEFAULT_GATHER,
    ):
        super().__init__()
        self.lambda_param = check_non_negative("lambda_param", lambda_param)
        self.mu_param = check_non_negative("mu_param", mu_param)
        self.nu_param = check_non_negative("nu_param", nu_param)
        self.eps = check_positive("eps", eps)
        self.gather = resolve(gather)

    def forward(self, out0: torch.Tensor, out1: torch.Tensor) -> torch.Tensor:
        check_views(out0, out1)
        invariance = F.mse_loss(out0, out1)
        columns0, columns1 = gather_views(self.gather, out0, out1)
        if columns0.shape[0] < 2:
            raise ValueError("VICReg needs at least 2 samples in the global batch")
        variance = 0.5 * (variance_term(columns0, self.eps) + variance_term(columns1, self.eps))
        covariance = covariance_term(columns0) + covariance_term(columns1)
        return (
            self.lambda_param * invariance + self.mu_param * variance + self.nu_param * covariance
        )
