"""The LightningModule that trains a model with a contrastive loss, its data module, and the
callback that records a run's files (docs/design.md §5) from rank 0."""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

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
    """Embeds both views, applies the loss, keeps the global loss and gradient norm of each step.

    The loss returned by ``training_step`` is the rank's local loss (what its backward needs); the
    recorded loss is the mean over ranks, which equals the single-device loss (docs/design.md §2),
    reduced for all steps at once when training ends (``curves``). The
    recorded gradient norm is taken after DDP has averaged the gradients, right before the
    optimizer applies them.

    ``loss`` is a module, or a factory (``gatherlab.components.factory.LossFactory``) that each
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
        self.history: list[dict[str, float]] = []

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
        loss = self.loss(out0, out1)
        value = float(loss.detach())
        if not math.isfinite(value):
            raise NonFiniteLoss("loss", value, self.global_step, self.global_rank)
        self.history.append({"step": self.global_step, "local_loss": value})
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad.reshape(-1) for p in self.parameters() if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.cat(grads)))
        if not math.isfinite(norm):
            raise NonFiniteLoss("gradient norm", norm, self.global_step, self.global_rank)
        self.history[-1]["grad_norm"] = norm

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer_factory(self.parameters())

    def curves(self) -> list[dict[str, float]]:
        """Per step: ``step``, the global ``loss`` and ``grad_norm``. A collective: call it on
        every rank. One all-reduce for the whole run instead of one per step, since a collective
        costs ~1 ms on gloo, as much as a training step of a small model."""
        local = torch.tensor([row["local_loss"] for row in self.history], dtype=torch.float64)
        global_loss = self.trainer.strategy.reduce(local, reduce_op="mean").tolist()
        return [
            {"step": row["step"], "loss": loss, "grad_norm": row["grad_norm"]}
            for row, loss in zip(self.history, global_loss, strict=True)
        ]


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


class RunRecorder(L.Callback):
    """Writes ``curves.csv`` and ``final_state.pt`` into the run directory, from rank 0 only."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)

    def on_train_end(self, trainer: L.Trainer, pl_module: ContrastiveModule) -> None:
        curves = pl_module.curves()
        if trainer.global_rank == 0:
            runfiles.write_curves(self.run_dir, curves)
            runfiles.write_final_state(self.run_dir, pl_module.model.state_dict())


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
