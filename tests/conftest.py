from __future__ import annotations

import pytest
from helpers import gatherlab_processes


@pytest.fixture
def no_leftover_processes():
    """Fails a test that leaves a gatherlab or spawned worker process running."""
    before = set(gatherlab_processes())
    yield
    left = [cmd for cmd in gatherlab_processes() if cmd not in before]
    assert not left, f"processes left behind: {left}"
