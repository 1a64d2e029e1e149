"""One figure style for gatherlab: every gather keeps its colour in every figure, and the
1-device reference is always drawn the same way (black, dashed).

Here are the style (`STYLE`, `gather_color`, `REFERENCE_STYLE`, `ZERO_FLOOR`,
`style_difference_axis`, `save`: PNG beside vector PDF) and the figures the library draws: a
sweep's comparison and loss matrix (`analysis.report`), the audit, the scaling figure, two
recordings compared (`gatherlab.compare`), the size benchmark's, and the notebook's. A figure that
one experiment alone draws lives in its script in ``experiments/`` and draws with this style."""

from __future__ import annotations

import contextlib
import logging
import re
import zlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt  # headless: matplotlib picks Agg; notebooks: the inline backend
import numpy as np
import pandas as pd

from gatherlab.core import runfiles, terms
from gatherlab.core.floor import threshold
from gatherlab.core.terms import GradientClass, World

# A style table, not a list of gathers: which gathers exist is the gather config group's options
# (gatherlab.gather.NAMES, conf/gather/*.yaml). A colour per option gatherlab ships, fixed's
# variants in fixed's blues; any other name gets one of OTHER_GATHER_COLORS (gather_color).
GATHER_COLORS = {
    "fixed": "#1f77b4",
    "fixed_all_reduce": "#6baed6",
    "fixed_reduce_scatter": "#08519c",
    "old": "#d62728",
    "torch_nn": "#2ca02c",
    "functional": "#17becf",
    "lightning": "#9467bd",
    "nograd_swap": "#ff7f0e",
    "nograd": "#8c564b",
    "avg": "#e377c2",
}
# how a column of the simulated world (gatherlab.ranks.simworld) is labelled apart from real ranks
SIMULATED_MARK = {World.REAL: "", World.SIMULATED: " sim"}
REFERENCE_STYLE = {"color": "black", "linestyle": (0, (4, 3)), "linewidth": 2.0, "zorder": 5}
DEVICE_STYLES = {2: "-", 4: "-.", 8: ":"}
# A sweep over the strategy (conf/strategy/) colours its runs by it: the correct ones in blues and
# greens, the traps in warm colours.
STRATEGY_COLORS = {
    "ddp": "#1f77b4", "zero": "#2ca02c", "fsdp2": "#17becf", "tp": "#3949ab",
    "fsdp2_unreduced": "#ff7f0e", "fsdp2_summed": "#d62728", "tp_unreduced_norm": "#e6550d",
    "pp": "#2ca02c", "pp_unscaled": "#d62728", "pp_untied": "#ff7f0e",
}  # fmt: skip
# |Δloss| of exactly 0 cannot sit on a log axis; such points are drawn at this floor.
ZERO_FLOOR = 1e-18

STYLE = {
    "figure.dpi": 110,
    "savefig.dpi": 200,
    "font.size": 10,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "legend.frameon": False,
}


# Colours for gathers that a user adds: each name keeps one of these in every figure.
OTHER_GATHER_COLORS = ("#bcbd22", "#7f7f7f", "#393b79", "#637939", "#8c6d31", "#843c39")


def gather_color(name: str) -> str:
    """The colour of gather ``name`` in every figure: its entry of `GATHER_COLORS`, else one of
    `OTHER_GATHER_COLORS` chosen by the name alone (the same in every figure and process)."""
    if name in GATHER_COLORS:
        return GATHER_COLORS[name]
    return OTHER_GATHER_COLORS[zlib.crc32(name.encode()) % len(OTHER_GATHER_COLORS)]


def style_difference_axis(axis: plt.Axes, tolerance: float | None, ylabel: str) -> None:
    """The |Δloss| panel of every figure, the library's and the experiments': log scale, exact
    zeros at the floor, the tolerance."""
    axis.set(
        yscale="log",
        xlabel="optimizer step",
        ylabel=ylabel,
        title=f"difference from the reference (exact 0 drawn at {ZERO_FLOOR:g})",
    )
    axis.set_ylim(bottom=ZERO_FLOOR / 3)
    axis.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))  # steps: no 0.5
    if tolerance is not None:  # always in view, whatever the runs' differences
        axis.set_ylim(top=max(axis.get_ylim()[1], 30 * tolerance))
        axis.axhline(tolerance, color="0.4", linewidth=1, linestyle=":")
        axis.annotate(
            f"match tolerance {tolerance:g}", (0.04, tolerance), xycoords=("axes fraction", "data"),
            ha="left", va="bottom", fontsize=8, color="0.3",
        )  # fmt: skip


