"""How ranks are started. Three launchers run the same Lightning training code:

- ``pool`` (default on CPU): one group of worker processes per world size, started once and kept
  alive with its gloo process group; every job runs ``Trainer.fit`` inside that group through
  Lightning's DDP strategy on an externally created process group. A job costs its training time,
  not the seconds of starting W Python processes that import torch and Lightning.
- ``spawn``: a fresh Lightning ``ddp_spawn`` run per job (the reference behaviour). Unlike plain
  ``ddp`` it does not re-execute the command line, so it runs inside a Hydra multirun.
- ``external``: the ranks were started by torchrun or SLURM; Lightning's DDP strategy finds them
  through its cluster environments.

One device needs no launcher: it trains in the calling process.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import shutil
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.strategies import DDPStrategy

log = logging.getLogger(__name__)

# Lightning announces hardware, tips and the stop reason at INFO on every run; keep its warnings.
for _name in ("lightning.pytorch", "lightning.fabric"):
    logging.getLogger(_name).setLevel(logging.WARNING)
# Lightning 2.6 calls a torch pytree API that torch 2.13 deprecates; harmless, and not ours to fix.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")

LAUNCHERS = ("pool", "spawn", "external")
# A collective that waits longer than this raises instead of hanging (a rank died or diverged).
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
# How long a new pool may take to start its processes and join them in a group.
POOL_START_TIMEOUT_S = 300.0


class RankError(RuntimeError):
    """A rank of a distributed job raised or died; the message names the rank and its error."""


def _trainer(
    devices: int,
    strategy: Any,
    precision: str,
    steps: int,
    callbacks: list[L.Callback],
    accelerator: str,
    num_nodes: int = 1,
) -> L.Trainer:
    """A quiet Trainer that runs ``steps`` optimizer steps."""
    return L.Trainer(
        accelerator=accelerator,
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        precision=precision,
        max_steps=steps,
        max_epochs=-1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        deterministic=True,
    )


def _backend(accelerator: str) -> str:
    return "gloo" if accelerator == "cpu" else "nccl"


class _ReleaseProcessGroup(L.Callback):
    """Destroys a spawned rank's process group once training is over, on every rank together.

    Without it a rank can exit while its gloo group is alive, and the group's destructor at
    interpreter exit intermittently aborts the process ("terminate called without an active
    exception"), which fails a run that trained correctly.
    """

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


class _ExistingGroup(ClusterEnvironment):
    """Lightning's view of a process group that is already initialised (the pool's)."""

    def __init__(self) -> None:
        super().__init__()
        self._rank, self._world_size = dist.get_rank(), dist.get_world_size()

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return "127.0.0.1"

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return dist.is_available() and dist.is_initialized()

    def world_size(self) -> int:
        return self._world_size

    def set_world_size(self, size: int) -> None:
        pass

    def global_rank(self) -> int:
        return self._rank

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return self._rank

    def node_rank(self) -> int:
        return 0


def fit_in_group(
    module: L.LightningModule,
    datamodule: L.LightningDataModule,
    precision: str,
    steps: int,
    callbacks: list[L.Callback],
) -> None:
    """``Trainer.fit`` on this rank of the already initialised default process group."""
    strategy = DDPStrategy(
        cluster_environment=_ExistingGroup(),
        process_group_backend=dist.get_backend(),
        timeout=COLLECTIVE_TIMEOUT,
    )
    trainer = _trainer(dist.get_world_size(), strategy, precision, steps, callbacks, "cpu")
    trainer.fit(module, datamodule=datamodule)


def _pool_worker(rank: int, world_size: int, store: str, connection: Connection) -> None:
    """A pool rank: join the group once, then run each job it receives until told to stop."""
    parent = os.getppid()
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
    connection.send(("ready", None))
    while True:
        # Poll so that a worker whose parent died (killed, not closed) exits instead of lingering.
        if not connection.poll(1.0):
            if os.getppid() != parent:
                return
            continue
        payload = connection.recv_bytes()
        if not payload:
            break
        try:
            function, args = pickle.loads(payload)
            connection.send(("ok", function(*args)))
        except BaseException as error:
            detail = "".join(traceback.format_exception(error)[-6:])
            connection.send(("error", f"rank {rank}: {type(error).__name__}: {error}\n{detail}"))
    dist.destroy_process_group()


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
        context = torch.multiprocessing.get_context("spawn")
        self._processes, self._connections = [], []
        for rank in range(world_size):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=_pool_worker,
                args=(rank, world_size, f"{self._store_dir}/store", theirs),
                name=f"gatherlab-pool-{world_size}-rank{rank}",
                daemon=True,
            )
            process.start()
            theirs.close()
            self._processes.append(process)
            self._connections.append(ours)
        self._collect(timeout_s=POOL_START_TIMEOUT_S)

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
        payload = pickle.dumps((function, args))
        for connection in self._connections:
            connection.send_bytes(payload)
        return self._collect(timeout_s)

    def _collect(self, timeout_s: float | None) -> list[Any]:
        """Each rank's answer, in rank order; on the first failure close the pool and raise."""
        results: dict[int, Any] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        by_connection = {connection: rank for rank, connection in enumerate(self._connections)}
        by_sentinel = {process.sentinel: rank for rank, process in enumerate(self._processes)}
        while len(results) < self.world_size:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            pending = [c for c, rank in by_connection.items() if rank not in results]
            ready = wait(pending + list(by_sentinel), timeout=remaining)
            if not ready:
                self.close()
                raise RankError(
                    f"no answer from every rank of the {self.world_size}-rank pool in {timeout_s} s"
                )
            for item in ready:
                if item in by_connection:
                    rank = by_connection[item]
                    try:
                        status, value = item.recv()
                    except EOFError:  # the process died
                        status, value = "error", self._death(rank)
                    if status == "error":
                        self.close()
                        raise RankError(value)
                    results[rank] = value
                else:
                    rank = by_sentinel.pop(item)
                    if rank not in results:
                        message = self._death(rank)
                        self.close()
                        raise RankError(message)
        return [results[rank] for rank in range(self.world_size)]

    def _death(self, rank: int) -> str:
        # A dead process closes its pipes a moment before it can be reaped: wait for its exit code.
        self._processes[rank].join(timeout=5.0)
        return f"rank {rank}: process exited with code {self._processes[rank].exitcode}"

    def close(self) -> None:
        """Stop every worker (politely, then by force) and remove the group's store."""
        for connection in self._connections:
            with contextlib.suppress(OSError):  # a dead worker's pipe is closed
                connection.send_bytes(b"")
        deadline = time.monotonic() + 5.0
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
        log.info("starting a pool of %d ranks", world_size)
        _pools[world_size] = WorkerPool(world_size)
    return _pools[world_size]


