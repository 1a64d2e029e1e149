"""The check of a training step (docs/checking.md §10): a user's ``LightningModule`` and data set
trained N steps on W ranks of the warm pool and on one device, compared step by step; when a W is
not exact, the same again with each removal that applies made (`gatherlab.runs.removals`) and
with all of them made, and the culprits named: the removals that make it exact. The runs are
trained by the training layer, whichever form they are (`gatherlab.runs.spec.StepForm`:
`runs.fit.Module`, `runs.plainstep.Step`, `runs.update.Update`), as
``ranks_for(W).run(form.train_on_rank, spec)``.

``gatherlab.check.check_training`` is the API and ``python -m gatherlab.check --module`` the
command line; this module trains and names the culprits, `gatherlab.check.judge` judges each run,
and nothing here says anything in words.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from gatherlab.check import experts, measure, where
from gatherlab.check.judge import InPrecision, Recorded, judge, with_precision
from gatherlab.check.reference import Reference, choose, one_device, training_differs
from gatherlab.check.table import (
    ALL_PARTS,
    EXACT,
    PRECISION_COLUMNS,
    TRAINING_COLUMNS,
    TRAINS_LIKE_ONE_DEVICE,
    CheckResult,
    Row,
    failed_row,
    frame,
    reference_notes,
)  # fmt: skip
from gatherlab.components import rowblocks
from gatherlab.components.factory import Recipe
from gatherlab.core import cli, floor, gradients, imports, terms
from gatherlab.core.parts import part_of
from gatherlab.core.runfiles import Trained
from gatherlab.core.terms import Cause, Culprit
from gatherlab.ranks import world
from gatherlab.ranks.external import ranks_for
from gatherlab.ranks.pool import RankError, WorkerPool
from gatherlab.runs import plainstep, removals, stages, tensorparallel
from gatherlab.runs import update as update_form
from gatherlab.runs.precision import FLOOR_ROW_BLOCKS, InFloat64, in_float64, threads_of_a_rank
from gatherlab.runs.spec import RunSpec, StepForm, TracedForm

__all__ = [
    "Setting", "check", "first_reference", "located", "reference",
    "validate",
]  # fmt: skip

T = TypeVar("T")


@dataclass(frozen=True)
class Setting:
    """What is trained (``form``: a LightningModule, a plain step or a whole update, each built
    inside every rank) and how (``spec``: the data, the batch, the steps, the seed, …), with the
    name the table gives it."""

    form: StepForm
    spec: RunSpec
    name: str
    low: str | None = None
    """A low precision its run is measured in, in floors (docs/design.md §2, "Low precision"):
    beside the verdict when ``spec.precision`` is float64, the verdict's own when it is the
    same; None: none."""

    floors_alone: bool = False
    """Judged in floors of ``low`` alone, at size or when asked (`sizing.floors_alone`,
    docs/design.md §2, "Low precision at size"): no float64 verdict, the runs' vectors kept in
    the precision, the one-device reference run once (without a process group, or in a one-rank
    group where it raises without one)."""

    @property
    def in_own_precision(self) -> bool:
        """Whether the verdict rests on a low precision's floors (the code cannot run in
        float64)."""
        return self.low is not None and self.low == self.spec.precision

    @property
    def update(self) -> update_form.Update | None:
        """The whole update, when that is the form (micro-batches are its alone)."""
        return self.form if isinstance(self.form, update_form.Update) else None

    @property
    def built(self) -> Recipe:
        """The factory of what the step trains: the module, or the plain form's model."""
        return self.form.recipe

    @property
    def label(self) -> str:
        """How the command line names what is trained (``--module M``, ``--step S`` or
        ``--update U``)."""
        return f"{self.form.option} {self.name}"

    def run_spec(self, removed: str, **changes: Any) -> RunSpec:
        """The spec of the run that makes the removals ``removed`` names (`removals.Removals
        .named`), with ``changes``."""
        return dataclasses.replace(self.spec, removals=removals.Removals.named(removed), **changes)

    def checked(self, built: Any) -> torch.nn.Module:
        """What the module's or the model's factory built, when it keeps the form's contract (a
        LightningModule with ``training_step`` and ``configure_optimizers``; an ``nn.Module``);
        a ValueError of one line otherwise."""
        return self.form.checked(built, self.label)


def _part_of(module: torch.nn.Module) -> Callable[[str], str]:
    """A parameter's part in a training step's check (`gatherlab.core.parts.part_of`): the
    module's child that holds it (its backbone, projection head, criterion, …), or the parameter
    itself when the module holds it directly; a module of one child is cut into that child's."""
    return part_of([n for n, p in module.named_parameters() if p.requires_grad])


def parts(module: torch.nn.Module) -> measure.Layout:
    """The parts of the first step's gradient (its trainable parameters in order, as
    ``StepLogCallback`` flattens them): each top-level child module, and each direct parameter (the
    children's children of a module of one child, `gatherlab.core.parts`)."""
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    return measure.layout(trainable, _part_of(module))


