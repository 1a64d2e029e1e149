"""The result of a check (`CheckResult`: its table, ``check.csv``, and the words that go with it),
the table's columns, its typed row (`Row`) and the one conversion of rows to the table (`frame`),
the verdict of a row, the row of a world size whose ranks raised, and whether a result says
"trains like one device". Rows are made by `gatherlab.check.judge` for
every form of the check; `gatherlab.check.diagnosis` puts them into words (docs/contract.md §5)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from gatherlab.core import cli, floor, terms
from gatherlab.runs.removals import NONE

__all__ = [
    "ALL_PARTS", "COLUMNS", "COMPARISON_COLUMNS", "EXACT", "MICRO_BATCHES", "PRECISION_COLUMNS",
    "REFERENCE", "TRAINING_COLUMNS", "TRAINS_LIKE_ONE_DEVICE", "TRAIN_COLUMN", "CheckResult",
    "ReferenceNote", "Row", "failed_row", "frame", "reference_notes", "result_of",
    "trains_like_one_device", "verdict",
]  # fmt: skip

EXACT = terms.GradientClass.EXACT
ALL_PARTS = "all"
"""The ``part`` of a row about the whole gradient (the rows of a check before parts existed)."""

REFERENCE = "reference"
"""The column that says how the one-device reference ran (`gatherlab.core.terms.ReferenceMode`)."""

COLUMNS = (
    "loss", "gather", "world_size", "part", "forward", "gradient", "verdict", "scale", "cause",
    "loss_diff", "cosine", "norm_ratio", "max_rel_err", "error", REFERENCE, "where", "departs",
)  # fmt: skip
"""The columns of a check's table (``check.csv``), in order; with ``steps`` a last column,
``train_max_abs_loss_diff``, follows. ``part`` is ``all`` for the whole gradient, then, when the
gradient has several parts, ``model`` and ``loss.<name>`` per trainable parameter of the loss;
``forward`` is ``same`` or ``differs``; ``gradient`` one of ``exact``, ``1/W``, ``W``,
``biased``, ``none``, ``other``, or with micro-batches a factor of `gatherlab.core.terms.Factor`
(``1/K``, ``K``, …); ``verdict`` is ``exact``, ``loss scaled``, ``loss differs``,
the gradient's class, ``diverges`` (with ``steps``) or ``failed``; ``scale`` the constant c of a
loss that is c × one device's; ``cause`` what reproduced a ``loss differs`` (``scaled``,
``local_negatives``, ``micro_negatives``, ``pair_order``, ``local_statistic``,
``unexplained``) or split a ``biased`` gradient
(``parts``); ``error`` the failing rank's error line; ``loss_diff`` the relative difference of
the global loss; ``gather`` is ``native`` when the loss communicates by itself; ``reference``
how the one-device reference ran, the same on every row of a loss: ``no group`` (the plain run,
as a one-GPU script runs it) or ``one-rank group`` (rank 0 of a one-rank gloo process group, for
code that raises without one; `gatherlab.check.reference`); ``where`` the first operation that
departs from one device (``file:line  op``) and ``departs`` what differs there, in words, empty
where the verdict is exact or nothing departs (`gatherlab.check.where`) (docs/contract.md §5,
docs/checking.md §6)."""
TRAIN_COLUMN = "train_max_abs_loss_diff"
MICRO_BATCHES = "micro_batches"
TRAINING_COLUMNS = (
    *COLUMNS[:3], MICRO_BATCHES, *COLUMNS[3:], TRAIN_COLUMN, "removed", "culprits",
    "first_diff_step", "max_abs_param_diff",
)  # fmt: skip
"""The columns of a training step's check: the loss check's, with ``micro_batches`` (K, the
micro-batches of each rank's update: 1 but for the whole-update form) after ``world_size``, then
``train_max_abs_loss_diff``, ``removed``, ``culprits`` (``;``-separated), ``first_diff_step``
(the first step whose loss leaves one device's) and ``max_abs_param_diff`` (the final weights)."""

COMPARISON_COLUMNS = (
    *COLUMNS, TRAIN_COLUMN, "first_diff_step", "max_abs_param_diff", "first_update", "first_part",
)  # fmt: skip
"""The columns of a comparison of two recordings (``python -m gatherlab.compare``, its
``check.csv``): the loss check's, ``loss`` the run's recording and ``reference`` the
reference's, ``gather`` ``native`` (the job communicates by itself); then the training's
``train_max_abs_loss_diff``, ``first_diff_step`` and ``max_abs_param_diff`` (of the final
weights' sketches), and ``first_update`` and ``first_part``, the first update whose loss or
gradient departs and the first part that departs there (``all``: the loss alone; empty when none
departs, `gatherlab.check.recordings`)."""

NOT_MEASURED = math.nan
"""A field a row has no value for (a failed row's numbers, a part's training curve): an empty
cell of the table, as pandas writes one."""


@dataclass(frozen=True)
class Row:
    """One row of a check's table: its fields are the columns of `COLUMNS`, `TRAINING_COLUMNS`
    and `COMPARISON_COLUMNS` (each table takes its own), and ``first_loss``, the run's first
    global loss, which no column holds (the cause of a whole update's differing loss is read from
    it). A field left at `NOT_MEASURED` is an empty cell."""

    loss: str
    gather: str
    world_size: int
    reference: str
    micro_batches: int = 1
    removed: str = NONE
    part: str = ALL_PARTS
    forward: str = ""
    gradient: str = ""
    verdict: str = ""
    scale: float | None = NOT_MEASURED
    cause: str = ""
    loss_diff: float = NOT_MEASURED
    cosine: float = NOT_MEASURED
    norm_ratio: float = NOT_MEASURED
    max_rel_err: float = NOT_MEASURED
    error: str = ""
    where: str | float = NOT_MEASURED
    departs: str | float = NOT_MEASURED
    train_max_abs_loss_diff: float = NOT_MEASURED
    culprits: str = ""
    first_diff_step: int | float | None = NOT_MEASURED
    max_abs_param_diff: float = NOT_MEASURED
    first_update: int | float | None = NOT_MEASURED
    first_part: str = ""
    first_loss: float = NOT_MEASURED
    precision: str = ""
    judged_in: str = ""
    floor: float = NOT_MEASURED
    floors: float = NOT_MEASURED
    in_precision: str = ""


def frame(rows: Sequence[Row], columns: Sequence[str]) -> pd.DataFrame:
    """The table of these rows with these columns, in order: the one place rows become
    ``check.csv``'s table. ``first_diff_step`` and ``first_update`` are nullable integers (empty:
    every step agrees)."""
    table = pd.DataFrame([dataclasses.asdict(row) for row in rows], columns=list(columns))
    for column in ("first_diff_step", "first_update"):
        if column in table:
            table[column] = table[column].astype("Int64")
    return table


TRAINS_LIKE_ONE_DEVICE = frozenset({EXACT, terms.LOSS_SCALED, *floor.WITHIN})
"""The verdicts of a world size that trains like one device: ``loss scaled`` only logs a scaled
value; ``exact within bf16`` (float32, fp16) is as close as a low precision lets a check tell
(docs/design.md §2, "Low precision")."""

PRECISION_COLUMNS = ("precision", "judged_in", "floor", "floors", "in_precision")
"""The columns a check in a low precision adds at the end of its table (docs/design.md §2, "Low
precision"): ``precision`` the run's (``bf16-mixed``, …), ``judged_in`` the precision its verdict
rests on (``64-true`` where the code runs in float64, else its own), ``floor`` the relative
departure of the gradient of one device with its forward in row blocks from one device's, in
that precision, ``floors`` the W-rank gradient's relative departure from the same-precision one
device's in floors, ``in_precision`` its verdict in that precision (``exact within bf16`` at most
`gatherlab.core.floor.threshold` floors, else its class read at that resolution); the
last three on the whole gradient's row."""


def verdict(
    forward: str,
    gradient: str,
    scale: float | None = None,
    apart: bool = False,
    data_differs: bool = False,
) -> str:
    """The verdict of a row: ``data differs`` when the run was not given one device's global
    batches (a recorded run, ``data_differs``: nothing else is judged then); ``exact`` when
    forward and gradient are; ``loss scaled`` when the forward is a constant multiple ``scale``
    of one device's and the gradient is exact; ``loss differs`` when the forward differs
    otherwise; else the gradient's class; and ``diverges`` where it would be ``exact`` or ``loss
    scaled`` but a training run compared (``apart``) leaves the 1-device one: a later step's loss
    (divided by ``scale``) or the final weights.

    >>> verdict("same", "exact"), verdict("differs", "exact", 2.0), verdict("same", "1/W")
    ('exact', 'loss scaled', '1/W')
    >>> verdict("differs", "biased", 2.0), verdict("differs", "exact", 2.0, apart=True)
    ('loss differs', 'diverges')
    """
    if data_differs:
        return str(terms.DATA_DIFFERS)
    if forward == terms.Forward.DIFFERS:
        first = terms.LOSS_SCALED if scale is not None and gradient == EXACT else terms.LOSS_DIFFERS
    else:
        first = gradient
    if apart and first in TRAINS_LIKE_ONE_DEVICE:
        return str(terms.DIVERGES)
    return str(first)


def failed_row(key: Row, error: BaseException) -> Row:
    """The row of a world size whose ranks raised (``key``: its loss, gather, world size and, for
    a training step, its run): ``failed``, and the rank's error line."""
    return dataclasses.replace(key, verdict=str(terms.FAILED), error=cli.first_line(error))


@dataclass(frozen=True)
class ReferenceNote:
    """What the printed text adds about a loss's (or step's) one-device reference beyond its
    ``reference`` column (`gatherlab.check.reference.Reference`): words to print only.

    Attributes:
        why: The plain run's error line, when the reference needed a one-rank process group.
        group_differs: What differs in a one-rank group from the plain run.
    """

    why: str = ""
    group_differs: str = ""


def reference_notes(notes: Mapping[str, tuple[str, str | None]]) -> dict[str, ReferenceNote]:
    """The notes of each loss of ``notes`` (its name → the reference's ``why`` and
    ``group_differs``) that has either."""
    return {
        name: ReferenceNote(why or "", differs or "")
        for name, (why, differs) in notes.items()
        if why or differs
    }


@dataclass(frozen=True)
class CheckResult:
    """What a check returns (`gatherlab.check.check_loss`, `check_gather`, `check_training`):
    its table and the words that go with it. `gatherlab.check.explain` and `explain_training`
    put it into words; ``check.csv`` is its ``table``.

    Attributes:
        table: The rows (`COLUMNS`, or `TRAINING_COLUMNS` for a training step;
            `PRECISION_COLUMNS` after them in a low precision), as `frame` makes them.
        trained: How the command line names what a training step's check trained (``--module
            M``, ``--step S``, ``--update U``); empty for a loss or a gather.
        reference_notes: Per loss (or step) whose reference says more than its ``reference``
            column, those words.
        precision_notes: Per loss (or step) judged in a precision other than the one asked (it
            cannot run in float64, or its floor is not measured), why, in words.
        unreduced: Per layout (W, K) of a training step whose ranks' gradients of some part
            differ, what was found (`gatherlab.check.training.Unreduced`).
        loss_check: The check of the module's loss attribute (``loss_attr``) where the loss was
            blamed.
    """

    table: pd.DataFrame
    trained: str = ""
    reference_notes: Mapping[str, ReferenceNote] = field(default_factory=dict)
    precision_notes: Mapping[str, str] = field(default_factory=dict)
    unreduced: Mapping[tuple[int, int], Any] = field(default_factory=dict)
    loss_check: CheckResult | None = None

    @property
    def trains_like_one_device(self) -> bool:
        """Whether every world size trains like one device (`trains_like_one_device`)."""
        return trains_like_one_device(self.table)


def result_of(checked: CheckResult | pd.DataFrame) -> CheckResult:
    """A check's result, or a table alone (``check.csv`` read back) as a result without words."""
    return checked if isinstance(checked, CheckResult) else CheckResult(checked)


def trains_like_one_device(checked: CheckResult | pd.DataFrame) -> bool:
    """Whether a check's result (or its table) says every world size trains like one device:
    every verdict of the whole gradient in `TRAINS_LIKE_ONE_DEVICE` (`check_loss`,
    `check_gather`), or for `check_training` every run without removals."""
    table = result_of(checked).table
    if "removed" in table:
        table = table[table["removed"] == NONE]
    if "part" in table:
        table = table[table["part"] == ALL_PARTS]
    return bool(table["verdict"].isin(TRAINS_LIKE_ONE_DEVICE).all())
