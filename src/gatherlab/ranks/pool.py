"""Warm worker pools: W processes joined once in a gloo process group, kept alive to run many
jobs, so a job costs its computation, not starting W processes that import torch and Lightning.
``pool(W).run(function, *args)`` calls ``function(*args)`` on every rank and returns the ranks'
results in rank order; a rank that raises or dies ends the call at once with ``RankError`` (its
``rank`` and its error in one line, ``cli.error_line``, computed in the rank). A rank that died is
named rather than the peers whose collectives with it broke (their errors echo its death and can
reach the pool first).

A job runs in the caller's current directory and import path (the caller's path first), whatever
they were when the pool started. The ranks ignore Ctrl-C, which the pools' process answers, and
end silently with ``ORPHANED_STATUS`` once that process is gone (``_end_with_parent``;
docs/contract.md §5, "Command lines"). A rank prints no warnings: each job sends back those its
code raised, and the pools' process gives each distinct one once per ``run`` with the number of
ranks that raised it (``... (on 2 of 4 ranks)``), or adds them to ``ranks_warnings()``.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import contextvars
import dataclasses
import itertools
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from gatherlab.core import cli, imports, terms
from gatherlab.ranks import forkstart, watched

__all__ = [
    "COLLECTIVE_TIMEOUT",
    "ORPHANED_STATUS",
    "POOL_START_TIMEOUT_S",
    "RankError",
    "RankWarning",
    "RanksWarnings",
    "WorkerPool",
    "close_pools",
    "deliver_warnings",
    "pool",
    "ranks_warnings",
    "sendable_warnings",
]

log = logging.getLogger(__name__)

# A collective that waits longer than this raises instead of hanging (a rank died or diverged).
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
# How long a new pool may take to start its processes and join them in a group.
POOL_START_TIMEOUT_S = 300.0
# The exit status of a rank that ended because the process that started its pool is gone.
ORPHANED_STATUS = 1
# How often the pool's process relays what its ranks wrote to their standard error while it waits.
_RELAY_S = 0.2
# After a failed watched job: how long the other ranks have to answer before the pool is closed.
_SETTLE_S = 1.0
# After a rank's error: how long a peer's death, which that error may be the echo of, has to show.
_DEATH_SHOWS_S = 0.1
# How many of a dead rank's last lines on its standard error its error shows.
_LAST_WORDS = 5


T = TypeVar("T")


class RankError(RuntimeError):
    """A rank of a distributed job raised or died; the message's first line is ``rank {rank}:
    {line}`` (a raised error's traceback follows it). ``rank`` is the rank (None when the error is
    the pool's, not one rank's: closed, no answer in time); ``line`` the rank's error in one line
    (``cli.error_line``, computed in the rank: ``AssertionError at mypkg/losses.py:12``; ``process
    exited with code 3`` for a rank that died); ``error`` the rank's exception itself when it could
    be sent (None when the rank died, or its exception does not pickle)."""

    def __init__(
        self,
        message: str,
        error: BaseException | None = None,
        rank: int | None = None,
        line: str | None = None,
    ) -> None:
        super().__init__(message)
        self.error = error
        self.rank = rank
        if line is None:
            line = message.strip().split("\n", 1)[0]
            line = line.removeprefix(f"rank {rank}: ") if rank is not None else line
        self.line = line

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.error, self.rank, self.line)


def _pool_worker(rank: int, world_size: int, store: str, connection: Connection) -> None:
    """A pool rank: join the group once, then run each job it receives until told to stop; a job's
    error goes back to the pool. Once the pool's process is gone, end at once and quietly."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the starting process answers Ctrl-C
    _end_with_parent()
    peers_store = _joined(rank, world_size, store, connection)
    if peers_store is None:
        return
    _answer(connection, ("ready", None, []))
    for number in itertools.count():
        try:
            payload = connection.recv_bytes()
        except EOFError:  # the pool's process is gone (its end is closed only after the stop)
            _orphaned()
        if not payload:
            break
        _run_job(payload, peers_store, f"job{number}", rank, connection)
    dist.destroy_process_group()


