"""Benchmarks, apart from the tests: ``python -m gatherlab.bench
{launcher,gather,sweep,check,record,record-fixed,size,compare} [options]``.

Each benchmark measures everything it compares in one invocation and prints ratios; nothing here
asserts a time. docs/performance.md gives each one's method and results.

- ``launcher``: N training jobs (``experiment=bug_demo``, cpu2) through ``gatherlab.lab.jobs.run``
  with ``launcher=spawn`` and with ``launcher=pool``; the marginal cost is the mean of jobs 2..N.
- ``gather``: forward + backward of every gather that is exact in every loss style on W real
  ranks, 256×128 to 4096×512 float32, in rounds whose orders are `balanced_orders`; each gather's
  median time and median ratio to ``fixed`` in the same round, the last line the smallest ratio
  (fastest / fixed). Bytes per rank are the ring algorithms', computed, not measured.
- ``sweep``: a sweep as a user runs it (``python -m gatherlab.train -m``, a fresh interpreter):
  its wall time against its jobs' training time, split into start-up, per-job overhead and the
  report.
- ``check``: ``python -m gatherlab.check`` from a fresh shell against the floor of
  ``python -c "import torch, torch.distributed"``; the ratio of their medians.
- ``record``: one optimizer update of a ~10M-parameter MLP on this CPU, float32 and float64, with
  and without `gatherlab.record.Recorder`, interleaved (the two in turns, which goes first
  alternating), each pair's time ratio and its median; the recorder's resident memory beyond the
  plain loop's, the bytes it writes per update and per 1,000 updates, and the same bytes of a real
  recording of a ~100M-parameter model with as many parts.
- ``record-fixed``: the recorder's fixed cost per update, on a tiny job at W = 1, 2, 4
  (`gatherlab.lab.recorder_cost`).
- ``size``: the check of a plain step and the recorder on a ResNet-like and a ViT-like model of
  1M to 86M parameters, against the plain training's compute and memory (`gatherlab.lab.sizes`).
- ``compare``: ``python -m gatherlab.compare A B`` from a fresh shell on the bundled DDP job's
  recordings (5 and 100 updates) and on a bf16 pair with its floor, in turns with ``import torch``
  and ``--no-figure`` (and ``--baseline SRC``'s command), and the command's phases
  (`gatherlab.lab.comparetime`).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from gatherlab.components import config
from gatherlab.core import terms
from gatherlab.gather import (
    NAMES,
    REDUCE_SCATTER_BACKENDS,
    STYLES,
    Fixed,
    Functional,
    Lightning,
    TorchNN,
    backward_collective,
    get,
)
from gatherlab.lab import recordtime, sizes
from gatherlab.lab.recordtime import RECORD_WARM_UP
from gatherlab.ranks import pool as pools


def _job_times(launcher: str, jobs: int, steps: int, root: Path) -> list[float]:
    # Imported here: only this benchmark trains (Lightning), the others need none of it.
    from gatherlab.lab import validation
    from gatherlab.lab.jobs import run as run_job

    overrides = ["experiment=bug_demo", "layout=cpu2", f"steps={steps}", f"launcher={launcher}"]
    with config.composed():
        cfg, choices = config.compose(overrides)
    validation.validate(cfg)
    times = []
    for job in range(jobs):
        start = time.perf_counter()
        run_job(cfg, root / f"{launcher}-{job}", choices, overrides)
        times.append(time.perf_counter() - start)
    return times


def launcher(jobs: int, steps: int) -> float:
    """Print the per-job cost of ``spawn`` and ``pool``; return their ratio."""
    if jobs < 2:
        raise SystemExit("gatherlab.bench: error: --jobs must be at least 2 (job 1 is start-up)")
    pools.close_pools()
    marginal = {}
    with tempfile.TemporaryDirectory(prefix="gatherlab-bench-") as root:
        print(f"{jobs} jobs of {steps} steps each, 2 CPU ranks (experiment=bug_demo layout=cpu2)")
        print(f"{'launcher':<8} {'first job [s]':>14} {'per job, jobs 2..N [s]':>23}")
        for name in (terms.Launcher.SPAWN, terms.Launcher.POOL):
            times = _job_times(name, jobs, steps, Path(root))
            marginal[name] = statistics.mean(times[1:])
            print(f"{name:<8} {times[0]:>14.3f} {marginal[name]:>23.3f}")
    pools.close_pools()
    ratio = marginal[terms.Launcher.POOL] / marginal[terms.Launcher.SPAWN]
    print(f"pool/spawn per-job cost ratio: {ratio:.4f}")
    return ratio


GATHER_SIZES = ((256, 128), (1024, 256), (4096, 512))
SHOWN_BACKENDS = tuple(terms.Backend)


def _exact_gathers() -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Every option of the ``gather`` group (``gatherlab.gather.NAMES``, in its order) whose gather
    declares ``exact`` for every loss style: ``fixed``, ``fixed`` forced to each backward
    collective, and the other exact gathers."""
    gathers = {name: get(name) for name in NAMES}
    return {
        name: gather
        for name, gather in gathers.items()
        if all(
            getattr(gather, "predicted", {}).get(style) == terms.GradientClass.EXACT
            for style in STYLES
        )
    }


