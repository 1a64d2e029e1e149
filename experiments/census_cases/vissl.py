"""The census's cases of vissl 0.1.6: ``SimclrInfoNCECriterion`` and ``BarlowTwinsCriterion``."""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F
from public_code import load, synthetic
from torch import nn

from census_cases.common import Case, Fix, NotRun, root_of, shim

VISSL = "0.1.6"
CLASSY_DIST = "classy_vision/generic/distributed_util.py"  # vissl's wheel carries classy_vision


def _vissl_stubs() -> dict[str, types.ModuleType]:
    """The registry and config classes the losses' files import: ``ClassyLoss`` (the base of
    the config-built wrapper, not of the criterion checked: an ``nn.Module``), ``register_loss``
    (a decorator of that wrapper: returns it) and ``AttrDict`` (a dict here)."""
    why = "the wrapper's config registry, not the criterion"
    classy = shim("classy_vision.losses", why, ClassyLoss=nn.Module,
                   register_loss=lambda name: lambda cls: cls)  # fmt: skip
    return {
        "classy_vision.losses": classy,
        "vissl.config": shim("vissl.config", why, AttrDict=dict),
        "vissl.utils.hydra_config": shim("vissl.utils.hydra_config", why, AttrDict=dict),
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
        root = root_of(root, "vissl", VISSL)
        module = load(root, files, _vissl_stubs())
        # as vissl runs on CPU (MACHINE.DEVICE cpu): else the masks are moved to CUDA
        sys.modules[f"{synthetic(root)}.classy_vision.generic.distributed_util"].set_cpu_device()
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
        module = load(root_of(root, "vissl", VISSL), files, _vissl_stubs())
        self.loss = module.BarlowTwinsCriterion(0.0051, 0.024, 16)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        return self.loss(torch.cat((z0, z1)))


VISSL_BARLOW_FIX = Fix(
    "average the cross-correlation with an all-reduce whose backward sums the gradients "
    "(census_fixes.all_reduce_sum) instead of classy_vision's all_reduce_mean (an in-place "
    "all_reduce that autograd does not see)",
    "vissl/barlow.patch",
)
CASES = [
    Case("vissl", VISSL, "SimclrInfoNCECriterion", "defaults (gathers in any group)",
         VisslSimclr),
    Case("vissl", VISSL, "BarlowTwinsCriterion", "defaults (all-reduces in any group)",
         VisslBarlow, fix=VISSL_BARLOW_FIX, repro="vissl_barlow.py"),
]  # fmt: skip
NOT_RUN = [
    NotRun(
        "vissl",
        VISSL,
        "SwAV, DINO, MoCo, NCE, DeepClusterV2 losses",
        "not run: each is built from a VISSL config (AttrDict) and keeps its own distributed state "
        "(a queue or prototypes the criterion updates, a SwAV queue filled over iterations); "
        "checking one means building that config and its loss-state hooks, not only its inputs",
    ),
]
