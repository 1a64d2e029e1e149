"""The report's tables on comparison tables built by hand: every key a sweep varies names its
rows, and a loss-matrix cell without a number says why."""

from __future__ import annotations

import pandas as pd
import pytest

from gatherlab.analysis import report


def _table(rows: list[dict]) -> pd.DataFrame:
    common = {
        "experiment": "bug_demo", "model": "mlp", "loss": "ntxent", "data": "gaussian",
        "optim": "sgd", "global_batch_size": 16, "precision": "64-true", "steps": 5, "seed": 0,
        "error": None, "max_abs_loss_diff": 0.0, "matches_reference": True,
    }  # fmt: skip
    return pd.DataFrame([{**common, **row} for row in rows])


def _run(number: int, **row) -> dict:
    layout = row.pop("layout", "cpu1")
    devices = int(layout[-1])
    return {"run_dir": str(number), "layout": layout, "devices": devices,
            "batch_size": 16 // devices, **row}  # fmt: skip


def _matrix_rows(table: pd.DataFrame) -> dict[str, str]:
    """The loss matrix's Markdown rows of ``table``, by loss."""
    diff, matches, verdicts = report.loss_matrix(table)
    markdown = report.matrix_markdown(diff, matches, verdicts, {}, 1e-10, 5)
    return {line.split("|")[1].strip(" `"): line for line in markdown.splitlines()[2:]}


def test_the_printed_comparison_names_every_key_the_sweep_varies():
    table = _table([
        _run(0, gather="old", optim="sgd", verdict="reference"),
        _run(1, gather="old", optim="adam", verdict="reference"),
        _run(2, gather="old", optim="sgd", layout="cpu2", verdict="differs"),
        _run(3, gather="old", optim="adam", layout="cpu2", verdict="differs"),
    ])  # fmt: skip
    names = [line.split()[:4] for line in report.comparison_text(table).splitlines()[1:]]
    assert names == [
        ["0:", "sgd", "old", "cpu1"],
        ["1:", "adam", "old", "cpu1"],
        ["2:", "sgd", "old", "cpu2"],
        ["3:", "adam", "old", "cpu2"],
    ]


def test_a_failed_run_shows_as_failed_in_its_loss_matrix_cell():
    nan = float("nan")
    table = _table([
        _run(0, loss="ntxent", gather="fixed", verdict="reference"),
        _run(1, loss="ntxent", gather="fixed", layout="cpu2", verdict="matches"),
        _run(2, loss="dcl", gather="fixed", verdict="reference"),
        _run(3, loss="dcl", gather="fixed", layout="cpu2", verdict="failed",
             max_abs_loss_diff=nan, matches_reference=False, error="NonFiniteLoss: ..."),
    ])  # fmt: skip
    rows = _matrix_rows(table)
    assert rows["ntxent"].endswith("| ✓ 0 |")
    assert rows["dcl"].endswith("| failed |")


def test_a_loss_matrix_cell_holds_the_largest_difference_of_its_runs_and_no_run_is_a_dash():
    # a sweep that is not a full product (experiment=downstream: old alone on ntxent_global), over
    # seeds: a cell's runs are shown by the largest |Δloss| of them
    table = _table([
        _run(0, loss="ntxent", gather="fixed", verdict="reference"),
        _run(1, loss="ntxent", gather="fixed", layout="cpu4", verdict="matches"),
        _run(2, loss="ntxent", gather="old", layout="cpu4", verdict="differs",
             max_abs_loss_diff=0.3, matches_reference=False),
        _run(3, loss="ntxent_global", gather="fixed", verdict="reference"),
        _run(4, loss="ntxent_global", gather="old", layout="cpu4", verdict="differs",
             max_abs_loss_diff=0.2, matches_reference=False),
        _run(5, loss="ntxent", gather="old", layout="cpu4", verdict="differs", seed=1,
             max_abs_loss_diff=0.1, matches_reference=False),  # another seed: the larger shown
        _run(6, loss="ntxent", gather="fixed", layout="cpu4", verdict="matches", seed=1,
             max_abs_loss_diff=1e-15),
    ])  # fmt: skip
    rows = _matrix_rows(table)
    assert rows["ntxent"].endswith("| ✓ 1e-15 | ✗ 0.3 |")
    assert rows["ntxent_global"].endswith("| — | ✗ 0.2 |")


def test_an_override_of_a_config_group_is_not_a_second_column():
    """``launcher=external`` in one run only (the two-node torchrun run beside pooled runs) is the
    ``launcher`` column already; a varying plain override gets its own column."""
    runs = pd.DataFrame([
        {"launcher": "pool", "layout": "cpu4", "overrides": {"steps": "30"}},
        {"launcher": "external", "layout": "cpu2",
         "overrides": {"steps": "30", "launcher": "external", "layout.nodes": "2"}},
    ])  # fmt: skip
    varying = report._varying_overrides(runs)
    assert list(varying.columns) == ["layout.nodes"]


def test_a_reference_is_one_device_taking_the_whole_batch_at_once():
    """A 1-device run that accumulates K > 1 micro-batches is a layout like any other, not a
    reference (docs/design.md §2)."""

    def run(devices: int, layout: dict) -> pd.Series:
        return pd.Series({"devices": devices, "config": {"layout": layout}})

    assert report.one_device_whole_batch(run(1, {"devices": 1, "micro_batches": 1}))
    assert report.one_device_whole_batch(run(1, {"devices": 1}))  # before micro-batches existed
    assert not report.one_device_whole_batch(run(1, {"devices": 1, "micro_batches": 2}))
    assert not report.one_device_whole_batch(run(2, {"devices": 2, "micro_batches": 1}))


def test_a_cell_of_several_runs_shows_a_match_only_when_every_run_matched():
    """Cells of three runs each (a sweep over seeds): one run that failed (no number, its
    ``matches_reference`` false or missing) or one that differs keeps the cell from ✓, and a run
    without a number is named in the cell even when the others have numbers."""
    nan = float("nan")

    def cell(loss: str, *runs: dict) -> list[dict]:
        return [_run(0, loss=loss, gather="fixed", verdict="reference")] + [
            _run(seed + 1, loss=loss, gather="fixed", layout="cpu2", seed=seed, **run)
            for seed, run in enumerate(runs)
        ]

    matches = {"verdict": "matches", "max_abs_loss_diff": 1e-15}
    failed = {"verdict": "failed", "max_abs_loss_diff": nan, "error": "NonFiniteLoss: ..."}
    table = _table([
        *cell("all_match", matches, matches, matches),
        *cell("one_differs", matches, {"verdict": "differs", "max_abs_loss_diff": 0.02,
                                       "matches_reference": False}, matches),
        *cell("failed_false", matches, {**failed, "matches_reference": False}, matches),
        *cell("failed_missing", matches, {**failed, "matches_reference": nan}, matches),
        *cell("failed_first", {**failed, "matches_reference": nan}, matches, matches),
        *cell("none_readable", {"verdict": "unreadable", "max_abs_loss_diff": nan,
                                "matches_reference": False}, {**failed, "matches_reference": nan}),
    ])  # fmt: skip
    _, matched, _ = report.loss_matrix(table)
    assert matched[("fixed", 2, 8)].to_dict() == {
        "all_match": True, "one_differs": False, "failed_false": False, "failed_missing": False,
        "failed_first": False, "none_readable": False,
    }  # fmt: skip
    rows = _matrix_rows(table)
    assert rows["all_match"].endswith("| ✓ 1e-15 |")
    assert rows["one_differs"].endswith("| ✗ 0.02 |")
    for loss in ("failed_false", "failed_missing", "failed_first"):
        assert rows[loss].endswith("| ✗ 1e-15 (failed) |"), rows[loss]
    assert rows["none_readable"].endswith("| unreadable, failed |")


def test_a_fresh_clone_without_a_sweep_is_told_to_run_one(tmp_path, monkeypatch):
    """The notebook on a fresh clone stopped at its second cell with "no multirun/ folder"; what
    makes one is said beside it, also where a multirun/ folder holds no finished sweep."""
    from gatherlab.analysis import results

    monkeypatch.chdir(tmp_path)
    for made in (False, True):
        if made:
            (tmp_path / "multirun").mkdir()
        with pytest.raises(FileNotFoundError) as missing:
            results.newest_sweep()
        assert str(missing.value).endswith(
            "; run a sweep first (make demo, or python -m gatherlab.train -m ...)"
        )
