"""Losses that take more than the two views' embeddings, as papers' code writes them, and the
functions that make those further inputs for a global batch, for ``gatherlab.check`` to take
with no wrapper (docs/checking.md §6, "A loss's inputs"):
``python -m gatherlab.check input_losses:masked_nt_xent --inputs input_losses:kept_rows``.

- ``masked_nt_xent(z0, z1, keep)``: NT-Xent over every rank's embeddings (an exact gather), the
  rows a boolean mask drops (padding, filtered pairs) left out; each rank's loss is the mean over
  its own kept rows. The ranks keep different numbers of rows, so the mean over ranks of those
  means is not one device's mean over all kept rows: the loss differs.
- ``masked_nt_xent_counted``: the same, each rank's sum divided by the kept rows of every rank
  (counted with an ``all_reduce``) and multiplied by W, as DDP averages: exact.
- ``masked_sigmoid(z0, z1, keep)``: a SigLIP-style sigmoid loss over the rank's own kept rows,
  no gather: its negatives are local.
- ``distilled(z0, z1, *, teacher)``: a per-sample distillation loss against a teacher's outputs
  given by keyword, a row per sample: exact.
- ``assigned(z0, z1, prototypes)``: a per-sample loss against prototypes that every rank holds
  whole (their number is not the batch's): exact.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from summing_gather import gather


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _every_row_loss(z0: torch.Tensor, z1: torch.Tensor, temperature: float) -> torch.Tensor:
    """Each own row's NT-Xent against every rank's rows of both views."""
    rank, _ = _world()
    z0, z1 = F.normalize(z0, dim=1), F.normalize(z1, dim=1)
    every0, every1 = gather(z0), gather(z1)
    n = len(z0)
    mine = torch.arange(n) + rank * n
    logits = z0 @ torch.cat([every1, every0]).T / temperature
    logits[torch.arange(n), len(every1) + mine] = float("-inf")  # not itself
    return F.cross_entropy(logits, mine, reduction="none")


def masked_nt_xent(
    z0: torch.Tensor, z1: torch.Tensor, keep: torch.Tensor, temperature: float = 0.5
) -> torch.Tensor:
    return _every_row_loss(z0, z1, temperature)[keep].mean()


def masked_nt_xent_counted(
    z0: torch.Tensor, z1: torch.Tensor, keep: torch.Tensor, temperature: float = 0.5
) -> torch.Tensor:
    _, world_size = _world()
    kept = keep.sum().to(z0.dtype)
    if world_size > 1:
        dist.all_reduce(kept)  # every rank's kept rows
    return _every_row_loss(z0, z1, temperature)[keep].sum() * world_size / kept


def kept_rows(global_batch_size: int) -> tuple[torch.Tensor]:
    """A mask of the rows to keep, drawn: the ranks keep different numbers of them."""
    return (torch.rand(global_batch_size) < 0.6,)


def masked_sigmoid(
    z0: torch.Tensor, z1: torch.Tensor, keep: torch.Tensor, temperature: float = 0.1
) -> torch.Tensor:
    z0, z1 = F.normalize(z0[keep], dim=1), F.normalize(z1[keep], dim=1)
    labels = 2 * torch.eye(len(z0), dtype=z0.dtype) - 1  # +1 on the pairs, -1 elsewhere
    return -F.logsigmoid(labels * (z0 @ z1.T) / temperature).sum() / len(z0)


def distilled(
    z0: torch.Tensor, z1: torch.Tensor, *, teacher: torch.Tensor, temperature: float = 0.2
) -> torch.Tensor:
    target = F.softmax(teacher / temperature, dim=1)
    student = F.log_softmax(torch.cat([z0, z1], dim=1)[:, : teacher.shape[1]] / temperature, dim=1)
    return -(target * student).sum(dim=1).mean()


def teacher_outputs(global_batch_size: int, embedding_dim: int) -> dict[str, torch.Tensor]:
    """A teacher's outputs for the global batch, by keyword."""
    return {"teacher": torch.randn(global_batch_size, embedding_dim)}


def assigned(
    z0: torch.Tensor, z1: torch.Tensor, prototypes: torch.Tensor, temperature: float = 0.1
) -> torch.Tensor:
    scores0 = F.normalize(z0, dim=1) @ F.normalize(prototypes, dim=1).T / temperature
    with torch.no_grad():  # view 1's prototype, view 0's target
        targets = (F.normalize(z1, dim=1) @ F.normalize(prototypes, dim=1).T).argmax(dim=1)
    return F.cross_entropy(scores0, targets)


def prototypes(embedding_dim: int) -> tuple[torch.Tensor]:
    """Ten prototypes, held whole by every rank."""
    return (torch.randn(10, embedding_dim),)
