"""The loss matrix on real gloo groups (float64): with ``fixed``, 2 and 4 ranks train exactly like
one device for every loss whose class declares it invariant (docs/design.md §3), and measurably
differently for the two that do not (``dclw``, ``barlowtwins``); ``old`` breaks every loss, since
every one of them communicates through its gather with gradient."""

from __future__ import annotations

from pathlib import Path

import hydra.utils
import numpy as np
import pandas as pd
import pytest
from bounds import FLOAT64_BOUND, MISS_FACTOR, differences
from helpers import capture_figures, run_training
from omegaconf import OmegaConf

from gatherlab.analysis import report, results
from gatherlab.components import config
from gatherlab.core import runfiles

# The module's fixture trains 44 jobs (11 losses × 4 runs, ~15 s on an idle 2-core machine); the
# first test to use it pays for them within its own time limit. With the other test process and
# other programs on the two cores that can take three times as long, so its tests get 300 s
# instead of the suite's 120 s: a hung collective still fails by name (and times out at 60 s).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _predictions() -> dict[str, bool]:
    """Every configured loss of `gatherlab.losses` (its YAML files: a new one is tested without
    editing this file), with the invariance its class declares (``layout_invariant``,
    docs/design.md §3); ``user`` is a template for a loss named on the command line, not a loss,
    and a loss of torch's (``cross_entropy``: the pipeline's language model) takes no gather. The
    files are read, not composed: this runs when each test process collects the tests."""
    files = (config.CONFIG_DIR / "loss").glob("*.yaml")
    nodes = {path.stem: OmegaConf.load(path) for path in files}
    targets = {
        name: node._target_
        for name, node in sorted(nodes.items())
        if not OmegaConf.is_missing(node, "_target_")
        and node._target_.startswith("gatherlab.losses.")
    }
    assert "ntxent" in targets and "user" not in targets
    return {
        name: hydra.utils.get_class(target).layout_invariant for name, target in targets.items()
    }


PREDICTED_INVARIANT = _predictions()
# 3 steps, not the sweep's 40: exactness holds or fails from the first update (a per-rank
# statistic or old's missing gradient changes the first step), and the loss must move between
# the first and the last step; a job's time is mostly its composition and its pool round trips.
STEPS = 3


@pytest.fixture(scope="module")
def matrix_runs(tmp_path_factory) -> Path:
    """Every loss on cpu1, with ``fixed`` on cpu2 and cpu4 and with ``old`` on cpu2, as the
    loss_matrix sweep runs them (``STEPS`` steps), each in ``root/<loss>-<gather>-<layout>``."""
    root = tmp_path_factory.mktemp("loss_matrix")
    for loss in PREDICTED_INVARIANT:
        runs = (("fixed", "cpu1"), ("fixed", "cpu2"), ("fixed", "cpu4"), ("old", "cpu2"))
        for gather, layout in runs:
            run_training(
                root / f"{loss}-{gather}-{layout}",
                "experiment=loss_matrix",
                f"steps={STEPS}",
                f"loss={loss}",
                f"gather={gather}",
                f"layout={layout}",
            )
    return root


def test_the_built_in_losses_declare_the_predictions_of_the_design():
    # docs/design.md §3: of the built-in losses, exactly the two with per-rank statistics are not
    # layout-invariant; stated here independently of the classes' declarations
    assert {name for name, invariant in PREDICTED_INVARIANT.items() if not invariant} == {
        "dclw",
        "barlowtwins",
    }
    assert len(PREDICTED_INVARIANT) >= 10


@pytest.mark.parametrize("layout", ["cpu2", "cpu4"])
@pytest.mark.parametrize("loss", PREDICTED_INVARIANT)
def test_fixed_on_two_and_four_ranks_is_invariant_exactly_where_predicted(
    matrix_runs, loss, layout
):
    loss_diff, param_diff = differences(
        matrix_runs / f"{loss}-fixed-{layout}", matrix_runs / f"{loss}-fixed-cpu1"
    )
    if PREDICTED_INVARIANT[loss]:
        assert loss_diff <= FLOAT64_BOUND and param_diff <= FLOAT64_BOUND
    else:
        assert loss_diff >= MISS_FACTOR * FLOAT64_BOUND
        assert param_diff >= MISS_FACTOR * FLOAT64_BOUND


