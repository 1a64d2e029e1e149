"""A recorded run against its recorded reference (`gatherlab.recording`: each optimizer update's
batch fingerprints, losses, per-part gradient sketches and norms, docs/contract.md §5,
docs/checking.md §6 "Comparing two recordings"), judged by the one judge of the check
(`gatherlab.check.judge.judge`).

The order of judgement: what was trained (the same parameters, the settings that must agree:
`NotComparable`, one line, else), then the data (the global batch of every update as a set of rows,
then as an order: a set that differs is the verdict ``data differs``, said before any gradient is
judged), then per update the loss and each part's gradient class (`gradients.classify` where the
full gradients were recorded, `gradients.classify_sketched` elsewhere: `class_of` is the one rule
of both), the first update and part that depart, and the causes the recordings measure: a part
not reduced over the ranks (``unreduced``), factors that differ between parts (``parts``); where
both recordings traced their first update, where B departs, as the check names it
(`gatherlab.check.where`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from gatherlab.check import batches, diagnosis, where
from gatherlab.check.experts import scaled
from gatherlab.check.judge import InPrecision, Recorded, as_classified, judge
from gatherlab.check.table import (
    ALL_PARTS,
    COMPARISON_COLUMNS,
    EXACT,
    PRECISION_COLUMNS,
    Row,
    frame,
    trains_like_one_device,
)  # fmt: skip
from gatherlab.core import gradients, held, runfiles, terms
from gatherlab.core.floor import (
    FEWER_BLOCKS_THRESHOLD,
    ROUNDING_CEILING,
    WITHIN,
    Floored,
    beyond_rounding,
    classify_at,
    classify_floored,
    classify_sketched_floored,
    relative,
    rounding_resolution,
    threshold,
)
from gatherlab.core.gradients import Classified, Layout
from gatherlab.core.terms import Forward, GradientClass
from gatherlab.recording.format import TRACE, Recording, RecordingError, read
from gatherlab.recording.record_options import FLOOR_BLOCKS_VARIABLE, FLOOR_ROW_BLOCKS

__all__ = [
    "MUST_AGREE", "UPDATE_COLUMNS", "Comparison", "NotComparable", "compare_recordings",
    "recording",
]  # fmt: skip

UPDATE_COLUMNS = (
    "update", "part", "gradient", "cosine", "norm_ratio", "rel_err", "source", "loss_a", "loss_b",
)  # fmt: skip
"""The columns of ``updates.csv``, one row per update and part (``all`` the whole gradient, then
each part when there are several): the gradient's class against the reference's, cosine, norm
ratio and relative error, read from the full gradients where both recordings hold them
(``source`` ``full``: max |g − g₁| / max |g₁|) or from the sketches (``sketch``:
‖S(g − g₁)‖ / ‖g₁‖, norm ratio from the exact norms), and both global losses."""

MUST_AGREE = ("seed", "precision", "k", "sketch_seed", "full_updates")
"""The header fields two recordings must share besides their models and ``settings`` (every key
of either, the optimizer and its learning rates among them) and their number of updates."""

FLOOR_COLUMNS = ("floor", "floors")
"""The columns ``updates.csv`` adds when a floor recording judges it (``--floor``): each row's
floor, the floor recording's relative departure from A at that update and part, and B's
departure in floors of it."""

FULL, SKETCH = "full", "sketch"


class NotComparable(ValueError):
    """Two recordings of different models or settings that must agree: one line naming what
    differs, with both values."""


@dataclass(frozen=True)
class Comparison:
    """A comparison of recording ``run`` (B) against ``reference`` (A): its ``table`` (the rows
    of `COMPARISON_COLUMNS`, ``check.csv``: the whole gradient, then each part), ``updates`` (the
    rows of `UPDATE_COLUMNS`, ``updates.csv``), the whole's ``verdict``, the exit ``status`` (0
    trains like the reference, 1 not), the printed ``words`` (ending with a newline), the
    ``data`` difference in words (None when every update's global batch is the reference's),
    ``notes`` (what differs without failing: another order of the same rows, updates without a
    loss), the first ``departure`` (update, part) (None when none departs), the two
    recordings' directories, and ``threshold`` (T) where a floor recording judged it."""

    table: pd.DataFrame
    updates: pd.DataFrame
    verdict: str
    status: int
    words: str
    data: str | None
    notes: tuple[str, ...]
    departure: tuple[int, str] | None
    reference: Path
    run: Path
    threshold: float | None = None
    """T, the most floors within the floor recording's, where one judged it (`floor.threshold`:
    5 where the floor has as many row blocks as B has ranks, 20 where fewer); None without."""

    @property
    def trains_like_reference(self) -> bool:
        """Whether the run trains like its reference (`trains_like_one_device` of the table)."""
        return self.status == 0


def recording(path: str | Path | Recording) -> Recording:
    """A recording, read (`gatherlab.recording.format.read`: `RecordingError` for a directory
    that is no finished recording of a version this gatherlab reads)."""
    return path if isinstance(path, Recording) else read(path)


# --- what was trained ---------------------------------------------------------------------------


def _same_model(a: Recording, b: Recording) -> None:
    """`NotComparable` unless both recordings hold the same parameters (names and shapes, in
    order; a sharded one as a whole)."""
    theirs = {p["name"]: list(p["shape"]) for p in a.header["parameters"]}
    mine = {p["name"]: list(p["shape"]) for p in b.header["parameters"]}
    for name, shape in mine.items():
        tied = a.header.get("tied", {}).get(name)
        if name not in theirs and tied is not None:  # a tied weight's copy under its own name
            raise NotComparable(
                f"A and B record different models: B has parameter {name} of shape {shape}, "
                f"which A's model ties to {tied} (one parameter on one device, held as a copy "
                f"on another stage); allowed: B's copy recorded under one device's name, "
                f"gatherlab.record(..., names={{{tied!r}: <its {name}>}}) on the ranks that hold it"
            )
        if name not in theirs:
            raise NotComparable(
                f"A and B record different models: B has parameter {name} of shape {shape}, A "
                "has none"
            )
        if theirs[name] != shape:
            raise NotComparable(
                f"A and B record different models: B has parameter {name} of shape {shape}, A "
                f"of shape {theirs[name]}"
            )
    for name, shape in theirs.items():
        if name not in mine:
            raise NotComparable(
                f"A and B record different models: A has parameter {name} of shape {shape}, B "
                "has none"
            )
    if list(mine) != list(theirs):
        raise NotComparable("A and B record the same parameters in another order")


def _judged(recording: Recording) -> str:
    """The precision a recording is judged in: its own (`Recording.precision`), fp16 parameters
    as fp16's autocast (they round alike)."""
    precision = recording.precision
    return str(terms.Precision.FP16_MIXED) if precision == "16-true" else precision


def _floor(
    a: Recording, b: Recording, c: Recording
) -> tuple[tuple[str, Recording, float], str | None]:
    """The precision of a comparison judged in floors, its floor recording ``c``, checked
    against A (the same model and settings, one device, a low precision: an autocast dtype, or
    parameters below float64; NotComparable in one line otherwise), and T, the most floors
    within it (`floor.threshold` of C's row blocks, B's ranks and whether C's calls of the forward
    span B's: `_calls_unspanned`, whose note says so where they do not)."""
    try:
        _same_model(a, c)
        _same_settings(a, c)
    except NotComparable as error:  # its words name C as B: said so
        raise NotComparable(f"--floor {c.path}, read as B here, is no floor of A: {error}; a "
                            "floor is A's own command recorded again") from None  # fmt: skip
    if c.world_size != 1:
        raise NotComparable(
            f"--floor {c.path} was recorded on {c.world_size} ranks; allowed: one device with its "
            "forward in row blocks (gatherlab.record.in_row_blocks)"
        )
    precision = _judged(a)
    if precision not in terms.PRECISIONS or precision == terms.Precision.FLOAT64:
        raise NotComparable(
            f"--floor {c.path}: A is recorded in {precision}, judged to 1e-10; allowed: a floor "
            "for recordings in float32, bf16 or fp16"
        )
    blocks = max(c.row_blocks, FLOOR_ROW_BLOCKS)  # a floor recorded before its blocks were: 2
    # where C has fewer blocks than B has ranks T is the looser one already, and nothing is noted
    note = _calls_unspanned(a, b, blocks) if blocks >= b.world_size else None
    return (precision, c, threshold(blocks, b.world_size, note is None)), note


def _calls_unspanned(a: Recording, b: Recording, blocks: int) -> str | None:
    """The note that the floor's calls of the forward do not span B's, or None where they do
    (or are not recorded). The floor is A's calls cut into ``blocks`` row blocks, so it rounds as
    calls of A's smallest block to A's largest call; a rank's call outside them (a GradCache job
    whose ranks embed 16 rows at once against A's chunks of 8; A's calls of 32 in blocks of 16
    against ranks' calls of 8) rounds in other matrix kernels, which the floor never measured."""
    sizes_a, sizes_b = _rows_per_call(a), _rows_per_call(b)
    if not sizes_a or not sizes_b:
        return None
    least, most = min(sizes_a) // blocks, max(sizes_a)
    if least <= min(sizes_b) and max(sizes_b) <= most:
        return None
    needed = ""  # B's calls smaller than the blocks (a pipeline's micro-batches): blocks of
    if max(sizes_b) <= most:  # at most B's smallest call
        needed = f"={max(blocks, _spanning(sizes_a, sizes_b))}"
    return diagnosis.CALLS_UNSPANNED.format(
        b=f"{min(sizes_b)}" if min(sizes_b) == max(sizes_b) else f"{min(sizes_b)}–{max(sizes_b)}",
        least=least, most=most, threshold=FEWER_BLOCKS_THRESHOLD, blocks=needed,
    )  # fmt: skip


