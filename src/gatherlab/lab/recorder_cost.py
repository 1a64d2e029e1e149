"""``python -m gatherlab.bench record-fixed``: the recorder's fixed cost per update, on a tiny job
whose update takes a few milliseconds, at W = 1, 2 and 4 real gloo ranks (docs/performance.md,
"Recording a job: the recorder's cost").

The job is what a user's small contrastive job is: an MLP encoder (64 → 128 → 128 → 32) of two
views of a global batch of 64 rows, SimCLR's NT-Xent over the exactly gathered batch, DDP (at
W > 1) and SGD. Two copies of it train in one process per rank, one plain and one recorded with
the one line a job adds (``gatherlab.record(model, optimizer, out, loss=criterion)``); their
updates alternate (which goes first alternating too), each timed from the update's start to its end
on every rank (a barrier before each), so that both see the same machine. Every rank runs one
torch thread on its core (the pool's), and W = 1, in this process, one thread too: with two, a
loaded machine's stalls made its update 70–200 ms where it takes 2 (its threads waiting on each
other). Printed per W: the mean
update of both (the recorder writes every few updates: a mean counts that writing, a median would
hide it), their difference (the recorder's fixed cost, milliseconds per update), the ratio of
the means and the median of the pairs' ratios (each timed pair's recorded ÷ plain update: what a
busy machine's stalls move least).
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

WORLD_SIZES = (1, 2, 4)
FEATURES, HIDDEN, EMBEDDING, GLOBAL_BATCH = 64, 128, 32, 64
WARM_UP = 5  # pairs before the timed ones (the first records the whole gradient and the trace)


def _job(seed: int):
    """The tiny job's model, loss and optimizer, the same weights on every rank."""
    from gatherlab.losses import NTXentLoss

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(), torch.nn.Linear(HIDDEN, EMBEDDING),
    )  # fmt: skip
    criterion = NTXentLoss(temperature=0.5, gather="fixed")
    return model, criterion, torch.optim.SGD(model.parameters(), lr=0.05)


def _times_on_rank(repeats: int, root: str) -> dict | None:
    """On every rank: the plain and the recorded copy's updates in turns; rank 0 returns the
    times (seconds)."""
    from gatherlab.recording.recorder import Recorder

    distributed = dist.is_available() and dist.is_initialized()
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    generator = torch.Generator().manual_seed(rank)
    rows = GLOBAL_BATCH // world
    views = torch.randn(2, rows, FEATURES, generator=generator)
    runs = {}
    for name in ("plain", "recorded"):
        model, criterion, optimizer = _job(0)
        wrapped = torch.nn.parallel.DistributedDataParallel(model) if distributed else model
        runs[name] = (wrapped, criterion, optimizer)
    recorder = Recorder(runs["recorded"][0], runs["recorded"][2], Path(root) / f"w{world}",
                        loss=runs["recorded"][1], seed=0)  # fmt: skip
    times: dict[str, list[float]] = {"plain": [], "recorded": []}
    gc.disable()  # no collection inside a timed update
    try:
        for pair in range(WARM_UP + repeats):
            for name in ("plain", "recorded") if pair % 2 == 0 else ("recorded", "plain"):
                model, criterion, optimizer = runs[name]
                if distributed:
                    dist.barrier()
                start = time.perf_counter()
                optimizer.zero_grad()
                criterion(model(views[0]), model(views[1])).backward()
                optimizer.step()
                if pair >= WARM_UP:
                    times[name].append(time.perf_counter() - start)
    finally:
        gc.enable()
    recorder.close()
    return times if rank == 0 else None


def median_of_pairs(times: dict[str, list[float]]) -> float:
    """The median of the pairs' ratios: each pair's recorded update ÷ its plain one."""
    return statistics.median(r / p for p, r in zip(times["plain"], times["recorded"], strict=True))


def measure(world_sizes: tuple[int, ...] = WORLD_SIZES, repeats: int = 200) -> list[dict]:
    """Each W's mean updates (ms), the recorder's fixed cost, the ratio of the means and the
    median of the pairs' ratios (`median_of_pairs`)."""
    from gatherlab.ranks import pool as pools

    rows = []
    with tempfile.TemporaryDirectory(prefix="gatherlab-bench-") as root:
        for world in world_sizes:
            if world == 1:
                threads = torch.get_num_threads()
                torch.set_num_threads(1)  # as each rank of the pool
                try:
                    times = _times_on_rank(repeats, root)
                finally:
                    torch.set_num_threads(threads)
            else:
                times = pools.pool(world).run(_times_on_rank, repeats, root)[0]
                pools.close_pools()
            plain, recorded = (1e3 * statistics.fmean(times[n]) for n in ("plain", "recorded"))
            rows.append({"world_size": world, "plain_ms": plain, "recorded_ms": recorded,
                         "fixed_ms": recorded - plain, "ratio": recorded / plain,
                         "median_ratio": median_of_pairs(times)})  # fmt: skip
    return rows


def report(world_sizes: tuple[int, ...] = WORLD_SIZES, repeats: int = 200) -> list[dict]:
    """Print `measure`'s table; return its rows."""
    rows = measure(world_sizes, repeats)
    print(f"a tiny job's update (MLP {FEATURES}→{HIDDEN}→{HIDDEN}→{EMBEDDING}, NT-Xent over the "
          f"gathered global batch of {GLOBAL_BATCH}, DDP at W > 1, SGD), plain and recorded in "
          f"turns on every rank, the mean of {repeats} pairs after {WARM_UP}; "
          "one CPU thread per rank, gloo")  # fmt: skip
    print(f"{'W':>2} {'plain [ms]':>11} {'recorded [ms]':>14} {'fixed cost [ms/update]':>23} "
          f"{'recorded/plain':>15} {'median of pairs':>16}")  # fmt: skip
    for row in rows:
        print(f"{row['world_size']:>2} {row['plain_ms']:>11.2f} {row['recorded_ms']:>14.2f} "
              f"{row['fixed_ms']:>23.3f} {row['ratio']:>15.3f} "
              f"{row['median_ratio']:>16.3f}")  # fmt: skip
    return rows