def validate(
    setting: Setting, micro_batches: Sequence[int] = (1,), world_sizes: Sequence[int] = ()
) -> tuple[tuple[removals.Removal, ...], measure.Layout]:
    """Build the module and the data set here (rank 0 of 1) and check what can be checked before
    any rank starts; a ValueError of one line otherwise. Returns the removals that apply (the
    module's batch norms and dropout layers, the data set's own randomness) and the parts of the
    module's gradient (`parts`). A whole update is also run once on one device with each number
    of micro-batches (`update_form.UpdateBroken` otherwise), and W = 1 is a layout of its own.
    A tensor-parallel model that is plain on a 1 × 1 mesh is built on the ranks of the first of
    ``world_sizes`` above 1, before any trains (`_validate_tensor_parallel`)."""
    spec = setting.spec  # its values checked when its options were made (`TrainingOptions`)
    recipe = setting.built
    label = setting.form.built_label(setting.label)
    try:
        built = recipe()
    except Exception as error:
        raise ValueError(f"{label}: cannot be built: {type(error).__name__}: {error}") from None
    module = setting.checked(built)
    if spec.tensor_parallel > 1:
        _validate_tensor_parallel(setting, module, [w for w in world_sizes if w > 1][:1])
    try:
        data = spec.data()
    except Exception as error:
        raise ValueError(f"--data: cannot be built: {type(error).__name__}: {error}") from None
    size, batch = plainstep.data_size(data, "--data"), spec.global_batch_size
    if batch > size:
        raise ValueError(
            f"--global-batch-size {batch} exceeds the {size} samples of the data set; allowed: at "
            f"most {size}"
        )
    if setting.update is not None:
        _honest_with_every_k(setting, micro_batches)
    return removals.found_in(module, data), parts(module)


def _validate_tensor_parallel(
    setting: Setting, plain: torch.nn.Module, first: Sequence[int] = ()
) -> None:
    """A tensor-parallel layout's model factory run here on a 1 × 1 mesh: a ValueError of one
    line when it raises, when its plan names a module the model does not have (torch only warns
    and skips that entry), or when it makes no parameter a DTensor over ``tp`` (code that does
    not parallelize itself). Where it makes none here, it is built once more on the ranks of the
    ``first`` layout (W of them, `tensorparallel.built_on_ranks`) before any trains: transformers
    applies a model's own plan (``from_pretrained(..., distributed_config=...)``) only where its
    ``tp_size`` is above 1, and builds the plain model on a 1 × 1 mesh. The same refusals apply
    to what the ranks built."""
    label = setting.form.built_label(setting.label)
    try:
        parallel, warned = tensorparallel.built_on_one_rank(setting.built)
    except Exception as error:
        raise ValueError(f"{label} with a mesh: {cli.error_line(error)}") from None
    _refuse_unresolved(label, plain, warned)
    if tensorparallel.parallelizes(setting.checked(parallel)):
        return
    built = []
    for world_size in first:
        try:
            built = ranks_for(world_size).run(
                tensorparallel.built_on_ranks, setting.built, setting.spec.tensor_parallel
            )
        except RankError as error:
            raise ValueError(
                f"{label} with a mesh on {world_size} ranks: {cli.error_line(error)}"
            ) from None
        _refuse_unresolved(label, plain, [text for _, warned in built for text in warned])
    if not built or not all(made for made, _ in built):
        raise ValueError(
            f"{label} was given a mesh and made no parameter a DTensor over mesh['tp']: it does "
            "not parallelize itself; allowed: a factory that calls parallelize_module(model, "
            "mesh['tp'], plan) when given a mesh, or no --tensor-parallel"
        )


def _refuse_unresolved(label: str, plain: torch.nn.Module, warned: Sequence[str]) -> None:
    """A ValueError of one line when the factory's plan named a module the model does not have:
    torch only warns and skips that plan entry."""
    unresolved = [text for text in warned if "plan" in text.lower()]
    if unresolved:
        modules = ", ".join(name for name, _ in plain.named_modules() if name)
        raise ValueError(
            f"{label}: parallelize_module: {unresolved[0].split(' in module')[0]}; allowed: a plan "
            f"whose keys name the model's modules ({modules})"
        )


def _train(
    setting: Setting,
    removed: str,
    world_size: int,
    in_group: bool = False,
    micro_batches: int = 1,
    **changes: Any,
) -> Trained:
    """The run that makes the removals ``removed`` names on one device (in this process; in a
    one-rank process group with ``in_group``) or on W ranks of the pool (rank 0's result,
    `_train_ranks`); a whole update with ``micro_batches`` per rank; ``changes`` to its spec
    (another precision, row blocks, reduced parameters)."""
    return _train_ranks(setting, removed, world_size, in_group, micro_batches, **changes)[0]


def _honest_with_every_k(setting: Setting, micro_batches: Sequence[int]) -> None:
    """A ValueError of one line unless the whole update is honest with each K on one device (one
    step after a backward); its layouts were checked with its options (`TrainingOptions`)."""
    for k in sorted(set(micro_batches)):
        try:
            once = dataclasses.replace(setting.spec, steps=1, micro_batches=k)
            choose(lambda once=once: setting.form.train_on_rank(once))
        except update_form.UpdateBroken as error:
            raise ValueError(f"{setting.label}: {error}") from None
        except Exception as error:  # the update raises with K micro-batches
            raise ValueError(
                f"{setting.label} with micro_batches={k} on one device: {cli.error_line(error)}"
            ) from None


def _culprits(
    verdicts: dict[str, str], applying: Sequence[removals.Removal], step_random: bool
) -> list[str]:
    """The removals that alone make the run exact or change its verdict; when none does but all
    of them together do, all of them; when all of them leave it inexact, ``step_randomness`` if
    the step draws from the global random streams (``step_random``), else ``loss``."""
    kept = verdicts[removals.NONE]
    exact = {EXACT, *floor.WITHIN}  # exact as far as the run's precision tells
    found = [r for r in applying if verdicts[r] in exact or verdicts[r] != kept]
    if len(applying) > 1:
        everything = verdicts[removals.ALL]
    else:
        everything = verdicts[applying[0]] if applying else kept
    if not found and everything in exact:
        found = list(applying)
    if everything not in exact:
        found.append(Culprit.STEP_RANDOMNESS if step_random else Culprit.LOSS)
    return found


