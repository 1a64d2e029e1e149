"""Figure (docs/results.md): does accumulating K micro-batches train like one device with the
whole batch?

Composes ``experiment=accumulation`` and trains gatherlab's own module (``python -m
gatherlab.train``'s job, ``gatherlab.lab.jobs.run``) for every loss × accumulation (naive, cached)
× W ranks × K micro-batches per rank, and once per loss on one device with the whole batch and no
accumulation (the reference); records max |Δloss| over the steps and the final max |Δweight|.
Each run owns its directory under ``multirun/accumulation-<time>/``. Writes
``figures/accumulation.{csv,md,png,pdf}``.

Usage: ``python experiments/accumulation.py [--redraw]`` (``--redraw``: the figure and the table
again from ``figures/accumulation.csv``, nothing trained).
"""

from __future__ import annotations

import sys
import time
from datetime import datetime
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from _sweep import FIGURES, REPO

from gatherlab.analysis import figures
from gatherlab.components import config
from gatherlab.core import gradients, runfiles
from gatherlab.lab import jobs, validation

EXACT = gradients.FLOAT64_TOLERANCE  # the float64 bound of docs/design.md §2


def main() -> None:
    if "--redraw" in sys.argv[1:]:
        publish(pd.read_csv(FIGURES / "accumulation.csv"))
        return
    start = time.perf_counter()
    with config.composed():
        cfg, _ = config.compose(["experiment=accumulation"])
        table = measured(cfg, start)
    table.to_csv(FIGURES / "accumulation.csv", index=False, float_format="%.6g")
    publish(table)
    print(f"wall time {time.perf_counter() - start:.0f} s")


def _run(root: Path, name: str, overrides: list[str]) -> Path:
    """One checked job of ``experiment=accumulation`` with ``overrides``, trained into
    ``root/name``."""
    cfg, choices = config.compose(["experiment=accumulation", *overrides])
    validation.validate(cfg)
    jobs.run(cfg, root / name, choices, overrides)
    return root / name


def _differences(run_dir: Path, reference_dir: Path) -> tuple[float, float, float]:
    """Max |Δloss| over the steps, final max |Δweight|, and the run's final loss."""
    loss, reference = (runfiles.read_curves(d)["loss"] for d in (run_dir, reference_dir))
    state, reference_state = (runfiles.read_final_state(d) for d in (run_dir, reference_dir))
    weights = max(float((state[k] - reference_state[k]).abs().max()) for k in state)
    return max(abs(a - b) for a, b in zip(loss, reference, strict=True)), weights, loss[-1]


def measured(cfg, start: float) -> pd.DataFrame:
    """Every loss × accumulation × (W, K) against its one-device run: the table."""
    spec = cfg.accumulation_experiment
    root = REPO / "multirun" / f"accumulation-{datetime.now():%Y-%m-%d_%H-%M-%S-%f}"
    rows = []
    for loss in spec.losses:
        reference = _run(root, f"{loss}-reference", [f"loss={loss}", "layout=cpu1"])
        for accumulation in spec.accumulations:
            for world_size in spec.world_sizes:
                for micro_batches in spec.micro_batches:
                    run_dir = _run(
                        root,
                        f"{loss}-{accumulation}-W{world_size}-K{micro_batches}",
                        [
                            f"loss={loss}", f"layout=cpu{world_size}",
                            f"layout.accumulation={accumulation}",
                            f"layout.micro_batches={micro_batches}",
                        ],
                    )  # fmt: skip
                    loss_diff, weight_diff, final = _differences(run_dir, reference)
                    rows.append({
                        "loss": loss, "accumulation": accumulation, "world_size": world_size,
                        "micro_batches": micro_batches,
                        "micro_batch_rows": cfg.global_batch_size // (world_size * micro_batches),
                        "max_abs_loss_diff": loss_diff, "max_abs_param_diff": weight_diff,
                        "final_loss": final, "steps": cfg.steps,
                        "global_batch_size": cfg.global_batch_size,
                        "reference_final_loss": runfiles.read_curves(reference)["loss"][-1],
                    })  # fmt: skip
        print(f"{loss}: done, {time.perf_counter() - start:.0f} s", flush=True)
    print(f"runs: {root}")
    return pd.DataFrame(rows)


