from __future__ import annotations

import dataclasses
import gc
import json
from pathlib import Path

import psutil
import pytest
from filelock import FileLock
from helpers import PR1531_SWEEP, Finished, descendants, run_command


@pytest.fixture(scope="session", autouse=True)
def worker_pools():
    """The test session shares one worker pool per world size (``gatherlab.ranks.pool.pool``), so a
    distributed test costs its computation, not process start-up. At the end no worker survives.

    Lightning is imported before the first pool starts, so that the pools' fork server preloads it
    (``forkstart.PRELOAD_IF_IMPORTED``): most test processes train with it on the pools, and without
    this, whether a pool's every rank imports it again (seconds each) would depend on which test
    happened to start the pools first."""
    import lightning.pytorch  # noqa: F401

    from gatherlab.ranks import pool as pools

    yield
    workers = [psutil.Process(pid) for pool in pools._pools.values() for pid in pool.pids]
    pools.close_pools()
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, f"pool workers outlived the session: {[p.pid for p in alive]}"


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Each test process computes with one torch thread, as each rank of the pools does. The two
    test processes and their pools' ranks share the machine's cores; a test process computing on
    every core (torch's default) only makes their threads wait on each other (measured on the
    2-core machine: ``make test-fast`` 45.8–47.2 s with the default, 37.2–39.1 s with one thread,
    81–86 s of CPU against 66–69 s; docs/testing.md, "Its time"). A test about a user's process
    on every core sets its threads itself (test_config.py)."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture
def no_leftover_processes():
    """Fails a test that leaves a process of its own running (a descendant of this test process)
    other than the session's pool workers. Processes of other programs on the machine, another
    gatherlab sweep included, are not this test's and are not counted."""
    from gatherlab.ranks import pool as pools

    before = set(descendants())
    yield
    pool_pids = {pid for pool in pools._pools.values() for pid in pool.pids}
    left = {pid: cmd for pid, cmd in descendants().items() if pid not in before | pool_pids}
    assert not left, f"processes left behind: {left}"


def _once_per_session(tmp_path_factory, worker_id: str, name: str, make) -> tuple[Path, object]:
    """The directory ``name`` and ``make(directory)``'s JSON-able result, made once for the whole
    test session: with two test processes (``pytest -n 2``) the first to need it makes it in their
    common temporary directory and the other reads it (a file lock there)."""
    base = tmp_path_factory.getbasetemp()
    shared = base if worker_id == "master" else base.parent  # this session's, for every process
    made = shared / name / "made.json"
    with FileLock(shared / f"{name}.lock"):
        if not made.exists():
            (shared / name).mkdir(exist_ok=True)
            result = make(shared / name)
            made.write_text(json.dumps(result))
    return shared / name, json.loads(made.read_text())


@pytest.fixture(scope="session")
def pr1531_sweep(tmp_path_factory, worker_id):
    """One finished sweep that every test reading a sweep shares (lightly PR #1531's case, `old`
    and `fixed` on 1 and 2 ranks, float64), run in-process on the warm pools: its directory and
    what the command printed. Tests copy it before changing it."""

    def make(directory):
        result = run_command("train", *PR1531_SWEEP, f"hydra.sweep.dir={directory / 'sweep'}")
        assert result.returncode == 0, result.stderr[-3000:]
        return dataclasses.asdict(result)

    directory, printed = _once_per_session(tmp_path_factory, worker_id, "pr1531", make)
    return directory / "sweep", Finished(**printed)


@pytest.fixture(scope="session")
def trainer_recordings(tmp_path_factory, worker_id):
    """The trainer jobs' recordings that test_record_hf.py and test_record_st.py read
    (`trainer_jobs.record`: job → name → its directory and the losses rank 0 printed), made once
    for the session in one process and one torchrun launch."""
    import trainer_jobs

    _, made = _once_per_session(tmp_path_factory, worker_id, "trainers", trainer_jobs.record)
    return {job: {name: (Path(out), losses) for name, (out, losses) in runs.items()}
            for job, runs in made.items()}  # fmt: skip


