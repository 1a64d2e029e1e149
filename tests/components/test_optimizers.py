"""LARS (gatherlab.components.optimizers): the trust ratio cancels a constant factor on the
gradient, except against the weight decay added to it (docs/design.md §7); bad arguments are
refused. Every configured optimizer trains `fixed` on 2 ranks like one device, and each run is
shown to have stepped its own optimizer (``optimizer_steps``)."""

from __future__ import annotations

import pytest
import torch
from bounds import FLOAT64_BOUND
from stepped import STEPPED, optimizer_steps

from gatherlab.components.optimizers import LARS


def _steps(scale: float, weight_decay: float) -> torch.Tensor:
    torch.manual_seed(0)
    parameter = torch.nn.Parameter(torch.randn(5, 3, dtype=torch.float64))
    target = torch.randn(5, 3, dtype=torch.float64)
    optimizer = LARS([parameter], lr=0.5, momentum=0.9, weight_decay=weight_decay)
    for _ in range(5):
        optimizer.zero_grad()
        (scale * (parameter - target).pow(2).sum()).backward()
        optimizer.step()
    return parameter.detach()


def test_a_constant_factor_on_the_gradient_cancels_without_weight_decay():
    assert torch.allclose(_steps(1.0, 0.0), _steps(1 / 8, 0.0), rtol=1e-14, atol=0)


def test_with_weight_decay_it_does_not():
    assert not torch.allclose(_steps(1.0, 1e-2), _steps(1 / 8, 1e-2), rtol=1e-6, atol=0)


def test_the_step_is_trust_ratio_times_learning_rate():
    parameter = torch.nn.Parameter(torch.tensor([3.0, 4.0], dtype=torch.float64))  # norm 5
    parameter.grad = torch.tensor([0.0, 2.0], dtype=torch.float64)  # norm 2
    LARS([parameter], lr=1.0, momentum=0.0, trust_coefficient=0.1).step()
    assert parameter.detach().tolist() == pytest.approx([3.0, 4.0 - 0.1 * 5 / 2 * 2.0])


@pytest.mark.parametrize("arguments", [{"lr": 0.0}, {"lr": 1.0, "momentum": -0.1},
                                       {"lr": 1.0, "trust_coefficient": 0.0}])  # fmt: skip
def test_bad_arguments_are_refused_by_name(arguments):
    with pytest.raises(ValueError, match=next(reversed(arguments))):
        LARS([torch.nn.Parameter(torch.zeros(1))], **arguments)


@pytest.mark.slow
def test_fixed_on_two_ranks_matches_one_device_under_every_optimizer(tmp_path):
    """Every configured optimizer other than plain SGD (which test_training.py trains): `fixed` on
    2 ranks against each optimizer's own 1-device run, 5 steps in float64, to the report's
    tolerance (docs/design.md §2 and §7: an exact gradient matches under any optimizer). The jobs
    run on the warm pools and the report compares them, without a sweep's figures. Which
    optimizer ran: each 1-device run, which trains in this process, steps its own optimizer five
    times (its class, settings and state, ``optimizer_steps``), and each 2-rank run matches that
    run and no other optimizer's (the references' final losses all differ)."""
    from helpers import run_training

    from gatherlab.analysis import report, results

    optimizers = ["sgd_momentum", "adam", "adam_l2", "adamw", "lars"]
    for number, (optim, layout) in enumerate(
        (optim, layout) for optim in optimizers for layout in ("cpu1", "cpu2")
    ):
        with optimizer_steps() as steps:
            run_training(
                tmp_path / f"{number}-{optim}-{layout}", f"optim={optim}", f"layout={layout}",
                "gather=fixed", "steps=5", "precision=64-true", "log_every=0",
            )  # fmt: skip
        if layout == "cpu1":  # in this process (the 2-rank runs step in the pool's ranks)
            assert steps == [STEPPED[optim]] * 5, (optim, steps)
    table = report.compare_sweep(results.load_runs(tmp_path), tmp_path).table
    assert list(zip(table["optim"], table["devices"], strict=True)) == [
        (optim, devices) for optim in optimizers for devices in (1, 2)
    ]
    references = table[table["devices"] == 1].set_index("optim")
    assert list(references["verdict"]) == ["reference"] * len(optimizers)
    # each optimizer trains its own run: the final losses of the references all differ
    assert references["final_loss"].nunique() == len(optimizers)
    for row in table[table["devices"] == 2].itertuples():
        assert row.verdict == "matches", row.optim
        assert row.reference == references.loc[row.optim, "run_dir"]  # its own optimizer's
        assert row.max_abs_loss_diff <= FLOAT64_BOUND, row.optim
        assert row.max_abs_param_diff <= FLOAT64_BOUND, row.optim