def _spanning(sizes_a: list[int], sizes_b: list[int]) -> int:
    """The row blocks that cut A's smallest call into blocks of at most B's smallest call."""
    return -(-min(sizes_a) // min(sizes_b))


def _floor_blocks(a: Recording, b: Recording) -> int:
    """The row blocks of the floor A's recorder is asked for: as many as B's ranks (at least
    `FLOOR_ROW_BLOCKS`), and more where B's calls of the forward are smaller than those blocks and
    no larger than A's calls (a pipeline's micro-batches): blocks of at most B's smallest call,
    which the floor's calls then span (`_calls_unspanned`)."""
    blocks = max(b.world_size, FLOOR_ROW_BLOCKS)  # as many partial sums as B's ranks
    sizes_a, sizes_b = _rows_per_call(a), _rows_per_call(b)
    smaller = sizes_a and sizes_b and min(sizes_b) < min(sizes_a) // blocks
    if smaller and max(sizes_b) <= max(sizes_a):
        blocks = max(blocks, _spanning(sizes_a, sizes_b))
    return blocks


def _rows_per_call(recording: Recording) -> list[int]:
    """Each rank's rows per call of the forward at each update (rounded down), where it recorded
    its calls and held rows."""
    return [
        len(rows) // calls
        for update in recording.updates if update.calls
        for rows, calls in zip(update.rows, update.calls, strict=True) if calls and rows
    ]  # fmt: skip


def _same_settings(a: Recording, b: Recording) -> None:
    """`NotComparable` unless the settings that must agree do: every key of either header's
    ``settings``, `MUST_AGREE`, and the number of updates."""
    missing = object()
    settings_a = _flat(a.header.get("settings", {}), "settings")
    settings_b = _flat(b.header.get("settings", {}), "settings")
    compared = [(key, settings_a.get(key, missing), settings_b.get(key, missing))
                for key in dict.fromkeys([*settings_a, *settings_b])]  # fmt: skip
    compared += [
        (key, a.header.get(key, missing), b.header.get(key, missing)) for key in MUST_AGREE
    ]
    for key, theirs, mine in compared:
        if theirs != mine:
            shown = ["not recorded" if v is missing else repr(v) for v in (theirs, mine)]
            raise NotComparable(
                f"A and B record different settings: {key} is {shown[0]} in A, {shown[1]} in B; "
                "a comparison needs them equal"
            )
    if len(a.updates) != len(b.updates):
        raise NotComparable(
            f"A and B record different numbers of updates: A {len(a.updates)}, B "
            f"{len(b.updates)}; a comparison needs them equal"
        )


def _flat(value: Any, name: str) -> dict[str, Any]:
    """A header's nested settings as one mapping of their paths (``settings
    param_groups[0].lr``) to their values, so that a difference names the one value."""
    if isinstance(value, dict):
        separator = " " if name == "settings" else "."
        return {path: leaf for key, item in value.items()
                for path, leaf in _flat(item, f"{name}{separator}{key}").items()}  # fmt: skip
    if isinstance(value, list) and any(isinstance(item, dict | list) for item in value):
        return {path: leaf for i, item in enumerate(value)
                for path, leaf in _flat(item, f"{name}[{i}]").items()}  # fmt: skip
    return {name: value}


# --- the gradients ------------------------------------------------------------------------------


def _micro_batches(a: Recording, b: Recording) -> int:
    """K, the micro-batches each of B's ranks accumulates per update for each of A's: the number
    of losses its first update recorded over A's (1 where either recorded none, or they do not
    divide)."""
    theirs, mine = (r.updates[0].micro_batches if r.updates else 0 for r in (a, b))
    return mine // theirs if theirs and mine and mine % theirs == 0 else 1


def _measured(
    a: Recording, b: Recording, precision: str, data: batches.Batches, micro_batches: int,
    floored: tuple[str, Recording, float] | None,
) -> tuple[list[str], tuple[int, list[str]] | None, dict[str, Any]]:  # fmt: skip
    """What the recordings measured beside the classes, for the words: the unreduced parts
    (`_unreduced`), the first update whose ranks step apart and its parts, and the numbers the
    diagnosis reads."""
    unreduced, measured = _unreduced(a, b, precision)
    desync = next(((u.index, u.drifted) for u in b.updates if u.drifted), None)
    measured = {**measured, "data_cause": data.explanation or "", "recorded": True,
                "micro_batches": micro_batches}  # fmt: skip
    if floored is not None:
        measured["loss_resolution"] = _loss_resolution(a, floored)
    if desync is not None:
        measured |= {"desync_update": desync[0], "desync_parts": ", ".join(desync[1])}
    return unreduced, desync, measured


def _loss_resolution(a: Recording, floored: tuple[str, Recording, float]) -> float:
    """How far B's first loss is held from A's judged in floors (`floor.forward_floored`): T
    floors of the floor recording's relative departure there, at least the unit roundoff."""
    first, perturbed = a.updates[0].loss, floored[1].updates[0].loss
    departure = abs(perturbed - first) / max(abs(first), 1e-300)
    return floored[2] * max(departure, terms.Precision(floored[0]).unit_roundoff)


def _own_micro_batches(b: Recording) -> int:
    """The K a factor of B's gradient is named by: the micro-batches its ranks accumulate per
    update, whatever A accumulates (B's K losses not divided by K give K, also where A
    accumulates as many and divides)."""
    return max(b.updates[0].micro_batches, 1) if b.updates else 1


def _sketch(update: Any, parts: Sequence[str]) -> np.ndarray:
    return np.concatenate([update.sketches[part] for part in parts])


def _whole_norm(update: Any, parts: Sequence[str]) -> float:
    return math.sqrt(math.fsum(update.norms[part] ** 2 for part in parts))


@dataclass(frozen=True)
class _Read:
    """One update's gradient of B read against A's: the whole's class and each part's (when
    there are several), their source (full gradients or sketches) and, judged in floors, each
    one's floor and its departure in floors (``all`` for the whole)."""

    whole: Classified
    parts: dict[str, Classified]
    source: str
    floors: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)


def _read(
    a: Recording, b: Recording, index: int, world_size: int, micro_batches: int,
    floored: tuple[str, Recording, float] | None = None,
) -> _Read:  # fmt: skip
    """Update ``index``'s gradient of B against A's, from the full gradients where both hold
    them, else from the sketches and exact norms; with ``floored`` (the precision and the floor
    recording C), in floors of C's departure from A at the same update (docs/checking.md §6,
    "Comparing two recordings": the relative departures are then L2, ‖g − g₁‖ / ‖g₁‖)."""
    parts = a.parts
    full_a, full_b = a.full_gradient(index), b.full_gradient(index)
    full_c = floored[1].full_gradient(index) if floored else None
    if full_a is not None and full_b is not None and (floored is None or full_c is not None):
        full_a, full_b = full_a.double(), full_b.double()
        if floored is None:
            whole = gradients.classify(full_b, full_a, world_size, micro_batches)
            split = gradients.classify_parts(full_b, full_a, a.layout(), world_size,
                                             micro_batches)  # fmt: skip
            return _Read(whole, split, FULL)
        pieces = {ALL_PARTS: (full_b, full_a, full_c.double())}
        if len(parts) > 1:
            layout = a.layout()
            split = [gradients.split(g, layout) for g in (full_b, full_a, full_c.double())]
            pieces |= {part: tuple(s[part] for s in split) for part in parts}
        limit = floored[2]
        whole = classify_floored(*pieces.pop(ALL_PARTS), floored[0], world_size, micro_batches,
                                 threshold=limit)  # fmt: skip
        reading = {ALL_PARTS: whole} | {
            name: classify_floored(*vectors, floored[0], world_size, micro_batches, whole.floor,
                                   limit)
            for name, vectors in pieces.items()
        }  # fmt: skip
        return _floored_read(reading, FULL)
    theirs, mine = a.updates[index], b.updates[index]
    named = {ALL_PARTS: parts} | ({part: [part] for part in parts} if len(parts) > 1 else {})
    if floored is None:
        reading = {
            name: gradients.classify_sketched(
                _sketch(mine, group), _sketch(theirs, group), _whole_norm(mine, group),
                _whole_norm(theirs, group), world_size, micro_batches,
            )
            for name, group in named.items()
        }  # fmt: skip
        whole = reading.pop(ALL_PARTS)
        return _Read(whole, reading, SKETCH)
    perturbed = floored[1].updates[index]

    def read(group: Sequence[str], least: float = 0.0) -> Floored:
        return classify_sketched_floored(
            (_sketch(mine, group), _sketch(theirs, group), _sketch(perturbed, group)),
            (_whole_norm(mine, group), _whole_norm(theirs, group)), floored[0], world_size,
            micro_batches, least, floored[2],
        )  # fmt: skip

    whole = read(named.pop(ALL_PARTS))
    reading = {ALL_PARTS: whole} | {name: read(group, whole.floor) for name, group in named.items()}
    return _floored_read(reading, SKETCH)


def _floored_read(reading: dict[str, Floored], source: str) -> _Read:
    classes = {name: as_classified(numbers) for name, numbers in reading.items()}
    return _Read(
        classes.pop(ALL_PARTS), classes, source,
        {name: (numbers.floor, numbers.floors) for name, numbers in reading.items()},
    )  # fmt: skip


