"""The command lines as users run them: a multirun with its report, and bad input."""

from __future__ import annotations

import shutil

import numpy as np
import pandas as pd
import pytest
from helpers import capture_figures, run_command

from gatherlab.analysis import report
from gatherlab.core import runfiles


@pytest.mark.slow
def test_multirun_writes_runs_and_comparison(pr1531_sweep):
    sweep, result = pr1531_sweep
    for job in range(4):
        assert {"curves.csv", "summary.json", "final_state.pt"} <= {
            p.name for p in (sweep / str(job)).iterdir()
        }
    table = pd.read_csv(sweep / report.COMPARISON)
    assert len(table) == 4
    required = {
        "experiment", "model", "loss", "data", "gather", "devices", "batch_size",
        "global_batch_size", "precision", "steps", "max_abs_loss_diff", "max_abs_param_diff",
        "matches_reference",
    }  # fmt: skip
    assert required <= set(table.columns)
    verdicts = {(row.gather, row.devices): row.matches_reference for row in table.itertuples()}
    assert verdicts == {("old", 1): True, ("old", 2): False, ("fixed", 1): True, ("fixed", 2): True}
    fixed = table[(table.gather == "fixed") & (table.devices == 2)].iloc[0]
    assert fixed.max_abs_loss_diff <= 1e-10 and fixed.max_abs_param_diff <= 1e-10
    assert (sweep / "comparison.png").stat().st_size > 0 and (sweep / "comparison.pdf").exists()
    output = result.stdout + result.stderr
    assert "comparison of 4 runs" in output
    for job, overrides in enumerate(["gather=old layout=cpu1", "gather=old layout=cpu2"], start=1):
        assert f"job {job}/4: experiment=lightly_pr1531 {overrides}" in output


@pytest.mark.slow
def test_the_report_command_rebuilds_the_same_table(pr1531_sweep, tmp_path, monkeypatch):
    sweep = tmp_path / "sweep"
    shutil.copytree(pr1531_sweep[0], sweep)
    table = pd.read_csv(sweep / report.COMPARISON)
    (sweep / report.COMPARISON).unlink()
    figures = capture_figures(monkeypatch)
    rerun = run_command("report", str(sweep))
    assert rerun.returncode == 0, rerun.stderr
    assert "(reference)" in rerun.stdout
    assert pd.read_csv(sweep / report.COMPARISON).equals(table)
    _assert_comparison_figure_draws_the_run_files(figures[report.FIGURE], sweep, table)


def _assert_comparison_figure_draws_the_run_files(figure, sweep, table: pd.DataFrame) -> None:
    """What the comparison figure drew, read back from its Figure: each 2-device run's loss curve
    and the 1-device reference's are the losses of their curves.csv, and the |Δloss| panel is
    |loss − reference loss| per step (0 at the floor 1e-18), with the float64 match tolerance."""
    loss_axis, diff_axis = figure.axes  # one group of comparable runs: one row of two panels
    reference_dir = table["reference"].dropna().unique()
    assert len(reference_dir) == 1
    reference = runfiles.read_curves(sweep / str(reference_dir[0]))
    drawn = {line.get_label(): line for line in loss_axis.get_lines()}
    differences = {line.get_label(): line for line in diff_axis.get_lines()}
    compared = table[table["devices"] == 2]
    reference_label = f"reference, 1 × {table['global_batch_size'].iloc[0]}"
    labels = [f"{row.gather}, 2 × {row.batch_size}" for row in compared.itertuples()]
    assert sorted(drawn) == sorted([*labels, reference_label])
    assert list(drawn[reference_label].get_ydata()) == reference["loss"]
    assert list(drawn[reference_label].get_xdata()) == reference["step"]
    for label, row in zip(labels, compared.itertuples(), strict=True):
        curves = runfiles.read_curves(sweep / str(row.run_dir))
        assert list(drawn[label].get_ydata()) == curves["loss"]
        assert list(drawn[label].get_xdata()) == curves["step"]
        expected = np.maximum(np.abs(np.subtract(curves["loss"], reference["loss"])), 1e-18)
        assert np.array_equal(differences[label].get_ydata(), expected)
        assert (expected.max() > 1e-10) == (row.gather == "old")  # not vacuous: old differs
    tolerance = [line for line in differences.values() if list(line.get_ydata()) == [1e-10] * 2]
    assert len(tolerance) == 1  # the match tolerance of float64 runs, as a horizontal line


