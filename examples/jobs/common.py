"""What the four jobs of this folder share, written as a training script writes it: a small seeded
data set of two views per sample, an MLP backbone with a projection head, an NT-Xent loss with a
learnt temperature over the all-gathered batch, the command line, the process group and the
sampler. Each job (``ddp.py``, ``lightning_job.py``, ``fsdp2.py``, ``zero.py``) is its own loop
around these; copy one with this file.

Only gatherlab's public modules appear: ``gatherlab.gather`` (the exact all-gather),
``gatherlab.data`` (the sampler that gives every world size the same global batch) and, in the
jobs, ``gatherlab.record``. The bugs a job can switch on (``--bug``) are written here beside their
correct forms:

- ``old-gather``: lightly's GatherLayer before PR #1531, whose backward keeps only the rank's own
  loss's gradient of its slice (`OldGather`) instead of the sum over every rank's loss;
- ``local-batchnorm``: the head's batch norm with each rank's own statistics (``BatchNorm1d``)
  instead of the global batch's (`GlobalBatchNorm1d`);
- ``sampler``: DistributedSampler's own shuffle on W ranks and one device's RandomSampler with a
  seeded generator, instead of `gatherlab.data.LayoutInvariantSampler` on every world size;
- ``temperature-outside``: the learnt temperature outside the module that DDP or FSDP2 wraps, so
  that its gradient is never reduced over the ranks;
- ``divide-twice``: the loss divided by W before the backward, on top of DDP's (or FSDP's)
  average.

Run plainly (``python examples/jobs/ddp.py``), a job is the one-device run, with no process group;
under ``torchrun --nproc-per-node W`` it trains the same global batch on W ranks (gloo on the CPU,
NCCL on CUDA). Rank 0 prints ``update U loss L`` per update and ``weights PART NORM`` at the end.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler

import gatherlab.data
import gatherlab.gather

BUGS = ("old-gather", "local-batchnorm", "sampler", "temperature-outside", "divide-twice")


def parse(
    description: str,
    bugs: tuple[str, ...],
    more: Callable[[argparse.ArgumentParser], None] | None = None,
    dtype: str = "float64",
) -> argparse.Namespace:
    """The jobs' command line; ``--bug`` outside ``bugs`` (those the job applies) is refused in
    one line, exit status 2. ``more`` adds a job's own options (``tp.py``'s ``--tp``); ``dtype``
    is the job's default (``pp.py``'s and ``ep.py``'s float32, as their users train)."""
    parser = argparse.ArgumentParser(description=description)
    if more is not None:
        more(parser)
    parser.add_argument("--record", metavar="DIR", help="record the run with gatherlab.record")
    parser.add_argument(
        "--trace",
        action="store_true",
        help="with --record: trace the first update (where two runs part)",
    )
    parser.add_argument("--steps", type=int, default=5, help="optimizer updates")
    parser.add_argument("--global-batch", type=int, default=16, help="rows per update, all ranks")
    parser.add_argument("--samples", type=int, default=64, help="samples in the data set")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    parser.add_argument("--dtype", choices=("float64", "float32"), default=dtype)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--bug", choices=("none", *dict.fromkeys((*BUGS, *bugs))), default="none")
    args = parser.parse_args()
    if args.bug not in ("none", *bugs):
        parser.exit(2, f"{parser.prog}: --bug {args.bug} does not apply to this job; allowed: "
                       f"{', '.join(('none', *bugs))}\n")  # fmt: skip
    for name in ("steps", "global_batch", "samples"):
        if getattr(args, name) < 1:
            parser.exit(2, f"{parser.prog}: --{name.replace('_', '-')}={getattr(args, name)}; "
                           "allowed: a positive integer\n")  # fmt: skip
    args.dtype = getattr(torch, args.dtype)
    return args


