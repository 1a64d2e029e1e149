"""The census's cases of LAVIS (salesforce-lavis 1.0.2): its ``ClipLoss``, a copy of OpenCLIP's,
with its flags; and the image-text contrastive (ITC) losses of BLIP-2 (``Blip2Qformer``), BLIP
(``BlipPretrain``) and ALBEF (``AlbefPretrain``), and BLIP-2's image-text matching (ITM), which
the models compute inline in their ``forward``, after the image encoder and BERT (which need
their checkpoints' configs and tokenizer) and before the heads that need both: the released
statements of each ``forward`` are compiled on their own, at their own lines
(`released_statements`), and run on the check's embeddings; the forward's other statements are
not run."""

from __future__ import annotations

import ast
import types
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from public_code import load
from torch import nn

from census_cases.common import Case, Fix, NotRun, flags_text, root_of, shim, stubs
from census_cases.torchmultimodal import hardest_negatives, text_tokens

LAVIS = "1.0.2"
LAVIS_PACKAGE = "salesforce-lavis"
LAVIS_BASE = ("lavis/common/dist_utils.py", "lavis/models/base_model.py")


class LavisClip(nn.Module):
    """LAVIS's released ``ClipLoss`` (``lavis/models/clip_models/loss.py``, loaded alone: it
    imports torch and, optionally, horovod, absent here) as OpenCLIP's is checked
    (`OpenClipForCheck`): features normalised, logit scale 1/0.07 held here."""

    def __init__(self, root=None, rank=0, world_size=1, **flags):
        super().__init__()
        files = ("lavis/models/clip_models/loss.py",)
        module = load(root_of(root, LAVIS_PACKAGE, LAVIS), files, {})
        self.loss = module.ClipLoss(rank=rank, world_size=world_size, **flags)
        self.register_buffer("logit_scale", torch.tensor(1 / 0.07).log())

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        z0, z1 = F.normalize(z0, dim=-1), F.normalize(z1, dim=-1)
        return self.loss(z0, z1, self.logit_scale.exp())


def lavis_base(root) -> types.ModuleType:
    """``lavis/models/base_model.py`` of the release (``concat_all_gather``,
    ``all_gather_with_grad``, ``SharedQueueMixin``, ``MomentumDistilationMixin``) with
    ``lavis/common/dist_utils.py`` (``is_dist_avail_and_initialized``). Stubs: timm (dist_utils
    downloads checkpoints with its hub), omegaconf and ``lavis.common.utils`` (base_model loads
    configs and checkpoints with them): none is used by the gathers or the mixins."""
    why = "checkpoints and configs; the gathers and the queue never use it"
    given = stubs(timm__models__hub=why)
    given["timm"] = shim("timm", why)
    given["timm.models"] = shim("timm.models", why)
    given["lavis.common.utils"] = shim("lavis.common.utils", why, get_abs_path=None, is_url=None)
    given["omegaconf"] = shim("omegaconf", why, OmegaConf=None)
    return load(root_of(root, LAVIS_PACKAGE, LAVIS), LAVIS_BASE, given)


def released_statements(
    root: Path,
    file: str,
    cls: str,
    method: str,
    first: str,
    last: str,
    arguments: tuple[str, ...],
    result: str,
    **namespace: Any,
) -> Any:
    """The statements of the released method ``cls.method`` of ``file``, from the first whose
    source holds ``first`` to the first after it whose source holds ``last``, compiled alone at
    their own lines (a trace names ``file:line`` as in the release) as a function of
    ``arguments`` returning the variable ``result``; ``namespace``: the module's names they use.
    The method's other statements (its encoders, ITM, language model) are left out."""
    path = root / file
    source = path.read_text()
    tree = ast.parse(source, str(path))
    body = next(
        node.body for klass in tree.body if isinstance(klass, ast.ClassDef) and klass.name == cls
        for node in klass.body if isinstance(node, ast.FunctionDef) and node.name == method
    )  # fmt: skip
    texts = [ast.get_source_segment(source, node) or "" for node in body]
    start = next(i for i, text in enumerate(texts) if first in text)
    end = next(i for i, text in enumerate(texts) if i >= start and last in text)
    chosen = body[start : end + 1]
    done = ast.Return(ast.Name(result, ast.Load()))
    ast.copy_location(done, chosen[-1])
    function = ast.FunctionDef(
        name=f"{cls}_{method}_lines",
        args=ast.arguments(posonlyargs=[], args=[ast.arg(name) for name in arguments],
                           kwonlyargs=[], kw_defaults=[], defaults=[]),
        body=[*chosen, done], decorator_list=[], returns=None,
    )  # fmt: skip
    ast.copy_location(function, chosen[0])
    module = ast.fix_missing_locations(ast.Module(body=[function], type_ignores=[]))
    scope = dict(namespace)
    exec(compile(module, str(path), "exec"), scope)
    return scope[function.name]


