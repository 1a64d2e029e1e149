"""Figure (docs/results.md): the lab's sweep over pipeline parallelism
(``experiment=pipeline_parallel``, docs/checking.md §10 "Pipeline parallelism in the lab"): a small
causal language model with its head tied to its embedding, cut into 2 stages and trained with 1F1B
over 4 micro-batches on pp 2 alone and dp 2 × pp 2 CPU ranks against one device, correct
(``strategy=pp``), with the micro-batches' gradients summed instead of averaged (``pp_unscaled``)
and with the tied copies' gradients left unsummed (``pp_untied``).

Runs the sweep; keeps every run's curves and its comparison with one device in
``figures/pipeline_parallel.csv``; draws ``figures/pipeline_parallel.{png,pdf}`` (each run's loss,
its |Δloss| from one device at each step, its final weights' largest difference); writes the
numbers into docs/results.md between ``<!-- pipeline_parallel:start -->`` and
``<!-- pipeline_parallel:end -->``.

Usage: ``python experiments/pipeline_parallel.py [--redraw]`` (``--redraw``: the figure and the
numbers again from ``figures/pipeline_parallel.csv``, nothing trained).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from _sweep import FIGURES, REPO, run_sweep

from gatherlab.analysis import figures
from gatherlab.core import gradients, runfiles

CSV = FIGURES / "pipeline_parallel.csv"
RESULTS = REPO / "docs" / "results.md"
START, END = "<!-- pipeline_parallel:start -->", "<!-- pipeline_parallel:end -->"
# what each layout of the sweep is, and what each strategy does
LAYOUTS = {"cpu2": "pp 2", "cpu4": "dp 2 × pp 2"}
STRATEGIES = {
    "pp": "correct",
    "pp_unscaled": "scale_grads=False: the micro-batches' gradients summed",
    "pp_untied": "the tied copies' gradients not summed",
}
COLUMNS = ("strategy", "layout", "devices", "verdict", "max_abs_loss_diff", "max_abs_param_diff",
           "step", "loss", "grad_norm", "reference_loss", "reference_grad_norm")  # fmt: skip


def main() -> None:
    if "--redraw" not in sys.argv[1:]:
        start = time.perf_counter()
        sweep_dir = run_sweep("pipeline_parallel")
        table_of(sweep_dir).to_csv(CSV, index=False, float_format="%.17g")
        print(f"sweep: {sweep_dir}, {time.perf_counter() - start:.0f} s")
    publish(pd.read_csv(CSV))


def table_of(sweep_dir: Path) -> pd.DataFrame:
    """Every run's curves beside its one-device reference's, with the sweep's verdict and final
    differences (``comparison.csv``): a row per run and step."""
    comparison = pd.read_csv(sweep_dir / runfiles.COMPARISON)
    rows = []
    for _, run in comparison.iterrows():
        curves = pd.read_csv(sweep_dir / str(run["run_dir"]) / runfiles.CURVES)
        reference = pd.read_csv(sweep_dir / str(run["reference"]) / runfiles.CURVES)
        for (_, at), (_, one) in zip(curves.iterrows(), reference.iterrows(), strict=True):
            rows.append({
                **{key: run[key] for key in COLUMNS[:6]}, "step": int(at["step"]),
                "loss": at["loss"], "grad_norm": at["grad_norm"], "reference_loss": one["loss"],
                "reference_grad_norm": one["grad_norm"],
            })  # fmt: skip
    return pd.DataFrame(rows, columns=list(COLUMNS))


def publish(table: pd.DataFrame) -> None:
    """figures/pipeline_parallel.{png,pdf} and the numbers in docs/results.md."""
    for path in figures.save(figure(table, gradients.FLOAT64_TOLERANCE), FIGURES /
                             "pipeline_parallel"):  # fmt: skip
        print(f"written: {path}")
    write_into_results(numbers(table))
    print(numbers(table))


def numbers(table: pd.DataFrame) -> str:
    """The Markdown table of docs/results.md: per strategy and layout, the verdict, the largest
    |Δloss| and |Δweight| against one device, and the first step's gradient norm over one
    device's (the loss at that step is the same: the same weights)."""
    header = ["strategy", *(f"{name} ({layout}): verdict, max \\|Δloss\\|, max \\|Δweight\\|, "
                            "step 0's gradient norm ÷ one device's"
                            for layout, name in LAYOUTS.items())]  # fmt: skip
    body = []
    for strategy, what in STRATEGIES.items():
        cells = []
        for layout in LAYOUTS:
            run = table[(table["strategy"] == strategy) & (table["layout"] == layout)]
            first = run[run["step"] == run["step"].min()].iloc[0]
            ratio = first["grad_norm"] / first["reference_grad_norm"]
            cells.append(f"{first['verdict']}, {first['max_abs_loss_diff']:.2g}, "
                         f"{first['max_abs_param_diff']:.2g}, {ratio:.4f}")  # fmt: skip
        body.append([f"{strategy} ({what})", *cells])
    return runfiles.markdown_table(header, body)


