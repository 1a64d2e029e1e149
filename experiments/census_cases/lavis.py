"""The census's cases of LAVIS (salesforce-lavis 1.0.2): its ``ClipLoss``, a copy of OpenCLIP's,
with its flags."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from public_code import load
from torch import nn

from census_cases.common import Case, NotRun, flags_text, root_of

LAVIS = "1.0.2"


class LavisClip(nn.Module):
    """LAVIS's released ``ClipLoss`` (``lavis/models/clip_models/loss.py``, loaded alone: it
    imports torch and, optionally, horovod, absent here) as OpenCLIP's is checked
    (`OpenClipForCheck`): features normalised, logit scale 1/0.07 held here."""

    def __init__(self, root=None, rank=0, world_size=1, **flags):
        super().__init__()
        files = ("lavis/models/clip_models/loss.py",)
        module = load(root_of(root, "salesforce-lavis", LAVIS), files, {})
        self.loss = module.ClipLoss(rank=rank, world_size=world_size, **flags)
        self.register_buffer("logit_scale", torch.tensor(1 / 0.07).log())

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        z0, z1 = F.normalize(z0, dim=-1), F.normalize(z1, dim=-1)
        return self.loss(z0, z1, self.logit_scale.exp())


def _lavis(flags: dict[str, Any], note: str = "") -> Case:
    return Case("salesforce-lavis", LAVIS, "ClipLoss", flags_text(flags), LavisClip, flags,
                note=note)  # fmt: skip


CASES = [
    _lavis({}, "gather_with_grad=True (a row below)"),
    _lavis({"local_loss": True}, "gather_with_grad=True (a row below)"),
    _lavis({"gather_with_grad": True}),
    _lavis({"local_loss": True, "gather_with_grad": True}),
]
NOT_RUN = [
    NotRun("salesforce-lavis", LAVIS, "BLIP, BLIP-2, ALBEF contrastive losses", "computed "
           "inside the models' forward, whose files import transformers (absent here)"),
]  # fmt: skip
