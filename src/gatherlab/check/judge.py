"""The judge: how a run on W ranks is judged against its one-device reference, for every form of
the check (a loss or gather, a plain step, a whole update, a LightningModule) and for a run
recorded elsewhere (`gatherlab.core.runfiles.Trained`). Each rule of a row (docs/contract.md §5,
docs/checking.md §6, §10) is written here once: the forward, the gradient's class and its parts',
the cause, the verdict (`gatherlab.check.table.verdict`, ``loss scaled`` and ``diverges`` included),
where the run departs. What only some forms have is given to it: the hypotheses that reproduce a
differing loss (`gatherlab.check.hypotheses`), where the run departs (`gatherlab.check.where`), the
first losses of naive accumulation (`gatherlab.check.training.micro_negatives`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING

import torch

from gatherlab.check import hypotheses
from gatherlab.check.table import ALL_PARTS, EXACT, TRAINS_LIKE_ONE_DEVICE, Row, verdict
from gatherlab.check.where import Departure
from gatherlab.core import floor, gradients
from gatherlab.core.floor import Floored
from gatherlab.core.gradients import Classified, Layout
from gatherlab.core.runfiles import Trained
from gatherlab.core.terms import (
    DIVERGES,
    Cause,
    DepartureKind,
    Forward,
    GradientClass,
    Precision,
)  # fmt: skip
from gatherlab.runs.precision import FLOOR_ROW_BLOCKS

if TYPE_CHECKING:  # a run is a `Measured` or a `Trained`, told apart by the second: the measuring
    from gatherlab.check.measure import Measured  # module imports torch.distributed.tensor (~0.6 s)

__all__ = ["InPrecision", "Recorded", "as_classified", "judge", "with_precision"]

Reproduce = Callable[[], tuple[Cause, float | None]]
"""What reproduces a differing global loss on one device: its cause and, for ``scaled``, c."""


@dataclasses.dataclass(frozen=True)
class _Curves:
    """A training run's losses against one device's: each step's |Δloss| with the run's loss
    divided by the scale, the first step where that exceeds ``tolerance`` (None when none does),
    and the final weights' max |Δ| (the last update shows in no loss)."""

    differences: list[float]
    first: int | None
    weights: float
    tolerance: float

    @property
    def apart(self) -> bool:
        """Whether the run leaves one device's: a step's loss or the final weights."""
        return self.first is not None or self.weights > self.tolerance


def _curves(
    run: Trained, reference: Trained, tolerance: float, scale: float | None,
    losses: float | None = None,
) -> _Curves:  # fmt: skip
    """The runs' losses compared (to ``losses``, else ``tolerance``), the run's divided by
    ``scale`` (when there is one), and their final weights (to ``tolerance``)."""
    factor = scale or 1.0
    differences = [abs(a / factor - b) for a, b in zip(run.losses, reference.losses, strict=True)]
    first = next((step for step, d in enumerate(differences) if d > (losses or tolerance)), None)
    weights = gradients.largest_difference(run.parameters, reference.parameters)
    return _Curves(differences, first, weights, tolerance)


def _gradient(run: Measured | Trained) -> torch.Tensor:
    return run.first_gradient if isinstance(run, Trained) else run.gradient


def _first_loss(run: Measured | Trained) -> float:
    return run.losses[0] if isinstance(run, Trained) else run.loss


def _diverges_words(curves: _Curves) -> str:
    """Where a run that ``diverges`` first leaves one device, for a table without the
    ``first_diff_step`` column (the loss check's)."""
    if curves.first is not None:
        return f"step {curves.first} is the first whose loss leaves one device's"
    return (
        f"every step's loss is one device's, the final weights are not (max |Δ| "
        f"{curves.weights:.3g})"
    )


