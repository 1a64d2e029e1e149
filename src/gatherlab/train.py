"""The Hydra entry point: ``python -m gatherlab.train [overrides]`` (``-m`` for sweeps).

Before Hydra starts any job, every job of the command (each combination of a sweep) is composed and
checked, so a bad value fails with one line and no worker process is ever started. Each job builds
data, model, loss (with its gather), module and trainer from the config, trains, and writes its run
files (DESIGN.md §5) into its Hydra output directory.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from gatherlab import configcheck, launch, runfiles, tracking
from gatherlab.configcheck import ConfigError
from gatherlab.module import ContrastiveModule, PairDataModule, ProgressLog, RunRecorder

log = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parents[2] / "conf"
CONFIG_NAME = "config"
# Config groups whose choice names a run in summary.json and comparison.csv.
CHOICE_GROUPS = (
    "experiment", "model", "loss", "data", "optim", "gather", "layout", "launcher", "logger",
)  # fmt: skip


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
    configcheck.check(cfg)
    run_dir = Path(run_dir)
    if (run_dir / runfiles.SUMMARY).exists():
        raise ConfigError(
            f"run directory {run_dir} already holds a finished run; it is never overwritten"
        )
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

    nodes = cfg.layout.get("nodes", 1)
    devices = cfg.layout.devices * nodes  # ranks in all
    dataset = hydra.utils.instantiate(cfg.data.dataset)
    if len(dataset) != cfg.data.num_samples:
        raise ConfigError(
            f"data.num_samples={cfg.data.num_samples} but the data set has {len(dataset)}"
        )
    torch.manual_seed(cfg.seed)  # the initial weights, identical in every layout
    model = hydra.utils.instantiate(cfg.model)
    loss = hydra.utils.instantiate(cfg.loss, gather=cfg.gather.name)
    module = ContrastiveModule(
        model, loss, hydra.utils.instantiate(cfg.optim), dataset.encode_second_view
    )
    datamodule = PairDataModule(
        dataset, cfg.global_batch_size, cfg.steps, seed=cfg.seed, shuffle=cfg.data.shuffle
    )

    described = {
        **{name: choices.get(name) for name in CHOICE_GROUPS},
        "devices": devices,
        "batch_size": cfg.global_batch_size // devices,
        "global_batch_size": cfg.global_batch_size,
        "steps": cfg.steps,
        "precision": cfg.precision,
        "seed": cfg.seed,
        "overrides": list(overrides),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "versions": runfiles.package_versions(),
    }
    start = time.perf_counter()
    try:
        launch.fit(
            module,
            datamodule,
            devices=cfg.layout.devices,
            num_nodes=nodes,
            precision=cfg.precision,
            steps=cfg.steps,
            callbacks=[RunRecorder(run_dir), ProgressLog(cfg.log_every, cfg.steps)],
            accelerator=cfg.layout.accelerator,
            launcher=cfg.launcher.name,
        )
    except Exception as error:  # whatever stopped training: recorded as a failed run
        message = _one_line(error)
        if launch.is_rank_zero():
            failed_step = re.search(r"at step (\d+)", message)
            runfiles.write_summary(
                run_dir,
                {
                    **described,
                    "status": "failed",
                    "error": message,
                    "failed_step": int(failed_step.group(1)) if failed_step else None,
                    "wall_s": time.perf_counter() - start,
                },
            )
        raise RunFailed(f"{run_dir}: {message}") from error
    wall_s = time.perf_counter() - start
    if not launch.is_rank_zero():
        return {}  # under torchrun or SLURM every rank runs this; rank 0 writes the run

    curves = runfiles.read_curves(run_dir)
    summary = {
        **described,
        "status": "ok",
        "final_loss": curves["loss"][-1],
        "wall_s": wall_s,
        **_evaluate(dataset, model, run_dir, cfg.precision),
    }
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
        devices,
        summary["final_loss"],
        wall_s,
    )
    return summary


class RunFailed(RuntimeError):
    """Training stopped (a rank raised or died, a loss was not finite); the run directory holds a
    summary with ``status: failed`` and the error."""


def _one_line(error: BaseException) -> str:
    """The error as one line: its type and the first line of its message (a rank's error keeps
    the rank's own type and message, without the traceback)."""
    text = [line for line in str(error).strip().splitlines() if line.strip()]
    if isinstance(error, launch.RankError):
        return text[0]
    rank = getattr(error, "error_index", None)  # a ddp_spawn rank (torch.multiprocessing)
    if rank is not None:
        if getattr(error, "exit_code", None) is not None:
            signal = getattr(error, "signal_name", None)
            how = f"signal {signal}" if signal else f"code {error.exit_code}"
            return f"rank {rank}: process exited with {how}"
        return f"rank {rank}: {text[-1] if text else type(error).__name__}"  # its last line
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _evaluate(dataset, model: torch.nn.Module, run_dir: Path, precision: str) -> dict[str, float]:
    """The data set's evaluation of the trained model (``evaluate``), if it has one: the final
    weights are read back, so it sees what any launcher trained."""
    evaluate = getattr(dataset, "evaluate", None)
    if evaluate is None:
        return {}
    model = model.to(torch.float64 if precision == "64-true" else torch.float32)
    model.load_state_dict(runfiles.read_final_state(run_dir))
    return evaluate(model)


# The number of jobs of the running command, known from the preflight, for progress lines.
_jobs_total: int | None = None
# Jobs of this command that failed (one line each), and whether it resumes an earlier sweep.
_failures: list[str] = []
_resuming = False


@hydra.main(config_path=str(CONFIG_DIR), config_name=CONFIG_NAME, version_base=None)
def _hydra_main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    overrides = list(hydra_cfg.overrides.task)
    if hydra_cfg.mode == RunMode.MULTIRUN:
        log.info("job %d/%s: %s", hydra_cfg.job.num + 1, _jobs_total or "?", " ".join(overrides))
    if "audit" in cfg:  # experiment=gather_audit: measure gradients instead of training
        from gatherlab import audit

        out = Path(hydra_cfg.runtime.output_dir)
        if (out / "audit.csv").exists():
            raise ConfigError(f"{out} already holds an audit; it is never overwritten")
        table = audit.run_config(cfg, out)
        log.info("gradient audit:\n%s", audit.markdown(table))
        log.info("written: %s/audit.{csv,md,png,pdf}", out)
        return
    run_dir = Path(hydra_cfg.runtime.output_dir)
    if _resuming and runfiles.is_complete(run_dir):
        log.info("job %d: complete in %s, not run again", hydra_cfg.job.num + 1, run_dir)
        return
    if _resuming:
        runfiles.set_aside_failed(run_dir)
    try:
        run(
            cfg,
            run_dir,
            choices=dict(hydra_cfg.runtime.choices),
            overrides=overrides,
            group=sweep_group(hydra_cfg),
        )
    except (RunFailed, ConfigError) as error:  # recorded; a sweep goes on with its next job
        log.error("%s", error)
        _failures.append(str(error))


def sweep_group(hydra_cfg: DictConfig) -> str:
    """The name that groups a sweep's runs (in wandb): its directory, as ``date/time``; a single
    run is a group of its own."""
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    return tracking.group_name(hydra_cfg.sweep.dir if multirun else hydra_cfg.runtime.output_dir)


class ClosePools(Callback):
    """Hydra callback: a sweep's worker pools end with the sweep."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        launch.close_pools()


def _group_options(group: str) -> list[str] | None:
    folder = CONFIG_DIR / group
    return sorted(path.stem for path in folder.glob("*.yaml")) if folder.is_dir() else None


def _check_group_choices(overrides: Sequence[str]) -> None:
    """Unknown config group options, named with what is allowed (Hydra's own message is a page)."""
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        group = override.key_or_group
        options = _group_options(group)
        if options is None or override.is_delete():
            continue
        values = (
            list(override.sweep_string_iterator())
            if override.is_sweep_override()
            else [override.value()]
        )
        for value in values:
            if value is not None and str(value) not in options:
                raise ConfigError(f"{group}={value!r} is unknown; allowed: {', '.join(options)}")


def job_overrides(overrides: Sequence[str], multirun: bool) -> list[list[str]]:
    """The overrides of every job the command will run, as Hydra's basic sweeper expands them."""
    if not multirun:
        return [list(overrides)]
    from hydra import compose as hydra_compose
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    parser = OverridesParser.create()
    fixed = [
        o.input_line for o in parser.parse_overrides(list(overrides)) if not o.is_sweep_override()
    ]
    params = (
        hydra_compose(CONFIG_NAME, overrides=fixed, return_hydra_config=True).hydra.sweeper.params
        or {}
    )
    combined = parser.parse_overrides(
        [f"{key}={value}" for key, value in params.items()] + list(overrides)
    )
    batches = BasicSweeper.split_arguments(combined, max_batch_size=None)
    return [list(job) for batch in batches for job in batch]


def compose(overrides: Sequence[str] = ()) -> tuple[DictConfig, dict[str, str | None]]:
    """The job config of ``overrides`` (without its ``hydra`` node) and its config group choices.

    Must run inside ``hydra.initialize_config_dir(CONFIG_DIR)`` (see ``composed``).
    """
    from hydra import compose as hydra_compose

    _check_group_choices(overrides)
    try:
        cfg = hydra_compose(CONFIG_NAME, overrides=list(overrides), return_hydra_config=True)
    except HydraException as error:
        raise ConfigError(str(error).splitlines()[0]) from None
    choices = dict(cfg.hydra.runtime.choices)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, choices


@contextmanager
def composed() -> Iterator[None]:
    """The context in which ``compose`` and ``job_overrides`` read gatherlab's configs."""
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        yield


def preflight(overrides: Sequence[str], multirun: bool) -> int:
    """Compose and check every job of the command; return the number of jobs."""
    return len(_checked_jobs(overrides, multirun))


def _checked_jobs(overrides: Sequence[str], multirun: bool) -> list[DictConfig]:
    _check_group_choices(overrides)
    with composed():
        configs = [compose(job)[0] for job in job_overrides(overrides, multirun)]
    for cfg in configs:
        configcheck.check(cfg)
    return configs


def _resume_directory(argv: list[str]) -> tuple[list[str], Path | None]:
    """``+resume=SWEEP_DIR`` (or ``resume=``) taken out of the command line."""
    rest, found = [], None
    for argument in argv:
        key, _, value = argument.partition("=")
        if key.lstrip("+") == "resume" and value:
            found = Path(value)
        else:
            rest.append(argument)
    return rest, found


def check_resume(sweep_dir: Path, overrides: Sequence[str], multirun: bool) -> None:
    """A sweep can be resumed only by the command that started it: same jobs, same numbers."""
    if not multirun:
        raise ConfigError("resume=... continues a sweep; allowed: with -m (--multirun)")
    if not sweep_dir.is_dir():
        raise ConfigError(f"resume={sweep_dir} does not exist; allowed: a sweep directory")
    if any(o.startswith("hydra.sweep.dir=") for o in overrides):
        raise ConfigError("resume=... sets hydra.sweep.dir itself; allowed: one of the two")
    with composed():
        jobs = job_overrides(overrides, multirun)
    for number, job in enumerate(jobs):
        summary = sweep_dir / str(number) / runfiles.SUMMARY
        if summary.exists():
            recorded = runfiles.read_summary(summary.parent).get("overrides")
            if recorded is not None and list(recorded) != list(job):
                raise ConfigError(
                    f"job {number + 1} of {sweep_dir} ran with {' '.join(recorded)}, this command "
                    f"would run {' '.join(job)}; allowed: the command that started the sweep"
                )


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    from hydra._internal.utils import get_args_parser

    global _jobs_total, _resuming
    argv, resume = _resume_directory(argv)
    args, _ = get_args_parser().parse_known_args(argv)
    if not (args.help or args.hydra_help or args.cfg or args.info or args.shell_completion):
        try:
            if resume is not None:
                check_resume(resume, args.overrides, args.multirun)
            configs = _checked_jobs(args.overrides, args.multirun)
        except ConfigError as error:
            print(f"gatherlab.train: error: {error}", file=sys.stderr)
            sys.exit(2)
        _jobs_total = len(configs)
        warnings = (configcheck.machine_warning(cfg) for cfg in configs)
        for warning in dict.fromkeys(w for w in warnings if w):
            print(f"gatherlab.train: warning: {warning}", file=sys.stderr)
    if resume is not None:
        _resuming = True
        argv.append(f"hydra.sweep.dir={resume.resolve()}")
    sys.argv = [sys.argv[0], *argv]
    _hydra_main()
    if _failures:
        jobs = f"{len(_failures)} of {_jobs_total} job(s)" if _jobs_total else "the run"
        print(f"gatherlab.train: error: {jobs} failed; first: {_failures[0]}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
