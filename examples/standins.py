"""Stand-ins for patterns found in public losses, written here in our own words and code (plain
torch and torch.distributed, their own gathers and constructor arguments, no gatherlab imports),
for ``gatherlab.check`` to diagnose. Each states a pattern; none is a released file. Whether the
released code behaves as its pattern does is checked on the released files themselves, by
``experiments/public_code.py`` (docs/results.md, "Checks of public code"). The verdict each should
get follows from docs/design.md §1; the tests state it independently.

- ``GatherLayerNTXent``: NT-Xent in the local style (the pattern of lightly's ``NTXentLoss`` with
  ``gather_distributed=True``): the loss pairs the rank's own rows, both views, with the gathered
  columns of both views, leaves each row's own embedding out, and finds each row's positive at the
  rank's offset. Its gather's backward sums every rank's gradient of each slice
  (``summing_gather``, the pattern lightly adopted in PR #1531). Exact.
- ``Pre1531NTXent``: the same loss, gathered by a backward that keeps the own slice: the rank gets
  the gradient its own loss gives its own rows, none of what the other ranks' losses give them
  (lightly's pattern before PR #1531). Biased. ``OwnSliceGather`` is that gather alone.
- ``ClipStyleLoss``: the pattern of OpenCLIP's ``ClipLoss``: ``rank``/``world_size`` at
  construction, ``forward(image_features, text_features, logit_scale)``, a symmetric
  cross-entropy between the two towers; by default the features are gathered without gradient and
  the live local tensor is put back in its slot. Checked through ``ClipLossForCheck``, a wrapper
  that normalises the features and holds the scale. With ``local_loss=False`` every rank computes
  the full loss: 1/W. With ``local_loss=True`` each rank scores its own rows against all columns:
  biased. With ``gather_with_grad=True`` (a gather whose backward sums): exact. With a learnt logit
  scale and the default flags: biased, since the scale's own gradient is complete on every rank
  while the embeddings' is 1/W.
- ``LocallyStandardisedBarlowTwins``: Barlow Twins whose embeddings are standardised with the
  rank's own batch statistics before an exact gather: the loss itself differs.
- ``MocoStyleGlobalLoss``: features gathered without any gradient (the pattern of MoCo's
  ``concat_all_gather``), then a loss of the gathered tensors only: no gradient reaches the model.
- ``CompensatedGlobalLoss``: a gather whose backward multiplies by W "to undo DDP's average" on
  top of a sum: W.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from summing_gather import SummingGather
from torch import nn


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _concatenated(x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x`` stacked along the rows in rank order (no autograd of its own)."""
    pieces = [torch.empty_like(x) for _ in range(_world()[1])]
    dist.all_gather(pieces, x.contiguous())
    return torch.cat(pieces)


def _own_rows(ctx, x: torch.Tensor) -> None:
    """Remembers which rows of the gathered tensor are this rank's."""
    rank = _world()[0]
    ctx.own = slice(rank * len(x), (rank + 1) * len(x))


class OwnSliceGather(torch.autograd.Function):
    """Forward: every rank's rows, in rank order. Backward: the rank keeps the own slice of the
    gradient its own loss gave; what the other ranks' losses give its rows is never sent."""

    @staticmethod
    def forward(ctx, x):
        _own_rows(ctx, x)
        return _concatenated(x)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.own]


class TimesWGather(SummingGather):
    """``SummingGather`` whose backward also multiplies by the world size "to undo DDP's average",
    on top of a sum that already does: every gradient is W times one device's."""

    @staticmethod
    def backward(ctx, grad):
        return SummingGather.backward(ctx, grad) * _world()[1]


def gather_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """A gather function ``x -> gathered x`` as a user writes one (for ``--gather``)."""
    if _world()[1] == 1:
        return tensor
    return SummingGather.apply(tensor)


