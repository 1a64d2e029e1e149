"""A Hugging Face ``Trainer`` job recorded with one callback (`gatherlab.record.HFRecorder`),
``examples/jobs/hf_job.py`` as a user runs it: one process, and two ranks under torchrun on gloo.

The jobs run in fresh interpreters: torchrun starts its ranks as processes of their own, and the
one-process job too, so that accelerate's process-wide state (its ``PartialState``, made once per
process) never outlives a test in the test process. Each process imports transformers' Trainer
(~8 s of CPU here), so the runs (`trainer_jobs.HF_RUNS`) are made once for the session, with
test_record_st.py's, in one process and one torchrun launch (`trainer_jobs.record`: each job's
``main`` in turn; the same recordings, bit for bit, as a process or launch each).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import REPO, pythonpath
from trainer_jobs import HF_MAX_GRAD_NORM

from gatherlab.compare import compare
from gatherlab.record import read
from gatherlab.recording.rows import row_digests

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("transformers") is None,
        reason="needs the hf extra: pip install 'gatherlab[hf]'",
    ),
]

JOB = REPO / "examples" / "jobs" / "hf_job.py"


def _job_module():
    """examples/jobs/hf_job.py as a module (its model, tokenizer and data set)."""
    sys.path.insert(0, str(JOB.parent))  # it imports st_job's tokenizer beside it
    spec = importlib.util.spec_from_file_location("hf_job", JOB)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def recordings(trainer_recordings) -> dict[str, Path]:
    """name → its recording's directory, of every run of `trainer_jobs.HF_RUNS`, made once for
    the session beside the sentence-transformers job's."""
    return {name: out for name, (out, _) in trainer_recordings["hf_job"].items()}


@pytest.mark.timeout(420)  # the session's trainer runs (~10 s of CPU a process to import)
def test_one_process_and_two_ranks_under_torchrun_record_the_same_updates(recordings, tmp_path):
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
    one, two = read(recordings["exact-w1"]), read(recordings["exact-w2"])
    assert (one.world_size, two.world_size) == (1, 2)
    assert one.parts == two.parts == ["bert", "classifier"]
    assert one.header["precision"] == "64-true" and one.header["seed"] == 0
    assert one.header["settings"]["max_grad_norm"] == HF_MAX_GRAD_NORM
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
    assert norm > 2 * HF_MAX_GRAD_NORM  # the clipping is not a no-op
    expected = gradient * min(1.0, HF_MAX_GRAD_NORM / (norm + 1e-6))
    assert one.updates[0].loss == pytest.approx(float(loss.detach()), rel=1e-14)
    recorded = one.full_gradient(0)
    recorded = recorded[recorded != 0] if len(recorded) != len(expected) else recorded
    assert float((recorded - expected).abs().max()) <= 1e-12 * float(expected.abs().max())


@pytest.mark.timeout(420)  # the session's trainer runs (~10 s of CPU a process to import)
def test_at_the_trainers_defaults_two_ranks_step_on_w_times_the_gradient(recordings):
    """The Trainer's defaults (float32, ``average_tokens_across_devices=True``), judged in floors
    of the floor the one-device command records with GATHERLAB_RECORD_FLOOR (the callback's
    model cut in row blocks, its loss joined as the rows' mean): two ranks' gradient is W = 2
    times one device's (norm ratio 2 to float32's rounding, ``--max-grad-norm 0``), millions of
    floors; the floor itself is one device's to a few unit roundoffs."""
    w1, w2, floor = (recordings[name] for name in ("w1", "w2", "w1-floor"))
    floored = read(floor)
    assert floored.header["row_blocks"] == 2 and floored.precision == "32-true"
    comparison = compare(w1, w2, floor=floor)
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