def step_draws_randomness(setting: Setting, in_group: bool = False) -> bool:
    """Whether the training step draws from the global random streams (``random``, ``numpy``,
    ``torch``): the first step's loss on one device (as the reference ran: in a one-rank process
    group with ``in_group``), computed twice from the same weights and the same global batch,
    with only the streams' seed changed. Dropout layers are off for it (they are a removal of
    their own); a step that cannot run outside training says no."""
    recipe, spec = setting.built, setting.spec
    data = spec.data()
    collate = setting.form.collate(data)
    batch = plainstep.as_precision(plainstep.first_batch(data, spec, collate), spec.precision)
    values = []
    with one_device(in_group), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log outside a Trainer
        for streams in (1, 2):
            module = setting.checked(recipe())
            removals.Removals.named(removals.Removal.DROPOUT).apply(module)
            module = plainstep.built_in(module, spec.precision)
            plainstep.seed_processes(spec.seed + streams)
            try:
                output = setting.form.one_step(module, batch)
                loss = output.get("loss") if isinstance(output, dict) else output
                values.append(float(loss.detach()))
            except Exception:
                return False
    return values[0] != values[1]


def reference(setting: Setting, removed: str, in_group: bool = False) -> Trained:
    """The 1-device run that makes the removals ``removed`` names, in this process (in a one-rank
    process group with ``in_group``: as `first_reference` chose)."""
    return _train(setting, removed, 1, in_group)


def first_reference(setting: Setting) -> Reference[Trained]:
    """The 1-device run without removals, as the reference of the check (`reference.choose`):
    without a process group, or in a one-rank group when the step raises without one; when both
    run, what differs between them (`reference.training_differs`, to the precision's
    tolerance). Judged in floors alone (`Setting.floors_alone`), the one-rank group runs only
    where the plain run raises: what differs between them is not looked for."""
    tolerance = gradients.tolerance(setting.spec.precision)
    return choose(
        lambda: _train(setting, removals.NONE, 1),
        None if setting.floors_alone
        else lambda grouped, plain: training_differs(grouped, plain, tolerance),
    )  # fmt: skip


def located(setting: Setting, world_size: int, in_group: bool) -> where.Departure | None:
    """Where the first step of the run without removals departs on W ranks from one device (as
    the reference ran, in a one-rank group with ``in_group``): the step's operations recorded on
    both (`gatherlab.runs.trace`) and compared (`gatherlab.check.where`); when no operation
    departs, or the recording fails on a rank, no place and why (the verdict stands); None for a
    whole update (its backwards run inside the user's function: not recorded)."""
    tensor_parallel = setting.spec.tensor_parallel
    if tensor_parallel > 1:
        return _layout_departure(setting, world_size, in_group)
    if not isinstance(setting.form, TracedForm) or setting.spec.expert_parallel > 1:
        # an expert-parallel forward runs other operations on a rank (its dispatch) than one
        # device: no pairing of them
        return None
    try:
        ranks = ranks_for(world_size).run(setting.form.trace_on_rank, setting.spec)
    except RankError as error:
        return where.unlocated(f"no line named: the trace failed on the ranks ({error})")
    with one_device(in_group):
        one = setting.form.trace_on_rank(setting.spec)
    spec = setting.spec
    tolerance = gradients.tolerance(spec.precision)
    return where.departure(one, ranks, world_size, spec.global_batch_size, tolerance)


def _layout_departure(setting: Setting, world_size: int, in_group: bool) -> where.Departure:
    """Where a tensor-parallel model's first forward on W ranks leaves one device's
    (`where.layout_departure`): rank 0's module inputs, output and dropout draws, then every
    rank's operations' results, against one device's."""
    form = setting.form
    try:
        ranks = ranks_for(world_size).run(form.layout_on_rank, setting.spec)
    except RankError as error:
        return where.unlocated(f"no line named: the layouts' record failed on the ranks ({error})")
    with one_device(in_group):
        one, _ = form.layout_on_rank(setting.spec)
    tensor_parallel = setting.spec.tensor_parallel
    return where.layout_departure(
        one, [seen for seen, _ in ranks], world_size // tensor_parallel, tensor_parallel,
        ranks[0][1], gradients.tolerance(setting.spec.precision),
    )  # fmt: skip


def micro_negatives(setting: Setting, world_size: int, k: int, in_group: bool) -> list[float]:
    """What a whole update's first logged loss would be at (W, K) if each micro-batch's loss saw
    only its micro-batch's rows (naive accumulation, docs/checking.md §10): on one device, the
    update with one micro-batch on each group of rows alone, from the initial weights, averaged.
    Two groupings, each a value: the W·K micro-batches one by one (rank r's micro-batch j: its
    rows r·B + j·B/K …, a loss of the rank's own rows), and the K micro-batches of all ranks
    together (micro-batch j of every rank: a loss that gathers each micro-batch over the
    ranks)."""
    spec = setting.spec
    data = spec.data()
    batch = plainstep.first_batch(data, spec, setting.form.collate(data))
    local = spec.global_batch_size // (world_size * k)

    def block(rank: int, j: int) -> torch.Tensor:
        start = (rank * k + j) * local
        return torch.arange(start, start + local)

    groupings = (
        [[block(r, j)] for r in range(world_size) for j in range(k)],
        [[block(r, j) for r in range(world_size)] for j in range(k)],
    )
    values = []
    with one_device(in_group):
        for groups in groupings:
            losses = [
                update_form.first_loss(setting.update, update_form.rows_of(batch, torch.cat(g)),
                                       spec.seed, spec.precision)
                for g in groups
            ]  # fmt: skip
            values.append(math.fsum(losses) / len(losses))
    return values


