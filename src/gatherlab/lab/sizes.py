"""``python -m gatherlab.bench size``: what checking and recording cost at real model sizes
(docs/performance.md, "Checking and recording at real sizes").

For each model of `gatherlab.lab.sizemodels` (a ResNet-like CNN, a ViT-like transformer) at each
size (about 1M, 10M, 25M, 86M parameters) and each precision (float64, float32, bf16-mixed):

- **plain**: the training as its user runs it, W = 2 ranks of a fresh pool, the model in
  torch's ``DistributedDataParallel``, SGD, ``contrastive_step`` on each rank's rows of the same
  global batches; its compute (the steps' wall time, between barriers) and each rank's peak
  resident memory;
- **check**: ``check_training(step=contrastive_step, model=build, world_sizes=(2,))`` of the same
  steps, in a process of its own whose W = 2 pool has started before the clock starts (start-up
  aside); its wall time, and the peak resident memory of the process (which trains the one-device
  references) and of each rank. In a low precision twice: as the check runs by default
  (``judge_in="auto"``: the float64 verdict below `defaults.FLOORS_ALONE_PARAMETERS` trainable
  parameters, floors alone at or above) and in the other mode (``float64`` or ``floors``), so that
  both sides of the choice are measured (docs/design.md §2, "Low precision at size");
- **record** (float32, batch 256): one update of the model plain and recorded
  (`gatherlab.record`), in turns, the median of the pairs' time ratios, and the bytes the
  recording writes per update.

Every measurement runs in a fresh interpreter (``python -m gatherlab.lab.sizes --one ...``), so a
peak is that measurement's alone. Ratios: check time ÷ plain compute, check peak ÷ plain rank's
peak, recorded ÷ plain update.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from gatherlab.check import defaults
from gatherlab.lab import sizemodels

__all__ = ["MODELS", "PRECISIONS", "SIZES", "main", "options", "redraw", "run", "summary"]

MODELS = tuple(sizemodels.SIZES)
SIZES = tuple(sizemodels.SIZES["vit"])
PRECISIONS = ("64-true", "32-true", "bf16-mixed")
DTYPES = {"64-true": torch.float64, "32-true": torch.float32, "bf16-mixed": torch.float32}
"""The parameters' dtype of each precision (bf16-mixed: float32 parameters, its forward under
``torch.autocast`` in bfloat16, as the check's runs)."""
STEPS, GLOBAL_BATCH, WORLD_SIZE = 3, 8, 2
RECORD_BATCH = 256
GOALS = {
    "check_time": 5.0, "check_memory": 4.0, "record": {"10M": 1.05, "86M": 1.02},
    "floors_alone": defaults.FLOORS_ALONE_PARAMETERS,
}  # fmt: skip
_MODULE = "gatherlab.lab.sizemodels"


