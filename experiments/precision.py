"""Figure (docs/results.md, docs/design.md §2 "Low precision"): how far W ranks depart from one
device in float32, bf16 and fp16, in floors, for exact code and for each bug class; the floor's
threshold, its margin and the power of each precision are measured here.

For every precision (``32-true``, ``bf16-mixed``, ``16-mixed``) × seed × W ∈ {2, 4, 8}, on real
gloo ranks of the warm pool: gatherlab's MLP-sized model of ``plain_steps`` and the global NT-Xent
(τ = 0.5, global batch 64) with the exact gather, the old gather, local negatives
(``precision_cases.own_rows``), per-rank batch norm (``precision_cases.build_with_batchnorm``)
and rank 1's slice scaled by 1 + ε (``precision_cases.ScaledSlice``) for ε from 1e-1 to 1e-7;
and the naive accumulation of ``updates.naive`` (K = 2) through ``gatherlab.check
.check_training``. Each departure ‖g_W − g₁‖ / ‖g₁‖ from one device in the same precision is
divided by W's floor, one device with its forward in as many row blocks as W's ranks
(`gatherlab.core.floor`; T is `floor.FLOOR_THRESHOLD` at every W);
the batch norm case takes the floor of the same model without batch norm (row blocks would split
its statistics). Writes ``figures/precision.{csv,md,png,pdf}``.

Usage: ``python experiments/precision.py [--redraw] [--seeds N]`` (``--redraw``: the figure and
the table again from ``figures/precision.csv``, nothing measured; ``--seeds``: 10 by default).
"""

from __future__ import annotations

import functools
import sys
import time

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from _sweep import FIGURES, REPO

sys.path.insert(0, str(REPO / "examples"))  # the stand-ins, imported by name on every rank too

import plain_steps
import precision_cases

from gatherlab.analysis import figures
from gatherlab.check import check_training, measure
from gatherlab.components.data import gaussian_pairs
from gatherlab.components.factory import Recipe
from gatherlab.core import floor, runfiles, terms
from gatherlab.gather import get
from gatherlab.losses import NTXentGlobalLoss
from gatherlab.runs.precision import FLOOR_ROW_BLOCKS

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
WORLD_SIZES = (2, 4, 8)
EPSILONS = (1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7)
GLOBAL_BATCH = 64
COLUMNS = ("precision", "case", "epsilon", "world_size", "seed", "floor", "departure", "floors",
           "verdict", "bitwise_exact")  # fmt: skip


def main() -> None:
    arguments = sys.argv[1:]
    if "--redraw" in arguments:
        publish(pd.read_csv(FIGURES / "precision.csv"))
        return
    seeds = int(arguments[arguments.index("--seeds") + 1]) if "--seeds" in arguments else 10
    start = time.perf_counter()
    rows = []
    for precision in PRECISIONS:
        for seed in range(seeds):
            rows += _gathers(precision, seed) + _accumulation(precision, seed)
        print(f"{precision}: done, {time.perf_counter() - start:.0f} s", flush=True)
    table = pd.DataFrame(rows, columns=list(COLUMNS))
    table.to_csv(FIGURES / "precision.csv", index=False, float_format="%.6g")
    publish(table)
    print(f"wall time {time.perf_counter() - start:.0f} s")