@dataclasses.dataclass(frozen=True)
class InPrecision:
    """A run judged in its own low precision (docs/design.md §2, "Low precision"): ``perturbed``
    is the same-precision one device with its model's forward in row blocks, whose departure from
    one device is the floor."""

    precision: str
    perturbed: Measured | Trained
    perturbed_curve: Trained | None = None
    """The perturbed run's training run, for a measured loss's curves (a trained run is its own)."""
    blocks: int = FLOOR_ROW_BLOCKS
    """The perturbation's row blocks: T is `floor.threshold` of them and the run's ranks."""
    threshold: float | None = None
    """T where the caller decided it from more than the blocks (a comparison of recordings, which
    knows each run's calls of the forward: `check.recordings._floor`)."""

    def limit(self, world_size: int) -> float:
        """T for a run of ``world_size`` ranks (`threshold`, else `floor.threshold`)."""
        if self.threshold is not None:
            return self.threshold
        return floor.threshold(self.blocks, world_size)

    def floored(
        self,
        run: Measured | Trained,
        reference: Measured | Trained,
        layout: Layout | None,
        world_size: int,
        micro_batches: int,
    ) -> tuple[Floored, dict[str, Floored]]:
        """The whole first gradient in floors (`floor.classify_floored`), and each part's with
        its own floor, at least the whole's (`floor.floor_of`), where the gradient has several
        parts."""
        mine, theirs, perturbed = _gradient(run), _gradient(reference), _gradient(self.perturbed)
        limit = self.limit(world_size)
        if not layout or len(layout) < 2 or len(mine) != len(theirs):
            whole = floor.classify_floored(
                mine, theirs, perturbed, self.precision, world_size, micro_batches, threshold=limit
            )
            return whole, {}
        # each part's moments read once, the whole's summed from them: two passes, not four
        (run_whole, run_parts), (floor_whole, floor_parts) = (
            gradients.part_moments(g, theirs, layout) for g in (mine, perturbed)
        )
        whole = self._classified(run_whole, floor_whole, world_size, micro_batches, limit)
        return whole, {
            name: self._classified(run_parts[name], floor_parts[name], world_size, micro_batches,
                                   limit, least=whole.floor)
            for name in layout
        }  # fmt: skip

    def _classified(
        self, run: gradients.Moments, perturbed: gradients.Moments, world_size: int,
        micro_batches: int, limit: float, least: float = 0.0,
    ) -> Floored:  # fmt: skip
        """`floor.classify_floored` of a gradient, its reference and the perturbed one device as
        their moments against the reference read them."""
        level = floor.floor_of(floor.relative_read(perturbed), self.precision, least)
        return floor.classify_read(run, level, self.precision, world_size, micro_batches, limit)

    def forward(
        self,
        run: Measured | Trained,
        reference: Measured | Trained,
        curves: tuple[Trained, Trained] | None,
        world_size: int,
    ) -> tuple[bool, float, float]:
        """Whether the run's first global loss is one device's in floors of this precision
        (`floor.forward_floored`), its relative difference, and the tolerance of its curves (a
        trained run's own, or a measured loss's training run's): T times the perturbed run's."""
        same, difference = floor.forward_floored(
            _first_loss(run), _first_loss(reference), _first_loss(self.perturbed), self.precision,
            self.limit(world_size),
        )  # fmt: skip
        reference_curve = reference if isinstance(run, Trained) else (curves or (None, None))[1]
        tolerance = (math.nan if reference_curve is None
                     else self.tolerance(reference_curve, world_size))  # fmt: skip
        return same, difference, tolerance

    def tolerance(self, reference: Trained, world_size: int) -> float:
        """A trained run's tolerance in this precision (losses and weights, absolute): T times
        the perturbed run's largest departure from one device's, of a step's loss or of a final
        weight, at least the unit roundoff of the largest loss (T: `floor.threshold` of the
        perturbation's blocks and the run's ``world_size``)."""
        perturbed = self.perturbed if isinstance(self.perturbed, Trained) else self.perturbed_curve
        assert perturbed is not None, "a measured loss's curves need the perturbed training run"
        losses = max(abs(a - b) for a, b in zip(perturbed.losses, reference.losses, strict=True))
        weights = gradients.largest_difference(perturbed.parameters, reference.parameters)
        least = Precision(self.precision).unit_roundoff * max(map(abs, reference.losses))
        return self.limit(world_size) * max(losses, weights, least)


