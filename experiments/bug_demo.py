"""README figure 1: the GatherLayer bug and its fix (``experiment=bug_demo``).

Runs the sweep, then copies its comparison figure to ``figures/bug_demo.{png,pdf}``.
Usage: ``python experiments/bug_demo.py``
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    sweep_dir = REPO / "multirun" / f"bug_demo-{datetime.now():%Y-%m-%d_%H-%M-%S-%f}"
    command = [
        sys.executable,
        "-m",
        "gatherlab.train",
        "-m",
        "experiment=bug_demo",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    subprocess.run(command, cwd=REPO, check=True)
    figures = REPO / "figures"
    figures.mkdir(exist_ok=True)
    for suffix in ("png", "pdf"):
        shutil.copyfile(sweep_dir / f"comparison.{suffix}", figures / f"bug_demo.{suffix}")
    shutil.copyfile(sweep_dir / "comparison.csv", figures / "bug_demo.csv")
    print(f"figure: {figures / 'bug_demo.png'} (from {sweep_dir})")


if __name__ == "__main__":
    main()
