"""The command line: ``python -m gatherlab.train [overrides]`` (``-m`` for sweeps).

Before Hydra starts any job, every job of the command (each combination of a sweep) is composed and
checked (``configcheck``), so a bad value fails with one line and exit status 2, and no worker
process is ever started. Hydra then runs each job (``jobs.run``, or ``jobs.run_audit`` for
``experiment=gather_audit``) in its own output directory; when a sweep ends, its report is written
(``report``) and its worker pools are closed. A failed job is recorded and the sweep goes on; the
command then exits with status 1 and one line.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from gatherlab import config, configcheck, runfiles
from gatherlab.config import ConfigError

# What a job needs (Lightning, pandas, matplotlib: seconds to import) is imported once the preflight
# has passed, so that a bad value is answered at once.

log = logging.getLogger(__name__)
# How a user starts this command line (an experiment's run_by names the one that runs it).
COMMAND = "python -m gatherlab.train"


def checked_jobs(overrides: Sequence[str], multirun: bool) -> list[DictConfig]:
    """Every job config of the command, composed and checked; the first bad value raises
    ``ConfigError``."""
    with config.composed():
        composed = [config.compose(job) for job in config.job_overrides(overrides, multirun)]
    for cfg, choices in composed:
        configcheck.check_command(cfg, choices["experiment"], COMMAND)
        configcheck.check(cfg)
    return [cfg for cfg, _ in composed]


def preflight(overrides: Sequence[str], multirun: bool) -> int:
    """Compose and check every job of the command; return the number of jobs."""
    return len(checked_jobs(overrides, multirun))


@dataclass
class Command:
    """One invocation: what the preflight learnt, and the jobs that failed. Hydra calls ``job``
    once per job."""

    jobs_total: int | None = None
    resuming: bool = False
    failures: list[str] = field(default_factory=list)

    def job(self, cfg: DictConfig) -> None:
        from gatherlab import audit, jobs, report

        hydra_cfg = HydraConfig.get()
        overrides = list(hydra_cfg.overrides.task)
        number = hydra_cfg.job.num + 1 if hydra_cfg.mode == RunMode.MULTIRUN else 1
        if hydra_cfg.mode == RunMode.MULTIRUN:
            log.info("job %d/%s: %s", number, self.jobs_total or "?", " ".join(overrides))
        run_dir = Path(hydra_cfg.runtime.output_dir)
        try:
            if "audit" in cfg:  # experiment=gather_audit: measure gradients instead of training
                table = audit.run(cfg, overrides, run_dir)
                log.info("gradient audit:\n%s", report.audit_markdown(table))
                log.info("written: %s/audit.{csv,md,png,pdf}", run_dir)
                return
            if self.resuming and runfiles.is_complete(run_dir):
                log.info("job %d: complete in %s, not run again", number, run_dir)
                return
            if self.resuming:
                runfiles.set_aside_failed(run_dir)
            jobs.run(
                cfg,
                run_dir,
                choices=dict(hydra_cfg.runtime.choices),
                overrides=overrides,
                group=sweep_group(hydra_cfg),
            )
        except (jobs.RunFailed, ConfigError) as error:  # recorded; a sweep goes on
            log.error("%s", error)
            self.failures.append(str(error))


def sweep_group(hydra_cfg: DictConfig) -> str:
    """The name that groups a sweep's runs (in wandb): its directory, as ``date/time``; a single
    run is a group of its own."""
    from gatherlab import tracking

    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    return tracking.group_name(hydra_cfg.sweep.dir if multirun else hydra_cfg.runtime.output_dir)


class ClosePools(Callback):
    """Hydra callback: a sweep's worker pools end with the sweep."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from gatherlab import pool

        pool.close_pools()


class ReportOnMultirunEnd(Callback):
    """Hydra callback: when a multirun ends, compare its runs and write the report."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from gatherlab import report, tracking

        sweep_dir = Path(config.hydra.sweep.dir)
        try:
            table = report.write_report(sweep_dir)
        except FileNotFoundError as error:
            log.error("no report: %s", error)
            return
        log.info("comparison of %d runs:\n%s", len(table), report.verdict(table))
        log.info("figure: %s", sweep_dir / f"{report.FIGURE}.png")
        if (sweep_dir / f"{report.MATRIX}.png").exists():
            log.info("loss matrix: %s", sweep_dir / f"{report.MATRIX}.png")
        logger = config.get("logger", {})
        if logger.get("name") == "wandb":
            tracking.log_sweep(
                sweep_dir,
                group=tracking.group_name(sweep_dir),
                project=logger.project,
                entity=logger.entity,
                tags=list(logger.tags),
            )


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
    with config.composed():
        planned = config.job_overrides(overrides, multirun)
    for number, job in enumerate(planned):
        summary = sweep_dir / str(number) / runfiles.SUMMARY
        job = [o for o in job if not o.lstrip("~+").startswith("hydra.")]  # as the job records
        if summary.exists():
            recorded = runfiles.read_summary(summary.parent).get("overrides")
            if recorded is not None and list(recorded) != job:
                raise ConfigError(
                    f"job {number + 1} of {sweep_dir} ran with {' '.join(recorded)}, this command "
                    f"would run {' '.join(job)}; allowed: the command that started the sweep"
                )


def _hydra_arguments(argv: Sequence[str]) -> Any:
    # Hydra's own command-line parser: no public API exposes it, and reading the flags exactly as
    # Hydra will (-m, --help, --cfg, ...) is what lets the preflight check the jobs Hydra runs.
    from hydra._internal.utils import get_args_parser

    return get_args_parser().parse_known_args(list(argv))[0]


@contextlib.contextmanager
def _command_line(argv: Sequence[str]) -> Iterator[None]:
    """``sys.argv`` as ``hydra.main`` reads it (its documented input), restored afterwards."""
    saved = sys.argv
    sys.argv = [saved[0] if saved else "gatherlab.train", *argv]
    try:
        yield
    finally:
        sys.argv = saved


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    argv, resume = _resume_directory(argv)
    args = _hydra_arguments(argv)
    command = Command(resuming=resume is not None)
    if not (args.help or args.hydra_help or args.cfg or args.info or args.shell_completion):
        try:
            if resume is not None:
                check_resume(resume, args.overrides, args.multirun)
            configs = checked_jobs(args.overrides, args.multirun)
        except ConfigError as error:
            print(f"gatherlab.train: error: {error}", file=sys.stderr)
            sys.exit(2)
        command.jobs_total = len(configs)
        warnings = (configcheck.machine_warning(cfg) for cfg in configs)
        for warning in dict.fromkeys(w for w in warnings if w):
            print(f"gatherlab.train: warning: {warning}", file=sys.stderr)
    if resume is not None:
        argv.append(f"hydra.sweep.dir={resume.resolve()}")
    from gatherlab.launch import quiet_frameworks

    quiet_frameworks()
    app = hydra.main(
        config_path=config.CONFIG_PATH, config_name=config.CONFIG_NAME, version_base=None
    )(command.job)
    with _command_line(argv):
        app()
    if command.failures:
        jobs_failed = (
            f"{len(command.failures)} of {command.jobs_total} job(s)"
            if command.jobs_total
            else "the run"
        )
        print(
            f"gatherlab.train: error: {jobs_failed} failed; first: {command.failures[0]}",
            file=sys.stderr,
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
