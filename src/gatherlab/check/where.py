"""Where a run on W ranks departs from one device: the first recorded operation whose result
(forward) or whose result's gradient (backward) on a rank is not the corresponding part of one
device's, named by the code's ``file:line`` and the operation, with what differs in words. The
records are `gatherlab.runs.trace`'s, of the same code with the same weights. How records are
aligned, which part of one device's tensor a rank's corresponds to, and which operation is named
in the forward and in the backward: docs/checking.md §6, "Where it departs". A tensor-parallel
model's first forward (`layout_departure`: its layouts, dropout draws, and `shard_departure`: each
operation's result against one device's whole or its shard): §10, "Tensor and sequence
parallelism".
"""

from __future__ import annotations

import difflib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gatherlab.core import gradients
from gatherlab.core.terms import DepartureKind
from gatherlab.runs.trace import INPUT, Op

if TYPE_CHECKING:  # annotations only: the module imports torch.distributed.tensor (~0.6 s), which
    from gatherlab.runs.tensorparallel import Drawn, Seen  # a comparison never needs

__all__ = [
    "NOWHERE", "AsShard", "Departure", "align", "as_shard", "backward", "departure", "forward",
    "layout_departure", "part_of", "shard_departure", "unlocated",
]  # fmt: skip

# Operations through which a scalar on the way to the returned loss stays what the global loss
# takes the mean over ranks of (§2): sums, means and constant scales of the loss, in place too
# (``loss += weight * regulariser``).
_LINEAR = frozenset({
    "add", "sub", "mul", "div", "neg", "mean", "sum", "true_divide", "__add__", "__radd__",
    "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__neg__", "reshape", "view",
    "squeeze", "flatten", "clone", "to", "double", "float", "__getitem__",
    "add_", "sub_", "mul_", "div_", "__iadd__", "__isub__", "__imul__", "__itruediv__",
})  # fmt: skip
# Operations whose result takes only the shape, dtype or device of their tensor arguments, not
# their values: such a result agreeing heals no departure upstream (`forward`), nor carries one.
_VALUE_FREE = frozenset({
    "new_zeros", "new_ones", "new_empty", "new_full", "zeros_like", "ones_like", "empty_like",
    "full_like", "rand_like", "randn_like", "randint_like",
})  # fmt: skip
# The most blocks of N rows a tensor is taken to stack (views or crops concatenated); more is taken
# as a flattened tensor, whose rows are lost.
_MAX_BLOCKS = 16


@dataclass(frozen=True)
class Departure:
    """Where a run departs: ``where`` is ``file:line  op`` (the ``where`` column of check.csv),
    ``words`` what differs, in a sentence; ``kind`` what sort of departure it is."""

    where: str
    words: str
    kind: DepartureKind
    over: tuple[int, int, int] | None = None
    """A statistic's reduction: (its dimension, the rank's entries along it, one device's), where
    the rank reduces over its part of one device's (``statistic``); None for any other."""


Index = tuple[torch.Tensor | slice, ...]


def align(one: Sequence[Op], other: Sequence[Op]) -> dict[int, int]:
    """The records of ``other`` paired with those of ``one`` (index in one → index in other): the
    matching blocks of (operation, file:line) that difflib's ``SequenceMatcher`` finds (without
    its junk heuristic), each record of a block paired with its counterpart."""

    def keys(ops: Sequence[Op]) -> list[tuple[str, str]]:
        return [(op.name, op.where) for op in ops]

    matcher = difflib.SequenceMatcher(None, keys(one), keys(other), autojunk=False)
    return {
        block.a + k: block.b + k
        for block in matcher.get_matching_blocks()
        for k in range(block.size)
    }


def part_of(
    one: tuple[int, ...], mine: tuple[int, ...], world_size: int, rank: int, batch: int
) -> list[Index]:
    """The indices of one device's tensor (shape ``one``) that may correspond to a rank's (shape
    ``mine``): per dimension all of it (equal sizes), or, where one device's is W times the rank's,
    the rank's block, or its B rows of each block of N (``batch`` = N); none when the shapes are
    otherwise apart."""
    if len(one) != len(mine):
        return []
    local = batch // world_size
    options: list[list[torch.Tensor | slice]] = []
    for size, own in zip(one, mine, strict=True):
        if size == own:
            options.append([slice(None)])
            continue
        if size != world_size * own:
            return []
        choices: list[torch.Tensor | slice] = [slice(rank * own, (rank + 1) * own)]
        blocks = own // local if local else 0
        if 1 < blocks <= _MAX_BLOCKS and own == blocks * local and size == blocks * batch:
            choices.append(torch.cat([
                torch.arange(j * batch + rank * local, j * batch + (rank + 1) * local)
                for j in range(blocks)
            ]))  # fmt: skip
        options.append(choices)
    return [tuple(combination) for combination in itertools.product(*options)]


def _take(tensor: torch.Tensor, index: Index) -> torch.Tensor:
    for dim, part in enumerate(index):
        if isinstance(part, torch.Tensor):
            tensor = tensor.index_select(dim, part)
        elif part != slice(None):
            tensor = tensor.narrow(dim, part.start, part.stop - part.start)
    return tensor


