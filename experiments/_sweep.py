"""What every figure script does: run one experiment (a sweep or the audit), copy its files into
``figures/``."""

from __future__ import annotations

import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIGURES = REPO / "figures"


def run_sweep(experiment: str, *overrides: str) -> Path:
    """``python -m gatherlab.train -m experiment=<experiment>`` into a new sweep directory."""
    sweep_dir = REPO / "multirun" / f"{experiment}-{datetime.now():%Y-%m-%d_%H-%M-%S-%f}"
    command = [
        sys.executable, "-m", "gatherlab.train", "-m", f"experiment={experiment}",
        f"hydra.sweep.dir={sweep_dir}", *overrides,
    ]  # fmt: skip
    subprocess.run(command, cwd=REPO, check=True)
    return sweep_dir


def run_audit(*overrides: str) -> Path:
    """``python -m gatherlab.audit`` into a new directory under ``outputs/``."""
    out = REPO / "outputs" / f"gather_audit-{datetime.now():%Y-%m-%d_%H-%M-%S-%f}"
    command = [sys.executable, "-m", "gatherlab.audit", "--out", str(out), *overrides]
    subprocess.run(command, cwd=REPO, check=True)
    return out


def publish(sweep_dir: Path, files: dict[str, str]) -> None:
    """Copy ``sweep_dir/<source>`` to ``figures/<target>`` for each pair of ``files``."""
    FIGURES.mkdir(exist_ok=True)
    for source, target in files.items():
        shutil.copyfile(sweep_dir / source, FIGURES / target)
        print(f"{FIGURES / target} (from {sweep_dir / source})")
