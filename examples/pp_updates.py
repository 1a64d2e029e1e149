"""A small causal language model that splits itself into pipeline stages with
``torch.distributed.pipelining``, and whole updates that run its schedule, for the check of a whole
update with ``--pipeline-parallel P`` (docs/checking.md §10, "Pipeline parallelism"). No gatherlab
imports: written as a user writes it, after torchtitan's way of splitting a model.

``build(mesh=None, ...)`` is the model factory. On one device (``mesh`` None) it returns the whole
model. Given the ranks' ``(dp, pp)`` mesh it builds the whole model (after the same seed on every
rank), cuts it into ``P × stages_per_rank`` stages of consecutive layers (the embedding on the
first, the final norm and the head on the last) and keeps only this rank's stages' modules, under
the whole model's names; each stage is a `Stage` over those modules, given to a ``PipelineStage``
over ``mesh["pp"]``, kept on the model as ``model.stages`` (a list: no module of the model's own).
``model.schedule_class`` is the schedule the update builds with its micro-batches: ``gpipe``
(``ScheduleGPipe``), ``1f1b`` (``Schedule1F1B``), or with several stages per rank (loop style)
``interleaved`` (``ScheduleInterleaved1F1B``), ``looped_bfs`` (``ScheduleLoopedBFS``) or
``zero_bubble`` (``ScheduleInterleavedZeroBubble``). The head is tied to the embedding
(``tied=True``): one parameter on one device, a copy on each of the first and the last stage.

The updates (each ``update(model, optimizer, batch, micro_batches)``, one optimizer step):

- ``mean_update``: each micro-batch's mean token loss with the schedule's default
  ``scale_grads=True`` (each gradient ÷ M); the tied copies' gradients summed over ``pp``, the
  replicas' averaged over ``dp``; it logs the mean of the micro-batches' losses: exact where the
  micro-batches hold as many tokens each (``ragged=False`` data);
- ``unscaled_update``: the same with ``scale_grads=False``: every gradient M times one device's;
- ``token_sum_update``: the sum over a micro-batch's tokens ÷ the global count of tokens (all
  ranks' rows), ``scale_grads=False``, replicas summed over ``dp``: exact with ragged padding too;
  it logs the sum of its micro-batches' losses (one device's loss);
- ``token_sum_scaled_update``: the same under the schedule's default ``scale_grads=True``, which
  divides by M once more: every gradient 1/M of one device's;
- ``token_sum_mean_logged_update``: the same as ``token_sum_update``, logging the mean of the
  micro-batches' losses: a correct run whose logged loss is 1/M of one device's;
- ``unreplicated_update``: ``mean_update`` without averaging the replicas' gradients over
  ``dp``: each data-parallel pipeline steps with its own rows' gradient;
- ``untied_update``: ``mean_update`` without summing the tied copies' gradients: the embedding
  and the head step with their own stage's part of one device's gradient and drift apart.

``Tokens(ragged=...)`` is the data: sequences of token ids and their next tokens, the targets
past each row's length padded with ``IGNORE`` (``ignore_index``) when ``ragged``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

VOCAB, FEATURES, LENGTH, IGNORE = 13, 8, 6, -100


class Block(nn.Module):
    """A pre-norm residual block that mixes each position with the mean of those before it
    (causal: position t sees positions ≤ t) and transforms it."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(FEATURES)
        self.mix = nn.Linear(FEATURES, FEATURES)
        self.out = nn.Linear(FEATURES, FEATURES)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        positions = torch.arange(1, x.shape[1] + 1, dtype=x.dtype, device=x.device)
        causal_mean = x.cumsum(dim=1) / positions[:, None]
        return h + self.out(torch.tanh(self.mix(causal_mean)))


class CausalLM(nn.Module):
    """Embedding, ``layers`` blocks (a ``ModuleDict`` keyed by index, so that a stage that keeps
    some keeps their names), final norm and head; the head tied to the embedding with ``tied``."""

    def __init__(self, layers: int = 4, tied: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, FEATURES)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(layers)})
        self.norm = nn.LayerNorm(FEATURES)
        self.head = nn.Linear(FEATURES, VOCAB, bias=False)
        self.tied = tied
        if tied:
            self.head.weight = self.emb.weight
        self.stages: list | None = None  # on a rank of a pipeline: its PipelineStages
        self.schedule_class: type | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.head(self.norm(h))


class Stage(nn.Module):
    """One pipeline stage: the modules of its consecutive layers, with the embedding on the first
    and the norm and head on the last (the model's own modules: their parameters are the
    model's)."""

    def __init__(self, model: CausalLM, layers: list[str], first: bool, last: bool) -> None:
        super().__init__()
        self.emb = model.emb if first else None
        self.layers = nn.ModuleList(model.layers[key] for key in layers)
        self.norm, self.head = (model.norm, model.head) if last else (None, None)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.emb is not None:
            h = self.emb(h)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h)) if self.head is not None else h


SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
             "interleaved": "ScheduleInterleaved1F1B", "looped_bfs": "ScheduleLoopedBFS",
             "zero_bubble": "ScheduleInterleavedZeroBubble"}  # fmt: skip


def build(
    mesh=None, layers: int = 4, tied: bool = True, schedule: str = "gpipe",
    stages_per_rank: int = 1, keep: str = "", traced_rows: int = 0,
):  # fmt: skip
    """The whole model on one device; on a rank of ``mesh`` its stages (see the module).
    ``traced_rows``: the stages cut by torch's tracing front end instead, ``pipeline()`` on a
    micro-batch of that many rows (in float64: the stages' buffers take the traced dtype), and
    ``build_stage``: the rank's stage module keeps the whole model's names (`traced`).
    ``keep``: ``"nothing"`` keeps no module on the last rank (a split that leaves it empty);
    ``"renamed"`` returns the rank's model inside a wrapper (its names ``module.…``, as DDP's
    are), not under one device's names."""
    model = CausalLM(layers, tied)
    if mesh is None:
        return model
    from torch.distributed import pipelining

    if traced_rows:
        return traced(model, mesh, traced_rows, schedule)
    pp = mesh["pp"]
    ranks, rank = pp.size(), pp.get_local_rank()
    total = ranks * stages_per_rank
    cut = [len(model.layers) * s // total for s in range(total + 1)]
    mine = list(range(rank, total, ranks))  # loop style: stage s on rank s % P
    stages = [Stage(model, [str(i) for i in range(cut[s], cut[s + 1])], s == 0, s == total - 1)
              for s in mine]  # fmt: skip
    kept = {name for stage in stages for name, _ in stage.named_modules()}
    if keep == "nothing" and rank == ranks - 1:
        stages, mine, kept = [], [], set()
    _keep_only(model, {id(m) for stage in stages for m in stage.modules()} if kept else set())
    model.stages = [
        pipelining.PipelineStage(stage, s, total, torch.device("cpu"), group=pp.get_group())
        for stage, s in zip(stages, mine, strict=True)
    ]
    model.schedule_class = getattr(pipelining, SCHEDULES[schedule])
    model.mesh = mesh
    if keep == "renamed":
        wrapper = nn.Module()
        wrapper.module = model
        return wrapper
    return model


def traced(model: CausalLM, mesh, rows: int, schedule: str = "gpipe") -> nn.Module:
    """This rank's stage as ``pipeline()`` cuts the model (one stage a rank, at the layers'
    boundaries) and ``build_stage`` builds it: a ``GraphModule`` whose parameters keep the whole
    model's names. ``pipeline()`` leaves a copy of the tied head's weight on the first stage, which
    its graph does not use."""
    from torch.distributed import pipelining

    pp = mesh["pp"]
    ranks, rank = pp.size(), pp.get_local_rank()
    cut = {f"layers.{len(model.layers) * s // ranks}": pipelining.SplitPoint.BEGINNING
           for s in range(1, ranks)}  # fmt: skip
    example = torch.zeros(rows, LENGTH, dtype=torch.long)
    pipe = pipelining.pipeline(model.double(), mb_args=(example,), split_spec=cut)
    stage = pipe.get_stage_module(rank)
    stage.stages = [pipe.build_stage(rank, torch.device("cpu"), group=pp.get_group())]
    stage.schedule_class = getattr(pipelining, SCHEDULES[schedule])
    stage.mesh, stage.tied = mesh, model.tied
    return stage


def _keep_only(model: CausalLM, kept: set[int]) -> None:
    """The model without the modules no stage of this rank holds (torchtitan's way: the names of
    those it keeps stay the whole model's)."""
    for name in ("emb", "norm", "head"):
        if id(getattr(model, name)) not in kept:
            setattr(model, name, None)
    for key in list(model.layers):
        if id(model.layers[key]) not in kept:
            del model.layers[key]


def mean_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean over the micro-batch's tokens that are not padding."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


def _sum_tied(model: CausalLM) -> None:
    """The tied embedding's and head's gradients summed over the pipeline's ranks: each copy then
    holds one device's gradient (a rank without a copy adds zeros)."""
    first = getattr(model, "emb", None)  # a traced stage holds no attribute it does not use
    copy = first if first is not None else getattr(model, "head", None)
    grad = copy.weight.grad if copy is not None else None
    summed = grad if grad is not None else torch.zeros(VOCAB, FEATURES, dtype=torch.float64)
    dist.all_reduce(summed, group=model.mesh["pp"].get_group())
    if grad is not None:
        copy.weight.grad = summed


def _reduce_replicas(model: CausalLM, op: str) -> None:
    """Every gradient averaged (``avg``) or summed (``sum``) over the data-parallel replicas."""
    dp = model.mesh["dp"]
    if dp.size() == 1:
        return
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=dp.get_group())
            if op == "avg":
                p.grad /= dp.size()


