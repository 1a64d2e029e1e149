"""Functions that the launcher tests run on every rank of a pool. They live apart from the tests so
that a worker unpickling them imports torch alone, not the test module's imports (Lightning)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def rank_and_sum() -> tuple[int, float]:
    tensor = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(tensor)
    return dist.get_rank(), float(tensor)


def fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one refuses")
    dist.barrier()  # rank 0 waits here for a rank that will never come


def exit_on_rank_one() -> None:
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def global_losses_of_rank() -> list[float]:
    """Each step's global loss (gatherlab.runs.steplog) from local losses that differ per rank."""
    from gatherlab.runs.steplog import global_losses

    local = {0: [1e16, 3.0, 0.25], 1: [1.0, 5.0, 0.5]}[dist.get_rank()]
    return global_losses(local)


def mark_started_then_wait(started: str, done: str) -> int:
    """Rank 0 writes the file ``started``; then every rank waits (up to 30 s) for ``done``, which
    only the calling process writes: the job ends only if the caller works while it runs."""
    import time
    from pathlib import Path

    if dist.get_rank() == 0:
        Path(started).write_text("")
    deadline = time.monotonic() + 30
    while not Path(done).exists():
        assert time.monotonic() < deadline, f"{done} never written"
        time.sleep(0.01)
    dist.barrier()
    return dist.get_rank()