def comparison_figure(
    table: pd.DataFrame,
    curves: Mapping[str, pd.DataFrame],
    tolerance: float | None = None,
    override_columns: Sequence[str] = (),
) -> plt.Figure:
    """Loss curves beside the reference (left) and |Δloss| against it on a log scale (right).

    One row of panels per group of comparable runs (``table.group``); ``curves`` maps ``run_dir``
    to that run's curves; ``override_columns`` are the table's columns of overrides that vary
    between runs (`gatherlab.analysis.report.SweepComparison`), which name a group in its title.
    """
    groups = list(dict.fromkeys(table["group"]))
    with plt.rc_context(STYLE):
        figure, axes = plt.subplots(
            len(groups), 2, figsize=(11, 3.6 * len(groups)), squeeze=False, layout="constrained"
        )
        for (loss_axis, diff_axis), group in zip(axes, groups, strict=True):
            runs = table[table["group"] == group]
            _draw_group_against_reference(loss_axis, diff_axis, runs, curves)
            style_difference_axis(diff_axis, tolerance, "|Δ loss| vs 1-device reference")
            title = _group_title(table, runs, override_columns)
            loss_axis.set(title=title, xlabel="optimizer step", ylabel="global loss")
            loss_axis.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
            loss_axis.legend(fontsize=8)
            if diff_axis.get_legend_handles_labels()[0]:  # a group may hold no compared run
                diff_axis.legend(fontsize=8, loc="center right")
    return figure


def _draw_group_against_reference(
    loss_axis: plt.Axes,
    diff_axis: plt.Axes,
    runs: pd.DataFrame,
    curves: Mapping[str, pd.DataFrame],
) -> None:
    """One group's panels of `comparison_figure`: each multi-device run's loss (left) and its
    |Δloss| against the group's reference (right), then the reference's loss."""
    reference_dir = runs["reference"].dropna().iloc[0] if runs["reference"].notna().any() else None
    floors = runs[runs["row_blocks"] > 1] if "row_blocks" in runs else runs.iloc[:0]
    if reference_dir is not None and len(floors) and runs["floors"].notna().any():
        limit = threshold(int(floors.iloc[0]["row_blocks"]), int(runs["devices"].max()))
        _draw_floor_band(diff_axis, curves[floors.iloc[0]["run_dir"]], curves[reference_dir],
                         limit)  # fmt: skip
    strategies = runs["strategy"].nunique() > 1 if "strategy" in runs else False
    drawn: list[tuple[str, np.ndarray]] = []  # each label drawn, with its losses
    for _, run in runs[runs["devices"] > 1].iterrows():
        run_curves = curves[run["run_dir"]]
        style = {
            "color": (STRATEGY_COLORS.get(run["strategy"], OTHER_GATHER_COLORS[0]) if strategies
                      else gather_color(run["gather"])),
            "linestyle": DEVICE_STYLES.get(run["devices"], "--"),
            "linewidth": 1.6,
            "marker": "o" if len(run_curves) < 3 else None,  # visible alone
        }  # fmt: skip
        named = f"{run['gather']}, {run['strategy']}" if strategies else run["gather"]
        label = f"{named}, {run['devices']} × {run['batch_size']}"
        losses = run_curves["loss"].to_numpy()
        under = [earlier for earlier, seen in drawn if np.array_equal(seen, losses)]
        drawn.append((label, losses))
        if under:  # the same numbers: drawn over them, which the legend says
            label += f" (over {', '.join(under)}: the same losses)"
        loss_axis.plot(run_curves["step"], run_curves["loss"], label=label, **style)
        if reference_dir is not None:
            reference = curves[reference_dir]
            steps = min(len(reference), len(run_curves))
            diff = np.abs(
                run_curves["loss"].to_numpy()[:steps] - reference["loss"].to_numpy()[:steps]
            )
            diff_axis.plot(
                reference["step"][:steps], np.maximum(diff, ZERO_FLOOR), label=label, **style
            )
    if reference_dir is not None:
        reference = curves[reference_dir]
        global_batch = runs["global_batch_size"].iloc[0]
        loss_axis.plot(
            reference["step"],
            reference["loss"],
            label=f"reference, 1 × {global_batch}",
            **REFERENCE_STYLE,
        )


def _draw_floor_band(
    diff_axis: plt.Axes, floor_curves: pd.DataFrame, reference: pd.DataFrame, limit: float
) -> None:
    """A low precision's floor on the |Δloss| panel (docs/design.md §2): the floor run's |Δloss|
    against the reference at each step (one device with its forward in two row blocks, grey),
    and the band up to ``limit`` (T, `floor.threshold`) times its largest, the loss half of a
    run's verdict (a
    run inside it matches as far as its precision lets the report tell, when its final weights
    are within as many floors too)."""
    steps = min(len(floor_curves), len(reference))
    floor = np.abs(floor_curves["loss"].to_numpy()[:steps] - reference["loss"].to_numpy()[:steps])
    x = reference["step"][:steps]
    diff_axis.fill_between(x, ZERO_FLOOR, max(limit * floor.max(), ZERO_FLOOR),
                           color="0.85", linewidth=0, zorder=0,
                           label=f"within {limit:g} floors")  # fmt: skip
    diff_axis.plot(x, np.maximum(floor, ZERO_FLOOR), color="0.45", linewidth=1.0,
                   label="floor: one device, 2 row blocks")  # fmt: skip


# The rounding of a number near 1 in each precision a run trains in: the finest difference its
# losses can show (`final_loss_figure` marks it at the reference's loss).
EPSILON = {precision: 2 * precision.unit_roundoff for precision in terms.Precision}


