"""The options of a recording (`RecordOptions`), each typed and documented once: read by
`gatherlab.record` (`Recorder`) and by the Lightning and Hugging Face callbacks, which pass them
on whole. A value that is not allowed is refused in one line (`gatherlab.recording.refusal`)
when the options are made."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from gatherlab.recording.refusal import refuse
from gatherlab.recording.sketch import DEFAULT_K

__all__ = [
    "FLOOR_BLOCKS_VARIABLE", "FLOOR_ROW_BLOCKS", "FLOOR_VARIABLE", "RecordOptions",
    "record_options",
]  # fmt: skip

# The floor's variables (`gatherlab.recording.recorder` reads them), here where a comparison of
# recordings names them without importing the recorder.
FLOOR_VARIABLE = "GATHERLAB_RECORD_FLOOR"
"""The environment variable that makes a one-device job record its floor: its value is the floor
recording's directory, which replaces the job's own ``out``."""
FLOOR_ROW_BLOCKS = 2
"""The row blocks of a floor recording's model forward by default (as the check's floor,
docs/design.md §2)."""
FLOOR_BLOCKS_VARIABLE = "GATHERLAB_RECORD_FLOOR_BLOCKS"
"""The variable that sets a floor recording's row blocks: as many as the ranks of the runs it
judges, whose T is then `gatherlab.core.floor.FLOOR_THRESHOLD` (fewer: `FEWER_BLOCKS_THRESHOLD`)."""


@dataclass(frozen=True, kw_only=True)
class RecordOptions:
    """How a job is recorded (docs/recording.md §11). ``gatherlab.record(model, optimizer, out,
    k=64)`` and ``LightningRecorder(out, trace=True)`` take any field as a keyword; or
    ``options=RecordOptions(...)``, with keywords set over it.

    Attributes:
        k: The sketch's size per part: an integer ≥ 2.
        full_updates: How many first updates keep their whole gradient (float64); None: the
            first, for a model of at most `gatherlab.recording.recorder.FULL_GRADIENT_LIMIT`
            parameters.
        seed: The job's seed, for the header (compared between runs); a callback reads the
            trainer's where none is given.
        settings: More of the job's settings that must agree between two runs (JSON values).
        trace: Record the operations of the first update's forward, from the model's first call
            to the loss, with their gradients (`gatherlab.runs.trace`; every result is copied:
            for small runs), so that the comparison names the line where two runs part
            (``trace.pt``).
        precision: The job's precision (``64-true``, ``32-true``, ``bf16-mixed``…); None: from
            the parameters' dtype, an autocast seen in the forward recorded per update (a
            callback gives its trainer's).
        batches: Whether the model's forward inputs are the batch (False: the job calls
            ``batch(x)``, as the callbacks do).
        losses: Whether the loss module's or the model output's loss is the micro-batch's loss
            (False: the job calls ``loss(value)``, as the callbacks do).
        sketch_seed: The seed of the sketch's random signs (the same in both runs compared).
    """

    k: int = DEFAULT_K
    full_updates: int | None = None
    seed: int | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)
    trace: bool = False
    precision: str | None = None
    batches: bool = True
    losses: bool = True
    sketch_seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 2:
            refuse(f"k={self.k!r}: the sketch's size per part; allowed: an integer ≥ 2")
        updates = self.full_updates
        if updates is not None and (not isinstance(updates, int) or updates < 0):
            refuse(f"full_updates={updates!r}: allowed: an integer ≥ 0, or None")
        if not isinstance(self.settings, Mapping):
            refuse(f"settings={self.settings!r}: allowed: a mapping of JSON values")


_FIELDS = frozenset(option.name for option in fields(RecordOptions))


def record_options(options: RecordOptions | None, chosen: Mapping[str, Any]) -> RecordOptions:
    """``options`` (the defaults when None) with the keywords ``chosen`` set over them; one line
    (`refuse`) for a keyword that is no field."""
    unknown = sorted(set(chosen) - _FIELDS)
    if unknown:
        refuse(f"{unknown[0]}= is no option of a recording; allowed: {', '.join(sorted(_FIELDS))}")
    if options is None:
        return RecordOptions(**chosen)
    if not isinstance(options, RecordOptions):
        refuse(f"options={type(options).__name__}(...): allowed: RecordOptions")
    values = {option.name: getattr(options, option.name) for option in fields(RecordOptions)}
    return RecordOptions(**values | dict(chosen))
