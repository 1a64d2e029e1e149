"""Collectives compared before they run: in a watched job each rank tells its peers which
collective it is about to enter (operation, shape, dtype, ``file:line``) and enters it only once
every peer has told the same, so that ranks that disagree, or wait for a peer that returned or
raised, end the job at once with one line naming each rank's call site instead of a hang, a wrong
result or a silent gloo abort (docs/checking.md §10, "Collectives that differ").

The calls are seen through torch's public ``TorchFunctionMode``; a DDP module the check builds
gets torch's Python all-reduce hook (``visible``: the same sums, bit for bit) so that its gradient
all-reduce is seen too. Collectives without a tensor (``barrier``) and DDP modules built
elsewhere are not seen; the group's timeout, set to the watch's, still ends those. The ranks talk
through their process group's store (``Peers``; a job's keys are its own, ``Peers.job``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
import os
import pickle
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.overrides import TorchFunctionMode

from gatherlab.core import cli, imports, terms

__all__ = [
    "NAMES", "CollectiveError", "Ended", "Entered", "Peers", "disagreement",
    "visible", "watch_timeout", "watched", "watching",
]  # fmt: skip

NAMES = frozenset({
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
    "all_to_all_single", "broadcast", "broadcast_object_list", "gather", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "scatter",
})  # fmt: skip
"""The collectives of ``torch.distributed`` that every rank of a group enters in the same order."""

# Those whose first argument may differ between ranks (uneven splits): compared by name and dtype.
_ANY_SHAPE = frozenset({"all_to_all", "all_to_all_single", "reduce_scatter"})
# The longest a waiting rank sleeps between two looks at its peers.
_LONGEST_POLL_S = 0.02
# After a disagreement: how long a rank waits for the peers that have not yet told theirs, so that
# its line names every rank (they arrive within milliseconds; a rank that hangs is not waited for).
_GATHER_WORDS_S = 0.5


@dataclasses.dataclass(frozen=True)
class Entered:
    """A collective a rank entered: the ``index``-th of its ``group`` on that rank, ``op`` its
    name, ``shape`` and ``dtype`` of the tensor every rank gives alike (its first argument; a list
    of tensors as ``(len, *shape)``), ``where`` the ``file:line`` of the code that called it."""

    rank: int
    group: str
    index: int
    op: str
    shape: tuple[int, ...] | None
    dtype: str
    where: str

    @property
    def fingerprint(self) -> tuple[Any, ...]:
        """What every rank of the group must enter alike."""
        return (self.op, None if self.op in _ANY_SHAPE else self.shape, self.dtype)

    def words(self) -> str:
        """``all_reduce at mine.py:17 ((4, 16) float32)``, ``all_reduce of DDP's gradient
        bucket ((1232,) float64)``."""
        shape = "" if self.shape is None else f"{self.shape} "
        where = self.where if self.where == _DDP else f"at {self.where}"
        return f"{self.op} {where} ({shape}{self.dtype})"


@dataclasses.dataclass(frozen=True)
class Ended:
    """A rank that left the job's code: ``counts`` the collectives it entered in each group,
    ``error`` its error in one line when it raised (None: it returned), and ``raised_by`` the rank
    whose error that is (a peer's error this rank passed on keeps the peer's rank; None: its
    own)."""

    rank: int
    counts: dict[str, int]
    error: str | None
    raised_by: int | None = None

    @property
    def raiser(self) -> int:
        """The rank whose error ``error`` is."""
        return self.rank if self.raised_by is None else self.raised_by


class CollectiveError(RuntimeError):
    """A watched job ended because its ranks' collectives disagree, or a peer raised or did not
    come: the message is one line naming each rank's call site. ``rank`` is the rank the line is
    about first (a peer that raised: that peer; ranks that disagree: the lowest of them), ``line``
    the line itself, as ``RankError`` carries them; ``own`` whether the line is that rank's own
    error (a peer's, passed on: shown as ``rank 1: ValueError: ...``) rather than about several
    ranks (``collectives differ: rank 0 entered ...; rank 1 entered ...``)."""

    def __init__(self, line: str, rank: int, own: bool = False):
        super().__init__(line)
        self.line, self.rank, self.own = line, rank, own

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.line, self.rank, self.own)


@dataclasses.dataclass(frozen=True)
class Peers:
    """A rank's link to its peers for one job: the ``store`` every rank of the process group
    reaches, the ``job``'s prefix of its keys, this ``rank``, and ``timeout_s`` (how long it waits
    for them; None in a job that is not watched)."""

    store: dist.Store
    job: str
    rank: int
    timeout_s: float | None

    def entered_key(self, group: str, index: int, rank: int) -> str:
        return f"{self.job}/{group}/{index}/{rank}"

    def ended_key(self, rank: int) -> str:
        return f"{self.job}/ended/{rank}"

    def read(self, key: str) -> Any | None:
        """The value a peer published under ``key``, None while it has not."""
        if not self.store.check([key]):
            return None
        return pickle.loads(self.store.get(key))

    def publish(self, key: str, value: Any) -> None:
        self.store.set(key, pickle.dumps(value))

    def told(self, group: str, index: int, ranks: Sequence[int]) -> list[Entered | Ended | None]:
        """What each of ``ranks`` told at the ``index``-th collective of ``group``: what it
        entered there, else that it ended, else None (not yet)."""
        return [
            self.read(self.entered_key(group, index, r)) or self.read(self.ended_key(r))
            for r in ranks
        ]

    def wait_ended(self, ranks: Sequence[int]) -> list[Ended]:
        """Every rank's end once each of ``ranks`` has ended (or after the timeout, what ended):
        a rank leaves its group only when its peers are out of their collectives."""
        return _until(lambda: [self.read(self.ended_key(r)) for r in ranks], self.timeout_s)


def _until(look: Callable[[], list[Any]], timeout_s: float) -> list[Any]:
    """``look()`` until nothing in it is None or ``timeout_s`` passed: its last answer."""
    deadline = time.monotonic() + timeout_s
    pause = 0.0002
    while True:
        seen = look()
        if all(item is not None for item in seen) or time.monotonic() >= deadline:
            return seen
        time.sleep(pause)
        pause = min(2 * pause, _LONGEST_POLL_S)


def disagreement(mine: Entered, seen: dict[int, Entered | Ended | None]) -> str | None:
    """The line that ends a job, when the group's ranks cannot all run ``mine``: ``seen`` holds,
    for each other rank of its group, what it entered at the same place (``Entered``), that it
    left the code (``Ended``), or None (not yet). None while nothing disagrees.

    >>> a = Entered(0, "world", 0, "all_reduce", (1,), "float32", "mine.py:17")
    >>> b = Entered(1, "world", 0, "all_gather", (2, 4, 16), "float32", "mine.py:19")
    >>> disagreement(a, {1: b})
    'rank 0 entered all_reduce at mine.py:17 ((1,) float32); rank 1 entered all_gather at mine.py:19 ((2, 4, 16) float32)'
    >>> disagreement(a, {1: Ended(1, {"world": 0}, None)})
    'rank 0 entered all_reduce at mine.py:17 ((1,) float32); rank 1 never entered it and returned'
    """  # noqa: E501
    everyone = {mine.rank: mine, **seen}
    entered = {r: e for r, e in everyone.items() if isinstance(e, Entered)}
    ended = {r: e for r, e in everyone.items() if isinstance(e, Ended)}
    differ = len({e.fingerprint for e in entered.values()}) > 1
    if not differ and not ended:
        return None
    parts = []
    by_call: dict[tuple[Any, ...], list[int]] = {}
    for rank, entry in sorted(entered.items()):
        by_call.setdefault((entry.fingerprint, entry.where), []).append(rank)
    for ranks in by_call.values():
        parts.append((ranks[0], f"{_ranks(ranks)} entered {entered[ranks[0]].words()}"))
    for rank, end in sorted(ended.items()):
        if end.error is None:
            parts.append((rank, f"{_ranks([rank])} never entered it and returned"))
        else:
            parts.append((rank, f"{_ranks([rank])} raised before it: {end.error}"))
    return "; ".join(text for _, text in sorted(parts))


def _ranks(ranks: Sequence[int]) -> str:
    """``rank 1``, ``ranks 1, 2, 3``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _group_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    return group


