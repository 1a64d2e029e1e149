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

import logging
import signal
import threading
import warnings
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment, LightningEnvironment
from lightning.pytorch.plugins import DoublePrecision
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from gatherlab.core import terms
from gatherlab.ranks import ports, watched
from gatherlab.ranks.external import launched_rank
from gatherlab.ranks.pool import COLLECTIVE_TIMEOUT, pool


def quiet_frameworks() -> None:
    """Lightning's announcements (hardware, tips, stop reason) off and its warnings on; called by
    every process that trains, before Lightning speaks."""
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Lightning 2.6 calls a torch pytree API that torch 2.13 deprecates; harmless, not ours to fix.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")


class _QuietDDPStrategy(DDPStrategy):
    """Lightning's DDP strategy, quieted in each rank's own process before it joins the group."""

    def setup_environment(self) -> None:
        quiet_frameworks()
        super().setup_environment()

    def configure_ddp(self) -> None:
        super().configure_ddp()
        watched.visible(self.model)  # in a check's watched job, its all-reduce is compared


class _SpawnEnvironment(LightningEnvironment):
    """Lightning's environment for ``ddp_spawn``, whose rank 0 listens on a port outside the
    kernel's ephemeral range (`ports.unclaimed_port`), chosen when the job is built: Lightning's
    own choice, a port the kernel lent and took back, was once taken by another process's
    connection before rank 0 listened on it."""

    def __init__(self) -> None:
        super().__init__()
        self._port = ports.unclaimed_port()

    @property
    def main_port(self) -> int:
        return self._port


