"""The census's cases of vissl 0.1.6: ``SimclrInfoNCECriterion``, ``BarlowTwinsCriterion``, and
the losses with state across updates, each built by its ``from_config`` from its block of the
release's own defaults (``vissl/config/defaults.yaml``) with small sizes: ``SwAVLoss`` (its
queue), ``DINOLoss`` (its center), ``MoCoLoss`` (its queue), ``NCELossWithMemory`` (its memory
bank) and ``DeepClusterV2Loss`` (its memory bank and centroids), checked over steps."""

from __future__ import annotations

import copy
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from public_code import load, synthetic
from scipy.sparse import csr_matrix
from torch import nn

from census_cases.common import (
    Case,
    Fix,
    NotRun,
    released_functions,
    root_of,
    shim,
    stubs,
    unused,
)

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


# --- the losses with state across updates ---------------------------------------------------------

QUEUE = 32  # SwAV's and MoCo's queue: two global batches of 16
STEPS = 3  # the updates each of them is checked over


def vissl_config(root: Path, name: str, **changes: Any) -> Any:
    """The block ``config.LOSS.<name>`` of the release's ``vissl/config/defaults.yaml`` with
    ``changes`` (a nested dict merged into its block), as vissl's own ``AttrDict``
    (``vissl/config/attr_dict.py``): what vissl's ``build_loss`` hands the loss's
    ``from_config``."""
    defaults = yaml.safe_load((root / "vissl/config/defaults.yaml").read_text())
    block = copy.deepcopy(defaults["config"]["LOSS"][name])

    def merged(into: dict, new: dict) -> dict:
        for key, value in new.items():
            if key not in into:
                raise KeyError(f"vissl's {name} config has no {key!r}")
            into[key] = merged(into[key], value) if isinstance(value, dict) else value
        return into

    attr_dict = load(root, ("vissl/config/attr_dict.py",), {}).AttrDict
    return attr_dict(merged(block, changes))


class _Hook:
    """The base of vissl's hooks here (classy_vision's ``ClassyHook``, whose module imports
    fvcore, absent): its ``_noop``, which the hooks name for the events they ignore."""

    def _noop(self, *args: Any, **kwargs: Any) -> None:
        return None


def _stateful_stubs(root: Path, **more: types.ModuleType) -> dict[str, types.ModuleType]:
    """`_vissl_stubs` with vissl's own ``AttrDict`` (the losses read their config by attribute)
    and the stubs of the hooks' imports: ``classy_vision.tasks`` (its ``ClassyTask`` names
    the hooks' annotations only: ``object`` here) and ``ClassyHook`` (`_Hook`); ``more``, a
    loss's own."""
    why = "the trainer's task: the hooks here are called with what they read of it"
    attr_dict = load(root, ("vissl/config/attr_dict.py",), {}).AttrDict
    return {
        **_vissl_stubs(),
        "vissl.config": shim("vissl.config", "the config package", AttrDict=attr_dict),
        "classy_vision.tasks": shim("classy_vision.tasks", why, ClassyTask=object),  # annotations
        "classy_vision.hooks.classy_hook": shim(
            "classy_vision.hooks.classy_hook", why, ClassyHook=_Hook
        ),
        **more,
    }


def _on_cpu(module: types.ModuleType) -> None:
    """classy_vision's ``set_cpu_device()`` in the distributed_util the loss's file imported, as
    vissl's CPU runs (MACHINE.DEVICE cpu) call it: else vissl moves tensors to CUDA."""
    module.get_cuda_device_index.__globals__["set_cpu_device"]()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class _HeldAsVissl(nn.Module):
    """A vissl loss held as vissl's trainer holds it: beside the model that DDP wraps
    (``task.loss``, not part of ``task.model``), so that DDP does not broadcast its buffers from
    rank 0 at each forward (a rank-local queue or memory bank would be overwritten); moved with
    this module (to the check's float64) all the same. Its parameters, if any, are this
    module's."""

    def hold(self, loss: nn.Module) -> None:
        object.__setattr__(self, "released", loss)  # not a submodule: no buffer DDP can see

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.released._apply(fn, recurse)
        return self


