"""The launchers: a job in the warm pool trains bit for bit like a fresh ``ddp_spawn`` run, a
failing rank ends its job quickly with its message, and no worker outlives its pool."""

from __future__ import annotations

import random
import socket
import time
from pathlib import Path

import psutil
import pytest
import ranks
import torch
from helpers import descendants, run_command, run_training

from gatherlab.core import runfiles, terms
from gatherlab.lab import jobs
from gatherlab.ranks import launch, ports
from gatherlab.ranks import pool as pools


def test_pool_runs_functions_on_every_rank_of_one_group():
    assert pools.pool(2).run(ranks.rank_and_sum) == [(0, 3.0), (1, 3.0)]
    assert pools.pool(4).run(ranks.rank_and_sum) == [(r, 10.0) for r in range(4)]


def test_run_beside_computes_in_this_process_while_the_ranks_run(tmp_path):
    """`WorkerPool.run_beside` (a one-device run of the check beside its W ranks): ``beside``
    runs while the ranks' job runs (it sees the job's first file and writes the file the job waits
    for: one after the other, either would wait for ever), and both results come back."""
    started, done = tmp_path / "started", tmp_path / "done"

    def beside() -> str:
        deadline = time.monotonic() + 30
        while not started.exists():
            assert time.monotonic() < deadline, "the ranks' job never started"
            time.sleep(0.01)
        done.write_text("")
        return "computed here"

    results, computed = pools.pool(2).run_beside(
        beside, ranks.mark_started_then_wait, str(started), str(done)
    )
    assert (results, computed) == ([0, 1], "computed here")
    assert pools.pool(2).run(ranks.rank_and_sum) == [(0, 3.0), (1, 3.0)]


def test_run_beside_closes_the_pool_when_this_process_fails(tmp_path):
    """``beside`` raising (Ctrl-C among its errors) while the ranks are mid-job: the error is
    raised, the pool closed (its answers are never read into a later job's), a new one started on
    next use."""
    pool = pools.pool(3)

    def beside() -> None:
        raise KeyboardInterrupt

    try:
        with pytest.raises(KeyboardInterrupt):
            pool.run_beside(beside, ranks.mark_started_then_wait, str(tmp_path / "s"),
                            str(tmp_path / "never"))  # fmt: skip
        assert not pool.alive
        assert pools.pool(3).run(ranks.rank_and_sum) == [(0, 6.0), (1, 6.0), (2, 6.0)]
    finally:
        pools._pools.pop(3).close()


# The failure tests break pools of 3 ranks of their own, so that the session's pools, which the
# other tests use, stay warm.
@pytest.mark.parametrize(
    ("function", "message"),
    [
        (ranks.fail_on_rank_one, "rank 1: ValueError: rank one refuses"),
        (ranks.exit_on_rank_one, "rank 1: process exited with code 3"),
    ],
)
def test_failing_rank_ends_the_job_quickly_and_the_pool_is_closed(function, message):
    broken = pools.WorkerPool(3)
    workers = [psutil.Process(pid) for pid in broken.pids]
    # The wait itself is bounded far below the collective timeout that rank 0 sits in: a failure
    # seen only through that timeout would end the wait with "no answer from every rank" instead
    # of the failing rank's own message.
    quickly = pools.COLLECTIVE_TIMEOUT.total_seconds() / 4
    with pytest.raises(pools.RankError, match=message):
        broken.run(function, timeout_s=quickly)
    assert not broken.alive
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, "the failed pool's workers must go"


def test_a_failed_pool_is_started_again_on_next_use():
    broken = pools.pool(3)
    with pytest.raises(pools.RankError):
        broken.run(ranks.fail_on_rank_one)
    try:
        assert pools.pool(3).run(ranks.rank_and_sum) == [(0, 6.0), (1, 6.0), (2, 6.0)]
        assert pools.pool(3) is not broken
    finally:
        pools._pools.pop(3).close()


def test_a_closed_pool_leaves_no_process():
    pool = pools.WorkerPool(2)
    workers = [psutil.Process(pid) for pid in pool.pids]
    assert set(pool.pids) <= set(descendants())
    pool.close()
    assert not any(worker.is_running() for worker in workers)
    assert not set(pool.pids) & set(descendants())


# Each spawn run starts a fresh interpreter per rank that imports Lightning (about 10 s here):
# one case, run in the pool after other jobs have used the group.
ISOLATION_CASES = {
    "bug_demo_old_cpu2": ["experiment=bug_demo", "steps=15", "gather=old", "layout=cpu2"],
}


