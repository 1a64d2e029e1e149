"""The census's cases (``experiments/census.py``): for each released package, the files a loss
needs, what is stubbed, the adapter that makes the loss ``loss(z0, z1)``, the flags checked, and
for a loss that is not exact the fix tried on a local copy of the released file.

Each adapter is a top-level name of this module: the check's ranks import this file as
``census_cases`` (the pool sends them the census's import path) and build the loss themselves,
each loading the released files on its first build (`public_code.load`). ``root`` is the folder
the release (or its fixed copy) was unpacked into; the census passes it.

The census needs the package registry; nothing in the test suite imports this module.

Inputs: the check gives every loss two views (``z0``, ``z1``: the MLP's 16-dimensional embeddings
of a pair of Gaussian views, float64, 16 rows over all ranks). An adapter that needs anything else
builds it from them in its forward, and its docstring says how.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from public_code import (
    OPEN_CLIP,
    OpenClipForCheck,
    _absent,
    _as_imported,
    _synthetic,
    load,
    open_clip_loss_module,
    release_root,
)
from torch import nn

# --- what a case is -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fix:
    """A fix tried on a local copy of the released files: each ``(file, old, new)`` replaces the
    one occurrence of ``old`` in ``file`` (relative to the wheel's root) before loading. Code
    that needs a collective whose backward sums the ranks' gradients imports it from
    ``census_fixes`` (``all_reduce_sum``, ``all_gather_rows``), on the ranks' import path with
    this module."""

    summary: str  # the fix in one line, for the table
    edits: tuple[tuple[str, str, str], ...]
    name: str = "fix"  # the copy's folder is ``<release>+<name>``


@dataclass(frozen=True)
class Case:
    package: str
    version: str
    loss: str  # the released class or function
    flags: str  # the flags as the table shows them
    factory: str  # a top-level name of this module, called with root= and kwargs; with
    # ``gather``, the import path of a loss of gatherlab's, given the released gather
    kwargs: dict[str, Any] = field(default_factory=dict)
    steps: int = 0  # for a loss with state: the check's --steps
    fix: Fix | None = None
    repro: str = ""  # experiments/census_repro/<name>.py, for a finding
    note: str = ""  # what the fix column says when there is no fix to try (a flag that is off)
    gather: str = ""  # a gather of this module checked with ``factory``, a loss of gatherlab's
    needs: tuple[tuple[str, str], ...] = ()  # other wheels put on the ranks' import path
    patch: Fix | None = None  # applied before the check: the row is of the patched release
    remark: str = ""  # a note under the table


@dataclass(frozen=True)
class NotRun:
    """A package or loss the census could not check, with its one-line reason."""

    package: str
    version: str
    loss: str
    reason: str


def _stubs(**why: str) -> dict[str, types.ModuleType]:
    """``_absent`` stubs, one per module name (dots written as ``__``), with why each is one."""
    names = {name.replace("__", "."): text for name, text in why.items()}
    return {name: _absent(name, text) for name, text in names.items()}


def _root(root: str | Path | None, package: str, version: str) -> Path:
    """``root``, or where the census unpacks the release (for the command line: the census must
    have run once)."""
    root = Path(root) if root else release_root(package, version)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is missing: python experiments/census.py unpacks it")
    return root


# --- lightly --------------------------------------------------------------------------------------

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
}
LIGHTLY_STUBS = {
    "lightly__models__utils": "it imports torchvision; memory_bank.py uses it only to fill a "
    "memory bank (memory_bank_size > 0, not used here)"
}


def lightly_module(root: str | Path | None, loss: str) -> types.ModuleType:
    """The released file of lightly's ``loss`` (from the release at ``root``, by default lightly
    `LIGHTLY` as the census unpacked it) with the files it imports; one stub,
    ``lightly.models.utils`` (torchvision), for NT-Xent's memory bank."""
    root, files = _root(root, "lightly", LIGHTLY), LIGHTLY_LOSSES[loss]
    return load(root, files, _stubs(**LIGHTLY_STUBS) if LIGHTLY_NTXENT[1] in files else {})


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
    (
        (
            "lightly/loss/msn_loss.py",
            "            mean_anchor_probs = torch.mean(anchor_probs, dim=0)\n",
            "            mean_anchor_probs = torch.mean(anchor_probs, dim=0)\n"
            "            if self.gather_distributed and dist.is_initialized():\n"
            "                from census_fixes import all_reduce_sum\n"
            "\n"
            "                mean_anchor_probs = all_reduce_sum(\n"
            "                    mean_anchor_probs / dist.get_world_size()\n"
            "                )\n",
        ),
    ),
)
BARLOW_GLOBAL = Fix(
    "standardise with the mean and variance of the whole batch, all-reduced with an "
    "all-reduce whose backward sums the gradients (census_fixes.all_reduce_sum), instead of "
    "the rank's F.batch_norm",
    (
        (
            "lightly/loss/barlow_twins_loss.py",
            "        z_a_norm, z_b_norm = _normalize(z_a), _normalize(z_b)\n",
            "        if self.gather_distributed and dist.is_initialized():\n"
            "            z_a_norm, z_b_norm = _normalize_global(z_a), _normalize_global(z_b)\n"
            "        else:\n"
            "            z_a_norm, z_b_norm = _normalize(z_a), _normalize(z_b)\n",
        ),
        (
            "lightly/loss/barlow_twins_loss.py",
            "def _normalize(z: torch.Tensor) -> torch.Tensor:\n",
            "def _normalize_global(z: torch.Tensor) -> torch.Tensor:\n"
            "    from census_fixes import all_reduce_sum\n"
            "\n"
            "    world_size = dist.get_world_size()\n"
            "    mean = all_reduce_sum(z.mean(0)) / world_size\n"
            "    var = all_reduce_sum((z - mean).pow(2).mean(0)) / world_size\n"
            "    return (z - mean) / torch.sqrt(var + 1e-5)\n"
            "\n\n"
            "def _normalize(z: torch.Tensor) -> torch.Tensor:\n",
        ),
    ),
)
RETURN_WEIGHTS = (
    "    return torch.tensor(2 - out0.shape[0] * nn.functional.softmax(similarity, dim=0))\n"
)
DCLW_GLOBAL = Fix(
    "the negative von Mises-Fisher weights' softmax over the gathered batch, then the rank's "
    "slice, instead of a softmax over the rank's rows",
    (
        (
            "lightly/loss/dcl_loss.py",
            RETURN_WEIGHTS,
            "    if dist.world_size() > 1:\n"
            "        n = similarity.shape[0]\n"
            "        everyone = torch.cat(dist.gather(similarity), 0)\n"
            "        weights = 2 - everyone.shape[0] * nn.functional.softmax(everyone, dim=0)\n"
            "        return weights[dist.rank() * n : (dist.rank() + 1) * n]\n" + RETURN_WEIGHTS,
        ),
    ),
)


BARLOW_1977 = Fix(
    "the cross-correlation all-reduced with an all-reduce whose backward sums the gradients "
    "(census_fixes.all_reduce_sum; what PR #1977 changed in 1.5.26) instead of dist.all_reduce, "
    "which autograd does not see, and " + BARLOW_GLOBAL.summary,
    (
        (
            "lightly/loss/barlow_twins_loss.py",
            "                c = c / world_size\n                dist.all_reduce(c)\n",
            "                from census_fixes import all_reduce_sum\n"
            "\n"
            "                c = all_reduce_sum(c / world_size)\n",
        ),
        *BARLOW_GLOBAL.edits,
    ),
)


