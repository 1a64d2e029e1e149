"""Gather implementations: all-gather a (B, ...) tensor from every rank into (W·B, ...).

Every gather has the same forward (the ranks' tensors in rank order); they differ in what the
backward hands rank s, G_r being rank r's gradient of the gathered tensor (docs/design.md §1's
table gives where each is found and its class per loss style):

- ``fixed`` (and ``fixed_all_reduce``, ``fixed_reduce_scatter``), ``torch_nn``, ``functional``,
  ``lightning``: Σ_r G_r[s], exact after DDP's 1/W average;
- ``old``, ``nograd_swap``: G_s[s], only the own loss's gradient of the own slice;
- ``avg``: (1/W) Σ_r G_r[s];
- ``nograd``: nothing; only the loss's direct uses of the local tensor carry a gradient.

Each is a `Gather` class (`gatherlab.gather.base`; the exact ones in `gatherlab.gather.exact`,
the others in `gatherlab.gather.inexact`). The names are the options of the Hydra config group
``gather``, one YAML file each in ``conf/gather/`` (package data ``gatherlab.conf``): sweeps, the
audit, ``python -m gatherlab.check --gather NAME`` and this module all read that folder. ``NAMES``
lists them; ``get(name)`` builds one, a function ``x -> gathered x`` that returns its input
without a process group of more than one rank, so the same loss code runs on one device.
``native`` is an option but no gather (the loss communicates by itself). A new gather is a
callable anywhere importable plus one YAML file that names it (docs/design.md §4).

Modules:

- ``base``: ``Gather``, the function type a loss takes, the styles and classes it predicts, ``rule``
- ``collectives``: the forward's all-gather and the backward's sum over ranks of a slice's gradient
- ``exact``: the exact gathers: ``Fixed``, ``TorchNN``, ``Functional``, ``Lightning``
- ``inexact``: the inexact gathers of public code: ``Old``, ``NogradSwap``, ``Avg``, ``Nograd``
- ``registry``: the options of ``conf/gather/*.yaml``: ``names``, ``get``, ``resolve``, ``ordered``
"""

from __future__ import annotations

# Names beside __all__ (imported "as" themselves) are importable from here too, as they were
# before the package was split, without being part of its documented face.
from gatherlab.gather.base import BIASED_EVERYWHERE as BIASED_EVERYWHERE
from gatherlab.gather.base import CLASSES, STYLES, Gather, GatherFn, rule
from gatherlab.gather.base import EXACT as EXACT
from gatherlab.gather.base import OWN_SLICE_ONLY as OWN_SLICE_ONLY
from gatherlab.gather.collectives import BACKWARD_COLLECTIVES as BACKWARD_COLLECTIVES
from gatherlab.gather.collectives import REDUCE_SCATTER_BACKENDS as REDUCE_SCATTER_BACKENDS
from gatherlab.gather.collectives import backward_collective as backward_collective
from gatherlab.gather.exact import Fixed, Functional, Lightning, TorchNN
from gatherlab.gather.inexact import Avg, Nograd, NogradSwap, Old
from gatherlab.gather.registry import IMPLEMENTATIONS as IMPLEMENTATIONS
from gatherlab.gather.registry import get, names, ordered, resolve

__all__ = [
    "CLASSES",
    "NAMES",
    "STYLES",
    "Avg",
    "Fixed",
    "Functional",
    "Gather",
    "GatherFn",
    "Lightning",
    "Nograd",
    "NogradSwap",
    "Old",
    "TorchNN",
    "get",
    "ordered",
    "resolve",
    "rule",
]

NAMES: tuple[str, ...]  # annotated only: ``__getattr__`` computes it (no assignment here)
"""The gathers gatherlab ships: every option of the ``gather`` config group in
``gatherlab.conf`` (the repository's ``conf/gather/*.yaml``) but ``native``, which is no gather,
in `ordered`'s order: ``("fixed", "fixed_all_reduce", "fixed_reduce_scatter", "torch_nn",
"functional", "lightning", "old", "nograd_swap", "avg", "nograd")``. Read from those files on each
access, so a YAML file added there is listed too; options that a directory on
``hydra.searchpath`` adds are Hydra's to list (``gatherlab.components.config.group_options``)."""


def __getattr__(attribute: str) -> tuple[str, ...]:
    if attribute == "NAMES":  # read on access: the YAML files are the registry
        return names()
    raise AttributeError(f"module {__name__!r} has no attribute {attribute!r}")
