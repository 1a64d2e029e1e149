"""Losses that each depart from one device at one line, written for the check of where a run
departs (`gatherlab.check.where`, docs/checking.md §6): plain torch and torch.distributed, no
gatherlab imports. The line the check must name carries the comment ``# departs: <class>``;
what a correct check says there follows from docs/design.md §1 (W ranks, B = N/W rows each):

- ``OwnBatchStatistic``: each view standardised with the mean and standard deviation of the
  rank's own rows, then gathered exactly into a global NT-Xent: the mean over dim 0 of the
  rank's B rows, where one device takes all N.
- ``SoftmaxWeightedRows``: each of the rank's rows scored against the gathered batch, the
  per-row losses weighted by a softmax over the rank's rows: a softmax over dim 0 of B rows,
  where one device takes N.
- ``MeanOfRankStds``: a buffer ``scale`` moved each step towards the mean over ranks of each
  rank's standard deviation of its rows per feature (an all_reduce of per-rank statistics), by
  which the embeddings are divided feature-wise: the first step is exact (the scale starts at
  1), the training diverges from the second; the std over dim 0 of the rank's B rows departs,
  and the buffer's update names the line that writes it.
- ``NoGradGatherNegatives``: each rank's queries (view 0) against keys gathered under
  ``torch.no_grad`` (view 1, MoCo-style), which on one device without a process group are the
  keys themselves, with their gradient: the forward agrees, the keys' gradient on the ranks is
  only their own positives' share; the all_gather runs without gradient.
- ``DetachedGatherLocal``: each rank's rows against every rank's, gathered by a plain
  ``dist.all_gather`` of the rows detached (gradient or none, it would carry none) with the
  rank's own rows put back live: the other ranks' rows get no gradient from this rank's loss;
  the cut is the ``detach`` (before, named at the ``empty_like`` the gathered list was made of).
- ``OwnSliceGatherGlobal``: a global NT-Xent (every rank the full loss over the gathered rows)
  behind a gather whose backward keeps only the rank's own slice: the embeddings' gradient is
  exactly 1/W of one device's, produced by that backward.
- ``SigmoidOwnSlice``: a SigLIP-style pairwise sigmoid loss, the rank's rows against every rank's
  columns behind the same own-slice gather, summed over the pairs and divided by the rank's rows
  (a local loss): biased, produced by that backward; ``SigmoidExact`` the same behind a summing
  gather is exact, though its sum over the rank's pairs is only its part of one device's.
- ``EntropyRegularised``: a per-row cross-entropy to a sharpened target plus a mean-entropy
  regulariser over the global batch, whose column sums are completed by an in-place
  ``dist.all_reduce`` (SUM), as MSN's code does; autograd does not see it, so the regulariser's
  gradient passes back unsummed: 1/W of one device's, named at the all_reduce.
- ``EntropyOwnMean``: the same with a second regulariser over the mean of the rank's own rows,
  after the all_reduce: the loss differs there.
- ``SinkhornMeMax``: MSN's pattern: targets balanced by a Sinkhorn over every rank's columns (its
  row sums all-reduced), which divides by the rank's own column count each iteration and
  multiplies by it at the end (intermediates W times one device's, the result one device's);
  a cross-entropy to them, and ``loss +=`` a me-max regulariser over the mean of the rank's own
  anchor rows: the loss differs at that mean, not in the Sinkhorn.
- ``QueueOwnKeys``: MoCo's queue of negatives: each rank's queries against its own positive key
  and a queue (a buffer), then the rank's own keys written into the queue in place under
  ``torch.no_grad`` (``queue[ptr:ptr + B] = keys``), where one device writes every key: the first
  step is exact, the training diverges from the second, named at the write.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from summing_gather import SummingGather
from summing_gather import gather as gathered
from torch import nn


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _OwnSliceGather(SummingGather):
    """Every rank's rows; the backward keeps the rank's own slice of its gradient only."""

    @staticmethod
    def backward(ctx, grad):  # departs: OwnSliceGatherGlobal, SigmoidOwnSlice
        return grad[ctx.own]


def no_grad_gathered(rows: torch.Tensor) -> torch.Tensor:
    """The gathered rows without gradient; without a process group, the rows themselves."""
    if not (dist.is_available() and dist.is_initialized()):
        return rows
    with torch.no_grad():
        parts = [torch.ones_like(rows) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, rows)  # departs: NoGradGatherNegatives
    return torch.cat(parts)


def nt_xent(z0: torch.Tensor, z1: torch.Tensor, temperature: float) -> torch.Tensor:
    """NT-Xent of two views over all their rows: row i of z0 and of z1 are a positive pair."""
    z = F.normalize(torch.cat([z0, z1]), dim=1)
    logits = (z @ z.T / temperature).masked_fill(torch.eye(len(z), dtype=torch.bool), -1e9)
    half = len(z0)
    targets = torch.cat([torch.arange(half, 2 * half), torch.arange(half)])
    return F.cross_entropy(logits, targets)


class OwnBatchStatistic(nn.Module):
    def __init__(self, temperature: float = 0.5):
        super().__init__()
        self.temperature = temperature

    def standardised(self, z: torch.Tensor) -> torch.Tensor:
        centred = z - z.mean(dim=0)  # departs: OwnBatchStatistic
        return centred / centred.std(dim=0)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        z0, z1 = self.standardised(z0), self.standardised(z1)
        return nt_xent(gathered(z0), gathered(z1), self.temperature)


class SoftmaxWeightedRows(nn.Module):
    def __init__(self, temperature: float = 0.5):
        super().__init__()
        self.temperature = temperature

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        rank, _ = _world()
        queries, keys = F.normalize(z0, dim=1), F.normalize(gathered(z1), dim=1)
        logits = queries @ keys.T / self.temperature
        targets = torch.arange(len(z0)) + rank * len(z0)
        per_row = F.cross_entropy(logits, targets, reduction="none")
        weights = torch.softmax(per_row.detach(), dim=0)  # departs: SoftmaxWeightedRows
        return (weights * per_row).sum()


class MeanOfRankStds(nn.Module):
    def __init__(self, temperature: float = 0.5, momentum: float = 0.5):
        super().__init__()
        self.temperature, self.momentum = temperature, momentum
        self.register_buffer("scale", torch.ones(()))

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        loss = nt_xent(gathered(z0) / self.scale, gathered(z1) / self.scale, self.temperature)
        with torch.no_grad():
            spread = torch.cat([z0, z1]).std(dim=0)  # departs: MeanOfRankStds
            _, size = _world()
            if size > 1:
                dist.all_reduce(spread)
                spread = spread / size
            self.scale = self.momentum * self.scale + (1 - self.momentum) * spread
        return loss


class NoGradGatherNegatives(nn.Module):
    def __init__(self, temperature: float = 0.5):
        super().__init__()
        self.temperature = temperature

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        rank, _ = _world()
        queries = F.normalize(z0, dim=1)
        keys = no_grad_gathered(F.normalize(z1, dim=1))
        targets = torch.arange(len(z0)) + rank * len(z0)
        return F.cross_entropy(queries @ keys.T / self.temperature, targets)


class DetachedGatherLocal(nn.Module):
    def __init__(self, temperature: float = 0.5):
        super().__init__()
        self.temperature = temperature

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        rank, world_size = _world()
        queries, keys = F.normalize(z0, dim=1), F.normalize(z1, dim=1)
        if world_size > 1:
            parts = [torch.empty_like(keys) for _ in range(world_size)]
            dist.all_gather(parts, keys.detach().contiguous())  # departs: DetachedGatherLocal
            parts[rank] = keys
            keys = torch.cat(parts)
        targets = torch.arange(len(z0)) + rank * len(z0)
        return F.cross_entropy(queries @ keys.T / self.temperature, targets)


class OwnSliceGatherGlobal(nn.Module):
    def __init__(self, temperature: float = 0.5):
        super().__init__()
        self.temperature = temperature

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        if _world()[1] > 1:
            z0, z1 = _OwnSliceGather.apply(z0), _OwnSliceGather.apply(z1)
        return nt_xent(z0, z1, self.temperature)


class SigmoidExact(nn.Module):
    gather = staticmethod(SummingGather.apply)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        rank, world_size = _world()
        z0, z1 = F.normalize(z0, dim=1), F.normalize(z1, dim=1)
        columns = self.gather(z1) if world_size > 1 else z1
        logits = z0 @ columns.T / 0.1
        n = len(z0)
        labels = -torch.ones_like(logits)
        labels[torch.arange(n), torch.arange(n) + rank * n] = 1.0  # the own pairs
        return -F.logsigmoid(labels * logits).sum() / n


class SigmoidOwnSlice(SigmoidExact):
    gather = staticmethod(_OwnSliceGather.apply)


class EntropyRegularised(nn.Module):
    own_mean = False

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        _, world_size = _world()
        probs = F.softmax(z0 / 0.5, dim=1)
        target = F.softmax(z1.detach() / 0.25, dim=1)
        cross_entropy = -(target * torch.log(probs)).sum(dim=1).mean()
        total = probs.sum(dim=0)  # this rank's part of the column sums
        if world_size > 1:
            dist.all_reduce(total)  # departs: EntropyRegularised
        average = total / (len(probs) * world_size)
        regulariser = (average * torch.log(average)).sum()
        if self.own_mean:
            own = probs.mean(dim=0)  # departs: EntropyOwnMean
            regulariser = regulariser + (own * torch.log(own)).sum()
        return cross_entropy + regulariser


class EntropyOwnMean(EntropyRegularised):
    own_mean = True


def _sinkhorn(scores: torch.Tensor, iterations: int = 3) -> torch.Tensor:
    """Balanced assignments of the rows to the prototypes, over every rank's rows."""
    _, world_size = _world()
    columns, prototypes = scores.shape
    q = scores.T.clone()
    total = q.sum()
    if world_size > 1:
        dist.all_reduce(total)
    q = q / total
    for _ in range(iterations):
        rows = q.sum(dim=1, keepdim=True)
        if world_size > 1:
            dist.all_reduce(rows)
        q /= rows
        q /= prototypes
        q /= q.sum(dim=0, keepdim=True)
        q /= columns  # the rank's own count: a scale the last line takes back
    q *= columns
    return q.T


