"""A user's own ``LightningModule`` and map-style data set, trained the way gatherlab trains its
own module (docs/design.md §2, §10): every layout sees the same global batches in the same order,
rank r its r-th contiguous slice, and the removals of ``gatherlab.check.removals`` applied on
request.

- ``ItemsDataModule`` serves each rank its slice of the global batches of any map-style data set
  (``len``, ``dataset[index]``), collated by the module's or the data set's ``collate_fn`` when it
  has one, else PyTorch's default;
- ``train_on_rank`` builds the module and the data set where it runs (inside each rank), trains
  them with Lightning on one device or in the rank's process group (``fit_on_rank``) and returns
  what the check compares, recorded by ``gatherlab.components.module.StepRecorder`` (which also
  writes the run files of a ``module=external`` run, docs/design.md §5).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
from torch.utils.data import DataLoader, default_collate

from gatherlab.check import removals
from gatherlab.check.steprun import seed_processes
from gatherlab.components.factory import Recipe
from gatherlab.components.module import StepRecorder, rank_sampler
from gatherlab.core import runfiles
from gatherlab.ranks import launch, world

__all__ = [
    "ItemsDataModule",
    "check_module",
    "collate_fn_of",
    "fit_on_rank",
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


def train_on_rank(
    module: Recipe,
    dataset: Recipe,
    removed: removals.Removals,
    global_batch_size: int,
    steps: int,
    seed: int,
    precision: str,
    shuffle: bool = True,
) -> runfiles.Trained:
    """Build the module and the data set here (with this rank's ``rank``/``world_size`` when
    their constructors take them; the module's initial weights drawn from ``seed``), apply
    ``removals``, and train ``steps`` steps with Lightning: on one device, or on this rank of the
    process group when there is one. Returns the run (``runfiles.Trained``: the global loss of each
    step, the first step's gradient, the final parameters)."""
    recorder = StepRecorder(keep_first_gradient=True)
    fit_on_rank(
        module, dataset, removed, global_batch_size, steps, seed, precision, shuffle, [recorder]
    )
    return recorder.trained()


def fit_on_rank(
    module: Recipe,
    dataset: Recipe,
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
    seed_processes(seed)
    if world.size() > 1:
        launch.fit_in_group(lightning_module, datamodule, precision, steps, callbacks)
    else:
        launch.fit(lightning_module, datamodule, 1, precision, steps, callbacks)
