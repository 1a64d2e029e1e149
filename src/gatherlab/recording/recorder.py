"""A training job recorded where it runs: what each optimizer update received, through torch's
public hooks, on every rank, written by rank 0 (`gatherlab.recording.format`; docs/recording.md
§11).

`Recorder` is added to a job with one line (``gatherlab.record(model, optimizer, out,
loss=criterion)``). For each update it keeps

- each rank's input rows (digests of the rows of the first tensor the model's forward takes, every
  forward call of the update in order: a forward pre-hook; or what ``recorder.batch(x)`` gives);
- each rank's loss (the loss module's output, through a forward hook on ``loss``; else the model
  output's ``loss``; else what ``recorder.loss(value)`` gives), the mean of its micro-batches';
- the gradient the optimizer receives, after the job's own clipping, unscaling and divisions:
  ``Optimizer.register_step_pre_hook``, or, for a step given a closure (Lightning, LBFGS), right
  after the closure, where the job's backward and clipping ran. Per part (the model's top-level
  children and direct parameters, each parameter of the loss module, as the check names them):
  its linear sketch (`gatherlab.recording.sketch`) and its exact norm; the whole gradient for the
  first ``full_updates`` updates.

A ``DTensor`` gradient (FSDP2's, tensor parallelism's, both on a 2-D mesh) is sketched shard by
shard, each element at its global position (`gatherlab.recording.placed`: ``Shard``,
``_StridedShard``, ``Replicate``; a ``Partial`` one reduced first), and rank 0 sums the sketches
of the ranks of each copy (the ranks that differ along cut mesh dimensions only); nothing is
gathered but for a partial gradient and the full gradients of the first updates. A plain gradient
(DDP's, ZeRO's, a parameter outside every wrapper) is sketched on every rank. Where the ranks'
sketches of the whole differ (two ranks, or two copies along a replicated mesh dimension), its
gradient was not reduced, and every rank's sketch is kept. The ranks keep their numbers and send
them to rank 0 in one ``all_gather_object`` every few updates (`FLUSH_SECONDS`, at most
`FLUSH_UPDATES` and `FLUSH_BYTES`; none without a process group), which writes them: a job
pays a few torch operations per part and update, not a collective and a file's opening. A rank's
sketches are sent as a digest of their bytes where the ranks hold the same parameters, and whole
in a second collective only where some rank's differ from rank 0's (`_without_sketches`).

``GATHERLAB_RECORD_FLOOR=DIR`` in a one-device job's environment records its floor instead
(`FLOOR_VARIABLE`): the same job into DIR, its model's forward in row blocks (`_FloorForward`,
`gatherlab.components.rowblocks`), whoever calls it (the job or its trainer), for ``python -m
gatherlab.compare A B --floor DIR`` in a low precision (docs/design.md §2, "Low precision").
A rank's input rows are fingerprinted without their padding (`gatherlab.recording.rows`), and a
tensor-parallel group's rows counted once (`placed.row_group`). What cannot be recorded is
refused in one line (`gatherlab.recording.refusal`).
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import itertools
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from gatherlab.components.rowblocks import blocked_as, join_measured
from gatherlab.core import cli
from gatherlab.core.held import Piece, assemble, copies_apart
from gatherlab.core.parts import part_of
from gatherlab.ranks import world
from gatherlab.recording import format, pieces, placed, sketch
from gatherlab.recording.record_options import (
    FLOOR_BLOCKS_VARIABLE,
    FLOOR_ROW_BLOCKS,
    FLOOR_VARIABLE,
    RecordOptions,
    record_options,
)
from gatherlab.recording.refusal import refuse
from gatherlab.recording.rows import (
    NO_PAD,
    Sampled,
    Whole,
    choice,
    digests,
    first_tensor,
    given_rows,
    paddings_together,
    sampled,
    sampled_bits,
    seen,
)
from gatherlab.runs.removals import batch_norms
from gatherlab.runs.steplog import mean_over_ranks

__all__ = [
    "FLOOR_BLOCKS_VARIABLE", "FLOOR_ROW_BLOCKS", "FLOOR_VARIABLE", "FLUSH_BYTES",
    "FLUSH_SECONDS", "FLUSH_UPDATES", "FULL_GRADIENT_LIMIT", "Recorder",
]  # fmt: skip

log = logging.getLogger(__name__)

FLUSH_UPDATES = 64
"""The most updates the ranks keep before rank 0 writes them (one collective for all of them; at
W > 1 a batch's collectives wait for every rank, whatever it holds: bench record-fixed's job at
W = 4 cost 0.91 ms an update with 16, 0.59 with 64, the medians of nine runs each)."""
FLUSH_BYTES = 8 << 20
"""The most bytes of kept numbers a rank holds before they are sent: each update's sketches (8·k
bytes a part, W times where every rank's are sent) and a tiny model's gradient copy (`_DEFERRED`);
a model of many parts sends fewer updates at once (`Recorder._most_kept`)."""
FLUSH_SECONDS = 2.0
"""How long, at most, the ranks keep their updates when updates are slow: the number kept is
chosen by rank 0 at each writing from the updates' measured time, and sent with it."""
_WEIGHT_SAMPLES = 16
"""The elements of each parameter whose bits a rank's fingerprint of its weights holds after each
step, on W ranks (`Recorder._weights_digests`)."""
_BATCHED = 1 << 16
"""A replicated gradient of at most this many elements is sketched with the other small ones of
its part in one product (each padded to whole blocks of k and concatenated): a few torch
operations per part and update instead of per parameter."""

_DEFERRED = 1 << 17
"""A model whose gradients are one batch of small ones (`_BATCHED`) of at most this many elements,
padded (a tiny model: 512 KiB in float32), on the CPU, has them copied at each update (one
concatenation) and sketched when the updates are sent (`Recorder._sketched_later`), all kept
updates in one pass: each update's sketch made alone after its backward took 0.19–0.25 ms of the
thread's CPU time here (bench record-fixed's job, the machine loaded), about four times what
the same operations take in a row (its code and data fetched again after the training's); the
copy takes 0.09–0.11 ms, the pass ~0.05 ms an update. The copies count in `FLUSH_BYTES`."""

FULL_GRADIENT_LIMIT = 1 << 20
"""By default (``full_updates=None``) the first update keeps its whole gradient when the model has
at most this many parameters (8 MiB in float64), none above: a recording's size stays that of its
sketches (a 100M-parameter model's whole gradient is 800 MB)."""


def _loss_of(output: Any) -> torch.Tensor | None:
    """The loss a model's output carries (a Hugging Face output's ``loss``, a dict's ``loss``)."""
    value = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return value if isinstance(value, torch.Tensor) and value.numel() == 1 else None


@dataclass(frozen=True)
class _Parameter:
    name: str
    part: str
    parameter: nn.Parameter


def _unwrapped(model: nn.Module) -> nn.Module:
    """The module whose parameter names the job wrote: DDP's wrapped module."""
    wrapped = getattr(model, "module", None)
    parallel = torch.nn.parallel.DistributedDataParallel
    return wrapped if isinstance(model, parallel) and isinstance(wrapped, nn.Module) else model


def _parameters(
    model: nn.Module,
    loss: nn.Module | None,
    optimizer,
    names: Mapping[str, torch.Tensor],
    model_names: Sequence[str] | None = None,
) -> list[_Parameter]:
    """Every parameter the optimizer updates, named and placed in its part: the model's (its
    part: `gatherlab.core.parts.part_of` of ``model_names``, one device's model's names where
    the ranks hold different parameters, else this model's: the top-level child, or the
    children of a model of one child), the loss module's (``loss.<name>``, each its own part), one
    the job names in ``names`` (that name, its own part; a parameter of the model named there is
    recorded under that name, one device's: a tied weight's copy on another stage), any other
    (``optimizer.<group>.<index>``, its own part). A name given twice, or a named tensor the
    optimizer does not update, raises `_Unnamed` with its one line (`Recorder._named`)."""
    named: list[_Parameter] = []
    seen: set[int] = set()

    def add(name: str, part: str, parameter: nn.Parameter) -> None:
        if id(parameter) not in seen and parameter.requires_grad:
            seen.add(id(parameter))
            named.append(_Parameter(name, part, parameter))

    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    own = dict(_unwrapped(model).named_parameters())
    renamed = {id(t): name for name, t in names.items()
               if isinstance(t, torch.Tensor) and name not in own}  # fmt: skip
    in_model = [(renamed.get(id(p), n), p) for n, p in own.items() if id(p) in optimized]
    part = part_of(model_names if model_names is not None
                   else [n for n, p in in_model if p.requires_grad])  # fmt: skip
    for name, parameter in in_model:
        add(name, part(name), parameter)
    if loss is not None:
        for name, parameter in loss.named_parameters():
            if id(parameter) in optimized:
                add(f"loss.{name}", f"loss.{name}", parameter)
    taken = {p.name for p in named}
    for name, parameter in names.items():
        if not isinstance(parameter, torch.Tensor) or id(parameter) not in optimized:
            raise _Unnamed(f"names={{{name!r}: ...}}: not a tensor the optimizer updates; "
                             "allowed: its parameters outside the model and the loss")  # fmt: skip
        if name in taken and renamed.get(id(parameter)) != name:
            raise _Unnamed(f"names={{{name!r}: ...}}: the model or the loss has a parameter "
                             f"of that name already; allowed: a name of its own")  # fmt: skip
        add(name, name, parameter)
    for g, group in enumerate(optimizer.param_groups):
        for i, parameter in enumerate(group["params"]):
            add(f"optimizer.{g}.{i}", f"optimizer.{g}.{i}", parameter)
    return named