def _lightly(
    version: str,
    loss: str,
    flag: str,
    fix: Fix | None = None,
    repro: str = "",
    factory: str = "lightly_loss",
    steps: int = 0,
    **kwargs: Any,
) -> list[Case]:
    """The loss with its released defaults, then with its distributed flag on."""
    arguments = {} if factory != "lightly_loss" else {"loss": loss}
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
    )
    return [off, on]


LIGHTLY_CASES = [
    *_lightly(LIGHTLY, "NTXentLoss", "gather_distributed"),
    *_lightly(LIGHTLY, "DirectCLRLoss", "gather_distributed", loss_dim=8),
    *_lightly(LIGHTLY, "DCLLoss", "gather_distributed"),
    *_lightly(LIGHTLY, "DCLWLoss", "gather_distributed", DCLW_GLOBAL, "lightly_dclw.py"),
    *_lightly(LIGHTLY, "BarlowTwinsLoss", "gather_distributed", BARLOW_GLOBAL,
              "lightly_barlow_twins.py"),
    *_lightly(LIGHTLY, "VICRegLoss", "gather_distributed"),
    *_lightly(LIGHTLY, "TiCoLoss", "gather_distributed", steps=3),
    *_lightly(LIGHTLY, "SwaVLoss", "sinkhorn_gather_distributed", factory="LightlySwaV"),
    *_lightly(LIGHTLY, "CAPILoss", "gather_distributed", factory="LightlyCAPI"),
    *_lightly(LIGHTLY, "MSNLoss", "gather_distributed", MSN_MEAN, "lightly_msn.py",
              factory="LightlyMSN"),
    *_lightly(LIGHTLY, "PMSNLoss", "gather_distributed", MSN_MEAN, "lightly_msn.py",
              factory="LightlyMSN", variant="PMSNLoss"),
    Case("lightly", LIGHTLY, "DINOLoss", "defaults (all-reduces its center in any group)",
         "LightlyDINO", steps=3),
    # the releases around each distributed fix: GatherLayer's backward (PR #1531, 1.5.4), Barlow
    # Twins's all_reduce through torch.distributed.nn (#1977, 1.5.26)
    *_lightly("1.5.3", "DCLLoss", "gather_distributed")[1:],
    *_lightly("1.5.4", "DCLLoss", "gather_distributed")[1:],
    *_lightly("1.5.25", "BarlowTwinsLoss", "gather_distributed", BARLOW_1977,
              "lightly_barlow_twins.py")[1:],
    *_lightly("1.5.26", "BarlowTwinsLoss", "gather_distributed", BARLOW_GLOBAL,
              "lightly_barlow_twins.py")[1:],
]  # fmt: skip


# --- open-clip-torch ------------------------------------------------------------------------------


class SigLipForCheck(nn.Module):
    """OpenCLIP's released ``SigLipLoss(rank, world_size, **flags)`` (from the release at
    ``root``, by default `OPEN_CLIP`) as ``loss(z0, z1)``: z0 the image features, z1 the text
    features, both normalised (the model normally does it), with SigLIP's initial logit scale
    (``exp(log 10)``) and bias (−10) held here, learnt with ``learn_scale_bias``."""

    def __init__(self, root=None, rank=0, world_size=1, learn_scale_bias=False, **flags):
        super().__init__()
        module = open_clip_loss_module(_root(root, "open-clip-torch", OPEN_CLIP))
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
        module = open_clip_loss_module(_root(root, "open-clip-torch", OPEN_CLIP))
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
        module = open_clip_loss_module(_root(root, "open-clip-torch", OPEN_CLIP))
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
    factory: str,
    flags: dict[str, Any],
    fix: Fix | None = None,
    repro: str = "",
    note: str = "",
) -> Case:
    return Case("open-clip-torch", OPEN_CLIP, loss, _flags(flags), factory, flags, fix=fix,
                repro=repro, note=note)  # fmt: skip


def _flags(flags: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value}" for key, value in flags.items()) or "defaults"


COCA_TOKENS = Fix(
    "the caption loss summed over the rank's tokens and divided by the non-pad tokens of all "
    "ranks (all_reduce), times W, instead of the mean over the rank's non-pad tokens",
    (
        (
            "open_clip/loss.py",
            "        caption_loss = self.caption_loss(\n"
            "            logits.permute(0, 2, 1),\n"
            "            labels,\n"
            "        )\n",
            "        pad = self.caption_loss.ignore_index\n"
            "        caption_loss = F.cross_entropy(\n"
            "            logits.permute(0, 2, 1), labels, ignore_index=pad, reduction='sum'\n"
            "        )\n"
            "        tokens = (labels != pad).sum().to(caption_loss.dtype)\n"
            "        if self.world_size > 1:\n"
            "            torch.distributed.all_reduce(tokens)\n"
            "        caption_loss = caption_loss * self.world_size / tokens\n",
        ),
    ),
)
GATHER_WITH_GRAD = "gather_with_grad=True (a row below)"
OPEN_CLIP_CASES = [
    _clip("ClipLoss", "OpenClipForCheck", {}, note=GATHER_WITH_GRAD),
    _clip("ClipLoss", "OpenClipForCheck", {"local_loss": True}, note=GATHER_WITH_GRAD),
    _clip("ClipLoss", "OpenClipForCheck", {"gather_with_grad": True}),
    _clip("ClipLoss", "OpenClipForCheck", {"local_loss": True, "gather_with_grad": True}),
    _clip("ClipLoss", "OpenClipForCheck", {"learn_logit_scale": True}, note=GATHER_WITH_GRAD),
    *(_clip("SigLipLoss", "SigLipForCheck", {"dist_impl": impl})
      for impl in ("bidir", "shift", "reduce", "gather")),
    _clip("SigLipLoss", "SigLipForCheck", {"learn_scale_bias": True}),
    _clip("DistillClipLoss", "DistillClipForCheck", {}, note=GATHER_WITH_GRAD),
    _clip("DistillClipLoss", "DistillClipForCheck", {"gather_with_grad": True}),
    _clip("DistillClipLoss", "DistillClipForCheck", {"local_loss": True, "gather_with_grad": True}),
    _clip("CoCaLoss", "CoCaForCheck", {}, note=GATHER_WITH_GRAD),
    _clip("CoCaLoss", "CoCaForCheck", {"gather_with_grad": True}, COCA_TOKENS, "coca_caption.py"),
    _clip("CoCaLoss", "CoCaForCheck", {"local_loss": True, "gather_with_grad": True}, COCA_TOKENS,
          "coca_caption.py"),
]  # fmt: skip


# --- simclr (Spijkervet/SimCLR) -------------------------------------------------------------------

SIMCLR = "1.0.2"
SIMCLR_FILES = ("simclr/modules/gather.py", "simclr/modules/nt_xent.py")


class SimclrNTXent(nn.Module):
    """simclr's released ``NT_Xent(batch_size, temperature=0.5, world_size)``, built for the
    batch size of each call (its mask depends on it; a user builds it with the rank's batch
    size); the views as given. It gathers when
    ``world_size`` > 1, which gatherlab passes."""

    def __init__(self, root=None, world_size=1, temperature=0.5):
        super().__init__()
        self.module = load(_root(root, "simclr", SIMCLR), SIMCLR_FILES, {})
        self.world_size, self.temperature = world_size, temperature
        self.losses: dict[int, nn.Module] = {}

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        if len(z0) not in self.losses:
            self.losses[len(z0)] = self.module.NT_Xent(len(z0), self.temperature, self.world_size)
        return self.losses[len(z0)](z0, z1)


