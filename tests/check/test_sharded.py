"""Sharded code in the check of a plain step or update (issue 50, first part): a model its factory
shards with FSDP2 and an optimizer that is ``ZeroRedundancyOptimizer`` are trained as they were
built, never wrapped in DDP again, their gradient and weights read whole from the shards
(`gatherlab.runs.record.whole`)."""

from __future__ import annotations

import pytest

from gatherlab.check import check_training

W = (2, 4)


def _whole_rows(table):
    return table[(table["part"] == "all") & (table["removed"] == "none")]


@pytest.mark.parametrize(
    "options",
    [
        {"model": "sharded_steps:build_fsdp2"},
        {"model": "sharded_steps:build_fsdp2", "model_kwargs": {"reshard_after_forward": False},
         "optimizer": "torch.optim:Adam", "optimizer_kwargs": {"lr": 0.01}},
        {"model": "plain_steps:build_model", "optimizer": "sharded_steps:zero_sgd"},
    ],
    ids=["fsdp2", "fsdp2-no-reshard-adam", "zero"],
)  # fmt: skip
def test_a_sharded_step_is_exact_in_float64_its_weights_to_1e_12(options):
    # before: every W failed, DDP's constructor broadcasting FSDP2's DTensors; rank 0's shard
    # read as the gradient fails here too (its length is a shard's)
    table = check_training(
        step="plain_steps:training_step", data="plain_steps:Pairs", world_sizes=W, steps=5,
        **options,
    )  # fmt: skip
    whole = _whole_rows(table)
    assert whole["verdict"].tolist() == ["exact", "exact"]
    assert whole["max_rel_err"].max() <= 1e-12
    assert whole["max_abs_param_diff"].max() <= 1e-12  # after 5 updates


def test_a_sharded_whole_update_is_exact_at_every_layout():
    table = check_training(
        update="updates:cached", model="sharded_steps:build_fsdp2", data="plain_steps:Pairs",
        world_sizes=W, micro_batches=(1, 2), steps=3,
    )  # fmt: skip
    whole = _whole_rows(table)
    assert whole["verdict"].tolist() == ["exact"] * 4
    assert whole["max_abs_param_diff"].max() <= 1e-12
