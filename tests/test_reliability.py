"""When things go wrong: bad numbers stop a run at their step, failing or killed ranks fail their
job and the sweep goes on, the report never claims a match without evidence, interrupted sweeps
resume, reruns are exact, and random configurations either run or fail in one line."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import pandas as pd
import pytest
from helpers import REPO, compose, gatherlab_processes, run_training

from gatherlab import configcheck, jobs, report, runfiles
from gatherlab.configcheck import ConfigError

pytestmark = pytest.mark.slow


def _command(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(REPO / "tests"), "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "gatherlab.train", *args],
        cwd=REPO, env=environment, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


# --- bad numbers --------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["cpu1", "cpu2"])
def test_a_nan_loss_stops_the_run_at_its_step_and_fails_it(tmp_path, layout):
    with pytest.raises(jobs.RunFailed, match="the loss is nan at step 1"):
        run_training(tmp_path, "optim.lr=1e300", "steps=6", f"layout={layout}")
    summary = runfiles.read_summary(tmp_path)
    assert summary["status"] == "failed" and summary["failed_step"] == 1
    assert "NonFiniteLoss" in summary["error"]
    assert not (tmp_path / runfiles.CURVES).exists()


# --- the report never claims a match without evidence -------------------------------------------


@pytest.fixture(scope="module")
def sweep_runs(tmp_path_factory):
    """A reference, a matching run, a failed run and runs that cannot be compared."""
    root = tmp_path_factory.mktemp("report")
    common = ("experiment=lightly_pr1531", "precision=64-true")
    run_training(root / "reference", *common, "layout=cpu1")
    run_training(root / "matches", *common, "layout=cpu2")
    run_training(root / "other_seed", *common, "layout=cpu2", "seed=3")
    run_training(root / "truncated", *common, "layout=cpu2")
    curves = runfiles.read_curves(root / "truncated")
    rows = [dict(zip(curves, values, strict=True)) for values in zip(*curves.values(), strict=True)]
    runfiles.write_curves(root / "truncated", rows[:-3])  # as if the run had stopped early
    run_training(root / "no_weights", *common, "layout=cpu2", "gather=old")
    (root / "no_weights" / runfiles.FINAL_STATE).unlink()
    run_training(root / "corrupt", *common, "layout=cpu2", "gather=old")
    (root / "corrupt" / runfiles.SUMMARY).write_text("{ not json")
    with pytest.raises(jobs.RunFailed):
        run_training(root / "nan", *common, "layout=cpu2", "optim.lr=inf")
    return root, report.write_report(root).set_index("run_dir")


@pytest.mark.parametrize(
    ("run", "verdict"),
    [
        ("reference", "reference"),
        ("matches", "matches"),
        ("other_seed", "no reference"),
        ("truncated", "not comparable"),
        ("no_weights", "unreadable"),
        ("corrupt", "unreadable"),
        ("nan", "failed"),
    ],
)
def test_each_run_gets_the_verdict_its_evidence_allows(sweep_runs, run, verdict):
    _, table = sweep_runs
    assert table.loc[run, "verdict"] == verdict
    assert bool(table.loc[run, "matches_reference"]) == (verdict in ("reference", "matches"))


def test_the_report_says_why_and_draws_only_readable_runs(sweep_runs):
    root, table = sweep_runs
    assert "7 steps against the reference's 10" in table.loc["truncated", "error"]
    assert "final_state.pt" in table.loc["no_weights", "error"]
    assert "summary.json" in table.loc["corrupt", "error"]
    written = pd.read_csv(root / report.COMPARISON)
    assert len(written) == 7 and {"verdict", "error", "status"} <= set(written.columns)
    assert set(written["verdict"]) == set(report.VERDICTS) - {"differs"}
    assert (root / "comparison.png").stat().st_size > 0
    text = report.verdict(table.reset_index())
    # every rank's loss is NaN at step 1; whichever rank reports first names the failure
    assert re.search(r"failed: rank \d: NonFiniteLoss: the loss is nan at step 1", text)


# --- failing and killed ranks in a sweep --------------------------------------------------------


@pytest.mark.parametrize("launcher", ["pool", "spawn"])
@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_failing_rank_fails_its_job_and_the_sweep_goes_on(tmp_path, launcher, how):
    before = set(gatherlab_processes())
    start = time.monotonic()
    result = _command(  # job 1 breaks rank 1 at step 2; job 2 names a rank that does not exist
        "-m", "loss._target_=faulty.RankFault", f"+loss.how={how}", "+loss.rank=1,5",
        "layout=cpu2", f"launcher={launcher}", "steps=4", f"hydra.sweep.dir={tmp_path}",
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr[-2000:]
    assert "gatherlab.train: error: 1 of 2 job(s) failed" in result.stderr
    failed, ok = (runfiles.read_summary(tmp_path / job) for job in ("0", "1"))
    # rank 1 breaks; rank 0, left in a collective, may report its broken connection first
    assert failed["status"] == "failed" and re.match(r"rank [01]: ", failed["error"])
    assert ok["status"] == "ok"
    table = pd.read_csv(tmp_path / report.COMPARISON)
    assert list(table["verdict"]) == ["failed", "no reference"]
    assert elapsed < 120  # far below two collective timeouts
    assert set(gatherlab_processes()) <= before


# --- interrupted sweeps -------------------------------------------------------------------------

SWEEP = ("-m", "experiment=lightly_pr1531", "gather=old,fixed", "layout=cpu1,cpu2")


def test_resume_runs_only_the_incomplete_jobs_and_rebuilds_the_report(tmp_path):
    sweep = tmp_path / "sweep"
    assert _command(*SWEEP, f"hydra.sweep.dir={sweep}").returncode == 0
    # interrupted: job 3 never wrote its summary, job 4 failed
    (sweep / "2" / runfiles.SUMMARY).unlink()
    failed = runfiles.read_summary(sweep / "3") | {"status": "failed", "error": "killed"}
    runfiles.write_summary(sweep / "3", failed)
    untouched = {job: (sweep / job / runfiles.CURVES).stat().st_mtime_ns for job in ("0", "1")}
    report_before = (sweep / report.COMPARISON).stat().st_mtime_ns
    result = _command(*SWEEP, f"+resume={sweep}")
    assert result.returncode == 0, result.stderr[-2000:]
    output = result.stdout + result.stderr
    assert "job 1: complete" in output and "job 2: complete" in output
    for job, mtime in untouched.items():
        assert (sweep / job / runfiles.CURVES).stat().st_mtime_ns == mtime
    for job in ("2", "3"):
        assert runfiles.read_summary(sweep / job)["status"] == "ok"
    assert (sweep / "3" / "summary.failed-1.json").exists()  # the failed attempt is kept
    assert (sweep / report.COMPARISON).stat().st_mtime_ns > report_before
    assert list(pd.read_csv(sweep / report.COMPARISON)["verdict"]) == [
        "reference", "differs", "matches", "matches",
    ]  # fmt: skip


def test_resume_refuses_another_command(tmp_path):
    sweep = tmp_path / "sweep"
    assert _command(*SWEEP, f"hydra.sweep.dir={sweep}").returncode == 0
    result = _command("-m", "experiment=lightly_pr1531", "gather=fixed", "layout=cpu1,cpu2",
                      f"+resume={sweep}")  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"gatherlab.train: error: job 1 of {sweep} ran with experiment=lightly_pr1531 gather=old "
        "layout=cpu1, this command would run experiment=lightly_pr1531 gather=fixed layout=cpu1; "
        "allowed: the command that started the sweep"
    ]


# --- run directories never collide --------------------------------------------------------------


def _start(*args: str) -> subprocess.Popen:
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "gatherlab.train", *args], cwd=REPO, env=environment,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_runs_started_together_get_their_own_directories(tmp_path):
    pattern = f"hydra.run.dir={tmp_path}/${{now:%H-%M-%S-%f}}"
    processes = [_start("steps=2", pattern) for _ in range(3)]
    assert [p.wait(timeout=300) for p in processes] == [0, 0, 0]
    runs = runfiles.find_runs(tmp_path)
    assert len(runs) == 3  # three directories, each with its own finished run


def test_two_runs_in_one_directory_never_mix(tmp_path):
    processes = [_start("steps=20", f"hydra.run.dir={tmp_path / 'same'}") for _ in range(2)]
    codes = sorted(p.wait(timeout=300) for p in processes)
    errors = [p.stderr.read() for p in processes]
    assert codes == [0, 1]
    assert any(
        "is in use by process" in error or "already holds a finished run" in error
        for error in errors
    )
    assert runfiles.read_summary(tmp_path / "same")["status"] == "ok"
    assert not (tmp_path / "same" / runfiles.LOCK).exists()


# --- exact reruns -------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["cpu1", "cpu2"])
def test_the_same_config_twice_gives_the_same_bytes(tmp_path, layout):
    for attempt in ("first", "second"):
        run_training(tmp_path / attempt, "experiment=bug_demo", "steps=10", f"layout={layout}")
    for name in (runfiles.CURVES, runfiles.FINAL_STATE):
        assert (tmp_path / "first" / name).read_bytes() == (tmp_path / "second" / name).read_bytes()
    summary = runfiles.read_summary(tmp_path / "first")
    assert summary["config"]["layout"]["devices"] == int(layout[-1])
    assert {"torch", "lightning", "hydra-core", "python"} <= set(summary["versions"])
    assert summary["versions"]["torch"].startswith("2.13.0")


# --- fuzzing the config surface -----------------------------------------------------------------

EXACT_GATHERS = {"fixed", "torch_nn", "functional", "lightning"}
INVARIANT_LOSSES = {"ntxent", "ntxent_global", "dcl", "dclw_global", "barlowtwins_global",
                    "vicreg", "tico", "clip"}  # fmt: skip
VALID = {
    "loss": ["ntxent", "ntxent_global", "dcl", "dclw", "barlowtwins", "vicreg", "tico", "clip"],
    "gather": ["fixed", "old", "torch_nn", "functional", "avg", "nograd_swap", "nograd"],
    "layout": ["cpu1", "cpu2", "cpu4"],
    "global_batch_size": ["8", "16"],
    "steps": ["1", "2"],
    "precision": ["64-true", "32-true"],
    "seed": ["0", "7"],
}
INVALID = {
    "loss": ["infonce"],
    "gather": ["nope"],
    "layout": ["cpu3"],
    "global_batch_size": ["6", "0", "-4", "1000", "many"],
    "steps": ["0", "-1"],
    "precision": ["16-mixed"],
    "seed": ["-1"],
}


def _overrides(draw_value, broken: str | None) -> dict[str, str]:
    return {key: draw_value(INVALID[key] if key == broken else VALID[key]) for key in VALID}


@pytest.fixture(scope="module")
def fuzz_root(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def _alarm(signum, frame):
    raise TimeoutError("a fuzzed configuration hung")


def test_random_configurations_run_or_fail_in_one_line(fuzz_root):
    import itertools
    import signal

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    counter = itertools.count()
    seen = {"ran": 0, "refused": 0, "failed": 0, "compared": 0}

    @settings(max_examples=40, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(st.data(), st.sampled_from([None] * 7 + list(VALID)))  # at most one key broken
    def check(data, broken):
        drawn = _overrides(lambda values: data.draw(st.sampled_from(values)), broken)
        overrides = [f"{key}={value}" for key, value in drawn.items()]
        run_dir = fuzz_root / str(next(counter))
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(120)
        try:
            try:
                cfg, choices = compose(*overrides)
                configcheck.check(cfg)
            except ConfigError as error:  # refused before anything starts, in one line
                message = str(error)
                assert "\n" not in message and "allowed" in message, message
                assert any(value in message for value in drawn.values()), (message, drawn)
                seen["refused"] += 1
                return
            try:
                jobs.run(cfg, run_dir, choices, overrides)
            except jobs.RunFailed as error:  # training stopped: one line, recorded as failed
                assert "\n" not in str(error)
                assert runfiles.read_summary(run_dir)["status"] == "failed"
                seen["failed"] += 1
                return
            seen["ran"] += 1
            if cfg.layout.devices == 1 or cfg.precision != "64-true":
                return
            reference = fuzz_root / f"{run_dir.name}-reference"
            reference_cfg, reference_choices = compose(*overrides, "layout=cpu1")
            jobs.run(reference_cfg, reference, reference_choices, overrides)
            shutil.copytree(run_dir, fuzz_root / f"pair-{run_dir.name}" / "run")
            shutil.copytree(reference, fuzz_root / f"pair-{run_dir.name}" / "reference")
            table = report.write_report(fuzz_root / f"pair-{run_dir.name}").set_index("run_dir")
            exact = drawn["gather"] in EXACT_GATHERS and drawn["loss"] in INVARIANT_LOSSES
            assert table.loc["run", "verdict"] == ("matches" if exact else "differs"), drawn
            seen["compared"] += 1
        finally:
            signal.alarm(0)

    check()
    print(seen)
    assert seen["refused"] and seen["ran"], seen  # both sides of the surface were exercised
