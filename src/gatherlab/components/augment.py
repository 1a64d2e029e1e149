"""Seeded random augmentations in torch (no torchvision): every draw for a sample comes from a
generator seeded by (seed, epoch, global sample index, stream), never from a per-process RNG, so a
sample gets the same views whichever rank of whichever layout loads it (docs/design.md §2)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

# Streams of one sample's randomness: each view's augmentation, then dropout masks.
VIEW_STREAMS = (0, 1)
DROPOUT_STREAM = 2


def sample_generator(seed: int, epoch: int, index: int, stream: int) -> torch.Generator:
    """A generator for one sample's draws in one stream, a function of its four arguments only."""
    words = np.random.SeedSequence([seed, epoch, index, stream]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed((int(words[0]) << 32 | int(words[1])) >> 1)


@dataclass(frozen=True)
class Augmentation:
    """A random view of a (C, H, W) image: resized crop with a small rotation (one affine
    resampling), brightness and contrast jitter, additive Gaussian noise.

    ``crop_scale`` bounds the crop's area as a fraction of the image, ``aspect_ratio`` its
    width/height (log-uniform), ``max_rotation`` the rotation in degrees; brightness moves every
    pixel by up to ±``brightness``, contrast scales deviations from the mean by 1 ± ``contrast``.
    """

    crop_scale: tuple[float, float] = (0.6, 1.0)
    aspect_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    max_rotation: float = 15.0
    brightness: float = 0.2
    contrast: float = 0.2
    noise: float = 0.05

    def __post_init__(self) -> None:
        low, high = self.crop_scale
        if not 0 < low <= high <= 1:
            raise ValueError(f"crop_scale must satisfy 0 < low ≤ high ≤ 1, got {self.crop_scale}")
        if not 0 < self.aspect_ratio[0] <= self.aspect_ratio[1]:
            raise ValueError(f"aspect_ratio must be 0 < low ≤ high, got {self.aspect_ratio}")
        for name in ("max_rotation", "brightness", "contrast", "noise"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be non-negative, got {getattr(self, name)}")

    def __call__(self, image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        uniform = torch.rand(7, generator=generator, dtype=torch.float64).tolist()
        area = self.crop_scale[0] + (self.crop_scale[1] - self.crop_scale[0]) * uniform[0]
        log_low, log_high = (math.log(r) for r in self.aspect_ratio)
        ratio = math.exp(log_low + (log_high - log_low) * uniform[1])
        width = min(1.0, math.sqrt(area * ratio))
        height = min(1.0, math.sqrt(area / ratio))
        centre_x = (1 - width) * (2 * uniform[2] - 1)
        centre_y = (1 - height) * (2 * uniform[3] - 1)
        angle = math.radians(self.max_rotation * (2 * uniform[4] - 1))
        cos, sin = math.cos(angle), math.sin(angle)
        theta = torch.tensor(
            [[[width * cos, -height * sin, centre_x], [width * sin, height * cos, centre_y]]],
            dtype=image.dtype,
        )
        grid = F.affine_grid(theta, [1, *image.shape], align_corners=False)
        view = F.grid_sample(image[None], grid, mode="bilinear", align_corners=False)[0]
        view = view + self.brightness * (2 * uniform[5] - 1)
        mean = view.mean()
        view = (view - mean) * (1 + self.contrast * (2 * uniform[6] - 1)) + mean
        noise = torch.randn(view.shape, generator=generator, dtype=view.dtype)
        return view + self.noise * noise
