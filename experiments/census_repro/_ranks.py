"""What every reproducer of the census shares: a loss ``loss(z0, z1)`` run on one device (no
process group) and on W gloo ranks of this machine (each with its rows), and the numbers that
differ. Plain torch; no gatherlab.

The gradient compared is of the embeddings z0 and z1 themselves, after DDP's average: each
rank's gradient of its rows divided by W (DDP averages the parameters' gradients; on embeddings
this is the same factor), gathered, against one device's gradient of all rows.

The fixed versions communicate with ``all_reduce_sum`` and ``all_gather_rows`` (autograd-aware
collectives whose backward sums the ranks' gradients), imported from
``experiments/census_fixes.py``, the module the census's fixes use, and importable from here.
"""

from __future__ import annotations

import os
import socket
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

EXPERIMENTS = str(Path(__file__).resolve().parents[1])  # where census_fixes is
if EXPERIMENTS not in sys.path:
    sys.path.insert(0, EXPERIMENTS)
from census_fixes import all_gather_rows, all_reduce_sum  # noqa: E402

__all__ = ["Loss", "all_gather_rows", "all_reduce_sum", "compare"]

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _views(rows: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    z0 = torch.randn(rows, dim, generator=generator, dtype=torch.float64)
    return z0, z0 + 0.5 * torch.randn(rows, dim, generator=generator, dtype=torch.float64)


def _run(loss: Loss, z0: torch.Tensor, z1: torch.Tensor) -> tuple[float, torch.Tensor]:
    z0, z1 = z0.clone().requires_grad_(), z1.clone().requires_grad_()
    value = loss(z0, z1)
    value.backward()
    grads = [torch.zeros_like(z) if z.grad is None else z.grad for z in (z0, z1)]
    return value.item(), torch.cat(grads, 1)


def _rank(rank: int, world_size: int, port: int, loss: Loss, rows: int, dim: int, seed: int):
    warnings.filterwarnings("ignore", "torch.distributed.nn.functional", FutureWarning)
    z0, z1 = _views(rows, dim, seed)
    one_loss, one_grad = _run(loss, z0, z1)  # one device: before any process group exists
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    part = slice(rank * rows // world_size, (rank + 1) * rows // world_size)
    rank_loss, rank_grad = _run(loss, z0[part], z1[part])
    losses = [torch.zeros(1, dtype=torch.float64) for _ in range(world_size)]
    dist.all_gather(losses, torch.tensor([rank_loss], dtype=torch.float64))
    grads = [torch.zeros_like(rank_grad) for _ in range(world_size)]
    dist.all_gather(grads, rank_grad / world_size)  # DDP's average
    if rank == 0:
        mean_loss, grad = torch.cat(losses).mean().item(), torch.cat(grads)
        cosine = torch.nn.functional.cosine_similarity(grad.flatten(), one_grad.flatten(), 0)
        print(
            f"  W = {world_size}: loss {mean_loss:.6g} (one device {one_loss:.6g}, relative "
            f"difference {abs(mean_loss - one_loss) / abs(one_loss):.3g}); gradient cosine "
            f"{cosine:.4g}, norm ratio {grad.norm() / one_grad.norm():.4g}"
        )
    dist.destroy_process_group()


def compare(label: str, loss: Loss, world_sizes=(2, 4), rows: int = 16, dim: int = 8, seed=0):
    """Prints ``label``, then per W the global loss (the mean over ranks of each rank's loss)
    and the gradient against one device's."""
    print(label)
    for world_size in world_sizes:
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            port = free.getsockname()[1]
        mp.spawn(_rank, (world_size, port, loss, rows, dim, seed), nprocs=world_size)