class _Unnamed(ValueError):
    """A bad ``names=`` of `_parameters`: its one line, refused by `Recorder._named` on every
    rank alike."""


def _tied(model: nn.Module) -> dict[str, str]:
    """The model's tied parameters: each other name of a parameter the model holds under
    several → the name ``named_parameters`` gives it (a language model's head and embedding)."""
    first: dict[int, str] = {}
    tied = {}
    for name, parameter in _unwrapped(model).named_parameters(remove_duplicate=False):
        if first.setdefault(id(parameter), name) != name:
            tied[name] = first[id(parameter)]
    return tied


def _stepping(optimizer) -> Any:
    """The optimizer that computes the update: the one a wrapper holds (a
    ``ZeroRedundancyOptimizer``'s ``optim`` on its shard, accelerate's ``optimizer``), else
    ``optimizer`` itself."""
    for attribute in ("optim", "optimizer"):
        inner = getattr(optimizer, attribute, None)
        if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
            return inner
    return optimizer


def _settings(optimizer) -> dict[str, Any]:
    """The class of the optimizer that computes the update (`_stepping`) and each group's
    hyper-parameters (what must agree between runs; a wrapper's name is the header's
    ``optimizer_wrapper``)."""

    def plain(value: Any) -> Any:
        if isinstance(value, bool | int | float | str) or value is None:
            return value
        if isinstance(value, list | tuple):
            return [plain(v) for v in value]
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return float(value)
        return repr(value)

    groups = [{key: plain(value) for key, value in group.items() if key != "params"}
              for group in optimizer.param_groups]  # fmt: skip
    return {"optimizer": type(_stepping(optimizer)).__name__, "param_groups": groups}


@dataclass
class _Batched:
    """The small replicated parameters of one dtype and device, of every part, sketched together
    (`_BATCHED`): each padded with zeros to whole blocks of k and concatenated, so that their
    blocks are one matrix; ``signs`` (parts × blocks) holds each block's sign in its part's row
    and 0 elsewhere, so that one matrix product gives every part's sketch, the same sketch as
    each parameter's own, summed. Squared norms: each block's in the blocks' own precision (a half
    one in float32), summed per part in float64, as `_norm` sums its rows."""

    parameters: list[_Parameter]
    pads: list[torch.Tensor]
    signs: torch.Tensor  # parts × blocks, in the blocks' dtype
    member: np.ndarray  # parts × blocks, 1 where the block is the part's, float64
    cpu_signs: np.ndarray | None = None  # ``signs`` in numpy, on the CPU

    def sketch(self, k: int, of_gradients: bool) -> tuple[np.ndarray, np.ndarray]:
        """The sketches (parts × k, float64) of these parameters' gradients (or weights) and each
        part's squared norm (`blocks`, `sketched`)."""
        return self.sketched(self.blocks(k, of_gradients))

    def blocks(self, k: int, of_gradients: bool) -> torch.Tensor:
        """These parameters' gradients (or weights), padded and concatenated: a copy, blocks × k,
        in float32 or float64 (one torch operation where they are float32 or float64)."""
        pieces = []
        for p, pad in zip(self.parameters, self.pads, strict=True):
            tensor = p.parameter.grad if of_gradients else p.parameter.data
            pieces += [placed.local(tensor).reshape(-1) if tensor is not None else pad.new_zeros(
                p.parameter.numel()), pad]  # fmt: skip
        blocks = torch.cat(pieces).view(-1, k)
        if blocks.dtype not in (torch.float64, torch.float32):  # half precisions: in float32
            blocks = blocks.float()
        return blocks

    def sketched(self, blocks: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """`sketch` of `blocks`' copy: the product (in numpy on the CPU), each block's norm in the
        blocks' own precision, the parts' sums of their squares in float64."""
        with torch.no_grad():  # a gradient made with create_graph=True: no graph of the sketch
            return self._sketched(blocks)

    def _sketched(self, blocks: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        if blocks.device.type == "cpu":  # the product in numpy: 4 µs here, torch's 9
            if self.cpu_signs is None:
                self.cpu_signs = self.signs.numpy()
            sketches = (self.cpu_signs @ blocks.numpy()).astype(np.float64)
        else:
            sketches = (self.signs @ blocks).cpu().numpy().astype(np.float64)
        norms = torch.linalg.vector_norm(blocks, dim=1).cpu().numpy().astype(np.float64)
        return sketches, self.member @ (norms * norms)


@dataclass(frozen=True)
class _Candidates:
    """A call's rows of the first update, before the run's pad value is known: whole (``by_pad``
    at None) and without each candidate value's trailing runs (`rows.Padding.candidates`), one
    to be chosen once every rank's pads are counted (``own``: the batch's own choice)."""

    own: tuple | None
    by_pad: dict[tuple | None, Sampled]


ATTACH_TIMEOUT_S = 120.0
"""How long a rank's recorder waits for every other rank's to attach (`_every_rank_attaches`)."""


def _every_rank_attaches() -> None:
    """Every rank attaches its recorder, or each that waited refuses in one line, naming the
    ranks that did not, where the group runs on gloo: a recorder attached on some ranks alone would
    meet the others' own collectives (DDP's), and both would wait for ever. gloo's
    ``monitored_barrier`` bounds the wait (`ATTACH_TIMEOUT_S`); NCCL has none, and there such a
    job waits for its process group's timeout."""
    if "gloo" not in str(dist.get_backend()):
        return
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=ATTACH_TIMEOUT_S), wait_all_ranks=True)
    except RuntimeError as error:
        refuse(
            f"gatherlab.record: rank {dist.get_rank()}'s recorder waited {ATTACH_TIMEOUT_S:g} s "
            f"for the other ranks' ({cli.error_line(error)}); allowed: gatherlab.record on every "
            f"rank, the one documented line run by each",
            by_this_rank=True,
        )


def _hookable(model: Any, optimizer: Any, loss: Any = None) -> None:
    """One line (`format.RecordingError`) for a model, optimizer or loss the recorder cannot
    hook: a trainer given as the model (a trainer takes a callback), an optimizer with no step,
    a loss that is no module (a name, a function)."""
    if isinstance(model, list | tuple) and model and all(isinstance(m, nn.Module) for m in model):
        refuse(
            f"gatherlab.record: model is a {type(model).__name__} of {len(model)} modules (a "
            f"rank's stages?), not one torch.nn.Module whose forward can be hooked; allowed: one "
            f"module holding them under one device's names, whose forward each stage's module "
            f'calls (docs/recording.md §11, "Pipeline and expert parallelism")'
        )
    if not isinstance(model, nn.Module):
        kind = f"{type(model).__module__}.{type(model).__qualname__}"
        refuse(
            f"gatherlab.record: model is a {kind}, not a torch.nn.Module, so its forward cannot be "
            f"hooked; allowed: the torch.nn.Module the optimizer trains, or for a trainer its "
            f"callback (gatherlab.record.LightningRecorder(DIR) for a Lightning Trainer, "
            f"gatherlab.record.HFRecorder(DIR) for a Hugging Face one)"
        )
    if not (callable(getattr(optimizer, "step", None)) and hasattr(optimizer, "param_groups")):
        kind = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        refuse(
            f"gatherlab.record: optimizer is a {kind}, which has no step() and param_groups to "
            f"hook; allowed: a torch.optim.Optimizer or a wrapper of one (ZeroRedundancyOptimizer, "
            f"accelerate's AcceleratedOptimizer)"
        )
    if loss is not None and not isinstance(loss, nn.Module):
        kind = f"{type(loss).__module__}.{type(loss).__qualname__}"
        refuse(
            f"gatherlab.record: loss is a {kind}, not a torch.nn.Module whose output can be "
            f"hooked; allowed: the loss module the job calls (its forward returns the loss), or "
            f"none: a model output's loss, or recorder.loss(value)"
        )


JOIN_ROUNDINGS = 64
"""How far a floor's model forward in row blocks may be from one call's, in unit roundoffs of the
output's dtype (`_FloorForward`): a model that treats each row on its own is one call's to
rounding (measured: bit for bit, 0 unit roundoffs, for the Hugging Face classifier and the
SentenceTransformer of examples/jobs/ in float32 and under bf16 autocast on the CPU); one whose
rows meet is far beyond (an in-batch contrastive loss over 8 rows: 0.18 relative in float32,
3·10⁶ unit roundoffs)."""


