"""Training with Lightning on a rank: the callbacks of every Lightning run (gatherlab's own module
and a user's), and a user's own ``LightningModule`` and map-style data set trained the way
gatherlab trains its own module (docs/design.md §2, docs/checking.md §10): every layout sees the
same global batches in the same order, rank r its r-th contiguous slice, and the removals of
`gatherlab.runs.removals` made on request.

- ``StepLogCallback`` records every step of any LightningModule (`gatherlab.runs.steplog.StepLog`)
  and, with a run directory, rank 0 writes the run files there (docs/contract.md §5);
  ``ProgressLog`` logs a line every few steps;
- ``ItemsDataModule`` serves each rank its slice of the global batches of any map-style data set
  (``len``, ``dataset[index]``), collated by the module's or the data set's ``collate_fn`` when it
  has one, else PyTorch's default;
- ``Module`` is the LightningModule form (`gatherlab.runs.spec.Form`): ``train_on_rank(spec)``
  builds the module and the data set where it runs (inside each rank), trains them on one device
  or in the rank's process group (``fit_on_rank``, which also trains a ``module=user`` run) and
  returns what the check compares.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import lightning as L
import torch
from torch.utils.data import DataLoader, default_collate

from gatherlab.components.factory import Recipe
from gatherlab.components.module import rank_sampler
from gatherlab.core import runfiles
from gatherlab.ranks import launch, world
from gatherlab.runs import removals, trace
from gatherlab.runs.plainstep import seed_processes
from gatherlab.runs.spec import RunSpec
from gatherlab.runs.steplog import StepLog, reduce_gradients

log = logging.getLogger(__name__)

__all__ = [
    "ItemsDataModule",
    "Module",
    "ProgressLog",
    "StepLogCallback",
    "TraceFirstStep",
    "collate_fn_of",
    "loss_of_step",
    "validated_module",
]  # fmt: skip


def validated_module(module: Any, label: str) -> L.LightningModule:
    """``module`` when it is a ``LightningModule`` with its own ``training_step`` and
    ``configure_optimizers``; a ValueError of one line, starting with ``label``, otherwise."""
    if not isinstance(module, L.LightningModule):
        raise ValueError(
            f"{label} built a {type(module).__name__}; allowed: a lightning.LightningModule with "
            "training_step and configure_optimizers"
        )
    for method in ("training_step", "configure_optimizers"):
        if getattr(type(module), method) is getattr(L.LightningModule, method):
            raise ValueError(f"{label} has no {method}; allowed: a LightningModule with one")
    return module


def collate_fn_of(module: Any, dataset: Any) -> Callable[[list[Any]], Any]:
    """The module's ``collate_fn``, else the data set's, else PyTorch's ``default_collate``."""
    return (
        getattr(module, "collate_fn", None)
        or getattr(dataset, "collate_fn", None)
        or (default_collate)
    )


class ItemsDataModule(L.LightningDataModule):
    """Each rank's slice of the same global batches of a map-style data set (docs/design.md §2),
    its items drawn with the data set's own randomness or, ``seeded``, with its global random
    streams seeded per sample (``removals.PerSample``)."""

    def __init__(
        self,
        dataset: Any,
        global_batch_size: int,
        steps: int,
        seed: int,
        shuffle: bool,
        seeded: bool,
        collate_fn: Callable[[list[Any]], Any],
    ):
        super().__init__()
        self.dataset, self.global_batch_size, self.steps = dataset, global_batch_size, steps
        self.seed, self.shuffle, self.seeded, self.collate_fn = seed, shuffle, seeded, collate_fn

    def train_dataloader(self) -> DataLoader:
        sampler = rank_sampler(
            self.trainer, len(self.dataset), self.global_batch_size, self.steps, self.seed,
            self.shuffle,
        )  # fmt: skip
        items = removals.PerSample(self.dataset, self.seed, self.seeded)
        return DataLoader(items, batch_sampler=sampler, collate_fn=self.collate_fn)


