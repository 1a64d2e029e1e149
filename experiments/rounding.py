"""Table and figure (docs/design.md §2, "Low precision"): how far CORRECT W-rank jobs depart from
one device by rounding alone, in each precision; the two constants of the low-precision judgement
measured on many jobs of the kinds users run: T (`gatherlab.core.floor.FLOOR_THRESHOLD`, the most
floors an exact run may score) and F (a departure beyond F · u, u the precision's unit roundoff,
is no rounding: judged departing without a floor).

For each job × precision × seed, the first update's gradient, all on real gloo ranks of the warm
pools (`gatherlab.ranks.pool`), one thread each:

- g₁: one device, the whole global batch, in the precision;
- g_split: one device, its model's forward in two contiguous row blocks, joined
  (`gatherlab.components.rowblocks.blocked`): the floor's perturbation;
- g_W: W ranks under ``torch.nn.parallel.DistributedDataParallel``, each its contiguous slice of
  the global batch (token sequences padded per rank to the rank's longest, as a tokenizer pads
  per batch), DDP's average; the same initial weights.

Recorded: departure = ‖g_W − g₁‖ / ‖g₁‖, floor = ‖g_split − g₁‖ / ‖g₁‖ (u where the row blocks
changed no bit), both also in units of u, and score = departure / floor; for the whole gradient
(part ``all``) and for each of the model's top-level children. The jobs are written here as
users write them (float32 by default, dropout 0 so that rounding is the only difference): MLPs
(classification and regression, ~10K, ~1M, ~10M parameters), a transformer encoder over padded
token sequences with a padding mask, mean pooling and a head (~1M, ~20M), NT-Xent over an
all-gathered batch (`gatherlab.gather.Fixed`) on an MLP and on the encoder, a
MultipleNegativesRankingLoss (sentence-transformers' in-batch negatives, scale 20) over gathered
positives, and BERT-base (`transformers.BertModel`, random weights, 110M) at W = 2. Precisions:
``32-true``, ``bf16-mixed`` and ``16-mixed`` (float32 parameters under ``torch.autocast`` on the
CPU; ``16-mixed`` with Lightning's initial loss scale 2¹⁶, unscaled after DDP's average),
``bf16-true`` (bf16 parameters); ``64-true`` for the jobs up to 10M parameters, as the check that
each job is correct (its W ranks equal one device to float64's rounding). For comparison, known
bugs on a few jobs: the old gather (`gatherlab.gather.get("old")`), local negatives (each rank's
contrastive loss over its own rows), the loss divided by W twice, and every rank reading rank
0's rows (no sampler). Writes ``figures/rounding.{csv,md,png,pdf}``.

Usage: ``python experiments/rounding.py [--quick] [--redraw] [--resume]`` (``--quick``: a
one-minute subset, its summary printed, nothing written; ``--redraw``: the table and the figure
again from ``figures/rounding.csv``, nothing measured; ``--resume``: the jobs that
``figures/rounding.csv`` already holds kept, the others measured; the CSV is written after each
job).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _sweep import FIGURES
from torch import nn

from gatherlab.analysis import figures
from gatherlab.components.rowblocks import blocked
from gatherlab.core import runfiles
from gatherlab.core.floor import FLOOR_THRESHOLD
from gatherlab.core.terms import Precision
from gatherlab.gather import Fixed, get
from gatherlab.ranks import pool
from gatherlab.runs.precision import FLOOR_ROW_BLOCKS, autocast, dtype

LOW_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
CHECK_PRECISION = "64-true"  # the jobs' own check: correct code equals one device in float64
FLOAT64_EXACT = 1e-13  # the most a correct job's W ranks may depart from one device in float64
LOSS_SCALE_16 = 2.0**16  # Lightning's (GradScaler's) initial loss scale for 16-mixed
F_MARGIN = 4.0  # F is at least this many times the largest departure / u measured
T_MARGIN = 2.0  # the margin asked of T over the largest score measured
CORRECT = "correct"
BUGS = ("old gather", "local negatives", "loss ÷ W twice", "same rows on every rank")
CONTRASTIVE = ("ntxent", "mnrl")
COLUMNS = ("job", "model", "loss", "parameters", "precision", "seed", "global_batch",
           "world_size", "case", "part", "departure", "floor", "departure_u", "floor_u",
           "score", "floor_least", "score_least", "bitwise_equal", "equals_split", "floor_w",
           "score_w", "equals_split_w", "loss_scale", "loss_scale_one")  # fmt: skip


@dataclass(frozen=True)
class Job:
    """One kind of job a user runs: its model (``mlp``, ``encoder``, ``bert``) with its sizes,
    its loss (``classify``, ``regress``, ``ntxent``, ``mnrl``), the global batches its seeds
    cycle through, how many seeds, the world sizes, the precisions, the bugs measured on its
    first ``bug_seeds`` seeds, and how token sequences are padded: ``per batch`` (to the longest
    of the rows a process reads, as a tokenizer pads each batch) or ``max_length`` (every
    sequence to the longest length the job draws)."""

    name: str
    model: str
    loss: str
    sizes: dict[str, Any]
    batches: tuple[int, ...] = (16, 32, 64)
    seeds: int = 5
    world_sizes: tuple[int, ...] = (2, 4, 8)
    precisions: tuple[str, ...] = (CHECK_PRECISION, *LOW_PRECISIONS)
    bugs: tuple[str, ...] = ()
    bug_seeds: int = 2
    padding: str = "per batch"

    def global_batch(self, seed: int) -> int:
        return self.batches[seed % len(self.batches)]


MLP_10K = {"inputs": 32, "hidden": (96, 64)}  # 10,026 parameters with 10 outputs
MLP_1M = {"inputs": 256, "hidden": (1024, 768)}  # 1.06M with 10 outputs
MLP_10M = {"inputs": 1024, "hidden": (2048, 2048, 2048)}  # 10.5M with 10 outputs
ENCODER_1M = {"vocab": 2000, "width": 128, "depth": 4, "heads": 4, "lengths": (8, 48)}
ENCODER_20M = {"vocab": 4000, "width": 512, "depth": 6, "heads": 8, "lengths": (8, 48)}
BERT_BASE = {"lengths": (8, 32)}
CONTRASTIVE_BUGS = BUGS
PLAIN_BUGS = ("loss ÷ W twice", "same rows on every rank")
NO_FLOAT64 = LOW_PRECISIONS

JOBS = (
    Job("mlp 10K classify", "mlp", "classify", {**MLP_10K, "outputs": 10}, seeds=20),
    Job("mlp 10K regress", "mlp", "regress", {**MLP_10K, "outputs": 4}, seeds=20),
    Job("mlp 1M classify", "mlp", "classify", {**MLP_1M, "outputs": 10}, seeds=10,
        bugs=PLAIN_BUGS),
    Job("mlp 1M regress", "mlp", "regress", {**MLP_1M, "outputs": 4}, seeds=10),
    Job("mlp 10M classify", "mlp", "classify", {**MLP_10M, "outputs": 10}),
    Job("mlp 1M ntxent", "mlp", "ntxent", {**MLP_1M, "outputs": 128}, seeds=10,
        bugs=CONTRASTIVE_BUGS),
    Job("encoder 1M classify", "encoder", "classify", {**ENCODER_1M, "outputs": 4}, seeds=10),
    Job("encoder 1M classify, max_length", "encoder", "classify",
        {**ENCODER_1M, "outputs": 4}, seeds=10, padding="max_length"),
    Job("encoder 1M ntxent", "encoder", "ntxent", {**ENCODER_1M, "outputs": 64}, seeds=10,
        bugs=CONTRASTIVE_BUGS),
    Job("encoder 1M mnrl", "encoder", "mnrl", {**ENCODER_1M, "outputs": 64}, seeds=10,
        bugs=("old gather", "local negatives", "loss ÷ W twice")),
    Job("encoder 20M classify", "encoder", "classify", {**ENCODER_20M, "outputs": 4},
        batches=(32, 16), seeds=4, precisions=NO_FLOAT64),
    Job("encoder 20M mnrl", "encoder", "mnrl", {**ENCODER_20M, "outputs": 256},
        batches=(16, 32), seeds=4, precisions=NO_FLOAT64),
    Job("bert-base classify", "bert", "classify", {**BERT_BASE, "outputs": 4}, batches=(16,),
        seeds=2, world_sizes=(2,), precisions=("32-true", "bf16-mixed")),
)  # fmt: skip

QUICK_JOBS = (
    Job("mlp 10K classify", "mlp", "classify", {**MLP_10K, "outputs": 10}, batches=(32,),
        seeds=2, world_sizes=(2, 4), precisions=(CHECK_PRECISION, "32-true", "bf16-mixed"),
        bugs=("same rows on every rank",), bug_seeds=1),
    Job("encoder 1M ntxent", "encoder", "ntxent", {**ENCODER_1M, "outputs": 64},
        batches=(16,), seeds=1, world_sizes=(2,), precisions=("32-true", "bf16-mixed"),
        bugs=("old gather",), bug_seeds=1),
)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The jobs, as a user writes them


def mlp(inputs: int, hidden: Sequence[int], outputs: int) -> nn.Sequential:
    """Linear layers with GELU between them."""
    layers: list[nn.Module] = []
    for width_in, width_out in zip((inputs, *hidden), hidden, strict=False):
        layers += [nn.Linear(width_in, width_out), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(hidden[-1], outputs))


class TextEncoder(nn.Module):
    """Token and position embeddings, a pre-norm transformer encoder that ignores padding (token
    0), a final norm, the mean over the real tokens, a linear head."""

    def __init__(self, vocab: int, width: int, depth: int, heads: int, outputs: int,
                 max_length: int = 64) -> None:  # fmt: skip
        super().__init__()
        self.tokens = nn.Embedding(vocab, width, padding_idx=0)
        self.positions = nn.Embedding(max_length, width)
        layer = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, activation="gelu", batch_first=True,
            norm_first=True,
        )  # fmt: skip
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, outputs)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        padding = tokens == 0
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        hidden = self.tokens(tokens) + self.positions(positions)
        hidden = self.norm(self.encoder(hidden, src_key_padding_mask=padding))
        real = (~padding).unsqueeze(-1).to(hidden.dtype)
        return self.head((hidden * real).sum(1) / real.sum(1))


class BertClassifier(nn.Module):
    """BERT-base with random weights (no dropout) and a linear head on its pooled output."""

    def __init__(self, outputs: int) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        config = BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        self.bert = BertModel(config)
        self.head = nn.Linear(config.hidden_size, outputs)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        output = self.bert(input_ids=tokens, attention_mask=(tokens != 0).long())
        return self.head(output.pooler_output)


def build_model(job: Job, seed: int, precision: str) -> nn.Module:
    """The job's model with the seed's initial weights, its parameters in the precision's
    dtype."""
    torch.manual_seed(seed)
    sizes = {k: v for k, v in job.sizes.items() if k != "lengths"}
    if job.model == "mlp":
        model: nn.Module = mlp(**sizes)
    elif job.model == "encoder":
        model = TextEncoder(**sizes)
    else:
        model = BertClassifier(sizes["outputs"])
    return model.to(dtype(precision))


def nt_xent(z0: torch.Tensor, z1: torch.Tensor, gather: Callable, rank: int,
            temperature: float = 0.5) -> torch.Tensor:  # fmt: skip
    """SimCLR's NT-Xent: each of the rank's 2n anchors against the 2N embeddings of every rank
    (its positive the other view of its row, itself excluded), the mean over the rank's
    anchors; DDP's average over the ranks makes it the mean over the global batch."""
    z0, z1 = F.normalize(z0, dim=1), F.normalize(z1, dim=1)
    every0, every1 = gather(z0), gather(z1)
    rows, total = len(z0), len(every0)
    own = torch.arange(rows) + (rank * rows if total > rows else 0)
    logits = torch.cat([z0, z1]) @ torch.cat([every0, every1]).T / temperature
    itself = torch.cat([own, own + total])
    excluded = torch.zeros_like(logits, dtype=torch.bool)
    excluded[torch.arange(2 * rows), itself] = True
    return F.cross_entropy(logits.masked_fill(excluded, -torch.inf), torch.cat([own + total, own]))