def start(args: argparse.Namespace) -> tuple[int, torch.device]:
    """(world size, device): a process group when torchrun started the process (gloo on the
    CPU, NCCL on CUDA), none when it was run plainly. The global batch must divide by W."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    device = torch.device(args.device)
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    world = int(os.environ["WORLD_SIZE"]) if launched else 1
    refuse_global_batch(args.global_batch, world)
    if launched:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        return dist.get_world_size(), device
    return 1, device


def refuse_global_batch(global_batch: int, world: int) -> None:
    """A global batch that W ranks cannot split evenly, refused in one line, exit status 2."""
    if global_batch % world:
        print(f"--global-batch={global_batch} does not divide by {world} ranks; allowed: a "
              f"multiple of {world}", file=sys.stderr)  # fmt: skip
        sys.exit(2)


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class TwoViews(Dataset):
    """``samples`` points x of ``dim`` standard normal features and their views x + 0.5·ε₀ and
    x + 0.5·ε₁, all drawn from ``seed`` once: every rank of every world size holds the same."""

    def __init__(self, samples: int, dim: int = 8, seed: int = 0, dtype=torch.float64):
        generator = torch.Generator().manual_seed(seed)
        points = torch.randn(samples, dim, generator=generator, dtype=torch.float64)
        noise = torch.randn(2, samples, dim, generator=generator, dtype=torch.float64)
        self.views = (points + 0.5 * noise).to(dtype)

    def __len__(self) -> int:
        return self.views.shape[1]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.views[0, index], self.views[1, index]


def loader(dataset: Dataset, args: argparse.Namespace, world: int) -> DataLoader:
    """global batch / W rows per rank. Correct: `gatherlab.data.LayoutInvariantSampler` on every
    world size. ``--bug sampler``: what a job usually does, RandomSampler with a seeded generator
    on one device and DistributedSampler's own shuffle on W ranks."""
    if args.bug != "sampler":
        sampler = gatherlab.data.LayoutInvariantSampler(dataset, args.global_batch, seed=args.seed)
    elif distributed():
        sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
    else:
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(args.seed))
    return DataLoader(dataset, batch_size=args.global_batch // world, sampler=sampler,
                      drop_last=True)  # fmt: skip


def batches(data: DataLoader, steps: int) -> Iterator[tuple[int, list[torch.Tensor]]]:
    """(update, batch) for ``steps`` updates, epoch after epoch (the sampler told each epoch)."""
    update, epoch = 0, 0
    while True:
        if hasattr(data.sampler, "set_epoch"):
            data.sampler.set_epoch(epoch)
        for batch in data:
            if update == steps:
                return
            yield update, batch
            update += 1
        epoch += 1


exact_gather = gatherlab.gather.Fixed()
"""Every rank's rows in rank order; the backward sums over the ranks each rank's loss's gradient
of the gathered rows (exact after DDP's average). The rows themselves without a process group."""


class OldGather(torch.autograd.Function):
    """lightly's GatherLayer before PR #1531 (the bug ``old-gather``). Forward: every rank's rows in
    rank order. Backward: the rank's own slice of its own loss's gradient, without the other ranks'
    losses' gradients of it."""

    @staticmethod
    def forward(ctx, rows):
        ctx.own = slice(dist.get_rank() * len(rows), (dist.get_rank() + 1) * len(rows))
        parts = [torch.empty_like(rows) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, rows.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.own]


def old_gather(rows: torch.Tensor) -> torch.Tensor:
    return OldGather.apply(rows) if distributed() else rows


class GlobalBatchNorm1d(nn.BatchNorm1d):
    """Batch norm with the statistics of the global batch: the rows of every rank gathered (exact
    gradient), normalised together as on one device, the rank's own rows kept. SyncBatchNorm does
    this on GPUs but refuses CPU tensors."""

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        if not (self.training and distributed()):
            return super().forward(rows)
        own = slice(dist.get_rank() * len(rows), (dist.get_rank() + 1) * len(rows))
        return super().forward(exact_gather(rows))[own]


class ProjectionHead(nn.Sequential):
    def __init__(self, width: int, out: int, local_batchnorm: bool = False):
        norm = nn.BatchNorm1d(width) if local_batchnorm else GlobalBatchNorm1d(width)
        super().__init__(nn.Linear(width, width), norm, nn.ReLU(), nn.Linear(width, out))


class SimCLR(nn.Module):
    """An MLP backbone and a projection head; ``model(view0, view1)`` embeds both views (each view
    through the batch norm on its own, as two calls of a SimCLR model do)."""

    def __init__(self, dim: int = 8, width: int = 16, out: int = 8, local_batchnorm=False):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(dim, width), nn.ReLU(), nn.Linear(width, width))
        self.head = ProjectionHead(width, out, local_batchnorm)

    def forward(self, view0, view1):
        return self.head(self.backbone(view0)), self.head(self.backbone(view1))


