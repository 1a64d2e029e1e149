"""A tensor- and sequence-parallel block recorded with `gatherlab.record`: one device is the plain
call (no process group); on W ranks of gatherlab's pool, ``parallelize_module`` on the ``tp``
dimension of a ``(dp, tp)`` mesh, and at dp > 1 FSDP2's ``fully_shard`` on ``dp`` after it (the
2-D placements: ``_StridedShard`` beside ``Shard``). Sizes are uneven on purpose (7 hidden
features cut in 4 + 3 over tp = 2, 5 features cut in 3 + 2 by FSDP2), so that shards fall across
the sketch's blocks of k = 7.

Bug ``norm_outside``: the LayerNorm left out of the plan while its input is the sequence shard,
so its parameters are plain tensors and each tp rank's gradient is the sum over its own positions
only (never reduced over tp). Bug ``local_head``: the head's output left each rank's shard of the
features (no ``output_layouts=Replicate()``), over which the loss's log-sum-exp runs (one device's
runs over all of them). Bug ``local_clip``: each rank clips its gradient by the norm of its own
shards (and its own copies of the replicated weights), not the whole gradient's."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gatherlab.record

BATCH, SEQUENCE, FEATURES, HIDDEN, OUTPUTS, STEPS = 4, 4, 5, 6, 4, 3


class Block(nn.Module):
    """A LayerNorm, an MLP with a residual and a linear head; its parts are its four layers."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(FEATURES)
        self.up = nn.Linear(FEATURES, HIDDEN)
        self.down = nn.Linear(HIDDEN, FEATURES)
        self.head = nn.Linear(FEATURES, OUTPUTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.down(F.gelu(self.up(self.norm(x)))))


def _parallel(block: Block, tp: int, bug: str, whole: bool = False) -> tuple[int, int, int]:
    """(dp, dp rank, tp rank): the block parallelized over the ranks (dp = W / tp); ``whole``:
    its input declared whole (``PrepareModuleInput``: each rank given the group's whole rows, cut
    into its sequence shard by the plan)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    dp = dist.get_world_size() // tp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    plan = {
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    if bug == "local_head":
        plan["head"] = ColwiseParallel(input_layouts=Shard(1))
    if bug != "norm_outside":
        plan["norm"] = SequenceParallel()
    if whole:
        cut = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                 use_local_output=True)  # fmt: skip
        parallelize_module(block, mesh["tp"], cut)
    parallelize_module(block, mesh["tp"], plan)
    if dp > 1:
        fully_shard(block, mesh=mesh["dp"])
    coordinate = mesh.get_coordinate()
    return dp, coordinate[0], coordinate[1]


def loop(out: str, tp: int = 2, bug: str = "", given: str = "recipe") -> dict[str, str]:
    """Trains ``STEPS`` updates of SGD with momentum, records them (k = 7, the first update's
    whole gradient) and returns each parameter's gradient placements as rank 0 last saw them.
    ``given``: how the rows reach the recorder: ``recipe``, each rank's model given its sequence
    shard, the rows given by the job (``batches=False``, ``recorder.batch`` on each group's first
    rank); ``whole``, the one documented line on every rank and every rank's model given its
    group's whole rows (the plan cuts them); ``shards``, the one line while each rank's model is
    given its own sequence shard (which the recorder cannot count: refused)."""
    torch.manual_seed(0)
    block = Block().double()
    dp, dp_rank, tp_rank = (1, 0, 0)
    if dist.is_available() and dist.is_initialized():
        dp, dp_rank, tp_rank = _parallel(block, tp, bug, whole=given == "whole")
    else:
        tp = 1
    optimizer = torch.optim.SGD(block.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    rows = BATCH // dp
    criterion = nn.MSELoss()
    if given == "recipe":
        recorder = gatherlab.record(block, optimizer, out, seed=0, k=7, full_updates=1,
                                    batches=False)  # fmt: skip
    else:
        recorder = gatherlab.record(block, optimizer, out, loss=criterion, seed=0, k=7,
                                    full_updates=1)  # fmt: skip
    for _ in range(STEPS):
        x = torch.randn(BATCH, SEQUENCE, FEATURES, generator=generator, dtype=torch.float64)
        y = torch.randn(BATCH, SEQUENCE, OUTPUTS, generator=generator, dtype=torch.float64)
        x, y = x[dp_rank * rows : (dp_rank + 1) * rows], y[dp_rank * rows : (dp_rank + 1) * rows]
        if given == "recipe" and tp_rank == 0:  # a tp group's rows, given by its first rank
            recorder.batch(x)
        optimizer.zero_grad()
        out = block(x if given == "whole" else x.chunk(tp, dim=1)[tp_rank])
        loss = torch.logsumexp(out, dim=-1).mean() if bug == "local_head" else criterion(out, y)
        if given == "recipe":
            recorder.loss(loss)
        loss.backward()
        if bug == "local_clip":
            _clip_by_own_norm(block, 0.1)
        optimizer.step()
    recorder.close()
    return {name: str(getattr(p.grad, "placements", None)) for name, p in block.named_parameters()}


def _clip_by_own_norm(block: nn.Module, bound: float) -> None:
    """The gradient scaled by bound / (its norm) where that is below 1, the norm taken over the
    tensors this rank holds (the ``local_clip`` bug; on one device, torch's clipping)."""
    held = [getattr(p.grad, "to_local", lambda g=p.grad: g)() for p in block.parameters()]
    norm = float(torch.sqrt(sum(g.pow(2).sum() for g in held)))
    for g in held:
        g.mul_(min(1.0, bound / norm))
