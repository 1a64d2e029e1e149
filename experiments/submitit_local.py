"""A sweep through Hydra's submitit launcher in its local mode writes the same run files and report
as the basic launcher: ``hydra/launcher=submitit_local`` runs each job as a submitit job (a pickled
call in a new process), the same code path as ``submitit_slurm`` without the cluster.

Runs the PR #1531 sweep (``experiment=lightly_pr1531 gather=old,fixed layout=cpu1,cpu2``, float64)
once with each launcher and compares, job by job: ``curves.csv`` byte for byte, the final weights
exactly, the summaries (all but wall time), and ``comparison.csv`` (all but wall time). Prints
what differs and exits 1 if anything does.

Usage: ``python experiments/submitit_local.py`` (about 1.5 minutes here).
"""

from __future__ import annotations

import sys

import pandas as pd
import torch
from _sweep import run_sweep

from gatherlab.core import runfiles

SWEEP = ("gather=old,fixed", "layout=cpu1,cpu2", "precision=64-true")
VARIABLE = {"wall_s"}  # the only field allowed to differ


def main() -> None:
    basic = run_sweep("lightly_pr1531", *SWEEP)
    submitit = run_sweep("lightly_pr1531", *SWEEP, "hydra/launcher=submitit_local")
    differences = []
    for job in range(4):
        a, b = basic / str(job), submitit / str(job)
        if (a / runfiles.CURVES).read_bytes() != (b / runfiles.CURVES).read_bytes():
            differences.append(f"job {job}: curves.csv")
        state_a, state_b = runfiles.read_final_state(a), runfiles.read_final_state(b)
        if any(not torch.equal(state_a[k], state_b[k]) for k in state_a):
            differences.append(f"job {job}: final_state.pt")
        summary_a, summary_b = runfiles.read_summary(a), runfiles.read_summary(b)
        for key in sorted((set(summary_a) | set(summary_b)) - VARIABLE):
            if summary_a.get(key) != summary_b.get(key):
                differences.append(f"job {job}: summary {key}")
    table_a = pd.read_csv(basic / runfiles.COMPARISON).drop(columns=list(VARIABLE))
    table_b = pd.read_csv(submitit / runfiles.COMPARISON).drop(columns=list(VARIABLE))
    if not table_a.equals(table_b):
        differences.append("comparison.csv")
    print(table_b[["gather", "layout", "verdict", "max_abs_loss_diff"]].to_string(index=False))
    print(f"basic launcher: {basic}\nsubmitit_local: {submitit}")
    print("differences:", ", ".join(differences) if differences else "none")
    sys.exit(1 if differences else 0)


if __name__ == "__main__":
    main()
