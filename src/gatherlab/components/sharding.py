"""How the lab distributes gatherlab's module over its ranks (``conf/strategy/``; docs/checking.md
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
- ``tp``: the model split over the ``tensor_parallel`` ranks of each data-parallel group (torch's
  ``parallelize_module`` with the model's own ``tensor_parallel_plan``, over the tensor-parallel
  mesh of Lightning's ``ModelParallelStrategy``), then FSDP2 over the data-parallel mesh as
  ``fsdp2``. The ranks of a data-parallel group hold its rows, and each rank's loss is its own
  part of them (1/W of the global batch), so the backward through the DTensors sums the group's
  shares and FSDP2 averages over the groups: tensor_parallel times the gradient of the mean over
  W; the model's gradients are divided by ``tensor_parallel`` after each backward. With
  ``sequence_parallel`` the rows are split before the norm too, whose gradient is then a partial
  sum over the group that torch all-reduces (a ``Partial`` DTensor redistributed to
  ``Replicate``); ``reduce_norm: false`` declares each rank's partial sum reduced without
  reducing it, so each rank steps its own: Megatron's sequence-parallel LayerNorm bug (a trap).
- ``ep``: a mixture of experts (``model=moe``) whose experts are spread over the ranks
  (``expert_parallel`` on the data-parallel mesh of Lightning's ``ModelParallelStrategy``: each
  rank computes its own experts' rows, sent to it by every rank), every rank holding every
  parameter. After each backward one all-reduce averages every gradient over the ranks, zeros
  where a rank computed none: a replicated parameter's mean, as DDP's, and an expert's gradient,
  which its rank alone computed summed over every rank's rows, divided by W. With
  ``scale_experts: false`` the experts' gradients are left summed, W times one device's (a trap).
- ``pp``: the model cut into pipeline stages over ``pipeline_parallel`` ranks, trained by
  ``PipelineModule`` (`gatherlab.components.pipeline`, which reads the pipeline's fields:
  ``schedule``, ``micro_batches``, ``scale_grads``, ``sum_tied``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from gatherlab.core import terms
from gatherlab.ranks import world

__all__ = ["Sharding"]

_VIEW_WARNING = r"FSDP2-wrapped module \(FSDP\w+\) returned a view tensor"


@dataclass(frozen=True)
class Sharding:
    """A ``conf/strategy/`` option, what each of its fields means in the module docstring."""

    name: str = terms.Strategy.DDP
    reshard_after_forward: bool = True
    divide_factor: float | None = None
    reduce_outside: bool = True
    tensor_parallel: int = 1
    sequence_parallel: bool = True
    reduce_norm: bool = True
    pipeline_parallel: int = 1
    schedule: str = "1f1b"
    micro_batches: int = 1
    scale_grads: bool = True
    sum_tied: bool = True
    scale_experts: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", terms.Strategy(self.name))

    @property
    def shards(self) -> bool:
        """Whether the module parallelises its model itself (in ``configure_model``) and finishes
        its gradients after each backward: ``fsdp2``, ``tp``, ``ep``."""
        return self.name in (terms.Strategy.FSDP2, terms.Strategy.TP, terms.Strategy.EP)

    @property
    def tensor_parallel_size(self) -> int:
        """The ranks of a tensor-parallel group: ``tensor_parallel`` under ``tp``, else 1."""
        return self.tensor_parallel if self.name == terms.Strategy.TP else 1

    @property
    def pipeline_parallel_size(self) -> int:
        """The ranks of a pipeline: ``pipeline_parallel`` under ``pp``, else 1."""
        return self.pipeline_parallel if self.name == terms.Strategy.PP else 1

    def shard(self, model: nn.Module, mesh) -> None:
        """Under ``tp``, ``model`` split over ``mesh["tensor_parallel"]`` by its plan; then FSDP2
        over ``mesh["data_parallel"]``: each of its modules that holds parameters of its own, then
        the model itself (the order FSDP2's documentation asks: inner modules first)."""
        from torch.distributed.fsdp import fully_shard

        if self.name == terms.Strategy.EP:  # the experts over the data-parallel ranks, no FSDP2
            model.expert_parallel(mesh["data_parallel"].get_group())
            return
        if self.name == terms.Strategy.TP:
            from torch.distributed.tensor.parallel import parallelize_module

            plan = model.tensor_parallel_plan(self.tensor_parallel, self.sequence_parallel)
            parallelize_module(model, mesh["tensor_parallel"], plan)
            _quiet_tensor_parallel()
        held = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
        for module in [*(m for m in held if m is not model), model]:
            fully_shard(
                module, mesh=mesh["data_parallel"], reshard_after_forward=self.reshard_after_forward
            )
            if self.divide_factor is not None:
                module.set_gradient_divide_factor(self.divide_factor)
        if self.name == terms.Strategy.TP and not self.reduce_norm:
            for module in held:  # after fully_shard's: its pre-forward puts the whole parameters
                module.register_forward_pre_hook(_PartialsLeftUnreduced())

    def after_backward(self, model: nn.Module, outside: Iterable[nn.Parameter]) -> None:
        """After a backward on a sharded model: under ``tp`` its gradients divided by
        ``tensor_parallel`` (see the module docstring); with ``reduce_outside``, the gradients
        of ``outside`` (parameters of no sharded module: the loss's) averaged over the ranks, in
        one all-reduce each."""
        if not self.shards or not dist.is_initialized():
            return
        if self.name == terms.Strategy.EP:
            self._experts_after_backward(model, outside)
            return
        if self.tensor_parallel_size > 1:
            for parameter in model.parameters():
                if parameter.grad is not None:
                    parameter.grad.div_(self.tensor_parallel_size)
        if not self.reduce_outside:
            return
        for parameter in outside:
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad, op=dist.ReduceOp.AVG)

    def _experts_after_backward(self, model: nn.Module, outside: Iterable[nn.Parameter]) -> None:
        """Under ``ep``: every gradient of ``model`` and ``outside`` averaged over the ranks in
        one all-reduce, zeros where a rank has none (see the module docstring); without
        ``scale_experts`` the experts' then multiplied by W (left summed: the trap)."""
        parameters = [*model.parameters(), *outside]
        flat = torch.cat([
            torch.zeros(p.numel(), dtype=p.dtype, device=p.device) if p.grad is None
            else p.grad.reshape(-1) for p in parameters
        ])  # fmt: skip
        dist.all_reduce(flat, op=dist.ReduceOp.AVG)
        for parameter, piece in zip(parameters, flat.split([p.numel() for p in parameters]),
                                    strict=True):  # fmt: skip
            parameter.grad = piece.view_as(parameter).clone()
        if not self.scale_experts:
            for parameter in model.experts.parameters():
                parameter.grad.mul_(dist.get_world_size())

    def optimizer(
        self, factory: Callable[..., torch.optim.Optimizer], parameters: Iterable[nn.Parameter]
    ) -> torch.optim.Optimizer:
        """The optimizer ``factory`` builds over ``parameters``; under ``zero`` on several ranks,
        inside ``ZeroRedundancyOptimizer`` (which calls ``factory`` on each rank's share)."""
        if self.name != terms.Strategy.ZERO or not dist.is_initialized():
            return factory(parameters)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(list(parameters), optimizer_class=factory)


