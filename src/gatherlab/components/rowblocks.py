"""A model's forward in contiguous row blocks of its inputs, joined along the rows: the
perturbation a low precision's floor is measured with (docs/design.md §2, "Low precision"). The
same numbers as one call in exact arithmetic for a model that treats each row on its own, with
each weight's gradient summed in as many partial sums as there are blocks, as W ranks sum it
before DDP's average. The check's forms wrap the user's model in `RowBlocks`; gatherlab's own
module computes its embeddings with `blocked` (``layout.row_blocks``).
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch
from torch import nn

__all__ = ["RowBlocks", "blocked", "in_row_blocks", "rows_of_batch"]


def rows_of_batch(value: Any) -> int | None:
    """The number of rows of the first tensor with a first dimension in ``value`` (a tensor, or
    tuples, lists and dicts of them), None when it holds none."""
    if isinstance(value, torch.Tensor):
        return len(value) if value.dim() else None
    items = value.values() if isinstance(value, dict) else value
    if isinstance(value, tuple | list | dict):
        for item in items:
            rows = rows_of_batch(item)
            if rows is not None:
                return rows
    return None


def _block(value: Any, rows: int, part: slice) -> Any:
    """``value`` with every tensor of ``rows`` rows cut to the rows of ``part``."""
    if isinstance(value, torch.Tensor):
        return value[part] if value.dim() and len(value) == rows else value
    if isinstance(value, tuple | list):
        return type(value)(_block(item, rows, part) for item in value)
    if isinstance(value, dict):
        return {key: _block(item, rows, part) for key, item in value.items()}
    return value


def _joined(outputs: list[Any]) -> Any:
    """The blocks' outputs put back together along the rows: tensors concatenated, tuples, lists
    and dicts item by item; a tensor without rows (a scalar) cannot be joined (ValueError)."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if not first.dim():
            raise ValueError(
                "the model returned a scalar (its loss?), which row blocks cannot join; allowed: "
                "the part of the model before its loss in row blocks"
            )
        return torch.cat(outputs)
    if isinstance(first, tuple | list):
        return type(first)(_joined(list(items)) for items in zip(*outputs, strict=True))
    if isinstance(first, dict):
        return {key: _joined([output[key] for output in outputs]) for key in first}
    return first


def blocked(function: Any, blocks: int, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` computed in ``blocks`` contiguous row blocks of its inputs
    (every tensor with as many rows as the first) and joined: the same numbers as one call in
    exact arithmetic when the function treats each row on its own, with the rounding of a sum
    split over ranks (`RowBlocks`)."""
    rows = rows_of_batch((args, kwargs))
    if blocks == 1 or rows is None or rows < blocks:
        return function(*args, **kwargs)
    bounds = [rows * b // blocks for b in range(blocks + 1)]
    parts = [slice(start, stop) for start, stop in itertools.pairwise(bounds)]
    outputs = [function(*_block(args, rows, p), **_block(kwargs, rows, p)) for p in parts]
    return _joined(outputs)


class RowBlocks(nn.Module):
    """A model whose forward runs in ``blocks`` contiguous row blocks of its inputs, joined along
    the rows (`blocked`): the floor's perturbation of one device (docs/design.md §2, "Low
    precision"). Each weight's gradient is then summed in ``blocks`` partial sums, as W ranks
    sum it before DDP's average, and nothing changes mathematically for a model that treats each
    row on its own. Its attributes are the model's, as through DDP's ``module``."""

    def __init__(self, module: nn.Module, blocks: int) -> None:
        super().__init__()
        self.module, self.blocks = module, blocks

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return blocked(self.module, self.blocks, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)


def in_row_blocks(module: nn.Module, blocks: int = 2) -> nn.Module:
    """``module`` itself, its forward from now on in ``blocks`` row blocks (`blocked`): for a
    job's own floor run, recorded and given to ``python -m gatherlab.compare --floor``. Its
    parameters keep their names (a `RowBlocks` wrapper would prefix them), so that the recording
    is of the same model. Wrap the part that treats each row on its own (the model before its
    loss), on one device."""
    module.forward = functools.partial(blocked, module.forward, blocks)  # the instance's own
    return module
