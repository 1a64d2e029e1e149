"""Recordings of the loops of ``tests/cases/recorded_jobs.py`` made for a test: on one device
without a process group (W = 1), or on the W ranks of gatherlab's warm pool (real gloo groups, the
check's own ranks: no fresh interpreter per recording)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any


def record(
    out: Path, world_size: int, job: str = "recorded_jobs:train", *args: Any, **kwargs: Any
) -> Path:
    """``job(out, *args, **kwargs)`` (``module:function`` of ``tests/cases/``) on ``world_size``
    ranks (1: here, no group); the recording's directory."""
    import importlib

    from gatherlab.ranks.external import ranks_for

    module, name = job.split(":")
    function = functools.partial(getattr(importlib.import_module(module), name), out, *args,
                                 **kwargs)  # fmt: skip
    if world_size == 1:
        function()
    else:
        ranks_for(world_size).run(function)
    return out


def record_cases(root: Path, cases: dict[str, tuple]) -> dict[str, Path]:
    """Each case (name → (W, ``module:function``, keyword arguments)) recorded into
    ``root / name``."""
    return {name: record(root / name, w, job, **kwargs)
            for name, (w, job, kwargs) in cases.items()}  # fmt: skip
