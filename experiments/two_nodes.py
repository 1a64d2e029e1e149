"""Two torchrun "nodes" on this machine reproduce the cpu4 run: the multi-node path
(``launcher=external``, ``layout.nodes=2``, c10d rendezvous) run for real, on gloo.

Runs ``experiment=bug_demo gather=fixed`` for 30 steps three ways: on one device (the reference)
and on 4 ranks from the warm pool (``layout=cpu4``), as one sweep; then as 2 nodes × 2 ranks,
each node a separate ``torchrun`` on localhost, both meeting at one c10d rendezvous, every rank a
fresh ``python -m gatherlab.train`` that Lightning's DDP strategy finds through torchrun's
environment. The torchrun run joins the sweep's directory and the report compares all three; the
script prints the report and the largest differences between the torchrun and the cpu4 run, and
exits 1 unless the two agree to the float64 bound with the same verdict.

Usage: ``python experiments/two_nodes.py`` (about a minute here; not a test: four fresh ranks cost
more than the suite's budget allows).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
from _sweep import REPO, run_sweep

from gatherlab import report
from gatherlab.core import gradients, runfiles, terms
from gatherlab.ranks.ports import unclaimed_port

STEPS = 30


def two_torchrun_nodes(run_dir: Path) -> None:
    """Node 0 and node 1 started side by side, as on two machines."""
    torchrun = Path(sys.executable).with_name("torchrun")
    endpoint = f"127.0.0.1:{unclaimed_port()}"
    command = [
        str(torchrun), "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}", "--rdzv-id=gatherlab-two-nodes",
        "-m", "gatherlab.train", "experiment=bug_demo", "gather=fixed", "layout=cpu2",
        "layout.nodes=2", "launcher=external", f"steps={STEPS}", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    nodes = [subprocess.Popen(command, cwd=REPO) for _ in range(2)]
    codes = [node.wait(timeout=600) for node in nodes]
    if any(codes):
        sys.exit(f"torchrun nodes exited with {codes}")


def main() -> None:
    sweep = run_sweep("bug_demo", "gather=fixed", "layout=cpu1,cpu4", f"steps={STEPS}")
    two_torchrun_nodes(sweep / "two_nodes")
    for name in (runfiles.COMPARISON, "comparison.png", "comparison.pdf"):
        (sweep / name).unlink(missing_ok=True)  # the sweep's own report, before the third run
    compared = report.write_report(sweep)
    print(report.comparison_text(compared))
    table = compared.table

    cpu4, nodes = sweep / "1", sweep / "two_nodes"
    summary = runfiles.read_summary(nodes)
    curves4 = pd.DataFrame(runfiles.read_curves(cpu4))
    curves2x2 = pd.DataFrame(runfiles.read_curves(nodes))
    loss_diff = float((curves4["loss"] - curves2x2["loss"]).abs().max())
    state4, state2x2 = runfiles.read_final_state(cpu4), runfiles.read_final_state(nodes)
    param_diff = max(float((state4[k] - state2x2[k]).abs().max()) for k in state4)
    verdicts = dict(zip(table["run_dir"].astype(str), table["verdict"], strict=True))
    print(
        f"torchrun 2 nodes × 2 ranks: {summary['devices']} ranks, launcher "
        f"{summary['launcher']}; against the pooled cpu4 run: max |Δloss| {loss_diff:.3g}, "
        f"max |Δparam| {param_diff:.3g}; verdicts: cpu4 {verdicts['1']}, two nodes "
        f"{verdicts['two_nodes']}"
    )
    same = verdicts["1"] == verdicts["two_nodes"] == terms.RunVerdict.MATCHES
    bound = gradients.FLOAT64_TOLERANCE
    if not (same and loss_diff <= bound and param_diff <= bound):
        sys.exit(1)


if __name__ == "__main__":
    main()
