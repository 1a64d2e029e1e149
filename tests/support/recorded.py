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


def in_memory(ranks: list[list[list[str]]], loss: float = 1.0):
    """A recording built in memory of one part ``w`` whose every update's gradient and loss
    (``loss``) are the same, and whose update u's rows are ``ranks[u]`` (each rank's digests):
    the data's rules without ranks."""
    import numpy as np

    from gatherlab.recording.format import Recording, Update

    parameters = [{"name": "w", "shape": [4], "part": "w", "sharded": False}]
    header = {"world_size": len(ranks[0]), "k": 4, "parts": ["w"], "parameters": parameters,
              "seed": 0, "precision": "64-true", "sketch_seed": 0, "full_updates": 0,
              "settings": {"optimizer": "SGD"}}  # fmt: skip
    sketch = np.array([1.0, -2.0, 0.5, 3.0])
    updates = [Update(u, [loss] * len(rows), loss, rows, {"w": sketch}, {"w": 2.0}, {}, None)
               for u, rows in enumerate(ranks)]  # fmt: skip
    return Recording(Path("/nonexistent"), header, updates, {"w": sketch}, {"w": 2.0})


def relative(a, b) -> float:
    """The largest |a − b| relative to the largest |b|."""
    import numpy as np

    return float(np.abs(a - b).max() / np.abs(b).max())


def whole_sketches(recording) -> dict:
    """Independently of the ranks' sketches: a recording's update 0 whole gradient (kept in float64,
    gathered whole from any shards), cut into its parameters and sketched here, summed per part
    (docs/recording.md §11, "The sketch")."""
    import numpy as np
    import torch

    from gatherlab.recording.sketch import signs, sketch

    gradient, k, start = recording.full_gradient(0), recording.k, 0
    expected = {part: torch.zeros(k, dtype=torch.float64) for part in recording.parts}
    for parameter in recording.header["parameters"]:
        numel = int(np.prod(parameter["shape"]))
        block_signs = signs(parameter["name"], numel, k, recording.header["sketch_seed"])
        expected[parameter["part"]] += sketch(gradient[start : start + numel], k, block_signs)
        start += numel
    return {part: values.numpy() for part, values in expected.items()}
