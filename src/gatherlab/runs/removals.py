"""The removals of docs/checking.md §10 (``batchnorm``, ``dropout``, ``data_randomness``): what a
training step may do that makes W ranks differ from one device, each taken out of a user's module
or data set on its own, so that the check of a training step can name the part that breaks it.

Each removal works on objects it has never seen (the ``torch.nn`` classes, or the data set's
``__getitem__`` wrapped) and changes nothing else. A removal is one member of `Removal`, which
holds all of it: its name and ``removals.<name>`` values, how to detect its cause, how to make it,
and what its cause does and how to fix it; a new removal is that member and its line in
conf/config.yaml's ``removals:``. `Removals` is which a run makes.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from gatherlab.components.augment import sample_generator
from gatherlab.components.batchnorm import GlobalBatchNorm
from gatherlab.core import terms
from gatherlab.ranks import world


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
    if world.device().type == terms.Device.CUDA:
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


def _same(a: Any, b: Any) -> bool:
    """Whether two data set items are equal (tensors, arrays, numbers, nested containers)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.shape == b.shape and bool(np.array_equal(a, b))
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def draws_randomness(data: Any) -> bool:
    """Whether the data set's items depend on the global random streams: item 0 read twice under
    two different seeds of them."""
    first = PerSample(data, seed=1, seeded=True)[(0, 0)]
    second = PerSample(data, seed=2, seeded=True)[(0, 0)]
    return not _same(first, second)


class Removal(StrEnum):
    """A cause of a difference between layouts that a training step may contain, taken out of a
    run (docs/checking.md §10), in the order the check reports them. Each member holds all that is
    known of its removal (see the module)."""

    # name, value that keeps the cause, value that removes it, the cause is found in a module or
    # data set, the removal made on a module (None: on the data set), what the cause does, its fix
    BATCHNORM = (
        "batchnorm", "as_is", "global", lambda module, data: bool(batch_norms(module)),
        global_batch_norm,
        "batch norm normalises each rank's batch with its own statistics (plain DDP's "
        "BatchNorm), so W ranks compute another function of the batch than one device. Fix: "
        "statistics over the global batch: torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) "
        "on GPUs (NCCL), gatherlab.components.batchnorm.GlobalBatchNorm on any backend; or no "
        "batch norm where the split batch passes.",
    )  # fmt: skip
    DROPOUT = (
        "dropout", "on", "off", lambda module, data: bool(dropouts(module)), no_dropout,
        "dropout masks come from each process's random generator, so a sample's mask depends on "
        "the rank that holds it and on what that rank drew before. Fix: draw each sample's mask "
        "from a generator seeded by (seed, epoch, sample index) "
        "(gatherlab.components.models.SeededDropout), or accept the difference: noise of the "
        "same distribution, not a bias.",
    )  # fmt: skip
    DATA_RANDOMNESS = (
        "data_randomness", "as_is", "per_sample", lambda module, data: draws_randomness(data),
        None,
        "the data set's augmentations draw from each process's global random streams (random, "
        "numpy, torch), so a sample's views depend on the rank that loads it. Fix: seed each "
        "sample's augmentation from its index and the epoch, e.g. a torch.Generator seeded by "
        "(seed, epoch, index) in __getitem__.",
    )  # fmt: skip

    def __new__(
        cls,
        name: str,
        kept: str,
        removed: str,
        found: Callable[[nn.Module, Any], bool],
        make: Callable[[nn.Module], int] | None,
        diagnosis: str,
    ) -> Removal:
        member = str.__new__(cls, name)
        member._value_ = name
        member.config_values = (kept, removed)
        member.found = found
        member.make = make
        member.diagnosis = diagnosis
        return member


# The runs of the training check, by what each removes: nothing, one removal, or all of them.
NONE, ALL = "none", "all"
# The stream of sample_generator that seeds a sample's global random streams (0, 1 and 2 + … are
# gatherlab's own augmentations and dropout masks, docs/design.md §2).
DATA_STREAM = 1_000_003

__all__ = [
    "ALL", "NONE", "PerSample", "Removal", "Removals", "batch_norms", "draws_randomness",
    "dropouts", "found_in", "global_batch_norm", "no_dropout", "seeded_streams",
]  # fmt: skip


def found_in(module: nn.Module, data: Any) -> tuple[Removal, ...]:
    """The removals whose cause ``module`` or ``data`` has (batch norms, dropout layers, a data
    set drawing from the global random streams), in `Removal`'s order."""
    return tuple(removal for removal in Removal if removal.found(module, data))


@dataclass(frozen=True)
class Removals:
    """Which removals a run makes."""

    removed: frozenset[Removal] = frozenset()

    def __contains__(self, removal: object) -> bool:
        return removal in self.removed

    @classmethod
    def named(cls, removed: str) -> Removals:
        """A run of the training check by what it removes: `NONE`, one `Removal`, or `ALL`."""
        if removed == ALL:
            return cls(frozenset(Removal))
        return cls(frozenset() if removed == NONE else frozenset({Removal(removed)}))

    @classmethod
    def from_config(cls, chosen: Mapping[str, Any] | None) -> Removals:
        """A sweep's ``removals.<removal>`` values (each member's ``config_values``; a missing
        key keeps its cause); a ValueError of one line names a key or value that is not
        allowed."""
        chosen = dict(chosen or {})
        unknown = sorted(set(chosen) - set(Removal))
        if unknown:
            allowed = ", ".join(Removal)
            raise ValueError(f"removals.{unknown[0]} is unknown; allowed: {allowed}")
        removed = set()
        for removal in Removal:
            kept, _ = removal.config_values
            value = chosen.get(removal, kept)
            if value not in removal.config_values:
                allowed = ", ".join(removal.config_values)
                raise ValueError(f"removals.{removal}={value!r} is not allowed; allowed: {allowed}")
            if value != kept:
                removed.add(removal)
        return cls(frozenset(removed))

    def made(self) -> tuple[Removal, ...]:
        """The removals this run makes, in `Removal`'s order."""
        return tuple(removal for removal in Removal if removal in self.removed)

    def apply(self, module: nn.Module) -> None:
        """Make the module's removals in place (batch norm over the global batch, dropout off);
        the data set's is made where it is read (`PerSample`)."""
        for removal in self.made():
            if removal.make is not None:
                removal.make(module)
