"""A sentence-transformers job recorded as its users write it (``examples/jobs/st_job.py``: a small
random BERT ``SentenceTransformer``, a ``datasets.Dataset`` of text pairs, the
``SentenceTransformerTrainer``, one callback ``HFRecorder(DIR, loss=loss)``), on one process and
on two ranks under torchrun (gloo): the recordings agree and `gatherlab.compare` says ``exact``.
W = 4, the other losses, samplers, accumulation and the desync run in ``experiments/jobs.py``
(docs/jobs.md). Fresh interpreters: torchrun starts its ranks as processes of their own, and
accelerate's process-wide state (its ``PartialState``) must not outlive a test."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
from helpers import REPO, pythonpath

from gatherlab.compare import compare
from gatherlab.record import read
from gatherlab.recording.recorder import FLOOR_VARIABLE

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("sentence_transformers") is None,
        reason="needs the st extra: pip install 'gatherlab[st]'",
    ),
]

JOB = REPO / "examples" / "jobs" / "st_job.py"


def _start(out, world_size: int, *options: str, env: dict | None = None) -> subprocess.Popen:
    job = [str(JOB), "--record", str(out), *options]
    if world_size > 1:
        job = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
               *job]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": pythonpath(), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, *job], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def _printed(process: subprocess.Popen) -> list[float]:
    output, errors = process.communicate(timeout=110)
    assert process.returncode == 0, errors[-3000:]
    return [float(loss) for _, loss in re.findall(r"^update (\d+) loss (\S+)$", output, re.M)]


def test_a_gathered_mnrl_job_on_two_ranks_records_one_devices_updates(tmp_path):
    """MultipleNegativesRankingLoss with ``gather_across_devices=True``, 4 updates of 16 text
    pairs of different lengths, each device batch padded to its own longest, in float64: each
    update's rows are the two columns' (two calls of the model, 8 rows each per rank, 16 on one
    device), its loss is the loss module's (the trainer's float32 log of it, 1e-6), both ranks'
    rows together are one device's however they are padded, and the comparison is ``exact`` to
    float64 rounding, every part but BERT's pooler, which mean pooling never trains (``none``)."""
    processes = [_start(tmp_path / "w1", 1, "--dtype", "float64"),
                 _start(tmp_path / "w2", 2, "--dtype", "float64")]  # fmt: skip
    logged = [_printed(process) for process in processes]
    one, two = read(tmp_path / "w1"), read(tmp_path / "w2")
    assert one.parts == two.parts == ["0.model.embeddings", "0.model.encoder", "0.model.pooler"]
    assert one.header["hooks"] == "trainer" and one.precision == "64-true"
    for recording, losses in zip((one, two), logged, strict=True):
        assert [u.loss for u in recording.updates] == pytest.approx(losses, rel=1e-6)
    for a, b in zip(one.updates, two.updates, strict=True):
        assert a.calls == [2] and b.calls == [2, 2]
        assert sorted(a.rows[0]) == sorted(b.rows[0] + b.rows[1])
    comparison = compare(one, two)
    assert (comparison.verdict, comparison.status) == ("exact", 0), comparison.words
    table = comparison.table.set_index("part")
    assert table.loc["0.model.pooler", "gradient"] == "none"
    assert float(table.loc["all", "max_rel_err"]) <= 1e-12


def test_at_the_trainers_defaults_the_floor_is_recorded_by_the_same_command(tmp_path):
    """The job as its users run it, float32 and padded per device batch: the one-device command
    run again with GATHERLAB_RECORD_FLOOR records the floor (the callback's model, a
    SentenceTransformer returning a dict of rows, cut in two row blocks); without it the
    comparison is ``not judged`` and names that command, with it the gathered MNRL is ``exact
    within float32`` and the ungathered one departs by millions of floors."""
    env = {FLOOR_VARIABLE: str(tmp_path / "w1-floor")}
    processes = [_start(tmp_path / "w1", 1), _start(tmp_path / "w1", 1, env=env),
                 _start(tmp_path / "w2", 2),
                 _start(tmp_path / "local", 2, "--loss", "mnrl")]  # fmt: skip
    for process in processes:
        _printed(process)
    assert read(tmp_path / "w1").precision == "32-true"
    floor = read(tmp_path / "w1-floor")
    assert floor.header["row_blocks"] == 2 and floor.world_size == 1
    unfloored = compare(tmp_path / "w1", tmp_path / "w2")
    assert (unfloored.verdict, unfloored.status) == ("not judged", 3)
    assert f"GATHERLAB_RECORD_FLOOR={tmp_path / 'w1'}-floor " in unfloored.words
    judged = compare(tmp_path / "w1", tmp_path / "w2", floor=tmp_path / "w1-floor")
    assert (judged.verdict, judged.status) == ("exact within float32", 0), judged.words
    local = compare(tmp_path / "w1", tmp_path / "local", floor=tmp_path / "w1-floor")
    assert local.status == 1 and float(local.table.iloc[0]["floors"]) > 1e4, local.words


def test_a_missing_extra_is_one_line_with_the_install(monkeypatch, capsys):
    """Without sentence-transformers the job says what to install, before it builds anything."""
    spec = importlib.util.spec_from_file_location("st_job", JOB)
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    found = importlib.util.find_spec

    def without(name, *args):
        return None if name == "sentence_transformers" else found(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without)
    with pytest.raises(SystemExit) as stopped:
        job.main([])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (
        "st_job: needs sentence_transformers; install them with: pip install 'gatherlab[st]'\n"
    )