def final_loss_figure(table: pd.DataFrame, tolerance: float | None = None) -> plt.Figure:
    """|final loss − its 1-device reference's final loss| of every compared run of a comparison
    table (`gatherlab.report.compare`), one bar per run in its gather's colour, on a log axis: an
    exact 0 drawn at `ZERO_FLOOR` and written ``0``; the match tolerance and the rounding of the
    reference's loss in the runs' precision (`EPSILON`) marked. The final losses themselves agree
    to two or three digits whether a run matches or not (bars of them look alike); their
    differences from the reference span sixteen orders of magnitude."""
    final = dict(zip(table["run_dir"], table["final_loss"], strict=True))
    runs = table[(table["verdict"] != "reference") & table["reference"].notna()]
    runs = runs[runs["final_loss"].notna() & runs["reference"].map(final).notna()]
    labels = _told_apart(runs, [f"{run.gather} {run.layout} ({run.devices} × {run.batch_size})"
                                for run in runs.itertuples()])  # fmt: skip
    differences = [abs(run.final_loss - final[run.reference]) for run in runs.itertuples()]
    precisions = set(runs["precision"])
    epsilon = EPSILON.get(precisions.pop()) if len(precisions) == 1 else None
    with plt.rc_context(STYLE):
        figure, axis = plt.subplots(figsize=(7.5, 1.6 + 0.45 * max(len(runs), 1)),
                                    layout="constrained")  # fmt: skip
        positions = np.arange(len(runs))[::-1]
        drawn = [max(d, ZERO_FLOOR) for d in differences]
        axis.barh(positions, drawn, height=0.6, color=[gather_color(g) for g in runs["gather"]])
        for position, difference, width in zip(positions, differences, drawn, strict=True):
            axis.annotate(
                "0" if difference == 0 else f"{difference:.2g}", (width, position),
                xytext=(3, 0), textcoords="offset points", va="center", fontsize=8,
            )  # fmt: skip
        axis.set_yticks(positions, labels, fontsize=8)
        axis.set_xscale("log")
        axis.set_xlim(ZERO_FLOOR / 3, max([*drawn, 30 * (tolerance or ZERO_FLOOR)]) * 30)
        axis.grid(axis="y", visible=False)
        axis.set(
            xlabel=f"|final loss − 1-device reference's| (exact 0 drawn at {ZERO_FLOOR:g})",
            title="final loss: each run's difference from its 1-device reference",
        )
        if tolerance is not None:
            axis.axvline(tolerance, color="0.3", linewidth=1, linestyle=":",
                         label=f"match tolerance {tolerance:g}")  # fmt: skip
        if epsilon is not None and len(runs):
            rounding = epsilon * max(abs(final[r]) for r in runs["reference"])
            axis.axvline(rounding, color="0.6", linewidth=1, linestyle="--",
                         label=f"rounding of the reference's loss ({rounding:.1g})")  # fmt: skip
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncols=2)
    return figure


def _told_apart(runs: pd.DataFrame, labels: list[str]) -> list[str]:
    """``labels``, each that several runs share followed by the choices that tell those runs
    apart (``strategy=tp``: a sweep over strategies, whose runs share gather and layout)."""
    shared = pd.Series(labels, index=runs.index)
    told = []
    for index, label in shared.items():
        alike = runs.loc[shared == label]
        keys = [key for key in runfiles.SUMMARY_CHOICES
                if key in runs and alike[key].nunique(dropna=False) > 1]  # fmt: skip
        told.append(label + "".join(f", {key}={runs.at[index, key]}" for key in keys))
    return told


def _group_title(table: pd.DataFrame, runs: pd.DataFrame, override_columns: Sequence[str]) -> str:
    """What one group of `comparison_figure` is: its experiment, loss, model and precision, and
    the keys that tell it from the table's other groups (e.g. ``removals.batchnorm=global``)."""
    first = runs.iloc[0]
    precision = terms.Precision(first["precision"])
    precision = (
        precision.word if precision.autocast_dtype_name is None else f"{precision.word} mixed"
    )
    what = ", ".join(str(first[c]) for c in ("loss", "model") if not pd.isna(first[c]))
    what = f"{what}, {precision}" if what else precision
    keys = [c for c in override_columns if c in table]
    named = [c for c in keys if table[c].nunique() > 1 and runs[c].nunique() == 1]
    what += "".join(f", {c}={first[c]}" for c in named)
    return f"{first['experiment']} — {what}" if first["experiment"] else what


