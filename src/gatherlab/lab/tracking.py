"""Weights & Biases tracking (``logger=wandb``): one wandb run per job, grouped by sweep, named by
the job's overrides, the resolved config as its config, the loss and gradient norm of every step
logged against the step; and, when a sweep ends, its figures and comparison table in one more run.

Runs are logged from the run files after training (what a run writes on disk is the record; wandb
mirrors it), so the ranks never talk to wandb. ``WANDB_MODE`` unset means offline: nothing
leaves the machine and ``wandb sync <dir>`` uploads later; ``WANDB_MODE=online`` (or any value
the user sets) wins. wandb writes only below the directory it is given (its ``wandb/`` folder,
cache and settings included), and each run ends its wandb service, so no process outlives it.
A tracking failure is logged and never fails a run whose files are written.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from gatherlab.core import runfiles

log = logging.getLogger(__name__)

# wandb's own settings directories, pointed into the directory being logged.
_DIRECTORIES = {
    "WANDB_CACHE_DIR": "cache",
    "WANDB_CONFIG_DIR": "config",
    "WANDB_DATA_DIR": "data",
    "WANDB_ARTIFACT_DIR": "artifacts",
}
INIT_TIMEOUT_S = 60


def mode() -> str:
    """The wandb mode: the user's ``WANDB_MODE``, offline when it is unset."""
    return os.environ.get("WANDB_MODE") or "offline"


@contextlib.contextmanager
def _inside(directory: Path) -> Iterator[None]:
    """wandb's cache, settings and staging directories below ``directory/wandb`` meanwhile."""
    saved = {name: os.environ.get(name) for name in (*_DIRECTORIES, "WANDB_MODE")}
    os.environ.update({name: str(directory / "wandb" / sub) for name, sub in _DIRECTORIES.items()})
    os.environ["WANDB_MODE"] = mode()  # an empty WANDB_MODE counts as unset
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _wandb_run(directory: Path, **init: Any) -> Iterator[Any]:
    """A finished-on-exit wandb run writing below ``directory``; its service ends with it."""
    import wandb

    with _inside(directory):
        settings = wandb.Settings(
            silent=True,
            console="off",
            disable_git=True,
            x_disable_stats=True,
            init_timeout=INIT_TIMEOUT_S,
        )
        run = wandb.init(dir=str(directory), settings=settings, reinit="finish_previous", **init)
        try:
            yield run
        finally:
            run.finish()
            wandb.teardown()


def group_name(directory: str | Path) -> str:
    """The wandb group of the runs in a sweep directory (or of a single run's directory): its
    last two path parts, ``<date>/<time>`` with Hydra's default layout."""
    directory = Path(directory)
    return f"{directory.parent.name}/{directory.name}"


def run_name(overrides: Sequence[str]) -> str:
    """A wandb run name from a job's overrides: ``gather=old,layout=cpu2`` (experiment left out,
    since the group already says it)."""
    shown = [o for o in overrides if not o.lstrip("+").startswith(("experiment=", "hydra."))]
    return ",".join(shown) or "defaults"


def log_run(
    run_dir: Path,
    summary: Mapping[str, Any],
    curves: Mapping[str, Sequence[float]],
    group: str,
    project: str = "gatherlab",
    entity: str | None = None,
    tags: Sequence[str] = (),
) -> None:
    """Mirror a finished run into wandb: its config, every step's loss and grad norm, its summary
    numbers (final loss, evaluations)."""
    try:
        with _wandb_run(
            Path(run_dir),
            project=project,
            entity=entity,
            group=group,
            name=run_name(summary.get("overrides", [])),
            job_type="train",
            tags=list(tags),
            config=summary.get("config", {}),
        ) as run:
            for step, loss, grad_norm in zip(
                curves["step"], curves["loss"], curves["grad_norm"], strict=True
            ):
                run.log({"loss": loss, "grad_norm": grad_norm}, step=int(step))
            for key, value in summary.items():
                if isinstance(value, int | float | str) and not isinstance(value, bool):
                    run.summary[key] = value
    except Exception as error:  # the run's files are written; tracking must not fail it
        log.warning("wandb: run %s not logged: %s: %s", run_dir, type(error).__name__, error)


def log_sweep(
    sweep_dir: Path,
    group: str,
    project: str = "gatherlab",
    entity: str | None = None,
    tags: Sequence[str] = (),
) -> None:
    """Upload a finished sweep's figures (every PNG in its directory) and comparison table as
    media of one ``report`` run in the sweep's group."""
    import pandas as pd
    import wandb

    sweep_dir = Path(sweep_dir)
    try:
        with _wandb_run(
            sweep_dir,
            project=project,
            entity=entity,
            group=group,
            name="report",
            job_type="report",
            tags=list(tags),
        ) as run:
            media: dict[str, Any] = {
                path.stem: wandb.Image(str(path)) for path in sorted(sweep_dir.glob("*.png"))
            }
            comparison = sweep_dir / runfiles.COMPARISON
            if comparison.exists():
                media["comparison_table"] = wandb.Table(dataframe=pd.read_csv(comparison))
            run.log(media)
    except Exception as error:
        log.warning("wandb: sweep %s not logged: %s: %s", sweep_dir, type(error).__name__, error)
