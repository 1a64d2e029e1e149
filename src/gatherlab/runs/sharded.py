"""Sharded code as a rank trains it (docs/checking.md §10, "Sharded code"): the one error FSDP2's
users meet when a sharded parameter is used outside its module's forward, named by the parameter;
and the parameters DDP holds that its forward does not use (`OutsideForward`), which stall its
reducer.

Outside the forward of the module that ``fully_shard`` wraps, its parameters are sharded
``DTensor``s; an operation that mixes one with a plain tensor raises ``aten.div.Tensor got mixed
torch.Tensor and DTensor``, which names neither the parameter nor the line. `naming_dtensors` runs
the step under a watch of its operations (torch's public ``TorchFunctionMode``) that follows each
parameter's DTensor through the operations made from it, and raises that error again as one line
naming the parameter and the user's line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from gatherlab.core import cli, imports
from gatherlab.runs.trace import tensors_in

__all__ = ["OutsideForward", "ShardedParameterOutsideForward", "naming_dtensors"]

MIXED = "got mixed torch.Tensor and DTensor"
"""What torch's error says when an operation mixes a plain tensor and a DTensor."""


class ShardedParameterOutsideForward(RuntimeError):
    """A sharded parameter used outside its module's forward, with mixed plain tensors."""


class _Follow(TorchFunctionMode):
    """Each DTensor made from a parameter, by the parameter's name; the failing operation's."""

    def __init__(self, named: dict[int, str]) -> None:
        super().__init__()
        self.made_from = dict(named)
        self.failed: tuple[str, str] | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sources = [self.made_from[id(t)] for t in tensors_in((args, kwargs))
                   if id(t) in self.made_from]  # fmt: skip
        try:
            result = func(*args, **kwargs)
        except RuntimeError as error:
            if MIXED in str(error) and sources and self.failed is None:
                self.failed = (sources[0], getattr(func, "__name__", str(func)))
            raise
        if sources:
            for tensor in tensors_in(result):
                if isinstance(tensor, DTensor):
                    self.made_from[id(tensor)] = sources[0]
        return result


def naming_dtensors(model: nn.Module, step: Callable[[], Any]) -> Any:
    """``step()``, its error of a sharded parameter mixed with plain tensors raised again as
    `ShardedParameterOutsideForward`, one line naming the parameter, the operation and the user's
    line; any other outcome as it is. Without a sharded parameter, ``step()`` alone."""
    named = {id(p): name for name, p in model.named_parameters() if isinstance(p, DTensor)}
    if not named:
        return step()
    watch = _Follow(named)
    try:
        with watch:
            return step()
    except RuntimeError as error:
        if watch.failed is None:
            raise
        name, operation = watch.failed
        frame = cli.user_frame(error)
        where = f" at {imports.place(*frame)}" if frame else ""
        raise ShardedParameterOutsideForward(
            f"parameter {name} is sharded by FSDP2 (a DTensor) and used outside its module's "
            f"forward{where} ({operation} with a plain tensor); allowed: use it inside that "
            "module's forward, or keep it out of every sharded module and reduce its gradient"
        ) from None


class OutsideForward:
    """The parameters a DDP module holds whose gradient its first forward with gradient does not
    reach (``names``): found by walking the output's autograd graph (torch's public
    ``Node.next_functions``; a leaf's ``AccumulateGrad`` node holds its ``variable``), as DDP's
    own ``find_unused_parameters`` does. DDP's reducer, without that option, waits for each of
    them after every backward of its forward; a gradient they get elsewhere (a loss over cached
    embeddings) does not count, so the reducer never averages its bucket."""

    def __init__(self, ddp: nn.Module) -> None:
        self.names: tuple[str, ...] = ()
        self._held = {id(p): name for name, p in ddp.module.named_parameters() if p.requires_grad}
        self._hook = ddp.register_forward_hook(self._look)

    def _look(self, module: nn.Module, inputs: Any, output: Any) -> None:
        graphs = [t.grad_fn for t in tensors_in(output) if t.grad_fn is not None]
        if not graphs:  # under no_grad, or an output that needs no gradient: not a forward DDP
            return  # prepares its reducer for
        self._hook.remove()
        reached, seen, stack = set(), set(), list(graphs)
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf
            if variable is not None:
                reached.add(id(variable))
            stack.extend(next_node for next_node, _ in node.next_functions)
        self.names = tuple(name for key, name in self._held.items() if key not in reached)
