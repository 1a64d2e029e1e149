"""notebooks/analysis.ipynb runs end to end against the session's small sweep (as CI does): every
cell executes, the verdict and the figures come out. The notebook's kernel is a fresh process, as
in Jupyter. It runs as a user opens it, with no ``SWEEP_DIR``: from the root of a checkout whose
``multirun/`` holds the sweep, it must find that sweep by itself."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys

import pytest
from bounds import FLOAT64_BOUND, MISS_FACTOR, differences
from helpers import REPO

from gatherlab.analysis import results
from gatherlab.core import runfiles

pytestmark = pytest.mark.slow
NOTEBOOK = REPO / "notebooks" / "analysis.ipynb"


def _jupyter():
    """nbformat and nbclient, imported by the tests that use them, not when every test process
    collects this file. nbformat imports jsonschema, whose import builds the grammar of its optional
    "iri" format check (rfc3987-syntax, a lark parser): 2–5 s here, for a check that nbformat never
    makes (it validates with a ``Draft4Validator`` without a format checker, and the notebook schema
    names no such format). That import is declined (``sys.modules[name] = None``: the import system
    raises ImportError, which jsonschema expects of an optional package), so the notebook is read,
    validated and run exactly as before, in 0.2 s."""
    sys.modules.setdefault("rfc3987_syntax", None)
    import nbformat
    from nbclient import NotebookClient

    return nbformat, NotebookClient


def test_notebook_is_stored_without_outputs():
    nbformat, _ = _jupyter()
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


@pytest.fixture(scope="module")
def root(pr1531_sweep, tmp_path_factory):
    """A checkout's root as the notebook sees it: the session's sweep under ``multirun/``, the
    newest of two (an older one, a copy, must not be taken)."""
    sweep, _ = pr1531_sweep
    root = tmp_path_factory.mktemp("checkout")
    older = shutil.copytree(sweep, root / "multirun" / "2026-01-01" / "00-00-00")
    os.utime(older / "comparison.csv", (0, 0))
    shutil.copytree(sweep, root / "multirun" / "2026-01-02" / "00-00-00")
    (root / "notebooks").mkdir()
    return root


@pytest.fixture(scope="module")
def executed(root):
    nbformat, NotebookClient = _jupyter()
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(root)}}
    ).execute()  # raises CellExecutionError if any cell fails
    return notebook


def test_without_sweep_dir_it_reads_the_newest_sweep_of_its_checkout(executed, root):
    printed = "".join(output["text"] for output in _outputs(executed, "stdout"))
    assert f"sweep: {root / 'multirun' / '2026-01-02' / '00-00-00'}\n" in printed


def test_opened_from_notebooks_it_finds_the_same_sweep(root, monkeypatch):
    # the notebook's own call, in the folder Jupyter opens it from
    monkeypatch.chdir(root / "notebooks")
    assert results.newest_sweep() == root / "multirun" / "2026-01-02" / "00-00-00"


def _outputs(notebook, kind: str) -> list:
    return [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if kind in output.get("data", {}) or output.get("name") == kind
    ]


def test_every_cell_runs_and_shows_the_verdict(executed, root):
    """The printed table, row by row, against the run files: the sweep is `old` and `fixed` on 1
    and 2 ranks (float64); `old` on 2 ranks misses its reference, `fixed` matches to rounding."""
    printed = "".join(output["text"] for output in _outputs(executed, "stdout"))
    assert "4 runs, 40 rows\n" in printed  # 4 runs of 10 steps
    rows = {
        int(run): (int(devices), int(batch), float(diff), outcome)
        for run, devices, batch, diff, outcome in re.findall(
            r"^(\d+): .*?\s(\d+) × (\d+)\s+(\S+)  (.+)$", printed, flags=re.MULTILINE
        )
    }
    assert [(r, rows[r][0], rows[r][3]) for r in sorted(rows)] == [
        (0, 1, "(reference)"), (1, 2, "NO"), (2, 1, "yes"), (3, 2, "yes"),
    ]  # fmt: skip
    sweep = root / "multirun" / "2026-01-02" / "00-00-00"
    for run in (1, 2, 3):  # the printed max |Δloss| (3 digits) is the run files' own
        loss_diff, param_diff = differences(sweep / str(run), sweep / "0")
        assert rows[run][2] == float(f"{loss_diff:.3g}"), (run, rows[run], loss_diff)
        if rows[run][3] == "yes":
            assert loss_diff <= FLOAT64_BOUND and param_diff <= FLOAT64_BOUND
        else:
            assert max(loss_diff, param_diff) >= MISS_FACTOR * FLOAT64_BOUND


def test_the_figures_are_drawn(executed):
    assert len(_outputs(executed, "image/png")) >= 2


def test_the_final_loss_figure_shows_each_runs_difference_from_its_reference(pr1531_sweep):
    """The notebook's second figure for a sweep over gathers and layouts, read back from the
    Figure: one bar per compared run, its length |final loss − the 1-device reference's| from the
    run files, on a log axis where `old` on 2 ranks lies beyond the match tolerance and `fixed`
    below it (exactly 0 on 1 device, rounding on 2)."""
    from gatherlab import report
    from gatherlab.analysis import figures

    notebook = json.loads(NOTEBOOK.read_text())
    assert "figures.final_loss_figure(table, tolerance)" in "".join(notebook["cells"][10]["source"])
    sweep, _ = pr1531_sweep
    table = report.compare_sweep(results.load_runs(sweep), sweep).table
    figure = figures.final_loss_figure(table, 1e-10)
    (axis,) = figure.axes
    ticks, names = axis.get_yticks(), [label.get_text() for label in axis.get_yticklabels()]
    at = dict(zip(ticks, names, strict=True))
    widths = {at[bar.get_y() + bar.get_height() / 2]: bar.get_width() for bar in axis.patches}
    assert axis.get_xscale() == "log"
    final = {run: runfiles.read_summary(sweep / run)["final_loss"] for run in "0123"}
    assert [at[tick] for tick in sorted(at, reverse=True)] == [  # top first: the table's order
        "old cpu2 (2 × 4)", "fixed cpu1 (1 × 8)", "fixed cpu2 (2 × 4)",
    ]  # fmt: skip
    assert len(widths) == 3
    assert widths["old cpu2 (2 × 4)"] == abs(final["1"] - final["0"]) > 1e-10 * MISS_FACTOR
    assert final["2"] == final["0"] and widths["fixed cpu1 (1 × 8)"] == figures.ZERO_FLOOR
    assert widths["fixed cpu2 (2 × 4)"] == max(abs(final["3"] - final["0"]), figures.ZERO_FLOOR)
    assert widths["fixed cpu2 (2 × 4)"] <= FLOAT64_BOUND
    lines = {line.get_label(): line.get_xdata()[0] for line in axis.get_lines()}
    assert lines["match tolerance 1e-10"] == 1e-10


def test_a_sweep_with_a_failed_run_loads_with_the_others(pr1531_sweep, tmp_path):
    # the notebook's first table: a failed run (as training writes it: a failed summary, no
    # curves, no weights) has no steps, and the other runs load with every step
    sweep = shutil.copytree(pr1531_sweep[0], tmp_path / "sweep")
    failed = sweep / "1"
    summary = runfiles.read_summary(failed)
    summary.update(status="failed", error="rank 1: RuntimeError: boom", failed_step=3)
    (failed / runfiles.SUMMARY).write_text(json.dumps(summary))
    (failed / runfiles.CURVES).unlink()
    (failed / runfiles.FINAL_STATE).unlink()

    curves = results.load_sweep(sweep)
    assert sorted(curves["run_dir"].unique()) == [str(sweep / n) for n in ("0", "2", "3")]
    assert curves.groupby("run_dir").size().tolist() == [summary["steps"]] * 3
    runs = results.load_runs(sweep).set_index("run_dir")
    assert runs.loc[str(failed), "status"] == "failed"