def _run(model, batch, micro_batches, loss_fn, scale_grads):
    """One schedule step on this rank's stages: each micro-batch's forward and backward; the
    micro-batches' losses on the rank of the last stage (an empty list elsewhere)."""
    tokens, targets = batch
    schedule = model.schedule_class(
        model.stages if len(model.stages) > 1 else model.stages[0],
        n_microbatches=micro_batches, loss_fn=loss_fn, scale_grads=scale_grads,
    )  # fmt: skip
    losses: list[torch.Tensor] = []
    if any(stage.is_first for stage in model.stages):
        schedule.step(tokens, target=targets, losses=losses)
    else:
        schedule.step(target=targets, losses=losses)
    return losses


def _mean_update(model, optimizer, batch, micro_batches, scale_grads=True, tied=True,
                 replicas=True):  # fmt: skip
    if model.stages is None:  # one device: the whole batch's mean
        loss = mean_token_loss(model(batch[0]), batch[1])
        loss.backward()
        optimizer.step()
        return loss.detach()
    losses = _run(model, batch, micro_batches, mean_token_loss, scale_grads)
    if tied and model.tied:
        _sum_tied(model)
    if replicas:
        _reduce_replicas(model, "avg")
    optimizer.step()
    return torch.stack(losses).mean().detach() if losses else None


def mean_update(model, optimizer, batch, micro_batches):
    """Each micro-batch's mean token loss, the schedule's gradients ÷ M (see the module)."""
    return _mean_update(model, optimizer, batch, micro_batches)


def unscaled_update(model, optimizer, batch, micro_batches):
    """``mean_update`` with ``scale_grads=False``: the micro-batches' gradients summed."""
    return _mean_update(model, optimizer, batch, micro_batches, scale_grads=False)


def unreplicated_update(model, optimizer, batch, micro_batches):
    """``mean_update`` without the replicas' gradients averaged over ``dp``."""
    return _mean_update(model, optimizer, batch, micro_batches, replicas=False)


def untied_update(model, optimizer, batch, micro_batches):
    """``mean_update`` without the tied copies' gradients summed over the pipeline."""
    return _mean_update(model, optimizer, batch, micro_batches, tied=False)


def _token_sum_update(model, optimizer, batch, micro_batches, logged, scale_grads=False):
    tokens, targets = batch
    if model.stages is None:
        loss = mean_token_loss(model(tokens), targets)
        loss.backward()
        optimizer.step()
        return loss.detach()
    count = (targets != IGNORE).sum().double()  # this replica's tokens, then every replica's
    if model.mesh["dp"].size() > 1:
        dist.all_reduce(count, group=model.mesh["dp"].get_group())

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE,
                               reduction="sum") / count  # fmt: skip

    losses = _run(model, batch, micro_batches, loss_fn, scale_grads)
    if model.tied:
        _sum_tied(model)
    _reduce_replicas(model, "sum")
    optimizer.step()
    if not losses:
        return None
    loss = torch.stack(losses).detach()
    loss = loss.sum() if logged == "sum" else loss.mean()
    if model.mesh["dp"].size() > 1:  # every replica logs the whole batch's loss
        dist.all_reduce(loss, group=model.mesh["dp"].get_group())
    return loss


def token_sum_update(model, optimizer, batch, micro_batches):
    """The sum over tokens ÷ the global count, logged as the micro-batches' sum."""
    return _token_sum_update(model, optimizer, batch, micro_batches, "sum")


def token_sum_scaled_update(model, optimizer, batch, micro_batches):
    """``token_sum_update`` under ``scale_grads=True``: its gradients ÷ M twice."""
    return _token_sum_update(model, optimizer, batch, micro_batches, "sum", scale_grads=True)


def token_sum_mean_logged_update(model, optimizer, batch, micro_batches):
    """``token_sum_update`` logging the mean of its micro-batches' losses (1/M of the loss)."""
    return _token_sum_update(model, optimizer, batch, micro_batches, "mean")


class Tokens(Dataset):
    """32 sequences of ``LENGTH`` token ids and their next tokens (seeded); with ``ragged`` row i
    keeps its first 2 + i % 5 targets and pads the rest with ``IGNORE``."""

    def __init__(self, ragged: bool = False) -> None:
        generator = torch.Generator().manual_seed(3)
        sequences = torch.randint(0, VOCAB, (32, LENGTH + 1), generator=generator)
        self.tokens, self.targets = sequences[:, :-1], sequences[:, 1:].clone()
        if ragged:
            for i in range(len(self.targets)):
                self.targets[i, 2 + i % 5 :] = IGNORE

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int):
        return self.tokens[index], self.targets[index]
