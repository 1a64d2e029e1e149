"""Losses written the way public self-supervised code writes them (plain torch and
torch.distributed, their own gathers, no gatherlab imports), each with a fault, or a need, that a
check must find. What a correct check finds follows from docs/design.md §1 (W ranks, local batch
B, global batch N = W·B, L the loss of one device on the whole batch):

- ``LearntTemperatureOwnSlice(temperature=0.1)``: a global NT-Xent (every rank the full loss over
  the gathered 2N rows) with a learnt temperature (``log_temperature``), gathered by an autograd
  Function whose backward keeps the own slice's gradient only. The model's gradient is ∇L/W
  (cosine 1, norm ratio 1/W), ``log_temperature``'s is exact (every rank has all of it, DDP
  averages W equal values): the whole gradient is biased.
- ``ScaledToUndoAverage(temperature=0.5, rank=0, world_size=1)``: OpenCLIP-style no-grad
  all_gather with the live local tensor put back in its slot, a global NT-Xent, then the loss
  multiplied by world_size "to undo DDP's average". The gradient is exact (1/W × W); the loss
  each rank returns is W·L: the forward differs by the constant factor W.
- ``ViewsConcatenatedThenGathered(temperature=0.5)``: each rank gathers cat([z0, z1]) (an exact
  gather), so the 2N rows come as [z0 of rank 0; z1 of rank 0; z0 of rank 1; …], and an NT-Xent
  pairs row i with row i + N as if they were view-major. Right on one device, wrong positives on
  W ranks: the loss differs, and equals one device's loss on (a, b) = the first and second half of
  [view0 rows of rank 0; view1 rows of rank 0; view0 rows of rank 1; …] ("pair_order"); the
  gradient is that loss's exact gradient.
- ``NeedsProcessGroup(temperature=0.5)`` and ``asserting_gather`` (a gather ``x -> gathered x``):
  an exact gather behind ``assert dist.is_initialized()``, as released code has it, under a global
  NT-Xent. Exact, provided the one-device reference runs in a process group of one rank (without
  one it raises AssertionError).
- ``FailsAtFourRanks(temperature=0.5, block_size=8)``: an exact view-wise NT-Xent (z0 and z1
  gathered separately) that raises ValueError when its local batch has fewer than ``block_size``
  rows. On the global batch of 16: exact at W = 2, fails on every rank at W = 4.
- ``CenterFromOwnRows(temperature=0.5, momentum=0.9)``: an exact view-wise NT-Xent of the
  embeddings minus a center (a buffer, as DINO-style code keeps one), the center then moved
  towards the mean of the rank's own rows only (no all_reduce). The first step is exact (the
  center starts at 0 everywhere); from the second on the center is rank 0's local mean (DDP
  broadcasts buffers from rank 0), not the global one: the training diverges.
- ``LocalNegativesOnly(temperature=0.5)``: a plain NT-Xent of the rank's own rows, no
  communication. The loss differs: it is the mean over ranks of one device's loss on each rank's
  slice alone ("local_negatives"), and the gradient is that loss's gradient (biased against L's).
- ``NoGradGatherNegatives(temperature=0.5)``: an InfoNCE of the rank's own rows of view 0 (the
  queries) against every rank's rows of view 1 (the keys, the positive of query i at row
  r·B + i), the keys gathered by ``concat_all_gather`` as MoCo-style code writes it: an
  all_gather under ``torch.no_grad`` into ``torch.ones_like`` buffers when a process group is
  initialised, the input itself (with its gradient) when none is. The forward is L on W ranks
  and on one device. Without a group (a user's plain one-GPU run) the gradient flows through
  queries and keys; in any group, one rank or W, only through the queries: the one-device run
  differs inside a one-rank group from the plain run, and the W-rank gradient, judged against
  the plain run, is biased (it was "exact" against a reference in a one-rank group, which lost
  the keys' gradient too).
- ``GlobalNoGradGather(temperature=0.5)``: every rank the full NT-Xent over the gathered rows of
  both views, both through ``concat_all_gather``. Without a group it is L with its gradient; in
  any group no gradient reaches the model: ``none`` on W ranks against the plain run (it was
  "exact" against a one-rank group's, zero too), and the one-rank group differs (``none``).
- ``TrainsNothing()``: the mean squared distance of the two views' embeddings, computed from
  detached copies. The forward is the same on W ranks (a mean of equal-sized means); no gradient
  reaches the model on either side: ``none`` (never ``exact``), and the check's exit status is 1.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from summing_gather import SummingGather
from torch import nn


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _nt_xent_rows(z: torch.Tensor, temperature: torch.Tensor | float) -> torch.Tensor:
    """NT-Xent over 2M rows whose positive pairs are (i, i + M): each row against all others."""
    z = F.normalize(z, dim=1)
    logits = z @ z.T / temperature
    self_pairs = torch.eye(len(z), dtype=torch.bool, device=z.device)
    logits = logits.masked_fill(self_pairs, float("-inf"))
    half = len(z) // 2
    targets = torch.cat([torch.arange(half, len(z)), torch.arange(half)]).to(z.device)
    return F.cross_entropy(logits, targets)


def _nt_xent(z0: torch.Tensor, z1: torch.Tensor, temperature: torch.Tensor | float) -> torch.Tensor:
    """SimCLR's NT-Xent of two views: row i of z0 and row i of z1 are the positive pair."""
    return _nt_xent_rows(torch.cat([z0, z1]), temperature)


