"""The removals of docs/design.md §10: what a training step may do that makes W ranks differ from
one device, each taken out of a user's module or data set on its own, so that the check of a
training step can name the part that breaks it.

- ``batchnorm``: every ``torch.nn`` batch norm replaced by ``GlobalBatchNorm`` (the statistics of
  the global batch, docs/design.md §2), its parameters, buffers and settings carried over;
- ``dropout``: every ``torch.nn`` dropout layer replaced by the identity;
- ``data_randomness``: the data set's global random streams (``random``, ``numpy.random``,
  ``torch``) seeded from (seed, epoch, index) around each item, so that a sample's draws are its
  own whichever rank loads it (the other streams are left as they were).

Each removal works on objects it has never seen: it looks for the ``torch.nn`` classes, or wraps
the data set's ``__getitem__``; it changes nothing else. `Removal` names them in the order the
check reports them, `Removals` is which a run makes (a sweep's ``removals.*`` keys, or one run of
the training check), and a new removal is one member there, one field here and its function.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from gatherlab.components.augment import sample_generator
from gatherlab.components.batchnorm import GlobalBatchNorm
from gatherlab.ranks import world


class Removal(StrEnum):
    """A cause of a difference between layouts that a training step may contain, taken out of a
    run (docs/design.md §10), in the order the check reports them."""

    BATCHNORM = "batchnorm"
    DROPOUT = "dropout"
    DATA_RANDOMNESS = "data_randomness"


# A sweep's ``removals.<removal>`` keys (conf/config.yaml, module=external): per removal, its
# values, the first that of a run that keeps the cause.
CONFIG_VALUES = {
    Removal.BATCHNORM: ("as_is", "global"),
    Removal.DROPOUT: ("on", "off"),
    Removal.DATA_RANDOMNESS: ("as_is", "per_sample"),
}
# The runs of the training check, by what each removes: nothing, one removal, or all of them.
NONE, ALL = "none", "all"
# The culprit left when every removal is made and the run is still not exact: the loss itself, or
# how it communicates across ranks.
LOSS = "loss"
# The culprit named instead of ``loss`` when the training step itself draws from the global random
# streams (an augmentation applied to the batch in the step): no removal takes that out.
STEP_RANDOMNESS = "step_randomness"
# The stream of sample_generator that seeds a sample's global random streams (0, 1 and 2 + … are
# gatherlab's own augmentations and dropout masks, docs/design.md §2).
DATA_STREAM = 1_000_003

__all__ = [
    "ALL", "CONFIG_VALUES", "LOSS", "NONE", "PerSample", "Removal", "Removals", "batch_norms",
    "dropouts", "global_batch_norm", "no_dropout", "seeded_streams",
]  # fmt: skip


@dataclass(frozen=True)
class Removals:
    """Which removals a run makes (one field per `Removal`)."""

    batchnorm: bool = False
    dropout: bool = False
    data_randomness: bool = False

    @classmethod
    def named(cls, removed: str) -> Removals:
        """A run of the training check by what it removes: `NONE`, one `Removal`, or `ALL`."""
        return cls(**{f.name: removed in (f.name, ALL) for f in fields(cls)})

    @classmethod
    def from_config(cls, chosen: Mapping[str, Any] | None) -> Removals:
        """A sweep's ``removals.<removal>`` values (`CONFIG_VALUES`; a missing key keeps its
        cause); a ValueError of one line names a key or value that is not allowed."""
        chosen = dict(chosen or {})
        unknown = sorted(set(chosen) - set(CONFIG_VALUES))
        if unknown:
            allowed = ", ".join(CONFIG_VALUES)
            raise ValueError(f"removals.{unknown[0]} is unknown; allowed: {allowed}")
        removed = {}
        for removal, values in CONFIG_VALUES.items():
            value = chosen.get(removal, values[0])
            if value not in values:
                raise ValueError(
                    f"removals.{removal}={value!r} is not allowed; allowed: {', '.join(values)}"
                )
            removed[removal.value] = value != values[0]
        return cls(**removed)

    def made(self) -> tuple[Removal, ...]:
        """The removals this run makes, in `Removal`'s order."""
        return tuple(removal for removal in Removal if getattr(self, removal.value))

    def apply(self, module: nn.Module) -> None:
        """Make the module's removals in place (batch norm over the global batch, dropout off);
        the data set's is made where it is read (`PerSample`)."""
        if self.batchnorm:
            global_batch_norm(module)
        if self.dropout:
            no_dropout(module)


