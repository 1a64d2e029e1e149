"""The census's cases of solo-learn 1.0.2 (its newest release): ``barlow_loss_func``,
``DINOLoss`` and ``solo.utils.misc.gather`` (the ``GatherLayer`` of its methods)."""

from __future__ import annotations

import torch
from public_code import load
from torch import nn

from census_cases.common import Case, Fix, NotRun, root_of

SOLO = "1.0.2"


def solo_gather(x: torch.Tensor, root: str | None = None) -> torch.Tensor:
    """solo-learn's released ``solo.utils.misc.gather`` (its ``GatherLayer``; NNCLR, NNBYOL,
    NNSiam, ReSSL and MoCo v2+ gather with it), as a gather ``x -> gathered x``. Loaded alone:
    misc.py imports only torch besides the standard library."""
    module = load(root_of(root, "solo-learn", SOLO), ("solo/utils/misc.py",), {})
    return module.gather(x)


class SoloBarlow(nn.Module):
    """solo-learn's released ``barlow_loss_func(z0, z1, lamb=5e-3, scale_loss=0.025)`` itself
    (a function: it all-reduces the cross-correlation whenever a process group exists; no
    flag), held in a module (gatherlab records where a loss departs only inside a module's
    forward)."""

    def __init__(self, root=None, lamb=5e-3, scale_loss=0.025):
        super().__init__()
        self.module = load(root_of(root, "solo-learn", SOLO), ("solo/losses/barlow.py",), {})
        self.lamb, self.scale_loss = lamb, scale_loss

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        return self.module.barlow_loss_func(z0, z1, self.lamb, self.scale_loss)


class SoloDINO(nn.Module):
    """solo-learn's released ``DINOLoss(num_prototypes=16, warmup_teacher_temp=0.04,
    teacher_temp=0.04, warmup_teacher_temp_epochs=0, num_epochs=1)`` on the two views as the two
    large crops: the student's output is ``cat(z0, z1)``, the teacher's the same detached (a
    momentum teacher at its start); its center, a buffer moved by the all-reduced teacher mean
    after each call, is state, so it is checked over steps."""

    def __init__(self, root=None):
        super().__init__()
        module = load(root_of(root, "solo-learn", SOLO), ("solo/losses/dino.py",), {})
        self.loss = module.DINOLoss(16, 0.04, 0.04, 0, 1)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        student = torch.cat((z0, z1))
        return self.loss(student, student.detach())


SOLO_BARLOW_FIX = Fix(
    "standardise with the whole batch's mean and variance (all-reduced), and all-reduce corr "
    "with an all-reduce whose backward sums the gradients (census_fixes.all_reduce_sum) instead "
    "of dist.all_reduce (no backward)",
    "solo_learn/barlow.patch",
)
SOLO_GATHER_FIX = Fix(
    "sum every rank's gradient (all_reduce) in GatherLayer.backward before taking the own slice",
    "solo_learn/gather.patch",
)
SOLO_FLOAT64 = Fix(
    "the BatchNorm1d built in the input's dtype (.to(z1.device, z1.dtype)): built in float32, "
    "it refuses the check's float64",
    "solo_learn/float64.patch",
)
FLOAT64_REMARK = (
    "its `BatchNorm1d(D)` is built in float32 and refuses the check's float64: the row is of "
    "the release with `.to(z1.device, z1.dtype)`, the fix applied on top"
)
CASES = [
    Case("solo-learn", SOLO, "barlow_loss_func",
         "defaults (all-reduces in any group); its BatchNorm1d in float64 (patched: see the notes)",
         SoloBarlow, fix=SOLO_BARLOW_FIX, repro="solo_barlow.py", patch=SOLO_FLOAT64,
         remark=FLOAT64_REMARK),
    Case("solo-learn", SOLO, "DINOLoss", "defaults (all-reduces its center in any group)",
         SoloDINO, steps=3),
    Case("solo-learn", SOLO, "utils.misc.gather (GatherLayer)",
         "rank's rows against the gathered batch: gatherlab's NTXentLoss(temperature=0.5) on it",
         "gatherlab.losses:NTXentLoss", {"temperature": 0.5}, fix=SOLO_GATHER_FIX,
         repro="solo_gather.py", gather=solo_gather),
]  # fmt: skip
NOT_RUN = [
    NotRun("solo-learn", SOLO, "swav_loss_func with SinkhornKnopp, deepclusterv2, k-means",
           "not run: their targets (Sinkhorn assignments, k-means centroids over a memory bank) "
           "are computed by the methods' training_step in files that import torchvision (absent "
           "here); the losses alone are per-sample functions of given targets"),
    NotRun("solo-learn", SOLO, "the methods (NNCLR, MoCo v2+, …)", "their files import "
           "torchvision (a LightningModule each): their gather is checked above"),
]  # fmt: skip