class TraceFirstStep(L.Callback):
    """Records the operations of the first ``training_step`` (`gatherlab.runs.trace`), from the
    batch it is given to the loss it returns, and their gradients in its backward."""

    def __init__(self) -> None:
        self.tracer: trace.Tracer | None = None
        self.before: dict[str, tuple] = {}
        self.ops: list[trace.Op] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_step != 0:
            return
        self.before = trace.buffer_state([("", pl_module)])
        self.tracer = tracer = trace.Tracer(trace.batch_tensors(batch))
        step = pl_module.training_step

        def training_step(*args: Any, **kwargs: Any) -> Any:  # marks the loss it returns
            output = step(*args, **kwargs)
            tracer.returned(loss_of_step(output))
            return output

        pl_module.training_step = training_step  # this instance's, for its first step only
        tracer.__enter__()

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        if self.tracer is not None and trainer.global_step == 0:
            self._stop(pl_module)
            self.tracer.buffers([("", pl_module)], self.before)
            self.tracer.keep_gradients()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self.tracer is not None and not self.ops:
            self.ops = self.tracer.detached()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if self.tracer is not None and not self.ops:  # the step raised inside the recording
            self._stop(pl_module)

    def _stop(self, pl_module) -> None:
        self.tracer.__exit__(None, None, None)
        vars(pl_module).pop("training_step", None)


@dataclass(frozen=True)
class Module:
    """The LightningModule form (`gatherlab.runs.spec.Form`): a user's ``LightningModule``, built
    inside each rank by ``module`` (with this rank's ``rank``/``world_size`` when its constructor
    takes them; its initial weights drawn from the recipe's seed), trained by Lightning."""

    module: Recipe
    option: ClassVar[str] = "--module"

    @property
    def recipe(self) -> Recipe:
        """The module's factory."""
        return self.module

    def built_label(self, label: str) -> str:
        """The form's own label."""
        return label

    def checked(self, built: Any, label: str) -> L.LightningModule:
        """`validated_module`."""
        return validated_module(built, label)

    def collate(self, data: Any) -> Callable[[list[Any]], Any]:
        """`collate_fn_of` a module built here and the data set."""
        return collate_fn_of(self.module(), data)

    def one_step(self, built: L.LightningModule, batch: Any) -> Any:
        """What ``training_step`` returns on ``batch`` (index 0), run as one device's Trainer runs
        it (`OneDevice`: ``self.all_gather`` and ``self.log`` reach it)."""
        one_device = OneDevice()
        built.fabric = one_device  # a weak reference: ``one_device`` outlives the step
        try:
            return built.training_step(batch, 0)
        finally:
            built.fabric = None

    def train_on_rank(self, spec: RunSpec) -> runfiles.Trained:
        """Train the run ``spec`` describes (`fit_on_rank`) and return it
        (``runfiles.Trained``: the global loss of each step, the first step's gradient, the final
        parameters)."""
        recorder = StepLogCallback(keep_first_gradient=True, step_budget_s=spec.step_budget_s,
                                steps=spec.steps)  # fmt: skip
        self.fit_on_rank(spec, [recorder])
        return recorder.trained()

    def trace_on_rank(self, spec: RunSpec) -> list[trace.Op]:
        """The operations of the first ``training_step`` on this rank (or one device), with their
        gradients: the module trained one step as `train_on_rank` trains it, without removals
        (`TraceFirstStep`)."""
        tracing = TraceFirstStep()
        self.fit_on_rank(replace(spec, removals=removals.Removals(), steps=1), [tracing])
        return tracing.ops

    def fit_on_rank(self, spec: RunSpec, callbacks: list[L.Callback]) -> None:
        """`train_on_rank`'s training with ``callbacks``: build the module and the data set here,
        make the removals, seed the global random streams from the seed, and fit ``spec.steps``
        steps on one device or on this rank of the process group when there is one (also a
        ``module=user`` run of the lab)."""
        lightning_module = self.module()
        spec.removals.apply(lightning_module)
        data = spec.data()
        seeded = removals.Removal.DATA_RANDOMNESS in spec.removals
        datamodule = ItemsDataModule(
            data, spec.global_batch_size, spec.steps, spec.seed, spec.shuffle, seeded,
            collate_fn_of(lightning_module, data),
        )  # fmt: skip
        seed_processes(spec.seed)
        if world.size() > 1:
            if spec.reduced:  # before the callbacks that record the gradient
                callbacks = [_ReducedGradients(spec.reduced), *callbacks]
            launch.fit_in_group(
                lightning_module, datamodule, spec.precision, spec.steps, callbacks, spec.strategy
            )
        else:
            launch.fit(lightning_module, datamodule, 1, spec.precision, spec.steps, callbacks)