# The files that take longest (seconds of test time each, setup included: issue 69's run with
# ``--durations=0`` on the 2-core machine while other engineers' work shared it, load average 1.3
# at its start and 4.7 at its end; see docs/testing.md, "Its time"), longest first: every file of a
# second or more, whether its tests are marked slow or not. ``make test`` hands whole files to two
# test processes in the order they come (``--dist loadfile``), each process taking the next file as
# it runs out; starting the longest first and ending with the shortest lets both finish together
# (30 s sooner than file order, where a 50 s file could start last). A file not named here comes
# after them (its slow tests first). Only the order depends on it, never a result. Each file is
# named by its path below tests/ (a name not found fails the collection: a file moved or renamed
# here too).
TESTS = Path(__file__).resolve().parent
LONGEST_FILES = (
    "lab/test_reliability.py",  # 93 s
    "journeys/test_refusals.py",  # 75 s
    "check/test_external_check.py",  # 58 s
    "journeys/test_install.py",  # 48 s
    "ranks/test_interrupt.py",  # 47 s
    "journeys/test_jobs.py",  # 43 s
    "check/test_tensor_parallel.py",  # 35 s
    "check/test_precision.py",  # 30 s
    "lab/test_expert_parallel_sweep.py",  # 30 s (alone, its pools started: 5 s warm; issue 70)
    "lab/test_pipeline_parallel_sweep.py",  # 28 s (alone, its pools started: 5 s warm; issue 70)
    "check/test_pipeline.py",  # 26 s (alone at load 6.5, 18 s CPU, its pools started; issue 70)
    "check/test_hf_tensor_parallel.py",  # 25 s (alone, its pools started; issue 70)
    "recording/test_hf_tp_recording.py",  # 20 s (alone, its pool started; issue 70)
    "ranks/test_launch.py",  # 25 s
    "journeys/test_record_st.py",  # 21 s
    "check/test_sharded.py",  # 21 s
    "lab/test_tensor_parallel_sweep.py",  # 21 s
    "journeys/test_record_hf.py",  # 21 s
    "check/test_training_check.py",  # 21 s
    "components/test_simclr.py",  # 19 s
    "losses/test_loss_matrix.py",  # 19 s
    "lab/test_config.py",  # 19 s
    "journeys/test_fuzz.py",  # 18 s
    "check/test_check.py",  # 17 s
    "journeys/test_compare_cli.py",  # 17 s
    "journeys/test_docs.py",  # 16 s
    "check/test_experts.py",  # 15 s (alone at load 7, its pools started; 28-40 s cold; issue 70)
    "check/test_step_check.py",  # 15 s
    "lab/test_low_precision_sweep.py",  # 15 s
    "check/test_diagnosis.py",  # 15 s
    "lab/test_strategy_sweep.py",  # 14 s
    "journeys/test_extend.py",  # 13 s
    "check/test_near_misses.py",  # 13 s
    "check/test_recordings.py",  # 9 s
    "lab/test_audit.py",  # 9 s
    "components/test_accumulation.py",  # 9 s
    "ranks/test_watched.py",  # 8 s
    "check/test_where.py",  # 8 s
    "journeys/test_notebook.py",  # 7 s
    "journeys/test_cli.py",  # 7 s
    "lab/test_sweep_module.py",  # 6 s
    "gather/test_gather.py",  # 6 s
    "gather/test_training.py",  # 6 s
    "check/test_update.py",  # 6 s
    "ranks/test_simworld.py",  # 6 s
    "lab/test_tracking.py",  # 6 s
    "recording/test_recorder.py",  # 4 s
    "experiments/test_census_logic.py",  # 4 s
    "recording/test_placed.py",  # 4 s
    "components/test_optimizers.py",  # 4 s
    "journeys/test_architecture.py",  # 2 s
    "check/test_loss_inputs.py",  # 2 s
    "ranks/test_processes.py",  # 2 s
    "experiments/test_census_training_path.py",  # 1 s
    "journeys/test_record_lightning.py",  # 1 s
    "check/test_function_losses.py",  # 1 s
    "check/test_sizing.py",  # 1 s
)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What a test process has loaded once it has collected the tests (torch, Lightning, pandas,
    matplotlib, Hydra and the test modules: ~500,000 objects that live as long as the process) is
    frozen out of the garbage collector (``gc.freeze``), so that its full collections during the
    tests walk only what the tests made (measured: ~1 s less per test process), as the command
    lines do at their end (``gatherlab.core.cli.exiting``). Nothing a test makes is frozen."""
    gc.freeze()


def pytest_unconfigure(config: pytest.Config) -> None:
    """At the end of a test process (the session's pools are closed, its fixtures torn down):
    what is left is frozen too, so that the interpreter's exit does not walk it all once more
    (~1.5 s per test process, which the session's last second waits for)."""
    gc.freeze()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files in ``LONGEST_FILES``' order, then the other files' slow tests (in file order),
    then the rest; within a file its slow tests first."""
    missing = [name for name in LONGEST_FILES if not (TESTS / name).is_file()]
    assert not missing, f"conftest.LONGEST_FILES names no test file: {missing}"

    def order(item: pytest.Item) -> tuple[int, bool]:
        name = item.path.relative_to(TESTS).as_posix()
        rank = LONGEST_FILES.index(name) if name in LONGEST_FILES else len(LONGEST_FILES)
        return rank, item.get_closest_marker("slow") is None

    items.sort(key=order)
