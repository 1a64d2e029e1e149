"""The inexact gathers found in public code: each rank's slice gets less than Σ_r G_r[s]
(docs/design.md §1): its own loss's gradient only (``Old``, ``NogradSwap``), their mean
(``Avg``), or nothing (``Nograd``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gatherlab.core import terms
from gatherlab.gather.base import BIASED_EVERYWHERE, OWN_SLICE_ONLY, Gather
from gatherlab.gather.collectives import all_gather_rows, sum_over_ranks_of_own_slice
from gatherlab.ranks import world

__all__ = ["Avg", "Nograd", "NogradSwap", "Old"]


class _OldGather(torch.autograd.Function):
    """Forward: all_gather. Backward: the own slice's gradient only, no collective.

    This was lightly's GatherLayer before #1531: the gradient other ranks' losses put on this
    rank's slice never reaches it.
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        return all_gather_rows(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad[world.own_rows(grad.shape[0])]


class _AvgGather(torch.autograd.Function):
    """Forward: all_gather. Backward: all_reduce AVG of every slice's gradient, own slice kept.

    The mean over ranks instead of the sum: every gradient that passes through the gather is W
    times too small (DisCo-CLIP; Horovod's allgather gradient since 0.21). gloo has no AVG, so the
    sum is divided by W.
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        return all_gather_rows(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return sum_over_ranks_of_own_slice(grad) / dist.get_world_size()


class Old(Gather):
    """lightly's GatherLayer before #1531: the own slice's gradient only."""

    predicted = OWN_SLICE_ONLY
    backward = terms.Rule.OWN

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return _OldGather.apply(tensor)


class NogradSwap(Gather):
    """A no-grad all_gather with the live local tensor put back in its slot (OpenCLIP's default)."""

    predicted = OWN_SLICE_ONLY
    backward = terms.Rule.OWN

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            gathered = all_gather_rows(tensor)
        own = world.own_rows(gathered.shape[0])
        return torch.cat([gathered[: own.start], tensor, gathered[own.stop :]], dim=0)


class Avg(Gather):
    """An all_reduce AVG of the slice gradients (DisCo-CLIP, Horovod ≥ 0.21)."""

    predicted = OWN_SLICE_ONLY
    backward = terms.Rule.MEAN

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return _AvgGather.apply(tensor)


class Nograd(Gather):
    """A no-grad all_gather and nothing else (MoCo's ``concat_all_gather`` on live features).

    Predicted biased: only the loss's direct uses of the local tensor carry a gradient. A global
    loss that has none (``ntxent_global``) gets no gradient at all, which the audit measures and
    marks as a disagreement (docs/design.md §1).
    """

    predicted = BIASED_EVERYWHERE
    backward = terms.Rule.NONE

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return all_gather_rows(tensor)