def multiple_negatives_ranking(anchors: torch.Tensor, positives: torch.Tensor, gather: Callable,
                               rank: int, scale: float = 20.0) -> torch.Tensor:  # fmt: skip
    """sentence-transformers' MultipleNegativesRankingLoss with gathered positives: the cosine
    similarity of each anchor to every positive, times ``scale``, cross-entropy against its
    own."""
    anchors, positives = F.normalize(anchors, dim=1), F.normalize(positives, dim=1)
    every = gather(positives)
    rows = len(anchors)
    own = torch.arange(rows) + (rank * rows if len(every) > rows else 0)
    return F.cross_entropy(anchors @ every.T * scale, own)


def job_loss(job: Job, forward: Callable, batch: dict[str, torch.Tensor], gather: Callable,
             rank: int) -> torch.Tensor:  # fmt: skip
    """The job's loss on the rank's rows of its batch: a mean over its rows."""
    if job.loss == "classify":
        return F.cross_entropy(forward(batch["inputs"]), batch["labels"])
    if job.loss == "regress":
        return F.mse_loss(forward(batch["inputs"]), batch["targets"].to(batch["inputs"].dtype))
    if job.loss == "ntxent":
        return nt_xent(forward(batch["view0"]), forward(batch["view1"]), gather, rank)
    return multiple_negatives_ranking(
        forward(batch["anchors"]), forward(batch["positives"]), gather, rank
    )


