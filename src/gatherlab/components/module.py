"""The LightningModule that trains a model with a contrastive loss and its data module; the
callbacks that record and log its training are the training layer's (`gatherlab.runs.lightning`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

from gatherlab.components.data import GlobalBatchSampler, PairDataset

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
