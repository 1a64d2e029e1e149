"""A user's whole optimizer update (no Lightning), trained the way gatherlab trains a plain step
(docs/checking.md §10, "The whole update"): ``update(model, optimizer, batch, micro_batches)``
performs one complete update on the rows this rank holds of one global batch — its forwards and
backwards over ``micro_batches`` micro-batches, any clipping or gradient scaler, and
``optimizer.step()`` — and returns the loss it logs. The model is built as for a plain step (the
same seed everywhere, ``DistributedDataParallel`` on W ranks, the bare module on one device); the
optimizer is built here and handed to the update.

What the optimizer sees is measured at ``optimizer.step()`` by torch's public step hook
(``Optimizer.register_step_pre_hook``): the first update's gradient as the step takes it, after the
user's clipping, unscaling and divisions. The update must be honest: exactly one optimizer step
per call, after at least one backward (`UpdateBroken` otherwise, found on one device before any
rank starts).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from gatherlab.components.factory import Recipe
from gatherlab.core import runfiles
from gatherlab.ranks import world
from gatherlab.runs import precision as runs_precision
from gatherlab.runs import removals, stages, tensorparallel
from gatherlab.runs.plainstep import (
    PlainModel,
    as_precision,
    build,
    first_on_rank,
    held_names,
    outside_forward,
    rank_batches,
    seed_processes,
    step_loss,
    trained_with,
    wrapped_for_rank,
)  # fmt: skip
from gatherlab.runs.sharded import naming_dtensors
from gatherlab.runs.spec import RunSpec
from gatherlab.runs.steplog import StepLog, reduce_gradients

__all__ = ["Update", "UpdateBroken", "first_loss", "rows_of"]

UpdateFunction = Callable[[nn.Module, torch.optim.Optimizer, Any, int], Any]


@dataclass(frozen=True)
class Update(PlainModel):
    """A whole optimizer update: ``update(model, optimizer, batch, micro_batches)`` returns the
    loss it logs; the model is built by ``model`` (a `Recipe` of the user's factory) and optimised
    by ``optimizer(params, **optimizer_kwargs)``."""

    update: UpdateFunction
    model: Recipe
    optimizer: Callable[..., torch.optim.Optimizer]
    optimizer_kwargs: dict[str, Any]
    option: ClassVar[str] = "--update"

    def one_step(self, built: nn.Module, batch: Any) -> torch.Tensor:
        """The loss one update with one micro-batch logs on ``batch`` (it steps ``built``'s own
        optimizer, built here), as a float64 tensor."""
        optimizer = self.optimizer(built.parameters(), **self.optimizer_kwargs)
        return torch.tensor(float(self.update(built, optimizer, batch, 1)), dtype=torch.float64)

    def train_on_rank(self, spec: RunSpec) -> runfiles.Trained:
        """Build the model, its optimizer and the data set here, make the removals, seed the
        global random streams from the seed, and run ``spec.steps`` updates, each on this rank's
        rows of one global batch (the whole batch on one device) with ``spec.micro_batches``.
        Returns each update's global loss, the first update's gradient as its optimizer step took
        it, and the final parameters; `UpdateBroken` for an update that does not step exactly
        once after a backward. Not traced: its backwards run inside the user's function. A
        pipeline's ranks (``spec.pipeline_parallel``) train as `train_pipeline_on_rank` does;
        one device trains the whole model."""
        if spec.pipeline_parallel > 1 and world.size() > 1:
            return self.train_pipeline_on_rank(spec)
        device = world.device()
        model = build(
            self, spec.removals, spec.precision, spec.tensor_parallel, spec.expert_parallel
        ).to(device)
        data = spec.data()
        wrapped = wrapped_for_rank(
            model, device, spec.row_blocks, spec.find_unused, spec.expert_parallel
        )
        watch = outside_forward(model, wrapped)
        optimizer = self.optimizer(model.parameters(), **self.optimizer_kwargs)
        recorder = StepLog(True, spec.step_budget_s, spec.steps, spec.keep_precision)
        seen = _Steps(model, recorder, spec.reduced)
        hook = optimizer.register_step_pre_hook(seen)
        seed_processes(spec.seed)
        try:
            for index, batch in enumerate(rank_batches(data, spec)):
                optimizer.zero_grad(set_to_none=True)
                seen.count, seen.without_gradient, seen.update = 0, False, index
                batch = as_precision(batch, spec.precision, device)
                with runs_precision.autocast(spec.precision, device):
                    loss = naming_dtensors(model, functools.partial(
                        self.update, wrapped, optimizer, batch, spec.micro_batches))  # fmt: skip
                _honest(seen, spec.micro_batches)
                value = (
                    loss
                    if isinstance(loss, torch.Tensor)
                    else torch.tensor(float(loss), dtype=torch.float64)
                )
                recorder.loss(step_loss(value.detach()), index, world.rank())
        finally:
            hook.remove()
        recorder.finish(model.parameters())
        parallel = model if spec.tensor_parallel > 1 else None
        return trained_with(recorder, watch, parallel, seen.partial, held_names(model))

    def train_pipeline_on_rank(self, spec: RunSpec) -> runfiles.Trained:
        """`train_on_rank` on a rank of a pipeline (docs/checking.md §10, "Pipeline
        parallelism"): the factory given the ranks' ``("dp", "pp")`` mesh keeps this rank's
        stages, under one device's names; no DDP around them (the update reduces over ``dp``);
        the update returns its loss on the rank of the last stage and None on the others. The
        first gradient is this rank's pipeline's and the final parameters rank 0's pipeline's,
        both assembled in one device's order from every rank's pieces, with the copies that
        ended apart (`stages.trained`)."""
        device = world.device()
        mesh = world.mesh(spec.pipeline_parallel, world.PIPELINE_MESH_DIMS)
        one_device = stages.OneDevice.of(self.model())  # the whole model, as one device builds it
        model = build(self, spec.removals, spec.precision, mesh=mesh).to(device)
        data = spec.data()
        optimizer = self.optimizer(model.parameters(), **self.optimizer_kwargs)
        recorder = StepLog(False, spec.step_budget_s, spec.steps)
        seen = _PipelineSteps(model, recorder, spec.reduced, mesh, one_device.names)
        hook = optimizer.register_step_pre_hook(seen)
        seed_processes(spec.seed)
        local: list[float | None] = []
        try:
            for index, batch in enumerate(rank_batches(data, spec)):
                optimizer.zero_grad(set_to_none=True)
                seen.count, seen.without_gradient, seen.update = 0, False, index
                batch = as_precision(batch, spec.precision, device)
                with runs_precision.autocast(spec.precision, device):
                    loss = self.update(model, optimizer, batch, spec.micro_batches)
                _honest(seen, spec.micro_batches)
                if loss is None:
                    local.append(None)
                    continue
                value = loss if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
                recorder.loss(step_loss(value.detach()), index, world.rank())
                local.append(recorder.local_losses[-1])
        finally:
            hook.remove()
        return stages.trained(model, mesh, one_device, seen.first, local, seen.unused)

    def held_on_rank(self, spec: RunSpec, layouts: tuple[tuple[int, int], ...]) -> stages.Held:
        """On the ranks of a layout, before any rank trains: what the factory kept on each
        (`stages.held_on_rank`), and its update run once at each layout (W/P pipelines, K
        micro-batches) on a pipeline's rows of the first batch there (the first of the rank's
        rows here: a layout of at least as many pipelines), from the initial weights."""
        mesh = world.mesh(spec.pipeline_parallel, world.PIPELINE_MESH_DIMS)
        data = spec.data()
        seed_processes(spec.seed)
        batch = as_precision(next(rank_batches(data, spec)), spec.precision, world.device())

        def built() -> nn.Module:
            return build(self, spec.removals, spec.precision, mesh=mesh).to(world.device())

        def run(model: nn.Module, pipelines: int, k: int) -> None:
            optimizer = self.optimizer(model.parameters(), **self.optimizer_kwargs)
            rows = rows_of(batch, torch.arange(spec.global_batch_size // pipelines))
            with runs_precision.autocast(spec.precision, world.device()):
                self.update(model, optimizer, rows, k)

        return stages.held_on_rank(built, run, layouts, stages.OneDevice.of(self.model()))

    def layout_on_rank(
        self, spec: RunSpec
    ) -> tuple[list[tensorparallel.Seen], list[tensorparallel.Drawn]]:
        """The layouts of the first update's first forward of a tensor-parallel model
        (`tensorparallel.LayoutWatch`), as `plainstep.Step.layout_on_rank` records a step's."""
        model, batch = first_on_rank(self, spec)
        optimizer = self.optimizer(model.parameters(), **self.optimizer_kwargs)
        watch = tensorparallel.LayoutWatch(model)
        try:
            with watch:
                self.update(wrapped_for_rank(model, world.device()), optimizer, batch,
                            spec.micro_batches)  # fmt: skip
        finally:
            seen = watch.close()
        return seen


class UpdateBroken(ValueError):
    """The update broke its contract: one optimizer step per call, after a backward."""


class _Steps:
    """The optimizer's steps during one update, seen by its step pre-hook: how many, and whether a
    gradient had reached the parameters; the first update's gradient goes to the recorder."""

    def __init__(self, model: nn.Module, recorder: StepLog, reduced: tuple[str, ...] = ()) -> None:
        self.model, self.recorder, self.reduced = model, recorder, reduced
        self.count, self.without_gradient, self.update = 0, False, 0
        self.partial: dict[str, str] = {}

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.count += 1
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        if all(p.grad is None for p in trainable):
            self.without_gradient = True
            return
        if self.count == 1 and self.update == 0:
            self.partial = tensorparallel.partial_gradients(self.model.named_parameters())
        reduce_gradients(self.model, self.reduced)  # the reproduction of an unreduced part
        if self.count == 1:  # what the step applies: clipped, unscaled, divided as the user does
            self.recorder.gradient(self.model.parameters(), self.update, world.rank())


class _PipelineSteps(_Steps):
    """`_Steps` on a rank of a pipeline: the first update's gradient kept as this rank's named
    pieces (`stages.pieces`), and a reproduction's parameters (``reduced``, one device's names:
    a tied copy's by its ``aliases``) averaged over the stage's replicas (``mesh["dp"]``), which
    hold the same names."""

    def __init__(
        self, model: nn.Module, recorder: StepLog, reduced: tuple[str, ...], mesh: Any,
        aliases: dict[str, str],
    ) -> None:  # fmt: skip
        super().__init__(model, recorder)
        self.replicated, self.mesh, self.aliases = reduced, mesh, aliases
        self.first: list = []
        self.unused: frozenset[str] = frozenset()  # held, never given a gradient by its stages

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        super().__call__(optimizer, args, kwargs)
        if self.without_gradient:
            return
        stages.reduce_replicas(self.model, self.replicated, self.mesh, self.aliases)
        if self.count == 1 and self.update == 0:
            self.first = stages.pieces(self.model, gradients=True)
            self.unused = frozenset(n for n, p in self.model.named_parameters()
                                    if p.requires_grad and p.grad is None)  # fmt: skip


def _honest(steps: _Steps, micro_batches: int) -> None:
    if steps.without_gradient:
        raise UpdateBroken(
            "the update called optimizer.step() before any backward reached the parameters; "
            "allowed: an update whose backward(s) come before its one step"
        )
    if steps.count != 1:
        times = "never calls" if not steps.count else f"calls {steps.count} times"
        raise UpdateBroken(
            f"the update {times} optimizer.step() with micro_batches={micro_batches}; allowed: "
            "exactly one step per update (accumulate the micro-batches' gradients, then step once)"
        )


def rows_of(batch: Any, rows: torch.Tensor) -> Any:
    """The batch's ``rows`` (indices into its first dimension), in every tensor it holds."""
    if isinstance(batch, torch.Tensor):
        return batch[rows]
    if isinstance(batch, tuple | list):
        return type(batch)(rows_of(item, rows) for item in batch)
    if isinstance(batch, dict):
        return {key: rows_of(item, rows) for key, item in batch.items()}
    return batch


def first_loss(update: Update, batch: Any, seed: int, precision: str) -> float:
    """The loss one update logs on ``batch`` on one device with one micro-batch, from the initial
    weights (the model built and the streams seeded as `Update.train_on_rank` does)."""
    model = build(update, removals.Removals(), precision).to(world.device())
    optimizer = update.optimizer(model.parameters(), **update.optimizer_kwargs)
    seed_processes(seed)
    with runs_precision.autocast(precision, world.device()):
        loss = update.update(model, optimizer, as_precision(batch, precision, world.device()), 1)
    return float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
