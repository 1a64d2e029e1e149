"""The loss form (`gatherlab.runs.spec.Form`): a loss trained on a small model with plain DDP, no
Lightning (the same arithmetic in a fraction of the start-up), in float64 (docs/checking.md §6).

The model and the loss are one module (`Whole`), as a LightningModule holds them: DDP sees one
forward per backward and averages the loss's own parameters (a learnt temperature) too. On a
simulated rank (`gatherlab.ranks.simworld`) there is no DDP: the gradients are averaged after the
backward (`average`). `build`, `value`, `backward` and `average` are also the steps of the check's
measurement of one gradient (`gatherlab.check.measure`).

A loss that calls the model itself (`calls_model`: it defines ``model_for(model)``, the module its
training hands it, such as GradCache's losses, which embed in mini-batches and embed again inside
their backward) is given that module and the views, ``loss(module, view0, view1, …)``; DDP then
wraps that module alone, as a trainer wraps the model such a loss holds, so that each of the
loss's calls of it is one of DDP's forwards; the model's forward is then the loss's to call, not
cut into row blocks (docs/checking.md §6, "A loss that calls the model itself").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gatherlab.components.factory import Inputs, Recipe
from gatherlab.core import runfiles
from gatherlab.core.terms import Precision
from gatherlab.ranks import simworld, watched, world
from gatherlab.runs import precision
from gatherlab.runs.spec import RunSpec
from gatherlab.runs.steplog import StepLog

__all__ = [
    "Batch", "Loss", "LossContractError", "ModelFactory", "Whole", "average", "backward", "build",
    "calls_model", "value",
]  # fmt: skip

ModelFactory = Callable[[], nn.Module]
Batch = tuple[torch.Tensor, torch.Tensor]


class LossContractError(ValueError):
    """The loss broke its contract: ``loss(out0, out1)`` must return a finite scalar tensor."""


def calls_model(loss: Any) -> bool:
    """Whether ``loss`` calls the model itself: it defines ``model_for(model)``, the module that
    its training hands it in place of the bare model (the model behind the interface the loss
    calls, such as a dict of features in and a dict of embeddings out); it is then called as
    ``loss(module, view0, view1, *inputs)`` and embeds the views through the module as often as
    it does in training."""
    return callable(getattr(loss, "model_for", None))


class Whole(nn.Module):
    """The model and the loss as one module, as the LightningModule holds them: DDP sees one
    forward per backward, and averages the loss's own parameters (a learnt temperature) too.
    A loss with further ``inputs`` (`Inputs`, made for the global batch) is given the rows of
    them that its views hold: ``rows`` of the global batch when set (a one-device forward of
    some rows, `gatherlab.check.hypotheses`), else this rank's own. A loss that calls the model
    itself (`calls_model`) is given ``model`` as ``loss.model_for(model)`` makes it (``model``
    here; DDP-wrapped on real ranks by `build`) and the views, not their embeddings."""

    def __init__(
        self, model: nn.Module, loss: nn.Module, row_blocks: int = 1, inputs: Inputs | None = None
    ):
        super().__init__()
        self.calls_model = calls_model(loss)
        if self.calls_model:
            model = loss.model_for(model)
        self.model, self.loss, self.row_blocks, self.inputs = model, loss, row_blocks, inputs
        self.rows: slice | torch.Tensor | None = None

    def forward(self, view0: torch.Tensor, view1: torch.Tensor) -> torch.Tensor:
        if self.calls_model:  # the loss embeds the views itself, through the model it is given
            args, kwargs = self.given(view0)
            return self.loss(self.model, view0, view1, *args, **kwargs)
        # in row blocks: the floor's perturbation of a low precision (`runs.precision.RowBlocks`)
        out0 = precision.blocked(self.model, self.row_blocks, view0)
        out1 = precision.blocked(self.model, self.row_blocks, view1)
        args, kwargs = self.given(out0)
        return self.loss(out0, out1, *args, **kwargs)

    def given(self, out0: torch.Tensor) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The further inputs of the rows ``out0`` holds (none without ``inputs``)."""
        if self.inputs is None:
            return (), {}
        rows = world.own_rows(self.inputs.batch) if self.rows is None else self.rows
        held = len(range(self.inputs.batch)[rows]) if isinstance(rows, slice) else len(rows)
        if held != len(out0):
            raise LossContractError(
                f"the views hold {len(out0)} rows, the inputs given with them {held} (made for "
                f"a global batch of {self.inputs.batch}); allowed: inputs made for the global "
                "batch the views are drawn from"
            )
        return self.inputs.of_rows(rows, out0)


