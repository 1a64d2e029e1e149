"""The global batches of two recordings compared, update by update (docs/design.md §6, "Comparing
two recordings", item 2): each update's rows (their digests, `recording.recorder.row_digests`) as
a multiset, where a difference is the verdict ``data differs``, said before any gradient is
judged, and as an order (the ranks' rows concatenated in rank order), where a difference is a
note: a DistributedSampler's strided order, or each rank's part of v blocks (views concatenated
per rank before the forward).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from gatherlab.check import diagnosis
from gatherlab.recording.format import Recording

__all__ = ["MOST_BLOCKS", "Batches", "blocks", "compare"]

NO_ROWS = "note: A holds no batch fingerprints: the data is not compared"


@dataclass(frozen=True)
class Batches:
    """The global batches compared: the first update whose set of rows differs and its words
    (None: none differs), how many updates differ so, and the notes (another order)."""

    update: int | None
    words: str | None
    notes: tuple[str, ...]


def _rows_words(update: int, theirs: Sequence[Sequence[str]], mine: Sequence[Sequence[str]]) -> str:
    """What differs between two global batches as multisets of row digests, precisely: which of
    B's ranks hold rows A's batch lacks, the rows A holds that B's lacks, the rows B holds more
    often than A."""
    reference = Counter(row for rank in theirs for row in rank)
    run = Counter(row for rank in mine for row in rank)
    said = []
    left = reference.copy()
    for rank, rows in enumerate(mine):
        lacking = 0
        for row in rows:
            if left[row] > 0:
                left[row] -= 1
            else:
                lacking += 1
        if lacking:
            held = "rows" if lacking > 1 else "row"
            if reference.keys() >= set(rows):
                said.append(f"B's rank {rank} holds {lacking} {held} more often than A's batch")
            else:
                said.append(f"B's rank {rank} holds {lacking} {held} A's batch lacks")
    lacks = sum((reference - run).values())
    if lacks:
        said.append(f"A's batch holds {lacks} row{'s' if lacks > 1 else ''} B's lacks")
    total_a, total_b = sum(reference.values()), sum(run.values())
    if total_a != total_b:
        said.append(f"B's global batch has {total_b} rows, A's {total_a}")
    return f"update {update}: the global batches differ: " + "; ".join(said)


def compare(a: Recording, b: Recording) -> Batches:
    """Every update's global batch of B against A's: as a set (a difference is the verdict
    ``data differs``) and as an order (the concatenation over ranks, in rank order; another order
    is a note)."""
    if not any(rank for u in a.updates for rank in u.rows):
        return Batches(None, None, (NO_ROWS,))
    first, words, reordered, blocked, differing = None, None, [], Counter(), 0
    for theirs, mine in zip(a.updates, b.updates, strict=True):
        order_a = [row for rank in theirs.rows for row in rank]
        order_b = [row for rank in mine.rows for row in rank]
        if Counter(order_a) != Counter(order_b):
            differing += 1
            if first is None:
                first, words = theirs.index, _rows_words(theirs.index, theirs.rows, mine.rows)
        elif order_a != order_b:
            count = STRIDED if _strided(order_a, mine.rows) else blocks(order_a, mine.rows)
            if count is None:
                reordered.append(theirs.index)
            else:
                blocked[count] += 1
    total = len(a.updates)
    if words is not None and differing > 1:
        words += f" (the global batches differ at {differing} of {total} updates)"
    notes = [(diagnosis.STRIDED_ORDER if count == STRIDED else diagnosis.BLOCK_ORDER).format(
                 blocks=count, updates=updates, total=total, world_size=b.world_size)
             for count, updates in blocked.items()]  # fmt: skip
    if reordered:
        notes.append(diagnosis.OTHER_ORDER.format(update=reordered[0], updates=len(reordered),
                                                  total=total))  # fmt: skip
    return Batches(first, words, tuple(notes))


# The most blocks (views, crops) a forward of one rank's rows concatenates, tested as an order.
MOST_BLOCKS = 16
STRIDED = 0  # the order of a strided sampler, counted among the blocks' orders


def _strided(reference: Sequence[str], ranks: Sequence[Sequence[str]]) -> bool:
    """Whether rank r holds the reference's rows r, r + W, r + 2W, … (a ``DistributedSampler``'s
    order), at least two each."""
    world = len(ranks)
    return len(reference) >= 2 * world and all(
        list(rows) == list(reference[r::world]) for r, rows in enumerate(ranks)
    )


def blocks(reference: Sequence[str], ranks: Sequence[Sequence[str]]) -> int | None:
    """The number of blocks v (2 … `MOST_BLOCKS`) such that each rank's rows are, block after
    block, its consecutive part of each of the reference's v equal blocks (the two views of a
    batch concatenated per rank); None when no v gives the order."""
    size, world = len(reference), len(ranks)
    for blocks in range(2, MOST_BLOCKS + 1):
        if size % (blocks * world):
            continue
        block, part = size // blocks, size // (blocks * world)
        if part < 2:  # one row of each block: a strided order (`_strided`), not blocks
            continue
        expected = [[row for j in range(blocks)
                     for row in reference[j * block + r * part: j * block + (r + 1) * part]]
                    for r in range(world)]  # fmt: skip
        if expected == [list(rows) for rows in ranks]:
            return blocks
    return None
