"""Figure (README, docs/results.md): can a learning rate hide the bug? SimCLR on the digits, 4
ranks, `fixed` and `old` on the global and the local NT-Xent over a grid of learning rates.

One sweep of ``experiment=lr_sweep`` (seeds 0..4 × ``loss=ntxent_global,ntxent`` ×
``gather=fixed,old`` × ``optim.lr`` 0.25 … 8, all on 4 ranks). Under plain SGD, `old` on the
global loss (a 1/W gradient) at lr·W is `fixed` at lr step for step (docs/design.md §7): the
script checks that on the sweep's own runs (every loss of the curve and every final weight, to
the float64 bound) together with the grad-norm ratio 1/W at every step, and on the local loss
(`old` biased) measures how far each `old` grid point stays from `fixed` at the experiment's lr.
Each run's backbone is probed by the 1-shot nearest-class-mean classifier
(``few_shot_accuracy``); per cell the mean and its 95% t-interval over the seeds. Writes
``figures/lr_sweep.{png,pdf,csv,md}``: the CSV one row per run, the Markdown the tables the
figure and docs/results.md read.

Usage: ``python experiments/lr_sweep.py`` (about 27 minutes here, 120 runs), or
``python experiments/lr_sweep.py SWEEP_DIR`` to redraw from a finished sweep, or
``python experiments/lr_sweep.py --redraw`` to draw the figure and write the Markdown again from
``figures/lr_sweep.csv`` (nothing trained, seconds).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from _stats import interval
from _sweep import FIGURES, run_sweep

from gatherlab import report, results
from gatherlab.analysis import figures
from gatherlab.components import config
from gatherlab.core import gradients, runfiles
from gatherlab.core.terms import GradientClass, Style

STYLES = {"ntxent_global": Style.GLOBAL, "ntxent": Style.LOCAL}  # docs/design.md §1's loss styles
PANELS = {
    "ntxent_global": f"global NT-Xent: old's gradient is {GradientClass.ONE_OVER_W}",
    "ntxent": f"local NT-Xent (lightly's): old's gradient is {GradientClass.BIASED}",
}
GATHERS = ("fixed", "old")
BOUND = gradients.FLOAT64_TOLERANCE
# what max_differences measures, in the order of the Markdown table's columns
DIFFERENCES = ("max_abs_loss_diff", "max_abs_param_diff", "max_abs_affine_diff",
               "grad_norm_ratio_err")  # fmt: skip


def max_differences(run_dir: str, other_dir: str, world_size: int) -> dict[str, float]:
    """Largest |Δloss| over the steps, largest |Δweight| over the final state (and over the batch
    norms' weight and bias alone), and the largest relative error of W·(the run's grad norm)
    against the other's at any step (a 1/W gradient has the ratio 1/W at every step)."""
    curves, other = results.load_curves(run_dir), results.load_curves(other_dir)
    state, other_state = results.load_final_state(run_dir), results.load_final_state(other_dir)
    assert list(curves["step"]) == list(other["step"]) and state.keys() == other_state.keys()
    return {
        "max_abs_loss_diff": float((curves["loss"] - other["loss"]).abs().max()),
        "max_abs_param_diff": report.max_abs_weight_difference(state, other_state),
        "max_abs_affine_diff": report.max_abs_weight_difference(  # docs/design.md §7
            state, other_state, keys=[key for key in state if _batch_norm_affine(key, state)]
        ),
        "grad_norm_ratio_err": float(
            (world_size * curves["grad_norm"] / other["grad_norm"] - 1).abs().max()
        ),
    }


def _batch_norm_affine(key: str, state: dict) -> bool:
    """Whether ``key`` of a state is a batch norm's weight or bias."""
    return f"{key.rsplit('.', 1)[0]}.running_mean" in state and key.endswith(("weight", "bias"))


def compare(runs: pd.DataFrame, base_lr: float) -> pd.DataFrame:
    """One row per run; an `old` row also holds its differences from `fixed` at lr/W (same loss
    and seed; where lr/W is on the grid) and from `fixed` at the experiment's lr ``base_lr``."""
    fixed = runs[runs["gather"] == "fixed"].set_index(["loss", "seed", "lr"])["run_dir"]
    rows = []
    for run in runs.itertuples():
        row = {
            "loss": run.loss, "style": STYLES[run.loss], "gather": run.gather, "lr": run.lr,
            "seed": run.seed, "few_shot_accuracy": run.few_shot_accuracy,
            "final_loss": run.final_loss,
        }  # fmt: skip
        if run.gather == "old":
            shifted = (run.loss, run.seed, run.lr / run.devices)
            if shifted in fixed.index:
                row["fixed_lr"] = shifted[2]
                row.update(max_differences(run.run_dir, fixed[shifted], run.devices))
            base = max_differences(run.run_dir, fixed[run.loss, run.seed, base_lr], run.devices)
            row["base_loss_diff"] = base["max_abs_loss_diff"]
            row["base_param_diff"] = base["max_abs_param_diff"]
        rows.append(row)
    return pd.DataFrame(rows).sort_values(["style", "gather", "lr", "seed"], ignore_index=True)