def _updates_table(
    a: Recording, b: Recording, world_size: int, micro_batches: int,
    floored: tuple[str, Recording, float] | None = None,
) -> tuple[pd.DataFrame, list[_Read]]:  # fmt: skip
    """The rows of ``updates.csv`` (`UPDATE_COLUMNS`, and `FLOOR_COLUMNS` judged in floors)
    and each update's reading."""
    rows, reads = [], []
    for theirs, mine in zip(a.updates, b.updates, strict=True):
        reading = _read(a, b, theirs.index, world_size, micro_batches, floored)
        reads.append(reading)
        for part, numbers in [(ALL_PARTS, reading.whole), *reading.parts.items()]:
            rows.append((theirs.index, part, str(numbers.gradient), numbers.cosine,
                         numbers.norm_ratio, numbers.max_rel_err, reading.source, theirs.loss,
                         mine.loss, *reading.floors.get(part, ())))  # fmt: skip
    columns = UPDATE_COLUMNS + (FLOOR_COLUMNS if floored else ())
    return pd.DataFrame(rows, columns=list(columns)), reads


_NOT_DEPARTING = (EXACT, terms.NOT_JUDGED)  # a class below the ceiling is not judged (`_ceiling`)


def _departing_at(rows: list[Row], departure: tuple[int, str] | None) -> list[Row]:
    """The rows with the first update and part that depart (``departure``; None: unchanged)."""
    if departure is None:
        return rows
    return [dataclasses.replace(r, first_update=departure[0], first_part=departure[1])
            for r in rows]  # fmt: skip


def _later_not_judged(
    rows: list[Row], departure: tuple[int, str] | None, updates: pd.DataFrame, threshold: float
) -> tuple[list[Row], tuple[int, str] | None]:
    """Judged in floors, a B within them at update 0 that departs later (``diverges``) is ``not
    judged``: one floor recording cannot tell that from rounding that training amplified; its
    departure is then the first update where anything leaves the floors (a gradient's
    `_first_beyond_floors` before its loss)."""
    rows = [dataclasses.replace(r, verdict=terms.NOT_JUDGED, in_precision=terms.NOT_JUDGED)
            if r.verdict == terms.DIVERGES else r for r in rows]  # fmt: skip
    beyond = _first_beyond_floors(updates, threshold)
    if rows[0].verdict == terms.NOT_JUDGED and departure and beyond < departure[0]:
        departure = (beyond, ALL_PARTS)
        rows = _departing_at(rows, departure)
    return rows, departure


def _with_part_alone(
    rows: list[Row], first: _Read, floored: tuple[str, Recording, float] | None,
    measured: dict[str, Any],
) -> tuple[list[Row], tuple[str, str, str] | None]:  # fmt: skip
    """The rows with the whole's verdict of a part beyond its floors beside a whole within them
    (`_part_alone`), its words in ``measured`` (``not_judged``); and that part, or None."""
    alone = _part_alone(rows[0].verdict, first, floored)
    if alone is None:
        return rows, None
    measured["not_judged"] = alone[2]
    return [dataclasses.replace(r, verdict=alone[1], in_precision=alone[1])
            if r.part == ALL_PARTS else r for r in rows], alone  # fmt: skip


def _part_alone(
    verdict: str, first: _Read, floored: tuple[str, Recording, float] | None
) -> tuple[str, str, str] | None:
    """Judged in floors with the whole first gradient within them (``verdict`` `WITHIN`): the
    part furthest beyond its own floors there, if one is, the whole's verdict that gives, and
    its words. ``biased`` where the part departs beyond any rounding of the precision
    (`floor.beyond_rounding`, the ceiling a correct run's part never reached); else ``not
    judged``: one floor recording cannot tell a part that departs this little from its rounding
    (a user's MoE router 31.7 floors apart, 0.07 relative, read `exact within bf16` beside its
    whole at 3.9)."""
    if floored is None or verdict not in WITHIN:
        return None
    departing = {part: numbers for part, numbers in first.parts.items()  # NaN: no gradient
                 if numbers.gradient not in _NOT_DEPARTING
                 and first.floors[part][1] > floored[2]}  # fmt: skip
    if not departing:
        return None
    part = max(departing, key=lambda name: first.floors[name][1])
    precision, departure = floored[0], departing[part].max_rel_err
    if beyond_rounding(departure, precision):
        return part, terms.GradientClass.BIASED, ""
    words = diagnosis.PART_NOT_JUDGED.format(
        part=part, floors=first.floors[part][1], departure=departure,
        ceiling=rounding_resolution(precision), word=terms.Precision(precision).word,
    )  # fmt: skip
    return part, terms.NOT_JUDGED, words


def _first_beyond_floors(updates: pd.DataFrame, threshold: float) -> int | float:
    """The first update whose whole gradient is beyond ``threshold`` floors of its own floor
    (`updates.csv`'s ``floors``), inf where none is: a later update's gradient judges nothing
    (`_departure`), but where B is not judged it is said where it first leaves them."""
    whole = updates[(updates["part"] == ALL_PARTS) & (updates["floors"] > threshold)]
    return int(whole["update"].min()) if len(whole) else math.inf


def _departure(
    a: Recording,
    b: Recording,
    reads: Sequence[_Read],
    tolerance: float,
    scale: float | None,
    floored: bool = False,
) -> tuple[int, str] | None:
    """The first update whose loss (divided by ``scale``) or gradient departs from A's, and the
    first part that departs there (``all``: the loss alone, or a gradient of one part). Judged
    in floors (``floored``), only update 0's gradient is (in floors, as the verdict's): later
    updates compare gradients at weights that rounding has moved apart in B and in the floor
    recording alike, by amounts of their own, and are held through their losses."""
    factor = scale if scale is not None and not math.isnan(scale) else 1.0
    for reading, theirs, mine in zip(reads, a.updates, b.updates, strict=True):
        judged = not floored or theirs.index == a.updates[0].index
        if judged and reading.whole.gradient not in _NOT_DEPARTING:  # the whole if parts agree
            alike = all(n.gradient == reading.whole.gradient for n in reading.parts.values())
            departing = (p for p, numbers in reading.parts.items()
                         if numbers.gradient not in _NOT_DEPARTING)  # fmt: skip
            return theirs.index, ALL_PARTS if alike else next(departing, ALL_PARTS)
        if abs(mine.loss / factor - theirs.loss) > tolerance:
            return theirs.index, ALL_PARTS
    return None


# --- the ranks' own gradients -------------------------------------------------------------------


def _unreduced(a: Recording, b: Recording, precision: str) -> tuple[list[str], dict[str, str]]:
    """B's parts whose gradient differs between its ranks (recorded per rank, `Update.unreduced`)
    and the words the diagnosis adds: at which updates, and whether their mean over the ranks is
    A's gradient (then reducing it is the fix): to float64's tolerance, or in a low precision
    within its rounding (`floor.ROUNDING_CEILING` unit roundoffs, beyond which a departure is
    judged without a floor: a mean 1.4 unit roundoffs of float32 from A's is A's to rounding)."""
    unit = terms.Precision(precision).unit_roundoff
    within = (gradients.FLOAT64_TOLERANCE if precision == terms.Precision.FLOAT64
              else ROUNDING_CEILING.get(terms.Precision(precision), 0.0) * unit)  # fmt: skip
    seen: dict[str, list[int]] = {}
    for update in b.updates:
        for part in update.unreduced:
            seen.setdefault(part, []).append(update.index)
    if not seen:
        return [], {}
    parts = [part for part in b.parts if part in seen]
    first = min(seen[parts[0]])
    where = []
    for part in parts:
        count = len(seen[part])
        every = count == len(b.updates)
        where.append("at every update" if every else
                     f"at {count} of {len(b.updates)} updates, from {min(seen[part])}")  # fmt: skip
    said = [_reduced_words(a, b, part, b.updates[first] if first in seen[part] else
                           b.updates[min(seen[part])], precision, within)
            for part in parts]  # fmt: skip
    mean_words = [words for words, _ in said]
    kinds = {kind for _, kind in said}
    apart = next((u for u in b.updates if u.copies_apart), None)
    if apart is not None:  # named from the copies themselves, without A
        mean_words.insert(0, f"Copies that differ in B's whole gradient of update {apart.index}: "
                             + held.listed(apart.copies_apart) + ".")  # fmt: skip
    if b.row_groups and _PARTIALS not in kinds:
        groups = ", ".join(str(group) for group in b.row_groups)  # not measured: the usual causes
        mean_words.append(diagnosis.TENSOR_PARALLEL_PARTIAL.format(groups=groups))
    at = [w if len(parts) == 1 else f"{p} {w}" for p, w in zip(parts, where, strict=True)]
    measured = {
        "unreduced_source": "from the recording",
        "unreduced": ", ".join(parts),
        "unreduced_updates": "; ".join(at) + ", each rank's own sketch of it recorded",
        "unreduced_mean": " ".join(mean_words),
    }
    if b.row_groups:  # DDP's mean is no fix there: the words above say what is
        measured["unreduced_fix"] = ""
    elif b.header.get("optimizer_wrapper") == _ZERO:  # each rank steps its own shard
        measured["unreduced_fix"] = diagnosis.ZERO_UNREDUCED_FIX
    return parts, measured


_ZERO = "ZeroRedundancyOptimizer"  # the wrapper's name as the recorder writes it


# What a part's gradients over B's ranks are, measured (`_reduced_words`).
_COPIES, _PARTIALS, _MEAN = "copies", "partials", "mean"


