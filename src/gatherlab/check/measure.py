"""A loss on W real gloo ranks against the same loss on one device, in float64: the global loss
(the mean over ranks of what each rank's loss returns), the parameter gradient that DDP hands to
the optimizer, and optionally a short training run (docs/design.md §1, §6). The gradient is
classified:

- ``exact``: max |g − g₁| / max |g₁| ≤ 1e-10 (summation order only);
- ``none``: no gradient reaches the parameters at all (g = 0), whether one device has one or
  not (nothing trains: never ``exact``);
- ``1/W``: same direction (cosine ≥ 1 − 1e-12) and norm ratio 1/W to a relative 1e-10;
- ``W``: same direction and norm ratio W to a relative 1e-10;
- with K micro-batches per rank (``micro_batches``), the other named factors of `factors`
  (``1/K``, ``K``, ``1/(W·K)``, ``W·K``, ``W/K``, ``K/W``; ``1/W = 1/K`` and ``W = K`` at
  W = K): same direction and that norm ratio to a relative 1e-10;
- ``biased``: a different direction (no rescaling repairs it);
- ``other``: anything else: the same direction at a factor that no name gives (the factor is
  the norm ratio), or a gradient where one device has none.

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
from gatherlab.core.runfiles import Trained
from gatherlab.core.terms import Factor, GradientClass, Style, World
from gatherlab.gather import CLASSES, STYLES, GatherFn, rule
from gatherlab.ranks import simworld, world
from gatherlab.ranks.external import ranks_for
from gatherlab.runs import loss as runs_loss
from gatherlab.runs import trace
from gatherlab.runs.record import flat_gradient, mean_over_ranks
from gatherlab.runs.spec import RunSpec

log = logging.getLogger(__name__)

EXACT_RELATIVE_ERROR = terms.FLOAT64
PARALLEL_COSINE = 1 - 1e-12
NORM_RATIO_TOLERANCE = terms.FLOAT64
# The global loss on W ranks against the 1-device loss: the same up to summation order.
FORWARD_RELATIVE_TOLERANCE = terms.FLOAT64
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
    "classify",
    "factor_name",
    "factors",
    "global_batches",
    "measure",
    "measure_on_ranks",
    "require_simulatable",
    "train",
    "validate_world_sizes",
]  # fmt: skip


Layout = dict[str, list[tuple[int, int]]]
"""The parts of a flattened gradient: each part's name and its ranges (start, stop) in it."""


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


def split(gradient: torch.Tensor, parts: Layout) -> dict[str, torch.Tensor]:
    """Each part's gradient, in the order of ``parts``."""
    return {
        name: torch.cat([gradient[start:stop] for start, stop in ranges])
        for name, ranges in parts.items()
    }


def measure(
    loss: Recipe,
    model_factory: ModelFactory,
    view0: torch.Tensor,
    view1: torch.Tensor,
    seed: int,
    distributed: bool = False,
    further: Sequence[Batch] = (),
) -> Measured:
    """The loss value and parameter gradient (DDP-averaged when ``distributed``) of ``loss`` on
    these views, a zero gradient when no gradient reaches the parameters at all; and the loss on
    each of the ``further`` batches, forward only, with the same weights."""
    whole, wrapped = runs_loss.build(loss, model_factory, seed, distributed)
    device = world.device()
    view0, view1 = view0.to(device), view1.to(device)
    further = [(other0.to(device), other1.to(device)) for other0, other1 in further]
    value = runs_loss.value(wrapped, view0.double(), view1.double())
    runs_loss.backward(whole, value, distributed)
    loss_value = float(value.detach())
    del value
    runs_loss.average(whole, distributed)
    with torch.no_grad():
        forwards = tuple(
            float(runs_loss.value(whole, other0.double(), other1.double()))
            for other0, other1 in further
        )
    parts = layout(whole.named_parameters(), _part_of_loss_check)
    return Measured(loss_value, flat_gradient(whole.parameters()).cpu(), forwards, parts)


