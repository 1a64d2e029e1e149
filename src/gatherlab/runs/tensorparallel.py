"""Tensor- and sequence-parallel code as a rank trains it (docs/checking.md §10, "Tensor and
sequence parallelism"): a model that parallelizes itself with torch's DTensor
(``parallelize_module`` over the ``tp`` dimension of the ranks' mesh, `gatherlab.ranks.world.mesh`).

- `built_on_one_rank` builds the user's model on a 1 × 1 mesh in this process (a one-rank process
  group), before any rank starts, with the warnings its plan raises: a plan key that names no
  module is only a warning in torch, which the check makes bad input; `built_on_ranks` builds it
  on a layout's ranks, before any trains, where it is plain on a 1 × 1 mesh (transformers' own
  tensor parallelism applies only at a ``tp_size`` above 1);
- `parallelizes` says whether a model holds a parameter sharded or replicated over ``tp``;
- `reduced_partial` is a gradient that is a partial sum over some mesh dimension
  (``Partial(sum)``: a sequence-parallel LayerNorm's) made whole over it, as torch's optimizers
  do when they add it to a replicated parameter: the reproduction of code that reads its local
  tensor;
- `replicas_apart` names the parameters whose replicas differ between the ranks of a mesh
  dimension they are replicated over: a replicated parameter stepped with each rank's own
  gradient;
- `LayoutWatch` records one forward's layouts, its operations' results (`gatherlab.runs.trace`,
  a DTensor's as its local tensor) and its dropout draws across the tensor-parallel group, which
  `gatherlab.check.where.layout_departure` compares with one device's.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.overrides import TorchFunctionMode

from gatherlab.core import cli, gradients, imports
from gatherlab.ranks import world
from gatherlab.runs import trace
from gatherlab.runs.trace import tensors_in

__all__ = [
    "Drawn", "LayoutWatch", "Seen", "built_on_one_rank", "built_on_ranks", "parallelizes",
    "partial_gradients", "reduced_partial", "replicas_apart",
]  # fmt: skip

TP = world.MESH_DIMS[1]


def built_on_one_rank(build: Any) -> tuple[Any, list[str]]:
    """``build(mesh=…)`` on a 1 × 1 mesh of this process (rank 0 of a one-rank gloo group,
    `world.alone`), with the text of every warning it raised."""
    from torch.distributed.device_mesh import init_device_mesh

    with world.alone(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mesh = init_device_mesh(world.device().type, (1, 1), mesh_dim_names=world.MESH_DIMS)
        built = build(mesh=mesh)
        return built, [str(w.message) for w in caught]


def built_on_ranks(build: Any, tensor_parallel: int) -> tuple[bool, list[str]]:
    """On each rank of a layout: ``build(mesh=…)`` on the ranks' (W / T) × T mesh (`world.mesh`,
    T = ``tensor_parallel``), whether what it made holds a parameter over ``tp`` (`parallelizes`),
    and the text of every warning it raised. For a factory whose model is plain on a 1 × 1 mesh:
    transformers applies a model's own plan only where its ``tp_size`` is above 1."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        built = build(mesh=world.mesh(tensor_parallel))
    return isinstance(built, nn.Module) and parallelizes(built), [str(w.message) for w in caught]


def parallelizes(model: nn.Module) -> bool:
    """Whether a parameter of ``model`` is a DTensor over a mesh with a ``tp`` dimension."""
    return any(
        isinstance(p, DTensor) and TP in (p.device_mesh.mesh_dim_names or ())
        for p in model.parameters()
    )


def reduced_partial(grad: torch.Tensor) -> torch.Tensor:
    """A DTensor gradient's partial sums made whole (``redistribute`` to ``Replicate`` on each
    mesh dimension where it is ``Partial``: an all-reduce there), anything else as it is."""
    if not isinstance(grad, DTensor) or not any(isinstance(p, Partial) for p in grad.placements):
        return grad
    placements = [Replicate() if isinstance(p, Partial) else p for p in grad.placements]
    return grad.redistribute(grad.device_mesh, placements)


def partial_gradients(parameters: Iterable[tuple[str, nn.Parameter]]) -> dict[str, str]:
    """The parameters whose gradient is a partial sum over a mesh dimension, each with that
    dimension's name."""
    found = {}
    for name, p in parameters:
        grad = p.grad
        if isinstance(grad, DTensor):
            names = grad.device_mesh.mesh_dim_names or ()
            dims = [i for i, placement in enumerate(grad.placements)
                    if isinstance(placement, Partial)]  # fmt: skip
            if dims:
                found[name] = names[dims[0]] if dims[0] < len(names) else str(dims[0])
    return found


