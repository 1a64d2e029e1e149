"""Models and optimizers that distribute themselves, as sharded training code builds them (no
gatherlab imports), for the check of a plain step or update (``--step``, ``--update``): the check
trains them as their factories made them, never wrapped in DDP again, and reads the whole
gradient and weights from their shards.

- ``build_fsdp2``: ``plain_steps.build_model`` with FSDP2's ``fully_shard`` on each of its two
  blocks and on the whole, over a ``cpu`` DeviceMesh of every rank (on one device: the plain
  model): exact;
- ``zero_sgd``: SGD as ``ZeroRedundancyOptimizer`` on W ranks (each rank steps its share of the
  parameters and broadcasts them), plain SGD on one device: exact with DDP's averaged gradient.
"""

from __future__ import annotations

import plain_steps
import torch
import torch.distributed as dist
from torch import nn


def _ranks() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def build_fsdp2(dim: int = 8, reshard_after_forward: bool = True) -> nn.Module:
    model = plain_steps.build_model(dim)
    if _ranks() > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (_ranks(),))
        for block in model:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def zero_sgd(parameters, lr: float = 0.01) -> torch.optim.Optimizer:
    if _ranks() > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(parameters, optimizer_class=torch.optim.SGD, lr=lr)
    return torch.optim.SGD(parameters, lr=lr)
