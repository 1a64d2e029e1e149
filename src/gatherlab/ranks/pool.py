"""Warm worker pools: W processes joined once in a gloo process group, kept alive to run many
jobs. ``pool(W).run(function, *args)`` calls ``function(*args)`` on every rank and returns the
ranks' results in rank order; a rank that raises or dies ends the call at once with ``RankError``.

The training launcher (``launch``), the gradient measurements (``gradients``), the benchmarks and
the test suite all run their distributed work here, so a job costs its computation, not the
seconds of starting W Python processes that import torch and Lightning.

A terminal's Ctrl-C sends SIGINT to every process of its foreground group, the workers and their
fork server too. They ignore it: the process that started the pools answers it (a
``KeyboardInterrupt`` there ends the pool it waits on at once), so a rank never prints a traceback
of its own.

A process that is killed (``kill -9``) closes nothing: each rank watches it (``_end_with_parent``)
and, once it is gone, ends at once with status ``ORPHANED_STATUS`` and prints nothing, whatever
it was doing (waiting for work, computing, waiting in a collective for a peer): nobody is left to
report to. The fork server ends when its last rank has (``forkstart``).
"""

from __future__ import annotations

import atexit
import contextlib
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
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from gatherlab.ranks import forkstart

log = logging.getLogger(__name__)

# A collective that waits longer than this raises instead of hanging (a rank died or diverged).
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
# How long a new pool may take to start its processes and join them in a group.
POOL_START_TIMEOUT_S = 300.0
# The exit status of a rank that ended because the process that started its pool is gone.
ORPHANED_STATUS = 1


class RankError(RuntimeError):
    """A rank of a distributed job raised or died; the message names the rank and its error, and
    ``error`` is the rank's exception itself when it could be sent (None when the rank died, or
    its exception does not pickle)."""

    def __init__(self, message: str, error: BaseException | None = None) -> None:
        super().__init__(message)
        self.error = error


def _pool_worker(rank: int, world_size: int, store: str, connection: Connection) -> None:
    """A pool rank: join the group once, then run each job it receives until told to stop; a job's
    error goes back to the pool. Once the pool's process is gone, end at once and quietly."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the starting process answers Ctrl-C
    _end_with_parent()
    # Join only when the pool says so: a worker forked after its pool's start was interrupted
    # finds its pipe closed (or the stop) and ends here, instead of waiting for ranks that never
    # come.
    try:
        if connection.recv_bytes() != b"join":
            return
    except EOFError:
        return
    # One core per rank (round robin): a rank that stays on its core wakes faster from a
    # collective; on gloo this halves the latency of each collective (measured: ~1.0 → ~0.6 ms).
    if hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
        torch.set_num_threads(1)  # more threads than its one core would only contend for it
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    _answer(connection, ("ready", None))
    while True:
        try:
            payload = connection.recv_bytes()
        except EOFError:  # the pool's process is gone (its end is closed only after the stop)
            _orphaned()
        if not payload:
            break
        try:
            # The caller's import path first: a job may name code from a directory that was put
            # on the path after this worker started (a user's loss, gather, model or data set).
            search_path, job = pickle.loads(payload)
            sys.path.extend(entry for entry in search_path if entry not in sys.path)
            function, args = pickle.loads(job)
            _answer(connection, ("ok", function(*args)))
        except BaseException as error:  # the job's own error, or a result that does not pickle
            detail = "".join(traceback.format_exception(error)[-6:])
            message = f"rank {rank}: {type(error).__name__}: {error}\n{detail}"
            try:
                _answer(connection, ("error", (message, error)))
            except Exception:  # an exception that does not pickle: its message only
                _answer(connection, ("error", (message, None)))
    dist.destroy_process_group()


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
        self._store_dir = tempfile.mkdtemp(prefix="gatherlab-pool-")
        context = torch.multiprocessing.get_context("forkserver")
        # The fork server imports torch (and Lightning where this process has) once; every worker
        # of every pool (the next one after a failure too) is forked from it with them loaded, in
        # milliseconds instead of the seconds a fresh interpreter spends importing them.
        forkstart.start()
        self._processes, self._connections = [], []
        try:  # interrupted (Ctrl-C) or failed: what was started ends with it
            for rank in range(world_size):
                ours, theirs = context.Pipe()
                self._connections.append(ours)
                process = context.Process(
                    target=_pool_worker,
                    args=(rank, world_size, f"{self._store_dir}/store", theirs),
                    name=f"gatherlab-pool-{world_size}-rank{rank}",
                    daemon=True,
                )
                process.start()
                theirs.close()
                self._processes.append(process)
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
        if not self.alive:
            raise RankError(f"the {self.world_size}-rank pool is closed")
        payload = pickle.dumps((sys.path, pickle.dumps((function, args))))
        for connection in self._connections:
            connection.send_bytes(payload)
        return self._collect(timeout_s)

    def _collect(self, timeout_s: float | None) -> list[Any]:
        """Each rank's answer, in rank order; on the first failure, or when this process is
        interrupted (Ctrl-C) while it waits, close the pool and raise."""
        try:
            return self._answers(timeout_s)
        except KeyboardInterrupt:
            self._abandon()
            raise

    def _answers(self, timeout_s: float | None) -> list[Any]:
        results: dict[int, Any] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        by_connection = {connection: rank for rank, connection in enumerate(self._connections)}
        by_sentinel = {process.sentinel: rank for rank, process in enumerate(self._processes)}
        while len(results) < self.world_size:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            pending = [c for c, rank in by_connection.items() if rank not in results]
            ready = wait(pending + list(by_sentinel), timeout=remaining)
            if not ready:
                self._abandon()
                raise RankError(
                    f"no answer from every rank of the {self.world_size}-rank pool in {timeout_s} s"
                )
            for item in ready:
                if item in by_connection:
                    rank = by_connection[item]
                    try:
                        status, value = item.recv()
                    except (EOFError, ConnectionResetError):  # the process died
                        status, value = "error", (self._death(rank), None)
                    if status == "error":
                        self._abandon()
                        raise RankError(*value)
                    results[rank] = value
                else:
                    rank = by_sentinel.pop(item)
                    if rank not in results:
                        message = self._death(rank)
                        self._abandon()
                        raise RankError(message)
        return [results[rank] for rank in range(self.world_size)]

    def _death(self, rank: int) -> str:
        # A dead process closes its pipes a moment before it can be reaped: wait for its exit code.
        self._processes[rank].join(timeout=5.0)
        return f"rank {rank}: process exited with code {self._processes[rank].exitcode}"

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
        for connection in self._connections:
            connection.close()
        self._processes, self._connections = [], []
        shutil.rmtree(self._store_dir, ignore_errors=True)


_pools: dict[int, WorkerPool] = {}


def pool(world_size: int) -> WorkerPool:
    """The live pool of ``world_size`` ranks, started on first use and after a failure."""
    existing = _pools.get(world_size)
    if existing is None or not existing.alive:
        if existing is not None:
            existing.close()
        if not _pools:
            atexit.register(close_pools)  # registering twice is harmless: closing is idempotent
        log.info("starting a pool of %d ranks", world_size)
        _pools[world_size] = WorkerPool(world_size)
    return _pools[world_size]


def close_pools() -> None:
    """Stop every pool; called when a sweep ends and at interpreter exit."""
    while _pools:
        _pools.popitem()[1].close()
