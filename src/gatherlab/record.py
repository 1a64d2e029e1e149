"""Record a training job where it runs, to compare it with another run of it
(``python -m gatherlab.compare A B``; docs/design.md §11):

    import gatherlab.record

    recorder = gatherlab.record(model, optimizer, "runs/w4", loss=criterion)
    for batch in loader:
        ...                      # the job's own loop, unchanged
    recorder.close()

``gatherlab.record(...)`` is `Recorder` (also a context manager). A Lightning ``Trainer`` takes
``gatherlab.record.LightningRecorder(out)`` among its callbacks, a Hugging Face ``Trainer``
``gatherlab.record.HFRecorder(out)`` (the ``hf`` extra). Every rank records; rank 0 writes.

In bf16 or fp16, record a third run, the floor: one device with
``gatherlab.record.in_row_blocks(model.backbone)`` (its forward in two row blocks), and compare
with ``--floor`` (docs/design.md §2, "Low precision").
"""

from __future__ import annotations

import sys
import types
from typing import Any

from gatherlab.components.rowblocks import in_row_blocks
from gatherlab.recording.format import Recording, RecordingError, read
from gatherlab.recording.recorder import Recorder

# The two callbacks are imported when first asked for (module __getattr__).
__all__ = [  # noqa: F822
    "HFRecorder", "LightningRecorder", "Recorder", "Recording", "RecordingError", "in_row_blocks",
    "read",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    """The callbacks, imported when first asked for (Lightning, transformers)."""
    if name == "LightningRecorder":
        from gatherlab.recording.lightning import LightningRecorder

        return LightningRecorder
    if name == "HFRecorder":
        from gatherlab.recording.hf import HFRecorder

        return HFRecorder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _CallableModule(types.ModuleType):
    """``gatherlab.record(model, optimizer, out, ...)`` is ``Recorder(...)``."""

    def __call__(self, *args: Any, **kwargs: Any) -> Recorder:
        return Recorder(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
