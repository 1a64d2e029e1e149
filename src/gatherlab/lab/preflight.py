"""Every job of ``python -m gatherlab.train`` checked before the first starts.

A bad value fails with ``ConfigError`` (one line; the command line prints it and exits with status
2) before Hydra writes a run or sweep directory and before any worker starts. Each job's config is
Hydra's own composition, checked as it will run (``validate_job``): a single run's by the
``ValidateRun`` callback (Hydra calls ``on_run_start`` with the run's config before it creates the
run's directory), a sweep's by ``validated_configs``, which the command's ``compose_sweep`` calls
when gatherlab's sweeper (src/hydra_plugins/gatherlab_sweeper) shows it the jobs before their
directory exists. A large sweep is composed and checked on all cores.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from gatherlab.components import config
from gatherlab.components.config import ConfigError
from gatherlab.core import cli, runfiles
from gatherlab.lab import validation

# What a job needs (Lightning, pandas, matplotlib: seconds to import) is imported once the checks
# have passed, or beside the composers of a large sweep, so that a bad value is answered at once.

__all__ = ["COMMAND", "ValidateRun", "validate_job", "validated_configs", "warn"]

# How a user starts the command line these jobs are checked for (an experiment's run_by names the
# one that runs it).
COMMAND = "python -m gatherlab.train"
# A sweep of at least this many jobs is composed and checked on all cores (``validated_configs``):
# composing a job takes Hydra ~0.08 s, checking it ~0.02 s, forking and sending configs back ~0.1 s.
PARALLEL_COMPOSITION = 16

Compose = Callable[[Sequence[str]], DictConfig]


def validate_job(cfg: DictConfig) -> DictConfig:
    """A composed job config (with its ``hydra`` node), checked: the first bad value raises
    ``ConfigError``."""
    validation.validate_command(cfg, cfg.hydra.runtime.choices.get("experiment"), COMMAND)
    validation.validate(cfg)
    return cfg


def warn(configs: Sequence[DictConfig]) -> None:
    """Warn, once per warning, of what runs but runs slowly."""
    warnings = (validation.machine_warning(cfg) for cfg in configs)
    for warning in dict.fromkeys(w for w in warnings if w):
        print(f"gatherlab.train: warning: {warning}", file=sys.stderr)


class ValidateRun(Callback):
    """Hydra callback (conf/config.yaml): a single run's config checked before Hydra creates its
    directory; a bad value ends the command there (``cli.fail``: Hydra turns a callback's
    exception into a warning and goes on, not an exit). A sweep's jobs are checked before its
    directory exists by gatherlab's sweeper, which shows them to the command
    (``validated_configs``)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            validate_job(config)
            runfiles.refuse_finished(Path(config.hydra.run.dir))
        except (ConfigError, runfiles.RunFinished) as error:
            cli.fail("train", error)
        warn([config])


def validated_configs(jobs: Sequence[Sequence[str]], compose: Compose) -> list[DictConfig]:
    """Each job's config, composed by ``compose`` and validated (``validate_job``), in the jobs'
    order, and the warnings of them all; the first bad value raises ``ConfigError``.

    A large sweep on a machine of several cores is split among processes forked from this one
    (each does its share as this one would: the same Hydra state, copied by the fork), while this
    one imports what the jobs run. A config keeps its resolvers' cache (what ``${now:...}`` gave
    the sweep's directory) through the pickle that brings it back."""
    cores = _cores()
    if len(jobs) < PARALLEL_COMPOSITION or cores < 2:
        configs = [_checked_one(job, compose) for job in jobs]
    else:
        configs = _checked_in_parallel(jobs, compose, cores)
    warn(configs)
    return configs


# What a forked composer composes with: set for the time of the fork, which copies it (the jobs
# travel to the composers as their overrides; the function, Hydra's loader and the sweep's config,
# never pickled, come with the fork).
_compose: Compose | None = None


def _checked_in_parallel(
    jobs: Sequence[Sequence[str]], compose: Compose, cores: int
) -> list[DictConfig]:
    first = _checked_one(jobs[0], compose)  # Hydra's first composition warms what forks share
    global _compose
    _compose = compose
    try:
        with multiprocessing.get_context("fork").Pool(cores, initializer=_start_composer) as pool:
            chunk = -(-(len(jobs) - 1) // cores)
            pending = pool.map_async(_checked_one, jobs[1:], chunksize=chunk)
            _import_job_modules()
            rest = pending.get()
    finally:
        _compose = None
    return [first, *rest]


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def _import_job_modules() -> None:
    """Import what the jobs run (Lightning: seconds), beside the composers of a large sweep."""
    from gatherlab.lab import audit, jobs  # noqa: F401


def _start_composer() -> None:
    """A forked composer leaves Ctrl-C to the command, which ends it (the pool's pipes close), and
    runs torch on one thread: OpenMP (libgomp) does not survive a fork, and a parallel region in
    the fork of a process whose OpenMP threads ran (building a data set to check its size does)
    waits forever for threads that were not forked."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if "torch" in sys.modules:  # imported by a check the first job ran here; else not needed
        sys.modules["torch"].set_num_threads(1)


def _checked_one(job: Sequence[str], compose: Compose | None = None) -> DictConfig:
    compose = compose or _compose
    assert compose is not None
    return validate_job(config.hydra_errors_as_one_line(compose, job))
