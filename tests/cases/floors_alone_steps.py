"""Plain steps for the check judged in floors alone (docs/design.md §2, "Low precision at size"),
on plain_steps' small model: the exact step, and the same step with the old gather (each rank's
gradient reaches only its own slice of the gathered embeddings: after DDP's average the whole
gradient is 1/W of one device's, docs/design.md §1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from plain_steps import training_step
from torch import nn

from gatherlab.gather import get

__all__ = ["THREADS", "counting_threads_step", "old_gather_step", "training_step"]

THREADS: list[tuple[str, int]] = []
"""What `counting_threads_step` saw in this process: each step's dtype and torch's threads."""


def old_gather_step(model: nn.Module, batch) -> torch.Tensor:
    """plain_steps' NT-Xent of both views, gathered with the old gather."""
    gather = get("old")
    x0, x1 = batch
    z0, z1 = model(torch.cat([x0, x1])).chunk(2)
    z = F.normalize(torch.cat([gather(z0), gather(z1)]), dim=1)
    logits = z @ z.T / 0.5
    logits = logits.masked_fill(torch.eye(len(z), dtype=torch.bool), -torch.inf)
    n = len(z) // 2
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return F.cross_entropy(logits, targets)


def counting_threads_step(model: nn.Module, batch) -> torch.Tensor:
    """plain_steps' step, noting its parameters' dtype and torch's intra-op threads (in the
    process that runs it: the command's one-device runs are seen here, the ranks' are not)."""
    THREADS.append((str(next(model.parameters()).dtype), torch.get_num_threads()))
    return training_step(model, batch)