SIMCLR_FIX = Fix(
    "gather each view on its own (z_i, then z_j); sum every rank's gradient in "
    "GatherLayer.backward (all_reduce, then the own slice); mask the positives at "
    "batch_size·world_size + i, not batch_size + i",
    (
        (
            "simclr/modules/nt_xent.py",
            "            mask[i, batch_size + i] = 0\n            mask[batch_size + i, i] = 0\n",
            "            mask[i, batch_size * world_size + i] = 0\n"
            "            mask[batch_size * world_size + i, i] = 0\n",
        ),
        (
            "simclr/modules/nt_xent.py",
            "            z = torch.cat(GatherLayer.apply(z), dim=0)\n",
            "            z = torch.cat(\n"
            "                (*GatherLayer.apply(z_i), *GatherLayer.apply(z_j)), dim=0\n"
            "            )\n",
        ),
        (
            "simclr/modules/gather.py",
            "        grad_out[:] = grads[dist.get_rank()]\n",
            "        all_gradients = torch.stack(grads)\n"
            "        dist.all_reduce(all_gradients)\n"
            "        grad_out[:] = all_gradients[dist.get_rank()]\n",
        ),
    ),
)
SIMCLR_CASES = [
    Case("simclr", SIMCLR, "NT_Xent", "world_size=W (gathers)", "SimclrNTXent", fix=SIMCLR_FIX,
         repro="simclr_nt_xent.py"),
]  # fmt: skip


# --- pytorch-metric-learning ----------------------------------------------------------------------

PML = "2.9.0"


def _importable(root: Path, package: str) -> None:
    """The release's folder first on this process's import path: a package whose imports need
    nothing absent here (no torchvision) is imported as its users import it, ``__init__`` and
    all. A copy of it imported from another folder (the release, then its fixed copy) is
    forgotten first."""
    loaded = sys.modules.get(package)
    if loaded is not None and not str(loaded.__file__).startswith(str(root) + "/"):
        for name in [name for name in sys.modules if name.split(".")[0] == package]:
            del sys.modules[name]
        sys.path[:] = [entry for entry in sys.path if not Path(entry, package).is_dir()]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))


class PmlDistributed(nn.Module):
    """pytorch-metric-learning's released ``DistributedLossWrapper(NTXentLoss(temperature=0.5),
    efficient)``, imported as a package (its imports need no torchvision). Its loss takes one
    set of embeddings and labels: here both views, ``cat(z0, z1)``, labelled by the sample's
    index in the global batch (rank·B + i on rank r; gatherlab passes rank), so that the two views
    of a sample are the positive pair. Without the wrapper (``wrap=False``) the same NTXentLoss
    on the rank's rows alone."""

    def __init__(self, root=None, rank=0, efficient=False, wrap=True):
        super().__init__()
        _importable(_root(root, "pytorch-metric-learning", PML), "pytorch_metric_learning")
        from pytorch_metric_learning import losses
        from pytorch_metric_learning.utils.distributed import DistributedLossWrapper

        loss = losses.NTXentLoss(temperature=0.5)
        self.loss = DistributedLossWrapper(loss, efficient=efficient) if wrap else loss
        self.rank = rank

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        samples = torch.arange(len(z0), device=z0.device) + self.rank * len(z0)
        return self.loss(torch.cat((z0, z1)), torch.cat((samples, samples)))


PML_EFFICIENT = Fix(
    "with efficient=True, gather the references with a gather whose backward sums the "
    "gradients (census_fixes.all_gather_rows), the own rows first as before, instead of the "
    "no-grad all_gather, and return the loss not multiplied by W",
    (
        (
            "pytorch_metric_learning/utils/distributed.py",
            "            loss = self.loss(emb, labels, indices_tuple, all_emb, all_labels)\n",
            "            loss = self.loss(emb, labels, indices_tuple, all_emb, all_labels)\n"
            "            loss = loss / world_size  # the gradient of every rank's rows is whole\n",
        ),
        (
            "pytorch_metric_learning/utils/distributed.py",
            "            all_emb = select_ref_or_regular(all_emb, all_ref_emb)\n"
            "            if indices_tuple is None:\n",
            "            all_emb = select_ref_or_regular(all_emb, all_ref_emb)\n"
            "            if all_ref_emb is None:\n"
            "                from census_fixes import all_gather_rows\n"
            "\n"
            "                gathered = list(all_gather_rows(emb).split(len(emb)))\n"
            "                own = gathered.pop(torch.distributed.get_rank())\n"
            "                all_emb = torch.cat([own, *gathered], dim=0)\n"
            "            if indices_tuple is None:\n",
        ),
    ),
)
PML_CASES = [
    Case("pytorch-metric-learning", PML, "NTXentLoss", "no wrapper", "PmlDistributed",
         {"wrap": False}, note="DistributedLossWrapper (next rows)"),
    Case("pytorch-metric-learning", PML, "DistributedLossWrapper(NTXentLoss)", "efficient=False",
         "PmlDistributed"),
    Case("pytorch-metric-learning", PML, "DistributedLossWrapper(NTXentLoss)", "efficient=True",
         "PmlDistributed", {"efficient": True}, fix=PML_EFFICIENT, repro="pml_efficient.py"),
]  # fmt: skip


# --- x-clip ---------------------------------------------------------------------------------------

X_CLIP = "0.14.4"
EINOPS = "0.8.2"  # x-clip's dependency, absent here: its wheel is put on the import path


