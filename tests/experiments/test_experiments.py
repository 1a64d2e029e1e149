"""The experiments' own logic (experiments/*.py), imported and run on small tables and run
directories written here, each expected value worked out by hand: the learning-rate sweep's
pairing of `old` at lr·W with `fixed` at lr (and with `fixed` at the experiment's lr), its
differences, its cells and their 95% t-intervals, its panel lines and tables; the downstream
figure's pairing of each multi-device run with the 1-device run of its seed; the accumulation
figure's differences; the public-code table's rows; the census's patch files (applied to a fake
release), remarks and ``--check``. (The statistics themselves:
``test_figure_stats.py``; the Markdown from the committed tables: ``test_figures.py``.)"""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import REPO
from scipy import stats

sys.path.insert(0, str(REPO / "experiments"))
import accumulation
import census
import census_cases
import downstream
import lr_sweep
import public_code
from census_cases import common as census_common

from gatherlab.core import runfiles

W = 4
GRID = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
BASE_LR = 0.5


def _sweep_runs() -> pd.DataFrame:
    """An lr sweep's runs as ``lr_sweep.compare`` takes them: both losses × both gathers × the
    grid × seeds 0, 1, on W ranks, each run directory named by its cell."""
    rows = [
        {"loss": loss, "gather": gather, "lr": lr, "seed": seed, "devices": W,
         "few_shot_accuracy": 0.5, "final_loss": 1.0, "run_dir": f"{loss}/{gather}/{lr:g}/{seed}"}
        for loss in ("ntxent_global", "ntxent") for gather in ("fixed", "old") for lr in GRID
        for seed in (0, 1)
    ]  # fmt: skip
    return pd.DataFrame(rows)


def test_old_at_lr_times_w_is_paired_with_fixed_at_lr_and_each_with_fixed_at_the_base_lr(
    monkeypatch,
):
    """``compare`` holds each `old` run against `fixed` at lr/W of its loss and seed (where the
    grid has it) and against `fixed` at the experiment's lr: every pair it measures is recorded."""
    pairs = []

    def differences(run_dir: str, other_dir: str, world_size: int) -> dict[str, float]:
        pairs.append((run_dir, other_dir, world_size))
        return dict.fromkeys(lr_sweep.DIFFERENCES, float(len(pairs)))

    monkeypatch.setattr(lr_sweep, "max_differences", differences)
    table = lr_sweep.compare(_sweep_runs(), BASE_LR)
    shifted = {(1.0, 0.25), (2.0, 0.5), (4.0, 1.0), (8.0, 2.0)}  # old's lr → fixed's lr = lr/4
    expected = {
        (f"{loss}/old/{lr:g}/{seed}", f"{loss}/fixed/{other:g}/{seed}", W)
        for loss in ("ntxent_global", "ntxent") for seed in (0, 1)
        for lr, other in [*shifted, *((lr, BASE_LR) for lr in GRID)]
    }  # fmt: skip
    # old at 2 meets fixed at 0.5 twice: as its lr/W and as the base lr
    assert sorted(pairs) == sorted([*expected, *(
        (f"{loss}/old/2/{seed}", f"{loss}/fixed/0.5/{seed}", W)
        for loss in ("ntxent_global", "ntxent") for seed in (0, 1)
    )])  # fmt: skip
    old = table[table["gather"] == "old"].set_index(["loss", "lr", "seed"])
    for lr in GRID:
        paired = old.loc[("ntxent_global", lr, 0), "fixed_lr"]
        assert (paired == lr / W) if lr / W in GRID else math.isnan(paired), (lr, paired)
    fixed = table[table["gather"] == "fixed"]
    assert fixed[["fixed_lr", "base_loss_diff"]].isna().all().all()  # only old rows are paired
    assert list(table["style"].unique()) == ["global", "local"]  # sorted by style, then gather


def _run_dir(path, losses, grad_norms, state) -> str:
    path.mkdir()
    rows = [{"step": step, "loss": loss, "grad_norm": norm}
            for step, (loss, norm) in enumerate(zip(losses, grad_norms, strict=True))]  # fmt: skip
    runfiles.write_curves(path, rows)
    runfiles.write_final_state(path, state)
    return str(path)


