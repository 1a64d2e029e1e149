"""A run in its precision (docs/design.md §2, "Low precision"): the dtype of its parameters and
inputs, the ``torch.autocast`` a mixed precision computes under, the perturbation the floor of a
low precision is measured with (one device's forward in row blocks, `RowBlocks`, kept with the
models in `gatherlab.components.rowblocks`), and the watch that tells whether code runs in float64
(`in_float64`).

Every training form reads these here, so that a run in bf16 is the same run whichever form trains
it: `gatherlab.runs.loss`, `gatherlab.runs.plainstep`, `gatherlab.runs.update`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from gatherlab.components.rowblocks import RowBlocks, blocked
from gatherlab.core import cli, imports
from gatherlab.core.gradients import one_thread
from gatherlab.core.terms import Precision
from gatherlab.runs.trace import tensors_in

__all__ = [
    "FLOOR_ROW_BLOCKS", "InFloat64", "RowBlocks", "autocast", "blocked", "dtype", "in_float64",
    "threads_of_a_rank",
]  # fmt: skip


FLOOR_ROW_BLOCKS = 2
"""The row blocks of the floor's perturbation: two, the rounding of a sum split over two ranks."""


def dtype(precision: str) -> torch.dtype:
    """The dtype of a run's parameters and floating inputs in ``precision``."""
    return getattr(torch, Precision(precision).dtype_name)


@contextlib.contextmanager
def threads_of_a_rank(precision: str) -> Iterator[None]:
    """A one-device run in a low precision computed on one intra-op thread, as each rank of the
    pool computes (`gatherlab.ranks.pool` sets one), so that the one-device runs the floor is
    measured with use the CPU kernels the ranks use: a kernel's rounding depends on its threads
    (measured on the size benchmark's ResNet at 25M parameters, float32, W = 2: the W-rank run
    6.96 floors from one device on two threads, a correct step read ``other``; 1.00 on one);
    float64's runs as they are (its 1e-10 holds either way)."""
    if precision == Precision.FLOAT64:
        yield
        return
    with one_thread():
        yield


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
    """Each torch call of the user's code (`core.cli.is_users`) that takes a float64 tensor and
    gives a floating result that is not float64 (``.float()``, an in-place operation on a float32
    tensor, a float32 tensor times a float64 number): the first one's place kept; the autocast
    dtype the code enables, if any. A float32 tensor the code makes (``torch.tensor(0.07)``, a
    learnt temperature's ``nn.Parameter`` made in ``__init__``) is no such call: it rounds a
    constant alike in every run, and float64 data meeting it is promoted to float64 (*changed,
    issue 71's eighth stop*: it was named, and such code judged in floors of its precision)."""

    def __init__(self) -> None:
        super().__init__()
        self.lower: str | None = None
        self.autocast: str | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if self.autocast is None and torch.is_autocast_enabled("cpu"):
            self.autocast = str(torch.get_autocast_dtype("cpu")).removeprefix("torch.")
        if self.lower is None and any(t.dtype == torch.float64 for t in tensors_in((args, kwargs))):
            floating = [t for t in tensors_in(result) if t.is_floating_point()]
            lower = next((t for t in floating if t.dtype != torch.float64), None)
            where = _users_place() if lower is not None else None
            if where is not None:
                name = getattr(func, "__name__", str(func))
                self.lower = f"{where} {name} → {str(lower.dtype).removeprefix('torch.')}"
        return result


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
