"""Load runs and sweeps into pandas. Notebooks and the report read run files only through here."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from gatherlab import runfiles

# Summary fields that become columns of the run table (the config itself stays in summary.json).
RUN_COLUMNS = (
    "experiment", "model", "loss", "data", "optim", "gather", "layout", "devices", "batch_size",
    "global_batch_size", "precision", "steps", "seed", "final_loss", "wall_s",
)  # fmt: skip


def override_values(overrides: list[str]) -> dict[str, str]:
    """``key=value`` command-line overrides as a mapping (``+``/``++`` prefixes dropped)."""
    pairs = (override.lstrip("+").split("=", 1) for override in overrides if "=" in override)
    return {key: value for key, value in pairs}


def load_runs(directory: str | Path) -> pd.DataFrame:
    """One row per run below ``directory``: its summary fields, its overrides, and ``run_dir``."""
    rows = []
    for run_dir in runfiles.find_runs(Path(directory)):
        summary = runfiles.read_summary(run_dir)
        row = {column: summary.get(column) for column in RUN_COLUMNS}
        row.update(_metrics(summary))
        row["overrides"] = override_values(summary.get("overrides", []))
        row["config"] = summary.get("config", {})
        row["run_dir"] = str(run_dir)
        rows.append(row)
    named = {*RUN_COLUMNS, "overrides", "config", "run_dir"}
    metrics = sorted({key for row in rows for key in row} - named)
    return pd.DataFrame(rows, columns=[*RUN_COLUMNS, *metrics, "overrides", "config", "run_dir"])


def _metrics(summary: dict) -> dict[str, float]:
    """Numbers a run reports beyond ``RUN_COLUMNS`` (an evaluation such as ``knn_accuracy``)."""
    return {
        key: value
        for key, value in summary.items()
        if key not in RUN_COLUMNS and isinstance(value, int | float) and not isinstance(value, bool)
    }


def load_curves(run_dir: str | Path) -> pd.DataFrame:
    """A run's ``curves.csv``: one row per optimizer step."""
    return pd.DataFrame(runfiles.read_curves(Path(run_dir)))
