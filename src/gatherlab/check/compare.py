"""A recorded run against its recorded reference (`gatherlab.recording`: each optimizer update's
batch fingerprints, losses, per-part gradient sketches and norms, docs/design.md §5, §6 "Comparing
two recordings"), judged by the one judge of the check (`gatherlab.check.judge.judge`).

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
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from gatherlab.check import batches, diagnosis, where
from gatherlab.check.judge import InPrecision, Recorded, judge
from gatherlab.check.table import (
    ALL_PARTS,
    COMPARISON_COLUMNS,
    EXACT,
    PRECISION_COLUMNS,
    Row,
    frame,
    trains_like_one_device,
)  # fmt: skip
from gatherlab.core import gradients, runfiles, terms
from gatherlab.core.floor import FLOOR_THRESHOLD, WITHIN
from gatherlab.core.gradients import Classified, Layout
from gatherlab.recording.format import Recording, read

__all__ = [
    "MUST_AGREE", "UPDATE_COLUMNS", "Comparison", "NotComparable", "compare", "recording",
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
    loss), the first ``departure`` (update, part) (None when none departs), and the two
    recordings' directories."""

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


def _floor(a: Recording, c: Recording) -> tuple[str, Recording]:
    """The precision of a comparison judged in floors and its floor recording ``c``, checked
    against A: the same model and settings, one device, a low precision (an autocast dtype, or
    parameters below float64); NotComparable in one line otherwise."""
    _same_model(a, c)
    _same_settings(a, c)
    if c.world_size != 1:
        raise NotComparable(
            f"--floor {c.path} was recorded on {c.world_size} ranks; allowed: one device with its "
            "forward in row blocks (gatherlab.record.in_row_blocks)"
        )
    autocast = next((u.autocast for u in a.updates if u.autocast), None)
    fp16 = terms.Precision.FP16_MIXED  # fp16 parameters round as fp16 autocast does
    named = {"bfloat16": terms.Precision.BF16_MIXED, "float16": fp16, "16-true": fp16}
    recorded = a.header.get("precision", terms.Precision.FLOAT64)
    precision = named.get(autocast or "", named.get(recorded, recorded))
    if precision not in terms.PRECISIONS or precision == terms.Precision.FLOAT64:
        raise NotComparable(
            f"--floor {c.path}: A is recorded in {precision}, judged to 1e-10; allowed: a floor "
            "for recordings in float32, bf16 or fp16"
        )
    return str(precision), c


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


def _sketch(update: Any, parts: Sequence[str]) -> np.ndarray:
    return np.concatenate([update.sketches[part] for part in parts])


def _whole_norm(update: Any, parts: Sequence[str]) -> float:
    return math.sqrt(math.fsum(update.norms[part] ** 2 for part in parts))


def _classified(
    a: Recording, b: Recording, index: int, world_size: int, micro_batches: int
) -> tuple[Classified, dict[str, Classified], str]:
    """Update ``index``'s gradient of B against A's, the whole and each part (when there are
    several), and the source: the full gradients where both recordings hold them, else the
    sketches and exact norms."""
    parts = a.parts
    full_a, full_b = a.full_gradient(index), b.full_gradient(index)
    if full_a is not None and full_b is not None:
        full_a, full_b = full_a.double(), full_b.double()
        whole = gradients.classify(full_b, full_a, world_size, micro_batches)
        split = gradients.classify_parts(full_b, full_a, a.layout(), world_size, micro_batches)
        return whole, split, FULL
    theirs, mine = a.updates[index], b.updates[index]
    whole = gradients.classify_sketched(
        _sketch(mine, parts), _sketch(theirs, parts), _whole_norm(mine, parts),
        _whole_norm(theirs, parts), world_size, micro_batches,
    )  # fmt: skip
    split = {}
    if len(parts) > 1:
        split = {
            part: gradients.classify_sketched(
                mine.sketches[part],
                theirs.sketches[part],
                mine.norms[part],
                theirs.norms[part],
                world_size,
                micro_batches,
            )
            for part in parts
        }
    return whole, split, SKETCH


def _updates_table(
    a: Recording, b: Recording, world_size: int, micro_batches: int
) -> tuple[pd.DataFrame, list[tuple[Classified, dict[str, Classified], str]]]:
    """The rows of ``updates.csv`` (`UPDATE_COLUMNS`) and each update's classes."""
    rows, classes = [], []
    for theirs, mine in zip(a.updates, b.updates, strict=True):
        whole, split, source = _classified(a, b, theirs.index, world_size, micro_batches)
        classes.append((whole, split, source))
        for part, numbers in [(ALL_PARTS, whole), *split.items()]:
            rows.append((theirs.index, part, str(numbers.gradient), numbers.cosine,
                         numbers.norm_ratio, numbers.max_rel_err, source, theirs.loss,
                         mine.loss))  # fmt: skip
    return pd.DataFrame(rows, columns=list(UPDATE_COLUMNS)), classes


