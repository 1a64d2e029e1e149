"""Figure (README, docs/results.md): the gradient error of the inexact gathers as W grows to 1024.

Runs ``python -m gatherlab.scaling`` (``experiment=gather_scaling``: one global batch of 1024,
float64; real gloo ranks at W = 2, 4, 8, the simulated world at W = 2 … 1024) three times:

1. the local and mixed losses (NT-Xent, VICReg), simulated up to W = 1024;
2. the global loss (NT-Xent computed whole on every rank), simulated up to W = 128: each of its
   simulated ranks computes the whole 2N × 2N loss, so a cell costs W times one loss;
3. the cost of one audit cell at W = 1024: the global loss with ``old``, the most expensive cell,
   in a process of its own, against the same process with the cell at W = 2 (wall time and peak
   memory above that baseline).

Writes ``figures/gather_scaling.{png,pdf,md,csv}`` (the tables joined, the cost in the .md).
Usage: ``python experiments/gather_scaling.py [--redraw]`` (``--redraw``: the figure again from
``figures/gather_scaling.csv``, nothing run).
"""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from datetime import datetime

import pandas as pd
from _sweep import FIGURES, REPO

from gatherlab import report
from gatherlab.analysis import figures
from gatherlab.core import runfiles

LOCAL_AND_MIXED = ["~audit.losses.ntxent_global"]
GLOBAL = ["~audit.losses.ntxent", "~audit.losses.vicreg"]
GLOBAL_SIZES = "audit.simulated_world_sizes=[2,4,8,16,32,64,128]"
COST_CELL = [*GLOBAL, "audit.world_sizes=[]", "audit.gathers=[old]"]


def scaling(name: str, *overrides: str) -> tuple[pd.DataFrame, float, float]:
    """``python -m gatherlab.scaling`` in a process of its own: its table, wall time (s) and peak
    resident memory (MB)."""
    out = REPO / "outputs" / f"gather_scaling-{name}-{datetime.now():%Y-%m-%d_%H-%M-%S-%f}"
    command = [sys.executable, "-m", "gatherlab.scaling", "--out", str(out), *overrides]
    start = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if peak <= before:  # an earlier child used more: this one's peak is not known
        peak = float("nan")
    print(f"{name}: {seconds:.0f} s, peak {peak / 1024:.0f} MB (written: {out})")
    return pd.read_csv(out / runfiles.SCALING), seconds, peak / 1024


def main() -> None:
    if "--redraw" in sys.argv[1:]:
        table = pd.read_csv(FIGURES / "gather_scaling.csv")
        figures.save(figures.scaling_figure(table), FIGURES / "gather_scaling")
        return
    start = time.perf_counter()
    # the cost cell first: the peak memory of children is a maximum, read while it grows
    _, baseline_s, baseline_mb = scaling(
        "cost-baseline", *COST_CELL, "audit.simulated_world_sizes=[2]"
    )
    cell, cell_s, cell_mb = scaling("cost-1024", *COST_CELL, "audit.simulated_world_sizes=[1024]")
    local_and_mixed, _, _ = scaling("local-and-mixed", *LOCAL_AND_MIXED)
    global_loss, _, _ = scaling("global", *GLOBAL, GLOBAL_SIZES)
    by_loss = dict(tuple(local_and_mixed.groupby("loss")))
    table = pd.concat(  # local, global, mixed
        [by_loss["ntxent"], global_loss, cell, by_loss["vicreg"]], ignore_index=True
    )
    FIGURES.mkdir(exist_ok=True)
    runfiles.write_table(table, FIGURES / "gather_scaling.csv")
    figures.save(figures.scaling_figure(table), FIGURES / "gather_scaling")
    cost = (
        f"\nCost of one audit cell at W = 1024 (`ntxent_global` × `old`, each of the 1024 "
        f"simulated ranks computing the whole 2048 × 2048 loss): {cell_s - baseline_s:.0f} s and "
        f"{cell_mb - baseline_mb:.0f} MB of peak memory above the same process with the cell at "
        f"W = 2 ({baseline_s:.0f} s, {baseline_mb:.0f} MB).\n"
    )
    (FIGURES / "gather_scaling.md").write_text(report.scaling_markdown(table) + cost)
    print(cost)
    print(f"figures/gather_scaling.{{png,pdf,md,csv}} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
