"""The operations of one forward, recorded as the code under check calls them: each torch function
(``torch.*``, ``torch.nn.functional.*``, ``Tensor`` methods, ``torch.distributed`` collectives),
the file and line of the code that called it, a copy of its result, the recorded operations whose
results it took, and, after the backward, the gradient of its result (docs/checking.md §6, "Where it
departs"). ``gatherlab.check.where`` compares the records of one device with those of each rank.

Recorded through torch's public ``TorchFunctionMode``: an operation is the call the code makes
(``F.normalize``, not the kernels inside it); calls that torch's, the frameworks' or gatherlab's own
machinery make (a DDP buffer broadcast, Lightning's logging) are not the code's and are not
recorded. Only floating-point results are kept as values; an integer or boolean result (indices,
masks) is positional and is linked, not compared.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from gatherlab.core import cli, imports

__all__ = ["INPUT", "Op", "Tracer", "batch_tensors", "buffer_state", "tensors_in", "traced"]

INPUT = "input"
"""The name of the record of a tensor the traced code was given (a view, a batch, a buffer)."""

# gatherlab's own machinery: the ranks, the runs and the check call torch too, around the code
# under check; its losses, gathers and models are code under check like a user's.
_MACHINERY = tuple(
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), package) + os.sep
    for package in ("runs", "check", "ranks", "core", "recording")
)
# The results a ``torch.distributed`` collective writes into its first argument (a tensor or a
# list of them) instead of returning them.
_IN_PLACE_MODULES = ("torch.distributed",)
# Calls that write their first argument in place and return nothing: recorded with it as their
# result (``queue[ptr:ptr + B] = keys`` writes the queue), as a collective's.
_WRITES = frozenset({"Tensor.__setitem__"})
# Calls whose result holds their input's values without its gradient (a stop-gradient).
_DETACHES = frozenset({"Tensor.detach", "Tensor.detach_"})
_COLLECTIVES = frozenset({
    "all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all", "broadcast",
    "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "send", "recv",
})  # fmt: skip


@dataclass
class Op:
    """One recorded call: ``name`` (``torch.mean``, ``Tensor.mean``,
    ``torch.nn.functional.batch_norm``, ``torch.distributed.all_gather``, or ``input``), ``where``
    the code's ``file:line``, ``value`` a float64 copy of its (first) floating-point result (None
    for none), ``inputs`` the indices of the records whose results it took, ``input_shapes`` the
    shapes of its tensor arguments, ``dims`` the dimensions it reduces or normalises over where the
    call names them (``()`` for all, None when it names none), ``no_grad`` whether it ran without
    gradient while an argument required one, ``grad`` the gradient of its result after the
    backward, ``backward`` the custom autograd Function whose backward takes its result's
    gradient (``Name.backward at file:line``), ``updates`` the buffer it wrote (in place or by
    assignment)."""

    index: int
    name: str
    where: str
    value: torch.Tensor | None
    inputs: tuple[int, ...] = ()
    input_shapes: tuple[tuple[int, ...], ...] = ()
    dims: tuple[int, ...] | None = None
    no_grad: bool = False
    grad: torch.Tensor | None = None
    backward: str | None = None
    updates: str | None = None
    returned: bool = False
    """Whether its result is what the traced code returned (the loss)."""
    rows: tuple[int, ...] = field(default=(), compare=False)
    """For an ``input``: its shape (the record keeps no value for non-floating inputs)."""

    @property
    def label(self) -> str:
        """``file:line  op``, as the ``where`` column of check.csv shows it."""
        return f"{self.where}  {self.short}"

    @property
    def short(self) -> str:
        """The operation's name without its module: ``mean``, ``batch_norm``, ``all_gather``."""
        return self.name.rsplit(".", 1)[-1]


@functools.cache
def _machinery(filename: str) -> bool:
    """Whether a frame's file is torch's, a framework's, the standard library's or gatherlab's own
    machinery rather than the code under check."""
    path = os.path.realpath(filename)
    if path.startswith(_MACHINERY) or filename.startswith("<frozen "):
        return True
    return not cli.is_users(filename) and not path.startswith(_GATHERLAB)


_GATHERLAB = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep


@functools.cache
def _torch_file(filename: str) -> bool:
    return os.path.realpath(filename).startswith(_TORCH)


_TORCH = os.path.dirname(os.path.realpath(torch.__file__)) + os.sep


