"""How ranks are started: one process for one device, a fresh ``ddp_spawn`` group on gloo for more.

``ddp_spawn`` (unlike Lightning's plain ``ddp``) does not re-execute the command line, so it runs
inside a Hydra multirun job like any other function call.
"""

from __future__ import annotations

import logging
import tempfile
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy

# Lightning announces hardware, tips and the stop reason at INFO on every run; keep its warnings.
for _name in ("lightning.pytorch", "lightning.fabric"):
    logging.getLogger(_name).setLevel(logging.WARNING)
# Lightning 2.6 calls a torch pytree API that torch 2.13 deprecates; harmless, and not ours to fix.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")

# A collective that waits longer than this raises instead of hanging (a rank died or diverged).
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


class _ReleaseProcessGroup(L.Callback):
    """Destroys a spawned rank's process group once training is over, on every rank together.

    Without it a rank can exit while its gloo group is alive, and the group's destructor at
    interpreter exit intermittently aborts the process ("terminate called without an active
    exception"), which fails a run that trained correctly.
    """

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def build_trainer(
    devices: int, precision: str, steps: int, callbacks: list[L.Callback], accelerator: str = "cpu"
) -> L.Trainer:
    """A quiet Trainer that runs ``steps`` optimizer steps on ``devices`` ranks."""
    if devices > 1:
        strategy = DDPStrategy(
            start_method="spawn",
            process_group_backend="gloo" if accelerator == "cpu" else "nccl",
            timeout=COLLECTIVE_TIMEOUT,
        )
        callbacks = [*callbacks, _ReleaseProcessGroup()]
    else:
        strategy = "auto"
    return L.Trainer(
        accelerator=accelerator,
        devices=devices,
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


def fit(
    module: L.LightningModule,
    datamodule: L.LightningDataModule,
    devices: int,
    precision: str,
    steps: int,
    callbacks: list[L.Callback],
    accelerator: str = "cpu",
) -> None:
    """Train ``module`` for ``steps`` steps on ``devices`` ranks (rank 0's callbacks record)."""
    trainer = build_trainer(devices, precision, steps, callbacks, accelerator)
    trainer.fit(module, datamodule=datamodule)


def _group_worker(
    rank: int, world_size: int, store_dir: str, function: Callable[..., Any], args: tuple
) -> None:
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"file://{store_dir}/store",
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    try:
        result = function(*args)
        torch.save(result, Path(store_dir) / f"result_{rank}.pt")
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def run_in_process_group(world_size: int, function: Callable[..., Any], *args: Any) -> list[Any]:
    """Run ``function(*args)`` on ``world_size`` fresh processes joined in a gloo group.

    Returns each rank's result in rank order. ``function`` must be importable by name (a
    module-level function); a rank that raises re-raises here with its traceback.
    """
    with tempfile.TemporaryDirectory(prefix="gatherlab-group-") as store_dir:
        torch.multiprocessing.start_processes(
            _group_worker,
            args=(world_size, store_dir, function, args),
            nprocs=world_size,
            start_method="spawn",
        )
        return [
            torch.load(Path(store_dir) / f"result_{rank}.pt", weights_only=False)
            for rank in range(world_size)
        ]