def test_the_differences_of_two_runs_are_their_largest_gaps_and_the_grad_norm_ratio_error(tmp_path):
    """|Δloss| 0.125 at step 1; |Δweight| 2 in a batch norm's running mean (a buffer: among the
    weights, not among the batch norm's affine weight and bias, whose largest is 0.25); and
    W·(0.25, 0.5)/(1, 1.6) − 1 = (0, 0.25)."""
    state = {"fc.weight": torch.tensor([1.0, 2.0]), "bn.weight": torch.tensor([1.0]),
             "bn.bias": torch.tensor([0.0]), "bn.running_mean": torch.tensor([0.0])}  # fmt: skip
    other = {"fc.weight": torch.tensor([1.0, 2.0625]), "bn.weight": torch.tensor([1.25]),
             "bn.bias": torch.tensor([0.125]), "bn.running_mean": torch.tensor([2.0])}  # fmt: skip
    run = _run_dir(tmp_path / "old", [1.0, 0.875], [0.25, 0.5], state)
    fixed = _run_dir(tmp_path / "fixed", [1.0, 0.75], [1.0, 1.6], other)
    assert lr_sweep.max_differences(run, fixed, W) == pytest.approx({
        "max_abs_loss_diff": 0.125, "max_abs_param_diff": 2.0, "max_abs_affine_diff": 0.25,
        "grad_norm_ratio_err": 0.25,
    }, abs=1e-15)  # fmt: skip
    assert accumulation._differences(tmp_path / "old", tmp_path / "fixed") == (0.125, 2.0, 0.875)


def _accuracies() -> pd.DataFrame:
    """Two cells of an lr sweep's table: (ntxent, fixed, 0.5) over 5 seeds, (ntxent, old, 1) over
    3."""
    fixed = [0.71, 0.79, 0.75, 0.72, 0.75]
    old = [0.60, 0.64, 0.65]
    rows = [{"loss": "ntxent", "gather": "fixed", "lr": 0.5, "seed": seed, "few_shot_accuracy": a}
            for seed, a in enumerate(fixed)]  # fmt: skip
    rows += [{"loss": "ntxent", "gather": "old", "lr": 1.0, "seed": seed, "few_shot_accuracy": a}
             for seed, a in enumerate(old)]  # fmt: skip
    return pd.DataFrame(rows)


def test_each_cell_is_the_mean_of_its_seeds_with_scipys_95_percent_t_interval():
    summary = lr_sweep.cells(_accuracies()).set_index(["gather", "lr"])
    for (gather, lr), values in (
        (("fixed", 0.5), [0.71, 0.79, 0.75, 0.72, 0.75]), (("old", 1.0), [0.60, 0.64, 0.65]),
    ):  # fmt: skip
        cell = summary.loc[(gather, lr)]
        low, high = stats.t.interval(0.95, len(values) - 1, loc=np.mean(values),
                                     scale=stats.sem(values))  # fmt: skip
        assert cell["seeds"] == len(values)
        assert cell["mean"] == pytest.approx(np.mean(values), abs=1e-15)
        assert cell["ci95"] == pytest.approx((high - low) / 2, rel=1e-12)
    # fixed: mean 0.744, sd 0.031305 (sum of squares 0.00392), t₀.₉₇₅,₄ 2.776445
    assert lr_sweep._mean_and_interval(summary.loc[("fixed", 0.5)]) == "0.7440 ± 0.0389"


def _compared(old: dict[float, tuple[float, float, float]]) -> pd.DataFrame:
    """An lr sweep's compared table of both losses: `old` rows, lr → (fixed_lr, each difference
    against it, the differences against fixed at the base lr), for seeds 0 and 1 (seed 1's
    differences twice seed 0's), and `fixed` rows at the same lrs."""
    rows = []
    for loss, style in lr_sweep.STYLES.items():
        for lr, (fixed_lr, paired, base) in old.items():
            for seed in (0, 1):
                rows.append({
                    "loss": loss, "style": str(style), "gather": "old", "lr": lr, "seed": seed,
                    "few_shot_accuracy": 0.5 + lr / 100 + seed / 1000, "fixed_lr": fixed_lr,
                    **dict.fromkeys(lr_sweep.DIFFERENCES, paired * (1 + seed)),
                    "base_loss_diff": base * (1 + seed), "base_param_diff": base * (1 + seed),
                })  # fmt: skip
            rows += [{"loss": loss, "style": str(style), "gather": "fixed", "lr": lr,
                      "seed": seed, "few_shot_accuracy": 0.6 - lr / 100 + seed / 1000}
                     for seed in (0, 1)]  # fmt: skip
    return pd.DataFrame(rows)


