"""CLIP's contrastive loss (Radford et al., 2021, "Learning Transferable Visual Models From
Natural Language Supervision"), distributed as OpenCLIP's ``ClipLoss(local_loss=True)``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gatherlab.gather import GatherFn, resolve
from gatherlab.losses._common import (
    DEFAULT_GATHER,
    check_positive,
    check_views,
    gather_views,
    local_offset,
    own_columns,
)

# OpenCLIP clamps the learnt logit scale at 100 to keep training stable.
MAX_LOGIT_SCALE = 100.0


class CLIPLoss(nn.Module):
    """Symmetric InfoNCE between two towers with a learnable logit scale, local-loss style.

    ``out0`` are one tower's embeddings (images), ``out1`` the other's (texts); both are
    L2-normalised and gathered. Rank r scores its own B samples of each tower against all N of the
    other: logits = s·a_r B_allᵀ and s·b_r A_allᵀ, targets at columns r·B + i, loss = the mean of
    the two cross-entropies. The mean over ranks is the single-device loss. The scale s = exp(t) is
    a parameter of the loss (t starts at log(1/temperature)), learnt with the model.
    """

    style = "local"  # how it splits over ranks (docs/design.md §1)
    layout_invariant = True  # docs/design.md §3: predicted with an exact gather

    def __init__(
        self,
        temperature: float = 0.07,
        learn_logit_scale: bool = True,
        gather: str | GatherFn | None = DEFAULT_GATHER,
    ):
        super().__init__()
        temperature = check_positive("temperature", temperature)
        # float64, so that a run in either precision starts from log(1/τ) correctly rounded
        log_scale = torch.tensor(math.log(1 / temperature), dtype=torch.float64)
        self.logit_scale = nn.Parameter(log_scale, requires_grad=bool(learn_logit_scale))
        self.gather = resolve(gather)

    def forward(self, out0: torch.Tensor, out1: torch.Tensor) -> torch.Tensor:
        check_views(out0, out1)
        out0, out1 = F.normalize(out0, dim=1), F.normalize(out1, dim=1)
        columns0, columns1 = gather_views(self.gather, out0, out1)
        targets = own_columns(local_offset(out0, columns0), out0.shape[0], out0.device)
        scale = self.logit_scale.clamp(max=math.log(MAX_LOGIT_SCALE)).exp()
        logits_01 = scale * out0 @ columns1.T
        logits_10 = scale * out1 @ columns0.T
        return 0.5 * (F.cross_entropy(logits_01, targets) + F.cross_entropy(logits_10, targets))
