"""``python -m gatherlab.bench compare``'s pieces (`gatherlab.lab.comparetime`) on one device: its
bf16 job, recorded with its floor, and the command's phases timed in a fresh interpreter; what
they record and print, never how fast (the suite asserts no wall-clock time; docs/performance.md
has the measured seconds)."""

from __future__ import annotations

import os

from helpers import pythonpath

from gatherlab.compare import compare
from gatherlab.lab import comparetime
from gatherlab.recording import format
from gatherlab.recording.record_options import FLOOR_VARIABLE


def test_the_bf16_job_records_itself_and_its_floor_and_one_device_is_exact_within_bf16(
    tmp_path, monkeypatch
):
    """One device's recording of the bf16 job: bf16-mixed, 32 rows per update from one call of
    its model; its floor (``GATHERLAB_RECORD_FLOOR``) in 2 row blocks; the recording against
    itself judged in floors: 0 floors, ``exact within bf16``. Its phases, in a fresh interpreter:
    every one measured, none negative, the figure drawn."""
    comparetime.bf16_job(str(tmp_path / "one"))
    monkeypatch.setenv(FLOOR_VARIABLE, str(tmp_path / "floor"))
    comparetime.bf16_job(str(tmp_path / "one"))  # its out holds a recording: the floor alone
    monkeypatch.delenv(FLOOR_VARIABLE)
    one, floor = format.read(tmp_path / "one"), format.read(tmp_path / "floor")
    assert one.precision == floor.precision == "bf16-mixed"
    assert [len(rows) for rows in one.updates[0].rows] == [comparetime.BF16_BATCH]
    assert len(one.updates) == comparetime.BF16_UPDATES and floor.header["row_blocks"] == 2
    judged = compare(tmp_path / "one", tmp_path / "one", floor=tmp_path / "floor")
    assert (judged.verdict, judged.status) == ("exact within bf16", 0)
    assert comparetime._verdict(judged.words) == "exact within bf16"
    environment = {**os.environ, "PYTHONPATH": pythonpath()}
    phases = comparetime._phases_of(
        environment, (tmp_path / "one", tmp_path / "one", tmp_path / "floor"), tmp_path / "out"
    )
    assert list(phases) == list(comparetime.PHASES)
    assert all(seconds >= 0 for seconds in phases.values()), phases
    assert (tmp_path / "out" / "figure" / "compare.png").exists()
    assert not (tmp_path / "out" / "tables" / "compare.png").exists()
