"""Compare every run of a sweep with its 1-device reference; write the table and the figure.

``python -m gatherlab.report SWEEP_DIR`` re-runs the comparison of a finished sweep; the same
comparison runs by itself when a multirun of ``python -m gatherlab.train`` ends.

A run's reference is the first 1-device run of the sweep (in ``results.load_runs``' order) that
finished and is readable, and whose resolved config equals the run's in everything but
``SPLIT_KEYS``: ``gather``, ``layout``, ``strategy``, ``launcher``, ``logger`` and ``log_every``
(docs/design.md §2, docs/contract.md §5). A run matches it when the loss at every step and every
final parameter agree within the tolerance of the run's precision (``gradients.TOLERANCE``). The
gradient audit's table is rendered here too (``write_audit``). Run files are read only through
``results``.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from gatherlab.analysis import figures, results
from gatherlab.core import cli, gradients, runfiles
from gatherlab.core.floor import threshold
from gatherlab.core.terms import GradientClass, Precision, RunVerdict, World
from gatherlab.gather import CLASSES
from gatherlab.runs.precision import FLOOR_ROW_BLOCKS

__all__ = [
    "SweepComparison",
    "audit_markdown",
    "common_tolerance",
    "compare_sweep",
    "comparison_text",
    "floor_run",
    "loss_matrix",
    "main",
    "matrix_markdown",
    "max_abs_weight_difference",
    "one_device_whole_batch",
    "predicted_invariance",
    "scaling_markdown",
    "write_audit",
    "write_loss_matrix",
    "write_report",
]  # fmt: skip

log = logging.getLogger(__name__)

# What may differ between a run and its reference: the split over devices, how its ranks share the
# model and were started, the gather, and how the run is logged.
SPLIT_KEYS = ("gather", "layout", "strategy", "launcher", "logger", "log_every")
COMPARISON = runfiles.COMPARISON
FIGURE = "comparison"
# Written too when the sweep varies the loss: one row per loss, one column per gather × layout.
MATRIX = "loss_matrix"
# Every row of the printed comparison is named by these, and by every other key the sweep varies.
NAMING_KEYS = ("gather", "layout")
# Split keys that name a row only where the sweep varies them.
NAMING_WHEN_VARIED = ("strategy",)
# The keys that may name a row: the summary's choices and sizes, but how a run was started and
# logged.
KEY_COLUMNS = tuple(
    key
    for key in (*runfiles.SUMMARY_CHOICES, *runfiles.SUMMARY_SIZES)
    if key in (*NAMING_KEYS, *NAMING_WHEN_VARIED) or key not in SPLIT_KEYS
)
DERIVED_KEYS = ("devices", "batch_size")  # follow from the layout and the global batch size


def _layout(run: pd.Series) -> dict[str, Any]:
    return run["config"].get("layout", {}) if isinstance(run["config"], dict) else {}


def one_device_whole_batch(run: pd.Series) -> bool:
    """Whether a run can be a reference: one device, taking the whole batch at once (no
    micro-batches: ``layout.micro_batches`` 1, where its config has the key) in one block of rows
    (``layout.row_blocks`` 1: a floor run is none, `floor_run`)."""
    layout = _layout(run)
    return run["devices"] == 1 and layout.get("micro_batches", 1) == 1 and not floor_run(run)


def floor_run(run: pd.Series) -> bool:
    """Whether a run is its group's floor (docs/design.md §2, "Low precision"): one device whose
    forward runs in row blocks (``layout.row_blocks`` > 1, ``layout=cpu1_floor``)."""
    return run["devices"] == 1 and _layout(run).get("row_blocks", 1) > 1


def _comparable(config: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in config.items() if k not in SPLIT_KEYS}, sort_keys=True)


def max_abs_weight_difference(
    state: dict, reference: dict, keys: Iterable[str] | None = None
) -> float:
    """The largest |Δ| between two final states (``results.load_final_state``), in float64: over
    every entry, or over ``keys`` alone; NaN when the states do not name the same entries.

    >>> import torch
    >>> state = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}
    >>> max_abs_weight_difference(state, {"w": torch.tensor([1.0, 2.25]), "b": torch.tensor([0.0])})
    0.5
    >>> max_abs_weight_difference(state, {"w": torch.tensor([1.0, 2.25]), "b": torch.tensor([0.0])},
    ...                           keys=["w"])
    0.25
    >>> max_abs_weight_difference(state, {"w": torch.tensor([1.0, 2.0])})
    nan
    """
    if state.keys() != reference.keys():
        return float("nan")
    return max(
        float((state[key].double() - reference[key].double()).abs().max())
        for key in (state if keys is None else keys)
    )


def _varying_overrides(runs: pd.DataFrame) -> pd.DataFrame:
    """Overrides whose value differs between runs, other than the table's own columns (a config
    group's choice, such as ``launcher=external`` in one run only, is its column already)."""
    values = pd.DataFrame(list(runs["overrides"]), index=runs.index)
    keep = [
        c for c in values.columns if c not in runs.columns and values[c].nunique(dropna=False) > 1
    ]
    return values[keep]


