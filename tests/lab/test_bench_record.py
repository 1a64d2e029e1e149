"""``python -m gatherlab.bench record`` at tiny sizes: what it prints, never how fast (the suite
asserts no wall-clock time; docs/performance.md has the measured ratios)."""

from __future__ import annotations

import re

from gatherlab.lab import bench
from gatherlab.recording.sketch import DEFAULT_K


def test_the_record_benchmark_prints_its_ratio_line_and_sketch_bytes_independent_of_the_model(
    capsys,
):
    ratios = bench.record(width=16, depth=2, batch=4, repeats=2, large_width=48)
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(
        r"recorded/plain update time: float32 \d+\.\d{3}, float64 \d+\.\d{3}", lines[-1]
    )
    assert set(ratios) == {"float32", "float64"}
    written = [line for line in lines if line.startswith("written")]
    assert len(written) == 3  # float32, float64, and the larger model
    # each update's sketches are parts × k float64 numbers, whatever the model's size
    sketches = f"its sketches {2 * DEFAULT_K * 8 / 1024:.2f})"
    assert all(sketches in line for line in written)


def test_the_fixed_cost_benchmark_prints_a_row_per_world_size(capsys):
    """``python -m gatherlab.bench record-fixed`` on one device, two pairs: its table's row, the
    fixed cost the difference of the means it prints, and the median of the pairs' ratios (no
    time asserted)."""
    from gatherlab.lab import bench

    bench.main(["record-fixed", "--world-sizes", "1", "--repeats", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["W", "plain", "[ms]", "recorded", "[ms]", "fixed", "cost",
                                "[ms/update]", "recorded/plain", "median", "of",
                                "pairs"]  # fmt: skip
    world, plain, recorded, fixed, ratio, median = lines[2].split()
    assert float(median) > 0
    assert world == "1" and abs(float(recorded) - float(plain) - float(fixed)) <= 0.011
    rounding = 0.005 / float(plain) * (1 + float(ratio)) + 0.0005  # of two printed decimals
    assert abs(float(recorded) / float(plain) - float(ratio)) <= rounding


def test_the_median_of_pairs_is_the_middle_pairs_ratio():
    """`recorder_cost.median_of_pairs`: each pair's recorded ÷ plain, their median (ratios 2, 1.5
    and 3 by hand: 2), not the ratio of the means (12 / 5 = 2.4)."""
    from gatherlab.lab.recorder_cost import median_of_pairs

    times = {"plain": [1.0, 2.0, 2.0], "recorded": [2.0, 3.0, 6.0]}
    assert median_of_pairs(times) == 2.0
