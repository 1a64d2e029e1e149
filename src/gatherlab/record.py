"""Record a training job where it runs, to compare it with another run of it
(``python -m gatherlab.compare A B``; docs/recording.md §11):

    import gatherlab.record

    recorder = gatherlab.record(model, optimizer, "runs/w4", loss=criterion)
    for batch in loader:
        ...                      # the job's own loop, unchanged
    recorder.close()

``gatherlab.record(...)`` is `Recorder` (also a context manager); how it records is
`RecordOptions`, whose fields every recorder takes as keywords (``k=``, ``trace=``, …). A
Lightning ``Trainer`` takes ``gatherlab.record.LightningRecorder(out)`` among its callbacks, a
Hugging Face ``Trainer`` ``gatherlab.record.HFRecorder(out)`` (the ``hf`` extra). Every rank
records; rank 0 writes.

In float32, bf16 or fp16, record a third run, the floor: the same one-device command with
``GATHERLAB_RECORD_FLOOR=DIR`` set (every recorder cuts the model's forward into row blocks
itself), and compare with ``--floor DIR`` (docs/design.md §2, "Low precision").
"""

from __future__ import annotations

import sys
import types
from typing import Any

from gatherlab.components.rowblocks import in_row_blocks
from gatherlab.recording.format import Recording, RecordingError, read
from gatherlab.recording.record_options import RecordOptions
from gatherlab.recording.recorder import Recorder

# The two callbacks are imported when first asked for (module __getattr__).
__all__ = [  # noqa: F822
    "HFRecorder", "LightningRecorder", "RecordOptions", "Recorder", "Recording", "RecordingError",
    "in_row_blocks", "read",
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
