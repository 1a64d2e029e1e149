"""Running one training job of a checked config (``run``; an audit's job is
`gatherlab.lab.audit`'s). The config was checked by ``validation`` before any job started; nothing
here checks it again, but what only running finds out (a directory that already holds a run, a rank
that fails).

A training run builds data, model, gather, loss and optimizer from the config (``config``), trains
on the layout's ranks (``launch``), and writes its run files (docs/contract.md §5) into its
directory: ``curves.csv`` and ``final_state.pt`` from rank 0 during training, ``summary.json`` when
it ends, failed or not. With ``module=user`` the user's LightningModule and data set are built
inside each rank instead (`gatherlab.runs.fit.Module.fit_on_rank`), with the same run files.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from gatherlab.components import config
from gatherlab.components.accumulation import Accumulation
from gatherlab.components.config import ConfigError
from gatherlab.components.module import ContrastiveModule, PairDataModule
from gatherlab.components.pipeline import PipelineModule
from gatherlab.core import cli, runfiles, terms
from gatherlab.lab import tracking
from gatherlab.ranks import launch
from gatherlab.ranks.pool import RankError, pool
from gatherlab.runs import fit, removals
from gatherlab.runs.fit import ProgressLog, StepLogCallback
from gatherlab.runs.spec import RunSpec

log = logging.getLogger(__name__)


class RunFailed(RuntimeError):
    """Training stopped (a rank raised or died, a loss was not finite); the run directory holds a
    summary with ``status: failed`` and the error."""


def run(
    cfg: DictConfig,
    run_dir: Path,
    choices: Mapping[str, str | None],
    overrides: Sequence[str] = (),
    group: str | None = None,
) -> dict[str, Any]:
    """Train the run ``cfg`` describes, write its files into ``run_dir``, return its summary.

    ``group`` names the sweep the run belongs to (its wandb group with ``logger=wandb``).
    """
    run_dir = Path(run_dir)
    try:  # a single run: already refused by preflight, before Hydra
        runfiles.refuse_finished(run_dir)
    except runfiles.RunFinished as error:
        raise ConfigError(str(error)) from None
    run_dir.mkdir(parents=True, exist_ok=True)
    if not launch.is_rank_zero():  # under torchrun or SLURM: rank 0 holds the directory
        return _train(cfg, run_dir, choices, overrides, group)
    try:
        with runfiles.claimed(run_dir):
            return _train(cfg, run_dir, choices, overrides, group)
    except runfiles.DirectoryInUse as error:
        raise ConfigError(str(error)) from None


def _train(
    cfg: DictConfig,
    run_dir: Path,
    choices: Mapping[str, str | None],
    overrides: Sequence[str],
    group: str | None,
) -> dict[str, Any]:
    """Build, train, and write the summary (rank 0): what ``run`` does in its directory."""
    built = None if config.is_user_module(cfg) else _Built.of(cfg)
    described = _described(cfg, choices, overrides, built)
    start = time.perf_counter()
    try:
        _fit(cfg, run_dir, built)
    except Exception as error:  # whatever stopped training: recorded as a failed run
        message = failure_line(error)
        if launch.is_rank_zero():  # the one writer of the run's files (under torchrun too)
            runfiles.write_summary(
                run_dir,
                {
                    **described,
                    "status": "failed",
                    "error": message,
                    "failed_step": getattr(_rank_exception(error), "step", None),
                    "wall_s": time.perf_counter() - start,
                },
            )
        raise RunFailed(f"{run_dir}: {message}") from error
    wall_s = time.perf_counter() - start
    if not launch.is_rank_zero():
        return {}  # under torchrun or SLURM every rank runs this; rank 0 writes the run
    return _finished(cfg, run_dir, group, built, described, wall_s)


@dataclass(frozen=True)
class _Built:
    """What gatherlab's own module trains (``module=contrastive``), built from the config."""

    dataset: Any
    model: torch.nn.Module
    module: ContrastiveModule | PipelineModule
    datamodule: PairDataModule
    layout_invariant: bool | None  # what the loss class predicts with an exact gather (§3)

    @classmethod
    def of(cls, cfg: DictConfig) -> _Built:
        """The module of ``strategy=pp`` (a language model cut into pipeline stages:
        `PipelineModule`), else gatherlab's contrastive module."""
        dataset = config.build_dataset(cfg)
        model = config.build_model(cfg)
        loss = config.loss_factory(cfg)  # each rank builds the loss in its process group
        sharding = config.build_sharding(cfg)
        if sharding.name == terms.Strategy.PP:
            module = PipelineModule(model, loss, config.build_optimizer(cfg), sharding)
        else:
            module = ContrastiveModule(
                model,
                loss,
                config.build_optimizer(cfg),
                getattr(dataset, "encode_second_view", True),
                accumulation=cfg.layout.get("accumulation", Accumulation.NONE),
                micro_batches=cfg.layout.get("micro_batches", 1),
                row_blocks=cfg.layout.get("row_blocks", 1),
                sharding=sharding,
            )
        datamodule = PairDataModule(
            dataset, cfg.global_batch_size, cfg.steps, seed=cfg.seed, shuffle=cfg.data.shuffle
        )
        return cls(dataset, model, module, datamodule, loss.declared("layout_invariant"))


