"""One device's parameters from the pieces that ranks hold (docs/checking.md §10, "Pipeline
parallelism"): in a pipeline- or expert-parallel run each rank holds some of one device's
parameters, under one device's names. A parameter may be held by several ranks: replicas (the
data-parallel copies of a stage), and copies of a weight that one device ties (an embedding on
the first stage and the output head on the last, one `nn.Parameter` on one device, which
``named_parameters(remove_duplicate=False)`` lists under both names). A piece may also be a
block of rows (dimension 0) of a parameter, as a rank holds its experts of a stacked expert
weight.

Pure arithmetic on the pieces, wherever they were gathered (a rank, the command, a recording's
reader): no process group here.

- `aliases`: each of one device's names of a parameter → the name ``named_parameters`` gives it;
- `Piece`: one rank's copy of one parameter, or of a block of its rows; `pieces_of` cuts a
  rank's flat vector into its pieces;
- `assemble`: one flat vector in one device's order from the pieces (the first holder's copy of
  each element), or `HeldError` naming what no rank holds or what one device does not have;
- `copies_apart`: the parameters whose copies differ between their holders, each with its copies
  (rank and name) and by how much (`Apart`), found from the copies alone, without a reference.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from gatherlab.core import gradients

__all__ = [
    "Apart", "HeldError", "Piece", "aliases", "assemble", "copies_apart", "order_of", "pieces_of",
]  # fmt: skip


class HeldError(ValueError):
    """Pieces that do not make one device's parameters: a name one device does not have, a shape
    that is not its, or a parameter (or rows of it) that no rank holds. One line."""


def aliases(named: Iterable[tuple[str, object]]) -> dict[str, str]:
    """Each name of ``named`` (one device's ``named_parameters(remove_duplicate=False)``: a tied
    parameter once per module that holds it) → the first name of the same object, the one
    ``named_parameters()`` gives it and one device's vectors are ordered by."""
    first: dict[int, str] = {}
    found = {}
    for name, parameter in named:
        found[name] = first.setdefault(id(parameter), name)
    return found


def order_of(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, tuple[int, ...]]]:
    """One device's order: each parameter's name and shape, as ``named_parameters()`` gives them
    (a tied parameter once)."""
    return [(name, tuple(parameter.shape)) for name, parameter in named]


@dataclass(frozen=True)
class Piece:
    """Rank ``rank``'s copy of the parameter it holds as ``name`` (one device's name, or an alias
    of it, `aliases`): ``value`` the whole parameter, or with ``start`` ≥ 0 the block of its rows
    from ``start`` (dimension 0, as many rows as ``value`` has)."""

    rank: int
    name: str
    value: torch.Tensor
    start: int | None = None

    @property
    def rows(self) -> tuple[int, int] | None:
        """The rows of one device's parameter this piece holds (None: the whole)."""
        if self.start is None:
            return None
        return self.start, self.start + (self.value.shape[0] if self.value.dim() else 1)


def pieces_of(
    rank: int, names: Sequence[tuple[str, tuple[int, ...]]], flat: torch.Tensor
) -> list[Piece]:
    """Rank ``rank``'s vector ``flat`` (its parameters, or their gradients, flattened one after
    the other in the order of ``names``: each one's name and shape) cut into its pieces, each
    whole; `HeldError` when the lengths differ."""
    sizes = [math.prod(shape) for _, shape in names]
    if sum(sizes) != flat.numel():
        raise HeldError(
            f"rank {rank}'s vector has {flat.numel()} values where its {len(names)} parameters "
            f"hold {sum(sizes)}; allowed: the parameters flattened in the order named"
        )
    values = torch.split(flat.reshape(-1), sizes)
    return [Piece(rank, name, value.reshape(shape))
            for (name, shape), value in zip(names, values, strict=True)]  # fmt: skip


def _canonical(piece: Piece, names: Mapping[str, str], known: Sequence[str]) -> str:
    if piece.name not in names:
        listed = ", ".join(known[:6]) + (", …" if len(known) > 6 else "")
        raise HeldError(
            f"rank {piece.rank} holds {piece.name}, which one device's model does not have; "
            f"allowed: one device's names ({listed})"
        )
    return names[piece.name]


