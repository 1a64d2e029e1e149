"""Figure (README, docs/results.md): when does a 1/W or biased gradient matter under real
optimizers?

Composes ``experiment=optimizer_matrix`` and trains, for every optimizer × cell (a gather on a
loss: exact, 1/W or biased per the audit) × W = 2, 4, 8 real gloo ranks and W = 32 simulated ranks
(``gatherlab.ranks.simworld``, one sample each), the same 100 steps as one device (plain DDP,
float64, ``gatherlab.check.measure.train``); records max |Δloss| over the steps and the final max
|Δweight|. Writes ``figures/optimizer_matrix.{png,pdf,csv,md}`` (the matrix) and
``figures/optimizer_curves.{png,pdf}`` (|Δloss| per step of the 1/W cell at the largest W).

Usage: ``python experiments/optimizer_matrix.py [--redraw]`` (``--redraw``: the matrix figure again
from ``figures/optimizer_matrix.csv``, nothing trained).
"""

from __future__ import annotations

import sys
import time

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from _sweep import FIGURES

from gatherlab import gather as gathering
from gatherlab.analysis import figures
from gatherlab.check import measure
from gatherlab.components import config
from gatherlab.core import gradients, runfiles, terms
from gatherlab.core.terms import GradientClass

EXACT = gradients.FLOAT64_TOLERANCE  # the float64 bound of docs/design.md §2


def main() -> None:
    if "--redraw" in sys.argv[1:]:  # the matrix again from figures/optimizer_matrix.csv
        table = pd.read_csv(FIGURES / "optimizer_matrix.csv")
        figures.save(figure(table, EXACT), FIGURES / "optimizer_matrix")
        return
    start = time.perf_counter()
    with config.composed():
        cfg, _ = config.compose(["experiment=optimizer_matrix"])
    table, curves, worlds = measured(cfg, start)
    publish(table, curves, worlds, cfg)
    print(f"wall time {time.perf_counter() - start:.0f} s")


def measured(cfg, start: float) -> tuple[pd.DataFrame, dict[str, list[float]], list]:
    """Every optimizer × cell × world size trained against one device: the table, the |Δloss|
    curves of the 1/W cell at the largest world, and the worlds. (Not the audit's inputs,
    ``audit.audit_inputs``: those are one batch of ``audit.losses``; these train ``steps``
    batches of ``optimizer_matrix.losses``.)"""
    spec = cfg.optimizer_matrix
    model = config.instantiate("model", cfg.model, _partial_=True, _convert_="all")
    batches = measure.global_batches(
        config.build_dataset(cfg), cfg.global_batch_size, cfg.seed, True, cfg.steps
    )
    losses = {
        name: config.loss_factory_of(node, None, cfg.seed) for name, node in spec.losses.items()
    }
    # real gloo ranks, then the simulated world (gatherlab.ranks.simworld) beyond the machine
    worlds = [(w, False) for w in spec.world_sizes]
    worlds += [(w, True) for w in spec.get("simulated_world_sizes", [])]
    rows, curves = [], {}
    for optimizer_name, node in spec.optimizers.items():
        optimizer = config.instantiate("optim", node)
        references = {
            name: measure.train(loss, model, batches, optimizer, 1, cfg.seed)
            for name, loss in losses.items()
        }
        for cell in spec.cells:
            loss = losses[cell.loss].with_gather(gathering.get(cell.gather))
            reference = references[cell.loss]
            for world_size, simulated in worlds:
                run = measure.train(
                    loss, model, batches, optimizer, world_size, cfg.seed, simulated
                )
                differences = [
                    abs(a - b) for a, b in zip(run.losses, reference.losses, strict=True)
                ]
                label = f"{cell.measured}: {cell.gather}\n{cell.loss}"
                rows.append({
                    "optimizer": optimizer_name, "cell": label, "gather": cell.gather,
                    "loss": cell.loss, "gradient": cell.measured, "world_size": world_size,
                    "world": terms.World.SIMULATED if simulated else terms.World.REAL,
                    "ranks": f"{world_size} sim" if simulated else str(world_size),
                    "max_abs_loss_diff": max(differences),
                    "max_abs_param_diff": float(
                        (run.parameters - reference.parameters).abs().max()
                    ),
                    "final_loss": run.losses[-1], "reference_final_loss": reference.losses[-1],
                })  # fmt: skip
                if (
                    cell.measured == GradientClass.ONE_OVER_W
                    and (world_size, simulated) == worlds[-1]
                ):
                    curves[optimizer_name] = differences
        print(f"{optimizer_name}: done, {time.perf_counter() - start:.0f} s", flush=True)
    return pd.DataFrame(rows), curves, worlds


