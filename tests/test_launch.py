"""The launchers: a job in the warm pool trains bit for bit like a fresh ``ddp_spawn`` run, a
failing rank ends its job quickly with its message, and no worker outlives its pool."""

from __future__ import annotations

import time

import hydra
import pytest
import torch
import torch.distributed as dist
from helpers import compose, gatherlab_processes, run_training

from gatherlab import launch, runfiles
from gatherlab import pool as pools
from gatherlab.losses import NTXentLoss
from gatherlab.module import ContrastiveModule, PairDataModule, RunRecorder


def _rank_and_sum() -> tuple[int, float]:
    tensor = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(tensor)
    return dist.get_rank(), float(tensor)


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one refuses")
    dist.barrier()  # rank 0 waits here for a rank that will never come


def _exit_on_rank_one() -> None:
    if dist.get_rank() == 1:
        import os

        os._exit(3)
    dist.barrier()


def test_pool_runs_functions_on_every_rank_of_one_group():
    assert pools.pool(2).run(_rank_and_sum) == [(0, 3.0), (1, 3.0)]
    assert pools.pool(4).run(_rank_and_sum) == [(r, 10.0) for r in range(4)]


@pytest.mark.parametrize(
    ("function", "message"),
    [
        (_fail_on_rank_one, "rank 1: ValueError: rank one refuses"),
        (_exit_on_rank_one, "rank 1: process exited with code 3"),
    ],
)
def test_failing_rank_ends_the_job_quickly_and_the_pool_is_rebuilt(function, message):
    broken = pools.pool(2)
    pids = broken.pids
    start = time.monotonic()
    with pytest.raises(pools.RankError, match=message):
        broken.run(function)
    # Far below the collective timeout that the waiting rank would otherwise sit in.
    assert time.monotonic() - start < pools.COLLECTIVE_TIMEOUT.total_seconds() / 4
    assert not broken.alive
    assert not set(pids) & set(gatherlab_processes()), "the failed pool's workers must be gone"
    assert pools.pool(2).run(_rank_and_sum) == [(0, 3.0), (1, 3.0)]
    assert pools.pool(2) is not broken


def test_closed_pools_leave_no_process():
    pids = pools.pool(2).pids + pools.pool(4).pids
    assert set(pids) <= set(gatherlab_processes())
    pools.close_pools()
    assert not set(pids) & set(gatherlab_processes())


ISOLATION_CASES = {
    "bug_demo_old_cpu2": ["experiment=bug_demo", "steps=15", "gather=old", "layout=cpu2"],
    "bug_demo_fixed_cpu4": ["experiment=bug_demo", "steps=15", "gather=fixed", "layout=cpu4"],
    "pr1531_fixed_cpu2": ["experiment=lightly_pr1531", "gather=fixed", "layout=cpu2"],
}


@pytest.mark.slow
def test_pool_jobs_after_other_jobs_equal_fresh_spawn_runs_bit_for_bit(tmp_path):
    """Each case runs in the pool after the others (in a used group) and alone with ``spawn``."""
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


class _FailingLoss(torch.nn.Module):
    """NT-Xent that raises on rank 1 at its third step (rank 0 then waits in a collective)."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.inner = NTXentLoss()

    def forward(self, out0, out1):
        self.calls += 1
        if dist.get_rank() == 1 and self.calls == 3:
            raise FloatingPointError("loss exploded on purpose")
        return self.inner(out0, out1)


@pytest.mark.slow
def test_rank_error_inside_training_reaches_the_main_process(tmp_path):
    cfg, _ = compose("experiment=bug_demo", "layout=cpu2", "steps=5")
    dataset = hydra.utils.instantiate(cfg.data.dataset)
    model = hydra.utils.instantiate(cfg.model)
    module = ContrastiveModule(model, _FailingLoss(), hydra.utils.instantiate(cfg.optim))
    datamodule = PairDataModule(dataset, cfg.global_batch_size, cfg.steps, seed=0, shuffle=True)
    start = time.monotonic()
    with pytest.raises(
        pools.RankError, match="rank 1: FloatingPointError: loss exploded on purpose"
    ):
        launch.fit(module, datamodule, 2, cfg.precision, cfg.steps, [RunRecorder(tmp_path)])
    assert time.monotonic() - start < pools.COLLECTIVE_TIMEOUT.total_seconds() / 4
    assert not (tmp_path / runfiles.CURVES).exists()
    run_training(tmp_path / "next", "experiment=bug_demo", "layout=cpu2", "steps=3")
    assert len(runfiles.read_curves(tmp_path / "next")["loss"]) == 3
