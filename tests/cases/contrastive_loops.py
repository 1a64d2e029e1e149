"""A plain loop of in-batch contrastive training recorded with `gatherlab.record`, as a job writes
it: an MLP embeds two views of each row; an InfoNCE loss scores each first view against every
second view of the batch (its own the positive), over the batch gathered across ranks by
gatherlab's exact gather (``gatherlab.gather.Fixed``: the backward sums every rank's gradient).
One device is the plain call; on W ranks a rank of gatherlab's pool, torch's DDP, each rank its
contiguous slice of every global batch, in K micro-batches accumulated (each loss divided by K).

Its slips: ``local``, no gather (each rank's rows are its own rows' only negatives); ``scaled``,
the loss module returning the loss divided by W (on top of DDP's average); with ``micro_batches``
K > 1 and the gather, each micro-batch's rows meet only that micro-batch's (naive accumulation).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gatherlab.gather
import gatherlab.record

GLOBAL, STEPS, DIM = 16, 2, 6


class InfoNCE(nn.Module):
    """Each first view against every second view of the (gathered) batch, at temperature 0.5;
    the rank's rows' mean cross-entropy (times 1/W for ``scaled``)."""

    def __init__(self, local: bool = False, scaled: bool = False) -> None:
        super().__init__()
        self.local, self.scaled = local, scaled
        self.gather = gatherlab.gather.Fixed()

    def forward(self, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        candidates = second if self.local else self.gather(second)
        offset = 0 if self.local else rank * len(first)
        logits = F.normalize(first, dim=1) @ F.normalize(candidates, dim=1).T / 0.5
        targets = torch.arange(len(first)) + offset
        loss = F.cross_entropy(logits, targets)
        return loss / world if self.scaled else loss


def loop(
    out: str, bug: str = "", micro_batches: int = 1, trace: bool = False, seed: int = 0,
    chunks: int = 1, dtype: str = "float64",
) -> None:  # fmt: skip
    """Trains ``STEPS`` updates of SGD and records them into ``out`` (``bug``: ``local``,
    ``scaled`` or none; ``chunks``: the rows embedded in that many calls, one loss over them all,
    as a job that embeds in chunks does; ``dtype``: the model's and the views')."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 8)).to(getattr(torch, dtype))
    criterion = InfoNCE(local=bug == "local", scaled=bug == "scaled")
    trained = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    points = torch.randn(GLOBAL * STEPS, DIM, generator=generator, dtype=torch.float64)
    views = [(points + 0.1 * torch.randn(points.shape, generator=generator,
                                         dtype=torch.float64)).to(getattr(torch, dtype))
             for _ in range(2)]  # fmt: skip
    rows = GLOBAL // world // micro_batches
    with gatherlab.record(trained, optimizer, out, loss=criterion, seed=0, trace=trace):
        for update in range(STEPS):
            optimizer.zero_grad()
            for micro in range(micro_batches):
                start = update * GLOBAL + rank * GLOBAL // world + micro * rows
                batch = slice(start, start + rows)
                both = torch.cat([views[0][batch], views[1][batch]])
                embedded = torch.cat([trained(part) for part in both.chunk(chunks)])
                (criterion(*embedded.chunk(2)) / micro_batches).backward()
            optimizer.step()
