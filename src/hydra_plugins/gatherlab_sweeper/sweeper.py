"""gatherlab's sweeper: Hydra's basic sweep, whose every job is composed once and shown to the task
before the first starts, written against Hydra's plugin interfaces only.

The jobs are those of Hydra's basic sweeper, in its order: ``params`` first, then the command
line's overrides, each sweep expanded (the first varying slowest; a later value of a key replaces
an earlier one in its place), launched in batches of ``max_batch_size``. Each job is composed once
with the config loader Hydra hands the sweeper; then, before any directory is written, the task
sees them all: when the task function has a ``compose_sweep(jobs, compose)`` method, that
composes the jobs (``compose`` composes one, from its overrides) and returns their configs, or
raises to stop the sweep (gatherlab's ``Command`` checks every job there). The sweeper then writes
``multirun.yaml`` and sets up the configured launcher with a context whose config loader hands out
those configs: a launcher composes each job through its context's loader (Hydra's launcher
interface), so the basic launcher runs each job on the config that was checked, not on a second
composition. Everything else (job numbers, each run's ``.hydra/``, the callbacks) is the
launcher's.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.config_loader import ConfigLoader
from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.object_type import ObjectType
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.errors import HydraException
from hydra.plugins.config_source import ConfigSource
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, RunMode, TaskFunction
from omegaconf import DictConfig, OmegaConf

__all__ = ["GatherlabSweeper"]


class GatherlabSweeper(Sweeper):
    """``hydra/sweeper=gatherlab`` (conf/hydra/sweeper/gatherlab.yaml): the basic sweeper's
    ``max_batch_size`` and ``params``, each job composed once and shown to the task first."""

    def __init__(self, max_batch_size: int | None = None, params: Any = None) -> None:
        if max_batch_size is not None and max_batch_size <= 0:
            raise HydraException(f"max_batch_size={max_batch_size}; allowed: a positive integer")
        self.max_batch_size = max_batch_size
        self.params = dict(params or {})
        self.hydra_context: HydraContext | None = None
        self.config: DictConfig | None = None
        self.launcher = None
        self.task_function: TaskFunction | None = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.hydra_context = hydra_context
        self.task_function = task_function
        self.config = config

    def jobs(self, arguments: Sequence[str]) -> list[list[str]]:
        """Each job's overrides, as Hydra's basic sweeper expands ``params`` and ``arguments``."""
        from gatherlab.components.config import sweep_jobs  # a gatherlab sweep runs: import it

        assert self.hydra_context is not None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        try:
            return sweep_jobs(self.params, arguments, parser)
        except ValueError as error:
            raise HydraException(str(error)) from None

    def sweep(self, arguments: list[str]) -> list[Sequence[Any]]:
        assert self.hydra_context is not None and self.config is not None
        assert self.task_function is not None
        loader = self.hydra_context.config_loader
        jobs = self.jobs(arguments)
        # Resolved before the jobs are composed, as the basic sweeper does: what ${now:...} gives
        # the sweep's directory goes into the resolvers' cache that each job's config copies.
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        compose = functools.partial(_compose, loader, self.config)
        compose_sweep = getattr(self.task_function, "compose_sweep", None)
        configs = compose_sweep(jobs, compose) if compose_sweep else [compose(j) for j in jobs]
        context = HydraContext(
            config_loader=_Composed(loader, jobs, configs), callbacks=self.hydra_context.callbacks
        )
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=context, task_function=self.task_function, config=self.config
        )
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        batch = self.max_batch_size or len(jobs) or 1
        returns = []
        for start in range(0, len(jobs), batch):
            results = self.launcher.launch(jobs[start : start + batch], initial_job_idx=start)
            for result in results:
                _ = result.return_value  # a job's exception ends the sweep, as the basic one's
            returns.append(results)
        return returns


def _compose(loader: ConfigLoader, master: DictConfig, job: Sequence[str]) -> DictConfig:
    return loader.load_sweep_config(master, list(job))


class _Composed(ConfigLoader):
    """The sweep's config loader, except that ``load_sweep_config`` hands out each job's config
    composed before (once; a job asked for again is composed again)."""

    def __init__(
        self, loader: ConfigLoader, jobs: Sequence[Sequence[str]], configs: Sequence[DictConfig]
    ) -> None:
        self._loader = loader
        self._configs: dict[tuple[str, ...], list[DictConfig]] = {}
        for job, cfg in zip(jobs, configs, strict=True):
            self._configs.setdefault(tuple(job), []).append(cfg)

    def load_sweep_config(self, master_config: DictConfig, sweep_overrides: list[str]) -> Any:
        composed = self._configs.get(tuple(sweep_overrides))
        if composed:
            return composed.pop(0)
        return self._loader.load_sweep_config(master_config, sweep_overrides)

    def load_configuration(
        self,
        config_name: str | None,
        overrides: list[str],
        run_mode: RunMode,
        from_shell: bool = True,
        validate_sweep_overrides: bool = True,
    ) -> DictConfig:
        return self._loader.load_configuration(
            config_name, overrides, run_mode, from_shell, validate_sweep_overrides
        )

    def get_search_path(self) -> ConfigSearchPath:
        return self._loader.get_search_path()

    def get_sources(self) -> list[ConfigSource]:
        return self._loader.get_sources()

    def list_groups(self, parent_name: str) -> list[str]:
        return self._loader.list_groups(parent_name)

    def get_group_options(
        self,
        group_name: str,
        results_filter: ObjectType | None = ObjectType.CONFIG,
        config_name: str | None = None,
        overrides: list[str] | None = None,
    ) -> list[str]:
        return self._loader.get_group_options(group_name, results_filter, config_name, overrides)

    def compute_defaults_list(
        self, config_name: str | None, overrides: list[str], run_mode: RunMode
    ) -> Any:
        return self._loader.compute_defaults_list(config_name, overrides, run_mode)
