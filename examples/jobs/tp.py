"""A tensor- and sequence-parallel transformer block (``parallelize_module`` on the ``tp`` dimension
of ``init_device_mesh("cpu", (W / tp, tp))`` on gloo, ``--tp`` 2 by default, and FSDP2's
``fully_shard`` on ``dp`` when W > tp): a causal attention and an MLP, each behind a LayerNorm, a
final LayerNorm and a linear head whose logits, averaged over the sequence, classify it.

    python examples/jobs/tp.py --record runs/one                # one device, no process group
    torchrun --nproc-per-node 2 examples/jobs/tp.py --record runs/tp2
    torchrun --nproc-per-node 4 examples/jobs/tp.py --record runs/dp2tp2   # dp 2 × tp 2
    python -m gatherlab.compare runs/one runs/tp2

Correct (``--bug none``), torchtitan's plan: each LayerNorm ``SequenceParallel`` (its input and
output cut along the sequence, its replicated weights' gradient ``Partial``, summed over tp by
DTensor before the step), the attention's projections ``ColwiseParallel`` (its heads cut over tp)
and its output ``RowwiseParallel(output_layouts=Shard(1))``, the MLP likewise, the head
``ColwiseParallel(output_layouts=Replicate())``; the model's input declared whole
(``PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1))``). Each tp
group's ranks train the same rows (their dp rank's), which the recorder, attached with the one
documented line on every rank, counts once (it reads the tensor-parallel groups off the
parameters' mesh). The residual dropout draws one mask for the global batch and sequence from a
seeded generator and keeps the rank's rows and positions, so that every layout applies one
device's mask.

``--bug`` switches one thing, each a user's slip that trains without an error:

- ``unreduced-norm``: the MLP's LayerNorm left out of the plan while its input is the sequence
  shard (Megatron's sequence-parallel norm without its all-reduce): its weights are plain tensors
  (at W > tp, FSDP2's over dp alone) and each tp rank's gradient is the sum over its own
  positions only, a Partial gradient stepped as if it were whole;
- ``local-logits``: the head ``ColwiseParallel`` with its default output, each rank's local shard
  of the classes (its ``Shard(-1)``), fed to a cross-entropy that is not parallel: each tp rank
  classifies among its own columns only (the head has twice the classes' columns, padded as a
  vocabulary is to a multiple of tp, so the labels fit each shard at tp = 2);
- ``whole-sequence``: the model's input declared as each rank's sequence shard
  (``input_layouts=Shard(1)``) while every rank passes the whole sequence: the global sequence is
  tp copies of it, and the causal attention of each copy sees the copies before it;
- ``same-dropout``: each rank draws its dropout mask for its own shard from the same seeded
  generator, so the tp ranks' positions share one mask where one device draws one per position.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import common
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import gatherlab.data
import gatherlab.record

BUGS = ("unreduced-norm", "local-logits", "whole-sequence", "same-dropout")
SEQUENCE, WIDTH, HEADS, CLASSES = 4, 8, 2, 4


class Sequences(Dataset):
    """``samples`` sequences of ``SEQUENCE`` positions of ``WIDTH`` standard normal features, and
    a label in 0 … ``CLASSES`` − 1 each (that of its largest feature sum), drawn from ``seed``."""

    def __init__(self, samples: int, seed: int = 0, dtype=torch.float64):
        generator = torch.Generator().manual_seed(seed)
        rows = torch.randn(samples, SEQUENCE, WIDTH, generator=generator, dtype=torch.float64)
        self.rows = rows.to(dtype)
        self.labels = rows.sum(1).view(samples, CLASSES, -1).sum(-1).argmax(-1)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows[index], self.labels[index]


class Dropout(nn.Module):
    """Residual dropout on the rank's rows and positions: the mask of the global batch and
    sequence drawn from one seeded generator (the same draws on every rank), the rank's part of
    it kept (``layout``: dp rank, dp, tp rank, tp). ``same``: the bug ``same-dropout``."""

    def __init__(self, p: float, seed: int, same: bool = False):
        super().__init__()
        self.p, self.same, self.layout = p, same, (0, 1, 0, 1)
        self.generator = torch.Generator().manual_seed(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        dp_rank, dp, tp_rank, tp = self.layout
        rows, positions, width = x.shape
        if self.same:  # each rank its own shard's mask, from the same generator
            draws = torch.rand(x.shape, generator=self.generator, dtype=x.dtype)
        else:  # the global mask, the rank's rows and positions of it
            draws = torch.rand(rows * dp, positions * tp, width, generator=self.generator,
                               dtype=x.dtype)  # fmt: skip
            draws = draws[dp_rank * rows : (dp_rank + 1) * rows].chunk(tp, dim=1)[tp_rank]
        return x * (draws >= self.p) / (1 - self.p)


class Attention(nn.Module):
    """Causal self-attention; under tensor parallelism each rank holds its heads' projections."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.head_width = width // heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (f(x).unflatten(-1, (-1, self.head_width)).transpose(1, 2)
                   for f in (self.q, self.k, self.v))  # fmt: skip
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).flatten(2))