@dataclasses.dataclass(frozen=True)
class Recorded:
    """What was measured of a run beside its own numbers: by a recording
    (`gatherlab.check.recordings`), ``classified``, the first gradient's class and its parts' where
    they were estimated from linear sketches (`gradients.classify_sketched`; None: classified by
    the judge from the gradients); ``unreduced``, the parts whose gradient differs between the
    run's ranks (their cause, and the whole's when it is not exact, is ``unreduced``: measured, it
    comes before any other); ``data_differs``, whether its global batches are not the reference's
    (the whole's verdict is ``data differs``). In a low precision, ``in_precision``: the floor's
    run of code judged in its own precision (`InPrecision`; None: judged in float64)."""

    classified: tuple[Classified, dict[str, Classified]] | None = None
    unreduced: Collection[str] = ()
    data_differs: bool = False
    in_precision: InPrecision | None = None
    desync: Collection[str] = ()
    """The parts whose weights differ between the run's ranks after some update (measured on
    the ranks): the run is no longer one model; its cause, after ``unreduced``, and a verdict
    that would train like one device is ``diverges``."""
    unreduced_over: str = ""
    """The mesh dimension over which ``unreduced``'s gradients are partial sums (a tensor-parallel
    model's, cause ``partial``); empty: gradients not reduced over the ranks (``unreduced``)."""
    rows_statistic: bool = False
    """Whether a departure that is a statistic over the rank's rows (a batch norm) is the cause,
    ``local_statistic``: a recording's, which has no removals to name it by (the check's name
    the batch norm a culprit)."""
    loss_rounding: float = 0.0
    """The rounding of the losses' own dtype where it is narrower than the precision the run is
    judged in (absolute; a float64 job whose loss is a float32 mean): its losses are held to it
    where it is larger than ``tolerance``, its gradient and weights to ``tolerance``."""


def _within(rows: list[Row], whole: Floored) -> list[Row]:
    """The rows of a run judged in its own precision: the precision's columns on them
    (`with_precision`), ``exact within …`` where float64's word would be ``exact``."""
    word = floor.within(whole.precision)
    return [
        dataclasses.replace(row, verdict=word) if row.verdict == EXACT else row
        for row in with_precision(rows, whole, whole.precision)
    ]


def as_classified(floored: Floored) -> Classified:
    """A gradient judged in floors as the numbers of a class (its class at the floor's
    resolution, cosine, norm ratio, relative departure)."""
    return Classified(floored.gradient, floored.cosine, floored.norm_ratio, floored.rel_err)


def with_precision(rows: list[Row], floored: Floored, judged_in: str) -> list[Row]:
    """The rows with the low-precision judgement of the whole gradient on the ``all`` row
    (``precision``, ``floor``, ``floors``, ``in_precision``) and ``judged_in`` on every row: the
    precision the verdict rests on."""
    numbers = {"precision": floored.precision, "floor": floored.floor,
               "floors": floored.floors, "in_precision": floored.verdict}  # fmt: skip
    return [
        dataclasses.replace(row, judged_in=judged_in, **(numbers if row.part == ALL_PARTS else {}))
        for row in rows
    ]


