"""Micro-batches in gatherlab's own module (``layout.micro_batches``, ``layout.accumulation``;
docs/design.md §2): the cached accumulation trains like one device with the whole batch on 1 and
2 ranks × K = 1, 2, 4 (with a learnt temperature too); naive accumulation of the local NT-Xent
trains the mean of each micro-batch's own loss, computed here with plain torch; a per-sample mean
loss accumulated naively is exact; the layout's keys are checked before any job starts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from bounds import differences
from helpers import compose, run_training, train_cases

from gatherlab.check import measure
from gatherlab.components import config
from gatherlab.components.config import ConfigError
from gatherlab.core import runfiles
from gatherlab.lab import validation

pytestmark = pytest.mark.slow

FLOAT64_BOUND = 1e-10  # layouts differ only in summation order (docs/design.md §2)
DIRECT_BOUND = 1e-12  # naive accumulation against the objective computed here
STEPS = 3
SMALL = (
    "model=mlp", "data=gaussian", "data.num_samples=32", "global_batch_size=16",
    f"steps={STEPS}", "precision=64-true", "gather=fixed", "optim=sgd", "optim.lr=0.5",
    "log_every=0",
)  # fmt: skip
LAYOUTS = [(ranks, k) for ranks in (1, 2) for k in (1, 2, 4)]


class SquaredDistance(torch.nn.Module):
    """A plain mean of per-sample terms: ‖out0_i − out1_i‖² averaged over the rank's rows."""

    def forward(self, out0: torch.Tensor, out1: torch.Tensor) -> torch.Tensor:
        return (out0 - out1).pow(2).sum(dim=1).mean()


def _accumulated(ranks: int, k: int, accumulation: str) -> list[str]:
    return [
        f"layout=cpu{ranks}", f"layout.accumulation={accumulation}", f"layout.micro_batches={k}",
    ]  # fmt: skip


def _differences(run_dir: Path, reference_dir: Path) -> tuple[float, float]:
    """Max |Δloss| over the steps and max |Δweight| of the final weights (`bounds.differences`),
    of runs of ``STEPS`` steps."""
    assert len(runfiles.read_curves(run_dir)["loss"]) == STEPS
    return differences(run_dir, reference_dir)


@pytest.fixture(scope="module")
def global_ntxent_runs(tmp_path_factory) -> dict[str, Path]:
    """The global NT-Xent with ``fixed``: one device with the whole batch, and cached
    accumulation on 1 and 2 ranks × K = 1, 2, 4."""
    cases = {"reference": ["layout=cpu1"]}
    cases |= {f"cached_{w}x{k}": _accumulated(w, k, "cached") for w, k in LAYOUTS}
    return train_cases(tmp_path_factory.mktemp("global"), cases, *SMALL, "loss=ntxent_global")


@pytest.mark.parametrize(("ranks", "k"), LAYOUTS)
def test_cached_accumulation_matches_one_device(global_ntxent_runs, ranks, k):
    loss_diff, weight_diff = _differences(
        global_ntxent_runs[f"cached_{ranks}x{k}"], global_ntxent_runs["reference"]
    )
    assert loss_diff <= FLOAT64_BOUND
    assert weight_diff <= FLOAT64_BOUND


def test_accumulated_runs_record_every_step_and_their_layout(global_ntxent_runs):
    run_dir = global_ntxent_runs["cached_2x4"]
    curves = runfiles.read_curves(run_dir)
    assert curves["step"] == list(range(STEPS))
    assert min(curves["grad_norm"]) > 0
    layout = runfiles.read_summary(run_dir)["config"]["layout"]
    assert (layout["devices"], layout["micro_batches"], layout["accumulation"]) == (2, 4, "cached")


@pytest.fixture(scope="module")
def learnt_temperature_runs(tmp_path_factory) -> dict[str, Path]:
    """CLIP's loss, whose logit scale (a learnt temperature) is a parameter of the loss: one
    device, and cached accumulation on 1 rank × K = 4 and 2 ranks × K = 2."""
    cases = {
        "reference": ["layout=cpu1"],
        "cached_1x4": _accumulated(1, 4, "cached"),
        "cached_2x2": _accumulated(2, 2, "cached"),
    }
    return train_cases(tmp_path_factory.mktemp("clip"), cases, *SMALL, "loss=clip")


