"""The lab's sweep over the strategy (docs/checking.md §10 "Sharded code", ``conf/strategy/``): ZeRO
and FSDP2 train gatherlab's own module like one device in float64, and each FSDP2 trap departs by
what its mathematics says; a strategy that cannot run is refused in one line before any job."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from helpers import run_command

from gatherlab.analysis import report
from gatherlab.components import config
from gatherlab.lab import validation

# a sweep of every strategy on 1 and 2 ranks, seconds of training (make test-fast leaves it out)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> tuple[pd.DataFrame, dict]:
    """CLIP's loss with and without its learnt logit scale (the one parameter outside the
    model), every strategy, one device and two ranks, 3 steps."""
    sweep = tmp_path_factory.mktemp("strategy") / "sweep"
    result = run_command(
        "train", "-m", "experiment=sharded", "steps=3", "layout=cpu1,cpu2",
        "loss.learn_logit_scale=true,false", f"hydra.sweep.dir={sweep}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    table = pd.read_csv(sweep / report.COMPARISON)
    table["learnt"] = table["run_dir"].map(
        lambda run: json.loads((sweep / str(run) / "summary.json").read_text())["config"]["loss"][
            "learn_logit_scale"
        ]
    )
    curves = {run: pd.read_csv(sweep / str(run) / "curves.csv") for run in table["run_dir"]}
    return table.set_index(["learnt", "strategy", "layout"]), curves


@pytest.mark.parametrize("learnt", [True, False])
@pytest.mark.parametrize("strategy", ["ddp", "zero", "fsdp2"])
def test_zero_and_fsdp2_train_like_one_device_to_1e_12(swept, strategy, learnt):
    table, _ = swept
    run = table.loc[(learnt, strategy, "cpu2")]
    assert run["verdict"] == "matches"
    assert run["max_abs_loss_diff"] <= 1e-12 and run["max_abs_param_diff"] <= 1e-12


def test_fsdp2_leaving_the_loss_parameter_unreduced_departs_only_where_there_is_one(swept):
    table, curves = swept
    unreduced = table.loc[(True, "fsdp2_unreduced", "cpu2")]
    # the same first step (the same weights), then each rank's own logit scale moves the model
    first = curves[unreduced["run_dir"]]["loss"][0]
    assert first == pytest.approx(curves[table.loc[(True, "ddp", "cpu1"), "run_dir"]]["loss"][0],
                                  abs=1e-15)  # fmt: skip
    assert unreduced["verdict"] == "differs" and unreduced["max_abs_loss_diff"] > 1e-4
    # without a parameter outside the model there is nothing left unreduced
    assert table.loc[(False, "fsdp2_unreduced", "cpu2"), "verdict"] == "matches"


def test_fsdp2s_divide_factor_of_1_sums_the_gradient_w_times(swept):
    table, curves = swept
    summed = curves[table.loc[(False, "fsdp2_summed", "cpu2"), "run_dir"]]
    reference = curves[table.loc[(False, "ddp", "cpu1"), "run_dir"]]
    # every gradient summed over the W = 2 ranks instead of averaged: the norm twice one device's
    assert summed["grad_norm"][0] == pytest.approx(2 * reference["grad_norm"][0], rel=1e-12)
    assert table.loc[(False, "fsdp2_summed", "cpu2"), "verdict"] == "differs"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["strategy=fsdp2", "layout=cpu2", "launcher=spawn"],
         "strategy=fsdp2 with launcher=spawn is not supported; allowed: launcher=pool (CPU "
         "layouts), or strategy=ddp"),
        (["strategy=zero", "layout=cpu2", "layout.accumulation=cached", "layout.micro_batches=2"],
         "strategy=zero with layout.accumulation=cached: the accumulating step averages whole "
         "gradients by itself; allowed: layout.accumulation=none, or strategy=ddp"),
        (["strategy=fsdp2", "precision=16-mixed"],
         "strategy=fsdp2 with precision=16-mixed: Lightning's ModelParallelStrategy refuses it; "
         "allowed: 64-true, 32-true, bf16-mixed, bf16-true"),
        (["strategy=fsdp2", "strategy.divide_factor=-1"],
         "strategy.divide_factor=-1 is not allowed; allowed: null (FSDP2's mean) or a number > 0"),
        (["strategy=fsdp2", "strategy.reduce_outside=maybe"],
         "strategy.reduce_outside='maybe' is not allowed; allowed: true or false"),
        (["strategy.name=cp"],
         "strategy.name='cp' is unknown; allowed: ddp, fsdp2, zero, tp, pp, ep"),
    ],
)  # fmt: skip
def test_a_strategy_that_cannot_run_is_refused_in_one_line(overrides, message):
    with config.composed():
        cfg, _ = config.compose(["experiment=bug_demo", *overrides])
    with pytest.raises(validation.ConfigError) as refused:
        validation.validate(cfg)
    assert str(refused.value) == message