@pytest.mark.slow
def test_pool_jobs_after_other_jobs_equal_fresh_spawn_runs_bit_for_bit(tmp_path):
    """Each case runs in the pool after other jobs (in a used group) and alone with ``spawn``."""
    run_training(tmp_path / "before", "experiment=lightly_pr1531", "layout=cpu2")
    for name, overrides in ISOLATION_CASES.items():
        run_training(tmp_path / f"{name}_pool", *overrides, "launcher=pool")
    for name, overrides in ISOLATION_CASES.items():
        run_training(tmp_path / f"{name}_spawn", *overrides, "launcher=spawn")
        pooled, spawned = tmp_path / f"{name}_pool", tmp_path / f"{name}_spawn"
        assert (pooled / runfiles.CURVES).read_bytes() == (
            spawned / runfiles.CURVES
        ).read_bytes(), name
        pooled_state, spawned_state = (
            runfiles.read_final_state(pooled),
            runfiles.read_final_state(spawned),
        )
        assert pooled_state.keys() == spawned_state.keys()
        for key in pooled_state:
            assert torch.equal(pooled_state[key], spawned_state[key]), (name, key)


@pytest.mark.slow
@pytest.mark.timeout(300)  # two fresh ranks import torch and Lightning: ~15 s idle, more on load
def test_torchrun_ranks_write_the_run_once_and_equal_the_pooled_run(tmp_path, monkeypatch, capfd):
    """``launcher=external`` as the README starts it, through torchrun on gloo, 2 ranks here.
    Fresh interpreters are the point: torchrun starts every rank as a new process that runs the
    whole command (Hydra included) in one shared run directory, which the pools never do. Only
    rank 0 writes the run files: one summary, one row per step; they equal the pooled run of the
    same config bit for bit (the same global batches, the same summation order on gloo). Who
    wrote and logged is recorded in every process (tests/support/who_writes.py): rank 0 each run
    file once, rank 1 none of them, and no gatherlab log line; equal contents alone would not
    tell."""
    import os
    import subprocess
    import sys

    import who_writes
    from helpers import pythonpath

    steps = 10
    config = ("experiment=bug_demo", "layout=cpu2", f"steps={steps}")
    pooled, external = tmp_path / "pool", tmp_path / "torchrun"
    run_training(pooled, *config)
    env = who_writes.recording({**os.environ, "PYTHONPATH": pythonpath()}, tmp_path / "who")
    started = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "gatherlab.train", *config, "launcher=external", f"hydra.run.dir={external}"],
        cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=240,  # a hang fails here, with the ranks' output, not at the test's limit
    )  # fmt: skip
    assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]

    # who wrote: rank 0 each run file once; rank 1 and torchrun itself nothing of gatherlab's
    recorded = who_writes.records(tmp_path / "who")
    run = str(external.resolve())
    assert who_writes.written(recorded) == [
        (0, "write_curves", run), (0, "write_final_state", run), (0, "write_summary", run),
    ]  # fmt: skip
    opened = who_writes.opened_below(recorded, external)
    # Hydra's own files (its log and its config copies) too are rank 0's alone: the other ranks
    # run Hydra with hydra.output_subdir=null and no log file (train.RANK_NOT_ZERO)
    hydra = [".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", "train.log"]
    assert sorted(opened[0]) == sorted([*hydra, runfiles.LOCK, runfiles.CURVES, runfiles.SUMMARY])
    assert set(opened) == {0}, opened
    # who logged: rank 0 its progress and the run's line; rank 1 nothing
    logged = who_writes.logged(recorded)
    assert set(logged) == {0}, logged
    assert logged[0][-1].startswith(f"gatherlab.lab.jobs: {external}: {steps} steps on 2 device")

    # no second copy, no failed summary; train.log is Hydra's log of the command
    assert {p.name for p in external.iterdir()} == {
        runfiles.CURVES, runfiles.FINAL_STATE, runfiles.SUMMARY, "train.log", ".hydra",
    }  # fmt: skip
    assert not (external / runfiles.LOCK).exists()
    summary = runfiles.read_summary(external)
    assert (summary["status"], summary["launcher"], summary["devices"]) == ("ok", "external", 2)
    curves = runfiles.read_curves(external)
    assert curves["step"] == list(range(steps))  # one row per step, written once
    assert (external / runfiles.CURVES).read_bytes() == (pooled / runfiles.CURVES).read_bytes()
    assert summary["final_loss"] == runfiles.read_summary(pooled)["final_loss"]
    state, pooled_state = runfiles.read_final_state(external), runfiles.read_final_state(pooled)
    assert state.keys() == pooled_state.keys()
    for key in state:
        assert torch.equal(state[key], pooled_state[key]), key

    # the same command again, on each rank as torchrun starts it (its variables): every rank
    # refuses the finished run in one line, exit status 2, before Hydra writes or Lightning
    # starts, and the run is left as it was. Each rank reads only its own environment and the run
    # directory to refuse, so each runs in this process: a second torchrun (three fresh
    # interpreters, ~10 s of CPU) would add only torchrun's own report of the status
    files = {path: path.stat().st_mtime_ns for path in external.rglob("*")}
    refusal = (
        f"gatherlab.train: error: run directory {external} already holds a finished run; it is "
        "never overwritten"
    )
    for rank in range(2):
        torchrun = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": 2, "LOCAL_WORLD_SIZE": 2,
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500}  # fmt: skip
        with monkeypatch.context() as patched:
            patched.delenv("SLURM_PROCID", raising=False)
            for name, value in torchrun.items():
                patched.setenv(name, str(value))
            # a job started past the refusal fails here at once, not at a collective's timeout
            patched.setattr(jobs, "run", _no_job)
            capfd.readouterr()
            again = run_command("train", *config, "launcher=external", f"hydra.run.dir={external}")
            written = capfd.readouterr()  # what reached the terminal besides the command's own
        assert (again.returncode, again.stdout) == (2, ""), (rank, again)
        assert again.stderr.splitlines() == [refusal], (rank, again.stderr)
        assert "Traceback" not in written.out + written.err, (rank, written)
    assert {path: path.stat().st_mtime_ns for path in external.rglob("*")} == files
    assert runfiles.read_summary(external) == summary


