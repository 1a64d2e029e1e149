"""experiments/rounding.py's measurement on real gloo ranks (W = 2), on a tiny MLP whose code is
correct: in float64 its two ranks equal one device to float64's rounding, in float32 they depart
by rounding only (more than nothing, at most 100 unit roundoffs); a rank that reads the wrong
rows departs by far more. And the table's arithmetic on a table written here: a part's W-block
floor at least its whole's, F rounded up to 1, 2, 5 × 10^k, F per precision, T's margin in each
scope."""

from __future__ import annotations

import sys

import pandas as pd
import pytest
from helpers import REPO

from gatherlab.core import floor

sys.path.insert(0, str(REPO / "experiments"))
import rounding

TINY = rounding.Job(
    "tiny mlp classify", "mlp", "classify", {"inputs": 8, "hidden": (16,), "outputs": 3},
    batches=(16,), seeds=1, world_sizes=(2,),
)  # fmt: skip
FLOAT32_U = 2.0**-24


def _whole(rows: list[dict], case: str = rounding.CORRECT) -> dict:
    (row,) = [r for r in rows if r["part"] == "all" and r["case"] == case]
    return row


@pytest.mark.slow
def test_correct_two_ranks_equal_one_device_in_float64_and_depart_by_rounding_in_float32():
    float64 = _whole(rounding.measure(TINY, "64-true", 0))
    assert float64["departure"] <= 1e-13
    float32 = rounding.measure(
        TINY, "32-true", 0, cases=(rounding.CORRECT, "same rows on every rank")
    )
    correct = _whole(float32)
    assert 0 < correct["departure"] <= 100 * FLOAT32_U
    assert correct["departure_u"] == pytest.approx(correct["departure"] / FLOAT32_U)
    assert correct["score"] == pytest.approx(correct["departure"] / correct["floor"])
    # the parts of the MLP (its layers 0 and 2 hold parameters) are measured too
    assert {r["part"] for r in float32 if r["case"] == rounding.CORRECT} == {"all", "0", "2"}
    # every rank reading rank 0's rows: half of the batch's gradient, nowhere near rounding
    assert _whole(float32, "same rows on every rank")["departure"] > 1e-2


def test_f_per_precision_and_t_in_each_scope_from_a_table_worked_out_by_hand():
    assert [rounding.nice_ceiling(v) for v in (0.9, 1.0, 1.1, 2.5, 7.0, 52.0)] == [
        1.0, 1.0, 2.0, 5.0, 10.0, 100.0,
    ]  # fmt: skip
    columns = ("precision", "part", "case", "departure_u", "score", "score_least", "departure",
               "floor_w", "score_w")  # fmt: skip
    rows = [
        ("32-true", "all", "correct", 6.0, 1.2, 1.2, 4e-7, 4e-7, 1.0),
        ("32-true", "head", "correct", 0.5, 2.0, 0.4, 2e-7, 1e-8, 20.0),
        ("bf16-mixed", "all", "correct", 0.25, 1.0, 1.0, 1e-3, 1e-3, 1.0),
        ("bf16-mixed", "head", "correct", 0.75, 7.0, 1.5, 3.5e-3, 5e-4, 7.0),
        ("32-true", "all", "old gather", 1e6, 1e6, 1e6, 0.3, 4e-7, 1e6),
    ]
    table = pd.DataFrame(rows, columns=columns).assign(job="a", seed=0, world_size=2)
    # a part's W-block floor at least its run's whole one: 2e-7 / 4e-7 and 3.5e-3 / 1e-3
    derived = rounding.with_derived(table)["score_w_least"].tolist()
    assert derived == pytest.approx([1.0, 0.5, 1.0, 3.5, 0.3 / 4e-7])
    found = rounding.constants(table)
    assert found.largest_departure_u == 6.0  # the bug is not counted
    assert found.factor == 50.0  # 4 × 6 = 24, rounded up
    assert found.factor_of == {"32-true": 50.0, "bf16-mixed": 5.0}  # 4 × 0.75 = 3 → 5
    assert found.factor_whole_of == {"32-true": 50.0, "bf16-mixed": 1.0}  # 4 × 0.25
    t = floor.FLOOR_THRESHOLD  # 5: a margin of 2× holds where the largest score is ≤ 2.5
    assert found.threshold_margin["whole gradient"] == pytest.approx(t / 1.2)
    assert found.threshold_needed["whole gradient"] == t  # 5 / 1.2 ≥ 2×: T holds
    assert found.threshold_needed["parts, own floor"] == 20.0  # 2 × 7 = 14, rounded up
    assert found.threshold_needed["parts, floor ≥ whole's"] == t  # 5 / 1.5 ≥ 2×: holds
    assert found.threshold_needed["parts, own W-block floor"] == 50.0  # 2 × 20
    assert found.largest_score["parts, W-block floor ≥ whole's"] == pytest.approx(3.5)
    assert found.threshold_needed["parts, W-block floor ≥ whole's"] == 10.0  # 2 × 3.5 = 7
