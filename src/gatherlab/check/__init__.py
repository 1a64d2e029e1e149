"""Check your own loss, gather or training step: does it train on W ranks exactly like one device?

``python -m gatherlab.check mypkg.losses:MyLoss --world-sizes 2,4`` checks a loss (``--gather``
alone: a gather, with gatherlab's three loss styles); ``--module`` (a LightningModule), ``--step``
(a plain PyTorch step) and ``--update`` (a whole update, with ``--micro-batches``) check a training
step. Each W runs on real gloo ranks and is judged against the same code on one device
(`gatherlab.check.judge`): the forward, the gradient's class, the verdict, and for every verdict
but ``exact`` its diagnosis in words. It writes ``check.csv`` into ``--out`` and exits 0 when every
W trains like one device (``exact`` or ``loss scaled``), 1 otherwise, 2 for bad input
(docs/checking.md §6, §10).

The names below are imported when first used, so that ``python -m gatherlab.check`` starts its
ranks' fork server before it imports torch (`gatherlab.check.__main__`).

Modules:

- ``api``: ``check_loss``, ``check_gather``, ``check_training``: the functions this package exports
- ``options``: the options of every form of the check, typed, documented and validated once
- ``defaults``: the check's defaults (the options' values) and what a loss's check trains
- ``measure``: a loss's gradient on W ranks, real or simulated, and on one device; the audit's cells
- ``judge``: the one judge of a run against its one-device reference, for every form of the check
- ``hypotheses``: the causes of a differing global loss, reproduced on one device, not guessed
- ``where``: where a run departs from one device: the first operation whose result differs
- ``reference``: the one-device reference: the plain run, or a one-rank group for code needing one
- ``floors``: the loss check in a low precision: each W judged against a measured floor
- ``training``: a training step's check: W ranks against one device, each removal, the culprits
- ``experts``: an expert-parallel run made one device's from its ranks' pieces, and its causes
- ``table``: ``check.csv``: its columns, its typed ``Row``, the one ``verdict()``, the failed row
- ``diagnosis``: the words of a check: each verdict's and culprit's diagnosis, the printed text
- ``launched``: the check on the ranks that torchrun or srun started (``--launcher external``)
- ``recordings``: a recorded run against its recorded reference, judged by ``judge``
- ``batches``: two recordings' global batches compared update by update, as rows and as an order
- ``sizing``: whether a training step's check fits in the memory left, told before any rank starts
- ``__main__``: the command line, ``python -m gatherlab.check``
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "COLUMNS", "CheckError", "CheckResult", "GatherOptions", "LossOptions", "TrainingOptions",
    "check_gather", "check_loss", "check_training", "explain", "explain_training",
    "trains_like_one_device",
]  # fmt: skip

# Where each public name lives (module of this package).
_HOMES = {
    "CheckError": "options", "GatherOptions": "options", "LossOptions": "options",
    "TrainingOptions": "options", "CheckResult": "table",
    "check_gather": "api", "check_loss": "api", "check_training": "api",
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
