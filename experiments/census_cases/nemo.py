"""The census's cases of NVIDIA NeMo (nemo_toolkit 2.4.1, the newest 2.x release that holds the
torch-only ``SigLipLoss``: 2.5.0 and later dropped ``nemo/collections/multimodal``): its
``SigLipLoss`` with either exchange, the multimodal collection's ``ClipLoss``, NeMo 2's
``ClipMegatronLoss`` (``nemo/collections/vlm``) and the BERT embedding model's ranking losses
(``nemo/collections/llm/bert/loss.py``), with their distributed flags.

The CLIP and BERT losses ask Megatron's ``parallel_state`` for the data-parallel rank, world
size and group; megatron-core is loaded from its own wheel (`MCORE`) and initialised for the
ranks' group as NeMo's trainer initialises it (tensor, pipeline and context parallel sizes 1: the
data-parallel group is every rank)."""

from __future__ import annotations

import sys
import types
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from public_code import load
from torch import nn

from census_cases.common import (
    Case,
    NotRun,
    flags_text,
    importable,
    released_functions,
    root_of,
    shim,
    unused,
)

NEMO = "2.4.1"
MCORE = "0.13.1"  # megatron-core of NeMo 2.4's time (nemo_toolkit leaves it unpinned)
SIGLIP = ("nemo/collections/multimodal/losses/siglip_loss.py",)
CLIP = ("nemo/collections/multimodal/losses/clip_loss.py",)
CLIP_MEGATRON = ("nemo/collections/vlm/clip/loss/clip_loss.py",)
BERT = ("nemo/collections/llm/bert/loss.py",)
MEGATRON_UTILS = "nemo/collections/nlp/modules/common/megatron/utils.py"
NEEDS = (("megatron-core", MCORE),)  # on every case: the census fetches the needs of a
# package's first case only

_STATE: dict[str, Any] = {"world": None}  # the default group parallel_state is initialised for


def parallel_state() -> types.ModuleType:
    """megatron-core's ``megatron.core.parallel_state`` (from its wheel, `MCORE`), initialised
    for the default process group that exists now (``initialize_model_parallel()`` with its
    default sizes, all 1, as NeMo's trainer calls it for data parallelism alone; without the
    extra gloo copies of the groups, used by Megatron's distributed optimiser, not by a loss),
    again whenever that group is another one than it was initialised for; with no group, its
    groups unset (its world size is then 0 and its rank 0, as Megatron answers)."""
    if "megatron.core.parallel_state" not in sys.modules:  # once: ``megatron`` is a namespace
        # package (no __init__), which `importable` would take for another copy and forget
        importable(root_of(None, "megatron-core", MCORE), "megatron")
    from megatron.core import parallel_state as state

    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if world is not _STATE["world"]:
        state.destroy_model_parallel()
        if world is not None:
            state.initialize_model_parallel(create_gloo_process_groups=False)
        _STATE["world"] = world
    return state


class _MegatronLossReduction(nn.Module):
    """A stand-in for NeMo's ``MegatronLossReduction`` (``nemo/lightning/megatron_parallel.py``,
    which imports Lightning and Megatron's training schedules): the base class of
    ``ClipMegatronLoss`` and of the BERT losses, an ``nn.Module``. The released base adds a
    forward pre-hook that puts the batch given to ``setup`` before the arguments; the adapter
    passes that batch itself."""


def _clip_stubs(root) -> dict[str, types.ModuleType]:
    """What the CLIP losses' files import from NeMo besides the loss: from
    ``nemo/collections/nlp/modules/common/megatron/utils.py`` (its file imports apex and NeMo's
    logging and model code) only its released ``average_losses_across_data_parallel_group``
    (`released_functions`; it averages the detached loss over the data-parallel group, for the
    log); and the stand-in `_MegatronLossReduction`."""
    utils = released_functions(root, MEGATRON_UTILS, "average_losses_across_data_parallel_group",
                               torch=torch, parallel_state=parallel_state())  # fmt: skip
    why = "its file imports apex and NeMo's model code; the loss uses only this function"
    lightning = "Lightning and Megatron's schedules; the loss uses only its base class"
    return {
        "nemo.collections.nlp.modules.common.megatron.utils": shim(
            "nemo.collections.nlp.modules.common.megatron.utils", why, **utils
        ),
        "nemo.lightning.megatron_parallel": shim(
            "nemo.lightning.megatron_parallel", lightning,
            MegatronLossReduction=_MegatronLossReduction,
        ),
    }  # fmt: skip


