"""A causal language model trained with pipeline parallelism (``torch.distributed.pipelining``: a
manual ``PipelineStage`` per rank, ``Schedule1F1B`` or ``ScheduleGPipe`` over ``--micro-batches``
micro-batches, or two stages a rank with ``ScheduleInterleaved1F1B``, on the ``pp`` dimension of
``init_device_mesh("cpu", (W / pp, pp))`` on gloo, ``--pp`` 2 by default, the replicas of a
stage averaged over ``dp`` when W > pp), in float32 (the users' default; ``--dtype float64`` to
judge to float64's 1e-10). The model: a token and a position embedding, ``DEPTH`` pre-norm
transformer blocks, a final LayerNorm and a head tied to the token embedding (one
``nn.Parameter`` on one device). Its text: token sequences of ragged lengths, padded to
``LENGTH``, the padding's labels ignored (-100).

    python examples/jobs/pp.py --record runs/one                 # one device, no process group
    torchrun --nproc-per-node 2 examples/jobs/pp.py --record runs/pp2
    torchrun --nproc-per-node 4 examples/jobs/pp.py --record runs/dp2pp2    # dp 2 × pp 2
    torchrun --nproc-per-node 2 examples/jobs/pp.py --schedule interleaved --record runs/i2
    GATHERLAB_RECORD_FLOOR=runs/one-floor GATHERLAB_RECORD_FLOOR_BLOCKS=4 \\
        python examples/jobs/pp.py --record runs/one
    python -m gatherlab.compare runs/one runs/pp2 --floor runs/one-floor

Each stage is the whole model built from the seed with what other stages hold set to None (as
torchtitan splits a model): its parameters keep one device's names. The last stage holds the
head's weight, a copy of the first stage's embedding; recorded with the one documented line on
every rank, ``gatherlab.record(model, optimizer, DIR, loss=loss_fn, names=...)``, where
``names={"emb.weight": model.head.weight}`` on the last stage gives that copy one device's name.
The first stage feeds the rows (the recorder digests them there), the last computes the loss
(recorded there alone). Interleaved, a rank keeps the blocks of its two stages (rank 0 of 2
blocks 0 and 2, rank 1 blocks 1 and 3) in its one model, and each stage's module calls that
model's forward on its own blocks (`Chunk`), so that the recorder on the model sees each stage's
call.

Correct (``--bug none``): each micro-batch's loss is its tokens' cross-entropy summed and divided
by the global batch's tokens (every micro-batch's and every replica's, counted before the step),
times the micro-batches and the replicas that the schedule (``scale_grads=True``) and the
replicas' average divide by again; the tied weight's two gradients summed over its two stages
(``dist.all_reduce`` on a group of the first and last stage). ``--bug`` switches one thing, each a
slip that trains without an error:

- ``unscaled``: the schedule built with ``scale_grads=False`` while each micro-batch's loss is a
  mean: every gradient the micro-batches' sum, ``--micro-batches`` times one device's;
- ``untied``: the tied weight's gradients not summed over the stages: the embedding steps with
  its own gradient, the head with its own, and the two copies part (Megatron-LM #299);
- ``ragged``: each micro-batch's loss the mean over its own tokens (the loss's default
  ``reduction="mean"``): micro-batches of ragged rows hold different numbers of tokens, and the
  mean of their means is not the global batch's (torchtitan #2972).

Rank 0 prints ``update U loss L`` per update (the last stages' loss, sent to it) and ``weights
PART NORM`` at the end.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys

import common
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import gatherlab.data
import gatherlab.record

BUGS = ("unscaled", "untied", "ragged")
Ends = collections.namedtuple("Ends", "is_first is_last")
"""Whether a rank holds the pipeline's first stage (it is given the rows) and its last (the
labels)."""
SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe",
             "interleaved": "ScheduleInterleaved1F1B"}  # fmt: skip
"""The schedules the job takes: ``torch.distributed.pipelining``'s class of each."""
VOCAB, LENGTH, WIDTH, HEADS, DEPTH = 32, 12, 16, 2, 4
PAD, IGNORED = 0, -100


