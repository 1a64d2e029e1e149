"""The census's cases of lightning-bolts 0.7.0: SimCLR's ``nt_xent_loss``, ``SWAVLoss`` (on
one node or two, patched for CPU and float64) and MoCo v2's ``Moco_v2.training_step`` (its queue
of keys gathered by ``concat_all_gather``, over steps; torchvision an import-only stand-in)."""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from public_code import load
from torch import nn

from census_cases.common import Case, Fix, NotRun, root_of, shim, torchvision_stand_in, unused

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


BOLTS_MOCO = (
    "pl_bolts/utils/stability.py",
    "pl_bolts/utils/warnings.py",
    "pl_bolts/models/self_supervised/moco/moco2_module.py",
)


def bolts_moco(root: str | None) -> types.ModuleType:
    """lightning-bolts's released ``moco2_module.py`` with ``pl_bolts/utils/stability.py``
    (``under_review``), ``pl_bolts/utils/warnings.py`` and ``pl_bolts/metrics/aggregation.py``
    (``mean``, ``precision_at_k``: ``pl_bolts.metrics`` holds them, as its ``__init__``
    does). pytorch_lightning is installed (imported first, as itself). Stubbed: torchvision (an
    import-only stand-in: the file imports it, and uses ``torchvision.models`` only in
    ``init_encoders``, which `BoltsMocoV2` overrides as its docstring invites);
    ``pl_bolts.utils`` (its ``__init__`` imports the callbacks and probes optional packages: it
    holds the flag the file reads, ``_TORCHVISION_AVAILABLE = True``, so that the file imports
    the stand-in as with torchvision installed); ``pl_bolts.transforms.self_supervised.
    moco_transforms`` (the data augmentations, torchvision's: never called)."""
    import pytorch_lightning  # noqa: F401  (before the load: as installed, not while stubs are set)

    root = root_of(root, "lightning-bolts", BOLTS)
    aggregation = load(root, ("pl_bolts/metrics/aggregation.py",), {})
    why = "the data augmentations of the MoCo v2 module (torchvision), not its loss"
    transforms = "pl_bolts.transforms.self_supervised.moco_transforms"
    names = [
        f"MoCo2{kind}{data}Transforms"
        for kind in ("Train", "Eval")
        for data in ("CIFAR10", "Imagenet", "STL10")
    ]
    stubs = {
        **torchvision_stand_in("models"),
        "pl_bolts.utils": shim("pl_bolts.utils", "its __init__ imports the callbacks and probes "
                               "optional packages; the flag read here is given",
                               _TORCHVISION_AVAILABLE=True),
        "pl_bolts.metrics": shim("pl_bolts.metrics", "its __init__'s names, from aggregation.py",
                                 mean=aggregation.mean, precision_at_k=aggregation.precision_at_k),
        "pl_bolts.transforms": shim("pl_bolts.transforms", why),
        "pl_bolts.transforms.self_supervised": shim("pl_bolts.transforms.self_supervised", why),
        transforms: shim(transforms, why, **{name: unused(name, why) for name in names}),
    }  # fmt: skip
    return load(root, BOLTS_MOCO, stubs)


class _Trainer:
    """What ``Moco_v2.training_step`` asks of its trainer: the strategy (``DDPStrategy`` on W
    ranks, so that ``_use_ddp`` is true, as Lightning's DDP sets it; Lightning's single-device
    strategy on one device and in a one-rank group) and the data module's name."""

    def __init__(self) -> None:
        from pytorch_lightning.strategies import DDPStrategy, SingleDeviceStrategy

        group = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.strategy = DDPStrategy() if group else SingleDeviceStrategy(torch.device("cpu"))
        self.datamodule = types.SimpleNamespace(name="cifar10")


class BoltsMocoV2(nn.Module):
    """lightning-bolts's released ``Moco_v2(emb_dim=16, num_negatives=32,
    softmax_temperature=0.07)`` (a LightningModule, in float64: ``.double()``, as Lightning's
    ``precision="64-true"`` puts it) and its released ``training_step`` on the batch
    ``((z0, z1), None)``: its ``forward`` (the queries, the keys under ``torch.no_grad`` with its
    batch shuffle across the ranks under DDP, the logits against the queue), its
    ``_dequeue_and_enqueue`` (the keys gathered by ``concat_all_gather`` under DDP, written into
    the queue at its pointer), its cross-entropy. The encoders are ``nn.Identity()`` (its
    ``init_encoders``, overridden here, returns them: the check's model is the query encoder, and
    the key encoder is the same model's output without gradient, a momentum copy at its start);
    ``log_dict`` (Lightning's logging) does nothing here; the trainer is `_Trainer`. The queue
    starts as released (``torch.randn`` with the check's seed) and is state: checked over
    steps."""

    def __init__(self, root=None, num_negatives=32, softmax_temperature=0.07):
        super().__init__()
        released = bolts_moco(root).Moco_v2

        class Moco(released):
            def init_encoders(self, base_encoder):
                return nn.Identity(), nn.Identity()

            def log_dict(self, *args, **kwargs):
                return None

        self.moco = Moco(emb_dim=16, num_negatives=num_negatives,
                         softmax_temperature=softmax_temperature).double()  # fmt: skip
        self.moco.trainer = _Trainer()

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        return self.moco.training_step(((z0, z1), None), 0)


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
BOLTS_MOCO_CPU = Fix(
    "CPU, float64: _batch_shuffle_ddp's .cuda() made device=x.device (its shuffle under DDP), "
    "and training_step's output.float() left out (it casts the logits to float32)",
    "lightning_bolts/moco_cpu.patch",
)
MOCO_REMARK = (
    "torchvision an import-only stand-in (the file imports it; init_encoders, its only use, is "
    "overridden with identity encoders); patched for CPU (_batch_shuffle_ddp's `.cuda()`) and "
    "float64 (training_step's `output.float()`)"
)
CASES = [
    Case("lightning-bolts", BOLTS, "SimCLR.nt_xent_loss", "defaults (gathers in any group)",
         BoltsNTXent),
    Case("lightning-bolts", BOLTS, "SWAVLoss", "gpus=W, num_nodes=1; patched for CPU float64",
         BoltsSwav, patch=BOLTS_CPU),
    Case("lightning-bolts", BOLTS, "SWAVLoss",
         "gpus=W/2, num_nodes=2; patched for CPU float64", BoltsSwav, {"nodes": 2},
         patch=BOLTS_CPU, remark=TWO_NODES_REMARK),
    Case("lightning-bolts", BOLTS, "Moco_v2.training_step (queue, concat_all_gather)",
         "emb_dim=16, num_negatives=32, softmax_temperature=0.07; torchvision an import-only "
         "stand-in; patched for CPU float64", BoltsMocoV2, steps=3, patch=BOLTS_MOCO_CPU,
         remark=MOCO_REMARK),
]  # fmt: skip
NOT_RUN: list[NotRun] = []