def _departure(
    a: Recording,
    b: Recording,
    classes: Sequence[tuple[Classified, dict[str, Classified], str]],
    tolerance: float,
    scale: float | None,
) -> tuple[int, str] | None:
    """The first update whose loss (divided by ``scale``) or gradient departs from A's, and the
    first part that departs there (``all``: the loss alone, or a gradient of one part)."""
    factor = scale if scale is not None and not math.isnan(scale) else 1.0
    for (whole, split, _), theirs, mine in zip(classes, a.updates, b.updates, strict=True):
        if whole.gradient != EXACT:  # the whole when every part is as the whole, else a part
            alike = all(numbers.gradient == whole.gradient for numbers in split.values())
            departing = (p for p, numbers in split.items() if numbers.gradient != EXACT)
            return theirs.index, ALL_PARTS if alike else next(departing, ALL_PARTS)
        if abs(mine.loss / factor - theirs.loss) > tolerance:
            return theirs.index, ALL_PARTS
    return None


# --- the ranks' own gradients -------------------------------------------------------------------


def _unreduced(a: Recording, b: Recording) -> tuple[list[str], dict[str, str]]:
    """B's parts whose gradient differs between its ranks (recorded per rank, `Update.unreduced`)
    and the words the diagnosis adds: at which updates, and whether their mean over the ranks is
    A's gradient (then reducing it is the fix)."""
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
    mean_words = []
    for part in parts:
        update = b.updates[first] if first in seen[part] else b.updates[min(seen[part])]
        mean = np.asarray(update.unreduced[part]).mean(axis=0)
        reference = np.asarray(a.updates[update.index].sketches[part])
        error = float(np.linalg.norm(mean - reference) / max(np.linalg.norm(reference), 1e-300))
        if error <= gradients.FLOAT64_TOLERANCE:
            mean_words.append(
                f"The mean over the ranks of {part}'s gradients is A's (update {update.index}, "
                f"relative difference {error:.2g} of the sketches): reducing it is the fix."
            )
        else:
            mean_words.append(
                f"The mean over the ranks of {part}'s gradients is not A's either (update "
                f"{update.index}, relative difference {error:.3g} of the sketches): reducing it "
                "alone does not make it A's."
            )
    at = [w if len(parts) == 1 else f"{p} {w}" for p, w in zip(parts, where, strict=True)]
    measured = {
        "unreduced_source": "from the recording",
        "unreduced": ", ".join(parts),
        "unreduced_updates": "; ".join(at) + ", each rank's own sketch of it recorded",
        "unreduced_mean": " ".join(mean_words),
    }
    return parts, measured


# --- the comparison -----------------------------------------------------------------------------


def _where(
    a: Recording, b: Recording, tolerance: float
) -> Callable[[], where.Departure | None] | None:
    """Where B's first update departs from A's, as the check names it (`check.where`), when both
    recorded a trace of it (``trace.pt``) and B has ranks: A's one device's records against each
    of B's ranks'. One device's global batch is A's rows of update 0, divided by the number of
    blocks its forward concatenates (two views: 2) where B's order shows them."""
    if b.world_size < 2 or a.world_size != 1:
        return None
    ones, ranks = a.trace(), b.trace()
    if not ones or not ranks or not ones[0] or not all(ranks):
        return None
    first_a, first_b = a.updates[0], b.updates[0]
    rows = [row for rank in first_a.rows for row in rank]
    batch = len(rows) // (batches.blocks(rows, first_b.rows) or 1)
    return lambda: where.departure(ones[0], ranks, b.world_size, batch, tolerance)


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
    header = recording.header
    return (f"{name} {recording.path} (W = {recording.world_size}, {len(recording.updates)} "
            f"updates, {header.get('precision', '?')}, k = {recording.k})")  # fmt: skip