def _caller() -> str | None:
    """The ``file:line`` of the code under check that made the current call: the innermost frame
    outside torch; None when that frame is machinery (the call is not the code's)."""
    frame = inspect.currentframe().f_back.f_back
    while frame is not None and (
        _torch_file(frame.f_code.co_filename) or frame.f_code.co_filename == __file__
    ):
        frame = frame.f_back
    if frame is None or _machinery(frame.f_code.co_filename):
        return None
    return imports.place(frame.f_code.co_filename, frame.f_lineno)


def _collective(name: str) -> bool:
    """Whether a call is one of torch.distributed's collectives, which carry no gradient (unlike
    the autograd-aware ones of torch.distributed.nn)."""
    module, _, short = name.rpartition(".")
    distributed = module.startswith("torch.distributed") and not module.startswith(
        "torch.distributed.nn"
    )
    return distributed and short in _COLLECTIVES


def _name(func) -> str:
    if getattr(func, "__name__", None) == "__get__" and hasattr(func, "__self__"):
        return "Tensor." + func.__self__.__name__  # an attribute such as ``.T``
    qualname = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
    module = getattr(func, "__module__", None)
    if qualname.startswith(("TensorBase.", "Tensor.")):
        return "Tensor." + qualname.split(".", 1)[1]
    if qualname.startswith("_VariableFunctionsClass."):
        return "torch." + qualname.split(".", 1)[1]
    if module and not qualname.startswith(module):
        return f"{module}.{qualname}"
    return qualname


Dims = tuple[int, ...] | None

# Operations that reduce or normalise over the batch by what they are, not by a ``dim`` argument:
# a batch norm in training mode takes every dimension but the features; a cross-entropy or NLL
# loss takes the softmax over its classes (dim 1) and the mean over its rows (dim 0).
_FIXED_DIMS = {
    "batch_norm": lambda arguments: (0,) if arguments.get("training") else None,
    "cross_entropy": lambda arguments: (1,) if arguments.get("reduction") == "none" else (1, 0),
    "nll_loss": lambda arguments: None if arguments.get("reduction") == "none" else (0,),
}


# The reductions and normalisations whose second positional argument is ``dim`` where they have no
# Python signature (``torch.mean(x, 0)``, ``x.softmax(0)``).
_REDUCTIONS = frozenset({
    "mean", "sum", "nansum", "nanmean", "prod", "std", "var", "std_mean", "var_mean", "logsumexp",
    "softmax", "log_softmax", "max", "min", "amax", "amin", "norm", "median", "cumsum", "argmax",
    "argmin", "all", "any",
})  # fmt: skip