BLIP2_QFORMER = "lavis/models/blip2_models/blip2_qformer.py"


def blip2_forward_lines(root: Path, last: str, arguments: tuple[str, ...], result: str) -> Any:
    """`released_statements` of ``Blip2Qformer.forward`` from ``image_feats_all = `` to the
    statement holding ``last``, with the module's names they use (torch, F, dist and the two
    gathers of `lavis_base`)."""
    base = lavis_base(root)
    return released_statements(
        root, BLIP2_QFORMER, "Blip2Qformer", "forward", "image_feats_all = ", last, arguments,
        result, torch=torch, F=F, dist=dist, concat_all_gather=base.concat_all_gather,
        all_gather_with_grad=base.all_gather_with_grad,
    )  # fmt: skip


class LavisBlip2Itc(nn.Module):
    """LAVIS's released BLIP-2 ITC (``Blip2Qformer.forward``, from ``image_feats_all =
    concat_all_gather(...)`` to ``loss_itc``: the gathers, the query-token maximum, label
    smoothing 0.1): the image features z0 as 2 query tokens of 8 and the text feature z1's
    first 8 values, each normalised (the model's projections normalised, as the forward has
    them), the temperature a parameter from 0.07 as ``Blip2Qformer`` makes it. The forward's
    ``image`` is z0 (only its size and device are read). The rest of the forward (the ViT, the
    Q-Former's BERT, ITM and the captioning loss) needs the image encoder and BERT and is not
    run."""

    def __init__(self, root=None):
        super().__init__()
        root = root_of(root, LAVIS_PACKAGE, LAVIS)
        arguments = ("self", "image", "image_feats", "text_feat")
        self.itc = blip2_forward_lines(root, "loss_itc = ", arguments, "loss_itc")
        self.temp = nn.Parameter(0.07 * torch.ones([]))

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        image_feats = F.normalize(z0.view(len(z0), 2, 8), dim=-1)
        text_feat = F.normalize(z1[:, :8], dim=-1)
        return self.itc(self, z0, image_feats, text_feat)


