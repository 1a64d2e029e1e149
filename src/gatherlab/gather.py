"""Gather implementations: all-gather a (B, ...) tensor from every rank into (W·B, ...).

Every implementation has the same forward (the ranks' tensors concatenated in rank order) and
differs only in what its backward hands back to the local input. With W ranks and a loss whose
gradient with respect to the gathered tensor on rank r is G_r (N × D, N = W·B), rank s receives:

- ``fixed``: Σ_r G_r[s] — the gradient of every rank's loss with respect to its slice. After DDP's
  1/W average this is exactly the single-device gradient (lightly ≥ #1531, solo-learn, VISSL).
- ``old``: G_s[s] — only its own loss's gradient of its own slice; the terms that other ranks'
  losses put on this slice are dropped (lightly < #1531, Spijkervet SimCLR, early solo-learn).

``get(name)`` returns a function ``x -> gathered x``; without an initialised process group (or
with one rank) it returns its input, so the same loss code runs on one device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

GatherFn = Callable[[torch.Tensor], torch.Tensor]

_REGISTRY: dict[str, GatherFn] = {}


def register(name: str) -> Callable[[GatherFn], GatherFn]:
    """Add a gather implementation under ``name`` (one decorator per implementation)."""

    def add(function: GatherFn) -> GatherFn:
        if name in _REGISTRY:
            raise ValueError(f"gather {name!r} is registered twice")
        _REGISTRY[name] = function
        return function

    return add


def world_size() -> int:
    """Number of ranks in the default process group, 1 when there is none."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank in the default process group, 0 when there is none."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _all_gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    slices = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(slices, tensor.contiguous())
    return slices


class _FixedGather(torch.autograd.Function):
    """Forward: all_gather. Backward: all_reduce SUM of every slice's gradient, keep own slice.

    Each rank's loss depends on every slice, so the gradient of slice s is the sum over ranks of
    what each rank's loss puts on it; the all_reduce delivers that sum to rank s.
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(_all_gather(tensor))

    @staticmethod
    def backward(ctx, *slice_grads: torch.Tensor) -> torch.Tensor:
        stacked = torch.stack(slice_grads)
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM)
        return stacked[dist.get_rank()]


class _OldGather(torch.autograd.Function):
    """Forward: all_gather. Backward: the own slice's gradient only, no collective.

    This was lightly's GatherLayer before #1531: the gradient other ranks' losses put on this
    rank's slice never reaches it.
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(_all_gather(tensor))

    @staticmethod
    def backward(ctx, *slice_grads: torch.Tensor) -> torch.Tensor:
        return slice_grads[dist.get_rank()]


@register("fixed")
def fixed(tensor: torch.Tensor) -> torch.Tensor:
    return torch.cat(_FixedGather.apply(tensor), dim=0)


@register("old")
def old(tensor: torch.Tensor) -> torch.Tensor:
    return torch.cat(_OldGather.apply(tensor), dim=0)


NAMES: tuple[str, ...] = tuple(_REGISTRY)


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass(frozen=True)
class Gather:
    """A registered gather implementation, picklable by name (ranks may be spawned processes)."""

    name: str

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return _REGISTRY[self.name](tensor) if world_size() > 1 else tensor


def get(name: str) -> GatherFn:
    """The gather implementation called ``name``; the identity when no process group is running."""
    if name not in _REGISTRY:
        raise ValueError(f"gather={name!r} is unknown; allowed: {', '.join(NAMES)}")
    return Gather(name)


def resolve(gather: str | GatherFn | None) -> GatherFn:
    """What a loss's ``gather`` argument means: a registry name, a callable, or None (identity)."""
    if gather is None:
        return _identity
    if isinstance(gather, str):
        return get(gather)
    if callable(gather):
        return gather
    raise TypeError(
        f"gather must be a name ({', '.join(NAMES)}), a callable or None, not {gather!r}"
    )
