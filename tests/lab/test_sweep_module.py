"""A user's own LightningModule in a sweep (``module=user``, ``data=user``): its runs are
compared with their 1-device references exactly as gatherlab's own module's, and the ``removals.*``
keys make each removal a group of its own, drawn as curves (docs/design.md §4, docs/contract.md
§5)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from helpers import run_command

from gatherlab.analysis import figures, report, results
from gatherlab.core import gradients

USER = (
    "module=user", "module._target_=ssl_modules:SimCLRWithBatchNorm",
    "data=user", "data.dataset._target_=ssl_modules:GaussianPairs",
)  # fmt: skip
SWEEP = (
    "-m", *USER, "layout=cpu1,cpu2", "removals.batchnorm=as_is,global", "steps=4",
    "global_batch_size=16", "precision=64-true", "log_every=0",
)  # fmt: skip


@pytest.mark.slow
def test_a_sweep_over_a_removal_attributes_the_difference_to_batch_norm(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_command("train", *SWEEP, f"hydra.sweep.dir={sweep}")
    assert result.returncode == 0, result.stderr[-3000:]

    table = pd.read_csv(sweep / report.COMPARISON)
    assert list(table["removals.batchnorm"]) == ["as_is", "global", "as_is", "global"]
    assert set(table["model"]) == {"ssl_modules:SimCLRWithBatchNorm"}
    by = {(row["removals.batchnorm"], row["devices"]): row for _, row in table.iterrows()}
    # each value of the removal is a group with its own 1-device reference
    assert by["as_is", 1]["verdict"] == by["global", 1]["verdict"] == "reference"
    assert by["as_is", 2]["reference"] == by["as_is", 1]["run_dir"]
    assert by["global", 2]["reference"] == by["global", 1]["run_dir"]
    # per-rank batch statistics: the 2-rank run is not the 1-device run; global ones: it is
    assert by["as_is", 2]["verdict"] == "differs"
    assert by["as_is", 2]["max_abs_loss_diff"] > 1e-6
    assert by["global", 2]["verdict"] == "matches"
    assert by["global", 2]["max_abs_loss_diff"] <= 1e-10
    assert by["global", 2]["max_abs_param_diff"] <= 1e-10

    # the run files are the same as for gatherlab's module: the table's numbers come from them
    for row in by.values():
        curves = results.load_curves(sweep / str(row["run_dir"]))
        assert list(curves["step"]) == [0, 1, 2, 3]
        assert curves["loss"].iloc[-1] == row["final_loss"]
        assert (curves["grad_norm"] > 0).all()
        reference = results.load_curves(sweep / str(row["reference"]))
        diff = float(np.abs(curves["loss"] - reference["loss"]).max())
        assert diff == row["max_abs_loss_diff"]

    # the printed comparison names the removal; the figure draws one panel row per value
    printed = (result.stderr + result.stdout).splitlines()
    assert any(line.startswith("2: as_is native cpu2") and line.endswith("NO") for line in printed)
    assert any(
        line.startswith("3: global native cpu2") and line.endswith("yes") for line in printed
    )
    assert (sweep / f"{report.FIGURE}.png").stat().st_size > 10_000
    compared = report.compare_sweep(results.load_runs(sweep), sweep)
    figure = figures.comparison_figure(
        compared.table, compared.curves, gradients.TOLERANCE["64-true"], compared.override_columns
    )
    titles = [axis.get_title() for axis in figure.axes[::2]]
    assert [title.rsplit(", ", 1)[-1] for title in titles] == [
        "removals.batchnorm=as_is", "removals.batchnorm=global",
    ]  # fmt: skip
    for loss_axis, value in zip(figure.axes[::2], ("as_is", "global"), strict=True):
        run_curves = results.load_curves(sweep / str(by[value, 2]["run_dir"]))
        reference = results.load_curves(sweep / str(by[value, 1]["run_dir"]))
        drawn = {line.get_label(): list(line.get_ydata()) for line in loss_axis.get_lines()}
        assert drawn == {
            "native, 2 × 8": list(run_curves["loss"]),
            "reference, 1 × 16": list(reference["loss"]),
        }


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ((*USER, "module._target_=ssl_modules:NotALightningModule"),
         "module (ssl_modules:NotALightningModule) built a NotALightningModule; allowed: a "
         "lightning.LightningModule"),
        ((*USER, "removals.batchnorm=sync"),
         "removals.batchnorm='sync' is not allowed; allowed: as_is, global"),
        (("removals.dropout=off",),
         "removals.dropout=off applies to module=user; allowed with module=contrastive: "
         "removals.dropout=on"),
        (("data=user", "data.dataset._target_=ssl_modules:GaussianPairs"),
         "data=user (a map-style data set read by index) serves module=user"),
    ],
    ids=["not-a-lightning-module", "unknown-value", "contrastive-removal", "contrastive-data"],
)  # fmt: skip
def test_a_bad_module_or_removal_is_one_line_before_any_rank(tmp_path, overrides, expected):
    result = run_command("train", *overrides, f"hydra.run.dir={tmp_path}/run")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"gatherlab.train: error: {expected}")
    assert not (tmp_path / "run").exists()
