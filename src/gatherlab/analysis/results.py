"""Load runs and sweeps into pandas. Notebooks and the report read run files only through here.

- ``load_sweep(paths)``: every run of one or more sweeps as a tidy table, one row per (run, step),
  with the run's config choices, sizes, evaluations and overrides as columns;
- ``load_run(run_dir)``: the same for one run;
- ``load_runs(directory)``: one row per run (summary fields, overrides, resolved config);
- ``load_comparison(sweep_dir)``: the sweep's comparison table (``comparison.csv``);
- ``newest_sweep(root)``: the most recent sweep directory (by default the nearest ``multirun/``),
  for notebooks.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from gatherlab.components import config
from gatherlab.core import runfiles

__all__ = [
    "load_comparison",
    "load_curves",
    "load_final_state",
    "load_run",
    "load_runs",
    "load_sweep",
    "newest_sweep",
]

# Summary fields that become columns of the run table (the config itself stays in summary.json).
RUN_COLUMNS = runfiles.SUMMARY_COLUMNS


# ``status``: ok, failed (training stopped; ``error`` says why) or unreadable (its summary).
STATUS_COLUMNS = ("status", "error")


def load_runs(directory: str | Path) -> pd.DataFrame:
    """One row per run below ``directory``, failed and unreadable runs included.

    Args:
        directory: a run, sweep or output directory; every directory below it that holds a
            ``summary.json`` is a run.

    Returns:
        A pandas DataFrame, one row per run (numbered directories by number), with the summary
        fields of docs/contract.md §5 (``runfiles.SUMMARY_COLUMNS``: ``experiment`` …
        ``loss_layout_invariant``), any further numeric summary field (``knn_accuracy``,
        ``failed_step``, …) sorted by name, then ``status`` (ok, failed or unreadable),
        ``error``, ``overrides`` (a dict ``key → value``), ``config`` (the resolved config as a
        dict) and ``run_dir``. No run gives an empty table with these columns.

    Example:
        >>> from gatherlab.analysis.results import load_runs
        >>> runs = load_runs("multirun")  # every run below multirun/: here, one sweep of 4
        >>> runs[["gather", "layout", "status"]]
          gather layout status
        0    old   cpu1     ok
        1    old   cpu2     ok
        2  fixed   cpu1     ok
        3  fixed   cpu2     ok
        >>> runs[runs["status"] != "ok"][["run_dir", "error"]]  # the failed runs, and why: none
        Empty DataFrame
        Columns: [run_dir, error]
        Index: []
    """
    rows = []
    for run_dir in runfiles.find_runs(Path(directory)):
        try:
            summary = runfiles.read_summary(run_dir)
            if not isinstance(summary, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as error:  # reported per run; the rest is still compared
            summary = {"status": "unreadable", "error": f"{runfiles.SUMMARY}: {error}"}
        row = {column: summary.get(column) for column in RUN_COLUMNS}
        row.update(_metrics(summary))
        row["status"] = summary.get("status", "ok")  # summaries before statuses were all ok
        row["strategy"] = summary.get("strategy", "ddp")  # and before strategies all DDP's
        row["error"] = summary.get("error")
        row["overrides"] = config.override_values(summary.get("overrides", []))
        row["config"] = summary.get("config", {})
        row["run_dir"] = str(run_dir)
        rows.append(row)
    named = {*RUN_COLUMNS, *STATUS_COLUMNS, "overrides", "config", "run_dir"}
    metrics = sorted({key for row in rows for key in row} - named)
    columns = [*RUN_COLUMNS, *metrics, *STATUS_COLUMNS, "overrides", "config", "run_dir"]
    return pd.DataFrame(rows, columns=columns)


def _metrics(summary: dict) -> dict[str, float]:
    """Numbers a run reports beyond ``RUN_COLUMNS`` (an evaluation such as ``knn_accuracy``)."""
    return {
        key: value
        for key, value in summary.items()
        if key not in RUN_COLUMNS and isinstance(value, int | float) and not isinstance(value, bool)
    }


def load_curves(run_dir: str | Path) -> pd.DataFrame:
    """A run's ``curves.csv``: one row per optimizer step.

    Args:
        run_dir: the run's directory.

    Returns:
        A pandas DataFrame with the columns ``step`` (0-based), ``loss`` and ``grad_norm``.

    Raises:
        FileNotFoundError: the run has no ``curves.csv`` (a failed run has none).
    """
    return pd.DataFrame(runfiles.read_curves(Path(run_dir)))


def load_final_state(run_dir: str | Path) -> dict:
    """A run's final weights (``final_state.pt``): parameter name → CPU tensor.

    Args:
        run_dir: the run's directory.

    Returns:
        The model's ``state_dict()`` after training, loaded with ``weights_only=True``.

    Raises:
        FileNotFoundError: the run has no ``final_state.pt`` (a failed run has none).
    """
    return runfiles.read_final_state(Path(run_dir))


def load_run(run_dir: str | Path) -> pd.DataFrame:
    """One run as a tidy table, one row per optimizer step.

    Args:
        run_dir: the run's directory (its ``summary.json`` and ``curves.csv``).

    Returns:
        A pandas DataFrame: ``step, loss, grad_norm``, then, repeated on every row, the summary
        fields of `load_runs` (the loss config choice renamed ``loss_function``, since ``loss``
        is the value at each step), its further numeric summary fields, one column per override
        key that is not already a column, and ``run_dir``.

    Raises:
        FileNotFoundError: the run has no ``summary.json`` or no ``curves.csv`` (a failed run
            has no curves).
        ValueError: ``summary.json`` is not valid JSON (``json.JSONDecodeError``).

    Example:
        >>> from gatherlab.analysis.results import load_run, newest_sweep
        >>> run = load_run(newest_sweep() / "1")  # or a single run's outputs/<date>/<time>
        >>> run[["step", "loss", "gather", "layout"]].head(3)
           step      loss gather layout
        0     0  2.725138    old   cpu2
        1     1  2.724713    old   cpu2
        2     2  2.724292    old   cpu2
        >>> axes = run.plot(x="step", y="loss")
    """
    run_dir = Path(run_dir)
    summary = runfiles.read_summary(run_dir)
    curves = load_curves(run_dir)
    info = {column: summary.get(column) for column in RUN_COLUMNS} | _metrics(summary)
    info["loss_function"] = info.pop("loss")
    for key, value in config.override_values(summary.get("overrides", [])).items():
        info.setdefault(key, value)
    info["run_dir"] = str(run_dir)
    for column, value in info.items():
        if column not in curves:
            curves[column] = value
    return curves


def load_sweep(paths: str | Path | Iterable[str | Path]) -> pd.DataFrame:
    """Every run below one sweep directory (or several) as one tidy table.

    Args:
        paths: a sweep directory, or several.

    Returns:
        A pandas DataFrame, one row per (run, step): the columns of `load_run` (empty where a
        run lacks one) and ``sweep``, the directory as given. A failed run has no steps, so no
        rows (`load_runs` lists it, with its error).

    Raises:
        FileNotFoundError: no finished run below any of ``paths``, or a run that says ``ok``
            without its ``curves.csv``.
        ValueError: a run's ``summary.json`` is not valid JSON.

    Example:
        >>> from gatherlab.analysis.results import load_sweep, newest_sweep
        >>> curves = load_sweep(newest_sweep())
        >>> curves.groupby(["gather", "layout"])["loss"].last()
        gather  layout
        fixed   cpu1      2.722102
                cpu2      2.722102
        old     cpu1      2.722102
                cpu2      2.721418
        Name: loss, dtype: float64
    """
    paths = [paths] if isinstance(paths, str | Path) else list(paths)
    frames = []
    for sweep in paths:
        for run_dir in runfiles.find_runs(Path(sweep)):
            if runfiles.read_summary(run_dir).get("status") == "failed":
                continue  # no curves: training stopped
            frame = load_run(run_dir)
            frame["sweep"] = str(sweep)
            frames.append(frame)
    if not frames:
        raise FileNotFoundError(f"no run that finished ({runfiles.SUMMARY}: ok) below {paths}")
    return pd.concat(frames, ignore_index=True)


def load_comparison(sweep_dir: str | Path) -> pd.DataFrame:
    """The comparison table a sweep's report wrote (``python -m gatherlab.report`` makes it).

    Args:
        sweep_dir: the sweep directory.

    Returns:
        ``comparison.csv`` as a pandas DataFrame, one row per run (its columns are listed in
        docs/contract.md §5; ``run_dir`` and ``reference`` are relative to ``sweep_dir``).

    Raises:
        FileNotFoundError: ``sweep_dir`` holds no ``comparison.csv``; the message names the
            command that writes it.

    Example:
        >>> from gatherlab.analysis.results import load_comparison, newest_sweep
        >>> table = load_comparison(newest_sweep())
        >>> table[["run_dir", "gather", "layout", "verdict", "reference"]]
           run_dir gather layout    verdict  reference
        0        0    old   cpu1  reference          0
        1        1    old   cpu2    differs          0
        2        2  fixed   cpu1    matches          0
        3        3  fixed   cpu2    matches          0
    """
    path = Path(sweep_dir) / runfiles.COMPARISON
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist; run python -m gatherlab.report {sweep_dir}"
        )
    return pd.read_csv(path)


# What finds a sweep where none is: one run first.
_SWEEP_FIRST = "run a sweep first (make demo, or python -m gatherlab.train -m ...)"


def newest_sweep(root: str | Path | None = None) -> Path:
    """The most recently finished sweep below ``root``: the directory with the newest
    ``comparison.csv``.

    Args:
        root: where to search, at any depth. None: the ``multirun`` folder of the working
            directory or, failing that, of its nearest parent that has one, so that a notebook
            opened from ``notebooks/`` finds the repository's sweeps as one opened from the root.

    Returns:
        The directory holding the ``comparison.csv`` modified last.

    Raises:
        FileNotFoundError: no ``comparison.csv`` below ``root`` (or no ``multirun`` folder).

    Example:
        >>> from gatherlab.analysis.results import newest_sweep
        >>> sweep = newest_sweep()  # multirun/ here or in a parent directory
        >>> (sweep / "comparison.csv").exists()
        True
    """
    if root is None:
        here = Path.cwd()
        folders = [p / "multirun" for p in (here, *here.parents) if (p / "multirun").is_dir()]
        if not folders:
            raise FileNotFoundError(f"no multirun/ folder in {here} or its parents; {_SWEEP_FIRST}")
        root = folders[0]
    found = sorted(Path(root).rglob(runfiles.COMPARISON), key=lambda path: path.stat().st_mtime)
    if not found:
        raise FileNotFoundError(
            f"no finished sweep (no {runfiles.COMPARISON}) below {root}; {_SWEEP_FIRST}"
        )
    return found[-1].parent
