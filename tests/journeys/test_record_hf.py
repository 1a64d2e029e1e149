"""A Hugging Face ``Trainer`` job recorded with one callback (`gatherlab.record.HFRecorder`),
``examples/jobs/hf_job.py`` as a user runs it: one process, and two ranks under torchrun on gloo.

The jobs run in fresh interpreters: torchrun starts its ranks as processes of their own, and the
one-process job too, so that accelerate's process-wide state (its ``PartialState``, made once per
process) never outlives a test in the test process. The two run side by side (~10 s each here).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import REPO, pythonpath

from gatherlab.compare import compare
from gatherlab.record import read
from gatherlab.recording.recorder import FLOOR_VARIABLE
from gatherlab.recording.rows import row_digests

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("transformers") is None,
        reason="needs the hf extra: pip install 'gatherlab[hf]'",
    ),
]

JOB = REPO / "examples" / "jobs" / "hf_job.py"
MAX_GRAD_NORM = 0.2  # below the gradient's norm at the start (asserted): the Trainer clips


def _job_module():
    """examples/jobs/hf_job.py as a module (its model, tokenizer and data set)."""
    sys.path.insert(0, str(JOB.parent))  # it imports st_job's tokenizer beside it
    spec = importlib.util.spec_from_file_location("hf_job", JOB)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _start(out, world_size: int, *options: str, env: dict | None = None) -> subprocess.Popen:
    job = [str(JOB), "--record", str(out), "--max-grad-norm", str(MAX_GRAD_NORM), *options]
    if world_size > 1:
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}"]
        job = launcher + job
    env = {**os.environ, "PYTHONPATH": pythonpath(), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(
        [sys.executable, *job], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _finish(process: subprocess.Popen) -> None:
    output, _ = process.communicate(timeout=110)
    assert process.returncode == 0, output[-3000:]


def test_one_process_and_two_ranks_under_torchrun_record_the_same_updates(tmp_path):
    """W = 1 with one micro-batch, W = 2 with two (``gradient_accumulation_steps``), float64,
    the Trainer told the model's loss is its rows' mean (``--mean-loss``): the same global
    batches (accelerate gives rank r the r-th of every W per-rank batches of one seeded sampler;
    with two micro-batches rank 0's
    rows of an update are the first and third quarter of one device's), each text a row however
    its device batch pads it, in the first epoch and the second, the same global loss, the same
    sketch of each part's gradient, to float64 rounding, and `gatherlab.compare` judges the two
    ``exact``. The one-process recording's first update is computed here by hand from the texts
    its rows name (each text tokenized alone, unpadded): the mean cross-entropy of those rows at
    the initial weights and its gradient, scaled as ``torch.nn.utils.clip_grad_norm_`` does."""
    steps = 10  # 64 texts, 8 a global batch: the second epoch from update 8, reseeded alike
    exact = ("--dtype", "float64", "--mean-loss")
    processes = [
        _start(tmp_path / "w1", 1, "--steps", str(steps), *exact),
        _start(tmp_path / "w2", 2, "--steps", str(steps), "--accumulation", "2", *exact),
    ]
    for process in processes:
        _finish(process)
    one, two = read(tmp_path / "w1"), read(tmp_path / "w2")
    assert (one.world_size, two.world_size) == (1, 2)
    assert one.parts == two.parts == ["bert", "classifier"]
    assert one.header["precision"] == "64-true" and one.header["seed"] == 0
    assert one.header["settings"]["max_grad_norm"] == MAX_GRAD_NORM
    assert len(one.updates) == len(two.updates) == steps
    for a, b in zip(one.updates, two.updates, strict=True):
        assert len(a.rows[0]) == 8 and [len(rows) for rows in b.rows] == [4, 4]
        quarters = [a.rows[0][i : i + 2] for i in range(0, 8, 2)]
        assert b.rows == [quarters[0] + quarters[2], quarters[1] + quarters[3]]
        assert b.unreduced == {}
        assert abs(a.loss - b.loss) <= 1e-10 * abs(a.loss)
        for part in one.parts:
            scale = float(np.abs(a.sketches[part]).max())
            assert float(np.abs(a.sketches[part] - b.sketches[part]).max()) <= 1e-10 * scale
    comparison = compare(one, two)  # python -m gatherlab.compare's judgement of the same
    assert (comparison.verdict, comparison.status, comparison.data) == ("exact", 0, None), (
        comparison.words
    )

    from transformers import DataCollatorWithPadding

    job = _job_module()
    words = job.tokenizer(str(tmp_path / "tokenizer"))
    texts = job.Texts(words)
    index_of = {row_digests(torch.tensor([item["input_ids"]]))[0]: i
                for i, item in enumerate(texts.items)}  # fmt: skip
    rows = [index_of[digest] for digest in one.updates[0].rows[0]]
    batch = DataCollatorWithPadding(words)([texts[i] for i in rows])
    model = job.classifier(0, "float64")  # the job's seed: its initial weights
    loss = model(**batch).loss
    loss.backward()
    gradient = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    norm = float(torch.linalg.vector_norm(gradient))
    assert norm > 2 * MAX_GRAD_NORM  # the clipping is not a no-op
    expected = gradient * min(1.0, MAX_GRAD_NORM / (norm + 1e-6))
    assert one.updates[0].loss == pytest.approx(float(loss.detach()), rel=1e-14)
    recorded = one.full_gradient(0)
    recorded = recorded[recorded != 0] if len(recorded) != len(expected) else recorded
    assert float((recorded - expected).abs().max()) <= 1e-12 * float(expected.abs().max())


def test_at_the_trainers_defaults_two_ranks_step_on_w_times_the_gradient(tmp_path):
    """The Trainer's defaults (float32, ``average_tokens_across_devices=True``), judged in floors
    of the floor the one-device command records with GATHERLAB_RECORD_FLOOR (the callback's
    model cut in row blocks, its loss joined as the rows' mean): two ranks' gradient is W = 2
    times one device's (norm ratio 2 to float32's rounding, ``--max-grad-norm 0``), millions of
    floors; the floor itself is one device's to a few unit roundoffs."""
    env = {FLOOR_VARIABLE: str(tmp_path / "w1-floor")}
    processes = [
        _start(tmp_path / "w1", 1, "--max-grad-norm", "0"),
        _start(tmp_path / "w1", 1, "--max-grad-norm", "0", env=env),
        _start(tmp_path / "w2", 2, "--max-grad-norm", "0"),
    ]
    for process in processes:
        _finish(process)
    floor = read(tmp_path / "w1-floor")
    assert floor.header["row_blocks"] == 2 and floor.precision == "32-true"
    comparison = compare(tmp_path / "w1", tmp_path / "w2", floor=tmp_path / "w1-floor")
    head = comparison.table.iloc[0]
    assert (head["gradient"], comparison.status) == ("W", 1), comparison.words
    assert abs(float(head["norm_ratio"]) - 2) <= 1e-5 and float(head["floors"]) > 1e5


def test_gatherlab_record_imports_without_transformers_and_says_how_to_get_it():
    """``import gatherlab.record`` does not import transformers; without it, asking for
    ``HFRecorder`` fails with the extra to install (a fresh interpreter, where transformers is
    made unimportable)."""
    code = (
        "import sys\n"
        "import gatherlab.record\n"
        "assert 'transformers' not in sys.modules, 'imported transformers'\n"
        "sys.modules['transformers'] = None\n"
        "try:\n"
        "    gatherlab.record.HFRecorder\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    finished = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert "install them with: pip install 'gatherlab[hf]'" in finished.stdout