def publish(table: pd.DataFrame, curves: dict[str, list[float]], worlds: list, cfg) -> None:
    """figures/optimizer_matrix.{csv,md,png,pdf} and figures/optimizer_curves.{png,pdf}."""
    spec = cfg.optimizer_matrix
    table.to_csv(FIGURES / "optimizer_matrix.csv", index=False, float_format="%.6g")
    batch = dict(zip(table["ranks"], table["world_size"], strict=True))
    diff = table.pivot_table(
        index="optimizer", columns=["cell", "ranks"], values="max_abs_loss_diff", sort=False
    )
    diff.columns = [(cell, w, cfg.global_batch_size // batch[w]) for cell, w in diff.columns]
    diff = diff.reindex(list(spec.optimizers))
    figures.save(figure(table, EXACT), FIGURES / "optimizer_matrix")
    figures.save(
        difference_curves(
            curves,
            f"old · ntxent_global (gradient 1/W) on {worlds[-1][0]}"
            f"{' simulated' if worlds[-1][1] else ''} ranks",
            EXACT,
        ),
        FIGURES / "optimizer_curves",
    )
    header = ["optimizer"] + [f"{cell.replace(chr(10), ' ')} W={w}" for cell, w, _ in diff.columns]
    params = table.pivot_table(
        index="optimizer", columns=["cell", "ranks"], values="max_abs_param_diff", sort=False
    ).reindex(list(spec.optimizers))
    markdown_rows = [
        [f"`{name}`"]
        + [f"{d:.2g} / {p:.2g}" for d, p in zip(diff.loc[name], params.loc[name], strict=True)]
        for name in diff.index
    ]
    (FIGURES / "optimizer_matrix.md").write_text(
        "max |Δloss| / final max |Δweight| against one device (float64, "
        f"{cfg.steps} steps, global batch {cfg.global_batch_size})\n\n"
        + runfiles.markdown_table(header, markdown_rows)
        + "\n"
    )
    print((FIGURES / "optimizer_matrix.md").read_text())


def _short(value: float) -> str:
    """A number in at most four characters: 0.17, 6e-8."""
    if value >= 0.1:
        return f"{value:.2g}"
    mantissa, exponent = f"{value:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def figure(table: pd.DataFrame, tolerance: float) -> plt.Figure:
    """The optimizer matrix for one paper column: rows the cells (gather on a loss, with the
    gradient class the audit measures) × world size, columns the optimizers; colour and number
    are max |Δloss| against one device (log scale), ✓ where it is within ``tolerance``."""
    rows = list(dict.fromkeys(zip(table["cell"], table["ranks"], strict=True)))
    optimizers = list(dict.fromkeys(table["optimizer"]))
    values = table.pivot_table(
        index=["cell", "ranks"], columns="optimizer", values="max_abs_loss_diff", sort=False
    ).reindex(index=rows, columns=optimizers)
    shown = np.maximum(values.to_numpy(dtype=float), figures.ZERO_FLOOR)
    norm = matplotlib.colors.LogNorm(
        vmin=figures.ZERO_FLOOR, vmax=max(1.0, float(np.nanmax(shown)))
    )
    with plt.rc_context({**figures.STYLE, "axes.grid": False, "font.size": 6.5}):
        drawn, axis = plt.subplots(figsize=(3.5, 0.9 + 0.19 * len(rows)), layout="constrained")
        image = axis.imshow(shown, cmap="magma_r", norm=norm, aspect="auto")
        for row in range(len(rows)):
            for column in range(len(optimizers)):
                value = values.iat[row, column]
                text = "✓" if value <= tolerance else _short(value)
                dark = norm(shown[row, column]) > 0.55
                axis.text(column, row, text, ha="center", va="center", fontsize=6,
                          color="white" if dark else "black")  # fmt: skip
        cells = [cell for cell, _ in rows]
        for row in range(1, len(rows)):
            if cells[row] != cells[row - 1]:
                axis.axhline(row - 0.5, color="white", linewidth=2)
        labels = [
            f"{cell.replace(chr(10), ' ')}, W={ranks}" if row == 0 or cells[row - 1] != cell
            else f"W={ranks}"
            for row, (cell, ranks) in enumerate(rows)
        ]  # fmt: skip
        axis.set_yticks(range(len(rows)), labels)
        axis.xaxis.tick_top()
        axis.set_xticks(range(len(optimizers)), optimizers, rotation=30, ha="left")
        axis.tick_params(length=0)
        for spine in axis.spines.values():
            spine.set_visible(False)
        bar = drawn.colorbar(image, ax=axis, shrink=0.8, pad=0.02)
        bar.set_label("max |Δloss| vs one device", fontsize=6)
        bar.ax.tick_params(labelsize=5.5)
        bar.ax.axhline(tolerance, color="0.3", linewidth=1.2)
        axis.set_title(f"✓: matches within {tolerance:g} (float64)", fontsize=6.5, pad=4)
    return drawn


def difference_curves(
    curves: dict[str, list[float]], title: str, tolerance: float | None = None
) -> plt.Figure:
    """|Δloss| against the reference per optimizer step, one line per name (log scale)."""
    with plt.rc_context(figures.STYLE):
        drawn, axis = plt.subplots(figsize=(6.4, 3.6), layout="constrained")
        lines = ("-", "--", "-.", ":")  # lines that coincide stay visible
        for number, (name, values) in enumerate(curves.items()):
            axis.plot(
                np.maximum(values, figures.ZERO_FLOOR), label=name, linewidth=1.6,
                linestyle=lines[number % len(lines)],
            )  # fmt: skip
        figures.style_difference_axis(axis, tolerance, "|Δloss| vs 1-device run")
        axis.set_title(title, fontsize=10)
        axis.legend(fontsize=8, ncols=2)
    return drawn


if __name__ == "__main__":
    main()
