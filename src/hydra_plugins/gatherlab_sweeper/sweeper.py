"""Hydra's basic sweeper, with every job composed once and checked before anything is written.

Hydra's basic sweeper composes each job twice (``validate_batch_is_legal``, then its launcher).
This sweeper expands the sweep exactly as the basic sweeper does (it is one), composes each job
once with Hydra's own ``load_sweep_config``, hands the jobs to the function its ``check`` names
(``gatherlab.lab.train.check_sweep``: a bad value is one line and exit status 2, before any
directory is written or worker started), and lets the basic launcher run those same configs instead
of composing them again. Everything else (``multirun.yaml``, job numbers, each run's ``.hydra/``,
the callbacks) is the basic sweeper's and launcher's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import HydraContext
from hydra.utils import get_method
from omegaconf import DictConfig

Compose = Callable[[Sequence[str]], DictConfig]


class GatherlabSweeper(BasicSweeper):
    """``hydra/sweeper=gatherlab``: the basic sweeper (``max_batch_size``, ``params``) whose jobs
    are composed once and checked, all of them, by ``check`` (an import path of a function of the
    jobs' overrides and a ``compose`` of one job that returns their configs) before the first
    starts."""

    def __init__(
        self, check: str, max_batch_size: int | None, params: dict[str, str] | None = None
    ) -> None:
        super().__init__(max_batch_size=max_batch_size, params=params)
        self.check: Callable[[list[list[str]], Compose], list[DictConfig]] = get_method(check)
        self._composed: set[tuple[str, ...]] = set()

    def sweep(self, arguments: list[str]) -> Any:
        assert self.hydra_context is not None and self.config is not None
        loader = self.hydra_context.config_loader
        parsed = OverridesParser.create(config_loader=loader).parse_overrides(
            [*self._parse_config(), *arguments]
        )  # as BasicSweeper.sweep expands them
        jobs = [job for batch in self.split_arguments(parsed, self.max_batch_size) for job in batch]
        # Resolved before the jobs are composed, as the basic sweeper does before it launches
        # them: what ${now:...} gives goes into the resolvers' cache that each job copies.
        str(self.config.hydra.sweep.dir)
        configs = self.check(jobs, lambda job: loader.load_sweep_config(self.config, list(job)))
        self._composed = {tuple(job) for job in jobs}
        if type(self.launcher) is BasicLauncher:  # it composes in this process: hand it the configs
            assert self.launcher.hydra_context is not None
            self.launcher.hydra_context = HydraContext(
                config_loader=_Composed(loader, dict(zip(map(tuple, jobs), configs, strict=True))),
                callbacks=self.launcher.hydra_context.callbacks,
            )
        return super().sweep(arguments)

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        """Hydra's early check of a batch; the jobs ``sweep`` composed are not composed again."""
        super().validate_batch_is_legal([job for job in batch if tuple(job) not in self._composed])


class _Composed:
    """Hydra's config loader, except that ``load_sweep_config`` hands out each job's config that
    the sweeper composed (once; a job asked for again is composed again)."""

    def __init__(self, loader: Any, configs: dict[tuple[str, ...], DictConfig]) -> None:
        self._loader = loader
        self._configs = configs

    def load_sweep_config(self, master_config: DictConfig, sweep_overrides: list[str]) -> Any:
        composed = self._configs.pop(tuple(sweep_overrides), None)
        if composed is not None:
            return composed
        return self._loader.load_sweep_config(master_config, sweep_overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
