"""The options of the config group ``gather``: gatherlab's YAML files (``conf/gather/*.yaml`` in
the package data ``gatherlab.conf``) are the registry of gathers, nothing in code registers one;
this module lists them (`names`), builds one (`get`), reads a loss's ``gather`` argument
(`resolve`) and sorts gathers in the order of docs/design.md §1's table (`ordered`, by
`IMPLEMENTATIONS`, which orders gatherlab's classes and registers nothing)."""

from __future__ import annotations

import importlib.resources
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from gatherlab.core.imports import locate
from gatherlab.gather.base import Gather, GatherFn
from gatherlab.gather.exact import Fixed, Functional, Lightning, TorchNN
from gatherlab.gather.inexact import Avg, Nograd, NogradSwap, Old

__all__ = ["IMPLEMENTATIONS", "get", "names", "ordered", "resolve"]

IMPLEMENTATIONS: tuple[type[Gather], ...] = (
    Fixed, TorchNN, Functional, Lightning, Old, NogradSwap, Avg, Nograd,
)  # fmt: skip
"""gatherlab's own `Gather` classes, in the order of docs/design.md §1's table (the exact gathers
first, ``nograd`` last): how `ordered` sorts. Every class of this package is here
(``tests/gather/test_gather.py`` fails on one that is not)."""


def _group_folder() -> Path:
    """``conf/gather/`` as the package carries it: ``gatherlab.conf`` is the repository's
    ``conf/`` (editable install) or its copy in a wheel, the folder Hydra composes too."""
    return Path(str(importlib.resources.files("gatherlab.conf"))) / "gather"


def _options() -> dict[str, Path]:
    """Every option of gatherlab's ``gather`` group, ``native`` included: name → its YAML file."""
    return {path.stem: path for path in sorted(_group_folder().glob("*.yaml"))}


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
    return None if target is None else locate(target)(**arguments)


def ordered(gathers: Mapping[str, Any]) -> dict[str, Any]:
    """Name → gather in the order of docs/design.md §1's table: the gathers of gatherlab's classes
    in `IMPLEMENTATIONS`'s order (``fixed`` and its variants first, ``nograd`` last), then every
    other gather; the names of one class in alphabetical order.

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
        return (
            IMPLEMENTATIONS.index(kind) if kind in IMPLEMENTATIONS else len(IMPLEMENTATIONS),
            name,
        )

    return dict(sorted(gathers.items(), key=place))


def _gathers() -> dict[str, GatherFn]:
    """Every option of gatherlab's ``gather`` group that is a gather (not ``native``), built, in
    `ordered`'s order."""
    built = {name: _build(name, path) for name, path in _options().items()}
    return ordered({name: gather for name, gather in built.items() if gather is not None})


def names() -> tuple[str, ...]:
    """The gathers gatherlab ships, in `ordered`'s order, read from the YAML files now
    (``gatherlab.gather.NAMES``)."""
    return tuple(_gathers())


def get(name: str) -> GatherFn:
    """The gather ``conf/gather/<name>.yaml`` names, built as Hydra builds it.

    Args:
        name: a name of `gatherlab.gather.NAMES`.

    Returns:
        A new instance of the file's ``_target_`` called with its other keys (for gatherlab's
        files a `Gather`): local (B, ...) tensor → gathered (W·B, ...) tensor in rank order.

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


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def resolve(gather: str | GatherFn | None) -> GatherFn:
    """What a loss's ``gather`` argument means.

    Args:
        gather: a name of `gatherlab.gather.NAMES`, a callable ``x -> gathered x``, or None.

    Returns:
        ``get(gather)`` for a name, the callable itself, or for None the identity.

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
