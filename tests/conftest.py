from __future__ import annotations

import pytest
from helpers import gatherlab_processes

from gatherlab import pool as pools


@pytest.fixture(scope="session", autouse=True)
def worker_pools():
    """The test session shares one worker pool per world size (``gatherlab.pool.pool``), so a
    distributed test costs its computation, not process start-up. At the end no worker survives."""
    yield
    pids = [pid for pool in pools._pools.values() for pid in pool.pids]
    pools.close_pools()
    survivors = set(pids) & set(gatherlab_processes())
    assert not survivors, f"pool workers outlived the session: {survivors}"


@pytest.fixture
def no_leftover_processes():
    """Fails a test that leaves a process running other than the session's pool workers."""
    before = set(gatherlab_processes())
    yield
    pool_pids = {pid for pool in pools._pools.values() for pid in pool.pids}
    left = {pid: cmd for pid, cmd in gatherlab_processes().items() if pid not in before | pool_pids}
    assert not left, f"processes left behind: {left}"
