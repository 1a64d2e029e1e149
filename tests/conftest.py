from __future__ import annotations

import psutil
import pytest
from helpers import PR1531_SWEEP, descendants, run_command

from gatherlab import pool as pools


@pytest.fixture(scope="session", autouse=True)
def worker_pools():
    """The test session shares one worker pool per world size (``gatherlab.pool.pool``), so a
    distributed test costs its computation, not process start-up. At the end no worker survives."""
    yield
    workers = [psutil.Process(pid) for pool in pools._pools.values() for pid in pool.pids]
    pools.close_pools()
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, f"pool workers outlived the session: {[p.pid for p in alive]}"


@pytest.fixture
def no_leftover_processes():
    """Fails a test that leaves a process of its own running (a descendant of this test process)
    other than the session's pool workers. Processes of other programs on the machine, another
    gatherlab sweep included, are not this test's and are not counted."""
    before = set(descendants())
    yield
    pool_pids = {pid for pool in pools._pools.values() for pid in pool.pids}
    left = {pid: cmd for pid, cmd in descendants().items() if pid not in before | pool_pids}
    assert not left, f"processes left behind: {left}"


@pytest.fixture(scope="session")
def pr1531_sweep(tmp_path_factory):
    """One finished sweep that every test reading a sweep shares (lightly PR #1531's case, `old`
    and `fixed` on 1 and 2 ranks, float64), run in-process on the warm pools: its directory and
    what the command printed. Tests copy it before changing it."""
    sweep = tmp_path_factory.mktemp("pr1531") / "sweep"
    result = run_command("train", *PR1531_SWEEP, f"hydra.sweep.dir={sweep}")
    assert result.returncode == 0, result.stderr[-3000:]
    return sweep, result


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tests first (in file order), so that with two test processes (``make test``) the
    long files start early and both processes finish together."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
