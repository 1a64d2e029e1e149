"""The recorder's refusals where a job runs (docs/recording.md §11, "Refusals"): one line, said
once, inside a trainer's callback and in torchrun's ranks alike; no trainer's traceback and no
torchrun failure summary. A job under plain ``python`` ends with exit status 2; torchrun's ranks end
with status 0, since its agent answers any other with its summary (`recording.refusal`). Fresh
interpreters: torchrun starts its ranks as processes of their own, which is what is tested.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from bundled_jobs import run_plainly
from helpers import REPO, pythonpath

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("sentence_transformers") is None,
        reason="needs the st extra: pip install 'gatherlab[st]'",
    ),
]

JOBS = REPO / "examples" / "jobs"
NO_LOSS_JOB = """\
import gatherlab.record
import st_job

real = gatherlab.record.HFRecorder


def without_loss(out, loss=None, **options):  # the callback without its loss= (the user's slip)
    return real(out, **options)


gatherlab.record.HFRecorder = without_loss
st_job.main(["--steps", "2", "--record", OUT])
"""


def _run(command: list[str], world_size: int, env: dict | None = None, cwd=None):
    if world_size:
        command = ["-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={world_size}", *command]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([pythonpath(), str(JOBS)]),
           "OMP_NUM_THREADS": "1", **(env or {})}  # fmt: skip
    return subprocess.run([sys.executable, *command], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def _one_line(finished: subprocess.CompletedProcess, status: int) -> str:
    """The one line the recorder said; nothing else of a failure printed."""
    printed = finished.stdout + finished.stderr
    assert finished.returncode == status, printed[-3000:]
    assert "Traceback" not in printed and "ChildFailedError" not in printed, printed[-3000:]
    said = [line for line in printed.splitlines() if line.startswith("gatherlab.record:")]
    assert len(said) == 1, printed[-3000:]
    return said[0]


@pytest.mark.parametrize("world_size", [0, 2])
def test_a_trainer_callbacks_refusal_in_torchruns_ranks_and_alone_is_one_line(tmp_path, world_size):
    """A sentence-transformers job whose HFRecorder lacks ``loss=``: the model's output carries no
    loss, refused at the first forward inside the Trainer, before any step; under torchrun at
    W = 2 (0: plain python) and with no traceback of the Trainer's."""
    job = tmp_path / "job.py"
    job.write_text(NO_LOSS_JOB.replace("OUT", repr(str(tmp_path / "run"))))
    finished = _run([str(job)], world_size, cwd=tmp_path)
    line = _one_line(finished, 2 if not world_size else 0)
    assert line.startswith("gatherlab.record: HFRecorder saw no loss in the model's first")


def test_a_floor_asked_of_torchruns_ranks_and_a_directory_taken_are_one_line_each(tmp_path):
    """The floor's variable under torchrun at W = 2 (a floor is one device's run), and a
    directory that holds a recording already, each one line before the first update (the DDP
    job: torch's import alone per rank). The one-device command (``python ddp.py``: no launcher,
    no process group) runs its ``main`` in this process (`bundled_jobs.run_plainly`: its exit
    status and what it printed; a fresh interpreter would add only its imports)."""
    job = ["--steps", "1", "--record", str(tmp_path / "run")]
    floor = {"GATHERLAB_RECORD_FLOOR": str(tmp_path / "floor")}
    line = _one_line(_run([str(JOBS / "ddp.py"), *job], 2, env=floor), 0)
    assert line == (f"gatherlab.record: GATHERLAB_RECORD_FLOOR={tmp_path / 'floor'}: a floor is "
                    "one device's run, and this job runs on 2 ranks; allowed: the job's "
                    "one-device command (python, or torchrun --nproc-per-node 1) with the "
                    "variable")  # fmt: skip
    assert not (tmp_path / "floor").exists() and not (tmp_path / "run").exists()
    assert run_plainly("ddp", *job).returncode == 0  # one device records
    line = _one_line(_run([str(JOBS / "ddp.py"), *job], 2), 0)
    assert line == (f"gatherlab.record: {tmp_path / 'run'} already holds a recording: give each "
                    "run its own directory")  # fmt: skip
    assert _one_line(run_plainly("ddp", *job), 2) == line


ONE_RANK_ATTACHES = """\
import torch
import torch.distributed as dist

import gatherlab.record
from gatherlab.recording import recorder

recorder.ATTACH_TIMEOUT_S = 3.0
dist.init_process_group("gloo")
model = torch.nn.Linear(2, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
if dist.get_rank() == 0:  # the user's slip: the one line on rank 0 alone
    gatherlab.record(model, optimizer, DIRECTORY)
dist.all_reduce(torch.ones(1))  # rank 1's own collective, as DDP's first backward makes
"""


def test_a_recorder_attached_on_one_rank_alone_is_said_in_one_line_not_a_hang(tmp_path):
    """A user's recorder attached on rank 0 alone met rank 1's own collective (DDP's), and both
    waited for ever with nothing said. The recorders' first act is gloo's bounded barrier: after
    `recorder.ATTACH_TIMEOUT_S` (3 s here) rank 0 names the rank that did not attach, in one line,
    and ends; rank 1's own collective then fails as any job's does when a peer leaves. Fresh
    interpreters: the wait and the end are the processes' own."""
    script = tmp_path / "one_rank.py"
    script.write_text(ONE_RANK_ATTACHES.replace("DIRECTORY", repr(str(tmp_path / "out"))))
    finished = _run([str(script)], world_size=2)
    printed = finished.stdout + finished.stderr
    said = [line for line in printed.splitlines() if line.startswith("gatherlab.record:")]
    assert said == [
        "gatherlab.record: rank 0's recorder waited 3 s for the other ranks' (RuntimeError: "
        "[Rank 0]: Ranks 1 failed to pass monitoredBarrier in 3000 ms); allowed: "
        "gatherlab.record on every rank, the one documented line run by each"
    ], printed[-3000:]
    assert finished.returncode != 0 and not (tmp_path / "out").exists()
