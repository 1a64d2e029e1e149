"""What every gather is: the `Gather` base class, the function type a loss takes (`GatherFn`), the
loss styles and gradient classes a gather predicts, and the backward rule it names (`rule`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from gatherlab.core import terms
from gatherlab.ranks import simworld, world

__all__ = [
    "BIASED_EVERYWHERE",
    "CLASSES",
    "EXACT",
    "OWN_SLICE_ONLY",
    "STYLES",
    "Gather",
    "GatherFn",
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

_S, _C = terms.Style, terms.GradientClass
EXACT = {_S.LOCAL: _C.EXACT, _S.GLOBAL: _C.EXACT, _S.MIXED: _C.EXACT}
"""The prediction of a backward that sums every rank's gradient of each slice: exact in every
style."""
OWN_SLICE_ONLY = {_S.LOCAL: _C.BIASED, _S.GLOBAL: _C.ONE_OVER_W, _S.MIXED: _C.BIASED}
"""The prediction of a backward that hands each slice its own loss's gradient only: a loss every
rank computes in full gets exactly 1/W of the gradient; a local or mixed loss loses the cross-rank
terms."""
BIASED_EVERYWHERE = {_S.LOCAL: _C.BIASED, _S.GLOBAL: _C.BIASED, _S.MIXED: _C.BIASED}
"""The prediction of a backward that passes no gradient: only a loss's direct uses of the local
tensor carry one."""


class Gather:
    """A gather implementation: ``gather(tensor)`` all-gathers the local (B, ...) tensor into the
    (W·B, ...) tensor of every rank's slices in rank order, with the backward that defines it.

    Without a process group of more than one rank the object returns its input, so the same loss
    code runs on one device; in a simulated world it follows its `Gather.backward` rule
    (``TypeError`` when it names none). The audit measures `Gather.predicted` (docs/design.md §1).
    A subclass implements `Gather.gather`, sets both attributes and stays picklable; a YAML file
    that names it makes it an option of the ``gather`` group (docs/design.md §4).

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
