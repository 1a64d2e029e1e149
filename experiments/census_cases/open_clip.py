"""The census's cases of open-clip-torch 3.3.0 (the newest release): ``ClipLoss`` (through
``public_code.OpenClipForCheck``), ``SigLipLoss`` with each of its exchanges,
``DistillClipLoss`` and ``CoCaLoss``, with their distributed flags."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from public_code import OPEN_CLIP, OpenClipForCheck, open_clip_loss_module
from torch import nn

from census_cases.common import Case, Fix, flags_text, root_of


class SigLipForCheck(nn.Module):
    """OpenCLIP's released ``SigLipLoss(rank, world_size, **flags)`` (from the release at
    ``root``, by default `OPEN_CLIP`) as ``loss(z0, z1)``: z0 the image features, z1 the text
    features, both normalised (the model normally does it), with SigLIP's initial logit scale
    (``exp(log 10)``) and bias (−10) held here, learnt with ``learn_scale_bias``."""

    def __init__(self, root=None, rank=0, world_size=1, learn_scale_bias=False, **flags):
        super().__init__()
        module = open_clip_loss_module(root_of(root, "open-clip-torch", OPEN_CLIP))
        self.loss = module.SigLipLoss(rank=rank, world_size=world_size, **flags)
        scale, bias = torch.tensor(10.0).log(), torch.tensor(-10.0)
        if learn_scale_bias:
            self.logit_scale, self.logit_bias = nn.Parameter(scale), nn.Parameter(bias)
        else:
            self.register_buffer("logit_scale", scale)
            self.register_buffer("logit_bias", bias)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        z0, z1 = F.normalize(z0, dim=-1), F.normalize(z1, dim=-1)
        return self.loss(z0, z1, self.logit_scale.exp(), self.logit_bias)


class CoCaForCheck(nn.Module):
    """OpenCLIP's released ``CoCaLoss`` (weights 1 and 1, ``pad_id=0``, as its training script
    sets them by default) as ``loss(z0, z1)``, its two losses summed as the training script sums
    them: the contrastive part on z0 (image) and z1 (text) normalised, logit scale 1/0.07; the
    caption part on logits made from z1 (its 16 values as 4 tokens × 4 classes) and labels made
    from z0's signs (token t: 2·[z0[2t] > 0] + [z0[2t+1] > 0], a class 0…3 fixed by the sample;
    class 0 is the pad, ignored), so that each rank holds its own number of pad tokens as real
    captions do."""

    def __init__(self, root=None, rank=0, world_size=1, **flags):
        super().__init__()
        module = open_clip_loss_module(root_of(root, "open-clip-torch", OPEN_CLIP))
        self.loss = module.CoCaLoss(
            caption_loss_weight=1.0, clip_loss_weight=1.0, rank=rank, world_size=world_size,
            **flags,
        )  # fmt: skip
        self.register_buffer("logit_scale", torch.tensor(1 / 0.07).log())

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        signs = (z0.detach()[:, :8] > 0).long().view(-1, 4, 2)
        labels = 2 * signs[..., 0] + signs[..., 1]
        logits = z1.view(-1, 4, 4)
        image, text = F.normalize(z0, dim=-1), F.normalize(z1, dim=-1)
        clip, caption = self.loss(image, text, logits, labels, self.logit_scale.exp())
        return clip + caption


class DistillClipForCheck(nn.Module):
    """OpenCLIP's released ``DistillClipLoss(rank, world_size, **flags)``, its two losses summed
    as the training script sums them: the student's features z0 (image) and z1 (text)
    normalised, logit scale 1/0.07; the teacher's, the same views detached and reversed along
    the feature dimension (a fixed other embedding of the same samples), normalised, logit scale
    1/0.07."""

    def __init__(self, root=None, rank=0, world_size=1, **flags):
        super().__init__()
        module = open_clip_loss_module(root_of(root, "open-clip-torch", OPEN_CLIP))
        self.loss = module.DistillClipLoss(rank=rank, world_size=world_size, **flags)
        self.register_buffer("logit_scale", torch.tensor(1 / 0.07).log())

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        image, text = F.normalize(z0, dim=-1), F.normalize(z1, dim=-1)
        teacher = [F.normalize(z.detach().flip(1), dim=-1) for z in (z0, z1)]
        scale = self.logit_scale.exp()
        contrastive, distill = self.loss(image, text, scale, *teacher, scale)
        return contrastive + distill


def _clip(
    loss: str,
    factory: type[nn.Module],
    flags: dict[str, Any],
    fix: Fix | None = None,
    repro: str = "",
    note: str = "",
) -> Case:
    return Case("open-clip-torch", OPEN_CLIP, loss, flags_text(flags), factory, flags, fix=fix,
                repro=repro, note=note)  # fmt: skip


COCA_TOKENS = Fix(
    "the caption loss summed over the rank's tokens and divided by the non-pad tokens of all "
    "ranks (all_reduce), times W, instead of the mean over the rank's non-pad tokens",
    "open_clip/coca_tokens.patch",
)
GATHER_WITH_GRAD = "gather_with_grad=True (a row below)"
CASES = [
    _clip("ClipLoss", OpenClipForCheck, {}, note=GATHER_WITH_GRAD),
    _clip("ClipLoss", OpenClipForCheck, {"local_loss": True}, note=GATHER_WITH_GRAD),
    _clip("ClipLoss", OpenClipForCheck, {"gather_with_grad": True}),
    _clip("ClipLoss", OpenClipForCheck, {"local_loss": True, "gather_with_grad": True}),
    _clip("ClipLoss", OpenClipForCheck, {"learn_logit_scale": True}, note=GATHER_WITH_GRAD),
    *(_clip("SigLipLoss", SigLipForCheck, {"dist_impl": impl})
      for impl in ("bidir", "shift", "reduce", "gather")),
    _clip("SigLipLoss", SigLipForCheck, {"learn_scale_bias": True}),
    _clip("DistillClipLoss", DistillClipForCheck, {}, note=GATHER_WITH_GRAD),
    _clip("DistillClipLoss", DistillClipForCheck, {"gather_with_grad": True}),
    _clip("DistillClipLoss", DistillClipForCheck, {"local_loss": True, "gather_with_grad": True}),
    _clip("CoCaLoss", CoCaForCheck, {}, note=GATHER_WITH_GRAD),
    _clip("CoCaLoss", CoCaForCheck, {"gather_with_grad": True}, COCA_TOKENS, "coca_caption.py"),
    _clip("CoCaLoss", CoCaForCheck, {"local_loss": True, "gather_with_grad": True}, COCA_TOKENS,
          "coca_caption.py"),
]  # fmt: skip