def _add_into(total: torch.Tensor, index: Index, value: torch.Tensor) -> None:
    """``total[index] += value`` for an `Index` of blocks and index tensors."""
    ranges = [
        part if isinstance(part, torch.Tensor) else torch.arange(size)[part]
        for part, size in zip(index, total.shape, strict=True)
    ]
    if not ranges:
        total += value
        return
    total.index_put_(torch.meshgrid(*ranges, indexing="ij"), value, accumulate=True)


def _scale(tensor: torch.Tensor) -> float:
    """The largest finite magnitude of ``tensor`` (a masked ``-inf`` is no scale)."""
    finite = tensor[torch.isfinite(tensor)]
    return max(float(finite.abs().max()) if finite.numel() else 0.0, torch.finfo(tensor.dtype).tiny)


def _difference(mine: torch.Tensor, theirs: torch.Tensor, scale: float) -> float:
    """The largest difference relative to ``scale``: equal entries (the same infinity too) are
    0 apart, a NaN or an infinity against another value infinitely."""
    if not mine.numel():
        return 0.0
    apart = torch.where(mine == theirs, 0.0, (mine - theirs).abs())
    return float(torch.nan_to_num(apart, nan=math.inf).max()) / scale


def _all_reduced(ops: Sequence[Op]) -> set[int]:
    """The records whose result an all_reduce takes (a rank's part of a sum or mean over ranks)."""
    return {i for op in ops if op.short == "all_reduce" for i in op.inputs}


def _loss_path(ops: Sequence[Op]) -> set[int]:
    """The records from which the returned loss follows by linear operations only."""
    path = {op.index for op in ops if op.returned}
    for op in reversed(ops):
        if op.index in path and op.short in _LINEAR:
            path.update(op.inputs)
    return path


@dataclass(frozen=True)
class _Agreed:
    """How one device's record i corresponds on the ranks: each rank's record and its index into
    one device's result (None: the whole of it, as the mean over ranks, or with ``summed`` as the
    sum over ranks: a rank's part of a sum, completed by an all_reduce or by the division that
    follows on the loss's path)."""

    theirs: tuple[Op, ...]
    indices: tuple[Index, ...] | None
    summed: bool = False


@dataclass(frozen=True)
class _Differs:
    rank: int
    mine: Op
    index: Index | None
    difference: float


def _over_ranks_agrees(
    op: Op, theirs: Sequence[Op], divisor: int, tolerance: float, scale: float
) -> bool:
    """Whether the ranks' results, summed and divided by ``divisor`` (W: their mean; 1: their
    sum), are one device's."""
    if any(t.value.shape != op.value.shape for t in theirs):
        return False
    total = sum(t.value for t in theirs) / divisor
    return _difference(total, op.value, scale) <= tolerance


def _compare(
    op: Op,
    theirs: Sequence[Op],
    world_size: int,
    batch: int,
    tolerance: float,
    on_path: bool,
    all_reduced: bool = False,
) -> _Agreed | _Differs | None:
    """One device's record against the ranks': agreed (and how), differs (on which rank first),
    or None when they cannot be compared. A result the ranks all-reduce (``all_reduced``) agrees
    when its mean over ranks is one device's."""
    scale = _scale(op.value)
    if on_path and op.value.numel() == 1 and all(t.value.numel() == 1 for t in theirs):
        total = math.fsum(float(t.value) for t in theirs)
        if abs(total / world_size - float(op.value)) <= tolerance * scale:
            return _Agreed(tuple(theirs), None)
        # a partial sum on the way to the loss (the rank's rows summed, then divided by their
        # number): its later division is compared in turn, the returned loss by the mean
        if not op.returned and abs(total - float(op.value)) <= tolerance * scale:
            return _Agreed(tuple(theirs), None, summed=True)
        return _Differs(0, theirs[0], None, abs(total / world_size - float(op.value)) / scale)
    flattened = op.input_shapes and op.value.dim() < len(op.input_shapes[0]) and op.dims is None
    if all_reduced:  # each rank's part of what an all_reduce completes: a mean or a sum
        if _over_ranks_agrees(op, theirs, world_size, tolerance, scale):
            return _Agreed(tuple(theirs), None)
        if _over_ranks_agrees(op, theirs, 1, tolerance, scale):
            return _Agreed(tuple(theirs), None, summed=True)
    indices = []
    for rank, mine in enumerate(theirs):
        if flattened and mine.value.shape != op.value.shape:
            return None  # a mask or reshape that flattens the rank's part: its rows are lost
        candidates = part_of(tuple(op.value.shape), tuple(mine.value.shape), world_size, rank,
                             batch)  # fmt: skip
        if not candidates:
            return None
        differences = [_difference(mine.value, _take(op.value, c), scale) for c in candidates]
        best = min(range(len(candidates)), key=differences.__getitem__)
        if differences[best] > tolerance:
            return _Differs(rank, mine, candidates[0], differences[0])
        indices.append(candidates[best])
    return _Agreed(tuple(theirs), tuple(indices))