class NTXent(nn.Module):
    """SimCLR's NT-Xent with a learnt temperature τ = exp(log_temperature): each of the rank's 2B
    embeddings against the 2N of the gathered global batch, its other view the positive; the
    rank's loss is the mean over its 2B rows, so the mean over ranks is the one-device loss."""

    def __init__(self, temperature: float = 0.5, gather=exact_gather):
        super().__init__()
        # one entry, not a scalar: fully_shard shards no 0-d parameter
        self.log_temperature = nn.Parameter(torch.full((1,), math.log(temperature)))
        self.gather = gather

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        z0, z1 = F.normalize(z0, dim=1), F.normalize(z1, dim=1)
        every0, every1 = self.gather(z0), self.gather(z1)
        total, rows = len(every0), len(z0)
        start = dist.get_rank() * rows if distributed() else 0
        mine = torch.arange(start, start + rows, device=z0.device)
        logits = torch.cat([z0, z1]) @ torch.cat([every0, every1]).T / self.log_temperature.exp()
        own_columns = torch.cat([mine, mine + total])  # each row against itself: masked out
        itself = torch.zeros_like(logits, dtype=torch.bool)
        itself[torch.arange(2 * rows, device=z0.device), own_columns] = True
        logits = logits.masked_fill(itself, float("-inf"))
        positives = torch.cat([mine + total, mine])
        return F.cross_entropy(logits, positives)


class Objective(nn.Module):
    """The model and its loss in one module, ``objective(view0, view1)`` the loss: what DDP or
    FSDP2 wraps so that the temperature's gradient is reduced with the model's."""

    def __init__(self, model: nn.Module, criterion: nn.Module):
        super().__init__()
        self.model, self.criterion = model, criterion

    def forward(self, view0, view1):
        return self.criterion(*self.model(view0, view1))


def build(args: argparse.Namespace, device: torch.device) -> tuple[SimCLR, NTXent]:
    """The model and the loss, the same initial weights on every rank (seeded)."""
    torch.manual_seed(args.seed)
    model = SimCLR(local_batchnorm=args.bug == "local-batchnorm")
    criterion = NTXent(gather=old_gather if args.bug == "old-gather" else exact_gather)
    return model.to(device, args.dtype), criterion.to(device, args.dtype)


def optimizer(parameters, args: argparse.Namespace) -> torch.optim.Optimizer:
    if args.optimizer == "adam":
        return torch.optim.Adam(parameters, lr=args.lr)
    return torch.optim.SGD(parameters, lr=args.lr, momentum=0.9)


def optimizer_class(args: argparse.Namespace) -> tuple[type[torch.optim.Optimizer], dict]:
    """The optimizer's class and settings (for ZeroRedundancyOptimizer)."""
    if args.optimizer == "adam":
        return torch.optim.Adam, {"lr": args.lr}
    return torch.optim.SGD, {"lr": args.lr, "momentum": 0.9}


def global_loss(loss: torch.Tensor) -> float:
    """The mean over ranks of the ranks' losses: the one-device loss."""
    loss = loss.detach().clone()
    if distributed():
        dist.all_reduce(loss)
        loss /= dist.get_world_size()
    return loss.item()


def report(update: int, loss: float) -> None:
    if not distributed() or dist.get_rank() == 0:
        print(f"update {update} loss {loss!r}", flush=True)


def report_weights(parts: dict[str, nn.Module | nn.Parameter]) -> None:
    """``weights PART NORM`` per part, the parameters' full values (an FSDP2 shard gathered, a
    collective: every rank calls this)."""
    from torch.distributed.tensor import DTensor

    norms = {}
    for name, part in parts.items():
        tensors = [part] if isinstance(part, torch.Tensor) else list(part.parameters())
        full = [t.full_tensor() if isinstance(t, DTensor) else t for t in tensors]
        norms[name] = torch.cat([t.detach().double().flatten().cpu() for t in full]).norm().item()
    if not distributed() or dist.get_rank() == 0:
        for name, norm in norms.items():
            print(f"weights {name} {norm!r}", flush=True)


def finish() -> None:
    """The process group destroyed once every rank is done (a barrier) and the objects that hold
    it are freed (called after the job's ``main`` returns, cycles collected first). Measured here
    on gloo: without the barrier, a rank that tore down while rank 0 still wrote aborted
    ("terminate called without an active exception", 1 of 6 runs); a ZeroRedundancyOptimizer
    freed after the group hung the exit (2 of 5); FSDP2's modules, in reference cycles until the
    interpreter's exit, aborted it so after the group was destroyed (1 of 8 runs at W = 4, and
    once in the 69 launches of experiments/jobs.py; with the collection first, 0 of 28)."""
    if distributed():
        gc.collect()  # what main left in reference cycles (FSDP2's modules) freed first
        dist.barrier()
        dist.destroy_process_group()
