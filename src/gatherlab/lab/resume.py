"""Resuming a sweep: ``python -m gatherlab.train -m ... +resume=SWEEP_DIR``.

The same command that started the sweep runs again in its directory: a job whose summary says
``ok`` is not run again, a failed attempt's summary is set aside and the job runs anew, and the
report is written again at the end. ``+resume=`` is the command line's, not a config key: it is
taken out of the arguments (``arguments``) before Hydra reads them. Only the command that started
the sweep may resume it (``check_jobs``: the same jobs under the same numbers).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from gatherlab.components.config import ConfigError
from gatherlab.core import runfiles

__all__ = ["arguments", "check_jobs", "skip_or_set_aside"]

log = logging.getLogger(__name__)


def arguments(typed: Sequence[str]) -> tuple[list[str], Path | None]:
    """The arguments Hydra reads and the sweep directory to resume (None when none): ``+resume=DIR``
    (or ``resume=DIR``) becomes the sweep's directory, ``hydra.sweep.dir=DIR``, and makes the
    command the sweep it resumes (``hydra.mode=MULTIRUN``, as ``-m`` does)."""
    rest, found = [], None
    for argument in typed:
        key, _, value = argument.partition("=")
        if key.lstrip("+") == "resume" and value:
            found = Path(value)
        else:
            rest.append(argument)
    if found is None:
        return rest, None
    if not found.is_dir():
        raise ConfigError(f"resume={found} does not exist; allowed: a sweep directory")
    if any(argument.startswith("hydra.sweep.dir=") for argument in rest):
        raise ConfigError("resume=... sets hydra.sweep.dir itself; allowed: one of the two")
    sweep_dir = found.resolve()
    return [*rest, f"hydra.sweep.dir={sweep_dir}", "hydra.mode=MULTIRUN"], sweep_dir


def check_jobs(sweep_dir: Path, jobs: Sequence[Sequence[str]]) -> None:
    """Refuse to resume ``sweep_dir`` with other jobs than those it ran: each job that wrote a
    summary must have run with the overrides the same job number has now."""
    for number, job in enumerate(jobs):
        summary = sweep_dir / str(number) / runfiles.SUMMARY
        if not summary.exists():
            continue
        recorded = runfiles.read_summary(summary.parent).get("overrides")
        if recorded is not None and list(recorded) != list(job):
            raise ConfigError(
                f"job {number + 1} of {sweep_dir} ran with {' '.join(recorded)}, this command "
                f"would run {' '.join(job)}; allowed: the command that started the sweep"
            )


def skip_or_set_aside(run_dir: Path, number: int) -> bool:
    """For a job of a resumed sweep: True when it finished before (it is not run again); else its
    failed attempt, if any, is set aside (``runfiles.set_aside_failed``) and it runs."""
    if runfiles.is_complete(run_dir):
        log.info("job %d: complete in %s, not run again", number, run_dir)
        return True
    runfiles.set_aside_failed(run_dir)
    return False
