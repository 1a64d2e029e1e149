"""Which process writes and logs, for the tests that start ranks under a launcher (torchrun, srun):
``recording(env, folder)`` is the environment that makes each started process record its writes,
file opens and gatherlab log records (tests/support/record_site/sitecustomize.py);
``records(folder)`` reads them back, each with the rank of the process that made it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

SITE = Path(__file__).resolve().parent / "record_site"


class Record(NamedTuple):
    rank: int | None  # None: a process no launcher started (torchrun itself)
    what: str  # runfiles.write_NAME, open, log
    detail: str  # the path written or opened, the log line


def recording(env: dict[str, str], folder: Path) -> dict[str, str]:
    """``env`` with the recording site first on PYTHONPATH and its records going to ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join([str(SITE), env.get("PYTHONPATH", "")])
    return {**env, "PYTHONPATH": path, "GATHERLAB_RECORD": str(folder)}


def records(folder: Path) -> list[Record]:
    """Every process's records, process by process in the order each made them."""
    found = []
    for log in sorted(folder.glob("*.jsonl")):
        found += [Record(*json.loads(line)) for line in log.read_text().splitlines()]
    return found


def opened_below(found: list[Record], directory: Path) -> dict[int | None, list[str]]:
    """The files opened for writing below ``directory``, by rank: their paths relative to it, in
    the order opened, a file opened twice listed twice."""
    directory = Path(directory).resolve()
    opened: dict[int | None, list[str]] = {}
    for record in found:
        path = Path(record.detail).resolve()
        if record.what == "open" and path.is_relative_to(directory):
            opened.setdefault(record.rank, []).append(path.relative_to(directory).as_posix())
    return opened


def written(found: list[Record]) -> list[tuple[int | None, str, str]]:
    """gatherlab's run-file writes: (rank, writer, path), sorted."""
    writes = [
        (record.rank, record.what.removeprefix("runfiles."), record.detail)
        for record in found
        if record.what.startswith("runfiles.")
    ]
    return sorted(writes, key=lambda write: (-1 if write[0] is None else write[0], *write[1:]))


def logged(found: list[Record]) -> dict[int | None, list[str]]:
    """The gatherlab log lines each rank handled, in order."""
    lines: dict[int | None, list[str]] = {}
    for record in found:
        if record.what == "log":
            lines.setdefault(record.rank, []).append(record.detail)
    return lines
