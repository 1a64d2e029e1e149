"""The demo on GPUs (NCCL), where the machine has them; skipped with the reason elsewhere. On one
GPU the 1-device run must match the CPU run (float64, summation order only); on two, ``fixed``
must match and ``old`` must not, as on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pandas as pd
import pytest
import torch
from bounds import FLOAT64_BOUND, MISS_FACTOR, differences
from helpers import run_training

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.slow]
COMMON = ("experiment=bug_demo", "steps=20")


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU; this machine has none")
def test_demo_on_one_gpu_matches_the_cpu(tmp_path):
    run_training(tmp_path / "cpu", *COMMON, "layout=cpu1")
    run_training(tmp_path / "gpu", *COMMON, "layout=gpu1")
    loss_diff, param_diff = differences(tmp_path / "gpu", tmp_path / "cpu")
    assert loss_diff <= FLOAT64_BOUND and param_diff <= FLOAT64_BOUND


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs; this machine has {GPUS}")
def test_demo_on_two_gpus(tmp_path):
    run_training(tmp_path / "reference", *COMMON, "layout=gpu1")
    for gather in ("fixed", "old"):
        run_training(tmp_path / gather, *COMMON, "layout=gpu2", f"gather={gather}")
    loss_diff, param_diff = differences(tmp_path / "fixed", tmp_path / "reference")
    assert loss_diff <= FLOAT64_BOUND and param_diff <= FLOAT64_BOUND
    loss_diff, param_diff = differences(tmp_path / "old", tmp_path / "reference")
    assert loss_diff >= MISS_FACTOR * FLOAT64_BOUND and param_diff >= MISS_FACTOR * FLOAT64_BOUND


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs; this machine has {GPUS}")
@pytest.mark.timeout(600)
def test_torchrun_check_on_two_gpus_equals_the_pooled_check(tmp_path):
    """``torchrun --nproc_per_node=2 -m gatherlab.check ... --launcher external --device cuda``:
    NCCL, each rank on its own GPU; the loss check and the training step's check, as a
    LightningModule and as a plain step (the batchnorm removal with ``SyncBatchNorm``), give the
    pooled CPU check's verdicts and, in float64, its numbers to the check's tolerance. Fresh
    interpreters: torchrun starts every rank."""
    from bounds import NUMBERS
    from helpers import pythonpath

    from gatherlab import check

    runs = {
        "loss": (("diagnosis_cases:LearntTemperatureOwnSlice", "--steps", "3"),
                 lambda: check.check_loss("diagnosis_cases:LearntTemperatureOwnSlice", (2,),
                                          steps=3).table),
        "module": (("--module", "ssl_modules:SimCLRWithBatchNorm", "--data",
                    "ssl_modules:GaussianPairs", "--steps", "3", "--global-batch-size", "16",
                    "--data-kwargs", '{"size": 64}'),
                   lambda: check.check_training("ssl_modules:SimCLRWithBatchNorm",
                                                "ssl_modules:GaussianPairs", (2,), steps=3,
                                                global_batch_size=16,
                                                data_kwargs={"size": 64}).table),
        "step": (("--step", "plain_steps:training_step", "--model", "plain_steps:build_model",
                  "--model-kwargs", '{"batchnorm": true}', "--data", "plain_steps:Pairs",
                  "--steps", "3", "--global-batch-size", "16"),
                 lambda: check.check_training(step="plain_steps:training_step",
                                              model="plain_steps:build_model",
                                              model_kwargs={"batchnorm": True},
                                              data="plain_steps:Pairs", world_sizes=(2,),
                                              steps=3, global_batch_size=16).table),
    }  # fmt: skip
    for name, (arguments, pooled) in runs.items():
        out = tmp_path / name
        started = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
             "2", "-m", "gatherlab.check", *arguments, "--launcher", "external", "--device",
             "cuda", "--out", str(out)],
            cwd=tmp_path, env={**os.environ, "PYTHONPATH": pythonpath()}, capture_output=True,
            text=True, timeout=500,
        )  # fmt: skip
        assert started.returncode == 1, started.stdout[-3000:] + started.stderr[-3000:]
        table, expected = pd.read_csv(out / "check.csv"), pooled().reset_index(drop=True)
        assert table["verdict"].tolist() == expected["verdict"].tolist(), name
        for column in set(NUMBERS) & set(table.columns) - {"first_diff_step"}:
            difference = (table[column].astype(float) - expected[column].astype(float)).abs()
            assert (difference.fillna(0) <= 1e-10).all(), (name, column)


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU; this machine has none")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("job", ["ddp", "fsdp2"])
def test_bundled_job_on_every_gpu_trains_as_one_gpu(job, tmp_path):
    """``examples/jobs/{ddp,fsdp2}.py --device cuda``: plainly on one GPU (no process group) and
    under torchrun on every GPU (NCCL), the same printed losses and final weights' norms to the
    float64 bound, as on CPU gloo (tests/journeys/test_jobs.py). Fresh interpreters: torchrun
    starts every rank."""
    from bundled_jobs import largest_difference, launch, printed

    one = printed(launch(job, None, "--device", "cuda"))
    every = printed(launch(job, GPUS, "--device", "cuda"))
    assert largest_difference(every, one) <= FLOAT64_BOUND


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs; this machine has {GPUS}")
@pytest.mark.timeout(600)
def test_torchrun_check_of_fsdp2_on_two_gpus_names_the_unreduced_temperature(tmp_path):
    """``torchrun --nproc_per_node=2 -m gatherlab.check --step … --launcher external --device
    cuda`` on a model its factory shards with FSDP2 over the GPUs (NCCL): the temperature on the
    sharded root is exact; outside every sharded module it is named unreduced, as on gloo
    (tests/check/test_sharded.py). Fresh interpreters: torchrun starts every rank."""
    from helpers import pythonpath

    for model, status, cause in [("build_fsdp2_temperature_inside", 0, "nan"),
                                 ("build_fsdp2_temperature_outside", 1, "unreduced")]:  # fmt: skip
        out = tmp_path / model
        started = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
             "2", "-m", "gatherlab.check", "--step", "sharded_steps:temperature_step", "--model",
             f"sharded_steps:{model}", "--data", "plain_steps:Pairs", "--steps", "3",
             "--launcher", "external", "--device", "cuda", "--out", str(out)],
            cwd=tmp_path, env={**os.environ, "PYTHONPATH": pythonpath()}, capture_output=True,
            text=True, timeout=500,
        )  # fmt: skip
        assert started.returncode == status, started.stdout[-3000:] + started.stderr[-3000:]
        table = pd.read_csv(out / "check.csv")
        whole = table[(table["part"] == "all") & (table["removed"] == "none")].iloc[0]
        assert str(whole["cause"]) == cause, whole
        assert whole["max_abs_param_diff"] <= (1e-12 if status == 0 else float("inf"))