@pytest.mark.parametrize("run", ["cached_1x4", "cached_2x2"])
def test_cached_accumulation_counts_a_learnt_temperature_once(learnt_temperature_runs, run):
    loss_diff, weight_diff = _differences(
        learnt_temperature_runs[run], learnt_temperature_runs["reference"]
    )
    assert loss_diff <= FLOAT64_BOUND
    assert weight_diff <= FLOAT64_BOUND


def _micro_batch_objective(
    overrides: list[str], ranks: int, k: int
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain torch, one device: each step's loss is the mean over the K micro-batches of the
    1-device loss of each micro-batch alone (micro-batch j: the j-th K-th of every rank's rows),
    its gradient one backward of that mean, the optimizer's step; the losses and final weights."""
    cfg, _ = compose(*overrides)
    model = config.build_model(cfg).double()
    loss = config.loss_factory(cfg)()  # as on one device
    optimizer = config.build_optimizer(cfg)(model.parameters())
    batches = measure.global_batches(
        config.build_dataset(cfg), cfg.global_batch_size, cfg.seed, cfg.data.shuffle, cfg.steps
    )
    losses = []
    for views in batches:
        per_rank = [view.double().chunk(ranks) for view in views]
        micro = [
            [torch.cat([rows.chunk(k)[j] for rows in view_rows]) for view_rows in per_rank]
            for j in range(k)
        ]
        step_loss = torch.stack([loss(model(v0), model(v1)) for v0, v1 in micro]).mean()
        optimizer.zero_grad()
        step_loss.backward()
        optimizer.step()
        losses.append(float(step_loss.detach()))
    return losses, model.state_dict()


@pytest.mark.parametrize(("ranks", "k"), [(1, 2), (1, 4), (2, 2)])
def test_naive_accumulation_of_the_local_ntxent_is_the_mean_of_micro_batch_losses(
    tmp_path, ranks, k
):
    overrides = [*SMALL, "loss=ntxent", *_accumulated(ranks, k, "naive")]
    run_training(tmp_path / "naive", *overrides)
    losses, weights = _micro_batch_objective(overrides, ranks, k)
    trained = runfiles.read_curves(tmp_path / "naive")["loss"]
    assert np.abs(np.array(trained) - np.array(losses)).max() <= DIRECT_BOUND
    state = runfiles.read_final_state(tmp_path / "naive")
    assert max(float((state[name] - weights[name]).abs().max()) for name in state) <= DIRECT_BOUND
    # and it is not the whole batch's loss: the micro-batches lose their other negatives
    whole, _ = _micro_batch_objective([*SMALL, "loss=ntxent", "layout=cpu1"], 1, 1)
    assert abs(trained[0] - whole[0]) > 1e-3


def test_naive_accumulation_of_a_per_sample_mean_loss_is_exact(tmp_path):
    common = [
        *SMALL, "loss=user", f"loss._target_={__name__}:SquaredDistance", "gather=native",
    ]  # fmt: skip
    runs = train_cases(
        tmp_path,
        {"reference": ["layout=cpu1"], "naive_2x4": _accumulated(2, 4, "naive")},
        *common,
    )
    loss_diff, weight_diff = _differences(runs["naive_2x4"], runs["reference"])
    assert loss_diff <= FLOAT64_BOUND
    assert weight_diff <= FLOAT64_BOUND


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["layout=cpu2", "layout.accumulation=cached", "layout.micro_batches=3"],
            "layout.micro_batches=3 does not divide the 8 rows of each rank "
            "(global_batch_size / devices); allowed: 1, 2, 4, 8",
        ),
        (
            ["layout.accumulation=naive", "layout.micro_batches=0"],
            "layout.micro_batches=0 is not allowed; allowed: a positive integer",
        ),
        (
            ["layout.micro_batches=2"],
            "layout.micro_batches=2 with layout.accumulation=none; allowed: "
            "layout.accumulation=naive or cached, or layout.micro_batches=1",
        ),
        (
            ["layout.accumulation=gradcache"],
            "layout.accumulation='gradcache' is unknown; allowed: none, naive, cached",
        ),
        (
            ["model=simclr", "data=digits", "layout.accumulation=cached"],
            "layout.accumulation=cached with model.norm='global': batch norm would see",
        ),
    ],
)
def test_micro_batches_are_checked_before_any_job(overrides, message):
    cfg, _ = compose("global_batch_size=16", *overrides)
    with pytest.raises(ConfigError) as raised:
        validation.validate(cfg)
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)
