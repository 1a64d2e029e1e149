"""Figure (README, docs/results.md): does the bug change what the network learns? SimCLR on the
digits, 30 seeds.

One sweep of ``experiment=downstream`` (seeds 0..29 × the five cells of ``conf/downstream_cell``:
the 1-device run of ``ntxent`` and of ``ntxent_global``; on 4 ranks ``ntxent`` with ``fixed``
(exact) and ``old`` (a biased gradient on a local loss), and ``ntxent_global`` with ``old`` (a
1/W gradient)). Each run's backbone is probed by the 1-shot nearest-class-mean classifier
(``few_shot_accuracy``). Per cell: mean and 95% t-interval over the seeds; per 4-rank cell the
paired difference from the 1-device run of the same seed and loss, with its 95% t-interval and
the smallest difference a paired t-test of these seeds detects with 80% power, from the
differences' measured spread. Baselines: raw pixels, and the untrained network of each seed.
Writes ``figures/downstream.{png,pdf,csv,md}``.

Usage: ``python experiments/downstream.py`` (about 28 minutes here, 150 runs), or
``python experiments/downstream.py SWEEP_DIR [SWEEP_DIR ...]`` to redraw from finished sweeps, or
``python experiments/downstream.py --redraw`` to draw the figure and write the Markdown again from
``figures/downstream.csv`` (nothing trained; the baselines recomputed, under a minute here).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from _stats import detectable_difference, interval
from _sweep import FIGURES, run_sweep

from gatherlab import results
from gatherlab.analysis import figures
from gatherlab.components import config
from gatherlab.core import runfiles
from gatherlab.core.terms import GradientClass


def baselines(seeds: list[int]) -> tuple[float, list[float]]:
    """The 1-shot accuracy of raw pixels, and of the untrained network of each seed."""
    with config.composed():
        cfg, _ = config.compose(["experiment=downstream"])
        dataset = config.build_dataset(cfg)
        untrained = []
        for seed in seeds:
            seeded, _ = config.compose(["experiment=downstream", f"seed={seed}"])
            model = config.build_model(seeded).double().eval()
            untrained.append(dataset.few_shot_accuracy(model.features))
    return dataset.few_shot_accuracy(), untrained


# the figure's rows: loss, gather (of a multi-device cell), devices, label
CELLS = (
    ("ntxent", "fixed", 1, "1 device (ntxent)"),
    ("ntxent", "fixed", 4, f"fixed, 4 ranks ({GradientClass.EXACT})"),
    ("ntxent", "old", 4, f"old, 4 ranks ({GradientClass.BIASED})"),
    ("ntxent_global", "fixed", 1, "1 device (ntxent_global)"),
    ("ntxent_global", "old", 4, f"old, 4 ranks ({GradientClass.ONE_OVER_W})"),
)


def cell_table(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per cell of ``CELLS``: its seeds' accuracies, their mean and 95% interval, and for
    a multi-device cell the paired difference from the 1-device run of the same seed and loss
    (mean, interval, sd, whether the interval excludes 0, the difference detectable at 80%)."""
    one_device = runs[runs["devices"] == 1].drop_duplicates(["loss", "seed"])
    reference = one_device.set_index(["loss", "seed"])["few_shot_accuracy"]
    rows = []
    for loss, gather, devices, label in CELLS:
        chosen = runs[(runs["loss"] == loss) & (runs["devices"] == devices)]
        if devices > 1:
            chosen = chosen[chosen["gather"] == gather]
        chosen = chosen.drop_duplicates("seed").sort_values("seed")
        accuracy = chosen["few_shot_accuracy"].to_numpy()
        paired = accuracy - reference.loc[loss].loc[chosen["seed"]].to_numpy()
        mean, half = interval(accuracy)
        diff, diff_half = interval(paired) if devices > 1 else (0.0, 0.0)
        spread = float(paired.std(ddof=1)) if devices > 1 else 0.0
        rows.append({
            "cell": label, "loss": loss, "gather": gather, "devices": devices,
            "seeds": len(accuracy), "mean": mean, "ci95": half, "paired_diff": diff,
            "paired_ci95": diff_half, "paired_sd": spread,
            "significant": devices > 1 and abs(diff) > diff_half,
            "detectable_80": detectable_difference(spread, len(paired)) if spread > 0 else 0.0,
            "per_seed": " ".join(f"{a:.4f}" for a in accuracy),
        })  # fmt: skip
    return pd.DataFrame(rows)


def markdown(table: pd.DataFrame, raw: float, untrained: list[float]) -> str:
    """``figures/downstream.md``: the baselines, then one row per cell of ``table``."""
    header = ["cell", "seeds", "mean ± 95%", "paired difference ± 95%", "sd of the differences",
              "significant", "detectable at 80% power"]  # fmt: skip
    body = [
        [row["cell"], str(row["seeds"]), f"{row['mean']:.4f} ± {row['ci95']:.4f}",
         *([f"{row['paired_diff']:+.4f} ± {row['paired_ci95']:.4f}", f"{row['paired_sd']:.4f}",
            "yes" if row["significant"] else "no", f"±{row['detectable_80']:.4f}"]
           if row["devices"] > 1 else ["—"] * 4)]
        for _, row in table.iterrows()
    ]  # fmt: skip
    return (
        f"1-shot probe accuracy; raw pixels {raw:.4f}, untrained network {np.mean(untrained):.4f} "
        f"({min(untrained):.4f}–{max(untrained):.4f} over the seeds). Detectable: the smallest "
        "true paired difference a two-sided paired t-test at 5% rejects with 80% power, from "
        "the differences' measured sd. Every seed's accuracy: figures/downstream.csv\n\n"
        + runfiles.markdown_table(header, body)
        + "\n"
    )