def x_clip_gather(x: torch.Tensor, root: str | None = None) -> torch.Tensor:
    """x-clip's released ``all_gather`` (``x_clip/distributed.py``, the ``AllGather`` function its
    ``CLIP.forward`` applies to the stacked text and image latents, along the batch dimension),
    as a gather ``x -> gathered x``: ``all_gather(x, 0, None)[0]`` when a group of more than one
    rank exists, else ``x``, as ``CLIP.forward`` decides (``requires_all_gather``). Loaded alone,
    with einops (its one import besides torch) from einops's wheel."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return x
    _importable(_root(None, "einops", EINOPS), "einops")
    module = load(_root(root, "x-clip", X_CLIP), ("x_clip/distributed.py",), {})
    return module.all_gather(x, 0, None)[0]


X_CLIP_IMPORTS = Fix(
    "import torch.nn.functional as F and define exists in x_clip/distributed.py (both are used "
    "there, neither is defined)",
    (
        (
            "x_clip/distributed.py",
            "from einops import rearrange\n",
            "from einops import rearrange\n"
            "import torch.nn.functional as F\n\n"
            "def exists(val):\n"
            "    return val is not None\n",
        ),
    ),
    "imports",
)
X_CLIP_BACKWARD = Fix(
    "sum every rank's gradient (all_reduce) before AllGather.backward takes the own slice",
    (
        (
            "x_clip/distributed.py",
            "        grads_by_rank = grads.split(batch_sizes, dim = ctx.dim)\n",
            "        grads = grads.contiguous()\n"
            "        distributed.all_reduce(grads)\n"
            "        grads_by_rank = grads.split(batch_sizes, dim = ctx.dim)\n",
        ),
    ),
)
X_CLIP_GLOBAL = "every rank's full loss: gatherlab's NTXentGlobalLoss(temperature=0.5) on it"
X_CLIP_CASES = [
    Case("x-clip", X_CLIP, "all_gather (CLIP.forward's gather)", X_CLIP_GLOBAL,
         "gatherlab.losses:NTXentGlobalLoss", {"temperature": 0.5}, fix=X_CLIP_IMPORTS,
         repro="x_clip_all_gather.py", gather="x_clip_gather", needs=(("einops", EINOPS),)),
    Case("x-clip", X_CLIP, "all_gather (CLIP.forward's gather)",
         X_CLIP_GLOBAL + "; with F and exists defined (the fix above)",
         "gatherlab.losses:NTXentGlobalLoss", {"temperature": 0.5}, fix=X_CLIP_BACKWARD,
         repro="x_clip_all_gather.py", gather="x_clip_gather", needs=(("einops", EINOPS),),
         patch=X_CLIP_IMPORTS),
]  # fmt: skip


# --- solo-learn -----------------------------------------------------------------------------------

SOLO = "1.0.2"


def solo_gather(x: torch.Tensor, root: str | None = None) -> torch.Tensor:
    """solo-learn's released ``solo.utils.misc.gather`` (its ``GatherLayer``; NNCLR, NNBYOL,
    NNSiam, ReSSL and MoCo v2+ gather with it), as a gather ``x -> gathered x``. Loaded alone:
    misc.py imports only torch besides the standard library."""
    module = load(_root(root, "solo-learn", SOLO), ("solo/utils/misc.py",), {})
    return module.gather(x)


class SoloBarlow(nn.Module):
    """solo-learn's released ``barlow_loss_func(z0, z1, lamb=5e-3, scale_loss=0.025)`` itself
    (a function: it all-reduces the cross-correlation whenever a process group exists; no
    flag), held in a module (gatherlab records where a loss departs only inside a module's
    forward)."""

    def __init__(self, root=None, lamb=5e-3, scale_loss=0.025):
        super().__init__()
        self.module = load(_root(root, "solo-learn", SOLO), ("solo/losses/barlow.py",), {})
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
        module = load(_root(root, "solo-learn", SOLO), ("solo/losses/dino.py",), {})
        self.loss = module.DINOLoss(16, 0.04, 0.04, 0, 1)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        student = torch.cat((z0, z1))
        return self.loss(student, student.detach())


SOLO_BARLOW_FIX = Fix(
    "standardise with the whole batch's mean and variance (all-reduced), and all-reduce corr "
    "with an all-reduce whose backward sums the gradients (census_fixes.all_reduce_sum) instead "
    "of dist.all_reduce (no backward)",
    (
        (
            "solo/losses/barlow.py",
            "    bn = torch.nn.BatchNorm1d(D, affine=False).to(z1.device, z1.dtype)\n"
            "    z1 = bn(z1)\n"
            "    z2 = bn(z2)\n",
            "    from census_fixes import all_reduce_sum\n"
            "\n"
            "    def bn(z):\n"
            "        if not (dist.is_available() and dist.is_initialized()):\n"
            "            return torch.nn.functional.batch_norm(z, None, None, training=True)\n"
            "        w = dist.get_world_size()\n"
            "        mean = all_reduce_sum(z.mean(0)) / w\n"
            "        var = all_reduce_sum((z - mean).pow(2).mean(0)) / w\n"
            "        return (z - mean) / torch.sqrt(var + 1e-5)\n"
            "\n"
            "    z1 = bn(z1)\n"
            "    z2 = bn(z2)\n",
        ),
        (
            "solo/losses/barlow.py",
            "        dist.all_reduce(corr)\n        world_size = dist.get_world_size()\n"
            "        corr /= world_size\n",
            "        world_size = dist.get_world_size()\n"
            "        corr = all_reduce_sum(corr / world_size)\n",
        ),
    ),
)
SOLO_GATHER_FIX = Fix(
    "sum every rank's gradient (all_reduce) in GatherLayer.backward before taking the own slice",
    (
        (
            "solo/utils/misc.py",
            "            grad_out[:] = grads[dist.get_rank()]\n",
            "            all_gradients = torch.stack(grads)\n"
            "            dist.all_reduce(all_gradients)\n"
            "            grad_out[:] = all_gradients[dist.get_rank()]\n",
        ),
    ),
)
SOLO_FLOAT64 = Fix(
    "the BatchNorm1d built in the input's dtype (.to(z1.device, z1.dtype)): built in float32, "
    "it refuses the check's float64",
    (
        (
            "solo/losses/barlow.py",
            "    bn = torch.nn.BatchNorm1d(D, affine=False).to(z1.device)\n",
            "    bn = torch.nn.BatchNorm1d(D, affine=False).to(z1.device, z1.dtype)\n",
        ),
    ),
    "float64",
)
SOLO_CASES = [
    Case("solo-learn", SOLO, "barlow_loss_func",
         "defaults (all-reduces in any group); its BatchNorm1d in float64 (patched: see the notes)",
         "SoloBarlow", fix=SOLO_BARLOW_FIX, repro="solo_barlow.py", patch=SOLO_FLOAT64),
    Case("solo-learn", SOLO, "DINOLoss", "defaults (all-reduces its center in any group)",
         "SoloDINO", steps=3),
    Case("solo-learn", SOLO, "utils.misc.gather (GatherLayer)",
         "rank's rows against the gathered batch: gatherlab's NTXentLoss(temperature=0.5) on it",
         "gatherlab.losses:NTXentLoss", {"temperature": 0.5}, fix=SOLO_GATHER_FIX,
         repro="solo_gather.py", gather="solo_gather"),
]  # fmt: skip


# --- sentence-transformers -----------------------------------------------------------------------

SBERT = "6.2.0"
SBERT_UTIL = (  # the files of sentence_transformers.util the losses use, their imports first
    "sentence_transformers/util/environment.py",
    "sentence_transformers/util/tensor.py",
    "sentence_transformers/util/similarity.py",
    "sentence_transformers/util/distributed.py",
)
SBERT_LOSSES = (
    "sentence_transformers/sentence_transformer/losses/multiple_negatives_ranking.py",
    "sentence_transformers/sentence_transformer/losses/cached_multiple_negatives_ranking.py",
)
NO_TRANSFORMERS = "transformers is not installed here"


class _Logger(logging.LoggerAdapter):
    """transformers' logger as these files use it: a standard logger with ``warning_once``."""

    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        self.warning(*args, **kwargs)


def _shim(name: str, why: str, **attributes: Any) -> types.ModuleType:
    """A stub (`_absent`) that holds ``attributes``: the names the loaded files import from it."""
    module = _absent(name, why)
    module.__path__ = []  # also a package, for the stubs below it
    for attribute, value in attributes.items():
        setattr(module, attribute, value)
    return module


