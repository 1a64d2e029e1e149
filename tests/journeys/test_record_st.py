"""A sentence-transformers job recorded as its users write it (``examples/jobs/st_job.py``: a small
random BERT ``SentenceTransformer``, a ``datasets.Dataset`` of text pairs, the
``SentenceTransformerTrainer``, one callback ``HFRecorder(DIR, loss=loss)``), on one process and
on two ranks under torchrun (gloo): the recordings agree and `gatherlab.compare` says ``exact``.
W = 4, the other losses, samplers, accumulation and the desync run in ``experiments/jobs.py``
(docs/jobs.md). Fresh interpreters: torchrun starts its ranks as processes of their own, and
accelerate's process-wide state (its ``PartialState``) must not outlive a test in the test
process. Each process imports sentence-transformers (~10 s of CPU here), so the runs
(`trainer_jobs.ST_RUNS`) are made once for the session, with test_record_hf.py's, in one process
and one torchrun launch (`trainer_jobs.record`: each run as the job's script runs it, in turn;
each recording bit for bit a process's or launch's own)."""

from __future__ import annotations

import importlib.util

import pytest
from helpers import REPO

from gatherlab.compare import compare
from gatherlab.record import read

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("sentence_transformers") is None,
        reason="needs the st extra: pip install 'gatherlab[st]'",
    ),
]

JOB = REPO / "examples" / "jobs" / "st_job.py"


@pytest.fixture
def recordings(trainer_recordings) -> dict[str, tuple]:
    """name → (its recording's directory, the losses rank 0 printed) of every run of
    `trainer_jobs.ST_RUNS`, made once for the session beside the Hugging Face job's."""
    return trainer_recordings["st_job"]


@pytest.mark.timeout(420)  # the session's trainer runs (~10 s of CPU a process to import)
def test_a_gathered_mnrl_job_on_two_ranks_records_one_devices_updates(recordings):
    """MultipleNegativesRankingLoss with ``gather_across_devices=True``, 4 updates of 16 text
    pairs of different lengths, each device batch padded to its own longest, in float64: each
    update's rows are the two columns' (two calls of the model, 8 rows each per rank, 16 on one
    device), its loss is the loss module's (the trainer's float32 log of it, 1e-6), both ranks'
    rows together are one device's however they are padded, and the comparison is ``exact`` to
    float64 rounding, every part but BERT's pooler, which mean pooling never trains (``none``)."""
    (w1, one_logged), (w2, two_logged) = recordings["float64-w1"], recordings["float64-w2"]
    one, two = read(w1), read(w2)
    assert one.parts == two.parts == ["0.model.embeddings", "0.model.encoder", "0.model.pooler"]
    assert one.header["hooks"] == "trainer" and one.precision == "64-true"
    for recording, losses in zip((one, two), (one_logged, two_logged), strict=True):
        assert [u.loss for u in recording.updates] == pytest.approx(losses, rel=1e-6)
    for a, b in zip(one.updates, two.updates, strict=True):
        assert a.calls == [2] and b.calls == [2, 2]
        assert sorted(a.rows[0]) == sorted(b.rows[0] + b.rows[1])
    comparison = compare(one, two)
    assert (comparison.verdict, comparison.status) == ("exact", 0), comparison.words
    table = comparison.table.set_index("part")
    assert table.loc["0.model.pooler", "gradient"] == "none"
    assert float(table.loc["all", "max_rel_err"]) <= 1e-12


@pytest.mark.timeout(420)  # the session's trainer runs (~10 s of CPU a process to import)
def test_at_the_trainers_defaults_the_floor_is_recorded_by_the_same_command(recordings):
    """The job as its users run it, float32 and padded per device batch: the one-device command
    run again with GATHERLAB_RECORD_FLOOR records the floor (the callback's model, a
    SentenceTransformer returning a dict of rows, cut in two row blocks); without it the
    comparison is ``not judged`` and names that command, with it the gathered MNRL is ``exact
    within float32`` and the ungathered one departs by millions of floors."""
    w1, w2, floor, local = (recordings[name][0] for name in ("w1", "w2", "w1-floor", "local"))
    assert read(w1).precision == "32-true"
    floored = read(floor)
    assert floored.header["row_blocks"] == 2 and floored.world_size == 1
    unfloored = compare(w1, w2)
    assert (unfloored.verdict, unfloored.status) == ("not judged", 3)
    # its floor recorded where the command would record it: named, never recorded over
    assert f"A's floor in 2 row blocks is recorded in {w1}-floor; compare again" in unfloored.words
    judged = compare(w1, w2, floor=floor)
    assert (judged.verdict, judged.status) == ("exact within float32", 0), judged.words
    local = compare(w1, local, floor=floor)
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
