"""Helpers shared by the tests: composing real configs, running the CLI, the process table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gatherlab import config, configcheck, jobs

REPO = Path(__file__).resolve().parents[1]


def compose(*overrides: str):
    """A run config composed from the real configs, with its config group choices."""
    with config.composed():
        return config.compose(list(overrides))


def run_training(run_dir: Path, *overrides: str) -> dict:
    """One checked run in this process (its ranks in the shared pool unless ``launcher=spawn``)."""
    cfg, choices = compose(*overrides)
    configcheck.check(cfg)
    return jobs.run(cfg, run_dir, choices, overrides)


def gatherlab_command(module: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m gatherlab.<module> args`` in the repository, as a user runs it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", f"gatherlab.{module}", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def gatherlab_processes() -> dict[int, str]:
    """Live processes that run gatherlab code or spawned workers (pid → command line), other than
    this test process."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "gatherlab" in cmdline or "multiprocessing.spawn" in cmdline:
            found[int(entry.name)] = cmdline
    return found
