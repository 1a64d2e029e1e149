"""Losses whose ranks do not enter the same collectives, or do not come to one, written for the
check's naming of them (`gatherlab.ranks.watched`, docs/checking.md §10): plain torch and
torch.distributed, no gatherlab imports. Without a process group (one device) each is a plain
mean of the embeddings' products; on the ranks, each line marked ``# enters: <class> (<ranks>)``
is a collective the check must name, with the ranks that call it:

- ``ExtraAllReduceOnRankZero``: rank 0 all-reduces a 1-element count that no other rank does,
  then every rank all-gathers its rows: rank 0's all_reduce meets the others' all_gather.
- ``GatherOnZeroReduceElsewhere``: rank 0 all-gathers its rows where every other rank
  all-reduces them.
- ``LastRankReturnsEarly``: the last rank returns its loss before the all_reduce of the loss that
  its peers enter; its next collective is DDP's all-reduce of the gradients, in its backward.
- ``LastRankRaises``: the last rank raises before the all_reduce its peers enter.
- ``LastRankSleeps``: the last rank sleeps a minute before the all_reduce its peers enter (a
  rank that hangs).
- ``LastRankAborts``: the last rank writes a line to its standard error and aborts (SIGABRT).
- ``CollectiveRaises``: every rank enters the same all_reduce, which torch.distributed refuses
  (a reduce operation it has no name for): an error from inside a collective.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

ABORT_LINE = "collective_cases: the last rank aborts now"
"""What ``LastRankAborts`` writes to its standard error before it aborts."""


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class ExtraAllReduceOnRankZero:
    def __call__(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        rank, size = _world()
        if size == 1:
            return (z0 * z1).mean()
        if rank == 0:
            count = torch.tensor([float(len(z0))], dtype=z0.dtype)
            dist.all_reduce(count)  # enters: ExtraAllReduceOnRankZero (rank 0)
        parts = [torch.empty_like(z1) for _ in range(size)]
        dist.all_gather(parts, z1.detach().contiguous())  # enters: ExtraAllReduceOnRankZero (all)
        return (z0 * z1).mean()


class GatherOnZeroReduceElsewhere:
    def __call__(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        rank, size = _world()
        if size == 1:
            return (z0 * z1).mean()
        rows = z1.detach().clone()
        if rank == 0:
            parts = [torch.empty_like(rows) for _ in range(size)]
            dist.all_gather(parts, rows)  # enters: GatherOnZeroReduceElsewhere (rank 0)
        else:
            dist.all_reduce(rows)  # enters: GatherOnZeroReduceElsewhere (others)
        return (z0 * z1).mean()


class _LastRankSkips:
    """The loss, all-reduced (without gradient) by every rank but the last, which first does
    ``_instead()``."""

    def __call__(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        rank, size = _world()
        loss = (z0 * z1).mean()
        if size == 1:
            return loss
        if rank == size - 1:
            self._instead()
            return loss
        total = loss.detach().clone()
        dist.all_reduce(total)  # enters: the peers of the last rank
        return loss

    def _instead(self) -> None:
        pass


class LastRankReturnsEarly(_LastRankSkips):
    pass


class LastRankRaises(_LastRankSkips):
    def _instead(self) -> None:
        raise ValueError("the last rank stops here")


class LastRankSleeps(_LastRankSkips):
    def _instead(self) -> None:
        time.sleep(60)


class LastRankAborts(_LastRankSkips):
    def _instead(self) -> None:
        print(ABORT_LINE, file=sys.stderr, flush=True)
        os.abort()


class EveryRankRaises:
    """Every rank raises the same error (a name the code lacks, say): whichever answers first,
    the row names the lowest rank."""

    def __call__(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        rank, size = _world()
        if size == 1:
            return (z0 * z1).mean()
        time.sleep(0.05 * (size - 1 - rank))  # the last rank raises first
        raise NameError(f"name 'exists' is not defined (rank {rank})")


class CollectiveRaises:
    """Every rank enters the same all_reduce with a reduce operation torch.distributed has no
    name for, which raises inside the collective on every rank."""

    def __call__(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        _, size = _world()
        loss = (z0 * z1).mean()
        if size > 1:
            dist.all_reduce(loss.detach().clone(), op="no such operation")  # enters: every rank
        return loss
