"""The models of the size benchmark (``python -m gatherlab.bench size``, docs/performance.md,
"Checking and recording at real sizes"), built in code, no download: a ResNet-like CNN and a
ViT-like transformer at about 1M, 10M, 25M and 86M parameters (`SIZES`), and the plain
PyTorch training step that trains them the way self-supervised code does (``contrastive_step``:
two views, SimCLR's NT-Xent over the batch gathered with the exact ``fixed`` gather), with its
data (``Views``). Each is a factory the check's ranks import by name (``module:attr``).

The ResNet keeps ResNet-18's shape (a stem, four stages of two basic blocks, widths w, 2w, 4w,
8w, the last three downsampling) with group norm of one group instead of batch norm: batch
norm's per-rank statistics would make every layout differ (the check's ``batchnorm`` culprit),
and the benchmark measures what a check costs, not that. Its parameters grow as w². The ViT
keeps ViT-B/16's block (pre-norm attention and a 4× MLP, 12·d² parameters a block): at d = 768
and 12 blocks, ViT-B's 86M parameters. Both train on small images (`IMAGE`: the ResNet on 8 × 8,
the ViT on 16 × 16 in 8 × 8 patches, 4 tokens and a class token), so that a step of the largest
trains in seconds on two CPU cores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gatherlab.gather import get

__all__ = ["SIZES", "ResNetLike", "ViTLike", "Views", "build", "contrastive_step", "parameters"]

EMBEDDING = 128  # the projection's output: what NT-Xent compares

# Per model, per nominal size: the constructor's arguments (counted: `parameters`).
SIZES: dict[str, dict[str, dict[str, int]]] = {
    "resnet": {
        "1M": {"width": 19},  # 1.03M
        "10M": {"width": 60},  # 10.1M
        "25M": {"width": 95},  # 25.3M
        "86M": {"width": 175},  # 85.6M
    },
    "vit": {
        "1M": {"dim": 128, "depth": 5},  # 1.04M
        "10M": {"dim": 320, "depth": 8},  # 10.0M
        "25M": {"dim": 512, "depth": 8},  # 25.4M
        "86M": {"dim": 768, "depth": 12},  # 85.3M
    },
}
# The side of the square images each model is trained on: small, so that a check's time is mostly
# the parameters' (each parameter sees few positions or tokens a row), the costly side for the
# check's and the recorder's cost per parameter against the training's compute.
IMAGE = {"resnet": 8, "vit": 16}


class _BasicBlock(nn.Module):
    def __init__(self, inputs: int, outputs: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(1, outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(1, outputs)
        self.shortcut = (
            nn.Identity() if stride == 1 and inputs == outputs
            else nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False),
                               nn.GroupNorm(1, outputs))
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(y)) + self.shortcut(x))


class ResNetLike(nn.Module):
    """ResNet-18's layout at base width ``width`` (group norm for batch norm), with a projection
    head of two linear layers to `EMBEDDING`."""

    def __init__(self, width: int = 64):
        super().__init__()
        widths = [width, 2 * width, 4 * width, 8 * width]
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.GroupNorm(1, width), nn.ReLU()
        )
        blocks, inputs = [], width
        for stage, outputs in enumerate(widths):
            stride = 1 if stage == 0 else 2
            blocks += [_BasicBlock(inputs, outputs, stride), _BasicBlock(outputs, outputs, 1)]
            inputs = outputs
        self.backbone = nn.Sequential(*blocks)
        self.head = nn.Sequential(
            nn.Linear(inputs, inputs), nn.ReLU(), nn.Linear(inputs, EMBEDDING)
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.backbone(self.stem(images)).mean(dim=(2, 3))
        return self.head(features)


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.heads, dim // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(batch, tokens, dim))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1, self.attention = nn.LayerNorm(dim), _Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViTLike(nn.Module):
    """ViT-B/16's block ``depth`` times at width ``dim`` (heads of 64), on ``image`` × ``image``
    images cut into 8 × 8 patches, the class token's final features projected to `EMBEDDING`."""

    PATCH = 8

    def __init__(self, dim: int = 768, depth: int = 12, image: int = 32):
        super().__init__()
        tokens = (image // self.PATCH) ** 2
        self.patches = nn.Linear(3 * self.PATCH**2, dim)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.position = nn.Parameter(0.02 * torch.randn(1, tokens + 1, dim))
        self.blocks = nn.Sequential(*[_Block(dim, max(1, dim // 64)) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, EMBEDDING)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        p = self.PATCH
        patches = F.unfold(images, p, stride=p).transpose(1, 2)  # (batch, tokens, 3·p²)
        x = self.patches(patches)
        x = torch.cat([self.cls.expand(len(x), -1, -1), x], dim=1) + self.position
        return self.head(self.norm(self.blocks(x))[:, 0])


def build(model: str = "vit", size: str = "10M") -> nn.Module:
    """The benchmark's ``model`` (resnet, vit) at the nominal ``size`` (1M, 10M, 25M, 86M)."""
    if model not in SIZES or size not in SIZES[model]:
        allowed = ", ".join(f"{m} at {'/'.join(SIZES[m])}" for m in SIZES)
        raise ValueError(f"model {model!r} at size {size!r}; allowed: {allowed}")
    if model == "resnet":
        return ResNetLike(**SIZES[model][size])
    return ViTLike(**SIZES[model][size], image=IMAGE[model])


def parameters(module: nn.Module) -> int:
    """The number of trainable parameters."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


class Views(torch.utils.data.Dataset):
    """``size`` fixed random images of ``image`` × ``image`` pixels and two noisy views of each
    (drawn once, from fixed seeds, so every rank and every run reads the same views)."""

    def __init__(self, size: int = 64, image: int = 16):
        generator = torch.Generator().manual_seed(3)
        base = torch.randn(size, 3, image, image, generator=generator)
        self.views = [base + 0.1 * torch.randn(base.shape, generator=generator) for _ in "ab"]

    def __len__(self) -> int:
        return len(self.views[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.views[0][index], self.views[1][index]


_gather = get("fixed")


def contrastive_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """SimCLR's step: both views in one forward, NT-Xent (temperature 0.5) over the batch gathered
    from every rank with ``fixed`` (exact: each rank's slice gets every rank's gradient)."""
    z0, z1 = model(torch.cat(batch)).chunk(2)
    z = F.normalize(torch.cat([_gather(z0), _gather(z1)]), dim=1)
    own = torch.eye(len(z), dtype=torch.bool, device=z.device)
    logits = (z @ z.T / 0.5).masked_fill(own, -torch.inf)
    n = len(z) // 2
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(n)]).to(z.device)
    return F.cross_entropy(logits, targets)