class Texts(Dataset):
    """``samples`` token sequences, each of its own length (``LENGTH`` / 2 … ``LENGTH``) padded
    to ``LENGTH`` with ``PAD``: a run of an arithmetic progression over the tokens 1 …
    ``VOCAB`` − 1 from a random start and step (a next token to learn), drawn from ``seed``; its
    labels the next tokens, ``IGNORED`` where there is none (the last token and the padding)."""

    def __init__(self, samples: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(LENGTH // 2, LENGTH + 1, (samples,), generator=generator)
        starts = torch.randint(0, VOCAB - 1, (samples, 1), generator=generator)
        steps = torch.randint(1, 4, (samples, 1), generator=generator)
        tokens = 1 + (starts + steps * torch.arange(LENGTH)) % (VOCAB - 1)
        real = torch.arange(LENGTH) < lengths[:, None]
        self.ids = tokens.where(real, PAD)
        self.labels = torch.full_like(self.ids, IGNORED)
        self.labels[:, :-1] = self.ids[:, 1:].where(real[:, 1:], IGNORED)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids[index], self.labels[index]


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP, each a residual."""

    def __init__(self):
        super().__init__()
        self.attn_norm, self.qkv = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.mlp_norm = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.attn_norm(h)).unflatten(-1, (3, HEADS, -1)).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.out(attended.transpose(1, 2).flatten(2))
        return h + self.mlp(self.mlp_norm(h))


class LanguageModel(nn.Module):
    """Token ids → next-token logits; a stage of it holds some of its modules, the others None:
    the first takes token ids, a later one the activations the stage before sent."""

    def __init__(self):
        super().__init__()
        self.emb, self.position = nn.Embedding(VOCAB, WIDTH), nn.Embedding(LENGTH, WIDTH)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(DEPTH)})
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied: one parameter on one device

    def forward(self, h: torch.Tensor, blocks: list[str] | None = None) -> torch.Tensor:
        """The blocks ``blocks`` (an interleaved stage's; by default every block it keeps), after
        the embeddings where they start at block 0 and before the norm and head where they end
        at the last block."""
        blocks = list(self.layers) if blocks is None else blocks
        if self.emb is not None and "0" in blocks:
            h = self.emb(h) + self.position(torch.arange(h.shape[1], device=h.device))
        for key in blocks:
            h = self.layers[key](h)
        if self.head is not None and str(DEPTH - 1) in blocks:
            h = self.head(self.norm(h))
        return h


class Chunk(nn.Module):
    """One of an interleaved rank's stages: its blocks (and the embeddings on the first stage,
    the norm and head on the last) registered here, whose gradients the schedule scales, and a
    forward that calls the rank's model on them (a plain reference, not a submodule: the
    schedule would scale the model's other stage's gradients too)."""

    def __init__(self, model: LanguageModel, blocks: list[str]):
        super().__init__()
        self.blocks, self.call = blocks, [model]
        self.layers = nn.ModuleList(model.layers[key] for key in blocks)
        if "0" in blocks:
            self.emb, self.position = model.emb, model.position
        if str(DEPTH - 1) in blocks:
            self.norm, self.head = model.norm, model.head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.call[0](h, blocks=self.blocks)


def split(model: LanguageModel, mine: list[int], stages: int) -> list[list[str]]:
    """Keep the stages ``mine`` of ``stages`` in ``model``: their ``DEPTH`` / stages blocks each,
    the embeddings on the first, the final norm and the head on the last; each kept stage's
    blocks."""
    per = DEPTH // stages
    kept = [[str(i) for i in range(stage * per, (stage + 1) * per)] for stage in mine]
    for i in range(DEPTH):
        if not any(str(i) in blocks for blocks in kept):
            del model.layers[str(i)]
    if 0 not in mine:
        model.emb = model.position = None
    if stages - 1 not in mine:
        model.norm = model.head = None
    return kept


class TokenLoss(nn.Module):
    """A micro-batch's cross-entropy over its tokens (``IGNORED`` labels left out): summed, times
    ``scale``, divided by ``tokens`` (the global batch's), or ``mean`` (the bug ``ragged``) the
    mean over its own tokens."""

    def __init__(self, mean: bool = False):
        super().__init__()
        self.mean, self.tokens, self.scale = mean, 1, 1.0

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits, labels = logits.flatten(0, 1), labels.flatten()
        if self.mean:
            return F.cross_entropy(logits, labels, ignore_index=IGNORED)
        summed = F.cross_entropy(logits, labels, ignore_index=IGNORED, reduction="sum")
        return summed * self.scale / self.tokens


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pp",
        type=int,
        default=2,
        help="the pipeline's stages, dividing W and the blocks (default: 2)",
    )
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=4,
        help="micro-batches per update, at least the stages (default: 4)",
    )
    parser.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="1f1b",
        help="1f1b, gpipe, or interleaved: two stages per rank, interleaved 1F1B (default: 1f1b)",
    )


def _refuse(line: str) -> None:
    """Bad input: one line (by rank 0), exit status 2 on every rank, before any trains."""
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr)
    sys.exit(2)


def pipeline(model: LanguageModel, loss_fn: TokenLoss, args: argparse.Namespace, world: int):
    """The mesh, this rank's stage of ``model`` and its schedule; the groups of its replicas and
    of the tied weight's two stages. Bad input refused in one line, before any training."""
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh

    pp, interleaved = args.pp, args.schedule == "interleaved"
    stages = pp * (2 if interleaved else 1)
    if pp < 2 or world % pp or DEPTH % stages:
        _refuse(f"--pp={pp}: the pipeline's ranks; allowed: at least 2, dividing the {world} "
                f"ranks, their {stages} stages dividing the {DEPTH} blocks")  # fmt: skip
    if args.schedule == "1f1b" and args.micro_batches < pp:
        _refuse(f"--micro-batches={args.micro_batches}: 1F1B needs at least one per stage; "
                f"allowed: {pp} or more, or --schedule gpipe")  # fmt: skip
    if interleaved and args.micro_batches % pp:
        _refuse(f"--micro-batches={args.micro_batches}: interleaved 1F1B needs a multiple of the "
                f"pipeline's {pp} ranks; allowed: {pp}, {2 * pp}, …")  # fmt: skip
    if args.global_batch % (world // pp * args.micro_batches):
        _refuse(f"--global-batch={args.global_batch} does not divide into {world // pp} "
                f"replicas × {args.micro_batches} micro-batches; allowed: a multiple of "
                f"{world // pp * args.micro_batches}")  # fmt: skip
    mesh = init_device_mesh("cpu", (world // pp, pp), mesh_dim_names=("dp", "pp"))
    replica, index = mesh.get_coordinate()
    mine = [index, index + pp] if interleaved else [index]  # stage s on rank s % pp
    kept = split(model, mine, stages)
    modules = [Chunk(model, blocks) for blocks in kept] if interleaved else [model]
    built = [pipelining.PipelineStage(module, s, stages, torch.device("cpu"),
                                      group=mesh["pp"].get_group())
             for module, s in zip(modules, mine, strict=True)]  # fmt: skip
    schedule = getattr(pipelining, SCHEDULES[args.schedule])(
        built if interleaved else built[0], args.micro_batches, loss_fn=loss_fn,
        scale_grads=args.bug != "unscaled")  # fmt: skip
    stage = Ends(built[0].is_first, built[-1].is_last)
    tied = None
    for row in mesh.mesh.tolist():  # every rank makes every group
        group = dist.new_group([row[0], row[-1]])
        if replica == mesh.mesh.tolist().index(row) and index in (0, pp - 1):
            tied = group
    return stage, schedule, mesh["dp"].get_group(), tied, replica, world // pp


def main() -> None:
    args = common.parse(__doc__.splitlines()[0], BUGS, _options, dtype="float32")
    world, device = common.start(args)
    torch.manual_seed(args.seed)
    model = LanguageModel().to(device, args.dtype)
    loss_fn = TokenLoss(mean=args.bug == "ragged")
    stage = schedule = replicas = tied = None
    replica, dp = 0, 1
    if common.distributed() and world > 1:  # torchrun --nproc-per-node 1: one device's run
        stage, schedule, replicas, tied, replica, dp = pipeline(model, loss_fn, args, world)
    micro_batches = args.micro_batches if stage is not None else 1
    optimizer = common.optimizer(model.parameters(), args)
    data = Texts(args.samples, seed=args.seed)
    sampler = gatherlab.data.LayoutInvariantSampler(data, args.global_batch, num_replicas=dp,
                                                    rank=replica, seed=args.seed)  # fmt: skip
    loader = DataLoader(data, batch_size=args.global_batch // dp, sampler=sampler, drop_last=True)
    copy = stage is not None and stage.is_last and not stage.is_first
    names = {"emb.weight": model.head.weight} if copy else {}  # the tied weight's copy
    recording = contextlib.nullcontext()
    if args.record:  # one line on every rank
        recording = gatherlab.record(model, optimizer, args.record, loss=loss_fn, seed=args.seed,
                                     names=names)  # fmt: skip
    with recording:
        for update, (ids, labels) in common.batches(loader, args.steps):
            tokens = (labels != IGNORED).sum()
            if replicas is not None and dp > 1:
                dist.all_reduce(tokens, group=replicas)
            loss_fn.tokens, loss_fn.scale = int(tokens), float(micro_batches * dp)
            optimizer.zero_grad()
            if stage is None:  # one device: the whole batch at once
                loss = loss_fn(model(ids.to(device)), labels.to(device))
                loss.backward()
                logged = loss.detach()
            else:
                logged = train_step(stage, schedule, model, ids, labels, args.bug, tied)
                for parameter in model.parameters():  # the stage's replicas averaged
                    if dp > 1:
                        dist.all_reduce(parameter.grad, group=replicas)
                        parameter.grad /= dp
            optimizer.step()
            common.report(update, global_loss(logged, dp))
    report_weights(model, stage)


def train_step(stage, schedule, model, ids, labels, bug: str, tied) -> torch.Tensor:
    """One update of this rank's stage: the schedule over the micro-batches (the first stage given
    the rows, the last the labels), then the tied weight's gradient summed over its two stages.
    The update's loss on a last stage (the mean of its micro-batches'), else 0."""
    losses: list[torch.Tensor] = []
    if stage.is_first:
        schedule.step(ids)
    elif stage.is_last:
        schedule.step(target=labels, losses=losses)
    else:
        schedule.step()
    if tied is not None and bug != "untied":  # the embedding's and the head's gradients summed
        weight = model.emb.weight if stage.is_first else model.head.weight
        dist.all_reduce(weight.grad, group=tied)
    if not losses:
        return torch.zeros(())
    return torch.stack([loss.detach() for loss in losses]).mean()


def global_loss(logged: torch.Tensor, dp: int) -> float:
    """The update's loss as one device computes it: the last stages' (each its replica's), sent
    to every rank and averaged over the replicas."""
    logged = logged.detach().double().clone()
    if common.distributed():
        dist.all_reduce(logged)
        logged /= dp
    return logged.item()


def report_weights(model: LanguageModel, stage) -> None:
    """``weights PART NORM`` per part of one device's model (a collective: every rank calls
    it), each parameter's norm from the lowest rank holding it (the tied head's weight is the
    embedding's)."""
    held = {name: float(p.detach().double().square().sum()) for name, p in model.named_parameters()
            if not name.startswith("head.")}  # fmt: skip
    every = [held]
    if common.distributed():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, held)
    squares: dict[str, float] = {}
    for one in every:
        for name, value in one.items():
            squares.setdefault(name, value)
    parts: dict[str, float] = {}
    for name, value in squares.items():
        part = name.split(".")[0]
        parts[part] = parts.get(part, 0.0) + value
    if not common.distributed() or dist.get_rank() == 0:
        for part in PARTS:
            print(f"weights {part} {parts[part] ** 0.5!r}", flush=True)


PARTS = ("emb", "position", "layers", "norm")
"""The parts of one device's model (its head's weight is the embedding's)."""


if __name__ == "__main__":
    main()
    common.finish()
