"""A traced two-rank job under torchrun ends cleanly, run after run (docs/usage.md, "When things go
wrong": gloo aborts a process whose peer tore its group down first). A soak test: twenty fresh
launches (~2 minutes here) do not fit the suite's budget, so it runs apart, ``make soak``; each
launch needs its own interpreters, since the failure it guards against is a process's exit."""

from __future__ import annotations

import pytest
from bundled_jobs import launch

from gatherlab.recording import format

pytestmark = pytest.mark.soak

LAUNCHES = 20


def test_a_traced_two_rank_job_ends_cleanly_every_time(tmp_path):
    """The bundled DDP job with ``--record`` and ``--trace`` at W = 2, twenty times: every launch
    exits 0 and leaves a whole recording with its trace (a rank that aborts at its exit fails
    torchrun with ChildFailedError, its recording whole all the same)."""
    failed = []
    for run in range(LAUNCHES):
        out = tmp_path / f"run{run}"
        finished = launch("ddp", 2, "--record", str(out), "--trace")
        if finished.returncode != 0:
            failed.append((run, finished.returncode, finished.stderr[-600:]))
            continue
        recording = format.read(out)
        assert len(recording.updates) == 5 and recording.trace() is not None
    assert not failed, failed
