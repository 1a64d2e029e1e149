"""The LightningModule that trains a model with a contrastive loss, its data module, and the
callbacks of every training run: the recorder of its steps (and its files, docs/design.md §5) and
its progress lines. The callbacks work with any LightningModule."""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

from gatherlab.components.data import GlobalBatchSampler, PairDataset
from gatherlab.core import runfiles

log = logging.getLogger(__name__)


class NonFiniteLoss(FloatingPointError):
    """A NaN or infinite loss or gradient norm (``what``, ``value``): the run stops at ``step``
    on ``rank``; the step is data (``summary.json``'s ``failed_step``), the message names it."""

    def __init__(self, what: str, value: float, step: int, rank: int) -> None:
        super().__init__(f"the {what} is {value} at step {step} (rank {rank})")
        self.what, self.value, self.step, self.rank = what, value, step, rank

    def __reduce__(
        self,
    ) -> tuple:  # sent from a rank to the command as it is (gatherlab.ranks.pool)
        return type(self), (self.what, self.value, self.step, self.rank)


OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class ContrastiveModule(L.LightningModule):
    """Embeds both views and applies the loss; ``training_step`` returns the rank's local loss
    (what its backward needs; `StepRecorder` records the steps).

    ``loss`` is a module, or a factory (``gatherlab.components.factory.Recipe``) that each
    rank calls in ``setup``, once its process group exists and before DDP wraps the module, so a
    loss that reads its rank and world size at construction gets them, and its parameters are
    trained.
    """

    def __init__(
        self,
        model: nn.Module,
        loss: nn.Module | Callable[[], nn.Module],
        optimizer: OptimizerFactory,
        encode_second_view: bool = True,
    ):
        super().__init__()
        self.model = model
        if isinstance(loss, nn.Module):
            self.loss, self.loss_factory = loss, None
        else:
            self.loss, self.loss_factory = None, loss
        self.optimizer_factory = optimizer
        self.encode_second_view = encode_second_view

    def setup(self, stage: str) -> None:
        if self.loss is None:
            self.loss = self.loss_factory()

    def _embed(self, view: torch.Tensor, keys: torch.Tensor | None, view_id: int) -> torch.Tensor:
        """The model's embedding of one view; a model with seeded randomness (dropout) also gets
        each sample's ``[epoch, index, view]``."""
        if keys is not None and getattr(self.model, "takes_sample_keys", False):
            view_column = torch.full_like(keys[:, :1], view_id)
            return self.model(view, sample_keys=torch.cat([keys, view_column], dim=1))
        return self.model(view)

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        """``batch``: ``(view0, view1)`` or ``(view0, view1, keys)``, keys ``[epoch, index]``."""
        view0, view1 = (view.to(self.dtype) for view in batch[:2])
        keys = batch[2] if len(batch) > 2 else None
        out0 = self._embed(view0, keys, 0).flatten(1)
        out1 = (self._embed(view1, keys, 1) if self.encode_second_view else view1).flatten(1)
        return self.loss(out0, out1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer_factory(self.parameters())

    def run_state_dict(self) -> dict[str, torch.Tensor]:
        """What ``final_state.pt`` holds (`StepRecorder`): the model's weights."""
        return self.model.state_dict()


class PairDataModule(L.LightningDataModule):
    """Serves each rank its slice of the same global batches (see ``GlobalBatchSampler``)."""

    def __init__(
        self, dataset: PairDataset, global_batch_size: int, steps: int, seed: int, shuffle: bool
    ):
        super().__init__()
        self.dataset, self.global_batch_size = dataset, global_batch_size
        self.steps, self.seed, self.shuffle = steps, seed, shuffle

    def train_dataloader(self) -> DataLoader:
        sampler = rank_sampler(
            self.trainer, len(self.dataset), self.global_batch_size, self.steps, self.seed,
            self.shuffle,
        )  # fmt: skip
        return DataLoader(self.dataset, batch_sampler=sampler)


def rank_sampler(
    trainer: L.Trainer, num_samples: int, global_batch_size: int, steps: int, seed: int,
    shuffle: bool,
) -> GlobalBatchSampler:  # fmt: skip
    """The sampler of this trainer's rank: its slice of each global batch, keys ``(epoch,
    index)`` (docs/design.md §2)."""
    return GlobalBatchSampler(
        num_samples=num_samples,
        global_batch_size=global_batch_size,
        num_batches=steps,
        rank=trainer.global_rank,
        world_size=trainer.world_size,
        seed=seed,
        shuffle=shuffle,
        with_epoch=True,
    )


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


class StepRecorder(L.Callback):
    """Records every optimizer step of any LightningModule on its rank: the loss ``training_step``
    returned (checked before its backward), the L2 norm of the gradient the optimizer applies
    (after DDP's average) and, with ``keep_first_gradient``, the first step's whole gradient. When
    training ends it takes each step's global loss, the mean over ranks (docs/design.md §2: one
    all-reduce for the run, since a collective costs as much as a small model's step), and the
    final parameters (`trained`). With ``run_dir``, rank 0 writes ``curves.csv`` and
    ``final_state.pt`` there (the module's ``run_state_dict()`` when it has one, else its
    ``state_dict()``). A NaN or infinite loss or gradient norm stops the run (`NonFiniteLoss`)."""

    def __init__(self, run_dir: str | Path | None = None, keep_first_gradient: bool = False):
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.keep_first_gradient = keep_first_gradient
        self.steps: list[int] = []
        self.local_losses: list[float] = []
        self.grad_norms: list[float] = []
        self.first_gradient: torch.Tensor | None = None
        self.losses: list[float] | None = None
        self.parameters: torch.Tensor | None = None

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        value = float(loss.detach())
        if not math.isfinite(value):
            raise NonFiniteLoss("loss", value, trainer.global_step, trainer.global_rank)
        self.steps.append(trainer.global_step)
        self.local_losses.append(value)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        trainable = [p for p in pl_module.parameters() if p.requires_grad]
        grads = [p.grad.reshape(-1) for p in trainable if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.cat(grads))) if grads else 0.0
        if not math.isfinite(norm):
            raise NonFiniteLoss("gradient norm", norm, trainer.global_step, trainer.global_rank)
        self.grad_norms.append(norm)
        if self.keep_first_gradient and self.first_gradient is None:
            self.first_gradient = torch.cat(
                [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                 for p in trainable]
            ).detach().double()  # fmt: skip

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        loss_of_step(outputs)  # the module's contract: a step returns its loss

    def on_train_end(self, trainer, pl_module) -> None:
        local = torch.tensor(self.local_losses, dtype=torch.float64)
        self.losses = trainer.strategy.reduce(local, reduce_op="mean").tolist()
        self.parameters = torch.cat(
            [p.detach().reshape(-1) for p in pl_module.parameters()]
        ).double()
        if self.run_dir is None or trainer.global_rank != 0:
            return
        rows = zip(self.steps, self.losses, self.grad_norms, strict=True)
        runfiles.write_curves(
            self.run_dir,
            [{"step": step, "loss": loss, "grad_norm": norm} for step, loss, norm in rows],
        )
        state = getattr(pl_module, "run_state_dict", pl_module.state_dict)
        runfiles.write_final_state(self.run_dir, state())

    def trained(self) -> runfiles.Trained:
        """The run as the checks compare it; a RuntimeError when it ended before its first step."""
        if self.losses is None or self.parameters is None or not self.local_losses:
            raise RuntimeError("training stopped before its first step")
        return runfiles.Trained(self.losses, self.first_gradient, self.parameters)


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
