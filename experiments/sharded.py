"""Figure (docs/results.md, docs/checking.md §10 "Sharded code"): DDP, FSDP2 and ZeRO against one
device, exact and with each trap of sharded training switched on, through the check of a plain
step (`gatherlab.check.check_training`).

For each strategy × case × W ∈ {2, 4}, on real gloo ranks in float64, 5 SGD updates of the local
NT-Xent with a learnt temperature (``examples/sharded_steps.py``): the strategy's correct code;
the temperature outside what DDP or FSDP2 holds (its gradient each rank's own: ``unreduced``,
reproduced by all-reducing it); the loss divided by W on top of the average (DDP, ZeRO) or FSDP2's
gradient divide factor 1 on every module (W times). Writes ``figures/sharded.{csv,md,png,pdf}``.

Usage: ``python experiments/sharded.py [--redraw]`` (``--redraw``: the figure and the table again
from ``figures/sharded.csv``, nothing trained).
"""

from __future__ import annotations

import sys
import time

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from _sweep import FIGURES, REPO

sys.path.insert(0, str(REPO / "examples"))  # the stand-ins, imported by name on every rank too

from gatherlab.analysis import figures
from gatherlab.check import check_training
from gatherlab.check.training import UNREDUCED
from gatherlab.core import gradients, runfiles

WORLD_SIZES = (2, 4)
STEPS = 5
SGD, ZERO = "torch.optim:SGD", "sharded_steps:zero_sgd"
# strategy → case → (step, model factory, its keyword arguments, optimizer)
CASES = {
    "ddp": {
        "exact": ("temperature_step", "build_with_temperature", {}, SGD),
        "temperature outside": ("temperature_step", "build_ddp_temperature_outside", {}, SGD),
        "loss ÷ W": ("divided_temperature_step", "build_with_temperature", {}, SGD),
    },
    "fsdp2": {
        "exact": ("temperature_step", "build_fsdp2_temperature_inside", {}, SGD),
        "temperature outside": ("temperature_step", "build_fsdp2_temperature_outside", {}, SGD),
        "divide factor 1": ("temperature_step", "build_fsdp2_temperature_inside",
                            {"divide_factor": 1.0}, SGD),
    },
    "zero": {
        "exact": ("temperature_step", "build_with_temperature", {}, ZERO),
        "temperature outside": ("temperature_step", "build_ddp_temperature_outside", {}, ZERO),
        "loss ÷ W": ("divided_temperature_step", "build_with_temperature", {}, ZERO),
    },
}  # fmt: skip
COLUMNS = ("strategy", "case", "world_size", "verdict", "gradient", "cause", "culprits",
           "cosine", "norm_ratio", "max_rel_err", "max_abs_param_diff", "unreduced",
           "reduced_verdict")  # fmt: skip


def main() -> None:
    if "--redraw" in sys.argv[1:]:
        publish(pd.read_csv(FIGURES / "sharded.csv", keep_default_na=False, na_values=[""]))
        return
    start = time.perf_counter()
    rows = []
    for strategy, cases in CASES.items():
        for case, (step, model, kwargs, optimizer) in cases.items():
            table = check_training(
                step=f"sharded_steps:{step}", model=f"sharded_steps:{model}", model_kwargs=kwargs,
                optimizer=optimizer, optimizer_kwargs={"lr": 0.01}, data="plain_steps:Pairs",
                world_sizes=WORLD_SIZES, steps=STEPS,
            ).table  # fmt: skip
            whole = table[(table["part"] == "all") & (table["removed"] == "none")]
            for _, row in whole.iterrows():
                found = table.attrs.get(UNREDUCED, {}).get(f"{row['world_size']},1")
                rows.append({
                    **{c: row[c] for c in COLUMNS if c in row}, "strategy": strategy,
                    "case": case, "unreduced": ";".join(found.parts) if found else "",
                    "reduced_verdict": found.reduced if found else "",
                })  # fmt: skip
        print(f"{strategy}: done, {time.perf_counter() - start:.0f} s", flush=True)
    table = pd.DataFrame(rows, columns=list(COLUMNS))
    table.to_csv(FIGURES / "sharded.csv", index=False, float_format="%.6g")
    publish(table)
    print(f"wall time {time.perf_counter() - start:.0f} s")