def replicas_apart(model: nn.Module) -> dict[str, str]:
    """The parameters of ``model`` replicated over a mesh dimension whose local tensors differ
    between that dimension's ranks (beyond float64's 1e-10 of the largest), each with the
    dimension's name: every rank of the dimension calls this (an all-gather per parameter)."""
    apart = {}
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            continue
        names = p.device_mesh.mesh_dim_names or ()
        for i, placement in enumerate(p.placements):
            if not isinstance(placement, Replicate) or p.device_mesh.size(i) == 1:
                continue
            local = p.to_local().detach()
            every = _gathered(local, p.device_mesh.get_group(i))
            scale = gradients.largest_difference(local.double().reshape(-1)) or 1.0
            if any(gradients.largest_difference(o.double().reshape(-1), local.double().reshape(-1))
                   > gradients.FLOAT64_TOLERANCE * scale for o in every):  # fmt: skip
                apart.setdefault(name, names[i] if i < len(names) else str(i))
    return apart


@dataclass(frozen=True)
class Seen:
    """A tensor where a tensor-parallel model's layout shows: a module's first input (``module``
    its name, ``""`` the model; ``output``: the model's output), its shape as one device's would
    be (a DTensor's global shape; a plain tensor's own), the DTensor's placements (``""``: a
    plain tensor), and the user's ``file:line`` that made the call or, for the output, that first
    used it (and how, ``use``). Or, with ``op``, an operation of the first forward (the model's
    input first, named ``input``) as `gatherlab.runs.trace` records it, its value what the rank
    holds (a DTensor's local tensor; None for a partial sum, ``Partial``, which is neither a
    whole nor a shard), in call order after the model's input."""

    module: str
    shape: tuple[int, ...]
    placements: str
    line: str | None
    output: bool = False
    use: str = ""
    op: trace.Op | None = None


@dataclass(frozen=True)
class Drawn:
    """A dropout layer's first draw on the ranks of a tensor-parallel group: whether their inputs
    were the same tensor (replicated) and whether their masks were the same."""

    module: str
    line: str | None
    same_input: bool
    same_mask: bool


DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
            nn.FeatureAlphaDropout)  # fmt: skip