def build(
    loss: Recipe,
    model_factory: ModelFactory,
    seed: int,
    distributed: bool,
    in_precision: str = Precision.FLOAT64,
    row_blocks: int = 1,
) -> tuple[Whole, nn.Module]:
    """The model (its weights drawn from ``seed``) and the loss as one module on this rank's
    device, its parameters in ``in_precision``'s dtype (float64 by default), its model's forward
    in ``row_blocks`` row blocks (the floor's perturbation, `runs.precision.RowBlocks`); and the
    module as this rank trains it: in DDP when ``distributed`` on real ranks, bare on one device
    and on a simulated rank. For a loss that calls the model itself (`calls_model`) that module
    is the model and the loss unwrapped, and DDP wraps the module the loss calls, on real ranks;
    such a loss may hold no trainable parameter of its own (no DDP would average it): refused."""
    torch.manual_seed(seed)
    model = model_factory()
    whole = Whole(model, loss(), row_blocks, loss.inputs)
    whole = whole.to(world.device(), precision.dtype(in_precision))
    # DDP as Lightning configures it (every parameter must get a gradient: ``backward`` checks);
    # a simulated rank averages the gradients itself after its backward (``average``)
    real_ddp = distributed and simworld.size() is None
    if whole.calls_model:
        models = {id(p) for p in whole.model.parameters()}
        own = [name for name, p in whole.loss.named_parameters()
               if p.requires_grad and id(p) not in models]  # fmt: skip
        if own:
            raise LossContractError(
                f"the loss calls the model itself and has a trainable parameter of its own "
                f"({own[0]}), which no DDP would average; allowed: a loss whose parameters are "
                "the model's, or frozen"
            )
        if real_ddp:  # as a trainer wraps the model that such a loss holds
            whole.model = watched.visible(DistributedDataParallel(whole.model))
        return whole, whole
    wrapped = watched.visible(DistributedDataParallel(whole)) if real_ddp else whole
    return whole, wrapped


def backward(whole: nn.Module, loss: torch.Tensor, distributed: bool) -> None:
    """``loss.backward()`` when a gradient can flow at all. Under DDP, a parameter left without a
    gradient while others have one means its bucket was never averaged: that is refused (a DDP
    training run of such a model fails at its next step) instead of measured."""
    if loss.requires_grad:
        loss.backward()
        if distributed:
            _check_every_parameter_has_a_gradient(whole)


def average(whole: nn.Module, distributed: bool) -> None:
    """A simulated rank's DDP: the gradients averaged over ranks, which a real rank's DDP did
    during its backward. The caller has let go of the loss's graph first: the other ranks compute
    while this one waits, and W graphs kept alive would hold W times the memory."""
    if distributed and simworld.size() is not None:
        simworld.average(list(whole.parameters()))


def _check_every_parameter_has_a_gradient(whole: nn.Module) -> None:
    missing = [name for name, p in whole.named_parameters() if p.requires_grad and p.grad is None]
    if missing and len(missing) < sum(1 for p in whole.parameters() if p.requires_grad):
        raise LossContractError(
            f"parameter {missing[0]} gets no gradient on rank {world.rank()} while others "
            "do; DDP cannot average such a model (use every parameter in the forward)"
        )


def value(
    wrapped: nn.Module,
    view0: torch.Tensor,
    view1: torch.Tensor,
    in_precision: str = Precision.FLOAT64,
) -> torch.Tensor:
    """The loss of two views through ``wrapped`` in ``in_precision`` (the views put in its dtype,
    the forward under its autocast), a scalar; `LossContractError` when it is no finite scalar
    tensor."""
    wanted = precision.dtype(in_precision)
    with precision.autocast(in_precision, view0.device):
        result = wrapped(view0.to(wanted), view1.to(wanted))
    if not isinstance(result, torch.Tensor) or result.numel() != 1:
        shape = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
        raise LossContractError(
            f"the loss returned {shape}; allowed: a scalar tensor (wrap a loss of another "
            "signature in a module whose forward(out0, out1) returns one)"
        )
    if not torch.isfinite(result).all():
        raise LossContractError(
            f"the loss returned {float(result.detach())}; allowed: a finite value"
        )
    return result.reshape(())


@dataclass(frozen=True)
class Loss:
    """A loss trained on a small model (``model``, built after the spec's seed) by
    ``optimizer(parameters)`` on fixed global batches of view pairs (``batches``, one per step:
    the spec's data is None); rank r takes the r-th contiguous slice of each."""

    loss: Recipe
    model: ModelFactory
    optimizer: Callable[..., torch.optim.Optimizer]
    batches: Sequence[Batch]

    def train_on_rank(self, spec: RunSpec) -> runfiles.Trained:
        """Train ``spec.steps`` steps here: plain DDP on this rank of the process group (or of the
        simulated world), the bare module on one device. Returns each step's global loss
        (`gatherlab.runs.steplog`), no first gradient (None), and the final parameters (the
        model's, then the loss's own)."""
        distributed = world.size() > 1
        rows = world.own_rows(len(self.batches[0][0])) if distributed else slice(None)
        whole, wrapped = build(
            self.loss, self.model, spec.seed, distributed, spec.precision, spec.row_blocks
        )
        step = self.optimizer(whole.parameters())
        recorder = StepLog()
        device = world.device()
        for index, (view0, view1) in enumerate(self.batches[: spec.steps]):
            step.zero_grad()
            loss = value(wrapped, view0[rows].to(device), view1[rows].to(device), spec.precision)
            backward(whole, loss, distributed)
            recorder.loss(loss, index, world.rank())
            del loss
            average(whole, distributed)
            step.step()
        recorder.finish(whole.parameters())
        return recorder.trained()
