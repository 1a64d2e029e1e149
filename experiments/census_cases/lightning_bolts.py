"""The census's cases of lightning-bolts 0.7.0: SimCLR's ``nt_xent_loss`` and ``SWAVLoss`` (on
one node or two, patched for CPU and float64)."""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from public_code import load
from torch import nn

from census_cases.common import Case, Fix, NotRun, root_of, shim, unused

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
    stubs = {"pl_bolts.optimizers": shim("pl_bolts.optimizers", why),
             "pl_bolts.transforms": shim("pl_bolts.transforms", why)}  # fmt: skip
    for name, attributes in names.items():
        stubs[name] = shim(name, why, **{a: unused(a, why) for a in attributes})
    return stubs


class BoltsNTXent(nn.Module):
    """lightning-bolts's released ``SimCLR.nt_xent_loss(out_1, out_2, temperature=0.5)`` (a
    method that does not use its module: called unbound) on z0 and z1 normalised, as its
    docstring assumes and its projection head returns them. It gathers with ``SyncFunction``
    whenever a group exists."""

    def __init__(self, root=None, temperature=0.5):
        super().__init__()
        self.module = load(root_of(root, "lightning-bolts", BOLTS), BOLTS_SIMCLR, _bolts_stubs())
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
        module = load(root_of(root, "lightning-bolts", BOLTS),
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
    "lightning_bolts/cpu.patch",
)
TWO_NODES_REMARK = (
    "patched for CPU and float64 (the sinkhorns' `.cuda()` and `.float()`); with two nodes the "
    "column marginal is 1/(gpus·B), not 1/(gpus·num_nodes·B), a uniform scale that the final "
    "column normalisation cancels: exact"
)
CASES = [
    Case("lightning-bolts", BOLTS, "SimCLR.nt_xent_loss", "defaults (gathers in any group)",
         BoltsNTXent),
    Case("lightning-bolts", BOLTS, "SWAVLoss", "gpus=W, num_nodes=1; patched for CPU float64",
         BoltsSwav, patch=BOLTS_CPU),
    Case("lightning-bolts", BOLTS, "SWAVLoss",
         "gpus=W/2, num_nodes=2; patched for CPU float64", BoltsSwav, {"nodes": 2},
         patch=BOLTS_CPU, remark=TWO_NODES_REMARK),
]  # fmt: skip
NOT_RUN = [
    NotRun("lightning-bolts", BOLTS, "MoCo v2 (moco2_module.py)", "inside a LightningModule "
           "that imports torchvision; its no-grad key gather feeds a queue: not checked yet"),
]  # fmt: skip
