"""The command line: ``python -m gatherlab.train [overrides]`` (``-m`` for sweeps).

Hydra reads the arguments (``+resume=`` aside: ``resume``) and runs the app, whose task is a
``Command``. Before any job starts, every job of the command is checked (``preflight``), so a bad
value fails with one line and exit status 2, before a directory is written or a worker started: a
single run's config by a Hydra callback, a sweep's jobs, each composed once, by gatherlab's sweeper
(src/hydra_plugins/gatherlab_sweeper), which shows them to the command (``Command.compose_sweep``)
before it writes the sweep's directory. Hydra's own refusals (a config that does not compose) are
one line with status 2 too. Hydra then runs each job (``jobs.run``, or ``audit.run`` for
``experiment=gather_audit``) in its own output directory; when a sweep ends, its report is written
and its worker pools are closed (``sweepend``). A failed job is recorded and the sweep goes on;
the command then exits with status 1 and one line. Ctrl-C stops the command with one line (for a
sweep: the job it stopped at and the command that resumes it) and exit status 130.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from gatherlab.components import config
from gatherlab.components.config import ConfigError
from gatherlab.core import cli
from gatherlab.lab import preflight, resume

# What a job needs (Lightning, pandas, matplotlib: seconds to import) is imported once the checks
# have passed, so that a bad value is answered at once.

__all__ = ["Command", "interrupted_line", "main"]

log = logging.getLogger(__name__)


@dataclass
class Command:
    """One invocation: the task Hydra runs once per job (``__call__``; Hydra names the jobs' log
    file after this module: ``train.log``), what the check of its jobs learnt, the jobs that
    failed, where it stands."""

    typed: list[str] = field(default_factory=list)  # the arguments, as typed
    resume_dir: Path | None = None  # the sweep that ``+resume=`` continues
    jobs_total: int | None = None
    failures: list[str] = field(default_factory=list)
    job_number: int | None = None  # the job started last
    sweep_dir: Path | None = None  # the sweep's directory, once known
    interrupted: bool = False  # Ctrl-C was pressed
    in_job: bool = False

    def __post_init__(self) -> None:
        self.sweep_dir = self.resume_dir

    def compose_sweep(
        self, jobs: Sequence[Sequence[str]], compose: preflight.Compose
    ) -> list[DictConfig]:
        """What gatherlab's sweeper asks of its task before it writes the sweep's directory: each
        job's config (``compose`` composes one) checked, or ``ConfigError``; a resumed sweep's jobs
        must be the ones it ran."""
        if self.resume_dir is not None:
            resume.check_jobs(self.resume_dir, jobs)
        configs = preflight.validated_configs(jobs, compose)
        swept = Path(str(configs[0].hydra.sweep.dir)) if configs and "hydra" in configs[0] else None
        if self.resume_dir is None and swept is not None and (swept / "multirun.yaml").exists():
            raise ConfigError(
                f"hydra.sweep.dir={swept} already holds a sweep; it is never overwritten; "
                f"allowed: +resume={swept} to finish it, or a directory of its own"
            )
        self.jobs_total = len(configs)
        return configs

    def __call__(self, cfg: DictConfig) -> None:
        if self.interrupted:  # a Ctrl-C that code between the jobs caught and did not pass on
            raise KeyboardInterrupt
        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode == RunMode.MULTIRUN:
            self.job_number = hydra_cfg.job.num + 1
            self.sweep_dir = Path(hydra_cfg.sweep.dir).resolve()
        else:
            self.job_number = self.jobs_total = 1
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
            if self.resume_dir is not None and resume.skip_or_set_aside(run_dir, number):
                return
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
        checks, Hydra composing a job) nothing of the command is open, and third-party code
        stopped at a random point may turn a ``KeyboardInterrupt`` into another error or swallow
        it: the command ends at once, its idle pools closed."""
        self.interrupted = True
        if self.in_job:
            raise KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C changes nothing
        if "gatherlab.ranks.pool" in sys.modules:
            sys.modules["gatherlab.ranks.pool"].close_pools()
        if "gatherlab.ranks.forkstart" in sys.modules:  # its exit hook, which os._exit skips
            sys.modules["gatherlab.ranks.forkstart"].stop()
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