class _Floors:
    """A check's runs in its low precision (``setting.low``), each trained once: on one device,
    and with its forward in as many row blocks as each W's ranks (`blocks_for`), the floor's
    perturbation (per removal and W), and the W-rank run measured in floors beside a float64
    verdict (docs/design.md §2, "Low precision")."""

    def __init__(self, setting: Setting, in_group: bool) -> None:
        self.setting, self.in_group = setting, in_group
        self._perturbed: dict[tuple[str, int], Trained] = {}
        self._one: Trained | None = None

    def judging(self, removed: str, world_size: int) -> InPrecision:
        """What the judge needs of a step judged in its own precision at ``world_size``: the
        floor's run of W's row blocks (`perturbed`)."""
        return InPrecision(self.setting.low, self.perturbed(removed, world_size),
                           blocks=blocks_for(world_size))  # fmt: skip

    def perturbed(self, removed: str, world_size: int) -> Trained:
        """One device in the low precision with its forward in as many row blocks as
        ``world_size`` (at least `FLOOR_ROW_BLOCKS`: W's floor, held to `floor.FLOOR_THRESHOLD`
        floors), the removals ``removed`` names made."""
        blocks = blocks_for(world_size)
        if (removed, blocks) not in self._perturbed:
            self._perturbed[removed, blocks] = _train(
                self.setting, removed, 1, self.in_group, precision=self.setting.low,
                row_blocks=blocks,
            )  # fmt: skip
        return self._perturbed[removed, blocks]

    def beside(self, world_size: int, k: int) -> floor.Floored:
        """The run without removals on (W, K) in the low precision, against one device in it,
        in floors."""
        low = self.setting.low
        if self._one is None:
            self._one = _train(self.setting, removals.NONE, 1, self.in_group, precision=low)
        run = _train(self.setting, removals.NONE, world_size, self.in_group, k, precision=low)
        return floor.classify_floored(
            run.first_gradient, self._one.first_gradient,
            self.perturbed(removals.NONE, world_size).first_gradient, low, world_size, k,
            threshold=floor.threshold(blocks_for(world_size), world_size),
        )  # fmt: skip


def blocks_for(world_size: int) -> int:
    """The row blocks of the floor W ranks are judged in: as many as its ranks, at least
    `FLOOR_ROW_BLOCKS` (docs/design.md §2)."""
    return max(FLOOR_ROW_BLOCKS, world_size)


def float64_watch(setting: Setting, in_group: bool = False) -> tuple[InFloat64, bool]:
    """Whether the step runs in float64 (`runs.precision.in_float64`): its first step on one
    device (in a one-rank group with ``in_group``), the module and the batch in float64, under a
    watch of its operations; the autocast its own code enables, if any; and whether the module's
    forward returned a scalar (its loss: `rowblocks.holds_scalar`), which no floor can cut."""
    spec = setting.spec
    data = spec.data()
    collate = setting.form.collate(data)
    batch = plainstep.as_precision(
        plainstep.first_batch(data, spec, collate), terms.Precision.FLOAT64
    )
    module = setting.checked(setting.built()).double()
    plainstep.seed_processes(spec.seed)

    def once() -> None:
        output = setting.form.one_step(module, batch)
        loss = output.get("loss") if isinstance(output, dict) else output
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.backward()

    scalars: list[bool] = []
    hook = module.register_forward_hook(
        lambda _, args, output: scalars.append(rowblocks.holds_scalar(output)))  # fmt: skip
    with one_device(in_group), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log outside a Trainer
        try:
            return in_float64(once), any(scalars)
        finally:
            hook.remove()


def layouts(world_sizes: Sequence[int], micro_batches: Sequence[int]) -> list[tuple[int, int]]:
    """The (W, K) layouts of a check, W major: every world size with every number of micro-batches,
    but (1, 1), the reference itself."""
    return [(w, k) for w in world_sizes for k in micro_batches if (w, k) != (1, 1)]


def check(
    setting: Setting,
    world_sizes: Sequence[int],
    applying: Sequence[removals.Removal],
    first: Reference[Trained] | None = None,
    layout: measure.Layout | None = None,
    micro_batches: Sequence[int] = (1,),
) -> CheckResult:
    """The check's result, its table (`TRAINING_COLUMNS`): for every layout (W, K) (`layouts`; K,
    the micro-batches of a whole update, is 1 for the other forms) the rows of its run without
    removals (`judge.judge`: the whole, then its parts of ``layout`` when the gradient has several)
    and, when that run is not exact, a row per run with removals (each that applies, then all);
    ``culprits`` on every row of a layout; a layout whose ranks raised has one ``failed`` row.
    ``first`` is the 1-device run without removals as `first_reference` chose it (made here when
    None); the runs with removals on one device run as it ran. The result (`CheckResult`) holds
    the reference's notes and, per layout whose ranks' gradients of some part differ, what was
    found (`Unreduced`; the cause ``unreduced`` and the culprit are named only where
    all-reducing those parts makes the run exact: reproduced)."""
    first = first_reference(setting) if first is None else first
    judging, rows = _Judging(setting, first, layout or {}), []
    with_removals = [*applying, removals.ALL] if len(applying) > 1 else list(applying)
    step_random = functools.cache(lambda: step_draws_randomness(setting, first.in_group))  # once
    for world_size, k in layouts(world_sizes, micro_batches):
        try:
            kept = judging.rows(removals.NONE, world_size, k)
            measured = [kept[0]]
            if kept[0].verdict not in TRAINS_LIKE_ONE_DEVICE:
                measured += [judging.rows(removed, world_size, k)[0] for removed in with_removals]
        except RankError as error:
            rows.append(failed_row(judging.key(removals.NONE, world_size, k), error))
            continue
        rows += _with_culprits(kept, measured[1:], applying, step_random,
                               judging.unreduced.get((world_size, k)))  # fmt: skip
    return CheckResult(
        frame(rows, TRAINING_COLUMNS + (PRECISION_COLUMNS if setting.low else ())),
        reference_notes=reference_notes({setting.name: (first.why, first.group_differs)}),
        unreduced={layout: found for layout, found in judging.unreduced.items() if found.parts},
    )


