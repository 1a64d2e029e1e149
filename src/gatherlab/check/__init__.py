"""Check your own loss, gather or training step: does it train on W ranks exactly like one device?

``python -m gatherlab.check mypkg.losses:MyLoss --kwargs '{"temperature": 0.1}' --world-sizes 2,4``
builds the loss inside every rank of a real gloo group (``gatherlab.components.factory``: with
``rank=`` and ``world_size=`` when its constructor takes them, ``gather=`` only with ``--gather``;
without it the loss communicates by itself), calls ``loss(z0, z1)`` on the rank's slice of the two
views' embeddings (the gradient audit's MLP and Gaussian view pairs, float64, the data order of
docs/design.md §2), and compares with the same loss on one device (without a process group, as a
one-GPU script runs it; in a one-rank group only for code that raises without one, which the text
says, as it says where the two differ):

- ``forward``: the global loss (the mean over ranks of what each rank returns) is ``same`` or
  ``differs`` (relative tolerance 1e-10);
- ``gradient``: DDP's parameter gradient is ``exact``, ``1/W``, ``W``, ``biased``, ``none`` or
  ``other`` (``measure.classify``);
- with ``--steps N``, a short training run's largest |Δloss|.

The verdict per W (`gatherlab.check.table.verdict`) is ``exact`` when both are, ``loss scaled``
when the global loss is a constant multiple of one device's and the gradient is exact, ``loss
differs`` when the forward differs otherwise, ``diverges`` when it would be exact but the training
run departs, ``failed`` when the W's ranks raised, and otherwise the gradient's class; every
verdict but ``exact`` comes with a diagnosis in plain words. ``--gather mod:fn`` without a loss
checks a gather with gatherlab's three loss styles; ``--module`` and ``--step`` check a training
step (docs/design.md §10). It writes ``check.csv`` into ``--out`` and exits 0 when every W trains
like one device (``exact`` or ``loss scaled``), 1 otherwise, 2 for bad input.

The names below are imported when first used, so that ``python -m gatherlab.check`` starts its
ranks' fork server before it imports torch (`gatherlab.check.__main__`).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "COLUMNS", "CheckError", "check_gather", "check_loss", "check_training",
    "explain", "explain_training", "trains_like_one_device",
]  # fmt: skip

# Where each public name lives (module of this package).
_HOMES = {
    "CheckError": "api", "check_gather": "api", "check_loss": "api", "check_training": "api",
    "COLUMNS": "table", "trains_like_one_device": "table",
    "explain": "diagnosis", "explain_training": "diagnosis",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
