"""The census's cases of torchmultimodal 2024.4.1 (the wheel torchmultimodal-nightly: the
registry has no torchmultimodal): ``ContrastiveLossWithTemperature`` with each
``BackpropType``, FLAVA's losses (``modules/losses/flava.py``: the global contrastive loss, ITM,
the masked-prediction loss of MLM and MMM) and BLIP-2's (``modules/losses/blip2_losses.py``: the
image-text contrastive, matching and captioning losses)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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
        self.module = _blip2(root)
        self.register_buffer("temp", torch.tensor(0.07))

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        image = F.normalize(z0.view(len(z0), 2, 8), dim=-1)
        text = F.normalize(z1[:, :8], dim=-1)
        return self.module.itc_loss(
            *self.module.compute_image_text_similarity(image, text, self.temp)
        )


TMM_FLAVA = (
    "torchmultimodal/utils/distributed.py",
    "torchmultimodal/modules/layers/normalizations.py",
    "torchmultimodal/modules/losses/contrastive_loss_with_temperature.py",
    "torchmultimodal/utils/common.py",
    "torchmultimodal/modules/losses/flava.py",
)
TMM_QFORMER = (
    "torchmultimodal/modules/layers/normalizations.py",
    "torchmultimodal/modules/layers/mlp.py",
    "torchmultimodal/modules/layers/multi_head_attention.py",
    "torchmultimodal/utils/attention.py",
    "torchmultimodal/models/blip2/qformer_utils.py",
    "torchmultimodal/models/blip2/qformer_layers.py",
    "torchmultimodal/models/blip2/qformer_model.py",
)
VOCAB = 11  # the small vocabulary of the token ids below (0 the padding, 1 the BOS)
TOKENS = 4  # the text's length


def _flava(root) -> object:
    """flava.py of the release, with its imports. One stub: the package ``torchmultimodal``
    itself, whose ``__init__`` makes the path manager of checkpoint files (iopath, absent here):
    utils/common.py imports its ``_PATH_MANAGER`` and the losses never use it."""
    why = "its __init__ makes the checkpoint files' path manager; the losses never use it"
    stubs = {"torchmultimodal": shim("torchmultimodal", why, _PATH_MANAGER=None)}
    return load(root_of(root, TMM_PACKAGE, TMM), TMM_FLAVA, stubs)


def _blip2(root) -> object:
    """blip2_losses.py of the release, with the stubs of `TmmBlip2Itc`."""
    stubs = {"torchmultimodal.models.blip2.blip2": shim(
        "torchmultimodal.models.blip2.blip2", "the BLIP-2 model, not the loss",
        Blip2Output=None)}  # fmt: skip
    stubs["torchmultimodal.models"] = shim("torchmultimodal.models", "the models")
    stubs["torchmultimodal.models.blip2"] = shim("torchmultimodal.models.blip2", "the model")
    return load(root_of(root, TMM_PACKAGE, TMM), TMM_BLIP2, stubs)


class TmmFlavaContrastive(nn.Module):
    """FLAVA's released ``FLAVAGlobalContrastiveLoss()`` (its logit scale a parameter from
    log(1/0.07), clamped by the loss; its gathers ``BackpropType.GLOBAL``, always) on z0 (the
    image's projected embedding) and z1 (the text's), which it normalises itself; no mask (as
    ``FLAVAPretrainingLoss`` calls it without ITM labels)."""

    def __init__(self, root=None):
        super().__init__()
        self.loss = _flava(root).FLAVAGlobalContrastiveLoss()

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        return self.loss(z0, z1, None).loss


def itm_labels(global_batch_size: int) -> dict[str, torch.Tensor]:
    """FLAVA's ITM labels, 1 (the pair matches) or 0, one per sample, drawn with the check's
    seed: split over the ranks as the views are."""
    return {"labels": torch.randint(0, 2, (global_batch_size,))}


class TmmFlavaItm(nn.Module):
    """FLAVA's released ``ITMLoss(hidden_size=16)`` (its pooler and two-way head, parameters of
    the loss) on the multimodal sequence [z0, z1] (two tokens of 16 per sample: the pooler takes
    the first) with the case's ITM labels (`itm_labels`). Nothing is gathered or reduced."""

    def __init__(self, root=None):
        super().__init__()
        self.loss = _flava(root).ITMLoss(hidden_size=16)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(torch.stack([z0, z1], dim=1), labels).loss