def one_device(
    loss: Recipe, model_factory: ModelFactory, seed: int
) -> Callable[[torch.Tensor, torch.Tensor], float]:
    """The loss of two views on one device, forward only, with the weights of ``measure``: the
    model and the loss are built at the first call (in the caller's process group, if any) and
    kept for the next."""
    built: list[nn.Module] = []

    def forward(view0: torch.Tensor, view1: torch.Tensor) -> float:
        if not built:
            built.append(runs_loss.build(loss, model_factory, seed, distributed=False)[0])
        with torch.no_grad():
            return float(runs_loss.value(built[0], view0.double(), view1.double()))

    return forward


def _on_rank(
    cells: Mapping[Hashable, Recipe],
    model_factory: ModelFactory,
    view0: torch.Tensor,
    view1: torch.Tensor,
    seed: int,
    further: Sequence[Batch] = (),
) -> dict[Hashable, Measured]:
    """On every rank: its slice of the global batch (and of the ``further`` batches); its local
    losses, and on rank 0 the gradient (after DDP's average it is the same on every rank)."""
    rows = world.own_rows(len(view0))
    mine = [(other0[rows], other1[rows]) for other0, other1 in further]
    measured = {}
    for cell, loss in cells.items():
        result = measure(loss, model_factory, view0[rows], view1[rows], seed, True, mine)
        keep = result.gradient if world.rank() == 0 else torch.empty(0)
        measured[cell] = Measured(result.loss, keep, result.forwards, result.parts)
    return measured


# The names of the loss's two arguments in its records (`gatherlab.runs.trace`).
TRACED_INPUTS = (
    "loss's argument out0 (view 0's embeddings)",
    "loss's argument out1 (view 1's embeddings)",
)


def traced(
    loss: Recipe, model_factory: ModelFactory, view0: torch.Tensor, view1: torch.Tensor, seed: int
) -> list[trace.Op]:
    """The operations of the loss's forward on these views, as `gatherlab.runs.trace` records
    them, with their gradients: the model and the loss built as `measure` builds them (no DDP:
    only the loss's own tensors are compared), in this process's group, if any."""
    whole, _ = runs_loss.build(loss, model_factory, seed, distributed=False)
    device = world.device()
    out0, out1 = whole.model(view0.to(device).double()), whole.model(view1.to(device).double())
    modules = [("", whole.loss)]
    before = trace.buffer_state(modules)
    with trace.traced(dict(zip(TRACED_INPUTS, (out0, out1), strict=True))) as tracer:
        value = whole.loss(out0, out1)
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
) -> dict[Hashable, Measured]:
    """Each cell's global loss (the mean over ranks of the ranks' losses) and DDP's gradient, on
    ``world_size`` ranks of the warm pool (or of the simulated world), each holding its slice of
    the global batch; and its global loss on each of the ``further`` global batches."""
    if len(view0) % world_size:
        raise ValueError(f"the global batch of {len(view0)} does not split over {world_size}")
    if simulated:
        for loss in cells.values():
            require_simulatable(loss)
    ranks = _run(
        world_size, simulated, _on_rank, dict(cells), model_factory, view0, view1, seed,
        tuple(further),
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
) -> Trained:
    """A training run of the loss form (`gatherlab.runs.loss.Loss`) on these global batches, on
    one device or on ``world_size`` ranks of the warm pool (plain DDP, no Lightning), or of the
    simulated world. Its ``first_gradient`` is not kept (None); its parameters are the model's,
    then the loss's own."""
    form = runs_loss.Loss(loss, model_factory, optimizer, tuple(batches))
    spec = RunSpec(None, len(batches[0][0]), len(batches), seed, terms.Precision.FLOAT64)
    if world_size == 1:
        return form.train_on_rank(spec)
    if simulated:
        require_simulatable(loss)
    return _run(world_size, simulated, form.train_on_rank, spec)[0]


def validate_world_sizes(world_sizes: Sequence[int], global_batch_size: int, batch: str) -> None:
    """A ValueError of one line unless every world size is an integer ≥ 2 that divides the global
    batch (``batch`` names it in the message, e.g. "the global batch of 16")."""
    for world_size in world_sizes:
        if not terms.is_integer(world_size, 2):
            raise ValueError(f"world size {world_size!r} is not allowed; allowed: integers ≥ 2")
        if global_batch_size % world_size:
            raise ValueError(
                f"world size {world_size} does not divide {batch}; allowed: divisors of "
                f"{global_batch_size}"
            )