def _tokens(generator: torch.Generator, rows: int, vocab: int, lengths: tuple[int, int],
            padding: str) -> torch.Tensor:  # fmt: skip
    """Random sequences of random lengths, padded with 0 to the longest (``per batch``) or to
    the longest length drawn (``max_length``)."""
    length = torch.randint(lengths[0], lengths[1] + 1, (rows,), generator=generator)
    columns = lengths[1] if padding == "max_length" else int(length.max())
    tokens = torch.randint(1, vocab, (rows, columns), generator=generator)
    return tokens.masked_fill(torch.arange(tokens.shape[1]) >= length[:, None], 0)


def _replaced(generator: torch.Generator, tokens: torch.Tensor, vocab: int,
              share: float) -> torch.Tensor:  # fmt: skip
    """``tokens`` with a share of its real tokens replaced by random ones (an augmentation)."""
    chosen = (torch.rand(tokens.shape, generator=generator) < share) & (tokens != 0)
    return torch.where(chosen, torch.randint(1, vocab, tokens.shape, generator=generator), tokens)


def make_batch(job: Job, seed: int, rows: int) -> dict[str, torch.Tensor]:
    """The global batch of the job's seed, in float32 (and token ids)."""
    generator = torch.Generator().manual_seed(1000 + seed)
    outputs = job.sizes["outputs"]
    if job.model == "mlp":
        inputs = torch.randn(rows, job.sizes["inputs"], generator=generator)
        teacher = torch.randn(job.sizes["inputs"], outputs, generator=generator)
        if job.loss == "ntxent":
            noise = 0.5 * torch.randn(inputs.shape, generator=generator)
            return {"view0": inputs, "view1": inputs + noise}
        if job.loss == "regress":
            noise = 0.1 * torch.randn(rows, outputs, generator=generator)
            return {"inputs": inputs, "targets": torch.tanh(inputs @ teacher / 8) + noise}
        return {"inputs": inputs, "labels": (inputs @ teacher).argmax(1)}
    vocab = job.sizes.get("vocab", 30522)  # BERT's
    tokens = _tokens(generator, rows, vocab, job.sizes["lengths"], job.padding)
    if job.loss == "ntxent":
        return {"view0": _replaced(generator, tokens, vocab, 0.15),
                "view1": _replaced(generator, tokens, vocab, 0.15)}  # fmt: skip
    if job.loss == "mnrl":
        positives = _tokens(generator, rows, vocab, job.sizes["lengths"], job.padding)
        return {"anchors": tokens, "positives": positives}
    return {"inputs": tokens, "labels": torch.randint(0, outputs, (rows,), generator=generator)}