def _bert_stubs() -> dict[str, types.ModuleType]:
    """What ``bert/loss.py`` imports from ``nemo/lightning/megatron_parallel.py`` (Lightning and
    Megatron's schedules): the stand-in `_MegatronLossReduction`, the ranking losses' base, and
    ``MaskedTokenLossReduction``, the masked-token loss of ``BERTLossReduction`` (not checked):
    calling it raises."""
    why = "Lightning and Megatron's schedules; the ranking losses use only its base class"
    masked = unused("MaskedTokenLossReduction", "the masked-token loss, not a ranking loss")
    return {"nemo.lightning.megatron_parallel": shim(
        "nemo.lightning.megatron_parallel", why, MegatronLossReduction=_MegatronLossReduction,
        MaskedTokenLossReduction=masked,
    )}  # fmt: skip


class NemoSigLip(nn.Module):
    """NeMo's released ``SigLipLoss(rank, world_size, **flags)`` (loaded alone: it imports only
    torch) as ``loss(z0, z1)``: z0 the image features, z1 the text features, both normalised (the
    model normally does it), with SigLIP's initial logit scale (``exp(log 10)``) and bias (−10)
    held here, learnt with ``learn_scale_bias``; its ``group`` the default, None (every rank:
    NeMo's CLIP model passes Megatron's data-parallel group, every rank without model
    parallelism). Its forward takes them as one tuple and returns (loss, {"loss": loss}): the
    loss is returned."""

    def __init__(self, root=None, rank=0, world_size=1, learn_scale_bias=False, **flags):
        super().__init__()
        module = load(root_of(root, "nemo_toolkit", NEMO), SIGLIP, {})
        self.loss = module.SigLipLoss(rank=rank, world_size=world_size, **flags)
        scale, bias = torch.tensor(10.0).log(), torch.tensor(-10.0)
        if learn_scale_bias:
            self.logit_scale, self.logit_bias = nn.Parameter(scale), nn.Parameter(bias)
        else:
            self.register_buffer("logit_scale", scale)
            self.register_buffer("logit_bias", bias)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        z0, z1 = F.normalize(z0, dim=-1), F.normalize(z1, dim=-1)
        return self.loss((z0, z1, self.logit_scale.exp(), self.logit_bias))[0]


class NemoClip(nn.Module):
    """NeMo's released ``ClipLoss(**flags)`` (``megatron=False``: the multimodal collection's) or
    ``ClipMegatronLoss(**flags)`` (``megatron=True``: NeMo 2's, in the vlm collection) as
    ``loss(z0, z1)``: features normalised (the model normally does it), logit scale 1/0.07 held
    here. The loss takes its rank and world size from Megatron's `parallel_state`, initialised
    for the ranks' group before it is built and before each forward. ``ClipMegatronLoss.forward``
    takes (batch, forward_out) and does not read the batch: None is given. Both return (loss, a
    dict of the loss averaged over the ranks, for the log): the loss is returned."""

    def __init__(self, root=None, megatron=False, **flags):
        super().__init__()
        root = root_of(root, "nemo_toolkit", NEMO)
        parallel_state()
        module = load(root, CLIP_MEGATRON if megatron else CLIP, _clip_stubs(root))
        self.megatron = megatron
        self.loss = (module.ClipMegatronLoss if megatron else module.ClipLoss)(**flags)
        self.register_buffer("logit_scale", torch.tensor(1 / 0.07).log())

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        parallel_state()
        output = (F.normalize(z0, dim=-1), F.normalize(z1, dim=-1), self.logit_scale.exp())
        return (self.loss(None, output) if self.megatron else self.loss(output))[0]


