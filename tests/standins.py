"""Stand-ins for losses found in public code, written the way that code writes them (its own
gathers, its own constructor arguments, no gatherlab imports), for ``gatherlab.check`` to diagnose.
The verdict each should get follows from docs/design.md §1; the tests state it independently.

- ``GatherLayerNTXent``: lightly's NT-Xent with ``gather_distributed=True`` since PR #1531: an
  autograd Function whose backward sums every rank's gradient of each slice. Exact.
- ``ClipStyleLoss``: OpenCLIP's ``ClipLoss`` pattern: ``rank``/``world_size`` at construction,
  features gathered without gradient and the live local tensor put back in its slot
  (``gather_with_grad=False``), ``forward(image_features, text_features, logit_scale)``; checked
  through ``ClipLossForCheck``, the wrapper of docs/results.md (checks of public code). With
  ``local_loss=False`` every rank computes the full loss: 1/W. With ``local_loss=True`` each rank
  takes its own rows against all columns: biased. With ``gather_with_grad=True``
  (``torch.distributed.nn``'s all_gather): exact. With a learnt logit scale and the default flags:
  biased, since the scale's own gradient is complete on every rank while the embeddings' is 1/W.
- ``LocallyStandardisedBarlowTwins``: Barlow Twins whose embeddings are standardised with the rank's
  own batch statistics before an exact gather: the loss itself differs.
- ``MocoStyleGlobalLoss``: MoCo's ``concat_all_gather`` (no gradient at all), then a loss of the
  gathered tensors only: no gradient reaches the model.
- ``CompensatedGlobalLoss``: a gather whose backward multiplies by W "to undo DDP's average" on
  top of a sum: W.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class GatherLayer(torch.autograd.Function):
    """lightly's GatherLayer after PR #1531."""

    @staticmethod
    def forward(ctx, input):
        output = [torch.empty_like(input) for _ in range(dist.get_world_size())]
        dist.all_gather(output, input)
        return tuple(output)

    @staticmethod
    def backward(ctx, *grads):
        all_gradients = torch.stack(grads)
        dist.all_reduce(all_gradients)
        return all_gradients[dist.get_rank()]


class GatherLayerPre1531(torch.autograd.Function):
    """lightly's GatherLayer before PR #1531, as lightly wrote it: the backward keeps only the
    gradient of the own slice that this rank's loss computed."""

    @staticmethod
    def forward(ctx, input):
        ctx.save_for_backward(input)
        output = [torch.empty_like(input) for _ in range(dist.get_world_size())]
        dist.all_gather(output, input)
        return tuple(output)

    @staticmethod
    def backward(ctx, *grads):
        (input,) = ctx.saved_tensors
        grad_out = torch.empty_like(input)
        grad_out[:] = grads[dist.get_rank()]
        return grad_out


def gather_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """A gather function ``x -> gathered x`` as a user writes one (for ``--gather``)."""
    if _world()[1] == 1:
        return tensor
    return torch.cat(GatherLayer.apply(tensor.contiguous()), dim=0)


@torch.no_grad()
def concat_all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """MoCo's helper: all_gather without gradient."""
    gathered = [torch.ones_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor, async_op=False)
    return torch.cat(gathered, dim=0)


def eye_rank(n: int) -> torch.Tensor:
    """lightly's ``eye_rank``: an (n, n·W) mask, True at (i, rank·n + i)."""
    rank, world_size = _world()
    rows = torch.arange(n)
    mask = torch.zeros((n, n * world_size), dtype=torch.bool)
    mask[rows, rank * n + rows] = True
    return mask


class GatherLayerNTXent(nn.Module):
    gather_layer = GatherLayer

    def __init__(self, temperature: float = 0.5, gather_distributed: bool = True):
        super().__init__()
        self.temperature = temperature
        self.gather_distributed = gather_distributed

    def forward(self, out0: torch.Tensor, out1: torch.Tensor) -> torch.Tensor:
        out0, out1 = F.normalize(out0, dim=1), F.normalize(out1, dim=1)
        rank, world_size = _world()
        if self.gather_distributed and world_size > 1:
            out0_large = torch.cat(self.gather_layer.apply(out0), 0)
            out1_large = torch.cat(self.gather_layer.apply(out1), 0)
            diag_mask = eye_rank(len(out0))
        else:
            out0_large, out1_large = out0, out1
            diag_mask = torch.eye(len(out0), dtype=torch.bool)
        logits_00 = out0 @ out0_large.T / self.temperature
        logits_01 = out0 @ out1_large.T / self.temperature
        logits_10 = out1 @ out0_large.T / self.temperature
        logits_11 = out1 @ out1_large.T / self.temperature
        logits_00 = logits_00[~diag_mask].view(len(out0), -1)
        logits_11 = logits_11[~diag_mask].view(len(out0), -1)
        logits_0100 = torch.cat([logits_01, logits_00], dim=1)
        logits_1011 = torch.cat([logits_10, logits_11], dim=1)
        logits = torch.cat([logits_0100, logits_1011], dim=0)
        labels = torch.arange(len(out0)) + rank * len(out0)
        return F.cross_entropy(logits, labels.repeat(2))


