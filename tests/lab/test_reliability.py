"""When things go wrong: bad numbers stop a run at their step, failing or killed ranks fail their
job and the sweep goes on, the report never claims a match without evidence, interrupted sweeps
resume, and reruns are exact (random configurations: test_fuzz.py)."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest
from faulty import PAUSE
from helpers import PR1531_SWEEP, REPO, process_group, pythonpath, run_command, run_training

from gatherlab.analysis import report
from gatherlab.core import runfiles
from gatherlab.lab import jobs

pytestmark = pytest.mark.slow


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
    common = ("experiment=lightly_pr1531", "precision=64-true", "steps=5")
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
    return root, report.write_report(root).table.set_index("run_dir")


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
    assert "2 steps against the reference's 5" in table.loc["truncated", "error"]
    assert "final_state.pt" in table.loc["no_weights", "error"]
    assert "summary.json" in table.loc["corrupt", "error"]
    written = pd.read_csv(root / report.COMPARISON)
    assert len(written) == 7 and {"verdict", "error", "status"} <= set(written.columns)
    assert set(written["verdict"]) == set(report.VERDICTS) - {"differs"}
    assert (root / "comparison.png").stat().st_size > 0
    text = report.comparison_text(table.reset_index())
    # every rank's loss is NaN at step 1; whichever rank reports first names the failure
    assert re.search(r"failed: rank \d: NonFiniteLoss: the loss is nan at step 1", text)


# --- failing and killed ranks in a sweep --------------------------------------------------------


# Per launcher: the jobs of one sweep (how rank 1 breaks × which rank breaks; rank 5 does not
# exist, so that job trains) and the verdicts of the report. With spawn, whose every job starts
# fresh interpreters (about 10 s here), one killed rank: a job after a failed one is the sweep's
# own logic, the same for both launchers, and how a raising spawned rank is reported is checked
# on torch's own exception below.
FAILING_SWEEPS = {
    "pool": (["+loss.how=raise,kill", "+loss.rank=1,5"], ["failed", "no reference"] * 2),
    "spawn": (["+loss.how=kill", "+loss.rank=1"], ["failed"]),
}


@pytest.mark.parametrize("launcher", FAILING_SWEEPS)
def test_failing_ranks_fail_their_jobs_and_the_sweep_goes_on(
    tmp_path, launcher, no_leftover_processes
):
    """Rank 1 raises, or its process is killed, at step 2: the job ends quickly with the rank's
    error, recorded as failed, and the sweep goes on with its next job (on a new pool)."""
    sweep, verdicts = FAILING_SWEEPS[launcher]
    result = run_command(
        "train", "-m", "loss._target_=faulty.RankFault", *sweep, "layout=cpu2",
        f"launcher={launcher}", "steps=2", f"hydra.sweep.dir={tmp_path}",
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    failures = verdicts.count("failed")
    assert f"gatherlab.train: error: {failures} of {len(verdicts)} job(s) failed" in result.stderr
    table = pd.read_csv(tmp_path / report.COMPARISON)
    assert list(table["verdict"]) == verdicts
    for run_dir in table[table["verdict"] == "failed"]["run_dir"]:
        failed = runfiles.read_summary(tmp_path / str(run_dir))
        # rank 1 breaks; rank 0, left in a collective, may report its broken connection first.
        # The job ends on that failure, not on the 60 s collective timeout rank 0 would
        # otherwise run into (gloo: "Timed out waiting ... for recv").
        assert re.match(r"rank [01]: ", failed["error"]), failed["error"]
        assert "timed out" not in failed["error"].lower(), failed["error"]


def test_a_spawned_rank_that_raises_or_dies_is_reported_in_one_line():
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    raised = ProcessRaisedException(
        "\n\n-- Process 1 terminated with the following error:\nTraceback (most recent call last):"
        "\n  ...\nValueError: fault injected on rank 1\n",
        error_index=1,
        error_pid=4321,
    )
    assert jobs.failure_line(raised) == "rank 1: ValueError: fault injected on rank 1"
    died = ProcessExitedException(
        "process 1 terminated with signal SIGKILL", error_index=1, error_pid=4321,
        exit_code=-9, signal_name="SIGKILL",
    )  # fmt: skip
    assert jobs.failure_line(died) == "rank 1: process exited with signal SIGKILL"


# --- interrupted sweeps -------------------------------------------------------------------------


def test_resume_runs_only_the_incomplete_jobs_and_rebuilds_the_report(pr1531_sweep, tmp_path):
    sweep = tmp_path / "sweep"
    shutil.copytree(pr1531_sweep[0], sweep)
    # interrupted: job 3 never wrote its summary, job 4 failed
    (sweep / "2" / runfiles.SUMMARY).unlink()
    failed = runfiles.read_summary(sweep / "3") | {"status": "failed", "error": "killed"}
    runfiles.write_summary(sweep / "3", failed)
    untouched = {job: (sweep / job / runfiles.CURVES).stat().st_mtime_ns for job in ("0", "1")}
    report_before = (sweep / report.COMPARISON).stat().st_mtime_ns
    result = run_command("train", *PR1531_SWEEP, f"+resume={sweep}")
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


# As the sweep of the report that asked for this (seven tracebacks: the command's and its ranks'):
# when job 3 trains, the 2-rank pool of job 2 waits for work and the 4-rank pool trains. Its rank
# 3 pauses at step 2 (when $GATHERLAB_TEST_PAUSE names a file), ranks 0-2 wait for it in a
# collective: the sweep is mid-training whatever the machine's speed.
PAUSED_SWEEP = (
    "-m", "experiment=lightly_pr1531", "loss._target_=faulty.RankFault", "+loss.how=pause",
    "+loss.rank=3", "layout=cpu1,cpu2,cpu4", "precision=64-true", "steps=2",
)  # fmt: skip


def _sigint_as_in_a_terminal() -> None:
    # A process started with SIGINT ignored (from a non-interactive shell, a CI runner) passes
    # that on, and Python then installs no KeyboardInterrupt handler at all: the command in a
    # terminal has the default disposition, so its test does too. (Popen's restore_signals
    # restores SIGPIPE and SIGXFSZ only.)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _paused(command: list[str], paused: Path, terminal: Path) -> subprocess.Popen:
    """``command`` started in a fresh interpreter, in a session (so a process group) of its own,
    what it and its processes print going into ``terminal`` as a terminal shows it (stdout and
    stderr together); returned once its job 3 is training, paused (pytest-timeout bounds a hang)."""
    env = {**os.environ, "PYTHONPATH": pythonpath(), PAUSE: str(paused)}
    with open(terminal, "w") as output:
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_sigint_as_in_a_terminal,
        )  # fmt: skip
    try:
        while not paused.exists():
            assert process.poll() is None, terminal.read_text()[-3000:]
            time.sleep(0.05)
    except BaseException:
        _end_session(process)
        raise
    return process


def _end_session(process: subprocess.Popen) -> None:
    """Whatever a failed test left in ``process``'s session (its group) is killed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def test_ctrl_c_or_kill_mid_sweep_ends_it_quietly_and_the_sweep_resumes(
    tmp_path, no_leftover_processes
):
    """Ctrl-C in a terminal sends SIGINT to the whole foreground process group: the command, its
    pools' fork server and ranks. The command stops with one line and status 130; the command
    that line prints, started as a shell would, pauses in job 3 again and is killed (``kill -9``,
    the command alone): its ranks find it gone and end without a word, its fork server with them.
    The sweep then resumes to a full report (here, in this process on the warm pools: another
    fresh interpreter would add its seconds of imports and pool start and show nothing more).
    Fresh interpreters in sessions of their own are the point: only a real process group shows
    what each process prints and leaves behind, and only a process apart from the tests can be
    killed."""
    sweep, terminal = tmp_path / "sweep", tmp_path / "terminal.txt"
    command = [sys.executable, "-m", "gatherlab.train", *PAUSED_SWEEP, f"hydra.sweep.dir={sweep}"]
    process = _paused(command, tmp_path / "paused", terminal)
    try:
        ours = psutil.Process(process.pid).children(recursive=True)  # fork server, ranks, ...
        assert len(ours) >= 6, ours  # 6 ranks
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C
        returncode = process.wait(timeout=60)
        printed = terminal.read_text()
        _, alive = psutil.wait_procs(ours, timeout=10)
    finally:
        _end_session(process)

    assert returncode == 130, printed[-3000:]
    assert "Traceback" not in printed and "KeyboardInterrupt" not in printed, printed[-3000:]
    assert not alive, f"processes left behind: {[p.pid for p in alive]}"
    again = [sys.executable, "-m", "gatherlab.train", *PAUSED_SWEEP, f"+resume={sweep.resolve()}"]
    said = printed.strip().splitlines()[-1]  # the last line, and the only one that says so
    assert said == f"gatherlab.train: interrupted at job 3/3; resume with: {shlex.join(again)}"
    assert printed.count("interrupted") == 1, printed[-3000:]
    assert runfiles.read_summary(sweep / "0")["status"] == "ok"
    assert runfiles.read_summary(sweep / "1")["status"] == "ok"
    assert not (sweep / "2" / runfiles.SUMMARY).exists()
    assert not (sweep / "2" / runfiles.LOCK).exists()

    pasted = shlex.split(said.split("resume with: ", 1)[1])  # as a shell reads it
    assert pasted[:3] == [sys.executable, "-m", "gatherlab.train"]
    killed = _paused(pasted, tmp_path / "paused-again", tmp_path / "killed.txt")
    try:
        killed.kill()  # kill -9: the command closes nothing, and nothing else is signalled
        killed.wait()
        deadline = time.monotonic() + 30  # a bound for a hang, not a measured time
        while (left := process_group(killed.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        printed = (tmp_path / "killed.txt").read_text()  # the ranks' last words, had they any
    finally:
        _end_session(killed)
    assert not left, f"processes left behind: { {pid: cmd[:100] for pid, cmd in left.items()} }"
    assert "Traceback" not in printed and "EOFError" not in printed, printed[-3000:]
    assert (sweep / "2" / runfiles.LOCK).exists()  # the killed command's, taken over below

    resumed = run_command("train", *pasted[3:])  # no $GATHERLAB_TEST_PAUSE here: rank 3 trains on
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "job 2: complete" in resumed.stdout + resumed.stderr
    assert [runfiles.read_summary(sweep / job)["status"] for job in "012"] == ["ok"] * 3
    table = pd.read_csv(sweep / report.COMPARISON)
    assert list(table["verdict"]) == ["reference", "matches", "matches"]


def test_resume_refuses_another_command(pr1531_sweep):
    sweep, _ = pr1531_sweep
    other = [o.replace("gather=old,fixed", "gather=fixed") for o in PR1531_SWEEP]
    result = run_command("train", *other, f"+resume={sweep}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"gatherlab.train: error: job 1 of {sweep} ran with experiment=lightly_pr1531 gather=old "
        "layout=cpu1 precision=64-true, this command would run experiment=lightly_pr1531 "
        "gather=fixed layout=cpu1 precision=64-true; allowed: the command that started the sweep"
    ]


# --- run directories never collide --------------------------------------------------------------


def test_runs_started_one_after_the_other_get_their_own_directories(tmp_path):
    pattern = f"hydra.run.dir={tmp_path}/${{now:%H-%M-%S-%f}}"
    for _ in range(2):
        assert run_command("train", "steps=2", pattern).returncode == 0
    assert len(runfiles.find_runs(tmp_path)) == 2  # named to the microsecond: one each


def test_a_directory_held_by_a_live_process_is_refused_in_one_line(tmp_path):
    """Two runs started together in one directory: the one that holds it (here this process)
    keeps it, the other stops with one line; the lock is the process id, so it holds between
    processes as within one."""
    held = tmp_path / "held"
    held.mkdir()
    with runfiles.claimed(held):  # this process writes a run there
        result = run_command("train", "steps=2", f"hydra.run.dir={held}")
    assert result.returncode == 1
    assert f"run directory {held} is in use by process {os.getpid()}" in result.stderr
    assert not (held / runfiles.SUMMARY).exists() and not (held / runfiles.LOCK).exists()
    finished = run_command("train", "steps=2", f"hydra.run.dir={held}")
    assert finished.returncode == 0, finished.stderr[-2000:]
    again = run_command("train", "steps=2", f"hydra.run.dir={held}")
    assert again.returncode == 2 and "already holds a finished run" in again.stderr
    assert runfiles.read_summary(held)["status"] == "ok"


def test_a_sweep_into_a_directory_that_holds_a_sweep_is_refused_before_any_job(tmp_path):
    """A user's sweep given another sweep's directory rewrote its multirun.yaml and its
    comparison, every job failing on the finished runs; it is refused in one line, exit 2,
    before any file is written, and names the resume."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text("the earlier sweep's\n")
    result = run_command("train", "-m", "gather=avg", "layout=cpu1,cpu2", "steps=2",
                         f"hydra.sweep.dir={sweep}")  # fmt: skip
    assert result.returncode == 2 and result.stderr.splitlines() == [
        f"gatherlab.train: error: hydra.sweep.dir={sweep} already holds a sweep; it is never "
        f"overwritten; allowed: +resume={sweep} to finish it, or a directory of its own"
    ], result.stderr
    assert [p.name for p in sweep.iterdir()] == ["multirun.yaml"]
    assert (sweep / "multirun.yaml").read_text() == "the earlier sweep's\n"


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