def judge(
    run: Measured | Trained,
    reference: Measured | Trained,
    key: Row,
    *,
    tolerance: float = gradients.FLOAT64_TOLERANCE,
    layout: Layout | None = None,
    curves: tuple[Trained, Trained] | None = None,
    reproduce: Reproduce | None = None,
    accumulated: Callable[[], Sequence[float]] | None = None,
    where: Callable[[], Departure | None] | None = None,
    recorded: Recorded | None = None,
) -> list[Row]:
    """The rows of a run on ``key.world_size`` ranks (``key.micro_batches`` per rank) against its
    one-device reference: the whole gradient's (``part`` ``all``), then each part's when it has
    several (a measured loss's: its reference's parts; a trained run's: ``layout``'s). ``key``
    names the rows (loss, gather, reference, removed).

    A run is a measured loss (`Measured`: its global loss relative to 1e-10, `same_forward`, and
    its training run in ``curves``, compared as a trained run's are) or a trained run (`Trained`:
    its first loss and every step's to ``tolerance``, absolute; its losses are its curve).

    - cause: a trained run's constant factor c (``scaled``); else, when the forward differs,
      what ``reproduce`` reproduces; ``micro_negatives`` when still none and one of the first
      losses of naive accumulation (``accumulated``) is the run's to ``tolerance``, relative;
      ``parts`` when the whole is biased and its parts are single factors
      (`gradients.single_factors`); ``local_statistic`` for an ``unexplained`` cause where the
      departure is a statistic.
    - verdict: `verdict`; ``diverges`` for the whole when its curves leave one device's.
    - where: for a whole that is not exact, ``where()`` (None: no place), on every row; a loss
      check's ``diverges`` says its step in ``departs`` first.

    A recorded run (`gatherlab.check.recordings`) gives what its recording measured (`Recorded`).
    A run judged in its own low precision (``recorded.in_precision``, `InPrecision`: the code
    cannot run in float64) has its forward, gradient and curves judged in floors of that
    precision, and the verdict ``exact within …`` where float64's would be ``exact``.
    """
    recorded = recorded or Recorded()
    classified, unreduced = recorded.classified, recorded.unreduced
    data_differs, in_precision = recorded.data_differs, recorded.in_precision
    world_size, micro_batches = key.world_size, key.micro_batches
    trained = isinstance(run, Trained)
    first, reference_first = _first_loss(run), _first_loss(reference)
    relative_same, loss_diff = gradients.same_forward(first, reference_first)
    low = None
    if in_precision is not None:  # the floors of its own precision replace float64's bounds
        low = in_precision.floored(run, reference, layout, world_size, micro_batches)
        relative_same, loss_diff, tolerance = in_precision.forward(run, reference, curves,
                                                                   world_size)  # fmt: skip
        classified = as_classified(low[0]), {k: as_classified(v) for k, v in low[1].items()}
    losses = max(tolerance, recorded.loss_rounding)  # the losses' own tolerance
    same = abs(first - reference_first) <= losses if trained else relative_same
    if trained and in_precision is not None:  # the first loss in floors too, as a measured one
        same = same and relative_same
    forward = Forward.SAME if same else Forward.DIFFERS
    cause, scale, shown_scale = None, None, None
    if trained:  # its own curve: a constant factor of every step's loss
        curves = (run, reference)
        scale = _curve_scale(run, reference, losses, in_precision is not None, key)
        cause = Cause.SCALED if scale is not None else None
    elif not same and reproduce is not None:
        cause, scale = reproduce()
    if classified is None:
        whole = gradients.classify(_gradient(run), _gradient(reference), world_size, micro_batches)
        parts = _classified_parts(run, reference, layout, world_size, micro_batches)
    else:
        whole, parts = classified
    if trained and cause is None and not same:  # its first loss and gradient, one factor
        shown_scale = _first_factor(first, reference_first, whole, key, losses)
        cause = Cause.SCALED if shown_scale is not None else None
    # its curve divided by c, as every scaled loss's is (c read from its first update too)
    compared = (None if curves is None else
                _curves(*curves, tolerance, scale or shown_scale, losses))  # fmt: skip
    if whole.gradient == GradientClass.BIASED and gradients.single_factors(parts):
        cause = Cause.PARTS
    elif cause is None and not same and accumulated is not None:
        cause = Cause.MICRO_NEGATIVES if _reproduced(first, accumulated(), tolerance) else None
    shared = dataclasses.replace(key, forward=str(forward), scale=scale or shown_scale,
                                 cause=str(cause or ""), loss_diff=loss_diff)  # fmt: skip
    if trained:  # every row of a trained run carries its curve's numbers
        shared = dataclasses.replace(
            shared, first_loss=first, train_max_abs_loss_diff=max(compared.differences),
            first_diff_step=compared.first, max_abs_param_diff=compared.weights,
        )  # fmt: skip
    head = _row(shared, ALL_PARTS, whole, compared is not None and compared.apart, data_differs)
    unreduced_cause = str(Cause.PARTIAL if recorded.unreduced_over else Cause.UNREDUCED)
    head = _measured_head(head, recorded, unreduced_cause, None if trained else compared)
    rows = [head] + [
        _row(shared, part, numbers, cause=unreduced_cause if part in unreduced else None)
        for part, numbers in parts.items()
    ]
    if low is not None:  # exact as far as its precision can tell
        rows = _within(rows, low[0])
    if rows[0].verdict in TRAINS_LIKE_ONE_DEVICE or where is None:
        return rows
    return _located(rows, where(), recorded.rows_statistic)