def _shape_of(value: Any) -> tuple[tuple[int, ...] | None, str]:
    """The shape and dtype of a collective's first argument: a tensor, or a list of them."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), str(value.dtype).removeprefix("torch.")
    if isinstance(value, list | tuple) and value and isinstance(value[0], torch.Tensor):
        return (len(value), *value[0].shape), str(value[0].dtype).removeprefix("torch.")
    if isinstance(value, list | tuple):
        return (len(value),), "object"
    return None, "object"


def _caller() -> str:
    """The ``file:line`` of the innermost frame outside torch and this module: the code that
    called the collective; ``_DDP`` for DDP's all-reduce of a gradient bucket."""
    if getattr(_in_ddp, "on", False):
        return _DDP
    frame = inspect.currentframe()
    while frame is not None and (
        frame.f_code.co_filename == __file__ or frame.f_code.co_filename.startswith(_TORCH)
    ):
        frame = frame.f_back
    return "?" if frame is None else imports.place(frame.f_code.co_filename, frame.f_lineno)


_TORCH = os.path.dirname(os.path.realpath(torch.__file__)) + os.sep
_DDP = "of DDP's gradient bucket"
_in_ddp = threading.local()  # set while DDP's hook all-reduces a bucket (in the backward)
_active = threading.local()  # the watch of the job this thread runs, if any


def _ddp_all_reduce(state, bucket):  # unannotated: DDP refuses a hook's annotations as strings
    """torch's own all-reduce hook of DDP (the bucket divided by W, then summed over ranks: what
    its C++ path does, bit for bit), compared by the job's watch first as DDP's."""
    watch = getattr(_active, "watch", None)
    if watch is not None:  # torch runs the hook with no torch function mode: told directly
        _in_ddp.on = True
        try:
            watch._enter("all_reduce", (bucket.buffer(),), {})
        finally:
            _in_ddp.on = False
    return default_hooks.allreduce_hook(state, bucket)