@torch.no_grad()
def gather_without_gradient(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's rows, detached: nothing flows back through them."""
    return _concatenated(tensor)


class GatherLayerNTXent(nn.Module):
    """NT-Xent, local style: this rank's rows against the gathered columns (see the module's
    docstring); ``gather_distributed=False`` scores the rank's rows against themselves."""

    gather = staticmethod(SummingGather.apply)

    def __init__(self, temperature: float = 0.5, gather_distributed: bool = True):
        super().__init__()
        self.temperature = temperature
        self.gather_distributed = gather_distributed

    def forward(self, out0: torch.Tensor, out1: torch.Tensor) -> torch.Tensor:
        n = len(out0)
        view0, view1 = F.normalize(out0, dim=1), F.normalize(out1, dim=1)
        rank, world_size = _world()
        if not (self.gather_distributed and world_size > 1):
            rank, world_size = 0, 1
        columns0, columns1 = (
            (self.gather(view0), self.gather(view1)) if world_size > 1 else (view0, view1)
        )
        m = n * world_size  # the columns of one view
        rows = torch.cat([view0, view1])  # 2n rows: the own samples' view 0, then their view 1
        similarity = rows @ torch.cat([columns0, columns1]).T / self.temperature  # (2n, 2m)
        samples = torch.arange(n) + rank * n  # the own samples' place in the global batch
        itself = torch.cat([samples, samples + m])  # the column of each row's own embedding
        positive = torch.cat([samples + m, samples])  # the column of its other view
        kept = torch.ones_like(similarity, dtype=torch.bool)
        kept[torch.arange(2 * n), itself] = False
        similarity = similarity[kept].view(2 * n, 2 * m - 1)
        # with ``itself`` left out, a positive to its right moves one column to the left
        target = positive - (positive > itself).long()
        return F.cross_entropy(similarity, target)


class Pre1531NTXent(GatherLayerNTXent):
    """The same NT-Xent, gathered by ``OwnSliceGather``."""

    gather = staticmethod(OwnSliceGather.apply)


class ClipStyleLoss(nn.Module):
    """The CLIP-style loss of the module's docstring: its flags, its signature, its gathers."""

    def __init__(
        self,
        local_loss: bool = False,
        gather_with_grad: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ):
        super().__init__()
        self.local_loss, self.gather_with_grad = local_loss, gather_with_grad
        self.rank, self.world_size = rank, world_size

    def columns(self, features: torch.Tensor) -> torch.Tensor:
        """Every rank's features. Without ``gather_with_grad`` they carry no gradient, except,
        for the full matrix, this rank's own, put back live into its slot."""
        if self.gather_with_grad:
            return SummingGather.apply(features)
        gathered = list(gather_without_gradient(features).split(len(features)))
        if not self.local_loss:
            gathered[self.rank] = features
        return torch.cat(gathered)

    def forward(self, image_features, text_features, logit_scale):
        images, texts, first = image_features, text_features, 0
        all_images, all_texts = images, texts
        if self.world_size > 1:
            all_images, all_texts = self.columns(images), self.columns(texts)
            if self.local_loss:  # own rows, every column; the positives at the rank's offset
                first = self.rank * len(images)
            else:  # every rank scores the full matrix
                images, texts = all_images, all_texts
        target = torch.arange(len(images)) + first
        image_to_text = F.cross_entropy(logit_scale * images @ all_texts.T, target)
        text_to_image = F.cross_entropy(logit_scale * texts @ all_images.T, target)
        return (image_to_text + text_to_image) / 2


class ClipLossForCheck(nn.Module):
    """The wrapper a CLIP-style loss needs for the check (the one ``experiments/public_code.py``
    writes for OpenCLIP's released ``ClipLoss``, here around ``ClipStyleLoss``): gatherlab calls
    ``loss(z0, z1)``; the CLIP-style loss also takes the logit scale, and the model normally
    normalises the features. ``rank`` and ``world_size`` are named so that gatherlab passes them."""

    def __init__(self, rank=0, world_size=1, learn_logit_scale=False, **flags):
        super().__init__()
        self.loss = ClipStyleLoss(rank=rank, world_size=world_size, **flags)
        scale = torch.tensor(1 / 0.07).log()
        if learn_logit_scale:
            self.logit_scale = nn.Parameter(scale)
        else:
            self.register_buffer("logit_scale", scale)

    def forward(self, z0, z1):
        z0, z1 = F.normalize(z0, dim=-1), F.normalize(z1, dim=-1)
        return self.loss(z0, z1, self.logit_scale.exp())


class LocallyStandardisedBarlowTwins(nn.Module):
    """Barlow Twins: the cross-correlation of the two views' standardised embeddings pushed to the
    identity (off the diagonal weighted by ``lambda_param``); the statistics are the rank's own."""

    def __init__(self, lambda_param: float = 5e-3):
        super().__init__()
        self.lambda_param = lambda_param

    def forward(self, z_a: torch.Tensor, z_b: torch.Tensor) -> torch.Tensor:
        standardised = [(z - z.mean(0)) / z.std(0) for z in (z_a, z_b)]  # this rank's statistics
        if _world()[1] > 1:
            standardised = [SummingGather.apply(z) for z in standardised]
        a, b = standardised
        correlation = a.T @ b / len(a)
        identity = torch.eye(len(correlation), dtype=torch.bool)
        squared = (correlation - identity.to(correlation.dtype)).pow(2)
        return squared[identity].sum() + self.lambda_param * squared[~identity].sum()


class MocoStyleGlobalLoss(nn.Module):
    """A global InfoNCE of queries against keys over the batch gathered without any gradient."""

    def __init__(self, temperature: float = 0.2):
        super().__init__()
        self.temperature = temperature

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        q, k = F.normalize(q, dim=1), F.normalize(k, dim=1)
        if _world()[1] > 1:
            q, k = gather_without_gradient(q), gather_without_gradient(k)
        logits = q @ k.T / self.temperature
        return F.cross_entropy(logits, torch.arange(len(q)))


# --- losses that break the contract ---------------------------------------------------------------


class PerSampleLoss(nn.Module):
    """Returns one value per sample (``reduction="none"``), not a scalar."""

    def forward(self, out0, out1):
        return (out0 - out1).pow(2).sum(1)


class NanLoss(nn.Module):
    def forward(self, out0, out1):
        return (out0 - out1).pow(2).mean() * float("nan")


class FailsOnRankOne(nn.Module):
    """Raises on rank 1 only, after rank 0 has entered a collective."""

    def forward(self, out0, out1):
        if _world()[0] == 1:
            raise RuntimeError("rank-local failure")
        return gather_with_grad(out0 - out1).pow(2).mean()


class CompensatedGlobalLoss(nn.Module):
    """A global loss (every rank computes it in full) through ``TimesWGather``."""

    def forward(self, out0, out1):
        if _world()[1] > 1:
            out0, out1 = TimesWGather.apply(out0), TimesWGather.apply(out1)
        return (out0 - out1).pow(2).mean()


class PermutedGatheredFeatures(nn.Module):
    """A loss that uses its gathered features through a permutation, as an image-text loss that
    gathers (B, tokens, D) features and transposes them does: each rank's rows (B, 2, 8) gathered
    with the gather given, then every rank the same weighted sum of the transposed (N, 8, 2)
    batch, divided by N. The gradient the gather's backward receives is not contiguous."""

    def __init__(self, gather):
        super().__init__()
        self.gather = gather
        self.register_buffer(
            "weights", torch.randn(16, 8, 2, generator=torch.Generator().manual_seed(1)).double()
        )

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        gathered = self.gather(z0.reshape(len(z0), 2, 8))
        transposed = gathered.permute(0, 2, 1)
        return (transposed * self.weights[: len(gathered)]).sum() / len(gathered) + 0 * z1.sum()
