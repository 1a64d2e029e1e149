"""The census's cases of lightly: 1.6.0 (the newest), each loss with its distributed flag off
and on, and the releases around its two distributed fixes (PR #1531's ``GatherLayer``, 1.5.4;
PR #1977's Barlow Twins ``all_reduce``, 1.5.26)."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from public_code import load
from torch import nn

from census_cases.common import NOT_YET, Case, Fix, NotRun, root_of, stubs

LIGHTLY = "1.6.0"  # the newest release on the registry when this was written
LIGHTLY_DIST = "lightly/utils/dist.py"
LIGHTLY_NTXENT = (
    LIGHTLY_DIST,
    "lightly/models/modules/memory_bank.py",
    "lightly/loss/ntx_ent_loss.py",
)
LIGHTLY_LOSSES: dict[str, tuple[str, ...]] = {
    # the released class → the files it needs, its own imports first
    "NTXentLoss": LIGHTLY_NTXENT,
    "DirectCLRLoss": (*LIGHTLY_NTXENT, "lightly/loss/directclr_loss.py"),
    "DCLLoss": (LIGHTLY_DIST, "lightly/loss/dcl_loss.py"),
    "DCLWLoss": (LIGHTLY_DIST, "lightly/loss/dcl_loss.py"),
    "BarlowTwinsLoss": ("lightly/loss/barlow_twins_loss.py",),
    "VICRegLoss": (LIGHTLY_DIST, "lightly/loss/vicreg_loss.py"),
    "TiCoLoss": (LIGHTLY_DIST, "lightly/loss/tico_loss.py"),
    "SwaVLoss": ("lightly/loss/swav_loss.py",),
    "CAPILoss": ("lightly/loss/capi_loss.py",),
    "MSNLoss": ("lightly/loss/msn_loss.py",),
    "PMSNLoss": ("lightly/loss/msn_loss.py", "lightly/loss/pmsn_loss.py"),
    "DINOLoss": ("lightly/models/modules/center.py", "lightly/loss/dino_loss.py"),
    "SIGReg": (LIGHTLY_DIST, "lightly/loss/lejepa_loss.py"),
    "LeJEPALoss": (LIGHTLY_DIST, "lightly/loss/lejepa_loss.py"),
    "VISRegLoss": (LIGHTLY_DIST, "lightly/loss/lejepa_loss.py", "lightly/loss/visreg_loss.py"),
    "LeWMLoss": (
        LIGHTLY_DIST,
        "lightly/loss/latent_distance.py",
        "lightly/loss/lejepa_loss.py",
        "lightly/loss/lewm_loss.py",
    ),
}
LIGHTLY_STUBS = {
    "lightly__models__utils": "it imports torchvision; memory_bank.py uses it only to fill a "
    "memory bank (memory_bank_size > 0, not used here)"
}


def lightly_module(root: str | Path | None, loss: str) -> types.ModuleType:
    """The released file of lightly's ``loss`` (from the release at ``root``, by default lightly
    `LIGHTLY` as the census unpacked it) with the files it imports; one stub,
    ``lightly.models.utils`` (torchvision), for NT-Xent's memory bank."""
    root, files = root_of(root, "lightly", LIGHTLY), LIGHTLY_LOSSES[loss]
    return load(root, files, stubs(**LIGHTLY_STUBS) if LIGHTLY_NTXENT[1] in files else {})


def lightly_loss(loss: str, root: str | None = None, **kwargs: Any) -> nn.Module:
    """lightly's released ``loss(**kwargs)`` itself, called as ``loss(z0, z1)`` (every one listed
    in `LIGHTLY_LOSSES` but SwaV takes the two views). It asks torch.distributed for the rank and
    world size itself (``lightly.utils.dist`` or ``torch.distributed``)."""
    return getattr(lightly_module(root, loss), loss)(**kwargs)


class LightlySwaV(nn.Module):
    """lightly's released ``SwaVLoss(**kwargs)`` on prototype scores: each view's embedding,
    normalised, against 8 fixed prototypes (a buffer drawn from seed 0, normalised, as SwaV's
    prototype layer holds them); the two views are the two high-resolution crops, no
    low-resolution crops, no queue. The loss returns a one-element tensor: its element is
    returned."""

    def __init__(self, root: str | None = None, **kwargs: Any):
        super().__init__()
        self.loss = lightly_loss("SwaVLoss", root, **kwargs)
        generator = torch.Generator().manual_seed(0)
        prototypes = torch.randn(8, 16, generator=generator, dtype=torch.float64)
        self.register_buffer("prototypes", F.normalize(prototypes, dim=1))

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        scores = [F.normalize(z, dim=1) @ self.prototypes.T for z in (z0, z1)]
        return self.loss(scores, []).squeeze(0)


