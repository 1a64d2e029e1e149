"""The census's cases of solo-learn 1.0.2 (its newest release): ``barlow_loss_func``,
``DINOLoss``, ``solo.utils.misc.gather`` (the ``GatherLayer`` of its methods), and what its
methods SwAV, DeepClusterV2, NNCLR and MoCo v2+ add around their losses (Sinkhorn-Knopp targets,
k-means over a memory bank, a support set, a queue of gathered keys), through the released method
files' own functions."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from public_code import load, synthetic
from torch import nn

from census_cases.common import Case, Fix, NotRun, root_of, shim, unused

SOLO = "1.0.2"
SOLO_METHODS = (  # the method files and what they import, their own imports first
    "solo/utils/misc.py",
    "solo/utils/lars.py",
    "solo/utils/metrics.py",
    "solo/utils/momentum.py",
    "solo/utils/knn.py",
    "solo/utils/sinkhorn_knopp.py",
    "solo/utils/kmeans.py",
    "solo/losses/swav.py",
    "solo/losses/deepclusterv2.py",
    "solo/losses/nnclr.py",
    "solo/losses/moco.py",
    "solo/methods/base.py",
    "solo/methods/swav.py",
    "solo/methods/deepclusterv2.py",
    "solo/methods/nnclr.py",
    "solo/methods/mocov2plus.py",
)
METHODS_REMARK = (
    "the released method files are loaded (solo/methods/base.py and the method's file) and "
    "their own functions called on the adapter, which holds what the LightningModule would "
    "(its backbone, projector and trainer are not built: the check's embeddings are the "
    "projections); one stub, pl_bolts.optimizers.lr_scheduler (base.py's scheduler); base.py "
    "imports torchvision only inside the backbone's construction, not run, so no torchvision "
    "stand-in is needed"
)


def solo_method(root: str | Path | None, name: str) -> types.ModuleType:
    """The released module ``name`` (``solo.methods.swav``, ``solo.utils.kmeans``, …) of the
    method files `SOLO_METHODS` of the release at ``root``, loaded together once per process.
    base.py imports pytorch_lightning and torchmetrics (both installed: imported first, as
    themselves) and one module that is stubbed: ``pl_bolts.optimizers.lr_scheduler`` (a
    dependency, lightning-bolts, for the schedule of ``configure_optimizers``, never called)."""
    import pytorch_lightning  # noqa: F401  (before the load: as installed, not while stubs are set)
    import torchmetrics  # noqa: F401

    root = root_of(root, "solo-learn", SOLO)
    why = "the learning-rate schedule of BaseMethod.configure_optimizers, not the loss"
    scheduler = "pl_bolts.optimizers.lr_scheduler"
    stubs = {
        scheduler: shim(scheduler, why, LinearWarmupCosineAnnealingLR=unused(
            "LinearWarmupCosineAnnealingLR", why)),
    }  # fmt: skip
    load(root, SOLO_METHODS, stubs)
    return sys.modules[f"{synthetic(root)}.{name}"]


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


def sample_indices(global_batch_size: int) -> torch.Tensor:
    """Each sample's index in the data set, ``0 … N-1`` (DeepClusterV2's ``batch[0]``): the
    data set is the one global batch, each step one epoch of it; split over the ranks as the
    views are."""
    return torch.arange(global_batch_size)


class SoloSwAV(nn.Module):
    """solo-learn's SwAV loss path as ``SwAV.training_step`` runs it, from the released files:
    the views' scores against learnt prototypes (``nn.utils.weight_norm(nn.Linear(16,
    num_prototypes, bias=False))``, as ``SwAV.__init__`` builds them, on the views normalised as
    its ``projector`` output is), the targets of the released ``SwAV.get_assignments`` (called
    on this module: its ``SinkhornKnopp(sk_iters, sk_epsilon, world_size)``, which all-reduces
    the sums of Q in any group, built here as ``on_train_start`` builds it with the trainer's
    world size), and the released ``swav_loss_func``. The targets are computed in this forward
    from the scores (no-grad, as released). With ``queue_size`` > 0 (and the epoch past
    ``epoch_queue_starts``) each rank holds its own ``queue_size // world_size`` past
    projections, as ``on_train_start`` registers it (zeros, here in float64: released in the
    default dtype), scored with the prototypes and put beside the batch in the Sinkhorn, and
    moved after the loss as ``training_step`` moves it: state, checked over steps. It is held as
    a plain tensor, not a buffer: the release registers it in ``on_train_start``, after
    Lightning has wrapped the module in DDP, whose buffers (those it found when it was built)
    are broadcast from rank 0 before every forward; a buffer registered here, before the check's
    DDP is built, would be overwritten with rank 0's queue, which the release's is not."""

    def __init__(self, root=None, world_size=1, num_prototypes=8, temperature=0.1,
                 sk_iters=3, sk_epsilon=0.05, queue_size=0):  # fmt: skip
        super().__init__()
        swav = solo_method(root, "solo.methods.swav")
        self.get_assignments = types.MethodType(swav.SwAV.get_assignments, self)
        self.swav_loss_func = swav.swav_loss_func
        linear = nn.Linear(16, num_prototypes, bias=False, dtype=torch.float64)
        self.prototypes = nn.utils.weight_norm(linear)
        self.sk = swav.SinkhornKnopp(sk_iters, sk_epsilon, world_size)
        self.temperature, self.queue_size = temperature, queue_size
        self.current_epoch, self.epoch_queue_starts = 0, 0
        if queue_size > 0:  # a plain tensor: see the docstring
            self.queue = torch.zeros(2, queue_size // world_size, 16, dtype=torch.float64)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        z1, z2 = F.normalize(z0), F.normalize(z1)
        preds = [self.prototypes(z1), self.prototypes(z2)]
        assignments = self.get_assignments(preds)
        loss = self.swav_loss_func(preds, assignments, self.temperature)
        if self.queue_size > 0:  # training_step's queue update
            z = torch.stack((z1, z2))
            self.queue[:, z.size(1) :] = self.queue[:, : -z.size(1)].clone()
            self.queue[:, : z.size(1)] = z.detach()
        return loss


class SoloDeepClusterV2(nn.Module):
    """solo-learn's DeepClusterV2 as its hooks run it, from the released files, each forward one
    epoch of a data set that is the global batch (the case's ``inputs``: each sample's index,
    `sample_indices`; one batch per epoch, ``batch_idx`` 0): the released
    ``DeepClusterV2.on_train_epoch_start`` (its ``KMeans.cluster_memory`` over the memory
    banks: centroids drawn on rank 0 and broadcast, counts and sums all-reduced, assignments and
    indices all-gathered; the centroids copied into the frozen prototypes), the released
    ``deepclusterv2_loss_func`` on the views' scores against them with the assignments of the
    batch's indices, and the released ``update_memory_banks``, all called on this module. The
    views normalised are the projections. The memory banks (one batch of the rank's rows, as
    ``on_train_start`` sizes them, ``len(train_dataloader) * batch_size``; released ``randn``)
    are made at the first forward (again whenever a forward's samples are not those they hold:
    the data set is the batch) and filled with that batch before the first k-means (released,
    epoch 0 has no assignments: every target is ignored and the loss is NaN); they are plain
    tensors, not buffers (as `SoloSwAV`'s queue: the release registers them after Lightning's
    DDP wrap, which never broadcasts them). The banks, assignments and prototypes are state,
    checked over steps. k-means's initial draw (``torch.randperm`` on rank 0) is made in a fork
    of the RNG seeded 0, the same on one device and on every rank."""

    def __init__(self, root=None, rank=0, world_size=1, num_prototypes=(2, 2),
                 temperature=0.1, kmeans_iters=10):  # fmt: skip
        super().__init__()
        method = solo_method(root, "solo.methods.deepclusterv2")
        released = method.DeepClusterV2
        self.on_train_epoch_start = types.MethodType(released.on_train_epoch_start, self)
        self.update_memory_banks = types.MethodType(released.update_memory_banks, self)
        self.loss_func = method.deepclusterv2_loss_func
        self.num_prototypes, self.temperature = list(num_prototypes), temperature
        self.num_large_crops, self.batch_size = 2, 0
        self.prototypes = nn.ModuleList(  # as DeepClusterV2.__init__: frozen (k-means sets them)
            [nn.Linear(16, k, bias=False, dtype=torch.float64) for k in num_prototypes]
        )
        for parameter in self.prototypes.parameters():
            parameter.requires_grad = False
        self.kmeans = method.KMeans(world_size=world_size, rank=rank, num_large_crops=2,
                                    dataset_size=16, proj_features_dim=16,
                                    num_prototypes=self.num_prototypes,
                                    kmeans_iters=kmeans_iters)  # fmt: skip
        self.local_memory_index = self.local_memory_embeddings = torch.empty(0)
        self.current_epoch = 0

    @property
    def device(self) -> torch.device:
        return self.local_memory_embeddings.device

    def forward(self, z0: torch.Tensor, z1: torch.Tensor, idxs: torch.Tensor) -> torch.Tensor:
        z1, z2 = F.normalize(z0), F.normalize(z1)
        fresh = len(self.local_memory_index) != len(idxs)
        if fresh or not torch.equal(self.local_memory_index, idxs):  # the rank's batch's samples
            # plain tensors, not buffers: registered by on_train_start after Lightning's DDP
            # wrap, never broadcast from rank 0 (as `SoloSwAV`'s queue); filled with this
            # batch before the first k-means
            self.batch_size = len(idxs)
            self.local_memory_index = torch.zeros_like(idxs)
            self.local_memory_embeddings = z1.new_zeros(2, len(idxs), z1.shape[1])
            self.update_memory_banks(idxs, [z1, z2], 0)
        self.current_epoch += 1  # past epoch 0: on_train_epoch_start runs the k-means
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            with torch.no_grad():
                self.on_train_epoch_start()
        p1 = torch.stack([proto(z1) for proto in self.prototypes])
        p2 = torch.stack([proto(z2) for proto in self.prototypes])
        preds = torch.stack([p1.unsqueeze(1), p2.unsqueeze(1)], dim=1)
        loss = self.loss_func(preds, self.assignments[:, idxs], self.temperature)
        self.update_memory_banks(idxs, [z1, z2], 0)
        return loss


class SoloNNCLR(nn.Module):
    """solo-learn's NNCLR loss path as ``NNCLR.training_step`` runs it, from the released files:
    the released ``NNCLR.find_nn`` (each view's nearest neighbour in the support set, no-grad),
    ``nnclr_loss_func(nn1, p2) / 2 + nnclr_loss_func(nn2, p1) / 2`` and
    ``NNCLR.dequeue_and_enqueue`` (the first view's projections gathered with the released
    ``gather`` into the support set), called on this module. The views are the projections z
    (normalised, as released) and, unnormalised, the predictions p (the predictor taken as the
    identity). The support set, ``queue_size`` rows, starts as released (``randn``, normalised;
    drawn here from a generator seeded 0, in float64); its labels (``queue_y``, for the logged
    nearest-neighbour accuracy only) are zeros. The support set is state: checked over
    steps."""

    def __init__(self, root=None, temperature=0.2, queue_size=32):
        super().__init__()
        method = solo_method(root, "solo.methods.nnclr")
        self.find_nn = types.MethodType(method.NNCLR.find_nn, self)
        self.dequeue_and_enqueue = types.MethodType(method.NNCLR.dequeue_and_enqueue, self)
        self.loss_func = method.nnclr_loss_func
        self.temperature, self.queue_size = temperature, queue_size
        generator = torch.Generator().manual_seed(0)
        queue = torch.randn(queue_size, 16, generator=generator, dtype=torch.float64)
        self.register_buffer("queue", F.normalize(queue, dim=1))
        self.register_buffer("queue_y", -torch.ones(queue_size, dtype=torch.long))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        p1, p2 = z0, z1
        z1, z2 = F.normalize(z0, dim=-1), F.normalize(z1, dim=-1)
        _, nn1 = self.find_nn(z1)
        _, nn2 = self.find_nn(z2)
        loss = (self.loss_func(nn1, p2, temperature=self.temperature) / 2
                + self.loss_func(nn2, p1, temperature=self.temperature) / 2)  # fmt: skip
        self.dequeue_and_enqueue(z1, torch.zeros(len(z1), dtype=torch.long))
        return loss


class SoloMoCoV2Plus(nn.Module):
    """solo-learn's MoCo v2+ loss path as ``MoCoV2Plus.training_step`` runs it, from the
    released files: ``(moco_loss_func(q1, k2, queue[1]) + moco_loss_func(q2, k1, queue[0])) /
    2`` (the released loss) on the views normalised as the queries and, detached, as the keys (a
    momentum projector at its start), then the keys of both views gathered with the released
    ``gather`` and put in the queue by the released ``MoCoV2Plus._dequeue_and_enqueue``, called
    on this module. The queue, (2, 16, ``queue_size``), starts as released (``randn``,
    normalised over its features; drawn here from a generator seeded 0, in float64) and is
    state: checked over steps."""

    def __init__(self, root=None, temperature=0.1, queue_size=32):
        super().__init__()
        method = solo_method(root, "solo.methods.mocov2plus")
        self._dequeue_and_enqueue = types.MethodType(method.MoCoV2Plus._dequeue_and_enqueue, self)
        self.loss_func, self.gather = method.moco_loss_func, method.gather
        self.temperature, self.queue_size = temperature, queue_size
        generator = torch.Generator().manual_seed(0)
        queue = torch.randn(2, 16, queue_size, generator=generator, dtype=torch.float64)
        self.register_buffer("queue", F.normalize(queue, dim=1))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        q1, q2 = F.normalize(z0, dim=-1), F.normalize(z1, dim=-1)
        k1, k2 = q1.detach(), q2.detach()
        queue = self.queue.clone().detach()
        loss = (self.loss_func(q1, k2, queue[1], self.temperature)
                + self.loss_func(q2, k1, queue[0], self.temperature)) / 2  # fmt: skip
        self._dequeue_and_enqueue(torch.stack((self.gather(k1), self.gather(k2))))
        return loss


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
SOLO_KMEANS_FLOAT64 = Fix(
    "k-means's centroids and sums built in the memory bank's dtype (.to(device, "
    "local_memory_embeddings.dtype)): built in float32, they round the check's float64 (and the "
    "ranks' float32 empty centroids meet rank 0's float64 in the broadcast)",
    "solo_learn/kmeans_float64.patch",
)
SOLO_KMEANS_INIT = Fix(
    "start the k-means from K rows drawn by rank 0 from the whole memory bank (every rank's "
    "rows, all-gathered in rank order) instead of from rank 0's own rows",
    "solo_learn/kmeans_init.patch",
)
SOLO_NNCLR_FIX = Fix(
    "every rank's predictions as the negatives (census_fixes.all_gather_rows, whose backward "
    "sums the ranks' gradients) and the labels offset by the rank's first row, instead of the "
    "rank's own predictions only",
    "solo_learn/nnclr.patch",
)
KMEANS_REMARK = (
    "its k-means builds its centroids and sums in float32: the row is of the release with them "
    "in the memory bank's dtype, the fix applied on top; " + METHODS_REMARK
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
    Case("solo-learn", SOLO, "SwAV: swav_loss_func, SinkhornKnopp (get_assignments)",
         "num_prototypes=8, sk_iters=3, sk_epsilon=0.05, no queue (the SinkhornKnopp all-reduces "
         "in any group)", SoloSwAV, remark=METHODS_REMARK),
    Case("solo-learn", SOLO, "SwAV: swav_loss_func, SinkhornKnopp (get_assignments)",
         "as above, queue_size=32 (each rank its queue_size // W past projections)", SoloSwAV,
         {"queue_size": 32}, steps=3),
    Case("solo-learn", SOLO, "DeepClusterV2: deepclusterv2_loss_func, KMeans.cluster_memory",
         "num_prototypes=(2, 2), kmeans_iters=10, a memory bank of one global batch; k-means in "
         "float64 (patched: see the notes)", SoloDeepClusterV2, steps=3, inputs=sample_indices,
         patch=SOLO_KMEANS_FLOAT64, fix=SOLO_KMEANS_INIT, repro="solo_deepclusterv2.py",
         remark=KMEANS_REMARK),
    Case("solo-learn", SOLO, "NNCLR: nnclr_loss_func, find_nn, dequeue_and_enqueue",
         "temperature=0.2, queue_size=32 (the support set fed by the gathered projections)",
         SoloNNCLR, steps=3, fix=SOLO_NNCLR_FIX, repro="solo_nnclr.py"),
    Case("solo-learn", SOLO, "MoCo v2+: moco_loss_func, _dequeue_and_enqueue",
         "temperature=0.1, queue_size=32 (the queue fed by the gathered keys)", SoloMoCoV2Plus,
         steps=3),
]  # fmt: skip
NOT_RUN: list[NotRun] = []