def _backward_collective(gather: Callable[[torch.Tensor], torch.Tensor]) -> str:
    """The collective of ``gather``'s backward on the running backend."""
    if isinstance(gather, Fixed):
        return gather.collective or backward_collective()
    if isinstance(gather, Functional):
        return "reduce_scatter"
    if isinstance(gather, TorchNN | Lightning):  # torch's all_gather
        reduce_scatter = str(dist.get_backend()) in REDUCE_SCATTER_BACKENDS
        return "reduce_scatter" if reduce_scatter else "all_to_all"
    return "unknown"


def _backward_bytes(collective: str, world_size: int, local_bytes: int) -> float:
    """The bytes a rank sends in the backward's collective (ring algorithms)."""
    if collective == "unknown":
        return float("nan")
    total = world_size * local_bytes  # every collective here moves the W slice gradients
    factor = 2 if collective == "all_reduce" else 1
    return factor * (world_size - 1) * total / world_size


def balanced_orders(count: int) -> list[list[int]]:
    """The orders in which ``count`` gathers run, one per round, in a cycle of rounds: a Williams
    design (a Latin square whose rows are ``(base + i) mod count``, ``base`` = 0, 1, count−1, 2,
    count−2, …; for an odd ``count`` also each row reversed). Over one cycle every gather runs at
    every position of a round equally often, and follows every other gather equally often, so
    neither being first (after the previous round) nor what ran just before is any one gather's.

    Example:
        >>> balanced_orders(4)
        [[0, 1, 3, 2], [1, 2, 0, 3], [2, 3, 1, 0], [3, 0, 2, 1]]
    """
    base = [0]
    for step in range(1, count):
        base.append((step + 1) // 2 if step % 2 else count - step // 2)
    rows = [[(item + shift) % count for item in base] for shift in range(count)]
    return rows if count % 2 == 0 or count == 1 else rows + [row[::-1] for row in rows]


WARM_UP_ROUNDS = 2


def _time_gathers(
    sizes: tuple[tuple[int, int], ...], repeats: int, default: str
) -> list[dict] | None:
    """On every rank: forward + backward of each exact gather per size, in rounds (every gather
    once per round, in `balanced_orders`, the same on every rank); rank 0 returns the rows, each
    with the median time and the median over rounds of its time ÷ ``default``'s in the same round
    (``default``: the name of the default gather, marked)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    variants = _exact_gathers()
    names = list(variants)
    orders = balanced_orders(len(names))
    rounds = -(-repeats // len(orders)) * len(orders)  # whole cycles of the design
    rows = []
    for batch, dim in sizes:
        generator = torch.Generator().manual_seed(rank)
        local = torch.randn(batch, dim, generator=generator)
        weight = torch.randn(world_size * batch, dim, generator=generator)
        times: dict[str, list[float]] = {name: [] for name in names}
        for round_number in range(WARM_UP_ROUNDS + rounds):
            order = orders[(round_number - WARM_UP_ROUNDS) % len(orders)]
            gc.collect()  # between rounds, never inside a timed call
            gc.disable()
            try:
                for index in order:
                    function = variants[names[index]]
                    x = local.clone().requires_grad_()
                    dist.barrier()
                    start = time.perf_counter()
                    (function(x) * weight).sum().backward()
                    dist.barrier()
                    if round_number >= WARM_UP_ROUNDS:
                        times[names[index]].append(time.perf_counter() - start)
            finally:
                gc.enable()
        for name, function in variants.items():
            collective = _backward_collective(function)
            sent = _backward_bytes(collective, world_size, local.numel() * 4)
            ratios = [t / d for t, d in zip(times[name], times[default], strict=True)]
            rows.append(
                {
                    "world_size": world_size,
                    "size": f"{batch}×{dim}",
                    "gather": name,
                    "default": name == default,
                    "rounds": rounds,
                    "ms": 1e3 * statistics.median(times[name]),
                    "ratio": statistics.median(ratios),
                    "collective": collective,
                    "sent_MB": sent / 2**20,
                }
            )
    return rows if rank == 0 else None


def median_interval(values: list[float], z: float = 1.96) -> tuple[float, float]:
    """A distribution-free ~95 % interval for the median of ``values``: the order statistics
    whose ranks are n/2 ∓ z·√n/2 (the binomial's normal approximation; the extremes for small
    n)."""
    ordered, n = sorted(values), len(values)
    half = z * math.sqrt(n) / 2
    low, high = max(0, math.floor(n / 2 - half)), min(n - 1, math.ceil(n / 2 + half) - 1)
    return ordered[low], ordered[high]


def _duel(batch: int, dim: int, names: tuple[str, str], pairs: int) -> list[float] | None:
    """On every rank: the two gathers ``names`` (the default, its closest rival) timed in ``pairs``
    interleaved pairs, ABBA (which runs first alternating, so a drift of the machine's load
    within a pair weighs on both alike); rank 0 returns each pair's time of the rival ÷ the
    default's."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    variants = _exact_gathers()
    generator = torch.Generator().manual_seed(rank)
    local = torch.randn(batch, dim, generator=generator)
    weight = torch.randn(world_size * batch, dim, generator=generator)
    ratios = []
    for pair in range(WARM_UP_ROUNDS + pairs):
        order = names if pair % 2 == 0 else names[::-1]
        took = {}
        gc.collect()
        gc.disable()
        try:
            for name in order:
                x = local.clone().requires_grad_()
                dist.barrier()
                start = time.perf_counter()
                (variants[name](x) * weight).sum().backward()
                dist.barrier()
                took[name] = time.perf_counter() - start
        finally:
            gc.enable()
        if pair >= WARM_UP_ROUNDS:
            ratios.append(took[names[1]] / took[names[0]])
    return ratios if rank == 0 else None


def gather(world_sizes: tuple[int, ...], repeats: int, pairs: int = 40) -> float:
    """Print forward + backward times of the exact gathers and each one's time ÷ the default
    gather's (``fixed``); return the smallest of those ratios at the largest size and world
    size (fastest / fixed)."""
    with config.composed():
        default = config.compose([])[1]["gather"]  # the gather a run gets unless it names one
    rows = []
    for world_size in world_sizes:
        rows += pools.pool(world_size).run(_time_gathers, GATHER_SIZES, repeats, default)[0]
        pools.close_pools()
    rounds = rows[0]["rounds"]
    print(
        f"forward + backward, float32, median of {rounds} rounds (each gather once per round, "
        "in balanced orders); backend gloo on CPU"
    )
    choices = ", ".join(f"{b}: {backward_collective(b)}" for b in SHOWN_BACKENDS)
    print(f"fixed's backward collective by backend: {choices}; * marks the default gather")
    print(f"÷ {default}: the median over rounds of the gather's time ÷ {default}'s in that round")
    print(
        f"{'W':>2} {'local size':>10} {'gather':<24} {'ms':>9} {'÷ ' + default:>8}  "
        "backward collective, sent/rank"
    )
    for row in rows:
        name = f"{row['gather']}{' *' if row['default'] else ''}"
        print(
            f"{row['world_size']:>2} {row['size']:>10} {name:<24} {row['ms']:>9.2f} "
            f"{row['ratio']:>8.3f}  {row['collective']}, {row['sent_MB']:.2f} MB"
        )
    world_size, (batch, dim) = max(world_sizes), GATHER_SIZES[-1]
    last = [r for r in rows if r["world_size"] == world_size and r["size"] == f"{batch}×{dim}"]
    ratios = {row["gather"]: row["ratio"] for row in last if row["gather"] != default}
    rival = min(ratios, key=ratios.get)  # picked by the rounds: its ratio there is biased low
    where = f"W={world_size}, {batch}×{dim}"
    print(f"closest rival in the rounds at {where}: {rival} ({ratios[rival]:.3f})")
    duel = pools.pool(world_size).run(_duel, batch, dim, (default, rival), pairs)[0]
    pools.close_pools()
    ratio = statistics.median(duel)
    low, high = median_interval(duel)
    print(f"{rival} / {default} in {pairs} fresh interleaved pairs (ABBA) at {where}: median "
          f"{ratio:.3f} (95 % interval {low:.3f}–{high:.3f})")  # fmt: skip
    fastest = min(1.0, ratio)
    print(f"fastest exact gather ({default if ratio >= 1 else rival}) / {default} at {where}: "
          f"{fastest:.3f}")  # fmt: skip
    return fastest


# The timestamp of a log line of python -m gatherlab.train (Hydra's job logging format).
_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")


def _stamp(line: str) -> float | None:
    found = _STAMP.match(line)
    if found is None:
        return None
    return datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _sweep_times(experiment: str, overrides: list[str], root: Path) -> dict[str, float]:
    """Run one sweep in a fresh interpreter; its wall time and where it went."""
    sweep_dir = root / experiment
    command = [sys.executable, "-m", "gatherlab.train", "-m", f"experiment={experiment}",
               *overrides, f"hydra.sweep.dir={sweep_dir}"]  # fmt: skip
    started = time.time()
    finished = subprocess.run(command, capture_output=True, text=True)
    ended = time.time()
    if finished.returncode != 0:
        raise SystemExit(f"gatherlab.bench: error: the sweep failed: {finished.stderr[-2000:]}")
    lines = (finished.stdout + finished.stderr).splitlines()
    job_starts = [_stamp(line) for line in lines if re.search(r"\bjob 1/\d+:", line)]
    summaries = sorted(sweep_dir.glob("*/summary.json"))
    training = sum(json.loads(path.read_text())["wall_s"] for path in summaries)
    last_end = max(path.stat().st_mtime for path in summaries)
    first = job_starts[0] if job_starts and job_starts[0] is not None else started
    return {
        "jobs": len(summaries),
        "wall": ended - started,
        "training": training,
        "startup": first - started,
        "overhead": (last_end - first) - training,
        "report": ended - last_end,
    }


def sweep(experiments: list[str], overrides: list[str]) -> float:
    """Print each sweep's wall time, its training time and their ratio, broken down; return the
    first sweep's wall ÷ training."""
    measured = {}
    with tempfile.TemporaryDirectory(prefix="gatherlab-bench-") as root:
        for experiment in experiments:
            measured[experiment] = _sweep_times(experiment, overrides, Path(root))
    print(f"{'sweep':<14} {'jobs':>5} {'wall [s]':>9} {'training':>9} {'wall/train':>11} "
          f"{'start-up':>9} {'per job':>8} {'report':>7}")  # fmt: skip
    for experiment, t in measured.items():
        print(f"{experiment:<14} {t['jobs']:>5} {t['wall']:>9.1f} {t['training']:>9.1f} "
              f"{t['wall'] / t['training']:>11.2f} {t['startup']:>9.1f} "
              f"{t['overhead'] / t['jobs']:>8.2f} {t['report']:>7.1f}")  # fmt: skip
    first, *rest = experiments
    for other in rest:
        ratio = measured[first]["startup"] / measured[other]["startup"]
        print(f"start-up of {first} / start-up of {other}: {ratio:.2f}")
    return measured[first]["wall"] / measured[first]["training"]


def _seconds(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    return time.perf_counter() - start


def check(repeats: int) -> float:
    """Print the check command's time against one interpreter's start-up; return their ratio."""
    floor_command = [sys.executable, "-c", "import torch, torch.distributed"]
    floors, checks = [], []
    with tempfile.TemporaryDirectory(prefix="gatherlab-bench-") as root:
        for repeat in range(repeats):
            validate_command = [
                sys.executable, "-m", "gatherlab.check", "gatherlab.losses:NTXentLoss",
                "--gather", "fixed", "--world-sizes", "2,4", "--out", f"{root}/{repeat}",
            ]  # fmt: skip
            floors.append(_seconds(floor_command))
            checks.append(_seconds(validate_command))
    floor, checked = statistics.median(floors), statistics.median(checks)
    print(f"python -c 'import torch, torch.distributed': {floor:.2f} s (median of {repeats})")
    print(f"python -m gatherlab.check NTXentLoss --gather fixed, W = 2, 4: {checked:.2f} s")
    print(f"check / one interpreter: {checked / floor:.2f}")
    return checked / floor


# --- record: the recorder's cost against a plain update ---------------------------------------

RECORD_WIDTH, RECORD_DEPTH, RECORD_BATCH = 1600, 4, 256  # 4 × (1600² + 1600) = 10.25M parameters
LARGE_WIDTH = 5000  # 4 × (5000² + 5000) = 100.02M parameters, as many parts


def _mlp(width: int, depth: int, dtype: torch.dtype) -> torch.nn.Sequential:
    """``depth`` linear layers of ``width`` (ReLU between): ``depth`` parts, the same weights each
    time (seed 0)."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for layer in range(depth):
        layers += [torch.nn.Linear(width, width)] + ([torch.nn.ReLU()] if layer < depth - 1 else [])
    return torch.nn.Sequential(*layers).to(dtype)


def _time_mlp(
    dtype: torch.dtype, width: int, depth: int, batch: int, repeats: int, k: int, out: Path
) -> dict:
    """`time_record` of the MLP ``depth`` × ``width`` on random rows and targets."""
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(batch, width, generator=generator, dtype=dtype)
    targets = torch.randn(batch, width, generator=generator, dtype=dtype)
    return recordtime.time_record(
        lambda: _mlp(width, depth, dtype), inputs, targets, repeats, k, out
    )


def _per_thousand(row: dict) -> str:
    thousand = 1000 * row["per_update"] + row["once"]
    return (f"{row['per_update'] / 1024:.2f} KiB per update (its line {row['line'] / 1024:.2f}, "
            f"its sketches {row['sketch'] / 1024:.2f}), {thousand / 2**20:.2f} MiB per 1,000 "
            f"updates + {row['full'] / 2**20:.1f} MiB of whole gradients (full_updates' default "
            f"keeps the first update's up to 2^20 parameters)")  # fmt: skip


def record(
    width: int = RECORD_WIDTH,
    depth: int = RECORD_DEPTH,
    batch: int = RECORD_BATCH,
    repeats: int = 20,
    k: int | None = None,
    large_width: int | None = LARGE_WIDTH,
) -> dict[str, float]:
    """Print a plain update's time against a recorded one's (float32 and float64), the recorder's
    memory and the bytes it writes; with ``large_width``, the bytes of a real recording of a model
    with as many parts of that width (float32, a few updates). Returns each dtype's ratio."""
    from gatherlab.recording.sketch import DEFAULT_K

    k = DEFAULT_K if k is None else k
    rows = []
    with tempfile.TemporaryDirectory(prefix="gatherlab-bench-") as root:
        for dtype in (torch.float32, torch.float64):
            out = Path(root) / str(dtype).removeprefix("torch.")
            rows.append(_time_mlp(dtype, width, depth, batch, repeats, k, out))
        large = None
        if large_width:
            large = _time_mlp(torch.float32, large_width, depth, batch, 1, k, Path(root) / "large")
    parameters = rows[0]["parameters"]
    print(
        f"one update (forward, mean squared error, backward, SGD step) of an MLP {depth} × {width} "
        f"({parameters / 1e6:.2f}M parameters, {depth} parts), batch {batch}, "
        f"{torch.get_num_threads()} CPU threads; k = {k}"
    )
    print(f"plain and recorded in turns, median of {repeats} pairs after {RECORD_WARM_UP} "
          f"(wall-clock; and this process's CPU time, which others' load moves less)")  # fmt: skip
    print(f"{'dtype':<8} {'plain [ms]':>11} {'recorded [ms]':>14} {'recorded/plain':>15} "
          f"{'CPU time ratio':>15}   resident memory added: first {RECORD_WARM_UP} updates, "
          f"next {repeats}")  # fmt: skip
    for row in rows:
        first, later = row["first_resident"] / 2**20, row["later_resident"] / 2**20
        print(f"{row['dtype']:<8} {row['plain_ms']:>11.1f} {row['recorded_ms']:>14.1f} "
              f"{row['ratio']:>15.3f} {row['cpu_ratio']:>15.3f}   {first:+.1f} MiB, "
              f"{later:+.1f} MiB")  # fmt: skip
    sketches = depth * k * 8
    print(f"the recorder holds: each parameter's block signs, ceil(n / k) × 8 bytes = "
          f"{rows[0]['signs'] / 1024:.0f} KiB, and an update's sketches, parts × k × 8 bytes = "
          f"{sketches / 1024:.1f} KiB (the first update's full gradient, n × 8 bytes, only "
          f"while it is written)")  # fmt: skip
    for row in rows:
        print(f"written, {row['dtype']}: {_per_thousand(row)}")
    if large is not None:
        print(f"written, {large['parameters'] / 1e6:.2f}M parameters ({depth} × {large_width}, "
              f"float32, {RECORD_WARM_UP + 1} updates): {_per_thousand(large)}")  # fmt: skip
    ratios = {row["dtype"]: row["ratio"] for row in rows}
    print("fastest recorded/fastest plain update (the least disturbed of each): "
          + ", ".join(f"{row['dtype']} {row['fastest_ratio']:.3f}" for row in rows))  # fmt: skip
    print("recorded/plain CPU time: "
          + ", ".join(f"{row['dtype']} {row['cpu_ratio']:.3f}" for row in rows))  # fmt: skip
    print("recorded/plain update time: "
          + ", ".join(f"{dtype} {ratio:.3f}" for dtype, ratio in ratios.items()))  # fmt: skip
    return ratios


def _record_options(commands) -> None:
    """``python -m gatherlab.bench record``'s and ``record-fixed``'s options."""
    record_parser = commands.add_parser(
        "record", help="an update's time with gatherlab.record against without, its bytes"
    )
    record_parser.add_argument(
        "--width", type=int, default=RECORD_WIDTH, help=f"(default {RECORD_WIDTH})"
    )
    record_parser.add_argument(
        "--depth", type=int, default=RECORD_DEPTH, help=f"layers = parts (default {RECORD_DEPTH})"
    )
    record_parser.add_argument(
        "--batch", type=int, default=RECORD_BATCH, help=f"rows (default {RECORD_BATCH})"
    )
    record_parser.add_argument(
        "--repeats", type=int, default=20, help="timed pairs per dtype (default 20)"
    )
    record_parser.add_argument("--k", type=int, default=None, help="the sketch's size per part")
    record_parser.add_argument(
        "--large-width", type=int, default=LARGE_WIDTH,
        help=f"the width of the large model recorded for its bytes, 0 for none "
             f"(default {LARGE_WIDTH}: ~100M parameters)",
    )  # fmt: skip
    fixed_parser = commands.add_parser(
        "record-fixed", help="the recorder's fixed cost per update of a tiny job, W = 1, 2, 4"
    )
    fixed_parser.add_argument(
        "--world-sizes", type=int, nargs="+", default=[1, 2, 4], help="(default 1 2 4)"
    )
    fixed_parser.add_argument(
        "--repeats", type=int, default=200, help="timed pairs per W (default 200)"
    )


def _parser() -> argparse.ArgumentParser:
    """The command line of every benchmark."""
    parser = argparse.ArgumentParser(
        prog="python -m gatherlab.bench", description=__doc__.splitlines()[0]
    )
    commands = parser.add_subparsers(dest="benchmark", required=True)
    launcher_parser = commands.add_parser(
        "launcher", help="per-job cost of the pool against ddp_spawn"
    )
    launcher_parser.add_argument(
        "--jobs", type=int, default=6, help="jobs per launcher (default 6)"
    )
    launcher_parser.add_argument(
        "--steps", type=int, default=50, help="optimizer steps per job (default 50)"
    )
    gather_parser = commands.add_parser(
        "gather", help="forward + backward time of the exact gathers"
    )
    gather_parser.add_argument(
        "--world-sizes", type=int, nargs="+", default=[2, 4], help="(default 2 4)"
    )
    gather_parser.add_argument(
        "--repeats", type=int, default=18,
        help="timed rounds, rounded up to whole cycles of the orders (default 18)",
    )  # fmt: skip
    gather_parser.add_argument(
        "--pairs", type=int, default=40,
        help="interleaved pairs of fixed and its closest rival at the largest W and size, after "
             "the rounds (default 40)",
    )  # fmt: skip
    sweep_parser = commands.add_parser(
        "sweep", help="a sweep's wall time against its jobs' training time, broken down"
    )
    sweep_parser.add_argument(
        "--experiments", nargs="+", default=["loss_matrix", "bug_demo"],
        help="the sweeps to run, each experiment=<name> (default loss_matrix bug_demo)",
    )  # fmt: skip
    sweep_parser.add_argument("overrides", nargs="*", help="Hydra overrides for every sweep")
    check_parser = commands.add_parser(
        "check", help="python -m gatherlab.check against one interpreter's start-up"
    )
    check_parser.add_argument("--repeats", type=int, default=5, help="runs of each (default 5)")
    _record_options(commands)
    sizes.options(commands)
    compare_parser = commands.add_parser(
        "compare", help="python -m gatherlab.compare A B from a fresh shell, and its phases"
    )
    compare_parser.add_argument(
        "--repeats", type=int, default=5, help="rounds of every variant, per case (default 5)"
    )
    compare_parser.add_argument(
        "--baseline", type=Path, default=None, metavar="SRC",
        help="another tree's src (e.g. main's), whose command is timed in turns with this one's "
             "on this tree's recordings (so one that reads their format: 2 since issue 71)",
    )  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.benchmark == "sweep":
        sweep(args.experiments, args.overrides)
    elif args.benchmark == "check":
        check(args.repeats)
    elif args.benchmark == "launcher":
        launcher(args.jobs, args.steps)
    elif args.benchmark == "gather":
        gather(tuple(args.world_sizes), args.repeats, args.pairs)
    elif args.benchmark == "record":
        record(args.width, args.depth, args.batch, args.repeats, args.k, args.large_width)
    elif args.benchmark == "record-fixed":
        from gatherlab.lab import recorder_cost

        recorder_cost.report(tuple(args.world_sizes), args.repeats)
    elif args.benchmark == "size" and args.redraw:
        if args.out is None:
            parser.error("size --redraw needs --out OUT (the OUT.csv to draw)")
        sizes.redraw(args.out)
    elif args.benchmark == "compare":
        from gatherlab.lab import comparetime

        comparetime.run(args.repeats, args.baseline)
    elif args.benchmark == "size":
        sizes.run(args.models, args.sizes, args.precisions, args.record_repeats, args.out)


if __name__ == "__main__":
    main()
