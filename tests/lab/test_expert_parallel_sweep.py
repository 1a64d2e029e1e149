"""The lab's expert parallelism (docs/checking.md §10 "Expert parallelism in the lab",
``strategy=ep``): the experiment composes and sweeps; the mixture of experts trains like one
device with its experts spread over 2 and 4 ranks; the experts' gradients left
summed make the first gradient the one a plain one-device computation predicts (the experts' part
W times one device's); rows really go to their expert's rank; a layout that cannot run is refused
in one line before any job."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
from helpers import run_command

from gatherlab.analysis import report
from gatherlab.components import config
from gatherlab.components.models import MoEMLP
from gatherlab.lab import validation
from gatherlab.ranks import pool as pools

# one sweep of 9 jobs on 1, 2 and 4 ranks, seconds of training (make test-fast leaves it out)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> tuple[pd.DataFrame, dict]:
    """``experiment=expert_parallel`` without its DDP runs: ep and ep_unscaled on one device, 2
    and 4 ranks, 3 steps, on the session's worker pools."""
    sweep = tmp_path_factory.mktemp("expert_parallel") / "sweep"
    result = run_command(
        "train", "-m", "experiment=expert_parallel", "steps=3", "strategy=ep,ep_unscaled",
        f"hydra.sweep.dir={sweep}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    table = pd.read_csv(sweep / report.COMPARISON)
    curves = {run: pd.read_csv(sweep / str(run) / "curves.csv") for run in table["run_dir"]}
    return table.set_index(["strategy", "layout"]), curves


def _first_gradient_parts() -> tuple[float, float]:
    """The squared norms of one device's first gradient without and with the experts' part, in
    plain PyTorch: the experiment's model and loss on its whole data set (its one global batch;
    CLIP's loss does not depend on the rows' order)."""
    with config.composed():
        cfg, _ = config.compose(["experiment=expert_parallel"])
    dataset = config.build_dataset(cfg)
    model = config.build_model(cfg).double()
    loss = config.loss_factory(cfg)().double()
    loss(model(dataset.view0), model(dataset.view1)).backward()
    experts = {id(p) for p in model.experts.parameters()}
    squared = [(id(p) in experts, float(p.grad.square().sum()))
               for p in [*model.parameters(), *loss.parameters()]]  # fmt: skip
    return sum(s for e, s in squared if not e), sum(s for e, s in squared if e)


def test_experts_spread_over_the_ranks_train_like_one_device_and_unscaled_they_depart(swept):
    table, curves = swept
    reference = curves[table.loc[("ep", "cpu1"), "run_dir"]]
    dense, experts = _first_gradient_parts()
    assert reference["grad_norm"][0] == pytest.approx(math.sqrt(dense + experts), rel=1e-12)
    for size, layout in ((2, "cpu2"), (4, "cpu4")):
        run = table.loc[("ep", layout)]
        assert run["verdict"] == "matches", layout
        # measured 4.4e-16 (losses) and 1.1e-16 (weights)
        assert run["max_abs_loss_diff"] <= 1e-12 and run["max_abs_param_diff"] <= 1e-12
        unscaled = table.loc[("ep_unscaled", layout)]
        trained = curves[unscaled["run_dir"]]
        assert trained["loss"][0] == pytest.approx(reference["loss"][0], abs=1e-14)
        assert unscaled["verdict"] == "differs"
        # the replicated parameters' gradient one device's, the experts' W times it
        assert trained["grad_norm"][0] == pytest.approx(
            math.sqrt(dense + size**2 * experts), rel=1e-12
        )


def _dispatched_on_a_rank() -> tuple[float, list[int]]:
    """On a rank of the pool: the model's output on this rank's 6 of 12 rows with its 4 experts
    spread over the ranks, against the same model computing every expert itself; which experts
    got a gradient here."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = MoEMLP(5, 8, 3, experts=4).double()
    rows = torch.randn(12, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mine = rows.chunk(dist.get_world_size())[dist.get_rank()]
    alone = model(mine)
    model.expert_parallel(dist.group.WORLD)
    spread = model(mine)
    spread.sum().backward()
    got = [i for i, expert in enumerate(model.experts) if expert[0].weight.grad is not None]
    return float((spread - alone).detach().abs().max()), got


def test_each_row_is_computed_by_its_experts_rank():
    first, second = pools.pool(2).run(_dispatched_on_a_rank)
    # the same outputs as every expert computed here; the experts' gradients where they live
    assert first[0] <= 1e-15 and second[0] <= 1e-15
    assert first[1] == [0, 1] and second[1] == [2, 3]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["layout=cpu4", "model.experts=6"],
         "model.experts=6 does not divide over the layout's 4 ranks under strategy=ep; allowed: "
         "a multiple of 4"),
        (["layout=cpu2", "model=norm_mlp"],
         "strategy=ep spreads a mixture of experts' experts over the ranks, and model "
         "(gatherlab.components.models.NormMLP) has none; allowed: model=moe"),
        (["layout=cpu2", "strategy.scale_experts=1"],
         "strategy.scale_experts=1 is not allowed; allowed: true or false"),
        (["layout=cpu2", "launcher=spawn"],
         "strategy=ep with launcher=spawn is not supported; allowed: launcher=pool (CPU "
         "layouts), or strategy=ddp"),
    ],
)  # fmt: skip
def test_an_expert_parallel_layout_that_cannot_run_is_refused_in_one_line(overrides, message):
    with config.composed():
        cfg, _ = config.compose(["experiment=expert_parallel", "strategy=ep", *overrides])
    with pytest.raises(validation.ConfigError) as refused:
        validation.validate(cfg)
    assert str(refused.value) == message