def _measured_head(
    head: Row, recorded: Recorded, unreduced_cause: str, loss_curves: _Curves | None
) -> Row:
    """The whole's row with what was measured beside its numbers: a part not reduced over the
    ranks (its cause, before any other, where the whole is not exact), ranks that step apart
    (``desync``: ``diverges`` where it would train like one device), and a measured loss's
    training run (``loss_curves``: its largest |Δloss| on this row only, and, where it
    diverges, its step in words: the loss check's table has no ``first_diff_step``)."""
    if recorded.unreduced and head.verdict != EXACT:
        head = dataclasses.replace(head, cause=unreduced_cause)
    elif recorded.desync:  # measured, whatever one device's run holds
        diverged = DIVERGES if head.verdict in TRAINS_LIKE_ONE_DEVICE else head.verdict
        head = dataclasses.replace(head, cause=str(Cause.DESYNC), verdict=diverged)
    if loss_curves is not None:
        head = dataclasses.replace(head, train_max_abs_loss_diff=max(loss_curves.differences))
        if head.verdict == DIVERGES:
            head = dataclasses.replace(head, departs=_diverges_words(loss_curves))
    return head


def _row(
    shared: Row,
    part: str,
    classified: Classified,
    apart: bool = False,
    data_differs: bool = False,
    cause: str | None = None,
) -> Row:
    """The row of one part (``all``: the whole) of a run's gradient: its class, its numbers and
    its verdict (``diverges`` and ``data differs`` only for the whole, whose curves are
    ``apart`` and whose batches differ); ``cause`` replaces the shared one (a part's own)."""
    return dataclasses.replace(
        shared, part=part, gradient=str(classified.gradient),
        verdict=verdict(shared.forward, classified.gradient, shared.scale, apart, data_differs),
        cosine=classified.cosine, norm_ratio=classified.norm_ratio,
        max_rel_err=classified.max_rel_err, cause=shared.cause if cause is None else cause,
    )  # fmt: skip


