"""What a check says at size (docs/checking.md §10, "At size"): a model whose check would need more
memory than the machine has left is refused in one line, with the estimate and the limit, before
any rank starts; the estimate is the vectors `gatherlab.check.sizing` counts."""

from __future__ import annotations

import re
from pathlib import Path

import plain_steps
import pytest
from torch import nn

from gatherlab import check
from gatherlab.check import sizing
from gatherlab.ranks import pool as pools

WIDE = 5000  # 8·5000 + 5000² + 5000·16 weights and their biases: 25,100,016 parameters


def wide_model() -> nn.Module:
    """plain_steps' step on a model of 25.1M parameters (8 → 5000 → 5000 → 16)."""
    return nn.Sequential(nn.Linear(8, WIDE), nn.Linear(WIDE, WIDE), nn.Linear(WIDE, 16))


def test_the_estimate_counts_the_float64_vectors_of_the_command_and_of_each_rank():
    parameters, vector = 1_000_000, 8_000_000
    estimate = sizing.estimate(parameters, 4)
    now = estimate.command - 12 * vector  # what the command held when it asked
    assert 0 < now < 2**40
    assert estimate.rank == sizing.RANK_START + 5 * vector
    assert estimate.total == estimate.command + 4 * estimate.rank
    assert sizing.too_large(parameters, 4, None) is None  # nothing known of the memory: no refusal
    assert sizing.too_large(parameters, 4, 2**50) is None
    # in a low precision the floor's runs in it: 4 vectors more in the command, none in a rank
    low = sizing.estimate(parameters, 4, "32-true")
    assert 0 <= low.command - 16 * vector - now < 2**26  # `now` read again: within 64 MiB
    assert low.rank == estimate.rank


def test_a_check_too_large_for_the_memory_left_is_refused_before_any_rank_starts(monkeypatch):
    monkeypatch.setattr(sizing, "available_bytes", lambda: 2 * 2**30)
    started = set(pools._pools)
    with pytest.raises(check.CheckError) as refused:
        check.check_training(
            step=plain_steps.training_step, model=wide_model, data=plain_steps.Pairs,
            world_sizes=(3,), steps=1, global_batch_size=6,
        )  # fmt: skip
    line = str(refused.value)
    assert "\n" not in line
    # 25,100,016 parameters: each rank RANK_START + 5 · 8 · 25,100,016 bytes = 1.22 GiB
    rank = (sizing.RANK_START + 5 * 8 * 25_100_016) / 2**30
    assert re.fullmatch(
        r"--step training_step: a check of 25\.1M trainable parameters at W = 3 "
        rf"needs about \d+\.\d GiB \(the command \d+\.\d GiB, each rank {rank:.1f} GiB\), more "
        r"than the 2\.0 GiB of memory available; allowed: fewer ranks \(--world-sizes\), a "
        r"smaller model, or a machine with more memory",
        line,
    ), line
    assert set(pools._pools) == started  # no pool of 3 ranks was started


def _refused_estimate(precision: str, judge_in: str) -> tuple[float, float]:
    """The command's and a rank's estimates (GiB) in the line that refuses the wide model's check
    at W = 3 in ``precision``, judged as ``judge_in`` says."""
    with pytest.raises(check.CheckError) as refused:
        check.check_training(
            step=plain_steps.training_step, model=wide_model, data=plain_steps.Pairs,
            world_sizes=(3,), steps=1, global_batch_size=6, precision=precision,
            judge_in=judge_in,
        )  # fmt: skip
    found = re.search(r"the command (\d+\.\d) GiB, each rank (\d+\.\d) GiB", str(refused.value))
    return float(found[1]), float(found[2])


def test_a_step_in_a_low_precision_is_estimated_with_its_floors_runs(monkeypatch):
    """The same step in float32 judged by float64 (``judge_in="float64"``): its command's estimate
    4 vectors of 8 · 25,100,016 bytes (0.75 GiB) above float64's, as the floor's runs in float32
    add to the command's peak."""
    monkeypatch.setattr(sizing, "available_bytes", lambda: 2 * 2**30)
    commands = {p: _refused_estimate(p, "float64")[0] for p in ("64-true", "32-true")}
    more = sizing.LOW_PRECISION_VECTORS * 8 * 25_100_016 / 2**30
    assert commands["32-true"] - commands["64-true"] == pytest.approx(more, abs=0.1)


def test_a_step_judged_in_floors_alone_is_estimated_with_its_vectors_in_its_precision(monkeypatch):
    """At 25.1M parameters (above `defaults.FLOORS_ALONE_PARAMETERS`) a float32 check is judged in
    floors alone by default: the command FLOORS_COMMAND vectors of 4 · 25,100,016 bytes where the
    float64 verdict's had 8 + W + 4 of 8 bytes, a rank RANK_START + FLOORS_RANK of them."""
    monkeypatch.setattr(sizing, "available_bytes", lambda: 2**28)
    vector = 4 * 25_100_016
    command, rank = _refused_estimate("32-true", "auto")
    float64s, _ = _refused_estimate("32-true", "float64")
    fewer = (8 + 3 + sizing.LOW_PRECISION_VECTORS) * 2 * vector - sizing.FLOORS_COMMAND * vector
    assert float64s - command == pytest.approx(fewer / 2**30, abs=0.1)
    assert rank == round((sizing.RANK_START + sizing.FLOORS_RANK * vector) / 2**30, 1)
    low = sizing.estimate(25_100_016, 3, "32-true", floors=True)
    assert low.rank == sizing.RANK_START + sizing.FLOORS_RANK * vector
    assert 0 < low.command - sizing.FLOORS_COMMAND * vector < 2**40  # what the command held
    assert sizing.estimate(25_100_016, 3, "bf16-true", floors=True).rank == (
        sizing.RANK_START + sizing.FLOORS_RANK * 2 * 25_100_016
    )


def test_the_memory_available_is_what_the_kernel_reports_or_less():
    available = sizing.available_bytes()
    meminfo = Path("/proc/meminfo").read_text()
    reported = int(re.search(r"^MemAvailable:\s+(\d+) kB", meminfo, re.M).group(1)) * 1024
    assert 0 < available <= reported * 1.1  # the kernel's number moves between the two reads


@pytest.mark.parametrize("budget", [0, -1.0, float("nan"), "10"])
def test_a_step_budget_that_is_no_number_of_seconds_is_one_line(budget):
    with pytest.raises(check.CheckError) as refused:
        check.check_training(
            step=plain_steps.training_step, model=plain_steps.build_model, data=plain_steps.Pairs,
            step_budget_s=budget,
        )  # fmt: skip
    assert str(refused.value) == f"--step-budget {budget!r}; allowed: a number of seconds > 0"