def _matched(one: Sequence[Op], ranks: Sequence[Sequence[Op]]) -> list[dict[int, int]]:
    return [align(one, theirs) for theirs in ranks]


def forward(
    one: Sequence[Op],
    ranks: Sequence[Sequence[Op]],
    world_size: int,
    batch: int,
    tolerance: float,
) -> tuple[Departure | None, dict[int, _Agreed]]:
    """The first operation whose result departs on a rank and stays departed (None when none
    does), and how each record that agrees corresponds (for `backward`). A departure is healed
    when a result made from it agrees again (a value scaled by the rank's row count and divided
    by it later, as a Sinkhorn normalisation does over the rank's columns; a scale that a
    normalisation removes): it is not where the run departs, and the walk goes on past it."""
    matches = _matched(one, ranks)
    path = _loss_path(one)
    reducing = [_all_reduced(theirs) for theirs in ranks]
    agreed: dict[int, _Agreed] = {}
    differing: dict[int, _Differs] = {}  # in forward order
    made_from: dict[int, frozenset[int]] = {}  # each record's unhealed departures upstream
    healed: set[int] = set()
    for op in one:
        upstream = frozenset().union(*(made_from.get(i, ()) for i in op.inputs))
        if op.short in _VALUE_FREE:
            upstream = frozenset()
        made_from[op.index] = upstream
        if op.value is None or any(op.index not in m for m in matches):
            continue
        theirs = [ranks[r][m[op.index]] for r, m in enumerate(matches)]
        if any(t.value is None for t in theirs):
            continue
        reduced = all(t.index in reducing[r] for r, t in enumerate(theirs))
        compared = _compare(op, theirs, world_size, batch, tolerance, op.index in path, reduced)
        if isinstance(compared, _Agreed):
            agreed[op.index] = compared
            healed |= upstream
            made_from[op.index] = frozenset()
        elif isinstance(compared, _Differs):
            differing[op.index] = compared
            made_from[op.index] = upstream | {op.index}
    for index, compared in differing.items():
        if index not in healed:
            words = _forward_words(
                one, one[index], compared, ranks, matches, world_size, batch, tolerance
            )
            return words, {i: a for i, a in agreed.items() if i < index}
    return None, agreed


def _forward_words(
    one: Sequence[Op],
    op: Op,
    differs: _Differs,
    ranks: Sequence[Sequence[Op]],
    matches: Sequence[dict[int, int]],
    world_size: int,
    batch: int,
    tolerance: float,
) -> Departure:
    rank, mine = differs.rank, differs.mine
    theirs = ranks[rank]
    matched_back = set(matches[rank].values())
    # an input from an operation only the ranks run (a gather) that already holds other rows
    for position, input_index in enumerate(mine.inputs):
        producer = theirs[input_index]
        if input_index in matched_back or producer.value is None or position >= len(op.inputs):
            continue
        counterpart = one[op.inputs[position]]
        if counterpart.value is None:
            continue
        order = _other_order(producer.value, counterpart.value, tolerance)
        if order is not None:
            return Departure(
                producer.label, _order_words(producer, order, rank), DepartureKind.ORDER
            )
    if mine.name == INPUT:
        words = (
            f"the {op.where} that rank {rank} is given is not its part of what one device is given "
            f"(max relative difference {differs.difference:.2g}): the data differs before any "
            "code runs"
        )
        return Departure(mine.label, words, DepartureKind.INPUT)
    reduced = _reduced_part(op, mine, world_size)
    if reduced is not None:
        return Departure(mine.label, reduced + _updated(theirs, mine), DepartureKind.STATISTIC,
                         _reduced_over(op, mine, world_size))  # fmt: skip
    if differs.index is None:  # a scalar on the loss's path: the mean over ranks
        mean = math.fsum(float(t[matches[r][op.index]].value) for r, t in enumerate(ranks))
        mean /= world_size
        words = (
            f"a {mine.short} on the loss's path: the mean over ranks of its value is {mean:.6g}, "
            f"one device's {float(op.value):.6g} ({mean / float(op.value):.6g} times)"
            if float(op.value) else f"a {mine.short} on the loss's path: the mean over ranks of "
            f"its value is {mean:.6g}, one device's 0"
        )  # fmt: skip
        return Departure(mine.label, words, DepartureKind.SCALAR)
    order = _other_order(mine.value, op.value, tolerance)
    if order is not None:
        return Departure(mine.label, _order_words(mine, order, rank), DepartureKind.ORDER)
    written = f" (it writes the buffer {mine.updates})" if mine.updates else ""
    given = _given_part(op, mine, world_size)
    if given is not None:
        words = (
            f"a {mine.short}{written} given the rank's {given[0]} rows of an input where one "
            f"device is given all {given[1]}: its result on rank {rank} is not its part of one "
            f"device's (max relative difference {differs.difference:.2g})"
        )
        return Departure(mine.label, words + _updated(theirs, mine), DepartureKind.RANK)
    words = (
        f"a {mine.short}{written} whose inputs agree with one device's gives another result on "
        f"rank {rank} (max relative difference {differs.difference:.2g}): it depends on the rank "
        "or the number of rows, or draws random numbers"
    )
    return Departure(mine.label, words + _updated(theirs, mine), DepartureKind.RANK)


