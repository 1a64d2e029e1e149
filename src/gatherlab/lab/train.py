"""The command line: ``python -m gatherlab.train [overrides]`` (``-m`` for sweeps).

Before any job starts, every job of the command is composed and checked (``configcheck``), so a
bad value fails with one line and exit status 2, and no worker process is ever started: a single
run here, before Hydra starts; each job of a sweep by gatherlab's Hydra sweeper
(``hydra/sweeper=gatherlab``, src/hydra_plugins/gatherlab_sweeper), which composes each job once
and hands the same configs to Hydra's launcher. Hydra then runs each job (``jobs.run``, or
``jobs.run_audit`` for ``experiment=gather_audit``) in its own output directory; when a sweep
ends, its report is written (``report``) and its worker pools are closed. A failed job is
recorded and the sweep goes on; the command then exits with status 1 and one line. Ctrl-C stops
the command with one line (for a sweep: the job it stopped at and the command that resumes it)
and exit status 130.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shlex
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from gatherlab.components import config
from gatherlab.components.config import ConfigError
from gatherlab.core import cli, runfiles
from gatherlab.lab import configcheck

# What a job needs (Lightning, pandas, matplotlib: seconds to import) is imported once the preflight
# has passed, so that a bad value is answered at once.

log = logging.getLogger(__name__)
# How a user starts this command line (an experiment's run_by names the one that runs it).
COMMAND = "python -m gatherlab.train"


def check_job(cfg: DictConfig) -> DictConfig:
    """A composed job config (with its ``hydra`` node), checked: the first bad value raises
    ``ConfigError``."""
    configcheck.check_command(cfg, cfg.hydra.runtime.choices.get("experiment"), COMMAND)
    configcheck.check(cfg)
    return cfg


def warn(configs: Sequence[DictConfig]) -> None:
    """Warn, once per warning, of what runs but runs slowly."""
    warnings = (configcheck.machine_warning(cfg) for cfg in configs)
    for warning in dict.fromkeys(w for w in warnings if w):
        print(f"gatherlab.train: warning: {warning}", file=sys.stderr)


def preflight(overrides: Sequence[str]) -> None:
    """Compose and check the job of a single run (the sweeper checks a sweep's, ``check_sweep``)."""
    with config.composed():
        cfg = check_job(config.compose_with_hydra(overrides))
    warn([cfg])


# The command running in this process: the sweeper (``check_sweep``) tells it how many jobs there
# are. Hydra builds the sweeper from its config, so nothing can be handed to it but through here.
_running: Command | None = None


def check_sweep(
    jobs: Sequence[Sequence[str]], compose: Callable[[Sequence[str]], DictConfig]
) -> list[DictConfig]:
    """The check of a sweep, called by gatherlab's sweeper (conf/hydra/sweeper/gatherlab.yaml)
    with each job's overrides and Hydra's composition of one job: every job composed and
    checked, or the command ends with one line (``cli.fail``); returns the configs."""
    try:
        configs = _checked_all(jobs, compose, meanwhile=_import_job_modules)
    except ConfigError as error:
        cli.fail("train", error)
    warn(configs)
    if _running is not None:
        _running.jobs_total = len(configs)
    return configs


# A sweep of at least this many jobs is composed and checked on all cores (``_checked_all``):
# composing a job takes Hydra ~0.1 s, checking it ~0.02 s, forking and sending configs back ~0.1 s.
PARALLEL_COMPOSITION = 16
_compose: Callable[[Sequence[str]], DictConfig] | None = None  # what a forked composer composes


def _checked_all(
    jobs: Sequence[Sequence[str]],
    compose: Callable[[Sequence[str]], DictConfig],
    meanwhile: Callable[[], object] = lambda: None,
) -> list[DictConfig]:
    """Each job's config, composed by ``compose`` and checked (``check_job``), in the jobs' order;
    a large sweep on a machine of several cores is split among processes forked from this one
    (each does its share as this one would: the same Hydra state, copied by the fork), while
    this one runs ``meanwhile``. A config keeps its resolvers' cache (what ``${now:...}`` gave the
    sweep's directory) through the pickle that brings it back."""
    cores = _cores()
    if len(jobs) < PARALLEL_COMPOSITION or cores < 2:
        configs = [_checked_one(job, compose) for job in jobs]
        meanwhile()
        return configs
    first = _checked_one(jobs[0], compose)  # Hydra's first composition warms what forks share
    global _compose
    _compose = compose
    try:
        with multiprocessing.get_context("fork").Pool(cores, initializer=_quiet_composer) as pool:
            chunk = -(-(len(jobs) - 1) // cores)
            pending = pool.map_async(_checked_one, jobs[1:], chunksize=chunk)
            meanwhile()
            rest = pending.get()
    finally:
        _compose = None
    return [first, *rest]


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def _import_job_modules() -> None:
    """Import what the jobs run (Lightning: seconds), beside the composers of a large sweep."""
    from gatherlab.lab import audit, jobs  # noqa: F401


def _quiet_composer() -> None:
    """A forked composer leaves Ctrl-C to the command, which ends it (the pool's pipes close)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _checked_one(
    job: Sequence[str], compose: Callable[[Sequence[str]], DictConfig] | None = None
) -> DictConfig:
    compose = compose or _compose
    assert compose is not None
    return check_job(config.hydra_errors_as_one_line(compose, job))


@dataclass
class Command:
    """One invocation: what the preflight learnt, the jobs that failed, where it stands. Hydra calls
    ``job`` once per job."""

    jobs_total: int | None = None
    resuming: bool = False
    failures: list[str] = field(default_factory=list)
    multirun: bool = False
    typed: list[str] = field(default_factory=list)  # the arguments, as typed
    job_number: int | None = None  # the job started last
    sweep_dir: Path | None = None
    interrupted: bool = False  # Ctrl-C was pressed
    in_job: bool = False

    def job(self, cfg: DictConfig) -> None:
        if self.interrupted:  # a Ctrl-C that code between the jobs caught and did not pass on
            raise KeyboardInterrupt
        hydra_cfg = HydraConfig.get()
        self.job_number = hydra_cfg.job.num + 1 if hydra_cfg.mode == RunMode.MULTIRUN else 1
        if hydra_cfg.mode == RunMode.MULTIRUN:
            self.sweep_dir = Path(hydra_cfg.sweep.dir).resolve()
        self.in_job = True
        try:
            self._run_job(cfg, hydra_cfg, self.job_number)
        finally:
            self.in_job = False

    def _run_job(self, cfg: DictConfig, hydra_cfg: DictConfig, number: int) -> None:
        from gatherlab.analysis import report
        from gatherlab.lab import audit, jobs
        from gatherlab.ranks.launch import quiet_frameworks

        quiet_frameworks()  # before Lightning speaks in this process
        overrides = list(hydra_cfg.overrides.task)
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
            if self.interrupted:  # Ctrl-C, turned into an error by code it stopped: not a failure
                raise KeyboardInterrupt from None
            log.error("%s", error)
            self.failures.append(str(error))

    def on_sigint(self, signum: int, frame: Any) -> None:
        """The command line's SIGINT handler. In a job, Ctrl-C raises ``KeyboardInterrupt`` there:
        its pools close and its directory is released on the way out. Anywhere else (the
        preflight, Hydra composing a job) nothing of the command is open, and third-party code
        stopped at a random point may turn a ``KeyboardInterrupt`` into another error or swallow
        it: the command ends at once, its idle pools closed."""
        self.interrupted = True
        if self.in_job:
            raise KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C changes nothing
        if "gatherlab.ranks.pool" in sys.modules:
            sys.modules["gatherlab.ranks.pool"].close_pools()
        logging.shutdown()  # what the jobs logged is in their log files
        print(f"gatherlab.train: {interrupted_line(self)}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130)


def sweep_group(hydra_cfg: DictConfig) -> str:
    """The name that groups a sweep's runs (in wandb): its directory, as ``date/time``; a single
    run is a group of its own."""
    from gatherlab.lab import tracking

    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    return tracking.group_name(hydra_cfg.sweep.dir if multirun else hydra_cfg.runtime.output_dir)


class ClosePools(Callback):
    """Hydra callback: a sweep's worker pools end with the sweep."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from gatherlab.ranks import pool

        pool.close_pools()


class ReportOnMultirunEnd(Callback):
    """Hydra callback: when a multirun ends, compare its runs and write the report."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from gatherlab.analysis import report
        from gatherlab.lab import tracking

        sweep_dir = Path(config.hydra.sweep.dir)
        try:
            table = report.write_report(sweep_dir)
        except FileNotFoundError as error:
            log.error("no report: %s", error)
            return
        log.info("comparison of %d runs:\n%s", len(table), report.comparison_text(table))
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


def _register_sweeper() -> None:
    """Make ``hydra/sweeper=gatherlab`` known to Hydra. Hydra finds plugins by walking the
    ``hydra_plugins`` package, which an editable install (the repository's .venv) hides from it,
    so the sweeper is registered by hand (``Plugins.register``, public). Its module is imported
    after Hydra's scan: the scan executes Hydra's core plugin modules again, and the sweeper must
    subclass the basic sweeper the scan leaves behind."""
    from hydra.core.plugins import Plugins

    plugins = Plugins.instance()  # the scan
    from hydra_plugins.gatherlab_sweeper.sweeper import GatherlabSweeper

    plugins.register(GatherlabSweeper)


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


def interrupted_line(command: Command) -> str:
    """What Ctrl-C leaves on the terminal: where the command stopped and, for a sweep, the command
    that resumes it (the arguments as typed, with ``+resume=``, each quoted for the shell)."""
    if command.multirun and command.sweep_dir is not None:
        dropped = ("hydra.sweep.dir=", "resume=")
        kept = [a for a in command.typed if not a.lstrip("~+").startswith(dropped)]
        again = shlex.join([*_program(), *kept, f"+resume={command.sweep_dir}"])
        number, total = command.job_number, command.jobs_total or "?"
        where = "before the first job" if number is None else f"at job {number}/{total}"
        return f"interrupted {where}; resume with: {again}"
    if command.job_number is None:
        return "interrupted before the first job; nothing to resume"
    return "interrupted; a single run does not resume: run the command again"


def _program() -> list[str]:
    """How this command was started (``python -m gatherlab.train``, with the interpreter as
    typed), or that when it was not started from the command line."""
    typed = list(getattr(sys, "orig_argv", []))
    for index in range(1, len(typed)):
        if typed[index - 1] == "-m" and typed[index] == "gatherlab.train":
            return typed[: index + 1]
    return ["python", "-m", "gatherlab.train"]


def main(argv: Sequence[str] | None = None) -> None:
    """The command line (``argv``: its arguments, ``sys.argv`` when not given). Ctrl-C ends it
    with one line and exit status 130; as the program itself (no ``argv``), also outside its
    jobs (``Command.on_sigint``)."""
    as_program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    typed = list(argv)
    argv, resume = _resume_directory(argv)
    args = _hydra_arguments(argv)
    command = Command(resuming=resume is not None, multirun=bool(args.multirun), typed=typed)
    command.sweep_dir = None if resume is None else resume.resolve()
    handler = signal.signal(signal.SIGINT, command.on_sigint) if as_program else None
    try:
        _run(command, argv, args, resume)
        if command.interrupted:  # a Ctrl-C that code in the sweep caught and did not pass on
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        # Ctrl-C: one line, no traceback. A second Ctrl-C while the pools close changes nothing.
        with contextlib.suppress(ValueError):  # only the main thread sets handlers
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(f"gatherlab.train: {interrupted_line(command)}", file=sys.stderr)
        sys.exit(130)
    finally:
        if handler is not None and not command.interrupted:
            signal.signal(signal.SIGINT, handler)
    if as_program:
        cli.exiting()
    if command.failures:
        jobs_failed = (
            f"{len(command.failures)} of {command.jobs_total} job(s)"
            if command.jobs_total
            else "the run"
        )
        cli.fail("train", f"{jobs_failed} failed; first: {command.failures[0]}", status=1)


def _run(command: Command, argv: list[str], args: Any, resume: Path | None) -> None:
    """The preflight, then Hydra's app; ``command`` records the jobs."""
    if not (args.help or args.hydra_help or args.cfg or args.info or args.shell_completion):
        try:
            if resume is not None:
                check_resume(resume, args.overrides, args.multirun)
            if not args.multirun:  # a sweep's jobs are checked by the sweeper (check_sweep)
                preflight(args.overrides)
                command.jobs_total = 1
        except ConfigError as error:
            cli.fail("train", error)
    if resume is not None:
        argv = [*argv, f"hydra.sweep.dir={resume.resolve()}"]
    _register_sweeper()
    app = hydra.main(
        config_path=config.CONFIG_PATH, config_name=config.CONFIG_NAME, version_base=None
    )(command.job)
    global _running
    _running = command
    try:
        with _command_line(argv):
            app()
    finally:
        _running = None


if __name__ == "__main__":
    # The module's own copy, not this ``__main__`` one: the sweeper calls
    # gatherlab.lab.train.check_sweep, which tells that module's running command (``_running``) how
    # many jobs there are.
    from gatherlab.lab import train

    train.main()