def cells(table: pd.DataFrame) -> pd.DataFrame:
    """Per (loss, gather, lr): the seeds, the mean accuracy and the half-width of its 95%
    t-interval."""
    rows = []
    for (loss, gather, lr), group in table.groupby(["loss", "gather", "lr"], sort=False):
        mean, half = interval(group["few_shot_accuracy"].to_numpy())
        rows.append({"loss": loss, "gather": gather, "lr": lr, "seeds": len(group), "mean": mean,
                     "ci95": half})  # fmt: skip
    return pd.DataFrame(rows)


def figure(
    summary: pd.DataFrame,
    panels: Mapping[str, str],
    *,
    gathers: Sequence[str],
    shifted: Mapping[str, str],
    base_lr: float,
    world_size: int,
    title: str,
) -> plt.Figure:
    """Probe accuracy against the SGD learning rate on ``world_size`` ranks: one panel per loss
    (``panels``: loss → the panel's title), in each the mean over the seeds of every gather of
    ``gathers`` in its colour, with its 95% interval as a band (``summary``: one row per loss,
    gather and ``lr``, with ``mean`` and ``ci95``), and the experiment's learning rate
    ``base_lr``. Where ``shifted`` maps a loss to a gather, that gather's points are drawn again,
    open, at lr/W: the prediction that it trains as the others at W times the learning rate."""
    grid = sorted(summary["lr"].unique())
    ticks = 2.0 ** np.arange(np.log2(grid[0] / world_size), np.log2(grid[-1]) + 1)
    with plt.rc_context({**figures.STYLE, "font.size": 8, "axes.titlesize": 8}):
        drawn, axes = plt.subplots(
            1, len(panels), figsize=(7.2, 3.1), sharey=True, layout="constrained"
        )
        for axis, (loss, panel_title) in zip(axes, panels.items(), strict=True):
            loss_cells = summary[summary["loss"] == loss]
            for gather in gathers:
                cell = loss_cells[loss_cells["gather"] == gather]
                color = figures.gather_color(gather)
                axis.plot(cell["lr"], cell["mean"], "o-", color=color, markersize=4,
                          label=f"{gather}, {world_size} ranks")  # fmt: skip
                axis.fill_between(cell["lr"], cell["mean"] - cell["ci95"],
                                  cell["mean"] + cell["ci95"], color=color, alpha=0.15,
                                  linewidth=0)  # fmt: skip
            if loss in shifted:
                cell = loss_cells[loss_cells["gather"] == shifted[loss]]
                axis.plot(cell["lr"] / world_size, cell["mean"], "o", mfc="none", markersize=9,
                          color=figures.gather_color(shifted[loss]),
                          label=f"{shifted[loss]}, drawn at lr/{world_size}")  # fmt: skip
            axis.axvline(base_lr, color="0.5", linestyle=":", linewidth=1,
                         label=f"the experiment's lr, {base_lr:g}")  # fmt: skip
            axis.set_xscale("log", base=2)
            axis.set_xticks(ticks, [f"{lr:g}" for lr in ticks])
            axis.set_xlim(ticks[0] / 1.4, ticks[-1] * 1.4)
            axis.set(title=panel_title, xlabel="SGD learning rate")
        axes[0].set_ylabel("1-shot probe accuracy (test)")
        axes[0].legend(loc="lower right", fontsize=7)  # in the order drawn
        drawn.suptitle(title)
    return drawn


def draw(summary: pd.DataFrame, table: pd.DataFrame, base_lr: float, world_size: int) -> None:
    """``figures/lr_sweep.{png,pdf}``: a panel per loss, each titled with its exact check."""
    seeds = summary["seeds"].min()
    drawn = figure(
        summary,
        {loss: f"{title}\n{_verdict(table, loss, base_lr)}" for loss, title in PANELS.items()},
        gathers=GATHERS,
        shifted={loss: "old" for loss in PANELS if STYLES[loss] == Style.GLOBAL},
        base_lr=base_lr,
        world_size=world_size,
        title=f"SimCLR on the digits, {world_size} ranks, 55 SGD steps: mean and 95% interval "
        f"(band) over {seeds} seeds",
    )
    figures.save(drawn, FIGURES / "lr_sweep")


def _verdict(table: pd.DataFrame, loss: str, base_lr: float) -> str:
    """The panel's exact check, in a line."""
    old = table[(table["loss"] == loss) & (table["gather"] == "old")]
    if STYLES[loss] == Style.GLOBAL:
        paired = old.dropna(subset=["fixed_lr"])
        largest = paired[["max_abs_loss_diff", "max_abs_param_diff"]].to_numpy().max()
        within = "to the bit" if largest == 0 else f"to {largest:.0e}"
        return f"old at lr·W = fixed at lr, loss and weights {within} ({len(paired)} runs)"
    nearest = np.floor(old["base_param_diff"].min() * 100) / 100  # a lower bound, as printed
    return f"no lr of old gives fixed at {base_lr:g}: |Δweight| ≥ {nearest:.2f}"