def _described(
    cfg: DictConfig,
    choices: Mapping[str, str | None],
    overrides: Sequence[str],
    built: _Built | None,
) -> dict[str, Any]:
    """The summary's description of the run (docs/contract.md §5), known before it trains."""
    devices = _devices(cfg)
    return {
        **{name: choices.get(name) for name in runfiles.SUMMARY_CHOICES},
        **(_user_choices(cfg) if built is None else {}),
        "devices": devices,
        "batch_size": cfg.global_batch_size // devices,
        "global_batch_size": cfg.global_batch_size,
        "steps": cfg.steps,
        "precision": cfg.precision,
        "seed": cfg.seed,
        # what the loss class predicts with an exact gather (docs/design.md §3), for the report
        "loss_layout_invariant": None if built is None else built.layout_invariant,
        "overrides": list(overrides),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "versions": runfiles.package_versions(),
    }


def _devices(cfg: DictConfig) -> int:
    """The run's ranks in all, over its nodes."""
    return cfg.layout.devices * cfg.layout.get("nodes", 1)


def _fit(cfg: DictConfig, run_dir: Path, built: _Built | None) -> None:
    """Train on the layout's ranks: gatherlab's module (``launch.fit``) or, with
    ``module=user``, the user's (``_fit_user_module``)."""
    if built is None:
        _fit_user_module(cfg, run_dir, _devices(cfg))
        return
    launch.fit(
        built.module,
        built.datamodule,
        devices=cfg.layout.devices,
        num_nodes=cfg.layout.get("nodes", 1),
        precision=cfg.precision,
        steps=cfg.steps,
        callbacks=[StepLogCallback(run_dir), ProgressLog(cfg.log_every, cfg.steps)],
        accelerator=cfg.layout.accelerator,
        launcher=cfg.launcher.name,
        strategy=built.module.sharding.name,
    )


def _finished(
    cfg: DictConfig,
    run_dir: Path,
    group: str | None,
    built: _Built | None,
    described: dict[str, Any],
    wall_s: float,
) -> dict[str, Any]:
    """Rank 0, after training: the summary (with the final loss and the data set's evaluation)
    written, the run mirrored to wandb with ``logger=wandb``, one line logged."""
    curves = runfiles.read_curves(run_dir)
    evaluation = {}
    if built is not None:
        evaluation = _evaluate(built.dataset, built.model, run_dir, cfg.precision)
    summary = {
        **described, "status": "ok", "final_loss": curves["loss"][-1], "wall_s": wall_s,
        **evaluation,
    }  # fmt: skip
    runfiles.write_summary(run_dir, summary)
    if cfg.logger.name == "wandb":
        tracking.log_run(
            run_dir,
            summary,
            curves,
            group=group or run_dir.name,
            project=cfg.logger.project,
            entity=cfg.logger.entity,
            tags=list(cfg.logger.tags),
        )
    log.info(
        "%s: %d steps on %d device(s), final loss %.10g, %.1f s",
        run_dir,
        cfg.steps,
        summary["devices"],
        summary["final_loss"],
        summary["wall_s"],
    )
    return summary


def _user_choices(cfg: DictConfig) -> dict[str, str | None]:
    """What a run of ``module=user`` records for the groups it does not use: as ``model`` the
    module's import path, ``native`` as its gather (it communicates by itself), no loss and no
    optimizer of gatherlab's."""
    return {"model": str(cfg.module._target_), "gather": "native", "loss": None, "optim": None}


def _fit_user_module(cfg: DictConfig, run_dir: Path, devices: int) -> None:
    """Train the user's module of ``module=user`` on its data set: each rank builds both in its
    process group and records the run files (``fit.Module.fit_on_rank``); one device trains
    here. The config was checked: several ranks only on the worker pools."""
    form = fit.Module(config.module_factory(cfg))
    spec = RunSpec(
        data=config.dataset_factory(cfg),
        removals=removals.Removals.from_config(cfg.get("removals")),
        global_batch_size=cfg.global_batch_size,
        steps=cfg.steps,
        seed=cfg.seed,
        precision=cfg.precision,
        shuffle=bool(cfg.data.shuffle),
    )
    callbacks = [StepLogCallback(run_dir), ProgressLog(cfg.log_every, cfg.steps)]
    if devices == 1:
        form.fit_on_rank(spec, callbacks)
    else:
        pool(devices).run(form.fit_on_rank, spec, callbacks)


def _rank_exception(error: BaseException) -> BaseException | None:
    """The exception a rank raised: the error itself in this process, the one the worker pool
    sent back (``RankError.error``). A ``ddp_spawn`` rank's comes back as text only."""
    if isinstance(error, RankError):
        return error.error
    return error


def failure_line(error: BaseException) -> str:
    """What stopped a run, as one line: a rank's error keeps the rank's own type and message
    (without the traceback), any other error its type and first line (``cli.one_line``)."""
    text = [line for line in str(error).strip().splitlines() if line.strip()]
    if isinstance(error, RankError):
        return text[0]
    rank = getattr(error, "error_index", None)  # a ddp_spawn rank (torch.multiprocessing)
    if rank is not None:
        if getattr(error, "exit_code", None) is not None:
            signal = getattr(error, "signal_name", None)
            how = f"signal {signal}" if signal else f"code {error.exit_code}"
            return f"rank {rank}: process exited with {how}"
        return f"rank {rank}: {text[-1] if text else type(error).__name__}"  # its last line
    return cli.one_line(error)


def _evaluate(dataset, model: torch.nn.Module, run_dir: Path, precision: str) -> dict[str, float]:
    """The data set's evaluation of the trained model (``evaluate``), if it has one: the final
    weights are read back, so it sees what any launcher trained."""
    evaluate = getattr(dataset, "evaluate", None)
    if evaluate is None:
        return {}
    model = model.to(getattr(torch, terms.Precision(precision).dtype_name))
    model.load_state_dict(runfiles.read_final_state(run_dir))
    return evaluate(model)