def _reduced_words(
    a: Recording, b: Recording, part: str, update: Any, precision: str, within: float
) -> tuple[str, str]:
    """What reducing ``part``'s gradient at ``update`` over B's ranks would give, in words, and
    what was measured (`_COPIES`, `_PARTIALS`, `_MEAN`): a sum over the ranks that hold copies
    of it (`_copies_summed`), a sum over each tensor-parallel group (`_partials_summed`), or the
    mean over the ranks, A's (within ``within``: reducing it is the fix) or not."""
    views = update.unreduced[part]
    reference = np.asarray(a.updates[update.index].sketches[part])
    summed = _copies_summed(b, views, reference)
    if summed is not None:
        return summed.format(part=part, update=update.index), _COPIES
    partials = _partials_summed(b, views, reference, within)
    if partials is not None:
        groups = ", ".join(str(group) for group in b.row_groups)
        return diagnosis.TENSOR_PARALLEL_SUMMED.format(
            part=part, update=update.index, error=partials, groups=groups), _PARTIALS  # fmt: skip
    mean = np.asarray(views).mean(axis=0)
    error = float(np.linalg.norm(mean - reference) / max(np.linalg.norm(reference), 1e-300))
    if error > within:
        return (f"The mean over the ranks of {part}'s gradients is not A's either (update "
                f"{update.index}, relative difference {error:.3g} of the sketches): reducing it "
                "alone does not make it A's.", _MEAN)  # fmt: skip
    unit, word = terms.Precision(precision).unit_roundoff, terms.Precision(precision).word
    rounding = ("" if precision == terms.Precision.FLOAT64 else
                f", {error / unit:.2g} unit roundoffs of {word}")  # fmt: skip
    return (f"The mean over the ranks of {part}'s gradients is A's (update {update.index}, "
            f"relative difference {error:.2g} of the sketches{rounding}): reducing it is the "
            "fix.", _MEAN)  # fmt: skip


def _partials_summed(
    b: Recording, views: np.ndarray, reference: np.ndarray, within: float
) -> float | None:
    """Where B is tensor-parallel (its ``row_groups``), the relative difference from A's of the
    largest of each group's sum of its ranks' gradients of a part, where every group's sum is A's
    (within ``within``): each rank held a partial gradient of a weight the group replicates (a
    norm under sequence parallelism, its input the rank's shard of the sequence). None
    otherwise."""
    if not b.row_groups:
        return None
    views = np.asarray(views)
    norm = max(float(np.linalg.norm(reference)), 1e-300)
    errors = [float(np.linalg.norm(views[list(group)].sum(axis=0) - reference)) / norm
              for group in b.row_groups if max(group) < len(views)]  # fmt: skip
    return max(errors) if errors and max(errors) <= within else None


def _copies_summed(b: Recording, views: np.ndarray, reference: np.ndarray) -> str | None:
    """Where B's ranks hold different parameters (pipeline stages, experts: its header's
    ``held``) and a part's copies hold distinct gradients whose sum is A's, the words that say so
    (placeholders ``part`` and ``update``): the copies of a weight one device ties, each given
    the share of one device's gradient that reaches its stage, not summed. None otherwise."""
    if not b.header.get("held"):
        return None
    distinct: list[np.ndarray] = []
    for view in np.asarray(views):
        if not any(np.array_equal(view, seen) for seen in distinct):
            distinct.append(view)
    if len(distinct) < 2:
        return None
    total = np.sum(distinct, axis=0)
    error = float(np.linalg.norm(total - reference) / max(np.linalg.norm(reference), 1e-300))
    if error > _COPIES_SUMMED:
        return None
    return (f"{{part}}'s copies on B's ranks hold {len(distinct)} different gradients whose sum is "
            f"A's (update {{update}}, relative difference {error:.2g} of the sketches): a weight "
            "one device ties, held on several stages, each copy given the share of the gradient "
            "that reaches its stage; summing them over the ranks that hold them "
            "(dist.all_reduce of its gradient on a group of those ranks) is the fix.")  # fmt: skip


def _copies_apart(b: Recording, rows: list[Row]) -> list[Row]:
    """Where B's ranks hold different parameters and the copies of one differ in its whole
    gradient (`Update.copies_apart`, named from the copies alone), an ``unreduced`` cause is
    ``copies_apart``, the copies its words (``departs``), as the check names a pipeline's
    (docs/checking.md §10, "Pipeline parallelism")."""
    apart = next((u.copies_apart for u in b.updates if u.copies_apart), None)
    if not apart or not b.header.get("held"):
        return rows
    return [dataclasses.replace(r, cause=str(terms.Cause.COPIES_APART), departs=held.listed(apart))
            if r.cause == terms.Cause.UNREDUCED else r for r in rows]  # fmt: skip


def _held_gradients(a: Recording, b: Recording, rows: list[Row]):
    """Where B's ranks hold different parameters and its first row departs with no cause yet:
    each parameter's holders in B, and B's and A's whole first gradients per parameter (float64);
    None elsewhere."""
    held = b.header.get("held")
    if not held or rows[0].verdict in (EXACT, *WITHIN) or rows[0].cause:
        return None
    mine, theirs = b.full_gradient(0), a.full_gradient(0)
    if mine is None or theirs is None:
        return None
    holders: dict[str, set[int]] = {}
    for rank, names in enumerate(held):
        for name in names:
            holders.setdefault(name, set()).add(rank)
    sizes = [math.prod(p["shape"]) for p in b.header["parameters"]]
    names = [p["name"] for p in b.header["parameters"]]
    own = dict(zip(names, mine.double().split(sizes), strict=True))
    one = dict(zip([p["name"] for p in a.header["parameters"]],
                   theirs.double().split([math.prod(p["shape"]) for p in a.header["parameters"]]),
                   strict=True))  # fmt: skip
    return holders, own, one


def _caused(rows: list[Row], cause: terms.Cause, words: str) -> list[Row]:
    """The departing rows with no cause given ``cause`` and ``words`` (``departs``)."""
    return [dataclasses.replace(r, cause=str(cause), departs=words)
            if r.verdict not in (EXACT, *WITHIN) and not r.cause else r
            for r in rows]  # fmt: skip


def _experts_mixed(a: Recording, b: Recording, rows: list[Row]) -> list[Row]:
    """Where B's ranks hold different parameters and two of them, held by different ranks (two
    experts), got one gradient (not zero; equal to ``_MIXED`` of its largest entry) in B's whole
    first gradient where A's differ, the departing rows' cause is ``experts_mixed``, those two
    its words (``departs``): each expert's gradient was reduced with other experts', over ranks
    that hold other experts at its place, as the check names it (`gatherlab.check.experts`)."""
    found = _held_gradients(a, b, rows)
    if found is None:
        return rows
    holders, own, one = found
    names = list(own)
    for i, name in enumerate(names):
        for other in names[i + 1 :]:
            if own[name].shape != own[other].shape or holders[name] & holders[other]:
                continue
            scale = float(one[name].abs().max()) or 1.0
            same = float((own[name] - own[other]).abs().max()) <= _MIXED * scale
            apart = float((one[name] - one[other]).abs().max())
            if same and float(own[name].abs().max()) > _MIXED * scale and apart > _MIXED * scale:
                return _caused(rows, terms.Cause.EXPERTS_MIXED, (
                    f"{name} on rank {min(holders[name])} and {other} on rank "
                    f"{min(holders[other])}, two experts, got one gradient, where one device's "
                    f"differ by {apart / scale:.2g} (max relative difference)"
                ))  # fmt: skip
    return rows


def _experts_scaled(a: Recording, b: Recording, rows: list[Row]) -> list[Row]:
    """Where B's ranks hold different parameters, its parameters every rank holds are A's in its
    whole first gradient and those some ranks hold alone (the experts) are one constant c ≠ 1
    times A's, to ``_SCALED_TOLERANCE`` (`experts.scaled`, the check's rule), the departing
    rows' cause is ``experts_scaled``: the experts' reduction divides by another
    count, as the check names it (`gatherlab.check.experts`; c = E, the expert groups, where
    their replicas' average leaves E times one device's)."""
    found = _held_gradients(a, b, rows)
    if found is None:
        return rows
    holders, own, one = found
    everyone = set().union(*holders.values())
    experts = [name for name in own if holders[name] != everyone]
    if len(experts) == len(own):  # no parameter every rank holds: nothing to hold them against
        return rows
    replicated = torch.cat([torch.full((len(own[n]),), holders[n] == everyone) for n in own])
    words = scaled(torch.cat(list(own.values())), torch.cat([one[n] for n in own]), replicated,
                   experts, len({frozenset(holders[name]) for name in experts}),
                   _SCALED_TOLERANCE, 1 - _SCALED_TOLERANCE)  # fmt: skip
    return rows if words is None else _caused(rows, terms.Cause.EXPERTS_SCALED, words)


_LOSS_ROUNDING = 64
"""Unit roundoffs of a loss's own dtype (relative to A's largest loss) within which two layouts'
losses are one loss rounded: a mean of n values in torch's cascaded sums rounds by a few log2(n)
unit roundoffs (a float64 job's float32 loss: 3e-8 apart, 0.6 of float32's unit roundoff, at
W = 2 in a user's Lightning job whose gradients agreed to 2.5e-16)."""


_MIXED = 1e-6
"""How close two experts' gradients must be in B (of one device's largest entry) to be one
gradient: float32's sums over the ranks (an all-reduce of two experts' gradients gives both the
same bits, 0 measured in ``ep.py --bug averaged``; one device's two experts there differ by 1.4
of the largest entry)."""


_SCALED_TOLERANCE = 1e-4
"""How close B's parameters every rank holds must be to A's (of A's largest entry), how far the
experts' norm ratio from 1 and how parallel their gradient (1 − cosine), for the comparison to
name the experts' gradient scaled (`experts.scaled`): beside float64's 1e-10, float32's rounding
of the same sums in other orders (~1e-7)."""


_COPIES_SUMMED = 1e-4
"""How close the sum of a part's distinct copies must be to A's gradient (relative, of the
sketches) for the comparison to name unsummed tied copies: beside float64's 1e-10, the rounding
of float32's sums over micro-batches (1.3e-7 measured on ``examples/jobs/pp.py --bug untied``
against one device, where its copies' differences from A's are 0.57 and 0.83)."""