def _unused(name: str, why: str) -> Any:
    def unused(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{name}: not loaded here ({why})")

    return unused


def sbert_modules(root: str | Path | None) -> types.ModuleType:
    """sentence-transformers' released ``multiple_negatives_ranking.py`` and
    ``cached_multiple_negatives_ranking.py`` (the last returned, the first its attribute chain),
    with the four files of ``sentence_transformers.util`` they use: ``distributed.py`` (the
    gather: ``all_gather_with_grad``, ``get_rank``), ``similarity.py`` (``cos_sim``),
    ``tensor.py`` and ``environment.py``. The package's ``__init__`` needs transformers, absent
    here; stubbed: ``transformers`` (``is_torch_npu_available`` False, ``utils.logging`` a
    standard logger, ``is_torchdynamo_compiling`` False), ``util.misc`` (``disable_logging``,
    ``similarity_fct_name``: for objects and config dicts, unused by the loss),
    ``base.losses.merged_forward`` (``embed_columns``: runs the model, which gatherlab's MLP
    replaces), ``sentence_transformer.model`` (the model's class, an annotation),
    ``base.losses.gradcache`` (GradCache's mini-batching through the model, which
    ``calculate_loss`` on given embeddings does not use: ``CachedLossMixin`` an empty class,
    ``has_static_embedding_input`` False, the token check a no-op)."""
    root = _root(root, "sentence-transformers", SBERT)
    utils = types.SimpleNamespace(
        logging=types.SimpleNamespace(get_logger=lambda name: _Logger(logging.getLogger(name))),
        is_torchdynamo_compiling=lambda: False,
    )
    transformers = _shim("transformers", NO_TRANSFORMERS, is_torch_npu_available=lambda: False)
    transformers.utils = _shim("transformers.utils", NO_TRANSFORMERS, **vars(utils))
    absent = {"transformers": transformers, "transformers.utils": transformers.utils}
    misc = _shim(
        "sentence_transformers.util.misc", "unused by the loss",
        disable_logging=_unused("disable_logging", "unused by the loss"),
        similarity_fct_name=_unused("similarity_fct_name", "for config dicts"),
    )  # fmt: skip
    prefix = _synthetic(root)  # the util files import misc relatively, by its loaded name
    sys.modules[f"{prefix}.sentence_transformers.util.misc"] = misc
    with _as_imported(absent, []):  # top-level stubs, which load does not take
        distributed = load(root, SBERT_UTIL, {"sentence_transformers.util.misc": misc})
    similarity = sys.modules[f"{prefix}.sentence_transformers.util.similarity"]
    util = _shim(
        "sentence_transformers.util", "only what the losses import is loaded",
        all_gather_with_grad=distributed.all_gather_with_grad, get_rank=distributed.get_rank,
        cos_sim=similarity.cos_sim, similarity_fct_name=misc.similarity_fct_name,
    )  # fmt: skip
    why = "it runs or describes the model, which gatherlab's MLP replaces"
    gradcache = _shim(
        "sentence_transformers.base.losses.gradcache", why,
        CachedLossMixin=type("CachedLossMixin", (), {}),
        RandContext=None, _create_minibatch=None, _get_batch_size=None,
        _validate_mini_batch_num_tokens=lambda value: None,
        has_static_embedding_input=lambda model: False,
    )  # fmt: skip
    stubs = {
        "sentence_transformers.util": util,
        "sentence_transformers.base": _shim("sentence_transformers.base", why),
        "sentence_transformers.base.losses": _shim("sentence_transformers.base.losses", why),
        "sentence_transformers.base.losses.merged_forward": _shim(
            "sentence_transformers.base.losses.merged_forward", why, embed_columns=None
        ),
        "sentence_transformers.base.losses.gradcache": gradcache,
        "sentence_transformers.sentence_transformer.model": _shim(
            "sentence_transformers.sentence_transformer.model", why, SentenceTransformer=None
        ),
    }
    with _as_imported(absent, []):
        return load(root, SBERT_LOSSES, stubs)


class SbertMNRL(nn.Module):
    """sentence-transformers' released ``MultipleNegativesRankingLoss(model=None, **flags)``
    through ``compute_loss_from_embeddings([z0, z1], labels=None)``, what its ``forward`` calls
    once the model has embedded the two columns (z0 the anchors, z1 the positives); with
    ``cached=True`` ``CachedMultipleNegativesRankingLoss(model=None, mini_batch_size=4,
    **flags)`` through ``calculate_loss([[z0], [z1]])``, its loss over mini-batches of 4 rows of
    the score matrix (GradCache's recomputation of the model is not what is checked: the
    embeddings are given)."""

    def __init__(self, root=None, cached=False, **flags):
        super().__init__()
        module = sbert_modules(root)
        self.cached = cached
        if cached:
            self.loss = module.CachedMultipleNegativesRankingLoss(None, mini_batch_size=4, **flags)
        else:
            ranking = sys.modules[_synthetic(_root(root, "sentence-transformers", SBERT))
                                  + ".sentence_transformers.sentence_transformer.losses"
                                  + ".multiple_negatives_ranking"]  # fmt: skip
            self.loss = ranking.MultipleNegativesRankingLoss(None, **flags)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        if self.cached:
            return self.loss.calculate_loss([[z0], [z1]])
        return self.loss.compute_loss_from_embeddings([z0, z1], None)


GATHER_ACROSS = "gather_across_devices=True (next row)"


def _sbert(loss: str, cached: bool, **flags: Any) -> list[Case]:
    on = {**flags, "gather_across_devices": True}
    return [
        Case("sentence-transformers", SBERT, loss, _flags(flags) + " (no gathering)",
             "SbertMNRL", {"cached": cached, **flags}, note=GATHER_ACROSS),
        Case("sentence-transformers", SBERT, loss, _flags(on), "SbertMNRL",
             {"cached": cached, **on}),
    ]  # fmt: skip


SYMMETRIC = ("query_to_doc", "doc_to_query")  # MultipleNegativesSymmetricRankingLoss's directions
SBERT_CASES = [
    *_sbert("MultipleNegativesRankingLoss", False),
    *_sbert("MultipleNegativesRankingLoss", False, directions=SYMMETRIC),
    *_sbert("CachedMultipleNegativesRankingLoss", True),
    *_sbert("CachedMultipleNegativesRankingLoss", True, directions=SYMMETRIC),
]


# --- torchmultimodal (torchmultimodal-nightly: the registry has no torchmultimodal) --------------

TMM = "2024.4.1"
TMM_PACKAGE = "torchmultimodal-nightly"
TMM_CONTRASTIVE = (
    "torchmultimodal/utils/distributed.py",
    "torchmultimodal/modules/losses/contrastive_loss_with_temperature.py",
)
TMM_BLIP2 = (
    "torchmultimodal/utils/distributed.py",
    "torchmultimodal/modules/losses/blip2_losses.py",
)


class TmmContrastive(nn.Module):
    """torchmultimodal's released ``ContrastiveLossWithTemperature()`` (its logit scale a
    parameter, learnt, from log(1/0.07)) on z0 and z1 normalised (the models normalise before
    it), called with ``backprop_type`` (``GLOBAL``, its default, ``LOCAL`` or ``NONE``), a
    forward argument of the loss."""

    def __init__(self, root=None, backprop_type="GLOBAL"):
        super().__init__()
        self.module = load(_root(root, TMM_PACKAGE, TMM), TMM_CONTRASTIVE, {})
        self.loss = self.module.ContrastiveLossWithTemperature()
        self.backprop_type = self.module.BackpropType[backprop_type]

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        z0, z1 = F.normalize(z0, dim=-1), F.normalize(z1, dim=-1)
        return self.loss(z0, z1, backprop_type=self.backprop_type)


class TmmBlip2Itc(nn.Module):
    """torchmultimodal's released BLIP-2 image-text contrastive loss:
    ``itc_loss(*compute_image_text_similarity(image, text, temp))`` (label smoothing 0.1), as
    ``Blip2Phase1Loss`` computes it: image the query tokens, z0 as 2 tokens of 8 (each
    normalised), text z1's first 8 values normalised, ``temp`` 0.07 held here. One stub:
    ``torchmultimodal.models.blip2.blip2`` (the model; ``Blip2Output`` is only an annotation
    here)."""

    def __init__(self, root=None):
        super().__init__()
        stubs = {"torchmultimodal.models.blip2.blip2": _shim(
            "torchmultimodal.models.blip2.blip2", "the BLIP-2 model, not the loss",
            Blip2Output=None)}  # fmt: skip
        stubs["torchmultimodal.models"] = _shim("torchmultimodal.models", "the models")
        stubs["torchmultimodal.models.blip2"] = _shim("torchmultimodal.models.blip2", "the model")
        self.module = load(_root(root, TMM_PACKAGE, TMM), TMM_BLIP2, stubs)
        self.register_buffer("temp", torch.tensor(0.07))

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        image = F.normalize(z0.view(len(z0), 2, 8), dim=-1)
        text = F.normalize(z1[:, :8], dim=-1)
        return self.module.itc_loss(
            *self.module.compute_image_text_similarity(image, text, self.temp)
        )


TMM_LOCAL = "backprop_type=GLOBAL (its default; next rows)"
BLIP2_GATHER = Fix(
    "gather the image and text features with a gather whose backward sums the gradients, made "
    "contiguous (census_fixes.all_gather_rows), instead of concat_gather_all_gpu with "
    "BackpropType.NONE",
    (
        (
            "torchmultimodal/modules/losses/blip2_losses.py",
            "    image_features_all = concat_gather_all_gpu(\n"
            "        image_features, backprop_type=BackpropType.NONE\n",
            "    from census_fixes import all_gather_rows\n"
            "\n"
            "    image_features_all = all_gather_rows(\n"
            "        image_features\n",
        ),
        (
            "torchmultimodal/modules/losses/blip2_losses.py",
            "    text_features_all = concat_gather_all_gpu(\n"
            "        text_features, backprop_type=BackpropType.NONE\n",
            "    text_features_all = all_gather_rows(\n        text_features\n",
        ),
    ),
)
BLIP2_GLOBAL = Fix(  # the released flag in place of NONE: a row of its own, not the fix
    "the image and text features gathered with BackpropType.GLOBAL instead of NONE",
    (
        (
            "torchmultimodal/modules/losses/blip2_losses.py",
            "    image_features_all = concat_gather_all_gpu(\n"
            "        image_features, backprop_type=BackpropType.NONE\n",
            "    image_features_all = concat_gather_all_gpu(\n"
            "        image_features, backprop_type=BackpropType.GLOBAL\n",
        ),
        (
            "torchmultimodal/modules/losses/blip2_losses.py",
            "    text_features_all = concat_gather_all_gpu(\n"
            "        text_features, backprop_type=BackpropType.NONE\n",
            "    text_features_all = concat_gather_all_gpu(\n"
            "        text_features, backprop_type=BackpropType.GLOBAL\n",
        ),
    ),
    "global",
)
TMM_CASES = [
    *(Case(TMM_PACKAGE, TMM, "ContrastiveLossWithTemperature", f"backprop_type={kind}",
           "TmmContrastive", {"backprop_type": kind}, note="" if kind == "GLOBAL" else TMM_LOCAL)
      for kind in ("GLOBAL", "LOCAL", "NONE")),
    Case(TMM_PACKAGE, TMM, "itc_loss(compute_image_text_similarity) (BLIP-2)",
         "defaults (gathers in any group)", "TmmBlip2Itc", fix=BLIP2_GATHER,
         repro="blip2_itc.py"),
    Case(TMM_PACKAGE, TMM, "itc_loss(compute_image_text_similarity) (BLIP-2)",
         "BackpropType.GLOBAL in place of NONE (patched: see the notes)", "TmmBlip2Itc",
         repro="blip2_itc.py", patch=BLIP2_GLOBAL,
         note="not a fix on gloo (see the notes); the fix is the row above's"),
]  # fmt: skip


# --- LAVIS (salesforce-lavis) ---------------------------------------------------------------------

LAVIS = "1.0.2"


class LavisClip(nn.Module):
    """LAVIS's released ``ClipLoss`` (``lavis/models/clip_models/loss.py``, loaded alone: it
    imports torch and, optionally, horovod, absent here) as OpenCLIP's is checked
    (`OpenClipForCheck`): features normalised, logit scale 1/0.07 held here."""

    def __init__(self, root=None, rank=0, world_size=1, **flags):
        super().__init__()
        files = ("lavis/models/clip_models/loss.py",)
        module = load(_root(root, "salesforce-lavis", LAVIS), files, {})
        self.loss = module.ClipLoss(rank=rank, world_size=world_size, **flags)
        self.register_buffer("logit_scale", torch.tensor(1 / 0.07).log())

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        z0, z1 = F.normalize(z0, dim=-1), F.normalize(z1, dim=-1)
        return self.loss(z0, z1, self.logit_scale.exp())


def _lavis(flags: dict[str, Any], note: str = "") -> Case:
    return Case("salesforce-lavis", LAVIS, "ClipLoss", _flags(flags), "LavisClip", flags,
                note=note)  # fmt: skip


LAVIS_CASES = [
    _lavis({}, "gather_with_grad=True (a row below)"),
    _lavis({"local_loss": True}, "gather_with_grad=True (a row below)"),
    _lavis({"gather_with_grad": True}),
    _lavis({"local_loss": True, "gather_with_grad": True}),
]


# --- CoCa-pytorch --------------------------------------------------------------------------------

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
        _importable(_root(None, "einops", EINOPS), "einops")
        files = ("coca_pytorch/coca_pytorch.py",)
        module = load(_root(root, COCA_PACKAGE, COCA), files, {})
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
    (
        (
            "coca_pytorch/coca_pytorch.py",
            "        contrastive_labels = torch.arange(batch, device=device)\n",
            "        contrastive_labels = torch.arange(sim.shape[0], device=device)\n",
        ),
    ),
    "labels",
)
COCA_BACKWARD = Fix(
    "sum every rank's gradient (all_reduce) before AllGather.backward takes the own slice",
    (
        (
            "coca_pytorch/coca_pytorch.py",
            "        grads_by_rank = grads.split(batch_sizes, dim = 0)\n",
            "        grads = grads.contiguous()\n"
            "        dist.all_reduce(grads)\n"
            "        grads_by_rank = grads.split(batch_sizes, dim = 0)\n",
        ),
    ),
)
COCA_CASES = [
    Case(COCA_PACKAGE, COCA, "CoCa (forward, return_loss=True)", "defaults (gathers in any group)",
         "CocaPytorch", fix=COCA_LABELS, repro="coca_pytorch.py", needs=(("einops", EINOPS),)),
    Case(COCA_PACKAGE, COCA, "CoCa (forward, return_loss=True)",
         "defaults; with the labels of every gathered row (the fix above)", "CocaPytorch",
         fix=COCA_BACKWARD, repro="coca_pytorch.py", needs=(("einops", EINOPS),),
         patch=COCA_LABELS),
]  # fmt: skip