def _one_error_line(result, expected: str) -> None:
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert expected in lines[0]
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["gather=nope"],
            "gather='nope' is unknown; allowed: avg, fixed, fixed_all_reduce, "
            "fixed_reduce_scatter, functional, lightning, native, nograd, nograd_swap, old, "
            "torch_nn",
        ),
        (["-m", "gather=fixed,nope", "layout=cpu2"], "gather='nope' is unknown"),
        (["-m", "layout=cpu1,cpu4", "global_batch_size=6"], "global_batch_size=6 does not divide"),
        (["-m", "loss.temperature=0.5,0"], "temperature must be a positive number, got 0"),
        # Hydra's refusal to compose the sweep's own config, before the sweeper: one line too
        (["-m", "gather=nope", "seed=0,1"], "gather='nope' is unknown"),
        # the mode is Hydra's (here set by the config, without -m): the jobs are a sweep's
        (["hydra.mode=MULTIRUN", "gather=fixed,nope"], "gather='nope' is unknown"),
        (["-m", "+resume=missing"], "resume=missing does not exist; allowed: a sweep directory"),
    ],
)
def test_bad_training_input_fails_in_one_line(tmp_path, args, expected, no_leftover_processes):
    result = run_command(
        "train", *args, f"hydra.sweep.dir={tmp_path}/s", f"hydra.run.dir={tmp_path}/r"
    )
    _one_error_line(result, expected)
    assert not any(tmp_path.iterdir()), "nothing may be written before the checks pass"


def test_report_of_missing_sweep_fails_in_one_line(tmp_path):
    _one_error_line(run_command("report", str(tmp_path / "missing")), "does not exist")


def test_log_every_prints_a_progress_line_every_n_steps_and_at_the_last(tmp_path):
    """``log_every=N``: one line after every N-th optimizer step and one after the last (README);
    its loss is that step's, as curves.csv has it (one device: the local loss is the global one).
    ``log_every=0``: none."""
    import re

    from gatherlab.core import runfiles

    printed = {}
    for every in (2, 0):
        run_dir = tmp_path / str(every)
        result = run_command("train", "steps=5", f"log_every={every}", f"hydra.run.dir={run_dir}")
        assert result.returncode == 0, result.stderr[-3000:]
        printed[every] = re.findall(
            r"step (\d+)/5: local loss (\S+), ", result.stdout + result.stderr
        )
        assert "5 steps on 1 device(s), final loss" in result.stdout + result.stderr
    assert [int(step) for step, _ in printed[2]] == [2, 4, 5]
    curves = runfiles.read_curves(tmp_path / "2")
    for step, loss in printed[2]:  # after step k (1-based) the loss of curves' row k - 1
        assert float(loss) == float(f"{curves['loss'][int(step) - 1]:.6g}")
    assert printed[0] == []


@pytest.mark.parametrize(
    ("environment", "typed", "added"),
    [
        ({}, [], []),
        ({"RANK": "0"}, [], []),
        ({"RANK": "1"}, [], ["hydra.output_subdir=null", "hydra/job_logging=none"]),
        ({"SLURM_PROCID": "3"}, [], ["hydra.output_subdir=null", "hydra/job_logging=none"]),
        ({"RANK": "1"}, ["hydra/job_logging=stdout"], ["hydra.output_subdir=null"]),
    ],
    ids=["no_launcher", "rank_0", "torchrun_rank_1", "srun_task_3", "typed_logging_kept"],
)
def test_ranks_other_than_zero_write_nothing_into_the_run_directory(
    environment, typed, added, monkeypatch
):
    """The overrides ``gatherlab.train`` adds for a rank other than 0 that torchrun or SLURM
    started (tests/ranks/test_launch.py's torchrun test sees their effect: rank 1 opens no file in
    the run directory); an override the user typed is kept, not doubled (Hydra refuses two)."""
    from gatherlab.lab import train

    for name in ("RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert train._rank_arguments(["experiment=bug_demo", *typed]) == added