def batch_norms(module: nn.Module) -> list[str]:
    """The names of the ``torch.nn`` batch norm layers of ``module`` (``SyncBatchNorm`` too)."""
    return [name for name, child in module.named_modules() if isinstance(child, _BatchNorm)]


def dropouts(module: nn.Module) -> list[str]:
    """The names of the ``torch.nn`` dropout layers of ``module``."""
    return [name for name, child in module.named_modules() if isinstance(child, _DropoutNd)]


def _replace(module: nn.Module, kind: type, make: Any) -> int:
    """Replace every child of ``module`` (recursively) that is a ``kind`` with ``make(child)``."""
    count = 0
    for name, child in module.named_children():
        if isinstance(child, kind):
            setattr(module, name, make(child))
            count += 1
        else:
            count += _replace(child, kind, make)
    return count


def _global(norm: _BatchNorm) -> GlobalBatchNorm:
    replacement = GlobalBatchNorm(norm.num_features, eps=norm.eps, momentum=norm.momentum)
    reference = norm.weight if norm.affine else norm.running_mean
    if reference is not None:  # the dtype and device of the layer it replaces, before the copies
        replacement.to(reference)
    with torch.no_grad():
        if norm.affine:
            replacement.weight.copy_(norm.weight)
            replacement.bias.copy_(norm.bias)
        else:  # no learnt scale and shift: the identity ones, not trained
            replacement.weight.requires_grad_(False)
            replacement.bias.requires_grad_(False)
        if norm.track_running_stats:
            replacement.running_mean.copy_(norm.running_mean)
            replacement.running_var.copy_(norm.running_var)
            replacement.num_batches_tracked.copy_(norm.num_batches_tracked)
    replacement.train(norm.training)
    return replacement


def global_batch_norm(module: nn.Module) -> int:
    """Replace every batch norm of ``module`` in place by one with the statistics of the global
    batch; return how many. By where this rank computes (``world.device``): on a GPU of an NCCL
    group ``torch.nn.SyncBatchNorm`` (which refuses CPU tensors), elsewhere ``GlobalBatchNorm``
    (the same statistics on any backend, and one device's ``BatchNorm`` in a one-rank world)."""
    if world.device().type == "cuda":
        return _replace(module, _BatchNorm, _synchronised)
    return _replace(module, _BatchNorm, _global)


def _synchronised(norm: _BatchNorm) -> nn.SyncBatchNorm:
    """``norm`` as a ``SyncBatchNorm``, its parameters, buffers and settings carried over."""
    replacement = nn.SyncBatchNorm.convert_sync_batchnorm(norm)
    replacement.train(norm.training)
    return replacement


def no_dropout(module: nn.Module) -> int:
    """Replace every dropout layer of ``module`` in place by ``nn.Identity``; return how many."""
    return _replace(module, _DropoutNd, lambda _: nn.Identity())


@contextmanager
def seeded_streams(seed: int, epoch: int, index: int) -> Iterator[None]:
    """Inside: ``random``, ``numpy.random`` and ``torch``'s global generator seeded from (seed,
    epoch, index) alone. Outside, each stream continues where it was."""
    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    words = sample_generator(seed, epoch, index, DATA_STREAM).initial_seed()
    random.seed(words)
    np.random.seed(words % 2**32)
    torch.manual_seed(words)
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])


class PerSample(torch.utils.data.Dataset):
    """A map-style data set read by key ``(epoch, index)`` (the global-batch sampler's keys,
    docs/design.md §2): ``dataset[index]``, with its global random streams seeded from (seed,
    epoch, index) when ``seeded`` (the ``data_randomness`` removal), as they come otherwise."""

    def __init__(self, dataset: Any, seed: int, seeded: bool):
        self.dataset, self.seed, self.seeded = dataset, seed, seeded

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        if not self.seeded:
            return self.dataset[index]
        with seeded_streams(self.seed, epoch, index):
            return self.dataset[index]
