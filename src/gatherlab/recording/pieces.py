"""The parameters of a job whose ranks hold different ones (pipeline stages, experts), recorded as
one device's (docs/recording.md §11, "Pipeline and expert parallelism"): each rank holds some of
one device's parameters under one device's names; a parameter held by several ranks (the
data-parallel replicas of a stage, a tied weight's copy on another stage, a replicated layer
beside the experts) has copies, which must agree.

- `held_by`: every rank's parameters, gathered once when the recorder is made; None where every
  rank holds the same ones (data parallelism, FSDP2, tensor parallelism: the recorder's other
  paths);
- `Held`: what the ranks hold: one device's order of their parameters (`merged`), and the
  pieces of each part (`Held.pieces`, `Piece`): its parameters grouped by the ranks that hold
  them, copies of each other (a part can hold a replicated router and experts split over the
  ranks); each rank sketches each piece it holds;
- `Held.combined`: each part's sketch and squared norm from the ranks' (the first copy of each
  piece, the pieces summed: a sketch is linear), and the parts whose copies differ, with each
  replica's view of the part (the j-th copy of every piece, summed);
- `Held.drifted`: the parts whose copies' weights differ after a step.

Nothing here sends anything but `held_by`'s one gather; the rest is arithmetic on what the
recorder's ranks send rank 0 at each writing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch.distributed as dist

__all__ = ["Held", "Piece", "held_by", "merged"]

Named = tuple[str, tuple[int, ...]]
"""A parameter as a rank holds it: one device's name and its shape."""


def merged(ranks: Sequence[Sequence[Named]], copies: Sequence[frozenset[str]] = ()) -> list[Named]:
    """Every rank's parameters in one order that keeps each rank's own (one device's, for
    consecutive stages, for stages interleaved over the ranks and for experts numbered in
    order): repeatedly the next parameter of a rank that no other rank holds later in its own
    order, of the lowest such rank but where another's is a lower-numbered sibling
    (`_numbered_before`: ``layers.1.…`` before ``layers.2.…``, as an ``nn.ModuleList`` or a
    ``ModuleDict`` keyed by number orders them on one device). ``copies``: per rank, the names
    it holds as another parameter's copy (a tied weight on the last stage, named by the job as
    one device names it), which take the place their own holder gives them and order nothing."""
    queues = [[item for item in held if item[0] not in (copies[rank] if copies else ())]
              for rank, held in enumerate(ranks)]  # fmt: skip
    order: list[Named] = []
    while any(queues):
        waiting = [queue for queue in queues if queue]
        ready = [
            queue
            for queue in waiting
            if not any(queue[0][0] in (n for n, _ in other[1:]) for other in queues)
        ]
        queue = (ready or waiting)[0]  # orders that disagree: the lowest rank's first
        for other in ready[1:]:
            if _numbered_before(other[0][0], queue[0][0]):
                queue = other
        name = queue[0][0]
        order.append(queue[0])
        for other in queues:
            other[:] = [item for item in other if item[0] != name]
    placed = {name for name, _ in order}
    for held in ranks:  # a copy whose own holder is no rank: where its rank holds it
        for item in held:
            if item[0] not in placed:
                placed.add(item[0])
                order.append(item)
    return order


def _numbered_before(name: str, other: str) -> bool:
    """Whether parameter ``name`` is a lower-numbered sibling's than ``other``: at the first
    component of their dotted paths where they differ, both are numbers and ``name``'s is less
    (stage 1's ``layers.1.w`` before stage 2's ``layers.2.w``, held by rank 1 and rank 0 of an
    interleaved pipeline). Other names are not ordered by this."""
    for mine, theirs in zip(name.split("."), other.split("."), strict=False):
        if mine != theirs:
            return mine.isdigit() and theirs.isdigit() and int(mine) < int(theirs)
    return False


@dataclass(frozen=True)
class Piece:
    """Parameters of one part (``names``) that the same ranks (``ranks``) hold: their copies."""

    part: str
    ranks: tuple[int, ...]
    names: tuple[str, ...]

    @property
    def key(self) -> str:
        """The piece's name among a rank's sketches: its part and its ranks."""
        return f"{self.part} @ {','.join(map(str, self.ranks))}"


