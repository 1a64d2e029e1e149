"""Models and optimizers that distribute themselves, as sharded training code builds them (no
gatherlab imports), for the check of a plain step or update (``--step``, ``--update``): the check
trains them as their factories made them, never wrapped in DDP again, and reads the whole
gradient and weights from their shards.

- ``build_fsdp2``: ``plain_steps.build_model`` with FSDP2's ``fully_shard`` on each of its two
  blocks and on the whole, over a ``cpu`` DeviceMesh of every rank (on one device: the plain
  model): exact;
- ``zero_sgd``: SGD as ``ZeroRedundancyOptimizer`` on W ranks (each rank steps its share of the
  parameters and broadcasts them), plain SGD on one device: exact with DDP's averaged gradient;
- ``temperature_step`` with ``build_fsdp2_temperature_outside``: SimCLR's local NT-Xent (each rank's
  own anchors against the gathered batch) with a learnt
  temperature that sits on the root, which is not sharded: FSDP2 reduces the network's gradient,
  nobody the temperature's, and each rank steps with its own (the cause ``unreduced``);
- ``temperature_step`` with ``build_ddp_temperature_outside``: the same with the network in DDP
  and the temperature beside it, outside DDP's module;
- ``temperature_step`` with ``build_ddp_temperature_outside`` and ``zero_sgd``: the owner of the
  temperature steps it with its own gradient and broadcasts it (``unreduced`` too);
- ``build_fsdp2_divided``: FSDP2's gradient divide factor 1 on every module: every gradient W times
  one device's;
- ``raw_temperature_step`` with ``build_fsdp2_temperature_inside(reshard_root=True)``: the
  sharded root's temperature used as it is after the forward, a DTensor mixed with plain tensors:
  torch raises, and the check names the parameter;
- ``own_slice_temperature_step``: the same loss gathered by a gather whose backward keeps the own
  slice (the old GatherLayer's rule): its temperature is unreduced too, but reducing it leaves the
  model's gradient biased, so ``unreduced`` is not the cause.
"""

from __future__ import annotations

import math

import plain_steps
import standins
import torch
import torch.distributed as dist
import torch.nn.functional as F
from summing_gather import gather
from torch import nn


def _ranks() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _mesh_device() -> str:
    """The device type of the ranks' mesh: their GPUs in an NCCL group, else the CPU."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def build_fsdp2(dim: int = 8, reshard_after_forward: bool = True) -> nn.Module:
    model = plain_steps.build_model(dim)
    if _ranks() > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(_mesh_device(), (_ranks(),))
        for block in model:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def zero_sgd(parameters, lr: float = 0.01) -> torch.optim.Optimizer:
    if _ranks() > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(parameters, optimizer_class=torch.optim.SGD, lr=lr)
    return torch.optim.SGD(parameters, lr=lr)


class WithTemperature(nn.Module):
    """A network and a learnt temperature (its log) beside it, as CLIP-style models hold one."""

    def __init__(self, net: nn.Module, temperature: float = 0.5) -> None:
        super().__init__()
        self.net = net
        # one element, not a scalar: fully_shard shards a parameter along its first dimension
        self.log_temperature = nn.Parameter(torch.tensor([math.log(temperature)]))

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.net(rows)


def build_with_temperature(dim: int = 8) -> nn.Module:
    return WithTemperature(plain_steps.build_model(dim))  # DDP holds all of it (the check's)


def build_fsdp2_temperature_inside(
    dim: int = 8, divide_factor: float | None = None, reshard_root: bool | None = None
) -> nn.Module:
    """The temperature on the root, which is sharded too: FSDP2 reduces every gradient. With
    ``divide_factor`` 1 on every sharded module, FSDP2 sums instead of averaging: W times."""
    model = WithTemperature(build_fsdp2(dim))
    if _ranks() > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(_mesh_device(), (_ranks(),))
        if reshard_root is None:
            fully_shard(model, mesh=mesh)
        else:
            fully_shard(model, mesh=mesh, reshard_after_forward=reshard_root)
        for module in model.modules():
            if divide_factor is not None and hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(divide_factor)
    return model


def build_fsdp2_temperature_outside(dim: int = 8) -> nn.Module:
    return WithTemperature(build_fsdp2(dim))  # the root, holding the temperature, not sharded


def build_ddp_temperature_outside(dim: int = 8, dtype: str = "float64") -> nn.Module:
    net = plain_steps.build_model(dim).to(getattr(torch, dtype))  # DDP's buckets take its dtype
    if _ranks() > 1:
        net = nn.parallel.DistributedDataParallel(net)
    return WithTemperature(net)  # the temperature outside DDP's module


def local_nt_xent(
    z0: torch.Tensor, z1: torch.Tensor, temperature: torch.Tensor, gathered=gather
) -> torch.Tensor:
    """NT-Xent of the rank's own anchors against every rank's embeddings (lightly's local
    style, ``gathered`` by a gradient-summing gather): with DDP's average over the ranks, the
    whole batch's loss."""
    rank = dist.get_rank() if _ranks() > 1 else 0
    rows = len(z0)
    z = F.normalize(torch.cat([gathered(z0), gathered(z1)]), dim=1)
    n = len(z) // 2
    own = torch.cat([torch.arange(rank * rows, (rank + 1) * rows)] * 2)
    own[rows:] += n  # the own rows of view 1
    logits = z[own] @ z.T / temperature
    logits[torch.arange(2 * rows), own] = -torch.inf  # an anchor is not its own candidate
    positives = torch.cat([own[rows:], own[:rows]])
    return F.cross_entropy(logits, positives)


def temperature_step(model: nn.Module, batch) -> torch.Tensor:
    x0, x1 = batch
    z0, z1 = model(torch.cat([x0, x1])).chunk(2)
    return local_nt_xent(z0, z1, _temperature(model).exp())


def divided_temperature_step(model: nn.Module, batch) -> torch.Tensor:
    """``temperature_step`` divided by W on top of DDP's or FSDP's average: every gradient 1/W."""
    return temperature_step(model, batch) / _ranks()


def _temperature(model: nn.Module) -> torch.Tensor:
    """The learnt log temperature, whole (a sharded root's is a ``DTensor`` outside forward)."""
    parameter = getattr(model, "module", model).log_temperature
    return parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter


def own_slice_temperature_step(model: nn.Module, batch) -> torch.Tensor:
    x0, x1 = batch
    z0, z1 = model(torch.cat([x0, x1])).chunk(2)
    return local_nt_xent(z0, z1, _temperature(model).exp(), standins.OwnSliceGather.apply)


def build_fsdp2_divided(dim: int = 8) -> nn.Module:
    """``build_fsdp2`` with FSDP2's gradient divide factor 1 on every sharded module: its
    reduce-scatter sums over the ranks instead of averaging, every gradient W times one device's."""
    model = build_fsdp2(dim)
    if _ranks() > 1:
        for module in model.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(1.0)
    return model


def raw_temperature_step(model: nn.Module, batch) -> torch.Tensor:
    x0, x1 = batch
    z0, z1 = model(torch.cat([x0, x1])).chunk(2)
    return local_nt_xent(z0, z1, model.log_temperature.exp())  # a DTensor outside the forward