def _peak_mib(pid: int | str = "self") -> float:
    """A process's peak resident memory so far (Linux: VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise OSError(f"no VmHWM in /proc/{pid}/status")


def _plain_on_rank(model: str, size: str, precision: str, steps: int, batch: int) -> dict:
    """On each rank: the plain training (DDP, SGD, the contrastive step on the rank's rows), its
    steps' wall time between barriers and this rank's peak resident memory."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from gatherlab.runs.precision import autocast

    torch.manual_seed(0)
    dtype = DTYPES[precision]
    net = DistributedDataParallel(sizemodels.build(model, size).to(dtype))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    data = sizemodels.Views(steps * batch, sizemodels.IMAGE[model])
    rank, world = dist.get_rank(), dist.get_world_size()
    local = batch // world
    dist.barrier()
    start = time.perf_counter()
    for step in range(steps):
        rows = slice(step * batch + rank * local, step * batch + (rank + 1) * local)
        views = (data.views[0][rows].to(dtype), data.views[1][rows].to(dtype))
        optimizer.zero_grad()
        with autocast(precision):
            loss = sizemodels.contrastive_step(net, views)
        loss.backward()
        optimizer.step()
    dist.barrier()
    return {"seconds": time.perf_counter() - start, "peak_mib": _peak_mib()}


def _warm_pool(world_size: int):
    from gatherlab.ranks import pool as pools

    ranks = pools.pool(world_size)
    ranks.run(os.getpid)  # started and joined before any clock starts
    return ranks


def plain(model: str, size: str, precision: str) -> dict:
    """The plain training on W = 2 fresh ranks: its compute and each rank's peak."""
    ranks = _warm_pool(WORLD_SIZE)
    results = ranks.run(_plain_on_rank, model, size, precision, STEPS, GLOBAL_BATCH)
    return {
        "plain_s": max(r["seconds"] for r in results),
        "plain_rank_mib": max(r["peak_mib"] for r in results),
    }


def check(model: str, size: str, precision: str, judge_in: str = "auto") -> dict:
    """``check_training`` of the same steps at W = 2 on a warm pool, judged as ``judge_in`` says
    (`sizing.floors_alone`): its wall time and verdict, the peak of this process (the one-device
    references) and of each rank."""
    from gatherlab.check import check_training, sizing

    ranks = _warm_pool(WORLD_SIZE)
    parameters = sizemodels.parameters(sizemodels.build(model, size))
    alone = sizing.floors_alone(precision, parameters, judge_in)
    estimated = sizing.estimate(parameters, WORLD_SIZE, precision, alone)
    start = time.perf_counter()
    table = check_training(
        step=f"{_MODULE}:contrastive_step", model=f"{_MODULE}:build",
        model_kwargs={"model": model, "size": size}, data=f"{_MODULE}:Views",
        data_kwargs={"size": STEPS * GLOBAL_BATCH, "image": sizemodels.IMAGE[model]},
        world_sizes=(WORLD_SIZE,), steps=STEPS, global_batch_size=GLOBAL_BATCH,
        precision=precision, judge_in=judge_in,
    ).table  # fmt: skip
    seconds = time.perf_counter() - start
    whole = table.iloc[0]
    return {
        "check_s": seconds,
        "judge_in": judge_in,
        "floors_alone": alone,
        "verdict": str(whole["verdict"]),
        "floors": float(whole["floors"]) if "floors" in table.columns else math.nan,
        "check_process_mib": _peak_mib(),
        "check_rank_mib": max(_peak_mib(pid) for pid in ranks.pids),
        "estimated_process_mib": estimated.command / 2**20,
        "estimated_rank_mib": estimated.rank / 2**20,
    }


def record(model: str, size: str, repeats: int) -> dict:
    """One float32 update at batch `RECORD_BATCH` (the model's embedding against fixed targets,
    mean squared error, SGD), plain and recorded in turns (`recordtime.time_record`)."""
    from gatherlab.lab import recordtime

    image = sizemodels.IMAGE[model]
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(RECORD_BATCH, 3, image, image, generator=generator)
    targets = torch.randn(RECORD_BATCH, sizemodels.EMBEDDING, generator=generator)

    def built() -> torch.nn.Module:
        torch.manual_seed(0)
        return sizemodels.build(model, size)

    with tempfile.TemporaryDirectory(prefix="gatherlab-bench-") as root:
        row = recordtime.time_record(built, inputs, targets, repeats, None, Path(root) / "out")
    return {
        "plain_update_s": row["plain_ms"] / 1e3,
        "record_ratio": row["ratio"],
        "record_kib": row["per_update"] / 1024,
    }


def _one(what: str, **options) -> dict:
    """One measurement in a fresh interpreter, its peak its own."""
    command = [sys.executable, "-m", "gatherlab.lab.sizes", "--one", what, json.dumps(options)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        tail = "\n".join(done.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"{what} {options}: exit {done.returncode}: {tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(
    models: Sequence[str] = MODELS,
    sizes: Sequence[str] = SIZES,
    precisions: Sequence[str] = PRECISIONS,
    record_repeats: int = 5,
    out: Path | None = None,
) -> list[dict]:
    """Every measurement, printed as it ends; the rows (one per model × size × precision)."""
    rows = []
    for model in models:
        for size in sizes:
            parameters = sizemodels.parameters(sizemodels.build(model, size))
            recorded = _one("record", model=model, size=size, repeats=record_repeats)
            for precision in precisions:
                plain_row = {"model": model, "size": size, "parameters": parameters,
                             "precision": precision}  # fmt: skip
                plain_row |= _one("plain", model=model, size=size, precision=precision)
                for judge_in in _modes(precision, parameters):
                    row = dict(plain_row)
                    row |= _one("check", model=model, size=size, precision=precision,
                                judge_in=judge_in)  # fmt: skip
                    row |= recorded if precision == "32-true" and judge_in == "auto" else {}
                    row["time_ratio"] = row["check_s"] / row["plain_s"]
                    peak = max(row["check_process_mib"], row["check_rank_mib"])
                    row["memory_ratio"] = peak / row["plain_rank_mib"]
                    rows.append(row)
                    _print_row(row)
    if out is not None:
        _write(rows, out)
    return rows


def _modes(precision: str, parameters: int) -> tuple[str, ...]:
    """The ``judge_in`` of each check measured: ``auto`` (the default), and in a low precision
    the other mode too (``float64`` where ``auto`` judges in floors alone, else ``floors``)."""
    from gatherlab.check import sizing

    if precision == "64-true":
        return ("auto",)
    return ("auto", "float64" if sizing.floors_alone(precision, parameters) else "floors")


def _print_row(row: dict) -> None:
    mode = "floors alone" if row["floors_alone"] else "float64 verdict"
    mode += "" if row["judge_in"] == "auto" else f", asked: {row['judge_in']}"
    line = (
        f"{row['model']:<7}{row['size']:>4} ({row['parameters'] / 1e6:6.2f}M) {row['precision']}: "
        f"plain {row['plain_s']:7.1f} s, {row['plain_rank_mib']:7.0f} MiB/rank; check [{mode}] "
        f"{row['check_s']:7.1f} s ({row['verdict']}, {row['floors']:.3g} floors), process "
        f"{row['check_process_mib']:7.0f} MiB, ranks {row['check_rank_mib']:7.0f} MiB (estimated "
        f"{row['estimated_process_mib']:.0f}, {row['estimated_rank_mib']:.0f}); check/plain time "
        f"{row['time_ratio']:.2f}, memory {row['memory_ratio']:.2f}"
    )
    if "record_ratio" in row:
        line += (f"; recorded/plain update {row['record_ratio']:.3f} (plain "
                 f"{row['plain_update_s']:.2f} s), {row['record_kib']:.1f} KiB/update")  # fmt: skip
    print(line, flush=True)


def _write(rows: list[dict], out: Path) -> None:
    import pandas as pd

    out.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(out.with_suffix(".csv"), index=False)
    redraw(out)


def redraw(out: Path) -> None:
    """The figure ``out``.png and .pdf drawn from ``out``.csv, and the README's sentence of it."""
    import pandas as pd

    from gatherlab.analysis import figures

    table = pd.read_csv(out.with_suffix(".csv"))
    figures.save(figures.size_cost_figure(table, GOALS), out)
    print(f"written: {out.with_suffix('.csv')}, {out}.png, {out}.pdf")
    print(f"the README's sentence of it:\n{summary(table)}")


def summary(table) -> str:
    """The README's sentence of a run's table at its largest size (README.md, "At real sizes";
    tests/journeys/test_docs.py holds the README to it): each precision's check time and peak
    memory over the plain training's, the range over the models, as the check runs by default
    (a low precision at size: floors alone), the float64 verdict asked for in float32, and the
    recorded update over the plain one."""
    largest = table[table["size"] == table["size"].iloc[-1]]

    def span(rows, column: str) -> str:
        low, high = rows[column].min(), rows[column].max()
        return f"{low:.1f}×" if f"{low:.1f}" == f"{high:.1f}" else f"{low:.1f}–{high:.1f}×"

    def of(precision: str, judge_in: str = "auto"):
        rows = largest[largest["precision"] == precision]
        return rows[rows["judge_in"] == judge_in] if "judge_in" in rows else rows

    f64, f32, bf16 = of("64-true"), of("32-true"), of("bf16-mixed")
    verdict64 = of("32-true", "float64")
    recorded = largest["record_ratio"].dropna()
    low, high = recorded.min(), recorded.max()
    return (
        f"A check (W = 2, 3 steps) of an {largest['size'].iloc[0]}-parameter ResNet- or ViT-like "
        f"step costs {span(f64, 'time_ratio')} the plain training's compute and "
        f"{span(f64, 'memory_ratio')} its memory in float64, {span(f32, 'time_ratio')} and "
        f"{span(f32, 'memory_ratio')} in float32, {span(bf16, 'time_ratio')} and "
        f"{span(bf16, 'memory_ratio')} in bf16, a low precision judged in floors alone at this "
        f"size ({span(verdict64, 'time_ratio')} and {span(verdict64, 'memory_ratio')} with the "
        f"float64 verdict asked for in float32); a recording {low:.2f}–{high:.2f}× an update "
        f"(five pairs)."
    )


def options(commands) -> None:
    """``python -m gatherlab.bench size``'s options."""
    parser = commands.add_parser(
        "size", help="the check's and the recorder's cost at 1M-86M parameters (ResNet, ViT)"
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=SIZES)
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    parser.add_argument(
        "--record-repeats", type=int, default=5, help="timed pairs of updates (default 5)"
    )
    parser.add_argument(
        "--out", type=Path, default=None,
        help="write OUT.csv and the figure OUT.png, OUT.pdf (e.g. figures/size_cost)",
    )  # fmt: skip
    parser.add_argument(
        "--redraw", action="store_true", help="only draw the figure again from OUT.csv"
    )


def main(argv: list[str] | None = None) -> None:
    """``--one WHAT OPTIONS``: one measurement in this interpreter, its result a JSON line."""
    parser = argparse.ArgumentParser(prog="python -m gatherlab.lab.sizes")
    parser.add_argument("--one", nargs=2, metavar=("WHAT", "OPTIONS"), required=True)
    args = parser.parse_args(argv)
    what, options = args.one[0], json.loads(args.one[1])
    measure = {"plain": plain, "check": check, "record": record}[what]
    print(json.dumps(measure(**options)), flush=True)


if __name__ == "__main__":
    main()
