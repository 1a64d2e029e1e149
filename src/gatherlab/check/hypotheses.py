"""Why a global loss on W ranks differs from one device's: causes reproduced, not guessed
(docs/checking.md §6). Each hypothesis computes, on one device, what the W-rank global loss would
be if that cause were at work; a hypothesis holds when it reproduces the measured global loss to a
relative 1e-10 on every batch the check measured (two). Only one-device forwards are run.

- ``scaled``: c × the 1-device loss, with one c for every batch (c ≠ 1);
- ``local_negatives``: the mean over ranks of the 1-device loss of each rank's slice alone (each
  rank's loss sees only its own rows: its negatives, targets or statistics are local);
- ``micro_negatives`` (with K > 1 micro-batches per rank): the mean over the W·K micro-batches of
  the 1-device loss of each micro-batch alone (what naive accumulation computes: each
  micro-batch's loss sees only its own rows);
- ``pair_order``: the 1-device loss of the rows in the order that concatenating the two views per
  rank and gathering produces ([view 0 of rank 0; view 1 of rank 0; view 0 of rank 1; …], split
  in halves as the two views), i.e. positives paired by position in that order.

A loss not divided by K when accumulating K micro-batches, or divided by it twice, is ``scaled``
with c = K or 1/K. A hypothesis whose one-device replay breaks the loss's contract (a loss that
returns NaN on a slice it was never meant to see alone, such as rows its memory bank never held)
does not hold: it reproduces nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from gatherlab.core import terms
from gatherlab.core.gradients import FLOAT64_TOLERANCE
from gatherlab.core.terms import Cause

# gatherlab.runs.loss and .steplog are imported where a hypothesis is replayed (a check's): they
# import torch.distributed.tensor (~0.6 s), which a comparison of recordings never needs.

Forward = Callable[..., float]
"""The loss of two views on one device, forward only: ``forward(view0, view1, rows=rows)``,
``rows`` the rows of the global batch the views hold (a slice or an index tensor), whose further
inputs a loss that takes some is given (`gatherlab.components.factory.Inputs`)."""
Batch = tuple[torch.Tensor, torch.Tensor]

__all__ = ["cause", "local_negatives", "micro_negatives", "pair_order", "scale"]


def _close(value: float, target: float, tolerance: float = FLOAT64_TOLERANCE) -> bool:
    return abs(value - target) <= tolerance * max(abs(target), torch.finfo(torch.float64).tiny)


def scale(
    losses: Sequence[float], references: Sequence[float], tolerance: float = FLOAT64_TOLERANCE
) -> float | None:
    """c when every loss is c × its reference to a relative ``tolerance``, one c for all (c ≠ 1
    by more than that); None otherwise (also when a reference is 0)."""
    if not losses or any(reference == 0 for reference in references):
        return None
    c = losses[0] / references[0]
    if _close(c, 1.0, tolerance) or not all(
        _close(loss, c * reference, tolerance)
        for loss, reference in zip(losses, references, strict=True)
    ):
        return None
    return c


def local_negatives(forward: Forward, batch: Batch, world_size: int) -> float:
    """The mean over ranks of the 1-device loss of each rank's slice of ``batch`` alone."""
    view0, view1 = batch
    slices = [terms.rows_of(rank, world_size, len(view0)) for rank in range(world_size)]
    from gatherlab.runs.steplog import mean_over_ranks

    return mean_over_ranks([[forward(view0[rows], view1[rows], rows=rows)] for rows in slices])[0]


def micro_negatives(forward: Forward, batch: Batch, world_size: int, micro_batches: int) -> float:
    """The mean over the W·K micro-batches of ``batch`` (W = ``world_size``, K =
    ``micro_batches``) of the 1-device loss of each micro-batch alone. The N rows split into W·K
    contiguous blocks of b = N/(W·K) rows: rank r holds rows r·K·b … (r+1)·K·b − 1
    (docs/design.md §2), and its micro-batch k is rows (r·K + k)·b … (r·K + k + 1)·b − 1. With
    equal blocks the mean over ranks of each rank's mean over its micro-batches is this mean over
    all W·K of them."""
    view0, view1 = batch
    blocks = world_size * micro_batches
    if len(view0) % blocks:
        raise ValueError(
            f"the global batch of {len(view0)} does not split into {world_size} ranks × "
            f"{micro_batches} micro-batches"
        )
    slices = [terms.rows_of(block, blocks, len(view0)) for block in range(blocks)]
    from gatherlab.runs.steplog import mean_over_ranks

    return mean_over_ranks([[forward(view0[rows], view1[rows], rows=rows)] for rows in slices])[0]


def pair_order(forward: Forward, batch: Batch, world_size: int) -> float:
    """The 1-device loss of the rows in the order that concatenating the views per rank, then
    gathering, produces, split in halves as the two views (a loss's further inputs taken in the
    order of the first half's samples)."""
    view0, view1 = batch
    slices = [terms.rows_of(rank, world_size, len(view0)) for rank in range(world_size)]
    rows = torch.cat([torch.cat([view0[s], view1[s]]) for s in slices])
    samples = torch.arange(len(view0))
    order = torch.cat([torch.cat([samples[s], samples[s]]) for s in slices])[: len(view0)]
    return forward(rows[: len(view0)], rows[len(view0) :], rows=order)


HYPOTHESES: dict[Cause, Callable[[Forward, Batch, int], float]] = {
    Cause.LOCAL_NEGATIVES: local_negatives,
    Cause.PAIR_ORDER: pair_order,
}


def cause(
    losses: Sequence[float],
    references: Sequence[float],
    forward: Forward,
    batches: Sequence[Batch],
    world_size: int,
    micro_batches: int = 1,
) -> tuple[Cause, float | None]:
    """The first hypothesis that reproduces the global ``losses`` of these ``batches`` on
    ``world_size`` ranks that each accumulate ``micro_batches`` micro-batches (``references``:
    one device's, the whole batch at once), in the order ``scaled``, ``local_negatives``,
    ``micro_negatives`` (only when ``micro_batches`` > 1: at 1 it is ``local_negatives``),
    ``pair_order``; ``unexplained`` when none does. With ``scaled``, its c; else None."""
    c = scale(losses, references)
    if c is not None:
        return Cause.SCALED, c
    tested = dict(HYPOTHESES)
    if micro_batches > 1:  # at K = 1 it is local_negatives; tested right after it
        micro = functools.partial(micro_negatives, micro_batches=micro_batches)
        tested = {Cause.LOCAL_NEGATIVES: local_negatives, Cause.MICRO_NEGATIVES: micro, **tested}
    for name, hypothesis in tested.items():
        if all(
            _reproduces(loss, hypothesis, forward, batch, world_size)
            for loss, batch in zip(losses, batches, strict=True)
        ):
            return name, None
    return Cause.UNEXPLAINED, None


def _reproduces(
    loss: float, hypothesis: Callable[..., float], forward: Forward, batch: Batch, world_size: int
) -> bool:
    """Whether ``hypothesis`` gives ``loss`` on ``batch``; not where its replay breaks the loss's
    contract (a loss that is not finite on the slices it gives)."""
    from gatherlab.runs.loss import LossContractError

    try:
        return _close(loss, hypothesis(forward, batch, world_size))
    except LossContractError:
        return False