class _Judging:
    """What `check`'s runs share while it judges each layout: the setting and its one-device
    reference (``first``), the references with removals made as they are needed, the runs in the
    low precision (`_Floors`), and per layout whose ranks' gradients of some part differ, what was
    found (`Unreduced`)."""

    def __init__(self, setting: Setting, first: Reference[Trained], layout: measure.Layout):
        self.setting, self.first, self.layout = setting, first, layout
        self.tolerance = gradients.tolerance(setting.spec.precision)
        self.references = {removals.NONE: first.value}
        self.floors, self.own = _Floors(setting, first.in_group), setting.in_own_precision
        self.unreduced: dict[tuple[int, int], Unreduced] = {}

    def rows(self, removed: str, world_size: int, k: int, **changes: Any) -> list[Row]:
        """The rows of the run at (W, K) with the removals ``removed`` names (``changes`` to its
        spec: a run that reproduces a finding, judged by its verdict alone)."""
        setting, first, floors, own = self.setting, self.first, self.floors, self.own
        if removed not in self.references:
            self.references[removed] = reference(setting, removed, first.in_group)
        kept = removed == removals.NONE and not changes  # only this run is explained further
        # the floor's row blocks, judged in the precision, on this process while the ranks train
        floor_here = functools.partial(floors.judging, removed, world_size) if own else _nothing
        ranks, floor_run = _train_ranks_beside(setting, removed, world_size, first.in_group, k,
                                               floor_here, **changes)  # fmt: skip
        if kept and world_size > 1:  # each rank's gradient of each part against rank 0's
            self.unreduced[world_size, k] = _unreduced(
                setting, ranks, self.layout,
                lambda **changes: self.rows(removed, world_size, k, **changes)[0].verdict,
            )  # fmt: skip
        # naive accumulation's first losses; of an expert-parallel update at K = 1, the loss of
        # each rank's rows alone: its routing's statistics over the rank's tokens
        expert = setting.spec.expert_parallel > 1 and world_size > 1
        accumulated = kept and setting.update is not None and (k > 1 or expert)
        found = self.unreduced.get((world_size, k)) if kept else None
        reproduced = _reproduced(found)  # then no operation departs: each rank's forward is right
        located_here = kept and world_size > 1 and not own and not reproduced  # float64's bounds
        departed: list[where.Departure | None] = []  # what ``where`` found, its kind a cause
        pipelines = world_size // setting.spec.pipeline_parallel  # a pipeline's ranks: one row
        rows = judge(
            ranks[0], self.references[removed], self.key(removed, pipelines, k),
            tolerance=self.tolerance, layout=self.layout,
            accumulated=functools.partial(micro_negatives, setting, pipelines, k, first.in_group)
            if accumulated else None,
            where=_keeping(functools.partial(located, setting, world_size, first.in_group),
                           departed) if located_here else None,
            recorded=_recorded(found if reproduced else None, floor_run),
        )  # fmt: skip
        rows = _stepped_where(rows, found) if reproduced else rows
        rows = _shard_caused(rows, departed)
        if expert:
            rows = _experts_caused(setting, rows, ranks[0], self.references[removed], k)
        rows = _pipeline_rows(rows, world_size, ranks[0], setting.spec.pipeline_parallel)
        if kept and setting.low is not None and not own:  # its low-precision run beside it
            rows = with_precision(rows, floors.beside(world_size, k), setting.spec.precision)
        return rows

    def key(self, removed: str, world_size: int, k: int) -> Row:
        return Row(self.setting.name, "native", world_size, str(self.first.mode),
                   micro_batches=k, removed=removed)  # fmt: skip


def _with_culprits(
    kept: list[Row], removed: list[Row], applying: Sequence[removals.Removal],
    step_random: Callable[[], bool], found: Unreduced | None,
) -> list[Row]:  # fmt: skip
    """A layout's rows (``kept``: its run without removals, whole and parts; ``removed``: one
    row per run with removals) with the culprits their verdicts name (none where the run
    without removals is exact), what was measured on the ranks in place of ``loss``."""
    verdicts = {r.removed: r.verdict for r in [kept[0], *removed]}
    exact = verdicts[removals.NONE] in TRAINS_LIKE_ONE_DEVICE
    culprits = [] if exact else _measured(
        _culprits(verdicts, applying, step_random()), kept[0].cause, found)  # fmt: skip
    return [dataclasses.replace(r, culprits=";".join(culprits)) for r in [*kept, *removed]]


def _recorded(reproduced: Unreduced | None, floor_run: InPrecision | None) -> Recorded:
    """What the judge takes besides the run's numbers: the parts reducing reproduces one device
    with (``unreduced``, over a mesh dimension for ``partial``), and the floor's run."""
    if reproduced is None:
        return Recorded(in_precision=floor_run)
    return Recorded(unreduced=reproduced.parts, in_precision=floor_run,
                    unreduced_over=reproduced.over)  # fmt: skip