def visible(model: nn.Module) -> nn.Module:
    """``model``, a DDP module, with its gradients' all-reduce seen by the watch of the job that
    builds it (``_ddp_all_reduce``); unchanged outside a watched job, or when it is no DDP
    module."""
    if getattr(_active, "watch", None) is not None and isinstance(model, DistributedDataParallel):
        model.register_comm_hook(None, _ddp_all_reduce)
    return model


class _Watch(TorchFunctionMode):
    """The mode of a watched job on one rank: each collective is compared with the peers' before
    it runs (`_enter`); ``counts`` the collectives entered in each group."""

    def __init__(self, peers: Peers):
        super().__init__()
        self.peers = peers
        self.counts: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name, module = getattr(func, "__name__", ""), getattr(func, "__module__", None) or ""
        if name in NAMES and module.startswith("torch.distributed.") and ".nn" not in module:
            self._enter(name, args, kwargs)
        return func(*args, **kwargs)

    def _enter(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        group = _group_of(args, kwargs)
        if group is None or group == dist.group.WORLD:
            key, ranks = "world", list(range(dist.get_world_size()))
        else:
            key, ranks = group.group_name, dist.get_process_group_ranks(group)
        first = args[0] if args else next(iter(kwargs.values()), None)
        shape, dtype = _shape_of(first)
        index = self.counts.get(key, 0)
        self.counts[key] = index + 1
        mine = Entered(self.peers.rank, key, index, op, shape, dtype, _caller())
        peers = self.peers
        peers.publish(peers.entered_key(key, index, mine.rank), mine)
        others = [r for r in ranks if r != mine.rank]
        deadline = time.monotonic() + peers.timeout_s
        pause = 0.0002
        while True:
            seen = dict(zip(others, peers.told(key, index, others), strict=True))
            line = disagreement(mine, seen)
            if line is not None:
                raise self._ended(mine, others, line)
            if all(isinstance(item, Entered) for item in seen.values()):
                return
            if time.monotonic() >= deadline:
                missing = [r for r, item in seen.items() if item is None]
                raise CollectiveError(
                    f"rank {mine.rank} waited {peers.timeout_s:g} s (the collective timeout) in "
                    f"{mine.words()} for {_ranks(missing)}, which neither entered it nor ended",
                    missing[0],
                )
            time.sleep(pause)
            pause = min(2 * pause, _LONGEST_POLL_S)

    def _ended(self, mine: Entered, others: list[int], first: str) -> CollectiveError:
        """The error of a disagreement, its line naming every rank that told in time."""
        told = _until(lambda: self.peers.told(mine.group, mine.index, others), _GATHER_WORDS_S)
        seen = dict(zip(others, told, strict=True))
        raised = [item for item in seen.values() if isinstance(item, Ended) and item.error]
        if raised:  # a peer raised: its error is the job's, as if this rank had not waited
            # named by the rank that raised it, not by a peer that passed it on first
            first_raised = min(raised, key=lambda item: (item.raised_by is not None, item.raiser))
            return CollectiveError(first_raised.error, first_raised.raiser, own=True)
        line = f"{terms.COLLECTIVES_DIFFER} {disagreement(mine, seen) or first}"
        return CollectiveError(line, min([mine.rank, *seen]))


@contextlib.contextmanager
def watched(peers: Peers | None) -> Iterator[None]:
    """Run the block with its collectives compared across ranks (``peers``; None, or no timeout:
    not watched); at its end, tell the peers that this rank returned or raised (what they wait for
    ends)."""
    if peers is None or peers.timeout_s is None:
        yield
        return
    watch = _Watch(peers)
    _active.watch = watch
    try:
        with watch:
            yield
    except BaseException as error:
        line = error.line if isinstance(error, CollectiveError) else cli.error_line(error)
        passed_on = error.rank if isinstance(error, CollectiveError) and error.own else None
        peers.publish(peers.ended_key(peers.rank), Ended(peers.rank, watch.counts, line, passed_on))
        raise
    finally:
        _active.watch = None
    peers.publish(peers.ended_key(peers.rank), Ended(peers.rank, watch.counts, None))


_timeout: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "gatherlab_collective_timeout", default=None
)


@contextlib.contextmanager
def watching(timeout_s: float) -> Iterator[None]:
    """While the block runs, every job of the warm pool and of the launcher's ranks is watched
    (its collectives compared across ranks, a peer waited for at most ``timeout_s``), and the
    process group's own timeout is ``timeout_s`` too: a collective the watch does not see (DDP's,
    in C++) ends then. The check runs inside it; the lab's training does not pay for it."""
    if not timeout_s > 0:
        raise ValueError(f"collective timeout {timeout_s!r} s; allowed: a number of seconds > 0")
    token = _timeout.set(float(timeout_s))
    try:
        yield
    finally:
        _timeout.reset(token)


def watch_timeout() -> float | None:
    """The timeout of the active ``watching`` block, None outside one (jobs are not watched)."""
    return _timeout.get()