class NemoBertRanking(nn.Module):
    """NeMo's released ``loss(**flags)`` of ``nemo/collections/llm/bert/loss.py``
    (``BERTInBatchExclusiveHardNegativesRankingLoss`` or ``HardNegativeRankingLoss``, with
    their default one hard negative and scale) as ``loss(z0, z1)``: the queries z0, the
    positives z1 and each query's one hard negative made from its own positive, z1 reversed
    along the feature dimension (a live other embedding of the same sample), all normalised (the
    embedding head normalises them), laid out as the loss reads its ``forward_out``: per sample
    its query, positive and negative rows in turn. It reads Megatron's `parallel_state` (for
    the gather, and the logged loss), initialised for the ranks' group before each forward; its
    forward takes (batch, forward_out) and does not read the batch: None is given. It returns
    (loss, the loss averaged over the ranks, for the log): the loss is returned."""

    def __init__(self, root=None, loss="BERTInBatchExclusiveHardNegativesRankingLoss", **flags):
        super().__init__()
        parallel_state()
        module = load(root_of(root, "nemo_toolkit", NEMO), BERT, _bert_stubs())
        self.loss = getattr(module, loss)(**flags)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        parallel_state()
        query, positive = F.normalize(z0, dim=-1), F.normalize(z1, dim=-1)
        rows = torch.stack((query, positive, positive.flip(1)), dim=1).reshape(-1, z0.shape[1])
        return self.loss(None, rows)[0]


GATHER_WITH_GRAD = "gather_with_grad=True (a row below)"
NOT_WORKING = (
    "NeMo's docstring says gather_with_grad \"is not currently working in the latest PyTorch "
    'version"; measured here (torch 2.13, gloo) it is exact'
)


def _siglip(flags: dict[str, Any]) -> Case:
    return Case("nemo_toolkit", NEMO, "SigLipLoss", flags_text(flags), NemoSigLip, flags,
                needs=NEEDS)  # fmt: skip


def _clip(flags: dict[str, Any], note: str = "", remark: str = "") -> Case:
    return Case("nemo_toolkit", NEMO, "ClipLoss", flags_text(flags), NemoClip, flags, note=note,
                needs=NEEDS, remark=remark)  # fmt: skip


def _clip_megatron(flags: dict[str, Any], note: str = "") -> Case:
    return Case("nemo_toolkit", NEMO, "ClipMegatronLoss", flags_text(flags), NemoClip,
                {"megatron": True, **flags}, note=note, needs=NEEDS)  # fmt: skip


def _bert(loss: str, flags: dict[str, Any], shown: str = "", note: str = "",
          remark: str = "") -> Case:  # fmt: skip
    return Case("nemo_toolkit", NEMO, loss, shown or flags_text(flags), NemoBertRanking,
                {"loss": loss, **flags}, note=note, needs=NEEDS, remark=remark)  # fmt: skip


IN_BATCH = "BERTInBatchExclusiveHardNegativesRankingLoss"
BERT_DEFAULTS = (
    "NeMo's BERT embedding model trains with these flags by default (BertEmbeddingConfig: "
    "global_in_batch_negatives=True, backprop_type='local'): every rank computes the loss of "
    "the whole global batch, its gradient only through its own rows"
)
CASES = [
    _siglip({}),
    _siglip({"bidir": False}),
    _siglip({"learn_scale_bias": True}),
    _clip({}, GATHER_WITH_GRAD),
    _clip({"local_loss": True}, GATHER_WITH_GRAD),
    _clip({"gather_with_grad": True}, remark=NOT_WORKING),
    _clip({"local_loss": True, "gather_with_grad": True}),
    _clip_megatron({}),
    _clip_megatron({"local_loss": True}),
    _clip_megatron({"gather_with_grad": False}, "gather_with_grad=True (the default, above)"),
    _bert("HardNegativeRankingLoss", {}, "defaults (hard negatives only, no in-batch ones)"),
    _bert(IN_BATCH, {}, "defaults (no gathering)", "global_in_batch_negatives=True (next rows)"),
    _bert(
        IN_BATCH,
        {"global_in_batch_negatives": True},
        note="backprop_type=global (next row)",
        remark=BERT_DEFAULTS,
    ),
    _bert(IN_BATCH, {"global_in_batch_negatives": True, "backprop_type": "global"}),
]
NOT_RUN: list[NotRun] = []