class LightlyCAPI(nn.Module):
    """lightly's released ``CAPILoss(**kwargs)`` on cluster logits made from the two views:
    the teacher's, z0 as 2 tokens of 8 clusters (the loss detaches them), the student's, z1
    the same way (its predicted tokens at the teacher's positions)."""

    def __init__(self, root: str | None = None, **kwargs: Any):
        super().__init__()
        self.loss = lightly_loss("CAPILoss", root, **kwargs)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        return self.loss(z0.view(len(z0), 2, 8), z1.view(len(z1), 2, 8))


class LightlyMSN(nn.Module):
    """lightly's released ``MSNLoss(**kwargs)`` (or ``PMSNLoss``, its subclass with a power-law
    prior in the regularisation, with ``variant="PMSNLoss"``) with z1 the anchors (one anchor
    view), z0 the targets (the loss computes their probabilities without gradient) and 8 fixed
    prototypes (as `LightlySwaV`)."""

    def __init__(self, root: str | None = None, variant: str = "MSNLoss", **kwargs: Any):
        super().__init__()
        self.loss = lightly_loss(variant, root, **kwargs)
        generator = torch.Generator().manual_seed(0)
        prototypes = torch.randn(8, 16, generator=generator, dtype=torch.float64)
        self.register_buffer("prototypes", prototypes)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        return self.loss(z1, z0, self.prototypes)


class LightlyLeJEPA(nn.Module):
    """lightly's released ``SIGReg(**kwargs)`` on the two views' projections stacked, shape
    (2, N, 16); with ``variant="LeJEPALoss"`` or ``"VISRegLoss"``, that loss with view 0 the
    global view and view 1 the local one, each (1, N, 16); with ``variant="LeWMLoss"``, view 0 as
    the predicted next frame, view 1 (detached) as the observed one, and both as the clip's two
    frames, (N, 2, 16). SIGReg projects onto random unit vectors drawn from the global generator
    in its forward (rank 0's broadcast with ``gather_distributed``); the check seeds every rank's
    generator and one device's alike, so the draws agree."""

    def __init__(self, root: str | None = None, variant: str = "SIGReg", **kwargs: Any):
        super().__init__()
        self.variant = variant
        self.loss = lightly_loss(variant, root, **kwargs)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        if self.variant == "SIGReg":
            return self.loss(torch.stack([z0, z1]))
        if self.variant == "LeWMLoss":
            return self.loss(predicted=z0[:, None], target=z1.detach()[:, None],
                             embeddings=torch.stack([z0, z1], dim=1))  # fmt: skip
        return self.loss(local_proj=z1[None], global_proj=z0[None])


class LightlyDINO(nn.Module):
    """lightly's released ``DINOLoss(output_dim=16, **kwargs)`` on the two views as the two
    global crops: the student's outputs z0 and z1, the teacher's the same detached (a momentum
    teacher at its start). Its center, a buffer moved after each call by the batch mean, which
    ``lightly.models.modules.center`` all-reduces whenever a group exists (no flag), is state: it
    is checked over steps."""

    def __init__(self, root: str | None = None, **kwargs: Any):
        super().__init__()
        self.loss = lightly_loss("DINOLoss", root, output_dim=16, **kwargs)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        return self.loss([z0.detach(), z1.detach()], [z0, z1])


MSN_MEAN = Fix(
    "all-reduce the mean anchor probabilities of the me-max regularisation, then / W, when "
    "gather_distributed (with an all-reduce whose backward sums the gradients: "
    "census_fixes.all_reduce_sum), instead of the rank's mean",
    "lightly/msn_mean.patch",
)
BARLOW_GLOBAL = Fix(
    "standardise with the mean and variance of the whole batch, all-reduced with an "
    "all-reduce whose backward sums the gradients (census_fixes.all_reduce_sum), instead of "
    "the rank's F.batch_norm",
    "lightly/barlow_global.patch",
)
DCLW_GLOBAL = Fix(
    "the negative von Mises-Fisher weights' softmax over the gathered batch, then the rank's "
    "slice, instead of a softmax over the rank's rows",
    "lightly/dclw_global.patch",
)
BARLOW_1977 = Fix(  # on 1.5.25: #1977's change, then BARLOW_GLOBAL's
    "the cross-correlation all-reduced with an all-reduce whose backward sums the gradients "
    "(census_fixes.all_reduce_sum; what PR #1977 changed in 1.5.26) instead of dist.all_reduce, "
    "which autograd does not see, and " + BARLOW_GLOBAL.summary,
    "lightly/barlow_1977.patch",
)
MSN_REMARK = (
    "`where` names the me-max regularisation's mean over the rank's rows (msn_loss.py:236); the "
    "Sinkhorn before it completes partial sums with an in-place `dist.all_reduce` and divides by "
    "the rank's own count, a scale its last line takes back: `where` passes both. All-reduced, "
    "the mean makes the loss exact"
)
PMSN_REMARK = (
    "as MSNLoss's: the regularisation's mean over the rank's rows (msn_loss.py:236, inherited)"
)


