"""LightningModules that shard themselves with FSDP2, the way Lightning's documentation asks
(``configure_model``, over ``self.device_mesh``, under its ``ModelParallelStrategy``), for the
check's ``--module … --strategy fsdp2`` (docs/checking.md §10, "Sharded code").

- ``ShardedSimCLR``: ``ssl_modules.SimCLR`` with each linear layer, then the backbone and the
  head, sharded over the data-parallel mesh: exact on any number of ranks.
- ``ShardedSimCLRLearntTemperature``: the same with a learnt temperature held by the module itself,
  in no sharded module: FSDP2 never reduces its gradient, each rank steps its own (a trap).
"""

from __future__ import annotations

import math

import torch
from ssl_modules import SimCLR
from torch import nn
from torch.distributed.fsdp import fully_shard


class ShardedSimCLR(SimCLR):
    def configure_model(self) -> None:
        if self.device_mesh is None:  # one device: the plain module
            return
        mesh = self.device_mesh["data_parallel"]
        for part in (self.backbone, self.projection_head):
            for layer in part:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(part, mesh=mesh)


class ShardedSimCLRLearntTemperature(ShardedSimCLR):
    def __init__(self, lr: float = 0.05, temperature: float = 0.5, dim: int = 8):
        super().__init__(lr, temperature, dim)
        self.log_temperature = nn.Parameter(torch.tensor(math.log(temperature)))

    def training_step(self, batch, batch_index):
        self.criterion.temperature = self.log_temperature.exp()
        return super().training_step(batch, batch_index)
