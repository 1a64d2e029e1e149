"""The seed-averaged figures of experiments/downstream.py and experiments/lr_sweep.py, drawn by
each script's own ``figure`` (in the style of `gatherlab.analysis.figures`) from the committed
tables (figures/*.csv) and read back from the Figure: every point is the table's, each cell in its
gather's colour, the 1-device cells as the reference; and the Markdown the scripts write from
those tables is what figures/ holds."""

from __future__ import annotations

import sys

import matplotlib.collections
import matplotlib.colors
import pandas as pd
import pytest
from helpers import REPO

sys.path.insert(0, str(REPO / "experiments"))
import downstream
import lr_sweep

from gatherlab.analysis import figures

FIGURES = REPO / "figures"


@pytest.fixture(scope="module")
def lr_table() -> pd.DataFrame:
    return pd.read_csv(FIGURES / "lr_sweep.csv")


@pytest.fixture(scope="module")
def downstream_table() -> pd.DataFrame:
    return pd.read_csv(FIGURES / "downstream.csv")


def test_the_lr_sweep_markdown_is_the_committed_one(lr_table):
    base_lr, world_size = lr_sweep.experiment_lr_and_world_size()
    assert (base_lr, world_size) == (0.5, 4)
    text = lr_sweep.markdown(lr_sweep.cells(lr_table), lr_table, base_lr)
    assert text == (FIGURES / "lr_sweep.md").read_text()


def test_the_lr_sweep_figure_draws_each_cell_and_the_prediction(lr_table):
    summary = lr_sweep.cells(lr_table)
    figure = lr_sweep.figure(
        summary,
        {"ntxent_global": "global", "ntxent": "local"},
        gathers=("fixed", "old"),
        shifted={"ntxent_global": "old"},
        base_lr=0.5,
        world_size=4,
        title="lr sweep",
    )
    for axis, loss in zip(figure.axes, ("ntxent_global", "ntxent"), strict=True):
        lines = {line.get_label(): line for line in axis.get_lines()}
        cells = {gather: summary[(summary["loss"] == loss) & (summary["gather"] == gather)]
                 for gather in ("fixed", "old")}  # fmt: skip
        for gather, cell in cells.items():
            line = lines[f"{gather}, 4 ranks"]
            assert list(line.get_xdata()) == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0]
            assert list(line.get_ydata()) == list(cell["mean"])
            assert line.get_color() == figures.gather_color(gather)
        assert list(lines["the experiment's lr, 0.5"].get_xdata()) == [0.5, 0.5]
        if loss == "ntxent":  # biased: no learning rate predicts it
            assert not [label for label in lines if "drawn at" in label]
            continue
        shifted = lines["old, drawn at lr/4"]
        assert list(shifted.get_xdata()) == [0.0625, 0.125, 0.25, 0.5, 1.0, 2.0]
        assert list(shifted.get_ydata()) == list(cells["old"]["mean"])
        # the prediction the figure shows, in the committed table: old at lr·4 is fixed at lr
        assert list(cells["old"]["mean"])[2:] == list(cells["fixed"]["mean"])[:4]
    legend = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert legend == [
        "fixed, 4 ranks", "old, 4 ranks", "old, drawn at lr/4", "the experiment's lr, 0.5"
    ]  # fmt: skip


def test_the_downstream_markdown_table_is_the_committed_one(downstream_table):
    # the paragraph above the table names the baselines, which take training-free but slow
    # probes of 30 untrained networks (`python experiments/downstream.py --redraw` computes them)
    text = downstream.markdown(downstream_table, raw=0.0, untrained=[0.0])
    committed = (FIGURES / "downstream.md").read_text()
    assert text.split("\n\n", 1)[1] == committed.split("\n\n", 1)[1]
    assert "| old, 4 ranks (1/W) | 30 | 0.7442 ± 0.0067 | -0.0309 ± 0.0075 |" in committed


def test_the_downstream_figure_draws_every_seed_and_each_cell_in_its_colour(downstream_table):
    figure = downstream.figure(downstream_table, raw=0.64, untrained=[0.47, 0.52, 0.56])
    top, bottom = figure.axes
    cells = list(downstream_table["cell"])
    assert [label.get_text() for label in top.get_yticklabels()] == cells
    colors = ["black", "#1f77b4", "#d62728", "black", "#d62728"]  # reference, fixed, old
    seeds = [c for c in top.collections if isinstance(c, matplotlib.collections.PathCollection)]
    means = [line for line in top.get_lines() if line.get_marker() == "o"]
    for y, (_, row) in enumerate(downstream_table.iterrows()):
        accuracies = [float(value) for value in row["per_seed"].split()]
        assert [tuple(point) for point in seeds[y].get_offsets()] == [(a, y) for a in accuracies]
        assert tuple(seeds[y].get_facecolor()[0]) == matplotlib.colors.to_rgba(colors[y], 0.5)
        assert (list(means[y].get_xdata()), list(means[y].get_ydata())) == ([row["mean"]], [y])
        assert means[y].get_color() == colors[y]
    baselines = [line.get_label() for line in top.get_lines() if line.get_label()[0] != "_"]
    assert baselines == ["raw pixels 0.640", "untrained network 0.517"]
    assert top.get_title() == "3 seeds (dots), mean and 95% interval"
    assert [label.get_text() for label in bottom.get_yticklabels()] == [
        "fixed, 4 ranks (exact)",
        "old, 4 ranks (biased)\ndetectable (80%) ±0.009",
        "old, 4 ranks (1/W)\ndetectable (80%) ±0.011",
    ]
    differences = [line for line in bottom.get_lines() if line.get_marker() == "o"]
    distributed = downstream_table[downstream_table["devices"] > 1]
    assert [line.get_xdata()[0] for line in differences] == list(distributed["paired_diff"])
    assert [line.get_color() for line in differences] == colors[1:3] + colors[4:]