class LayoutWatch(TorchFunctionMode):
    """The layouts of one forward of ``model`` (its first call): each module's first tensor input
    and the model's output (`Seen`), the first operation of the user's code that takes that
    output, each dropout layer's draw across the tensor-parallel group (`Drawn`, on W ranks), and
    the forward's operations with their results (`Seen` with ``op``: a `trace.Tracer` from the
    model's pre-hook, after those of its plan and of FSDP2, to its forward hook). Active around
    one step (a public ``TorchFunctionMode``; its hooks, torch's public module hooks, removed by
    `close`)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.seen: list[Seen] = []
        self.drawn: list[Drawn] = []
        self._output: dict[int, int] = {}  # id of an output tensor → its index in seen
        self._done = False
        self._tracer: trace.Tracer | None = None  # active during the first forward
        self._pending: tuple[int, bool] | None = None  # (its record's index, made by machinery)
        self._machinery: set[int] = set()  # the tracer's records of torch.distributed's calls
        self._group = _tensor_parallel_group(model)
        self._hooks = [m.register_forward_pre_hook(functools.partial(self._input, name))
                       for name, m in model.named_modules()]  # fmt: skip
        self._hooks.append(model.register_forward_pre_hook(self._traced))
        self._hooks += [m.register_forward_hook(functools.partial(self._dropped, name))
                        for name, m in model.named_modules()
                        if isinstance(m, DROPOUTS) and self._group is not None]  # fmt: skip
        self._hooks.append(model.register_forward_hook(self._returned))

    def _traced(self, module: nn.Module, args: tuple) -> None:
        given = next(iter(tensors_in(args)), None)
        if self._done or self._tracer is not None or given is None:
            return
        self._tracer = trace.Tracer({"input": given})
        self._tracer.__enter__()  # above this mode: its records are the user's calls

    def _untraced(self) -> None:
        """The tracer's records, each result as the rank holds it, appended to ``seen``."""
        if self._tracer is None:
            return
        self._settle()
        tracer, self._tracer = self._tracer, None
        tracer.__exit__(None, None, None)
        for op in tracer.detached():
            if op.index in self._machinery:
                continue
            held = _held(op.value)
            self.seen.append(Seen("", op.rows, _placements(op.value), op.where,
                                  op=replace(op, value=held)))  # fmt: skip

    def __exit__(self, *exc: Any) -> None:
        self._untraced()  # a forward that raised left its tracer above this mode
        return super().__exit__(*exc)

    def _dropped(self, name: str, module: nn.Module, args: tuple, output: Any) -> None:
        given = next(iter(tensors_in(args)), None)
        drew = module.training and isinstance(output, torch.Tensor)
        if self._done or given is None or not drew:
            return
        given, output = _local(given), _local(output)
        mask = (output == 0) & (given != 0)
        line = _user_line()
        same_input, same_mask = _same(given, self._group), _same(mask.to(given.dtype), self._group)
        self.drawn.append(Drawn(name, line, same_input, same_mask))

    def _input(self, name: str, module: nn.Module, args: tuple) -> None:
        tensor = next(iter(tensors_in(args)), None)
        if self._done or tensor is None:
            return
        self.seen.append(Seen(name, tuple(tensor.shape), _placements(tensor), _user_line()))

    def _returned(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._done:
            return
        self._done = True
        self._untraced()
        for tensor in tensors_in(output):
            seen = Seen("", tuple(tensor.shape), _placements(tensor), None, output=True)
            self.seen.append(seen)
            self._output[id(tensor)] = len(self.seen) - 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._output:
            for tensor in tensors_in((args, kwargs)):
                index = self._output.pop(id(tensor), None)
                if index is not None and not self.seen[index].use:
                    use = getattr(func, "__name__", str(func))
                    self.seen[index] = replace(self.seen[index], line=_user_line(), use=use)
        tracer = self._tracer
        # a call the tracer passed on (not one its own recording makes): the tracer records it,
        # if at all, as its next record once it returns
        passed_on = _outside_torch(sys._getframe(1)) if tracer is not None else None
        if passed_on is not None and passed_on.f_code is not _TRACER_CALL:
            passed_on = None
        if passed_on is not None:
            self._settle()
        result = func(*args, **kwargs)
        if passed_on is not None:
            self._pending = (len(tracer.ops), _from_distributed(passed_on.f_back))
        return result

    def _settle(self) -> None:
        """The record the tracer made of the last call it passed on, if any, kept out of the
        comparison when torch.distributed's machinery made that call (a parallel style's hook
        redistributing, FSDP2 gathering, ``full_tensor``): attributed to the user's line all the
        same, it is no operation of the user's and one device has none."""
        if self._pending is not None and self._tracer is not None:
            index, machinery = self._pending
            if machinery and len(self._tracer.ops) > index:
                self._machinery.add(index)
        self._pending = None

    def close(self) -> tuple[list[Seen], list[Drawn]]:
        for hook in self._hooks:
            hook.remove()
        return list(self.seen), list(self.drawn)


def _tensor_parallel_group(model: nn.Module) -> Any:
    """The process group of the ``tp`` dimension of the mesh a parameter of ``model`` lives on;
    None without one (one device)."""
    for p in model.parameters():
        names = p.device_mesh.mesh_dim_names or () if isinstance(p, DTensor) else ()
        if TP in names and p.device_mesh.size(names.index(TP)) > 1:
            return p.device_mesh.get_group(names.index(TP))
    return None


_TORCH = os.path.dirname(os.path.realpath(torch.__file__)) + os.sep
_DISTRIBUTED = os.path.join(_TORCH, "distributed") + os.sep
_TRACER_CALL = trace.Tracer.__torch_function__.__code__


@functools.cache
def _in(folder: str, filename: str) -> bool:
    return os.path.realpath(filename).startswith(folder)


def _outside_torch(frame: Any) -> Any:
    """The first frame, from ``frame`` outwards, whose code is not torch's."""
    while frame is not None and _in(_TORCH, frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def _from_distributed(frame: Any) -> bool:
    """Whether a call made in ``frame`` comes from torch.distributed's code: a frame of it
    before (inward of) the first frame outside torch."""
    while frame is not None and _in(_TORCH, frame.f_code.co_filename):
        if _in(_DISTRIBUTED, frame.f_code.co_filename):
            return True
        frame = frame.f_back
    return False


def _held(value: torch.Tensor | None) -> torch.Tensor | None:
    """A recorded result as the rank holds it: a DTensor's local tensor (its shard, or its copy
    where it is replicated), None where it is a partial sum; a plain tensor as it is."""
    if not isinstance(value, DTensor):
        return value
    if any(isinstance(p, Partial) for p in value.placements):
        return None
    return value.to_local()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach()


def _same(tensor: torch.Tensor, group: Any) -> bool:
    """Whether every rank of ``group`` holds this same tensor."""
    return all(torch.equal(other, tensor) for other in _gathered(tensor, group))


def _gathered(tensor: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every rank's ``tensor`` of ``group``, in its ranks' order (an all-gather over it)."""
    tensor = tensor.contiguous()
    every = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, tensor, group=group)
    return every


def _placements(tensor: torch.Tensor) -> str:
    if not isinstance(tensor, DTensor):
        return ""
    names = tensor.device_mesh.mesh_dim_names or ()
    return ", ".join(f"{names[i] if i < len(names) else i}: {p}"
                     for i, p in enumerate(tensor.placements))  # fmt: skip


def _user_line() -> str | None:
    """The ``file:line`` of the innermost frame of the code under check on the stack."""
    frame = inspect.currentframe()
    while frame is not None:
        filename = frame.f_code.co_filename
        if cli.is_users(filename) and not os.path.realpath(filename).startswith(_GATHERLAB):
            return imports.place(filename, frame.f_lineno)
        frame = frame.f_back
    return None


_GATHERLAB = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep
