"""Gather implementations: all-gather a (B, ...) tensor from every rank into (W·B, ...).

Every implementation has the same forward (the ranks' tensors concatenated in rank order) and
differs only in what its backward hands back to the local input. With W ranks and a loss whose
gradient with respect to the gathered tensor on rank r is G_r (N × D, N = W·B), rank s receives
(docs/design.md §1):

- ``fixed``: Σ_r G_r[s], the gradient of every rank's loss with respect to its slice. After DDP's
  1/W average this is exactly the single-device gradient (lightly ≥ #1531, solo-learn, VISSL).
  Its backward all-reduces on gloo and reduce-scatters on NCCL; ``fixed_all_reduce`` and
  ``fixed_reduce_scatter`` force one collective (``Fixed(collective=...)``).
- ``torch_nn``: the same sum, by ``torch.distributed.nn.functional.all_gather``'s backward
  (reduce-scatter on NCCL, all-to-all and a sum elsewhere).
- ``functional``: the same sum, by ``_functional_collectives.all_gather_single_autograd``'s
  backward (reduce-scatter).
- ``lightning``: the same sum, by what ``LightningModule.all_gather(sync_grads=True)`` runs under
  DDP (``torch_nn`` underneath, stacked to (W, B, ...), flattened here).
- ``old``: G_s[s], only its own loss's gradient of its own slice; the terms that other ranks'
  losses put on this slice are dropped (lightly < #1531, Spijkervet SimCLR, early solo-learn).
- ``nograd_swap``: a no-grad all_gather whose own slot is replaced by the live local tensor, so
  the gradient is again G_s[s] (OpenCLIP's default ``gather_with_grad=False``).
- ``nograd``: a no-grad all_gather and nothing else: no gradient flows through it at all, only
  the loss's direct uses of the local tensor carry one (MoCo's ``concat_all_gather`` used on live
  features).
- ``avg``: (1/W) Σ_r G_r[s], the sum averaged by an all-reduce AVG (DisCo-CLIP, Horovod ≥ 0.21).

Each is a ``Gather`` class that states its predicted gradient class per loss style. The names
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

import contextlib
import importlib
import importlib.resources
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gatherlab.core import terms
from gatherlab.ranks import simworld, world

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

GatherFn = Callable[[torch.Tensor], torch.Tensor]
"""A gather as a loss takes it: a function from the local (B, ...) tensor to the gathered
(W·B, ...) tensor."""

STYLES = tuple(terms.Style)
"""The loss styles of docs/design.md §1 (`gatherlab.core.terms.Style`): the keys of
`Gather.predicted`."""
CLASSES = tuple(terms.GradientClass)
"""The gradient classes a gather's backward can give after DDP's average (docs/design.md §1;
`gatherlab.core.terms.GradientClass`)."""


class Gather:
    """A gather implementation: ``gather(tensor)`` all-gathers the local (B, ...) tensor into the
    (W·B, ...) tensor of every rank's slices in rank order, with the backward that defines it.

    ``predicted`` maps each loss style (``STYLES``) to the gradient class (``CLASSES``) that the
    mathematics predicts after DDP's average (docs/design.md §1); the audit measures it and marks
    a disagreement. A style left out has no prediction. Calling the object gathers when a process
    group of more than one rank runs, and returns its input otherwise, so the same loss code runs
    on one device. Subclasses are picklable (ranks may be spawned processes).

    ``backward`` names the rule its backward obeys (``simworld.RULES``: ``sum``, ``own``,
    ``mean``, ``none``), from which the simulated world of ``simworld`` reproduces it without a
    process group; a gather that names none runs on real ranks only.

    A subclass implements `Gather.gather` and sets `Gather.predicted` and `Gather.backward`; a
    YAML file in a ``gather/`` folder of the config search path that names it with ``_target_``
    makes it an option of the ``gather`` group (docs/design.md §4). Calling a gather whose
    ``backward`` is None in a simulated world of more than one rank raises ``TypeError``.

    Example:
        >>> import torch
        >>> from gatherlab.gather import get
        >>> fixed = get("fixed")
        >>> fixed(torch.ones(2, 3)).shape  # no process group: the input itself
        torch.Size([2, 3])
    """

    predicted: Mapping[str, str] = {}
    """The gradient class (`CLASSES`) predicted per loss style (`STYLES`); a style left out has no
    prediction."""
    backward: str | None = None
    """The rule of the backward (``sum``, ``own``, ``mean``, ``none``;
    `gatherlab.ranks.simworld.RULES`), or None when the gather names none and runs on real ranks
    only."""

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Gather ``tensor`` from every rank of the running process group.

        Called by the object only when a process group of more than one rank runs; a subclass
        implements it.

        Args:
            tensor: this rank's (B, ...) tensor; every rank passes the same shape.

        Returns:
            The (W·B, ...) tensor of every rank's slice in rank order, with this gather's
            backward.

        Raises:
            NotImplementedError: in the base class.
        """
        raise NotImplementedError

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if world.size() == 1:
            return tensor
        if simworld.size() is None:
            return self.gather(tensor)
        if self.backward is None:
            raise TypeError(f"{type(self).__name__} names no backward rule to simulate")
        return simworld.gather(tensor, self.backward)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash(type(self))

    def __repr__(self) -> str:
        arguments = ", ".join(f"{key}={value!r}" for key, value in vars(self).items())
        return f"{type(self).__name__}({arguments})"