def _rows_of(job: Job, batch: dict[str, torch.Tensor], rows: slice, precision: str
             ) -> dict[str, torch.Tensor]:  # fmt: skip
    """The rows of the batch a process reads: floating inputs in the precision's dtype, token
    sequences padded as the job pads them (``per batch``: to the longest of these rows)."""
    mine = {}
    for key, value in batch.items():
        value = value[rows]
        if value.is_floating_point():
            value = value.to(dtype(precision))
        elif value.dim() == 2 and job.padding == "per batch":  # token ids
            value = value[:, : int((value != 0).sum(1).max())]
        mine[key] = value
    return mine


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


Gradient = tuple[dict[str, torch.Tensor], float]
"""A first gradient by parameter name, and the loss scale it was computed with (1 but in
``16-mixed``)."""


def gradient(job: Job, precision: str, seed: int, batch: dict[str, torch.Tensor],
             distributed: bool, row_blocks: int = 1, case: str = CORRECT) -> Gradient:  # fmt: skip
    """The first update's gradient of the job, by parameter name: on one device (the whole
    batch, its forward in ``row_blocks`` row blocks), or on this rank of the process group under
    DDP (its contiguous slice, DDP's average), with the bug ``case`` if it is one. In
    ``16-mixed`` as GradScaler computes it: the loss times 2¹⁶, the gradient divided by it after
    DDP's average, and where that overflows (an inf or NaN on every rank after the average) the
    step skipped and the scale halved until it does not."""
    scale = LOSS_SCALE_16 if precision == "16-mixed" else 1.0
    while True:
        found = _scaled_gradient(job, precision, seed, batch, distributed, row_blocks, case, scale)
        if scale == 1.0 or all(bool(torch.isfinite(g).all()) for g in found.values()):
            return found, scale
        scale /= 2


