"""What happens when a sweep of ``python -m gatherlab.train -m`` ends: Hydra callbacks
(conf/config.yaml, ``hydra.callbacks``) that write the sweep's report and close its worker pools."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

__all__ = ["ClosePools", "ReportOnMultirunEnd"]

log = logging.getLogger(__name__)


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
            compared = report.write_report(sweep_dir)
        except FileNotFoundError as error:
            log.error("no report: %s", error)
            return
        log.info(
            "comparison of %d runs:\n%s", len(compared.table), report.comparison_text(compared)
        )
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