class VisslSwAV(_HeldAsVissl):
    """vissl's released ``SwAVLoss.from_config`` (embedding_dim 16, 8 prototypes, a queue of
    `QUEUE` embeddings from the first update on: ``queue_length`` 32, ``start_iter`` 0, the
    rest vissl's defaults) on the rank's two views as vissl's SwAV head gives them:
    ``[e, prototypes0(e)]``, ``e = normalize(cat(z0, z1))``, the prototypes (a linear map
    without bias, as vissl's ``SwAVPrototypesHead``) held here, a parameter. ``local_queue_length``
    is ``queue_length // W``, as vissl's ``infer_losses_config`` sets it; each rank's local
    queues are its share (every W-th row) of the queues one device draws (the released
    ``initialize_queue`` called once with the whole length, from the same random state), so that
    the ranks' queues together are one device's (in a VISSL job each rank draws its own). The
    queue scores are filled by vissl's released ``SwAVUpdateQueueScoresHook.on_forward`` (the
    trainer calls it after the model's forward, before the loss), given the loss and this
    module as the model's head. ``NormalizePrototypesHook`` (it renormalises the head's
    weights after the optimizer's step) is not called: the check's update has no place for
    it. The row is of the release with ``distributed_sinkhornknopp``'s codes kept in float64
    (`VISSL_SWAV_FLOAT64`): released, they are float32 and so is the loss."""

    def __init__(self, root=None, world_size=1, prototypes=8):
        super().__init__()
        root = root_of(root, "vissl", VISSL)
        why = "the file manager of its dump of a NaN loss"
        iopath = shim("iopath.common.file_io", why, g_pathmgr=stubs(g_pathmgr=why)["g_pathmgr"])
        files = (
            CLASSY_DIST,
            "vissl/losses/distibuted_sinkhornknopp.py",
            "vissl/losses/swav_loss.py",
        )
        module = load(root, files, _stateful_stubs(root, **{"iopath.common.file_io": iopath}))
        _on_cpu(module)
        hooks = load(root, ("vissl/hooks/swav_hooks.py",), _stateful_stubs(root))
        config = vissl_config(
            root,
            "swav_loss",
            embedding_dim=16,
            num_prototypes=[prototypes],
            queue={"queue_length": QUEUE, "local_queue_length": QUEUE // world_size},
        )
        drawn_from = torch.get_rng_state()
        loss = module.SwAVLoss.from_config(config)
        criterion, rank = loss.swav_criterion, _rank()
        torch.set_rng_state(drawn_from)  # one device's queues, drawn as its build draws them
        criterion.local_queue_length = QUEUE
        criterion.initialize_queue()
        criterion.local_queue_length = QUEUE // world_size
        for name in ("local_queue0", "local_emb_queue"):
            setattr(criterion, name, getattr(criterion, name)[:, rank::world_size].clone())
        self.hold(loss)
        self.nmb_heads = 1
        self.prototypes0 = nn.Linear(16, prototypes, bias=False)
        self.hook = hooks.SwAVUpdateQueueScoresHook()
        attr_dict = load(root, ("vissl/config/attr_dict.py",), {}).AttrDict
        self.task_config = attr_dict({"LOSS": {"name": "swav_loss"}})  # what the hook reads

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        embedding = F.normalize(torch.cat((z0, z1)), dim=1)
        model = types.SimpleNamespace(heads=[self])
        task = types.SimpleNamespace(config=self.task_config, loss=self.released, model=model)
        self.hook.on_forward(task)
        return self.released([embedding, self.prototypes0(embedding)], None)


class VisslDINO(_HeldAsVissl):
    """vissl's released ``DINOLoss.from_config`` (output_dim 16, num_crops 2 as vissl's
    ``infer_losses_config`` sets them from the head and the transforms, a teacher temperature
    warm-up of 4 iterations, the rest vissl's defaults) on the rank's student output
    ``cat(z0, z1)``, the teacher's the same detached (a momentum teacher at its start): what
    vissl's ``DINOHook.on_forward`` sets on the loss before it runs, ``teacher_output``, and
    its ``teacher_temp`` from the released ``DINOHook.get_teacher_temperature`` at this
    module's iteration (of 100). The center, moved after each call by the all-reduced teacher
    mean, is state: checked over steps."""

    def __init__(self, root=None):
        super().__init__()
        root = root_of(root, "vissl", VISSL)
        why = "the teacher's checkpoint and build, which the loss checked here does not use"
        helpers = {
            "vissl.models.model_helpers": shim(
                "vissl.models.model_helpers", why, get_no_ddp_model=unused("get_no_ddp_model", why)
            )
        }
        module = load(
            root, (CLASSY_DIST, "vissl/losses/dino_loss.py"), _stateful_stubs(root, **helpers)
        )
        _on_cpu(module)
        models = shim("vissl.models", why, build_model=unused("build_model", why))
        hooks = load(
            root,
            ("vissl/hooks/dino_hooks.py",),
            _stateful_stubs(root, **helpers, **{"vissl.models": models}),
        )
        config = vissl_config(root, "dino_loss", output_dim=16, teacher_temp_warmup_iters=4)
        config.num_crops = 2
        self.hold(module.DINOLoss.from_config(config))
        self.hook, self.iteration = hooks.DINOHook(), 0

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        student = torch.cat((z0, z1))
        self.released.teacher_output = student.detach()
        task = types.SimpleNamespace(
            loss=self.released, iteration=self.iteration, max_iteration=100
        )
        self.hook.get_teacher_temperature(task)
        self.iteration += 1
        return self.released([student])


class VisslMoCo(_HeldAsVissl):
    """vissl's released ``MoCoLoss.from_config`` (embedding_dim 16, queue_size `QUEUE`, the rest
    vissl's defaults) on the query z0, with the key vissl's ``MoCoHook.on_forward`` sets on the
    loss before it runs: the momentum encoder's normalised output of the other view, here
    ``normalize(z1)`` detached (the encoder at its start). Its queue, filled after each call
    with the keys gathered by vissl's ``concat_all_gather``, is state: checked over steps."""

    def __init__(self, root=None):
        super().__init__()
        root = root_of(root, "vissl", VISSL)
        gather = released_functions(root, "vissl/utils/misc.py", "concat_all_gather", torch=torch)
        misc = shim(
            "vissl.utils.misc", "misc.py imports iopath and scipy: its gather only", **gather
        )
        module = load(
            root,
            ("vissl/losses/moco_loss.py",),
            _stateful_stubs(root, **{"vissl.utils.misc": misc}),
        )
        config = vissl_config(root, "moco_loss", embedding_dim=16, queue_size=QUEUE)
        self.hold(module.MoCoLoss.from_config(config))

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        self.released.key = F.normalize(z1.detach(), dim=1)
        return self.released(z0)


def sample_indices(global_batch_size: int) -> torch.Tensor:
    """Each sample's index in the data set (the check's inputs): the global batch as the data
    set, ``0 … 15``, every update (each rank given its rows)."""
    return torch.arange(global_batch_size)


class _DrawnForTheGlobalBatch(nn.Module):
    """vissl's released negative sampler (``AliasMethod``) drawing, at each call, for the whole
    global batch from a seed of its own (the call's number), the rank's rows kept: every rank's
    negatives are those one device draws for its samples (left to the ranks' shared random
    state, each rank would draw the first rows' negatives)."""

    def __init__(self, sampler: nn.Module, rank: int, world_size: int):
        super().__init__()
        self.sampler, self.rank, self.world_size, self.calls = sampler, rank, world_size, 0

    def draw(self, n: int) -> torch.Tensor:
        self.calls += 1
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.calls)
            drawn = self.sampler.draw(n * self.world_size)
        return drawn.view(self.world_size, n)[self.rank]


