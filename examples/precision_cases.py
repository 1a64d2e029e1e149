"""Code for the check in a low precision (``--precision``, docs/design.md §2, "Low precision"),
written the way public code writes it (no gatherlab imports), with what a correct check finds:

- ``own_rows``: a "gather" that keeps each rank's own rows, so a global loss sees only local
  negatives: its gradient departs from one device's by far more than any precision's floor;
- ``ScaledSlice(epsilon)``: an all-gather whose backward sums every rank's gradient (exact),
  with rank 1's slice then scaled by 1 + epsilon: a departure of a known size, seen in a
  precision only when it is larger than that precision's power;
- ``build_float32_scale``: the plain step's model of ``plain_steps`` whose output its forward
  casts to float32: it cannot run in float64, so it is judged in its own precision;
- ``build_with_batchnorm``: the same model with ``BatchNorm1d``, whose per-rank statistics differ
  from one device's in every precision;
- ``build_loss_returning`` and ``loss_step``: the plain step's model with its NT-Xent inside its
  forward, which returns the loss (a CLIP-style two-tower model does): no floor's row blocks can
  cut it, so a low precision is judged in float64;
- ``Float32TemperatureNTXent``: a global NT-Xent over the gathered batch whose logits it divides
  by its temperature in float32: a loss that cannot run in float64, exact in its precision.
"""

from __future__ import annotations

import plain_steps
import torch
import torch.distributed as dist
from summing_gather import gather
from torch import nn


def own_rows(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's own rows, nothing gathered."""
    return tensor


class ScaledSlice:
    """The exact gather, then rank 1's slice of the gathered rows scaled by 1 + ``epsilon``."""

    def __init__(self, epsilon: float) -> None:
        self.epsilon = epsilon

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        gathered = gather(tensor)
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return gathered
        rows = len(tensor)
        scale = torch.ones(len(gathered), 1, dtype=gathered.dtype, device=gathered.device)
        scale[rows : 2 * rows] = 1 + self.epsilon
        return gathered * scale

    def __repr__(self) -> str:
        return f"ScaledSlice({self.epsilon:g})"


class Float32Scale(nn.Module):
    """``plain_steps.build_model()`` whose output is cast to float32 in its forward and scaled."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.inner = plain_steps.build_model(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.full((16,), 0.5)  # float32 whatever the model's dtype
        return self.inner(x).float() * scale  # the rows' numbers rounded to float32


def build_float32_scale(dim: int = 8) -> nn.Module:
    return Float32Scale(dim)


def build_with_batchnorm(dim: int = 8) -> nn.Module:
    return plain_steps.build_model(dim, batchnorm=True)


class Float32TemperatureNTXent(nn.Module):
    """NT-Xent over every rank's embeddings (an exact gather), its logits divided in float32."""

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        temperature = torch.tensor(0.5)  # float32 whatever the embeddings' dtype
        z = torch.nn.functional.normalize(torch.cat([gather(z0), gather(z1)]), dim=1)
        logits = ((z @ z.T).float() / temperature).to(z.dtype)  # rounded to float32
        logits = logits.masked_fill(torch.eye(len(z), dtype=torch.bool), -torch.inf)
        n = len(z) // 2
        targets = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
        return torch.nn.functional.cross_entropy(logits, targets)


class LossReturning(nn.Module):
    """``plain_steps.build_model()`` and NT-Xent over its two views, its forward the loss."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.inner = plain_steps.build_model(dim)

    def forward(self, x0: torch.Tensor, x1: torch.Tensor) -> torch.Tensor:
        z0, z1 = self.inner(torch.cat([x0, x1])).chunk(2)
        return plain_steps.nt_xent(z0, z1)


def build_loss_returning(dim: int = 8) -> nn.Module:
    return LossReturning(dim)


def loss_step(model: nn.Module, batch) -> torch.Tensor:
    return model(*batch)
