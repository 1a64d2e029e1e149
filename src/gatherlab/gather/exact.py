"""The exact gathers: each rank's slice gets Σ_r G_r[s], every rank's gradient of it summed
(docs/design.md §1): lightly's fixed GatherLayer (``Fixed``) and the gathers torch and Lightning
ship (``TorchNN``, ``Functional``, ``Lightning``)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist

from gatherlab.core import terms
from gatherlab.gather.base import EXACT, Gather
from gatherlab.gather.collectives import (
    BACKWARD_COLLECTIVES,
    all_gather_rows,
    sum_over_ranks_of_own_slice,
)

__all__ = ["Fixed", "Functional", "Lightning", "TorchNN"]


class _FixedGather(torch.autograd.Function):
    """Forward: all_gather. Backward: every rank's gradient of each slice summed, own slice kept.

    Each rank's loss depends on every slice, so the gradient of slice s is the sum over ranks of
    what each rank's loss puts on it. An all_reduce SUM of all W slice gradients delivers that sum
    to every rank, a reduce_scatter SUM only to the slice's owner; ``collective`` picks one (None:
    the cheaper one for the backend, ``backward_collective``).
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, collective: str | None) -> torch.Tensor:
        ctx.collective = collective
        return all_gather_rows(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        return sum_over_ranks_of_own_slice(grad, ctx.collective), None


class Fixed(Gather):
    """lightly's GatherLayer since #1531: every rank's gradient of each slice summed.

    Args:
        collective: the collective of the backward, ``"all_reduce"`` or ``"reduce_scatter"``;
            None picks the cheaper one for the running backend (reduce-scatter on NCCL and XCCL,
            all-reduce elsewhere).

    Raises:
        ValueError: ``collective`` is none of these.
    """

    predicted = EXACT
    backward = terms.Rule.SUM

    def __init__(self, collective: str | None = None):
        if collective is not None and collective not in BACKWARD_COLLECTIVES:
            allowed = ", ".join(BACKWARD_COLLECTIVES)
            raise ValueError(f"collective={collective!r} is not allowed; allowed: {allowed}")
        self.collective = collective

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return _FixedGather.apply(tensor, self.collective)


@contextlib.contextmanager
def _deprecated_all_gather_is_intended() -> Iterator[None]:
    """torch 2.13 deprecates ``torch.distributed.nn.functional.all_gather``; ``torch_nn`` and
    ``lightning`` exist to measure exactly that public API, so its warning is expected here."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"torch\.distributed\.nn\.functional\.all_gather is deprecated"
        )
        yield


class TorchNN(Gather):
    """``torch.distributed.nn.functional.all_gather``."""

    predicted = EXACT
    backward = terms.Rule.SUM

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn.functional import all_gather

        with _deprecated_all_gather_is_intended():
            return torch.cat(all_gather(tensor.contiguous()), dim=0)


class Functional(Gather):
    """``_functional_collectives.all_gather_single_autograd``: from a private torch module, the
    functional collectives torch's own tensor-parallel code uses; measured here for that reason."""

    predicted = EXACT
    backward = terms.Rule.SUM

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        from torch.distributed import _functional_collectives

        gathered = _functional_collectives.all_gather_single_autograd(
            tensor.contiguous(), 0, dist.group.WORLD
        )
        return _functional_collectives.wait_tensor(gathered)


class Lightning(Gather):
    """What ``LightningModule.all_gather(tensor, sync_grads=True)`` runs under DDP. Its function
    is private to Lightning; it is called directly so that a loss needs no LightningModule."""

    predicted = EXACT
    backward = terms.Rule.SUM

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available

        with _deprecated_all_gather_is_intended():
            return _all_gather_ddp_if_available(tensor, sync_grads=True).flatten(0, 1)