class VisslNCE(_HeldAsVissl):
    """vissl's released ``NCELossWithMemory.from_config`` (NPID's NCE: embedding_dim 16, a memory
    bank of the 16 samples, ``num_train_samples`` 16, 8 negatives, the rest vissl's defaults) on
    z0 as each sample's embedding (NPID's one view; z1 is not used), with the samples' indices
    (`sample_indices`, the check's inputs) as its targets. Its memory bank (synced at the first
    call, updated with the gathered embeddings after each) and its normalisation constant (set
    from the first batch's gathered mean) are state: checked over steps. The negatives are drawn
    by the released sampler for the global batch (`_DrawnForTheGlobalBatch`)."""

    def __init__(self, root=None, world_size=1):
        super().__init__()
        root = root_of(root, "vissl", VISSL)
        util = shim(
            "classy_vision.generic.util",
            "util.py imports fvcore: is_pos_int only",
            **released_functions(root, "classy_vision/generic/util.py", "is_pos_int"),
        )
        module = load(
            root,
            (CLASSY_DIST, "vissl/losses/nce_loss.py"),
            _stateful_stubs(root, **{"classy_vision.generic.util": util}),
        )
        config = vissl_config(
            root,
            "nce_loss_with_memory",
            num_train_samples=16,
            negative_sampling_params={"num_negatives": 8},
            memory_params={"embedding_dim": 16},
        )
        loss = module.NCELossWithMemory.from_config(config)
        average = loss.nce_average
        average.multinomial = _DrawnForTheGlobalBatch(average.multinomial, _rank(), world_size)
        self.hold(loss)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return self.released(z0, index)


