"""notebooks/analysis.ipynb runs end to end against the session's small sweep (as CI does): every
cell executes, the verdict and the figures come out. The notebook's kernel is a fresh process, as
in Jupyter."""

from __future__ import annotations

import nbformat
import pytest
from helpers import REPO
from nbclient import NotebookClient

pytestmark = pytest.mark.slow
NOTEBOOK = REPO / "notebooks" / "analysis.ipynb"


def test_notebook_is_stored_without_outputs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


@pytest.fixture(scope="module")
def executed(pr1531_sweep):
    sweep, _ = pr1531_sweep  # the notebook only reads it
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    (parameters,) = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    parameters.source += f"\nSWEEP_DIR = {str(sweep)!r}"
    NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}
    ).execute()  # raises CellExecutionError if any cell fails
    return notebook


def _outputs(notebook, kind: str) -> list:
    return [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if kind in output.get("data", {}) or output.get("name") == kind
    ]


def test_every_cell_runs_and_shows_the_verdict(executed):
    printed = "".join(output["text"] for output in _outputs(executed, "stdout"))
    assert "matches" in printed and "NO" in printed and "yes" in printed


def test_the_figures_are_drawn(executed):
    assert len(_outputs(executed, "image/png")) >= 2
