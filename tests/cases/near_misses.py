"""Losses and plain steps built to just miss a verdict that exits 0 (``exact``, ``loss scaled``:
`gatherlab.check.table.TRAINS_LIKE_ONE_DEVICE`), and one that fails at a single world size;
plain torch and torch.distributed, no gatherlab imports. Each starts from one device's global
NT-Xent computed on every rank over the gathered rows (``diagnosis_cases``' NT-Xent,
``summing_gather``'s gather) and changes one thing. What a correct check finds follows from
docs/design.md §1 (W ranks, L the loss of one device on the whole batch, ∇L its gradient; DDP
averages the ranks' gradients):

- ``ScaledOverSummingGather()``: W·L over a gather whose backward sums every rank's gradient of
  each slice. That gather alone is exact (each rank's gradient of its own rows is W·∂L/∂rows,
  DDP divides by W); the factor W, put in "to undo DDP's average", is then one too many: the
  forward is W·L (scale W) and the gradient W·∇L, cosine 1, norm ratio W. The gradient's class is
  ``W`` and the verdict ``loss differs``: a loss that logs W·L is ``loss scaled`` only while its
  gradient is exact.
- ``StrayGradientOnRankZero(scaled=False, weight=1.0)``: L over the summing gather, plus, on rank
  0 only, ``weight · Σ(z0 − z0.detach())``. Each difference is 0.0, so the term's value is exactly
  0 and every rank's loss is L; its gradient is ``weight`` on each of rank 0's view-0 embeddings,
  so the averaged gradient is ∇L plus a vector no other rank, and no device, has: the forward is
  ``same``, the gradient ``biased`` (not parallel to ∇L), never ``exact``. With ``scaled=True``
  the same term is added to W·L over a gather whose backward keeps only the rank's own slice
  (1/W × W: an exact gradient, ``diagnosis_cases.ScaledToUndoAverage``): the forward is W·L
  (scale W), the gradient ``biased``, the verdict ``loss differs``, never ``loss scaled``.
- ``StrayGradientAtCall(call=2)``: L over the summing gather, plus that zero-valued term on rank
  0 at this instance's forward number ``call`` (from 0) only. A training run of ``call`` + 1
  steps equals one device's at every step's loss (the term's value is 0, and the weights before
  the last update are one device's); only the last update, and so the final weights, differ. The
  first step the check measures has no term (a fresh instance): its gradient is exact.
- ``StrayValueAtCall(call=2, offset=1e-6)``: L, plus on rank 0 at forward number ``call`` only
  the constant ``offset`` (no gradient): the global loss of step ``call`` is L + offset/W, every
  gradient one device's.
- ``stray_gradient_at_last_step(model, batch)``, a plain PyTorch step (``--step``, with
  ``plain_steps.build_model`` and ``plain_steps.Pairs``): ``plain_steps.training_step``, plus on
  rank 0 the zero-valued term at the model's forward number ``LAST_STEP`` only, for a run of
  ``LAST_STEP`` + 1 steps: every step's loss is one device's, the final weights are not.
- ``FailsAtWorldSize(failing_at=4)``: L over the summing gather (exact), except on
  ``failing_at`` ranks, where the last rank raises ``ValueError: fails at world size
  <failing_at>`` before the gather its peers enter. (Not ``world_size=``: the check passes that
  to a loss whose signature takes it.)
"""

from __future__ import annotations

import diagnosis_cases
import plain_steps
import torch
import torch.distributed as dist
from summing_gather import gather
from torch import nn

LAST_STEP = 2
"""The forward (from 0) at which ``stray_gradient_at_last_step`` adds its term: the last of a
3-step run."""


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _summed(z0: torch.Tensor, z1: torch.Tensor, temperature: float) -> torch.Tensor:
    """L on every rank: the NT-Xent of the gathered rows, the gather's backward summing."""
    return diagnosis_cases._nt_xent(gather(z0), gather(z1), temperature)


def _zero_valued(z0: torch.Tensor, weight: float) -> torch.Tensor:
    """A term whose value is exactly 0 and whose gradient is ``weight`` on every entry of z0."""
    return weight * (z0 - z0.detach()).sum()


class ScaledOverSummingGather(nn.Module):
    def __init__(self, temperature: float = 0.5):
        super().__init__()
        self.temperature = temperature

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        return _summed(z0, z1, self.temperature) * _world()[1]


class StrayGradientOnRankZero(nn.Module):
    def __init__(self, temperature: float = 0.5, scaled: bool = False, weight: float = 1.0):
        super().__init__()
        self.temperature, self.scaled, self.weight = temperature, scaled, weight

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        rank, size = _world()
        if self.scaled and size > 1:  # W·L, its gradient exact: 1/W (own slice) × W
            own = diagnosis_cases._AllGatherOwnGrad.apply
            loss = diagnosis_cases._nt_xent(own(z0), own(z1), self.temperature) * size
        else:
            loss = _summed(z0, z1, self.temperature)
        if size > 1 and rank == 0:
            loss = loss + _zero_valued(z0, self.weight)
        return loss


class StrayGradientAtCall(nn.Module):
    def __init__(self, temperature: float = 0.5, call: int = 2):
        super().__init__()
        self.temperature, self.call, self.calls = temperature, call, 0

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        rank, size = _world()
        loss = _summed(z0, z1, self.temperature)
        if size > 1 and rank == 0 and self.calls == self.call:
            loss = loss + _zero_valued(z0, 1.0)
        self.calls += 1
        return loss


class StrayValueAtCall(nn.Module):
    def __init__(self, temperature: float = 0.5, call: int = 2, offset: float = 1e-6):
        super().__init__()
        self.temperature, self.call, self.offset, self.calls = temperature, call, offset, 0

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        rank, size = _world()
        loss = _summed(z0, z1, self.temperature)
        if size > 1 and rank == 0 and self.calls == self.call:
            loss = loss + self.offset
        self.calls += 1
        return loss


def stray_gradient_at_last_step(model: nn.Module, batch) -> torch.Tensor:
    inner = getattr(model, "module", model)  # the model itself, inside DDP or not
    calls = getattr(inner, "near_misses_calls", 0)
    inner.near_misses_calls = calls + 1
    x0, x1 = batch
    z0, z1 = model(torch.cat([x0, x1])).chunk(2)
    loss = plain_steps.nt_xent(z0, z1)
    rank, size = _world()
    if size > 1 and rank == 0 and calls == LAST_STEP:
        loss = loss + _zero_valued(z0, 1.0)
    return loss


class FailsAtWorldSize(nn.Module):
    def __init__(self, temperature: float = 0.5, failing_at: int = 4):
        super().__init__()
        self.temperature, self.failing_at = temperature, failing_at

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        rank, size = _world()
        if size == self.failing_at and rank == size - 1:
            raise ValueError(f"fails at world size {size}")
        return _summed(z0, z1, self.temperature)