class Pre1531NTXent(GatherLayerNTXent):
    """lightly's NT-Xent with the GatherLayer it had before PR #1531."""

    gather_layer = GatherLayerPre1531


class ClipStyleLoss(nn.Module):
    """OpenCLIP's ``ClipLoss``: its constructor flags and its forward signature."""

    def __init__(
        self,
        local_loss: bool = False,
        gather_with_grad: bool = False,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ):
        super().__init__()
        self.local_loss, self.gather_with_grad = local_loss, gather_with_grad
        self.rank, self.world_size = rank, world_size

    def gather_features(self, image_features, text_features):
        if self.gather_with_grad:
            with warnings.catch_warnings():  # torch 2.13 deprecates torch.distributed.nn
                warnings.simplefilter("ignore")
                all_image = torch.cat(torch.distributed.nn.all_gather(image_features), dim=0)
                all_text = torch.cat(torch.distributed.nn.all_gather(text_features), dim=0)
            return all_image, all_text
        gathered_image = [torch.zeros_like(image_features) for _ in range(self.world_size)]
        gathered_text = [torch.zeros_like(text_features) for _ in range(self.world_size)]
        dist.all_gather(gathered_image, image_features)
        dist.all_gather(gathered_text, text_features)
        if not self.local_loss:
            # ensure grads for local rank when all_* features don't have a gradient
            gathered_image[self.rank] = image_features
            gathered_text[self.rank] = text_features
        return torch.cat(gathered_image, dim=0), torch.cat(gathered_text, dim=0)

    def forward(self, image_features, text_features, logit_scale):
        if self.world_size > 1:
            all_image, all_text = self.gather_features(image_features, text_features)
            if self.local_loss:
                logits_per_image = logit_scale * image_features @ all_text.T
                logits_per_text = logit_scale * text_features @ all_image.T
            else:
                logits_per_image = logit_scale * all_image @ all_text.T
                logits_per_text = logits_per_image.T
        else:
            logits_per_image = logit_scale * image_features @ text_features.T
            logits_per_text = logit_scale * text_features @ image_features.T
        labels = torch.arange(logits_per_image.shape[0])
        if self.world_size > 1 and self.local_loss:
            labels = labels + logits_per_image.shape[0] * self.rank
        loss_image = F.cross_entropy(logits_per_image, labels)
        loss_text = F.cross_entropy(logits_per_text, labels)
        return (loss_image + loss_text) / 2


# The wrapper of docs/results.md ("Checks of public code"), with the stand-in in place of
# open_clip's ClipLoss.
class ClipLossForCheck(nn.Module):
    """gatherlab calls loss(z0, z1); ClipLoss also takes the logit scale, and the model normally
    normalises the features. rank and world_size are named so that gatherlab passes them."""

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
    def __init__(self, lambda_param: float = 5e-3):
        super().__init__()
        self.lambda_param = lambda_param

    def forward(self, z_a: torch.Tensor, z_b: torch.Tensor) -> torch.Tensor:
        z_a_norm = (z_a - z_a.mean(0)) / z_a.std(0)  # this rank's batch statistics
        z_b_norm = (z_b - z_b.mean(0)) / z_b.std(0)
        if _world()[1] > 1:
            z_a_norm = torch.cat(GatherLayer.apply(z_a_norm), 0)
            z_b_norm = torch.cat(GatherLayer.apply(z_b_norm), 0)
        c = z_a_norm.T @ z_b_norm / len(z_a_norm)
        on_diag = (torch.diagonal(c) - 1).pow(2).sum()
        off_diag = (c - torch.diag(torch.diagonal(c))).pow(2).sum()
        return on_diag + self.lambda_param * off_diag


class MocoStyleGlobalLoss(nn.Module):
    def __init__(self, temperature: float = 0.2):
        super().__init__()
        self.temperature = temperature

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        q, k = F.normalize(q, dim=1), F.normalize(k, dim=1)
        if _world()[1] > 1:
            q, k = concat_all_gather(q), concat_all_gather(k)
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


class GatherLayerTimesW(GatherLayer):
    """A GatherLayer whose backward also multiplies by the world size "to undo DDP's average", on
    top of a sum that already does: every gradient is W times one device's."""

    @staticmethod
    def backward(ctx, *grads):
        return GatherLayer.backward(ctx, *grads) * dist.get_world_size()


class CompensatedGlobalLoss(nn.Module):
    """A global loss (every rank computes it in full) through ``GatherLayerTimesW``."""

    def forward(self, out0, out1):
        if _world()[1] > 1:
            out0 = torch.cat(GatherLayerTimesW.apply(out0), 0)
            out1 = torch.cat(GatherLayerTimesW.apply(out1), 0)
        return (out0 - out1).pow(2).mean()
