"""The census's cases of CoCa-pytorch 0.1.0: the loss of its ``CoCa`` model's forward, released,
then with the labels fixed."""

from __future__ import annotations

import torch
from public_code import load
from torch import nn

from census_cases.common import EINOPS, Case, Fix, importable, root_of

COCA = "0.1.0"
COCA_PACKAGE = "CoCa-pytorch"


class CocaPytorch(nn.Module):
    """CoCa-pytorch's released ``CoCa`` model, its loss as its ``forward(text, image_tokens=...,
    return_loss=True)`` computes it (the caption loss plus the contrastive loss over the
    latents it gathers when a group of more than one rank exists), small: ``dim=16``,
    ``num_tokens=4``, one unimodal and one multimodal layer, 2 heads of 8, ``image_dim=8``, 2
    image queries, float64. The model's own weights (drawn from seed 0, the same on every rank)
    are held fixed, so that the gradient checked is the one reaching gatherlab's MLP: the image
    tokens are z0 as 2 tokens of 8; the text, 6 tokens fixed by the sample, 1 + [z1[t] > 0]
    (no pad token: the caption loss is then a mean over the same number of tokens on every
    rank). Loaded alone, with einops from its wheel."""

    def __init__(self, root=None):
        super().__init__()
        importable(root_of(None, "einops", EINOPS), "einops")
        files = ("coca_pytorch/coca_pytorch.py",)
        module = load(root_of(root, COCA_PACKAGE, COCA), files, {})
        model = module.CoCa(
            dim=16, num_tokens=4, unimodal_depth=1, multimodal_depth=1, image_dim=8,
            num_img_queries=2, dim_head=8, heads=2,
        )  # fmt: skip
        self.model = model.double().requires_grad_(False)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        text = 1 + (z1.detach()[:, :6] > 0).long()
        return self.model(text, image_tokens=z0.view(len(z0), 2, 8), return_loss=True)


COCA_LABELS = Fix(
    "label the contrastive loss with every gathered row, arange(sim.shape[0]), instead of "
    "arange(batch), the rank's batch",
    "coca_pytorch/labels.patch",
)
COCA_BACKWARD = Fix(
    "sum every rank's gradient (all_reduce) before AllGather.backward takes the own slice",
    "coca_pytorch/backward.patch",
)
CASES = [
    Case(COCA_PACKAGE, COCA, "CoCa (forward, return_loss=True)", "defaults (gathers in any group)",
         CocaPytorch, fix=COCA_LABELS, repro="coca_pytorch.py", needs=(("einops", EINOPS),)),
    Case(COCA_PACKAGE, COCA, "CoCa (forward, return_loss=True)",
         "defaults; with the labels of every gathered row (the fix above)", CocaPytorch,
         fix=COCA_BACKWARD, repro="coca_pytorch.py", needs=(("einops", EINOPS),),
         patch=COCA_LABELS),
]  # fmt: skip
