"""The arithmetic of a comparison with one device, written once: the tolerances, a gradient's
cosine and norm ratio with one device's, the named constant factors, the class of a gradient
(and of each of its parts), and whether a global loss is one device's (docs/design.md §1, §2).
The check (`gatherlab.check`: measure, where, reference, hypotheses, judge) and the report
(`gatherlab.analysis.report`) read them here.

A gradient against one device's:

- ``exact``: max |g − g₁| / max |g₁| ≤ 1e-10 (summation order only);
- ``none``: no gradient reaches the parameters (g = 0), whether one device has one or not;
- a named factor (`factors`: 1/W, W, and with K micro-batches per rank 1/K, K, …): the same
  direction (cosine ≥ `PARALLEL_COSINE`) and that norm ratio to a relative 1e-10;
- ``biased``: another direction; ``other``: anything else (the same direction at a factor no
  name gives, or a gradient where one device has none).
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

from gatherlab.core.terms import Factor, GradientClass, Precision

if TYPE_CHECKING:  # torch is imported by the functions that take tensors, when first called:
    import torch  # the tolerances are read by `python -m gatherlab.check` before torch (§4)

__all__ = [
    "FLOAT32_TOLERANCE", "FLOAT64_TOLERANCE", "PARALLEL_COSINE", "SINGLE_FACTORS", "TOLERANCE",
    "Classified", "Layout", "Moments", "class_of", "classify", "classify_parts",
    "classify_sketched", "cosine_and_norm_ratio", "factor_name", "factors", "largest_difference",
    "moments", "one_thread", "part_moments", "read_cosine_and_norm_ratio", "same_forward",
    "single_factors", "split", "tolerance",
]  # fmt: skip

# Layouts agree up to the order of floating-point sums (gloo's all-reduce, DDP's gradient average).
# Over tens of steps that stays within ~1e-13 in float64 and ~1e-6 in float32; the bounds leave
# room above that and stay far below what a wrong gradient produces (≥ 1e-6 after one step here).
FLOAT64_TOLERANCE = 1e-10
"""The float64 bound of docs/design.md §2: a loss, a gradient, a norm ratio or a weight of W ranks
against one device, relative or absolute as each comparison states."""
FLOAT32_TOLERANCE = 1e-5
"""The float32 bound of docs/design.md §2 (a training run's losses and weights, absolute)."""
TOLERANCE = {Precision.FLOAT64: FLOAT64_TOLERANCE, Precision.FLOAT32: FLOAT32_TOLERANCE}
"""Per precision, the largest |Δloss| and |Δparameter| of a run that matches its reference."""


def tolerance(precision: str) -> float:
    """A fixed absolute bound of ``precision`` (`TOLERANCE`; for bf16 and fp16, 16 units of
    roundoff), where a check compares two runs of one device: a layout of W ranks is judged in
    those precisions against a measured floor instead (`gatherlab.core.floor`)."""
    return TOLERANCE.get(precision, 16 * Precision(precision).unit_roundoff)


PARALLEL_COSINE = 1 - 1e-12
"""The cosine at and above which a gradient has one device's direction."""

Layout = dict[str, list[tuple[int, int]]]
"""The parts of a flattened gradient: each part's name and its ranges (start, stop) in it."""


class Classified(NamedTuple):
    """A gradient's class against one device's (`classify`), with the numbers it is read from."""

    gradient: str
    cosine: float
    norm_ratio: float
    max_rel_err: float


def same_forward(loss: float, reference: float) -> tuple[bool, float]:
    """Whether a global loss is the reference's up to summation order, and its relative
    difference."""
    difference = abs(loss - reference) / max(abs(reference), sys.float_info.min)  # float64's tiny
    return difference <= FLOAT64_TOLERANCE, difference


def _near(ratio: float, expected: float, resolution: float = FLOAT64_TOLERANCE) -> bool:
    return abs(ratio / expected - 1) <= max(resolution, FLOAT64_TOLERANCE)


def cosine_and_norm_ratio(vector: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """The cosine of ``vector`` with a nonzero ``reference`` (NaN for a zero vector) and the
    ratio of their norms."""
    import torch

    norm, reference_norm = torch.linalg.vector_norm(vector), torch.linalg.vector_norm(reference)
    cosine = float(vector @ reference / (norm * reference_norm)) if norm > 0 else float("nan")
    return cosine, float(norm / reference_norm)


def read_cosine_and_norm_ratio(read: Moments) -> tuple[float, float]:
    """`cosine_and_norm_ratio` from the `Moments` of a vector and a nonzero reference."""
    norm, reference_norm = math.sqrt(read.squares), math.sqrt(read.reference_squares)
    cosine = read.product / (norm * reference_norm) if norm > 0 else math.nan
    return cosine, norm / reference_norm


def factors(world_size: int, micro_batches: int = 1) -> dict[str, float]:
    """The named constant factors of a gradient on ``world_size`` ranks that each accumulate
    ``micro_batches`` micro-batches, name → c, in the order a norm ratio is matched
    (docs/design.md §1): those of one axis (1/W, W, 1/K, K), then those of both (1/(W·K), W·K,
    W/K, K/W). A name is there only when every axis it involves is ≥ 2 and its c is not 1, so
    with ``micro_batches=1`` only 1/W and W (none at W = 1). Where two names give one c, the
    first keeps it (K, not W/K, at W = K²; W, not K/W, at K = W²), except at W = K, where 1/W
    and 1/K (W and K) are one name, ``1/W = 1/K`` (``W = K``): no measurement tells them apart
    there, another (W, K) does."""
    both = world_size >= 2 and micro_batches >= 2
    candidates: list[tuple[str, float]] = []
    if both and world_size == micro_batches:
        candidates += [(Factor.ONE_OVER_W_OR_K, 1 / world_size), (Factor.W_OR_K, world_size)]
    else:
        if world_size >= 2:
            candidates += [(GradientClass.ONE_OVER_W, 1 / world_size)]
            candidates += [(GradientClass.W, world_size)]
        if micro_batches >= 2:
            candidates += [(Factor.ONE_OVER_K, 1 / micro_batches), (Factor.K, micro_batches)]
    if both:
        product, quotient = world_size * micro_batches, world_size / micro_batches
        candidates += [(Factor.ONE_OVER_W_K, 1 / product), (Factor.W_K, product),
                       (Factor.W_OVER_K, quotient), (Factor.K_OVER_W, 1 / quotient)]  # fmt: skip
    named: dict[str, float] = {}
    for name, c in candidates:
        if not _near(c, 1) and not any(_near(c, kept) for kept in named.values()):
            named[name] = c
    return named


def factor_name(
    ratio: float, world_size: int, micro_batches: int = 1, resolution: float = FLOAT64_TOLERANCE
) -> str | None:
    """The name of the constant factor ``ratio`` on this layout (`factors`, to a relative 1e-10,
    or to ``resolution`` when that is coarser), or None when no name gives it."""
    for name, c in factors(world_size, micro_batches).items():
        if _near(ratio, c, resolution):
            return name
    return None


def class_of(
    cosine: float,
    norm_ratio: float,
    rel_err: float,
    zero_gradient: bool,
    zero_reference: bool,
    world_size: int,
    micro_batches: int = 1,
    resolution: float = FLOAT64_TOLERANCE,
) -> str:
    """The class of a gradient from the numbers it is read from, the one rule of docs/design.md §1
    for a whole gradient (`classify`), for one estimated from linear sketches
    (`classify_sketched`) and for one in a low precision (`classify_floored`): no gradient on
    either side ``none``; a gradient where one device has none ``other``; ``rel_err`` (its
    difference relative to one device's) ≤ ``resolution`` (1e-10 in float64) ``exact``; a zero
    gradient ``none``; the same direction (``cosine`` ≥ `PARALLEL_COSINE`, or 1 − resolution²
    when that is lower) at a named factor ``norm_ratio`` (`factors`, to the resolution) that
    factor's name; another direction ``biased``; else ``other`` (the right direction at a factor
    no name gives)."""
    if zero_reference:  # no gradient on one device either: nothing to compare a direction with
        return GradientClass.NONE if zero_gradient else GradientClass.OTHER
    if rel_err <= resolution:
        return GradientClass.EXACT
    if zero_gradient:
        return GradientClass.NONE
    if cosine >= min(PARALLEL_COSINE, 1 - resolution**2):
        named = factor_name(norm_ratio, world_size, micro_batches, resolution)
        return GradientClass.OTHER if named is None else named
    return GradientClass.BIASED


# `moments` reads both vectors in blocks of this many elements (512 KiB of float64 for the two):
# every sum and peak in one pass that stays in the cache, where whole-vector operations made six
# temporaries of the gradient's size and eight passes (measured at 85M float64 elements, one
# thread: `classify` 1.6-3.0 s before, 0.4 s in blocks of 2^14 to 2^17, 0.76 s in blocks of 2^18).
_BLOCK = 1 << 15
# ... on one thread (`one_thread`): each block's few operations are too small to split, and where
# other processes share the cores, a second thread that is not scheduled holds every operation up
# at its barrier (measured on two shared cores: `moments` of two 85M-element vectors 18-65 s with
# two threads, 0.6-0.9 s on one).


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op threads set to one, and back to what they were."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class Moments(NamedTuple):
    """What a comparison of a gradient g with a reference g₁ reads of the two (`moments`), each in
    float64: the sums g·g, g₁·g₁, g·g₁ and (g − g₁)·(g − g₁), and the peaks max |g|, max |g₁| and
    max |g − g₁|."""

    squares: float
    reference_squares: float
    product: float
    difference_squares: float
    peak: float
    reference_peak: float
    departure: float


def moments(gradient: torch.Tensor, reference: torch.Tensor) -> Moments:
    """The `Moments` of ``gradient`` against ``reference`` (flattened, the same length), read in
    one pass over both in blocks (`_BLOCK`), so that no temporary of their size is made; a NaN
    anywhere is kept (`torch.maximum`)."""
    import torch

    mine, theirs = gradient.reshape(-1), reference.reshape(-1)
    sums = torch.zeros(4, dtype=torch.float64)
    peaks = torch.zeros(3, dtype=torch.float64)
    blocks = torch.empty(3, min(_BLOCK, mine.numel()), dtype=torch.float64)  # reused: no allocation
    with one_thread():
        for start in range(0, mine.numel(), _BLOCK):
            stop = min(start + _BLOCK, mine.numel())
            a, b, d = blocks[:, : stop - start]
            a.copy_(mine[start:stop])  # in float64, whatever the vectors' dtype
            b.copy_(theirs[start:stop])
            torch.sub(a, b, out=d)
            sums += torch.stack([a @ a, b @ b, a @ b, d @ d])
            peaks = torch.maximum(peaks, torch.stack([a.abs().max(), b.abs().max(), d.abs().max()]))
    return Moments(*sums.tolist(), *peaks.tolist())


def part_moments(
    gradient: torch.Tensor, reference: torch.Tensor, parts: Layout
) -> tuple[Moments, dict[str, Moments]]:
    """The `Moments` of each part of ``parts`` (its ranges of the flattened vectors) and of the
    whole, in one pass over both vectors: the whole's sums are its parts' sums and its peaks their
    largest, where the parts' ranges cover the vectors (else the whole is read on its own)."""
    read = {
        name: _summed([moments(gradient[a:b], reference[a:b]) for a, b in ranges])
        for name, ranges in parts.items()
    }
    covered = sum(b - a for ranges in parts.values() for a, b in ranges)
    whole = _summed(list(read.values())) if covered == gradient.numel() else None
    return (moments(gradient, reference) if whole is None else whole), read


def _summed(read: Sequence[Moments]) -> Moments:
    """The `Moments` of vectors made of pieces from the pieces' own: sums added, peaks the
    largest (a NaN kept)."""
    if len(read) == 1:
        return read[0]
    sums = [math.fsum(r[i] for r in read) for i in range(4)]
    peaks = [
        math.nan if any(math.isnan(r[i]) for r in read) else max(r[i] for r in read)
        for i in range(4, 7)
    ]
    return Moments(*sums, *peaks)


def largest_difference(tensor: torch.Tensor, other: torch.Tensor | None = None) -> float:
    """max |tensor − other| (max |tensor| without ``other``) over the flattened tensors, read in
    blocks (`_BLOCK`) so that no temporary of their size is made; NaN where either holds a NaN,
    0 for empty tensors."""
    import torch

    mine = tensor.reshape(-1)
    theirs = None if other is None else other.reshape(-1)
    peak = torch.zeros((), dtype=torch.float64)
    blocks = torch.empty(2, min(_BLOCK, mine.numel()), dtype=torch.float64)  # reused
    with one_thread():
        for start in range(0, mine.numel(), _BLOCK):
            stop = min(start + _BLOCK, mine.numel())
            block, other_block = blocks[:, : stop - start]
            block.copy_(mine[start:stop])  # in float64, whatever the vectors' dtype
            if theirs is not None:
                block.sub_(other_block.copy_(theirs[start:stop]))
            peak = torch.maximum(peak, block.abs_().max())  # a NaN stays
    return float(peak)


def classify(
    gradient: torch.Tensor, reference: torch.Tensor, world_size: int, micro_batches: int = 1
) -> Classified:
    """The class of ``gradient`` against ``reference`` on ``world_size`` ranks that each
    accumulate ``micro_batches`` micro-batches (`class_of`), with cosine, norm ratio, max rel.
    error (max |g − g₁| / max |g₁|): a gradient parallel to the reference at a named factor
    (`factors`) is named by it, at any other factor ``other`` (the factor is its norm ratio). No
    gradient on either side is ``none``, never ``exact``: nothing trains (cosine, norm ratio and
    max rel. error NaN, as for any zero reference). Its numbers are read in one pass
    (`moments`)."""
    read = moments(gradient, reference)
    zero_gradient = read.peak == 0
    if read.reference_squares == 0:  # no gradient on one device either
        measured = class_of(math.nan, math.nan, math.nan, zero_gradient, True, world_size)
        return Classified(measured, math.nan, math.nan, math.nan)
    cosine, norm_ratio = read_cosine_and_norm_ratio(read)
    max_rel_err = read.departure / read.reference_peak
    measured = class_of(
        cosine, norm_ratio, max_rel_err, zero_gradient, False, world_size, micro_batches
    )
    return Classified(measured, cosine, norm_ratio, max_rel_err)


def classify_sketched(
    sketch: Sequence[float],
    reference_sketch: Sequence[float],
    norm: float,
    reference_norm: float,
    world_size: int,
    micro_batches: int = 1,
    resolution: float = FLOAT64_TOLERANCE,
) -> Classified:
    """The class of a gradient known by its linear sketch S g and its exact norm ‖g‖ against one
    device's (S g₁, ‖g₁‖), by the rule of `class_of`: cosine ⟨S g, S g₁⟩ / (‖S g‖ ‖S g₁‖), norm
    ratio ‖g‖ / ‖g₁‖ (exact), relative error ‖S(g − g₁)‖ / ‖g₁‖ with the exact ‖g₁‖ (its
    ``max_rel_err`` field). A linear sketch keeps equality and parallelism (S(c·g) = c·S g), so
    ``exact`` and a named factor are read exactly; a biased gradient's cosine and relative error
    are estimates, within the bounds docs/recording.md §11 states for k. ``resolution``: the
    smallest relative departure read as one (1e-10 in float64; T floors in a low precision,
    `gatherlab.core.floor.classify_sketched_floored`)."""
    import numpy as np

    mine = np.asarray(sketch, dtype=np.float64)
    theirs = np.asarray(reference_sketch, dtype=np.float64)
    if reference_norm == 0:
        measured = class_of(math.nan, math.nan, math.nan, norm == 0, True, world_size)
        return Classified(measured, math.nan, math.nan, math.nan)
    product = float(np.linalg.norm(mine)) * float(np.linalg.norm(theirs))
    cosine = float(mine @ theirs / product) if product > 0 else math.nan
    norm_ratio = norm / reference_norm
    rel_err = float(np.linalg.norm(mine - theirs)) / reference_norm
    measured = class_of(
        cosine, norm_ratio, rel_err, norm == 0, False, world_size, micro_batches, resolution
    )
    return Classified(measured, cosine, norm_ratio, rel_err)


def split(gradient: torch.Tensor, parts: Layout) -> dict[str, torch.Tensor]:
    """Each part's gradient, in the order of ``parts``: a view of ``gradient`` for a part of one
    range (a top-level child's parameters are one), a copy for a part of several (not to be
    changed in place: it may be the gradient itself)."""
    import torch

    return {
        name: gradient[ranges[0][0] : ranges[0][1]] if len(ranges) == 1
        else torch.cat([gradient[start:stop] for start, stop in ranges])
        for name, ranges in parts.items()
    }  # fmt: skip


def classify_parts(
    gradient: torch.Tensor,
    reference: torch.Tensor,
    parts: Layout | None,
    world_size: int,
    micro_batches: int = 1,
) -> dict[str, Classified]:
    """Each part's class against the reference's same part (`classify`), when the gradient has
    more than one part; nothing for one part (the whole is that part)."""
    if parts is None or len(parts) < 2:
        return {}
    mine, theirs = split(gradient, parts), split(reference, parts)
    return {name: classify(mine[name], theirs[name], world_size, micro_batches) for name in parts}


SINGLE_FACTORS = {
    GradientClass.EXACT, GradientClass.ONE_OVER_W, GradientClass.W, GradientClass.NONE, *Factor,
}  # fmt: skip
"""The classes that are one named factor of one device's gradient (1 included: exact)."""


def single_factors(parts: Mapping[str, Classified]) -> bool:
    """Whether every part's gradient (`classify_parts`) is one named factor of one device's
    (exact, 1/W, W, a `Factor` such as K, or none) and the factors differ: their sum then points
    elsewhere (``biased``), and the parts say why."""
    classes = {numbers[0] for numbers in parts.values()}
    return len(classes) > 1 and classes <= SINGLE_FACTORS