def _experts_caused(
    setting: Setting, rows: list[Row], run: Trained, reference: Trained, k: int
) -> list[Row]:
    """An expert-parallel run's rows with the cause read from its ranks' pieces
    (`experts.departure`: ``experts_mixed``, ``experts_scaled``, with their words in
    ``departs``; else ``copies_apart`` where copies of a parameter got different first
    gradients on their holders and reducing did not reproduce one device, the copies named), or
    ``local_tokens`` where the loss of each rank's rows alone on one device reproduced its first
    loss at K = 1 (the judge's ``micro_negatives``)."""
    if rows[0].verdict in TRAINS_LIKE_ONE_DEVICE:
        return rows
    if rows[0].cause == Cause.MICRO_NEGATIVES and k == 1:
        return [dataclasses.replace(r, cause=str(Cause.LOCAL_TOKENS)) for r in rows]
    if rows[0].cause not in ("", Cause.PARTS):
        return rows
    found = experts.departure(run, reference, setting.checked(setting.built()),
                              setting.spec.expert_parallel)  # fmt: skip
    apart, _ = experts.unreduced(run)
    if found is None and apart and not rows[0].cause:  # not reproduced: named from the copies
        words = "at the first update: " + "; ".join(a.words() for a in apart[:3])
        found = experts.Departure(Cause.COPIES_APART, words)
    if found is None:
        return rows
    head = dataclasses.replace(rows[0], cause=str(found.cause), departs=found.words)
    return [head, *(dataclasses.replace(r, cause=str(found.cause)) for r in rows[1:])]


def _measured(culprits: list[str], cause: str, found: Unreduced | None) -> list[str]:
    """The culprits the removals name, with what was measured on the ranks in place of ``loss``:
    ``layout`` where a tensor's shape departs (no removal takes it out), and first ``unreduced``
    (or ``partial``, a tensor-parallel model's) where reducing reproduces one device; and
    ``shard_as_whole`` where an operation's result is neither one device's nor its shard."""
    if cause in (Cause.LAYOUT, Cause.SHARD_AS_WHOLE, *_EXPERT_CAUSES, Cause.COPIES_APART):
        measured = Culprit(cause)
        culprits = [measured if c == Culprit.LOSS else c for c in culprits]
    if _reproduced(found):
        named = Culprit.PARTIAL if found.over else Culprit.UNREDUCED
        culprits = [named, *(c for c in culprits if c != Culprit.LOSS)]
    return culprits


_EXPERT_CAUSES = (Cause.LOCAL_TOKENS, Cause.EXPERTS_MIXED, Cause.EXPERTS_SCALED)


def _keeping(
    find: Callable[[], where.Departure | None], kept: list[where.Departure | None]
) -> Callable[[], where.Departure | None]:
    """``find``, with what it found appended to ``kept``."""

    def found() -> where.Departure | None:
        kept.append(find())
        return kept[-1]

    return found


def _shard_caused(rows: list[Row], departed: Sequence[where.Departure | None]) -> list[Row]:
    """The rows with the cause ``shard_as_whole`` where the run departs at a tensor-parallel
    model's operation whose result is neither one device's nor its shard (`where.shard_departure`:
    measured, as a ``layout`` is, which the judge names from its kind)."""
    if not any(d is not None and d.kind == terms.DepartureKind.SHARD for d in departed):
        return rows
    return [dataclasses.replace(r, cause=str(Cause.SHARD_AS_WHOLE)) for r in rows]


def _pipeline_rows(
    rows: list[Row], world_size: int, rank0: Trained, pipeline_parallel: int
) -> list[Row]:
    """A pipeline's rows, judged as its W / P data-parallel pipelines (a factor W names the
    replicas, docs/design.md §1), with their world size W; where copies of a parameter ended apart
    (`Trained.copies_apart`, from the copies alone), the cause ``copies_apart`` and the copies in
    ``departs``; where the micro-batches' losses reproduce the first loss (the judge's
    ``micro_negatives``), the cause ``micro_mean``: a mean over each micro-batch's own rows or
    tokens; where every part's gradient is K or 1/K times one device's, ``micro_scale``
    (docs/checking.md §10, "Pipeline parallelism")."""
    if pipeline_parallel == 1:
        return rows
    rows = [dataclasses.replace(r, world_size=world_size) for r in rows]
    if rows and rows[0].cause == Cause.MICRO_NEGATIVES:
        rows = [dataclasses.replace(r, cause=str(Cause.MICRO_MEAN)) for r in rows]
    scaled = (terms.Factor.K, terms.Factor.ONE_OVER_K)
    if rows and rows[0].verdict in scaled and all(r.gradient == rows[0].verdict for r in rows):
        rows = [dataclasses.replace(r, cause=str(Cause.MICRO_SCALE)) for r in rows]
    if not rows or not rank0.copies_apart or rows[0].verdict in TRAINS_LIKE_ONE_DEVICE:
        return rows
    words = _copies_words(rank0.copies_apart)
    if rows[0].cause == Cause.UNREDUCED:  # reducing the replicas reproduced one device: said so
        return [dataclasses.replace(r, departs=words) for r in rows]
    return [dataclasses.replace(r, cause=str(Cause.COPIES_APART), departs=words) for r in rows]


def _copies_words(apart: Sequence[Any]) -> str:
    """The copies that ended apart (`core.held.Apart`) in a few words: each tied parameter's
    copies, then the replicas, the first of them in full and how many more."""
    tied = [a.words() for a in apart if a.tied]
    replicas = [a for a in apart if not a.tied]
    if replicas:
        more = f" (and {len(replicas) - 1} more parameters' replicas)" if len(replicas) > 1 else ""
        tied.append(f"{replicas[0].words()}{more}")
    return "; ".join(tied)


