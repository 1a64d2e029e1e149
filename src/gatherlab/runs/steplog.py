"""The one record of a training run's steps, whatever trains it (gatherlab's module and a user's
LightningModule through `gatherlab.runs.fit.StepLogCallback`; a plain PyTorch step, a
whole update and the loss check's loss in `plainstep`, `update` and `loss`): each optimizer step's
local loss (checked finite before its backward), the L2 norm of the gradient the optimizer applies
(after DDP's average), optionally the first step's whole gradient, and when training ends each
step's global loss and the final parameters (`gatherlab.core.runfiles.Trained`).

The global loss of a step is the mean over ranks of the ranks' local losses (docs/design.md §2),
computed one way everywhere: `mean_over_ranks` (``math.fsum`` of the ranks' values over W, the
correctly rounded sum), in the calling process from the ranks' results or inside the ranks after
one all-gather for the whole run (`global_losses`; a collective costs as much as a small model's
step).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from gatherlab.core import runfiles
from gatherlab.ranks import simworld, world
from gatherlab.runs import tensorparallel

log = logging.getLogger(__name__)

__all__ = [
    "NonFiniteLoss",
    "StepLog",
    "flat_gradient",
    "flat_parameters",
    "global_losses",
    "gradient_norm",
    "mean_over_ranks",
]  # fmt: skip


class NonFiniteLoss(FloatingPointError):
    """A NaN or infinite loss or gradient norm (``what``, ``value``): the run stops at ``step``
    on ``rank``; the step is data (``summary.json``'s ``failed_step``), the message names it."""

    def __init__(self, what: str, value: float, step: int, rank: int) -> None:
        super().__init__(f"the {what} is {value} at step {step} (rank {rank})")
        self.what, self.value, self.step, self.rank = what, value, step, rank

    def __reduce__(self) -> tuple:  # sent from a rank to the command as it is (ranks.pool)
        return type(self), (self.what, self.value, self.step, self.rank)


def reduce_gradients(model: nn.Module, names: Iterable[str]) -> None:
    """The gradients of ``model``'s parameters named ``names`` replaced by their mean over the
    ranks (an all-reduce each; nothing on one device): what DDP or FSDP would have done for a
    parameter they do not hold; a DTensor's partial sums made whole over their mesh dimension
    (`tensorparallel.reduced_partial`), as torch's optimizers take them."""
    wanted = set(names)
    if not wanted or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    for name, parameter in model.named_parameters():
        if name not in wanted or parameter.grad is None:
            continue
        if isinstance(parameter.grad, DTensor):  # its partial sums made whole over their group
            parameter.grad = tensorparallel.reduced_partial(parameter.grad)
            continue
        dist.all_reduce(parameter.grad, op=dist.ReduceOp.SUM)
        parameter.grad /= dist.get_world_size()


def flat_gradient(parameters: Iterable[nn.Parameter]) -> torch.Tensor:
    """The gradients of ``parameters`` flattened into one vector, in their order, each whole
    (`gatherlab.ranks.world.whole`: a sharded parameter's gathered from its shards); a parameter
    that got no gradient contributes zeros."""
    return torch.cat(
        [world.whole(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
         for p in parameters]
    ).detach()  # fmt: skip


def gradient_norm(parameters: Iterable[nn.Parameter]) -> float:
    """The L2 norm of `flat_gradient` without flattening it: the norm of the parameters' norms
    (each gradient whole, as `flat_gradient` takes it, every parameter in the same order on every
    rank; its norm in float64); 0 for no parameters."""
    norms = [
        torch.linalg.vector_norm(
            world.whole(p.grad if p.grad is not None else torch.zeros_like(p)).detach()
        ).double()
        for p in parameters
    ]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


def flat_parameters(parameters: Iterable[nn.Parameter], keep: bool = False) -> torch.Tensor:
    """The values of ``parameters`` flattened into one float64 vector on the CPU, each whole
    (`gatherlab.ranks.world.whole`); in their own dtype with ``keep``."""
    flat = torch.cat([world.whole(p.detach()).reshape(-1) for p in parameters])
    return (flat if keep else flat.double()).cpu()


def mean_over_ranks(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Each step's global loss from every rank's local losses (``per_rank[r][step]``): their
    mean over the ranks, summed correctly rounded (``math.fsum``)."""
    return [math.fsum(values) / len(per_rank) for values in zip(*per_rank, strict=True)]


def global_losses(local: Sequence[float]) -> list[float]:
    """Inside a rank: each step's global loss (`mean_over_ranks`) from this rank's local losses
    and every other rank's, all-gathered once for the run (in the simulated world too); on one
    device, the losses as they are."""
    if world.size() == 1:
        return list(local)
    mine = torch.tensor(local, dtype=torch.float64, device=world.device())
    if simworld.size() is not None:  # the virtual ranks' all-gather (rank order)
        every = simworld.gather(mine.reshape(1, -1), "none")
        return mean_over_ranks(every.tolist())
    every = [torch.empty_like(mine) for _ in range(world.size())]
    dist.all_gather(every, mine)
    return mean_over_ranks([values.cpu().tolist() for values in every])


class StepLog:
    """Records every optimizer step of a run on its rank (see the module): call `loss` before the
    step's backward, `gradient` before the optimizer's step, and `trained` when training ends."""

    def __init__(
        self,
        keep_first_gradient: bool = False,
        step_budget_s: float = math.inf,
        steps: int = 0,
        keep_precision: bool = False,
    ):
        self.keep_first_gradient = keep_first_gradient
        self.keep_precision = keep_precision  # the vectors in the parameters' dtype, not float64
        self.step_budget_s, self.planned = step_budget_s, steps
        self._step_began = time.perf_counter()
        self.steps: list[int] = []
        self.local_losses: list[float] = []
        self.grad_norms: list[float] = []
        self.first_gradient: torch.Tensor | None = None
        self.losses: list[float] | None = None
        self.parameters: torch.Tensor | None = None

    def loss(self, loss: torch.Tensor, step: int, rank: int) -> None:
        """The step's local loss; `NonFiniteLoss` for a NaN or an infinity."""
        value = float(loss.detach())
        if not math.isfinite(value):
            raise NonFiniteLoss("loss", value, step, rank)
        self.steps.append(step)
        self.local_losses.append(value)

    def gradient(self, parameters: Iterable[nn.Parameter], step: int, rank: int) -> None:
        """The gradient the optimizer is about to apply: its norm, and the whole of it at the
        first step with ``keep_first_gradient``; `NonFiniteLoss` for a non-finite norm."""
        trainable = [p for p in parameters if p.requires_grad]
        keep = self.keep_first_gradient and self.first_gradient is None
        if keep:  # the whole gradient, flattened once
            gradient = flat_gradient(trainable) if trainable else torch.zeros(0)
            norm = float(torch.linalg.vector_norm(gradient)) if len(gradient) else 0.0
        else:  # its norm alone, from each parameter's: no copy of the whole
            norm = gradient_norm(trainable)
        if not math.isfinite(norm):
            raise NonFiniteLoss("gradient norm", norm, step, rank)
        self.grad_norms.append(norm)
        if keep:
            self.first_gradient = (gradient if self.keep_precision else gradient.double()).cpu()
        self._over_budget(step, rank)

    def start(self) -> None:
        """The first step's clock starts now (by default: when the recorder was made)."""
        self._step_began = time.perf_counter()

    def _over_budget(self, step: int, rank: int) -> None:
        """A warning when this step (since the last one's gradient, or since the recorder was made)
        took longer than ``step_budget_s``: one line, with the steps done and to go, on one device
        or rank 0 only."""
        now = time.perf_counter()
        took, self._step_began = now - self._step_began, now
        if took <= self.step_budget_s or rank != 0:
            return
        if world.size() > 1:
            where = f"rank 0 of {world.size()}"
        else:  # the check's reference runs twice, the second in a one-rank group
            where = "one device in a one-rank group" if dist.is_initialized() else "one device"
        left = f", {self.planned - step - 1} to go" if self.planned else ""
        log.warning(
            "%s: step %d took %.1f s, over the step budget of %g s; %d done%s",
            where, step, took, self.step_budget_s, step + 1, left,
        )  # fmt: skip

    def finish(self, parameters: Iterable[nn.Parameter]) -> None:
        """Training ended: each step's global loss (a collective on W ranks: every rank calls
        this) and the final parameters."""
        self.losses = global_losses(self.local_losses)
        self.parameters = flat_parameters(parameters, self.keep_precision)

    def write(self, run_dir: str | Path, state: dict[str, torch.Tensor]) -> None:
        """Write the run's ``curves.csv`` (step, global loss, rank 0's gradient norm) and its
        ``final_state.pt`` (``state``) into ``run_dir`` (docs/contract.md §5): rank 0's task."""
        rows = zip(self.steps, self.losses or [], self.grad_norms, strict=True)
        runfiles.write_curves(
            run_dir, [{"step": step, "loss": loss, "grad_norm": norm} for step, loss, norm in rows]
        )
        runfiles.write_final_state(run_dir, state)

    def trained(self) -> runfiles.Trained:
        """The run as the checks compare it; a RuntimeError when it ended before its first step."""
        if self.losses is None or self.parameters is None or not self.local_losses:
            raise RuntimeError("training stopped before its first step")
        return runfiles.Trained(self.losses, self.first_gradient, self.parameters)
