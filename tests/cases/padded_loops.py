"""A plain training loop over text padded per device batch, recorded with `gatherlab.record`, as a
job writes it: sentences of 3 to 9 token ids, a collator that pads each device batch to its own
longest (``torch.nn.utils.rnn.pad_sequence`` with the pad id 0, ``batch_first``), a model of an
embedding with ``padding_idx=0``, a mean over each sentence's own tokens and a linear head, an MSE
to a target per sentence. One device is the plain call (no process group); on W ranks, a rank of
gatherlab's pool with torch's DDP, each rank its contiguous slice of every global batch, padded to
its own longest: one sentence is a row of another length at every W. ``mask``: the collator
also returns the attention mask and the model takes it as its second argument (``model(ids,
mask)``); else the model finds the padding itself (its ids of 0). ``fixed``: every sentence
of 8 ids, no padding at all (a language model's synthetic data of one length), no mask.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import gatherlab.record

GLOBAL, STEPS, VOCABULARY = 8, 3, 32


class Bag(nn.Module):
    """An embedding of the ids (the pad id 0 embeds to 0), the mean over each row's tokens, and a
    linear head: each sentence's output is its own, however it is padded."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCABULARY, 8, padding_idx=0)
        self.head = nn.Linear(8, 2)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        mask = (ids != 0) if mask is None else mask.bool()
        summed = (self.embedding(ids) * mask.unsqueeze(-1)).sum(1)
        return self.head(summed / mask.sum(1, keepdim=True))


def sentences(fixed: bool = False) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``GLOBAL * STEPS`` sentences of 3 to 9 ids (``fixed``: 8) in 1 … VOCABULARY − 1, and a
    target each."""
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(3, 10, (GLOBAL * STEPS,), generator=generator)
    if fixed:
        lengths = torch.full_like(lengths, 8)
    ids = [torch.randint(1, VOCABULARY, (int(n),), generator=generator) for n in lengths]
    return ids, torch.randn(GLOBAL * STEPS, 2, generator=generator, dtype=torch.float64)


def collate(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows padded to the batch's longest with 0, and their attention mask."""
    ids = nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0)
    return ids, (ids != 0).long()


def loop(out: str, mask: bool = False, fixed: bool = False) -> None:
    """Trains ``STEPS`` updates of SGD on the padded sentences and records them into ``out``."""
    distributed = dist.is_available() and dist.is_initialized()
    world_size, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    torch.manual_seed(0)
    model = Bag().double()
    trained = nn.parallel.DistributedDataParallel(model) if world_size > 1 else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ids, targets = sentences(fixed)
    rows = GLOBAL // world_size
    with gatherlab.record(trained, optimizer, out, seed=0):
        for update in range(STEPS):
            start = update * GLOBAL + rank * rows
            batch, attention = collate(ids[start : start + rows])
            optimizer.zero_grad()
            output = trained(batch, attention) if mask else trained(batch)
            nn.functional.mse_loss(output, targets[start : start + rows]).backward()
            optimizer.step()