def _given_part(op: Op, mine: Op, world_size: int) -> tuple[int, int] | None:
    """(the rank's rows, one device's) of the first input the rank is given its part of, along
    dimension 0 (one device's W times the rank's), when its result is one device's whole shape,
    not such a part (a write of the rank's rows into a queue: where one device writes all)."""
    if op.value is None or mine.value is None or mine.value.shape != op.value.shape:
        return None
    for one_shape, rank_shape in zip(op.input_shapes, mine.input_shapes, strict=False):
        if (
            len(one_shape) == len(rank_shape)
            and one_shape
            and rank_shape[0] * world_size == (one_shape[0]) != rank_shape[0]
        ):
            return rank_shape[0], one_shape[0]
    return None


def _updated(theirs: Sequence[Op], start: Op) -> str:
    """ ", from which Tensor.add_ at x.py:12 updates the buffer center" when a record that the
    departing one flows into writes a buffer."""
    reached = {start.index}
    for op in theirs[start.index + 1 :]:
        if reached.intersection(op.inputs):
            reached.add(op.index)
            if op.updates is not None:
                return f", from which {op.short} at {op.where} updates the buffer {op.updates}"
    return ""


def _reduced_part(op: Op, mine: Op, world_size: int) -> str | None:
    """ "a mean over dim 0 of the rank's 8 rows, where one device takes all 16" when the operation
    reduces or normalises over a dimension in which the rank holds its part of one device's
    input."""
    for one_shape, rank_shape in zip(op.input_shapes, mine.input_shapes, strict=False):
        if len(one_shape) != len(rank_shape):
            continue
        parts = [d for d, (a, b) in enumerate(zip(one_shape, rank_shape, strict=True))
                 if _part_of(a, b, world_size)]  # fmt: skip
        if not parts:
            continue
        dims = op.dims if op.dims else tuple(range(len(one_shape)))
        if op.dims is None and op.value is not None and op.value.numel() > 1:
            continue  # names no dimension and reduces none
        for dim in dims:
            if dim in parts:
                what = "rows" if dim == 0 else "entries"
                over = f"over dim {dim}" if op.dims else "over all entries"
                return (
                    f"a {mine.short} {over} of the rank's {rank_shape[dim]} {what}, where one "
                    f"device takes all {one_shape[dim]}"
                )
    return None


def _reduced_over(op: Op, mine: Op, world_size: int) -> tuple[int, int, int] | None:
    """(dimension, the rank's entries, one device's) of the reduction `_reduced_part` names."""
    for one_shape, rank_shape in zip(op.input_shapes, mine.input_shapes, strict=False):
        if len(one_shape) != len(rank_shape):
            continue
        for dim in op.dims if op.dims else range(len(one_shape)):
            a, b = one_shape[dim], rank_shape[dim]
            if _part_of(a, b, world_size):
                return dim, b, a
    return None


