"""Gather implementations: all-gather a (B, ...) tensor from every rank into (W·B, ...).

Every implementation has the same forward (the ranks' tensors concatenated in rank order) and
differs only in what its backward hands back to the local input. With W ranks and a loss whose
gradient with respect to the gathered tensor on rank r is G_r (N × D, N = W·B), rank s receives
(docs/design.md §1):

- ``fixed``: Σ_r G_r[s], the gradient of every rank's loss with respect to its slice. After DDP's
  1/W average this is exactly the single-device gradient (lightly ≥ #1531, VISSL).
  Its backward all-reduces on gloo and reduce-scatters on NCCL; ``fixed_all_reduce`` and
  ``fixed_reduce_scatter`` force one collective (``Fixed(collective=...)``).
- ``torch_nn``: the same sum, by ``torch.distributed.nn.functional.all_gather``'s backward
  (reduce-scatter on NCCL, all-to-all and a sum elsewhere).
- ``functional``: the same sum, by ``_functional_collectives.all_gather_single_autograd``'s
  backward (reduce-scatter).
- ``lightning``: the same sum, by what ``LightningModule.all_gather(sync_grads=True)`` runs under
  DDP (``torch_nn`` underneath, stacked to (W, B, ...), flattened here).
- ``old``: G_s[s], only its own loss's gradient of its own slice; the terms that other ranks'
  losses put on this slice are dropped (lightly < #1531, Spijkervet SimCLR, solo-learn 1.0.2).
- ``nograd_swap``: a no-grad all_gather whose own slot is replaced by the live local tensor, so
  the gradient is again G_s[s] (OpenCLIP's default ``gather_with_grad=False``).
- ``avg``: (1/W) Σ_r G_r[s], the sum averaged by an all-reduce AVG (DisCo-CLIP, Horovod ≥ 0.21).
- ``nograd``: a no-grad all_gather and nothing else: no gradient flows through it at all, only
  the loss's direct uses of the local tensor carry one (MoCo's ``concat_all_gather`` used on live
  features).

Each is a ``Gather`` class (`gatherlab.gather.base`) that states its predicted gradient class per
loss style; the exact ones are in `gatherlab.gather.exact`, the others in
`gatherlab.gather.inexact`, their collectives in `gatherlab.gather.collectives`, and
`gatherlab.gather.registry.IMPLEMENTATIONS` lists them in this order. The names
are the options of the Hydra config group ``gather``, one YAML file each in ``conf/gather/`` (the
package data ``gatherlab.conf``): that folder is the one registry of gathers, which sweeps, the
audit, ``python -m gatherlab.check --gather NAME`` and this module all read. ``NAMES`` lists its
options, ``get(name)`` builds the gather an option's file names (its ``_target_`` with the file's
other keys, as Hydra builds it), a function ``x -> gathered x``; without an initialised process
group (or with one rank) it returns its input, so the same loss code runs on one device.
``native`` (``_target_: null``) is an option but no gather: the loss communicates by itself. A new
gather is a callable anywhere importable, best a ``Gather`` subclass, plus one YAML file that
names it (docs/design.md §4); nothing registers it in code.
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