def matrix_figure(
    diff: pd.DataFrame, matches: pd.DataFrame, tolerance: float | None = None
) -> plt.Figure:
    """Heat map of max |Δloss| against the reference (log colour scale): rows are losses, columns
    ``(gather, devices, batch_size)``; a ✓ marks a cell that matches its reference."""
    values = np.maximum(diff.to_numpy(dtype=float), ZERO_FLOOR)
    norm = matplotlib.colors.LogNorm(vmin=ZERO_FLOOR, vmax=max(1.0, float(np.nanmax(values))))
    rows, columns = diff.shape
    with plt.rc_context({**STYLE, "axes.grid": False}):
        figure, axis = plt.subplots(
            figsize=(2.0 + 1.25 * columns, max(1.2 + 0.45 * rows, 3.0)), layout="constrained"
        )
        image = axis.imshow(values, cmap="magma_r", norm=norm, aspect="auto")
        for row in range(rows):
            for column in range(columns):
                value, match = diff.iat[row, column], matches.iat[row, column]
                if np.isnan(value):
                    continue
                text = ("✓ 0" if value == 0 else f"✓ {value:.0e}") if match else f"✗ {value:.2g}"
                dark = norm(values[row, column]) > 0.55
                axis.text(
                    column, row, text, ha="center", va="center", fontsize=8,
                    color="white" if dark else "black",
                )  # fmt: skip
        gathers = [gather for gather, _, _ in diff.columns]
        for column in range(1, columns):
            if gathers[column] != gathers[column - 1]:
                axis.axvline(column - 0.5, color="white", linewidth=3)
        axis.xaxis.tick_top()
        axis.set_xticks(
            range(columns),
            [f"{gather}\n{devices} × {batch}" for gather, devices, batch in diff.columns],
        )
        for tick, gather in zip(axis.xaxis.get_major_ticks(), gathers, strict=True):
            tick.label2.set_color(gather_color(gather))
            tick.label2.set_fontweight("bold")
        axis.set_yticks(range(rows), list(diff.index))
        axis.tick_params(length=0)
        for spine in axis.spines.values():
            spine.set_visible(False)
        bar = figure.colorbar(image, ax=axis, shrink=0.9)
        bar.set_label("max |Δloss| vs 1-device\nreference (log scale)")  # fits 2 rows
        if tolerance is not None:
            bar.ax.axhline(tolerance, color="0.3", linewidth=1.5)
        axis.set_title(
            "gather, devices × batch per device"
            + (f"   (✓: matches within {tolerance:g})" if tolerance is not None else ""),
            fontsize=9,
            pad=8,
        )
    return figure


CLASS_COLORS = {
    GradientClass.EXACT: "#4c9f70", GradientClass.ONE_OVER_W: "#f2c14e", GradientClass.W: "#f08a4b",
    GradientClass.BIASED: "#d1495b", GradientClass.NONE: "#c3c8d0", GradientClass.OTHER: "#8d99ae",
}  # fmt: skip


def audit_figure(table: pd.DataFrame, classes: tuple[str, ...]) -> plt.Figure:
    """Heat map of the gradient audit: rows gathers, columns loss × world size, cell colour = the
    measured class; a cell whose measurement differs from the prediction is outlined and names
    the prediction."""
    gathers = list(dict.fromkeys(table["gather"]))
    losses = list(dict.fromkeys(table["loss"]))
    columns = sorted(
        dict.fromkeys(zip(table["loss"], table["world_size"], table["world"], strict=True)),
        key=lambda column: (losses.index(column[0]), column[1], column[2]),
    )
    styles = dict(zip(table["loss"], table["style"], strict=True))
    colormap = matplotlib.colors.ListedColormap([CLASS_COLORS[c] for c in classes])
    with plt.rc_context({**STYLE, "axes.grid": False}):
        figure, axis = plt.subplots(
            figsize=(2.2 + 0.95 * len(columns), 1.3 + 0.5 * len(gathers)), layout="constrained"
        )
        codes = _audit_cells(axis, table, gathers, columns, classes)
        axis.imshow(codes, cmap=colormap, vmin=-0.5, vmax=len(classes) - 0.5, aspect="auto")
        for column in range(1, len(columns)):
            if columns[column][0] != columns[column - 1][0]:
                axis.axvline(column - 0.5, color="white", linewidth=6)
        _audit_axes(axis, gathers, columns, styles, classes)
    return figure


def _audit_cells(
    axis: plt.Axes,
    table: pd.DataFrame,
    gathers: list[str],
    columns: list[tuple],
    classes: tuple[str, ...],
) -> np.ndarray:
    """Each cell's text (and its outline where the measurement differs from the prediction);
    returns the cells' class codes for the heat map."""
    codes = np.full((len(gathers), len(columns)), np.nan)
    for _, cell in table.iterrows():
        row = gathers.index(cell["gather"])
        column = columns.index((cell["loss"], cell["world_size"], cell["world"]))
        codes[row, column] = classes.index(cell["measured"])
        surprise = cell["measured"] != cell["predicted"]
        text = cell["measured"]
        text += f"\npredicted {cell['predicted']}" if surprise else ""
        axis.text(column, row, text, ha="center", va="center", fontsize=7.5)
        if surprise:
            axis.add_patch(
                matplotlib.patches.Rectangle(
                    (column - 0.46, row - 0.44), 0.92, 0.88,
                    fill=False, edgecolor="black", linewidth=2, linestyle="--",
                )
            )  # fmt: skip
    return codes


def _audit_axes(
    axis: plt.Axes,
    gathers: list[str],
    columns: list[tuple],
    styles: dict[str, str],
    classes: tuple[str, ...],
) -> None:
    """The heat map's labels (loss, style and W above; gathers in their colours on the left),
    its legend of classes and its title."""
    axis.xaxis.tick_top()
    axis.set_xticks(
        range(len(columns)),
        [
            f"{loss}\n({styles[loss]})\nW={size}{SIMULATED_MARK[world]}"
            for loss, size, world in columns
        ],
    )
    axis.set_yticks(range(len(gathers)), gathers)
    for label, gather in zip(axis.get_yticklabels(), gathers, strict=True):
        label.set_color(gather_color(gather))
        label.set_fontweight("bold")
    axis.tick_params(length=0)
    for spine in axis.spines.values():
        spine.set_visible(False)
    handles = [matplotlib.patches.Patch(color=CLASS_COLORS[c], label=c) for c in classes]
    handles.append(
        matplotlib.patches.Patch(
            fill=False, edgecolor="black", linestyle="--", label="differs from prediction"
        )
    )
    axis.legend(
        handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=len(handles),
        fontsize=8, handlelength=1.2,
    )  # fmt: skip

    axis.set_title(
        "gradient after DDP's average vs the 1-device gradient (float64)", fontsize=9, pad=6
    )