def figure(table: pd.DataFrame, tolerance: float) -> plt.Figure:
    """Three panels: every run's loss per step (one device's dashed), its |Δloss| from one device
    per step (log scale, exact zeros at the floor, the float64 tolerance dotted), and its final
    weights' largest |Δ| from one device's (a bar per strategy and layout, its verdict over it).
    ``table`` has the columns of ``figures/pipeline_parallel.csv``."""
    runs = table[table["layout"].isin(LAYOUTS)]
    with plt.rc_context(figures.STYLE):
        drawn, (loss_axis, diff_axis, bar_axis) = plt.subplots(
            1, 3, figsize=(15, 4.4), layout="constrained"
        )
        reference = runs[runs["strategy"] == "pp"].groupby("step", sort=True)["reference_loss"]
        loss_axis.plot(reference.first().index, reference.first().to_numpy(),
                       label="one device", **figures.REFERENCE_STYLE)  # fmt: skip
        for (strategy, layout), run in runs.groupby(["strategy", "layout"], sort=False):
            style = {"color": figures.STRATEGY_COLORS.get(strategy, "0.5"),
                     "linestyle": figures.DEVICE_STYLES.get(int(run["devices"].iloc[0]), "-"),
                     "label": f"{strategy}, {LAYOUTS[layout]}"}  # fmt: skip
            loss_axis.plot(run["step"], run["loss"], **style)
            difference = np.maximum((run["loss"] - run["reference_loss"]).abs(), figures.ZERO_FLOOR)
            diff_axis.plot(run["step"], difference, **style)
        loss_axis.set(xlabel="optimizer step", ylabel="loss (cross-entropy, nats)",
                      title="loss against one device")  # fmt: skip
        loss_axis.legend(fontsize=7)
        figures.style_difference_axis(diff_axis, tolerance, "|Δloss| vs one device")
        _final_weight_bars(bar_axis, runs, tolerance)
        drawn.suptitle("Pipeline parallelism in the lab against one device (tiny tied-weight LM, "
                       "1F1B, 4 micro-batches, float64)", fontsize=10)  # fmt: skip
    return drawn


def _final_weight_bars(axis: plt.Axes, runs: pd.DataFrame, tolerance: float) -> None:
    """The final weights' largest |Δ| from one device's: a group of bars per strategy, a bar per
    layout, the verdict written over each."""
    strategies = list(dict.fromkeys(runs["strategy"]))
    width = 0.8 / len(LAYOUTS)
    for offset, layout in enumerate(LAYOUTS):
        at = runs[runs["layout"] == layout].groupby("strategy").first().loc[strategies]
        x = np.arange(len(strategies)) + (offset - (len(LAYOUTS) - 1) / 2) * width
        heights = np.maximum(at["max_abs_param_diff"].to_numpy(float), figures.ZERO_FLOOR)
        axis.bar(x, heights, width, label=LAYOUTS[layout], color=("#9ecae1", "#3182bd")[offset])
        for left, height, verdict in zip(x, heights, at["verdict"], strict=True):
            axis.text(left, height * 2, verdict, ha="center", va="bottom", fontsize=7)
    axis.axhline(tolerance, color="0.4", linewidth=1, linestyle=":")
    axis.set_xticks(range(len(strategies)), strategies)
    axis.set(yscale="log", ylim=(figures.ZERO_FLOOR / 10, 10),
             ylabel="final weights' max |Δ| vs one device",
             title=f"after the last step (exact 0 drawn at {figures.ZERO_FLOOR:g})")  # fmt: skip
    axis.legend(fontsize=8, loc="upper left")


def write_into_results(text: str) -> None:
    """``text`` between this script's markers in docs/results.md."""
    document = RESULTS.read_text()
    if document.count(START) != 1 or document.count(END) != 1:
        raise RuntimeError(f"{RESULTS}: expected one {START} and one {END}")
    before, rest = document.split(START)
    _, after = rest.split(END)
    RESULTS.write_text(f"{before}{START}\n{text}\n{END}{after}")


if __name__ == "__main__":
    main()
