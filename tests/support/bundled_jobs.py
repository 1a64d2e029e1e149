"""The bundled jobs of ``examples/jobs/`` launched as a user launches them, for the tests that
run them (``tests/journeys/test_jobs.py`` on CPU gloo, ``tests/journeys/test_gpu.py`` on NCCL):
plainly for one device, or under torchrun on a free port; what rank 0 printed, parsed. The
one-device run can also run in the test process (`run_plainly`), where the session has imported
torch and Lightning already."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import random
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

JOBS = Path(__file__).resolve().parents[2] / "examples" / "jobs"
LAUNCH_TIMEOUT = 150  # seconds per launch: four ranks importing torch on two loaded cores


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(job: str, world_size: int | None, *arguments: str) -> subprocess.CompletedProcess:
    """``python JOB`` (``world_size`` None: one device) or torchrun with W ranks on a free port."""
    script = str(JOBS / f"{job}.py")
    if world_size is None:
        command = [sys.executable, script]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                   str(world_size), "--master-addr", "127.0.0.1", "--master-port",
                   str(free_port()), script]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*command, *arguments], capture_output=True, text=True, env=env,
                          timeout=LAUNCH_TIMEOUT)  # fmt: skip


def run_plainly(job: str, *arguments: str) -> subprocess.CompletedProcess:
    """``python JOB ARGUMENTS`` for one device (no process group), in this process: the job's
    ``main`` with that command line and one torch thread, as ``launch`` runs it
    (``OMP_NUM_THREADS=1``); what it printed, its exit status. This process must hold no process
    group and no torchrun variables (the job would take them for its launch); its environment and
    global random states are as they were afterwards (Lightning's ``seed_everything`` sets both)."""
    import torch
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized()), "a process group in this process"
    assert not {"RANK", "WORLD_SIZE"} & set(os.environ), "torchrun's variables in this process"
    stdout, stderr, returncode = io.StringIO(), io.StringIO(), 0
    environment, threads = dict(os.environ), torch.get_num_threads()
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    sys.path.insert(0, str(JOBS))
    argv, sys.argv = sys.argv, [f"{job}.py", *arguments]
    try:
        torch.set_num_threads(1)
        main = importlib.import_module(job).main
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                main()
            except SystemExit as exit:
                returncode = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
    finally:
        sys.argv = argv
        sys.path.remove(str(JOBS))
        torch.set_num_threads(threads)
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        os.environ.clear()
        os.environ.update(environment)
    return subprocess.CompletedProcess([job, *arguments], returncode, stdout.getvalue(),
                                       stderr.getvalue())  # fmt: skip


SIMCLR_PARTS = ("backbone", "head", "loss.log_temperature")
"""The parts whose weights the jobs of ``common.py``'s SimCLR model print."""


def printed(
    result: subprocess.CompletedProcess, parts: tuple[str, ...] = SIMCLR_PARTS
) -> tuple[list[float], dict[str, float]]:
    """The losses of the updates in order and the final weights' norms per part (``parts``, in
    order), as rank 0 printed them; the job must have succeeded."""
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    updates = re.findall(r"^update (\d+) loss (\S+)$", result.stdout, re.M)
    assert [int(u) for u, _ in updates] == list(range(5)), result.stdout[-2000:]
    weights = dict(re.findall(r"^weights (\S+) (\S+)$", result.stdout, re.M))
    assert list(weights) == list(parts)
    return [float(loss) for _, loss in updates], {k: float(v) for k, v in weights.items()}


def largest_difference(run, reference) -> float:
    (losses, weights), (reference_losses, reference_weights) = run, reference
    return max(
        *(abs(a - b) for a, b in zip(losses, reference_losses, strict=True)),
        *(abs(weights[part] - reference_weights[part]) for part in reference_weights),
    )