def scaling_figure(table: pd.DataFrame) -> plt.Figure:
    """The gradient of each inexact gather against W (``scaling.csv``), sized for one column of a
    paper: one row per loss, cosine (left) and norm ratio (right) to the 1-device gradient; the
    simulated world as lines, real ranks as open squares, the prediction dashed. A gather exact
    at every W is named in the title instead of drawn; one with no gradient at all in its panel."""
    losses = list(dict.fromkeys(table["loss"]))
    exact = [
        gather
        for gather, cells in table.groupby("gather", sort=False)
        if (cells["measured"] == GradientClass.EXACT).all()
    ]
    drawn = table[~table["gather"].isin(exact)]
    with plt.rc_context({**STYLE, "font.size": 7, "axes.titlesize": 7}):
        figure, axes = plt.subplots(
            len(losses), 2, figsize=(3.5, 0.5 + 1.55 * len(losses)), sharex=True, squeeze=False,
            layout="constrained",
        )  # fmt: skip
        for row, loss in enumerate(losses):
            style = table[table["loss"] == loss]["style"].iloc[0]
            _scaling_row(*axes[row], drawn[drawn["loss"] == loss], f"{loss}\n({style} loss)", row)
        _scaling_world_size_axes(axes[-1], sorted(set(table["world_size"])))
        _scaling_legend(figure, axes[0, 0])
        title = "inexact gathers against W, float64"
        if exact:
            title += f" (exact at every W: {', '.join(exact)})"
        figure.suptitle(title, fontsize=7.5)
    return figure


def _scaling_row(
    cosine_axis: plt.Axes, ratio_axis: plt.Axes, cells: pd.DataFrame, label: str, row: int
) -> None:
    """One loss's panels of `scaling_figure`: each gather's cosine and norm ratio against W."""
    absent = []
    # each drawn thinner than the one before: curves that coincide stay visible
    for order, (gather, rows) in enumerate(cells.groupby("gather", sort=False)):
        rows = rows.sort_values("world_size")
        if (rows["norm_ratio"] == 0).all():
            absent.append(gather)
            continue
        color = gather_color(gather)
        simulated = rows[rows["world"] == World.SIMULATED]
        real = rows[rows["world"] == World.REAL]
        predicted = rows.drop_duplicates("world_size")
        for axis, key in ((cosine_axis, "cosine"), (ratio_axis, "norm_ratio")):
            axis.plot(
                predicted["world_size"], predicted[f"predicted_{key}"], color="black",
                linestyle=(0, (2, 2)), linewidth=0.7, zorder=4,
            )  # fmt: skip
            axis.plot(
                simulated["world_size"], simulated[key], color=color, marker="o",
                markersize=3 - 0.5 * order, linewidth=2.6 - 0.8 * order,
                label=gather if row == 0 and key == "cosine" else None,
            )  # fmt: skip
            axis.plot(
                real["world_size"], real[key], linestyle="none", marker="s",
                markersize=6, markerfacecolor="none", markeredgecolor=color,
                markeredgewidth=1.0,
            )  # fmt: skip
    cosine_axis.set_ylabel(label)
    if row == 0:
        cosine_axis.set_title("cosine to the 1-device gradient")
        ratio_axis.set_title("norm ratio ‖g‖ / ‖g₁‖")
    if absent:
        cosine_axis.text(
            0.03, 0.06, f"{', '.join(absent)}: no gradient at all", fontsize=6,
            transform=cosine_axis.transAxes, color="0.3",
        )  # fmt: skip
    ratio_axis.set_yscale("log")
    low, high = ratio_axis.get_ylim()  # within a decade, log ticks would crowd
    ratio_axis.yaxis.set_major_locator(
        matplotlib.ticker.MaxNLocator(nbins=4)
        if high < 10 * low
        else matplotlib.ticker.LogLocator(subs=(1, 2, 5))
    )
    ratio_axis.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter("{:g}".format))
    ratio_axis.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())


def _scaling_world_size_axes(bottom: Sequence[plt.Axes], sizes: list[int]) -> None:
    """The shared W axis of `scaling_figure`, in powers of 2, on its bottom row."""
    for axis in bottom:
        axis.set_xscale("log", base=2)
        axis.set_xticks([s for s in sizes if s in (2, 8, 32, 128, 512)] or sizes)
        axis.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter("{:g}".format))
        axis.xaxis.set_minor_locator(matplotlib.ticker.FixedLocator(sizes))
        axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axis.set_xlabel("world size W")


