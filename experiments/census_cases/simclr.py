"""The census's case of simclr 1.0.2 (Spijkervet/SimCLR): ``NT_Xent``, which gathers when
``world_size`` > 1."""

from __future__ import annotations

import torch
from public_code import load
from torch import nn

from census_cases.common import Case, Fix, root_of

SIMCLR = "1.0.2"
SIMCLR_FILES = ("simclr/modules/gather.py", "simclr/modules/nt_xent.py")


class SimclrNTXent(nn.Module):
    """simclr's released ``NT_Xent(batch_size, temperature=0.5, world_size)``, built for the
    batch size of each call (its mask depends on it; a user builds it with the rank's batch
    size); the views as given. It gathers when
    ``world_size`` > 1, which gatherlab passes."""

    def __init__(self, root=None, world_size=1, temperature=0.5):
        super().__init__()
        self.module = load(root_of(root, "simclr", SIMCLR), SIMCLR_FILES, {})
        self.world_size, self.temperature = world_size, temperature
        self.losses: dict[int, nn.Module] = {}

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        if len(z0) not in self.losses:
            self.losses[len(z0)] = self.module.NT_Xent(len(z0), self.temperature, self.world_size)
        return self.losses[len(z0)](z0, z1)


SIMCLR_FIX = Fix(
    "gather each view on its own (z_i, then z_j); sum every rank's gradient in "
    "GatherLayer.backward (all_reduce, then the own slice); mask the positives at "
    "batch_size·world_size + i, not batch_size + i",
    "simclr/nt_xent.patch",
)
CASES = [
    Case("simclr", SIMCLR, "NT_Xent", "world_size=W (gathers)", SimclrNTXent, fix=SIMCLR_FIX,
         repro="simclr_nt_xent.py"),
]  # fmt: skip