class _QuietModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2, and tensor parallelism, through the
    module's ``configure_model``), quieted in each rank's own process, on the process group that
    already exists: ``tensor_parallel`` ranks per data-parallel group (rank r's data-parallel
    index r // tensor_parallel, torch's ``init_device_mesh`` order)."""

    def __init__(self, environment: ClusterEnvironment, tensor_parallel: int = 1) -> None:
        super().__init__(
            data_parallel_size=dist.get_world_size() // tensor_parallel,
            tensor_parallel_size=tensor_parallel,
            process_group_backend=dist.get_backend(),
            timeout=COLLECTIVE_TIMEOUT,
        )
        self.cluster_environment = environment

    def setup_environment(self) -> None:
        quiet_frameworks()
        super().setup_environment()


def _trainer(
    devices: int,
    strategy: Any,
    precision: str,
    steps: int,
    callbacks: list[L.Callback],
    accelerator: str,
    num_nodes: int = 1,
) -> L.Trainer:
    """A quiet Trainer that runs ``steps`` optimizer steps. Lightning's ``ModelParallelStrategy``
    refuses ``precision="64-true"`` by name; its own ``DoublePrecision`` plugin, which is what
    that name selects, it takes (measured exact to 2e-16 against one device's 64-true run)."""
    in_float64 = isinstance(strategy, ModelParallelStrategy) and precision == "64-true"
    return L.Trainer(
        accelerator=accelerator,
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        **({"plugins": [DoublePrecision()]} if in_float64 else {"precision": precision}),
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


def _backend(accelerator: str) -> terms.Backend:
    return terms.Accelerator(accelerator).device.backend


class _ReleaseProcessGroup(L.Callback):
    """Destroys a rank's process group once training is over, on every rank together: a rank
    that Lightning spawned, or one that torchrun or SLURM started (``launcher=external``).

    Without it a rank can exit while its gloo group is alive, and the group's destructor at
    interpreter exit intermittently aborts the process ("terminate called without an active
    exception"), which fails a run that trained correctly.
    """

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


class _Interrupted(L.Callback):
    """Notes that training ended on a ``KeyboardInterrupt`` (Ctrl-C)."""

    def __init__(self) -> None:
        self.interrupted = False

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self.interrupted = self.interrupted or isinstance(exception, KeyboardInterrupt)


def _fit_interruptibly(
    trainer: L.Trainer, module: L.LightningModule, datamodule: L.LightningDataModule
) -> None:
    """``trainer.fit``, interrupted as any other call. On Ctrl-C, Lightning tears training down,
    ignores SIGINT from then on and calls ``sys.exit(1)``; the caller gets the
    ``KeyboardInterrupt`` instead (the process's SIGINT handler put back), and decides what an
    interruption means."""
    interrupted = _Interrupted()
    trainer.callbacks.append(interrupted)
    main_thread = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGINT) if main_thread else None
    try:
        trainer.fit(module, datamodule=datamodule)
    except SystemExit:
        if not interrupted.interrupted:
            raise
        if handler is not None:
            signal.signal(signal.SIGINT, handler)
        raise KeyboardInterrupt from None


class _ExistingGroup(ClusterEnvironment):
    """Lightning's view of a process group that is already initialised (the pool's)."""

    def __init__(self, local_rank: int | None = None) -> None:
        super().__init__()
        self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        self._local_rank = self._rank if local_rank is None else local_rank

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
        return self._local_rank

    def node_rank(self) -> int:
        return 0


def fit_in_group(
    module: L.LightningModule,
    datamodule: L.LightningDataModule,
    precision: str,
    steps: int,
    callbacks: list[L.Callback],
    strategy: str = terms.Strategy.DDP,
) -> None:
    """``Trainer.fit`` on this rank of the already initialised default process group: on the CPU
    (gloo), or on an NCCL group on the GPU ``torch.cuda.set_device`` chose for this rank; through
    Lightning's DDP strategy, or its ``ModelParallelStrategy`` for ``strategy="fsdp2"``,
    ``"tp"``, ``"pp"`` or ``"ep"`` (the module parallelises itself: in ``configure_model``, or
    its pipeline at its first step), with as many ranks in the mesh's second dimension as the
    module's ``tensor_parallel_size`` says (1 when it says nothing; a pipeline's ranks under
    ``pp``)."""
    quiet_frameworks()
    if dist.get_backend() == terms.Backend.NCCL:
        accelerator, devices = terms.Device.CUDA, torch.cuda.device_count()
        environment = _ExistingGroup(local_rank=torch.cuda.current_device())
    else:
        accelerator, devices = terms.Device.CPU, dist.get_world_size()
        environment = _ExistingGroup()
    if strategy in (terms.Strategy.FSDP2, terms.Strategy.TP, terms.Strategy.PP, terms.Strategy.EP):
        tensor_parallel = getattr(module, "tensor_parallel_size", 1)
        lightning_strategy = _QuietModelParallelStrategy(environment, tensor_parallel)
    else:
        lightning_strategy = _QuietDDPStrategy(
            cluster_environment=environment,
            process_group_backend=dist.get_backend(),
            timeout=COLLECTIVE_TIMEOUT,
        )
    trainer = _trainer(devices, lightning_strategy, precision, steps, callbacks, accelerator)
    trainer.fit(module, datamodule=datamodule)


def fit(
    module: L.LightningModule,
    datamodule: L.LightningDataModule,
    devices: int,
    precision: str,
    steps: int,
    callbacks: list[L.Callback],
    accelerator: str = terms.Accelerator.CPU,
    launcher: str = terms.Launcher.POOL,
    num_nodes: int = 1,
    strategy: str = terms.Strategy.DDP,
) -> None:
    """Train ``module`` for ``steps`` steps on ``devices`` ranks per node (rank 0's callbacks
    record). The config was checked (``validation``): several nodes only with
    ``launcher="external"``, ``pool`` only on the CPU, a ``strategy`` other than ``ddp`` only on
    the pool."""
    quiet_frameworks()
    if devices == 1 and launcher != terms.Launcher.EXTERNAL:
        trainer = _trainer(1, "auto", precision, steps, callbacks, accelerator)
    elif launcher == terms.Launcher.POOL:
        pool(devices).run(fit_in_group, module, datamodule, precision, steps, callbacks, strategy)
        return
    elif launcher == terms.Launcher.SPAWN:
        strategy = _QuietDDPStrategy(
            cluster_environment=_SpawnEnvironment(),
            start_method="spawn",
            process_group_backend=_backend(accelerator),
            timeout=COLLECTIVE_TIMEOUT,
        )
        callbacks = [*callbacks, _ReleaseProcessGroup()]
        trainer = _trainer(devices, strategy, precision, steps, callbacks, accelerator)
    else:
        # torchrun or SLURM started this process as one rank; Lightning reads the environment.
        strategy = _QuietDDPStrategy(
            process_group_backend=_backend(accelerator), timeout=COLLECTIVE_TIMEOUT
        )
        callbacks = [*callbacks, _ReleaseProcessGroup()]  # as spawned ranks: see its docstring
        trainer = _trainer(devices, strategy, precision, steps, callbacks, accelerator, num_nodes)
    _fit_interruptibly(trainer, module, datamodule)


def is_rank_zero() -> bool:
    """False only in a rank other than 0 that torchrun or SLURM started (launcher=external;
    `gatherlab.ranks.external.launched_rank`)."""
    return launched_rank() in (None, 0)
