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
            )  # fmt: skip
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
    figure = figures.sharded_figure(table, gradients.FLOAT64_TOLERANCE)
    figures.save(figure, FIGURES / "sharded")
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


if __name__ == "__main__":
    main()