def same_forward(loss: float, reference: float) -> tuple[bool, float]:
    """Whether a global loss is the reference's up to summation order, and its relative
    difference."""
    difference = abs(loss - reference) / max(abs(reference), torch.finfo(torch.float64).tiny)
    return difference <= FORWARD_RELATIVE_TOLERANCE, difference


def _near(ratio: float, expected: float) -> bool:
    return abs(ratio / expected - 1) <= NORM_RATIO_TOLERANCE


def cosine_and_norm_ratio(vector: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """The cosine of ``vector`` with a nonzero ``reference`` (NaN for a zero vector) and the
    ratio of their norms."""
    norm, reference_norm = torch.linalg.vector_norm(vector), torch.linalg.vector_norm(reference)
    cosine = float(vector @ reference / (norm * reference_norm)) if norm > 0 else float("nan")
    return cosine, float(norm / reference_norm)


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


def factor_name(ratio: float, world_size: int, micro_batches: int = 1) -> str | None:
    """The name of the constant factor ``ratio`` on this layout (`factors`, to a relative 1e-10),
    or None when no name gives it."""
    for name, c in factors(world_size, micro_batches).items():
        if _near(ratio, c):
            return name
    return None


def classify(
    gradient: torch.Tensor, reference: torch.Tensor, world_size: int, micro_batches: int = 1
) -> tuple[str, float, float, float]:
    """The class of ``gradient`` against ``reference`` on ``world_size`` ranks that each
    accumulate ``micro_batches`` micro-batches, with cosine, norm ratio, max rel. error: a
    gradient parallel to the reference at a named factor (`factors`) is named by it, at any other
    factor ``other`` (the factor is its norm ratio). No gradient on either side is ``none``,
    never ``exact``: nothing trains (cosine, norm ratio and max rel. error NaN, as for any zero
    reference)."""
    axes = (world_size, micro_batches)
    if float(torch.linalg.vector_norm(reference)) == 0:  # no gradient on one device either
        measured = GradientClass.NONE if gradient.abs().max() == 0 else GradientClass.OTHER
        return measured, float("nan"), float("nan"), float("nan")
    cosine, norm_ratio = cosine_and_norm_ratio(gradient, reference)
    norm = float(torch.linalg.vector_norm(gradient))
    max_rel_err = float((gradient - reference).abs().max() / reference.abs().max())
    if max_rel_err <= EXACT_RELATIVE_ERROR:
        measured = GradientClass.EXACT
    elif norm == 0:
        measured = GradientClass.NONE
    elif cosine >= PARALLEL_COSINE and (named := factor_name(norm_ratio, *axes)) is not None:
        measured = named
    elif cosine < PARALLEL_COSINE:
        measured = GradientClass.BIASED
    else:
        measured = GradientClass.OTHER
    return measured, cosine, norm_ratio, max_rel_err


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


def classify_parts(
    gradient: torch.Tensor,
    reference: torch.Tensor,
    parts: Layout | None,
    world_size: int,
    micro_batches: int = 1,
) -> dict[str, tuple[str, float, float, float]]:
    """Each part's class against the reference's same part (`classify`), when the gradient has
    more than one part; nothing for one part (the whole is that part)."""
    if parts is None or len(parts) < 2:
        return {}
    mine, theirs = split(gradient, parts), split(reference, parts)
    return {name: classify(mine[name], theirs[name], world_size, micro_batches) for name in parts}


SINGLE_FACTORS = {
    GradientClass.EXACT, GradientClass.ONE_OVER_W, GradientClass.W, GradientClass.NONE, *Factor,
}  # fmt: skip


def single_factors(parts: Mapping[str, tuple[str, float, float, float]]) -> bool:
    """Whether every part's gradient (`classify_parts`) is one named factor of one device's
    (exact, 1/W, W, a `Factor` such as K, or none) and the factors differ: their sum then points
    elsewhere (``biased``), and the parts say why."""
    classes = {numbers[0] for numbers in parts.values()}
    return len(classes) > 1 and classes <= SINGLE_FACTORS