VERDICTS = tuple(RunVerdict)
"""What a run's row says of it (``verdict``, `gatherlab.core.terms.RunVerdict`)."""


def _read_run_files(run_dir: str) -> tuple[pd.DataFrame, dict] | str:
    """A run's curves and final weights, or why they cannot be read."""
    try:
        curves = results.load_curves(run_dir)
        state = results.load_final_state(run_dir)
    except Exception as error:  # a missing or corrupt file: reported for this run only
        return cli.one_line(error)
    if curves.empty or not curves["loss"].notna().all():
        return f"{runfiles.CURVES}: no steps or a missing loss"
    return curves, state


def _not_comparable(run: pd.Series, curves: pd.DataFrame, reference: pd.Series,
                    reference_curves: pd.DataFrame) -> str | None:  # fmt: skip
    """Why a run cannot be held against its reference, if it cannot."""
    if run["steps"] != reference["steps"] or len(curves) != len(reference_curves):
        return f"{len(curves)} steps against the reference's {len(reference_curves)}"
    if list(curves["step"]) != list(reference_curves["step"]):
        return "its steps are not the reference's"
    return None


@dataclass(frozen=True)
class SweepComparison:
    """A sweep's runs held against their one-device references (`compare_sweep`).

    Attributes:
        table: One row per run (``comparison.csv``): its verdict (``VERDICTS``), reference and
            differences, and a column per override that varies between the runs.
        curves: Every readable run's curves (``results.load_curves``), by its ``run_dir``.
        override_columns: The columns of ``table`` that are overrides varying between the runs
            (``optim.lr``, …), which name a run beside the table's own keys.
    """

    table: pd.DataFrame
    curves: Mapping[str, pd.DataFrame] = field(default_factory=dict)
    override_columns: tuple[str, ...] = ()


def compare_sweep(runs: pd.DataFrame, root: Path) -> SweepComparison:
    """The comparison of ``runs`` (from ``results.load_runs``): its table and every readable
    run's curves, its paths (``run_dir``, ``reference``) relative to ``root`` (the sweep's
    directory). Each row gets a ``verdict`` (``VERDICTS``); a run is compared only with a
    reference that it can be held against, and ``matches_reference`` is true only with that
    evidence."""
    table = runs.copy()
    files: dict[str, tuple[pd.DataFrame, dict]] = {}
    table["verdict"] = None
    for index, run in table.iterrows():
        if run["status"] != "ok":
            table.loc[index, "verdict"] = run["status"]
            continue
        found = _read_run_files(run["run_dir"])
        if isinstance(found, str):
            table.loc[index, ["verdict", "error"]] = [RunVerdict.UNREADABLE, found]
        else:
            files[run["run_dir"]] = found
    table["group"] = table["config"].map(_comparable).factorize()[0]
    table["reference"] = None
    table["max_abs_loss_diff"] = float("nan")
    table["max_abs_param_diff"] = float("nan")
    table["floors"] = float("nan")
    table["row_blocks"] = [_layout(run).get("row_blocks", 1) for _, run in table.iterrows()]
    for _, group in table.groupby("group"):
        usable = group[group["verdict"].isna()]
        candidates = usable[usable.apply(one_device_whole_batch, axis=1)]
        if candidates.empty:
            table.loc[usable.index, "verdict"] = RunVerdict.NO_REFERENCE
            continue
        reference = candidates.iloc[0]
        reference_files = files[reference["run_dir"]]
        floors = usable[usable.apply(floor_run, axis=1)]
        floor = None
        if len(floors):  # its departure from the reference is the group's floor
            floor = _held_against(floors.iloc[0], files[floors.iloc[0]["run_dir"]], reference,
                                  reference_files)  # fmt: skip
        for index, run in usable.iterrows():
            table.loc[index, "reference"] = reference["run_dir"]
            held = _held_against(run, files[run["run_dir"]], reference, reference_files, floor)
            for column, value in held.items():
                table.loc[index, column] = value
    table["matches_reference"] = table["verdict"].isin([RunVerdict.REFERENCE, RunVerdict.MATCHES])
    varying = _varying_overrides(table)
    table = pd.concat([table, varying], axis=1)
    for column in ("run_dir", "reference"):
        table[column] = table[column].map(lambda path: _relative(path, root))
    curves = {_relative(path, root): frame for path, (frame, _) in files.items()}
    table = table.drop(columns=["overrides", "config"])
    return SweepComparison(table, curves, tuple(varying.columns))


