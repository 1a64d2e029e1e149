"""A user's plain PyTorch training step (no Lightning), trained the way gatherlab trains its own
runs (docs/design.md §2, docs/checking.md §10): the model that ``build_model(**kwargs)`` returns,
built inside every rank after the same seed, wrapped in torch's ``DistributedDataParallel`` on W
ranks (the bare module on one device), the user's optimizer, and ``training_step(model, batch)``
called on each rank's slice of the same global batches; the removals of `gatherlab.runs.removals`
made on request; every step recorded by `gatherlab.runs.steplog.StepLog`.

- ``Step`` is the form (`gatherlab.runs.spec.Form`): what is trained (the step, the model, the
  optimizer); ``Step.train_on_rank(spec)`` trains it here (on one device, or on this rank of the
  process group when there is one) and returns what the check compares (``runfiles.Trained``);
- ``step_loss`` holds the step's contract: a scalar tensor.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import default_collate

from gatherlab.components.data import GlobalBatchSampler
from gatherlab.components.factory import Recipe
from gatherlab.core import runfiles, terms
from gatherlab.ranks import watched, world
from gatherlab.runs import precision as runs_precision
from gatherlab.runs import removals, tensorparallel, trace
from gatherlab.runs.sharded import OutsideForward, naming_dtensors
from gatherlab.runs.spec import RunSpec
from gatherlab.runs.steplog import StepLog, reduce_gradients

__all__ = [
    "PlainModel", "Step", "as_precision", "build", "built_in", "checked_model", "data_size",
    "distributes_itself", "first_batch", "first_on_rank", "held_names", "mesh_of",
    "rank_batches", "seed_processes", "step_loss", "wrapped_for_rank",
]  # fmt: skip

StepFunction = Callable[[nn.Module, Any], torch.Tensor]


class PlainModel:
    """What a plain form (a step, a whole update) answers the check on one device about its model,
    the user's ``nn.Module`` built by ``self.model`` (`gatherlab.runs.spec.StepForm`)."""

    model: Recipe

    @property
    def recipe(self) -> Recipe:
        """The model's factory."""
        return self.model

    def built_label(self, label: str) -> str:
        """``--model`` and the factory's name."""
        return f"--model {self.model.name}"

    def checked(self, built: Any, label: str) -> nn.Module:
        """The model, when it is an ``nn.Module``; a ValueError of one line otherwise."""
        return checked_model(self.model, built)

    def collate(self, data: Any) -> Callable[[list[Any]], Any] | None:
        """The data set's ``collate_fn``, if any."""
        return getattr(data, "collate_fn", None)


