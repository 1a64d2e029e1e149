"""The demo on GPUs (NCCL), where the machine has them; skipped with the reason elsewhere. On one
GPU the 1-device run must match the CPU run (float64, summation order only); on two, ``fixed``
must match and ``old`` must not, as on the CPU."""

from __future__ import annotations

import pytest
import torch
from helpers import run_training
from test_training import FLOAT64_BOUND, MISS_FACTOR, _differences

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.slow]
COMMON = ("experiment=bug_demo", "steps=20")


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU; this machine has none")
def test_demo_on_one_gpu_matches_the_cpu(tmp_path):
    run_training(tmp_path / "cpu", *COMMON, "layout=cpu1")
    run_training(tmp_path / "gpu", *COMMON, "layout=gpu1")
    loss_diff, param_diff = _differences(tmp_path / "gpu", tmp_path / "cpu")
    assert loss_diff <= FLOAT64_BOUND and param_diff <= FLOAT64_BOUND


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs; this machine has {GPUS}")
def test_demo_on_two_gpus(tmp_path):
    run_training(tmp_path / "reference", *COMMON, "layout=gpu1")
    for gather in ("fixed", "old"):
        run_training(tmp_path / gather, *COMMON, "layout=gpu2", f"gather={gather}")
    loss_diff, param_diff = _differences(tmp_path / "fixed", tmp_path / "reference")
    assert loss_diff <= FLOAT64_BOUND and param_diff <= FLOAT64_BOUND
    loss_diff, param_diff = _differences(tmp_path / "old", tmp_path / "reference")
    assert loss_diff >= MISS_FACTOR * FLOAT64_BOUND and param_diff >= MISS_FACTOR * FLOAT64_BOUND
