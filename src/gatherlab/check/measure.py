"""A loss on W real gloo ranks against the same loss on one device, in float64: the global loss
(the mean over ranks of what each rank's loss returns), the parameter gradient that DDP hands to
the optimizer, and optionally a short training run (docs/design.md §1, docs/checking.md §6). The
gradient's class is `gatherlab.core.gradients.classify`'s.

``audit`` measures every gather × loss × world size (the gradient audit); ``gatherlab.check``
measures any loss. Losses are ``Recipe`` objects, built inside each rank; the ranks run in
the warm worker pools, or, with ``simulated=True``, as the virtual ranks of ``simworld`` (any
world size, the gathers simulated from their backward rules).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import pandas as pd
import torch
from torch import nn

from gatherlab.components.data import GlobalBatchSampler
from gatherlab.components.factory import Recipe
from gatherlab.core import terms
from gatherlab.core.gradients import Layout, classify
from gatherlab.core.runfiles import Trained
from gatherlab.core.terms import Style, World
from gatherlab.gather import CLASSES, STYLES, GatherFn, rule
from gatherlab.ranks import simworld, world
from gatherlab.ranks.external import ranks_for
from gatherlab.runs import loss as runs_loss
from gatherlab.runs import trace
from gatherlab.runs.spec import RunSpec
from gatherlab.runs.steplog import flat_gradient, mean_over_ranks

log = logging.getLogger(__name__)

NO_PREDICTION = "no prediction"
COLUMNS = (
    "gather", "loss", "style", "world_size", "world", "predicted", "measured", "cosine",
    "norm_ratio", "max_rel_err",
)  # fmt: skip

ModelFactory = runs_loss.ModelFactory
Batch = runs_loss.Batch
LossContractError = runs_loss.LossContractError

__all__ = [
    "CLASSES",
    "COLUMNS",
    "LossContractError",
    "Measured",
    "audit",
    "forward_on_one_device",
    "global_batches",
    "measure",
    "measure_on_ranks",
    "require_simulatable",
    "train",
]  # fmt: skip


@dataclass(frozen=True)
class Measured:
    """One loss on one layout: the global loss and the parameter gradient after DDP's average
    (the model's parameters, then the loss's own, flattened; ``parts`` names their ranges:
    ``model`` and ``loss.<name>`` per trainable parameter of the loss), and the global loss on
    further batches (``forwards``, forward only, the same weights)."""

    loss: float
    gradient: torch.Tensor
    forwards: tuple[float, ...] = ()
    parts: Layout | None = None


def layout(named: Iterable[tuple[str, nn.Parameter]], part_of: Callable[[str], str]) -> Layout:
    """The parts of the gradient flattened from these parameters in order: each trainable
    parameter's range under its part's name, ``part_of(parameter name)``."""
    parts: Layout = {}
    start = 0
    for name, parameter in named:
        stop = start + parameter.numel()
        if parameter.requires_grad:
            parts.setdefault(part_of(name), []).append((start, stop))
        start = stop
    return parts


def _part_of_loss_check(name: str) -> str:
    """A parameter of ``runs.loss.Whole``: the model's are one part, each of the loss's its own."""
    return "model" if name.startswith("model.") else name


def measure(
    loss: Recipe,
    model_factory: ModelFactory,
    view0: torch.Tensor,
    view1: torch.Tensor,
    seed: int,
    distributed: bool = False,
    further: Sequence[Batch] = (),
    precision: str = terms.Precision.FLOAT64,
    row_blocks: int = 1,
) -> Measured:
    """The loss value and parameter gradient (DDP-averaged when ``distributed``) of ``loss`` on
    these views, a zero gradient when no gradient reaches the parameters at all; and the loss on
    each of the ``further`` batches, forward only, with the same weights. In ``precision``
    (`gatherlab.runs.precision`; the gradient returned in float64 whatever its dtype), the
    model's forward in ``row_blocks`` row blocks (the floor's perturbation)."""
    whole, wrapped = runs_loss.build(loss, model_factory, seed, distributed, precision, row_blocks)
    device = world.device()
    view0, view1 = view0.to(device), view1.to(device)
    further = [(other0.to(device), other1.to(device)) for other0, other1 in further]
    value = runs_loss.value(wrapped, view0, view1, precision)
    runs_loss.backward(whole, value, distributed)
    loss_value = float(value.detach())
    del value
    runs_loss.average(whole, distributed)
    with torch.no_grad():
        forwards = tuple(
            float(runs_loss.value(whole, other0, other1, precision)) for other0, other1 in further
        )
    parts = layout(whole.named_parameters(), _part_of_loss_check)
    gradient = flat_gradient(whole.parameters()).cpu().double()
    return Measured(loss_value, gradient, forwards, parts)


def forward_on_one_device(
    loss: Recipe, model_factory: ModelFactory, seed: int
) -> Callable[..., float]:
    """The loss of two views on one device, forward only, with the weights of ``measure``: the
    model and the loss are built at the first call (in the caller's process group, if any) and
    kept for the next. ``rows``: the rows of the global batch the views hold (a slice or an
    index tensor), whose further inputs the loss is given, if it has any; all by default."""
    built: list[runs_loss.Whole] = []

    def forward(
        view0: torch.Tensor, view1: torch.Tensor, rows: slice | torch.Tensor = slice(None)
    ) -> float:
        if not built:
            built.append(runs_loss.build(loss, model_factory, seed, distributed=False)[0])
        built[0].rows = rows
        with torch.no_grad():
            return float(runs_loss.value(built[0], view0, view1))

    return forward


def _on_rank(
    cells: Mapping[Hashable, Recipe],
    model_factory: ModelFactory,
    view0: torch.Tensor,
    view1: torch.Tensor,
    seed: int,
    further: Sequence[Batch] = (),
    precision: str = terms.Precision.FLOAT64,
) -> dict[Hashable, Measured]:
    """On every rank: its slice of the global batch (and of the ``further`` batches); its local
    losses, and on rank 0 the gradient (after DDP's average it is the same on every rank)."""
    rows = world.own_rows(len(view0))
    mine = [(other0[rows], other1[rows]) for other0, other1 in further]
    measured = {}
    for cell, loss in cells.items():
        result = measure(loss, model_factory, view0[rows], view1[rows], seed, True, mine, precision)
        keep = result.gradient if world.rank() == 0 else torch.empty(0)
        measured[cell] = Measured(result.loss, keep, result.forwards, result.parts)
    return measured


# The names of the loss's two arguments in its records (`gatherlab.runs.trace`); of a loss that
# calls the model itself (`runs.loss.calls_model`), the views.
TRACED_INPUTS = (
    "loss's argument out0 (view 0's embeddings)",
    "loss's argument out1 (view 1's embeddings)",
)
TRACED_VIEWS = ("loss's argument view0 (view 0)", "loss's argument view1 (view 1)")


def traced(
    loss: Recipe, model_factory: ModelFactory, view0: torch.Tensor, view1: torch.Tensor, seed: int
) -> list[trace.Op]:
    """The operations of the loss's forward on these views, as `gatherlab.runs.trace` records
    them, with their gradients: the model and the loss built as `measure` builds them (no DDP:
    only the loss's own tensors are compared), in this process's group, if any. A loss that
    calls the model itself is given the views and the model (its calls of it recorded too)."""
    whole, _ = runs_loss.build(loss, model_factory, seed, distributed=False)
    device = world.device()
    view0, view1 = view0.to(device, torch.float64), view1.to(device, torch.float64)
    if whole.calls_model:
        out0, out1, names, model = view0, view1, TRACED_VIEWS, (whole.model,)
    else:
        out0, out1, names, model = whole.model(view0), whole.model(view1), TRACED_INPUTS, ()
    args, kwargs = whole.given(out0)
    modules = [("", whole.loss)]
    before = trace.buffer_state(modules)
    given = dict(zip(names, (out0, out1), strict=True))
    if loss.inputs is not None:  # the further inputs that are tensors, named as the loss's
        values = (*args, *kwargs.values())
        given |= {
            f"loss's input {name}": value
            for name, value in zip(loss.inputs.names(), values, strict=True)
            if isinstance(value, torch.Tensor)
        }
    with trace.traced(given) as tracer:
        value = whole.loss(*model, out0, out1, *args, **kwargs)
    tracer.returned(value)
    tracer.buffers(modules, before)
    tracer.keep_gradients()
    if isinstance(value, torch.Tensor) and value.requires_grad:
        value.sum().backward()
    return tracer.detached()


def _traced_on_rank(
    cells: Mapping[Hashable, Recipe],
    model_factory: ModelFactory,
    view0: torch.Tensor,
    view1: torch.Tensor,
    seed: int,
) -> dict[Hashable, list[trace.Op]]:
    rows = world.own_rows(len(view0))
    return {
        cell: traced(loss, model_factory, view0[rows], view1[rows], seed)
        for cell, loss in cells.items()
    }


def traced_on_ranks(
    cells: Mapping[Hashable, Recipe],
    model_factory: ModelFactory,
    view0: torch.Tensor,
    view1: torch.Tensor,
    world_size: int,
    seed: int,
) -> dict[Hashable, list[list[trace.Op]]]:
    """Each cell's records (`traced`) on every rank of ``world_size`` ranks of the warm pool, each
    on its slice of the global batch: per cell, rank 0's, rank 1's, …"""
    ranks = _run(world_size, False, _traced_on_rank, dict(cells), model_factory, view0, view1, seed)
    return {cell: [rank[cell] for rank in ranks] for cell in cells}


def _run(world_size: int, simulated: bool, function: Callable[..., object], *args) -> list:
    """``function(*args)`` on every rank of a world: W ranks of the warm pool (or the ranks a
    launcher started, ``ranks.external``), or W simulated ranks in this process."""
    if simulated:
        return simworld.run(world_size, function, *args)
    return ranks_for(world_size).run(function, *args)


def require_simulatable(loss: Recipe) -> None:
    """A ValueError in one line unless the simulated world can run ``loss``: its gather must be
    a ``Gather`` that names the rule of its backward (a loss without a gather communicates by
    itself, through a process group the simulated world does not have)."""
    if rule(loss.gather) is None:
        raise ValueError(
            f"gather {loss.gather!r} of {loss.name} cannot be simulated; allowed: a "
            f"gatherlab.gather.Gather whose backward names a rule ({', '.join(simworld.RULES)})"
        )


def measure_on_ranks(
    cells: Mapping[Hashable, Recipe],
    model_factory: ModelFactory,
    view0: torch.Tensor,
    view1: torch.Tensor,
    world_size: int,
    seed: int,
    simulated: bool = False,
    further: Sequence[Batch] = (),
    precision: str = terms.Precision.FLOAT64,
) -> dict[Hashable, Measured]:
    """Each cell's global loss (the mean over ranks of the ranks' losses) and DDP's gradient, on
    ``world_size`` ranks of the warm pool (or of the simulated world), each holding its slice of
    the global batch, in ``precision``; and its global loss on each of the ``further`` global
    batches."""
    if len(view0) % world_size:
        raise ValueError(f"the global batch of {len(view0)} does not split over {world_size}")
    if simulated:
        for loss in cells.values():
            require_simulatable(loss)
    ranks = _run(
        world_size, simulated, _on_rank, dict(cells), model_factory, view0, view1, seed,
        tuple(further), precision,
    )  # fmt: skip

    def losses(cell: Hashable) -> list[float]:  # the global loss of each batch, in order
        return mean_over_ranks([(rank[cell].loss, *rank[cell].forwards) for rank in ranks])

    return {
        cell: Measured(
            losses(cell)[0], ranks[0][cell].gradient, tuple(losses(cell)[1:]), ranks[0][cell].parts
        )
        for cell in cells
    }


def train(
    loss: Recipe,
    model_factory: ModelFactory,
    batches: Sequence[Batch],
    optimizer: Callable[..., torch.optim.Optimizer],
    world_size: int,
    seed: int,
    simulated: bool = False,
    precision: str = terms.Precision.FLOAT64,
    row_blocks: int = 1,
) -> Trained:
    """A training run of the loss form (`gatherlab.runs.loss.Loss`) on these global batches, on
    one device or on ``world_size`` ranks of the warm pool (plain DDP, no Lightning), or of the
    simulated world, in ``precision`` (on one device, its forward in ``row_blocks`` row blocks:
    the floor's perturbation). Its ``first_gradient`` is not kept (None); its parameters are the
    model's, then the loss's own."""
    form = runs_loss.Loss(loss, model_factory, optimizer, tuple(batches))
    spec = RunSpec(None, len(batches[0][0]), len(batches), seed, precision, row_blocks=row_blocks)
    if world_size == 1:
        return form.train_on_rank(spec)
    if simulated:
        require_simulatable(loss)
    return _run(world_size, simulated, form.train_on_rank, spec)[0]


def style(factory: Recipe | Callable[..., nn.Module]) -> Style | None:
    """The loss style a loss class declares (``style``: local, global or mixed), if any; a
    ValueError of one line for another value."""
    target = getattr(factory, "factory", factory)
    declared = getattr(target, "style", None)
    if declared is None or declared in STYLES:
        return None if declared is None else Style(declared)
    raise ValueError(
        f"{getattr(target, '__qualname__', target)} declares style={declared!r}; allowed: "
        f"{', '.join(STYLES)} (docs/design.md §1), or no style"
    )


def predicted(gather: GatherFn, loss_style: str | None) -> str:
    """The class a gather declares for a loss style (``Gather.predicted``), or "no prediction"."""
    declared = getattr(gather, "predicted", None) or {}
    return declared.get(loss_style, NO_PREDICTION) if loss_style else NO_PREDICTION


def audit(
    losses: Mapping[str, Recipe],
    model_factory: ModelFactory,
    view0: torch.Tensor,
    view1: torch.Tensor,
    gathers: Mapping[str, GatherFn],
    world_sizes: Sequence[int] = (2, 4, 8),
    seed: int = 0,
    simulated_world_sizes: Sequence[int] = (),
) -> pd.DataFrame:
    """One row per gather × loss × world (``COLUMNS``): ``world_sizes`` on real ranks, then
    ``simulated_world_sizes`` in the simulated world. ``losses`` maps a loss name to its factory
    (its gather is replaced by each gather's), ``gathers`` a gather name to the gather;
    ``view0``/``view1`` are one global batch."""
    references = {
        name: measure(loss.with_gather(None), model_factory, view0, view1, seed)
        for name, loss in losses.items()
    }
    cells = {
        (gather, name): loss.with_gather(gathers[gather])
        for gather in gathers
        for name, loss in losses.items()
    }
    rows = []
    worlds = [(w, World.REAL) for w in world_sizes]
    worlds += [(w, World.SIMULATED) for w in simulated_world_sizes]
    for world_size, kind in worlds:
        log.info("auditing %d cells on %d %s ranks", len(cells), world_size, kind)
        simulated = kind == World.SIMULATED
        measured = measure_on_ranks(cells, model_factory, view0, view1, world_size, seed, simulated)
        for gather, name in cells:
            gradient_class, cosine, norm_ratio, max_rel_err = classify(
                measured[gather, name].gradient, references[name].gradient, world_size
            )
            loss_style = style(losses[name])
            rows.append(
                {
                    "gather": gather,
                    "loss": name,
                    "style": loss_style or "unknown",
                    "world_size": world_size,
                    "world": kind,
                    "predicted": predicted(gathers[gather], loss_style),
                    "measured": gradient_class,
                    "cosine": cosine,
                    "norm_ratio": norm_ratio,
                    "max_rel_err": max_rel_err,
                }
            )
    return pd.DataFrame(rows, columns=list(COLUMNS))


def global_batches(dataset, global_batch_size: int, seed: int, shuffle: bool, steps: int) -> list:
    """The views of the first ``steps`` global batches a training run with this data takes, in
    the data order of docs/design.md §2 (rank r's slice of each is rows r·B … (r+1)·B − 1)."""
    sampler = GlobalBatchSampler(
        len(dataset), global_batch_size, steps, seed=seed, shuffle=shuffle, with_epoch=True
    )
    batches = []
    for keys in sampler:
        items = [dataset[key] for key in keys]
        batches.append((torch.stack([i[0] for i in items]), torch.stack([i[1] for i in items])))
    return batches