def _part_of(whole: int, part: int, world_size: int) -> bool:
    """Whether ``part`` entries are the rank's part of one device's ``whole``: a share 1/m of
    it, m ≥ 2 dividing W (1/W where the rank reduces over its own rows; 1/K for a micro-batch of
    K gathered over the ranks, read as one of W·K ranks)."""
    return part > 0 and whole != part and whole % part == 0 and world_size % (whole // part) == 0


def _other_order(mine: torch.Tensor, theirs: torch.Tensor, tolerance: float) -> list[int] | None:
    """For each row of ``mine`` the row of ``theirs`` it equals, when ``mine`` holds the rows of
    ``theirs`` in another order; None otherwise."""
    if mine.shape != theirs.shape or mine.dim() < 1 or len(mine) < 2:
        return None
    rows, other = mine.reshape(len(mine), -1), theirs.reshape(len(theirs), -1)
    distances = torch.cdist(rows, other, p=float("inf"))
    nearest = distances.argmin(dim=1)
    if len(set(nearest.tolist())) != len(mine):
        return None
    if float(distances.gather(1, nearest[:, None]).max()) > tolerance * _scale(theirs):
        return None
    order = nearest.tolist()
    return None if order == list(range(len(mine))) else order


def _order_words(op: Op, order: list[int], rank: int) -> str:
    first = next(i for i, j in enumerate(order) if i != j)
    return (
        f"a {op.short} whose result on rank {rank} holds one device's rows in another order "
        f"(its row {first} is one device's row {order[first]}): rows are paired by position in "
        "an order one device does not have"
    )


def backward(
    one: Sequence[Op],
    ranks: Sequence[Sequence[Op]],
    agreed: dict[int, _Agreed],
    world_size: int,
    tolerance: float,
) -> Departure | None:
    """The first operation, in backward order, whose result's gradient departs (the ranks' parts
    summed, each divided by W), named by the operation whose backward produced it."""
    matches = _matched(one, ranks)
    fine: set[int] = set()  # rank 0's records whose gradient agrees
    for index in sorted(agreed, reverse=True):
        op, how = one[index], agreed[index]
        if op.grad is None and all(t.grad is None for t in how.theirs):
            continue
        total = torch.zeros_like(op.value)
        for rank, mine in enumerate(how.theirs):
            if mine.grad is None:
                continue
            if how.summed:  # every rank's part is in one device's whole: each one's gradient
                total += mine.grad / world_size / world_size
            elif how.indices is None:
                total += mine.grad / world_size
            else:
                _add_into(total, how.indices[rank], mine.grad / world_size)
        expected = op.grad if op.grad is not None else torch.zeros_like(op.value)
        if _difference(total, expected, _scale(expected)) <= tolerance:
            fine.add(matches[0][index])
            continue
        if not total.any():  # no gradient on the ranks: cut where the value was made
            culprit = _cut(ranks[0], matches[0][index])
        else:
            culprit = _culprit(ranks[0], matches[0][index], fine, set(matches[0].values()))
        what = op.where if op.name == INPUT else f"the result of {op.short} at {op.where}"
        words = f"the gradient of {what} on the ranks is {_factor(total, expected, world_size)}"
        if op.returned:  # nothing traced after it: the scale comes from code after the loss
            words += (": it is the loss the traced code returned, so what changes its gradient "
                      "comes after it, outside the trace (the loss divided or multiplied before "
                      "its backward)")  # fmt: skip
        if culprit is None:
            return Departure(op.label, words, DepartureKind.GRADIENT)
        label, how_named = culprit
        return Departure(label, f"{words}: {how_named}", DepartureKind.GRADIENT)
    return None


def _factor(total: torch.Tensor, expected: torch.Tensor, world_size: int) -> str:
    """The ranks' gradient against one device's, in words: 0, a named factor of it, another
    factor, or another direction (`gatherlab.core.gradients`)."""
    norm, reference = float(total.norm()), float(expected.norm())
    if norm == 0:
        return f"0, where one device's has norm {reference:.3g}"
    if reference == 0:
        return f"of norm {norm:.3g}, where one device's is 0"
    cosine, ratio = gradients.cosine_and_norm_ratio(total.flatten(), expected.flatten())
    if cosine >= gradients.PARALLEL_COSINE:
        name = gradients.factor_name(ratio, world_size)
        if name is not None:
            return f"{name} of one device's (norm ratio {ratio:.6g}, cosine 1)"
        return f"{ratio:.6g} times one device's (cosine 1)"
    return f"in another direction than one device's (cosine {cosine:.6g}, norm ratio {ratio:.4g})"


def _culprit(
    theirs: Sequence[Op], start: int, fine: set[int], matched: set[int]
) -> tuple[str, str] | None:
    """The record of rank 0 whose backward gave record ``start`` its gradient: among the records
    its result flows into before one whose gradient agrees, a custom autograd Function's
    backward, else a collective or another operation without gradient, else the consumer."""
    reached, frontier, consumers = [], {start}, []
    for op in theirs[start + 1 :]:
        if not frontier.intersection(op.inputs):
            continue
        if start in op.inputs:
            consumers.append(op)
        if op.index in fine:
            continue
        reached.append(op)
        frontier.add(op.index)
    for op in reached:
        if op.backward is not None:
            name, _, place = op.backward.partition(" at ")
            return f"{place or op.where}  {name}", f"{op.backward} produces it"
    without = [op for op in reached if op.no_grad]
    for op in sorted(without, key=lambda op: not op.name.startswith("torch.distributed")):
        return op.label, _without_gradient(op, theirs)
    for op in consumers:
        if op.index in fine or op.index not in matched:
            return op.label, f"the backward of {op.short} at {op.where} produces it"
    return None


def _without_gradient(op: Op, theirs: Sequence[Op]) -> str:
    """What an operation that ran without gradient does to the gradient, in words: an in-place
    all_reduce whose tensor still carries one (its input's gradient recorded) passes it back
    unsummed; anything else passes none back."""
    carried = any(theirs[i].grad is not None for i in op.inputs)
    if op.short == "all_reduce" and carried:
        return (
            f"all_reduce at {op.where} sums the ranks' values in place, unseen by autograd: the "
            "gradient passes back through it unsummed, each rank's own part of it (after DDP's "
            "average, 1/W of one device's)"
        )
    return (
        f"{op.short} at {op.where} runs without gradient, so what it passes on carries no "
        "gradient back"
    )


def _cut(theirs: Sequence[Op], start: int) -> tuple[str, str] | None:
    """The operation, among those rank 0's record ``start`` was made from, that ran without
    gradient (a collective first): where the gradient is cut."""
    made_from, stack = set(), [start]
    while stack:
        index = stack.pop()
        for i in theirs[index].inputs:
            if i not in made_from:
                made_from.add(i)
                stack.append(i)
    without = [theirs[i] for i in sorted(made_from) if theirs[i].no_grad]
    for op in sorted(without, key=lambda op: not op.name.startswith("torch.distributed")):
        return op.label, (
            f"{op.short} at {op.where} runs without gradient, so what it passes on carries no "
            "gradient back"
        )
    return None


def departure(
    one: Sequence[Op],
    ranks: Sequence[Sequence[Op]],
    world_size: int,
    batch: int,
    tolerance: float,
) -> Departure | None:
    """The forward departure when there is one, else the backward one, else `NOWHERE`."""
    found, agreed = forward(one, ranks, world_size, batch, tolerance)
    if found is not None:
        return found
    return backward(one, ranks, agreed, world_size, tolerance) or NOWHERE


def unlocated(why: str) -> Departure:
    """No place, and ``why`` in words (the ``departs`` column; ``where`` stays empty)."""
    return Departure("", why, DepartureKind.NONE)


NOWHERE = unlocated(
    "no line named: every result and gradient of the first step that the trace compares agrees "
    "with one device's; what differs is outside them (state written in place that a later step "
    "reads, an integer or boolean result, a result of another shape than one device's, such as "
    "rows padded to another length, a micro-batch after the first, or code the traced call does "
    "not run)"
)


def layout_departure(
    one: Sequence[Seen], ranks: Sequence[Sequence[Seen]], data_parallel: int,
    tensor_parallel: int, drawn: Sequence[Drawn] = (),
    tolerance: float = gradients.FLOAT64_TOLERANCE,
) -> Departure:  # fmt: skip
    """Where a tensor-parallel model's first forward on the ranks (``ranks``, each rank's
    `runs.tensorparallel.LayoutWatch` record, rank 0's first) leaves one device's (``one``),
    docs/checking.md §10 "Tensor and sequence parallelism": on rank 0, the first module whose
    input, a DTensor, has another global shape than one device's input of that module (its rows
    those of the rank's data-parallel group, 1 / ``data_parallel`` of them), named at the line
    that calls the model (what it passes is what departs), then the model's output where it is
    not one device's shape (a shard taken as the whole); then a dropout layer whose draws on the
    ranks of a tensor-parallel group (``drawn``) agree where their inputs are shards or differ
    where their inputs are one tensor; then the first operation whose result on a rank is
    neither one device's nor its shard (`shard_departure`). No place when none."""
    mine = [seen for seen in ranks[0] if seen.op is None]
    one_ops = [seen.op for seen in one if seen.op is not None]
    one = [seen for seen in one if seen.op is None]
    ones = {seen.module: seen for seen in one if not seen.output}
    outputs = [seen for seen in one if seen.output]
    called = next((seen.line for seen in mine if seen.module == "" and not seen.output), None)
    for seen in mine:
        if seen.output or not seen.placements or seen.module not in ones:
            continue
        expected = _rows_over(ones[seen.module].shape, data_parallel)
        if seen.shape != expected:  # named where the step gives the model what it passes
            return Departure(
                f"{called or seen.line}  {seen.module or 'the model'}",
                _input_words(seen, expected, tensor_parallel),
                DepartureKind.LAYOUT,
            )
    for seen, theirs in zip([s for s in mine if s.output], outputs, strict=False):
        expected = _rows_over(theirs.shape, data_parallel)
        if seen.shape != expected:
            return Departure(
                f"{seen.line}  {seen.use}", _output_words(seen, expected), DepartureKind.LAYOUT
            )
    for draw in drawn:
        if draw.same_input != draw.same_mask:
            return Departure(f"{draw.line}  {draw.module}", _drawn_words(draw),
                             DepartureKind.RANDOMNESS)  # fmt: skip
    rank_ops = [[seen.op for seen in theirs if seen.op is not None] for theirs in ranks]
    found = shard_departure(one_ops, rank_ops, data_parallel, tensor_parallel, tolerance)
    if found is not None:
        return found
    return unlocated(
        "no line named: every module's input and the model's output have one device's shapes on "
        "the ranks, and every result of the first forward compared is one device's or its shard "
        "(what departs is outside the model's first forward, or in a result not compared)"
    )


# Reshapes: a result that is the same numbers in another shape, sized by the code's own counts.
_RESHAPES = frozenset({
    "view", "reshape", "unflatten", "flatten", "view_as", "reshape_as", "split", "chunk",
    "tensor_split", "unfold",
})  # fmt: skip
# Draws: one device draws for its whole tensor what no tensor-parallel layout draws for a shard,
# so a draw that differs ends the comparison (a dropout layer is `Drawn`'s to name).
_DRAWS = frozenset({
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli",
    "multinomial", "normal", "poisson", "rrelu", "uniform_", "normal_", "bernoulli_",
    "exponential_", "random_", "cauchy_", "log_normal_", "geometric_",
})  # fmt: skip


@dataclass(frozen=True)
class AsShard:
    """How a rank's result stands to one device's (`as_shard`): ``dim`` the dimension along which
    it is one device's chunk at the rank's tensor-parallel index (None: one device's whole),
    ``rows`` whether one device's was first cut to the rows of the rank's data-parallel group,
    ``difference`` the largest difference from that candidate relative to one device's largest
    magnitude (the nearest candidate's, where none agrees), ``agrees`` whether it is within the
    tolerance."""

    dim: int | None
    rows: bool
    difference: float
    agrees: bool

    def words(self, index: int, tensor_parallel: int) -> str:
        """``one device's whole``, ``its chunk 0 of 2 along dimension 1``, with ``of its
        data-parallel group's rows`` where they were cut."""
        what = (
            "one device's whole" if self.dim is None
            else f"one device's chunk {index} of {tensor_parallel} along dimension {self.dim}"
        )  # fmt: skip
        return f"{what} (the rows of the rank's data-parallel group)" if self.rows else what


def as_shard(
    one: torch.Tensor, mine: torch.Tensor, group: int, groups: int, index: int,
    tensor_parallel: int, tolerance: float = gradients.FLOAT64_TOLERANCE,
) -> AsShard | None:  # fmt: skip
    """Whether ``mine``, a result on the rank of data-parallel group ``group`` (of ``groups``)
    and tensor-parallel index ``index``, is one device's result ``one`` or its shard: one
    device's whole, or its chunk ``index`` of ``tensor_parallel`` along one dimension
    (``torch.chunk``, as a DTensor's ``Shard`` cuts); each also with one device's dimension 0
    first cut to the group's rows (`terms.rows_of`) where it divides into ``groups``. None where
    no candidate has ``mine``'s shape (a layout, not a value)."""
    bases = [(False, one)]
    length = one.shape[0] if one.dim() and mine.dim() else 0
    if groups > 1 and length >= groups and not length % groups:
        bases.append((True, one.chunk(groups)[group]))
    candidates = [(None, rows, base) for rows, base in bases if base.shape == mine.shape]
    for rows, base in bases:  # after the wholes: of equal candidates, the first is named
        for dim in range(base.dim()):
            chunks = base.chunk(tensor_parallel, dim)
            if len(chunks) == tensor_parallel and chunks[index].shape == mine.shape:
                candidates.append((dim, rows, chunks[index]))
    if not candidates:
        return None
    scale = _scale(one)
    differences = [_difference(mine, candidate, scale) for _, _, candidate in candidates]
    best = min(range(len(candidates)), key=differences.__getitem__)
    dim, rows, _ = candidates[best]
    return AsShard(dim, rows, differences[best], differences[best] <= tolerance)


@dataclass(frozen=True)
class _Unsharded:
    """The first operation of one device's record (``index``) whose result on ``rank`` is neither
    one device's nor its shard (``nearest``: the candidate nearest to it)."""

    index: int
    rank: int
    mine: Op
    nearest: AsShard


def shard_departure(
    one: Sequence[Op], ranks: Sequence[Sequence[Op]], data_parallel: int, tensor_parallel: int,
    tolerance: float = gradients.FLOAT64_TOLERANCE,
) -> Departure | None:  # fmt: skip
    """The first operation of a tensor-parallel model's first forward whose result on some rank
    is neither one device's result nor its shard (`as_shard`), the ranks' records paired with one
    device's as `align` pairs them (docs/checking.md §10, "Tensor and sequence parallelism"). A
    departure is healed, and passed, when a result made from it agrees again (a partial sum the
    code completes itself). None when every result compared agrees; also when the model's input
    differs (the data, not the model) or once a draw differs (from there one device's draws are no
    layout's)."""
    found = [
        _first_unsharded(one, theirs, rank, data_parallel, tensor_parallel, tolerance)
        for rank, theirs in enumerate(ranks)
    ]
    found = [f for f in found if f is not None]
    if not found:
        return None
    first = min(found, key=lambda f: (f.index, f.rank))
    op = one[first.index]
    return Departure(
        first.mine.label,
        _unsharded_words(op, first, data_parallel, tensor_parallel),
        DepartureKind.SHARD,
    )


def _first_unsharded(
    one: Sequence[Op], theirs: Sequence[Op], rank: int, data_parallel: int, tensor_parallel: int,
    tolerance: float,
) -> _Unsharded | None:  # fmt: skip
    group, index = divmod(rank, tensor_parallel)
    match = align(one, theirs)
    made_from: dict[int, frozenset[int]] = {}  # each record's unhealed departures upstream
    healed: set[int] = set()
    differing: dict[int, _Unsharded] = {}  # in forward order
    for op in one:
        upstream = frozenset().union(*(made_from.get(i, ()) for i in op.inputs))
        made_from[op.index] = frozenset() if op.short in _VALUE_FREE else upstream
        if op.value is None or op.index not in match or theirs[match[op.index]].value is None:
            continue
        mine = theirs[match[op.index]]
        shard = as_shard(op.value, mine.value, group, data_parallel, index, tensor_parallel,
                         tolerance)  # fmt: skip
        if shard is None:
            continue  # no shape in common: the layouts' to name
        if shard.agrees:
            healed |= upstream
            made_from[op.index] = frozenset()
            continue
        if op.name == INPUT or op.short in _DRAWS:
            break  # what the model is given, or draws, differ: its operations are not compared
        differing[op.index] = _Unsharded(op.index, rank, mine, shard)
        made_from[op.index] = upstream | {op.index}
    return next((d for i, d in differing.items() if i not in healed), None)


def _unsharded_words(op: Op, first: _Unsharded, data_parallel: int, tensor_parallel: int) -> str:
    mine, nearest = first.mine, first.nearest
    index = first.rank % tensor_parallel
    words = (
        f"a {mine.short} whose result on rank {first.rank} (tensor-parallel rank {index} of "
        f"{tensor_parallel}), of shape {tuple(mine.value.shape)}, is neither one device's result, "
        f"of shape {tuple(op.value.shape)}, nor its shard: it differs from the nearest, "
        f"{nearest.words(index, tensor_parallel)}, by {nearest.difference:.2g} (max relative "
        "difference)"
    )
    sharded = _sharded_input(op, mine, data_parallel, tensor_parallel)
    reduced = _reduced_part(op, mine, tensor_parallel)
    if reduced is not None:
        return (
            f"{words}; {reduced}: a statistic of the rank's shard taken as the whole's. Fix: "
            "reduce the DTensor itself, whose shards DTensor combines (y.mean(dim).full_tensor() "
            "on the DTensor), or read it whole first (y.full_tensor(), or y.redistribute(mesh, "
            "[Replicate()])), not its local tensor (to_local())"
        )
    if sharded is not None:
        dim, held, whole = sharded
        words += (
            f"; its input holds the rank's shard of dimension {dim} ({held} of one device's "
            f"{whole}), which it takes as the whole"
        )
    if mine.short in _RESHAPES:
        return (
            f"{words}. Fix: size the {mine.short} from what the rank holds: -1 on the sharded "
            "dimension's count (t.unflatten(-1, (-1, head_size))), or the rank's count (a head "
            "count divided by mesh['tp'].size(), heads // tp), not the model's"
        )
    return (
        f"{words}. Fix: keep the tensor a DTensor through the {mine.short} (use_local_output=False "
        "in the plan), so that DTensor computes it over the shards, or read it whole first "
        "(full_tensor())"
    )


def _sharded_input(
    op: Op, mine: Op, data_parallel: int, tensor_parallel: int
) -> tuple[int, int, int] | None:
    """(dimension, the rank's size, one device's) of the first dimension of an input that the
    rank holds 1 / ``tensor_parallel`` of (its dimension 0 taken as the data-parallel group's
    rows)."""
    for one_shape, rank_shape in zip(op.input_shapes, mine.input_shapes, strict=False):
        if len(one_shape) != len(rank_shape):
            continue
        expected = _rows_over(one_shape, data_parallel)
        for dim, (whole, held) in enumerate(zip(expected, rank_shape, strict=True)):
            if whole == tensor_parallel * held != held:
                return dim, held, one_shape[dim]
    return None


def _drawn_words(draw: Drawn) -> str:
    if draw.same_input:
        return (
            f"dropout {draw.module} draws another mask on each rank of the tensor-parallel group, "
            "whose ranks hold the same tensor (replicated): the replicas stop being one. Fix: the "
            "same seed on every rank of the group for a replicated tensor (torch.manual_seed "
            "alike on them)"
        )
    return (
        f"dropout {draw.module} draws the same mask on every rank of the tensor-parallel group, "
        "each of which holds another shard of its input: the mask repeats from shard to shard, "
        "which one device's never does. Fix: another seed on each rank of the group for a sharded "
        "tensor (as Megatron's tensor-parallel random state does), the same for the replicated "
        "ones"
    )


def _rows_over(shape: tuple[int, ...], data_parallel: int) -> tuple[int, ...]:
    """One device's shape with the rows a data-parallel group holds (§2)."""
    return (shape[0] // data_parallel, *shape[1:]) if shape else shape


def _apart(seen: tuple[int, ...], expected: tuple[int, ...]) -> str:
    """The dimensions where two shapes differ, in words."""
    if len(seen) != len(expected):
        return f"{len(seen)} dimensions where one device's has {len(expected)}"
    pairs = enumerate(zip(seen, expected, strict=True))
    return ", ".join(
        f"dimension {d} {a} where one device's is {b}" for d, (a, b) in pairs if a != b
    )


def _input_words(seen: Seen, expected: tuple[int, ...], tensor_parallel: int) -> str:
    name = f"module {seen.module}" if seen.module else "the model"
    return (
        f"the input of {name} is, over the tensor-parallel group ({seen.placements}), a tensor of "
        f"shape {seen.shape} where one device's is {expected} ({_apart(seen.shape, expected)}): "
        "what each rank passes is not what the plan's input layout says it is (the whole of a "
        f"dimension taken as one of {tensor_parallel} shards, or another dimension sharded). Fix: "
        "pass each rank its shard of the dimension the plan names (x.chunk(T, dim)"
        "[mesh['tp'].get_local_rank()]), or declare what it passes "
        "(PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(dim)))"
    )


def _output_words(seen: Seen, expected: tuple[int, ...]) -> str:
    held = f"a DTensor ({seen.placements})" if seen.placements else "a plain tensor"
    return (
        f"the model's output is {held} of shape {seen.shape} on each rank where one device's is "
        f"{expected} ({_apart(seen.shape, expected)}): each rank holds its shard (a "
        f"ColwiseParallel's local output), and {seen.use} takes it as the whole. Fix: gather it "
        "in the plan (the last layer's ColwiseParallel(output_layouts=Replicate())), or compute "
        "the loss over the shards (cross-entropy under torch.distributed.tensor.parallel"
        ".loss_parallel(), the output kept a DTensor with use_local_output=False)"
    )
