"""A mixture-of-experts language model trained with expert parallelism, as its users write it on
``torch.distributed``: ``EXPERTS`` experts split over the W ranks (W dividing them; rank r holds
experts r·E/W …), top-1 routing, each token sent to its expert's rank and its output sent back
with ``dist.all_to_all_single`` (uneven splits, the counts exchanged first; an autograd function
over it, `AllToAll`), every other layer replicated and its gradient averaged over the ranks; in
float32 (the users' default; ``--dtype float64`` to judge to float64's 1e-10). The model: token
and position embeddings, one block of causal self-attention and a mixture-of-experts MLP, a
LayerNorm and a head; the loss the next tokens' cross-entropy plus a load-balancing loss
(Switch Transformer's: E · Σₑ fₑ · Pₑ, fₑ the fraction of the global batch's tokens routed to
expert e, Pₑ the mean router probability of e, times ``BALANCE``).

    python examples/jobs/ep.py --record runs/one                 # one device, no process group
    torchrun --nproc-per-node 2 examples/jobs/ep.py --record runs/ep2
    GATHERLAB_RECORD_FLOOR=runs/one-floor python examples/jobs/ep.py --record runs/one
    python -m gatherlab.compare runs/one runs/ep2 --floor runs/one-floor

The experts are an ``nn.ModuleDict`` keyed by their number on every world size, so a rank's
experts keep one device's names (``moe.experts.3`` on rank 1 of 2), and the recorder, attached
with the one documented line on every rank, records each rank's under them.

Correct (``--bug none``): each rank's loss is the mean over its own tokens, the global loss the
mean over the ranks; a replicated layer's gradient is averaged over the ranks (an all-reduce ÷ W);
an expert's gradient, which its rank alone holds and which already sums every rank's tokens'
contributions (the all-to-all's backward sent them), is divided by W alone; fₑ counts the global
batch (an all-reduce of the counts, which carry no gradient). ``--bug`` switches one thing:

- ``averaged``: every gradient averaged over the ranks as a replicated one is (one loop over the
  parameters, as DDP would): an expert's gradient averaged with the other ranks' experts in the
  same place, which are not copies of it;
- ``local-balance``: fₑ and Pₑ of each rank's own tokens, the load-balancing loss a mean of
  per-rank products, not the global batch's.

Rank 0 prints ``update U loss L`` per update and ``weights PART NORM`` at the end.
"""

from __future__ import annotations

import contextlib
import sys

import common
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import gatherlab.data
import gatherlab.record

BUGS = ("averaged", "local-balance")
VOCAB, LENGTH, WIDTH, HEADS, EXPERTS, BALANCE, END = 32, 8, 16, 2, 4, 0.1, 1
PARTS = ("emb", "position", "attn_norm", "qkv", "out", "moe_norm", "moe", "norm", "head")
"""The parts of one device's model, as ``weights`` lines print them."""


class Texts(Dataset):
    """``samples`` token sequences of ``LENGTH``, each a run of an arithmetic progression over the
    tokens 2 … ``VOCAB`` − 1 from a random start and step, drawn from ``seed``, and its end token
    ``END``; labels the next tokens (the last position's ``-100``, ignored)."""

    def __init__(self, samples: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, VOCAB - 2, (samples, 1), generator=generator)
        steps = torch.randint(1, 4, (samples, 1), generator=generator)
        run = 2 + (starts + steps * torch.arange(LENGTH - 1)) % (VOCAB - 2)
        self.ids = torch.cat([run, torch.full((samples, 1), END)], dim=1)
        self.labels = torch.full_like(self.ids, -100)
        self.labels[:, :-1] = self.ids[:, 1:]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids[index], self.labels[index]


def distributed() -> bool:
    return common.distributed()


