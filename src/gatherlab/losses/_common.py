"""What every loss family shares: argument checks and the gathering of the two views."""

from __future__ import annotations

import torch

from gatherlab.gather import GatherFn
from gatherlab.ranks import world

DEFAULT_GATHER = "fixed"
"""The gather every loss of this package uses when its ``gather`` argument is not given: ``fixed``,
the exact one (docs/design.md §1), an option of the ``gather`` config group. These losses never
communicate by themselves, so ``gather=native`` (which passes no gather) is refused with them
rather than run as this default (``gatherlab.components.config.native_refusal``);
``gather=None`` gathers nothing (one device)."""


def check_positive(name: str, value: float) -> float:
    """``value`` as a float, or a ValueError naming the argument."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def check_non_negative(name: str, value: float) -> float:
    """``value`` as a float, or a ValueError naming the argument."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
        raise ValueError(f"{name} must be a non-negative number, got {value!r}")
    return float(value)


def check_views(out0: torch.Tensor, out1: torch.Tensor, min_rows: int = 1) -> None:
    """Both views: (B, D) tensors of the same shape with at least ``min_rows`` rows."""
    if out0.ndim != 2 or out0.shape != out1.shape:
        raise ValueError(
            f"the two views must be (batch, dim) tensors of one shape, got "
            f"{tuple(out0.shape)} and {tuple(out1.shape)}"
        )
    if out0.shape[0] < min_rows:
        raise ValueError(f"this loss needs at least {min_rows} samples per batch, got {len(out0)}")


def gather_views(
    gather: GatherFn, out0: torch.Tensor, out1: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both views gathered in one collective (side by side), then split again."""
    gathered = gather(torch.cat([out0, out1], dim=1))
    return gathered[:, : out0.shape[1]], gathered[:, out0.shape[1] :]


def local_offset(local: torch.Tensor, gathered: torch.Tensor) -> int:
    """Index of this rank's first sample in the gathered batch: where its own rows start
    (``gatherlab.ranks.world.own_rows``, from ``gatherlab.core.terms.rows_of``); 0 when nothing
    was gathered."""
    return world.own_rows(gathered.shape[0]).start if gathered.shape[0] > local.shape[0] else 0


def own_columns(first: int, rows: int, device: torch.device) -> torch.Tensor:
    """Indices ``first .. first + rows - 1`` of this rank's samples among the columns a loss
    compares its rows with (the gathered batch, where ``first`` is ``local_offset``'s): the
    positives' columns, as a tensor."""
    return first + torch.arange(rows, device=device)


def off_diagonal(matrix: torch.Tensor) -> torch.Tensor:
    """The off-diagonal entries of a square matrix, flattened."""
    size = matrix.shape[0]
    return matrix.flatten()[:-1].view(size - 1, size + 1)[:, 1:].flatten()