# --- the comparison -----------------------------------------------------------------------------


def _untraceable(empty: list[str]) -> str:
    """Why no line is named where runs recorded with trace=True hold an empty trace (``empty``:
    ``A``, ``B`` or both): the recorder said why as it recorded each."""
    held = ("both runs were recorded with trace=True and their traces hold" if len(empty) == 2
            else f"{empty[0]} was recorded with trace=True and its trace holds")  # fmt: skip
    return (
        f"no line named: {held} no operation: the recorder said why as it recorded (a loss not "
        "computed from the model's calls with gradients, as a cached, GradCache-style loss's; "
        "calls that give DTensors, as tensor parallelism's), which a trace cannot follow"
    )


def _where(
    a: Recording, b: Recording, tolerance: float, micro_batches: int, floored: bool
) -> Callable[[], where.Departure | None] | None:
    """Where B's first update departs from A's, as the check names it (`check.where`), when both
    recorded a trace of it (``trace.pt``) and B has ranks: A's one device's records against each
    of B's ranks'. One device's global batch is A's rows of update 0, divided by the number of
    blocks its forward concatenates (two views: 2) where B's order shows them. Where a trace was
    recorded but no line can be read from it, why (`where.unlocated`; a trace recorded empty:
    `_untraceable`); None where neither run traced."""
    ones, ranks = a.trace(), b.trace()
    if ones is None and ranks is None:
        return None
    empty = [name for name, held in (("A", ones), ("B", ranks))
             if held is not None and not (held and all(held))]  # fmt: skip
    why = None
    if empty:
        why = _untraceable(empty)
    elif (ones is None) != (ranks is None):
        traced = "A" if ranks is None else "B"
        why = (f"no line named: only {traced} traced its first update; record "
               f"{'B' if traced == 'A' else 'A'} with trace=True too")  # fmt: skip
    elif a.world_size != 1:
        why = f"no line named: A ran on {a.world_size} ranks, and a line is read against one device"
    elif b.world_size < 2:
        why = "no line named: B ran on one device, whose trace is not read against ranks"
    elif floored:
        why = (
            "no line named: in a low precision every result parts by rounding; record both "
            "runs in float64 with trace=True to name the line"
        )
    if why is not None:
        return lambda: where.unlocated(why)
    first_a, first_b = a.updates[0], b.updates[0]
    rows = [row for rank in first_a.rows for row in rank]
    count = batches.blocks(rows, first_b.rows) or 1
    batch = len(rows) // count
    calls_a, calls_b = (first_a.calls or [count])[0], [c for c in first_b.calls or [] if c]
    if micro_batches == 1 and (calls_a not in (1, count) or any(c != calls_a for c in calls_b)):
        why = (f"no line named: A's first update called its model's forward {calls_a} times and "
               f"B's ranks {', '.join(map(str, calls_b))} times (chunks), and a trace reads the "
               "rows given call against call (each of A's calls one block of its batch, each "
               "rank's call its part of it); the rows are judged by their digests")  # fmt: skip
        return lambda: _not_of_the_rows(
            where.departure(ones[0], ranks, b.world_size, batch, tolerance), why
        )
    if micro_batches > 1:  # rank 0's first micro-batch: the first of W·K blocks of A's rows
        return lambda: where.departure(ones[0], ranks[:1], b.world_size * micro_batches, batch,
                                       tolerance)  # fmt: skip
    return lambda: where.departure(ones[0], ranks, b.world_size, batch, tolerance)


def _not_of_the_rows(found: where.Departure | None, why: str) -> where.Departure | None:
    """A trace's departure where A's and B's calls do not align (`_where`): one about the rows
    given (their values or order) is read from calls that hold other rows, so it is ``why``
    unlocated; any other stands."""
    if found is not None and found.kind in (terms.DepartureKind.INPUT, terms.DepartureKind.ORDER):
        return where.unlocated(why)
    return found


def _trained(recording: Recording, full: bool, unlossed: set[int]) -> runfiles.Trained:
    """A recording as the judge takes a trained run: each update's global loss (0 at the updates
    ``unlossed``, where either recording has none), update 0's full gradient (``full``) or its
    parts' sketches concatenated, the final weights' sketches."""
    parts = recording.parts
    if full:
        first = recording.full_gradient(0).double()
    else:
        first = torch.from_numpy(_sketch(recording.updates[0], parts).copy())
    weights = torch.from_numpy(np.concatenate([recording.weights_sketch[p] for p in parts]))
    losses = [0.0 if u.index in unlossed else u.loss for u in recording.updates]
    return runfiles.Trained(losses, first, weights.double())


def _sketch_layout(recording: Recording) -> Layout:
    """The parts of the concatenated sketches: part i holds entries i·k … (i + 1)·k."""
    k = recording.k
    return {part: [(i * k, (i + 1) * k)] for i, part in enumerate(recording.parts)}


def _describe(recording: Recording, name: str) -> str:
    """A recording in one line: its world size, updates, precision, k, and the rows each rank
    records per update (the first tensor of each call of the model's forward, or of each batch a
    trainer gives: two calls, one per view, hold twice the batch's rows)."""
    described = (f"{name} {recording.path} (W = {recording.world_size}, {len(recording.updates)} "
                 f"updates, {recording.precision}, k = {recording.k}")  # fmt: skip
    first = recording.updates[0] if recording.updates else None
    if first is None or not first.rows or not first.rows[0]:
        return described + ")"
    calls = first.calls[0] if first.calls else None
    batches = recording.header.get("settings", {}).get("trainer") == "lightning"  # its batches'
    called = "" if not calls else (
        f", from {calls} batch{'es' if calls > 1 else ''} its trainer gave" if batches
        else f", from {calls} call{'s' if calls > 1 else ''} of its model's forward"
    )  # fmt: skip
    if recording.row_groups:  # tensor parallelism: each group's rows once, by its first rank
        groups = ", ".join(str(group) for group in recording.row_groups)
        return described + (f"; {len(first.rows[0])} rows per tensor-parallel group ({groups}, "
                            f"its rows counted once) and update{called})")  # fmt: skip
    return described + f"; {len(first.rows[0])} rows per rank and update{called})"


def _outside_notes(recording: Recording) -> list[str]:
    """A note for each parameter the optimizer updates outside the model and the loss that the
    job did not name (its part ``optimizer.<group>.<index>``), with its shape."""
    return [
        f"note: part {p['name']} is a parameter of shape {p['shape']} that the optimizer updates "
        "outside the model and the loss; gatherlab.record(..., names={'NAME': parameter}) names it"
        for p in recording.header["parameters"] if p["name"].startswith("optimizer.")
    ]  # fmt: skip


def compare_recordings(
    reference: str | Path | Recording,
    run: str | Path | Recording,
    *,
    tolerance: float | None = None,
    floor: str | Path | Recording | None = None,
) -> Comparison:
    """Recording ``run`` (B) against ``reference`` (A, normally the one-device run), in the order
    of the module's docstring. ``tolerance``: the largest |Δloss| of an update and |Δ| of the
    final weights' sketches (absolute; default the precision's, `gradients.TOLERANCE`); the
    gradients' classes keep the bounds of docs/design.md §1. ``floor``: in a low precision, a
    recording of one device with its forward in row blocks (``GATHERLAB_RECORD_FLOOR``,
    `gatherlab.record.in_row_blocks`): update 0's gradient is judged in floors of its departure
    from A, every update's loss and the final weights to T times its largest departure of either
    (docs/design.md §2, "Low precision"; docs/checking.md §6), the verdict ``exact within bf16``
    where float64's bounds would say ``other``. In a low precision without one, the verdict is ``not
    judged`` (status 3) with the command that records one, unless the data differs, the first
    gradient or loss departs beyond any rounding (`_ceiling`), or B's every number is A's to the
    last bit (`_identical`: ``exact``).

    Raises:
        RecordingError: a directory that is no finished recording of a version this gatherlab
            reads (`gatherlab.recording.format.read`).
        NotComparable: the recordings' models or settings differ.
    """
    a, b = recording(reference), recording(run)
    _same_model(a, b)
    _same_settings(a, b)
    floored, set_aside = _floored(a, b, floor)
    precision = _judged(a)
    if tolerance is None:
        tolerance = gradients.TOLERANCE.get(precision, gradients.FLOAT64_TOLERANCE)
    world_size, micro_batches = b.world_size, _micro_batches(a, b)
    data = batches.compare_batches(a, b)
    data = dataclasses.replace(data, notes=(*data.notes, *set_aside))
    named_k = _own_micro_batches(b)
    updates, reads = _updates_table(a, b, world_size, named_k, floored)
    rounded = floored is None and precision != terms.Precision.FLOAT64  # no floor to judge by
    ceiling, identical = None, False
    if rounded and data.update is None:
        ceiling = _ceiling(a, b, reads[0], precision, named_k)
        identical = ceiling is None and _identical(a, b)
    if ceiling is not None:  # departing beyond any rounding: update 0 judged without a floor
        reads[0] = ceiling[0]
        updates = _ceiling_updates(updates, ceiling[0])
        tolerance = ceiling[1] * max(abs(a.updates[0].loss), 1e-300)
    unreduced, desync, measured = _measured(a, b, precision, data, micro_batches, floored)
    data, unlossed, rounding = _losses_noted(a, b, data, floored is not None or ceiling is not None)
    rows, tolerance = _rows(a, b, reads, data, (floored, ceiling), (unreduced, desync, unlossed),
                            (tolerance, rounding), micro_batches)  # fmt: skip
    rows = _copies_apart(b, rows)
    rows = _experts_scaled(a, b, _experts_mixed(a, b, rows))
    rows, alone = _with_part_alone(rows, reads[0], floored, measured)
    judged = (floored is not None or ceiling is not None or precision == terms.Precision.FLOAT64
              or data.update is not None or identical)  # fmt: skip
    departure = None
    if judged:
        departure = _departure(a, b, reads, tolerance, rows[0].scale,
                               floored is not None or ceiling is not None)  # fmt: skip
        if desync is not None and (departure is None or desync[0] < departure[0]):
            departure = (desync[0], desync[1][0])  # the ranks part before B parts from A
        if alone is not None and departure is None:
            departure = (0, alone[0])
    rows = _departing_at(rows, departure)
    if rounded and ceiling is None and not identical:  # rounding cannot be told from departing
        rows, updates = _not_judged(rows, updates, verdict=not judged)
    if floored is not None and desync is None:  # departing only later: rounding amplified?
        rows, departure = _later_not_judged(rows, departure, updates, floored[2])
    table = frame(rows, COMPARISON_COLUMNS + (PRECISION_COLUMNS if floored else ()))
    status = (0 if trains_like_one_device(table) else 1 if judged
              and rows[0].verdict != terms.NOT_JUDGED else terms.NOT_JUDGED_STATUS)  # fmt: skip
    said = _Said(table, updates, data, departure, measured, tolerance, desync,
                 floored[2] if floored else threshold(2, 1),
                 None if ceiling is None else (precision, ceiling[1]), identical,
                 bool(set_aside))  # fmt: skip
    words = _words(a, b, said) if judged else _not_judged_words(a, b, said, reads[0], precision)
    return Comparison(
        table=table, updates=updates, verdict=rows[0].verdict, status=status, words=words,
        data=data.words, notes=data.notes, departure=departure, reference=a.path, run=b.path,
        threshold=floored[2] if floored else None,
    )  # fmt: skip