@pytest.mark.parametrize("loss", PREDICTED_INVARIANT)
def test_old_on_two_ranks_breaks_every_loss(matrix_runs, loss):
    loss_diff, param_diff = differences(
        matrix_runs / f"{loss}-old-cpu2", matrix_runs / f"{loss}-fixed-cpu1"
    )
    assert loss_diff >= MISS_FACTOR * FLOAT64_BOUND
    assert param_diff >= MISS_FACTOR * FLOAT64_BOUND


def test_the_report_writes_the_matrix_as_measured(matrix_runs, monkeypatch):
    # the comparison and its matrix; the sweep report around them (with its comparison figure)
    # is tested on the sweeps of test_extend.py and test_cli.py
    runs = results.load_runs(matrix_runs)
    table = report.compare_sweep(runs, matrix_runs).table
    figures = capture_figures(monkeypatch)
    report.write_loss_matrix(table, runs, matrix_runs)
    for name in ("loss_matrix.png", "loss_matrix.pdf", "loss_matrix.md"):
        assert (matrix_runs / name).stat().st_size > 0
    diff, matches, _ = report.loss_matrix(table)
    assert sorted(diff.index) == sorted(PREDICTED_INVARIANT)  # in run directory order
    cells = {
        ("fixed", 2, 16): "fixed-cpu2",
        ("fixed", 4, 8): "fixed-cpu4",
        ("old", 2, 16): "old-cpu2",
    }
    assert sorted(diff.columns) == sorted(cells)
    for loss in PREDICTED_INVARIANT:
        for cell, run in cells.items():
            measured, _ = differences(
                matrix_runs / f"{loss}-{run}", matrix_runs / f"{loss}-fixed-cpu1"
            )
            assert diff.loc[loss, cell] == measured
        for cell in (("fixed", 2, 16), ("fixed", 4, 8)):
            assert matches.loc[loss, cell] == PREDICTED_INVARIANT[loss]
        assert not matches.loc[loss, ("old", 2, 16)]
    _assert_matrix_figure_draws(figures[report.MATRIX], matrix_runs, list(diff.index))
    markdown = (matrix_runs / "loss_matrix.md").read_text().splitlines()
    rows = {line.split("|")[1].strip(" `"): line for line in markdown if line.startswith("| `")}
    assert rows.keys() == PREDICTED_INVARIANT.keys()
    assert "| **not** invariant | ✗" in rows["dclw"] and "| invariant | ✓" in rows["vicreg"]


def _assert_matrix_figure_draws(figure, root: Path, losses: list[str]) -> None:
    """What the loss-matrix figure drew, read back from its Figure: the heat map's array is max
    |Δloss| of each run's files against its loss's 1-device run (0 at the floor 1e-18), and each
    cell's text is ✓ exactly where design.md §3 predicts invariance (never for ``old``)."""
    axis = figure.axes[0]  # the matrix; the colour bar is the other
    [image] = axis.get_images()
    columns = (("fixed", 2), ("fixed", 4), ("old", 2))  # gather, ranks (global batch 32)
    assert [label.get_text() for label in axis.get_yticklabels()] == losses
    assert [label.get_text() for label in axis.get_xticklabels()] == [
        f"{gather}\n{ranks} × {32 // ranks}" for gather, ranks in columns
    ]
    drawn = np.asarray(image.get_array())
    texts = {(round(t.get_position()[1]), round(t.get_position()[0])): t for t in axis.texts}
    texts = {cell: text.get_text() for cell, text in texts.items()}
    assert drawn.shape == (len(losses), len(columns)) and len(texts) == drawn.size
    for row, loss in enumerate(losses):
        for column, (gather, ranks) in enumerate(columns):
            run = root / f"{loss}-{gather}-cpu{ranks}"
            measured, _ = differences(run, root / f"{loss}-fixed-cpu1")
            assert drawn[row, column] == max(measured, 1e-18)
            match = gather == "fixed" and PREDICTED_INVARIANT[loss]
            exact = "✓ 0" if measured == 0 else f"✓ {measured:.0e}"  # an exact 0 written 0
            assert texts[row, column] == (exact if match else f"✗ {measured:.2g}")


def test_every_loss_curve_is_finite_and_moves(matrix_runs):
    for loss in PREDICTED_INVARIANT:
        curves = pd.DataFrame(runfiles.read_curves(matrix_runs / f"{loss}-fixed-cpu1"))
        assert curves["loss"].notna().all() and curves["grad_norm"].gt(0).all()
        assert curves["loss"].iloc[-1] != curves["loss"].iloc[0]
