"""A run in its precision (docs/design.md §2, "Low precision"): the dtype of its parameters and
inputs, the ``torch.autocast`` a mixed precision computes under, and the perturbation the floor
of a low precision is measured with: one device's forward in row blocks (`RowBlocks`).

Every training form reads these here, so that a run in bf16 is the same run whichever form trains
it: `gatherlab.runs.loss`, `gatherlab.runs.plainstep`, `gatherlab.runs.update`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from gatherlab.core import cli, imports
from gatherlab.core.terms import Precision

__all__ = [
    "FLOOR_ROW_BLOCKS", "InFloat64", "RowBlocks", "autocast", "blocked", "dtype", "in_float64",
    "rows_of_batch",
]  # fmt: skip


FLOOR_ROW_BLOCKS = 2
"""The row blocks of the floor's perturbation: two, the rounding of a sum split over two ranks."""


def dtype(precision: str) -> torch.dtype:
    """The dtype of a run's parameters and floating inputs in ``precision``."""
    return getattr(torch, Precision(precision).dtype_name)


@contextlib.contextmanager
def autocast(precision: str, device: torch.device | str = "cpu") -> Iterator[None]:
    """``torch.autocast`` in a mixed precision's dtype on ``device``, as Lightning's
    ``bf16-mixed`` and ``16-mixed`` run a step; nothing for the other precisions."""
    name = Precision(precision).autocast_dtype_name
    if name is None:
        yield
        return
    kind = torch.device(device).type
    with torch.autocast(kind, dtype=getattr(torch, name)):
        yield


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
            raise ValueError("the model returned a scalar, which row blocks cannot join")
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


@dataclass(frozen=True)
class InFloat64:
    """What running code with float64 parameters and inputs showed (`in_float64`): ``lower``,
    the first operation of the code whose floating result is not float64 (``file:line op →
    dtype``), or the error it raised in float64, None when it runs in float64 throughout;
    ``autocast``, the dtype its own ``torch.autocast`` asks for (None: it does not autocast),
    which leaves float64 operations alone on the CPU."""

    lower: str | None
    autocast: str | None

    @property
    def runs(self) -> bool:
        """Whether the code runs in float64, so that float64 can judge it."""
        return self.lower is None


class _Float64Watch(TorchFunctionMode):
    """Each torch call of the user's code (`core.cli.is_users`) whose floating result is not
    float64: the first one's place kept; the autocast dtype the code enables, if any."""

    def __init__(self) -> None:
        super().__init__()
        self.lower: str | None = None
        self.autocast: str | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if self.autocast is None and torch.is_autocast_enabled("cpu"):
            self.autocast = str(torch.get_autocast_dtype("cpu")).removeprefix("torch.")
        if self.lower is None:
            floating = [t for t in _tensors(result) if t.is_floating_point()]
            lower = next((t for t in floating if t.dtype != torch.float64), None)
            where = _users_place() if lower is not None else None
            if where is not None:
                name = getattr(func, "__name__", str(func))
                self.lower = f"{where} {name} → {str(lower.dtype).removeprefix('torch.')}"
        return result


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, tuple | list):
        for item in value:
            yield from _tensors(item)


def _users_place() -> str | None:
    """The ``file:line`` of the code that made the current torch call, the innermost frame
    outside torch, when it is the user's (`core.cli.is_users`); None when it is gatherlab's or a
    framework's own."""
    frame = inspect.currentframe()
    while frame is not None and (
        frame.f_code.co_filename == __file__ or _torch_file(frame.f_code.co_filename)
    ):
        frame = frame.f_back
    if frame is None or not cli.is_users(frame.f_code.co_filename):
        return None
    if os.path.realpath(frame.f_code.co_filename).startswith(_GATHERLAB):
        return None
    return imports.place(frame.f_code.co_filename, frame.f_lineno)


_TORCH = os.path.dirname(os.path.realpath(torch.__file__)) + os.sep
_GATHERLAB = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep


@functools.cache
def _torch_file(filename: str) -> bool:
    return os.path.realpath(filename).startswith(_TORCH)


def in_float64(function: Callable[[], Any]) -> InFloat64:
    """``function()`` (the code on float64 parameters and inputs: one forward and backward) run
    under a watch of its operations: the first that leaves float64, and the autocast it enables.
    What ``function`` raises is raised: the caller tells an error of float64 from one of the
    setting (a step that needs a process group)."""
    watch = _Float64Watch()
    with watch:
        function()
    return InFloat64(watch.lower, watch.autocast)