def test_each_panel_states_its_exact_check_in_a_line():
    bitwise = _compared({0.5: (float("nan"), 0.0, 0.129), 2.0: (0.5, 0.0, 0.5)})
    assert lr_sweep._verdict(bitwise, "ntxent_global", BASE_LR) == (
        "old at lr·W = fixed at lr, loss and weights to the bit (2 runs)"
    )
    close = _compared({0.5: (float("nan"), 0.0, 0.129), 2.0: (0.5, 3e-16, 0.5)})
    assert lr_sweep._verdict(close, "ntxent_global", BASE_LR) == (
        "old at lr·W = fixed at lr, loss and weights to 6e-16 (2 runs)"  # seed 1's: 2 × 3e-16
    )
    # the smallest |Δweight| against fixed at 0.5, 0.129, printed rounded down as a bound
    assert lr_sweep._verdict(close, "ntxent", BASE_LR) == (
        "no lr of old gives fixed at 0.5: |Δweight| ≥ 0.12"
    )


def test_the_markdown_tables_hold_the_pairs_the_nearest_and_the_best_cells():
    table = _compared({0.5: (float("nan"), 0.0, 0.129), 2.0: (0.5, 3e-16, 0.5)})
    lines = lr_sweep.markdown(lr_sweep.cells(table), table, BASE_LR).splitlines()
    # pairs: old at 2 against fixed at 0.5, 2 seeds, the largest (seed 1's) of each difference
    assert "| global | 2 | 0.5 | 2 | 6.00e-16 | 6.00e-16 | 6.00e-16 | 6.00e-16 |" in lines
    assert "| local | 2 | 0.5 | 2 | 6.00e-16 | 6.00e-16 | 6.00e-16 | 6.00e-16 |" in lines
    assert not [line for line in lines if line.startswith("| global | 0.5 | nan")]  # unpaired
    # nearest: the smallest over the seeds (seed 0's)
    assert "| global | 0.5 | 0.129 | 0.129 |" in lines and "| local | 2 | 0.5 | 0.5 |" in lines
    # best: old's mean rises with lr (0.5 + lr/100 + seed/1000), fixed's falls (0.6 − lr/100)
    assert "| global | old | 2 | 0.5205 ± 0.0064 |" in lines
    # two seeds 0.001 apart: sd 0.001/√2, half-width t₀.₉₇₅,₁ · 0.001/2 = 0.0064
    assert "| global | fixed | 0.5 | 0.5955 ± 0.0064 |" in lines


def test_each_multi_device_run_is_paired_with_the_one_device_run_of_its_seed():
    """Seeds listed out of order, a repeated run dropped: old's accuracy is the 1-device one of
    its seed minus (0.02, 0.03, 0.025) for seeds (0, 1, 2), fixed's equal to it. The paired
    differences have mean −0.025 and sd 0.005, so a 95% half-width of t₀.₉₇₅,₂ · 0.005/√3 =
    0.0124: significant; fixed's are all 0: not."""
    one = {0: 0.70, 1: 0.80, 2: 0.75}
    drop = {0: 0.02, 1: 0.03, 2: 0.025}
    rows = []
    for loss in ("ntxent", "ntxent_global"):
        for seed in (2, 0, 1):
            rows.append({"loss": loss, "gather": "fixed", "devices": 1, "seed": seed,
                         "few_shot_accuracy": one[seed]})  # fmt: skip
            rows.append({"loss": loss, "gather": "old", "devices": 4, "seed": seed,
                         "few_shot_accuracy": one[seed] - drop[seed]})  # fmt: skip
            rows.append({"loss": loss, "gather": "fixed", "devices": 4, "seed": seed,
                         "few_shot_accuracy": one[seed]})  # fmt: skip
    rows.append({**rows[1], "few_shot_accuracy": 0.0})  # a second run of a cell: the first kept
    table = downstream.cell_table(pd.DataFrame(rows)).set_index("cell")
    half = stats.t.ppf(0.975, 2) * 0.005 / math.sqrt(3)
    for cell in ("old, 4 ranks (biased)", "old, 4 ranks (1/W)"):
        old = table.loc[cell]
        assert old["seeds"] == 3 and old["per_seed"] == "0.6800 0.7700 0.7250"  # seeds 0, 1, 2
        assert old["paired_diff"] == pytest.approx(-0.025, abs=1e-12)
        assert old["paired_sd"] == pytest.approx(0.005, rel=1e-9)
        assert old["paired_ci95"] == pytest.approx(half, rel=1e-9)
        assert old["mean"] == pytest.approx(0.725, abs=1e-12)
        assert bool(old["significant"])
    fixed = table.loc["fixed, 4 ranks (exact)"]
    assert (fixed["paired_diff"], fixed["paired_sd"], fixed["paired_ci95"]) == (0.0, 0.0, 0.0)
    assert not fixed["significant"] and fixed["detectable_80"] == 0.0
    assert table.loc["1 device (ntxent)", "per_seed"] == "0.7000 0.8000 0.7500"