def _views(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = gaussian_pairs(num_samples=GLOBAL_BATCH, dim=8, noise=0.5, seed=seed)
    pairs = [data[i] for i in range(GLOBAL_BATCH)]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def _loss(gather, seed: int) -> Recipe:
    return Recipe(NTXentGlobalLoss, {"temperature": 0.5}, gather, seed)


def _gathers(precision: str, seed: int) -> list[dict]:
    """The gather cases at every W: each W-rank gradient against one device's in ``precision``,
    in floors."""
    view0, view1 = _views(seed)
    exact = _loss(get("fixed"), seed)
    cells = {"exact": exact, "old gather": _loss(get("old"), seed),
             "local negatives": _loss(precision_cases.own_rows, seed)}  # fmt: skip
    cells |= {("slice", e): _loss(precision_cases.ScaledSlice(e), seed) for e in EPSILONS}
    models = {"plain": functools.partial(plain_steps.build_model, 8),
              "batchnorm": functools.partial(precision_cases.build_with_batchnorm, 8)}  # fmt: skip

    def one_device(model, row_blocks: int = 1) -> torch.Tensor:
        return measure.measure(
            exact, model, view0, view1, seed, precision=precision, row_blocks=row_blocks
        ).gradient

    one = {name: one_device(model) for name, model in models.items()}
    rows = []
    for world_size in WORLD_SIZES:
        blocks = max(FLOOR_ROW_BLOCKS, world_size)  # W's floor: as many partial sums as ranks
        perturbed = one_device(models["plain"], blocks)
        floor_value = floor.floor_of(floor.relative(perturbed, one["plain"]), precision)
        measured = measure.measure_on_ranks(
            cells, models["plain"], view0, view1, world_size, seed, precision=precision
        )
        batchnorm = measure.measure_on_ranks(
            {0: exact}, models["batchnorm"], view0, view1, world_size, seed, precision=precision
        )[0]
        exact_gradient = measured["exact"].gradient
        results = [(c, m.gradient, one["plain"]) for c, m in measured.items()]
        results.append(("per-rank batch norm", batchnorm.gradient, one["batchnorm"]))
        for case, gradient, reference in results:
            floored = floor.classify_at(gradient, reference, floor_value, precision, world_size,
                                        threshold=floor.threshold(blocks, world_size))  # fmt: skip
            name, epsilon = (f"slice × (1 + {case[1]:g})", case[1]) if isinstance(case, tuple) \
                else (case, None)  # fmt: skip
            rows.append({
                "precision": precision, "case": name, "epsilon": epsilon,
                "world_size": world_size, "seed": seed, "floor": floor_value,
                "departure": floored.rel_err, "floors": floored.floors,
                "verdict": floored.verdict,
                "bitwise_exact": bool(torch.equal(gradient, exact_gradient))
                if case != "per-rank batch norm" else False,
            })  # fmt: skip
    return rows


def _accumulation(precision: str, seed: int) -> list[dict]:
    """Naive accumulation (``updates.naive``, K = 2) at every W through the check of a whole
    update: its run in ``precision`` measured in floors beside float64's verdict."""
    table = check_training(
        update="updates:naive", model="plain_steps:build_model", data="plain_steps:Pairs",
        world_sizes=WORLD_SIZES, micro_batches=(2,), steps=1, global_batch_size=GLOBAL_BATCH,
        precision=precision, seed=seed,
    ).table  # fmt: skip
    whole = table[(table["part"] == "all") & (table["removed"] == "none")]
    return [
        {"precision": precision, "case": "naive accumulation", "epsilon": None,
         "world_size": int(r["world_size"]), "seed": seed, "floor": r["floor"],
         "departure": r["floors"] * r["floor"], "floors": r["floors"],
         "verdict": r["in_precision"], "bitwise_exact": False}
        for _, r in whole.iterrows()
    ]  # fmt: skip


def publish(table: pd.DataFrame) -> None:
    """figures/precision.{png,pdf,md} from the table."""
    figures.save(figure(table, floor.FLOOR_THRESHOLD), FIGURES / "precision")
    (FIGURES / "precision.md").write_text(summary(table))
    print((FIGURES / "precision.md").read_text())


# The bug classes of the figure, each with its colour; the exact runs are drawn as every reference
# is, the slices scaled by 1 + ε in one sequential map.
PRECISION_CASES = {
    "exact": {"color": "black", "marker": "o", "zorder": 6},  # over the slices that round away
    "old gather": {"color": figures.GATHER_COLORS["old"], "marker": "s"},
    "local negatives": {"color": "#ff7f0e", "marker": "^"},
    "per-rank batch norm": {"color": "#9467bd", "marker": "D"},
    "naive accumulation": {"color": "#8c564b", "marker": "v"},
}


def figure(table: pd.DataFrame, threshold: float) -> plt.Figure:
    """One panel per precision: each case's gradient departure from the same-precision one device
    in floors against W (the median over seeds, the band from the least to the most), on a log
    scale with exact zeros at the floor; the threshold drawn. A case under it is ``exact within``
    that precision: the exact runs always, a slice scaled by 1 + ε only where ε is larger than
    the precision's power. ``table`` has the columns of ``figures/precision.csv``."""
    precisions = list(dict.fromkeys(table["precision"]))
    epsilons = sorted({e for e in table["epsilon"].dropna()}, reverse=True)
    shades = plt.get_cmap("viridis")(np.linspace(0.1, 0.85, max(len(epsilons), 1)))
    styles = dict(PRECISION_CASES)
    for epsilon, shade in zip(epsilons, shades, strict=False):
        styles[f"slice × (1 + {epsilon:g})"] = {"color": shade, "marker": ".", "linestyle": ":"}
    with plt.rc_context(figures.STYLE):
        drawn, axes = plt.subplots(1, len(precisions), figsize=(3.9 * len(precisions), 4.2),
                                   sharey=True, layout="constrained")  # fmt: skip
        axes_ = list(np.atleast_1d(axes))
        for axis, precision in zip(axes_, precisions, strict=True):
            rows = table[table["precision"] == precision]
            for label, style in styles.items():
                group = rows[rows["case"] == label]
                if not len(group):
                    continue
                scores = group.groupby("world_size")["floors"]
                sizes = scores.median().index.to_numpy()
                low, mid, high = (np.maximum(f().to_numpy(float), figures.ZERO_FLOOR)
                                  for f in (scores.min, scores.median, scores.max))  # fmt: skip
                axis.plot(sizes, mid, linewidth=1.4, markersize=5, label=label,
                          **{"linestyle": "-", **style})  # fmt: skip
                axis.fill_between(sizes, low, high, color=style["color"], alpha=0.12, linewidth=0,
                                  zorder=style.get("zorder", 1) - 1)  # fmt: skip
            axis.axhline(threshold, **{**figures.REFERENCE_STYLE, "linewidth": 1.4})
            axis.text(sizes[0], threshold * 1.25, f"threshold: {threshold:g} floors", fontsize=8)
            word = terms.Precision(precision).word
            median_floor = rows.loc[rows["case"] == "exact", "floor"].median()
            axis.set_title(f"{word} ({precision}), median floor {median_floor:.1e}", fontsize=9)
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")
            axis.set_xticks(
                sorted(set(rows["world_size"])), map(str, sorted(set(rows["world_size"])))
            )
            axis.set_xlabel("W ranks")
            if axis is axes_[0]:
                axis.set_ylabel("‖g_W − g₁‖ / floor (same precision)")
        handles, labels = axes_[0].get_legend_handles_labels()
        drawn.legend(handles, labels, loc="outside right center", fontsize=8)
        drawn.suptitle("W ranks against one device in the same low precision, in floors of one "
                       "device with its forward in as many row blocks as ranks",
                       fontsize=10)  # fmt: skip
    return drawn


def summary(table: pd.DataFrame) -> str:
    """The table of docs/design.md §2 "Low precision": per precision the floor, the exact runs'
    worst score and its margin to the threshold, each bug class's least score, and the power."""
    threshold = floor.FLOOR_THRESHOLD
    seeds, sizes = table["seed"].nunique(), sorted(table["world_size"].unique())
    header = ["precision", "floor (median)", "exact: worst", "margin", "old gather: least",
              "local negatives: least", "per-rank batch norm: least",
              "naive accumulation: least", "power: gradient departure (T · floor)",
              "power: smallest ε seen", "ε bitwise exact"]  # fmt: skip
    body = []
    for precision, rows in table.groupby("precision", sort=False):

        def least(case: str, rows=rows) -> str:
            return f"{rows.loc[rows['case'] == case, 'floors'].min():.3g}"

        worst = rows.loc[rows["case"] == "exact", "floors"].max()
        slices = rows[rows["epsilon"].notna()]
        seen = slices.groupby("epsilon")["floors"].min()
        detected = [e for e, score in seen.items() if score > threshold]
        bitwise = slices.groupby("epsilon")["bitwise_exact"].all()
        body.append([
            precision, f"{rows['floor'].median():.2g}", f"{worst:.3g}",
            f"{threshold / worst:.2g}×", least("old gather"), least("local negatives"),
            least("per-rank batch norm"), least("naive accumulation"),
            f"{threshold * rows['floor'].median():.2g}",
            f"{min(detected):g}" if detected else "none",
            ", ".join(f"{e:g}" for e, same in bitwise.items() if same) or "none",
        ])  # fmt: skip
    return (
        f"Gradient departure of W ranks from one device in the same precision, in floors (one "
        f"device with its forward in as many row blocks as W has ranks), threshold "
        f"{threshold:g}: {seeds} seeds, "
        f'W = {", ".join(map(str, sizes))}, global batch {GLOBAL_BATCH}. "least": the smallest '
        'score of the bug over seeds and W; "power": the smallest ε whose slice × (1 + ε) '
        'scores above the threshold at every seed and W; "bitwise exact": the ε whose W-rank '
        "gradient equals the exact gather's bit for bit at every seed and W (the departure "
        "rounds away).\n\n" + runfiles.markdown_table(header, body) + "\n"
    )


if __name__ == "__main__":
    main()
