"""A low precision judged against a measured floor, written once (docs/design.md §2, "Low
precision"): the floor, the score, the class read at the floor's resolution, the verdict word
and the power of the judgement.

In float32, bf16 or fp16 a W-rank run never equals one device to float64's 1e-10: every sum over
rows that the ranks split rounds differently. Its departure from the **same-precision** one-device
run is therefore measured in units of a **floor**: the departure of a perturbation of one device
that adds rounding of the same kind and changes nothing mathematically, its model's forward in two
row blocks (`gatherlab.runs.precision.RowBlocks`). ``score = ‖g_W − g₁‖ / ‖g_split − g₁‖``; a run
with a score ≤ `FLOOR_THRESHOLD` is as close to one device as its precision allows (``exact
within bf16``); beyond it, its class is read as in float64 with the floor's resolution, T · floor,
in place of 1e-10. The smallest departure the judgement sees is that resolution, its **power**.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from gatherlab.core.terms import GradientClass, Precision

if TYPE_CHECKING:
    import torch

    from gatherlab.core.gradients import Moments

__all__ = [
    "FLOOR_THRESHOLD", "WITHIN", "Floored", "classify_at", "classify_floored",
    "classify_sketched_floored", "floor_of",
    "forward_floored", "judged_in", "power_words", "relative", "within",
]  # fmt: skip

FLOOR_THRESHOLD = 3.0
"""The most floors a W-rank run may depart from one device and still be ``exact within`` its
precision: exact runs measured at most 1.37 (float32), 1.25 (bf16) and 1.19 (fp16) floors (MLP +
NT-Xent, global batch 64, 10 seeds, W = 2, 4, 8; `experiments/precision.py`), a margin of 2.2×;
the old gather, local negatives, per-rank batch norm and naive accumulation at least 4.4 (bf16's
naive accumulation at W = 8), most far more (docs/design.md §2, "Low precision")."""


def within(precision: str) -> str:
    """The verdict of a run as close to one device as ``precision`` allows: ``exact within
    bf16`` (``float32``, ``fp16``)."""
    return f"exact within {Precision(precision).word}"


WITHIN = frozenset(within(p) for p in Precision if p != Precision.FLOAT64)
"""The verdicts ``exact within float32``, ``exact within bf16`` and ``exact within fp16``."""


def relative(vector: torch.Tensor, reference: torch.Tensor) -> float:
    """‖vector − reference‖ / ‖reference‖ in float64 (NaN for a zero reference), read in one
    pass (`gradients.moments`)."""
    from gatherlab.core.gradients import moments

    return _relative(moments(vector, reference))


def _relative(read: Moments) -> float:
    norm = math.sqrt(read.reference_squares)
    return math.sqrt(read.difference_squares) / norm if norm > 0 else math.nan


def floor_of(perturbed: float, precision: str, least: float = 0.0) -> float:
    """The floor from the perturbation's measured relative departure: itself, or the precision's
    unit roundoff where the perturbation changed no bit (a floor of 0 would make every rounding a
    departure); at least ``least`` (a part's floor is at least its whole gradient's: a part's
    own perturbation is one sample of its rounding, and a small one made a correct part read
    ``biased`` beside an exact whole)."""
    return max(perturbed if perturbed > 0 else Precision(precision).unit_roundoff, least)


class Floored(NamedTuple):
    """A gradient in a low precision against the same-precision one device's, in floors:
    ``gradient`` its class read at the floor's resolution (`classify_floored`), ``verdict``
    ``exact within …`` for an exact class, else the class; ``floor`` the perturbation's relative
    departure, ``floors`` the run's relative departure ``rel_err`` in floors; ``cosine`` and
    ``norm_ratio`` against one device's."""

    precision: str
    gradient: str
    verdict: str
    floor: float
    floors: float
    cosine: float
    norm_ratio: float
    rel_err: float

    @property
    def power(self) -> float:
        """The smallest relative departure of the gradient this judgement sees: T · floor."""
        return FLOOR_THRESHOLD * self.floor


def classify_floored(
    gradient: torch.Tensor,
    reference: torch.Tensor,
    perturbed: torch.Tensor,
    precision: str,
    world_size: int,
    micro_batches: int = 1,
    least_floor: float = 0.0,
) -> Floored:
    """``gradient`` (W ranks, in ``precision``) against ``reference`` (one device, the same
    precision) in units of the floor that ``perturbed`` (one device in row blocks) measures
    (`classify_at`), at least ``least_floor`` (a part's: its whole's floor, `floor_of`)."""
    floor = floor_of(relative(perturbed, reference), precision, least_floor)
    return classify_at(gradient, reference, floor, precision, world_size, micro_batches)