class SinkhornMeMax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        prototypes = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
        self.register_buffer("prototypes", F.normalize(prototypes, dim=1))

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        prototypes = self.prototypes.to(z0.dtype)
        anchors = F.softmax(F.normalize(z0, dim=1) @ prototypes.T / 0.1, dim=1)
        with torch.no_grad():
            targets = _sinkhorn(F.softmax(F.normalize(z1, dim=1) @ prototypes.T / 0.05, dim=1))
        loss = torch.mean(torch.sum(-targets * torch.log(anchors), dim=1))
        mean_anchor = torch.mean(anchors, dim=0)  # departs: SinkhornMeMax
        loss += (mean_anchor * torch.log(mean_anchor)).sum()
        return loss


class QueueOwnKeys(nn.Module):
    def __init__(self, size: int = 32) -> None:
        super().__init__()
        queue = torch.randn(size, 16, generator=torch.Generator().manual_seed(1))
        self.register_buffer("queue", F.normalize(queue, dim=1))
        self.pointer = 0

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        queries, keys = F.normalize(z0, dim=1), F.normalize(z1, dim=1).detach()
        queue = self.queue.clone().to(z0.dtype)  # the negatives as they are before the write
        positives = (queries * keys).sum(dim=1, keepdim=True)
        logits = torch.cat([positives, queries @ queue.T], dim=1) / 0.2
        loss = F.cross_entropy(logits, torch.zeros(len(z0), dtype=torch.long))
        with torch.no_grad():
            rows = len(keys)
            self.queue[self.pointer : self.pointer + rows] = keys  # departs: QueueOwnKeys
            self.pointer = (self.pointer + rows) % len(self.queue)
        return loss
