"""experiments/rounding.py's measurement on real gloo ranks (W = 2), on a tiny MLP whose code is
correct: in float64 its two ranks equal one device to float64's rounding, in float32 they depart
by rounding only (more than nothing, at most 100 unit roundoffs); a rank that reads the wrong
rows departs by far more. And the table's arithmetic: F rounded up to 1, 2, 5 × 10^k, F per
precision, T's margin, from a table written here."""

from __future__ import annotations

import sys

import pandas as pd
import pytest
from helpers import REPO

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


def test_f_is_rounded_up_to_one_two_or_five_and_t_is_held_to_its_margin():
    assert [rounding.nice_ceiling(v) for v in (0.9, 1.0, 1.1, 2.5, 7.0, 52.0)] == [
        1.0, 1.0, 2.0, 5.0, 10.0, 100.0,
    ]  # fmt: skip
    rows = [
        {"case": "correct", "precision": "32-true", "part": "all", "departure_u": 6.0,
         "score": 1.2, "score_least": 1.2, "score_w": 1.0},
        {"case": "correct", "precision": "bf16-mixed", "part": "head", "departure_u": 0.5,
         "score": 2.0, "score_least": 0.4, "score_w": 7.0},
        {"case": "old gather", "precision": "32-true", "part": "all", "departure_u": 1e6,
         "score": 1e6, "score_least": 1e6, "score_w": 1e6},
    ]  # fmt: skip
    found = rounding.constants(pd.DataFrame(rows))
    assert found.largest_departure_u == 6.0  # the bug is not counted
    assert found.factor == 50.0  # 4 × 6 = 24, rounded up
    # each precision's F from its own runs: 4 × 0.5 = 2 for bf16-mixed, 4 × 6 → 50 for float32
    assert found.factor_of == {"32-true": 50.0, "bf16-mixed": 2.0}
    assert found.threshold_margin["whole gradient"] == pytest.approx(3 / 1.2)
    assert found.threshold_needed["whole gradient"] == 3.0  # 2.5× ≥ 2×: T holds
    assert found.threshold_needed["parts, own floor"] == 5.0  # 1.5×: T = 2 · 2, rounded up
    assert found.largest_score["parts, floor ≥ whole's"] == 0.4
    assert found.threshold_needed["parts, own W-block floor"] == 20.0  # 2 · 7, rounded up
