"""Sharded code in the check of a plain step or update (issue 50): a model its factory
shards with FSDP2 and an optimizer that is ``ZeroRedundancyOptimizer`` are trained as they were
built, never wrapped in DDP again, their gradient and weights read whole from the shards
(`gatherlab.ranks.world.whole`)."""

from __future__ import annotations

import pytest

from gatherlab.check import CheckError, check_training, explain_training

W = (2, 4)


def _whole_rows(table):
    return table[(table["part"] == "all") & (table["removed"] == "none")]


@pytest.mark.slow
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
    ).table  # fmt: skip
    whole = _whole_rows(table)
    assert whole["verdict"].tolist() == ["exact", "exact"]
    assert whole["max_rel_err"].max() <= 1e-12
    assert whole["max_abs_param_diff"].max() <= 1e-12  # after 5 updates


@pytest.mark.slow
def test_a_sharded_whole_update_is_exact_at_every_layout():
    table = check_training(
        update="updates:cached", model="sharded_steps:build_fsdp2", data="plain_steps:Pairs",
        world_sizes=W, micro_batches=(1, 2), steps=3,
    ).table  # fmt: skip
    whole = _whole_rows(table)
    assert whole["verdict"].tolist() == ["exact"] * 4
    assert whole["max_abs_param_diff"].max() <= 1e-12


# --- a parameter whose gradient no one reduces --------------------------------------------------


@pytest.fixture(scope="module")
def unreduced() -> dict:
    """The local NT-Xent with a learnt temperature outside FSDP2's sharded modules, outside DDP's
    module (with SGD, and with ZeRO's optimizer), and outside DDP's module with a gather that
    keeps the own slice, on 2 and 4 ranks."""
    sgd = "torch.optim:SGD"
    cases = {
        "fsdp2": ("temperature_step", "build_fsdp2_temperature_outside", sgd),
        "ddp": ("temperature_step", "build_ddp_temperature_outside", sgd),
        # ZeRO: the temperature's owner steps it with its own gradient and broadcasts it, so the
        # ranks' weights agree with each other, not with one device
        "zero": ("temperature_step", "build_ddp_temperature_outside", "sharded_steps:zero_sgd"),
        "own_slice": ("own_slice_temperature_step", "build_ddp_temperature_outside", sgd),
    }
    return {
        name: check_training(step=f"sharded_steps:{step}", model=f"sharded_steps:{model}",
                             optimizer=optimizer, optimizer_kwargs={"lr": 0.01},
                             data="plain_steps:Pairs", world_sizes=W, steps=3)
        for name, (step, model, optimizer) in cases.items()
    }  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fsdp2", "ddp", "zero"])
def test_a_parameter_no_one_reduces_is_the_cause_with_the_model_part_exact(unreduced, case):
    result = unreduced[case]
    table = result.table
    rows = table[table["removed"] == "none"].set_index(["world_size", "part"])
    for world_size in W:
        assert rows.loc[(world_size, "all"), ["verdict", "cause", "culprits"]].tolist() == [
            "biased",
            "unreduced",
            "unreduced",
        ]
        assert rows.loc[(world_size, "log_temperature"), "cause"] == "unreduced"
        assert rows.loc[(world_size, "net"), "gradient"] == "exact"
        found = result.unreduced[world_size, 1]
        # reproduced: with the temperature's gradient all-reduced the run is exact
        assert (found.parts, found.reduced) == (("log_temperature",), "exact")
    text = " ".join(explain_training(result).split())
    assert "the gradient of log_temperature differs between the run's ranks" in text
    assert "All-reduced after each backward (the mean over the ranks), the run is exact" in text
    # each rank's own forward is right: no operation of it is named as where the run departs
    assert "where it departs" not in text


@pytest.mark.slow
def test_ranks_that_differ_are_no_cause_where_reducing_them_is_not_the_fix(unreduced):
    # the own-slice gather breaks the model's gradient too: reducing the parts whose ranks differ
    # leaves it biased, so neither the cause nor the culprit is "unreduced" (a cause given
    # whenever ranks differ fails here)
    result = unreduced["own_slice"]
    table = result.table
    whole = table[(table["removed"] == "none") & (table["part"] == "all")]
    assert set(whole["verdict"]) == {"biased"}
    assert "unreduced" not in set(whole["cause"])
    assert set(whole["culprits"]) == {"loss"}
    for world_size in W:
        assert result.unreduced[world_size, 1].reduced == "biased"


