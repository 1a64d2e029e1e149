"""A user's own ``LightningModule`` and map-style data set, trained the way gatherlab trains its
own module (docs/design.md §2, §10): every layout sees the same global batches in the same order,
rank r its r-th contiguous slice, and the removals of ``gatherlab.check.removals`` applied on
request.

- ``ItemsDataModule`` serves each rank its slice of the global batches of any map-style data set
  (``len``, ``dataset[index]``), collated by the module's or the data set's ``collate_fn`` when it
  has one, else PyTorch's default;
- ``Recorder`` keeps what the check compares: the loss each step's ``training_step`` returned,
  the parameter gradient of the first step after DDP's average, and the final parameters;
- ``train_on_rank`` builds the module and the data set where it runs (inside each rank) and
  trains them with Lightning on one device or in the rank's process group (``fit_on_rank``, which
  ``module=external`` runs with ``RunFilesRecorder``: the run files of docs/design.md §5).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, default_collate

from gatherlab import gather as gathering
from gatherlab.check import removals
from gatherlab.components.factory import LossFactory
from gatherlab.components.module import NonFiniteLoss, rank_sampler
from gatherlab.core import runfiles
from gatherlab.ranks import launch

__all__ = [
    "ItemsDataModule",
    "Recorder",
    "RunFilesRecorder",
    "Trained",
    "check_module",
    "collate_fn_of",
    "data_size",
    "fit_on_rank",
    "loss_of",
    "train_on_rank",
]  # fmt: skip


def check_module(module: Any, label: str) -> L.LightningModule:
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


def _loss_value(output: Any) -> torch.Tensor:
    """The loss a ``training_step`` returned: the tensor, or a mapping's ``"loss"``."""
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


class Recorder(L.Callback):
    """Keeps each step's loss (what ``training_step`` returned on this rank), the parameter
    gradient of the first step as DDP hands it to the optimizer, and the final parameters."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.first_gradient: torch.Tensor | None = None
        self.parameters: torch.Tensor | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.losses.append(float(_loss_value(outputs).detach()))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.first_gradient is None:
            self.first_gradient = torch.cat(
                [
                    (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
                    for p in pl_module.parameters()
                    if p.requires_grad
                ]
            ).double()

    def on_train_end(self, trainer, pl_module) -> None:
        self.parameters = torch.cat(
            [p.detach().reshape(-1) for p in pl_module.parameters()]
        ).double()


class RunFilesRecorder(L.Callback):
    """A run's ``curves.csv`` and ``final_state.pt`` (docs/design.md §5) for any LightningModule,
    as ``module.RunRecorder`` writes them for gatherlab's: per step the loss ``training_step``
    returned on each rank, its mean over ranks taken once when training ends (the global loss,
    docs/design.md §2), and the L2 norm of the gradient the optimizer applies (after DDP's
    average); the module's ``state_dict`` at the end. Files from rank 0 only."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.history: list[dict[str, float]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = [p.grad.reshape(-1) for p in pl_module.parameters() if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.cat(grads))) if grads else 0.0
        if not math.isfinite(norm):
            raise NonFiniteLoss("gradient norm", norm, trainer.global_step, trainer.global_rank)
        self.history.append({"step": trainer.global_step, "grad_norm": norm})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        value = float(_loss_value(outputs).detach())
        if not math.isfinite(value):
            raise NonFiniteLoss("loss", value, trainer.global_step - 1, trainer.global_rank)
        self.history[-1]["local_loss"] = value

    def on_train_end(self, trainer, pl_module) -> None:
        local = torch.tensor([row["local_loss"] for row in self.history], dtype=torch.float64)
        global_loss = trainer.strategy.reduce(local, reduce_op="mean").tolist()
        if trainer.global_rank == 0:
            runfiles.write_curves(
                self.run_dir,
                [
                    {"step": row["step"], "loss": loss, "grad_norm": row["grad_norm"]}
                    for row, loss in zip(self.history, global_loss, strict=True)
                ],
            )
            runfiles.write_final_state(self.run_dir, pl_module.state_dict())


@dataclass(frozen=True)
class Trained:
    """One rank's run: its losses per step, the first step's gradient, the final parameters."""

    losses: list[float]
    first_gradient: torch.Tensor
    parameters: torch.Tensor


def _seed_processes(seed: int) -> None:
    """Every process's global random streams from ``seed``, as a training script seeds them
    (``lightning.seed_everything``): the same on every rank."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def train_on_rank(
    module: LossFactory,
    dataset: LossFactory,
    removed: removals.Removals,
    global_batch_size: int,
    steps: int,
    seed: int,
    precision: str,
    shuffle: bool = True,
) -> Trained:
    """Build the module and the data set here (with this rank's ``rank``/``world_size`` when
    their constructors take them; the module's initial weights drawn from ``seed``), apply
    ``removals``, and train ``steps`` steps with Lightning: on one device, or on this rank of the
    process group when there is one. Returns this rank's ``Trained``."""
    recorder = Recorder()
    fit_on_rank(
        module, dataset, removed, global_batch_size, steps, seed, precision, shuffle, [recorder]
    )
    if recorder.first_gradient is None or recorder.parameters is None:
        raise RuntimeError(f"training stopped before its first step on rank {gathering.rank()}")
    if not all(math.isfinite(value) for value in recorder.losses):
        raise FloatingPointError(f"a non-finite loss on rank {gathering.rank()}")
    return Trained(recorder.losses, recorder.first_gradient, recorder.parameters)


def fit_on_rank(
    module: LossFactory,
    dataset: LossFactory,
    removed: removals.Removals,
    global_batch_size: int,
    steps: int,
    seed: int,
    precision: str,
    shuffle: bool,
    callbacks: list[L.Callback],
) -> None:
    """``train_on_rank``'s training with ``callbacks``: build the module and the data set here,
    apply ``removals``, seed the global random streams from ``seed``, and fit ``steps`` steps on
    one device or on this rank of the process group when there is one."""
    lightning_module = module()
    removed.apply(lightning_module)
    data = dataset()
    datamodule = ItemsDataModule(
        data, global_batch_size, steps, seed, shuffle, removed.data_randomness,
        collate_fn_of(lightning_module, data),
    )  # fmt: skip
    _seed_processes(seed)
    if gathering.world_size() > 1:
        launch.fit_in_group(lightning_module, datamodule, precision, steps, callbacks)
    else:
        launch.fit(lightning_module, datamodule, 1, precision, steps, callbacks)


class _LossOf:
    """The loss a module holds as an attribute, built by building the module (picklable: a
    factory for ``gatherlab.check.check_loss``)."""

    def __init__(self, module: LossFactory, attribute: str):
        self.module, self.attribute = module, attribute
        self.__qualname__ = f"{module.name}.{attribute}"

    def __call__(self) -> torch.nn.Module:
        return getattr(self.module(), self.attribute)


def loss_of(module: LossFactory, attribute: str) -> Callable[[], torch.nn.Module]:
    """A factory of the loss that ``module``'s objects hold as ``attribute``."""
    return _LossOf(module, attribute)