def _located(rows: list[Row], departure: Departure | None, rows_statistic: bool) -> list[Row]:
    """The rows with where the run departs (None: no place found), on every row; a ``diverges``
    whose step is in words keeps them first. An ``unexplained`` cause whose departure is a
    statistic over the rank's part is ``local_statistic``: that is why. With no cause read, a
    statistic over the entries its rows meet is its negatives (`_statistic_cause`), and, where
    ``rows_statistic`` (`Recorded`), one over the rank's rows (a batch norm) ``local_statistic``."""
    if departure is None:
        return rows
    head = rows[0]
    steps = head.departs if isinstance(head.departs, str) else None
    if steps is not None and departure.kind == DepartureKind.NONE:
        return rows  # the step it departs at says where; no line of the first step to add
    words = departure.words if steps is None else f"{steps}; at step 0: {departure.words}"
    located = {"where": departure.where, "departs": words}
    statistic = departure.kind == DepartureKind.STATISTIC
    over_rows = not departure.over or departure.over[0] == 0  # not the entries its rows meet
    if statistic and head.cause == Cause.UNEXPLAINED:
        located["cause"] = str(Cause.LOCAL_STATISTIC)
    elif statistic and not head.cause and not over_rows:  # the entries its rows meet: negatives
        located["cause"] = str(_statistic_cause(departure.over, head))
    elif statistic and not head.cause and rows_statistic:  # the rank's rows: a batch norm's
        located["cause"] = str(Cause.LOCAL_STATISTIC)
    if departure.kind == DepartureKind.LAYOUT:  # measured: a shape one device does not have
        located["cause"] = str(Cause.LAYOUT)
    return [dataclasses.replace(r, **located) for r in rows]


def _curve_scale(
    run: Trained, reference: Trained, tolerance: float, floored: bool, key: Row
) -> float | None:
    """c where every step's loss of ``run`` is c times the reference's (`hypotheses.scale`), to
    ``tolerance``; judged in floors (``floored``) only where c is one of the layout's named
    factors: to a floor's tolerance a ratio that merely stays near one value is no factor (a loss
    over each rank's own negatives read ×0.746, "drop the factor")."""
    scale = hypotheses.scale(run.losses, reference.losses, tolerance)
    if scale is not None and floored and gradients.factor_name(
            scale, key.world_size, key.micro_batches, tolerance) is None:  # fmt: skip
        return None
    return scale


def _first_factor(
    first: float, reference: float, whole: Classified, key: Row, tolerance: float
) -> float | None:
    """c where a trained run's first loss, computed at the reference's weights on its rows, is a
    named factor c of the reference's (`gradients.factor_name`, to the losses' ``tolerance``
    relative to the reference's loss) and its first gradient is that factor too: the cause
    ``scaled``, read from the first step, after which the run trains at other weights."""
    if not reference or math.isnan(first) or math.isnan(reference):
        return None
    resolution = max(tolerance / abs(reference), gradients.FLOAT64_TOLERANCE)
    name = gradients.factor_name(first / reference, key.world_size, key.micro_batches, resolution)
    return first / reference if name is not None and name == whole.gradient else None


def _statistic_cause(over: tuple[int, int, int], head: Row) -> Cause:
    """The cause a run's departure names where nothing reproduced one (a recording has no
    one-device run to reproduce it on): a reduction over the rank's part of the entries its rows
    meet (a similarity's columns, dimension ``over[0]`` ≥ 1) is the rank's own rows as each row's
    negatives (``local_negatives``), or its micro-batch's where the run accumulates K
    micro-batches (``micro_negatives``)."""
    return Cause.MICRO_NEGATIVES if head.micro_batches > 1 else Cause.LOCAL_NEGATIVES


def _reproduced(first: float, values: Sequence[float], tolerance: float) -> bool:
    """Whether one of ``values`` is the run's first loss to ``tolerance``, relative."""
    return any(abs(value - first) <= tolerance * max(abs(value), 1e-300) for value in values)


def _classified_parts(
    run: Measured | Trained,
    reference: Measured | Trained,
    layout: Layout | None,
    world_size: int,
    micro_batches: int,
) -> dict[str, Classified]:
    """Each part's class of the first gradient (`gradients.classify_parts`): a measured loss's
    parts are its reference's; a trained run's are ``layout``'s, when the run kept its parameters
    (a removal may replace a layer and its parameters with it)."""
    gradient = _gradient(run)
    if not isinstance(run, Trained):  # a `Measured`: the parts its reference measured
        layout = reference.parts
    elif layout is None or len(gradient) != sum(b - a for r in layout.values() for a, b in r):
        return {}
    return gradients.classify_parts(
        gradient, _gradient(reference), layout, world_size, micro_batches
    )