@pytest.mark.slow
def test_ddps_reducer_stalled_by_a_parameter_its_forward_does_not_use_is_named():
    # GradCache with the learnt temperature in the loss over the cached embeddings: the check's DDP
    # holds the temperature, which its forward never uses, so its reducer waits for it and never
    # averages the model's gradient (each rank steps its own: net differs between the ranks)
    result = check_training(
        update="updates:cached_learnt_temperature", model="updates:build_with_temperature",
        data="plain_steps:Pairs", world_sizes=W, micro_batches=(1, 2), steps=3,
    )  # fmt: skip
    rows = result.table[result.table["removed"] == "none"].set_index(
        ["world_size", "micro_batches", "part"]
    )
    for world_size in W:
        assert rows.loc[(world_size, 1, "all"), ["verdict", "cause", "culprits"]].tolist() == [
            "biased", "unreduced", "unreduced",
        ]  # fmt: skip
        assert rows.loc[(world_size, 1, "net"), "cause"] == "unreduced"
        # its gradient is the global loss's on every rank: nothing to reduce there
        assert rows.loc[(world_size, 1, "log_temperature"), "gradient"] == "exact"
        found = result.unreduced[world_size, 1]
        assert found.parts == ("net",) and found.stalled == ("log_temperature",)
        # reducing net by hand is not the fix; DDP finding unused parameters is, and is exact
        assert found.reduced not in ("exact", None) and found.unstalled == "exact"
        # two micro-batches: DDP itself refuses the second forward (its own message)
        assert "find_unused_parameters=True" in rows.loc[(world_size, 2, "all"), "error"]
    text = " ".join(explain_training(result).split())
    assert ("log_temperature gets no gradient from DDP's forward" in text
            and "With DDP's find_unused_parameters=True and log_temperature's gradient "
            "all-reduced, the run is exact" in text)  # fmt: skip


@pytest.mark.slow
def test_fsdp2s_divide_factor_of_1_on_every_module_is_w_on_every_part():
    table = check_training(
        step="plain_steps:training_step", model="sharded_steps:build_fsdp2_divided",
        data="plain_steps:Pairs", world_sizes=W, steps=1,
    ).table  # fmt: skip
    rows = table[table["removed"] == "none"]
    for world_size in W:
        at = rows[rows["world_size"] == world_size]
        assert set(at["gradient"]) == {"W"}, at  # the whole and both parts
        assert at["norm_ratio"].tolist() == pytest.approx([world_size] * len(at), rel=1e-12)


def test_a_sharded_parameter_used_outside_its_forward_is_one_line_naming_it():
    # torch's own error names neither: "aten.div.Tensor got mixed torch.Tensor and DTensor"
    table = check_training(
        step="sharded_steps:raw_temperature_step",
        model="sharded_steps:build_fsdp2_temperature_inside",
        model_kwargs={"reshard_root": True}, data="plain_steps:Pairs", world_sizes=(2,), steps=1,
    ).table  # fmt: skip
    (error,) = table["error"]
    assert error.startswith(
        "rank 0: ShardedParameterOutsideForward: parameter log_temperature is sharded by FSDP2 (a "
        "DTensor) and used outside its module's forward at sharded_steps.py:"
    ), error
    assert "(div with a plain tensor)" in error and "\n" not in error


# --- a LightningModule that shards itself (Lightning's ModelParallelStrategy, --strategy fsdp2) --


@pytest.mark.slow
def test_a_lightningmodule_sharding_itself_is_exact_and_its_own_temperature_unreduced():
    common = {"data": "ssl_modules:GaussianPairs", "world_sizes": W, "strategy": "fsdp2"}
    exact = _whole_rows(check_training("sharded_modules:ShardedSimCLR", steps=3, **common).table)
    assert exact["verdict"].tolist() == ["exact", "exact"]
    assert exact["max_abs_param_diff"].max() <= 1e-12
    # the temperature the module holds is in no sharded module: each rank steps its own
    result = check_training("sharded_modules:ShardedSimCLRLearntTemperature", steps=2, **common)
    table = result.table
    rows = table[table["removed"] == "none"].set_index(["world_size", "part"])
    for world_size in W:
        assert rows.loc[(world_size, "all"), ["verdict", "cause"]].tolist() == [
            "biased", "unreduced",
        ]  # fmt: skip
        assert rows.loc[(world_size, "backbone"), "gradient"] == "exact"
        assert rows.loc[(world_size, "projection_head"), "gradient"] == "exact"
        found = result.unreduced[world_size, 1]
        assert (found.parts, found.reduced) == (("log_temperature",), "exact")


def test_a_strategy_for_a_plain_step_is_refused_in_one_line():
    with pytest.raises(CheckError) as refused:
        check_training(step="plain_steps:training_step", model="plain_steps:build_model",
                       data="plain_steps:Pairs", strategy="fsdp2")  # fmt: skip
    assert str(refused.value) == (
        "--strategy fsdp2: allowed: ddp, fsdp2 with --module (a --step's or --update's model "
        "factory distributes the model itself)"
    )
