"""A sweep in bf16 (docs/design.md §2, "Low precision"): each run against the 1-device reference in
floors of the sweep's floor run (``layout=cpu1_floor``, one device with its forward in two row
blocks), the floor's band on the comparison figure, and the refusals of the floor's layout."""

from __future__ import annotations

import pandas as pd
import pytest
from helpers import capture_figures, run_command

from gatherlab.analysis import report
from gatherlab.components import config
from gatherlab.core import floor
from gatherlab.lab import validation

# a bf16 sweep on 1, 2 and 4 ranks, seconds of training (make test-fast leaves it out)
pytestmark = pytest.mark.slow

SWEEP = ("-m", "experiment=bug_demo", "precision=bf16-mixed", "steps=10")


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> tuple[pd.DataFrame, str]:
    sweep = tmp_path_factory.mktemp("bf16") / "sweep"
    result = run_command(
        "train", *SWEEP, "layout=cpu1,cpu1_floor,cpu2,cpu4", f"hydra.sweep.dir={sweep}"
    )
    assert result.returncode == 0, result.stderr
    table = pd.read_csv(sweep / report.COMPARISON)
    return table, result.stdout


def test_a_bf16_sweep_judges_each_run_in_floors_of_its_floor_run(swept):
    table, printed = swept
    rows = table.set_index(["gather", "layout"])
    # one group: the first 1-device run is the reference, the other one device is it bit for bit
    assert rows.loc[("old", "cpu1"), "verdict"] == "reference"
    assert (rows.loc[("fixed", "cpu1"), ["verdict", "floors"]] == ["matches", 0.0]).all()
    for gather in ("old", "fixed"):
        # the floor against the reference is one floor, by its definition
        assert rows.loc[(gather, "cpu1_floor"), "floors"] == pytest.approx(1.0)
    for layout in ("cpu2", "cpu4"):
        exact, old = rows.loc[("fixed", layout)], rows.loc[("old", layout)]
        limit = floor.threshold(2, int(layout.removeprefix("cpu")))  # the floor run's 2 blocks
        assert exact["verdict"] == "matches" and exact["floors"] <= limit
        assert old["verdict"] == "differs" and old["floors"] > 4 * limit
        # measured, not by a fixed bound: the exact run's |Δloss| is bf16's, far above float64's
        assert exact["max_abs_loss_diff"] > 1e-5
    assert "floors (the floor)" in printed


def test_a_bf16_sweep_without_a_floor_run_says_what_to_add(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_command("train", *SWEEP, "gather=fixed", "layout=cpu1,cpu2",
                         f"hydra.sweep.dir={sweep}")  # fmt: skip
    table = pd.read_csv(sweep / report.COMPARISON).set_index("layout")
    assert table.loc["cpu2", "verdict"] == "not comparable"
    assert table.loc["cpu2", "error"] == (
        "no floor run for precision=bf16-mixed: add layout=cpu1_floor to the sweep "
        '(docs/design.md §2, "Low precision")'
    )
    assert result.returncode == 0


def test_the_comparison_figure_draws_the_floor_and_its_band(swept, tmp_path, monkeypatch):
    drawn = capture_figures(monkeypatch)
    sweep = tmp_path / "again"
    run_command("train", *SWEEP, "gather=fixed", "layout=cpu1,cpu1_floor,cpu2",
                f"hydra.sweep.dir={sweep}")  # fmt: skip
    figure = drawn["comparison"]
    diff_axis = figure.axes[1]
    labels = [line.get_label() for line in diff_axis.get_lines()]
    assert "floor: one device, 2 row blocks" in labels
    limit = floor.threshold(2, 2)  # the floor run's 2 row blocks, the group's 2 devices at most
    band = next(c for c in diff_axis.collections if c.get_label() == f"within {limit:g} floors")
    top = band.get_paths()[0].vertices[:, 1].max()
    table = pd.read_csv(sweep / report.COMPARISON).set_index("layout")
    floor_diff = table.loc["cpu1_floor", "max_abs_loss_diff"]
    assert top == pytest.approx(limit * floor_diff, rel=1e-6)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["experiment=bug_demo", "layout=cpu2", "layout.row_blocks=2"],
         "layout.row_blocks=2 is one device's floor run; allowed with 2 devices × 1 "
         "micro-batches: layout.row_blocks=1 (the floor: layout=cpu1_floor)"),
        (["experiment=simclr_digits", "layout=cpu1_floor"],
         "layout.row_blocks=2 with model.norm='global': the blocks would split batch norm's "
         "statistics; allowed: a model without batch norm (model=mlp, linear), or "
         "layout.row_blocks=1"),
        (["experiment=bug_demo", "precision=16-mixed", "layout=cpu1", "layout.accumulation=naive",
          "layout.micro_batches=2"],
         "precision=16-mixed with layout.accumulation=naive: its micro-batches' backwards apply "
         "no gradient scaler; allowed: layout.accumulation=none, or precision=bf16-mixed"),
        (["experiment=bug_demo", "precision=8-true"],
         "precision='8-true' is not allowed; allowed: 64-true, 32-true, bf16-mixed, 16-mixed, "
         "bf16-true"),
    ],
)  # fmt: skip
def test_the_floors_layout_is_refused_in_one_line_where_it_cannot_be_a_floor(overrides, message):
    with config.composed():
        cfg, _ = config.compose(overrides)
    with pytest.raises(validation.ConfigError) as refused:
        validation.validate(cfg)
    assert str(refused.value) == message