class _FloorForward:
    """A floor recording's model forward (`FLOOR_VARIABLE`): the model's own forward (whatever
    wraps it already, an autocast included) in `FLOOR_ROW_BLOCKS` row blocks, joined
    (`gatherlab.components.rowblocks`). At its first call in training it measures, without
    gradients and with the model in ``eval()`` (no dropout), how far the joined outputs are from
    one call's (`rowblocks.join_measured`), which also decides how a scalar it returns (its loss)
    is joined; beyond `JOIN_ROUNDINGS` unit roundoffs the floor is refused in one line: the
    model's rows meet, and row blocks would change what it computes."""

    def __init__(self, module: nn.Module, blocks: int, said: str) -> None:
        self.module, self.blocks, self.said = module, blocks, said
        self.original = module.forward
        self.scalars: str | None = None
        self.measured = False
        self.calls = 0  # in training
        module.forward = self  # the instance's own: its parameters keep their names

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            if not self.measured:
                self._measure(args, kwargs)
            self.calls += 1
        return blocked_as(self.scalars, self.original, self.blocks, *args, **kwargs)

    def _measure(self, args: tuple, kwargs: dict) -> None:
        modes = {module: module.training for module in self.module.modules()}
        try:
            with torch.no_grad():
                self.module.eval()
                joined = join_measured(self.original, self.blocks, *args, **kwargs)
        finally:
            for module, training in modes.items():
                module.training = training
            # The casts made without gradients, in the step's autocast, are not the training's:
            # FSDP2's modules re-use a weight's cached cast, which then has no gradient path, and
            # every weight under them trained with no gradient (a user's floor, 0.51 from A).
            torch.clear_autocast_cache()
        self.measured, self.scalars = True, joined.scalars
        unit = torch.finfo(joined.dtype).eps / 2
        if joined.relative > JOIN_ROUNDINGS * unit:
            dtype = str(joined.dtype).removeprefix("torch.")
            refuse(
                f"{self.said}: the model's forward in {self.blocks} row blocks is not one "
                f"call's: its {joined.leaf} departs from one call's by {joined.relative:.2g} "
                f"(relative, without dropout), beyond {JOIN_ROUNDINGS} unit roundoffs of "
                f"{dtype}: its rows meet (a loss over the batch's rows, a batch statistic, a "
                "mean over tokens), and row blocks change what it computes; allowed: the part of "
                "the model before its loss in gatherlab.record.in_row_blocks(...) in the job "
                "(with the variable set, the recorder then cuts nothing itself), or both runs "
                "recorded in float64"
            )


_HALF = (torch.bfloat16, torch.float16)
"""The half precisions a wrapper may cast a job's wider parameters to for its forward."""


@functools.cache
def _dtensor() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


def _fully_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 (``fully_shard``) wraps a module of ``model``."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(module, FSDPModule) for module in model.modules())


