"""The parts of a model's gradient, named once (docs/checking.md §10, "What is compared";
docs/recording.md §11, "What is recorded"): the check of a training step and the recorder of a job
both cut a gradient into the same parts, so that a part's class means the same in both.

A part is a child of the shallowest module that holds the parameters in more than one child (or
holds one of them itself), or a parameter of that module: a model's top-level children and direct
parameters, unless it has a single child, whose children are then its parts, and so on down. A
``backbone`` and a ``head`` are two parts; ``nn.Sequential(encoder)`` is cut into the encoder's
layers, never into one part that no table would show apart from the whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["part_of"]


def _prefix(name: str, depth: int) -> str:
    return ".".join(name.split(".")[:depth])


def part_of(names: Sequence[str]) -> Callable[[str], str]:
    """The part of each parameter name of a module whose parameters are ``names`` (dotted, as
    ``named_parameters`` gives them): its prefix at the least depth at which the names fall into
    more than one part, or at which one of them is a parameter itself."""
    depth = 1
    while names:
        prefixes = {_prefix(name, depth) for name in names}
        only = next(iter(prefixes))
        if len(prefixes) > 1 or only in names:  # several parts, or a parameter of its own
            break
        depth += 1
    return lambda name: _prefix(name, depth)
