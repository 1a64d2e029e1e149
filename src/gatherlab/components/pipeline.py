"""How the lab trains a model cut into pipeline stages (``strategy=pp``, docs/checking.md §10,
"Pipeline parallelism in the lab"): `PipelineModule`, a LightningModule whose ``training_step``
runs a ``torch.distributed.pipelining`` schedule over the pipeline ranks; `Schedule`, the schedules
it builds.

Lightning has no pipeline strategy. The module trains under Lightning's ``ModelParallelStrategy``
with manual optimisation: that strategy makes a two-dimensional device mesh of the ranks that
exist and leaves the parallelising to the module; its second dimension, which Lightning names
``tensor_parallel``, holds the module's ``pipeline_parallel`` ranks (rank r's stage r mod P), its
first the data-parallel groups, and its sampler gives every rank of a pipeline that group's rows
(the first stage reads the tokens, the last the targets). At each step:

1. each rank runs the schedule over its stages (`Schedule`: GPipe, 1F1B, or interleaved 1F1B with
   two stages per rank), the group's rows in ``micro_batches`` micro-batches, each micro-batch's
   loss the model's loss of its rows (the mean over its tokens); with ``scale_grads`` the schedule
   divides the summed gradients by the number of micro-batches (torch's default), without it
   every gradient is that many times one device's (a trap);
2. one all-reduce over all the ranks gives every rank the whole model's gradient averaged over the
   data-parallel groups (each parameter's from the rank whose stage holds it, zeros from the
   others) and the step's loss (the last stage's mean of its micro-batches' losses): what one
   device has, so the run's files record it as one device's (its gradient norm, its weights);
3. the tied weight: the first stage embeds with the model's ``embed.weight``, the last stage's
   head reads its own copy; with ``sum_tied`` each copy's gradient is replaced by their sum (what
   Megatron's all-reduce over the embedding group computes) and the copies stay equal; without
   it each copy steps its own part of one device's gradient and they drift apart (a trap);
4. every rank steps the whole model (the pipeline ranks step the same numbers: what each stage
   would step on its own) and the copy.

On one device (no mesh) the module trains the plain run: the whole batch through the whole model,
whatever the strategy says.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from enum import StrEnum

import lightning as L
import torch
import torch.distributed as dist
from torch import nn

from gatherlab.components.sharding import Sharding

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

__all__ = ["PipelineModule", "Schedule"]


class Schedule(StrEnum):
    """The pipeline schedules ``strategy.schedule`` names (``torch.distributed.pipelining``'s):
    ``ScheduleGPipe``, ``Schedule1F1B``, and ``ScheduleInterleaved1F1B`` with two stages per rank
    (rank r holds stages r and r + P)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"

    @property
    def stages_per_rank(self) -> int:
        return 2 if self == Schedule.INTERLEAVED_1F1B else 1

    def built(self, stages: list, micro_batches: int, loss_fn: Callable, scale_grads: bool):
        """torch's schedule over this rank's ``stages``."""
        from torch.distributed import pipelining

        if self == Schedule.INTERLEAVED_1F1B:
            return pipelining.ScheduleInterleaved1F1B(
                stages, micro_batches, loss_fn=loss_fn, scale_grads=scale_grads
            )
        single = pipelining.ScheduleGPipe if self == Schedule.GPIPE else pipelining.Schedule1F1B
        return single(stages[0], micro_batches, loss_fn=loss_fn, scale_grads=scale_grads)


class PipelineModule(L.LightningModule):
    """Trains a language model that cuts itself into stages (``model.pipeline_stages(count,
    head_weight)`` and ``model.tied_weight``: `gatherlab.components.models.TinyLM`) with a
    per-token loss (``loss(logits, targets)`` on the flattened tokens: torch's
    ``CrossEntropyLoss``), as the module docstring says. ``loss`` is a module or a factory that
    each rank calls in ``setup`` (as `ContrastiveModule`'s); ``sharding``: the ``pp`` strategy's
    fields."""

    def __init__(
        self,
        model: nn.Module,
        loss: nn.Module | Callable[[], nn.Module],
        optimizer: OptimizerFactory,
        sharding: Sharding,
    ):
        super().__init__()
        self.model = model
        if isinstance(loss, nn.Module):
            self.loss, self.loss_factory = loss, None
        else:
            self.loss, self.loss_factory = None, loss
        self.optimizer_factory = optimizer
        self.sharding = sharding
        self.schedule = Schedule(sharding.schedule)
        self.automatic_optimization = False
        self._pipeline: _Pipeline | None = None  # built at the first step on several ranks

    def setup(self, stage: str) -> None:
        if self.loss is None:
            self.loss = self.loss_factory()

    @property
    def tensor_parallel_size(self) -> int:
        """The size of the second dimension of the mesh that Lightning's ``ModelParallelStrategy``
        makes for this module (``ranks.launch``): the pipeline's ranks."""
        return self.sharding.pipeline_parallel_size

    def configure_model(self) -> None:
        """Nothing to parallelise here (``ModelParallelStrategy`` asks for the hook): the stages
        are built at the first step, once the precision plugin has converted the model."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer_factory(self.model.parameters())

    def token_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of these rows: ``loss`` over their tokens (logits batch × length × vocabulary,
        targets batch × length)."""
        return self.loss(logits.flatten(0, 1), targets.flatten())

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        """``batch``: ``(tokens, targets)``. One optimizer step; returns the step's loss (the
        global batch's on one device, the data-parallel groups' mean on several ranks)."""
        tokens, targets = batch[0], batch[1]
        optimizer = self.optimizers()
        optimizer.zero_grad()
        if self.device_mesh is None:  # one device: the plain run
            loss = self.token_loss(self.model(tokens), targets)
            self.manual_backward(loss)
            optimizer.step()
            return loss.detach()
        if self._pipeline is None:
            self._pipeline = _Pipeline(self)
        loss = self._pipeline.step(tokens, targets)
        # The schedule ran the backward: the step's loss goes through Lightning's manual_backward
        # as a leaf of its own (no parameter's gradient changes), so that the callbacks'
        # on_before_backward see it once, as they see every other module's.
        self.manual_backward(loss.detach().requires_grad_())
        optimizer.step()
        self._pipeline.step_copy()
        return loss.detach()

    def run_state_dict(self) -> dict[str, torch.Tensor]:
        """What ``final_state.pt`` holds: the model's weights under one device's names (every
        rank holds the whole model, step 4 of the module docstring)."""
        return dict(self.model.state_dict())


class _Pipeline:
    """A rank's stages, their schedule, the last stage's copy of the tied weight and its
    optimizer (steps 1-4 of the module docstring)."""

    def __init__(self, module: PipelineModule):
        from torch.distributed.pipelining import PipelineStage

        self.module, sharding = module, module.sharding
        mesh = module.device_mesh["tensor_parallel"]  # Lightning's name: the pipeline's ranks
        size, rank = mesh.size(), mesh.get_local_rank()
        count = size * module.schedule.stages_per_rank
        self.indices = [rank + size * k for k in range(module.schedule.stages_per_rank)]
        self.is_first, self.is_last = 0 in self.indices, count - 1 in self.indices
        self.tied = module.model.tied_weight
        self.copy = nn.Parameter(self.tied.detach().clone())  # the last stage's head
        self.copy_optimizer = module.optimizer_factory([self.copy])
        modules = module.model.pipeline_stages(count, self.copy)
        stages = [
            PipelineStage(modules[i], i, count, module.device, group=mesh.get_group())
            for i in self.indices
        ]
        self.schedule = module.schedule.built(
            stages, sharding.micro_batches, module.token_loss, sharding.scale_grads
        )
        self.data_parallel = dist.get_world_size() // size
        self.sum_tied = sharding.sum_tied

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Steps 1-3: the schedule, the whole gradient on every rank, the tied copies; returns
        the step's loss."""
        self.copy.grad = None
        losses: list[torch.Tensor] = []
        given = {"target": targets, "losses": losses} if self.is_last else {}
        if self.is_first:
            self.schedule.step(tokens, **given)
        else:
            self.schedule.step(**given)
        parameters = [*self.module.model.parameters(), self.copy]
        here = torch.stack(losses).mean() if self.is_last else None
        flat = torch.cat([
            *(torch.zeros(p.numel(), dtype=p.dtype, device=p.device) if p.grad is None
              else p.grad.reshape(-1) for p in parameters),
            torch.zeros(1, dtype=self.copy.dtype, device=self.copy.device) if here is None
            else here.detach().reshape(1).to(self.copy.dtype),
        ])  # fmt: skip
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= self.data_parallel
        pieces = flat.split([*(p.numel() for p in parameters), 1])
        for parameter, piece in zip(parameters, pieces, strict=False):
            parameter.grad = piece.view_as(parameter).clone()
        if self.sum_tied:
            total = self.tied.grad + self.copy.grad
            self.tied.grad, self.copy.grad = total, total.clone()
        return pieces[-1].reshape(())

    def step_copy(self) -> None:
        """Step 4 for the copy of the tied weight (its own optimizer, outside Lightning's: one
        optimizer step per training step is recorded)."""
        self.copy_optimizer.step()
