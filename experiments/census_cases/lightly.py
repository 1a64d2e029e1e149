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

from census_cases.common import Case, Fix, NotRun, released_functions, root_of, shim, stubs

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
    "VICRegLLoss": (LIGHTLY_DIST, "lightly/loss/vicreg_loss.py", "lightly/loss/vicregl_loss.py"),
    "DetConSLoss": (LIGHTLY_DIST, "lightly/loss/detcon_loss.py"),
    "DetConBLoss": (LIGHTLY_DIST, "lightly/loss/detcon_loss.py"),
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
    ``lightly.models.utils`` (torchvision), for NT-Xent's memory bank, and for VICRegL the same
    module holding only its released ``nearest_neighbors`` (`released_functions`)."""
    root, files = root_of(root, "lightly", LIGHTLY), LIGHTLY_LOSSES[loss]
    if loss == "VICRegLLoss":
        utils = released_functions(root, "lightly/models/utils.py", "nearest_neighbors",
                                   torch=torch, Tuple=tuple)  # fmt: skip
        why = "its file imports torchvision; VICRegL's matching uses only nearest_neighbors"
        return load(root, files, {"lightly.models.utils": shim("lightly.models.utils", why,
                                                               **utils)})  # fmt: skip
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


class LightlyDetCon(nn.Module):
    """lightly's released ``DetConSLoss(**kwargs)`` (or ``DetConBLoss`` with
    ``variant="DetConBLoss"``, its target branch the prediction branch itself) on each sample's
    16 numbers as 2 regions of 8, called with the two views' region indices as lightly's users
    call it: ``loss(z0, z1, mask_view0, mask_view1)``, the masks the check's inputs
    (`detcon_masks`), each rank given its rows."""

    def __init__(self, root: str | None = None, variant: str = "DetConSLoss", **kwargs: Any):
        super().__init__()
        self.variant = variant
        self.loss = lightly_loss(variant, root, **kwargs)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor, mask_view0: torch.Tensor,
                mask_view1: torch.Tensor) -> torch.Tensor:  # fmt: skip
        regions0 = z0.reshape(len(z0), DETCON_REGIONS, -1)
        regions1 = z1.reshape(len(z1), DETCON_REGIONS, -1)
        if self.variant == "DetConSLoss":
            return self.loss(regions0, regions1, mask_view0, mask_view1)
        return self.loss(regions0, regions1, regions0, regions1, mask_view0, mask_view1)


class LightlyVICRegL(nn.Module):
    """lightly's released ``VICRegLLoss(**kwargs)`` on two global views, each sample's 16
    numbers its global features and, reshaped, its 2 × 2 map of local features of 4, called
    with the maps' grids (`vicregl_grids`, the check's inputs: each rank given its rows) as
    lightly's users call it: ``loss([(g0, l0), (g1, l1)], [grid0, grid1])``."""

    def __init__(self, root: str | None = None, **kwargs: Any):
        super().__init__()
        self.loss = lightly_loss("VICRegLLoss", root, **kwargs)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor, grid0: torch.Tensor,
                grid1: torch.Tensor) -> torch.Tensor:  # fmt: skip
        maps = [z.reshape(len(z), 2, 2, 4) for z in (z0, z1)]
        return self.loss([(z0, maps[0]), (z1, maps[1])], [grid0, grid1])


def vicregl_grids(global_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each view's 2 × 2 grid of the local features' image coordinates, (N, 2, 2, 2), drawn."""
    return torch.rand(global_batch_size, 2, 2, 2), torch.rand(global_batch_size, 2, 2, 2)


DETCON_REGIONS = 2  # regions sampled per view; each region's embedding 16 / 2 = 8 numbers


def detcon_masks(global_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each view's sampled region indices, (N, 2) integers in [0, 3): a row per sample, split
    over the ranks as the views are; drawn with the check's seed."""
    shape = (global_batch_size, DETCON_REGIONS)
    return torch.randint(0, 3, shape), torch.randint(0, 3, shape)


def _detcon(variant: str) -> list[Case]:
    """DetCon's loss with its distributed flag on (its default) and off, given its masks."""
    return [
        Case("lightly", LIGHTLY, variant, flags, LightlyDetCon,
             {"variant": variant, "gather_distributed": on}, inputs=detcon_masks,
             note="" if on else "gather_distributed=True (its default; previous row)")
        for flags, on in (("defaults (gather_distributed=True)", True),
                          ("gather_distributed=False", False))
    ]  # fmt: skip


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
    inputs: Any = None,
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
        inputs=inputs,
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
        inputs=inputs,
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
    *_lightly(LIGHTLY, "VICRegLLoss", "gather_distributed", factory=LightlyVICRegL,
              inputs=vicregl_grids),
    *_detcon("DetConSLoss"),
    *_detcon("DetConBLoss"),
    # the releases around each distributed fix: GatherLayer's backward (PR #1531, 1.5.4), Barlow
    # Twins's all_reduce through torch.distributed.nn (#1977, 1.5.26)
    *_lightly("1.5.3", "DCLLoss", "gather_distributed")[1:],
    *_lightly("1.5.4", "DCLLoss", "gather_distributed")[1:],
    *_lightly("1.5.25", "BarlowTwinsLoss", "gather_distributed", BARLOW_1977,
              "lightly_barlow_twins.py")[1:],
    *_lightly("1.5.26", "BarlowTwinsLoss", "gather_distributed", BARLOW_GLOBAL,
              "lightly_barlow_twins.py")[1:],
]  # fmt: skip
NOT_RUN: list[NotRun] = []