def _floored(
    a: Recording, b: Recording, floor: str | Path | Recording | None
) -> tuple[tuple[str, Recording, float] | None, tuple[str, ...]]:
    """The floor recording as `_floor` reads it, or None: without one, or where it is no floor
    of rounding (`_no_rounding_floor`), then with the note that says so; and the note that its
    calls do not span B's (`_calls_unspanned`), where it is judged by."""
    if floor is None:
        return None, ()
    floored, unspanned = _floor(a, b, recording(floor))
    set_aside = _no_rounding_floor(a, floored)
    if set_aside is not None:
        return None, (set_aside,)
    return floored, () if unspanned is None else (unspanned,)


def _no_rounding_floor(a: Recording, floored: tuple[str, Recording, float]) -> str | None:
    """The note that sets the floor recording C aside, where C's first gradient departs from A's
    beyond any rounding of the precision (`floor.beyond_rounding`, the relative L2 departure, as
    `_ceiling` reads B's): C is then no perturbation of rounding but of something the row blocks
    change otherwise (a dropout mask), and T times it would let any departure through; None
    where C is a floor."""
    precision, c = floored[0], floored[1]
    full_a, full_c = a.full_gradient(0), c.full_gradient(0)
    if full_a is not None and full_c is not None:
        departure = relative(full_c.double(), full_a.double())
    else:
        departure = _read(a, c, 0, 1, 1).whole.max_rel_err
    if not beyond_rounding(departure, precision):
        return None
    return diagnosis.NO_ROUNDING_FLOOR.format(
        floor=c.path, departure=departure, word=terms.Precision(precision).word,
        ceiling=rounding_resolution(precision),
    )  # fmt: skip


def _identical(a: Recording, b: Recording) -> bool:
    """Whether B's every recorded number is A's to the last bit (in a low precision without a
    floor, which then needs none: no rounding departs by 0): each update's global loss (where
    either recorded one), each part's sketch and norm, none unreduced, the first updates' whole
    gradients where both kept them, and the final weights' sketches and norms (a job launched
    with ``torchrun --nproc-per-node 1`` against ``python``, or run twice)."""
    weights = (np.array_equal(a.weights_sketch[p], b.weights_sketch[p]) for p in a.parts)
    if a.weights_norms != b.weights_norms or not all(weights):
        return False
    for x, y in zip(a.updates, b.updates, strict=True):
        unrecorded = math.isnan(x.loss) and math.isnan(y.loss)  # no loss in either: not compared
        if (x.loss != y.loss and not unrecorded) or x.norms != y.norms or y.unreduced or any(
                not np.array_equal(x.sketches[p], y.sketches[p]) for p in a.parts):  # fmt: skip
            return False
    for update in range(min(a.full_updates, b.full_updates)):
        if not torch.equal(a.full_gradient(update), b.full_gradient(update)):
            return False
    return True


def _not_judged(
    rows: list[Row], updates: pd.DataFrame, verdict: bool
) -> tuple[list[Row], pd.DataFrame]:
    """A low precision without a floor recording, and no departure beyond its rounding: no class
    and no forward (and, unless the data differs, no ``verdict``: `terms.NOT_JUDGED`)."""
    unjudged = {"forward": terms.NOT_JUDGED, "gradient": terms.NOT_JUDGED}
    if verdict:
        unjudged |= {"verdict": terms.NOT_JUDGED, "first_diff_step": None}
    return ([dataclasses.replace(r, **unjudged) for r in rows],
            updates.assign(gradient=terms.NOT_JUDGED))  # fmt: skip


def _rows(
    a: Recording, b: Recording, reads: list[_Read], data: batches.Batches,
    low: tuple[tuple[str, Recording, float] | None, tuple[_Read, float] | None],
    measured: tuple[list[str], tuple[int, list[str]] | None, set[int]],
    tolerances: tuple[float, float], micro_batches: int,
) -> tuple[list[Row], float]:  # fmt: skip
    """The judge's rows of B against A (`judge.judge`) and the tolerance of their losses: in
    floors of the floor recording (``low[0]``), or, beyond rounding without one (``low[1]``,
    `_ceiling`), with the classes read at the ceiling and a forward within it not judged."""
    (floored, ceiling), (unreduced, desync, unlossed) = low, measured
    tolerance, rounding = tolerances  # the losses' own rounding (`_loss_rounding`) beside it
    full = reads[0].source == FULL
    key = Row(loss=str(b.path), gather="native", world_size=b.world_size, reference=str(a.path),
              micro_batches=micro_batches)  # fmt: skip
    in_precision = None
    if floored is not None:
        in_precision = InPrecision(floored[0], _trained(floored[1], full, unlossed),
                                   blocks=max(floored[1].row_blocks, FLOOR_ROW_BLOCKS),
                                   threshold=floored[2])  # fmt: skip
        tolerance = in_precision.tolerance(_trained(a, full, unlossed), b.world_size)
    given = (reads[0].whole, reads[0].parts)  # its factors named by B's own K (`_read`)
    rows = judge(
        _trained(b, full, unlossed), _trained(a, full, unlossed), key, tolerance=tolerance,
        layout=a.layout() if full else _sketch_layout(a),
        recorded=Recorded(given, unreduced, data.update is not None, in_precision,
                          () if desync is None else desync[1], loss_rounding=rounding,
                          rows_statistic=True),
        where=None if data.update is not None else _where(
            a, b, tolerance, micro_batches, floored is not None or ceiling is not None),
    )  # fmt: skip
    if ceiling is not None:  # within the ceiling nothing is told without a floor
        rows = [dataclasses.replace(r, forward=terms.NOT_JUDGED) if r.forward == Forward.SAME
                else r for r in rows]  # fmt: skip
    return rows, max(tolerance, rounding)


def _losses_noted(
    a: Recording, b: Recording, data: batches.Batches, floored: bool
) -> tuple[batches.Batches, set[int], float]:
    """What the losses allow: the updates either recording has no loss at (``unlossed``: their
    losses not compared) and the losses' own rounding (`_loss_rounding`), each with its note."""
    unlossed = {x.index for x, y in zip(a.updates, b.updates, strict=True)
                if math.isnan(x.loss) or math.isnan(y.loss)}  # fmt: skip
    rounding, rounding_note = _loss_rounding(a, b, floored)
    no_loss = unlossed and diagnosis.NO_LOSS.format(updates=len(unlossed), total=len(a.updates))
    notes = [note for note in (no_loss, rounding_note) if note]
    return dataclasses.replace(data, notes=(*data.notes, *notes)), unlossed, rounding


def _loss_rounding(a: Recording, b: Recording, floored: bool) -> tuple[float, str]:
    """Judged to float64's bound (not ``floored``), where either recording's loss tensor was of a
    narrower dtype (a float64 job's ``F.cross_entropy(logits.float(), …)``: a float32 mean of its
    rows, which one device and W ranks round otherwise): `_LOSS_ROUNDING` unit roundoffs of that
    dtype times A's largest |loss|, the losses' own tolerance, and the note that says so; 0 and
    no note elsewhere."""
    dtypes = {u.loss_dtype for r in (a, b) for u in r.updates if u.loss_dtype} - {"float64"}
    losses = [abs(u.loss) for u in a.updates if not math.isnan(u.loss)]
    if floored or _judged(a) != terms.Precision.FLOAT64 or not dtypes or not losses:
        return 0.0, ""
    dtype = max(dtypes, key=lambda name: torch.finfo(getattr(torch, name)).eps)
    rounding = _LOSS_ROUNDING * torch.finfo(getattr(torch, dtype)).eps / 2 * max(losses)
    return rounding, diagnosis.LOSS_ROUNDED.format(dtype=dtype, rounding=rounding,
                                                   units=_LOSS_ROUNDING)  # fmt: skip