def close_pools() -> None:
    """Stop every pool; called when a sweep ends and at interpreter exit."""
    while _pools:
        _pools.popitem()[1].close()


atexit.register(close_pools)


def fit(
    module: L.LightningModule,
    datamodule: L.LightningDataModule,
    devices: int,
    precision: str,
    steps: int,
    callbacks: list[L.Callback],
    accelerator: str = "cpu",
    launcher: str = "pool",
    num_nodes: int = 1,
) -> None:
    """Train ``module`` for ``steps`` steps on ``devices`` ranks per node (rank 0's callbacks
    record); several nodes only with ``launcher="external"``."""
    if num_nodes > 1 and launcher != "external":
        raise ValueError(f"layout.nodes={num_nodes} needs launcher=external (torchrun or SLURM)")
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher={launcher!r} is unknown; allowed: {', '.join(LAUNCHERS)}")
    if devices == 1 and launcher != "external":
        _trainer(1, "auto", precision, steps, callbacks, accelerator).fit(
            module, datamodule=datamodule
        )
    elif launcher == "pool":
        if accelerator != "cpu":
            raise ValueError(
                f"launcher=pool runs gloo groups on the CPU, not accelerator={accelerator!r}"
            )
        pool(devices).run(fit_in_group, module, datamodule, precision, steps, callbacks)
    elif launcher == "spawn":
        strategy = DDPStrategy(
            start_method="spawn",
            process_group_backend=_backend(accelerator),
            timeout=COLLECTIVE_TIMEOUT,
        )
        callbacks = [*callbacks, _ReleaseProcessGroup()]
        _trainer(devices, strategy, precision, steps, callbacks, accelerator).fit(
            module, datamodule=datamodule
        )
    else:
        # torchrun or SLURM started this process as one rank; Lightning reads the environment.
        strategy = DDPStrategy(
            process_group_backend=_backend(accelerator), timeout=COLLECTIVE_TIMEOUT
        )
        _trainer(devices, strategy, precision, steps, callbacks, accelerator, num_nodes).fit(
            module, datamodule=datamodule
        )


def is_rank_zero() -> bool:
    """False only in a rank other than 0 that torchrun or SLURM started (launcher=external)."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0))) == 0
