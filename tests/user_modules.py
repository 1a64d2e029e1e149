"""A user's SimCLR as public SSL code writes it, for the sweeps of ``module=external`` (and
``data=external``): a LightningModule with an MLP backbone, a projection head with ``BatchNorm1d``,
NT-Xent over the batch gathered from every rank by an autograd-aware all_gather (exact), SGD; and
a small map-style data set of Gaussian view pairs."""

from __future__ import annotations

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from standins import GatherLayer
from torch import nn


class SimCLRWithBatchNorm(L.LightningModule):
    """SimCLR: backbone, projection head with batch norm, NT-Xent over the global batch. Each
    rank's loss is the mean over its own rows, so the mean over ranks is the 1-device loss; its
    batch norm uses the rank's own statistics, as ``nn.BatchNorm1d`` does."""

    def __init__(self, dim: int = 8, hidden: int = 32, out: int = 16, temperature: float = 0.5,
                 lr: float = 0.1, dropout: float = 0.0):  # fmt: skip
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(dropout))
        self.head = nn.Sequential(
            nn.Linear(hidden, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, out)
        )
        self.temperature, self.lr = temperature, lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch, batch_idx):
        view0, view1 = batch
        z0, z1 = F.normalize(self(view0), dim=1), F.normalize(self(view1), dim=1)
        rank = 0
        z0_all, z1_all = z0, z1
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            rank = dist.get_rank()
            z0_all = torch.cat(GatherLayer.apply(z0.contiguous()), dim=0)
            z1_all = torch.cat(GatherLayer.apply(z1.contiguous()), dim=0)
        local, total = len(z0), len(z0_all)
        logits = torch.cat([z0, z1]) @ torch.cat([z0_all, z1_all]).T / self.temperature
        own = torch.arange(local, device=logits.device) + rank * local  # rows in the global batch
        self_columns = torch.cat([own, own + total])
        positives = torch.cat([own + total, own])
        rows = torch.arange(2 * local, device=logits.device)
        logits = logits.index_put((rows, self_columns), torch.tensor(float("-inf")).to(logits))
        return F.cross_entropy(logits, positives)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class GaussianPairs(torch.utils.data.Dataset):
    """Two noisy views of standard normal points, all drawn from ``seed`` when built (float32)."""

    def __init__(self, num_samples: int = 256, dim: int = 8, noise: float = 0.5, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        points = torch.randn(num_samples, dim, generator=generator)
        self.view0 = points + noise * torch.randn(num_samples, dim, generator=generator)
        self.view1 = points + noise * torch.randn(num_samples, dim, generator=generator)

    def __len__(self) -> int:
        return len(self.view0)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.view0[index], self.view1[index]


class NotALightningModule(nn.Module):
    """A plain ``nn.Module``: no training_step, no optimizer."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 2)