# --- lightning-bolts -----------------------------------------------------------------------------

BOLTS = "0.7.0"
BOLTS_SIMCLR = (
    "pl_bolts/utils/stability.py",
    "pl_bolts/models/self_supervised/simclr/simclr_module.py",
)


def _bolts_stubs() -> dict[str, types.ModuleType]:
    """What ``simclr_module.py`` imports for the model and its training, not for its loss
    (``nt_xent_loss`` and ``SyncFunction``): the ResNets, LARS, the schedule and the datasets'
    normalisations (torchvision)."""
    why = "the model, optimiser and data of the SimCLR module (torchvision), not its loss"
    names = {
        "pl_bolts.models.self_supervised.resnets": ("resnet18", "resnet50"),
        "pl_bolts.optimizers.lars": ("LARS",),
        "pl_bolts.optimizers.lr_scheduler": ("linear_warmup_decay",),
        "pl_bolts.transforms.dataset_normalizations": (
            "cifar10_normalization", "imagenet_normalization", "stl10_normalization",
        ),
    }  # fmt: skip
    stubs = {"pl_bolts.optimizers": _shim("pl_bolts.optimizers", why),
             "pl_bolts.transforms": _shim("pl_bolts.transforms", why)}  # fmt: skip
    for name, attributes in names.items():
        stubs[name] = _shim(name, why, **{a: _unused(a, why) for a in attributes})
    return stubs


