"""A model's forward in contiguous row blocks of its inputs, joined along the rows: the
perturbation a low precision's floor is measured with (docs/design.md §2, "Low precision"). The
same numbers as one call in exact arithmetic for a model that treats each row on its own, with
each weight's gradient summed in as many partial sums as there are blocks, as W ranks sum it
before DDP's average. The check's forms wrap the user's model in `RowBlocks`; gatherlab's own
module computes its embeddings with `blocked` (``layout.row_blocks``); a recorded job's floor
(`gatherlab.recording.recorder`) cuts its model's forward with `join_measured` first, which
measures on the first call how far the blocks joined are from one call.

The blocks' outputs are joined as they came: tensors with rows concatenated; tuples, lists,
named tuples, dicts and Hugging Face ``ModelOutput`` s rebuilt as their own type; a scalar (a
loss the model returns) as the rows' weighted mean of the blocks' (a mean over rows) or their sum
(a sum over the batch divided by a count given to every block), whichever `join_measured` finds
to be one call's.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "SCALAR_JOINS", "Joined", "RowBlocks", "blocked", "blocked_as", "in_row_blocks",
    "join_measured", "rows_of_batch",
]  # fmt: skip


def rows_of_batch(value: Any) -> int | None:
    """The number of rows of the first tensor with a first dimension in ``value`` (a tensor, or
    tuples, lists and mappings of them), None when it holds none."""
    if isinstance(value, torch.Tensor):
        return len(value) if value.dim() else None
    items = value.values() if isinstance(value, Mapping) else value
    if isinstance(value, tuple | list | Mapping):
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
    if isinstance(value, Mapping):
        return _rebuilt(value, {key: _block(item, rows, part) for key, item in value.items()})
    return value


def _rebuilt(like: Mapping, items: dict) -> Mapping:
    """``items`` as a mapping of ``like``'s own type: a dict; a Hugging Face ``ModelOutput`` (a
    dataclass over an ordered dict, built from keywords); any other mapping built from a dict (a
    tokenizer's ``BatchEncoding``)."""
    if type(like) is dict:
        return items
    if dataclasses.is_dataclass(like):
        return type(like)(**items)
    return type(like)(items)


SCALAR_JOINS = ("mean", "sum")
"""How the blocks' scalars (a loss the model returns) make one call's: their mean weighted by the
blocks' rows (a mean over the rows), or their sum (a sum over the batch divided by a count that
every block is given). None refuses a scalar (`blocked`)."""


def _joined(outputs: list[Any], sizes: list[int], scalars: str | None = None) -> Any:
    """The blocks' outputs put back together along the rows (the module's docstring); a scalar
    tensor by the rule ``scalars`` (`SCALAR_JOINS`), refused with None (ValueError)."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if first.dim():
            return torch.cat(outputs)
        if scalars == "sum":
            return torch.stack(outputs).sum()
        if scalars == "mean":
            weights = torch.tensor(sizes, dtype=first.dtype, device=first.device) / sum(sizes)
            return (torch.stack(outputs) * weights).sum()
        raise ValueError(
            "the model returned a scalar (its loss?), which row blocks cannot join; allowed: "
            "the part of the model before its loss in row blocks"
        )
    if isinstance(first, tuple | list):
        items = [_joined(list(parts), sizes, scalars) for parts in zip(*outputs, strict=True)]
        if hasattr(first, "_fields"):  # a named tuple
            return type(first)(*items)
        return type(first)(items)
    if isinstance(first, Mapping):
        return _rebuilt(first, {key: _joined([output[key] for output in outputs], sizes, scalars)
                                for key in first})  # fmt: skip
    return first


def holds_scalar(output: Any) -> bool:
    """Whether a model's ``output`` holds a scalar tensor (a loss it computes over all its rows),
    which `blocked` refuses to join: the row blocks cannot cut such a model."""
    if isinstance(output, torch.Tensor):
        return output.dim() == 0
    if isinstance(output, tuple | list):
        return any(holds_scalar(item) for item in output)
    if isinstance(output, Mapping):
        return any(holds_scalar(item) for item in output.values())
    return False


def _bounds(rows: int, blocks: int) -> list[slice]:
    bounds = [rows * b // blocks for b in range(blocks + 1)]
    return [slice(start, stop) for start, stop in itertools.pairwise(bounds)]


def blocked_as(scalars: str | None, function: Any, blocks: int, *args: Any, **kwargs: Any) -> Any:
    """`blocked` with a scalar of the outputs joined by ``scalars`` (`SCALAR_JOINS`)."""
    rows = rows_of_batch((args, kwargs))
    if blocks == 1 or rows is None or rows < blocks:
        return function(*args, **kwargs)
    parts = _bounds(rows, blocks)
    outputs = [function(*_block(args, rows, p), **_block(kwargs, rows, p)) for p in parts]
    return _joined(outputs, [p.stop - p.start for p in parts], scalars)


def blocked(function: Any, blocks: int, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` computed in ``blocks`` contiguous row blocks of its inputs
    (every tensor with as many rows as the first) and joined: the same numbers as one call in
    exact arithmetic when the function treats each row on its own, with the rounding of a sum
    split over ranks (`RowBlocks`). A scalar output (a loss) is refused (ValueError)."""
    return blocked_as(None, function, blocks, *args, **kwargs)


def _leaves(value: Any, name: str = "output") -> list[tuple[str, torch.Tensor]]:
    """Every floating tensor of an output, named by its path (``output['loss']``)."""
    if isinstance(value, torch.Tensor):
        return [(name, value)] if value.is_floating_point() else []
    if isinstance(value, Mapping):
        return [leaf for key, item in value.items() for leaf in _leaves(item, f"{name}[{key!r}]")]
    if isinstance(value, tuple | list):
        return [leaf for i, item in enumerate(value) for leaf in _leaves(item, f"{name}[{i}]")]
    return []


@dataclass(frozen=True)
class Joined:
    """How far a function's outputs computed in row blocks and joined are from one call's
    (`join_measured`): the rule that joined its scalars (`SCALAR_JOINS`, None without any), the
    output whose relative difference ‖joined − whole‖ / ‖whole‖ is the largest, that difference
    (inf where a shape differs) and that output's dtype."""

    scalars: str | None
    leaf: str
    relative: float
    dtype: torch.dtype


def _difference(joined: Any, whole: Any) -> tuple[str, float, torch.dtype]:
    """The output whose joined value is relatively farthest from one call's, that distance and
    its dtype."""
    worst = None
    for (name, mine), (_, theirs) in zip(_leaves(joined), _leaves(whole), strict=False):
        if mine.shape != theirs.shape:
            return name, math.inf, theirs.dtype
        scale = torch.linalg.vector_norm(theirs.double())
        gap = torch.linalg.vector_norm(mine.double() - theirs.double())
        relative = float(gap / scale) if scale > 0 else (0.0 if gap == 0 else math.inf)
        if worst is None or relative > worst[1]:
            worst = (name, relative, theirs.dtype)
    return worst or ("output", 0.0, torch.float32)


def join_measured(function: Any, blocks: int, *args: Any, **kwargs: Any) -> Joined:
    """``function`` called once and in ``blocks`` row blocks on the same inputs, and how far the
    joined outputs are from the one call's (`Joined`); a scalar output is tried with each rule of
    `SCALAR_JOINS` and the nearer kept. The caller runs it without gradients and without
    randomness (the recorder: ``torch.no_grad()`` and the model in ``eval()``)."""
    whole = function(*args, **kwargs)
    rows = rows_of_batch((args, kwargs))
    if rows is None or rows < blocks:
        return Joined(None, "output", 0.0, torch.float32)
    parts = _bounds(rows, blocks)
    outputs = [function(*_block(args, rows, p), **_block(kwargs, rows, p)) for p in parts]
    sizes = [p.stop - p.start for p in parts]
    has_scalar = any(leaf.dim() == 0 for _, leaf in _leaves(whole))
    found = [Joined(rule, *_difference(_joined(outputs, sizes, rule), whole))
             for rule in (SCALAR_JOINS if has_scalar else (None,))]  # fmt: skip
    return min(found, key=lambda joined: joined.relative)


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
    module.row_blocks = blocks  # what a recording of it says (its header's ``row_blocks``)
    return module