def _ceiling(
    a: Recording, b: Recording, first: _Read, precision: str, micro_batches: int
) -> tuple[_Read, float] | None:
    """Without a floor, B's first gradient against A's where it departs beyond any rounding of
    the precision (`floor.beyond_rounding`: `floor.ROUNDING_CEILING` unit roundoffs, the
    relative L2 departure, from the full gradients or their sketches' estimate): the classes of
    the whole and of each part read at that resolution (a part within it ``not judged``), and
    the resolution; None where it and the first loss depart less (`_loss_beyond_rounding`; then
    nothing is judged)."""
    resolution = rounding_resolution(precision)
    full_a, full_b = a.full_gradient(0), b.full_gradient(0)
    world_size = b.world_size
    if first.source == FULL:
        pieces = {ALL_PARTS: (full_b.double(), full_a.double())}
        if len(a.parts) > 1:
            split = [gradients.split(g.double(), a.layout()) for g in (full_b, full_a)]
            pieces |= {part: (split[0][part], split[1][part]) for part in a.parts}
        departures = {name: relative(*pair) for name, pair in pieces.items()}
        read = {ALL_PARTS: first.whole} | first.parts  # max_rel_err as every table gives it
        classes = {name: as_classified(classify_at(*pair, resolution, precision, world_size,
                                                   micro_batches, threshold=1.0))._replace(
                       max_rel_err=read[name].max_rel_err)
                   for name, pair in pieces.items()}  # fmt: skip
    else:
        named = {ALL_PARTS: first.whole} | first.parts
        departures = {name: numbers.max_rel_err for name, numbers in named.items()}
        theirs, mine = a.updates[0], b.updates[0]
        groups = {ALL_PARTS: a.parts} | {part: [part] for part in a.parts}
        classes = {name: gradients.classify_sketched(
            _sketch(mine, groups[name]), _sketch(theirs, groups[name]),
            _whole_norm(mine, groups[name]), _whole_norm(theirs, groups[name]), world_size,
            micro_batches, resolution) for name in named}  # fmt: skip
    if not beyond_rounding(departures[ALL_PARTS], precision) and not _loss_beyond_rounding(
            a, b, precision):  # fmt: skip
        return None
    classes = {name: numbers if beyond_rounding(departures[name], precision) else
               numbers._replace(gradient=terms.NOT_JUDGED)
               for name, numbers in classes.items()}  # fmt: skip
    whole = classes.pop(ALL_PARTS)
    return _Read(whole, classes if len(a.parts) > 1 else {}, first.source), resolution


def _loss_beyond_rounding(a: Recording, b: Recording, precision: str) -> bool:
    """Whether B's first loss departs from A's beyond any rounding of the precision: by more than
    `rounding_resolution` times A's largest loss of the run, the scale its rounding is of (a loss
    near 0 at the start, a negative cosine, rounds at the scale it reaches); a clipping that
    binds can make the first gradients equal where the losses are not (a loss W times one
    device's)."""
    first_a, first_b = a.updates[0].loss, b.updates[0].loss
    losses = [abs(u.loss) for u in a.updates if not math.isnan(u.loss)]
    if math.isnan(first_a) or math.isnan(first_b) or not losses:
        return False
    return abs(first_b - first_a) > rounding_resolution(precision) * max(losses)


def _ceiling_updates(updates: pd.DataFrame, first: _Read) -> pd.DataFrame:
    """``updates.csv`` judged beyond rounding without a floor: update 0's classes at the
    ceiling (`_ceiling`), every later update's gradient not judged."""
    classes = {ALL_PARTS: first.whole.gradient} | {p: n.gradient for p, n in first.parts.items()}
    gradient = [
        classes.get(part, terms.NOT_JUDGED) if update == 0 else terms.NOT_JUDGED
        for update, part in zip(updates["update"], updates["part"], strict=True)
    ]
    return updates.assign(gradient=gradient)


# The columns of the comparison's printed table (check.csv has them all).
PRINTED = (
    "part", "forward", "gradient", "verdict", "scale", "cause", "loss_diff", "cosine",
    "norm_ratio", "max_rel_err", "train_max_abs_loss_diff", "first_diff_step",
    "max_abs_param_diff",
)  # fmt: skip
# How many updates from the first departure the text shows (updates.csv has every one): after it
# the weights differ, and later updates compare gradients at other weights.
SHOWN_UPDATES = 1


@dataclass(frozen=True)
class _Said:
    """What the words of a comparison are made of: its table, its updates, the data, the first
    departure, the causes measured, and the tolerance of its losses and final weights."""

    table: pd.DataFrame
    updates: pd.DataFrame
    data: batches.Batches
    departure: tuple[int, str] | None
    measured: dict[str, str]
    tolerance: float
    desync: tuple[int, list[str]] | None = None
    threshold: float = 0.0
    """T, the most floors within the floor recording's (`floor.threshold`)."""
    ceiling: tuple[str, float] | None = None
    """Judged beyond rounding without a floor: the precision and the resolution (`_ceiling`)."""
    identical: bool = False
    """A low precision judged without a floor: B's every number is A's to the last bit
    (`_identical`)."""
    set_aside: bool = False
    """A floor recording was given and set aside (`_no_rounding_floor`)."""


def _heading(a: Recording, b: Recording, said: _Said) -> list[str]:
    """The two recordings, the data's difference, the notes and the table."""
    lines = [f"{_describe(b, 'B')}\nagainst {_describe(a, 'A')}"]
    if said.data.words is not None:
        lines.append(said.data.words)
    lines += [*said.data.notes, *_outside_notes(a)]
    lines.append(diagnosis.markdown(diagnosis._shown_parts(said.table), PRINTED))
    return lines


def _words(a: Recording, b: Recording, said: _Said) -> str:
    """The comparison as text: the recordings, the data's difference first, the table, the first
    departure and the updates around it (or, judged in floors, how far within them B stays),
    the diagnosis of the verdict, and the last line."""
    table, updates = said.table, said.updates
    lines = _heading(a, b, said)
    head = table.iloc[0]
    floored = "in_precision" in table.columns
    columns = UPDATE_COLUMNS + (FLOOR_COLUMNS if floored else ())
    if said.departure is not None and said.data.words is None:  # other data: no gradient to read
        update = said.departure[0]
        shown = updates[
            (updates["update"] >= update) & (updates["update"] < update + SHOWN_UPDATES)
        ]
        lines.append(_departure_words(head, said, floored) + " (updates.csv has every update "
                     "and part):\n" + diagnosis.markdown(shown, columns))  # fmt: skip
    elif floored and said.data.words is None:
        lines.append(_within_floors_words(head, said))
    if head["verdict"] not in (EXACT, *WITHIN):
        parts = table[table["part"] != ALL_PARTS]
        cause = head["cause"]
        named = f" ({cause})" if cause and head["verdict"] != terms.LOSS_SCALED else ""
        text = diagnosis.diagnosis(table.iloc[:1], parts, said.measured)
        if head["gradient"] not in (GradientClass.BIASED, GradientClass.NONE):  # turns none
            text += _clipped(a, b, said.departure[0] if said.departure is not None else 0)
        if said.ceiling is not None and head["gradient"] == GradientClass.OTHER:
            precision, resolution = said.ceiling
            text += " " + diagnosis.CEILING_OTHER.format(
                word=terms.Precision(precision).word, resolution=resolution,
                cosine=head["cosine"],
            )  # fmt: skip
        resolution = said.measured.get("loss_resolution")
        unnamed = head["gradient"] in (GradientClass.BIASED, GradientClass.OTHER) and not cause
        unnamed = unnamed and head["verdict"] != terms.DATA_DIFFERS  # the data said, no causes
        if resolution is not None and head["forward"] == terms.Forward.SAME and unnamed:
            text += " " + diagnosis.LOSS_UNRESOLVED.format(
                word=terms.Precision(head["precision"]).word, resolution=resolution,
                threshold=said.threshold,
            )  # fmt: skip
        micro_batches = int(said.measured.get("micro_batches", 1))
        explained = cause in (terms.Cause.MICRO_NEGATIVES, terms.Cause.LOCAL_NEGATIVES,
                              terms.Cause.SCALED)  # a cause read: no other guessed  # fmt: skip
        if head["forward"] == terms.Forward.DIFFERS and micro_batches > 1 and not explained:
            text += " " + diagnosis.RECORDED_MICRO_BATCHES.format(micro_batches=micro_batches)
        if head["verdict"] == terms.LOSS_DIFFERS and not cause and not _traced(a, b):
            micro = " or to its micro-batch's" if micro_batches > 1 else ""
            parallel = any(len(group) > 1 for group in b.row_groups)
            words = diagnosis.RECORDED_TENSOR_PARALLEL if parallel else diagnosis.RECORDED_UNTRACED
            text += " " + words.format(micro=micro)
        lines.append(f"B against A, W = {head['world_size']}: {head['verdict']}{named}\n"
                     + diagnosis._paragraph(text) + diagnosis._departs(table.iloc[:1]))  # fmt: skip
    lines += diagnosis._precision_lines(table, None, said.threshold)  # judged in floors (--floor)
    if trains_like_one_device(table) and floored:
        word = terms.Precision(table["precision"].iloc[0]).word
        lines.append(f"B trains like A as far as {word} can tell (within {said.threshold:g} "
                     "floors of the floor recording).")  # fmt: skip
    elif trains_like_one_device(table) and said.identical:
        lines.append(
            f"B trains like A ({a.precision}): every number it recorded is A's to the "
            "last bit, which no rounding departs by: no floor recording is needed."
        )
    elif trains_like_one_device(table):
        lines.append(f"B trains like A ({a.precision}, every update's loss and gradient).")
    return "\n\n".join(lines) + "\n"


def _traced(a: Recording, b: Recording) -> bool:
    """Whether both recordings traced their first update (their ``trace.pt``)."""
    return all((recording.path / TRACE).is_file() for recording in (a, b))