def _scaling_legend(figure: plt.Figure, first: plt.Axes) -> None:
    """The gathers (from the first panel) and the three marks of `scaling_figure`."""
    handles, labels = first.get_legend_handles_labels()
    handles += [
        matplotlib.lines.Line2D([], [], color="0.3", marker="o", markersize=3),
        matplotlib.lines.Line2D(
            [], [], color="0.3", linestyle="none", marker="s", markersize=6,
            markerfacecolor="none",
        ),
        matplotlib.lines.Line2D([], [], color="black", linestyle=(0, (2, 2)), linewidth=0.7),
    ]  # fmt: skip
    labels += ["simulated", "real gloo ranks", "predicted"]
    figure.legend(
        handles, labels, loc="outside lower center", ncol=3, fontsize=6.5, handlelength=2.0,
        columnspacing=1.0,
    )  # fmt: skip


VARIANT_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")


def ablation_figure(
    table: pd.DataFrame,
    curves: Mapping[str, pd.DataFrame],
    variant: str,
    metric: str,
    tolerance: float | None = None,
) -> plt.Figure:
    """Loss curves (left), |Δloss| against each run's 1-device reference on a log scale (middle)
    and a downstream ``metric`` per run (right), for the runs of a sweep over ``variant`` (the
    matched configuration first, then each ablation) and layouts."""
    variants = list(dict.fromkeys(table[variant]))
    colors = dict(zip(variants, VARIANT_COLORS, strict=False))
    with plt.rc_context(STYLE):
        figure, (loss_axis, diff_axis, metric_axis) = plt.subplots(
            1, 3, figsize=(15, 4.6), layout="constrained", width_ratios=[1.1, 1.1, 0.8]
        )
        _draw_variants_against_reference(loss_axis, diff_axis, table, curves, variant, colors)
        style_difference_axis(
            diff_axis, tolerance, "|Δ loss| vs the 1-device run of the same config"
        )
        loss_axis.set(xlabel="optimizer step", ylabel="global loss", title="loss")
        loss_axis.legend(fontsize=7, ncol=2)
        _draw_metric_bars(metric_axis, table, variant, metric, colors)
    return figure


def _draw_variants_against_reference(
    loss_axis: plt.Axes,
    diff_axis: plt.Axes,
    table: pd.DataFrame,
    curves: Mapping[str, pd.DataFrame],
    variant: str,
    colors: Mapping[str, str],
) -> None:
    """The curves of `ablation_figure`: each multi-device run's loss (left) and its |Δloss|
    against its own 1-device reference (middle), in its variant's colour; the first 1-device run
    drawn as the reference."""
    reference_drawn = False
    for _, run in table.iterrows():
        run_curves = curves[run["run_dir"]]
        if run["devices"] == 1:
            if not reference_drawn:
                loss_axis.plot(
                    run_curves["step"], run_curves["loss"],
                    label=f"{run[variant]}, 1 × {run['global_batch_size']}", **REFERENCE_STYLE,
                )  # fmt: skip
                reference_drawn = True
            continue
        style = {
            "color": colors[run[variant]],
            "linestyle": DEVICE_STYLES.get(run["devices"], "--"),
            "linewidth": 1.4,
        }
        label = f"{run[variant]}, {run['devices']} × {run['batch_size']}"
        loss_axis.plot(run_curves["step"], run_curves["loss"], label=label, **style)
        if run["reference"] is not None:
            reference = curves[run["reference"]]["loss"].to_numpy()
            diff = np.abs(run_curves["loss"].to_numpy() - reference)
            diff_axis.plot(run_curves["step"], np.maximum(diff, ZERO_FLOOR), label=label, **style)


def _draw_metric_bars(
    metric_axis: plt.Axes,
    table: pd.DataFrame,
    variant: str,
    metric: str,
    colors: Mapping[str, str],
) -> None:
    """The right panel of `ablation_figure`: one bar per run, its ``metric`` written beside it."""
    labels, values, bar_colors = [], [], []
    for _, run in table.iterrows():
        labels.append(f"{run[variant]}, {run['devices']} × {run['batch_size']}")
        values.append(run[metric])
        bar_colors.append(colors[run[variant]])
    positions = np.arange(len(labels))[::-1]
    metric_axis.barh(positions, values, color=bar_colors, height=0.7)
    for position, value in zip(positions, values, strict=True):
        metric_axis.annotate(
            f"{value:.3f}", (value, position), xytext=(3, 0), textcoords="offset points",
            va="center", fontsize=8,
        )  # fmt: skip
    low = min(values)
    metric_axis.set_xlim(max(0.0, low - 0.03), min(1.0, max(values) + 0.012))
    metric_axis.set_yticks(positions, labels, fontsize=8)
    name = metric.replace("_", " ").replace("knn", "k-NN")
    metric_axis.set(xlabel=f"{name} (test split)", title=f"{name} of each run")
    metric_axis.grid(axis="y", visible=False)


# The colours of a recording's parts (each part keeps its place in the recording's order).
PART_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2")
PART_LINES = ("--", ":", "-.", (0, (5, 1, 1, 1)))


_SUPERSCRIPTS = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


class PlainPowers(matplotlib.ticker.LogFormatterSciNotation):
    """A log axis's tick labels as `LogFormatterSciNotation` writes them, in plain text: 10⁻¹⁰ and
    3×10⁻⁵, Unicode superscripts in place of mathtext (the same labels drawn; laying out a mathtext
    label is most of the time a PDF of a small figure takes: 0.3 s of a comparison's 0.9 s of
    drawing, measured). A label of another form is kept as it is."""

    def __call__(self, x: float, pos: int | None = None) -> str:
        label = super().__call__(x, pos)
        power = re.fullmatch(r"\$\\mathdefault\{(?:([\d.]+)\\times)?10\^\{(-?\d+)\}\}\$", label)
        if power is None:
            return label
        mantissa, exponent = power.groups()
        return f"{mantissa + '×' if mantissa else ''}10{exponent.translate(_SUPERSCRIPTS)}"