def _quiet_tensor_parallel() -> None:
    """Two warnings off in a rank that trains ``tp``, each given on every rank at every step,
    neither about a result (every run is compared with one device, docs/checking.md §10):

    - FSDP2's, that a module returned a view (a plan's output is ``DTensor.to_local``'s view; an
      in-place write to it would skip a hook): the module writes nothing into its embeddings;
    - torch's log line that reading a tensor-parallel parameter or gradient whole under FSDP2
      takes two all-gathers in sequence (`world.quiet_two_gathers`)."""
    warnings.filterwarnings("ignore", message=_VIEW_WARNING)
    world.quiet_two_gathers()


class _PartialsLeftUnreduced:
    """A forward pre-hook (registered after FSDP2's, which puts the whole parameters in place):
    on each parameter of its module, once, a gradient hook that declares a gradient that is a
    partial sum over the tensor-parallel ranks (a ``Partial`` DTensor: the sequence-parallel
    norm's) reduced without reducing it (``DTensor.from_local`` of the rank's own partial sum as
    ``Replicate``), so that neither FSDP2 nor the optimizer reduces it: each rank steps its own
    partial sum (Megatron's sequence-parallel LayerNorm bug, the trap ``reduce_norm: false``)."""

    def __init__(self) -> None:
        self.hooked: list[nn.Parameter] = []  # FSDP2 keeps one whole parameter for the run

    def __call__(self, module: nn.Module, args) -> None:
        for parameter in module.parameters(recurse=False):
            if not any(parameter is hooked for hooked in self.hooked):
                self.hooked.append(parameter)
                parameter.register_hook(_partial_declared_reduced)


def _partial_declared_reduced(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` with each ``Partial`` placement declared ``Replicate``, its values unreduced."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if not isinstance(grad, DTensor) or not any(isinstance(p, Partial) for p in grad.placements):
        return grad
    placements = [Replicate() if isinstance(p, Partial) else p for p in grad.placements]
    return DTensor.from_local(grad.to_local(), grad.device_mesh, placements, run_check=False)