def markdown(summary: pd.DataFrame, table: pd.DataFrame, base_lr: float) -> str:
    grid = sorted(summary["lr"].unique())
    value = summary.set_index(["loss", "gather", "lr"])
    columns = [(loss, gather) for loss in PANELS for gather in GATHERS]
    accuracy = [
        [
            f"{lr:g}",
            *(_mean_and_interval(value.loc[(loss, gather, lr)]) for loss, gather in columns),
        ]
        for lr in grid
    ]
    header = ["lr", *(f"{STYLES[loss]}, {gather}" for loss, gather in columns)]
    old = table[table["gather"] == "old"]
    pairs = [
        [STYLES[loss], f"{lr:g}", f"{group['fixed_lr'].iloc[0]:g}", str(len(group)),
         *(f"{group[column].max():.2e}" for column in DIFFERENCES)]
        for (loss, lr), group in old.dropna(subset=["fixed_lr"]).groupby(["loss", "lr"], sort=False)
    ]  # fmt: skip
    nearest = [
        [STYLES[loss], f"{lr:g}", f"{group['base_loss_diff'].min():.3g}",
         f"{group['base_param_diff'].min():.3g}"]
        for (loss, lr), group in old.groupby(["loss", "lr"], sort=False)
    ]  # fmt: skip
    best = []
    for loss, gather in columns:
        cell = summary[(summary["loss"] == loss) & (summary["gather"] == gather)]
        top = cell.loc[cell["mean"].idxmax()]
        best.append([STYLES[loss], gather, f"{top['lr']:g}", _mean_and_interval(top)])
    seeds = summary["seeds"].min()
    return "\n".join([
        f"1-shot probe accuracy, mean ± 95% t-interval over {seeds} seeds (4 ranks, SGD, 55 steps)",
        "", runfiles.markdown_table(header, accuracy), "",
        "Best grid point of each cell:", "",
        runfiles.markdown_table(["loss", "gather", "lr", "accuracy"], best), "",
        "old at lr against fixed at lr/W (same loss and seed; W = 4), largest over the seeds: "
        "|Δloss| over all steps, |Δweight| over the final state (of it, the batch norms' weight "
        f"and bias), and |W·grad norm(old) / grad norm(fixed) − 1| at any step; bound {BOUND:g}",
        "", runfiles.markdown_table(
            ["loss", "old lr", "fixed lr", "seeds", "max |Δloss|", "max |Δweight|",
             "max |Δ batch-norm affine|", "grad-norm ratio error"], pairs), "",
        f"old at each grid point against fixed at the experiment's lr {base_lr:g} (same loss and "
        "seed), smallest over the seeds", "",
        runfiles.markdown_table(["loss", "old lr", "min |Δloss|", "min |Δweight|"], nearest), "",
    ])  # fmt: skip


def _mean_and_interval(cell: pd.Series) -> str:
    return f"{cell['mean']:.4f} ± {cell['ci95']:.4f}"


def main() -> None:
    start = time.perf_counter()
    base_lr, world_size = experiment_lr_and_world_size()
    if "--redraw" in sys.argv[1:]:
        table = pd.read_csv(FIGURES / "lr_sweep.csv")
    else:
        sweeps = [Path(path) for path in sys.argv[1:]] or [run_sweep("lr_sweep")]
        runs = pd.concat([results.load_runs(sweep) for sweep in sweeps], ignore_index=True)
        failed = runs[runs["status"] != "ok"]
        if len(failed):
            sys.exit(f"lr_sweep: {len(failed)} runs did not finish: {', '.join(failed['run_dir'])}")
        runs["lr"] = [config["optim"]["lr"] for config in runs["config"]]
        (world_size,) = runs["devices"].unique()
        table = compare(runs, base_lr)
        table.to_csv(FIGURES / "lr_sweep.csv", index=False, float_format="%.6g")
    summary = cells(table)
    draw(summary, table, base_lr, world_size)
    text = markdown(summary, table, base_lr)
    (FIGURES / "lr_sweep.md").write_text(text)
    print(text)
    print(f"wall time {time.perf_counter() - start:.0f} s")


def experiment_lr_and_world_size() -> tuple[float, int]:
    """The learning rate of ``experiment=lr_sweep`` without its sweep (the downstream run's), and
    its world size."""
    with config.composed():
        cfg, _ = config.compose(["experiment=lr_sweep"])
    return cfg.optim.lr, cfg.layout.devices * cfg.layout.nodes


if __name__ == "__main__":
    main()
