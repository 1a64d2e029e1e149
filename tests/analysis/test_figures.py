"""The size benchmark's figure (``python -m gatherlab.bench size``), drawn by
`gatherlab.analysis.figures` from rows written here and read back from the Figure: each model and
precision against its parameters, the goals, the axes' scales. (The experiments' own figures:
tests/experiments/.)"""

from __future__ import annotations

import pandas as pd

from gatherlab.analysis import figures


def test_the_size_figure_draws_each_model_and_precision_against_its_parameters():
    # rows as python -m gatherlab.bench size writes them (its CSV's columns that the figure reads)
    rows = [
        ("vit", "1M", 1.0e6, "64-true", 4.0, 1.5, None),
        ("vit", "86M", 8.5e7, "64-true", 3.0, 3.2, None),
        ("vit", "1M", 1.0e6, "32-true", 9.0, 1.8, 1.10),
        ("vit", "86M", 8.5e7, "32-true", 8.0, 6.0, 1.01),
    ]
    table = pd.DataFrame(rows, columns=["model", "size", "parameters", "precision", "time_ratio",
                                        "memory_ratio", "record_ratio"])  # fmt: skip
    goals = {"check_time": 5.0, "check_memory": 4.0, "record": {"86M": 1.02}}
    figure = figures.size_cost_figure(table, goals)
    time_axis, memory_axis, record_axis = figure.axes
    lines = {line.get_label(): line for line in time_axis.get_lines()}
    assert list(lines["vit, float64"].get_xdata()) == [1.0e6, 8.5e7]
    assert list(lines["vit, float64"].get_ydata()) == [4.0, 3.0]
    assert list(lines["vit, float32"].get_ydata()) == [9.0, 8.0]
    assert list(lines["goal 5"].get_ydata()) == [5.0, 5.0]
    memory = {line.get_label(): line for line in memory_axis.get_lines()}
    assert list(memory["vit, float32"].get_ydata()) == [1.8, 6.0]
    recorded = [line for line in record_axis.get_lines() if line.get_label() == "vit"]
    assert [list(line.get_ydata()) for line in recorded] == [[1.10, 1.01]]  # float32 rows only
    assert time_axis.get_xscale() == "log" and time_axis.get_yscale() == "log"
    assert record_axis.get_yscale() == "linear"
