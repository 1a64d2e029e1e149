"""The size benchmark's figure (``python -m gatherlab.bench size``), drawn by
`gatherlab.analysis.figures` from rows written here and read back from the Figure: each model and
precision against its parameters, the goals, the axes' scales. (The experiments' own figures:
tests/experiments/.)"""

from __future__ import annotations

import pandas as pd

from gatherlab.analysis import figures


def test_the_size_figure_draws_each_model_and_precision_against_its_parameters():
    # rows as python -m gatherlab.bench size writes them (its CSV's columns that the figure reads):
    # float32 at 86M both ways, by default (auto: floors alone) and with the float64 verdict
    rows = [
        ("vit", "1M", 1.0e6, "64-true", "auto", 4.0, 1.5, None),
        ("vit", "86M", 8.5e7, "64-true", "auto", 3.0, 3.2, None),
        ("vit", "1M", 1.0e6, "32-true", "auto", 9.0, 1.8, 1.10),
        ("vit", "86M", 8.5e7, "32-true", "auto", 4.5, 2.5, 1.01),
        ("vit", "86M", 8.5e7, "32-true", "float64", 15.0, 6.0, None),
        ("vit", "1M", 1.0e6, "32-true", "floors", 5.0, 1.4, None),
    ]
    table = pd.DataFrame(rows, columns=["model", "size", "parameters", "precision", "judge_in",
                                        "time_ratio", "memory_ratio", "record_ratio"])  # fmt: skip
    goals = {"check_time": 5.0, "check_memory": 4.0, "record": {"86M": 1.02},
             "floors_alone": 2e7}  # fmt: skip
    figure = figures.size_cost_figure(table, goals)
    time_axis, memory_axis, record_axis = figure.axes
    lines = {line.get_label(): line for line in time_axis.get_lines()}
    assert list(lines["vit, float64"].get_xdata()) == [1.0e6, 8.5e7]
    assert list(lines["vit, float64"].get_ydata()) == [4.0, 3.0]
    assert list(lines["vit, float32"].get_ydata()) == [9.0, 4.5]
    assert lines["vit, float32"].get_linestyle() == "-"
    other = lines["vit, float32, float64 verdict"]
    assert (list(other.get_ydata()), other.get_linestyle()) == ([15.0], ":")
    assert list(lines["vit, float32, floors alone"].get_xdata()) == [1.0e6]
    assert list(lines["goal 5"].get_ydata()) == [5.0, 5.0]
    assert list(lines["floors alone from 20M"].get_xdata()) == [2e7, 2e7]
    memory = {line.get_label(): line for line in memory_axis.get_lines()}
    assert list(memory["vit, float32"].get_ydata()) == [1.8, 2.5]
    recorded = [line for line in record_axis.get_lines() if line.get_label() == "vit"]
    assert [list(line.get_ydata()) for line in recorded] == [[1.10, 1.01]]  # float32 rows only
    assert time_axis.get_xscale() == "log" and time_axis.get_yscale() == "log"
    assert record_axis.get_yscale() == "linear"


def test_a_size_table_without_modes_is_drawn_as_the_default_mode():
    # a CSV written before the benchmark measured both modes: every row as the check ran then
    rows = [("resnet", "1M", 1.0e6, "32-true", 9.0, 1.8, 1.10),
            ("resnet", "86M", 8.5e7, "32-true", 14.5, 5.7, 0.95)]  # fmt: skip
    table = pd.DataFrame(rows, columns=["model", "size", "parameters", "precision", "time_ratio",
                                        "memory_ratio", "record_ratio"])  # fmt: skip
    figure = figures.size_cost_figure(table, {"check_time": 5.0, "check_memory": 4.0,
                                              "record": {}})  # fmt: skip
    lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
    assert list(lines["resnet, float32"].get_ydata()) == [9.0, 14.5]
