"""experiments/pipeline_parallel.py's own logic on a small table written here: each run's row of
docs/results.md (its verdict, differences and first gradient norm over one device's, worked out by
hand) and its figure (three panels, a line per run, a bar per run)."""

from __future__ import annotations

import sys

import pandas as pd
from helpers import REPO

sys.path.insert(0, str(REPO / "experiments"))
import pipeline_parallel


def _table() -> pd.DataFrame:
    """Two steps of each strategy on pp 2 and dp 2 × pp 2 against one device, whose first
    gradient norm is 2.0: the unscaled run's is 8.0 (4 times), the untied run's 1.5."""
    first_norm = {"pp": 2.0, "pp_unscaled": 8.0, "pp_untied": 1.5}
    departed = {"pp": (4e-16, 2e-16, "matches"), "pp_unscaled": (0.16, 0.39, "differs"),
                "pp_untied": (0.026, 0.27, "differs")}  # fmt: skip
    rows = []
    for strategy, norm in first_norm.items():
        for layout, devices in (("cpu1", 1), ("cpu2", 2), ("cpu4", 4)):
            loss_diff, param_diff, verdict = departed[strategy] if devices > 1 else (0, 0, "ref")
            for step in (0, 1):
                rows.append({
                    "strategy": strategy, "layout": layout, "devices": devices,
                    "verdict": verdict, "max_abs_loss_diff": loss_diff,
                    "max_abs_param_diff": param_diff, "step": step,
                    "loss": 2.5 - step + (loss_diff if step else 0),
                    "grad_norm": (norm if devices > 1 else 2.0) if step == 0 else 1.0,
                    "reference_loss": 2.5 - step, "reference_grad_norm": 2.0 if step == 0 else 1.0,
                })  # fmt: skip
    return pd.DataFrame(rows, columns=list(pipeline_parallel.COLUMNS))


def test_the_numbers_name_each_runs_verdict_differences_and_first_gradient_norm_ratio():
    lines = pipeline_parallel.numbers(_table()).splitlines()
    assert len(lines) == 5  # a header, its rule, a row per strategy
    assert (
        lines[2]
        == "| pp (correct) | matches, 4e-16, 2e-16, 1.0000 | matches, 4e-16, 2e-16, 1.0000 |"
    )
    assert lines[3].endswith("| differs, 0.16, 0.39, 4.0000 | differs, 0.16, 0.39, 4.0000 |")
    assert lines[4].endswith("| differs, 0.026, 0.27, 0.7500 | differs, 0.026, 0.27, 0.7500 |")


def test_the_figure_draws_every_run_on_two_layouts_against_one_device():
    drawn = pipeline_parallel.figure(_table(), tolerance=1e-10)
    loss_axis, diff_axis, bar_axis = drawn.axes
    # one device once, then the 3 strategies × 2 layouts; their differences and the tolerance
    assert len(loss_axis.get_lines()) == 1 + 6 and len(diff_axis.get_lines()) == 6 + 1
    assert len(bar_axis.patches) == 6
    assert [text.get_text() for text in bar_axis.texts].count("differs") == 4
