"""A pipeline-parallel whole update as a rank trains it (docs/checking.md §10, "Pipeline
parallelism"): the user's model factory, given the ranks' ``("dp", "pp")`` mesh
(`gatherlab.ranks.world.mesh`), keeps this rank's stages of the model under one device's
parameter names, and the user's update runs their schedule (``torch.distributed.pipelining``):
every micro-batch's forward and backward, then one optimizer step. No DDP is put around the
model: a schedule calls its stages' modules, never a wrapper's forward; the update reduces over
``dp`` itself.

- `OneDevice`: one device's order of the parameters (names and shapes) and the aliases of a
  weight it ties, from the whole model built here as one device builds it;
- `pieces`: this rank's named parameters, or their gradients, as `core.held.Piece`s;
- `reduce_replicas`: named gradients averaged over a stage's replicas (``dp``): the reproduction
  of a replica nobody reduced;
- `trained`: what a rank's run returns: each step's global loss (`global_losses`), the first
  gradient of its pipeline and rank 0's final parameters assembled in one device's order, and
  the copies of a parameter that ended apart (`core.held.copies_apart`, every rank's copies);
- `held_on_rank`: the names each rank's factory kept, for the check's refusals before any rank
  trains (`splits`: an empty stage, a name one device lacks, a parameter no rank holds), and its
  update run once with each number of micro-batches (a schedule that refuses them raises
  there).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gatherlab.core import held, runfiles
from gatherlab.ranks import world

__all__ = [
    "Held", "NoLoss", "OneDevice", "global_losses", "held_on_rank", "pieces", "reduce_replicas",
    "schedule_of", "splits", "trained",
]  # fmt: skip

PP = world.PIPELINE_MESH_DIMS[1]


class NoLoss(ValueError):
    """No rank of the pipeline returned a loss for a step (one line)."""


@dataclass(frozen=True)
class OneDevice:
    """One device's parameters as a pipeline's pieces are assembled into them: each trainable
    parameter's name and shape in ``named_parameters`` order, and every name of each parameter
    (a tied one's aliases included) → the name it is ordered by."""

    order: tuple[tuple[str, tuple[int, ...]], ...]
    names: dict[str, str]

    @classmethod
    def of(cls, model: nn.Module) -> OneDevice:
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        return cls(tuple(held.order_of(trainable)),
                   held.aliases(model.named_parameters(remove_duplicate=False)))  # fmt: skip


def pieces(model: nn.Module, gradients: bool = False) -> list[held.Piece]:
    """This rank's trainable parameters (or, with ``gradients``, their gradients: zeros where a
    parameter has none) as pieces under the names the rank holds them by."""
    rank = world.rank()
    found = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        value = (p.grad if p.grad is not None else torch.zeros_like(p)) if gradients else p
        found.append(held.Piece(rank, name, value.detach().double().cpu().clone()))
    return found


def reduce_replicas(
    model: nn.Module, names: Sequence[str], mesh: Any, aliases: dict[str, str] | None = None
) -> None:
    """The gradients of ``model``'s parameters named ``names`` (one device's names; a copy held
    under an alias of one, ``aliases``, too) averaged over the stage's replicas (an all-reduce
    each over ``mesh["dp"]``, whose ranks hold the same stage: the same names); nothing with one
    replica or no names."""
    wanted = set(names)
    dp = mesh[world.PIPELINE_MESH_DIMS[0]]
    if not wanted or dp.size() == 1:
        return
    for name, parameter in model.named_parameters():
        if (aliases or {}).get(name, name) in wanted and parameter.grad is not None:
            dist.all_reduce(parameter.grad, group=dp.get_group())
            parameter.grad /= dp.size()


def _pipeline_group(mesh: Any) -> Any:
    return mesh[PP].get_group()


def global_losses(local: Sequence[float | None]) -> list[float]:
    """Each step's global loss: the mean of the losses the ranks returned for it (a pipeline's
    last stage returns its loss, the other stages None; the mean over the data-parallel
    pipelines, docs/design.md §2), summed correctly rounded; every rank calls this (an
    all-gather of objects). `NoLoss` for a step no rank returned a loss for."""
    every: list[Any] = [None] * world.size()
    dist.all_gather_object(every, list(local))
    losses = []
    for step, values in enumerate(zip(*every, strict=True)):
        returned = [v for v in values if v is not None]
        if not returned:
            raise NoLoss(
                f"the update returned no loss on any rank at update {step}; allowed: the loss on "
                "the rank of the pipeline's last stage (None on the others)"
            )
        losses.append(math.fsum(returned) / len(returned))
    return losses


def trained(
    model: nn.Module,
    mesh: Any,
    one_device: OneDevice,
    first_gradient: list[held.Piece],
    local_losses: Sequence[float | None],
    unused: frozenset[str] = frozenset(),
) -> runfiles.Trained:
    """A rank's run as the check compares it (every rank calls this: collectives). The first
    gradient is its pipeline's (its ranks' pieces all-gathered over ``pp``, assembled in one
    device's order): a rank of another data-parallel replica holds its own, which the check
    compares with rank 0's. The final parameters are rank 0's pipeline's, assembled on rank 0
    from every rank's pieces (gathered to it), where every parameter held by several ranks
    (the replicas of a stage, the copies of a tied weight) is compared across its holders:
    those that ended apart are ``copies_apart`` (`core.held.Apart`); the other ranks return no
    parameters. A copy the rank holds but its stages never use (``unused``: no gradient at the
    first step, as ``pipeline()`` leaves a tied head's copy on the first stage) counts only
    where no rank holds a used one."""
    losses = global_losses(local_losses)
    mine: list[Any] = [None] * mesh[PP].size()
    dist.all_gather_object(mine, (first_gradient, unused), group=_pipeline_group(mesh))
    gradient = held.assemble(one_device.order, _used(mine, one_device), one_device.names)
    every: list[Any] | None = [None] * world.size() if world.rank() == 0 else None
    dist.gather_object((pieces(model), unused), every, dst=0)
    if every is None:
        return runfiles.Trained(losses, gradient, torch.empty(0, dtype=torch.float64))
    ranks = set(dist.get_process_group_ranks(_pipeline_group(mesh)))
    everything = _used(every, one_device)
    ours = [p for p in everything if p.rank in ranks]
    parameters = held.assemble(one_device.order, ours, one_device.names)
    apart = tuple(held.copies_apart(everything, one_device.names, of="weights at the run's end"))
    return runfiles.Trained(losses, gradient, parameters, copies_apart=apart)


def _used(
    gathered: Sequence[tuple[list[held.Piece], frozenset[str]]], one_device: OneDevice
) -> list[held.Piece]:
    """The ranks' pieces but the copies their stages never used, unless no rank used any copy
    of that parameter (then it is held all the same)."""
    used = [p for ps, unused in gathered for p in ps if p.name not in unused]
    have = {one_device.names.get(p.name, p.name) for p in used}
    dead = [p for ps, unused in gathered for p in ps
            if p.name in unused and one_device.names.get(p.name, p.name) not in have]  # fmt: skip
    return used + dead


def schedule_of(error: BaseException) -> str | None:
    """The class of the pipeline schedule (``torch.distributed.pipelining.schedules``'
    ``PipelineScheduleSingle`` or ``PipelineScheduleMulti``) in whose code ``error`` was raised,
    or None: the innermost frame of its traceback whose ``self`` is one."""
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        PipelineScheduleSingle,
    )  # fmt: skip

    found, trace = None, error.__traceback__
    while trace is not None:
        owner = trace.tb_frame.f_locals.get("self")
        if isinstance(owner, PipelineScheduleSingle | PipelineScheduleMulti):
            found = type(owner).__name__
        trace = trace.tb_next
    return found