class _QformerBert(nn.Module):
    """A stand-in, written here, for the Q-Former's BERT in its ITM call
    (``self.Qformer.bert(text_ids, query_embeds=..., attention_mask=...,
    encoder_hidden_states=...)``): each query token attends once to the image embeddings
    (learnt key and value maps, width 8), and the text's token ids, embedded (vocabulary 11) and
    averaged over the text's attention mask, are added to every query; the last hidden state is
    the queries'. The smallest thing whose matching logits depend on the query tokens, the image
    and the text, as the ITM needs; LAVIS's own BERT needs its config and tokenizer files."""

    def __init__(self, width: int = 8, vocab: int = 11):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.key, self.value = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, input_ids, query_embeds, attention_mask, encoder_hidden_states, **kwargs):
        mask = attention_mask[:, query_embeds.shape[1] :].to(query_embeds.dtype)
        text = (self.embed(input_ids) * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        scores = query_embeds @ self.key(encoder_hidden_states).transpose(1, 2)
        attended = scores.softmax(dim=-1) @ self.value(encoder_hidden_states)
        return types.SimpleNamespace(last_hidden_state=attended + text[:, None, :])


class LavisBlip2Itm(nn.Module):
    """LAVIS's released BLIP-2 ITM (``Blip2Qformer.forward``, from ``image_feats_all =
    concat_all_gather(...)`` to ``loss_itm``: the ITC similarities as in `LavisBlip2Itc`, then
    the text ids and masks gathered without gradient, the image embeddings with
    ``all_gather_with_grad``, a negative image per text and a negative text per image picked
    from every rank's by the similarities, the Q-Former on the 3B pairs, ``itm_head``'s logits
    averaged over the queries): the image embeddings z0 as 2 tokens of 8, the text tokens of
    the case (`census_cases.torchmultimodal.text_tokens`), 2 learnt query tokens, ``itm_head``
    a learnt linear map 8 to 2, the Q-Former's BERT the stand-in `_QformerBert`; the temperature
    0.07 held here (ITM uses the similarities only without gradient). The negatives are the
    hardest (`census_cases.torchmultimodal.hardest_negatives`) instead of drawn."""

    def __init__(self, root=None):
        super().__init__()
        root = root_of(root, LAVIS_PACKAGE, LAVIS)
        arguments = ("self", "image", "image_feats", "text_feat", "image_embeds", "text_tokens")
        self.itm = blip2_forward_lines(root, "loss_itm = ", arguments, "loss_itm")
        self.register_buffer("temp", torch.tensor(0.07))
        self.query_tokens = nn.Parameter(torch.randn(1, 2, 8))
        self.Qformer = nn.ModuleDict({"bert": _QformerBert()})
        self.itm_head = nn.Linear(8, 2)

    def forward(self, z0, z1, input_ids, attention_mask) -> torch.Tensor:
        embeds = z0.view(len(z0), 2, 8)
        tokens = types.SimpleNamespace(input_ids=input_ids, attention_mask=attention_mask)
        feats, text_feat = F.normalize(embeds, dim=-1), F.normalize(z1[:, :8], dim=-1)
        with hardest_negatives():
            return self.itm(self, z0, feats, text_feat, embeds, tokens)


class _Identity(nn.Module):
    """The momentum copy of an encoder, here the identity: the check's model is the encoder,
    and its momentum copy cannot be made inside the loss. ``bert`` and ``forward_text`` (the
    text encoder's calls in ALBEF and BLIP) return its tokens as the last hidden state."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens

    def bert(self, input_ids: torch.Tensor, **kwargs: Any) -> types.SimpleNamespace:
        return types.SimpleNamespace(last_hidden_state=input_ids)

    def forward_text(self, text: types.SimpleNamespace) -> types.SimpleNamespace:
        return types.SimpleNamespace(last_hidden_state=text.input_ids)


MOMENTUM_ITC = {  # model: (file, class)
    "ALBEF": ("lavis/models/albef_models/albef_pretrain.py", "AlbefPretrain"),
    "BLIP": ("lavis/models/blip_models/blip_pretrain.py", "BlipPretrain"),
}


class LavisMomentumItc(nn.Module):
    """LAVIS's released ITC of ALBEF (``AlbefPretrain.forward``) or BLIP (``BlipPretrain.forward``),
    ``model``: the statements from the momentum features (``self._momentum_update()``) to
    ``self._dequeue_and_enqueue(...)``, which score the rank's image and text features against
    the momentum features of the rank's batch and a queue (filled with every rank's, gathered
    by ``concat_all_gather``), with soft targets (``alpha`` 0.4, the configs' default, without
    the ramp-up). Around them, built here: the image z0 as 2 tokens of 8 and the text z1 as 2
    tokens of 8 (the encoders are the check's model; their momentum copies `_Identity`); the
    projections ``vision_proj``, ``text_proj`` (8 to 8, learnt) and their momentum copies
    (momentum 0.995, updated by the released ``MomentumDistilationMixin``); the temperature a
    parameter from 0.07; queues of 32 (the released ``SharedQueueMixin``), random unit columns
    at the start as the models make them. A loss with state: checked with ``steps``."""

    def __init__(self, root=None, model="ALBEF"):
        super().__init__()
        root = root_of(root, LAVIS_PACKAGE, LAVIS)
        base = lavis_base(root)
        file, cls = MOMENTUM_ITC[model]
        self.itc = released_statements(
            root, file, cls, "forward", "self._momentum_update()", "self._dequeue_and_enqueue(",
            ("self", "image", "image_feat", "text_feat", "text", "alpha"), "loss_itc",
            torch=torch, F=F, dist=dist, concat_all_gather=base.concat_all_gather,
        )  # fmt: skip
        # the released mixins' methods, bound to this module
        self._momentum_update = types.MethodType(
            base.MomentumDistilationMixin._momentum_update, self
        )
        self._dequeue_and_enqueue = types.MethodType(
            base.SharedQueueMixin._dequeue_and_enqueue, self
        )
        self.vision_proj, self.text_proj = nn.Linear(8, 8), nn.Linear(8, 8)
        self.vision_proj_m, self.text_proj_m = nn.Linear(8, 8), nn.Linear(8, 8)
        self.visual_encoder_m, self.text_encoder_m = _Identity(), _Identity()
        self.model_pairs = [[self.vision_proj, self.vision_proj_m],
                            [self.text_proj, self.text_proj_m]]  # fmt: skip
        base.MomentumDistilationMixin.copy_params(self)
        self.momentum, self.queue_size, self.alpha = 0.995, 32, 0.4
        self.temp = nn.Parameter(0.07 * torch.ones([]))
        self.register_buffer("image_queue", F.normalize(torch.randn(8, 32), dim=0))
        self.register_buffer("text_queue", F.normalize(torch.randn(8, 32), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        image = z0.view(len(z0), 2, 8)
        tokens = z1.view(len(z1), 2, 8)
        text = types.SimpleNamespace(input_ids=tokens, attention_mask=torch.ones(len(z1), 2))
        image_feat = F.normalize(self.vision_proj(image[:, 0, :]), dim=-1)
        text_feat = F.normalize(self.text_proj(tokens[:, 0, :]), dim=-1)
        return self.itc(self, image, image_feat, text_feat, text, self.alpha)


def _lavis(flags: dict[str, Any], note: str = "") -> Case:
    return Case(LAVIS_PACKAGE, LAVIS, "ClipLoss", flags_text(flags), LavisClip, flags,
                note=note)  # fmt: skip


MOMENTUM_GATHER = {
    model: Fix(
        "the batch's momentum features gathered from every rank (concat_all_gather: they carry "
        "no gradient) before the queue, the targets on the rank's columns of them, instead of "
        "the rank's own batch",
        f"lavis/{model.lower()}_itc_gather.patch",
    )
    for model in MOMENTUM_ITC
}
BLIP2_REMARK = (
    "exact against its own one-device run, which is a one-rank group: the forward calls "
    "`dist.get_rank()`, so it cannot run without a process group, and in a one-rank group "
    "`concat_all_gather` (no gradient) detaches the gathered columns too; on one device and on "
    "W ranks alike the image features get no gradient as the text's columns, nor the text's as "
    "the image's. torchmultimodal's copy of these lines (its `concat_gather_all_gpu` returns "
    "its input without a group, with its gradient) is biased for that reason (its rows above)"
)
CASES = [
    _lavis({}, "gather_with_grad=True (a row below)"),
    _lavis({"local_loss": True}, "gather_with_grad=True (a row below)"),
    _lavis({"gather_with_grad": True}),
    _lavis({"local_loss": True, "gather_with_grad": True}),
    Case(LAVIS_PACKAGE, LAVIS, "Blip2Qformer.forward, its ITC (BLIP-2)",
         "the released ITC lines (learnt temperature)", LavisBlip2Itc, remark=BLIP2_REMARK),
    Case(LAVIS_PACKAGE, LAVIS, "Blip2Qformer.forward, its ITM (BLIP-2)",
         "the released ITC and ITM lines; a stand-in Q-Former; hardest negatives, not drawn",
         LavisBlip2Itm, inputs=text_tokens),
    *(Case(LAVIS_PACKAGE, LAVIS, f"{MOMENTUM_ITC[model][1]}.forward, its ITC ({model})",
           "the released ITC lines (momentum features, queue of 32, learnt temperature)",
           LavisMomentumItc, {"model": model}, steps=3, fix=MOMENTUM_GATHER[model],
           repro="lavis_momentum_itc.py")
      for model in MOMENTUM_ITC),
]  # fmt: skip
NOT_RUN: list[NotRun] = []
