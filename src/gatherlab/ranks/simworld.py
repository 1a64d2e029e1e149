"""The simulated world: W ranks as threads of one process, for world sizes no machine here has
(docs/design.md §9).

``run(W, function, *args)`` calls ``function(*args)`` on W virtual ranks and returns their results
in rank order, like ``pool(W).run``; ``rank()`` and ``size()`` say which rank of which world a
thread is, and its collectives meet the other threads at a rendezvous. One rank computes at a time
(it hands the turn on at a collective), so one rank's temporaries are alive at a time and the
global RNG is used by one rank at a time.

Only the communication is simulated: every rank runs the loss code a real rank runs on its own
slice. A gather is simulated from the rule its backward obeys (``RULES``: ``sum``, ``own``,
``mean``, ``none``), DDP's average of the parameter gradients by ``average``. Validated against
real gloo ranks (``tests/lab/test_audit.py``, ``tests/ranks/test_simworld.py``).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gatherlab.core import terms

__all__ = ["RULES", "WorldBroken", "average", "gather", "rank", "run", "size"]

RULES = tuple(terms.Rule)
"""The backward rules a simulated gather obeys (see above; `gatherlab.core.terms.Rule`,
`gatherlab.gather.Gather.backward`)."""


class WorldBroken(RuntimeError):
    """Another virtual rank raised or returned, so the collective this rank waits at can never
    complete.

    Raised inside the waiting ranks; `run` reports the rank that failed by itself, not these.
    """


class _World:
    """The rendezvous of W threads: one collective at a time, in the order every rank calls them.

    No collective can hang: a rank that raises breaks the world, and so does a rank that returns
    while others wait at a collective it never joins (a real group would hang there).
    """

    def __init__(self, size: int):
        self.size = size
        self.turn = threading.Lock()  # held by the one rank that computes
        self._condition = threading.Condition()
        self._posted: dict[int, Any] = {}
        self._finished: set[int] = set()
        self._generation = 0
        self._result: Any = None
        self._error: str | None = None

    def exchange(self, rank: int, value: Any, combine: Callable[[list[Any]], Any]) -> Any:
        """Every rank posts ``value``; the last to arrive computes ``combine`` of the values in
        rank order, and every rank returns that. A waiting rank hands the turn on."""
        with self._condition:
            self._check()
            generation = self._generation
            self._posted[rank] = value
            if len(self._posted) == self.size:
                values = [self._posted[r] for r in range(self.size)]
                self._posted = {}
                try:
                    self._result = combine(values)
                except BaseException as error:
                    self._break(f"rank {rank} failed to combine a collective: {error}")
                    raise
                self._generation += 1
                self._condition.notify_all()
                return self._result
            self._check_finished()
            _release_freed_memory()
            self.turn.release()
            try:
                self._condition.wait_for(
                    lambda: self._generation != generation or self._error is not None
                )
                # valid until this rank posts again: the next result needs its value too
                result, error = self._result, self._error
            finally:
                # the rank that holds the turn may be waiting for the condition: leave it first
                self._condition.release()
                self.turn.acquire()
                self._condition.acquire()
        if error is not None:
            raise WorldBroken(error)
        return result

    def finish(self, rank: int, error: BaseException | None) -> None:
        with self._condition:
            self._finished.add(rank)
            if error is not None:
                self._break(f"rank {rank} raised {type(error).__name__}")
            else:
                self._check_finished()

    def _check_finished(self) -> None:
        if self._posted and len(self._posted) + len(self._finished) == self.size:
            finished = ", ".join(map(str, sorted(self._finished)))
            self._break(f"rank {finished} returned while others wait at a collective")

    def _break(self, reason: str) -> None:
        self._error = self._error or reason
        self._condition.notify_all()

    def _check(self) -> None:
        if self._error is not None:
            raise WorldBroken(self._error)


class _FreedMemory:
    """Gives memory that ranks freed back to the operating system as the turn passes on.

    glibc keeps freed memory in the arena of the thread that freed it, for that thread to reuse;
    with one thread per rank, a global loss's 2N × 2N temporaries would stay resident once per
    arena and the process would grow with W (measured: ~36 MB per rank at N = 1024). When the
    resident size has grown by ``threshold`` bytes since the last release, ``malloc_trim`` hands
    the free pages back. Elsewhere than glibc on Linux it does nothing.
    """

    threshold = 256 << 20

    def __init__(self):
        self._trim = self._baseline = None
        try:
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
            self._page = os.sysconf("SC_PAGE_SIZE")
            self._baseline = self._resident()
        except (OSError, AttributeError, ValueError):
            self._trim = None

    def _resident(self) -> int:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * self._page

    def release(self) -> None:
        if self._trim is None:
            return
        resident = self._resident()
        if resident - self._baseline > self.threshold:
            self._trim(0)
            self._baseline = self._resident()


_memory: _FreedMemory | None = None  # made when a first rank waits: nothing happens at import
_local = threading.local()


def _release_freed_memory() -> None:
    global _memory
    if _memory is None:
        _memory = _FreedMemory()
    _memory.release()


def _world() -> _World | None:
    return getattr(_local, "world", None)


def size() -> int | None:
    """The simulated world's size in a virtual rank's thread, None elsewhere.

    Returns:
        W inside a rank of `run`, else None.
    """
    world = _world()
    return world.size if world is not None else None


def rank() -> int | None:
    """This thread's rank in the simulated world, None outside one.

    Returns:
        The rank (0 to W − 1) inside a rank of `run`, else None.

    Example:
        >>> from gatherlab.ranks import simworld
        >>> simworld.run(4, simworld.rank)
        [0, 1, 2, 3]
    """
    return getattr(_local, "rank", None) if _world() is not None else None


def _current() -> tuple[_World, int]:
    world = _world()
    if world is None:
        raise RuntimeError("not in a simulated world (simworld.run)")
    return world, _local.rank


def _exchange(value: Any, combine: Callable[[list[Any]], Any]) -> Any:
    world, this_rank = _current()
    return world.exchange(this_rank, value, combine)


def _own_rows(total: int) -> slice:
    world, this_rank = _current()
    return terms.rows_of(this_rank, world.size, total)


def _concatenate(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(values, dim=0)


def _sum(values: list[torch.Tensor]) -> torch.Tensor:
    """Σ over ranks in rank order."""
    total = values[0].clone()
    for value in values[1:]:
        total += value
    return total


def _all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's tensor concatenated in rank order; a copy of its own for each rank (a real
    rank owns its buffer)."""
    return _exchange(tensor.detach(), _concatenate).clone()