def _no_job(*_, **__):
    raise AssertionError("a job started after the refusal")


@pytest.mark.parametrize(
    ("environment", "rank_zero"),
    [({"RANK": "0"}, True), ({"RANK": "1"}, False), ({"SLURM_PROCID": "1"}, False)],
    ids=["torchrun_rank_0", "torchrun_rank_1", "srun_task_1"],
)
def test_only_rank_zero_writes_the_summary_and_logs_the_run_to_wandb(
    environment, rank_zero, tmp_path, monkeypatch
):
    """The rank-0 decision of ``launcher=external`` (``launch.is_rank_zero``: torchrun's RANK,
    srun's SLURM_PROCID), taken in this process on a 1-device run with ``logger=wandb``: as rank 0
    the job writes the summary and logs the run to wandb once, as any other rank neither. Here and
    not in the torchrun test above, whose every rank would import wandb (~3 s); wandb itself is not
    started: ``tracking.log_run`` is recorded instead (tests/lab/test_tracking.py logs real
    runs)."""
    from helpers import compose

    from gatherlab.lab import jobs, tracking

    logged = []
    monkeypatch.setattr(tracking, "log_run", lambda run_dir, *_, **__: logged.append(run_dir))
    for name in ("RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    overrides = ("experiment=bug_demo", "layout=cpu1", "steps=2", "logger=wandb", "log_every=0")
    cfg, choices = compose(*overrides)
    summary = jobs.run(cfg, tmp_path / "run", choices, overrides)
    if rank_zero:
        assert (summary["status"], logged) == ("ok", [tmp_path / "run"])
    else:
        assert (summary, logged) == ({}, [])
    assert (tmp_path / "run" / runfiles.SUMMARY).exists() == rank_zero


def test_the_spawned_ranks_rendezvous_port_is_one_the_kernel_never_lends(monkeypatch):
    """Lightning's own choice for ``ddp_spawn``, a port ``bind(0)`` lent and took back, was taken
    by another process's gloo connection before rank 0 listened on it (EADDRINUSE in CI): the
    spawn launcher's port lies below the kernel's ephemeral range, is drawn afresh whatever the
    job's seed, and a port held is passed by."""
    low, _ = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    with socket.socket() as held:
        held.bind(("", 0))
        taken = held.getsockname()[1]
        draws = iter([taken, 24680])
        with monkeypatch.context() as patched:
            patched.setattr(ports.random.SystemRandom, "randint", lambda *_: next(draws))
            assert ports.unclaimed_port() == 24680

    def spawn_port(seed: int) -> int:
        """The port of the trainer ``launcher=spawn`` builds, after a job seeded ``seed``."""
        random.seed(seed)
        built = []
        monkeypatch.setattr(launch, "_trainer", lambda _, strategy, *__: built.append(strategy))
        monkeypatch.setattr(launch, "_fit_interruptibly", lambda *_: None)
        launch.fit(None, None, 2, "64-true", 1, [], launcher=terms.Launcher.SPAWN)
        return built[0].cluster_environment.main_port

    chosen = [spawn_port(seed=0) for _ in range(8)]
    assert all(ports.LOWEST <= port < low for port in chosen), chosen
    assert len(set(chosen)) > 1, chosen
