"""The two autograd-aware collectives the census's fixes use (the patch files of
``experiments/census_cases/fixes/``) and its reproducers (``experiments/census_repro/``): an
all-reduce and an all-gather whose backward sums every rank's gradient, in plain torch.

A fix is a patch applied to a copy of a released file; the code it adds imports these with
``from census_fixes import ...``, which the census's ranks can do because the census puts
``experiments/`` on the import path the pool sends them (``python -m gatherlab.check`` needs
``PYTHONPATH=experiments``, as for the adapters).

Without a process group, or with one rank, both return their input: the same loss code runs on
one device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_gather_rows", "all_reduce_sum"]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class _AllReduceSum(torch.autograd.Function):
    """Forward: an all_reduce SUM of a copy of the input (the input itself is left as it is).
    Backward: an all_reduce SUM of the gradient. Every rank's loss depends on the sum, so the
    gradient of the rank's input is the sum over ranks of each rank's gradient of the sum."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        summed = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        return summed

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        summed = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        return summed


class _AllGatherRows(torch.autograd.Function):
    """Forward: every rank's rows (the same number on each), concatenated in rank order.
    Backward: the gradient of the whole gathered tensor all-reduced (SUM) over ranks, then the
    rank's own slice: the sum of what every rank's loss puts on the rank's rows (the rule of
    ``gatherlab.gather.Fixed``). The gradient is made contiguous before the collective, whatever
    its strides (a gathered tensor used through ``.permute`` hands its backward a gradient that
    is not)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()
        pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, tensor)
        ctx.rows = tensor.shape[0]
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        summed = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        start = dist.get_rank() * ctx.rows
        return summed[start : start + ctx.rows]


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor`` over ranks, whose backward sums the ranks' gradients; ``tensor``
    itself without a process group of more than one rank."""
    return _AllReduceSum.apply(tensor) if _distributed() else tensor


def all_gather_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor`` (each with the same number of rows) concatenated along the first
    dimension in rank order, whose backward gives each rank the sum over ranks of the gradient
    of its rows; ``tensor`` itself without a process group of more than one rank."""
    return _AllGatherRows.apply(tensor) if _distributed() else tensor
