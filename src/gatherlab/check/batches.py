"""The global batches of two recordings compared, update by update (docs/checking.md §6, "Comparing
two recordings", item 2): each update's rows (their digests, `recording.rows.row_digests`) as
a multiset, where a difference is the verdict ``data differs``, said before any gradient is
judged, and as an order (the ranks' rows concatenated in rank order), where a difference is a
note: a DistributedSampler's strided order, or each rank's part of v blocks (views concatenated
per rank before the forward).

A difference is explained from the fingerprints alone (`explain`): each run's epochs (an update
most of whose rows its epoch has given already starts the next one: a sampler without replacement
gives each row once per epoch), a row a rank holds twice within an epoch (padding), rows that one
run never gives although it covered its data set, and where the runs part: at update 0 (other
permutations), where an epoch starts (another reshuffle, or an epoch's order repeated), or where
their epochs are cut differently.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from gatherlab.check import diagnosis
from gatherlab.recording.format import Recording

__all__ = ["MOST_BLOCKS", "Batches", "blocks", "compare_batches", "epoch_starts", "explain"]

NO_ROWS = "note: A holds no batch fingerprints: the data is not compared"


@dataclass(frozen=True)
class Batches:
    """The global batches compared: the first update whose set of rows differs and its words
    (None: none differs; how many updates differ so said in them), the notes (another order), and
    what explains the difference with its fix (`explain`; None when none differs)."""

    update: int | None
    words: str | None
    notes: tuple[str, ...]
    explanation: str | None = None


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


def compare_batches(a: Recording, b: Recording) -> Batches:
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
    explanation = None if first is None else explain(a, b, first, strided=STRIDED in blocked)
    return Batches(first, words, tuple(notes), explanation)


# --- what explains a difference, from the fingerprints ------------------------------------------


def _global(recording: Recording) -> list[list[str]]:
    """Each update's global batch: its ranks' rows concatenated in rank order."""
    return [[row for rank in update.rows for row in rank] for update in recording.updates]


def epoch_starts(batches: Sequence[Sequence[str]]) -> list[int]:
    """The updates at which a run's epochs start, from its global batches: update 0, and each
    update more than half of whose rows its epoch has given already (a sampler without
    replacement gives each row once per epoch; its next epoch gives them again, a padded one a
    few of them twice)."""
    starts, seen = [0], set()
    for update, rows in enumerate(batches):
        if update and rows and 2 * sum(row in seen for row in rows) > len(rows):
            starts.append(update)
            seen = set()
        seen.update(rows)
    return starts


def _held_twice(
    recording: Recording, starts: list[int], until: int
) -> tuple[int, int, list[str]] | None:
    """The first (update, rank, rows) up to update ``until`` where a rank holds rows that its
    epoch has given already (padding, or samples the data set holds twice), None where no epoch
    repeats a row."""
    seen: set[str] = set()
    for update in recording.updates[: until + 1]:
        if update.index in starts:
            seen = set()
        for rank, rows in enumerate(update.rows):
            again = [row for i, row in enumerate(rows) if row in seen or row in rows[:i]]
            if again:
                return update.index, rank, again
            seen.update(rows)
    return None


def _ends_epoch(batches: list[list[str]], update: int) -> bool:
    """Whether ``update`` may end its epoch, where a sampler pads with the epoch's first rows: it
    is the last recorded, or the next update gives no row the run has not given before it (a
    new epoch of the same data set). A next update of rows never given continues the epoch, and
    rows held twice before it are equal samples of the data set, not padding."""
    if update + 1 >= len(batches):
        return True
    given = {row for rows in batches[: update + 1] for row in rows}
    return all(row in given for row in batches[update + 1])


def _grouped_alike(batches: dict[str, list[list[str]]], update: int) -> bool:
    """Whether the runs' global batches at ``update`` share most of their rows: equal samples
    grouped per device move a few rows of a batch to another (a duplicate kept out of one
    device's batch), where another permutation moves most of them."""
    a, b = Counter(batches["A"][update]), Counter(batches["B"][update])
    return 2 * (a & b).total() > max(a.total(), b.total())


def _epoch_counts(batches: list[list[str]], starts: list[int], epoch: int) -> Counter:
    """How often each row appears in a run's epoch ``epoch``, all of it that was recorded."""
    if epoch >= len(starts):
        return Counter()
    end = starts[epoch + 1] if epoch + 1 < len(starts) else len(batches)
    return Counter(row for rows in batches[starts[epoch] : end] for row in rows)


def _repeats_epoch(batches: list[list[str]], starts: list[int], epoch: int) -> bool:
    """Whether the run gives epoch ``epoch`` the rows of its previous epoch in the same order."""
    begin, previous = starts[epoch], starts[epoch - 1]
    end = starts[epoch + 1] if epoch + 1 < len(starts) else len(batches)
    length = min(end - begin, begin - previous)
    return batches[begin : begin + length] == batches[previous : previous + length]


def explain(a: Recording, b: Recording, first: int, strided: bool = False) -> str:
    """What explains that B's global batch of update ``first`` (the first that differs) is not
    A's, with its fix, from the two recordings' fingerprints (the module's docstring), in the
    order: global batches of other sizes from update 0, a row held twice within an epoch (as
    padding only at an epoch's end, `_ends_epoch`; as equal samples grouped per device only where
    the batches share most rows, `_grouped_alike`), a batch most of whose rows one run never
    gives though it covered its data set, another permutation from update 0, another reshuffle
    where an epoch starts, epochs cut differently; ``strided``: B held A's rows strided over its
    ranks before (a DistributedSampler's order)."""
    batches = {"A": _global(a), "B": _global(b)}
    sizes = {name: len(rows[0]) if rows else 0 for name, rows in batches.items()}
    if first == 0 and sizes["A"] != sizes["B"]:  # another global batch from the first update
        return diagnosis.DATA_CAUSES["size"].format(rows_a=sizes["A"], rows_b=sizes["B"])
    starts = {name: epoch_starts(rows) for name, rows in batches.items()}
    for name, recording, other in (("B", b, "A"), ("A", a, "B")):
        held = _held_twice(recording, starts[name], first)
        if held is not None and held[0] == first:
            update, rank, again = held
            epoch = bisect.bisect_right(starts[name], update) - 1
            theirs = _epoch_counts(batches[other], starts[other], epoch)
            kind = "duplicated" if all(theirs[row] >= 2 for row in again) else "padded"
            if kind == "padded" and not _ends_epoch(batches[name], update):
                continue  # no padding there: the data set's equal samples
            if kind == "duplicated" and not _grouped_alike(batches, update):
                continue  # other batches, not the same samples grouped otherwise
            return diagnosis.DATA_CAUSES[kind].format(
                run=name, rank=rank, rows=len(again), held=_rows(len(again)), epoch=epoch,
                update=update, other=other,
            )  # fmt: skip
    for name, other in (("B", "A"), ("A", "B")):
        if len(starts[other]) > 1:  # the other run gave its whole data set at least once
            given = {row for rows in batches[other] for row in rows}
            foreign = sum(row not in given for row in batches[name][first])
            if 2 * foreign > len(batches[name][first]):  # more than an epoch's dropped rest
                return diagnosis.DATA_CAUSES["foreign"].format(
                    run=name, other=other, update=first, rows=foreign, held=_rows(foreign)
                )
    if first == 0:
        return _start(batches, first)
    until = {name: [start for start in starts[name] if start <= first] for name in starts}
    if first in until["A"] and until["A"] == until["B"]:  # both start an epoch there
        epoch = until["A"].index(first)
        repeats = "".join(
            diagnosis.DATA_REPEATS.format(run=name, epoch=epoch, previous=epoch - 1)
            for name in ("A", "B") if _repeats_epoch(batches[name], starts[name], epoch)
        )  # fmt: skip
        return diagnosis.DATA_CAUSES["reshuffled"].format(
            update=first, epoch=epoch, previous=epoch - 1, repeats=repeats,
            strided=diagnosis.DATA_STRIDED if strided else "",
        )  # fmt: skip
    if len(starts["A"]) > 1 and len(starts["B"]) > 1 and starts["A"][1] != starts["B"][1]:
        rows = {name: sum(len(r) for r in batches[name][: starts[name][1]]) for name in batches}
        return diagnosis.DATA_CAUSES["epochs"].format(
            rows_a=rows["A"], updates_a=starts["A"][1], rows_b=rows["B"],
            updates_b=starts["B"][1], update=first,
        )  # fmt: skip
    epoch = bisect.bisect_right(starts["A"], first) - 1
    return diagnosis.DATA_CAUSES["unexplained"].format(update=first, epoch=epoch)


def _start(batches: dict[str, list[list[str]]], first: int) -> str:
    """Why update ``first`` (0) differs: another permutation where B's rows that A's batch lacks
    are A's rows at other updates (the same samples, in another order); where none is, and A
    never covered its data set, the fingerprints cannot tell that from inputs that differ."""
    given = {row for rows in batches["A"] for row in rows}
    lacking = set(batches["B"][first]) - set(batches["A"][first])
    if not lacking or any(row in given for row in lacking):
        return diagnosis.DATA_CAUSES["start"]
    return diagnosis.DATA_CAUSES["unseen"].format(
        rows=len(lacking), held=_rows(len(lacking)), update=first
    )


def _rows(count: int) -> str:
    return "row" if count == 1 else "rows"


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
