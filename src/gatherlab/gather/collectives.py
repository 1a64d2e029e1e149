"""The collectives gatherlab's own gathers run: the forward's all-gather into one tensor, and the
sum over ranks of each slice's gradient that ``fixed``'s and ``avg``'s backward deliver to the
slice's owner, by the collective the backend runs faster."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gatherlab.core import terms
from gatherlab.ranks import world

__all__ = [
    "BACKWARD_COLLECTIVES",
    "REDUCE_SCATTER_BACKENDS",
    "all_gather_rows",
    "backward_collective",
    "sum_over_ranks_of_own_slice",
]

# The two collectives that deliver Σ_r G_r[s] to rank s in ``fixed``'s backward. NCCL's
# reduce-scatter of S sends half the bytes of an all-reduce of W·S and copies nothing; torch's
# reduce-scatter on gloo clones the whole W·S gradient, all-reduces the clone and copies the own
# slice out (tests/gather/test_gather.py profiles it), the all-reduce and one copy more. So each
# backend gets its own (``python -m gatherlab.bench gather`` times both).
BACKWARD_COLLECTIVES = ("all_reduce", "reduce_scatter")
REDUCE_SCATTER_BACKENDS = frozenset({terms.Backend.NCCL, terms.Backend.XCCL})


def backward_collective(backend: str | None = None) -> str:
    """The collective ``fixed``'s (and ``avg``'s) backward uses on ``backend`` (None: the running
    one): ``reduce_scatter`` on NCCL and XCCL, ``all_reduce`` elsewhere."""
    backend = str(dist.get_backend()) if backend is None else backend
    return "reduce_scatter" if backend in REDUCE_SCATTER_BACKENDS else "all_reduce"


def all_gather_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's tensor, concatenated along the first dimension in rank order, gathered straight
    into one preallocated tensor (no list of slices, no concatenation)."""
    tensor = tensor.contiguous()
    gathered = tensor.new_empty((dist.get_world_size() * tensor.shape[0], *tensor.shape[1:]))
    dist.all_gather_single(gathered, tensor)
    return gathered


def sum_over_ranks_of_own_slice(grad: torch.Tensor, collective: str | None = None) -> torch.Tensor:
    """Σ_r G_r[s] on rank s, where ``grad`` is this rank's G_r, the gradient of the whole gathered
    tensor (N × …).

    reduce_scatter reads ``grad`` and writes the sum straight into the own slice (no copy);
    all_reduce sums in place, so it works on one copy of ``grad``, which autograd may share with
    other nodes (an addition hands the same gradient to both of its inputs), and keeps a view of
    its own rows.
    """
    if (collective or backward_collective()) == "reduce_scatter":
        own = grad.new_empty((grad.shape[0] // dist.get_world_size(), *grad.shape[1:]))
        dist.reduce_scatter_single(own, grad.contiguous(), op=dist.ReduceOp.SUM)
        return own
    summed = grad.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    return summed[world.own_rows(summed.shape[0])]
