"""Plain PyTorch training loops recorded with `gatherlab.record.Recorder`, for the comparison of
recordings (``tests/check/test_compare.py``, ``tests/journeys/test_compare_cli.py``). Each runs on
one device without a process group, or on a rank of a gloo group (gatherlab's pool), and writes
its recording from rank 0.

- `train`: the loop of gatherlab's check of a plain step (``runs.plainstep.Step``: the model of
  ``plain_steps.build_model`` built after the seed in float64, torch's DDP on W ranks, SGD, each
  rank the r-th consecutive part of the check's global batches), with the recorder added; the
  step is ``plain_steps.training_step`` (exact at every W), `divided_twice` (the loss divided by
  W on top of DDP's average: the gradient is 1/W of one device's, the loss too), or with
  ``divide_gradients`` the gradients divided by W after the backward (1/W, the loss one
  device's); ``sampler="torch"``: torch's samplers as a script uses them, ``RandomSampler`` on
  one device and ``DistributedSampler`` on W ranks (another global batch at every update);
- `temperature_job`: NT-Xent with a learnt temperature kept outside DDP (its gradient is each
  rank's own: not reduced over the ranks; their mean is one device's).
"""

from __future__ import annotations

import math
from pathlib import Path

import plain_steps
import torch
import torch.distributed as dist
import torch.nn.functional as F
from summing_gather import gather
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
) -> None:
    """The check's loop of a plain step, recorded into ``out`` (see the module)."""
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
    with Recorder(model, optimizer, out, k=k, full_updates=full_updates, seed=seed) as recorder:
        for batch in batches:
            optimizer.zero_grad()
            loss = function(wrapped, batch)
            recorder.loss(loss)
            loss.backward()
            if divide_gradients:
                for parameter in model.parameters():
                    parameter.grad /= world_size()
            optimizer.step()


class LearntTemperature(nn.Module):
    """NT-Xent of the rank's own rows (its anchors, both views) against the gathered batch
    (every rank's rows, a summing gather), its temperature learnt: each rank's loss is its
    anchors' mean, so the mean over ranks is one device's loss, and the temperature's gradient
    on a rank is its own anchors' (their mean over ranks one device's)."""

    def __init__(self, temperature: float = 0.5):
        super().__init__()
        self.log_temperature = nn.Parameter(torch.tensor(math.log(temperature)))

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        rows, start = len(z0), rank() * len(z0)
        anchors = F.normalize(torch.cat([z0, z1]), dim=1)
        every = F.normalize(torch.cat([gather(z0), gather(z1)]), dim=1)
        n = len(every) // 2
        own = torch.arange(start, start + rows)
        logits = anchors @ every.T / self.log_temperature.exp()
        itself = torch.zeros_like(logits, dtype=torch.bool)
        itself[torch.arange(2 * rows), torch.cat([own, n + own])] = True
        logits = logits.masked_fill(itself, -torch.inf)
        return F.cross_entropy(logits, torch.cat([n + own, own]))


def temperature_job(out: str | Path, *, steps: int = 4, seed: int = 0, lr: float = 0.05,
                    k: int = 64) -> None:  # fmt: skip
    """NT-Xent with its temperature outside DDP: the model in DDP, the criterion beside it, both
    in one SGD; recorded into ``out`` with the criterion's parameter as part
    ``loss.log_temperature``."""
    from gatherlab.components.factory import Recipe
    from gatherlab.record import Recorder
    from gatherlab.runs import plainstep

    spec = _spec(steps, 16, seed)
    model = Recipe(plain_steps.build_model, {}, None, seed)().double()
    criterion = LearntTemperature().double()
    wrapped = plainstep.wrapped_for_rank(model, torch.device("cpu"))
    optimizer = torch.optim.SGD([*model.parameters(), *criterion.parameters()], lr=lr)
    plainstep.seed_processes(seed)
    with Recorder(model, optimizer, out, loss=criterion, k=k, seed=seed) as recorder:
        for batch in plainstep.rank_batches(spec.data(), spec):
            x0, x1 = plainstep.as_precision(batch, "64-true")
            optimizer.zero_grad()
            z0, z1 = wrapped(torch.cat([x0, x1])).chunk(2)
            loss = criterion(z0, z1)
            recorder.loss(loss)
            loss.backward()
            optimizer.step()
