"""Data sets of view pairs and the sampler that makes every layout see the same global batches.

The sampler follows DESIGN.md §2: one permutation per epoch drawn from (seed, epoch) alone, global
batch k is the k-th contiguous block of it, and rank r takes the r-th contiguous slice of that
block. Gathering the ranks' batches in rank order therefore rebuilds the single-device batch row
for row, whatever the number of ranks.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset


class PairDataset(Dataset):
    """Pairs ``(view0[i], view1[i])`` held in memory.

    ``encode_second_view`` tells the trainer whether view 1 goes through the model too (two
    augmented views) or is a fixed target embedding (the case of lightly PR #1531's test).
    """

    def __init__(self, view0: torch.Tensor, view1: torch.Tensor, encode_second_view: bool = True):
        if len(view0) != len(view1):
            raise ValueError(f"views have {len(view0)} and {len(view1)} samples")
        self.view0, self.view1 = view0, view1
        self.encode_second_view = encode_second_view

    def __len__(self) -> int:
        return len(self.view0)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.view0[index], self.view1[index]


def arange_pairs() -> PairDataset:
    """lightly PR #1531's test: inputs arange(80) as (8, 2, 5), targets arange(32) as (8, 2, 2)."""
    inputs = torch.arange(80, dtype=torch.float64).reshape(8, 2, 5)
    targets = torch.arange(32, dtype=torch.float64).reshape(8, 2, 2)
    return PairDataset(inputs, targets, encode_second_view=False)


def gaussian_pairs(num_samples: int, dim: int, noise: float = 0.5, seed: int = 0) -> PairDataset:
    """Views x + noise·ε₀ and x + noise·ε₁ of standard normal points x, all drawn from ``seed``."""
    if num_samples < 1 or dim < 1:
        raise ValueError(
            f"data.num_samples and data.dim must be positive, got {num_samples}, {dim}"
        )
    generator = torch.Generator().manual_seed(seed)
    points = torch.randn(num_samples, dim, generator=generator, dtype=torch.float64)
    view0 = points + noise * torch.randn(num_samples, dim, generator=generator, dtype=torch.float64)
    view1 = points + noise * torch.randn(num_samples, dim, generator=generator, dtype=torch.float64)
    return PairDataset(view0, view1)


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The sample order of ``epoch``: a permutation drawn from (seed, epoch) alone, or 0..n-1."""
    if not shuffle:
        return np.arange(num_samples)
    return np.random.default_rng((seed, epoch)).permutation(num_samples)


class GlobalBatchSampler:
    """Yields, for ``num_batches`` optimizer steps, this rank's slice of each global batch."""

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        num_batches: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ):
        if global_batch_size % world_size:
            raise ValueError(
                f"global_batch_size={global_batch_size} does not divide by {world_size} devices"
            )
        if global_batch_size > num_samples:
            raise ValueError(
                f"global_batch_size={global_batch_size} exceeds the {num_samples} samples"
            )
        self.num_samples, self.global_batch_size = num_samples, global_batch_size
        self.num_batches, self.rank, self.world_size = num_batches, rank, world_size
        self.seed, self.shuffle = seed, shuffle

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[list[int]]:
        batches_per_epoch = self.num_samples // self.global_batch_size
        local = self.global_batch_size // self.world_size
        order = None
        for step in range(self.num_batches):
            epoch, block = divmod(step, batches_per_epoch)
            if block == 0:
                order = epoch_order(self.num_samples, self.seed, epoch, self.shuffle)
            start = block * self.global_batch_size + self.rank * local
            yield order[start : start + local].tolist()