def figure(table: pd.DataFrame, raw: float, untrained: Sequence[float]) -> plt.Figure:
    """Seed-averaged probe accuracy, sized for one column of a paper: every seed's accuracy and
    each cell's mean with its 95% interval (top; a 1-device cell in the reference's colour, a
    multi-device one in its gather's), against the accuracy of raw pixels ``raw`` and the mean of
    the untrained networks ``untrained`` (one per seed); below, each multi-device cell's paired
    difference from the 1-device run of the same seed, with its interval and the smallest
    difference detectable at 80% power.

    ``table`` has one row per cell: ``cell`` (its label), ``gather``, ``devices``, ``mean``,
    ``ci95``, ``paired_diff``, ``paired_ci95``, ``detectable_80`` and ``per_seed`` (the
    accuracies, separated by spaces), as `cell_table` writes them."""
    with plt.rc_context({**figures.STYLE, "font.size": 7, "axes.titlesize": 7}):
        drawn, (top, bottom) = plt.subplots(
            2, 1, figsize=(3.5, 4.3), layout="constrained", gridspec_kw={"height_ratios": [5, 3]}
        )
        _draw_seed_accuracies(top, table, raw, untrained)
        _draw_paired_differences(bottom, table)
        top.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.4, -0.2), ncol=2)
    return drawn


def _cell_color(gather: str, devices: int) -> str:
    """A cell of `figure` in its gather's colour, a 1-device cell as the reference."""
    return figures.REFERENCE_STYLE["color"] if devices == 1 else figures.gather_color(gather)


def _draw_seed_accuracies(
    axis: plt.Axes, table: pd.DataFrame, raw: float, untrained: Sequence[float]
) -> None:
    """The top panel of `figure`: each cell's seeds, mean and interval; baselines."""
    for y, (_, row) in enumerate(table.iterrows()):
        color = _cell_color(row["gather"], row["devices"])
        accuracies = np.array(row["per_seed"].split(), dtype=float)
        axis.scatter(accuracies, [y] * len(accuracies), color=color, alpha=0.5, s=9)
        axis.errorbar(row["mean"], y, xerr=row["ci95"], fmt="o", color=color, capsize=3,
                      markersize=4)  # fmt: skip
    axis.axvline(raw, color="0.5", linestyle=":", label=f"raw pixels {raw:.3f}")
    axis.axvline(np.mean(untrained), color="0.5", linestyle="--",
                 label=f"untrained network {np.mean(untrained):.3f}")  # fmt: skip
    axis.set_yticks(range(len(table)), list(table["cell"]))
    axis.invert_yaxis()
    axis.set(xlabel="1-shot probe accuracy (test, 50 label draws)",
             title=f"{len(untrained)} seeds (dots), mean and 95% interval")  # fmt: skip


def _draw_paired_differences(axis: plt.Axes, table: pd.DataFrame) -> None:
    """The bottom panel of `figure`: each multi-device cell's paired difference."""
    distributed = table[table["devices"] > 1]
    labels = []
    for y, (_, row) in enumerate(distributed.iterrows()):
        axis.errorbar(row["paired_diff"], y, xerr=row["paired_ci95"], fmt="o",
                      color=_cell_color(row["gather"], row["devices"]), capsize=3,
                      markersize=4)  # fmt: skip
        detectable = row["detectable_80"]
        labels.append(row["cell"] + (f"\ndetectable (80%) ±{detectable:.3f}" if detectable else ""))
    axis.set_yticks(range(len(labels)), labels)
    axis.invert_yaxis()
    axis.axvline(0, color="black", linewidth=1)
    axis.set(xlabel="Δ accuracy vs 1 device, same seed", title="paired difference, 95% interval")


def main() -> None:
    start = time.perf_counter()
    if "--redraw" in sys.argv[1:]:  # the sweep's seeds are 0 … n-1 (conf/experiment/downstream)
        table = pd.read_csv(FIGURES / "downstream.csv")
        seeds = list(range(int(table["seeds"].max())))
    else:
        sweeps = [Path(path) for path in sys.argv[1:]] or [run_sweep("downstream")]
        runs = pd.concat([results.load_runs(sweep) for sweep in sweeps], ignore_index=True)
        runs = runs[runs["status"] == "ok"]
        table = cell_table(runs)
        table.to_csv(FIGURES / "downstream.csv", index=False, float_format="%.6g")
        seeds = sorted(runs["seed"].unique())
    raw, untrained = baselines(seeds)
    figures.save(figure(table, raw, untrained), FIGURES / "downstream")
    text = markdown(table, raw, untrained)
    (FIGURES / "downstream.md").write_text(text)
    print(text)
    print(f"wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