def test_the_public_code_table_has_a_row_per_w_with_the_parts_only_when_they_differ():
    case = public_code.CASES[0]
    table = pd.DataFrame([
        {"world_size": 2, "part": "all", "verdict": "biased", "cause": "parts",
         "norm_ratio": 0.123456, "cosine": 0.99},
        {"world_size": 2, "part": "model", "gradient": "1/W"},
        {"world_size": 2, "part": "loss.t", "gradient": "exact"},
        {"world_size": 4, "part": "all", "verdict": "exact", "cause": "", "norm_ratio": 1.0,
         "cosine": float("nan")},
        {"world_size": 4, "part": "model", "gradient": "exact"},
        {"world_size": 4, "part": "loss.t", "gradient": "exact"},
    ])  # fmt: skip
    start = [case.package, case.version, case.label]
    assert public_code.rows_of(case, table) == [
        [
            *start,
            "2",
            "biased",
            "parts",
            "model 1/W, loss.t exact",
            "0.1235",
            "0.99",
            case.predicted,
        ],
        [*start, "4", "exact", "", "", "1", "—", case.predicted],
    ]


def test_a_census_fix_is_a_patch_that_git_apply_puts_on_a_copy_of_the_release(
    tmp_path, monkeypatch
):
    """A fake release of one file and a unified diff of it: the copy holds the patched text, the
    release its own; a patch whose context the release does not hold stops the census."""
    release = tmp_path / "cache" / "toy-1.0"
    (release / "toy").mkdir(parents=True)
    (release / "toy" / "loss.py").write_text("def loss(z):\n    m = z.mean(0)\n    return m\n")
    fixes = tmp_path / "fixes" / "toy"
    fixes.mkdir(parents=True)
    (fixes / "mean.patch").write_text(
        "--- a/toy/loss.py\n+++ b/toy/loss.py\n@@ -1,3 +1,4 @@\n def loss(z):\n"
        "     m = z.mean(0)\n+    m = all_reduce_sum(m) / 2\n     return m\n"
    )
    (fixes / "stale.patch").write_text(
        "--- a/toy/loss.py\n+++ b/toy/loss.py\n@@ -1,3 +1,3 @@\n def loss(z):\n"
        "-    m = z.sum(0)\n+    m = z.mean(0)\n     return m\n"
    )
    monkeypatch.setattr(census_common, "FIXES", tmp_path / "fixes")
    fix = census_common.Fix("all-reduce the mean", "toy/mean.patch")
    copy = census_common.fixed_copy(release, fix, f"{fix.name}-1")
    assert copy == tmp_path / "cache" / "toy-1.0+mean-1"
    assert (copy / "toy" / "loss.py").read_text() == (
        "def loss(z):\n    m = z.mean(0)\n    m = all_reduce_sum(m) / 2\n    return m\n"
    )
    assert (release / "toy" / "loss.py").read_text().count("all_reduce_sum") == 0
    stale = census_common.Fix("a fix of another release", "toy/stale.patch")
    with pytest.raises(RuntimeError, match=r"toy/stale\.patch does not apply"):
        census_common.fixed_copy(release, stale, "stale-1")


def test_every_census_fix_is_a_patch_file_of_its_package_and_every_patch_file_a_fix():
    used = {f.patch for case in census_cases.CASES for f in (case.fix, case.patch) if f}
    on_disk = {str(p.relative_to(census_common.FIXES)) for p in census_common.FIXES.rglob("*")
               if p.is_file()}  # fmt: skip
    assert used == on_disk and len(used) == 36
    for module in census_cases.PACKAGES:
        for case in module.CASES:
            for fix in (case.fix, case.patch):
                if fix is not None:  # fixes/<the case's module>/<what>.patch, a unified diff
                    assert fix.patch.split("/")[0] == module.__name__.split(".")[-1]
                    text = (census_common.FIXES / fix.patch).read_text()
                    assert text.startswith("--- a/") and "\n+++ b/" in text and "\n@@ -" in text


