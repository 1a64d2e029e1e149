"""Whole optimizer updates written the way public training loops write them (a model, torch's
optimizer, the update's own forwards and backwards over K micro-batches, no gatherlab imports), for
the check of a whole update (``--update``, docs/checking.md §10). Each takes ``(model, optimizer,
batch, micro_batches)``, splits its rows (the two views of ``plain_steps.Pairs``) into K
contiguous micro-batches, steps the optimizer once and returns the loss it logs. What a correct
check finds, against one device with the whole batch and K = 1 (N rows, W ranks, B = N/W):

- ``naive``: the NT-Xent of each micro-batch, divided by K, one backward each (the gather of
  ``plain_steps.nt_xent`` gathers the k-th micro-batch of every rank): the loss is the mean over k
  of one device's loss of the rows of every rank's k-th micro-batch alone, its negatives only
  those rows; exact at K = 1.
- ``cached``: GradCache's scheme: every micro-batch's embeddings without gradient, the loss over
  all of them (gathered over the ranks with a gradient-summing gather) and its gradient with
  respect to them, then one recomputation per micro-batch backpropagating its rows of that
  gradient: exact at every (W, K).
- ``cached_divided``: the same with the loss divided by K: every gradient is 1/K of one device's
  and the logged loss too.
- ``cached_temperature`` with ``build_with_temperature``: a learnt temperature, the loss
  recomputed in each of the K passes (the recomputed micro-batch's rows live, the others cached):
  the model's gradient is exact, the temperature's K times one device's.
- ``cached_clipped``: ``cached`` with the gradient clipped to norm ``CLIP`` before the step: the
  gradient the optimizer takes has norm ``CLIP`` exactly.
- ``mean_squared``: a per-sample loss (mean squared distance between the two views' outputs),
  each micro-batch's mean divided by K: exact at every (W, K).
"""

from __future__ import annotations

import math

import torch
from plain_steps import build_model, nt_xent
from torch import nn

CLIP = 1e-3


def _micro_batches(batch, micro_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    view0, view1 = batch
    return list(zip(view0.chunk(micro_batches), view1.chunk(micro_batches), strict=True))


def _embed(model: nn.Module, view0: torch.Tensor, view1: torch.Tensor):
    return model(torch.cat([view0, view1])).chunk(2)


def naive(model, optimizer, batch, micro_batches: int):
    logged = 0.0
    for view0, view1 in _micro_batches(batch, micro_batches):
        loss = nt_xent(*_embed(model, view0, view1)) / micro_batches
        loss.backward()
        logged += float(loss.detach())
    optimizer.step()
    return logged


def _cached(model, batch, micro_batches: int, loss_of, divide: bool = False):
    """The cached scheme's loss over all micro-batches, its gradient with respect to the cached
    embeddings backpropagated through one recomputation per micro-batch."""
    parts = _micro_batches(batch, micro_batches)
    with torch.no_grad():
        cached = [_embed(model, view0, view1) for view0, view1 in parts]
    z0 = torch.cat([c[0] for c in cached]).requires_grad_()
    z1 = torch.cat([c[1] for c in cached]).requires_grad_()
    loss = loss_of(z0, z1) / (micro_batches if divide else 1)
    loss.backward()
    rows = len(z0) // micro_batches
    for k, (view0, view1) in enumerate(parts):
        live0, live1 = _embed(model, view0, view1)
        own = slice(k * rows, (k + 1) * rows)
        torch.autograd.backward([live0, live1], [z0.grad[own], z1.grad[own]])
    return loss.detach()


def cached(model, optimizer, batch, micro_batches: int):
    loss = _cached(model, batch, micro_batches, nt_xent)
    optimizer.step()
    return loss


def cached_divided(model, optimizer, batch, micro_batches: int):
    loss = _cached(model, batch, micro_batches, nt_xent, divide=True)
    optimizer.step()
    return loss


def cached_clipped(model, optimizer, batch, micro_batches: int):
    loss = _cached(model, batch, micro_batches, nt_xent)
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    optimizer.step()
    return loss


class WithTemperature(nn.Module):
    """``build_model``'s network and a learnt temperature (its log), as CLIP-style models hold
    one."""

    def __init__(self, temperature: float = 0.5):
        super().__init__()
        self.net = build_model()
        self.log_temperature = nn.Parameter(torch.tensor(math.log(temperature)))

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.net(rows)


def build_with_temperature(temperature: float = 0.5) -> nn.Module:
    return WithTemperature(temperature)


def _temperature(model: nn.Module) -> torch.Tensor:
    return getattr(model, "module", model).log_temperature.exp()


def cached_temperature(model, optimizer, batch, micro_batches: int):
    parts = _micro_batches(batch, micro_batches)
    with torch.no_grad():
        cached_rows = [_embed(model, view0, view1) for view0, view1 in parts]
    logged = None
    for k, (view0, view1) in enumerate(parts):  # the loss again in each pass, one part live
        live0, live1 = _embed(model, view0, view1)
        z0 = torch.cat([live0 if j == k else c[0] for j, c in enumerate(cached_rows)])
        z1 = torch.cat([live1 if j == k else c[1] for j, c in enumerate(cached_rows)])
        loss = nt_xent(z0, z1, _temperature(model))
        loss.backward()  # the temperature's gradient, once per pass
        logged = loss.detach() if logged is None else logged
    optimizer.step()
    return logged


def mean_squared(model, optimizer, batch, micro_batches: int):
    logged = 0.0
    for view0, view1 in _micro_batches(batch, micro_batches):
        z0, z1 = _embed(model, view0, view1)
        loss = ((z0 - z1) ** 2).sum(dim=1).mean() / micro_batches
        loss.backward()
        logged += float(loss.detach())
    optimizer.step()
    return logged


def cached_learnt_temperature(model, optimizer, batch, micro_batches: int):
    """``cached`` with ``build_with_temperature``'s learnt temperature used once, in the loss over
    the cached embeddings: exact at every (W, K)."""
    loss = _cached(model, batch, micro_batches, lambda z0, z1: nt_xent(z0, z1, _temperature(model)))
    optimizer.step()
    return loss


# --- updates that break the contract: one optimizer step per update, after a backward -----------


def never_steps(model, optimizer, batch, micro_batches: int):
    loss = nt_xent(*_embed(model, *batch))
    loss.backward()
    return loss.detach()


def steps_per_micro_batch(model, optimizer, batch, micro_batches: int):
    """One step per micro-batch: right at K = 1, two steps at K = 2."""
    logged = 0.0
    for view0, view1 in _micro_batches(batch, micro_batches):
        loss = nt_xent(*_embed(model, view0, view1)) / micro_batches
        loss.backward()
        optimizer.step()
        logged += float(loss.detach())
    return logged


def steps_before_backward(model, optimizer, batch, micro_batches: int):
    optimizer.step()
    loss = nt_xent(*_embed(model, *batch))
    loss.backward()
    return loss.detach()
