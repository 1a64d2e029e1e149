"""How the lab distributes gatherlab's module over its ranks (``conf/strategy/``; docs/design.md
§10 "Sharded code"): `Sharding`, what ``ContrastiveModule`` asks of it at each point of training.

- ``ddp``: Lightning's DDP averages every gradient (the default; nothing to do here).
- ``fsdp2``: the model's modules that hold parameters, then the model, each ``fully_shard``-ed
  over the ranks (``configure_model``, on the data-parallel mesh of Lightning's
  ``ModelParallelStrategy``). A parameter outside the model (the loss's learnt temperature) is in
  no sharded module, so FSDP2 never reduces its gradient: with ``reduce_outside`` (the default)
  it is averaged over the ranks after each backward, as DDP would; without it each rank steps its
  own gradient (the trap, §10). ``divide_factor``: FSDP2's ``set_gradient_divide_factor`` on
  every sharded module (1.0: the gradients summed over the ranks, not averaged, a trap).
- ``zero``: DDP with the optimizer in torch's ``ZeroRedundancyOptimizer`` (each rank steps the
  parameters it owns and broadcasts them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from gatherlab.core import terms

__all__ = ["Sharding"]


@dataclass(frozen=True)
class Sharding:
    """A ``conf/strategy/`` option, what each of its fields means in the module docstring."""

    name: str = terms.Strategy.DDP
    reshard_after_forward: bool = True
    divide_factor: float | None = None
    reduce_outside: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", terms.Strategy(self.name))

    @property
    def shards(self) -> bool:
        return self.name == terms.Strategy.FSDP2

    def shard(self, model: nn.Module, mesh) -> None:
        """FSDP2 on ``model`` over ``mesh``: each of its modules that holds parameters of its
        own, then the model itself (the order FSDP2's documentation asks: inner modules first)."""
        from torch.distributed.fsdp import fully_shard

        held = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
        for module in [*(m for m in held if m is not model), model]:
            fully_shard(module, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
            if self.divide_factor is not None:
                module.set_gradient_divide_factor(self.divide_factor)

    def reduce_outside_model(self, parameters: Iterable[nn.Parameter]) -> None:
        """After a backward under FSDP2 with ``reduce_outside``: the gradients of ``parameters``
        (those of no sharded module) averaged over the ranks, in one all-reduce each."""
        if not (self.shards and self.reduce_outside) or not dist.is_initialized():
            return
        for parameter in parameters:
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad, op=dist.ReduceOp.AVG)

    def optimizer(
        self, factory: Callable[..., torch.optim.Optimizer], parameters: Iterable[nn.Parameter]
    ) -> torch.optim.Optimizer:
        """The optimizer ``factory`` builds over ``parameters``; under ``zero`` on several ranks,
        inside ``ZeroRedundancyOptimizer`` (which calls ``factory`` on each rank's share)."""
        if self.name != terms.Strategy.ZERO or not dist.is_initialized():
            return factory(parameters)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(list(parameters), optimizer_class=factory)
