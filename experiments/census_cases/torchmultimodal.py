"""The census's cases of torchmultimodal 2024.4.1 (the wheel torchmultimodal-nightly: the
registry has no torchmultimodal): ``ContrastiveLossWithTemperature`` with each
``BackpropType``, and BLIP-2's image-text contrastive loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from public_code import load
from torch import nn

from census_cases.common import Case, Fix, NotRun, root_of, shim

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
        self.module = load(root_of(root, TMM_PACKAGE, TMM), TMM_CONTRASTIVE, {})
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
        stubs = {"torchmultimodal.models.blip2.blip2": shim(
            "torchmultimodal.models.blip2.blip2", "the BLIP-2 model, not the loss",
            Blip2Output=None)}  # fmt: skip
        stubs["torchmultimodal.models"] = shim("torchmultimodal.models", "the models")
        stubs["torchmultimodal.models.blip2"] = shim("torchmultimodal.models.blip2", "the model")
        self.module = load(root_of(root, TMM_PACKAGE, TMM), TMM_BLIP2, stubs)
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
    "torchmultimodal/blip2_gather.patch",
)
BLIP2_GLOBAL = Fix(  # the released flag in place of NONE: a row of its own, not the fix
    "the image and text features gathered with BackpropType.GLOBAL instead of NONE",
    "torchmultimodal/blip2_global.patch",
)
GLOBAL_REMARK = (
    "the release with its own flag, `BackpropType.GLOBAL` (torch.distributed.nn's `all_gather`, "
    "whose backward sums), in place of `NONE` in both gathers: still biased on gloo, because "
    "that backward receives gradients that are not contiguous here (the image features are "
    "permuted after the gather) and scatters them into buffers of the same strides, and gloo's "
    "scatter gives a wrong result for them (measured by "
    "[torch_gloo_all_gather.py](../experiments/census_repro/torch_gloo_all_gather.py): the same "
    "gather's gradient has cosine 0.267 when it is not contiguous, 1 when it is); the fix, "
    "census_fixes.all_gather_rows, makes the gradient contiguous before summing it (the row "
    "above)"
)
CASES = [
    *(Case(TMM_PACKAGE, TMM, "ContrastiveLossWithTemperature", f"backprop_type={kind}",
           TmmContrastive, {"backprop_type": kind}, note="" if kind == "GLOBAL" else TMM_LOCAL)
      for kind in ("GLOBAL", "LOCAL", "NONE")),
    Case(TMM_PACKAGE, TMM, "itc_loss(compute_image_text_similarity) (BLIP-2)",
         "defaults (gathers in any group)", TmmBlip2Itc, fix=BLIP2_GATHER,
         repro="blip2_itc.py"),
    Case(TMM_PACKAGE, TMM, "itc_loss(compute_image_text_similarity) (BLIP-2)",
         "BackpropType.GLOBAL in place of NONE (patched: see the notes)", TmmBlip2Itc,
         repro="blip2_itc.py", patch=BLIP2_GLOBAL,
         note="not a fix on gloo (see the notes); the fix is the row above's",
         remark=GLOBAL_REMARK),
]  # fmt: skip
NOT_RUN = [
    NotRun(
        TMM_PACKAGE,
        TMM,
        "FLAVA losses; BLIP-2 ITM and ITG",
        "need the models' heads and tokens at the call; not checked yet",
    ),
]