@dataclass(frozen=True)
class Step(PlainModel):
    """A plain PyTorch training step: ``step(model, batch)`` returns the loss tensor; the model is
    built by ``model`` (a `Recipe` of the user's factory) and optimised by ``optimizer(params,
    **optimizer_kwargs)``."""

    step: StepFunction
    model: Recipe
    optimizer: Callable[..., torch.optim.Optimizer]
    optimizer_kwargs: dict[str, Any]
    option: ClassVar[str] = "--step"

    def one_step(self, built: nn.Module, batch: Any) -> Any:
        """The loss the step returns on ``batch``."""
        return self.step(built, batch)

    def train_on_rank(self, spec: RunSpec) -> runfiles.Trained:
        """Build the model and the data set here, make the removals, seed the global random
        streams from the seed (as a training script does), and train ``spec.steps`` steps: DDP
        over this rank's process group when there is one, the bare model on one device. Returns
        each step's global loss (`gatherlab.runs.steplog`), the first step's gradient as the
        optimizer gets it, and the final parameters."""
        device = world.device()  # a rank's own GPU in an NCCL group, else the CPU
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
        seed_processes(spec.seed)
        partial: dict[str, str] = {}
        for index, batch in enumerate(rank_batches(data, spec)):
            optimizer.zero_grad()
            with runs_precision.autocast(spec.precision, device):
                batch = as_precision(batch, spec.precision, device)
                output = naming_dtensors(model, functools.partial(self.step, wrapped, batch))
            loss = step_loss(output)
            recorder.loss(loss, index, world.rank())
            loss.backward()
            if index == 0:
                partial = tensorparallel.partial_gradients(model.named_parameters())
            reduce_gradients(model, spec.reduced)  # the reproduction of an unreduced part
            recorder.gradient(model.parameters(), index, world.rank())
            optimizer.step()
        recorder.finish(model.parameters())
        parallel = model if spec.tensor_parallel > 1 else None
        return trained_with(recorder, watch, parallel, partial, held_names(model))

    def trace_on_rank(self, spec: RunSpec) -> list[trace.Op]:
        """The operations of the first step's forward (`gatherlab.runs.trace`), with their
        gradients: the model built, wrapped and seeded as `train_on_rank` does (no removals), on
        this rank's slice of the first global batch (the whole batch on one device)."""
        spec = replace(spec, removals=removals.Removals(), steps=1)
        device = world.device()
        model = build(
            self, spec.removals, spec.precision, spec.tensor_parallel, spec.expert_parallel
        ).to(device)
        data = spec.data()
        wrapped = wrapped_for_rank(model, device, expert_parallel=spec.expert_parallel)
        seed_processes(spec.seed)
        batch = as_precision(next(rank_batches(data, spec)), spec.precision, device)
        modules = [("", model)]
        before = trace.buffer_state(modules)
        with trace.traced(trace.batch_tensors(batch)) as tracer:
            returned = self.step(wrapped, batch)
            loss = step_loss(returned)
        tracer.returned(returned)  # the step's own tensor (`step_loss`'s reshape is no record)
        tracer.buffers(modules, before)
        tracer.keep_gradients()
        if loss.requires_grad:
            loss.backward()
        return tracer.detached()

    def layout_on_rank(
        self, spec: RunSpec
    ) -> tuple[list[tensorparallel.Seen], list[tensorparallel.Drawn]]:
        """The layouts of the first step's forward of a tensor-parallel model
        (`tensorparallel.LayoutWatch`): built and seeded as `train_on_rank` does, on this rank's
        rows of the first global batch (the whole batch on one device)."""
        model, batch = first_on_rank(self, spec)
        watch = tensorparallel.LayoutWatch(model)
        try:
            with watch:
                step_loss(self.step(wrapped_for_rank(model, world.device()), batch))
        finally:
            seen = watch.close()
        return seen


def first_on_rank(form: PlainModel, spec: RunSpec) -> tuple[nn.Module, Any]:
    """The form's model built here as a run without removals builds it, and this rank's rows of
    the first global batch, the global random streams seeded."""
    spec = replace(spec, removals=removals.Removals(), steps=1)
    device = world.device()
    model = build(
        form, spec.removals, spec.precision, spec.tensor_parallel, spec.expert_parallel
    ).to(device)
    data = spec.data()
    seed_processes(spec.seed)
    return model, as_precision(next(rank_batches(data, spec)), spec.precision, device)


def checked_model(recipe: Recipe, built: Any) -> nn.Module:
    """What a plain form's model factory built, when it is an ``nn.Module``; a ValueError of one
    line otherwise."""
    if not isinstance(built, nn.Module):
        raise ValueError(
            f"--model {recipe.name} returned a {type(built).__name__}; allowed: a torch.nn.Module"
        )
    return built


