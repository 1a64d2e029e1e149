"""The trainer jobs' runs that ``tests/journeys/test_record_hf.py`` and ``test_record_st.py`` read
(``examples/jobs/hf_job.py``, a Hugging Face ``Trainer``; ``examples/jobs/st_job.py``, a
``SentenceTransformerTrainer``; each with its one callback), made once per test session
(``conftest.py``: ``trainer_recordings``): every one-process run in one plain process and every
two-rank run in one torchrun launch (`bundled_jobs.start_together`: each run as its script runs
it, in turn, its process group and accelerate's process-wide state its own). Each process imports
sentence-transformers and transformers' Trainer (~10 s of CPU here), so the two files' runs share
the processes that one file's runs had (three processes and one torchrun agent fewer: ~27 s of
CPU); every recording is the one a launch of its own makes, bit for bit (compared once, file by
file)."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from bundled_jobs import finish_together, start_together
from helpers import pythonpath

from gatherlab.recording.record_options import FLOOR_VARIABLE

HF_MAX_GRAD_NORM = 0.2
"""The Hugging Face job's clipping in every run (below the gradient's norm at the start, which
test_record_hf.py asserts: the Trainer clips)."""

HF_RUNS = {  # name → (world size, the job's options, a variable set for it)
    "exact-w1": (1, ("--steps", "10", "--dtype", "float64", "--mean-loss"), None),
    "w1": (1, ("--max-grad-norm", "0"), None),
    "w1-floor": (1, ("--max-grad-norm", "0"), FLOOR_VARIABLE),  # w1's command, and the variable
    "exact-w2": (2, ("--steps", "10", "--accumulation", "2", "--dtype", "float64", "--mean-loss"),
                 None),
    "w2": (2, ("--max-grad-norm", "0"), None),
}  # fmt: skip
"""``hf_job``'s runs: exact, W = 1 with one micro-batch and W = 2 with two, and at the Trainer's
defaults without clipping (each command ``hf_job.py --record DIR --max-grad-norm
HF_MAX_GRAD_NORM OPTIONS``; the floor's: w1's, recorded into ``w1-floor``)."""

ST_RUNS = {  # name → (world size, the job's options, a variable set for it)
    "float64-w1": (1, ("--dtype", "float64"), None),
    "w1": (1, (), None),
    "w1-floor": (1, (), FLOOR_VARIABLE),  # w1's command, and the floor's variable
    "float64-w2": (2, ("--dtype", "float64"), None),
    "w2": (2, (), None),
    "local": (2, ("--loss", "mnrl"), None),
}
"""``st_job``'s runs: in float64 and at the trainer's defaults (each command ``st_job.py --record
DIR OPTIONS``; the floor's: w1's, recorded into ``w1-floor``)."""


def _runs() -> dict[str, dict[str, tuple]]:
    """job → its runs, of the jobs whose extra is installed."""
    runs = {"hf_job": HF_RUNS} if importlib.util.find_spec("transformers") else {}
    if importlib.util.find_spec("sentence_transformers"):
        runs["st_job"] = ST_RUNS
    return runs


def record(root: Path) -> dict[str, dict[str, tuple[str, list[float]]]]:
    """job (``hf_job``, ``st_job``) → name → (its recording's directory, the losses rank 0
    printed), every run of `HF_RUNS` and `ST_RUNS` made under ``root``: the one-process runs in
    one process and the two-rank runs in one torchrun launch, both started before either is
    waited for."""
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    extra = {"hf_job": ("--max-grad-norm", str(HF_MAX_GRAD_NORM)), "st_job": ()}
    runs = [(job, name, spec) for job, named in _runs().items() for name, spec in named.items()]

    def command(job, name, spec):
        out = root / job / name.removesuffix("-floor")
        return (job, "--record", str(out), *extra[job], *spec[1])

    def variables(job, name, spec):
        return {spec[2]: str(root / job / name)} if spec[2] else {}

    started = []
    for world_size in (1, 2):
        these = [run for run in runs if run[2][0] == world_size]
        process = start_together(world_size if world_size > 1 else None,
                                 [command(*run) for run in these],
                                 [variables(*run) for run in these], env=env)  # fmt: skip
        started.append((these, process))
    recorded = {job: {} for job in _runs()}
    for these, process in started:
        finished = finish_together(process, [command(*run) for run in these])
        for (job, name, _), result in zip(these, finished, strict=True):
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
            losses = re.findall(r"^update (\d+) loss (\S+)$", result.stdout, re.M)
            recorded[job][name] = (str(root / job / name), [float(loss) for _, loss in losses])
    return recorded