def _held_against(
    run: pd.Series,
    run_files: tuple[pd.DataFrame, dict],
    reference: pd.Series,
    reference_files: tuple[pd.DataFrame, dict],
    floor: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A run held against its reference (the files of each: its curves and final weights): its
    ``verdict``, its largest |Δloss| and |Δparameter| where the two can be compared, and an
    ``error`` that says why where they cannot. In float64 and float32 it matches within the
    precision's tolerance (`gradients.TOLERANCE`); in bf16 or fp16 within T floors
    (`floor.threshold` of the floor run's row blocks and the run's devices), ``floors`` the
    larger of its two differences in units of the group's floor run's (``floor``, its own held
    numbers; `_floors`)."""
    (run_curves, state), (reference_curves, reference_state) = run_files, reference_files
    why = _not_comparable(run, run_curves, reference, reference_curves)
    if why is not None:
        return {"verdict": RunVerdict.NOT_COMPARABLE, "error": why}
    loss = run_curves["loss"].to_numpy()
    loss_diff = float(abs(loss - reference_curves["loss"].to_numpy()).max())
    param_diff = max_abs_weight_difference(state, reference_state)
    held = {"max_abs_loss_diff": loss_diff, "max_abs_param_diff": param_diff}
    if run["run_dir"] == reference["run_dir"]:
        return {**held, "verdict": RunVerdict.REFERENCE}
    if param_diff != param_diff:  # NaN: the final weights have other names
        error = "its final weights are not the reference's"
        return {**held, "verdict": RunVerdict.NOT_COMPARABLE, "error": error}
    if run["precision"] in gradients.TOLERANCE:
        tolerance = gradients.TOLERANCE[run["precision"]]
        matches = loss_diff <= tolerance and param_diff <= tolerance
        return {**held, "verdict": RunVerdict.MATCHES if matches else RunVerdict.DIFFERS}
    if floor is None or "max_abs_loss_diff" not in floor:
        error = (f"no floor run for precision={run['precision']}: add layout=cpu1_floor to the "
                 "sweep (docs/design.md §2, \"Low precision\")")  # fmt: skip
        return {**held, "verdict": RunVerdict.NOT_COMPARABLE, "error": error}
    floors = _floors(held, floor, run["precision"], reference_files[0]["loss"].abs().max())
    matches = floors <= threshold(FLOOR_ROW_BLOCKS, int(run.get("devices", FLOOR_ROW_BLOCKS)))
    return {**held, "floors": floors,
            "verdict": RunVerdict.MATCHES if matches else RunVerdict.DIFFERS}  # fmt: skip


def _floors(held: dict[str, float], floor: dict[str, float], precision: str, scale: float) -> float:
    """A run's differences from its reference in units of the floor run's: the larger of max
    |Δloss| and max |Δparameter|, each over the floor's own (where the floor changed no bit, the
    precision's unit roundoff, times the largest loss ``scale`` for the loss)."""
    unit = Precision(precision).unit_roundoff
    least = {"max_abs_loss_diff": unit * max(scale, 1e-300), "max_abs_param_diff": unit}
    return max(held[key] / (floor[key] or least[key]) for key in least)


def _relative(path: str | None, root: Path) -> str | None:
    if path is None:
        return None
    try:
        return str(Path(path).resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


def write_report(sweep_dir: str | Path) -> SweepComparison:
    """Compare the runs below ``sweep_dir``; write ``comparison.csv``, ``.png``, ``.pdf`` there."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"sweep directory {sweep_dir} does not exist")
    runs = results.load_runs(sweep_dir)
    if runs.empty:
        raise FileNotFoundError(f"no finished run (no {runfiles.SUMMARY}) below {sweep_dir}")
    compared = compare_sweep(runs, sweep_dir)
    table, curves = compared.table, compared.curves
    table.to_csv(sweep_dir / COMPARISON, index=False)
    drawn = table[table["run_dir"].isin(curves)]  # failed and unreadable runs are not drawn
    if not drawn.empty:
        figure = figures.comparison_figure(
            drawn, curves, common_tolerance(table), compared.override_columns
        )
        figures.save(figure, sweep_dir / FIGURE)
    if table["loss"].nunique() > 1:
        write_loss_matrix(table, runs, sweep_dir)
    return compared


def common_tolerance(table: pd.DataFrame) -> float | None:
    """The match tolerance of the table's runs, None when they mix precisions or are judged
    against a floor (bf16, fp16)."""
    tolerances = {gradients.TOLERANCE.get(p) for p in table["precision"].dropna()}
    return tolerances.pop() if len(tolerances) == 1 else None


def write_loss_matrix(table: pd.DataFrame, runs: pd.DataFrame, sweep_dir: str | Path) -> None:
    """``loss_matrix.{png,pdf,md}`` of a comparison ``table`` (``runs``: ``results.load_runs``)."""
    sweep_dir = Path(sweep_dir)
    tolerance = common_tolerance(table)
    diff, matches, verdicts = loss_matrix(table)
    predicted = predicted_invariance(runs)
    steps = int(table["steps"].max())
    figures.save(figures.matrix_figure(diff, matches, tolerance), sweep_dir / MATRIX)
    markdown = matrix_markdown(diff, matches, verdicts, predicted, tolerance, steps)
    (sweep_dir / f"{MATRIX}.md").write_text(markdown)


def loss_matrix(table: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Max |Δloss|, whether the runs match, and a verdict, per loss (rows, in sweep order) and
    gather × layout (columns ``(gather, devices, batch_size)``) of the multi-device runs. A cell
    of several runs (a sweep over seeds, say) has their largest |Δloss|, matches only if every
    run's ``matches_reference`` is true (a missing one is no match), and as its verdict those of
    its runs that neither match nor differ (a run that failed, could not be read or compared),
    each once (`_unmatched`); a cell of no run has NaN, False and None."""
    runs = table[table["devices"] > 1]
    index = list(dict.fromkeys(runs["loss"]))
    keys = zip(runs["gather"], runs["devices"], runs["batch_size"], strict=True)
    columns = pd.MultiIndex.from_tuples(list(dict.fromkeys(keys)))
    cells = runs.groupby(["loss", "gather", "devices", "batch_size"], sort=False).agg(
        diff=("max_abs_loss_diff", "max"),
        matches=("matches_reference", lambda values: bool(values.eq(True).all())),
        verdict=("verdict", _unmatched),
    )
    diff = pd.DataFrame(float("nan"), index=index, columns=columns)
    matches = pd.DataFrame(False, index=index, columns=columns)
    verdicts = pd.DataFrame(None, index=index, columns=columns, dtype=object)
    for (loss, *column), cell in cells.iterrows():
        diff.loc[loss, tuple(column)] = cell["diff"]
        matches.loc[loss, tuple(column)] = cell["matches"]
        verdicts.loc[loss, tuple(column)] = cell["verdict"]
    return diff, matches, verdicts


def _unmatched(verdicts: pd.Series) -> str | None:
    """The verdicts of a cell's runs other than ``reference``, ``matches`` and ``differs`` (those
    have their number in the cell), each once in order, joined by commas; None when none.

    >>> _unmatched(pd.Series(["matches", "failed", "differs", "failed", "unreadable"]))
    'failed, unreadable'
    """
    shown = (RunVerdict.REFERENCE, RunVerdict.MATCHES, RunVerdict.DIFFERS)
    kept = [str(verdict) for verdict in dict.fromkeys(verdicts.dropna()) if verdict not in shown]
    return ", ".join(kept) or None


def predicted_invariance(runs: pd.DataFrame) -> dict[str, bool | None]:
    """Per loss name, whether its class predicts it layout-invariant with an exact gather
    (``layout_invariant``, docs/design.md §3, recorded in each run's summary), None when the class
    does not say."""
    predicted = {}
    for loss, invariant in zip(runs["loss"], runs["loss_layout_invariant"], strict=True):
        predicted[loss] = None if pd.isna(invariant) else bool(invariant)
    return predicted


def matrix_markdown(
    diff: pd.DataFrame,
    matches: pd.DataFrame,
    verdicts: pd.DataFrame,
    predicted: dict[str, bool | None],
    tolerance: float | None,
    steps: int,
) -> str:
    """The loss matrix as a Markdown table: ✓/✗ and max |Δloss| per cell, with the verdicts of
    its runs that have no number."""
    names = {True: "invariant", False: "**not** invariant", None: "?"}
    header = ["loss", "predicted with an exact gather"] + [
        f"`{gather}` {devices} × {batch}" for gather, devices, batch in diff.columns
    ]
    rows = []
    for loss in diff.index:
        cells = [
            _matrix_cell(value, match, verdict)
            for value, match, verdict in zip(
                diff.loc[loss], matches.loc[loss], verdicts.loc[loss], strict=True
            )
        ]
        rows.append([f"`{loss}`", names[predicted.get(loss)], *cells])
    intro = (
        f"Max |Δloss| over {steps} steps against each loss's 1-device reference; ✓ = the run "
        f"matches it (loss at every step and final parameters within "
        f"{tolerance if tolerance is not None else 'the tolerance of its precision'})."
    )
    return f"{intro}\n\n{runfiles.markdown_table(header, rows)}\n"


def _matrix_cell(value: float, match: bool, verdict: str | None) -> str:
    if not pd.isna(value):  # with the runs that have no number, when some have none
        shown = f"{'✓' if match else '✗'} {value:.2g}"
        return shown if pd.isna(verdict) else f"{shown} ({verdict})"
    if pd.isna(verdict):  # no run of the sweep has this loss, gather and layout
        return "—"
    return verdict  # a run without a number says why: failed, unreadable, not comparable


def comparison_text(compared: SweepComparison | pd.DataFrame) -> str:
    """The comparison (or its table alone, ``comparison.csv`` read back: no override columns
    named) as a short text table: run, devices × batch, max |Δloss|, verdict (and, for a run that
    failed or could not be compared, why)."""
    if isinstance(compared, SweepComparison):
        table, extra = compared.table, compared.override_columns
    else:
        table, extra = compared, ()
    keys = [
        c for c in (*KEY_COLUMNS, *extra) if c in table and c not in (*NAMING_KEYS, *DERIVED_KEYS)
    ]
    varying = [c for c in keys if table[c].nunique(dropna=False) > 1]
    shown = [*varying, *NAMING_KEYS]
    names = [
        f"{run['run_dir']}: " + " ".join("-" if pd.isna(run[c]) else str(run[c]) for c in shown)
        for _, run in table.iterrows()
    ]
    width = max(28, *map(len, names))
    lines = [f"{'run':<{width}} {'devices × batch':>15} {'max |Δloss|':>12}  matches"]
    outcomes = {
        RunVerdict.REFERENCE: "(reference)",
        RunVerdict.MATCHES: "yes",
        RunVerdict.DIFFERS: "NO",
    }
    for name, (_, run) in zip(names, table.iterrows(), strict=True):
        outcome = outcomes.get(run["verdict"], run["verdict"])
        failed = (RunVerdict.FAILED, RunVerdict.UNREADABLE, RunVerdict.NOT_COMPARABLE)
        if run["verdict"] in failed and run["error"]:
            outcome = f"{outcome}: {run['error']}"
        if "floors" in run and not pd.isna(run["floors"]):  # bf16, fp16: against the floor
            floor = " (the floor)" if run.get("row_blocks", 1) > 1 else ""
            outcome = f"{outcome}, {run['floors']:.3g} floors{floor}"
        devices = "?" if pd.isna(run["devices"]) else int(run["devices"])
        batch = "?" if pd.isna(run["batch_size"]) else int(run["batch_size"])
        lines.append(
            f"{name:<{width}} {devices:>7} × {batch!s:<5} "
            f"{run['max_abs_loss_diff']:>12.3g}  {outcome}"
        )
    return "\n".join(lines)


def write_audit(table: pd.DataFrame, out: str | Path) -> None:
    """The audit's table (``audit.csv``, written by the audit job) as ``audit.md`` and the figure
    ``audit.png`` / ``audit.pdf`` in ``out``."""
    out = Path(out)
    (out / "audit.md").write_text(audit_markdown(table))
    figures.save(figures.audit_figure(table, CLASSES), out / "audit")


def audit_markdown(table: pd.DataFrame) -> str:
    """The audit as a Markdown table: rows gathers, columns loss × W, measured class per cell
    (with the prediction where they differ)."""
    losses = list(dict.fromkeys(table["loss"]))
    columns = sorted(
        dict.fromkeys(zip(table["loss"], table["world_size"], table["world"], strict=True)),
        key=lambda column: (losses.index(column[0]), column[1], column[2]),
    )
    styles = dict(zip(table["loss"], table["style"], strict=True))
    header = ["gather"] + [
        f"`{loss}` ({styles[loss]}) W={world_size}{figures.SIMULATED_MARK[world]}"
        for loss, world_size, world in columns
    ]
    cells = table.set_index(["gather", "loss", "world_size", "world"])
    rows = []
    for gather in dict.fromkeys(table["gather"]):
        row = [f"`{gather}`"]
        for loss, world_size, world in columns:
            measured = cells.loc[(gather, loss, world_size, world)]
            cell = measured["measured"]
            if measured["measured"] != measured["predicted"]:
                cell = f"⚠ {cell} (predicted {measured['predicted']})"
            row.append(cell)
        rows.append(row)
    intro = (
        "Measured class of the parameter gradient after DDP's average against the 1-device "
        "gradient (float64); ⚠ marks a cell whose measurement differs from the gather's "
        'prediction (docs/design.md §1), which follows it; "sim" marks a simulated world '
        "(docs/design.md §9)."
    )
    return f"{intro}\n\n{runfiles.markdown_table(header, rows)}\n"


def _cosine_and_ratio_cell(row: pd.Series) -> str:
    if pd.isna(row["cosine"]):
        return GradientClass.NONE if row["norm_ratio"] == 0 else "n/a"
    return f"{row['cosine']:.4g} / {row['norm_ratio']:.3g}"


def scaling_markdown(table: pd.DataFrame) -> str:
    """The gradient against W (``scaling.csv``) as a Markdown table: per loss and gather, cosine
    and norm ratio at each W (the simulated world's where it ran, else real ranks', marked r), and
    how far the measurement is from the prediction."""
    sizes = sorted(set(table["world_size"]))
    header = ["loss (style)", "gather", *(f"W={size}" for size in sizes)]
    header += ["max \\|Δcos\\|", "max \\|Δratio\\|/ratio", "prediction"]
    rows = []
    for (loss, gather), cells in table.groupby(["loss", "gather"], sort=False):
        row = [f"`{loss}` ({cells['style'].iloc[0]})", f"`{gather}`"]
        for size in sizes:
            at = cells[cells["world_size"] == size]
            simulated = at[at["world"] == World.SIMULATED]
            if len(simulated):
                row.append(_cosine_and_ratio_cell(simulated.iloc[0]))
            elif len(at):
                row.append(f"{_cosine_and_ratio_cell(at.iloc[0])} r")
            else:
                row.append("")
        predicted = cells[cells["prediction"] != "none"]
        cosine = (predicted["cosine"] - predicted["predicted_cosine"]).abs().max()
        ratio = (
            (predicted["norm_ratio"] / predicted["predicted_norm_ratio"] - 1).abs().max()
            if (predicted["predicted_norm_ratio"] > 0).all()
            else (predicted["norm_ratio"] - predicted["predicted_norm_ratio"]).abs().max()
        )
        kinds = ", ".join(dict.fromkeys(cells["prediction"]))
        row += [f"{cosine:.2g}" if len(predicted) else "", f"{ratio:.2g}" if len(predicted) else ""]
        rows.append([*row, kinds])
    intro = (
        "Cosine / norm ratio of the parameter gradient after DDP's average to the 1-device "
        "gradient (float64) against the world size W: the simulated world's, or real gloo "
        "ranks' where marked r (docs/design.md §9). The last columns compare every row, real "
        "and simulated, with its prediction (exact: a closed form; expectation: over the random "
        'partition of the batch into slices); "none": no gradient at all.'
    )
    return f"{intro}\n\n{runfiles.markdown_table(header, rows)}\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m gatherlab.report", description=__doc__.splitlines()[0]
    )
    parser.add_argument("sweep_dir", type=Path, help="the directory of a finished multirun")
    args = parser.parse_args(argv)
    try:
        compared = write_report(args.sweep_dir)
    except FileNotFoundError as error:
        cli.fail("report", error)
    print(comparison_text(compared))
    print(f"figure: {args.sweep_dir / FIGURE}.png")
    if (args.sweep_dir / f"{MATRIX}.png").exists():
        print(f"loss matrix: {args.sweep_dir / MATRIX}.png and .md")


if __name__ == "__main__":
    main()
