"""A low-precision check judged in floors alone (docs/design.md §2, "Low precision at size"): by
default at or above `defaults.FLOORS_ALONE_PARAMETERS` trainable parameters, at any size with
``judge_in="floors"``, never with ``judge_in="float64"``. Pinned on plain_steps' small model: a
correct step is ``exact within`` its precision (where the float64 verdict says ``exact``), the old
gather departs by 1/W at the floor's resolution, the vectors kept in float32 measure what the
float64 verdict's float32 run beside it measures, and the threshold and the option decide."""

from __future__ import annotations

import pytest

from gatherlab.check import CheckError, check_training, defaults, explain_training, sizing
from gatherlab.core import floor

STEP = {"model": "plain_steps:build_model", "data": "plain_steps:Pairs", "world_sizes": (2,),
        "steps": 2}  # fmt: skip
PARAMETERS = 8 * 32 + 32 + 32 * 32 + 32 + 32 * 32 + 32 + 32 * 16 + 16  # plain_steps.build_model()


def _whole(result):
    table = result.table
    return table[(table["part"] == "all") & (table["removed"] == "none")].iloc[0]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_correct_step_in_floors_alone_is_exact_within_its_precision_as_float64_says_exact(
    precision,
):
    # the same step judged both ways: float64's verdict (exact, the precision's run beside it)
    # and floors alone, whose one-device, row-block and W runs in the precision are the runs the
    # float64 verdict measured beside it; their vectors are kept in the precision here, in
    # float64 there, and the floors agree to the float64 sums' rounding
    alone = check_training(step="floors_alone_steps:training_step", precision=precision,
                           judge_in="floors", **STEP)  # fmt: skip
    verdict = check_training(step="floors_alone_steps:training_step", precision=precision,
                             judge_in="float64", **STEP)  # fmt: skip
    word = {"32-true": "float32", "bf16-mixed": "bf16"}[precision]
    row, beside = _whole(alone), _whole(verdict)
    assert (beside["judged_in"], beside["verdict"]) == ("64-true", "exact")
    assert (row["judged_in"], row["verdict"]) == (precision, f"exact within {word}")
    assert set(alone.table["verdict"]) == {f"exact within {word}"}  # every part too
    assert row["floors"] <= floor.FLOOR_THRESHOLD
    assert row["floor"] == pytest.approx(beside["floor"], rel=1e-12)
    assert row["floors"] == pytest.approx(beside["floors"], rel=1e-12)
    text = " ".join(explain_training(alone).split())
    assert (
        f"Asked for (--judge-in floors), it is judged in {word} against a measured floor alone"
        in (text)
    )
    assert f"trains like one device as far as {word} can tell" in text


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_old_gather_departs_by_one_over_w_in_floors_alone(precision):
    # each rank's gradient reaches only its own slice of the gathered embeddings: after DDP's
    # average, 1/W of one device's (docs/design.md §1); far beyond any floor
    result = check_training(step="floors_alone_steps:old_gather_step", precision=precision,
                            judge_in="floors", **STEP)  # fmt: skip
    row = _whole(result)
    assert (row["judged_in"], row["verdict"], row["gradient"]) == (precision, "1/W", "1/W")
    assert row["norm_ratio"] == pytest.approx(1 / 2, rel=floor.FLOOR_THRESHOLD * row["floor"])
    assert row["floors"] > 10 * floor.FLOOR_THRESHOLD
    assert row["culprits"] == "loss"


def test_the_threshold_decides_by_the_trainable_parameters_and_the_option_overrides_it():
    threshold = defaults.FLOORS_ALONE_PARAMETERS
    assert not sizing.floors_alone("32-true", threshold - 1)
    assert sizing.floors_alone("32-true", threshold)
    assert sizing.floors_alone("bf16-mixed", threshold)
    assert not sizing.floors_alone("64-true", threshold, "floors")  # float64 is float64
    assert not sizing.floors_alone("32-true", 10**12, "float64")
    assert sizing.floors_alone("32-true", 1, "floors")


def test_a_check_at_or_above_the_threshold_is_judged_in_floors_alone_and_says_so(monkeypatch):
    # the threshold set at the small model's own count: auto judges it in floors alone, and
    # judge_in="float64" gives the float64 verdict back
    monkeypatch.setattr(defaults, "FLOORS_ALONE_PARAMETERS", PARAMETERS)
    result = check_training(step="floors_alone_steps:training_step", precision="32-true", **STEP)
    row = _whole(result)
    assert (row["judged_in"], row["verdict"]) == ("32-true", "exact within float32")
    text = " ".join(explain_training(result).split())
    assert (
        f"At {PARAMETERS:,} trainable parameters (from {PARAMETERS:,}) it is judged in float32 "
        "against a measured floor alone" in text
    )
    assert "--judge-in float64 (judge_in='float64') asks for the float64 verdict" in text
    asked = check_training(step="floors_alone_steps:training_step", precision="32-true",
                           judge_in="float64", **STEP)  # fmt: skip
    assert (_whole(asked)["judged_in"], _whole(asked)["verdict"]) == ("64-true", "exact")
    monkeypatch.setattr(defaults, "FLOORS_ALONE_PARAMETERS", PARAMETERS + 1)
    below = check_training(step="floors_alone_steps:training_step", precision="32-true", **STEP)
    assert (_whole(below)["judged_in"], _whole(below)["verdict"]) == ("64-true", "exact")


def test_a_model_whose_floor_is_not_measured_keeps_the_float64_verdict_in_floors_alone():
    # row blocks would split batch norm's statistics: no floor, so float64 judges it whatever
    # judge_in asks, and its culprit is named as before
    result = check_training(
        step="plain_steps:training_step", model="precision_cases:build_with_batchnorm",
        data="plain_steps:Pairs", world_sizes=(2,), steps=1, precision="bf16-mixed",
        judge_in="floors",
    )  # fmt: skip
    assert "in_precision" not in result.table.columns
    assert set(result.table.loc[result.table["removed"] == "none", "culprits"]) == {"batchnorm"}
    text = " ".join(explain_training(result).split())
    assert "The floor in bf16 is not measured for a model with batch norm" in text


def test_one_device_runs_in_a_low_precision_compute_on_one_thread_as_each_rank(monkeypatch):
    # a CPU kernel's rounding depends on its threads: the floor's one-device runs compute on
    # the one thread each rank of the pool has; float64's reference keeps the process's own
    import floors_alone_steps
    import torch

    monkeypatch.setattr(floors_alone_steps, "THREADS", [])
    before = torch.get_num_threads()
    threads = max(2, before)
    torch.set_num_threads(threads)
    try:
        check_training(step="floors_alone_steps:counting_threads_step", precision="32-true",
                       judge_in="float64", **STEP)  # fmt: skip
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    seen = set(floors_alone_steps.THREADS)
    assert ("torch.float32", 1) in seen  # the floor's runs: one device, its row blocks
    assert ("torch.float64", threads) in seen  # the float64 verdict's reference
    assert ("torch.float32", threads) not in seen


def test_a_judge_in_that_is_no_mode_is_refused_in_one_line():
    with pytest.raises(CheckError) as refused:
        check_training(step="floors_alone_steps:training_step", judge_in="fast", **STEP)
    assert str(refused.value) == (
        "--judge-in 'fast' is not allowed; allowed: auto, float64, floors"
    )