class _AllGatherOwnGrad(torch.autograd.Function):
    """all_gather whose backward returns only this rank's slice of the gathered gradient."""

    @staticmethod
    def forward(ctx, x):
        ctx.rank, ctx.rows = dist.get_rank(), len(x)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows]


def _gather(x: torch.Tensor) -> torch.Tensor:
    return SummingGather.apply(x) if _distributed() else x


class LearntTemperatureOwnSlice(nn.Module):
    def __init__(self, temperature: float = 0.1):
        super().__init__()
        self.log_temperature = nn.Parameter(torch.tensor(math.log(temperature)))

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        if _distributed():
            z0, z1 = _AllGatherOwnGrad.apply(z0), _AllGatherOwnGrad.apply(z1)
        return _nt_xent(z0, z1, self.log_temperature.exp())


class ScaledToUndoAverage(nn.Module):
    def __init__(self, temperature: float = 0.5, rank: int = 0, world_size: int = 1):
        super().__init__()
        self.temperature, self.rank, self.world_size = temperature, rank, world_size

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.zeros_like(x) for _ in range(self.world_size)]
        with torch.no_grad():
            dist.all_gather(parts, x)
        parts[self.rank] = x  # keep the gradient of the local rows
        return torch.cat(parts)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            z0, z1 = self.gather(z0), self.gather(z1)
        loss = _nt_xent(z0, z1, self.temperature)
        return loss * self.world_size  # DDP divides the gradients by world_size


class ViewsConcatenatedThenGathered(nn.Module):
    def __init__(self, temperature: float = 0.5):
        super().__init__()
        self.temperature = temperature

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        z = _gather(torch.cat([z0, z1]))
        return _nt_xent_rows(z, self.temperature)


def asserting_gather(x: torch.Tensor) -> torch.Tensor:
    """The gathered x of all ranks, in rank order, with gradients summed over ranks."""
    assert dist.is_initialized()
    return SummingGather.apply(x)


class NeedsProcessGroup(nn.Module):
    def __init__(self, temperature: float = 0.5):
        super().__init__()
        self.temperature = temperature

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        return _nt_xent(asserting_gather(z0), asserting_gather(z1), self.temperature)


class FailsAtFourRanks(nn.Module):
    def __init__(self, temperature: float = 0.5, block_size: int = 8):
        super().__init__()
        self.temperature, self.block_size = temperature, block_size

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        if len(z0) < self.block_size:
            raise ValueError(
                f"needs at least {self.block_size} rows per rank (its block size), got {len(z0)}"
            )
        return _nt_xent(_gather(z0), _gather(z1), self.temperature)


class CenterFromOwnRows(nn.Module):
    def __init__(self, temperature: float = 0.5, momentum: float = 0.9):
        super().__init__()
        self.temperature, self.momentum = temperature, momentum
        self.register_buffer("center", torch.zeros(()))

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        loss = _nt_xent(_gather(z0) - self.center, _gather(z1) - self.center, self.temperature)
        with torch.no_grad():  # the rank's own rows: the mean is not all-reduced
            own = torch.cat([z0, z1]).mean()
            self.center.mul_(self.momentum).add_((1 - self.momentum) * own)
        return loss


class LocalNegativesOnly(nn.Module):
    def __init__(self, temperature: float = 0.5):
        super().__init__()
        self.temperature = temperature

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        return _nt_xent(z0, z1, self.temperature)


def concat_all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's rows of ``tensor`` in rank order, without gradient; ``tensor`` itself (with
    its gradient) when no process group is initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return tensor
    gathered = [torch.ones_like(tensor) for _ in range(dist.get_world_size())]
    with torch.no_grad():
        dist.all_gather(gathered, tensor)
    return torch.cat(gathered)


class NoGradGatherNegatives(nn.Module):
    def __init__(self, temperature: float = 0.5):
        super().__init__()
        self.temperature = temperature

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        queries, keys = F.normalize(z0, dim=1), concat_all_gather(F.normalize(z1, dim=1))
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        positives = torch.arange(len(queries), device=queries.device) + rank * len(queries)
        return F.cross_entropy(queries @ keys.T / self.temperature, positives)


class GlobalNoGradGather(nn.Module):
    def __init__(self, temperature: float = 0.5):
        super().__init__()
        self.temperature = temperature

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        return _nt_xent(concat_all_gather(z0), concat_all_gather(z1), self.temperature)


class TrainsNothing(nn.Module):
    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        return (z0.detach() - z1.detach()).pow(2).sum(dim=1).mean()