def compare(
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
    recording of one device with its forward in row blocks (`gatherlab.record.in_row_blocks`):
    B's first gradient, losses and final weights are judged in floors of its departure from A
    (docs/design.md §2, "Low precision"), its verdict ``exact within bf16`` where float64's bounds
    would say ``other``.

    Raises:
        RecordingError: a directory that is no finished recording of a version this gatherlab
            reads (`gatherlab.recording.format.read`).
        NotComparable: the recordings' models or settings differ.
    """
    a, b = recording(reference), recording(run)
    _same_model(a, b)
    _same_settings(a, b)
    floored = None if floor is None else _floor(a, recording(floor))
    if tolerance is None:
        precision = a.header.get("precision", terms.Precision.FLOAT64)
        tolerance = gradients.TOLERANCE.get(precision, gradients.FLOAT64_TOLERANCE)
    world_size, micro_batches = b.world_size, _micro_batches(a, b)
    data = batches.compare(a, b)
    updates, classes = _updates_table(a, b, world_size, micro_batches)
    unreduced, measured = _unreduced(a, b)
    measured = {**measured, "data_cause": data.explanation or ""}
    whole, split, source = classes[0]
    full = source == FULL
    key = Row(loss=str(b.path), gather="native", world_size=world_size, reference=str(a.path),
              micro_batches=micro_batches)  # fmt: skip
    unlossed = {x.index for x, y in zip(a.updates, b.updates, strict=True)
                if math.isnan(x.loss) or math.isnan(y.loss)}  # fmt: skip
    if unlossed:
        data = dataclasses.replace(data, notes=(*data.notes, diagnosis.NO_LOSS.format(
            updates=len(unlossed), total=len(a.updates))))  # fmt: skip
    in_precision = None
    if floored is not None:
        in_precision = InPrecision(floored[0], _trained(floored[1], full, unlossed))
    rows = judge(
        _trained(b, full, unlossed), _trained(a, full, unlossed), key, tolerance=tolerance,
        layout=a.layout() if full else _sketch_layout(a),
        recorded=Recorded(None if full else (whole, split), unreduced, data.update is not None,
                          in_precision),
        where=None if data.update is not None or floored else _where(a, b, tolerance),
    )  # fmt: skip
    departure = _departure(a, b, classes, tolerance, rows[0].scale)
    if departure is not None:
        rows = [dataclasses.replace(r, first_update=departure[0], first_part=departure[1])
                for r in rows]  # fmt: skip
    table = frame(rows, COMPARISON_COLUMNS + (PRECISION_COLUMNS if floored else ()))
    status = 0 if trains_like_one_device(table) else 1
    words = _words(a, b, table, updates, data, departure, measured)
    return Comparison(
        table=table, updates=updates, verdict=rows[0].verdict, status=status, words=words,
        data=data.words, notes=data.notes, departure=departure, reference=a.path, run=b.path,
    )  # fmt: skip


# The columns of the comparison's printed table (check.csv has them all).
PRINTED = (
    "part", "forward", "gradient", "verdict", "scale", "cause", "loss_diff", "cosine",
    "norm_ratio", "max_rel_err", "train_max_abs_loss_diff", "first_diff_step",
    "max_abs_param_diff",
)  # fmt: skip
# How many updates from the first departure the text shows (updates.csv has every one): after it
# the weights differ, and later updates compare gradients at other weights.
SHOWN_UPDATES = 1


def _words(
    a: Recording,
    b: Recording,
    table: pd.DataFrame,
    updates: pd.DataFrame,
    data: batches.Batches,
    departure: tuple[int, str] | None,
    measured: dict[str, str],
) -> str:
    """The comparison as text: the recordings, the data's difference first, the table, the first
    departure and the updates around it, the diagnosis of the verdict, and the last line."""
    lines = [f"{_describe(b, 'B')}\nagainst {_describe(a, 'A')}"]
    if data.words is not None:
        lines.append(data.words)
    lines += list(data.notes)
    lines.append(diagnosis.markdown(diagnosis._shown_parts(table), PRINTED))
    head = table.iloc[0]
    if departure is not None and data.words is None:  # other data: no gradient to read
        update, part = departure
        shown = updates[
            (updates["update"] >= update) & (updates["update"] < update + SHOWN_UPDATES)
        ]
        lines.append(
            f"B departs from A first at update {update}"
            + ("" if part == ALL_PARTS else f", part {part}")
            + " (updates.csv has every update and part):\n"
            + diagnosis.markdown(shown, UPDATE_COLUMNS)
        )
    if head["verdict"] not in (EXACT, *WITHIN):
        parts = table[table["part"] != ALL_PARTS]
        cause = head["cause"]
        named = f" ({cause})" if cause and head["verdict"] != terms.LOSS_SCALED else ""
        text = diagnosis.diagnosis(table.iloc[:1], parts, measured)
        lines.append(f"B against A, W = {head['world_size']}: {head['verdict']}{named}\n"
                     + diagnosis._paragraph(text) + diagnosis._departs(table.iloc[:1]))  # fmt: skip
    lines += diagnosis._precision_lines(table, None)  # judged in floors (--floor)
    if trains_like_one_device(table) and "in_precision" in table.columns:
        word = terms.Precision(table["precision"].iloc[0]).word
        lines.append(f"B trains like A as far as {word} can tell (within {FLOOR_THRESHOLD:g} "
                     "floors of the floor recording).")  # fmt: skip
    elif trains_like_one_device(table):
        precision = a.header.get("precision", "")
        lines.append(f"B trains like A ({precision}, every update's loss and gradient).")
    return "\n\n".join(lines) + "\n"
