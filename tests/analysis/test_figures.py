"""The size benchmark's figure (``python -m gatherlab.bench size``), drawn by
`gatherlab.analysis.figures` from rows written here and read back from the Figure: each model and
precision against its parameters, the goals, the axes' scales; the comparison's log axis labelled
in plain text. (The experiments' own figures: tests/experiments/.)"""

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


def test_a_comparisons_log_axis_labels_its_ticks_in_plain_text():
    """The comparison figure's difference axis (`figures.PlainPowers`): each decade and each
    labelled tick between decades written as its value is, 10⁻¹⁰ and 3×10⁻⁵, with Unicode
    superscripts and no mathtext (a ``$`` in a label is laid out as mathtext, 0.3 s a figure)."""
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots()
    axis.set_yscale("log")
    formatter = figures.PlainPowers()
    formatter.set_axis(axis.yaxis)
    axis.set_ylim(1e-17, 1e-3)
    formatter.set_locs([1e-16, 1e-10, 1e-4])
    assert [formatter(x) for x in (1e-16, 1e-10, 1.0, 10.0)] == ["10⁻¹⁶", "10⁻¹⁰", "10⁰", "10¹"]
    axis.set_ylim(2e-5, 9e-5)  # under one decade: the ticks between decades are labelled
    between = figures.PlainPowers(labelOnlyBase=False)
    between.set_axis(axis.yaxis)
    between.set_locs([3e-5, 5e-5])
    assert between(3e-5) == "3×10⁻⁵"
    plt.close(figure)
    updates = pd.DataFrame({"update": [0, 0, 1, 1], "part": ["all", "w", "all", "w"],
                            "loss_a": [1.0, 1.0, 0.5, 0.5], "loss_b": [1.0, 1.0, 0.5, 0.5],
                            "rel_err": [1e-15, 2e-15, 3e-13, 1e-12]})  # fmt: skip
    drawn = figures.recordings_figure(updates, tolerance=1e-10)
    drawn.canvas.draw()
    labels = [tick.get_text() for tick in drawn.axes[1].get_yticklabels() if tick.get_text()]
    assert labels and not any("$" in label for label in labels), labels
    assert "10⁻¹⁰" in labels, labels
    plt.close(drawn)


def test_the_final_loss_figure_tells_apart_runs_that_share_gather_and_layout():
    """A sweep over strategies: two runs of `fixed cpu2` (2 × 32), a correct one 6.9e-18 from its
    reference and a departing one 2.7e-4, were drawn under the same label, indistinguishable. The
    choice that tells them apart follows a shared label; a label no other run has stays as it is."""
    import matplotlib.pyplot as plt

    table = pd.DataFrame({
        "run_dir": ["0", "1", "2", "3"], "gather": ["fixed"] * 4,
        "layout": ["cpu1", "cpu2", "cpu2", "cpu4"], "devices": [1, 2, 2, 4],
        "batch_size": [64, 32, 32, 16], "strategy": ["ddp", "tp", "tp_unreduced", "tp"],
        "verdict": ["reference", "matches", "differs", "matches"],
        "reference": [None, "0", "0", "0"], "final_loss": [1.0, 1.0, 1.00027, 1.0],
        "precision": ["64-true"] * 4,
    })  # fmt: skip
    figure = figures.final_loss_figure(table, 1e-10)
    labels = [label.get_text() for label in figure.axes[0].get_yticklabels()]  # the table's order
    assert labels == [
        "fixed cpu2 (2 × 32), strategy=tp",
        "fixed cpu2 (2 × 32), strategy=tp_unreduced",
        "fixed cpu4 (4 × 16)",
    ]
    plt.close(figure)


def test_a_saved_figures_pdf_embeds_truetype_fonts_not_type_3(tmp_path, caplog):
    """Many publishers refuse a PDF with Type 3 fonts, matplotlib's default (a researcher's
    review of the figures); `figures.save` embeds TrueType. The subsetting of those fonts logs
    each step at INFO, which a sweep's Hydra printed (~90 lines before its table): none is
    logged where INFO is shown."""
    import logging

    import matplotlib.pyplot as plt

    figure, axis = plt.subplots()
    axis.plot([0, 1], [1, 0], label="old")
    axis.set(xlabel="optimizer step", ylabel="global loss")
    axis.legend()
    with caplog.at_level(logging.INFO):
        _, pdf = figures.save(figure, tmp_path / "figure")
    written = pdf.read_bytes()
    assert b"/Type3" not in written and b"/FontFile2" in written
    assert not [r for r in caplog.records if r.name.startswith("fontTools")], caplog.records
    assert logging.getLogger("fontTools").level == logging.NOTSET  # left as it was


def test_a_comparison_says_which_runs_lie_under_another_and_counts_steps_in_whole_numbers():
    """Two gathers whose losses are the same numbers (the old gather and one whose backward
    averages, both 1/W on a global loss) were drawn one over the other with nothing said (a
    newcomer's sweep: the old one's red line hidden); a three-step run's axes read 0.5, 1.5."""
    import matplotlib.pyplot as plt

    table = pd.DataFrame({
        "run_dir": ["0", "1", "2", "3"], "group": [0] * 4,
        "gather": ["fixed", "old", "fixed", "mean_grad"], "devices": [1, 2, 2, 2],
        "batch_size": [16, 8, 8, 8], "reference": [None, "0", "0", "0"],
        "global_batch_size": [16] * 4, "experiment": [""] * 4, "loss": ["ntxent"] * 4,
        "model": ["mlp"] * 4, "precision": ["64-true"] * 4,
    })  # fmt: skip
    steps = [0, 1, 2]
    curves = {run: pd.DataFrame({"step": steps, "loss": losses}) for run, losses in {
        "0": [2.67, 2.73, 2.58], "1": [2.67, 2.75, 2.62], "2": [2.67, 2.73, 2.58],
        "3": [2.67, 2.75, 2.62]}.items()}  # fmt: skip
    figure = figures.comparison_figure(table, curves, 1e-10)
    loss_axis, diff_axis = figure.axes[:2]
    labels = [line.get_label() for line in loss_axis.get_lines()]
    assert labels == ["old, 2 × 8", "fixed, 2 × 8",
                      "mean_grad, 2 × 8 (over old, 2 × 8: the same losses)",
                      "reference, 1 × 16"]  # fmt: skip
    figure.canvas.draw()
    for axis in (loss_axis, diff_axis):
        ticks = [tick for tick in axis.get_xticks() if 0 <= tick <= 2]
        assert ticks == [0, 1, 2], ticks
    plt.close(figure)