def recordings_figure(
    updates: pd.DataFrame,
    reference: str = "A",
    run: str = "B",
    tolerance: float | None = None,
    departure: int | None = None,
    threshold: float | None = None,
) -> plt.Figure:
    """Two recordings compared (``python -m gatherlab.compare``): both global losses per update
    (left; the reference drawn as every reference is) and each part's gradient relative difference
    from the reference's per update on a log scale (right; exact zeros at the floor, the whole
    gradient black), with the first departing update marked (``departure``). ``updates`` has the
    columns of ``updates.csv`` (`gatherlab.check.recordings.UPDATE_COLUMNS`); judged in floors (its
    ``floor`` column), the floor recording's own departure is drawn, the rounding alone, and
    ``threshold`` times it, the most that is within it, instead of a fixed ``tolerance``."""
    whole = updates[updates["part"] == "all"]
    parts = [p for p in dict.fromkeys(updates["part"]) if p != "all"]
    with plt.rc_context(STYLE):
        figure, (loss_axis, diff_axis) = plt.subplots(1, 2, figsize=(11, 3.8), layout="constrained")
        marker = "o" if len(whole) < 3 else None  # visible alone
        loss_axis.plot(whole["update"], whole["loss_b"], color=gather_color("fixed"),
                       linewidth=1.6, marker=marker, label=run)  # fmt: skip
        loss_axis.plot(whole["update"], whole["loss_a"], label=f"{reference} (reference)",
                       **REFERENCE_STYLE)  # fmt: skip
        loss_axis.set(xlabel="optimizer update", ylabel="global loss", title="loss per update")
        drawn = [("all (whole gradient)", whole, "black", "-")]
        drawn += [(part, updates[updates["part"] == part], PART_COLORS[i % len(PART_COLORS)],
                   PART_LINES[i % len(PART_LINES)]) for i, part in enumerate(parts)]  # fmt: skip
        for label, rows, color, line in drawn:  # parts that coincide stay visible by their lines
            diff_axis.plot(rows["update"], np.maximum(rows["rel_err"].to_numpy(float), ZERO_FLOOR),
                           color=color, linestyle=line, linewidth=1.4, marker=marker,
                           label=label)  # fmt: skip
        floored = "floor" in updates.columns and threshold is not None
        if floored:  # the rounding alone, and the most of it update 0's gradient may depart by
            floor = whole["floor"].to_numpy(float)
            diff_axis.plot(whole["update"], floor, color="0.55", linewidth=2.4, alpha=0.6,
                           zorder=0, label="floor recording (rounding alone)")  # fmt: skip
            diff_axis.plot(whole["update"].iloc[:1], threshold * floor[:1], color="0.2",
                           marker="_", markersize=18, markeredgewidth=2, linestyle="none",
                           label=f"{threshold:g} floors at update 0: the most within")  # fmt: skip
        style_difference_axis(diff_axis, tolerance, f"gradient relative difference vs {reference}")
        if floored:  # no exact zeros to draw in a low precision: the axis fits the departures
            values = np.concatenate([updates["rel_err"].to_numpy(float), floor])
            values = values[np.isfinite(values) & (values > 0)]
            if values.size:
                diff_axis.set_ylim(values.min() / 5, values.max() * 5)
            diff_axis.set_title("difference from the reference, and the floor's")
        diff_axis.set(xlabel="optimizer update")
        if departure is not None:
            for axis in (loss_axis, diff_axis):
                axis.axvline(departure, color=GATHER_COLORS["old"], linewidth=1, linestyle="--",
                             label=f"{run} departs (update {departure})" if axis is loss_axis
                             else None)  # fmt: skip
        loss_axis.legend(fontsize=8)
        diff_axis.legend(fontsize=8, loc="best")
        for axis in (loss_axis, diff_axis):  # updates are whole numbers
            axis.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        diff_axis.yaxis.set_major_formatter(PlainPowers())
        diff_axis.yaxis.set_minor_formatter(PlainPowers(labelOnlyBase=False))
    return figure


@contextlib.contextmanager
def _quiet_font_subsetting() -> Iterator[None]:
    """fontTools, which subsets the TrueType fonts a PDF embeds, logs each step at INFO: a
    program that shows INFO (a Hydra sweep: ~90 lines of "maxp pruned" before its table) would
    print them. Its logger is held at WARNING while the PDF is written."""
    logger = logging.getLogger("fontTools")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def save(figure: plt.Figure, path_without_suffix: str | Path) -> list[Path]:
    """Write the figure as PNG and vector PDF; return both paths.

    The layout is computed once, for the PNG, and kept for the PDF: it is in figure coordinates,
    the same for both, and computing it is most of the time a figure of many panels takes. The
    PDF embeds its fonts as TrueType (``pdf.fonttype`` 42), which publishers take; matplotlib's
    default, Type 3, many refuse."""
    png, pdf = Path(f"{path_without_suffix}.png"), Path(f"{path_without_suffix}.pdf")
    figure.savefig(png, dpi=STYLE["savefig.dpi"])  # the style's resolution (saved outside it)
    figure.set_layout_engine("none")
    with plt.rc_context({"pdf.fonttype": 42}), _quiet_font_subsetting():
        figure.savefig(pdf)
    plt.close(figure)
    return [png, pdf]


