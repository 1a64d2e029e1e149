"""Plain PyTorch training loops recorded with `gatherlab.record.Recorder`, for the comparison of
recordings (``tests/check/test_recordings.py``, ``tests/journeys/test_compare_cli.py``). Each runs
on one device without a process group, or on a rank of a gloo group (gatherlab's pool), and writes
its recording from rank 0.

- `train`: the loop of gatherlab's check of a plain step (``runs.plainstep.Step``: the model of
  ``plain_steps.build_model`` built after the seed in float64, torch's DDP on W ranks, SGD, each
  rank the r-th consecutive part of the check's global batches), with the recorder added; the
  step is ``plain_steps.training_step`` (exact at every W), `divided_twice` (the loss divided by
  W on top of DDP's average: the gradient is 1/W of one device's, the loss too), or with
  ``divide_gradients`` the gradients divided by W after the backward (1/W, the loss one
  device's); ``sampler="torch"``: torch's samplers as a script uses them, ``RandomSampler`` on
  one device and ``DistributedSampler`` on W ranks (another global batch at every update).

DDP, FSDP2 and ZeRO loops with a temperature outside every wrapper are ``recorded_loops``'.
"""

from __future__ import annotations

from pathlib import Path

import plain_steps
import torch
import torch.distributed as dist
from torch import nn


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def divided_twice(model: nn.Module, batch) -> torch.Tensor:
    """``plain_steps.training_step``'s loss divided by W, where DDP already averages."""
    return plain_steps.training_step(model, batch) / world_size()


def _spec(steps: int, global_batch_size: int, seed: int):
    from gatherlab.components.factory import Recipe
    from gatherlab.runs.spec import RunSpec

    data = Recipe(plain_steps.Pairs, {}, None, seed)
    return RunSpec(data=data, global_batch_size=global_batch_size, steps=steps, seed=seed,
                   precision="64-true")  # fmt: skip


def _torch_batches(data, steps: int, global_batch_size: int, seed: int):
    """torch's samplers as a training script uses them: ``RandomSampler`` on one device,
    ``DistributedSampler`` (its own shuffle, strided per rank) on W ranks."""
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

    size = world_size()
    if size == 1:
        sampler = RandomSampler(data)  # its seed drawn from torch's global generator
    else:
        sampler = DistributedSampler(data, size, rank(), shuffle=True, seed=seed)
    loader = DataLoader(data, batch_size=global_batch_size // size, sampler=sampler)
    for index, batch in enumerate(loader):
        if index == steps:
            return
        yield [view.double() for view in batch]


def train(
    out: str | Path,
    step: str = "training_step",
    *,
    steps: int = 4,
    global_batch_size: int = 16,
    seed: int = 0,
    lr: float = 0.01,
    k: int = 64,
    full_updates: int = 1,
    divide_gradients: bool = False,
    sampler: str = "global",
    model_kwargs: dict | None = None,
    trace: bool = False,
) -> None:
    """The check's loop of a plain step, recorded into ``out`` (see the module); ``trace``: the
    recorder traces the first update's forward."""
    from gatherlab.components.factory import Recipe
    from gatherlab.record import Recorder
    from gatherlab.runs import plainstep

    function = globals().get(step) or getattr(plain_steps, step)
    spec = _spec(steps, global_batch_size, seed)
    model = Recipe(plain_steps.build_model, dict(model_kwargs or {}), None, seed)().double()
    data = spec.data()
    wrapped = plainstep.wrapped_for_rank(model, torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    plainstep.seed_processes(seed)
    if sampler == "torch":
        batches = _torch_batches(data, steps, global_batch_size, seed)
    else:
        batches = (plainstep.as_precision(b, "64-true") for b in plainstep.rank_batches(data, spec))
    with Recorder(
        model, optimizer, out, k=k, full_updates=full_updates, seed=seed, trace=trace
    ) as recorder:
        for batch in batches:
            optimizer.zero_grad()
            loss = function(wrapped, batch)
            recorder.loss(loss)
            loss.backward()
            if divide_gradients:
                for parameter in model.parameters():
                    parameter.grad /= world_size()
            optimizer.step()