class Classifier(nn.Module):
    def __init__(self, args: argparse.Namespace):
        super().__init__()
        self.attn_norm, self.attn = nn.LayerNorm(WIDTH), Attention(WIDTH, HEADS)
        self.mlp_norm = nn.LayerNorm(WIDTH)
        hidden = 4 * WIDTH
        self.mlp = nn.Sequential(nn.Linear(WIDTH, hidden), nn.GELU(), nn.Linear(hidden, WIDTH))
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 2 * CLASSES)
        self.dropout = Dropout(0.1, args.seed, same=args.bug == "same-dropout")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.dropout(self.attn(self.attn_norm(x)))
        h = h + self.dropout(self.mlp(self.mlp_norm(h)))
        return self.head(self.norm(h)).mean(dim=1)  # the sequence's class logits


def parallel(model: Classifier, tp: int, bug: str) -> tuple[int, int, int, int]:
    """The model parallelized over the ranks, W / tp data-parallel groups of tp ranks: (dp rank,
    dp, tp rank, tp)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel as Colwise
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        SequenceParallel,
        parallelize_module,
    )
    from torch.distributed.tensor.parallel import RowwiseParallel as Rowwise

    world = int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    given = Shard(1) if bug == "whole-sequence" else Replicate()
    sequence = Shard(1)
    whole = PrepareModuleInput(
        input_layouts=(given,), desired_input_layouts=(sequence,), use_local_output=True
    )
    plan = {
        "attn_norm": SequenceParallel(),
        "attn": PrepareModuleInput(input_layouts=(sequence,), desired_input_layouts=(Replicate(),)),
        **{f"attn.{name}": Colwise() for name in "qkv"},
        "attn.o": Rowwise(output_layouts=sequence),
        "mlp_norm": SequenceParallel(),
        "mlp.0": Colwise(input_layouts=sequence),
        "mlp.2": Rowwise(output_layouts=sequence),
        "norm": SequenceParallel(),
        "head": Colwise(input_layouts=sequence, output_layouts=Replicate()),
    }
    if bug == "unreduced-norm":
        del plan["mlp_norm"]
    if bug == "local-logits":
        plan["head"] = Colwise(input_layouts=sequence)
    parallelize_module(model, mesh["tp"], whole)
    parallelize_module(model, mesh["tp"], plan)
    if world > tp:
        fully_shard(model, mesh=mesh["dp"])
    dp_rank, tp_rank = mesh.get_coordinate()
    return dp_rank, world // tp, tp_rank, tp


def _tp_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, default=2,
                        help="the tensor-parallel degree, at most W (default: 2)")  # fmt: skip


def main() -> None:
    args = common.parse(__doc__.splitlines()[0], BUGS, _tp_option)
    world, device = common.start(args)
    torch.manual_seed(args.seed)
    model = Classifier(args).to(device, args.dtype)
    criterion = nn.CrossEntropyLoss()
    layout = (0, 1, 0, 1)
    if common.distributed():
        tp = min(args.tp, world)
        if world % tp:
            print(f"--tp={args.tp} does not divide {world} ranks; allowed: a divisor of {world}",
                  file=sys.stderr)  # fmt: skip
            sys.exit(2)
        layout = parallel(model, tp, args.bug)
    model.dropout.layout = dp_rank, dp, _, _ = layout
    common.refuse_global_batch(args.global_batch, dp)
    optimizer = common.optimizer(model.parameters(), args)
    data = Sequences(args.samples, seed=args.seed, dtype=args.dtype)
    sampler = gatherlab.data.LayoutInvariantSampler(data, args.global_batch, num_replicas=dp,
                                                    rank=dp_rank, seed=args.seed)  # fmt: skip
    loader = DataLoader(data, batch_size=args.global_batch // dp, sampler=sampler, drop_last=True)
    recording = contextlib.nullcontext()
    if args.record:  # one line on every rank: a tp group's rows are counted once
        recording = gatherlab.record(model, optimizer, args.record, loss=criterion, seed=args.seed)
    with recording:
        for update, (rows, labels) in common.batches(loader, args.steps):
            rows, labels = rows.to(device), labels.to(device)
            loss = criterion(model(rows), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            common.report(update, common.global_loss(loss))
    common.report_weights({name: getattr(model, name) for name in
                           ("attn_norm", "attn", "mlp_norm", "mlp", "norm", "head")})  # fmt: skip


if __name__ == "__main__":
    main()
    common.finish()
