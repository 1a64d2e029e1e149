"""The bundled jobs of ``examples/jobs/`` launched as a user launches them, for the tests that
run them (``tests/journeys/test_jobs.py`` on CPU gloo, ``tests/journeys/test_gpu.py`` on NCCL):
plainly for one device, or under torchrun on a free port; what rank 0 printed, parsed. The
one-device run can also run in the test process (`run_plainly`), where the session has imported
torch and Lightning already, and several runs at one W can share one launch
(`start_together`, this file run as the ranks' script)."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from gatherlab.ranks.ports import unclaimed_port

JOBS = Path(__file__).resolve().parents[2] / "examples" / "jobs"
LAUNCH_TIMEOUT = 150  # seconds per launch: four ranks importing torch on two loaded cores
RUN_MARK = "--- bundled_jobs run"  # the line before each run's output in `start_together`


def launch(job: str, world_size: int | None, *arguments: str) -> subprocess.CompletedProcess:
    """``python JOB ARGUMENTS`` (``world_size`` None: one device) or torchrun with W ranks on a
    free port, one torch thread per process; what it printed, its exit status."""
    [finished] = launch_together(world_size, [(job, *arguments)])
    return finished


def start_together(
    world_size: int | None,
    runs: list[tuple[str, ...]],
    environments: list[dict[str, str]] | None = None,
    **popen,
) -> subprocess.Popen:
    """Runs of the bundled jobs in one launch (each run a job's name and its arguments, as
    ``launch`` takes them; ``environments``: variables set for each run alone), started: under
    torchrun at ``world_size`` on a free port or, None, as one plain process, one torch thread
    per process. One run is its job's script. Several: in every rank, each run as its script
    runs it, in turn (this file the ranks' script, `_run_together`): each builds its own process
    group and leaves it, as in a launch of its own, and its recording and what it prints are that
    launch's, bit for bit (every run of tests/journeys/test_jobs.py, test_record_hf.py and
    test_record_st.py compared once). A launch costs torchrun's agent and torch's import in every
    rank (~3 s of CPU each here, with a trainer's and sentence-transformers' ~8 s), so runs that
    need no launch of their own share one. ``popen``: Popen's options (``env`` added to)."""
    environments = environments or [{} for _ in runs]
    env = {**popen.pop("env", os.environ), "OMP_NUM_THREADS": "1"}
    if len(runs) == 1:
        [(job, *arguments)] = runs
        command = [sys.executable, str(JOBS / f"{job}.py"), *arguments]
        env |= environments[0]
    else:
        command = [sys.executable, __file__, json.dumps(runs), json.dumps(environments)]
    if world_size is not None:
        command[1:1] = ["-m", "torch.distributed.run", "--nproc-per-node", str(world_size),
                        "--master-addr", "127.0.0.1", "--master-port",
                        str(unclaimed_port())]  # fmt: skip
    options = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True} | popen
    return subprocess.Popen(command, env=env, **options)


def finish_together(
    process: subprocess.Popen, runs: list[tuple[str, ...]]
) -> list[subprocess.CompletedProcess]:
    """Per run of `start_together`'s launch, what rank 0 printed for it; the launch's exit status
    and standard error are every run's (a hang fails here, with what was printed)."""
    stdout, stderr = process.communicate(timeout=LAUNCH_TIMEOUT + 30 * len(runs))
    printed = {0: stdout} if len(runs) == 1 else dict.fromkeys(range(len(runs)), "")
    for part in re.split(f"^{RUN_MARK} ", stdout, flags=re.M)[1:]:
        number, _, text = part.partition("\n")
        printed[int(number)] = text
    return [subprocess.CompletedProcess(run, process.returncode, printed[number], stderr)
            for number, run in enumerate(runs)]  # fmt: skip


def launch_together(
    world_size: int | None, runs: list[tuple[str, ...]]
) -> list[subprocess.CompletedProcess]:
    """`start_together`, then `finish_together`."""
    return finish_together(start_together(world_size, runs), runs)


def _run_together(runs: list[list[str]], environments: list[dict[str, str]]) -> None:
    """The ranks' side of `start_together`: each run as its script runs it, in turn (its
    variables set for it alone): the job's ``main``, then what its script does after it
    (``leave_group`` for the trainer jobs, ``common.finish`` for the others: the process group
    left by every rank together), then what a new process would not hold either is dropped
    (accelerate's process-wide state). So each run builds its own process group: on torchrun's
    one store, under keys of its own (`_group_of_its_own`)."""
    sys.path.insert(0, str(JOBS))
    import torch.distributed as dist

    init_process_group = dist.init_process_group
    for number, (job, *arguments) in enumerate(runs):
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"{RUN_MARK} {number}", flush=True)
        environment = environments[number]
        os.environ.update(environment)
        sys.argv = [str(JOBS / f"{job}.py"), *arguments]
        module = importlib.import_module(job)
        dist.init_process_group = _group_of_its_own(init_process_group, number)
        module.main()
        if hasattr(module, "leave_group"):
            module.leave_group()
        else:
            importlib.import_module("common").finish()
        for name in environment:
            del os.environ[name]
        if "accelerate" in sys.modules:  # made once per process by the trainer (PartialState)
            from accelerate.state import AcceleratorState, GradientState

            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()


def _group_of_its_own(init_process_group, number: int):
    """``init_process_group`` for a process's ``number``-th run: the first as it is; a later one
    on torchrun's store under a prefix of its own (a group made again on the same store under the
    same keys may read its peers' addresses from the last group: a rank then reached a closed
    one, "Connection reset by peer", here)."""
    import torch.distributed as dist

    if number == 0:
        return init_process_group

    def init(*arguments, **options):
        if options.get("store") is None:
            store, rank, world_size = next(dist.rendezvous(options.pop("init_method", "env://")))
            options |= {"store": dist.PrefixStore(f"run {number}/", store), "rank": rank,
                        "world_size": world_size}  # fmt: skip
        return init_process_group(*arguments, **options)

    return init


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


if __name__ == "__main__":  # the ranks of `start_together`
    _run_together(json.loads(sys.argv[1]), json.loads(sys.argv[2]))