def interrupted_line(command: Command) -> str:
    """What Ctrl-C leaves on the terminal: where the command stopped and, for a sweep, the command
    that resumes it (the arguments as typed, with ``+resume=``, each quoted for the shell)."""
    if command.sweep_dir is not None:
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
    typed = list(sys.argv[1:] if argv is None else argv)
    try:
        arguments, resume_dir = resume.arguments(typed)
    except ConfigError as error:
        cli.fail("train", error)
    arguments = [*arguments, *_rank_arguments(arguments)]
    command = Command(typed=typed, resume_dir=resume_dir)
    handler = signal.signal(signal.SIGINT, command.on_sigint) if as_program else None
    try:
        _run_app(command, arguments)
        if command.interrupted:  # a Ctrl-C that code in the sweep caught and did not pass on
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        # Ctrl-C: one line, no traceback. A second Ctrl-C while the pools close changes nothing.
        with contextlib.suppress(ValueError):  # only the main thread sets handlers
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(f"gatherlab.train: {interrupted_line(command)}", file=sys.stderr)
        sys.exit(130)
    except ConfigError as error:  # a check's or Hydra's refusal, before any job started
        cli.fail("train", error)
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


# Hydra's public config of what a job writes into its directory: no copy of the config
# (``.hydra/``) and no log file (``train.log``), for the ranks that do not own the run directory.
RANK_NOT_ZERO = {"hydra.output_subdir": "null", "hydra/job_logging": "none"}


def _rank_arguments(arguments: Sequence[str]) -> list[str]:
    """The overrides of a rank other than 0 that torchrun or SLURM started, which shares rank 0's
    run directory: it writes nothing there (``RANK_NOT_ZERO``, each unless typed). None for
    rank 0 or a process no launcher started."""
    from gatherlab.ranks.external import launched_rank

    try:
        if launched_rank() in (None, 0):
            return []
    except ValueError:  # a malformed RANK: the launcher's own check says so, in one line
        return []
    typed = {argument.lstrip("+~").split("=", 1)[0] for argument in arguments}
    return [f"{key}={value}" for key, value in RANK_NOT_ZERO.items() if key not in typed]


def _run_app(command: Command, arguments: list[str]) -> None:
    """Hydra's app on ``arguments``, ``command`` its task. Hydra's refusal to compose a config
    raises ``ConfigError``."""
    _register_sweeper()
    app = hydra.main(
        config_path=config.CONFIG_PATH, config_name=config.CONFIG_NAME, version_base=None
    )(command)
    with _command_line(arguments), _errors_raised():
        config.hydra_errors_as_one_line(app)


def _register_sweeper() -> None:
    """Make ``hydra/sweeper=gatherlab`` known to Hydra. Hydra finds plugins by walking the
    ``hydra_plugins`` package, which an editable install (the repository's .venv) hides from it,
    so the sweeper is registered by hand (``Plugins.register``, public; an installed wheel's is
    also found by the walk)."""
    from hydra.core.plugins import Plugins

    from hydra_plugins.gatherlab_sweeper.sweeper import GatherlabSweeper

    Plugins.instance().register(GatherlabSweeper)


@contextlib.contextmanager
def _command_line(arguments: Sequence[str]) -> Iterator[None]:
    """``sys.argv`` as ``hydra.main`` reads it (its documented input), restored afterwards."""
    saved = sys.argv
    sys.argv = [saved[0] if saved else "gatherlab.train", *arguments]
    try:
        yield
    finally:
        sys.argv = saved


@contextlib.contextmanager
def _errors_raised() -> Iterator[None]:
    """Hydra's app raises what stops it (``HYDRA_FULL_ERROR=1``, documented) instead of printing
    it over several lines and exiting with status 1: the command line says it in one."""
    saved = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = saved
