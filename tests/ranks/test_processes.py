"""The process checks are blind to other programs: a gatherlab sweep that this test process did
not start runs beside the tests, and neither the leftover check nor the pool check counts it."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest
from helpers import REPO, descendants, run_training

# a sweep in a fresh interpreter beside the tests (make test-fast leaves it out)
pytestmark = pytest.mark.slow


def test_a_sweep_beside_the_tests_is_not_counted(tmp_path, no_leftover_processes):
    """A fresh interpreter is the point: another user's sweep, started apart from this test (the
    shell that starts it exits at once, so it is nobody's child here)."""
    sweep = f"{sys.executable} -m gatherlab.train -m experiment=bug_demo hydra.sweep.dir={tmp_path}"
    started = subprocess.run(
        ["sh", "-c", f"{sweep}/other > {tmp_path}/other.log 2>&1 & echo $!"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    other = psutil.Process(int(started.stdout))
    try:
        # Until it has exec'd python, the child is a fork of the shell with the shell's command
        # line (`sh -c ...`): its identity is read once that has changed (psutil reads the command
        # line afresh each time; pytest-timeout bounds the wait)
        while other.cmdline()[:2] == ["sh", "-c"]:
            assert other.status() != psutil.STATUS_ZOMBIE, (tmp_path / "other.log").read_text()
            time.sleep(0.01)
        assert other.cmdline()[1:4] == ["-m", "gatherlab.train", "-m"], other.cmdline()
        assert other.pid not in descendants()
        run_training(tmp_path / "mine", "experiment=bug_demo", "layout=cpu2", "steps=3")
        assert other.is_running(), "the other sweep must still run while this test checks"
    finally:
        for process in [*other.children(recursive=True), other]:
            process.kill()
        psutil.wait_procs([other], timeout=10)
