"""A refusal of the recorder where the job runs (docs/recording.md §11, "Refusals"): one line on the
job's standard error, said once (by rank 0, or by the one process), and the job ends, on every
rank together: every refusal is decided alike on every rank (a setting each reads, or rank 0's
answer sent to all of them), so that no rank is left waiting in a collective.

It is raised as `Refused`, a `RecordingError` (what a program that records jobs catches) that is
also a ``SystemExit``: uncaught, it ends the process with exit status 2 and no traceback, from a
plain loop, a Lightning ``Trainer`` or a Hugging Face ``Trainer`` alike, none of which keeps a
``SystemExit`` from ending the process. Under torchrun (its agent sets ``TORCHELASTIC_RUN_ID`` in
every rank), whose agent answers any rank's non-zero exit status with a failure summary and a
traceback of its own, the ranks end with status 0: the refusal's line is what the command prints,
and the recording it did not make is refused by ``python -m gatherlab.compare`` in one line. There
a rank with a process group ends at once, without the interpreter's exit (`refuse`).
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import torch.distributed as dist

from gatherlab.recording.format import RecordingError

__all__ = ["PREFIX", "Refused", "refuse"]

PREFIX = "gatherlab.record: "
"""What a refusal's line begins with where it does not name the recorder itself."""
UNDER_TORCHRUN = "TORCHELASTIC_RUN_ID"
"""The variable torchrun's agent sets in every rank it starts."""


class Refused(RecordingError, SystemExit):
    """The recorder refused the job: ``str()`` is the line; uncaught, the process ends with
    ``code`` (2, or 0 under torchrun) and nothing more is printed."""

    def __init__(self, line: str, code: int) -> None:
        RecordingError.__init__(self, line)
        self.code = code

    def __str__(self) -> str:
        return self.args[0]


def refuse(line: str, by_this_rank: bool = False) -> NoReturn:
    """Say ``line`` once on standard error and end the job (`Refused`): by rank 0, the ranks'
    refusals being alike, or ``by_this_rank`` (one only some ranks reach: a rank that waited for
    the others). A rank of torchrun's
    with a process group ends at once (``os._exit(0)``, its output flushed): raised, the
    interpreter's exit tore the group down while its peer still held its own, and gloo aborted
    one of them (SIGABRT, ``terminate called without an active exception``, and torchrun's
    failure summary: 3 of 10 refused two-rank launches here, 0 of 20 since)."""
    grouped = dist.is_available() and dist.is_initialized()
    if not grouped or by_this_rank or dist.get_rank() == 0:
        said = line if line.startswith("gatherlab.record") else PREFIX + line
        print(said, file=sys.stderr, flush=True)
    if UNDER_TORCHRUN in os.environ and grouped:
        sys.stdout.flush()
        os._exit(0)
    raise Refused(line, 0 if UNDER_TORCHRUN in os.environ else 2)