class Recorder:
    """Records every optimizer update of a training job (see the module's docstring); a context
    manager: leaving it closes the recording (``close``). Every rank makes one and calls
    ``close``; rank 0 writes ``out``.

    ``loss``: the job's loss module, whose output is each micro-batch's loss and whose parameters
    (a learnt temperature) are parts of their own. ``names``: a name for each parameter the
    optimizer updates outside the model and the loss (``{"temperature": tau}``; unnamed, one is
    ``optimizer.<group>.<index>``). ``options``: how it records (`RecordOptions`: ``k``,
    ``full_updates``, ``seed``, ``settings``, ``trace``, ``precision``, ``batches``, ``losses``,
    ``sketch_seed``, each documented there); any of its fields may also be given as a keyword,
    set over ``options``.

    With `FLOOR_VARIABLE` set, a one-device job records its floor into that directory instead
    of ``out``, its model's forward in `FLOOR_ROW_BLOCKS` row blocks (`FLOOR_BLOCKS_VARIABLE`'s
    number where set), whoever calls it (`_FloorForward`); refused in one line
    (`gatherlab.recording.refusal`) on W ranks, for a model with batch norm, whose statistics the
    blocks would split, and for one whose rows meet (its join checked on the first call)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        out: str | Path,
        *,
        loss: nn.Module | None = None,
        names: Mapping[str, torch.Tensor] | None = None,
        options: RecordOptions | None = None,
        **chosen: Any,
    ) -> None:
        _hookable(model, optimizer, loss)
        options = record_options(options, chosen)
        k, full_updates, trace = options.k, options.full_updates, options.trace
        self._distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size() if self._distributed else 1
        self.rank = dist.get_rank() if self._distributed else 0
        if self._distributed:
            _every_rank_attaches()
        self._floor_forward: _FloorForward | None = None
        out, row_blocks = self._floor(model, out)
        self._parameters = self._named(model, loss, optimizer, names or {})
        self._held, self._pieces = self._holding(model, loss, optimizer, names or {})
        if full_updates is None:  # the first update's whole gradient where it is small
            shapes = ([shape for _, shape in self._held.order] if self._held is not None
                      else [p.parameter.shape for p in self._parameters])  # fmt: skip
            numel = sum(math.prod(shape) for shape in shapes)
            full_updates = 1 if numel <= FULL_GRADIENT_LIMIT else 0
        self.k, self.full_updates, self.sketch_seed = k, full_updates, options.sketch_seed
        self.parts = list(dict.fromkeys(p.part for p in self._parameters))
        self._sketched = self.parts  # the rows of a rank's sketches: its parts
        if self._held is not None:  # one device's parts, in one device's order; pieces sketched
            self.parts = list(dict.fromkeys(self._part(name) for name, _ in self._held.order))
            self._sketched = [piece.key for piece in self._pieces]
        self._signs: dict[str, torch.Tensor] = {}
        self._plan: tuple[list[_Batched], list[tuple[int, _Parameter]]] | None = None
        self._weight_samples: tuple | None = None  # `_weights_sampled`'s views, made once
        self._weight_lengths: list[int] = []  # each part's samples of its weights
        self._row_group: placed.RowGroup | None = None  # this rank's tensor-parallel group
        self._counted: list[placed.RowGroup] | None = None  # each rank's, once decided
        self._rows: list[Sampled | Whole | torch.Tensor] = []  # the update's rows (`rows.seen`;
        # token ids without a mask whole, until the update's end: `rows.paddings_together`)
        self._pads: dict[tuple, int] = {}  # each pad value's batches on every rank (`_untied`)
        self._calls = 0  # the model's forward calls (or batches given) in the update
        self._last_given: dict[str, tuple] = {}  # where the last rows and labels lay (`_again`)
        self._apart: list[str] = []  # the copies that differ in the assembled gradient
        self._losses: list[float] = []
        self._loss_dtype: str | None = None  # the dtype of the update's loss tensor
        self._autocast: str | None = None
        self._autocast_hooks: dict[nn.Module, Any] = {}  # `_attach`, `_pruned`
        self._first_child: nn.Module | None = None  # the first the first update's forward called
        self._model = model
        self._pending: list[dict[str, Any]] = []  # this rank's updates not yet sent to rank 0
        self._due, self._flushed_at = 1, time.perf_counter()  # the first update is sent at once
        self.updates = 0
        self._closed = False
        self._trace = trace
        self._tracer: Any = None  # the first update's, while it records
        self._traced: list | None = None
        first = self._parameters[0].parameter if self._parameters else None
        self._device = first.device.type if first is not None else "cpu"  # its autocast's
        self._dtype = first.dtype if first is not None else torch.float32  # the parameters'
        self._cast_hooks: list[Any] = []  # `_attach`, `_on_cast`: the first update's alone
        header = self._header(model, optimizer, options, k, full_updates, row_blocks)
        self._writer = self._open(Path(out), header)
        self._hooks = self._attach(model, optimizer, loss, options.batches, options.losses)
        if self._writer is not None:  # rank 0 says so where the job ends without close()
            self._out = Path(out)
            atexit.register(self._unclosed)

    def _unclosed(self) -> None:
        """At the process's exit, the one line that says a recording was left unfinished: the
        job ended without `close` (or its ``with`` block's end) after recording updates."""
        if not self._closed and self.updates:
            print(f"gatherlab.record: {self._out} is unfinished: the job ended without "
                  "recorder.close(), and gatherlab.compare refuses it; allowed: recorder.close() "
                  "after the last update on every rank, or `with gatherlab.record(...)`",
                  file=sys.stderr, flush=True)  # fmt: skip

    def _header(self, model, optimizer, options: RecordOptions, k: int, full_updates: int,
                row_blocks: int) -> dict[str, Any]:  # fmt: skip
        """The recording's header (docs/contract.md §5): the versions, the layout, the precision,
        the settings, one device's parameters and parts, what the ranks hold, how rows are seen,
        and the command that launched the job."""
        first = self._parameters[0].parameter if self._parameters else None
        dtype = self._dtype
        return {
            "gatherlab": _version(), "torch": torch.__version__,
            "world_size": self.world_size, "precision": options.precision or _precision(dtype),
            "dtype": str(dtype).removeprefix("torch."),
            "device": first.device.type if first is not None else "cpu",
            "seed": options.seed, "k": k, "sketch_seed": options.sketch_seed,
            "full_updates": full_updates,
            "settings": {**_settings(optimizer), **dict(options.settings)},
            "optimizer_wrapper": (
                type(optimizer).__name__ if _stepping(optimizer) is not optimizer else None
            ),
            "parameters": [
                {"name": p.name, "shape": list(p.parameter.shape), "part": p.part,
                 "sharded": placed.is_sharded(p.parameter)}
                for p in self._parameters
            ] if self._held is None else [
                {"name": name, "shape": list(shape), "part": self._part(name), "sharded": False}
                for name, shape in self._held.order
            ],
            "parts": self.parts,
            "tied": _tied(model),
            "held": None if self._held is None else [[name for name, _ in held]
                                                     for held in self._held.ranks],
            "row_blocks": row_blocks, "batch_norm": batch_norms(_unwrapped(model)),
            "hooks": "model" if options.batches else "trainer", "command": _launch_command(),
        }  # fmt: skip

    def _named(self, model, loss, optimizer, names) -> list[_Parameter]:
        """`_parameters`, a bad ``names=`` refused on every rank alike: the ranks may be given
        different names (a pipeline's last stage names its tied copy), so each rank's answer is
        sent to all of them (one collective) and the first refusal is every rank's."""
        try:
            named, why = _parameters(model, loss, optimizer, names), None
        except _Unnamed as refused:
            named, why = [], str(refused)
        if self._distributed:
            every: list[Any] = [None] * self.world_size
            dist.all_gather_object(every, why)
            why = next((line for line in every if line), None)
        if why is not None:
            refuse(why)
        return named

    def _holding(self, model, loss, optimizer, names) -> tuple[Any, list[pieces.Piece]]:
        """Where the ranks hold different parameters (pipeline stages, experts): what each holds
        (`pieces.Held`, one collective) and every part's pieces (the parts cut as one device's
        model is, from every rank's names of it), each parameter placed in its piece; (None, [])
        where they hold the same. Refused in one line: a DTensor among them (pipeline or expert
        parallelism over FSDP2 or tensor parallelism is not recorded)."""
        ids = {id(p) for p in _unwrapped(model).parameters()}
        own = {n for n, _ in _unwrapped(model).named_parameters()}
        from_model = [p.name for p in self._parameters if id(p.parameter) in ids]
        copies = [name for name in from_model if name not in own]
        sharded = any(isinstance(p.parameter, _dtensor()) for p in self._parameters)
        held = pieces.held_by([(p.name, tuple(p.parameter.shape)) for p in self._parameters],
                              from_model, copies, self._distributed, sharded)  # fmt: skip
        if held is None:
            return None, []
        if held.sharded:  # decided alike on every rank
            refuse(
                "the ranks hold different parameters (pipeline stages or experts) and some are "
                "DTensors (FSDP2, tensor parallelism): the recorder does not combine the two; "
                "allowed: each rank's parameters plain tensors (replicas reduced by the job, or "
                "DDP)"
            )
        model_names = sorted(held.from_model)
        self._held, self._model_part = held, part_of(model_names)
        held_as = {id(p): n for n, p in _unwrapped(model).named_parameters()}
        self._held_as = {p.name: held_as.get(id(p.parameter), p.name) for p in self._parameters}
        found = held.pieces(self._part)
        piece_of = {name: piece.key for piece in found for name in piece.names}
        self._parameters = [  # each sketched in its piece's row (`_sketched`)
            _Parameter(p.name, piece_of[p.name], p.parameter)
            for p in _parameters(model, loss, optimizer, names, model_names)
        ]  # fmt: skip
        return held, found

    def _part(self, name: str) -> str:
        """One device's part of a parameter of a job whose ranks hold different ones: the
        model's cut as one device's model is, any other its own."""
        return self._model_part(name) if name in self._held.from_model else name

    def _open(self, out: Path, header: dict[str, Any]) -> format.Writer | None:
        """Rank 0's writer of ``out``; every rank raises the one line when rank 0 cannot write,
        none waits for it."""
        writer, error = None, [None]
        if self.rank == 0:
            try:
                writer = format.Writer(out, header)
            except format.RecordingError as refused:
                error = [str(refused)]
            except OSError as refused:  # a file where the directory goes, no permission
                error = [
                    f"gatherlab.record: cannot write a recording into {out} "
                    f"({cli.error_line(refused)}); allowed: a directory, new or empty"
                ]
        if self._distributed:
            dist.broadcast_object_list(error, src=0)
        if error[0] is not None:
            refuse(error[0])
        return writer

    def _attach(self, model, optimizer, loss, batches: bool, losses: bool) -> list[Any]:
        """The hooks: the optimizer's step; the model's forward (its rows) unless the job gives
        the batches; the loss module's output, or the model output's loss, unless the job gives
        the losses; and, for the autocast its forward runs under, the model's and its children's
        forwards (a trainer's autocast can wrap the model's forward itself, inside its call:
        accelerate's does, which a hook on the model's call does not see); after the first update
        the model's and the first child it called alone (`_pruned`)."""
        hooks = [optimizer.register_step_pre_hook(self._before_step),
                 optimizer.register_step_post_hook(self._after_step)]  # fmt: skip
        if batches:
            # first of the model's pre-hooks: its rows as the job gives them, before a hook of the
            # job's own changes them (tensor parallelism's PrepareModuleInput cuts the sequence)
            hooks.append(model.register_forward_pre_hook(self._on_forward, with_kwargs=True,
                                                         prepend=True))  # fmt: skip
        if losses and loss is not None:
            hooks.append(loss.register_forward_hook(self._on_loss))
        elif losses:
            hooks.append(model.register_forward_hook(self._on_output))
        for module in (model, *_unwrapped(model).children()):
            self._autocast_hooks[module] = module.register_forward_pre_hook(self._on_autocast)
        if self._dtype not in _HALF:  # a wrapper that casts the weights for the forward
            owners = [m for m in _unwrapped(model).modules()
                      if next(m.parameters(recurse=False), None) is not None]  # fmt: skip
            self._cast_hooks = [m.register_forward_pre_hook(self._on_cast) for m in owners]
        return hooks + list(self._autocast_hooks.values()) + self._cast_hooks

    def _floor(self, model: nn.Module, out: str | Path) -> tuple[str | Path, int]:
        """Where the recording goes and its model's row blocks: ``out`` and 1, or, with
        `FLOOR_VARIABLE` set, its directory and `FLOOR_ROW_BLOCKS`, the model's forward in row
        blocks from now on (`_FloorForward`), whoever calls it (the job, or its trainer); each
        refusal one line (`refuse`). One process in a process group of its own (``torchrun
        --nproc-per-node 1``) is one device."""
        floor = os.environ.get(FLOOR_VARIABLE)
        cuts = [getattr(m, "row_blocks", 1) for m in _unwrapped(model).modules()]
        cut = max((b for b in cuts if isinstance(b, int)), default=1)
        if not floor:  # a job that cuts a part of its model itself (in_row_blocks) says so
            return out, cut
        said = f"{FLOOR_VARIABLE}={floor}"
        blocks = os.environ.get(FLOOR_BLOCKS_VARIABLE, str(FLOOR_ROW_BLOCKS))
        if not blocks.isdigit() or int(blocks) < 2:
            refuse(f"{FLOOR_BLOCKS_VARIABLE}={blocks}: the floor's row blocks; allowed: an "
                   "integer ≥ 2, as many as the ranks of the runs it judges")  # fmt: skip
        if self.world_size > 1:
            refuse(
                f"{said}: a floor is one device's run, and this job runs on {self.world_size} "
                "ranks; allowed: the job's one-device command (python, or torchrun "
                "--nproc-per-node 1) with the variable"
            )
        norms = batch_norms(_unwrapped(model))
        if norms:
            refuse(
                f"{said}: the model has batch norm ({', '.join(norms)}), whose statistics row "
                "blocks would split: no floor can be measured for it; allowed: a model without "
                "batch norm, or both runs recorded in float64"
            )
        if cut > 1:  # the job cuts the part before its loss itself: the floor is that cut
            log.warning("gatherlab.record: %s: recording this job's floor into %s (its own "
                        "in_row_blocks cut, %d row blocks), not into %s", said, floor, cut,
                        out)  # fmt: skip
            return floor, cut
        self._floor_forward = _FloorForward(_unwrapped(model), int(blocks), said)
        log.warning("gatherlab.record: %s: recording this job's floor into %s (its model's "
                    "forward in %d row blocks), not into %s", said, floor, int(blocks),
                    out)  # fmt: skip
        return floor, int(blocks)

    # what the job gives -----------------------------------------------------------------------
    def batch(self, batch: Any) -> None:
        """This rank's input rows of the update (``batch``'s ``input_ids``, else its first tensor;
        their padding left out: `gatherlab.recording.rows.rows_of`), in order."""
        found = given_rows(batch)
        if found is not None:
            self._given(*found)

    def _given(self, tensor: torch.Tensor, mask: torch.Tensor | None) -> None:
        """One call's rows and their mask (`batch`), copied."""
        self._rows.append(seen(tensor, mask))
        self._calls += 1
        if self._trace and self.updates == 0 and self._traced is None:
            self._trace_input(tensor)

    def _trace_input(self, tensor: torch.Tensor) -> None:
        from gatherlab.runs import trace

        if self._tracer is None:  # the update's first forward call
            self._tracer = trace.Tracer(plain=True)
            self._tracer.__enter__()
        self._tracer.given(f"batch {self._calls - 1}", tensor)

    def _trace_end(self, loss: torch.Tensor | None) -> None:
        """The first update's forward has reached its loss: its records keep their gradients.
        A trace begun inside the backward (the model's first call with gradients made by the
        loss's backward hook, as a cached loss makes it), which autograd has left since
        (`runs.trace.Tracer.active`), or one whose records the loss was not computed from (a
        cached loss that runs the model again inside its forward: `runs.trace.Tracer.computed`),
        or one of DTensors (tensor parallelism: `runs.trace.Tracer.sharded`), is no trace: said
        in one line, the update recorded untraced."""
        tracer, self._tracer = self._tracer, None
        active = tracer.active()
        why = None
        if not active or (loss is not None and not tracer.sharded and not tracer.computed(loss)):
            why = ("the first update's loss was not computed from the model's calls with "
                   "gradients (a cached, GradCache-style loss runs the model again inside its "
                   "forward or from its backward hook)")  # fmt: skip
        elif tracer.sharded:
            why = (
                "the model's calls give DTensors (tensor or sequence parallelism), whose "
                "shards a trace does not read against one device's whole tensors"
            )
        if why is not None:
            log.warning(f"gatherlab.record: trace=True: {why}, so a trace cannot follow it: this "
                        "recording is untraced, its gradients recorded as always")  # fmt: skip
            if active:
                tracer.__exit__(None, None, None)
            self._traced = type(tracer)()  # an empty trace, none begun again in the update
            return
        if loss is not None:
            tracer.returned(loss)
        tracer.keep_gradients()
        tracer.__exit__(None, None, None)
        self._traced = tracer

    def loss(self, value: torch.Tensor | float) -> None:
        """This rank's loss of a micro-batch of the update."""
        if self._tracer is not None:
            self._trace_end(value if isinstance(value, torch.Tensor) else None)
        if isinstance(value, torch.Tensor):  # its dtype: the losses' rounding (`format.Update`)
            self._loss_dtype = str(value.dtype).removeprefix("torch.")
        self._losses.append(float(value.detach() if isinstance(value, torch.Tensor) else value))

    # A forward without gradients (an evaluation, a monitor between updates) trains nothing: its
    # rows and loss are not the update's.
    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled():
            return
        one = len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor)
        if one and self._held is None:  # one tensor: its rows, no mask (`given_rows`'s answer)
            self._given(args[0], None)
            return
        if not self._received(args, kwargs):
            if self._again("rows", first_tensor((args, kwargs))) and self._calls:
                self._rows.pop()  # the stage's shapes were inferred on them: counted once
                self._calls -= 1
            self.batch((args, kwargs))

    def _again(self, kind: str, given: torch.Tensor | None) -> bool:
        """Whether a pipeline's forward (``kind`` rows) or loss (``kind`` loss, ``given`` its
        labels) is given the same memory as the last of the update (where the ranks hold
        different parameters): a stage that infers its shapes (``PipelineStage`` without
        ``input_args``, torch's default) runs its first micro-batch through the model, and the
        last stage its loss on the first micro-batch's labels, once before the step's schedule,
        on detached views of the same tensors; the step's run of that micro-batch replaces it."""
        if self._held is None or given is None:
            return False
        place = (given.data_ptr(), tuple(given.shape), given.stride(), self.updates)
        seen, self._last_given[kind] = self._last_given.get(kind), place
        return seen == place

    def _received(self, args: tuple, kwargs: dict) -> bool:
        """Whether a forward's first tensor is the activation a pipeline stage received from the
        stage before (the ranks hold different parameters, and it is a leaf that requires its
        gradient: ``PipelineStage`` makes its received activations so, for the backward it sends
        back), not rows of the batch: only a first stage's are."""
        if self._held is None:
            return False
        first = first_tensor((args, kwargs))
        return first is not None and first.requires_grad and first.is_leaf

    def _on_autocast(self, module: nn.Module, args: tuple) -> None:
        """The autocast dtype a training forward runs under, once seen (`_attach`)."""
        if self._autocast is None and torch.is_grad_enabled():
            if self._first_child is None and module is not self._model:
                self._first_child = module
            if torch.is_autocast_enabled(self._device):
                self._autocast = str(torch.get_autocast_dtype(self._device)).removeprefix("torch.")

    def _on_cast(self, module: nn.Module, args: tuple) -> None:
        """The half precision a module's weights are in when its forward runs, where the job's
        parameters are wider: a wrapper that casts them for the forward and keeps its parameters
        in float32 (FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``) trains as
        an autocast does, and is recorded as one (``autocast``, its precision ``bf16-mixed``);
        looked for in the first update's forward alone (`_pruned`)."""
        if self._autocast is None and torch.is_grad_enabled():
            cast = next((p.dtype for p in module.parameters(recurse=False) if p.dtype in _HALF),
                        None)  # fmt: skip
            if cast is not None:
                self._autocast = str(cast).removeprefix("torch.")

    def _pruned(self) -> None:
        """After the first update, the autocast's hooks that are left (`_attach`): none once an
        autocast is seen (it is the recording's from then on), else the model's and the first
        child its forward called (a hook on a module makes torch take its slower call path, a
        few microseconds a call: on every child of a tiny model, 10 % of its update)."""
        keep = (self._model, self._first_child) if self._autocast is None else ()
        for module, hook in list(self._autocast_hooks.items()):
            if module not in keep:
                hook.remove()
                del self._autocast_hooks[module]
        for hook in self._cast_hooks:  # `_on_cast`: the first update's alone
            hook.remove()
        self._cast_hooks = []

    def _on_loss(self, module: nn.Module, args: tuple, output: Any) -> None:
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.numel() == 1:
            if self._held is not None:  # a pipeline's stage: its loss given again (`_again`)
                labels = [a for a in args if isinstance(a, torch.Tensor) and not a.requires_grad]
                if self._again("loss", labels[-1] if labels else None) and self._losses:
                    self._losses.pop()  # the inferred shapes' loss
            self.loss(output)

    def _on_output(self, module: nn.Module, args: tuple, output: Any) -> None:
        if torch.is_grad_enabled() and (value := _loss_of(output)) is not None:
            self.loss(value)

    # each update ------------------------------------------------------------------------------
    def _before_step(self, optimizer, args: tuple, kwargs: dict):
        # args: step's own, the optimizer first (torch calls the hook with them as step got them)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self._record_update()
            return None

        def recorded():  # the job's forward, backward and clipping run in its closure
            with torch.enable_grad():
                result = closure()
            self._record_update()
            return result

        if "closure" in kwargs:
            return args, {**kwargs, "closure": recorded}
        return (args[0], recorded, *args[2:]), kwargs

    def _signs_of(self, name: str, numel: int) -> torch.Tensor:
        if name not in self._signs or self._signs[name].numel() != -(-numel // self.k):
            self._signs[name] = sketch.signs(name, numel, self.k, self.sketch_seed)
        return self._signs[name]

    def _planned(self) -> tuple[list[_Batched], list[tuple[int, _Parameter]]]:
        """The small replicated parameters, batched by dtype and device (`_Batched`), and the
        others with their part's index, sketched one by one; made at the first sketch, when the
        parameters are what the job trains (an FSDP2 one a ``DTensor``)."""
        if self._plan is not None:
            return self._plan
        index = {part: i for i, part in enumerate(self._sketched)}
        groups: dict[tuple, list[_Parameter]] = {}
        others = []
        for p in self._parameters:  # a DTensor whole here as a plain tensor (`placed.whole_here`)
            if not placed.whole_here(p.parameter) or p.parameter.numel() > _BATCHED:
                others.append((index[p.part], p))
            else:
                groups.setdefault((p.parameter.dtype, p.parameter.device), []).append(p)
        self._plan = [self._batched(members, index) for members in groups.values()], others
        return self._plan

    def _batched(self, members: list[_Parameter], index: dict[str, int]) -> _Batched:
        """Parameters of one dtype and device sketched together: the zeros that pad each to
        whole blocks of k, each block's sign in its part's row."""
        first = members[0].parameter
        signs = [self._signs_of(p.name, p.parameter.numel()) for p in members]
        matrix = torch.zeros(len(self._sketched), sum(len(s) for s in signs),
                             dtype=torch.float64)  # fmt: skip
        start = 0
        for block_signs, p in zip(signs, members, strict=True):
            matrix[index[p.part], start : start + len(block_signs)] = block_signs
            start += len(block_signs)
        pads = [placed.local(first).new_zeros(-p.parameter.numel() % self.k) for p in members]
        dtype = first.dtype if first.dtype in (torch.float64, torch.float32) else torch.float32
        return _Batched(members, pads, matrix.to(first.device, dtype),
                        matrix.abs().numpy())  # fmt: skip

    def _deferred(self) -> bool:
        """Whether each update's gradients are copied and sketched when sent (`_DEFERRED`): one
        batch of small ones, of at most `_DEFERRED` elements padded, on the CPU."""
        batched, others = self._planned()
        return (len(batched) == 1 and not others and self._device == "cpu"
                and batched[0].signs.shape[1] * self.k <= _DEFERRED)  # fmt: skip

    def _most_kept(self) -> int:
        """The most updates kept before they are sent: `FLUSH_UPDATES`, fewer where their numbers
        would pass `FLUSH_BYTES` (each update's sketches, counted W times, and its gradients'
        copy where they are sketched later)."""
        each = self.world_size * len(self._sketched) * self.k * 8
        if self._deferred():
            signs = self._planned()[0][0].signs
            each += signs.shape[1] * self.k * signs.element_size()
        return max(1, min(FLUSH_UPDATES, FLUSH_BYTES // each))

    def _sketches(self, of_gradients: bool) -> dict[str, Any]:
        """This rank's sketches (parts × k) and squared norms (parts) of its plain gradients (or
        weights), ``replicated``, and of its DTensor shards per group of ranks whose shards sum to
        the whole (`gatherlab.recording.placed`), ``groups``: {ranks: (sketches, squares)}."""
        k, count = self.k, len(self._sketched)
        groups: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}
        batched, others = self._planned()
        if of_gradients and self._deferred():
            with torch.no_grad():  # a gradient made with create_graph=True: no graph of the copy
                return {"later": batched[0].blocks(k, of_gradients)}  # `_sketched_later`
        with torch.no_grad():
            made = [group.sketch(k, of_gradients) for group in batched]
        if len(made) == 1 and not others:  # the sketch of one batch of small parameters: its own
            replicated, squares = made[0]
            return {"replicated": replicated, "squares": squares, "groups": groups}
        replicated, squares = np.zeros((count, k)), np.zeros(count)
        for values, squared in made:
            replicated += values
            squares += squared
        for index, p in others:
            tensor = p.parameter.grad if of_gradients else p.parameter.data
            if tensor is None:
                continue
            held = placed.placed(tensor, self.rank)
            signs = self._signs_of(p.name, p.parameter.numel())
            values = placed.sketched(held, k, signs).numpy()
            if held.indices is None:
                replicated[index] += values
                squares[index] += _norm(held.local) ** 2
                continue
            if held.group not in groups:
                groups[held.group] = (np.zeros((count, k)), np.zeros(count))
            groups[held.group][0][index] += values
            groups[held.group][1][index] += _norm(held.local) ** 2
        return {"replicated": replicated, "squares": squares, "groups": groups}

    def _sketched_later(self, pending: list[tuple[dict[str, Any], Any]]) -> None:
        """The sketches of the updates whose gradients were copied (``later``, `_DEFERRED`), made
        when they are sent, one after the other in one pass."""
        for entry, _ in pending:
            if "later" in entry:
                replicated, squares = self._plan[0][0].sketched(entry.pop("later"))
                entry.update(replicated=replicated, squares=squares, groups={})

    def _gathered(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        if not self._distributed:
            return [payload]
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, payload)
        return every

    def _combined(self, every: list[dict[str, Any]]):
        """Each part's sketch and norm from every rank's: what each rank sees of the whole is its
        plain sketch plus, for each group of ranks it belongs to, the sum of that group's shards'
        sketches (the ranks of one copy); rank 0's is recorded, and the parts that some rank sees
        otherwise (a gradient not reduced over ranks, or over a replicated mesh dimension) keep
        every rank's. Where the ranks hold different parameters, the pieces' first copies summed
        (`pieces.Held.combined`)."""
        if self._held is not None:
            return pieces.Held.combined(self._pieces, self.parts,
                                        [payload["replicated"] for payload in every],
                                        [payload["squares"] for payload in every])  # fmt: skip
        if len(every) == 1 and not every[0]["groups"]:  # one rank's plain sketches: its own
            norms = dict(zip(self.parts, np.sqrt(every[0]["squares"]).tolist(), strict=True))
            return every[0]["replicated"], norms, {}
        sums: dict[tuple[int, ...], list[np.ndarray]] = {}
        for payload in every:  # in rank order: every rank of a group sums it in the same order
            for ranks, (values, squares) in payload["groups"].items():
                total = sums.setdefault(ranks, [np.zeros_like(values), np.zeros_like(squares)])
                total[0] += values
                total[1] += squares
        views, squared = [], []
        for payload in every:
            views.append(payload["replicated"] + sum(
                (sums[ranks][0] for ranks in payload["groups"]), np.zeros_like(
                    payload["replicated"])))  # fmt: skip
            squared.append(payload["squares"] + sum(
                (sums[ranks][1] for ranks in payload["groups"]), np.zeros_like(
                    payload["squares"])))  # fmt: skip
        norms = {part: math.sqrt(squared[0][i]) for i, part in enumerate(self.parts)}
        unreduced = {
            part: [view[i] for view in views]
            for i, part in enumerate(self.parts)
            if any(not np.array_equal(view[i], views[0][i]) for view in views[1:])
        }
        return views[0], norms, unreduced

    def _full_gradient(self) -> torch.Tensor | None:
        """The whole gradient in float64 (every rank takes part: a sharded one is gathered; where
        the ranks hold different parameters, each rank's sent to every rank and assembled in one
        device's order, each from its lowest holder: `gatherlab.core.held.assemble`)."""
        if self._held is not None:
            return self._assembled()
        pieces = []
        for p in self._parameters:
            grad = p.parameter.grad
            if grad is None:
                pieces.append(torch.zeros(p.parameter.numel(), dtype=torch.float64))
                continue
            grad = world.whole(grad)  # a DTensor gathered (torch's two-gather warning quiet)
            pieces.append(grad.detach().reshape(-1).double().cpu())
        return torch.cat(pieces) if self.rank == 0 else None

    def _assembled(self) -> torch.Tensor | None:
        """The whole gradient of a job whose ranks hold different parameters, on rank 0, and
        the copies that differ in it (`copies_apart`: each with the ranks and the names they
        hold it under, a tied copy under its own), kept for the update's line."""
        mine = {p.name: (self._held_as[p.name], (p.parameter.grad if p.parameter.grad is not None
                         else torch.zeros_like(p.parameter)).detach().double().cpu())
                for p in self._parameters}  # fmt: skip
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, mine)
        if self.rank != 0:
            return None
        sent = [Piece(rank, held, value) for rank, values in enumerate(every)
                for held, value in values.values()]  # fmt: skip
        names = {held: name for values in every for name, (held, _) in values.items()}
        self._apart = [apart.words() for apart in copies_apart(sent, names)]
        return assemble(list(self._held.order), sent, names)

    def _record_update(self) -> None:
        """This update's numbers, kept until the ranks send them (`_flush`). A floor whose model
        forward the first update never called is refused before its step."""
        if self.updates == 0 and self._floor_forward is not None and not self._floor_forward.calls:
            refuse(
                f"{self._floor_forward.said}: the first update never called the model's forward, "
                "which the floor cuts in row blocks (its training step calls the model's parts "
                "itself); allowed: the part of the model before its loss in "
                "gatherlab.record.in_row_blocks(...) in the job"
            )
        ids = [i for i, rows in enumerate(self._rows) if isinstance(rows, torch.Tensor)]
        pads: dict[tuple, int] = {}
        for i, found in zip(ids, paddings_together([self._rows[i] for i in ids]), strict=True):
            raw, keeps = self._rows[i], {None: None, **dict(found.candidates)}
            if self.updates or not found.candidates:  # the run's pads seen: `rows.choice`
                pad = choice(found.pad, list(keeps)[1:], self._pads)
                self._rows[i] = sampled(raw, keeps[pad])
            else:  # the first update: each candidate's rows, for every rank's pads to choose
                made = {pad: sampled(raw, keep) for pad, keep in keeps.items()}
                self._rows[i] = _Candidates(found.pad, made)
            shown = NO_PAD if found.pad is None else found.pad  # `rows.choice`
            pads[shown] = pads.get(shown, 0) + 1
        entry = {
            **self._sketches(of_gradients=True),
            "loss": (self._losses[0] if len(self._losses) == 1 else float(np.mean(self._losses))
                     if self._losses else math.nan),
            "rows": self._rows, "pads": pads,
            "calls": self._calls, "micro_batches": len(self._losses), "autocast": self._autocast,
            "loss_dtype": self._loss_dtype,
        }  # fmt: skip
        full = self._full_gradient() if self.updates < self.full_updates else None
        if self._apart:  # the copies that differ in the whole gradient just assembled
            entry["copies_apart"], self._apart = self._apart, []
        if self.updates == 0 and self._trace:
            if self._tracer is not None:  # no loss was seen: the trace ends at the step
                self._trace_end(None)
            entry["trace"] = self._traced.detached() if self._traced is not None else []
        self._pending.append((entry, full))
        self.updates += 1
        if self.updates == 1 or (self._autocast is not None and self._autocast_hooks):
            self._pruned()
        self._rows, self._losses, self._calls, self._loss_dtype = [], [], 0, None

    def _after_step(self, optimizer, args: tuple, kwargs: dict) -> None:
        """After the step: on W ranks, this rank's weights' fingerprint (`_weights_digests`),
        so that ranks that step apart are seen at the update they part; then the kept updates
        are sent when due."""
        if self._distributed and self._pending and "weights" not in self._pending[-1][0]:
            self._pending[-1][0]["weights"] = self._weights_sampled()
        if self.updates >= self._due:
            self._flush()

    def _weights_sampled(self) -> np.ndarray:
        """The samples of the weights after the step that `_weights_digests` digests when the
        updates are sent: at most `_WEIGHT_SAMPLES` elements of each replicated parameter, evenly
        spaced (ranks that step apart move almost every element; an FSDP2 shard is each rank's
        own, and is not compared), copied in one concatenation of views made once (re-made where
        a parameter's storage moved)."""
        made = self._weight_samples
        if made is None or any(tensor.data_ptr() != at for tensor, at in made[1]):
            members = [p for part in self._sketched for p in self._parameters
                       if p.part == part and not isinstance(p.parameter, _dtensor())]  # fmt: skip
            views = [p.parameter.detach().reshape(-1)[:: -(-p.parameter.numel() // _WEIGHT_SAMPLES)]
                     for p in members]  # fmt: skip
            lengths = {part: 0 for part in self._sketched}
            for p, view in zip(members, views, strict=True):
                lengths[p.part] += len(view)
            self._weight_samples = (views, [(p.parameter, p.parameter.data_ptr())
                                            for p in members])  # fmt: skip
            self._weight_lengths = list(lengths.values())
        views = self._weight_samples[0]
        if not views:
            return np.zeros(0)
        if not all(p.is_contiguous() for p, _ in self._weight_samples[1]):
            self._weight_samples = None  # a reshaped copy: made again at the next step
        samples = torch.cat(views)
        if samples.dtype == torch.bfloat16:  # numpy has none: float32 holds it exactly
            samples = samples.float()
        return samples.cpu().numpy()

    def _weights_digests(self, samples: list[np.ndarray]) -> list[Sampled]:
        """Each update's weights' samples (`_weights_sampled`) as one matrix of a row per part,
        its samples in float64, zero-padded to the longest (a part without any: one zero), to be
        digested with the rows (`rows.digests`): each part's 64-bit digest."""
        if not samples:
            return []
        lengths = [length or 1 for length in self._weight_lengths]
        ends = np.cumsum([0, *self._weight_lengths])
        made = []
        for values in samples:
            matrix = np.zeros((len(lengths), max(lengths)))
            for row, (start, stop) in enumerate(itertools.pairwise(ends)):
                matrix[row, : stop - start] = values[start:stop]
            made.append(sampled_bits(matrix))
        return made

    def _flush(self, final: dict[str, np.ndarray] | None = None) -> None:
        """Every rank sends rank 0 its kept updates (and, at the end, its final weights' sketch) in
        one collective; rank 0 writes them and says when the next are due (`FLUSH_SECONDS`)."""
        pending, self._pending = self._pending, []
        first = self.updates - len(pending)
        now = time.perf_counter()
        each = (now - self._flushed_at) / max(len(pending), 1)
        self._flushed_at = now
        kept = max(1, min(self._most_kept(), int(FLUSH_SECONDS / max(each, 1e-9))))
        if self._row_group is None:
            self._row_group = placed.row_group([p.parameter for p in self._parameters], self.rank,
                                               fsdp=_fully_sharded(self._model))  # fmt: skip
        self._made(pending)
        every, alike = self._sent([entry for entry, _ in pending], final, kept)
        self._due = self.updates + every[0]["kept"]  # rank 0's choice, the same on every rank
        self._untied(every)
        self._count_rows(every, first)
        if self._writer is None:
            return
        self._written(pending, first, every, alike)
        if final is not None:
            sketches, norms, _ = self._combined([r["final"] for r in every])
            start = self._writer.sketch(sketches.reshape(-1))
            final = {
                "updates": self.updates,
                "weights_sketch": start,
                "weights_norms": norms,
                "row_groups": sorted({g.ranks for g in self._counted or [] if len(g.ranks) > 1}),
            }
            self._writer.close(final)

    def _made(self, pending: list[tuple[dict[str, Any], Any]]) -> None:
        """The kept updates' numbers that are made when they are sent: the sketches of copied
        gradients (`_sketched_later`), every update's rows' and weights' digests at once."""
        self._sketched_later(pending)
        for entry, _ in pending:  # rows copied whole: their bits now (`rows.Whole`)
            entry["rows"] = [row.sampled() if isinstance(row, Whole) else row
                             for row in entry["rows"]]  # fmt: skip
        samples = [sample for entry, _ in pending for sample in entry["rows"]]
        weighed = [entry for entry, _ in pending if "weights" in entry]
        samples += self._weights_digests([entry["weights"] for entry in weighed])
        each = [tuple(row.by_pad.values()) if isinstance(row, _Candidates) else (row,)
                for row in samples]  # fmt: skip
        made = iter(digests([sample for row in each for sample in row]))  # all at once
        for entry, _ in pending:
            rows = [next(made) if isinstance(row, Sampled) else
                    (row.own, {pad: next(made) for pad in row.by_pad})
                    for row in entry["rows"]]  # fmt: skip
            untied = all(isinstance(row, np.ndarray) for row in rows)
            entry["rows"] = (
                (np.concatenate(rows) if rows else np.zeros(0, np.uint64)) if untied else rows
            )  # a tied call's digests: `_untied`, once every rank's are here
        for entry in weighed:
            entry["weights"] = next(made)

    def _sent(self, mine: list[dict[str, Any]], final: dict[str, np.ndarray] | None,
              kept: int) -> tuple[list[dict[str, Any]], bool]:  # fmt: skip
        """Every rank's kept updates, sent to every rank (`_gathered`), and whether every rank's
        sketches are rank 0's (``alike``: rank 0's entries then hold its own, and the others'
        none). Where the ranks hold the same parameters, each first sends its updates without
        their sketches (`_without_sketches`), then, where some rank's differ from rank 0's or
        cannot be told alike, every rank's sketches in a second collective."""
        digested = self._distributed and self._held is None  # else every rank's numbers at once
        every = self._gathered({
            "updates": [_without_sketches(entry) for entry in mine] if digested else mine,
            "final": final, "kept": kept, "row_group": self._row_group,
        })  # fmt: skip
        if not digested:
            return every, not self._distributed
        alike = _sketched_alike(every)
        own = [{key: entry[key] for key in _SKETCHED} for entry in mine]
        numbers = [own] if alike else self._gathered(own)  # alike: rank 0's, its own
        for payload, theirs in zip(every, numbers, strict=False):
            for entry, values in zip(payload["updates"], theirs, strict=True):
                entry.update(values)
        return every, alike

    def _untied(self, every: list[dict[str, Any]]) -> None:
        """Every rank's calls of the first update given the digests of their rows without the
        run's pad value (`rows.choice`: the value that padded the most of the run's batches so
        far on every rank, ``pads``, counted here on every rank alike): two rows of a device's
        batch, one padded by one and the other ending in a token nowhere else, and rows of one
        length ending alike, are padded as the run's other batches show."""
        for payload in every:
            for entry in payload["updates"]:
                for pad, count in entry.pop("pads", {}).items():
                    self._pads[pad] = self._pads.get(pad, 0) + count
        for payload in every:
            for entry in payload["updates"]:
                if isinstance(entry["rows"], np.ndarray):
                    continue
                rows = []
                for row in entry["rows"]:
                    if isinstance(row, tuple):
                        own, by_pad = row
                        row = by_pad[choice(own, list(by_pad)[1:], self._pads)]
                    rows.append(row)
                entry["rows"] = np.concatenate(rows) if rows else np.zeros(0, np.uint64)

    def _written(self, pending: list, first: int, every: list[dict[str, Any]],
                 alike: bool = False) -> None:  # fmt: skip
        """Rank 0 writes the kept updates, the first numbered ``first``, from every rank's
        numbers (``alike``: every rank's sketches are rank 0's, `_sketched_alike`)."""
        for position, (_, full) in enumerate(pending):
            self._write(first + position, [r["updates"][position] for r in every], full, alike)
        self._writer.flush()

    def _count_rows(self, every: list[dict[str, Any]], first: int) -> None:
        """Tensor parallelism's rows counted once (docs/recording.md §11): the ranks of a
        tensor-parallel group (`placed.row_group`, from the parameters' mesh) train the same
        rows, which the group's first rank holds for it; the others' are compared with them and
        left out. A group the parameters only suggest (`RowGroup.sure` False) whose rows differ
        at the first update is data-parallel: every rank's rows count. A sure group whose ranks
        give different rows (each its shard of the sequence) is refused in one line, on every
        rank alike (each has every rank's rows)."""
        if self._counted is None:
            groups = [payload["row_group"] for payload in every]
            unsure = [g for g in groups if not g.sure and len(g.ranks) > 1]
            if unsure and _rows_differ(every, groups, 0):
                groups = [placed.RowGroup((rank,)) for rank in range(len(every))]
            self._counted = groups
        for position in range(len(every[0]["updates"])):
            differing = _rows_differ(every, self._counted, position)
            if differing:
                refuse(
                    f"the ranks {differing} of one tensor-parallel group (their parameters cut "
                    f"over one mesh dimension) give their model different rows at update "
                    f"{first + position} (each its shard of the sequence, or rows of its own): "
                    "they cannot be counted as the group's samples; allowed: every rank of a "
                    "tensor-parallel group given the group's whole rows (the plan's input "
                    "declared replicated, PrepareModuleInput(input_layouts=Replicate(), ...)), or "
                    "gatherlab.record(..., batches=False) and recorder.batch(<the group's whole "
                    "rows>) on its ranks"
                )

    def _write(self, update: int, ranks: list[dict[str, Any]], full: torch.Tensor | None,
               alike: bool = False) -> None:  # fmt: skip
        """Rank 0 writes one update from every rank's numbers (``alike``: every rank's sketches
        are rank 0's, combined from rank 0's alone)."""
        writer = self._writer
        sketches, norms, unreduced = self._combined(ranks[:1] if alike else ranks)
        drifted = []
        if "weights" in ranks[0]:  # the parts whose weights differ between ranks after the step
            digests = np.stack([r["weights"] for r in ranks])
            if self._held is not None:  # between the copies of each piece alone
                drifted = pieces.Held.drifted(self._pieces, self.parts, digests)
            else:
                drifted = [part for i, part in enumerate(self.parts)
                           if not (digests[:, i] == digests[0, i]).all()]  # fmt: skip
        start = writer.sketch(sketches.reshape(-1))
        starts = {part: [writer.sketch(values) for values in per_rank]
                  for part, per_rank in unreduced.items()}  # fmt: skip
        if full is not None:
            writer.full(update, full)
        if "trace" in ranks[0]:
            writer.trace([r["trace"] for r in ranks])
        counted_rows = [r["rows"] if self._counts(rank) else np.zeros(0, np.uint64)
                        for rank, r in enumerate(ranks)]  # fmt: skip
        losses = [r["loss"] for r in ranks]
        counted = losses
        if self._held is not None:  # a pipeline's loss is its last stages' alone
            counted = [v for v in losses if not math.isnan(v)] or losses
        micro_batches = next((r["micro_batches"] for r in ranks if r["micro_batches"]), 0)
        writer.update({
            "update": update, "losses": [_json_float(v) for v in losses],
            "loss": _json_float(mean_over_ranks([[v] for v in counted])[0]),
            "rows": {"start": writer.rows(np.concatenate(counted_rows)),
                     "counts": [len(rows) for rows in counted_rows]},
            "calls": [r["calls"] if self._counts(rank) else 0 for rank, r in enumerate(ranks)],
            "norms": norms, "unreduced": starts, "sketch": start,
            "autocast": ranks[0]["autocast"], "micro_batches": micro_batches,
            "loss_dtype": next((r["loss_dtype"] for r in ranks if r.get("loss_dtype")), None),
            "drifted": drifted,
            **({"copies_apart": ranks[0]["copies_apart"]} if "copies_apart" in ranks[0] else {}),
        })  # fmt: skip

    def _counts(self, rank: int) -> bool:
        """Whether ``rank``'s rows count: it is the first of its tensor-parallel group."""
        return self._counted is None or self._counted[rank].ranks[0] == rank

    # the end ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Records the final weights and ends the recording (every rank calls it): the updates
        the ranks still keep and the final weights' sketches in one collective, then a barrier,
        so that every rank returns once rank 0 has written the whole recording."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._unclosed)
        for hook in self._hooks:
            hook.remove()
        self._flush(final=self._sketches(of_gradients=False))
        if self._distributed:
            dist.barrier()

    @property
    def seen_loss(self) -> bool:
        """Whether the update under way has given this rank a loss."""
        return bool(self._losses)

    def abandon(self) -> None:
        """Stop recording without closing (the job stops: the recording stays unfinished)."""
        self._closed = True
        atexit.unregister(self._unclosed)
        for hook in self._hooks:
            hook.remove()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
        else:  # the job failed: the recording stays unfinished, what it wrote stays readable
            self.abandon()


_SKETCHED = ("replicated", "squares", "groups")
"""The numbers of an update's sketches that rank 0 combines (`Recorder._combined`)."""


def _without_sketches(entry: dict[str, Any]) -> dict[str, Any]:
    """What a rank sends of an update at first where the ranks hold the same parameters
    (`Recorder._flush`): all but its sketches, which a digest of their bytes stands for where
    they are plain (none: a sharded gradient's, whose groups rank 0 sums, or sketches holding a
    NaN, which equals nothing). A data-parallel job's reduced gradient is the same on every rank
    to the last bit, and so is its sketch: rank 0 needs its own alone (each update's sketches
    are 8·k bytes a part, and W = 4 spent 0.5 ms an update sending every rank's to every
    rank)."""
    sent = {key: value for key, value in entry.items() if key not in _SKETCHED}
    values = entry["replicated"]
    plain = not entry["groups"] and not np.isnan(values).any()
    sent["sketched"] = hashlib.blake2b(values.tobytes(), digest_size=16).digest() if plain else None
    return sent


def _sketched_alike(every: list[dict[str, Any]]) -> bool:
    """Whether every rank's sketches of every update sent are rank 0's, by their digests
    (`_without_sketches`); False where one cannot be told (no digest), decided alike on every
    rank. Equal bytes are what `Recorder._combined` compares, but for NaN."""
    for position, entry in enumerate(every[0]["updates"]):
        digest = entry.get("sketched")
        if digest is None or any(p["updates"][position]["sketched"] != digest for p in every[1:]):
            return False
    return True


def _rows_differ(every: list[dict[str, Any]], groups: list[placed.RowGroup], position: int):
    """The first group (its ranks) one of whose ranks gives other rows than the group's first
    rank at the update at ``position`` of the batch sent (a rank that gives none is not
    compared); None where none does."""
    for rank, group in enumerate(groups):
        first = group.ranks[0]
        if first == rank:
            continue
        mine = every[rank]["updates"][position]["rows"]
        theirs = every[first]["updates"][position]["rows"]
        if len(mine) and not np.array_equal(mine, theirs):
            return list(group.ranks)
    return None


def _launch_command() -> list[str]:
    """The command that started this job: under torchrun its agent's (``torchrun
    --nproc-per-node 1 job.py …``, whose ranks run ``job.py`` without it), else this process's
    (``sys.orig_argv``)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        try:
            line = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
            return _as_typed([part.decode() for part in line.split(b"\0") if part])
        except OSError:  # not Linux: the rank's own command
            pass
    return list(sys.orig_argv)


def _as_typed(command: list[str]) -> list[str]:
    """``command`` as a shell starts it: a console script (an executable file of no Python source
    that its first line runs with the interpreter: the agent's ``python …/bin/torchrun …``) by
    its name where the PATH finds that file by it, else by its path."""
    if len(command) < 2 or not Path(command[0]).name.startswith("python"):
        return command
    script = Path(command[1])
    if script.suffix == ".py" or not script.is_file() or not os.access(script, os.X_OK):
        return command
    with open(script, "rb") as file:
        if file.read(2) != b"#!":
            return command
    found = shutil.which(script.name)
    named = found is not None and Path(found).resolve() == script.resolve()
    return [script.name if named else str(script), *command[2:]]


def _norm(values: torch.Tensor) -> float:
    """The L2 norm of ``values``: each row of 256's norm in the values' own precision (a half one
    in float32), their squares summed in float64. Measured on a float32 gradient of 2.36M
    elements against a float64 sum: 1.4e-9 relative, where one ``vector_norm`` of the whole in
    float32 was 8e-5 and a float64 copy costs 5 times the time; the rows' ``vecdot`` (5e-10) took
    4.6 times as long, since it makes the rows' products first (issue 61); equal gradients have
    equal norms."""
    flat = values.detach().reshape(-1)
    if flat.dtype not in (torch.float64, torch.float32):
        flat = flat.float()
    even = flat.numel() // _NORM_ROW * _NORM_ROW
    rows = flat[:even].view(-1, _NORM_ROW)
    squared = float(torch.linalg.vector_norm(rows, dim=1).double().square().sum())
    squared += float(flat[even:].double().pow(2).sum())
    return math.sqrt(squared)


_NORM_ROW = 256


def _json_float(value: float) -> float | None:
    return None if math.isnan(value) else value


def _precision(dtype: torch.dtype) -> str:
    return {torch.float64: "64-true", torch.float32: "32-true", torch.bfloat16: "bf16-true",
            torch.float16: "16-true"}.get(dtype, str(dtype))  # fmt: skip


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gatherlab")
    except PackageNotFoundError:
        return "unknown"