def classify_at(
    gradient: torch.Tensor,
    reference: torch.Tensor,
    floor: float,
    precision: str,
    world_size: int,
    micro_batches: int = 1,
) -> Floored:
    """``gradient`` against ``reference`` in units of ``floor``: its class by
    `gradients.class_of` at the resolution T · floor."""
    from gatherlab.core.gradients import class_of, moments, read_cosine_and_norm_ratio

    read = moments(gradient, reference)  # one pass over both
    zero_gradient = not read.peak > 0
    if read.reference_squares == 0:
        measured = class_of(math.nan, math.nan, math.nan, zero_gradient, True, world_size)
        return Floored(precision, measured, measured, floor, math.nan, math.nan, math.nan,
                       math.nan)  # fmt: skip
    rel_err = _relative(read)
    cosine, norm_ratio = read_cosine_and_norm_ratio(read)
    resolution = FLOOR_THRESHOLD * floor
    measured = class_of(
        cosine, norm_ratio, rel_err, zero_gradient, False, world_size, micro_batches, resolution
    )
    verdict = within(precision) if measured == GradientClass.EXACT else measured
    return Floored(precision, measured, verdict, floor, rel_err / floor, cosine, norm_ratio,
                   rel_err)  # fmt: skip


def classify_sketched_floored(
    sketches: tuple[Sequence[float], Sequence[float], Sequence[float]],
    norms: tuple[float, float],
    precision: str,
    world_size: int,
    micro_batches: int = 1,
    least_floor: float = 0.0,
) -> Floored:
    """A gradient known by its linear sketch and exact norm (``sketches``: the run's, one
    device's, the perturbed one device's; ``norms``: the run's and one device's) in floors, as
    `classify_floored` reads full gradients: the floor ‖S(g_split − g₁)‖ / ‖g₁‖, the class by
    `gradients.classify_sketched` at the resolution T · floor (the relative departures are the
    sketches' estimates of the full gradients', docs/design.md §11); the floor at least
    ``least_floor``."""
    import numpy as np

    from gatherlab.core.gradients import classify_sketched

    mine, theirs, perturbed = (np.asarray(s, dtype=np.float64) for s in sketches)
    norm, reference_norm = norms
    departure = float(np.linalg.norm(perturbed - theirs)) / reference_norm if reference_norm else 0
    floor = floor_of(departure, precision, least_floor)
    measured = classify_sketched(mine, theirs, norm, reference_norm, world_size, micro_batches,
                                 FLOOR_THRESHOLD * floor)  # fmt: skip
    verdict = within(precision) if measured.gradient == GradientClass.EXACT else measured.gradient
    return Floored(precision, measured.gradient, verdict, floor, measured.max_rel_err / floor,
                   measured.cosine, measured.norm_ratio, measured.max_rel_err)  # fmt: skip


def forward_floored(
    loss: float, reference: float, perturbed: float, precision: str
) -> tuple[bool, float]:
    """Whether a global loss in a low precision is the same-precision one device's to T floors
    (the floor: the perturbation's relative difference, at least the unit roundoff), and its
    relative difference."""
    scale = max(abs(reference), 1e-300)
    floor = max(abs(perturbed - reference) / scale, Precision(precision).unit_roundoff)
    difference = abs(loss - reference) / scale
    return difference <= FLOOR_THRESHOLD * floor, difference


def power_words(floored: Floored) -> str:
    """What a low-precision judgement cannot see, in one sentence."""
    word = Precision(floored.precision).word
    return (
        f"in {word} this check detects departures of the gradient of ~{floored.power:.1e} "
        f"(relative) and larger ({FLOOR_THRESHOLD:g} floors of {floored.floor:.1e}); run in "
        "float64 to see smaller ones"
    )


def judged_in(
    requested: str, runs_in_float64: bool, autocast: str | None
) -> tuple[str, str | None]:
    """The precision a check's verdict rests on, and the low precision measured in floors (None:
    none), for code asked to run in ``requested``: float64 judges code that runs in it, and its
    run in ``requested`` (or in the dtype its own ``torch.autocast`` asks for) is measured beside
    it; code that cannot run in float64 is judged in its own precision, ``requested`` or, asked
    for float64, float32 (docs/design.md §2, "Low precision")."""
    own = {"bfloat16": Precision.BF16_MIXED, "float16": Precision.FP16_MIXED}.get(autocast or "")
    if requested == Precision.FLOAT64:
        low = own if runs_in_float64 else (own or Precision.FLOAT32)
    else:
        low = Precision(requested)
    if runs_in_float64:
        return str(Precision.FLOAT64), None if low is None else str(low)
    return str(low), str(low)