def validate_pipeline(
    setting: Setting, micro_batches: Sequence[int], world_sizes: Sequence[int]
) -> None:
    """A pipeline's split and schedule checked on the ranks of the smallest W before any rank
    trains (`update_form.Update.held_on_rank`; the launcher's ranks under ``--launcher
    external``): a ValueError of one line when the factory given
    the mesh raises, keeps no parameter on a rank (an empty stage), keeps a parameter under a
    name or shape one device's model does not have, or leaves one of its parameters on no rank
    (`stages.splits`), and when the update raises at a layout (W/P pipelines, K micro-batches:
    a pipeline's rows of the first batch there), the schedule that raised named: a schedule that
    does not take those micro-batches."""
    label, degree = setting.form.built_label(setting.label), setting.spec.pipeline_parallel
    one = stages.OneDevice.of(setting.checked(setting.built()))
    pairs = tuple(sorted({(w // degree, k) for w in world_sizes for k in micro_batches}))
    first = min(world_sizes)
    try:
        kept = ranks_for(first).run(setting.form.held_on_rank, setting.spec, pairs)
    except RankError as error:
        raise ValueError(
            f"{label} with a ('dp', 'pp') mesh on {first} ranks: rank {error.rank}: {error.line}"
        ) from None
    wrong = stages.splits([found.names for found in kept], one)
    if wrong:
        raise ValueError(f"--pipeline-parallel {degree}: {label}: {wrong}")
    refused = next((found.refused for found in kept if found.refused is not None), None)
    if refused is not None:
        pipelines, k, line, schedule = refused
        rows = setting.spec.global_batch_size // (pipelines * k)
        raise ValueError(
            f"--pipeline-parallel {degree} --micro-batches {k} at W = {pipelines * degree}: "
            f"{schedule or 'the update'} refuses {label}'s stages: {line}; allowed: a schedule "
            f"and micro-batches it takes (each micro-batch there: {rows} rows)"
        )


def _stepped_where(rows: list[Row], found: Unreduced) -> list[Row]:
    """A reproduced ``partial`` run's rows with ``where`` the user's optimizer step that takes
    each rank's local gradient (`Unreduced.stepped_by`), when there is one."""
    if not found.stepped_by:
        return rows
    departs = f"its step takes each rank's local gradient: a partial sum over {found.over}"
    return [dataclasses.replace(r, where=found.stepped_by, departs=departs) for r in rows]


@dataclass
class Unreduced:
    """The parts of a run whose gradient differs between its ranks (``parts``; none: every rank
    holds the same gradient), and the verdict of the run with those parts' gradients all-reduced
    (``reduced``: the mean over ranks after each backward, `RunSpec.reduced`; None: not run).
    Where that is not the fix and the check's DDP holds parameters its forward does not use
    (``stalled``, `runs.sharded.OutsideForward`: its reducer waited for them, so it averaged
    nothing), the verdict of the run with DDP told to find unused parameters and their gradients
    all-reduced (``unstalled``, `RunSpec.find_unused`)."""

    parts: tuple[str, ...]
    reduced: str | None = None
    stalled: tuple[str, ...] = ()
    unstalled: str | None = None
    over: str = ""
    """A tensor-parallel model's: the mesh dimension over which the parameters ``partial`` names
    have partial-sum gradients and replicas that ended apart (docs/checking.md §10, "Tensor and
    sequence parallelism"); ``reduced`` is then the run with those sums made whole before each
    step. Empty otherwise."""
    partial: tuple[str, ...] = ()
    stepped_by: str = ""
    """Where the optimizer's step is defined, when it is the user's code (``file:line
    Class.step``, the ``where`` column): what steps each rank with its local gradient."""


def _unreduced(
    setting: Setting,
    ranks: Sequence[Trained],
    layout: measure.Layout,
    verdict_with: Callable[..., str],
) -> Unreduced:
    """The parts whose ranks' gradients differ (`unreduced_parts`) and, when there are some, the
    verdict of the run with their parameters' gradients all-reduced (``verdict_with(reduced=
    names)``): the reproduction; failing that, with a stalled DDP reducer unstalled
    (``verdict_with(reduced=…, find_unused=True)``)."""
    if ranks[0].rank_gradients:  # an expert-parallel run, made one device's from its pieces
        return _experts_unreduced(setting, ranks[0], verdict_with)
    found = Unreduced(unreduced_parts(ranks, layout))
    if not found.parts and ranks[0].replicas_apart:
        return _partial(setting, ranks[0], verdict_with)
    if not found.parts:
        return found
    found.reduced = verdict_with(reduced=_parameters_of(setting, found.parts))
    if found.reduced not in TRAINS_LIKE_ONE_DEVICE and ranks[0].outside_forward:
        found.stalled = ranks[0].outside_forward
        found.unstalled = verdict_with(reduced=found.stalled, find_unused=True)
    return found


def _experts_unreduced(
    setting: Setting, run: Trained, verdict_with: Callable[..., str]
) -> Unreduced:
    """An expert-parallel run's parts whose parameters' copies got different first gradients on
    their holders (`experts.unreduced`), and, where those parameters are held by every rank (the
    replicated ones), the verdict of the run with their gradients all-reduced (the mean over all
    ranks, `RunSpec.reduced`): the reproduction. An expert's replicas that differ are named and
    not reproduced (their reduction is over their own group)."""
    apart, everywhere = experts.unreduced(run)
    if not apart:
        return Unreduced(())
    part = _part_of(setting.checked(setting.built()))
    found = Unreduced(tuple(dict.fromkeys(part(a.name) for a in apart)))
    if everywhere and len(everywhere) == len(apart):
        found.reduced = verdict_with(reduced=everywhere)
    return found


def _partial(setting: Setting, rank0: Trained, verdict_with: Callable[..., str]) -> Unreduced:
    """A tensor-parallel run whose replicated parameters ended apart on the ranks: the parameters
    whose first gradient was a partial sum (``Partial(sum)`` over a mesh dimension; those whose
    ranks' partial sums are equal stay together but step with a part of the sum), and the
    verdict of the run with their gradients made whole before each step (`RunSpec.reduced`,
    `runs.tensorparallel.reduced_partial`): the reproduction."""
    partial = dict(rank0.partial)
    if not partial:
        return Unreduced(())
    built = setting.checked(setting.built())
    part = _part_of(built)
    parts = tuple(dict.fromkeys(part(name) for name in partial))
    found = Unreduced(parts, over=next(iter(partial.values())), partial=tuple(partial))
    found.reduced = verdict_with(reduced=found.partial)
    found.stepped_by = _stepped_by(setting, built)
    return found


def _stepped_by(setting: Setting, built: torch.nn.Module) -> str:
    """``file:line  Class.step`` of the optimizer the form builds, when its step is the user's
    code (not torch's); empty otherwise."""
    factory = getattr(setting.form, "optimizer", None)
    if factory is None:
        return ""
    try:
        step = type(factory(built.parameters(), **setting.form.optimizer_kwargs)).step
        code = inspect.unwrap(step)  # under torch.no_grad's decorator
        filename, (lines, line) = inspect.getsourcefile(code), inspect.getsourcelines(code)
        line += next(i for i, text in enumerate(lines) if text.lstrip().startswith("def "))
    except Exception:  # a builtin, or source that cannot be read: no line to name
        return ""
    if filename is None or not cli.is_users(filename):
        return ""
    return f"{imports.place(filename, line)}  {step.__qualname__}"


def _reproduced(found: Unreduced | None) -> bool:
    """Whether all-reducing the parts found unreduced (or unstalling DDP's reducer) makes the run
    train like one device."""
    if found is None:
        return False
    return TRAINS_LIKE_ONE_DEVICE.intersection({found.reduced, found.unstalled}) != set()


def unreduced_parts(ranks: Sequence[Trained], layout: measure.Layout) -> tuple[str, ...]:
    """The parts (of ``layout``; the whole, ``all``, without one) whose first gradient differs
    between the ranks beyond float64's 1e-10 of rank 0's largest: a gradient nobody reduced."""
    first = ranks[0].first_gradient
    if first is None or len(ranks) < 2:
        return ()
    if all(torch.equal(first, other.first_gradient) for other in ranks[1:]):
        return ()  # every rank holds rank 0's gradient bit for bit (DDP's average): one pass
    parts = layout if layout else {ALL_PARTS: [(0, len(first))]}
    mine = {name: gradients.split(first, {name: ranges})[name] for name, ranges in parts.items()}
    found = []
    for name, ranges in parts.items():
        scale = gradients.largest_difference(mine[name]) or 1.0
        for other in ranks[1:]:
            theirs = gradients.split(other.first_gradient, {name: ranges})[name]
            if (
                gradients.largest_difference(theirs, mine[name])
                > gradients.FLOAT64_TOLERANCE * scale
            ):
                found.append(name)
                break
    return tuple(found)


def _parameters_of(setting: Setting, parts: Sequence[str]) -> tuple[str, ...]:
    """The names of the trainable parameters of ``parts`` (each a top-level child or a direct
    parameter of what the form builds, `parts`), as the form's ``named_parameters`` gives them."""
    built = setting.checked(setting.built())
    part = _part_of(built)
    return tuple(name for name, parameter in built.named_parameters()
                 if parameter.requires_grad and part(name) in parts)  # fmt: skip


def _train_ranks(
    setting: Setting,
    removed: str,
    world_size: int,
    in_group: bool = False,
    micro_batches: int = 1,
    **changes: Any,
) -> list[Trained]:
    """`_train`'s run, every rank's result in rank order (one device: one); the ranks after rank
    0 send no final parameters (`_trained_on_rank`)."""
    spec = setting.run_spec(removed, micro_batches=micro_batches, **changes)
    if world_size == 1:  # as the reference ran (`first_reference`); a low precision's threads
        with one_device(in_group), threads_of_a_rank(spec.precision):  # as a rank's
            return [setting.form.train_on_rank(spec)]
    ranks = ranks_for(world_size).run(_trained_on_rank, setting.form, spec)
    if spec.expert_parallel > 1:  # each rank holds some of one device's parameters
        return [experts.assembled(ranks, setting.checked(setting.built()))]
    return ranks


def _nothing() -> None:
    """What is computed beside the ranks where nothing is (`_train_ranks_beside`)."""


def _train_ranks_beside(
    setting: Setting, removed: str, world_size: int, in_group: bool, micro_batches: int,
    beside: Callable[[], T], **changes: Any,
) -> tuple[list[Trained], T]:  # fmt: skip
    """`_train_ranks`' run (``changes`` to its spec, as it takes them) and ``beside()``, computed
    in this process while the pool's ranks train: a one-device run of the check on the cores the
    ranks leave (the floor's row blocks, on one thread: docs/design.md §2). One device, experts
    to assemble from the ranks, or a launcher's ranks (this process is rank 0): one after the
    other. Each is a run of its own,
    seeded, so the order changes no number."""
    spec = setting.run_spec(removed, micro_batches=micro_batches, **changes)
    ranks = ranks_for(world_size) if world_size > 1 else None
    if not isinstance(ranks, WorkerPool) or spec.expert_parallel > 1:
        trained = _train_ranks(setting, removed, world_size, in_group, micro_batches, **changes)
        return trained, beside()
    return ranks.run_beside(beside, _trained_on_rank, setting.form, spec)


def _trained_on_rank(form: StepForm, spec: RunSpec) -> Trained:
    """On each rank: ``form.train_on_rank(spec)``; a rank after rank 0 keeps its final parameters
    to itself (an empty tensor instead). The check reads rank 0's run whole and of the others
    only their first gradient (`unreduced_parts`), so a model of 86M float64 parameters sends
    690 MB less per rank to the command, which holds them all at once."""
    trained = form.train_on_rank(spec)
    if world.rank() == 0 or spec.expert_parallel > 1:  # each rank its part of one device's
        return trained
    return dataclasses.replace(trained, parameters=torch.empty(0, dtype=torch.float64))