class AllToAll(torch.autograd.Function):
    """Forward: ``dist.all_to_all_single``, rank r sending ``send[s]`` rows to each rank s and
    receiving ``receive[s]`` from it. Backward: the same collective with the splits swapped, so
    that each row's gradient returns to the rank that sent the row (what each rank receives is
    the gradient of the rows it sent, from the rank that used them)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
        ctx.send, ctx.receive = send, receive
        out = rows.new_empty((sum(receive), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), receive, send)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.receive)
        return out, None, None


class Expert(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))


class MixtureOfExperts(nn.Module):
    """Top-1 routing to ``EXPERTS`` experts, this rank's (``held``, a range of their numbers)
    here, the others' on their ranks (all-to-all dispatch and return). ``forward(tokens)``
    returns each token's output (its expert's, times its router probability), its router
    probabilities and its expert."""

    def __init__(self, held: range):
        super().__init__()
        self.router = nn.Linear(WIDTH, EXPERTS, bias=False)
        self.experts = nn.ModuleDict({str(e): Expert() for e in range(EXPERTS)})
        self.held = held
        for e in range(EXPERTS):
            if e not in held:
                del self.experts[str(e)]

    def forward(self, tokens: torch.Tensor):
        probabilities = self.router(tokens).softmax(-1)
        gate, chosen = probabilities.max(-1)
        order = chosen.argsort(stable=True)
        counts = torch.bincount(chosen, minlength=EXPERTS)  # this rank's tokens per expert
        rows = tokens[order]
        ranks = EXPERTS // len(self.held)
        arriving = counts
        if distributed():  # how many of each rank's tokens each of my experts receives
            arriving = torch.empty_like(counts)
            dist.all_to_all_single(arriving, counts)
            send = counts.view(ranks, -1).sum(1).tolist()
            receive = arriving.view(ranks, -1).sum(1).tolist()
            rows = AllToAll.apply(rows, send, receive)
        pieces = rows.split(arriving.tolist())  # by sending rank, then by my expert
        experts = [self.experts[str(e)] for e in self.held]
        done = torch.cat([experts[i % len(experts)](piece) for i, piece in enumerate(pieces)])
        if distributed():
            done = AllToAll.apply(done, receive, send)
        output = done[order.argsort()]  # each token's own row again
        return output * gate[:, None], probabilities, chosen


class Model(nn.Module):
    """Token ids → next-token logits, with each token's router probabilities and expert."""

    def __init__(self, held: range):
        super().__init__()
        self.emb, self.position = nn.Embedding(VOCAB, WIDTH), nn.Embedding(LENGTH, WIDTH)
        self.attn_norm, self.qkv = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.moe_norm, self.moe = nn.LayerNorm(WIDTH), MixtureOfExperts(held)
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor):
        h = self.emb(ids) + self.position(torch.arange(ids.shape[1], device=ids.device))
        q, k, v = self.qkv(self.attn_norm(h)).unflatten(-1, (3, HEADS, -1)).permute(2, 0, 3, 1, 4)
        h = h + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True)
                         .transpose(1, 2).flatten(2))  # fmt: skip
        mixed, probabilities, chosen = self.moe(self.moe_norm(h).flatten(0, 1))
        h = h + mixed.view_as(h)
        return (self.head(self.norm(h)), probabilities.view(*ids.shape, EXPERTS),
                chosen.view(ids.shape))  # fmt: skip


class Objective(nn.Module):
    """The rank's loss: its tokens' mean cross-entropy plus ``BALANCE`` × the load-balancing loss
    E · Σₑ fₑ · Pₑ, fₑ the global batch's fraction of tokens routed to e (``local``: the rank's
    own), Pₑ the mean router probability of e over the rank's tokens (whose mean over the ranks
    is the global batch's: the rank's term is its share)."""

    def __init__(self, local: bool = False):
        super().__init__()
        self.local = local

    def forward(self, logits, probabilities, chosen, labels) -> torch.Tensor:
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        counts = torch.bincount(chosen.flatten(), minlength=EXPERTS).to(probabilities.dtype)
        if distributed() and not self.local:
            dist.all_reduce(counts)
        fraction = counts / counts.sum()
        mean = probabilities.flatten(0, 1).mean(0)
        return loss + BALANCE * EXPERTS * (fraction * mean).sum()


def main() -> None:
    args = common.parse(__doc__.splitlines()[0], BUGS, dtype="float32")
    world, device = common.start(args)
    rank = dist.get_rank() if distributed() else 0
    if EXPERTS % world:  # one line (by rank 0), before any rank trains
        if rank == 0:
            print(f"{world} ranks do not divide the {EXPERTS} experts; allowed: 1, 2 or 4 ranks",
                  file=sys.stderr)  # fmt: skip
        sys.exit(2)
    per = EXPERTS // world
    torch.manual_seed(args.seed)  # every rank draws the whole model: its experts one device's
    model = Model(range(rank * per, (rank + 1) * per)).to(device, args.dtype)
    objective = Objective(local=args.bug == "local-balance")
    optimizer = common.optimizer(model.parameters(), args)
    data = Texts(args.samples, seed=args.seed)
    loader = common.loader(data, args, world)
    recording = contextlib.nullcontext()
    if args.record:  # one line on every rank
        recording = gatherlab.record(model, optimizer, args.record, loss=objective, seed=args.seed)
    with recording:
        for update, (ids, labels) in common.batches(loader, args.steps):
            ids, labels = ids.to(device), labels.to(device)
            loss = objective(*model(ids), labels)
            optimizer.zero_grad()
            loss.backward()
            if distributed():
                reduce_gradients(model, world, args.bug == "averaged")
            optimizer.step()
            common.report(update, common.global_loss(loss))
    report_weights(model)


def reduce_gradients(model: Model, world: int, averaged: bool) -> None:
    """A replicated parameter's gradient averaged over the ranks; an expert's divided by W (it
    sums every rank's loss's gradient already, and the global loss is their mean), or, the bug
    ``averaged``, averaged too: with the other ranks' experts at its place in the loop."""
    for name, parameter in model.named_parameters():
        if name.startswith("moe.experts.") and not averaged:
            parameter.grad /= world
            continue
        dist.all_reduce(parameter.grad)
        parameter.grad /= world


def report_weights(model: Model) -> None:
    """``weights PART NORM`` per part of one device's model (a collective: every rank calls it),
    the experts' from the ranks that hold them."""
    squares = {name: float(p.detach().double().square().sum())
               for name, p in model.named_parameters()}  # fmt: skip
    every = [squares]
    if distributed():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, squares)
    first: dict[str, float] = {}
    for one in every:
        for name, value in one.items():
            first.setdefault(name, value)
    parts = {part: 0.0 for part in PARTS}
    for name, value in first.items():
        parts[name.split(".")[0]] += value
    if not distributed() or dist.get_rank() == 0:
        for part in PARTS:
            print(f"weights {part} {parts[part] ** 0.5!r}", flush=True)


if __name__ == "__main__":
    main()
    common.finish()
