"""The all-gather with a gradient as public code writes it, shared by every example and test case
here that needs one: every rank's rows in rank order, and a backward that sums over the ranks the
gradient that each rank's loss gives the gathered rows, then keeps the rank's own slice (lightly's
gather after PR #1531, solo-learn's ``GatherLayer``). Exact on any number of ranks (docs/design.md
§1). Plain torch.distributed, no gatherlab imports.

The gathers that must differ (a backward keeping the own slice, one multiplying by W, one without
gradient) are written beside the cases that show them."""

from __future__ import annotations

import torch
import torch.distributed as dist


class SummingGather(torch.autograd.Function):
    """Forward: every rank's rows, in rank order. Backward: the gathered rows' gradient summed over
    the ranks, this rank's slice of it."""

    @staticmethod
    def forward(ctx, rows):
        rank, size = dist.get_rank(), dist.get_world_size()
        ctx.own = slice(rank * len(rows), (rank + 1) * len(rows))
        parts = [torch.empty_like(rows) for _ in range(size)]
        dist.all_gather(parts, rows.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        summed = grad.contiguous().clone()
        dist.all_reduce(summed)
        return summed[ctx.own]


def gather(rows: torch.Tensor) -> torch.Tensor:
    """``SummingGather`` on two ranks or more; the rows themselves without a process group or in a
    group of one."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return SummingGather.apply(rows)
    return rows