@dataclass(frozen=True)
class Held:
    """What each rank holds (``ranks``: its parameters, one device's names and shapes, in its
    order; ``from_model``: the names that are the model's, whose parts are cut as one device's
    model is), one device's order of them (``order``), and whether some are DTensors."""

    ranks: tuple[tuple[Named, ...], ...]
    from_model: frozenset[str]
    order: tuple[Named, ...]
    sharded: bool = False
    """Whether some rank holds a ``DTensor`` among them (FSDP2, tensor parallelism)."""

    def pieces(self, part_of: Callable[[str], str]) -> list[Piece]:
        """The pieces of every part: its parameters grouped by the ranks that hold them (each
        rank of a piece a copy of it), in one device's order of their first parameter."""
        holders: dict[str, list[int]] = {}
        for rank, held in enumerate(self.ranks):
            for name, _ in held:
                holders.setdefault(name, []).append(rank)
        found: dict[tuple[str, tuple[int, ...]], list[str]] = {}
        for name, _ in self.order:
            found.setdefault((part_of(name), tuple(holders[name])), []).append(name)
        return [Piece(part, ranks, tuple(names)) for (part, ranks), names in found.items()]

    @staticmethod
    def combined(
        pieces: Sequence[Piece],
        parts: Sequence[str],
        views: Sequence[np.ndarray],
        squares: Sequence[np.ndarray],
    ) -> tuple[np.ndarray, dict[str, float], dict[str, list[np.ndarray]]]:
        """Each part's sketch (parts × k) and norm from every rank's sketches of its pieces
        (``views``, rank by rank, pieces × k, a piece it does not hold zeros; ``squares`` their
        squared norms): the first copy of each piece, the part's pieces summed. A part whose
        copies differ (a gradient not reduced over a stage's replicas, a tied weight's copies not
        summed) also gets each replica's view, the j-th copy of every piece summed (as many views
        as its most copies)."""
        k = views[0].shape[1]
        sketch, squared = np.zeros((len(parts), k)), np.zeros(len(parts))
        unreduced: dict[str, list[np.ndarray]] = {}
        for i, part in enumerate(parts):
            mine = [(u, piece) for u, piece in enumerate(pieces) if piece.part == part]
            for u, piece in mine:
                sketch[i] += views[piece.ranks[0]][u]
                squared[i] += squares[piece.ranks[0]][u]
            apart = any(not np.array_equal(views[r][u], views[piece.ranks[0]][u])
                        for u, piece in mine for r in piece.ranks[1:])  # fmt: skip
            if apart:
                copies = max(len(piece.ranks) for _, piece in mine)
                unreduced[part] = [
                    sum((views[piece.ranks[j % len(piece.ranks)]][u] for u, piece in mine),
                        np.zeros(k))
                    for j in range(copies)
                ]  # fmt: skip
        norms = {part: float(np.sqrt(squared[i])) for i, part in enumerate(parts)}
        return sketch, norms, unreduced

    @staticmethod
    def drifted(pieces: Sequence[Piece], parts: Sequence[str], digests: np.ndarray) -> list[str]:
        """The parts some of whose pieces' copies hold other weights after a step (``digests``:
        ranks × pieces, each rank's digest of its weights of each piece)."""
        apart = {
            piece.part
            for u, piece in enumerate(pieces)
            if (digests[list(piece.ranks), u] != digests[piece.ranks[0], u]).any()
        }
        return [part for part in parts if part in apart]


def held_by(
    held: Sequence[Named],
    from_model: Sequence[str],
    copies: Sequence[str],
    distributed: bool,
    sharded: bool = False,
) -> Held | None:
    """Every rank's parameters (one collective, when the recorder is made), as `Held`: what it
    holds, which of them are the model's, which it holds as another's copy (`merged`), and
    whether some rank holds a ``DTensor`` (``sharded``: every rank decides alike); None without
    a process group or where every rank holds the same parameters."""
    if not distributed:
        return None
    every: list = [None] * dist.get_world_size()
    sent = ([(n, tuple(s)) for n, s in held], list(from_model), list(copies), sharded)
    dist.all_gather_object(every, sent)
    ranks = tuple(tuple(parameters) for parameters, _, _, _ in every)
    if all(parameters == ranks[0] for parameters in ranks):
        return None
    model = frozenset(name for _, names, _, _ in every for name in names)
    order = merged(ranks, [frozenset(names) for _, _, names, _ in every])
    return Held(ranks, model, tuple(order), any(shard for *_, shard in every))
