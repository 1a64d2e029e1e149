"""Plain PyTorch training steps written the way public self-supervised code writes them (a model
factory, a step function, torch's optimizer, no Lightning, no gatherlab imports), for the check of
a training step's plain form (``--step``, docs/checking.md §10). What a correct check finds:

- ``training_step`` with ``build_model()``: SimCLR's NT-Xent over the batch gathered with an
  autograd all-gather whose backward sums every rank's gradient of its slice (``summing_gather``):
  exact;
- ``build_model(batchnorm=True)``: the projection head of the SimCLR paper with ``BatchNorm1d``,
  per-rank statistics under DDP: the loss differs, culprit ``batchnorm``;
- ``build_model(dropout=0.2)``: dropout in the head, masks from each process's generator:
  culprit ``dropout``;
- ``augmenting_step`` on ``Points``: the two views drawn in the step from the global generator
  (as GPU augmentation pipelines apply them to the batch): culprit ``step_randomness``;
- ``own_slice_step``: each rank's own rows as anchors against the second views gathered with a
  gather whose backward keeps only the gradient of the rank's own slice (lightly's
  ``GatherLayer`` before PR #1531, ``OwnSliceGather``): biased, departing at that backward;
- ``Pairs`` / ``Points``: fixed Gaussian points (and two noisy views of them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from summing_gather import SummingGather, gather
from torch import nn


# The data, then the model and the steps that train it.
class Points(torch.utils.data.Dataset):
    def __init__(self, size: int = 64, dim: int = 8):
        self.points = torch.randn(size, dim, generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.points[index]


class Pairs(Points):
    def __init__(self, size: int = 64, dim: int = 8):
        super().__init__(size, dim)
        noise = torch.Generator().manual_seed(8)
        self.views = [self.points + 0.1 * torch.randn(self.points.shape, generator=noise)
                      for _ in range(2)]  # fmt: skip

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.views[0][index], self.views[1][index]


def nt_xent(z0: torch.Tensor, z1: torch.Tensor, temperature: float = 0.5) -> torch.Tensor:
    z = F.normalize(torch.cat([gather(z0), gather(z1)]), dim=1)
    logits = z @ z.T / temperature
    logits = logits.masked_fill(torch.eye(len(z), dtype=torch.bool, device=z.device), -torch.inf)
    n = len(z) // 2
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(n)]).to(z.device)
    return F.cross_entropy(logits, targets)


def build_model(dim: int = 8, batchnorm: bool = False, dropout: float = 0.0) -> nn.Module:
    head = [nn.Linear(32, 32)]
    if batchnorm:
        head.append(nn.BatchNorm1d(32))
    head.append(nn.ReLU())
    if dropout:
        head.append(nn.Dropout(dropout))
    head.append(nn.Linear(32, 16))
    return nn.Sequential(
        nn.Sequential(nn.Linear(dim, 32), nn.ReLU(), nn.Linear(32, 32)),  # backbone
        nn.Sequential(*head),  # projection head
    )


def training_step(model: nn.Module, batch) -> torch.Tensor:
    x0, x1 = batch
    z0, z1 = model(torch.cat([x0, x1])).chunk(2)  # one forward for both views
    return nt_xent(z0, z1)


def augmenting_step(model: nn.Module, batch) -> torch.Tensor:
    x0 = batch + 0.1 * torch.randn_like(batch)  # the views drawn here, on the whole batch
    x1 = batch + 0.1 * torch.randn_like(batch)
    return training_step(model, (x0, x1))


def returns_nothing(model: nn.Module, batch) -> None:
    model(batch[0])


def returns_per_sample(model: nn.Module, batch) -> torch.Tensor:
    return model(batch[0]).pow(2).mean(dim=1)


def builds_a_dict(dim: int = 8) -> dict:
    return {"backbone": nn.Linear(dim, 32)}


class OwnSliceGather(SummingGather):
    """`SummingGather`'s forward; a backward that keeps the rank's own slice of the gathered rows'
    gradient, the other ranks' gradients of that slice dropped."""

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.own]


def own_slice_step(model: nn.Module, batch) -> torch.Tensor:
    """The rank's first views as anchors, every rank's second views gathered as candidates: a
    mean over the rank's own rows, as a local loss takes it."""
    x0, x1 = batch
    z0, z1 = model(torch.cat([x0, x1])).chunk(2)
    z0, z1 = F.normalize(z0, dim=1), F.normalize(z1, dim=1)
    grouped = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if grouped else 0
    candidates = OwnSliceGather.apply(z1) if grouped else z1
    targets = torch.arange(len(z0)) + rank * len(z0)
    return F.cross_entropy(z0 @ candidates.T / 0.5, targets)