def itm_labels_with_a_positive(global_batch_size: int) -> dict[str, torch.Tensor]:
    """ITM labels as `itm_labels`, every even row a matching pair (1): each rank holds at least
    one at every W of the check (2 rows a rank at W = 8). A rank with none would take
    ``FLAVAPretrainingLoss``'s fallback, ``pos_pairs.new([True])``, which cannot index a batch
    of more than one row."""
    labels = torch.randint(0, 2, (global_batch_size,))
    labels[::2] = 1
    return {"labels": labels}


class TmmFlavaContrastiveMasked(nn.Module):
    """FLAVA's released ``FLAVAGlobalContrastiveLoss()`` as ``FLAVAPretrainingLoss`` calls it
    when ITM labels are given: with the mask of the matching pairs (``itm_labels.ne(0)``, as its
    forward makes ``pos_mask``; the case's labels, `itm_labels_with_a_positive`), so that the
    contrastive loss is the mean over the rank's matching pairs only. z0 the image's projected
    embedding, z1 the text's, as in `TmmFlavaContrastive`."""

    def __init__(self, root=None):
        super().__init__()
        self.loss = _flava(root).FLAVAGlobalContrastiveLoss()

    def forward(self, z0: torch.Tensor, z1: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(z0, z1, labels.ne(0)).loss


def masked_labels(global_batch_size: int) -> dict[str, torch.Tensor]:
    """The masked tokens' labels of `TmmFlavaMasked`: each of the 4 tokens of a sample masked
    with probability 0.4 (its label an id in [0, 11)), the others ``-1`` (the loss's
    ``ignore_index``), so that the number of masked tokens differs from sample to sample, as a
    masking of each token does; at least one per sample. Drawn with the check's seed."""
    masked = torch.rand(global_batch_size, TOKENS) < 0.4
    masked[:, 0] |= ~masked.any(dim=1)
    labels = torch.randint(0, VOCAB, (global_batch_size, TOKENS))
    return {"masked_labels": labels.masked_fill(~masked, -1)}


class TmmFlavaMasked(nn.Module):
    """FLAVA's released ``MaskedPredictionLoss(hidden_size=8, vocab_size=11)``, the loss of MLM,
    MIM and of MMM's text and image parts (``FLAVAPretrainingLoss`` holds one per task; its
    head a parameter of the loss), on the sequence z0, z1 as 4 tokens of 8 per sample, with the
    case's masked labels (`masked_labels`): the cross-entropy's mean over the rank's masked
    tokens. Nothing is gathered or reduced."""

    def __init__(self, root=None):
        super().__init__()
        self.loss = _flava(root).MaskedPredictionLoss(hidden_size=8, vocab_size=VOCAB)

    def forward(self, z0: torch.Tensor, z1: torch.Tensor, masked_labels: torch.Tensor):
        hidden = torch.cat([z0, z1], dim=1).view(len(z0), TOKENS, 8)
        return self.loss(hidden, masked_labels).loss


def text_tokens(global_batch_size: int) -> dict[str, torch.Tensor]:
    """BLIP-2's text tokens: per sample a length of 2 to 4 tokens (drawn), the first the CLS
    (id 2), the others ids in [3, 11), padded with 0 (the pad id) to 4, and its attention mask.
    Drawn with the check's seed; split over the ranks as the views are."""
    lengths = torch.randint(2, TOKENS + 1, (global_batch_size, 1))
    mask = (torch.arange(TOKENS) < lengths).long()
    ids = torch.randint(3, VOCAB, (global_batch_size, TOKENS))
    ids[:, 0] = 2
    return {"input_ids": ids * mask, "attention_mask": mask}


@contextlib.contextmanager
def hardest_negatives() -> Iterator[None]:
    """``torch.multinomial``, while the released ITM picks its negatives, in place of a draw:
    the index of the largest weight (the hardest negative). A draw takes the random stream,
    which is not the same on one device (16 draws) as on a rank (its rows'), so the two would
    pick different negatives; the weights drawn from, the gathered rows picked and their
    gradients are the released code's."""
    drawn = torch.multinomial

    def hardest(weights: torch.Tensor, num_samples: int, *args, **kwargs) -> torch.Tensor:
        return weights.argmax(dim=-1, keepdim=True)[..., :num_samples]

    torch.multinomial = hardest
    try:
        yield
    finally:
        torch.multinomial = drawn


class TmmBlip2Itm(nn.Module):
    """torchmultimodal's released BLIP-2 image-text matching loss, ``itm_loss``, as
    ``Blip2Phase1Loss`` calls it: the similarities from ``compute_image_text_similarity`` (as in
    `TmmBlip2Itc`: image z0 as 2 query tokens of 8, text z1's first 8 values; ``temp`` 0.07 held
    here, since ITM uses the similarities only without gradient), ``itm_head`` that of a
    released ``Blip2Phase1Loss(dim_q=8)``, the image embeddings z0 as 2 tokens of 8 (gathered by
    ``itm_loss`` with ``BackpropType.GLOBAL``), the text tokens of the case (`text_tokens`,
    gathered without gradient), 2 learnt query tokens, and the released ``QformerModel`` from a
    small config (2 layers, width 8, 2 heads, cross-attention in every layer to the image's
    8-wide tokens, vocabulary 11) as the Q-Former. The negatives are the hardest
    (`hardest_negatives`) instead of drawn."""

    def __init__(self, root=None):
        super().__init__()
        root = root_of(root, TMM_PACKAGE, TMM)
        self.module = _blip2(root)
        self.itm_head = self.module.Blip2Phase1Loss(dim_q=8).itm_head
        self.register_buffer("temp", torch.tensor(0.07))
        self.qformer = load(root, TMM_QFORMER, {}).QformerModel(
            num_hidden_layers=2, dim_q=8, dim_feedforward=16, num_heads=2,
            max_position_embeddings=8, vocab_size=VOCAB, query_length=2, dim_kv=8,
            cross_attention_freq=1,
        )  # fmt: skip
        self.query_tokens = nn.Parameter(torch.randn(1, 2, 8))

    def forward(self, z0, z1, input_ids, attention_mask) -> torch.Tensor:
        embeddings = z0.view(len(z0), 2, 8)
        sim_i2t, sim_t2i = self.module.compute_image_text_similarity(
            F.normalize(embeddings, dim=-1), F.normalize(z1[:, :8], dim=-1), self.temp
        )
        with hardest_negatives():
            return self.module.itm_loss(
                input_ids=input_ids, image_embeds=embeddings, sim_i2t=sim_i2t,
                sim_t2i=sim_t2i, model_query_tokens=self.query_tokens, qformer=self.qformer,
                itm_head=self.itm_head, attention_mask=attention_mask,
            )  # fmt: skip


class TmmBlip2Itg(nn.Module):
    """torchmultimodal's released BLIP-2 image captioning loss, ``itg_loss`` (label smoothing
    0.1, mean over the tokens that are not padding, BOS id 1, pad id 0), on prediction scores
    made here from z0 and z1 (4 tokens of 8 per sample through a linear head to the vocabulary
    of 11, the head a parameter of the loss), with the case's text tokens (`text_tokens`).
    Nothing is gathered or reduced."""

    def __init__(self, root=None):
        super().__init__()
        self.module = _blip2(root)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, z0, z1, input_ids, attention_mask) -> torch.Tensor:
        scores = self.head(torch.cat([z0, z1], dim=1).view(len(z0), TOKENS, 8))
        return self.module.itg_loss(input_ids, scores, 1, 0, VOCAB)


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
FLAVA_MASKED_MEAN = Fix(
    "the rank's sum of the cross-entropy over its masked tokens divided by the mean number of "
    "masked tokens per rank (census_fixes.all_reduce_sum of the count, over W), instead of the "
    "mean over the rank's own",
    "torchmultimodal/flava_masked_mean.patch",
)
FLAVA_MASK_MEAN = Fix(
    "with a mask, the rank's sum of the cross-entropy over its kept rows divided by the mean "
    "number of kept rows per rank (census_fixes.all_reduce_sum of the count, over W), instead "
    "of the mean over the rank's own",
    "torchmultimodal/flava_contrastive_mask_mean.patch",
)
BLIP2_ITG_MEAN = Fix(
    "the rank's sum of the cross-entropy over its tokens divided by the mean number of tokens "
    "per rank (census_fixes.all_reduce_sum of the count, over W), instead of the mean over the "
    "rank's own (reduction='mean')",
    "torchmultimodal/blip2_itg_mean.patch",
)
FP32_FLOAT64 = Fix(  # a change the check needs: float64, applied before the check
    "Fp32LayerNorm keeps float64 in float64",
    "torchmultimodal/fp32_layer_norm_float64.patch",
)
FLOAT64_REMARK = (
    "checked on the release with one change the check needs (patched): `Fp32LayerNorm` "
    "(`modules/layers/normalizations.py`), which computes in float32 whatever its input's "
    "dtype, computes a float64 input in float64; without it the layer norms' parameters "
    "differ from one device's by float32's rounding (relative 1e-7, measured), which is not the "
    "distributed path"
)
CASES += [
    Case(TMM_PACKAGE, TMM, "FLAVAGlobalContrastiveLoss (FLAVA)",
         "defaults (gathers with BackpropType.GLOBAL, always)", TmmFlavaContrastive),
    Case(TMM_PACKAGE, TMM, "FLAVAGlobalContrastiveLoss (FLAVA)",
         "with FLAVAPretrainingLoss's mask of the ITM positives", TmmFlavaContrastiveMasked,
         inputs=itm_labels_with_a_positive, fix=FLAVA_MASK_MEAN,
         repro="flava_contrastive_mask.py"),
    Case(TMM_PACKAGE, TMM, "ITMLoss (FLAVA)", "hidden_size=16 (its pooler and head learnt)",
         TmmFlavaItm, inputs=itm_labels),
    Case(TMM_PACKAGE, TMM, "MaskedPredictionLoss (FLAVA: MLM, MIM, MMM)",
         "hidden_size=8, vocab_size=11 (masked tokens per sample differ); float64 layer norm "
         "(patched)", TmmFlavaMasked, inputs=masked_labels, fix=FLAVA_MASKED_MEAN,
         repro="flava_masked_mean.py", patch=FP32_FLOAT64, remark=FLOAT64_REMARK),
    Case(TMM_PACKAGE, TMM, "itm_loss (BLIP-2)",
         "a small QformerModel, float64 layer norm (patched); hardest negatives, not drawn",
         TmmBlip2Itm, inputs=text_tokens, patch=FP32_FLOAT64, remark=FLOAT64_REMARK),
    Case(TMM_PACKAGE, TMM, "itg_loss (BLIP-2)",
         "defaults (label smoothing 0.1; texts of 2 to 4 tokens, padded)", TmmBlip2Itg,
         inputs=text_tokens, fix=BLIP2_ITG_MEAN, repro="blip2_itg_mean.py"),
]  # fmt: skip
NOT_RUN: list[NotRun] = []