def _all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's tensor, concatenated along the first dimension in rank order, gathered straight
    into one preallocated tensor (no list of slices, no concatenation)."""
    tensor = tensor.contiguous()
    gathered = tensor.new_empty((dist.get_world_size() * tensor.shape[0], *tensor.shape[1:]))
    dist.all_gather_single(gathered, tensor)
    return gathered


# The two collectives that deliver Σ_r G_r[s] to rank s in ``fixed``'s backward. NCCL's
# reduce-scatter of S sends half the bytes of an all-reduce of W·S; on gloo the all-reduce is the
# faster one (``python -m gatherlab.bench gather`` measures both), so each backend gets its own.
BACKWARD_COLLECTIVES = ("all_reduce", "reduce_scatter")
REDUCE_SCATTER_BACKENDS = frozenset({"nccl", "xccl"})


def backward_collective(backend: str | None = None) -> str:
    """The collective ``fixed``'s (and ``avg``'s) backward uses on ``backend`` (None: the running
    one): ``reduce_scatter`` on NCCL and XCCL, ``all_reduce`` elsewhere."""
    backend = str(dist.get_backend()) if backend is None else backend
    return "reduce_scatter" if backend in REDUCE_SCATTER_BACKENDS else "all_reduce"


def _sum_over_ranks_of_own_slice(grad: torch.Tensor, collective: str | None = None) -> torch.Tensor:
    """Σ_r G_r[s] on rank s, where ``grad`` is this rank's G_r, the gradient of the whole gathered
    tensor (N × …).

    reduce_scatter reads ``grad`` and writes the sum straight into the own slice (no copy);
    all_reduce sums in place, so it works on one copy of ``grad``, which autograd may share with
    other nodes (an addition hands the same gradient to both of its inputs), and keeps a view of
    its own rows.
    """
    if (collective or backward_collective()) == "reduce_scatter":
        own = grad.new_empty((grad.shape[0] // dist.get_world_size(), *grad.shape[1:]))
        dist.reduce_scatter_single(own, grad.contiguous(), op=dist.ReduceOp.SUM)
        return own
    summed = grad.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    return summed[world.own_rows(summed.shape[0])]


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
        return _all_gather(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        return _sum_over_ranks_of_own_slice(grad, ctx.collective), None


class _OldGather(torch.autograd.Function):
    """Forward: all_gather. Backward: the own slice's gradient only, no collective.

    This was lightly's GatherLayer before #1531: the gradient other ranks' losses put on this
    rank's slice never reaches it.
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        return _all_gather(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad[world.own_rows(grad.shape[0])]


class _AvgGather(torch.autograd.Function):
    """Forward: all_gather. Backward: all_reduce AVG of every slice's gradient, own slice kept.

    The mean over ranks instead of the sum: every gradient that passes through the gather is W
    times too small (DisCo-CLIP; Horovod's allgather gradient since 0.21). gloo has no AVG, so the
    sum is divided by W.
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        return _all_gather(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _sum_over_ranks_of_own_slice(grad) / dist.get_world_size()


_S, _C = terms.Style, terms.GradientClass
EXACT = {_S.LOCAL: _C.EXACT, _S.GLOBAL: _C.EXACT, _S.MIXED: _C.EXACT}
# The backward hands each slice its own loss's gradient only: a loss every rank computes in full
# gets exactly 1/W of the gradient; a local or mixed loss loses the cross-rank terms.
OWN_SLICE_ONLY = {_S.LOCAL: _C.BIASED, _S.GLOBAL: _C.ONE_OVER_W, _S.MIXED: _C.BIASED}
BIASED_EVERYWHERE = {_S.LOCAL: _C.BIASED, _S.GLOBAL: _C.BIASED, _S.MIXED: _C.BIASED}


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
    """``_functional_collectives.all_gather_single_autograd``: a private torch module, and the one
    whose backward torch itself uses for tensor-parallel code; measured here for that reason."""

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


class Old(Gather):
    """lightly's GatherLayer before #1531: the own slice's gradient only."""

    predicted = OWN_SLICE_ONLY
    backward = terms.Rule.OWN

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return _OldGather.apply(tensor)


class NogradSwap(Gather):
    """A no-grad all_gather with the live local tensor put back in its slot (OpenCLIP's default)."""

    predicted = OWN_SLICE_ONLY
    backward = terms.Rule.OWN

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            gathered = _all_gather(tensor)
        own = world.own_rows(gathered.shape[0])
        return torch.cat([gathered[: own.start], tensor, gathered[own.stop :]], dim=0)


class Avg(Gather):
    """An all_reduce AVG of the slice gradients (DisCo-CLIP, Horovod ≥ 0.21)."""

    predicted = OWN_SLICE_ONLY
    backward = terms.Rule.MEAN

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return _AvgGather.apply(tensor)


class Nograd(Gather):
    """A no-grad all_gather and nothing else (MoCo's ``concat_all_gather`` on live features).

    Predicted biased: only the loss's direct uses of the local tensor carry a gradient. A global
    loss that has none (``ntxent_global``) gets no gradient at all, which the audit measures and
    marks as a disagreement (docs/design.md §1).
    """

    predicted = BIASED_EVERYWHERE
    backward = terms.Rule.NONE

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return _all_gather(tensor)


def rule(gather: GatherFn | None) -> terms.Rule | None:
    """The rule a gather's backward obeys (``simworld.RULES``), from which the simulated world
    reproduces it; None for a gather that names none (it runs on real ranks only).

    Args:
        gather: a gather (any callable) or None.

    Returns:
        Its ``backward`` attribute when that is one of `gatherlab.ranks.simworld.RULES`, else None.

    Example:
        >>> from gatherlab.gather import get, rule
        >>> rule(get("old"))
        <Rule.OWN: 'own'>
    """
    named = getattr(gather, "backward", None)
    return terms.Rule(named) if named in simworld.RULES else None


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


# --- the registry: the options of the config group ``gather`` ------------------------------------

# The classes of this module in the order it defines them, the order of docs/design.md §1's table
# (the exact gathers first, ``nograd`` last): how `ordered` sorts. Read from the module itself.
_CLASSES = tuple(
    value
    for value in dict(globals()).values()
    if isinstance(value, type) and issubclass(value, Gather) and value is not Gather
)


def _group_folder() -> Path:
    """``conf/gather/`` as the package carries it: ``gatherlab.conf`` is the repository's
    ``conf/`` (editable install) or its copy in a wheel, the folder Hydra composes too."""
    return Path(str(importlib.resources.files("gatherlab.conf"))) / "gather"


def _options() -> dict[str, Path]:
    """Every option of gatherlab's ``gather`` group, ``native`` included: name → its YAML file."""
    return {path.stem: path for path in sorted(_group_folder().glob("*.yaml"))}


def _import(target: str) -> Any:
    """The object a ``_target_`` names: ``package.module.attribute`` or
    ``package.module:attribute``."""
    module, _, attribute = target.partition(":") if ":" in target else target.rpartition(".")
    value = importlib.import_module(module)
    for part in attribute.split("."):
        value = getattr(value, part)
    return value


def _build(name: str, path: Path) -> GatherFn | None:
    """What the option's file names: its ``_target_`` called with the file's other keys as keyword
    arguments (Hydra's ``instantiate`` of that file), None for ``_target_: null`` (``native``)."""
    from omegaconf import OmegaConf  # imported here: only a gather built by name reads YAML

    arguments = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    target = arguments.pop("_target_", None)
    special = sorted(key for key in arguments if key.startswith("_"))
    if special:
        raise ValueError(
            f"gather={name!r} ({path}) sets {special[0]}, which gatherlab.gather.get does not "
            "read; allowed: _target_ and the keyword arguments of the gather it names"
        )
    return None if target is None else _import(target)(**arguments)


def ordered(gathers: Mapping[str, Any]) -> dict[str, Any]:
    """Name → gather in the order of docs/design.md §1's table: the gathers of this module's
    classes in the order it defines them (``fixed`` and its variants first, ``nograd`` last),
    then every other gather; the names of one class in alphabetical order.

    Args:
        gathers: name → gather, e.g. the options of the ``gather`` group built.

    Returns:
        The same items, in that order.

    Example:
        >>> from gatherlab.gather import Fixed, Old, ordered
        >>> list(ordered({"mine": print, "old": Old(), "fixed_x": Fixed(), "fixed": Fixed()}))
        ['fixed', 'fixed_x', 'old', 'mine']
    """

    def place(item: tuple[str, Any]) -> tuple[int, str]:
        name, gather = item
        kind = type(gather)
        return (_CLASSES.index(kind) if kind in _CLASSES else len(_CLASSES), name)

    return dict(sorted(gathers.items(), key=place))


def _gathers() -> dict[str, GatherFn]:
    """Every option of gatherlab's ``gather`` group that is a gather (not ``native``), built, in
    `ordered`'s order."""
    built = {name: _build(name, path) for name, path in _options().items()}
    return ordered({name: gather for name, gather in built.items() if gather is not None})


NAMES: tuple[str, ...]  # annotated only: ``__getattr__`` computes it (no assignment here)
"""The gathers gatherlab ships: every option of the ``gather`` config group in
``gatherlab.conf`` (the repository's ``conf/gather/*.yaml``) but ``native``, which is no gather,
in `ordered`'s order: ``("fixed", "fixed_all_reduce", "fixed_reduce_scatter", "torch_nn",
"functional", "lightning", "old", "nograd_swap", "avg", "nograd")``. Read from those files on each
access, so a YAML file added there is listed too; options that a directory on
``hydra.searchpath`` adds are Hydra's to list (``gatherlab.components.config.group_options``)."""


def __getattr__(attribute: str) -> tuple[str, ...]:
    if attribute == "NAMES":  # read on access: the YAML files are the registry
        return tuple(_gathers())
    raise AttributeError(f"module {__name__!r} has no attribute {attribute!r}")


def get(name: str) -> GatherFn:
    """The gather that the option ``name`` of the ``gather`` config group names
    (``conf/gather/<name>.yaml`` in ``gatherlab.conf``), built as Hydra builds it; it returns its
    input when no process group of more than one rank is running.

    Args:
        name: a name of `NAMES`.

    Returns:
        A new instance of what the file's ``_target_`` names, called with the file's other keys
        (for gatherlab's files a `Gather` subclass): a picklable callable that maps the local
        (B, ...) tensor to the gathered (W·B, ...) tensor in rank order.

    Raises:
        ValueError: ``name`` is no option of the group, or is ``native`` (no gather: the loss
            communicates by itself); the message lists the allowed names.

    Example:
        >>> from gatherlab.gather import get
        >>> get("fixed"), get("fixed_all_reduce")
        (Fixed(collective=None), Fixed(collective='all_reduce'))
    """
    options = _options()
    gather = _build(name, options[name]) if isinstance(name, str) and name in options else None
    if gather is None:
        allowed = ", ".join(_gathers())
        what = (
            "is no gather: the loss communicates by itself (its YAML file has _target_: null)"
            if name in options
            else "is unknown"
        )
        raise ValueError(f"gather={name!r} {what}; allowed: {allowed}")
    return gather


def resolve(gather: str | GatherFn | None) -> GatherFn:
    """What a loss's ``gather`` argument means: a name of `NAMES`, a callable, or None (identity).

    Args:
        gather: a name of `NAMES`, a callable ``x -> gathered x``, or None.

    Returns:
        ``get(gather)`` for a name, the callable itself, or for None a function that returns its
        input (no gathering).

    Raises:
        ValueError: an unknown name, or ``"native"`` (no gather).
        TypeError: anything else than a string, a callable or None.

    Example:
        >>> import torch
        >>> from gatherlab.gather import resolve
        >>> resolve(None)(torch.ones(2)).tolist()
        [1.0, 1.0]
    """
    if gather is None:
        return _identity
    if isinstance(gather, str):
        return get(gather)
    if callable(gather):
        return gather
    raise TypeError(
        f"gather must be a name ({', '.join(_gathers())}), a callable or None, not {gather!r}"
    )