def _joined(
    rank: int, world_size: int, store: str, connection: Connection
) -> dist.FileStore | None:
    """The rank's standard error sent to its file, and the rank in the pool's gloo group once the
    pool says so; its store (the group's, and the watch's: `collectives`), or None when the pool's
    start was abandoned."""
    # What the rank writes to its standard error (its own prints, torch's C++ messages, the last
    # words of a process that aborts) goes to a file that the pool's process relays (`_relay`).
    try:
        errors = os.open(_stderr_file(store, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except FileNotFoundError:  # the pool's directory is gone: its start was abandoned
        return None
    os.dup2(errors, 2)
    os.close(errors)
    # Join only when the pool says so: a worker forked after its pool's start was interrupted
    # finds its pipe closed (or the stop) and ends here, instead of waiting for ranks that never
    # come.
    try:
        if connection.recv_bytes() != b"join":
            return None
    except EOFError:
        return None
    # One core per rank (round robin): a rank that stays on its core wakes faster from a
    # collective; on gloo this halves the latency of each collective (measured: ~1.0 → ~0.6 ms).
    if hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
        torch.set_num_threads(1)  # more threads than its one core would only contend for it
    peers_store = dist.FileStore(store, world_size)
    dist.init_process_group(
        terms.Backend.GLOO,
        store=peers_store,
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    return peers_store


def _run_job(
    payload: bytes, store: dist.Store, job: str, rank: int, connection: Connection
) -> None:
    """Run one job on this rank and answer the pool: its result, or its error as the rank's line
    (a peer's error named by that peer), with the job's warnings."""
    caught: list[warnings.WarningMessage] = []
    try:
        # The job's warnings go back with its answer, as this rank's filters let them through.
        with warnings.catch_warnings(record=True) as caught:
            # The caller's import path first, in its order (`imports.search_path`: its
            # entries absolute, and the directory of a module it imported that no entry
            # finds), this rank's other entries after it: a job may name code from a
            # directory that was put on the path after this worker started, or relative to a
            # current directory that is not this worker's (a user's loss, gather, model or
            # data set), and a module is found where the caller finds it, not in a directory
            # an earlier job left on this rank's path.
            search_path, pickled, watch_s, here = pickle.loads(payload)
            sys.path[:] = [*search_path, *(e for e in sys.path if e not in search_path)]
            # The caller's current directory: a relative path in the job (a file the user's
            # code opens, a place shown relative to it: `cli.place`) reads as in the caller.
            with contextlib.suppress(OSError):  # a directory since removed: stay
                os.chdir(here)
            function, args = pickle.loads(pickled)
            # The watch's keys are this job's number (``job``), never its bytes: a job sent
            # twice (the same check run again on a warm pool) must not read the first's keys.
            result = _watched_call(function, args, watched.Peers(store, job, rank, watch_s))
        _answer(connection, ("ok", result, sendable_warnings(caught)))
    except BaseException as error:  # the job's own error, or a result that does not pickle
        # an error from inside a collective leaves the group's transport unusable: "broken"
        broken = not isinstance(error, watched.CollectiveError) and _in_torch_distributed(error)
        status = "broken" if broken else "error"
        detail = "".join(traceback.format_exception(error)[-6:])
        if isinstance(error, watched.CollectiveError):  # a peer's error, or several ranks'
            named, line = error.rank, error.line
            message = f"rank {named}: {line}" if error.own else f"{line}\n{detail}"
        else:
            named, line = rank, cli.error_line(error)
            message = f"rank {named}: {line}\n{detail}"
        try:
            _answer(connection, (status, (message, error, named, line), sendable_warnings(caught)))
        except Exception:  # an exception that does not pickle: its message only
            _answer(connection, (status, (message, None, named, line), sendable_warnings(caught)))


_TORCH_DISTRIBUTED = os.path.join(os.path.dirname(os.path.realpath(dist.__file__)), "")


def _in_torch_distributed(error: BaseException) -> bool:
    """Whether ``error`` was raised inside torch.distributed: a collective that timed out, or
    whose peer left or went elsewhere, can leave its half of an operation in the group's
    transport, which the next job's collectives would read (a user's correct loss failed with
    "Connection closed by peer" after a loss whose rank 0 alone all-reduced). The watch's own
    errors are raised before the collective runs (`watched.CollectiveError`)."""
    frames = traceback.extract_tb(error.__traceback__)
    return any(os.path.realpath(frame.filename).startswith(_TORCH_DISTRIBUTED) for frame in frames)


def _watched_call(function: Callable[..., Any], args: tuple[Any, ...], peers: watched.Peers) -> Any:
    """``function(*args)``; in a watched job (``peers.timeout_s`` set), its collectives compared
    with the peers' before they run, and the group's own timeout that long (``collectives``)."""
    if peers.timeout_s is None:
        return function(*args)
    group = dist.group.WORLD
    group.set_timeout(timedelta(seconds=peers.timeout_s))
    try:
        with watched.watched(peers):
            return function(*args)
    finally:
        group.set_timeout(COLLECTIVE_TIMEOUT)


def _stderr_file(store: str, rank: int) -> str:
    """Where a rank of the pool whose group's store is ``store`` writes its standard error."""
    return f"{store}.stderr.{rank}"


# A warning as it travels from a rank: its category's module, qualified name and nearest built-in
# base (the pool's process finds the category among its imported modules, else uses that base),
# its message, file and line.
_SentWarning = tuple[str, str, str, str, str, int]


def sendable_warnings(caught: list[warnings.WarningMessage]) -> list[_SentWarning]:
    """A job's distinct warnings (by category, message, file and line), first seen first."""
    distinct: dict[_SentWarning, None] = {}
    for record in caught:
        category = record.category
        base = next(c.__name__ for c in category.__mro__ if c.__module__ == "builtins")
        sent = (category.__module__, category.__qualname__, base)
        distinct[(*sent, str(record.message), record.filename, record.lineno)] = None
    return list(distinct)


def _answer(connection: Connection, answer: tuple[str, Any]) -> None:
    """Send ``answer`` to the pool; if the pool's process is gone (a broken pipe), end quietly.
    What does not pickle raises, before anything is sent."""
    try:
        connection.send(answer)
    except OSError:
        _orphaned()


def _end_with_parent() -> None:
    """End this rank once the process that started it is gone, whatever the rank is doing: a
    thread waits for that process (``multiprocessing.parent_process``: a pipe that it holds
    open, closed by its death). A pool stops its ranks before it lets go of them: only a process
    that ended without closing its pools (killed, crashed) sets the thread off."""
    parent = multiprocessing.parent_process()

    def watch() -> None:
        parent.join()
        _orphaned()

    threading.Thread(target=watch, name="gatherlab-parent-watch", daemon=True).start()


def _orphaned() -> NoReturn:
    """End this rank now, without a traceback and without its exit handlers: its pool's process is
    gone, its peers are ending too (a collective with them would fail or wait), and there is
    nobody to report to."""
    os._exit(ORPHANED_STATUS)


@dataclasses.dataclass(frozen=True)
class RankWarning:
    """A distinct warning the ranks raised (by category, message, file and line): ``count`` rank
    jobs raised it, of the ``total`` rank jobs that ran while it was collected."""

    category: type[Warning]
    message: str
    filename: str
    lineno: int
    count: int
    total: int

    def line(self) -> str:
        """``Category: first line of the message (file:line), in count of total rank jobs``."""
        lines = self.message.strip().splitlines()
        text = f"{self.category.__name__}: {lines[0]}" if lines else self.category.__name__
        where = cli.place(self.filename, self.lineno)
        return f"{text} ({where}), in {self.count} of {self.total} rank jobs"


class RanksWarnings:
    """The warnings of the ranks' jobs while ``ranks_warnings()`` is active, each distinct warning
    once. A *rank job* is one rank's part of one ``run``: a run on a 2-rank pool and one on a
    4-rank pool are 6 rank jobs; a run that failed counts the ranks that answered. A warning's
    count is the number of rank jobs that raised it (once per job, however often the job raised
    it, as the rank's filters let it through: a warning shown "default" once per location is raised
    again by each job, one an import raises only by the first job of each rank)."""

    def __init__(self) -> None:
        self._counts: dict[tuple[type[Warning], str, str, int], int] = {}
        self.total = 0

    def add(self, per_rank: list[list[_SentWarning]]) -> None:
        """One run's warnings, a list per rank that answered."""
        self.total += len(per_rank)
        for key, count in _counted(per_rank).items():
            self._counts[key] = self._counts.get(key, 0) + count

    def records(self) -> list[RankWarning]:
        """Each distinct warning with its count and the total, first raised first."""
        return [RankWarning(*key, count, self.total) for key, count in self._counts.items()]

    def lines(self) -> list[str]:
        """Each distinct warning as one line: ``FutureWarning: <first line of the message>
        (<file>:<line>), in 6 of 6 rank jobs`` (the file relative to the current directory when
        it is below it)."""
        return [record.line() for record in self.records()]


_collector: contextvars.ContextVar[RanksWarnings | None] = contextvars.ContextVar(
    "gatherlab_ranks_warnings", default=None
)


@contextlib.contextmanager
def ranks_warnings() -> Iterator[RanksWarnings]:
    """Collect the warnings of every ``run`` (of any pool) in its block instead of showing them:
    ``with ranks_warnings() as collected: ...; collected.lines()``. Nested, the innermost
    collects."""
    collector = RanksWarnings()
    token = _collector.set(collector)
    try:
        yield collector
    finally:
        _collector.reset(token)


def _counted(per_rank: list[list[_SentWarning]]) -> dict[tuple[type[Warning], str, str, int], int]:
    """Each distinct warning of one run and the number of ranks that raised it."""
    counts: dict[tuple[type[Warning], str, str, int], int] = {}
    for sent in per_rank:
        for key in dict.fromkeys((_category(*w[:3]), *w[3:]) for w in sent):
            counts[key] = counts.get(key, 0) + 1
    return counts


def _category(module: str, qualname: str, base: str) -> type[Warning]:
    """A rank's warning category, as this process knows it: the class itself where its module is
    imported here (nothing is imported for it), else its nearest built-in base."""
    found: Any = sys.modules.get(module)
    for name in qualname.split("."):
        found = getattr(found, name, None)
    if isinstance(found, type) and issubclass(found, Warning):
        return found
    found = getattr(builtins, base, None)
    return found if isinstance(found, type) and issubclass(found, Warning) else UserWarning


# The registry of the ranks' warnings given again in this process: its filters' "default" action
# shows each (message, category, line) once per process, as each rank showed its own before.
_registry: dict[Any, Any] = {}


def deliver_warnings(per_rank: list[list[_SentWarning]]) -> None:
    """One run's warnings: to the active collector (``ranks_warnings``), else each distinct one
    once in this process (``warnings.warn_explicit``, under this process's filters), ``(on k of W
    ranks)`` appended to its message."""
    collector = _collector.get()
    if collector is not None:
        collector.add(per_rank)
        return
    for (category, message, filename, lineno), count in _counted(per_rank).items():
        text = f"{message} (on {count} of {len(per_rank)} ranks)"
        warnings.warn_explicit(text, category, filename, lineno, registry=_registry)


class WorkerPool:
    """W processes joined in one gloo group, kept alive to run many jobs (and the test suite's
    distributed checks: ``pool(W).run(function, *args)``).

    ``run(function, *args)`` calls ``function(*args)`` on every rank and returns the ranks' results
    in rank order. If a rank raises or dies, the pool is closed at once (ranks blocked in a
    collective are not waited for) and ``RankError`` carries that rank's message.
    """

    def __init__(self, world_size: int):
        if world_size < 2:
            raise ValueError(f"a pool needs at least 2 ranks, got {world_size}")
        self.world_size = world_size
        self._relayed = [0] * world_size  # bytes of each rank's stderr relayed (`_relay`)
        self._stderr_tail: list[list[str]] = [[] for _ in range(world_size)]
        context = torch.multiprocessing.get_context("forkserver")
        # The fork server imports torch (and Lightning where this process has) once; every worker
        # of every pool (the next one after a failure too) is forked from it with them loaded, in
        # milliseconds instead of the seconds a fresh interpreter spends importing them.
        forkstart.start()
        self._processes, self._connections = [], []
        self._store_dir = tempfile.mkdtemp(prefix="gatherlab-pool-")
        self._store = f"{self._store_dir}/store"
        try:  # interrupted (Ctrl-C) or failed: what was started ends with it
            for rank in range(world_size):
                ours, theirs = context.Pipe()
                self._connections.append(ours)
                process = context.Process(
                    target=_pool_worker,
                    args=(rank, world_size, self._store, theirs),
                    name=f"gatherlab-pool-{world_size}-rank{rank}",
                    daemon=True,
                )
                # A Ctrl-C while the server forks the rank (it waits seconds for the server's
                # imports) is answered once the rank is among those an interruption ends.
                with _interrupt_deferred():
                    process.start()
                    self._processes.append(process)
                theirs.close()
            for connection in self._connections:
                connection.send_bytes(b"join")
            self._collect(timeout_s=POOL_START_TIMEOUT_S)
        except BaseException:
            self._abandon()
            raise

    @property
    def alive(self) -> bool:
        return bool(self._processes) and all(process.is_alive() for process in self._processes)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._processes]

    def run(
        self, function: Callable[..., Any], *args: Any, timeout_s: float | None = None
    ) -> list[Any]:
        return self._results(self._send(function, args), timeout_s)

    def run_beside(
        self, beside: Callable[[], T], function: Callable[..., Any], *args: Any
    ) -> tuple[list[Any], T]:
        """`run`'s results, and ``beside()`` computed in this process while the ranks run the
        job (a one-device run of the check beside its W ranks, on the cores they leave). If
        ``beside`` raises, Ctrl-C included, the pool is closed (its ranks are mid-job, their
        answers unread) and the error raised."""
        watch_s = self._send(function, args)
        try:
            computed = beside()
        except BaseException:
            self._abandon()
            raise
        return self._results(watch_s, None), computed

    def _send(self, function: Callable[..., Any], args: tuple[Any, ...]) -> float | None:
        """The job sent to every rank; its collectives' watch (``None``: unwatched)."""
        if not self.alive:
            raise RankError(f"the {self.world_size}-rank pool is closed")
        job, modules = imports.pickled((function, args))
        watch_s = watched.watch_timeout()
        payload = pickle.dumps((imports.search_path(modules), job, watch_s, os.getcwd()))
        for connection in self._connections:
            connection.send_bytes(payload)
        return watch_s

    def _results(self, watch_s: float | None, timeout_s: float | None) -> list[Any]:
        """Every rank's answer to the job `_send` sent, in rank order, its warnings delivered."""
        warned: dict[int, list[_SentWarning]] = {}
        try:
            results = self._collect(timeout_s, warned, watched=watch_s is not None)
        except RankError:
            # The warnings of the ranks that answered, also of the one that failed; a warning
            # that this process's filters turn into an error does not hide the rank's.
            with contextlib.suppress(Warning):
                deliver_warnings(list(warned.values()))
            raise
        deliver_warnings([warned[rank] for rank in range(self.world_size)])
        return results

    def _collect(
        self, timeout_s: float | None, warned: dict[int, list[_SentWarning]] | None = None,
        watched: bool = False,
    ) -> list[Any]:  # fmt: skip
        """Each rank's answer, in rank order (each rank's warnings into ``warned``); on the first
        failure, or when this process is interrupted (Ctrl-C) while it waits, close the pool and
        raise. A failed ``watched`` job (``collectives``) whose every rank answers within
        ``_SETTLE_S``, none from inside a collective (`_in_torch_distributed`), leaves the pool
        open: no rank is left in a collective, and none left half of one behind."""
        try:
            return self._answers(timeout_s, {} if warned is None else warned, watched)
        except KeyboardInterrupt:
            self._abandon()
            raise

    def _answers(
        self, timeout_s: float | None, warned: dict[int, list[_SentWarning]], watched: bool
    ) -> list[Any]:
        results: dict[int, Any] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        by_connection = {connection: rank for rank, connection in enumerate(self._connections)}
        by_sentinel = {process.sentinel: rank for rank, process in enumerate(self._processes)}
        while len(results) < self.world_size:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            pending = [c for c, rank in by_connection.items() if rank not in results]
            ready = wait(pending + list(by_sentinel), timeout=min(remaining or _RELAY_S, _RELAY_S))
            self._relay()
            if not ready and (deadline is None or time.monotonic() < deadline):
                continue
            if not ready:
                self._abandon()
                raise RankError(
                    f"no answer from every rank of the {self.world_size}-rank pool in {timeout_s} s"
                )
            for item in ready:
                if item in by_connection:
                    rank = by_connection[item]
                    try:
                        status, value, warned[rank] = item.recv()
                    except (EOFError, ConnectionResetError):  # the process died
                        error = self._death(rank)
                        self._abandon()
                        raise error from None
                    if status in ("error", "broken"):
                        # A peer that died is the cause of the transport errors of the ranks in
                        # a collective with it (gloo's "Connection reset by peer"), which can
                        # arrive before its death does: the death is named.
                        dead = self._dead_peer(rank, by_sentinel)
                        if dead is not None:
                            error = self._death(dead)
                            self._abandon()
                            raise error
                        errors = [value]
                        answered = {*results, rank}
                        if not (watched and status == "error" and self._settled(
                                by_connection, answered, warned, errors)):  # fmt: skip
                            self._abandon()
                        # ranks that all raised: the lowest one named, whichever answered first
                        raise RankError(*min(errors, key=lambda error: error[2]))
                    results[rank] = value
                else:
                    rank = by_sentinel.pop(item)
                    if rank not in results:
                        error = self._death(rank)
                        self._abandon()
                        raise error
        return [results[rank] for rank in range(self.world_size)]

    def _dead_peer(self, rank: int, by_sentinel: dict[int, int]) -> int | None:
        """The lowest rank other than ``rank`` whose process has ended, or ends within
        ``_DEATH_SHOWS_S``; None when every other rank lives."""
        others = {sentinel: r for sentinel, r in by_sentinel.items() if r != rank}
        ended = wait(list(others), timeout=_DEATH_SHOWS_S) if others else []
        return min((others[sentinel] for sentinel in ended), default=None)

    def _settled(
        self, by_connection: dict[Connection, int], answered: set[int],
        warned: dict[int, list[_SentWarning]], errors: list[Any],
    ) -> bool:  # fmt: skip
        """Whether every rank that has not ``answered`` answers (anything) within ``_SETTLE_S``
        (their errors added to ``errors``): after a failed watched job, the ranks whose peer
        failed end at their next collective."""
        pending = {c: rank for c, rank in by_connection.items() if rank not in answered}
        deadline = time.monotonic() + _SETTLE_S
        while pending and time.monotonic() < deadline:
            for connection in wait(list(pending), timeout=deadline - time.monotonic()):
                rank = pending.pop(connection)
                try:
                    status, value, warned[rank] = connection.recv()
                except (EOFError, ConnectionResetError):  # it died
                    return False
                if status in ("error", "broken"):
                    errors.append(value)
                if status == "broken":  # its transport unusable: the pool is closed
                    return False
        return not pending

    def _death(self, rank: int) -> RankError:
        """A rank that died: its exit code, or the signal that killed it, and the last lines it
        wrote to its standard error (a C++ abort's reason is there)."""
        # A dead process closes its pipes a moment before it can be reaped: wait for its exit code.
        self._processes[rank].join(timeout=5.0)
        code = self._processes[rank].exitcode
        last = self._relay().get(rank, [])[-_LAST_WORDS:]
        if code is not None and code < 0:
            line = f"process killed by {signal.Signals(-code).name}"
        else:
            line = f"process exited with code {code}"
        if last:
            line += f"; its last line on stderr: {last[-1].strip()[:300]}"
        detail = "".join(f"  {text}\n" for text in last)
        return RankError(f"rank {rank}: {line}\n{detail}", None, rank, line)

    def _relay(self) -> dict[int, list[str]]:
        """Write what the ranks wrote to their standard error since the last relay to this
        process's (``sys.stderr``); return each rank's lines of it."""
        lines = {}
        for rank in range(len(self._processes)):
            path = _stderr_file(self._store, rank)
            try:
                with open(path, "rb") as file:
                    file.seek(self._relayed[rank])
                    new = file.read()
            except OSError:
                continue
            self._relayed[rank] += len(new)
            if new:
                text = new.decode(errors="replace")
                sys.stderr.write(text)
                sys.stderr.flush()
                self._stderr_tail[rank] = (self._stderr_tail[rank] + text.splitlines())[-50:]
            lines[rank] = [line for line in self._stderr_tail[rank] if line.strip()]
        return lines

    def _abandon(self) -> None:
        """After a failure: the other ranks may wait in a collective for the failed one, and would
        not read a polite stop; end them at once."""
        self.close(grace_s=0.0)

    def close(self, grace_s: float = 5.0) -> None:
        """Stop every worker (politely for up to ``grace_s``, then by force) and remove the
        group's store."""
        for connection in self._connections:
            with contextlib.suppress(OSError):  # a dead worker's pipe is closed
                connection.send_bytes(b"")
        deadline = time.monotonic() + grace_s
        for process in self._processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self._processes:
            if process.is_alive():
                process.kill()
                process.join()
        self._relay()
        for connection in self._connections:
            connection.close()
        self._processes, self._connections = [], []
        shutil.rmtree(self._store_dir, ignore_errors=True)


@contextlib.contextmanager
def _interrupt_deferred() -> Iterator[None]:
    """A SIGINT that arrives in the block is answered (by the handler it would have met) once the
    block is over. Only the main thread receives Python's signals: elsewhere nothing is deferred."""
    main_thread = threading.current_thread() is threading.main_thread()
    if not main_thread or signal.getsignal(signal.SIGINT) is None:  # None: a handler set from C
        yield
        return
    arrived: list[int] = []
    handler = signal.signal(signal.SIGINT, lambda signum, frame: arrived.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        if arrived:
            signal.raise_signal(signal.SIGINT)


_pools: dict[int, WorkerPool] = {}


def pool(world_size: int) -> WorkerPool:
    """The live pool of ``world_size`` ranks, started on first use and after a failure."""
    existing = _pools.get(world_size)
    if existing is None or not existing.alive:
        if existing is not None:
            existing.close()
        if not _pools:
            # The fork server's exit hook first (`forkstart.start` registers it once), so that it
            # runs after this one: the server and the resource tracker end once the pools have.
            forkstart.start()
            atexit.register(close_pools)  # registering twice is harmless: closing is idempotent
        log.info("starting a pool of %d ranks", world_size)
        _pools[world_size] = WorkerPool(world_size)
    return _pools[world_size]


def close_pools() -> None:
    """Stop every pool; called when a sweep ends and at interpreter exit."""
    while _pools:
        _pools.popitem()[1].close()