def publish(table: pd.DataFrame) -> None:
    """figures/accumulation.{png,pdf,md} from the table."""
    figures.save(figure(table, EXACT), FIGURES / "accumulation")
    layouts = list(dict.fromkeys(zip(table["world_size"], table["micro_batches"], strict=True)))
    header = ["loss", "accumulation"] + [f"W={w} K={k}" for w, k in layouts]
    markdown_rows = []
    for (loss, accumulation), group in table.groupby(["loss", "accumulation"], sort=False):
        cells = group.set_index(["world_size", "micro_batches"])
        markdown_rows.append(
            [f"`{loss}`", accumulation]
            + [
                f"{cells.loc[layout, 'max_abs_loss_diff']:.2g} / "
                f"{cells.loc[layout, 'max_abs_param_diff']:.2g}"
                for layout in layouts
            ]
        )
    steps, batch = table["steps"].iat[0], table["global_batch_size"].iat[0]
    (FIGURES / "accumulation.md").write_text(
        "max |Δloss| / final max |Δweight| against one device with the whole batch (float64, "
        f"{steps} steps, global batch {batch}; W ranks × K micro-batches per rank)\n\n"
        + runfiles.markdown_table(header, markdown_rows)
        + "\n"
    )
    print((FIGURES / "accumulation.md").read_text())


ACCUMULATION_STYLES = {
    "cached": {"color": "#1f77b4", "marker": "o", "linestyle": "-"},
    "naive": {"color": "#d62728", "marker": "s", "linestyle": "--"},
}


def figure(table: pd.DataFrame, tolerance: float) -> plt.Figure:
    """One panel per loss: max |Δloss| against one device with the whole batch (log scale, exact
    zeros at the floor) for every layout W ranks × K micro-batches, one line per accumulation;
    a point on or under the tolerance line trains like one device."""
    losses = list(dict.fromkeys(table["loss"]))
    layouts = list(dict.fromkeys(zip(table["world_size"], table["micro_batches"], strict=True)))
    with plt.rc_context(figures.STYLE):
        drawn, axes = plt.subplots(
            1, len(losses), figsize=(3.6 * len(losses), 3.6), sharey=True, layout="constrained"
        )
        axes_ = list(np.atleast_1d(axes))
        for axis, loss in zip(axes_, losses, strict=True):
            rows = table[table["loss"] == loss]
            for accumulation, group in rows.groupby("accumulation", sort=False):
                cells = group.set_index(["world_size", "micro_batches"])["max_abs_loss_diff"]
                style = ACCUMULATION_STYLES.get(accumulation, {})
                for world_size in dict.fromkeys(w for w, _ in layouts):  # a line per W
                    columns = [i for i, (w, _) in enumerate(layouts) if w == world_size]
                    values = [max(cells.loc[layouts[i]], figures.ZERO_FLOOR) for i in columns]
                    axis.plot(
                        columns, values, linewidth=1.4, markersize=5, **style,
                        label=accumulation if world_size == layouts[0][0] else None,
                    )  # fmt: skip
            figures.style_difference_axis(
                axis, tolerance, "max |Δloss| vs one device" if axis is axes_[0] else ""
            )
            axis.set_title(loss, fontsize=10)
            axis.set_xticks(range(len(layouts)), [f"W={w}\nK={k}" for w, k in layouts], fontsize=7)
            axis.set_xlabel("W ranks × K micro-batches per rank")
            for boundary in range(1, len(layouts)):
                if layouts[boundary][0] != layouts[boundary - 1][0]:
                    axis.axvline(boundary - 0.5, color="0.85", linewidth=1)
        handles, labels = axes_[0].get_legend_handles_labels()
        drawn.legend(
            handles, labels, loc="outside lower center", ncols=2, fontsize=8, title="accumulation"
        )
        drawn.suptitle(
            f"Accumulating K micro-batches (float64; exact 0 drawn at {figures.ZERO_FLOOR:g})",
            fontsize=10,
        )
    return drawn


if __name__ == "__main__":
    main()
