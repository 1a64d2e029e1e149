"""Plain training loops recorded with `gatherlab.record`, as a job runs them: one device is the
plain call (no process group); on W ranks each runs inside a rank of gatherlab's pool
(``pools.pool(W).run(loop, out, ...)``), where torch's DDP, FSDP2 (``fully_shard`` on a ``cpu``
mesh) or ``ZeroRedundancyOptimizer`` wrap the same model. The data: a fixed global batch of
``GLOBAL`` rows per update, rank r taking its contiguous slice.

Bugs, each named by its switch: ``divide_twice`` (the loss divided by W on top of DDP's average),
``temperature_outside`` (a learnt scale outside every wrapper: its gradient is not reduced),
``batchnorm`` (a per-rank BatchNorm1d in the body: its statistics are each rank's),
``accumulate_sum`` (micro-batches' losses summed, not averaged: the gradient is K times),
``desync`` (the last rank's learning rate 1 % larger from update 2: the ranks step apart),
``desync_last`` (the same from the last update only: its step alone parts the ranks).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

import gatherlab.record

GLOBAL, STEPS, DIM = 16, 4, 8


class Scaled(nn.Module):
    """A mean-squared error whose prediction is multiplied by a learnt scale (a temperature)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor([1.5], dtype=torch.float64))
        self.divisor = 1  # the bug ``divide_in_loss``: the loss divided by K in the loss itself
        self.in_float32 = False  # the mean in float32 (``logits.float()`` in a float64 job)

    def forward(self, prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        squares = (prediction * self.scale - target) ** 2
        loss = (squares.float() if self.in_float32 else squares).mean()
        return loss if self.divisor == 1 else loss / self.divisor


class Mixed(nn.Module):
    """Each row mixed with another row of the same call at random (mixup inside the forward): a
    random draw that depends on the call's rows, so that in row blocks it draws otherwise."""

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return 0.5 * rows + 0.5 * rows[torch.randperm(len(rows))]


class Net(nn.Module):
    """A small MLP and, unless it is given one at each call (outside), its loss."""

    def __init__(
        self, criterion: nn.Module | None, batchnorm: bool = False, mixed: bool = False
    ) -> None:
        super().__init__()
        norm = nn.BatchNorm1d(16) if batchnorm else nn.Identity()
        drawn = [Mixed()] if mixed else []
        layers = [nn.Linear(DIM, 16), norm, nn.Tanh(), *drawn, nn.Linear(16, 16), nn.Tanh()]
        self.body = nn.Sequential(*layers, nn.Linear(16, 4)).double()
        self.criterion = criterion

    def forward(self, batch, target, criterion: nn.Module | None = None) -> torch.Tensor:
        return (criterion or self.criterion)(self.body(batch), target)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(GLOBAL * STEPS, DIM, generator=generator, dtype=torch.float64)
    return x, torch.randn(GLOBAL * STEPS, 4, generator=generator, dtype=torch.float64)


def loop(
    out: str, wrap: str = "ddp", bug: str = "", k: int = 64, full_updates: int = 1,
    trace: bool = False, micro_batches: int = 1, dtype: str = "float64", row_blocks: int = 1,
    autocast: str | None = None, mixed: bool = False, float32_loss: bool = False,
) -> None:  # fmt: skip
    """Trains ``STEPS`` updates of SGD and records them into ``out``; ``wrap``: ``ddp``,
    ``fsdp2`` or ``zero`` (DDP with ``ZeroRedundancyOptimizer``); without a process group the
    plain model. ``trace``: the recorder traces the first update's forward. ``micro_batches``:
    each rank accumulates its rows in that many micro-batches, each loss divided by their number
    (DDP reduces at every backward: the gradient is the same). ``dtype``: the model's and the
    data's (``float32``: a low precision's recording); ``row_blocks``: on one device, the body's
    forward in that many row blocks (the floor's recording, `gatherlab.record.in_row_blocks`);
    ``autocast``: the forward under ``torch.autocast`` in that dtype (``bfloat16``: bf16-mixed,
    with float32 parameters); ``mixed``: each row mixed with another of its call at random in the
    body (`Mixed`: in row blocks, the floor's forward draws otherwise); ``float32_loss``: the
    loss a float32 mean of the float64 model's squares (``logits.float()``)."""
    world_size, rank = _world()
    torch.manual_seed(0)
    criterion = Scaled().to(getattr(torch, dtype))
    criterion.in_float32 = float32_loss
    if bug == "divide_in_loss":  # divided by K again, where the loss is recorded (a pipeline's
        criterion.divisor = micro_batches  # loss function divided, its schedule scaling too)
    outside = bug == "temperature_outside"
    network = Net(None if outside else criterion, batchnorm=bug == "batchnorm",
                  mixed=mixed)  # fmt: skip
    network.to(getattr(torch, dtype))
    if row_blocks > 1:
        gatherlab.record.in_row_blocks(network.body, row_blocks)
    trained: nn.Module = network
    if world_size > 1 and wrap == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for layer in network.body:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(network, mesh=mesh)
    elif world_size > 1:
        trained = nn.parallel.DistributedDataParallel(network)
    parameters = [*network.parameters(), *(criterion.parameters() if outside else ())]
    if wrap == "zero" and world_size > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(parameters, torch.optim.SGD, lr=0.1)
    else:
        optimizer = torch.optim.SGD(parameters, lr=0.1)
    x, y = (tensor.to(getattr(torch, dtype)) for tensor in _data())
    rows = GLOBAL // world_size
    recorder = gatherlab.record(
        trained, optimizer, out, loss=criterion, seed=0, k=k, full_updates=full_updates,
        trace=trace,
    )  # fmt: skip
    for update in range(STEPS):
        parts_at = {"desync": 2, "desync_last": STEPS - 1}.get(bug)
        if update == parts_at and rank == world_size - 1 and world_size > 1:
            for group in optimizer.param_groups:
                group["lr"] *= 1.01
        optimizer.zero_grad()
        for micro in range(micro_batches):  # each rank's rows, one micro-batch after the other
            start = update * GLOBAL + rank * rows + micro * (rows // micro_batches)
            batch = slice(start, start + rows // micro_batches)
            mixed = contextlib.nullcontext() if autocast is None else torch.autocast(
                "cpu", dtype=getattr(torch, autocast))  # fmt: skip
            with mixed:
                loss = trained(x[batch], y[batch], criterion if outside else None)
            if bug == "divide_twice":
                loss = loss / world_size
            (loss if bug == "accumulate_sum" else loss / micro_batches).backward()
        optimizer.step()
    recorder.close()