def _as_model_output(embeddings: torch.Tensor) -> list[torch.Tensor]:
    """The model vissl's ``init_memory`` runs on each crop, here: the check's embeddings are
    the model's output already (vissl's models return a list of outputs)."""
    return [embeddings]


class VisslDeepClusterV2(_HeldAsVissl):
    """vissl's released ``DeepClusterV2Loss.from_config`` (two heads of 2 clusters, embedding_dim
    16, a memory bank of the 16 samples, ``num_train_samples`` 16 and ``BATCHSIZE_PER_REPLICA``
    16/W as vissl's ``infer_losses_config`` sets it, the rest vissl's defaults) on the rank's
    crops ``cat(z0, z1)`` with their samples' indices (`sample_indices`, the check's inputs,
    once per crop), each update an epoch of the one-batch data set: vissl's released hooks
    called as its trainer calls them, ``InitMemoryHook.on_start`` (the memory bank filled by the
    loss's ``init_memory`` with the first batch's z0, detached) and
    ``ClusterMemoryHook.on_phase_start`` (the loss's distributed k-means, ``cluster_memory``,
    its centroids and assignments) before each forward. Its memory bank, centroids and
    assignments are state: checked over steps. Two clusters: k-means starts from K rows of rank
    0's memory bank, 16/W rows (2 at W = 8)."""

    def __init__(self, root=None, world_size=1):
        super().__init__()
        root = root_of(root, "vissl", VISSL)
        sparse = released_functions(
            root, "vissl/utils/misc.py", "get_indices_sparse", np=np, csr_matrix=csr_matrix
        )
        misc = shim("vissl.utils.misc", "misc.py imports iopath: get_indices_sparse only", **sparse)
        module = load(
            root,
            (CLASSY_DIST, "vissl/losses/deepclusterv2_loss.py"),
            _stateful_stubs(root, **{"vissl.utils.misc": misc}),
        )
        hooks = load(root, ("vissl/hooks/deepclusterv2_hooks.py",), _stateful_stubs(root))
        config = vissl_config(
            root,
            "deepclusterv2_loss",
            BATCHSIZE_PER_REPLICA=16 // world_size,
            num_clusters=[2, 2],
            memory_params={"embedding_dim": 16},
            num_train_samples=16,
        )
        self.hold(module.DeepClusterV2Loss.from_config(config))
        self.starts, self.phases = hooks.InitMemoryHook(), hooks.ClusterMemoryHook()
        attr_dict = load(root, ("vissl/config/attr_dict.py",), {}).AttrDict
        self.task_config = attr_dict({"LOSS": {"name": "deepclusterv2_loss"}})  # the hooks read it
        self.phase = -1

    def forward(self, z0: torch.Tensor, z1: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        crops, indices = torch.cat((z0, z1)), torch.cat((index, index))
        batch = {"data_idx": [indices], "data": [[z0.detach(), z1.detach()]]}
        task = types.SimpleNamespace(
            config=self.task_config,
            loss=self.released,
            train_phase_idx=self.phase,
            model=_as_model_output,
            dataloaders={"train": [batch]},
        )
        self.starts.on_start(task)  # the first call only: it returns once a phase has run
        self.phases.on_phase_start(task)
        self.phase += 1
        return self.released(crops, indices)


VISSL_BARLOW_FIX = Fix(
    "average the cross-correlation with an all-reduce whose backward sums the gradients "
    "(census_fixes.all_reduce_sum) instead of classy_vision's all_reduce_mean (an in-place "
    "all_reduce that autograd does not see)",
    "vissl/barlow.patch",
)
VISSL_SWAV_FLOAT64 = Fix(
    "float64: the Sinkhorn-Knopp codes kept in the input's dtype (.float() casts them to "
    "float32, and the loss is summed in their dtype)",
    "vissl/swav_float64.patch",
)
SWAV_FLOAT64_REMARK = (
    "`distributed_sinkhornknopp` returns its codes `.float()` and the loss sums in their dtype: "
    "the loss is float32 whatever its input, and the row is of the release with the codes kept "
    "in the input's dtype (float64)"
)
VISSL_DC2_CPU = Fix(
    "CPU, float64: the memory's and k-means' .cuda() calls removed and the k-means centroids "
    "and sums made in the memory bank's dtype (torch.empty/zeros make float32)",
    "vissl/deepclusterv2_cpu.patch",
)
DC2_CPU_REMARK = (
    "`init_memory` and `cluster_memory` move their tensors with `.cuda()` and make the k-means "
    "centroids in float32 (rank 0 broadcasts its float64 rows into them): the row is of the "
    "release with the `.cuda()` calls removed and those tensors in the memory bank's dtype"
)
VISSL_DC2_FIX = Fix(
    "start the k-means from K rows drawn from the whole memory bank (every rank's rows, "
    "gathered with gather_from_all) instead of from rank 0's own rows",
    "vissl/deepclusterv2_kmeans_start.patch",
)
DEEPCLUSTERV2 = Case(
    "vissl", VISSL, "DeepClusterV2Loss",
    "from its config: 2 heads of 2 clusters, a memory bank of 16 (distributed k-means in any "
    "group); on CPU in float64 (patched: see the notes)", VisslDeepClusterV2, steps=STEPS,
    inputs=sample_indices, patch=VISSL_DC2_CPU, fix=VISSL_DC2_FIX,
    repro="vissl_deepclusterv2.py", remark=DC2_CPU_REMARK,
)  # fmt: skip
CASES = [
    Case("vissl", VISSL, "SimclrInfoNCECriterion", "defaults (gathers in any group)",
         VisslSimclr),
    Case("vissl", VISSL, "BarlowTwinsCriterion", "defaults (all-reduces in any group)",
         VisslBarlow, fix=VISSL_BARLOW_FIX, repro="vissl_barlow.py"),
    Case("vissl", VISSL, "SwAVLoss",
         "from its config: 8 prototypes, a queue of 32 from the first update (its local queues "
         "and Sinkhorn-Knopp distributed in any group); its codes in float64 (patched: see the "
         "notes)", VisslSwAV, steps=STEPS, patch=VISSL_SWAV_FLOAT64, remark=SWAV_FLOAT64_REMARK),
    Case("vissl", VISSL, "DINOLoss", "from its config (all-reduces its center in any group)",
         VisslDINO, steps=STEPS),
    Case("vissl", VISSL, "MoCoLoss",
         "from its config: a queue of 32 (fills it with the gathered keys in any group)",
         VisslMoCo, steps=STEPS),
    Case("vissl", VISSL, "NCELossWithMemory",
         "from its config: NCE, a memory bank of 16, 8 negatives (gathers the memory's updates "
         "in any group)", VisslNCE, steps=STEPS, inputs=sample_indices),
    DEEPCLUSTERV2,
]  # fmt: skip
NOT_RUN: list[NotRun] = []