class OneDevice:
    """What a LightningModule's step reaches of its Trainer where gatherlab runs the step alone (a
    check's first step in float64, its draws of randomness): one device's, as Lightning's
    single-device strategy gives them; attached through the module's public ``fabric`` attribute,
    which Lightning's module methods read before its Trainer. ``all_gather`` returns the tensor
    itself (one device, no leading dimension), ``log_dict`` keeps nothing, ``backward`` is the
    loss's own (``manual_backward``). Without it ``self.all_gather``, Lightning's own gather,
    raised "not attached to a Trainer", and the check refused the module as code that cannot run
    in float64."""

    loggers: ClassVar[list] = []
    logger = None
    global_rank, local_rank, node_rank, world_size = 0, 0, 0, 1

    @property
    def strategy(self) -> OneDevice:
        return self

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False):
        return tensor

    def log_dict(self, metrics: Any, step: int | None = None) -> None:
        pass

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        loss.backward(*args, **kwargs)


class _ReducedGradients(L.Callback):
    """The gradients of the parameters ``names`` all-reduced (the mean over the ranks) before
    each optimizer step: the reproduction of an unreduced part (`RunSpec.reduced`)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        reduce_gradients(pl_module, self.names)


def loss_of_step(output: Any) -> torch.Tensor:
    """The loss a ``training_step`` returned: the tensor, or a mapping's ``"loss"``; a TypeError of
    one line for anything else."""
    loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        if output is None or (isinstance(output, list | dict) and not output):
            returned = "nothing"  # Lightning hands on a step that returned None as []
        elif isinstance(output, dict):
            returned = f"a dict of {sorted(output)}"
        else:
            returned = type(output).__name__
        raise TypeError(
            f"training_step returned {returned}; allowed: the loss tensor or a dict with 'loss'"
        )
    return loss


class StepLogCallback(L.Callback):
    """Records every optimizer step of any LightningModule on its rank (`StepLog`: the loss
    ``training_step`` returned, checked before its backward; the norm of the gradient the
    optimizer applies, after DDP's average; with ``keep_first_gradient`` the first step's whole
    gradient; when training ends each step's global loss and the final parameters). With
    ``run_dir``, rank 0 writes ``curves.csv`` and ``final_state.pt`` there (the module's
    ``run_state_dict()`` when it has one, else its ``state_dict()``). A NaN or infinite loss or
    gradient norm stops the run (`gatherlab.runs.steplog.NonFiniteLoss`)."""

    def __init__(
        self,
        run_dir: str | Path | None = None,
        keep_first_gradient: bool = False,
        step_budget_s: float = math.inf,
        steps: int = 0,
    ):
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.recorder = StepLog(keep_first_gradient, step_budget_s, steps)

    def on_train_start(self, trainer, pl_module) -> None:
        self.recorder.start()  # the first step's time is not the Trainer's set-up

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        self.recorder.loss(loss, trainer.global_step, trainer.global_rank)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.recorder.gradient(pl_module.parameters(), trainer.global_step, trainer.global_rank)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        loss_of_step(outputs)  # the module's contract: a step returns its loss

    def on_train_end(self, trainer, pl_module) -> None:
        self.recorder.finish(pl_module.parameters())
        if self.run_dir is not None:  # every rank: a sharded state is gathered whole
            state = getattr(pl_module, "run_state_dict", pl_module.state_dict)()
            if trainer.global_rank == 0:
                self.recorder.write(self.run_dir, state)

    def trained(self) -> runfiles.Trained:
        """The run as the checks compare it (`StepLog.trained`)."""
        return self.recorder.trained()


class ProgressLog(L.Callback):
    """A line every ``every`` optimizer steps (and at the last) from rank 0: the step, rank 0's
    local loss (what ``training_step`` returned; the global loss is reduced once, when training
    ends), the time so far. Works with any LightningModule."""

    def __init__(self, every: int, steps: int):
        self.every, self.steps = every, steps
        self.start = 0.0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # A rank in a worker process has no logging configured; its progress goes to stderr.
        package = logging.getLogger("gatherlab")
        if trainer.global_rank == 0 and not package.hasHandlers():
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][rank 0] %(message)s"))
            package.addHandler(handler)
            package.setLevel(logging.INFO)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if trainer.global_rank != 0 or not self.every:
            return
        if step % self.every == 0 or step == self.steps:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            log.info(
                "step %d/%d: local loss %.6g, %.1f s",
                step,
                self.steps,
                float(loss),
                time.perf_counter() - self.start,
            )
