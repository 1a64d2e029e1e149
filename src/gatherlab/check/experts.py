"""An expert-parallel run against one device (docs/checking.md §10, "Expert parallelism"). Each
rank holds some of one device's parameters under one device's names: those every rank holds
(the replicated ones) and its experts (`runfiles.Trained.held`). So the ranks' runs are made one
run in one device's order before they are judged, and what such code gets wrong is read from
each rank's pieces:

- `held_on_rank`: on each rank, before any trains: the parameters its model holds;
- `refused`: the one line for a split that is not expert parallelism (what the ranks hold does
  not make one device's model, a rank holds no expert, every rank holds every parameter), and
  `split_refused` the same for what the ranks of each W built, or a factory that raises there;
- `assembled`: the ranks' runs as one run in one device's order (`core.held.assemble`: the first
  gradient and the final parameters; rank 0's losses, the global ones);
- `unreduced`: the parameters whose copies' first gradients differ between their holders
  (`core.held.copies_apart`), and those of them every rank holds;
- `departure`: the cause read from the pieces against one device's gradient: ``experts_mixed``
  (experts held by different ranks given one gradient: reduced over ranks that hold other
  experts) or ``experts_scaled`` (the experts' gradient a constant other than 1 times one
  device's, every parameter every rank holds exact), with its words.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from itertools import chain
from typing import Any

import torch
from torch import nn

from gatherlab.core import gradients, held
from gatherlab.core.runfiles import Trained
from gatherlab.core.terms import Cause

__all__ = [
    "Departure", "assembled", "departure", "held_on_rank", "refused", "split_refused", "unreduced",
]  # fmt: skip

Held = tuple[tuple[str, tuple[int, ...], bool], ...]


def held_on_rank(form: Any, spec: Any) -> Held:
    """On a rank: the parameters its model holds (`plainstep.held_names`), built as a run builds
    it (the ranks' ``("dp", "ep")`` mesh, the seed), trained by nothing."""
    from gatherlab.runs import plainstep, removals

    model = plainstep.build(form, removals.Removals(), spec.precision, 1, spec.expert_parallel)
    return plainstep.held_names(model)


def _everywhere(every: Sequence[Held]) -> set[str]:
    """The names every rank holds."""
    return set.intersection(*({name for name, _, _ in names} for names in every))


def _experts(names: Sequence[str]) -> list[str]:
    """The experts the names belong to: each name up to its first number (``experts.3``), else
    the module that holds it."""
    found = []
    for name in names:
        parts = name.split(".")
        cut = next((i for i, part in enumerate(parts) if part.isdigit()), len(parts) - 2)
        found.append(".".join(parts[: cut + 1]))
    return list(dict.fromkeys(found))


def refused(model: nn.Module, every: Sequence[Held], degree: int, label: str) -> str | None:
    """The one line for what W ranks built (``every``, in rank order; one device's ``model``)
    that is not an expert-parallel split of it, None where it is: a name or shape one device's
    model does not have, or a parameter no rank holds (`core.held.assemble`); every rank holding
    every parameter (nothing split); a rank of an ep group holding no expert (more ranks than
    experts); the ranks at one ep index (the replicas) holding different parameters."""
    named = list(model.named_parameters())
    order = held.order_of(named)
    pieces = [
        held.Piece(rank, name, torch.zeros(shape))
        for rank, names in enumerate(every)
        for name, shape, _ in names
    ]  # fmt: skip
    try:
        held.assemble(order, pieces, held.aliases(model.named_parameters(remove_duplicate=False)))
    except held.HeldError as error:
        return f"{label}: {error}"
    everywhere = _everywhere(every)
    if everywhere >= {name for name, _ in named}:
        return (
            f"{label} was given a mesh and every rank holds every parameter: it does not split "
            "its experts over mesh['ep']; allowed: a factory that keeps this rank's experts of "
            "mesh['ep'] (one device's names) when given a mesh, or no --expert-parallel"
        )
    experts = _experts([name for name, _ in named if name not in everywhere])
    for rank, names in enumerate(every):
        if {name for name, _, _ in names} <= everywhere:
            listed = ", ".join(experts[:4]) + (", …" if len(experts) > 4 else "")
            return (
                f"--expert-parallel {degree}: rank {rank} (ep rank {rank % degree} of {degree}) "
                f"holds no expert: the model's {len(experts)} experts ({listed}) are fewer than "
                f"the {degree} ranks of an ep group; allowed: an E of at most {len(experts)} "
                "that the factory splits its experts over"
            )
    for rank, names in enumerate(every):
        replica = every[rank % degree]
        if {name for name, _, _ in names} != {name for name, _, _ in replica}:
            return (
                f"{label}: rank {rank} holds other parameters than rank {rank % degree}, its "
                f"replica at ep rank {rank % degree} (the ranks r and r + {degree} hold the same "
                "experts); allowed: experts chosen by mesh['ep'].get_local_rank() alone"
            )
    return None


def _pieces(trained: Trained, rank: int, gradient: bool) -> list[held.Piece]:
    """A rank's first gradient (``gradient``) or final parameters as pieces under the names it
    holds them by (`Trained.held`, `core.held.pieces_of`)."""
    entries = [(name, shape) for name, shape, trains in trained.held if trains or not gradient]
    return held.pieces_of(rank, entries, trained.first_gradient if gradient else trained.parameters)


def assembled(ranks: Sequence[Trained], model: nn.Module) -> Trained:
    """The ranks' runs (rank order, each with its final parameters) as one run in the order of
    one device's ``model``: its first gradient and final parameters assembled by name, each
    element from the lowest rank that holds it (`core.held.assemble`); the global losses of rank
    0; every rank's gradient pieces kept (``rank_gradients``) for `unreduced` and `departure`."""
    named = list(model.named_parameters())
    names = held.aliases(model.named_parameters(remove_duplicate=False))
    trainable = held.order_of([(name, p) for name, p in named if p.requires_grad])
    by_rank = [_pieces(trained, rank, True) for rank, trained in enumerate(ranks)]
    weights = chain.from_iterable(_pieces(t, rank, False) for rank, t in enumerate(ranks))
    return dataclasses.replace(
        ranks[0],
        first_gradient=held.assemble(trainable, chain.from_iterable(by_rank), names),
        parameters=held.assemble(held.order_of(named), weights, names),
        held=(), rank_gradients=tuple(tuple(pieces) for pieces in by_rank),
    )  # fmt: skip


def unreduced(run: Trained) -> tuple[list[held.Apart], tuple[str, ...]]:
    """The parameters whose copies' first gradients differ between their holders (more than
    float64's 1e-10 of the lowest rank's largest), and the names of those every rank holds (a
    replicated parameter: the mean over all ranks reproduces its reduction)."""
    apart = held.copies_apart(chain.from_iterable(run.rank_gradients))
    holders = len(run.rank_gradients)
    return apart, tuple(a.name for a in apart if len(a.copies) == holders)


@dataclasses.dataclass(frozen=True)
class Departure:
    """What the pieces show of an expert-parallel run's gradient: its cause and the words that
    name the parameters."""

    cause: Cause
    words: str


def departure(run: Trained, reference: Trained, model: nn.Module, degree: int) -> Departure | None:
    """The cause of an expert-parallel run's departing first gradient, read from its ranks'
    pieces (``run.rank_gradients``) against one device's (``reference``, in ``model``'s order):

    - ``experts_mixed``: two experts held by different ranks at one place of their ranks'
      parameters got one gradient, not zero (equal to float64's 1e-10; zero where no token of
      either's ep group reached them), where one device's differ: their
      gradients were reduced together, over ranks that hold other experts (every parameter
      all-reduced over all ranks, or a DDP around the experts);
    - ``experts_scaled``: the experts' gradient (the parameters not every rank holds) is one
      device's times a constant c ≠ 1 (cosine ≥ 1 − 1e-12), every parameter every rank holds
      exact: the experts' reduction divides by another count than one device's (by their W/E
      replicas where the ep group already summed their tokens' gradients: c = E).

    None where neither holds."""
    if not run.rank_gradients or reference.first_gradient is None:
        return None
    order = [(name, tuple(p.shape)) for name, p in model.named_parameters() if p.requires_grad]
    sizes = [int(torch.Size(shape).numel()) for _, shape in order]
    theirs = dict(zip([n for n, _ in order], reference.first_gradient.split(sizes), strict=True))
    every = [{piece.name for piece in pieces} for pieces in run.rank_gradients]
    everywhere = set.intersection(*every)
    own = [[p for p in pieces if p.name not in everywhere] for pieces in run.rank_gradients]
    tolerance = gradients.FLOAT64_TOLERANCE
    for rank, pieces in enumerate(own[1:], 1):
        for first, other in zip(own[0], pieces, strict=False):
            if first.name == other.name or first.value.shape != other.value.shape:
                continue
            scale = gradients.largest_difference(theirs[first.name]) or 1.0
            same = gradients.largest_difference(first.value, other.value) <= tolerance * scale
            apart = gradients.largest_difference(theirs[first.name], theirs[other.name])
            some = gradients.largest_difference(first.value) > tolerance * scale  # not both 0
            if same and some and apart > tolerance * scale:
                return Departure(Cause.EXPERTS_MIXED, (
                    f"{first.name} on rank 0 and {other.name} on rank {rank}, two experts, got "
                    "one gradient, where one device's differ by "
                    f"{apart / scale:.2g} (max relative difference)"
                ))  # fmt: skip
    names = [n for n, _ in order]
    replicated = torch.cat(
        [torch.full((size,), n in everywhere) for n, size in zip(names, sizes, strict=True)]
    )
    words = scaled(run.first_gradient, reference.first_gradient, replicated,
                   [n for n in names if n not in everywhere], degree)  # fmt: skip
    return None if words is None else Departure(Cause.EXPERTS_SCALED, words)


def scaled(
    mine: torch.Tensor, one: torch.Tensor, replicated: torch.Tensor, experts: Sequence[str],
    degree: int, tolerance: float = gradients.FLOAT64_TOLERANCE,
    parallel: float = gradients.PARALLEL_COSINE,
) -> str | None:  # fmt: skip
    """The words of ``experts_scaled``, None where it does not hold: a whole first gradient
    (``mine``) whose entries every rank holds (``replicated``, a mask) are one device's (``one``)
    to ``tolerance`` of their largest, and whose others (the ``experts``' parameters, not all
    zero) are a constant c ≠ 1 times one device's (cosine ≥ ``parallel``); c = E or 1/E named
    (E = ``degree``, the expert groups). The check's rule and the comparison of recordings'
    (`gatherlab.check.recordings`, in float32's rounding)."""
    if replicated.all() or not one[~replicated].abs().max() > 0:
        return None
    scale = gradients.largest_difference(one[replicated]) or 1.0
    if gradients.largest_difference(mine[replicated], one[replicated]) > tolerance * scale:
        return None
    cosine, ratio = gradients.cosine_and_norm_ratio(mine[~replicated], one[~replicated])
    if cosine < parallel or abs(ratio - 1) <= tolerance:
        return None
    named = next((f" = {name}" for name, c in (("E", degree), ("1/E", 1 / degree))
                  if abs(ratio - c) <= tolerance * c), "")  # fmt: skip
    return (f"the experts' gradient ({', '.join(_experts(experts))}) is {ratio:.6g}{named} times "
            f"one device's (cosine {cosine:.12g}), every parameter every rank holds exact "
            f"(E = {degree})")  # fmt: skip


def split_refused(setting: Any, world_sizes: Sequence[int]) -> str | None:
    """The one line for an expert-parallel factory whose ranks do not split one device's model
    (`refused`), built on the ranks of each W ≥ 2 (`held_on_rank`) before any rank trains; or
    for a factory that raises there. None where every W splits it. ``setting``: the training
    check's (`check.training.Setting`)."""
    from gatherlab.ranks.external import ranks_for
    from gatherlab.ranks.pool import RankError

    label = setting.form.built_label(setting.label)
    model = setting.checked(setting.built())
    degree = setting.spec.expert_parallel
    for world_size in sorted({w for w in world_sizes if w > 1}):
        try:
            every = ranks_for(world_size).run(held_on_rank, setting.form, setting.spec)
        except RankError as error:
            first = str(error).splitlines()[0]  # the failing rank and its error, no traceback
            return f"{label} with a (dp, ep) mesh on {world_size} ranks: {first}"
        line = refused(model, every, degree, label)
        if line is not None:
            return line
    return None