def _lightly(
    version: str,
    loss: str,
    flag: str,
    fix: Fix | None = None,
    repro: str = "",
    factory: type[nn.Module] | None = None,
    steps: int = 0,
    remark: str = "",
    **kwargs: Any,
) -> list[Case]:
    """The loss with its released defaults, then with its distributed flag on (``remark``: the
    note of the second)."""
    arguments = {} if factory else {"loss": loss}
    factory = factory or lightly_loss
    off = Case(
        "lightly",
        version,
        loss,
        "defaults (" + flag + "=False)",
        factory,
        {**arguments, **kwargs},
        steps,
        note=f"{flag}=True (next row)",
    )
    on = Case(
        "lightly",
        version,
        loss,
        f"{flag}=True",
        factory,
        {**arguments, **kwargs, flag: True},
        steps,
        fix,
        repro,
        remark=remark,
    )
    return [off, on]


CASES = [
    *_lightly(LIGHTLY, "NTXentLoss", "gather_distributed"),
    *_lightly(LIGHTLY, "DirectCLRLoss", "gather_distributed", loss_dim=8),
    *_lightly(LIGHTLY, "DCLLoss", "gather_distributed"),
    *_lightly(LIGHTLY, "DCLWLoss", "gather_distributed", DCLW_GLOBAL, "lightly_dclw.py"),
    *_lightly(LIGHTLY, "BarlowTwinsLoss", "gather_distributed", BARLOW_GLOBAL,
              "lightly_barlow_twins.py"),
    *_lightly(LIGHTLY, "VICRegLoss", "gather_distributed"),
    *_lightly(LIGHTLY, "TiCoLoss", "gather_distributed", steps=3),
    *_lightly(LIGHTLY, "SwaVLoss", "sinkhorn_gather_distributed", factory=LightlySwaV),
    *_lightly(LIGHTLY, "CAPILoss", "gather_distributed", factory=LightlyCAPI),
    *_lightly(LIGHTLY, "MSNLoss", "gather_distributed", MSN_MEAN, "lightly_msn.py",
              factory=LightlyMSN, remark=MSN_REMARK),
    *_lightly(LIGHTLY, "PMSNLoss", "gather_distributed", MSN_MEAN, "lightly_msn.py",
              factory=LightlyMSN, remark=PMSN_REMARK, variant="PMSNLoss"),
    Case("lightly", LIGHTLY, "DINOLoss", "defaults (all-reduces its center in any group)",
         LightlyDINO, steps=3),
    *_lightly(LIGHTLY, "SIGReg", "gather_distributed", factory=LightlyLeJEPA),
    *_lightly(LIGHTLY, "LeJEPALoss", "gather_distributed", factory=LightlyLeJEPA,
              variant="LeJEPALoss"),
    *_lightly(LIGHTLY, "VISRegLoss", "gather_distributed", factory=LightlyLeJEPA,
              variant="VISRegLoss"),
    *_lightly(LIGHTLY, "LeWMLoss", "gather_distributed", factory=LightlyLeJEPA,
              variant="LeWMLoss"),
    # the releases around each distributed fix: GatherLayer's backward (PR #1531, 1.5.4), Barlow
    # Twins's all_reduce through torch.distributed.nn (#1977, 1.5.26)
    *_lightly("1.5.3", "DCLLoss", "gather_distributed")[1:],
    *_lightly("1.5.4", "DCLLoss", "gather_distributed")[1:],
    *_lightly("1.5.25", "BarlowTwinsLoss", "gather_distributed", BARLOW_1977,
              "lightly_barlow_twins.py")[1:],
    *_lightly("1.5.26", "BarlowTwinsLoss", "gather_distributed", BARLOW_GLOBAL,
              "lightly_barlow_twins.py")[1:],
]  # fmt: skip
NOT_RUN = [
    NotRun("lightly", LIGHTLY, "DetConSLoss, DetConBLoss", NOT_YET + " (region masks per view)"),
    NotRun("lightly", LIGHTLY, "VICRegLLoss", NOT_YET + " (local features and their grids)"),
]  # fmt: skip
