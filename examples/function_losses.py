"""Losses written as plain functions, the way many papers' code writes them (``def loss(z0, z1,
temperature=...)``, no module, no factory), for ``gatherlab.check`` to take as they are written:
``python -m gatherlab.check function_losses:gathered_nt_xent``.

- ``gathered_nt_xent``: NT-Xent over every rank's embeddings, gathered by a backward that sums
  the slices' gradients over the ranks (``summing_gather``), each rank's loss the mean over its
  own rows: exact.
- ``local_sigmoid_loss``: a SigLIP-style pairwise sigmoid loss over the rank's own rows only: its
  negatives are local, the loss differs from one device's.
- ``CallableSigmoidLoss``: the same as a callable object that is no ``nn.Module``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from summing_gather import SummingGather


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gathered_nt_xent(z0: torch.Tensor, z1: torch.Tensor, temperature: float = 0.5) -> torch.Tensor:
    rank, world_size = _world()
    z0, z1 = F.normalize(z0, dim=1), F.normalize(z1, dim=1)
    every0, every1 = (SummingGather.apply(z) for z in (z0, z1)) if world_size > 1 else (z0, z1)
    n = len(z0)
    mine = torch.arange(n) + rank * n  # the own rows' place among every rank's rows
    logits = z0 @ torch.cat([every1, every0]).T / temperature  # a row against both views
    logits[torch.arange(n), len(every1) + mine] = float("-inf")  # not itself
    return F.cross_entropy(logits, mine)


def local_sigmoid_loss(z0: torch.Tensor, z1: torch.Tensor, temperature: float = 0.1):
    z0, z1 = F.normalize(z0, dim=1), F.normalize(z1, dim=1)
    logits = z0 @ z1.T / temperature
    labels = 2 * torch.eye(len(z0), dtype=z0.dtype) - 1  # +1 on the pairs, -1 elsewhere
    return -F.logsigmoid(labels * logits).sum() / len(z0)


class CallableSigmoidLoss:
    """The same local loss as a plain callable object (no ``nn.Module``), built by its class."""

    def __init__(self, temperature: float = 0.1) -> None:
        self.temperature = temperature

    def __call__(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        return local_sigmoid_loss(z0, z1, self.temperature)
