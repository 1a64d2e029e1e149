"""Losses whose ranks do not enter the same collectives, written for the check's naming of
collectives that differ (`gatherlab.ranks.collectives`, docs/design.md §10): plain torch and
torch.distributed, no gatherlab imports. Without a process group (one device) each is a plain
mean of the embeddings; on the ranks each line marked ``# enters: <class>`` is the collective the
check must name, with the rank that calls it:

- ``ExtraAllReduceOnRankZero``: rank 0 all-reduces a 1-element count that no other rank does,
  then every rank all-gathers its rows: rank 0's all_reduce meets the others' all_gather.
- ``GatherOnZeroReduceElsewhere``: rank 0 all-gathers its rows where every other rank
  all-reduces them.
- ``LastRankReturnsEarly``: the last rank returns its own loss before the all_reduce of the
  loss that its peers enter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gathered(rows: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(rows) for _ in range(_world()[1])]
    dist.all_gather(parts, rows.detach().contiguous())  # enters: ExtraAllReduceOnRankZero
    return torch.cat(parts)


class ExtraAllReduceOnRankZero:
    def __call__(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        rank, size = _world()
        if size == 1:
            return (z0 * z1).mean()
        if rank == 0:
            count = torch.tensor([float(len(z0))], dtype=z0.dtype)
            dist.all_reduce(count)  # enters: ExtraAllReduceOnRankZero
        return (z0 * _gathered(z1)[: len(z0)]).mean()


class GatherOnZeroReduceElsewhere:
    def __call__(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        rank, size = _world()
        if size == 1:
            return (z0 * z1).mean()
        rows = z1.detach().clone()
        if rank == 0:
            parts = [torch.empty_like(rows) for _ in range(size)]
            dist.all_gather(parts, rows)  # enters: GatherOnZeroReduceElsewhere
        else:
            dist.all_reduce(rows)  # enters: GatherOnZeroReduceElsewhere
        return (z0 * z1).mean()


class LastRankReturnsEarly:
    def __call__(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        rank, size = _world()
        loss = (z0 * z1).mean()
        if size == 1 or rank == size - 1:
            return loss
        total = loss.detach().clone()
        dist.all_reduce(total)  # enters: LastRankReturnsEarly
        return loss