def _scaled_gradient(job: Job, precision: str, seed: int, batch: dict[str, torch.Tensor],
                     distributed: bool, row_blocks: int, case: str, scale: float
                     ) -> dict[str, torch.Tensor]:  # fmt: skip
    """`gradient` with the loss times ``scale``, the gradient divided by it."""
    rank, size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    total = len(next(iter(batch.values())))
    reader = 0 if case == "same rows on every rank" else rank
    rows = slice(reader * total // size, (reader + 1) * total // size)
    mine = _rows_of(job, batch, rows, precision)
    model = build_model(job, seed, precision)
    network = nn.parallel.DistributedDataParallel(model) if distributed else model

    def forward(inputs: torch.Tensor) -> torch.Tensor:
        return blocked(network, row_blocks, inputs) if row_blocks > 1 else network(inputs)

    gather: Callable = _identity  # one device: every gather is the identity
    if distributed:
        gather = {"old gather": get("old"), "local negatives": _identity}.get(case, Fixed())
    with autocast(precision):
        loss = job_loss(job, forward, mine, gather, rank)
    if case == "loss ÷ W twice":
        loss = loss / size  # DDP averages over the ranks once more
    (loss * scale).backward()
    return {name: (p.grad.detach() if p.grad is not None else torch.zeros_like(p)) / scale
            for name, p in model.named_parameters()}  # fmt: skip


def one_device_on_ranks(job: Job, precision: str, seed: int, batch: dict[str, torch.Tensor],
                        blocks: Sequence[int]) -> dict[int, Gradient]:  # fmt: skip
    """On a pool of two ranks, no collective: the one-device gradient with its forward in each
    number of row blocks of ``blocks`` (1: g₁), rank r computing every other one from the r-th,
    each on one core as the W ranks compute theirs."""
    mine = blocks[dist.get_rank() :: dist.get_world_size()]
    return {b: gradient(job, precision, seed, batch, False, row_blocks=b) for b in mine}


def distributed_on_ranks(
    job: Job, precision: str, seed: int, batch: dict[str, torch.Tensor], cases: Sequence[str]
) -> dict[str, Gradient] | None:
    """On every rank of the pool: the DDP gradient of each case; rank 0's returned (after DDP's
    average every rank holds the same)."""
    found = {case: gradient(job, precision, seed, batch, True, case=case) for case in cases}
    return found if dist.get_rank() == 0 else None


# ---------------------------------------------------------------------------------------------
# The measurement


def _squares(gradients: dict[str, torch.Tensor], names: Sequence[str],
             reference: dict[str, torch.Tensor] | None = None) -> float:  # fmt: skip
    """Σ ‖g − reference‖² (‖g‖² without one) over the named parameters, in float64."""
    total = 0.0
    for name in names:
        value = gradients[name].double()
        if reference is not None:
            value = value - reference[name].double()
        total += float(value.square().sum())
    return total


def _relative(gradients: dict, reference: dict, names: Sequence[str]) -> float:
    norm = _squares(reference, names)
    return math.sqrt(_squares(gradients, names, reference) / norm) if norm > 0 else math.nan


def _finite(*gradients: dict[str, torch.Tensor], what: str) -> None:
    """Raise where a gradient holds an inf or a NaN (a loss scale that overflowed would make
    the step one that GradScaler skips, not a gradient to compare)."""
    for found in gradients:
        if not all(bool(torch.isfinite(g).all()) for g in found.values()):
            raise FloatingPointError(f"{what}: a gradient that is not finite")


def parts_of(names: Sequence[str]) -> dict[str, list[str]]:
    """The whole gradient (``all``) and each top-level child of the model, by parameter name."""
    parts: dict[str, list[str]] = {"all": list(names)}
    for name in names:
        parts.setdefault(name.split(".")[0], []).append(name)
    return parts


def measure(job: Job, precision: str, seed: int, world_sizes: Sequence[int] | None = None,
            cases: Sequence[str] = (CORRECT,)) -> list[dict[str, Any]]:  # fmt: skip
    """The rows of the table for one job, precision and seed: for each W and case, each part's
    departure of g_W from g₁, its floor (g_split's departure; u where it is 0), both in units
    of u, and the score departure / floor; the floor at least the whole gradient's and the
    score in it (``floor_least``, ``score_least``: the same as the others for ``all``); the
    floor of one device in as many row blocks as the run has ranks and the score in it
    (``floor_w``, ``score_w``: a candidate floor that cuts the rows as the ranks do); whether
    g_W equals g₁, g_split and the W-block g_split bit for bit; the loss scales of g_W and g₁
    (16-mixed)."""
    global_batch = job.global_batch(seed)
    batch = make_batch(job, seed, global_batch)
    sizes = tuple(world_sizes or job.world_sizes)
    blocks = list(dict.fromkeys((1, FLOOR_ROW_BLOCKS, *sizes)))
    one_device = {}
    for found in pool.pool(2).run(one_device_on_ranks, job, precision, seed, batch, blocks):
        one_device |= found
    (one, one_scale), (split, _) = one_device[1], one_device[FLOOR_ROW_BLOCKS]
    _finite(*(g for g, _ in one_device.values()), what=f"{job.name}, {precision}, seed {seed}")
    unit = Precision(precision).unit_roundoff
    parts = parts_of(list(one))

    def floors_of(perturbed: dict[str, torch.Tensor]) -> dict[str, float]:
        found = {part: _relative(perturbed, one, names) for part, names in parts.items()}
        return {part: value if value > 0 else unit for part, value in found.items()}

    floors = floors_of(split)
    parameters = sum(g.numel() for g in one.values())
    rows = []
    for world_size in sizes:
        split_w = one_device[world_size][0]
        floors_w = floors_of(split_w)
        ranks = pool.pool(world_size)
        found = ranks.run(distributed_on_ranks, job, precision, seed, batch, cases)[0]
        for case, (gradients, scale) in found.items():
            _finite(gradients, what=f"{job.name}, {precision}, seed {seed}: W = {world_size}")
            equal = all(torch.equal(gradients[n], one[n]) for n in one)
            as_split = all(torch.equal(gradients[n], split[n]) for n in one)
            as_split_w = all(torch.equal(gradients[n], split_w[n]) for n in one)
            for part, names in parts.items():
                departure = _relative(gradients, one, names)
                least = max(floors[part], floors["all"])
                rows.append({
                    "job": job.name, "model": job.model, "loss": job.loss,
                    "parameters": parameters, "precision": precision, "seed": seed,
                    "global_batch": global_batch, "world_size": world_size, "case": case,
                    "part": part, "departure": departure, "floor": floors[part],
                    "departure_u": departure / unit, "floor_u": floors[part] / unit,
                    "score": departure / floors[part], "floor_least": least,
                    "score_least": departure / least, "bitwise_equal": equal,
                    "equals_split": as_split, "floor_w": floors_w[part],
                    "score_w": departure / floors_w[part], "equals_split_w": as_split_w,
                    "loss_scale": scale, "loss_scale_one": one_scale,
                })  # fmt: skip
    return rows


def run(jobs: Sequence[Job], done: pd.DataFrame | None = None,
        save: Callable[[pd.DataFrame], None] | None = None) -> pd.DataFrame:  # fmt: skip
    """Every job × precision × seed, with progress and the time each job took; the jobs that
    ``done`` holds are kept, not measured again. ``save`` is given the table after each job.
    The pools are closed after each job: a rank keeps the memory of the largest model it held,
    and three pools' ranks of the 10M-parameter jobs together outgrow this machine's memory."""
    start = time.perf_counter()
    table = done if done is not None else pd.DataFrame(columns=list(COLUMNS))
    for number, job in enumerate(jobs, 1):
        if job.name in set(table["job"]):
            print(f"[{number}/{len(jobs)}] {job.name}: kept from the table", flush=True)
            continue
        began, rows = time.perf_counter(), []
        for precision in job.precisions:
            for seed in range(job.seeds):
                bugs = job.bugs if seed < job.bug_seeds and precision != CHECK_PRECISION else ()
                rows += measure(job, precision, seed, cases=(CORRECT, *bugs))
        pool.close_pools()
        measured = pd.DataFrame(rows, columns=list(COLUMNS))
        table = measured if not len(table) else pd.concat([table, measured], ignore_index=True)
        if save is not None:
            save(table)
        print(f"[{number}/{len(jobs)}] {job.name}: {time.perf_counter() - began:.0f} s "
              f"(total {time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
    return table


# ---------------------------------------------------------------------------------------------
# The summary and the figure


def nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 5 × 10^k at least ``value``."""
    power = 10.0 ** math.floor(math.log10(value))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= value * (1 - 1e-12))


# Where T is tested: the whole gradient, and the parts with either floor a part may be given;
# and both with the candidate floor of as many row blocks as the run has ranks.
SCOPES = {"whole gradient": ("all", "score"), "parts, own floor": ("parts", "score"),
          "parts, floor ≥ whole's": ("parts", "score_least"),
          "whole gradient, W-block floor": ("all", "score_w"),
          "parts, own W-block floor": ("parts", "score_w"),
          "parts, W-block floor ≥ whole's": ("parts", "score_w_least")}  # fmt: skip
RUN = ["job", "precision", "seed", "world_size", "case"]  # one W-rank run's rows


def with_derived(table: pd.DataFrame) -> pd.DataFrame:
    """The table with ``score_w_least``: each part's departure in its W-block floor, at least
    the whole gradient's W-block floor of the same run (``score_w`` for ``all``)."""
    whole = table.loc[table["part"] == "all", [*RUN, "floor_w"]]
    merged = table.merge(whole.rename(columns={"floor_w": "floor_w_all"}), on=RUN, how="left")
    least = np.maximum(merged["floor_w"], merged["floor_w_all"])
    return table.assign(score_w_least=(merged["departure"] / least).to_numpy())


def _scope(rows: pd.DataFrame, scope: str) -> pd.Series:
    """The scores of ``rows`` in ``scope`` (`SCOPES`)."""
    part, column = SCOPES[scope]
    chosen = rows["part"] == "all" if part == "all" else rows["part"] != "all"
    return rows.loc[chosen, column]


@dataclass(frozen=True)
class Constants:
    """F and T from the correct runs in the low precisions: the largest departure / u (whole
    gradient and parts) and F (1, 2 or 5 × 10^k, at least `F_MARGIN` × it), one for every
    precision; per precision F_p from that precision's runs alone (``factor_of``: whole
    gradients and parts; ``factor_whole_of``: whole gradients only); per scope of `SCOPES` the
    largest score, T's margin over it, and the T that would leave `T_MARGIN` (T itself where
    it does)."""

    largest_departure_u: float
    factor: float
    factor_of: dict[str, float]
    factor_whole_of: dict[str, float]
    largest_score: dict[str, float]
    threshold_margin: dict[str, float]
    threshold_needed: dict[str, float]


def constants(table: pd.DataFrame) -> Constants:
    correct = with_derived(table)
    correct = correct[(correct["case"] == CORRECT) & correct["precision"].isin(LOW_PRECISIONS)]
    whole = correct[correct["part"] == "all"]
    largest_departure = correct["departure_u"].max()

    def factors(rows: pd.DataFrame) -> dict[str, float]:
        largest = rows.groupby("precision", sort=False)["departure_u"].max()
        return {p: nice_ceiling(F_MARGIN * value) for p, value in largest.items()}

    largest = {scope: float(_scope(correct, scope).max()) for scope in SCOPES}
    margin = {scope: FLOOR_THRESHOLD / score for scope, score in largest.items()}
    needed = {scope: FLOOR_THRESHOLD if margin[scope] >= T_MARGIN
              else nice_ceiling(T_MARGIN * score) for scope, score in largest.items()}  # fmt: skip
    return Constants(largest_departure, nice_ceiling(F_MARGIN * largest_departure),
                     factors(correct), factors(whole), largest, margin, needed)  # fmt: skip


def summary(table: pd.DataFrame) -> str:
    """The Markdown of figures/rounding.md: per precision the correct runs' maximum and 99th
    percentile of departure / u, floor / u and score, for whole gradients and for parts; F and
    F_p and the relative departures they stand for; the verdict on T in each scope; the float64
    check; and each known bug's least departure / u and score against them."""
    found = constants(table)
    table = with_derived(table)
    correct = table[table["case"] == CORRECT]
    low = correct[correct["precision"].isin(LOW_PRECISIONS)]
    whole_rows, part_rows, factor_rows = [], [], []
    for precision, rows in low.groupby("precision", sort=False):
        whole, parts = rows[rows["part"] == "all"], rows[rows["part"] != "all"]
        unit = _unit(precision)
        whole_rows.append([precision, f"{unit:.2g}", str(len(whole)), *_max_p99(
            whole, ("departure_u", "floor_u", "score", "score_w"))])  # fmt: skip
        part_rows.append([precision, str(len(parts)), *_max_p99(
            parts, ("departure_u", "score", "score_least", "score_w_least"))])  # fmt: skip
        factor_rows.append([
            precision, f"{unit:.2g}", f"{found.factor_whole_of[precision]:g}",
            f"{found.factor_whole_of[precision] * unit:.2g}", f"{found.factor_of[precision]:g}",
            f"{found.factor_of[precision] * unit:.2g}", f"{found.factor * unit:.2g}",
        ])  # fmt: skip
    verdicts = []
    for scope in SCOPES:
        largest, margin = found.largest_score[scope], found.threshold_margin[scope]
        verdict = (f"holds with a margin of {margin:.2g}× (≥ {T_MARGIN:g}×)" if margin >= T_MARGIN
                   else f"leaves a margin of {margin:.2g}× (< {T_MARGIN:g}×); T = "
                   f"{found.threshold_needed[scope]:g} would leave {T_MARGIN:g}×")  # fmt: skip
        verdicts.append(f"- {scope}: largest score {largest:.3g}, T = {FLOOR_THRESHOLD:g} "
                        f"{verdict}")  # fmt: skip
    checked = correct[(correct["precision"] == CHECK_PRECISION) & (correct["part"] == "all")]
    whole_header = [f"{name}: {stat}" for name in ("departure/u", "floor/u", "score",
                    "score in the W-block floor") for stat in ("max", "p99")]  # fmt: skip
    part_header = [f"{name}: {stat}" for name in ("departure/u", "score (own floor)",
                   "score (floor ≥ whole's)", "score (W-block floor ≥ whole's)")
                   for stat in ("max", "p99")]  # fmt: skip
    factor_header = ["precision", "u", "F_p (whole)", "F_p · u (whole)", "F_p (with parts)",
                     "F_p · u (with parts)", f"F · u (F = {found.factor:g})"]  # fmt: skip
    text = [
        f"Correct jobs: the first update's gradient on W ranks (DDP) against one device in the "
        f"same precision; {correct['job'].nunique()} jobs, "
        f"{int((low['part'] == 'all').sum())} runs of W ranks in the low precisions (and "
        f"{len(checked)} in float64, the check that the jobs are correct). departure = "
        f"‖g_W − g₁‖/‖g₁‖; floor = ‖g_split − g₁‖/‖g₁‖, one device with its forward in "
        f"{FLOOR_ROW_BLOCKS} row blocks (u where that changed no bit); the W-block floor the "
        "same with as many row blocks as the run has ranks; u the precision's unit roundoff; "
        "score = departure/floor. Maximum and 99th percentile over the runs.",
        "",
        "Whole gradient:",
        "",
        runfiles.markdown_table(["precision", "u", "runs", *whole_header], whole_rows),
        "",
        "Parts (the model's top-level children), the score with the part's own floor, with its "
        "floor at least the whole gradient's, and with its W-block floor at least the whole's:",
        "",
        runfiles.markdown_table(["precision", "part runs", *part_header], part_rows),
        "",
        f"**F** (at least {F_MARGIN:g}× the largest departure/u of a correct run, rounded up to "
        f"1, 2 or 5 × 10^k): one F for every precision, from the largest departure/u of all, "
        f"{found.largest_departure_u:.3g}, is F = {found.factor:g}; F_p from each precision's "
        "runs alone, whole gradients only and with the parts:",
        "",
        runfiles.markdown_table(factor_header, factor_rows),
        "",
        f"**T** = {FLOOR_THRESHOLD:g} (margin asked: {T_MARGIN:g}×):",
        *verdicts,
    ]
    if len(checked):
        largest = checked["departure"].max()
        text += ["", f"float64 check: the correct jobs' largest departure is {largest:.2g} "
                 f"({'≤' if largest <= FLOAT64_EXACT else '>'} {FLOAT64_EXACT:g})."]  # fmt: skip
    text += ["", _bug_table(table, found)]
    return "\n".join(text) + "\n"


def _max_p99(rows: pd.DataFrame, columns: Sequence[str]) -> list[str]:
    """The maximum and the 99th percentile of each column."""
    return [f"{f(rows[c]):.3g}" for c in columns for f in (np.max, _p99)]


def _unit(precision: str) -> float:
    return Precision(precision).unit_roundoff


def _p99(values: pd.Series) -> float:
    return float(np.percentile(values, 99))


def _bug_table(table: pd.DataFrame, found: Constants) -> str:
    """Each known bug's least departure / u and scores (whole gradient) per precision, and how
    many of its runs exceed F · u, F_p · u (whole gradients) and T (in either floor)."""
    bugs = table[(table["case"] != CORRECT) & (table["part"] == "all")]
    if not len(bugs):
        return ""
    body = []
    for (case, precision), rows in bugs.groupby(["case", "precision"], sort=False):

        def above(column: str, level: float, rows: pd.DataFrame = rows) -> str:
            return f"{int((rows[column] > level).sum())}/{len(rows)}"

        body.append([
            case, precision, ", ".join(sorted(rows["job"].unique())),
            f"{rows['departure'].min():.2g}", f"{rows['departure_u'].min():.3g}",
            above("departure_u", found.factor),
            above("departure_u", found.factor_whole_of[precision]),
            f"{rows['score'].min():.3g}", above("score", FLOOR_THRESHOLD),
            f"{rows['score_w'].min():.3g}", above("score_w", FLOOR_THRESHOLD),
        ])  # fmt: skip
    header = ["known bug", "precision", "jobs", "departure: least", "departure/u: least",
              "runs > F · u", "runs > F_p · u (whole)", "score: least",
              f"runs > T = {FLOOR_THRESHOLD:g}", "W-block score: least",
              "runs > T (W-block)"]  # fmt: skip
    return ("Known bugs, for comparison (whole gradient, W = " + ", ".join(
        map(str, sorted(bugs["world_size"].unique()))) + "):\n\n"
        + runfiles.markdown_table(header, body))  # fmt: skip


PRECISION_COLORS = {"32-true": "#1f77b4", "bf16-mixed": "#d62728", "16-mixed": "#2ca02c",
                    "bf16-true": "#9467bd"}  # fmt: skip


def figure(table: pd.DataFrame) -> plt.Figure:
    """Four panels over the jobs, log scales, one colour per precision, the correct runs'
    whole gradient as dots and their parts as small rings, the known bugs (whole gradient) as
    crosses: departure / u with F (black) and each precision's F_p (its colour, dotted); the
    score with T, the parts' floor at least the whole's; the same in the W-block floor; the
    parts' score with their own floor."""
    found = constants(table)
    table = with_derived(table)
    table = table[table["precision"].isin(LOW_PRECISIONS)]
    jobs = list(dict.fromkeys(table["job"]))
    precisions = [p for p in LOW_PRECISIONS if p in set(table["precision"])]
    whole, parts = table["part"] == "all", table["part"] != "all"
    correct = table["case"] == CORRECT
    panels = (
        ("departure_u", found.factor, f"F = {found.factor:g}", "‖g_W − g₁‖ / ‖g₁‖\nin units of u",
         {"whole": whole & correct, "parts": parts & correct, "bugs": whole & ~correct}),
        ("score_least", FLOOR_THRESHOLD, f"T = {FLOOR_THRESHOLD:g}",
         "score (2-block floor;\na part's ≥ the whole's)",
         {"whole": whole & correct, "parts": parts & correct, "bugs": whole & ~correct}),
        ("score_w_least", FLOOR_THRESHOLD, f"T = {FLOOR_THRESHOLD:g}",
         "score (W-block floor;\na part's ≥ the whole's)",
         {"whole": whole & correct, "parts": parts & correct, "bugs": whole & ~correct}),
        ("score", FLOOR_THRESHOLD, f"T = {FLOOR_THRESHOLD:g}", "parts' score\n(own 2-block floor)",
         {"parts": parts & correct}),
    )  # fmt: skip
    marks = {"whole": {"marker": "o", "s": 14}, "bugs": {"marker": "x", "s": 22},
             "parts": {"marker": "o", "s": 10, "facecolors": "none", "alpha": 0.45}}  # fmt: skip
    generator = np.random.default_rng(0)
    with plt.rc_context(figures.STYLE):
        shown, axes = plt.subplots(len(panels), 1, figsize=(11, 12.5), sharex=True,
                                   layout="constrained")  # fmt: skip
        for axis, (column, level, label, ylabel, groups) in zip(axes, panels, strict=True):
            for offset, precision in enumerate(precisions):
                color = PRECISION_COLORS[precision]
                for group, chosen in groups.items():
                    rows = table[chosen & (table["precision"] == precision)]
                    x = (rows["job"].map(jobs.index).to_numpy(float) + (offset - 1.5) * 0.18
                         + generator.uniform(-0.05, 0.05, len(rows)))  # fmt: skip
                    y = np.maximum(rows[column].to_numpy(float), figures.ZERO_FLOOR)
                    style = {"alpha": 0.7, **marks[group]}
                    if style.get("facecolors") == "none":
                        style["edgecolors"] = color
                    else:
                        style["color"] = color
                    axis.scatter(x, y, linewidths=1, label=f"{precision}: {group}", **style)
                if column == "departure_u":
                    axis.axhline(found.factor_whole_of[precision], color=color, linestyle=":",
                                 linewidth=1.2)  # fmt: skip
            axis.axhline(level, **{**figures.REFERENCE_STYLE, "linewidth": 1.4})
            axis.text(-0.45, level * 1.4, label, fontsize=8)
            axis.set_yscale("log")
            axis.set_ylabel(ylabel)
        for axis in axes:
            axis.set_ylim(bottom=1e-2)
        axes[-1].set_xticks(range(len(jobs)), jobs, rotation=30, ha="right")
        axes[-1].set_xlabel("job (model, loss); W = 2, 4, 8 and seeds jittered")
        handles, labels = axes[0].get_legend_handles_labels()
        shown.legend(handles, labels, loc="outside right center", fontsize=8)
        shown.suptitle(
            "Correct W-rank jobs against one device in the same precision (first gradient), "
            "and known bugs; dotted: each precision's F_p (whole gradients)", fontsize=10,
        )  # fmt: skip
    return shown


def publish(table: pd.DataFrame) -> None:
    """figures/rounding.{md,png,pdf} from the table, the summary printed."""
    figures.save(figure(table), FIGURES / "rounding")
    (FIGURES / "rounding.md").write_text(summary(table))
    print((FIGURES / "rounding.md").read_text())


def main() -> None:
    arguments = sys.argv[1:]
    if "--redraw" in arguments:
        publish(pd.read_csv(FIGURES / "rounding.csv"))
        return
    start = time.perf_counter()
    if "--quick" in arguments:
        print(summary(run(QUICK_JOBS)))
    else:
        csv = FIGURES / "rounding.csv"
        done = pd.read_csv(csv) if "--resume" in arguments and csv.exists() else None
        publish(run(JOBS, done, lambda t: t.to_csv(csv, index=False, float_format="%.6g")))
    print(f"wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    # The ranks import the rank functions by module name: run them from ``rounding``, not from
    # ``__main__`` (a rank's ``__main__`` is its pool's worker).
    import rounding

    rounding.main()
