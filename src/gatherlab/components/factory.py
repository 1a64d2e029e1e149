"""Building a loss, a module or a data set where it runs: inside each rank, after the process group
exists.

Losses from other projects are built the way their own training scripts build them: OpenCLIP's
``ClipLoss(rank=, world_size=)`` reads the layout at construction, lightly's losses with
``gather_distributed=True`` communicate by themselves. A ``Recipe`` carries what the loss is
made of (an importable factory and its keyword arguments) to the ranks and builds it there
(docs/design.md §4):

- ``rank=`` and ``world_size=`` are passed when the factory's signature takes them and the
  arguments do not set them (from the running process group; 0 and 1 on one device);
- ``gather=`` is passed only when a gather is given; without one the loss communicates by itself
  ("native");
- the loss's own parameters, if any, are drawn from ``seed``, so every rank and the 1-device
  reference start from the same ones;
- a loss written as a plain function (``def loss(z0, z1, temperature=0.5)``: positional inputs
  the arguments do not fill) is the loss itself, not its factory: it is taken as it is written
  (`FunctionLoss`), its keyword arguments bound;
- what a loss takes besides the two views' embeddings (masks, token ids, a teacher's outputs,
  prototypes) travels with it as `Inputs`, made once for the whole global batch: each rank is
  given its own rows of every tensor that has a row per sample, and the rest whole.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gatherlab.core.imports import locate
from gatherlab.gather import GatherFn
from gatherlab.ranks import world

__all__ = ["AttributeOf", "FunctionLoss", "Inputs", "Recipe", "is_loss_function", "locate"]


def _parameters(factory: Callable[..., Any]) -> Mapping[str, inspect.Parameter]:
    try:
        return inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without a signature: pass nothing extra
        return {}


@dataclass(frozen=True)
class Inputs:
    """What a loss takes besides the two views' embeddings, made for a whole global batch of
    ``batch`` rows: ``loss(out0, out1, *args, **kwargs)`` (docs/checking.md §6, "A loss's
    inputs"). A tensor whose first dimension is ``batch`` holds a row per sample (a mask, token
    ids, a teacher's outputs) and is split as the views are: the loss on a rank is given that
    rank's rows; anything else (prototypes, a table, a number) is given whole to every rank and
    to one device alike. A tensor that holds both views' rows (2·``batch``) is given whole too:
    give each view's rows as a tensor of its own."""

    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    batch: int = 0

    @classmethod
    def made(cls, made: Any, batch: int, named: str = "the inputs") -> Inputs:
        """The inputs a user's factory (or the user) made: a tuple or list (given positionally),
        a dict with string keys (given by keyword) or one tensor; a ValueError of one line,
        naming them as ``named``, otherwise."""
        if isinstance(made, torch.Tensor):
            made = (made,)
        if isinstance(made, Mapping) and all(isinstance(key, str) for key in made):
            return cls((), dict(made), batch)
        if isinstance(made, tuple | list):
            return cls(tuple(made), {}, batch)
        raise ValueError(
            f"{named} are a {type(made).__name__}; allowed: a tuple or list of the loss's further "
            "positional inputs, a dict of its keyword inputs (string keys), or one tensor"
        )

    def split(self, value: Any) -> bool:
        """Whether ``value`` is split over the ranks (a tensor with a row per sample)."""
        return isinstance(value, torch.Tensor) and value.dim() > 0 and len(value) == self.batch

    def of_rows(
        self, rows: slice | torch.Tensor, like: torch.Tensor
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The positional and keyword inputs of these ``rows`` of the global batch: each split
        tensor's rows, the rest whole; every tensor on ``like``'s device, a floating one in its
        dtype (the precision the loss runs in)."""

        def given(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            if self.split(value):
                value = value[rows]
            dtype = like.dtype if value.is_floating_point() else value.dtype
            return value.to(like.device, dtype)

        return tuple(given(v) for v in self.args), {k: given(v) for k, v in self.kwargs.items()}

    def names(self) -> list[str]:
        """A name for each input, in the order of ``args`` then ``kwargs``, as the trace calls
        them (`gatherlab.runs.trace`): ``argument 3``, …, then each keyword."""
        return [f"argument {i + 3}" for i in range(len(self.args))] + list(self.kwargs)


@dataclass(frozen=True)
class Recipe:
    """An object to build in the process that uses it (``recipe()``): a loss, a user's
    LightningModule or a data set, as ``factory(**kwargs)`` with this rank's ``rank=`` and
    ``world_size=`` when the factory takes them, ``gather=`` when one is given, and its initial
    parameters drawn from ``seed``. Picklable when ``factory`` and ``gather`` are (a class or
    function of an importable module is).

    ``gather=None`` builds the object without a ``gather`` argument: a loss then communicates by
    itself. ``inputs``: what a loss is called with besides the two views' embeddings, if
    anything (`Inputs`).
    """

    factory: Callable[..., nn.Module]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    gather: GatherFn | None = None
    seed: int = 0
    inputs: Inputs | None = None

    def arguments(self) -> dict[str, Any]:
        """The keyword arguments the factory gets in this process."""
        arguments = dict(self.kwargs)
        accepted = _parameters(self.factory)
        if "rank" in accepted and "rank" not in arguments:
            arguments["rank"] = world.rank()
        if "world_size" in accepted and "world_size" not in arguments:
            arguments["world_size"] = world.size()
        if self.gather is not None:
            arguments["gather"] = self.gather
        return arguments

    def __call__(self, **given: Any) -> nn.Module:
        """The object built here; ``given``: more keyword arguments (a tensor-parallel layout's
        ``mesh``, docs/checking.md §10), each passed when the factory takes it."""
        accepted = _parameters(self.factory) if given else {}
        arguments = {**self.arguments(), **{k: v for k, v in given.items() if k in accepted}}
        if is_loss_function(self.factory, arguments):
            return FunctionLoss(self.factory, arguments)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return self.factory(**arguments)

    def accepts(self, keyword: str) -> bool:
        """Whether the factory takes the keyword argument ``keyword``."""
        return keyword in _parameters(self.factory)

    def with_gather(self, gather: GatherFn | None) -> Recipe:
        return Recipe(self.factory, self.kwargs, gather, self.seed, self.inputs)

    def declared(self, attribute: str) -> Any:
        """What the loss class declares (``style``, ``layout_invariant``), None when it does not."""
        return getattr(self.factory, attribute, None)

    @property
    def name(self) -> str:
        return f"{self.factory.__module__}:{self.factory.__qualname__}"


def is_loss_function(factory: Callable[..., Any], arguments: Mapping[str, Any]) -> bool:
    """Whether ``factory`` is a loss written as a plain function rather than a factory of one: a
    function (not a class) with a positional parameter that has no default and that
    ``arguments`` do not fill, its inputs (a factory called with ``arguments`` alone would
    raise ``missing required positional arguments``)."""
    if inspect.isclass(factory) or not callable(factory):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return any(
        p.kind in positional and p.default is inspect.Parameter.empty and name not in arguments
        for name, p in _parameters(factory).items()
    )


class FunctionLoss(nn.Module):
    """A loss written as a plain function, as a module: ``forward(*inputs, **named)`` is
    ``function(*inputs, **named, **kwargs)``. It holds no parameters and no buffers of its own."""

    def __init__(self, function: Callable[..., torch.Tensor], kwargs: Mapping[str, Any]):
        super().__init__()
        self.function, self.kwargs = function, dict(kwargs)

    def forward(self, *inputs: Any, **named: Any) -> torch.Tensor:
        return self.function(*inputs, **named, **self.kwargs)

    def extra_repr(self) -> str:
        return f"{self.function.__module__}.{self.function.__qualname__}"


class AttributeOf:
    """A factory of what ``recipe``'s objects hold as ``attribute`` (a module's loss, say), built
    by building the object: picklable as the recipe is, for a check that builds it in each rank."""

    def __init__(self, recipe: Recipe, attribute: str):
        self.recipe, self.attribute = recipe, attribute
        self.__qualname__ = f"{recipe.name}.{attribute}"

    def __call__(self) -> Any:
        return getattr(self.recipe(), self.attribute)