class BoltsNTXent(nn.Module):
    """lightning-bolts's released ``SimCLR.nt_xent_loss(out_1, out_2, temperature=0.5)`` (a
    method that does not use its module: called unbound) on z0 and z1 normalised, as its
    docstring assumes and its projection head returns them. It gathers with ``SyncFunction``
    whenever a group exists."""

    def __init__(self, root=None, temperature=0.5):
        super().__init__()
        self.module = load(_root(root, "lightning-bolts", BOLTS), BOLTS_SIMCLR, _bolts_stubs())
        self.temperature = temperature

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        z0, z1 = F.normalize(z0, dim=1), F.normalize(z1, dim=1)
        return self.module.SimCLR.nt_xent_loss(None, z0, z1, self.temperature)


class BoltsSwav(nn.Module):
    """lightning-bolts's released ``SWAVLoss(temperature=0.1, crops_for_assign=(0, 1),
    num_crops=(2,), sinkhorn_iterations=3, epsilon=0.05, gpus, num_nodes)`` with the ranks
    spread over ``nodes`` nodes (``gpus`` = W / nodes per node, as the SwAV module passes its
    trainer's): ``output`` is both views' scores against 8 fixed prototypes (as `LightlySwaV`),
    ``embedding`` the two views, no queue. Its ``forward`` returns (loss, queue, use_queue):
    the loss is returned."""

    def __init__(self, root=None, world_size=1, nodes=1):
        super().__init__()
        module = load(_root(root, "lightning-bolts", BOLTS),
                      ("pl_bolts/models/self_supervised/swav/loss.py",), {})  # fmt: skip
        self.loss = module.SWAVLoss(0.1, (0, 1), (2,), 3, 0.05, world_size // nodes, nodes)
        generator = torch.Generator().manual_seed(0)
        prototypes = torch.randn(8, 16, generator=generator, dtype=torch.float64)
        self.register_buffer("prototypes", F.normalize(prototypes, dim=1))

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        embedding = F.normalize(torch.cat((z0, z1)), dim=1)
        loss, _, _ = self.loss(embedding @ self.prototypes.T, embedding, self.prototypes, len(z0))
        return loss


BOLTS_CPU = Fix(
    "CPU, float64: the sinkhorns' .cuda() calls removed (gpus > 0 puts r and c on CUDA) and "
    "their codes kept in the input's dtype (.float() casts them to float32)",
    tuple(
        ("pl_bolts/models/self_supervised/swav/loss.py", old, new)
        for old, new in (
            (
                "                r = torch.ones(dim_k).cuda() / dim_k\n",
                "                r = torch.ones(dim_k) / dim_k\n",
            ),
            (
                "                c = torch.ones(dim_b).cuda() / dim_b\n",
                "                c = torch.ones(dim_b) / dim_b\n",
            ),
            (
                "                r = torch.ones(q.shape[0]).cuda(non_blocking=True) / q.shape[0]\n",
                "                r = torch.ones(q.shape[0]) / q.shape[0]\n",
            ),
            (
                "                c = torch.ones(q.shape[1]).cuda(non_blocking=True) / (self.gpus * "
                "q.shape[1])\n",
                "                c = torch.ones(q.shape[1]) / (self.gpus * q.shape[1])\n",
            ),
            (
                "            return (q / torch.sum(q, dim=0, keepdim=True)).t().float()\n"
                "\n    def distributed_sinkhorn",
                "            return (q / torch.sum(q, dim=0, keepdim=True)).t()\n"
                "\n    def distributed_sinkhorn",
            ),
            (
                "                dist.all_reduce(curr_sum)\n"
                "            return (q / torch.sum(q, dim=0, keepdim=True)).t().float()\n",
                "                dist.all_reduce(curr_sum)\n"
                "            return (q / torch.sum(q, dim=0, keepdim=True)).t()\n",
            ),
        )
    ),
    "cpu",
)
BOLTS_CASES = [
    Case("lightning-bolts", BOLTS, "SimCLR.nt_xent_loss", "defaults (gathers in any group)",
         "BoltsNTXent"),
    Case("lightning-bolts", BOLTS, "SWAVLoss", "gpus=W, num_nodes=1; patched for CPU float64",
         "BoltsSwav", patch=BOLTS_CPU),
    Case("lightning-bolts", BOLTS, "SWAVLoss",
         "gpus=W/2, num_nodes=2; patched for CPU float64", "BoltsSwav", {"nodes": 2},
         patch=BOLTS_CPU),
]  # fmt: skip


# --- vissl ---------------------------------------------------------------------------------------

VISSL = "0.1.6"
CLASSY_DIST = "classy_vision/generic/distributed_util.py"  # vissl's wheel carries classy_vision


def _vissl_stubs() -> dict[str, types.ModuleType]:
    """The registry and config classes the losses' files import: ``ClassyLoss`` (the base of
    the config-built wrapper, not of the criterion checked: an ``nn.Module``), ``register_loss``
    (a decorator of that wrapper: returns it) and ``AttrDict`` (a dict here)."""
    why = "the wrapper's config registry, not the criterion"
    classy = _shim("classy_vision.losses", why, ClassyLoss=nn.Module,
                   register_loss=lambda name: lambda cls: cls)  # fmt: skip
    return {
        "classy_vision.losses": classy,
        "vissl.config": _shim("vissl.config", why, AttrDict=dict),
        "vissl.utils.hydra_config": _shim("vissl.utils.hydra_config", why, AttrDict=dict),
    }


class VisslSimclr(nn.Module):
    """vissl's released ``SimclrInfoNCECriterion(buffer_params, temperature=0.1)`` on the
    rank's embedding as vissl lays it out: both views concatenated, ``cat(z0, z1)`` (its masks
    are built for that layout, with ``world_size`` W, ``effective_batch_size`` 2·16 and the rank
    from torch.distributed), on CPU (classy_vision's ``set_cpu_device()``, as vissl's CPU runs
    set it); it gathers with vissl's ``gather_from_all``."""

    def __init__(self, root=None, world_size=1):
        super().__init__()
        files = (CLASSY_DIST, "vissl/utils/distributed_utils.py",
                 "vissl/losses/simclr_info_nce_loss.py")  # fmt: skip
        root = _root(root, "vissl", VISSL)
        module = load(root, files, _vissl_stubs())
        # as vissl runs on CPU (MACHINE.DEVICE cpu): else the masks are moved to CUDA
        sys.modules[f"{_synthetic(root)}.classy_vision.generic.distributed_util"].set_cpu_device()
        buffer = types.SimpleNamespace(world_size=world_size, embedding_dim=16,
                                       effective_batch_size=32)  # fmt: skip
        self.loss = module.SimclrInfoNCECriterion(buffer, temperature=0.1)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        return self.loss(F.normalize(torch.cat((z0, z1)), dim=1))


class VisslBarlow(nn.Module):
    """vissl's released ``BarlowTwinsCriterion(lambda_=0.0051, scale_loss=0.024,
    embedding_dim=16)`` on the rank's embedding ``cat(z0, z1)`` (the layout its docstring asks
    for); it standardises with ``SyncNormalizeFunction`` (statistics all-reduced) and averages
    the cross-correlation with classy_vision's ``all_reduce_mean``."""

    def __init__(self, root=None):
        super().__init__()
        files = (CLASSY_DIST, "vissl/utils/apex_helpers.py", "vissl/losses/barlow_twins_loss.py")
        module = load(_root(root, "vissl", VISSL), files, _vissl_stubs())
        self.loss = module.BarlowTwinsCriterion(0.0051, 0.024, 16)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        return self.loss(torch.cat((z0, z1)))


VISSL_BARLOW_FIX = Fix(
    "average the cross-correlation with an all-reduce whose backward sums the gradients "
    "(census_fixes.all_reduce_sum) instead of classy_vision's all_reduce_mean (an in-place "
    "all_reduce that autograd does not see)",
    (
        (
            "vissl/losses/barlow_twins_loss.py",
            "        correlation_matrix = all_reduce_mean(correlation_matrix)\n",
            "        if torch.distributed.is_available() and torch.distributed.is_initialized():\n"
            "            from census_fixes import all_reduce_sum\n"
            "\n"
            "            correlation_matrix = all_reduce_sum(\n"
            "                correlation_matrix / torch.distributed.get_world_size()\n"
            "            )\n",
        ),
    ),
)
VISSL_CASES = [
    Case("vissl", VISSL, "SimclrInfoNCECriterion", "defaults (gathers in any group)",
         "VisslSimclr"),
    Case("vissl", VISSL, "BarlowTwinsCriterion", "defaults (all-reduces in any group)",
         "VisslBarlow", fix=VISSL_BARLOW_FIX, repro="vissl_barlow.py"),
]  # fmt: skip


# --- the census -----------------------------------------------------------------------------------

CASES: list[Case] = [
    *LIGHTLY_CASES, *OPEN_CLIP_CASES, *SBERT_CASES, *PML_CASES, *SOLO_CASES, *SIMCLR_CASES,
    *X_CLIP_CASES, *COCA_CASES, *TMM_CASES, *LAVIS_CASES, *BOLTS_CASES, *VISSL_CASES,
]  # fmt: skip
REMARKS = {  # (package, loss, flags) → a note under the table
    ("lightly", "MSNLoss", "gather_distributed=True"):
        "`where` names the Sinkhorn's `torch.sum` (msn_loss.py:83), a partial sum that the "
        "in-place `dist.all_reduce` on the next line completes; what departs is the me-max "
        "regularisation's mean over the rank's rows (msn_loss.py:236): all-reduced, the loss "
        "is exact",
    ("lightly", "PMSNLoss", "gather_distributed=True"):
        "as MSNLoss's: the regularisation's mean over the rank's rows (msn_loss.py:236, "
        "inherited); `where` names the Sinkhorn's partial `sum`",
    ("solo-learn", "barlow_loss_func", SOLO_CASES[0].flags):
        "its `BatchNorm1d(D)` is built in float32 and refuses the check's float64: the row is "
        "of the release with `.to(z1.device, z1.dtype)`, the fix applied on top",
    ("lightning-bolts", "SWAVLoss", BOLTS_CASES[2].flags):
        "patched for CPU and float64 (the sinkhorns' `.cuda()` and `.float()`); with two "
        "nodes the column marginal is 1/(gpus·B), not 1/(gpus·num_nodes·B), a uniform scale "
        "that the final column normalisation cancels: exact",
    (TMM_PACKAGE, TMM_CASES[4].loss, TMM_CASES[4].flags):
        "the release with its own flag, `BackpropType.GLOBAL` (torch.distributed.nn's "
        "`all_gather`, whose backward sums), in place of `NONE` in both gathers: still biased "
        "on gloo, because that backward receives gradients that are not contiguous here (the "
        "image features are permuted after the gather) and scatters them into buffers of the "
        "same strides, and gloo's scatter gives a wrong result for them (measured by "
        "[torch_gloo_all_gather.py](../experiments/census_repro/torch_gloo_all_gather.py): the "
        "same gather's gradient has cosine 0.267 when it is not contiguous, 1 when it is); the "
        "fix, census_fixes.all_gather_rows, makes the gradient contiguous before summing it "
        "(the row above)",
    ("pytorch-metric-learning", "DistributedLossWrapper(NTXentLoss)", "efficient=False"):
        "`loss scaled`: the loss is W × one device's (`return loss * world_size`) and the "
        "gradient exact after DDP's average: training is one device's, the logged loss W "
        "times it",
}  # fmt: skip
CASES = [
    dataclasses.replace(case, remark=REMARKS.get((case.package, case.loss, case.flags), ""))
    for case in CASES
]
__all__ = ["CASES", "NOT_RUN", "OpenClipForCheck"]
NOT_YET = "not checked yet: needs an adapter for its inputs"
NOT_RUN: list[NotRun] = [
    NotRun("lightly", LIGHTLY, "DetConSLoss, DetConBLoss", NOT_YET + " (region masks per view)"),
    NotRun("lightly", LIGHTLY, "VICRegLLoss", NOT_YET + " (local features and their grids)"),
    NotRun("lightly", LIGHTLY, "SIGReg, LeJEPALoss", NOT_YET + " (random projections drawn "
           "from the global generator, broadcast from rank 0)"),
    NotRun("lightly", LIGHTLY, "VISRegLoss, LeWMLoss", NOT_YET),
    NotRun("sentence-transformers", SBERT, "GISTEmbedLoss, CachedGISTEmbedLoss",
           NOT_YET + " (a guide model's embeddings)"),
    NotRun("sentence-transformers", SBERT, "the multi-vector, sparse and cross-encoder "
           "MultipleNegativesRankingLoss variants", NOT_YET),
    NotRun("sentence-transformers", SBERT, "(Cached)MultipleNegativesSymmetricRankingLoss",
           "deprecated wrappers of the losses above with directions (query_to_doc, "
           "doc_to_query): those rows"),
    NotRun("solo-learn", SOLO, "swav_loss_func with SinkhornKnopp, deepclusterv2, k-means",
           NOT_YET + " (prototypes, queues)"),
    NotRun("solo-learn", SOLO, "the methods (NNCLR, MoCo v2+, …)", "their files import "
           "torchvision (a LightningModule each): their gather is checked above"),
    NotRun("vissl", VISSL, "SwAV, DINO, MoCo, NCE, DeepClusterV2 losses",
           NOT_YET + " (config-built, with queues or prototypes)"),
    NotRun(TMM_PACKAGE, TMM, "FLAVA losses; BLIP-2 ITM and ITG",
           "need the models' heads and tokens at the call; not checked yet"),
    NotRun("salesforce-lavis", LAVIS, "BLIP, BLIP-2, ALBEF contrastive losses", "computed "
           "inside the models' forward, whose files import transformers (absent here)"),
    NotRun("lightning-bolts", BOLTS, "MoCo v2 (moco2_module.py)", "inside a LightningModule "
           "that imports torchvision; its no-grad key gather feeds a queue: not checked yet"),
]  # fmt: skip