def publish(table: pd.DataFrame) -> None:
    """figures/sharded.{png,pdf,md} from the table."""
    figures.save(figure(table, gradients.FLOAT64_TOLERANCE), FIGURES / "sharded")
    header = ["strategy", "case", *(f"W = {w}" for w in WORLD_SIZES)]
    body = []
    for (strategy, case), rows in table.groupby(["strategy", "case"], sort=False):
        cells = []
        for _, row in rows.sort_values("world_size").iterrows():
            named = f" ({row['cause']})" if isinstance(row["cause"], str) and row["cause"] else ""
            cells.append(f"{row['verdict']}{named}, gradient {row['gradient']}, weights "
                         f"{row['max_abs_param_diff']:.2g}")  # fmt: skip
        body.append([strategy, case, *cells])
    (FIGURES / "sharded.md").write_text(
        f"DDP, FSDP2 and ZeRO against one device (float64, {STEPS} SGD updates, the local NT-Xent "
        "with a learnt temperature; the check of a plain step, `gatherlab.check.check_training`): "
        "the verdict, its cause, the first gradient's class and the final weights' largest "
        "difference from one device's.\n\n" + runfiles.markdown_table(header, body) + "\n"
    )
    print((FIGURES / "sharded.md").read_text())


SHARDED_SIZES = {2: "#6baed6", 4: "#08519c"}  # a world size's bar in the figure


def figure(table: pd.DataFrame, tolerance: float) -> plt.Figure:
    """One panel per strategy (DDP, FSDP2, ZeRO): for each case, the final weights' max |Δ|
    against one device after the run's updates (log scale, exact zeros at the floor), a bar per
    W, its verdict written over it; the float64 tolerance drawn. ``table`` has the columns of
    ``figures/sharded.csv``."""
    strategies = list(dict.fromkeys(table["strategy"]))
    sizes = sorted(set(table["world_size"]))
    width = 0.8 / len(sizes)
    with plt.rc_context(figures.STYLE):
        drawn, axes = plt.subplots(1, len(strategies), figsize=(4.2 * len(strategies), 4.2),
                                   sharey=True, layout="constrained")  # fmt: skip
        for axis, strategy in zip(np.atleast_1d(axes), strategies, strict=True):
            rows = table[table["strategy"] == strategy]
            cases = list(dict.fromkeys(rows["case"]))
            for offset, size in enumerate(sizes):
                at = rows[rows["world_size"] == size].set_index("case").loc[cases]
                x = np.arange(len(cases)) + (offset - (len(sizes) - 1) / 2) * width
                heights = np.maximum(at["max_abs_param_diff"].to_numpy(float), figures.ZERO_FLOOR)
                axis.bar(x, heights, width, color=SHARDED_SIZES.get(size, "0.5"),
                         label=f"W = {size}")  # fmt: skip
                for left, height, (_, row) in zip(x, heights, at.iterrows(), strict=True):
                    named = row["cause"] if isinstance(row["cause"], str) and row["cause"] else ""
                    if row["verdict"] == "loss differs":  # the gradient says more
                        named = f"gradient {row['gradient']}"
                    word = f"{row['verdict']}\n({named})" if named else row["verdict"]
                    lift = 1.6 * 12**offset  # each W a line higher: neighbours never overlap
                    axis.text(left, height * lift, word, ha="center", va="bottom", fontsize=6.5)
            axis.axhline(tolerance, **{**figures.REFERENCE_STYLE, "linewidth": 1.2})
            axis.set_xticks(range(len(cases)), cases, fontsize=8)
            axis.set_yscale("log")
            axis.set_ylim(figures.ZERO_FLOOR / 10, 100)
            axis.set_title(strategy, fontsize=10)
            if axis is np.atleast_1d(axes)[0]:
                axis.set_ylabel("final weights' max |Δ| vs one device")
                axis.legend(fontsize=8, loc="upper left")
        drawn.suptitle(f"Sharded training against one device (float64; dashed: {tolerance:g}; "
                       f"exact 0 drawn at {figures.ZERO_FLOOR:g})", fontsize=10)  # fmt: skip
    return drawn


if __name__ == "__main__":
    main()