class _Gather(torch.autograd.Function):
    """Forward: the all_gather. Backward: the slice gradient that ``rule`` prescribes."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, rule: str) -> torch.Tensor:
        ctx.rule = rule
        return _all_gather(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        own = _own_rows(grad.shape[0])
        if ctx.rule == "own":
            return grad[own], None
        summed = _exchange(grad.contiguous(), _sum)[own]
        return (summed / size() if ctx.rule == "mean" else summed.clone()), None


def gather(tensor: torch.Tensor, rule: str) -> torch.Tensor:
    """All-gather ``tensor`` from every virtual rank, with the backward ``rule`` (``RULES``).

    Every rank of the world must call it, in the same order as its other collectives.

    Args:
        tensor: this rank's (B, ...) tensor.
        rule: the backward's rule, one of `RULES`.

    Returns:
        The (W·B, ...) tensor of every rank's slice in rank order, this rank's own copy.

    Raises:
        ValueError: ``rule`` is not one of `RULES`.
        RuntimeError: called outside a simulated world.
        WorldBroken: another rank raised or returned instead of joining.
    """
    if rule not in RULES:
        raise ValueError(f"rule={rule!r} is unknown; allowed: {', '.join(RULES)}")
    if rule == "none":
        return _all_gather(tensor)
    return _Gather.apply(tensor, rule)


def _average(values: list[list[torch.Tensor | None]]) -> list[torch.Tensor | None]:
    averaged = []
    for index, grads in enumerate(zip(*values, strict=True)):
        present = [grad is not None for grad in grads]
        if not any(present):
            averaged.append(None)
            continue
        if not all(present):
            missing = present.index(False)
            raise ValueError(
                f"parameter {index} gets no gradient on simulated rank {missing} while others do"
            )
        averaged.append(_sum(list(grads)) / len(grads))
    return averaged


def average(parameters: Sequence[torch.nn.Parameter]) -> None:
    """DDP's all-reduce: every rank's parameter gradients replaced by their mean over ranks (a
    parameter without a gradient on every rank keeps none).

    Every rank of the world must call it with its own copy of the same parameters.

    Args:
        parameters: this rank's parameters, in the same order on every rank; their ``grad`` is
            replaced in place.

    Raises:
        ValueError: a parameter has a gradient on some ranks and none on others (in the rank that
            combines; the others get `WorldBroken`).
        RuntimeError: called outside a simulated world.
        WorldBroken: another rank raised or returned instead of joining.
    """
    grads = [None if p.grad is None else p.grad.detach() for p in parameters]
    for parameter, mean in zip(parameters, _exchange(grads, _average), strict=True):
        parameter.grad = None if mean is None else mean.clone()


def run(world_size: int, function: Callable[..., Any], *args: Any) -> list[Any]:
    """``function(*args)`` on ``world_size`` virtual ranks, threads of this process taking turns
    (docs/design.md §9); their results in rank order.

    Args:
        world_size: the number of virtual ranks, ≥ 1.
        function: called once in every rank; it finds its rank through `rank`.
        *args: passed to ``function`` in every rank (the same objects, not copies).

    Raises:
        ValueError: ``world_size`` is below 1.
        RuntimeError: a rank raised (its error the ``__cause__``); the others are released from
            their collectives. The rank named is the lowest that raised by itself rather than
            with `WorldBroken`.

    Example:
        >>> import torch
        >>> from gatherlab import gather
        >>> from gatherlab.ranks import simworld
        >>> def gathered():
        ...     return gather.get("fixed")(torch.full((1, 2), float(simworld.rank())))
        >>> simworld.run(2, gathered)[0].tolist()
        [[0.0, 0.0], [1.0, 1.0]]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    world = _World(world_size)
    results: list[Any] = [None] * world_size
    errors: dict[int, BaseException] = {}

    def rank_main(this_rank: int) -> None:
        _local.world, _local.rank = world, this_rank
        error = None
        with world.turn:
            try:
                results[this_rank] = function(*args)
            except BaseException as raised:
                error = errors[this_rank] = raised
            finally:
                _local.world = _local.rank = None
                world.finish(this_rank, error)

    threads = [
        threading.Thread(target=rank_main, args=(r,), name=f"simulated-rank-{r}", daemon=True)
        for r in range(world_size)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:  # the first rank that raised by itself, not because the world broke
        failed, error = min(
            errors.items(), key=lambda item: (isinstance(item[1], WorldBroken), item[0])
        )
        raise RuntimeError(
            f"simulated rank {failed} of {world_size}: {type(error).__name__}: {error}"
        ) from error
    return results
