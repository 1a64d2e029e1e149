"""LightningModules and data sets written the way public self-supervised code writes them, for the
check of a training step (``gatherlab.check.check_training``, docs/checking.md §10). Each is what a
researcher would bring; none knows gatherlab.

- ``SimCLR``: a backbone and a projection head, a local-style NT-Xent over the batch gathered by
  a gather whose backward sums every rank's gradient (examples/standins.py, the pattern of lightly
  after PR #1531): exact on any number of ranks.
- ``SimCLRWithBatchNorm``: the projection head of the SimCLR paper, with ``BatchNorm1d``: per-rank
  statistics (plain DDP), so W ranks see other normalised embeddings than one device.
- ``SimCLRWithDropout``: dropout in the head; masks drawn from each process's own generator.
- ``SimCLRPre1531``: the same NT-Xent, gathered by a backward that keeps the own slice (the
  pattern of lightly before PR #1531).
- ``BYOL``: an online network with a predictor and an EMA target network (no batch norm), a
  per-sample loss: exact, the target follows the exact gradient it is given.
- ``LightningGatherCLIP``: an encoder and a learnt logit scale, each rank's own rows against the
  batch gathered by Lightning's own ``self.all_gather(z, sync_grads=True)`` (whose backward sums
  every rank's gradient): exact; with ``sync_grads=False`` the other ranks' gradients of the
  rank's rows are dropped: biased.
- ``NotALightningModule``: a plain ``nn.Module`` (no ``training_step``), a mistake to refuse.
- ``GaussianPairs``: two fixed noisy views of Gaussian points. ``AugmentedGaussians``: the same
  points, the views drawn in ``__getitem__`` from the global torch generator, as torchvision's
  transforms draw them.
"""

from __future__ import annotations

import copy

import lightning as L
import torch
import torch.nn.functional as F
from standins import GatherLayerNTXent, Pre1531NTXent
from torch import nn


class SimCLR(L.LightningModule):
    def __init__(self, lr: float = 0.05, temperature: float = 0.5, dim: int = 8):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(dim, 32), nn.ReLU(), nn.Linear(32, 32))
        self.projection_head = self.head()
        self.criterion = self.loss(temperature)
        self.lr = lr

    def head(self) -> nn.Module:
        return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))

    def loss(self, temperature: float) -> nn.Module:
        return GatherLayerNTXent(temperature=temperature, gather_distributed=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection_head(self.backbone(x))

    def training_step(self, batch, batch_index):
        x0, x1 = batch
        return self.criterion(self(x0), self(x1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class SimCLRWithBatchNorm(SimCLR):
    def head(self) -> nn.Module:
        return nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 16))


class SimCLRWithDropout(SimCLR):
    def head(self) -> nn.Module:
        return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 16))


class SimCLRPre1531(SimCLR):
    def loss(self, temperature: float) -> nn.Module:
        return Pre1531NTXent(temperature=temperature, gather_distributed=True)


class BYOL(L.LightningModule):
    def __init__(self, lr: float = 0.05, momentum: float = 0.99, dim: int = 8):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(dim, 32), nn.ReLU(), nn.Linear(32, 32))
        self.projection_head = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
        self.prediction_head = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        self.backbone_momentum = copy.deepcopy(self.backbone)
        self.projection_head_momentum = copy.deepcopy(self.projection_head)
        for parameter in (
            *self.backbone_momentum.parameters(),
            *self.projection_head_momentum.parameters(),
        ):
            parameter.requires_grad = False
        self.lr, self.momentum = lr, momentum

    def forward(self, x):
        return self.prediction_head(self.projection_head(self.backbone(x)))

    @torch.no_grad()
    def forward_momentum(self, x):
        return self.projection_head_momentum(self.backbone_momentum(x))

    def training_step(self, batch, batch_index):
        x0, x1 = batch
        p0, p1 = self(x0), self(x1)
        z0, z1 = self.forward_momentum(x0), self.forward_momentum(x1)
        loss = 2 - F.cosine_similarity(p0, z1).mean() - F.cosine_similarity(p1, z0).mean()
        return {"loss": loss}

    @torch.no_grad()
    def on_train_batch_end(self, outputs, batch, batch_index):
        for online, target in (
            (self.backbone, self.backbone_momentum),
            (self.projection_head, self.projection_head_momentum),
        ):
            for p, q in zip(online.parameters(), target.parameters(), strict=True):
                q.mul_(self.momentum).add_(p, alpha=1 - self.momentum)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class LightningGatherCLIP(L.LightningModule):
    def __init__(self, lr: float = 0.05, dim: int = 8, sync_grads: bool = True):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(dim, 32), nn.ReLU(), nn.Linear(32, 16))
        self.logit_scale = nn.Parameter(torch.tensor(2.0))
        self.lr, self.sync_grads = lr, sync_grads

    def training_step(self, batch, batch_index):
        x0, x1 = batch
        z0 = F.normalize(self.encoder(x0), dim=1)
        z1 = F.normalize(self.encoder(x1), dim=1)
        gathered = self.all_gather(z1, sync_grads=self.sync_grads).reshape(-1, z1.shape[1])
        logits = self.logit_scale.exp() * z0 @ gathered.T
        labels = torch.arange(len(z0)) + self.global_rank * len(z0)
        loss = F.cross_entropy(logits, labels)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class NotALightningModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 2)

    def forward(self, x):
        return self.linear(x)


class GaussianPairs(torch.utils.data.Dataset):
    """``size`` Gaussian points in ``dim`` dimensions, each with two fixed noisy views."""

    def __init__(self, size: int = 256, dim: int = 8, noise: float = 0.5):
        generator = torch.Generator().manual_seed(0)
        self.points = torch.randn(size, dim, generator=generator)
        self.views = [
            self.points + noise * torch.randn(size, dim, generator=generator) for _ in range(2)
        ]
        self.noise = noise

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, index: int):
        return self.views[0][index], self.views[1][index]


class AugmentedGaussians(GaussianPairs):
    """The same points, each view drawn anew from the global generator, as transforms do."""

    def __getitem__(self, index: int):
        point = self.points[index]
        return tuple(point + self.noise * torch.randn_like(point) for _ in range(2))


def gaussian_pairs(size: int = 256, dim: int = 8) -> GaussianPairs:
    """A factory function, as a data module's setup builds its data set."""
    return GaussianPairs(size, dim)
