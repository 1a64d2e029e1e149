"""The lab's tensor parallelism (docs/checking.md §10 "Sharded code", ``strategy=tp``): a layout
with a tensor-parallel degree composes and sweeps, tp 2 alone and dp 2 × tp 2 train gatherlab's
own module like one device in float64, with and without sequence parallelism, and Megatron's
sequence-parallel LayerNorm bug departs only where the norm's gradient is a partial sum; a
tensor-parallel layout that cannot run is refused in one line before any job."""

from __future__ import annotations

import inspect

import pandas as pd
import pytest
from helpers import run_command

from gatherlab.analysis import report
from gatherlab.components import config
from gatherlab.lab import validation
from gatherlab.ranks import world

# one sweep of 12 jobs on 1, 2 and 4 ranks, seconds of training (make test-fast leaves it out)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> tuple[pd.DataFrame, dict]:
    """``experiment=tensor_parallel`` (CLIP's loss with its learnt logit scale on the pre-norm
    block ``model=norm_mlp``): ``tp`` and its trap ``tp_unreduced_norm``, with and without
    sequence parallelism, on one device, tp 2 alone and dp 2 × tp 2, 3 steps."""
    sweep = tmp_path_factory.mktemp("tensor_parallel") / "sweep"
    result = run_command(
        "train", "-m", "experiment=tensor_parallel", "steps=3", "layout=cpu1,cpu2,cpu4",
        "strategy.sequence_parallel=true,false", f"hydra.sweep.dir={sweep}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    table = pd.read_csv(sweep / report.COMPARISON)
    curves = {run: pd.read_csv(sweep / str(run) / "curves.csv") for run in table["run_dir"]}
    return table.set_index(["strategy", "strategy.sequence_parallel", "layout"]), curves


def test_tensor_parallelism_trains_like_one_device_and_the_unreduced_norm_departs(swept):
    table, curves = swept
    for sequence_parallel in (True, False):
        for layout in ("cpu2", "cpu4"):  # tp 2 alone; dp 2 × tp 2
            run = table.loc[("tp", sequence_parallel, layout)]
            assert run["verdict"] == "matches", (sequence_parallel, layout)
            # measured 2.2e-16 for the losses, ≤ 2e-16 for the weights
            assert run["max_abs_loss_diff"] <= 1e-12 and run["max_abs_param_diff"] <= 1e-12
    reference = curves[table.loc[("tp", True, "cpu1"), "run_dir"]]
    for layout in ("cpu2", "cpu4"):
        unreduced = table.loc[("tp_unreduced_norm", True, layout)]
        # the same first loss (the same weights), then each rank steps its own partial sum of the
        # norm's gradient: measured |Δloss| 0.049 (tp 2) and 0.021 (dp 2 × tp 2) within 3 steps
        first = curves[unreduced["run_dir"]]["loss"][0]
        assert first == pytest.approx(reference["loss"][0], abs=1e-15)
        assert unreduced["verdict"] == "differs" and unreduced["max_abs_loss_diff"] > 1e-2
        # without sequence parallelism every rank normalises every row: nothing left unreduced
        assert table.loc[("tp_unreduced_norm", False, layout), "max_abs_loss_diff"] <= 1e-12


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["layout=cpu4", "strategy.tensor_parallel=3"],
         "strategy.tensor_parallel=3 does not divide the layout's 4 ranks (layout.devices × "
         "layout.nodes); allowed: 1, 2, 4"),
        (["strategy.tensor_parallel=0"],
         "strategy.tensor_parallel=0 is not allowed; allowed: a positive integer"),
        (["layout=cpu4", "model=mlp"],
         "strategy=tp splits the model by its tensor_parallel_plan(tensor_parallel, "
         "sequence_parallel), which model (gatherlab.components.models.MLP) does not have; "
         "allowed: model=norm_mlp"),
        (["layout=cpu4", "model.hidden_features=63"],
         "model (gatherlab.components.models.NormMLP): model.hidden_features=63 does not divide "
         "by strategy.tensor_parallel=2; allowed: a multiple of 2"),
        (["layout=cpu4", "launcher=spawn"],
         "strategy=tp with launcher=spawn is not supported; allowed: launcher=pool (CPU "
         "layouts), or strategy=ddp"),
        (["precision=16-mixed"],
         "strategy=tp with precision=16-mixed: Lightning's ModelParallelStrategy refuses it; "
         "allowed: 64-true, 32-true, bf16-mixed, bf16-true"),
        (["strategy.reduce_norm=maybe"],
         "strategy.reduce_norm='maybe' is not allowed; allowed: true or false"),
        (["strategy=fsdp2", "+strategy.tensor_parallel=2"],
         "strategy.tensor_parallel=2 is strategy=tp's; allowed with strategy=fsdp2: "
         "strategy.tensor_parallel=1, or strategy=tp"),
        (["data=arange", "global_batch_size=8", "data.dim=5"],
         "strategy=tp with a data set whose second view is a fixed target (not encoded): the "
         "model's plan splits only the rows it encodes; allowed: a data set whose views both go "
         "through the model (data=gaussian, digits), or strategy=fsdp2"),
    ],
)  # fmt: skip
def test_a_tensor_parallel_layout_that_cannot_run_is_refused_in_one_line(overrides, message):
    with config.composed():
        cfg, _ = config.compose(["experiment=tensor_parallel", "strategy=tp", *overrides])
    with pytest.raises(validation.ConfigError) as refused:
        validation.validate(cfg)
    assert str(refused.value) == message


def test_the_redistribution_warning_is_quieted_on_torchs_own_logger():
    # a private module's logger (ranks.world quiets it where it reads a DTensor whole, the lab
    # under tp): this fails when torch renames it, which would bring the warning back on every
    # rank at every step
    from torch.distributed.tensor import _redistribute

    assert _redistribute.logger.name == world.REDISTRIBUTE_LOGGER
    assert "%d sequential %s" in inspect.getsource(_redistribute)  # the line quieted