def seed_processes(seed: int) -> None:
    """Every process's global random streams from ``seed``, as a training script seeds them
    (``lightning.seed_everything``): the same on every rank."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def data_size(data: Any, label: str) -> int:
    """The number of samples of a map-style data set (``len`` and ``data[index]``, item 0 read
    once); a ValueError of one line, starting with ``label``, otherwise."""
    if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise ValueError(
            f"{label} built a {type(data).__name__} without __len__ and __getitem__; allowed: a "
            "map-style data set"
        )
    try:
        size = len(data)
        data[0]
    except Exception as error:
        raise ValueError(
            f"{label} breaks the map-style contract: {type(error).__name__}: {error}; allowed: "
            "len(data set) and data set[index]"
        ) from None
    return size


def step_loss(value: Any) -> torch.Tensor:
    """What the step returned, when it is a scalar tensor; a TypeError of one line otherwise."""
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        if value is None:
            returned = "nothing"
        elif isinstance(value, torch.Tensor):
            returned = f"a tensor of shape {tuple(value.shape)}"
        else:
            returned = f"a {type(value).__name__}"
        raise TypeError(f"the step returned {returned}; allowed: the loss, a scalar tensor")
    return value.reshape(())


def build(
    step: Step, removed: removals.Removals, precision: str, tensor_parallel: int = 1,
    expert_parallel: int = 1, mesh: Any = None,
) -> nn.Module:  # fmt: skip
    """The user's model, built here after the seed, its removals made, in the run's precision; a
    TypeError of one line when the factory returns no ``nn.Module``. With a tensor-parallel degree
    the factory is given the ranks' ``mesh`` (`world.mesh`; None on one device) to parallelize
    the model itself (docs/checking.md §10, "Tensor and sequence parallelism"); with an
    expert-parallel degree, their ``("dp", "ep")`` mesh to keep its experts of it ("Expert
    parallelism"); given a ``mesh`` (a pipeline's ``("dp", "pp")``, "Pipeline parallelism"),
    that one."""
    if mesh is not None:
        model = step.model(mesh=mesh)
    elif max(tensor_parallel, expert_parallel) > 1:
        model = step.model(mesh=mesh_of(tensor_parallel, expert_parallel))
    else:
        model = step.model()
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"--model {step.model.name} returned a {type(model).__name__}; allowed: a "
            "torch.nn.Module"
        )
    removed.apply(model)
    wanted = _converted(precision)
    in_ddp = [p for m in model.modules() if isinstance(m, DistributedDataParallel)
              for p in m.parameters()]  # fmt: skip
    other = next((p.dtype for p in in_ddp if p.dtype != wanted), None)
    if wanted is not None and other is not None:
        raise TypeError(
            f"--model {step.model.name} put its model in DDP in {other}: DDP's buckets keep that "
            f"dtype, so it cannot be converted to {wanted} after; allowed: the model in {wanted} "
            "before DDP wraps it, or --precision in its dtype"
        )
    return built_in(model, precision)


def mesh_of(tensor_parallel: int, expert_parallel: int):
    """The mesh a plain form's model factory is given (`world.mesh`): ``("dp", "tp")`` for a
    tensor-parallel degree, ``("dp", "ep")`` for an expert-parallel one, None otherwise and on one
    device."""
    if expert_parallel > 1:
        return world.mesh(expert_parallel, world.EXPERT_MESH_DIMS)
    return world.mesh(tensor_parallel)


def held_names(model: nn.Module) -> tuple[tuple[str, tuple[int, ...], bool], ...]:
    """Each parameter of the model a rank trains, as `runfiles.Trained.held` lists it: its name
    (inside a DDP the factory put it in: one device's), its shape and whether it trains."""
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    return tuple((name, tuple(p.shape), p.requires_grad) for name, p in inner.named_parameters())


def built_in(model: nn.Module, precision: str) -> nn.Module:
    """The model in the run's precision: converted for ``64-true`` and ``bf16-true``, as built
    for the others (`_converted`)."""
    return model.to(_converted(precision)) if _converted(precision) else model


def _converted(precision: str) -> torch.dtype | None:
    """The dtype a run converts the model and the batch to, as Lightning's ``64-true`` and
    ``bf16-true`` do; None where they stay as built (float32 and the mixed precisions, whose
    autocast decides each operation's dtype)."""
    if precision in (terms.Precision.FLOAT64, terms.Precision.BF16_TRUE):
        return runs_precision.dtype(precision)
    return None


def as_precision(batch: Any, precision: str, device: torch.device | None = None) -> Any:
    """The batch with its floating tensors in the run's precision (as Lightning's 64-true and
    bf16-true do), every tensor on ``device`` when one is given."""
    if isinstance(batch, torch.Tensor):
        wanted = _converted(precision) or batch.dtype
        batch = batch.to(wanted) if batch.is_floating_point() else batch
        return batch if device is None else batch.to(device)
    if isinstance(batch, tuple | list):
        return type(batch)(as_precision(item, precision, device) for item in batch)
    if isinstance(batch, dict):
        return {key: as_precision(item, precision, device) for key, item in batch.items()}
    return batch


def wrapped_for_rank(
    model: nn.Module, device: torch.device, row_blocks: int = 1, find_unused: bool = False,
    expert_parallel: int = 1,
) -> nn.Module:  # fmt: skip
    """The model as this rank trains it: in ``DistributedDataParallel`` over the rank's process
    group when there is one (on the rank's own GPU in an NCCL group; ``find_unused``: its
    ``find_unused_parameters``), bare on one device (its forward in ``row_blocks`` row blocks,
    the floor's perturbation, `runs.precision.RowBlocks`); as the factory made it when it
    distributes itself (`distributes_itself`: sharded by FSDP2, or in DDP already), never
    wrapped twice; never in DDP in an expert-parallel layout (``expert_parallel`` ≥ 2), whose
    ranks hold different experts and whose code reduces its gradients itself (docs/checking.md
    §10, "Expert parallelism")."""
    if world.size() == 1:
        return model if row_blocks == 1 else runs_precision.RowBlocks(model, row_blocks)
    if distributes_itself(model) or expert_parallel > 1:
        return model
    on_gpu = device.type == terms.Device.CUDA
    ddp = DistributedDataParallel(
        model, device_ids=[device] if on_gpu else None, find_unused_parameters=find_unused
    )
    return watched.visible(ddp)  # its all-reduce seen by the check's watch


def outside_forward(model: nn.Module, wrapped: nn.Module) -> OutsideForward | None:
    """The watch of the parameters the check's DDP (``wrapped``, around ``model``) holds that its
    forward does not use (`runs.sharded.OutsideForward`); None where the check did not wrap."""
    if wrapped is model or not isinstance(wrapped, DistributedDataParallel):
        return None
    return OutsideForward(wrapped)


def trained_with(
    recorder: StepLog,
    watch: OutsideForward | None,
    parallel: nn.Module | None = None,
    partial: dict[str, str] | None = None,
    held: tuple[tuple[str, tuple[int, ...], bool], ...] = (),
) -> runfiles.Trained:
    """The recorder's run, with the parameters the watch found outside the forward; of a
    tensor-parallel model (``parallel``; every rank calls this), the parameters whose replicas
    ended apart (`tensorparallel.replicas_apart`) and those whose first gradient was a partial
    sum (``partial``); the parameters the rank holds (``held``, `held_names`)."""
    names = watch.names if watch is not None else ()
    apart = tensorparallel.replicas_apart(parallel) if parallel is not None else {}
    return replace(
        recorder.trained(), outside_forward=names, replicas_apart=tuple(apart.items()),
        partial=tuple((partial or {}).items()), held=held,
    )  # fmt: skip


def distributes_itself(model: nn.Module) -> bool:
    """Whether the user's factory made the model distributed already: parameters sharded over the
    ranks (``DTensor``: FSDP2's ``fully_shard``), or the model or a part of it in DDP."""
    if any(isinstance(m, DistributedDataParallel) for m in model.modules()):
        return True
    return any(isinstance(p, DTensor) for p in model.parameters())


def rank_batches(
    dataset: Any, spec: RunSpec, collate: Callable[[list[Any]], Any] | None = None,
    one_device: bool = False,
):  # fmt: skip
    """This rank's slice of each of the spec's global batches (docs/design.md §2: of its
    data-parallel group's, the same for the T ranks of a tensor-parallel group), or the whole
    batch with ``one_device``, collated by ``collate``, else the data set's ``collate_fn``, else
    PyTorch's default."""
    rank, size = (0, 1) if one_device else world.data_parallel(spec.replica_ranks)
    sampler = GlobalBatchSampler(
        num_samples=len(dataset), global_batch_size=spec.global_batch_size,
        num_batches=spec.steps, rank=rank, world_size=size, seed=spec.seed, shuffle=spec.shuffle,
        with_epoch=True,
    )  # fmt: skip
    seeded = removals.Removal.DATA_RANDOMNESS in spec.removals
    items = removals.PerSample(dataset, spec.seed, seeded)
    collate = collate or getattr(dataset, "collate_fn", None) or default_collate
    for keys in sampler:
        yield collate([items[key] for key in keys])


def first_batch(
    dataset: Any, spec: RunSpec, collate: Callable[[list[Any]], Any] | None = None
) -> Any:
    """The spec's first global batch, as one device takes it (the data set's own randomness as
    is)."""
    first = replace(spec, removals=removals.Removals(), steps=1)
    return next(rank_batches(dataset, first, collate, one_device=True))
