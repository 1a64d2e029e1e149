"""The LightningModule that trains a model with a contrastive loss and its data module; the
callbacks that record and log its training are the training layer's (`gatherlab.runs.fit`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

from gatherlab.components.accumulation import Accumulation, micro_batches
from gatherlab.components.data import GlobalBatchSampler, PairDataset
from gatherlab.components.rowblocks import blocked
from gatherlab.components.sharding import Sharding
from gatherlab.ranks import world

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class ContrastiveModule(L.LightningModule):
    """Embeds both views and applies the loss; ``training_step`` returns the rank's local loss
    (what its backward needs; `StepLogCallback` records the steps).

    ``loss`` is a module, or a factory (``gatherlab.components.factory.Recipe``) that each
    rank calls in ``setup``, once its process group exists and before DDP wraps the module, so a
    loss that reads its rank and world size at construction gets them, and its parameters are
    trained.

    ``accumulation`` and ``micro_batches`` (K) say how the rank's rows make one update
    (`gatherlab.components.accumulation`): ``none`` trains with Lightning's automatic optimisation;
    ``naive`` and ``cached`` with its manual optimisation, the gradients kept on each rank during
    the K passes and averaged over the ranks once, before the step (what DDP's reduction computes).

    ``sharding`` says how the module is distributed over the ranks (`Sharding`: DDP, FSDP2 or
    ZeRO); it shards the model in ``configure_model`` under Lightning's ``ModelParallelStrategy``.
    """

    def __init__(
        self,
        model: nn.Module,
        loss: nn.Module | Callable[[], nn.Module],
        optimizer: OptimizerFactory,
        encode_second_view: bool = True,
        accumulation: str = Accumulation.NONE,
        micro_batches: int = 1,
        row_blocks: int = 1,
        sharding: Sharding | None = None,
    ):
        super().__init__()
        self.model = model
        self.row_blocks = row_blocks  # the floor's perturbation of a low precision (§2)
        if isinstance(loss, nn.Module):
            self.loss, self.loss_factory = loss, None
        else:
            self.loss, self.loss_factory = None, loss
        self.optimizer_factory = optimizer
        self.encode_second_view = encode_second_view
        self.accumulation = Accumulation(accumulation)
        if self.accumulation == Accumulation.NONE and micro_batches != 1:
            raise ValueError(
                f"micro_batches={micro_batches} with accumulation=none; allowed: "
                "accumulation=naive or cached, or micro_batches=1"
            )
        self.micro_batches = micro_batches
        self.automatic_optimization = self.accumulation == Accumulation.NONE
        self.sharding = sharding or Sharding()

    def setup(self, stage: str) -> None:
        if self.loss is None:
            self.loss = self.loss_factory()

    @property
    def tensor_parallel_size(self) -> int:
        """The ranks of each tensor-parallel group that Lightning's ``ModelParallelStrategy``
        makes for this module (``ranks.launch``): ``strategy.tensor_parallel`` under ``tp``,
        else 1."""
        return self.sharding.tensor_parallel_size

    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy`` (``fsdp2`` or ``tp`` on several ranks): the model split
        over its tensor-parallel mesh (``tp``) and sharded over its data-parallel mesh; anything
        else trains the module as it is."""
        if self.sharding.shards and self.device_mesh is not None:
            self.sharding.shard(self.model, self.device_mesh)

    def on_after_backward(self) -> None:
        """Under FSDP2 (``fsdp2``, ``tp``): the model's gradients as the strategy finishes them
        (`Sharding.after_backward`), and those of the parameters outside the model (the loss's),
        which no sharded module holds, averaged over the ranks (unless the strategy says not
        to). One device (no mesh) trains the plain run."""
        if self.sharding.shards and self.device_mesh is not None:
            outside = [] if self.loss is None else list(self.loss.parameters())
            self.sharding.after_backward(self.model, outside)

    def _embed(self, view: torch.Tensor, keys: torch.Tensor | None, view_id: int) -> torch.Tensor:
        """The model's embedding of one view; a model with seeded randomness (dropout) also gets
        each sample's ``[epoch, index, view]``."""
        if keys is not None and getattr(self.model, "takes_sample_keys", False):
            view_column = torch.full_like(keys[:, :1], view_id)
            sample_keys = torch.cat([keys, view_column], dim=1)
            return blocked(self.model, self.row_blocks, view, sample_keys=sample_keys)
        return blocked(self.model, self.row_blocks, view)

    def _embeddings(
        self, view0: torch.Tensor, view1: torch.Tensor, keys: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out0 = self._embed(view0, keys, 0).flatten(1)
        out1 = (self._embed(view1, keys, 1) if self.encode_second_view else view1).flatten(1)
        return out0, out1

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        """``batch``: ``(view0, view1)`` or ``(view0, view1, keys)``, keys ``[epoch, index]``.
        Returns the rank's loss of the step: with ``naive``, the mean of its micro-batches'."""
        view0, view1 = (view.to(self.dtype) for view in batch[:2])
        keys = batch[2] if len(batch) > 2 else None
        if self.automatic_optimization:
            return self.loss(*self._embeddings(view0, view1, keys))
        optimizer = self.optimizers()
        optimizer.zero_grad()
        split = [micro_batches(tensor, self.micro_batches) for tensor in (view0, view1, keys)]
        parts = list(zip(*split, strict=True))
        if self.accumulation == Accumulation.NAIVE:
            loss = self._naive_backward(parts, optimizer)
        else:
            loss = self._cached_backward(parts, optimizer)
        self._average_gradients_over_ranks()
        optimizer.step()
        return loss.detach()

    def _recorded_backward(self, loss: torch.Tensor, optimizer) -> None:
        """The step's one backward through Lightning (``manual_backward``: the callbacks'
        ``on_before_backward`` sees the step's loss once), without DDP's gradient reduction: the
        gradients are averaged once, after the last pass."""
        with optimizer.toggle_model(sync_grad=False):
            self.manual_backward(loss)

    def _naive_backward(self, parts: list[tuple], optimizer) -> torch.Tensor:
        """One backward of loss/K per micro-batch; the last one goes through Lightning, its value
        shifted by the earlier micro-batches' share (a constant: no gradient) to the step's
        loss, the mean of the K micro-batches' losses."""
        count = len(parts)
        earlier = torch.zeros((), dtype=self.dtype, device=self.device)
        for index, (view0, view1, keys) in enumerate(parts):
            share = self.loss(*self._embeddings(view0, view1, keys)) / count
            if index < count - 1:
                share.backward()  # 32/64-true precision (validated): no scaler to apply
                earlier = earlier + share.detach()
            else:
                self._recorded_backward(share + earlier, optimizer)
        return share.detach() + earlier

    def _cached_backward(self, parts: list[tuple], optimizer) -> torch.Tensor:
        """GradCache: every micro-batch's embeddings without grad; the loss on all of them, its
        backward giving the embeddings' gradients (and the loss's own parameters theirs, once);
        then each micro-batch recomputed with grad and backpropagated from its cached gradients.
        """
        with torch.no_grad():
            cached = [self._embeddings(*part) for part in parts]
        out0 = torch.cat([pair[0] for pair in cached]).requires_grad_()
        out1 = torch.cat([pair[1] for pair in cached])
        second_view_learnt = self.encode_second_view
        out1.requires_grad_(second_view_learnt)
        loss = self.loss(out0, out1)
        self._recorded_backward(loss, optimizer)
        sizes = [len(pair[0]) for pair in cached]
        gradients0 = out0.grad.split(sizes)
        gradients1 = out1.grad.split(sizes) if second_view_learnt else [None] * len(parts)
        for part, gradient0, gradient1 in zip(parts, gradients0, gradients1, strict=True):
            again0, again1 = self._embeddings(*part)
            if second_view_learnt:
                torch.autograd.backward([again0, again1], [gradient0, gradient1])
            else:
                torch.autograd.backward(again0, gradient0)
        return loss

    def _average_gradients_over_ranks(self) -> None:
        """Each gradient averaged over the ranks in one collective (Lightning's
        ``strategy.reduce``, a mean); nothing on one device."""
        if self.trainer.world_size == 1:
            return
        held = [p for p in self.parameters() if p.grad is not None]
        flat = torch.cat([p.grad.reshape(-1) for p in held])
        flat = self.trainer.strategy.reduce(flat, reduce_op="mean")
        for parameter, gradient in zip(held, flat.split([p.numel() for p in held]), strict=True):
            parameter.grad.copy_(gradient.view_as(parameter.grad))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.sharding.optimizer(self.optimizer_factory, self.parameters())

    def run_state_dict(self) -> dict[str, torch.Tensor]:
        """What ``final_state.pt`` holds (`StepLogCallback`): the model's weights, a sharded one
        gathered whole (every rank calls this)."""
        return {name: world.whole(value) for name, value in self.model.state_dict().items()}


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
    """The sampler of this trainer's rank: its data-parallel group's slice of each global batch,
    keys ``(epoch, index)`` (docs/design.md §2). The group is the strategy's, as Lightning's own
    distributed sampler takes it (``distributed_sampler_kwargs``): the rank itself under DDP and
    FSDP2; under ``tp`` the ranks of one data-parallel group take the same slice (the model splits
    its rows among them, `NormMLP.tensor_parallel_plan`). One device: the whole batch."""
    group = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {
        "num_replicas": trainer.world_size, "rank": trainer.global_rank,
    }  # fmt: skip
    return GlobalBatchSampler(
        num_samples=num_samples,
        global_batch_size=global_batch_size,
        num_batches=steps,
        rank=group["rank"],
        world_size=group["num_replicas"],
        seed=seed,
        shuffle=shuffle,
        with_epoch=True,
    )
