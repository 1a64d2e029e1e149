"""The lab's pipeline parallelism (docs/checking.md §10 "Pipeline parallelism in the lab",
``strategy=pp``): the experiment composes and sweeps; pp 2 alone and dp 2 × pp 2 train the tied
language model like one device in float64; the micro-batch scale trap makes the first gradient
exactly M times one device's and the tied-weight trap departs from the first update on, each
with the first loss unchanged; a pipeline layout that cannot run is refused in one line before
any job; the model's stages chained are the model."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from helpers import run_command

from gatherlab.analysis import report
from gatherlab.components import config
from gatherlab.components.models import TinyLM
from gatherlab.lab import validation

MICRO_BATCHES = 4  # conf/strategy/pp.yaml's M

# one sweep of 9 jobs on 1, 2 and 4 ranks, seconds of training (make test-fast leaves it out)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> tuple[pd.DataFrame, dict]:
    """``experiment=pipeline_parallel``: pp and its two traps on one device, pp 2 and dp 2 × pp 2,
    3 steps: one command, on the session's worker pools of 2 and 4 ranks."""
    sweep = tmp_path_factory.mktemp("pipeline_parallel") / "sweep"
    result = run_command(
        "train", "-m", "experiment=pipeline_parallel", "steps=3", f"hydra.sweep.dir={sweep}"
    )
    assert result.returncode == 0, result.stderr
    table = pd.read_csv(sweep / report.COMPARISON)
    curves = {run: pd.read_csv(sweep / str(run) / "curves.csv") for run in table["run_dir"]}
    return table.set_index(["strategy", "layout"]), curves


def test_a_pipeline_trains_like_one_device_and_each_trap_departs(swept):
    table, curves = swept
    reference = curves[table.loc[("pp", "cpu1"), "run_dir"]]
    for layout in ("cpu2", "cpu4"):  # pp 2 alone; dp 2 × pp 2
        run = table.loc[("pp", layout)]
        assert run["verdict"] == "matches", layout
        assert run["max_abs_loss_diff"] <= 1e-12 and run["max_abs_param_diff"] <= 1e-12
        # the recorded gradient norm is the whole model's, as one device's
        assert curves[run["run_dir"]]["grad_norm"].to_numpy() == pytest.approx(
            reference["grad_norm"].to_numpy(), rel=1e-12
        )
        for trap in ("pp_unscaled", "pp_untied"):
            departed = table.loc[(trap, layout)]
            trained = curves[departed["run_dir"]]
            # the same weights at the first step: the same loss
            assert trained["loss"][0] == pytest.approx(reference["loss"][0], abs=1e-14), trap
            assert departed["verdict"] == "differs", (trap, layout)
            assert departed["max_abs_param_diff"] > 1e-3 and trained["loss"][1] != pytest.approx(
                reference["loss"][1], abs=1e-6
            )
        # summed, not averaged, over the M micro-batches: every gradient M times one device's
        unscaled = curves[table.loc[("pp_unscaled", layout), "run_dir"]]
        assert unscaled["grad_norm"][0] == pytest.approx(
            MICRO_BATCHES * reference["grad_norm"][0], rel=1e-12
        )
        # the embedding steps with the first stage's part of its gradient alone: another norm
        untied = curves[table.loc[("pp_untied", layout), "run_dir"]]
        assert abs(untied["grad_norm"][0] / reference["grad_norm"][0] - 1) > 1e-3


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["layout=cpu4", "strategy.pipeline_parallel=3"],
         "strategy.pipeline_parallel=3 does not divide the layout's 4 ranks (layout.devices × "
         "layout.nodes); allowed: 1, 2, 4"),
        (["layout=cpu2", "strategy.schedule=zero_bubble"],
         "strategy.schedule='zero_bubble' is not supported; allowed: gpipe, 1f1b, "
         "interleaved_1f1b"),
        (["layout=cpu4", "strategy.micro_batches=3"],
         "strategy.micro_batches=3 does not divide the 16 rows of each pipeline "
         "(global_batch_size / the data-parallel groups); allowed: 1, 2, 4, 8, 16"),
        (["layout=cpu4", "strategy.micro_batches=1"],
         "strategy.micro_batches=1 with strategy.schedule=1f1b: 1F1B takes at least one "
         "micro-batch per stage (2); allowed: at least 2"),
        (["layout=cpu2", "strategy.schedule=interleaved_1f1b", "model.depth=3"],
         "model (gatherlab.components.models.TinyLM): 4 pipeline stages of a model of "
         "model.depth=3 blocks leave a stage without a block; allowed: at most 3 stages "
         "(model.depth ≥ strategy.pipeline_parallel × the schedule's stages per rank)"),
        (["layout=cpu2", "model=mlp", "data=gaussian", "loss=ntxent", "gather=fixed"],
         "strategy=pp with model (gatherlab.components.models.MLP): strategy=pp trains a "
         "language model cut into pipeline stages, which this model is not; allowed: "
         "model=tiny_lm"),
        (["layout=cpu2", "strategy=ddp"],
         "strategy=ddp with model (gatherlab.components.models.TinyLM): a language model cut "
         "into pipeline stages is trained by strategy=pp alone; allowed: strategy=pp, or a model "
         "of a view (model=mlp, norm_mlp, ...)"),
        (["layout=cpu1_floor", "precision=bf16-mixed"],
         "layout.row_blocks=2 with strategy=pp: its module runs one device's batch whole, with "
         "no floor run in row blocks; allowed: layout.row_blocks=1 (a low precision judged by "
         "the check, python -m gatherlab.check --pipeline-parallel)"),
        (["layout=cpu2", "strategy.sum_tied=sometimes"],
         "strategy.sum_tied='sometimes' is not allowed; allowed: true or false"),
    ],
)  # fmt: skip
def test_a_pipeline_layout_that_cannot_run_is_refused_in_one_line(overrides, message):
    with config.composed():
        cfg, _ = config.compose(["experiment=pipeline_parallel", "strategy=pp", *overrides])
    with pytest.raises(validation.ConfigError) as refused:
        validation.validate(cfg)
    assert str(refused.value) == message


def test_the_models_stages_chained_are_the_model_and_its_copy_of_the_tied_weight_is_its_head():
    torch.manual_seed(0)
    model = TinyLM(vocab_size=11, features=6, hidden_features=10, depth=5).double()
    tokens = torch.randint(11, (3, 7))
    for count in (1, 2, 4, 5):
        hidden = tokens
        for stage in model.pipeline_stages(count):
            hidden = stage(hidden)
        assert torch.equal(hidden, model(tokens)), count
    # a copy of the tied weight as the last stage's head: the head reads it, the embedding not
    copy = torch.nn.Parameter(model.tied_weight.detach().clone())
    first, last = model.pipeline_stages(2, copy)
    last(first(tokens)).square().sum().backward()
    embedded = model.tied_weight.grad.clone()
    model.zero_grad()
    model(tokens).square().sum().backward()
    assert torch.allclose(embedded + copy.grad, model.tied_weight.grad, rtol=1e-13, atol=1e-13)
    assert not torch.allclose(embedded, model.tied_weight.grad)
