"""The census's own logic (experiments/census.py) on tables built here by hand, as the check
writes them (one row per W and part): a case is exact only when every W is; a case that is not
exact at some W (or whose loss is only scaled, when it has a fix: a fix of the value) gets its
fix applied and checked again; the fix column says exact only when every W of the fixed run is;
the cells and the cause column read what the rows hold. And, on real gloo ranks of the pool, on
a stand-in release written here: a finding (a case with a reproducer) and its fixed copy are
checked at W = 2, 4 and 8, another case and its fixed copy at W = 2 and 4."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.distributed as dist
from helpers import REPO
from torch import nn

sys.path.insert(0, str(REPO / "experiments"))
import census
from census_cases.common import Case, Fix
from census_fixes import all_gather_rows

FIX = Fix("sum the slices' gradients", "lightly/gather.patch")
CASE = Case("pkg", "1.0", "Loss", "gather=True", "pkg:Loss", fix=FIX)


def _table(*whole: tuple[str, dict]) -> pd.DataFrame:
    """A check's table: for each W = 2, 4, … the row of the whole gradient (``verdict`` and the
    given columns) and one row of a part (which the census must not read)."""
    rows = []
    for world_size, (verdict, columns) in zip((2, 4, 8), whole, strict=False):
        base = {"world_size": world_size, "verdict": verdict, "forward": "same", "cosine": 1.0,
                "norm_ratio": 1.0, "loss_diff": 0.0, "scale": None, "error": None,
                "max_rel_err": None, "cause": None, "where": None}  # fmt: skip
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


def test_a_scaled_loss_with_a_fix_of_its_value_gets_it_checked_and_a_fix_that_scales_is_not_exact():
    scaled = ("loss scaled", {"scale": 2.0})
    checks = _Checks(_table(scaled, scaled), _table(EXACT, EXACT))
    row = census.census_row(CASE, Path("/cache/pkg-1.0"), checks, _copied)
    assert len(checks.roots) == 2 and checks.roots[1].startswith("pkg-1.0+gather-")
    cells = dict(zip(census.COLUMNS, row, strict=True))
    assert (cells["W = 2"], cells["fix"], cells["with the fix (W = 2, 4)"]) == (
        "loss scaled (×2)", FIX.summary, "exact",
    )  # fmt: skip
    checks = _Checks(_table(BIASED, BIASED), _table(scaled, scaled))
    row = census.census_row(CASE, Path("/cache/pkg-1.0"), checks, _copied)
    cells = dict(zip(census.COLUMNS, row, strict=True))
    assert cells["with the fix (W = 2, 4)"] == "loss scaled (×2) / loss scaled (×2)"
    # without a fix, a scaled loss is a row that trains like one device: nothing to say
    checks = _Checks(_table(scaled, scaled))
    row = census.census_row(dataclasses.replace(CASE, fix=None), Path("/r/pkg-1.0"), checks)
    cells = dict(zip(census.COLUMNS, row, strict=True))
    assert len(checks.roots) == 1 and (cells["fix"], cells["with the fix (W = 2, 4)"]) == ("", "")


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


def test_a_finding_biased_only_at_w_8_is_not_exact_and_its_cells_show_w_2_and_4():
    """A finding is checked at W = 2, 4 and 8 (its page shows all three); the table's cells are
    W = 2 and 4, and W = 8 still decides whether the row is exact and its fix is tried."""
    checks = _Checks(_table(EXACT, EXACT, BIASED), _table(EXACT, EXACT, EXACT))
    row = census.census_row(CASE, Path("/cache/pkg-1.0"), checks, _copied)
    cells = dict(zip(census.COLUMNS, row, strict=True))
    assert (cells["W = 2"], cells["W = 4"]) == ("exact", "exact")
    assert len(checks.roots) == 2 and cells["with the fix (W = 2, 4)"] == "exact"


FINDING = Case("pkg", "1.0", "Loss", "gather=True", "pkg:Loss", fix=FIX, repro="pkg_gather.py",
               remark="the backward keeps the own slice",
               threads=(("https://example.org/1", "it does not sum the slices"),))  # fmt: skip
ANSWERED = Case("pkg", "1.0", "Other", "defaults", "pkg:Other",
                threads=(("https://example.org/thread/2", "it is exact"),))  # fmt: skip


def test_a_findings_page_holds_its_numbers_lines_patch_reproducer_and_thread(tmp_path, monkeypatch):
    import census_pages

    release = tmp_path / "pkg-1.0"
    (release / "pkg").mkdir(parents=True)
    (release / "pkg" / "loss.py").write_text("".join(f"line {n}\n" for n in range(1, 21)))
    (tmp_path / "fixes" / "lightly").mkdir(parents=True)
    (tmp_path / "fixes" / "lightly" / "gather.patch").write_text("--- a/pkg/loss.py\n")
    (tmp_path / "repro").mkdir()
    (tmp_path / "repro" / "pkg_gather.py").write_text("print('released, fixed')\n")
    monkeypatch.setattr(census_pages, "FIXES", tmp_path / "fixes")
    monkeypatch.setattr(census_pages, "REPRO", tmp_path / "repro")
    biased = ("biased", {**BIASED[1], "where": " pkg/loss.py:12  backward", "max_rel_err": 0.75})
    checked = [
        census_pages.Checked(FINDING, _table(biased, biased, biased),
                             _table(EXACT, EXACT, EXACT), release),
        census_pages.Checked(ANSWERED, _table(EXACT, EXACT), None, release),
    ]  # fmt: skip
    written = census_pages.pages(checked)
    assert set(written) == {census_pages.FINDINGS / "pkg_gather.md",
                            census_pages.FINDINGS / "README.md"}  # fmt: skip
    page = written[census_pages.FINDINGS / "pkg_gather.md"]
    # one line per W with the table's numbers: Δloss, cosine, norm ratio, largest relative error
    assert "| 8 | biased | 0 | 0.988 | 0.5 | 0.75 |" in page
    assert "| 8 | exact | 0 | 1 | 1 | — |" in page  # the fixed run's
    # the released lines around the named one, the named one marked
    assert ">   12  line 12" in page and "    10  line 10" in page and "line 15" not in page
    assert "The backward keeps the own slice." in page
    assert "--- a/pkg/loss.py" in page and "print('released, fixed')" in page
    assert '`python experiments/census.py --only "pkg 1.0 Loss"`' in page
    assert "**Public thread** https://example.org/1: it does not sum the slices." in page
    index = written[census_pages.FINDINGS / "README.md"]
    assert "[pkg_gather](pkg_gather.md)" in index and "W = 8: biased" in index
    assert "- https://example.org/thread/2: it is exact. pkg 1.0 `Other` (defaults)" in index


def test_the_pages_are_written_when_they_differ_and_a_page_of_no_finding_removed(tmp_path):
    (tmp_path / "old.md").write_text("a finding the census no longer has\n")
    (tmp_path / "same.md").write_text("same\n")
    written = {tmp_path / "same.md": "same\n", tmp_path / "new.md": "new\n"}
    assert census.publish_pages(written, check=True) == 1  # nothing written
    assert (tmp_path / "old.md").is_file() and not (tmp_path / "new.md").exists()
    assert census.publish_pages(written, check=False) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.md", "same.md"]
    assert census.publish_pages(written, check=True) == 0


class TimesWRelease(nn.Module):
    """A stand-in for a released loss, read from its release's folder ``root`` as the census's
    adapters read theirs: the mean over the rank's rows of the squared distance of a row's view-0
    embedding to the mean of every rank's view-1 embeddings (gathered with a gather whose
    backward sums the ranks' gradients), multiplied by W when the release's file ``factor`` says
    ``W`` (the released bug: loss and gradient W times one device's), not when it says ``1``
    (the fixed copy: exact)."""

    def __init__(self, root: str):
        super().__init__()
        self.times_w = (Path(root) / "factor").read_text() == "W"

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        value = ((z0 - all_gather_rows(z1).mean(0)) ** 2).sum(1).mean()
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        return value * world_size if self.times_w else value


def _fixed_release(root: Path, fix: Fix, label: str) -> Path:
    """A fixed copy of the stand-in release, as `census_cases.common.fixed_copy` makes one."""
    copy = root.with_name(f"{root.name}+{label}")
    copy.mkdir()
    (copy / "factor").write_text("1")
    return copy


def _world_sizes(table: pd.DataFrame) -> list[int]:
    return table[table["part"] == "all"]["world_size"].tolist()


@pytest.mark.slow  # four checks on the pool, up to W = 8: 30 s
def test_a_finding_and_its_fixed_copy_are_checked_at_w_2_4_and_8_other_rows_at_2_and_4(tmp_path):
    release = tmp_path / "pkg-1.0"
    release.mkdir()
    (release / "factor").write_text("W")
    finding = Case("pkg", "1.0", "Loss", "times_w=True", TimesWRelease, fix=FIX,
                   repro="pkg_times_w.py")  # fmt: skip
    other = dataclasses.replace(finding, flags="times_w=True, no reproducer", repro="")
    kept = []
    for case in (finding, other):
        census.census_row(case, release, copied=_fixed_release, kept=kept)
    (released, fixed), (other_released, other_fixed) = [(c.table, c.fixed) for c in kept]
    assert _world_sizes(released) == _world_sizes(fixed) == [2, 4, 8]
    assert _world_sizes(other_released) == _world_sizes(other_fixed) == [2, 4]
    # what each checked: the release W times one device's (its gradient's norm ratio W), the
    # fixed copy one device's
    whole = released[released["part"] == "all"]
    assert whole["cause"].tolist() == ["scaled"] * 3
    assert whole["norm_ratio"].tolist() == pytest.approx([2.0, 4.0, 8.0], rel=1e-12)
    assert set(fixed["verdict"]) == set(other_fixed["verdict"]) == {"exact"}