def test_a_release_imported_whole_goes_first_on_the_path_and_leaves_the_others(
    tmp_path, monkeypatch
):
    """The census imports a release whole from its folder (`common.importable`): the folder goes
    first on the path, a copy of the package imported from elsewhere is forgotten, and every other
    folder stays, site-packages too (which also holds the package: what later cases import, as
    pytorch_lightning or functorch, is there)."""
    installed, release, fixed = (tmp_path / name for name in ("site", "release", "fixed"))
    for folder, text in ((installed, "installed"), (release, "release"), (fixed, "fixed")):
        (folder / "toypkg").mkdir(parents=True)
        (folder / "toypkg" / "__init__.py").write_text(f"WHERE = {text!r}\n")
    (installed / "otherpkg.py").write_text("")
    monkeypatch.setattr(sys, "path", [str(installed), *sys.path])
    monkeypatch.delitem(sys.modules, "toypkg", raising=False)
    import toypkg

    assert toypkg.WHERE == "installed"
    wheres = []
    for root in (release, fixed, release):
        census_common.importable(root, "toypkg")
        wheres.append(importlib.import_module("toypkg").WHERE)
        assert sys.path[0] == str(root) and str(installed) in sys.path
    assert wheres == ["release", "fixed", "release"]
    importlib.import_module("otherpkg")  # site-packages is still searched
    for name in ("toypkg", "otherpkg"):
        sys.modules.pop(name, None)


def test_a_census_remark_travels_with_its_case_into_the_notes():
    """``--only PMSNLoss`` selects PMSN's two rows; the note under the table is the remark of
    the one with the flag on, whatever else is selected."""
    selected = [c for c in census_cases.CASES if "PMSNLoss" in f"{c.package} {c.version} {c.loss}"]
    assert [c.flags for c in selected] == [
        "defaults (gather_distributed=False)", "gather_distributed=True",
    ]  # fmt: skip
    assert census.notes(selected) == [
        "- lightly 1.6.0 `PMSNLoss` (gather_distributed=True): as MSNLoss's: the "
        "regularisation's mean over the rank's rows (msn_loss.py:236, inherited)."
    ]
    two_nodes = [c for c in census_cases.CASES if c.loss == "SWAVLoss" and "num_nodes=2" in c.flags]
    assert len(two_nodes) == 1 and two_nodes[0].remark.startswith("patched for CPU and float64")
    everything = census.notes(census_cases.CASES)
    assert len(everything) == 22 and everything[8].startswith(
        "- pytorch-metric-learning 2.9.0 `DistributedLossWrapper(NTXentLoss)` (efficient=False): "
        "`loss scaled`"
    )


def test_the_census_writes_its_table_only_when_it_changed_and_check_writes_nothing(
    monkeypatch, capsys
):
    written = []
    monkeypatch.setattr(census, "committed", lambda: "| a |\n| 1 |")
    monkeypatch.setattr(census, "write_into_results", lambda *args: written.append(args))
    assert census.publish("| a |\n| 1 |", check=True) == 0
    assert census.publish("| a |\n| 1 |", check=False) == 0 and written == []
    capsys.readouterr()
    assert census.publish("| a |\n| 2 |", check=True) == 1 and written == []
    assert "-| 1 |\n+| 2 |\n" in capsys.readouterr().out
    assert census.publish("| a |\n| 2 |", check=False) == 0
    assert written == [("| a |\n| 2 |", census.START, census.END)]


def test_importing_the_census_loads_no_released_file():
    assert not [name for name in sys.modules if name.startswith("_released_")]
    assert "pytorch_metric_learning" not in sys.modules and "einops" not in sys.modules


def test_every_census_finding_has_its_committed_page_and_every_page_a_finding():
    """docs/findings/ is the census's (`census_pages`): a page per reproducer of a case, each
    naming its release, patch and reproducer; the index links every page; the README points at
    the index. (What the pages say is the census's run: `census.py --check` compares them.)"""
    import census_pages

    found = census_pages.findings(
        [census_pages.Checked(case, "", None, REPO) for case in census_cases.CASES]
    )
    pages = {p.name for p in census_pages.FINDINGS.glob("*.md")} - {census_pages.INDEX}
    assert pages == {f"{Path(name).stem}.md" for name in found}
    index = (census_pages.FINDINGS / census_pages.INDEX).read_text()
    for name, checked in found.items():
        page = (census_pages.FINDINGS / f"{Path(name).stem}.md").read_text()
        assert f"experiments/census_repro/{name}" in page and f"({Path(name).stem}.md)" in index
        for one in checked:
            assert f"{one.case.package} {one.case.version} `{one.case.loss}`" in page
            if one.case.fix is not None:
                assert f"## The patch `{one.case.fix.patch}`" in page
    assert "docs/findings/README.md" in (REPO / "README.md").read_text()