@dataclass(frozen=True)
class Held:
    """What a rank's factory kept (each trainable parameter's name and shape) and, when the
    ranks' names make one device's model, what its update did once at each layout: None where it
    ran, else the layout (the pipelines, W/P, and the micro-batches K), the error's line and the
    schedule that raised it (`schedule_of`)."""

    names: tuple[tuple[str, tuple[int, ...]], ...]
    refused: tuple[int, int, str, str | None] | None = None


def splits(kept: Sequence[Sequence[tuple[str, tuple[int, ...]]]], one_device: OneDevice) -> str:
    """What is wrong with the names and shapes each rank kept (``kept[r]``: the ranks of one or
    more pipelines), as
    one line with what is allowed: a rank that kept nothing (its stage is empty), or what
    `core.held.assemble` finds (a name or shape one device's model does not have, a parameter
    no rank holds); empty where they make one device's model."""
    empty = [rank for rank, names in enumerate(kept) if not names]
    if empty:
        return (
            f"rank {empty[0]} keeps no parameter (its stage is empty); allowed: a split that gives "
            "each rank of a pipeline a stage with parameters"
        )
    pieces = [held.Piece(rank, name, torch.zeros(shape, dtype=torch.float64))
              for rank, names in enumerate(kept) for name, shape in names]  # fmt: skip
    try:
        held.assemble(one_device.order, pieces, one_device.names)
    except held.HeldError as error:
        return str(error)
    return ""


def held_on_rank(
    build: Callable[[], nn.Module],
    run: Callable[[nn.Module, int, int], Any],
    layouts: Sequence[tuple[int, int]],
    one_device: OneDevice,
) -> Held:
    """On each rank of a layout (before any rank trains): ``build()`` (the factory with the
    mesh), the names it kept; when the ranks' names make one device's model (`splits`),
    ``run(model, pipelines, K)`` (one update from the initial weights on a pipeline's rows of the
    first batch at that layout) at each layout on a fresh build, until one raises: its layout,
    its line and its schedule. Every rank decides alike (an all-gather of the names)."""
    from gatherlab.core import cli

    model = build()
    names = tuple(held.order_of((n, p) for n, p in model.named_parameters() if p.requires_grad))
    every: list[Any] = [None] * world.size()
    dist.all_gather_object(every, names)
    if splits(every, one_device):
        return Held(names)
    for index, (pipelines, k) in enumerate(layouts):
        try:
            run(model if index == 0 else build(), pipelines, k)
        except Exception as error:
            return Held(names, (pipelines, k, cli.error_line(error), schedule_of(error)))
    return Held(names)