SIZE_MODEL_MARKERS = {"resnet": "o", "vit": "s"}  # the size benchmark's two models
SIZE_PRECISION_COLORS = {"64-true": "0.15", "32-true": "#1f77b4", "bf16-mixed": "#ff7f0e"}
SIZE_MODE_WORDS = {"float64": "float64 verdict", "floors": "floors alone"}


def _log_ratios(axis) -> None:
    """A log y axis of ratios, its ticks labelled as numbers (4, 15, 20), 15 and 1.5 too, so
    that a top between 10 and 20 is labelled."""
    axis.set_yscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}")
    axis.yaxis.set_major_formatter(plain)
    axis.yaxis.set_minor_formatter(plain)
    axis.yaxis.set_minor_locator(matplotlib.ticker.LogLocator(subs=(1.5, *range(2, 10))))


def size_cost_figure(table: pd.DataFrame, goals: Mapping[str, object]) -> plt.Figure:
    """The cost of checking and recording against the model's size (``python -m gatherlab.bench
    size``; ``table`` has the columns of its CSV): the check's time ÷ the plain training's
    compute, its peak resident memory per process ÷ a plain rank's (log axes), and the recorded
    update ÷ the plain one (linear), against the parameters; one colour per precision, one marker
    per model; a check as it runs by default (``judge_in`` ``auto``, or no such column) solid, in
    the other mode (its ``judge_in``: the float64 verdict, floors alone) dotted; the goals
    (``goals``: ``check_time``, ``check_memory``, ``record`` by size) in black, dashed, and where
    a low precision is judged in floors alone by default (``floors_alone``, parameters) a grey
    vertical line."""
    panels = (
        ("time_ratio", "check time ÷ plain compute", goals["check_time"]),
        ("memory_ratio", "check peak memory ÷ plain rank's", goals["check_memory"]),
        ("record_ratio", "recorded ÷ plain update (float32, batch 256)", None),
    )
    table = table.copy()
    if "judge_in" not in table.columns:
        table["judge_in"] = "auto"
    threshold = goals.get("floors_alone")
    with plt.rc_context(STYLE):
        figure, axes = plt.subplots(1, 3, figsize=(14, 5.6), layout="constrained")
        for axis, (column, label, goal) in zip(axes, panels, strict=True):
            groups = table.groupby(["model", "precision", "judge_in"], sort=False)
            for (model, precision, judge_in), rows in groups:
                rows = rows.dropna(subset=[column]).sort_values("parameters")
                if rows.empty:
                    continue
                word = terms.Precision(precision).word
                mode = SIZE_MODE_WORDS.get(judge_in)
                axis.plot(
                    rows["parameters"], rows[column], marker=SIZE_MODEL_MARKERS.get(model, "^"),
                    color=SIZE_PRECISION_COLORS.get(precision, "0.5"),
                    linestyle=":" if mode else "-", markersize=4 if mode else 5,
                    label=model if column == "record_ratio"
                    else f"{model}, {word}" + (f", {mode}" if mode else ""),
                )  # fmt: skip
            if goal is not None:
                axis.axhline(goal, **{**REFERENCE_STYLE, "linewidth": 1.2}, label=f"goal {goal:g}")
            if threshold is not None and column != "record_ratio":
                axis.axvline(float(threshold), color="0.6", linewidth=0.8,  # type: ignore[arg-type]
                             label=f"floors alone from {float(threshold) / 1e6:g}M")  # type: ignore[arg-type]  # fmt: skip
            if column == "record_ratio":
                for size, bound in dict(goals["record"]).items():  # type: ignore[call-overload]
                    at = table.loc[table["size"] == size, "parameters"]
                    if len(at):
                        axis.plot([at.min() / 1.6, at.max() * 1.6], [bound, bound],
                                  **{**REFERENCE_STYLE, "linewidth": 1.2})  # fmt: skip
                        axis.annotate(f"goal {bound:g} at {size}", (at.max() * 1.6, bound),
                                      fontsize=7, va="bottom", ha="right")  # fmt: skip
            axis.set_xscale("log")
            if column != "record_ratio":  # ratios of a few percent read better on a linear axis
                _log_ratios(axis)
            axis.set_xlabel("parameters")
            axis.set_ylabel(label)
            if column == "record_ratio":
                handles, labels = axis.get_legend_handles_labels()
                by_label = dict(zip(labels, handles, strict=True))
                axis.legend(by_label.values(), by_label.keys(), fontsize=7)
        handles, labels = axes[0].get_legend_handles_labels()  # one legend below the panels
        by_label = dict(zip(labels, handles, strict=True))
        figure.legend(by_label.values(), by_label.keys(), loc="outside lower center", ncol=5,
                      fontsize=7)  # fmt: skip
        figure.suptitle("What a check (W = 2, 3 steps) and a recording cost against the plain "
                        "training, by model size; solid: as the check runs by default, dotted: "
                        "the other mode", fontsize=10)  # fmt: skip
    return figure
