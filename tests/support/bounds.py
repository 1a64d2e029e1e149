"""How close two layouts of one run must be, and how far a run that must differ is: the bounds
that the training tests of every folder assert (docs/design.md §2, ``gradients.TOLERANCE``), and the
differences of two run directories they are held to."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# Stated in docs/design.md and gradients.TOLERANCE: layouts differ only in summation order.
FLOAT64_BOUND = 1e-10
FLOAT32_BOUND = 1e-5
# `old` must miss by far more than rounding: at least 100 times the bound.
MISS_FACTOR = 100
# The columns of check.csv that hold numbers: two launchers' checks agree on them to 1e-12
# (tests/check/test_external_check.py, on gloo; tests/journeys/test_gpu.py, on NCCL).
NUMBERS = (
    "scale", "loss_diff", "cosine", "norm_ratio", "max_rel_err", "train_max_abs_loss_diff",
    "max_abs_param_diff", "first_diff_step",
)  # fmt: skip


def differences(run_dir: Path, reference_dir: Path) -> tuple[float, float]:
    """Max |Δloss| over all steps and max |Δparameter| of the final weights."""
    from gatherlab.core import runfiles

    loss = np.array(runfiles.read_curves(run_dir)["loss"])
    reference_loss = np.array(runfiles.read_curves(reference_dir)["loss"])
    assert len(loss) == len(reference_loss)
    state, reference = runfiles.read_final_state(run_dir), runfiles.read_final_state(reference_dir)
    assert state.keys() == reference.keys()
    param_diff = max(float((state[k] - reference[k]).abs().max()) for k in state)
    return float(np.abs(loss - reference_loss).max()), param_diff