def _clipped(a: Recording, b: Recording, update: int) -> str:
    """Where B's job clips its gradient (``max_grad_norm`` in its header's settings, which the
    trainers' callbacks record) and B's gradient norm at ``update`` is that bound, to 1e-4
    relative (clipping scales the gradient to bound · n / (n + 1e-6)): the words that say so
    (`diagnosis.CLIPPED`), else nothing. Said only of a gradient in A's direction: clipping
    scales a gradient, it turns none."""
    bound = (b.header.get("settings") or {}).get("max_grad_norm")
    if not bound or update >= min(len(a.updates), len(b.updates)):
        return ""
    norm_b = math.sqrt(sum(value * value for value in b.updates[update].norms.values()))
    if abs(norm_b - bound) > 1e-4 * bound:
        return ""
    norm_a = math.sqrt(sum(value * value for value in a.updates[update].norms.values()))
    return " " + diagnosis.CLIPPED.format(bound=bound, update=update, norm=norm_b, norm_a=norm_a)


def _departure_words(head: pd.Series, said: _Said, floored: bool) -> str:
    """Where B departs first, in the numbering of every table and figure (updates from 0; an
    update's loss is computed before its step, so a gradient that departs at update u moves the
    loss of update u + 1 first)."""
    update, part = said.departure
    where = f"B departs from A first at update {update}" + (
        "" if part == ALL_PARTS else f", part {part}"
    )
    rows = said.updates[(said.updates["update"] == update) & (said.updates["part"] == part)]
    row = rows.iloc[0]
    if said.desync is not None and said.desync[0] == update and row["gradient"] == EXACT:
        parts = ", ".join(said.desync[1])
        return (f"B's ranks part from each other first at update {update}: their weights differ "
                f"after its step ({parts}), though its gradient is A's")  # fmt: skip
    if row["gradient"] == EXACT:  # its gradient is A's there: the loss departs
        difference = abs(row["loss_b"] - row["loss_a"])
        return f"{where}: its loss leaves A's by {difference:.3g} (tolerance {said.tolerance:.3g})"
    gradient = f"its gradient is {row['gradient']}"
    if said.ceiling is not None:
        precision, resolution = said.ceiling
        word, unit = terms.Precision(precision).word, terms.Precision(precision).unit_roundoff
        gradient += (
            f", beyond {resolution / unit:g} unit roundoffs of {word} ({resolution:.2g} "
            "relative), which rounding gave no correct run measured (docs/design.md §2): judged "
            "without a floor recording; a part that departs less is not judged"
        )
    elif floored and head["verdict"] == terms.NOT_JUDGED:  # later than update 0: no class
        where = where.replace("departs from A first", "leaves A's floors first")
        gradient = (f"its gradient is {row['floors']:.3g} floors of the floor recording's "
                    f"departure there ({row['floor']:.2g}; at most {said.threshold:g} is within "
                    "it), its class not judged (below)")  # fmt: skip
    elif floored:
        gradient += (f", {row['floors']:.3g} floors of the floor recording's departure there "
                     f"({row['floor']:.2g}; at most {said.threshold:g} is within it)")  # fmt: skip
    first_loss = head["first_diff_step"]
    scale = head.get("scale")  # B's losses are compared divided by it (`_departure`)
    scaled = ("" if scale is None or pd.isna(scale) or scale == 1 else
              f" (divided by its scale, {scale:.6g})")  # fmt: skip
    if first_loss is not None and not pd.isna(first_loss):
        step = int(first_loss)
        when = ("the same update" if step == update else
                f"the first computed with the weights of update {update}'s step"
                if step == update + 1 else f"{step - update} updates later")  # fmt: skip
        loss = f"; its loss{scaled} first leaves A's at update {step} (first_diff_step: {when})"
    elif head["verdict"] == terms.LOSS_DIFFERS:  # update 0's loss judged in floors of its own
        loss = (f"; its first loss{scaled} departs from A's beyond the floors of the floor "
                f"recording's (a relative {head['loss_diff']:.3g}), though no update's loss leaves "
                f"A's by more than the curves' tolerance, {said.tolerance:.3g}")  # fmt: skip
    else:
        loss = (f"; no update's loss{scaled} leaves A's by more than its tolerance, "
                f"{said.tolerance:.3g}")  # fmt: skip
    return f"{where}: {gradient}{loss}"


def _within_floors_words(head: pd.Series, said: _Said) -> str:
    """Judged in floors and departing at no update: update 0's gradient in floors, and the losses
    and final weights beside their tolerance (T times the floor recording's largest departure of
    either), so that weights far apart in absolute terms are seen to be as far apart as the
    floor recording's."""
    first = said.updates[(said.updates["part"] == ALL_PARTS)].iloc[0]
    losses, weights = head["train_max_abs_loss_diff"], head["max_abs_param_diff"]
    beyond = [what for what, value in (("its losses", losses), ("its final weights", weights))
              if value > said.tolerance]  # fmt: skip
    opening = "No update departs" if not beyond else "Update 0 is within floors"
    closing = f", beyond it: {' and '.join(beyond)}" if beyond else ""
    return (
        f"{opening}: update 0's gradient is {first['floors']:.3g} floors from A's (a "
        f"floor: {first['floor']:.2g}, the floor recording's departure; at most "
        f"{said.threshold:g} floors is within). Later "
        "updates' gradients are read at weights that rounding has moved apart, in B and in the "
        "floor recording alike (updates.csv has each one's floors), and are held through the "
        f"losses and the final weights' sketches, to {said.tolerance:.3g} ({said.threshold:g} "
        "times the floor recording's largest departure of either from A's): B's largest "
        f"|Δloss| is {losses:.3g}, its final weights' {weights:.3g}{closing}."
    )


def _not_judged_words(a: Recording, b: Recording, said: _Said, first: _Read, precision: str) -> str:
    """A low precision without a floor recording: what was measured, and the command that
    records the floor (where the one given was set aside, how to record one that is a floor)."""
    word = terms.Precision(precision).word
    lines = _heading(a, b, said)
    departure = first.whole.max_rel_err
    measure = "max |g − g₁| / max |g₁|" if first.source == FULL else "‖S(g − g₁)‖ / ‖g₁‖"
    rounds = ("W ranks depart from one device" if b.world_size > 1 else
              "one device's runs depart that sum in another order (another strategy, launcher or "
              "kernel)")  # fmt: skip
    lines.append(
        f"not judged: A and B are recorded in {precision}, whose rounding alone makes {rounds}; "
        f"without a floor no departure can be told from it (B's first "
        f"gradient departs from A's by {departure:.2g}, {measure}; {word}'s unit roundoff is "
        f"{terms.Precision(precision).unit_roundoff:.2g}). "
        + (diagnosis.FLOOR_SET_ASIDE if said.set_aside else _floor_command(a, b))
    )
    return "\n\n".join(lines) + "\n"


def _unused(path: Path) -> Path:
    """``path``, or the first of ``path-2``, ``path-3``, … that does not exist."""
    numbered = (path.with_name(f"{path.name}-{n}") for n in itertools.count(2))
    return next(p for p in itertools.chain([path], numbered) if not p.exists())


def _floor_recorded(path: Path, blocks: int) -> bool:
    """Whether ``path`` holds a finished floor recording of ``blocks`` row blocks."""
    try:
        floor = read(path)
    except RecordingError:
        return False
    return floor.world_size == 1 and floor.row_blocks == blocks


def _interpreter(command: Sequence[str] | None) -> str:
    """The Python that ran A's command, where it names one (``.venv/bin/python job.py``), so that
    the comparison it prints runs where gatherlab is installed; else ``python``."""
    first = command[0] if command else ""
    return shlex.quote(first) if re.fullmatch(r"python[\d.]*", Path(first).name) else "python"


def _floor_command(a: Recording, b: Recording) -> str:
    """How to record A's floor: A's own command (the one that launched it, torchrun's included)
    with ``GATHERLAB_RECORD_FLOOR``, which every recorder reads (the plain one and the trainers'
    callbacks); a model with batch norm has none."""
    header = a.header
    norms = header.get("batch_norm") or []
    if norms:
        return (f"A's model has batch norm ({', '.join(norms)}), whose statistics a floor's row "
                "blocks would split: no floor can be measured for it; record both runs in "
                "float64 to judge them.")  # fmt: skip
    blocks = _floor_blocks(a, b)
    floor_dir = Path(f"{a.path}-floor{'' if blocks == FLOOR_ROW_BLOCKS else blocks}")
    again = (
        f"{_interpreter(header.get('command'))} -m gatherlab.compare {a.path} {b.path} --floor {{}}"
    )
    if _floor_recorded(floor_dir, blocks):
        return (f"A's floor in {blocks} row blocks is recorded in {floor_dir}; compare again "
                f"with it:\n    {again.format(floor_dir)}")  # fmt: skip
    floor_dir = _unused(floor_dir)  # the recorder writes into no directory that exists
    again = again.format(floor_dir)
    variables = f"GATHERLAB_RECORD_FLOOR={floor_dir}" + (
        f" {FLOOR_BLOCKS_VARIABLE}={blocks}" if blocks != FLOOR_ROW_BLOCKS else "")  # fmt: skip
    command = header.get("command")
    if command:
        return (f"Record the floor, A's job on one device with its model's forward in {blocks} "
                "row blocks (A's own command: what else it writes, saved weights or logs, it "
                f"writes again), and compare again:\n    {variables} {shlex.join(command)}\n"
                f"    {again}")  # fmt: skip
    return (f"Record the floor, A's job on one device run again with {variables} in its "
            f"environment, and compare again:\n    {again}")  # fmt: skip
