"""The census's own logic (experiments/census.py) on tables built here by hand, as the check
writes them (one row per W and part): a case is exact only when every W is; a case that is not
exact at some W gets its fix applied and checked again; the fix column says exact only when every
W of the fixed run is; the cells and the cause column read what the rows hold."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest
from helpers import REPO

sys.path.insert(0, str(REPO / "experiments"))
import census
from census_cases.common import Case, Fix

FIX = Fix("sum the slices' gradients", "lightly/gather.patch")
CASE = Case("pkg", "1.0", "Loss", "gather=True", "pkg:Loss", fix=FIX)


def _table(*whole: tuple[str, dict]) -> pd.DataFrame:
    """A check's table: for each W = 2, 4, … the row of the whole gradient (``verdict`` and the
    given columns) and one row of a part (which the census must not read)."""
    rows = []
    for world_size, (verdict, columns) in zip((2, 4, 8), whole, strict=False):
        base = {"world_size": world_size, "verdict": verdict, "forward": "same", "cosine": 1.0,
                "norm_ratio": 1.0, "loss_diff": 0.0, "scale": None, "error": None,
                "cause": None, "where": None}  # fmt: skip
        rows.append({**base, "part": "all", **columns})
        rows.append({**base, "part": "model", "verdict": "exact"})
    return pd.DataFrame(rows)


EXACT = ("exact", {})
BIASED = ("biased", {"cosine": 0.9876, "norm_ratio": 0.5, "cause": "own_slice",
                     "where": " loss.py:12  backward"})  # fmt: skip


@pytest.mark.parametrize(
    ("whole", "expected"),
    [((EXACT, EXACT), True), ((EXACT, BIASED), False), ((BIASED, EXACT), False),
     ((("loss scaled", {"scale": 2.0}), EXACT), True), ((EXACT, ("failed", {})), False)],
)  # fmt: skip
def test_a_case_is_exact_only_when_every_world_size_is(whole, expected):
    assert census.exact(_table(*whole)) is expected
    assert census.exact("failed on one device: ValueError") is False


class _Checks:
    """A stand-in for the check: the given tables in turn, each root it was asked about noted."""

    def __init__(self, *tables):
        self.tables, self.roots = list(tables), []

    def __call__(self, case, root):
        self.roots.append(Path(root).name)
        return self.tables.pop(0)


def _copied(root: Path, fix: Fix, label: str) -> Path:
    return root.with_name(f"{root.name}+{label}")


def test_a_row_exact_at_one_w_and_not_at_another_gets_its_fix_applied_and_checked():
    checks = _Checks(_table(EXACT, BIASED), _table(EXACT, EXACT))
    row = census.census_row(CASE, Path("/cache/pkg-1.0"), checks, _copied)
    assert checks.roots[0] == "pkg-1.0" and checks.roots[1].startswith("pkg-1.0+gather-")
    cells = dict(zip(census.COLUMNS, row, strict=True))
    assert (cells["W = 2"], cells["W = 4"]) == ("exact", "biased (cos 0.988, norm 0.5)")
    assert cells["cause; where"] == "own_slice; `loss.py:12  backward`"
    assert (cells["fix"], cells["with the fix (W = 2, 4)"]) == (FIX.summary, "exact")


def test_an_exact_row_is_not_checked_again():
    checks = _Checks(_table(EXACT, EXACT))
    row = census.census_row(CASE, Path("/cache/pkg-1.0"), checks, _copied)
    assert len(checks.roots) == 1
    cells = dict(zip(census.COLUMNS, row, strict=True))
    assert (cells["fix"], cells["with the fix (W = 2, 4)"], cells["cause; where"]) == ("", "", "")


def test_the_fix_column_says_exact_only_when_every_w_of_the_fixed_run_is():
    checks = _Checks(_table(BIASED, BIASED), _table(EXACT, BIASED))
    row = census.census_row(CASE, Path("/cache/pkg-1.0"), checks, _copied)
    cells = dict(zip(census.COLUMNS, row, strict=True))
    assert cells["with the fix (W = 2, 4)"] == "exact / biased (cos 0.988, norm 0.5)"


def test_a_case_without_a_fix_says_its_note_and_a_patched_case_is_checked_patched():
    patch = Fix("float64 and the CPU", "lightly/gather.patch")
    case = Case("pkg", "1.0", "Loss", "gather=False", "pkg:Loss", note="the flag is off",
                patch=patch)  # fmt: skip
    checks = _Checks(_table(BIASED, BIASED))
    row = census.census_row(case, Path("/cache/pkg-1.0"), checks, _copied)
    assert len(checks.roots) == 1 and checks.roots[0].startswith(f"pkg-1.0+{patch.name}-")
    cells = dict(zip(census.COLUMNS, row, strict=True))
    assert (cells["fix"], cells["with the fix (W = 2, 4)"]) == ("the flag is off", "")


def test_the_cells_name_the_loss_difference_the_scale_and_a_failure():
    table = _table(("loss differs", {"forward": "differs", "loss_diff": 0.123456}),
                   ("failed", {"error": "rank 1: RuntimeError: boom"}))  # fmt: skip
    assert census.verdicts(table) == [
        "loss differs (Δloss 0.123, cos 1, norm 1)", "failed: rank 1: RuntimeError: boom",
    ]  # fmt: skip
    assert census.verdicts(_table(("loss scaled", {"scale": 0.5}), EXACT)) == [
        "loss scaled (×0.5)", "exact",
    ]  # fmt: skip