def _arguments(func, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name where the function has a Python signature (defaults
    applied); else ``dim`` from the second positional argument of a method-like call."""
    try:
        bound = inspect.signature(func).bind(*args, **kwargs)
    except (TypeError, ValueError):
        arguments = dict(kwargs)
        short = _name(func).rsplit(".", 1)[-1]
        if short in _REDUCTIONS and "dim" not in arguments and len(args) > 1 and _is_dims(args[1]):
            arguments["dim"] = args[1]
        return arguments
    bound.apply_defaults()
    return dict(bound.arguments)


def _is_dims(value) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return True
    return isinstance(value, (tuple, list)) and all(isinstance(v, int) for v in value)


def _dims(name: str, arguments: dict, shapes: tuple[tuple[int, ...], ...]) -> Dims:
    short = name.rsplit(".", 1)[-1]
    if short in _FIXED_DIMS:
        return _FIXED_DIMS[short](arguments)
    dim = arguments.get("dim")
    if dim is None:
        return None
    rank = len(shapes[0]) if shapes else 0
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    return tuple(d % rank if rank else d for d in dims)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor, without importing DTensor's module (~0.6 s; a comparison
    of recordings never needs it): none exists before it is imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def _value(tensor: torch.Tensor) -> torch.Tensor | None:
    if not tensor.is_floating_point() or tensor.is_meta:
        return None
    if _is_dtensor(tensor):  # copied without an operation of DTensor's own, which could
        # redistribute it: a vocabulary-parallel embedding's pending sum consumes its mask there
        local = tensor.to_local().detach().to("cpu", torch.float64, copy=True)
        return type(tensor).from_local(local, tensor.device_mesh, tensor.placements,
                                       run_check=False, shape=tensor.shape,
                                       stride=tensor.stride())  # fmt: skip
    return tensor.detach().to("cpu", torch.float64, copy=True)


class Tracer(TorchFunctionMode):
    """Records the calls of the code under check while active (``with Tracer(given) as tracer:``);
    ``tracer.ops`` holds them in call order, first an ``input`` record for each tensor ``given``
    to the code (a name for each: ``view 0``, ``batch``);
    `keep_gradients` (after the forward, before the backward) makes the backward fill each
    record's ``grad``; `buffers` names the records that wrote a module's buffers."""

    def __init__(self, given: Mapping[str, torch.Tensor] | None = None, plain=False) -> None:
        super().__init__()
        self._plain = plain
        self.sharded = False
        """With ``plain``: whether a call gave a DTensor (tensor or sequence parallelism), which
        is then not recorded: a recording's trace is read against one device's whole tensors."""
        self._given = dict(given or {})
        self.ops: list[Op] = []
        self._results: list[list[torch.Tensor]] = []  # each record's result tensors, kept alive
        self._producer: dict[int, int] = {}  # id(tensor) -> the record that produced it
        self._probed: bool | None = None  # `active`'s probe: None, else whether it was seen

    def __enter__(self) -> Tracer:
        for what, tensor in self._given.items():  # before the mode records anything
            self.given(what, tensor)
        return super().__enter__()

    def given(self, what: str, tensor: torch.Tensor) -> None:
        """An ``input`` record: a tensor given to the code (at the start, or before a later call
        of the model that takes it, as a recorded job's second view)."""
        self._record(INPUT, what, [tensor], (), (), None, False)

    def active(self) -> bool:
        """Whether this mode still sees the calls of the thread that entered it. Autograd runs a
        backward hook in its thread's state of the backward's start and restores that state
        after the hook: a mode entered inside a hook (a cached loss calls its model from its
        backward) is gone afterwards, and leaving it then would pop another."""
        self._probed = False
        torch.empty(0)  # a torch function: the mode sees it where it is active
        seen, self._probed = self._probed, None
        return bool(seen)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._probed is not None:  # `active`'s probe: not recorded
            self._probed = True
            return func(*args, **kwargs)
        result = func(*args, **kwargs)
        where = _caller()
        if where is None:
            return result
        name = _name(func)
        flat_args = list(tensors_in((args, kwargs)))
        results = list(tensors_in(result))
        if not results and (name.startswith(_IN_PLACE_MODULES) or name in _WRITES) and args:
            results = list(tensors_in(args[0]))  # in place: its inputs include what it overwrites
        if not results:
            return result
        if self._plain and any(_is_dtensor(r) for r in results):
            self.sharded = True
            return result
        shapes = tuple(tuple(a.shape) for a in flat_args)
        dims = _dims(name, _arguments(func, args, kwargs), shapes)
        # torch.distributed's collectives carry no gradient (its autograd-aware functions live in
        # torch.distributed.nn), nor does anything computed with gradients disabled, nor a
        # detached copy of a tensor that has one
        carries = torch.is_grad_enabled() and not _collective(name) and name not in _DETACHES
        no_grad = not carries and any(a.requires_grad for a in flat_args)
        inputs = tuple(dict.fromkeys(self._producer[id(a)] for a in flat_args
                                     if id(a) in self._producer))  # fmt: skip
        self._record(name, where, results, inputs, shapes, dims, no_grad)
        return result

    def _record(self, name, where, results, inputs, shapes, dims, no_grad) -> None:
        index = len(self.ops)
        first = results[0]
        self.ops.append(Op(index, name, where, _value(first), inputs, shapes, dims, no_grad,
                           rows=tuple(first.shape)))  # fmt: skip
        self._results.append(results)
        for tensor in results:
            self._producer[id(tensor)] = index

    def keep_gradients(self) -> None:
        """After the forward: each record whose result takes part in the backward gets its
        gradient there (``Op.grad``), and the custom autograd Function whose backward it passes
        through is named (``Op.backward``)."""
        for op, results in zip(self.ops, self._results, strict=True):
            tensor = results[0]
            if not tensor.requires_grad:
                continue
            op.backward = _custom_backward(tensor.grad_fn)
            tensor.register_hook(functools.partial(_keep, op))

    def buffers(self, modules: Iterable[tuple[str, nn.Module]], before: dict[str, tuple]) -> None:
        """Name the records that wrote a buffer of these modules during the forward: in place
        (the record's result is the buffer) or by assignment (the buffer is now a record's
        result). ``before``: `buffer_state` of the same modules taken before the forward."""
        for name, buffer in _named_buffers(modules):
            identity, value = before.get(name, (None, None))
            if identity == id(buffer) and torch.equal(value, buffer):
                continue
            writers = [op for op, results in zip(self.ops, self._results, strict=True)
                       if any(r is buffer for r in results)]  # fmt: skip
            if writers:
                writers[-1].updates = name

    def computed(self, loss: torch.Tensor) -> bool:
        """Whether ``loss`` was computed from a result this tracer recorded: its autograd graph
        reaches one. A loss that runs its model and the model's backward inside its own forward
        (a cached, GradCache-style loss: the loss taken on embeddings made without gradients,
        the model run again chunk by chunk) returns one that reaches none."""
        made = {id(r.grad_fn) for results in self._results for r in results if r.grad_fn}
        seen, frontier = set(), [loss.grad_fn]
        while frontier:
            node = frontier.pop()
            if node is None or id(node) in seen:
                continue
            if id(node) in made:
                return True
            seen.add(id(node))
            frontier.extend(next_node for next_node, _ in node.next_functions)
        return False

    def returned(self, tensor: torch.Tensor) -> None:
        """Mark the record whose result the code returned (the loss)."""
        if id(tensor) in self._producer:
            self.ops[self._producer[id(tensor)]].returned = True

    def detached(self) -> list[Op]:
        """The records as plain data (results released), to send from a rank."""
        self._results.clear()
        self._producer.clear()
        return [replace(op) for op in self.ops]


def tensors_in(value) -> Iterator[torch.Tensor]:
    """The tensors in a call's arguments or result (nested tuples, lists and dicts): every watch
    of a step's operations reads them so (`runs.precision`, `runs.sharded`)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)


def _keep(op: Op, grad: torch.Tensor | None) -> None:
    # autograd hands a hook None where the result's gradient is undefined (no loss depends on it,
    # as on a padded position's masked-out value under DDP): nothing to keep
    if grad is not None:
        op.grad = grad.detach().to("cpu", torch.float64, copy=True)


def _custom_backward(node) -> str | None:
    cls = getattr(type(node), "_forward_cls", None) if node is not None else None
    if cls is None:
        return None
    try:
        filename = inspect.getsourcefile(cls.backward)
        lines, line = inspect.getsourcelines(cls.backward)
        line += next(i for i, text in enumerate(lines) if text.lstrip().startswith("def "))
    except (OSError, TypeError, StopIteration):
        return f"{cls.__qualname__}.backward"
    return f"{cls.__qualname__}.backward at {imports.place(filename, line)}"


def _named_buffers(modules: Iterable[tuple[str, nn.Module]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The buffers of ``modules`` by their names; a callable that is no ``nn.Module`` (a loss
    object of its own kind) holds none that torch names."""
    for prefix, module in modules:
        if not isinstance(module, nn.Module):
            continue
        for name, buffer in module.named_buffers():
            yield (f"{prefix}.{name}" if prefix else name), buffer


def buffer_state(modules: Iterable[tuple[str, nn.Module]]) -> dict[str, tuple]:
    """Each buffer's identity and a copy of its value, to tell afterwards which the forward
    wrote."""
    return {name: (id(buffer), buffer.detach().clone()) for name, buffer in _named_buffers(modules)}


def batch_tensors(batch, name: str = "batch") -> dict[str, torch.Tensor]:
    """The floating tensors of a batch by their place in it (``batch[0]``, ``batch['x']``), to
    record as the inputs the code is given."""
    if isinstance(batch, torch.Tensor):
        return {name: batch} if batch.is_floating_point() else {}
    found: dict[str, torch.Tensor] = {}
    items = batch.items() if isinstance(batch, dict) else enumerate(batch)
    if isinstance(batch, (tuple, list, dict)):
        for key, item in items:
            found.update(batch_tensors(item, f"{name}[{key!r}]"))
    return found


@contextmanager
def traced(given: Mapping[str, torch.Tensor] | None = None) -> Iterator[Tracer]:
    """``with traced({"view 0": z0}) as tracer:`` records the calls of the block (`Tracer`)."""
    with Tracer(given) as tracer:
        yield tracer
