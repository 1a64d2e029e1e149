"""The census's cases of x-clip 0.14.4: its ``all_gather`` (the gather ``CLIP.forward`` applies
whenever W > 1), checked with a loss of gatherlab's."""

from __future__ import annotations

import torch
from public_code import load

from census_cases.common import EINOPS, Case, Fix, importable, root_of

X_CLIP = "0.14.4"


def x_clip_gather(x: torch.Tensor, root: str | None = None) -> torch.Tensor:
    """x-clip's released ``all_gather`` (``x_clip/distributed.py``, the ``AllGather`` function its
    ``CLIP.forward`` applies to the stacked text and image latents, along the batch dimension),
    as a gather ``x -> gathered x``: ``all_gather(x, 0, None)[0]`` when a group of more than one
    rank exists, else ``x``, as ``CLIP.forward`` decides (``requires_all_gather``). Loaded alone,
    with einops (its one import besides torch) from einops's wheel."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return x
    importable(root_of(None, "einops", EINOPS), "einops")
    module = load(root_of(root, "x-clip", X_CLIP), ("x_clip/distributed.py",), {})
    return module.all_gather(x, 0, None)[0]


X_CLIP_IMPORTS = Fix(
    "import torch.nn.functional as F and define exists in x_clip/distributed.py (both are used "
    "there, neither is defined)",
    "x_clip/imports.patch",
)
X_CLIP_BACKWARD = Fix(
    "sum every rank's gradient (all_reduce) before AllGather.backward takes the own slice",
    "x_clip/backward.patch",
)
X_CLIP_GLOBAL = "every rank's full loss: gatherlab's NTXentGlobalLoss(temperature=0.5) on it"
CASES = [
    Case("x-clip", X_CLIP, "all_gather (CLIP.forward's gather)", X_CLIP_GLOBAL,
         "gatherlab.losses:NTXentGlobalLoss", {"temperature": 0.5}, fix=X_CLIP_IMPORTS,
         repro="x_clip_all_gather.py", gather=x_clip_gather, needs=(("einops", EINOPS),)),
    Case("x-clip", X_CLIP, "all_gather (CLIP.forward's gather)",
         X_CLIP_GLOBAL + "; with F and exists defined (the fix above)",
         "gatherlab.losses:NTXentGlobalLoss", {"temperature": 0.5}, fix=X_CLIP_BACKWARD,
         repro="x_clip_all_gather.py", gather=x_clip_gather, needs=(("einops", EINOPS),),
         patch=X_CLIP_IMPORTS),
]  # fmt: skip