def assemble(
    order: Sequence[tuple[str, tuple[int, ...]]],
    pieces: Iterable[Piece],
    names: Mapping[str, str] | None = None,
) -> torch.Tensor:
    """One float64 vector of one device's parameters in ``order`` (`order_of`), each element
    taken from the lowest rank that holds it (another holder's copy is `copies_apart`'s to
    compare). ``names``: `aliases` (None: every piece under the name ``order`` gives it).
    `HeldError` for a piece of a name one device does not have or of another shape, and for a
    parameter, or rows of it, that no rank holds."""
    shapes = dict(order)
    names = dict(names) if names is not None else {name: name for name in shapes}
    known = list(shapes)
    whole: dict[str, torch.Tensor] = {}
    filled: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for piece in sorted(pieces, key=lambda p: p.rank):  # the lowest rank's copy is kept
        name = _canonical(piece, names, known)
        shape = shapes[name]
        value = piece.value.detach().double().cpu()
        if piece.start is None:
            if tuple(value.shape) != shape:
                raise HeldError(
                    f"rank {piece.rank} holds {piece.name} of shape {tuple(value.shape)}; allowed: "
                    f"one device's shape {shape}"
                )
            whole.setdefault(name, value)
            continue
        start, stop = piece.rows
        if not shape or tuple(value.shape[1:]) != shape[1:] or start < 0 or stop > shape[0]:
            raise HeldError(
                f"rank {piece.rank} holds rows {start}–{stop} of {piece.name} of shape "
                f"{tuple(value.shape)}; allowed: rows of one device's shape {shape}"
            )
        target = filled.setdefault(name, torch.zeros(shape, dtype=torch.float64))
        mask = covered.setdefault(name, torch.zeros(shape[0], dtype=torch.bool))
        fresh = ~mask[start:stop]  # rows no lower rank holds
        target[start:stop][fresh] = value[fresh]
        mask[start:stop] = True
    vectors = []
    for name, shape in order:
        if name in whole:
            vectors.append(whole[name].reshape(-1))
            continue
        if name not in filled:
            raise HeldError(
                f"no rank holds {name} (shape {shape}) of one device's model; allowed: a split "
                "whose stages hold every parameter"
            )
        missing = (~covered[name]).nonzero().reshape(-1)
        if len(missing):
            raise HeldError(
                f"no rank holds row {int(missing[0])} of {name} (shape {shape}); allowed: blocks "
                "of rows that cover it"
            )
        vectors.append(filled[name].reshape(-1))
    return torch.cat(vectors) if vectors else torch.zeros(0, dtype=torch.float64)


@dataclass(frozen=True)
class Apart:
    """One device's parameter ``name`` (or its ``rows``) whose copies differ: each copy as
    (rank, the name the rank holds it under), the lowest rank first, and the largest absolute
    difference from that first copy, relative to the first copy's largest magnitude; ``of``
    says what was compared (the copies' gradients, or their weights at the run's end)."""

    name: str
    copies: tuple[tuple[int, str], ...]
    difference: float
    rows: tuple[int, int] | None = None
    of: str = "gradients"

    @property
    def tied(self) -> bool:
        """Whether the copies are held under different names: a weight one device ties (not
        replicas of one stage)."""
        return len({held for _, held in self.copies}) > 1

    def words(self) -> str:
        """The copies in one phrase: ``emb.weight on rank 0 and head.weight on rank 1, copies of
        one device's emb.weight, whose gradients differ by 0.12 (max relative difference)``."""
        listed = [f"{held} on rank {rank}" for rank, held in self.copies]
        held = " and ".join([", ".join(listed[:-1]), listed[-1]] if len(listed) > 2 else listed)
        what = f"rows {self.rows[0]}–{self.rows[1]} of {self.name}" if self.rows else self.name
        return (
            f"{held}, copies of one device's {what}, whose {self.of} differ by "
            f"{self.difference:.2g} (max relative difference)"
        )


def listed(words: Sequence[str], most: int = 3) -> str:
    """The first ``most`` of some copies' `Apart.words`, and how many more differ: a stage's
    replicas left unreduced make every parameter's copies differ, too many to read."""
    more = len(words) - most
    return "; ".join(words[:most]) + (f"; and {more} more parameters' copies" if more > 0 else "")


def copies_apart(
    pieces: Iterable[Piece],
    names: Mapping[str, str] | None = None,
    tolerance: float = gradients.FLOAT64_TOLERANCE,
    of: str = "gradients",
) -> list[Apart]:
    """The parameters (or blocks of rows) held by more than one rank whose copies differ from
    the lowest rank's by more than ``tolerance`` of its largest magnitude (float64's 1e-10 by
    default), in the order of their first piece. ``names``: `aliases` (None: the pieces' names
    as they are); ``of``: what the pieces are (`Apart.of`)."""
    held: dict[tuple[str, tuple[int, int] | None], list[Piece]] = {}
    for piece in pieces:
        name = names.get(piece.name, piece.name) if names is not None else piece.name
        held.setdefault((name, piece.rows), []).append(piece)
    found = []
    for (name, rows), copies in held.items():
        if len(copies) < 2:
            continue
        copies = sorted(copies, key=lambda p: p.rank)
        first = copies[0].value.detach().double().reshape(-1).cpu()
        scale = gradients.largest_difference(first) or 1.0
        largest = max(
            gradients.largest_difference(c.value.detach().double().reshape(-1).cpu(), first)
            for c in copies[1:]
        )  # fmt: skip
        if largest > tolerance * scale:
            found.append(
                Apart(name, tuple((c.rank, c.name) for c in copies), largest / scale, rows, of)
            )
    return found
