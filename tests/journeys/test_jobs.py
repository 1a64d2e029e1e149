"""The bundled jobs (``examples/jobs/``: a plain DDP loop, a Lightning ``Trainer``, FSDP2's
``fully_shard``, ``ZeroRedundancyOptimizer``, tensor and sequence parallelism with
``parallelize_module``) as a user runs them: plainly for one device (no
process group) and under ``torchrun --nproc-per-node W`` on CPU gloo. Correct, each trains at
its W (`WORLD_SIZES`) exactly as one device does in float64 (every update's printed global loss
and the final weights' norms, to the float64 bound) and ``gatherlab.compare`` finds their
recordings exact; each
bug switch moves some update's loss or a final weight by at least 100 times that bound, and the
comparison names it: its verdict, its first update and part, its cause.

These tests start fresh interpreters on purpose: torchrun starting the job's ranks, each process
building its own process group, is what they test (docs/testing.md, "Tests that start a fresh
interpreter"). Each launch costs torch's import on every rank and in torchrun's agent (and
Lightning's in its job), so each run is made once and serves every test of it (a module-scoped
cache of the runs and their recordings), every job runs 5 updates of a tiny model, each correct
job and each bug switch runs where its code differs (`BUGS`, `WORLD_SIZES`;
``experiments/jobs.py`` runs the whole matrix), and the runs at one W share one launch
(`TOGETHER`, `bundled_jobs.launch_together`: each job in turn in the ranks torchrun started, as
its script runs it, building and leaving its own process group; the same numbers, bit for bit,
as a launch each). The one-device runs, which
no launcher starts and which hold no process group, run the job's ``main`` in the test process
instead (`bundled_jobs.run_plainly`, one torch thread as a launch has): a fresh interpreter would
add only its imports (3.4 s here, Lightning's job 8 s)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from bounds import FLOAT64_BOUND, MISS_FACTOR
from bundled_jobs import (
    LAUNCH_TIMEOUT,
    SIMCLR_PARTS,
    largest_difference,
    launch_together,
    printed,
    run_plainly,
)

import gatherlab.compare as compare
from gatherlab.recording.recorder import FLOOR_BLOCKS_VARIABLE, FLOOR_VARIABLE

pytestmark = pytest.mark.slow

BUGS = {
    "ddp": ("old-gather", "sampler", "temperature-outside", "divide-twice"),
    "fsdp2": ("local-batchnorm", "temperature-outside"),
    "zero": ("temperature-outside",),
    "lightning_job": (),
    "tp": ("unreduced-norm", "local-logits", "whole-sequence", "same-dropout"),
    "pp": ("unscaled", "untied", "ragged"),
    "ep": ("averaged", "local-balance"),
    "hf_tp": ("clip-per-mesh",),
}
"""The switches tested per job, each once where its code is: ``common.py``'s on ``ddp`` (the
gather, the sampler) or in a sharded module (the batch norm); each job's own temperature
placement; the division, the same line in every loop, on ``ddp``. Lightning's own switches (its
sampler, which Lightning replaces by a DistributedSampler) cost a Lightning import per rank
(~7 s each here) and run in ``experiments/jobs.py``, with every job × W = 1, 2, 4 × switch
(docs/jobs.md)."""

WORLD_SIZES = {"ddp": (4,), "fsdp2": (4,), "zero": (2,), "lightning_job": (2,), "tp": (4,),
               "pp": (2,), "ep": (2,), "hf_tp": (2, 4)}  # fmt: skip
"""The world size each correct job is launched at (their bug switches run at 2; FSDP2's shards
uneven at 4; ``tp`` at 4, dp 2 × tp 2 with its default ``--tp 2``, FSDP2 over tensor parallelism,
its switches at tp = 2 alone; ``pp`` and ``ep`` at 2 in float32, and at 4, dp 2 × pp 2 and one
expert per rank, in float64, `FLOAT64`, number by number; docs/jobs.md has them at 4 in
float32); the recorder under DDP, FSDP2 and ZeRO at W = 2 and 4 is tested on the pool
(tests/recording/test_recorder.py), under tensor parallelism at tp = 2 and dp 2 × tp 2 in
tests/recording/test_placed.py."""

PARTS = {
    "tp": ("attn_norm", "attn", "mlp_norm", "mlp", "norm", "head"),
    "pp": ("emb", "position", "layers", "norm"),
    "ep": ("emb", "position", "attn_norm", "qkv", "out", "moe_norm", "moe", "norm", "head"),
    "hf_tp": ("model", "lm_head"),
}
"""The parts whose final weights a job prints, where they are not SimCLR's."""

FLOAT32 = ("pp", "ep")
"""The jobs that train in float32 at their defaults, as their users run them (pipeline and expert
parallelism): judged in floors of their floor recording (the one-device command run again with
``GATHERLAB_RECORD_FLOOR``), not to float64's bound."""
FLOORED = (*FLOAT32, "hf_tp")
"""The jobs judged in floors: `FLOAT32`'s, and transformers' own tensor parallelism at its
defaults (float32; transformers computes its loss in float32 whatever the parameters' dtype, so
that its float64 run at dp 2 × tp 2 is not one device's number by number)."""
FLOOR_BLOCKS = 4
"""The floor's row blocks: as many as the most ranks these jobs run on (and as a 2-stage
pipeline's 4 micro-batches), so that T is 5 (design §2, "Low precision")."""


FIRST_PART = {"ddp": "backbone", "fsdp2": "backbone", "zero": "backbone", "lightning_job": "model",
              "tp": "attn_norm", "pp": "emb", "ep": "emb", "hf_tp": "model"}  # fmt: skip
"""The first part of each job's model, where a departure of every part is named."""


def expected(job: str, bug: str) -> tuple[str, int, str, str, str | None]:
    """What the comparison must say of a switch at W = 2: verdict, first departing update and
    part, that part's gradient class, cause. The old gather's own-slice backward makes the local
    NT-Xent's gradient biased (design §1's table); per-rank batch statistics change the forward,
    so the loss at update 0; DistributedSampler's epoch 1 holds other rows than RandomSampler's
    (its epoch 0 the same rows, strided: a note); an unreduced temperature is each rank's own
    gradient; a loss divided by W on top of DDP's average is 1/W of every gradient (Lightning
    records the loss training_step returns, divided too: the loss differs first). Tensor
    parallelism's (``tp``): a norm's gradient summed over the rank's own positions only is each
    rank's own; a cross-entropy over each rank's shard of the classes, the whole sequence given
    where a shard is declared, and one dropout mask shared by the tp ranks change the forward.
    A pipeline's (``pp``, judged in floors): a schedule that does not average its micro-batches
    while each micro-batch's loss is a mean gives K = 4 times every gradient; the tied weight's
    copies not summed over their stages differ (each its stage's share of one device's gradient),
    named from the copies; a mean over each micro-batch's own tokens weighs ragged
    micro-batches otherwise, the loss first. Expert parallelism's (``ep``): an expert's gradient
    averaged with other ranks' experts (two experts given one gradient); a load-balancing loss
    over each rank's own tokens changes the loss, every part's gradient."""
    first = FIRST_PART[job]
    divided = "loss differs" if job == "lightning_job" else "1/W"
    return {
        "old-gather": ("biased", 0, first, "biased", None),
        "local-batchnorm": ("loss differs", 0, first, "biased", None),
        "sampler": ("data differs", 4, first, "exact", None),
        "temperature-outside": ("biased", 0, "loss.log_temperature", "other", "unreduced"),
        "divide-twice": (divided, 0, "all", "1/W", None),
        "unreduced-norm": ("biased", 0, "mlp_norm", "biased", "unreduced"),
        "local-logits": ("loss differs", 0, "all", "biased", None),
        "whole-sequence": ("loss differs", 0, "all", "biased", None),
        "same-dropout": ("loss differs", 0, "all", "biased", None),
        "unscaled": ("K", 0, "all", "K", None),
        "untied": ("biased", 0, "emb", "biased", "copies_apart"),
        "ragged": ("loss differs", 0, "all", "biased", None),
        "averaged": ("biased", 0, "moe", "biased", "experts_mixed"),
        "local-balance": ("loss differs", 0, first, "biased", None),
        "clip-per-mesh": ("biased", 0, "model", "biased", None),
    }[bug]


FLOAT64 = "float64"
"""A float32 job's run in float64 (``--dtype float64``, in place of a switch), at W = 4 (dp 2 ×
pp 2; four ranks of one expert each), where its recording must be one device's to float64's
rounding, number by number."""

INTERLEAVED = "interleaved"
"""The pipeline's run with two stages a rank (``--schedule interleaved``: rank 0 of a pipeline
holds stages 0 and 2) in float64 (in place of a switch), at W = 4 (dp 2 × pp 2), whose recording
must be one device's number by number as `FLOAT64`'s is; its one device is `FLOAT64`'s."""

OWN_RUNS = {"pp": (FLOAT64, INTERLEAVED), "ep": (FLOAT64,)}
"""The float32 jobs' runs at W = 4 beside their correct run and switches."""

TOGETHER = {
    world_size: [(job, bug) for job in sorted(BUGS, key=lambda job: job == "lightning_job")
                 for bug in ("none", *BUGS[job], *OWN_RUNS.get(job, ()))
                 if world_size in (WORLD_SIZES[job] if bug == "none" else
                                   (4,) if bug in OWN_RUNS.get(job, ()) else (2,))]
    for world_size in (2, 4)
}  # fmt: skip
"""The runs that share a launch at each W (`bundled_jobs.launch_together`): every correct job at
its W and every switch at 2, the float32 jobs in float64 at 4 (the pipeline interleaved too);
Lightning's job last (it sets process-wide state: its seed's variable)."""


def switched(bug: str) -> tuple[str, ...]:
    """A run's arguments for ``bug``: the switch, float64 (`FLOAT64`), or interleaved stages in
    float64 (`INTERLEAVED`)."""
    if bug == INTERLEAVED:
        return "--schedule", "interleaved", "--dtype", "float64"
    return ("--dtype", "float64") if bug == FLOAT64 else ("--bug", bug)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """(job, W, bug) → (what rank 0 printed, the recording, the launch), each run once with
    ``--record``; W None is the one-device run (in this process). Every switch but ``sampler``
    leaves one device unchanged (a gather, batch norm or division over one rank is the identity),
    so those share the correct one-device run. The first run asked for at a W launches every run
    of `TOGETHER` at that W, in one launch."""
    root, runs = tmp_path_factory.mktemp("jobs"), {}

    def out(job: str, world_size: int | None, bug: str) -> str:
        return str(root / f"{job}-{bug}-{world_size or 'one'}")

    def run(job: str, world_size: int | None, bug: str = "none"):
        if world_size is None and bug == INTERLEAVED:  # one device has no schedule
            bug = FLOAT64
        if world_size is None and bug not in ("sampler", "floor", FLOAT64):
            bug = "none"
        key = (job, world_size, bug)
        if world_size is None and bug == "floor" and key not in runs:  # the same command again
            os.environ |= {FLOOR_VARIABLE: out(*key), FLOOR_BLOCKS_VARIABLE: str(FLOOR_BLOCKS)}
            try:
                runs[key] = run_plainly(job, "--record", out(*key) + "-not-written")
            finally:
                del os.environ[FLOOR_VARIABLE], os.environ[FLOOR_BLOCKS_VARIABLE]
        elif world_size is None and key not in runs:  # python JOB: no launcher, no process group
            runs[key] = run_plainly(job, *switched(bug), "--record", out(*key))
        elif key not in runs:
            together = TOGETHER[world_size]
            launched = launch_together(world_size, [
                (other, *switched(switch), "--record", out(other, world_size, switch))
                for other, switch in together
            ])  # fmt: skip
            runs.update({(other, world_size, switch): result for (other, switch), result
                         in zip(together, launched, strict=True)})  # fmt: skip
        result = runs[key]
        return printed(result, PARTS.get(job, SIMCLR_PARTS)), Path(out(*key)), result

    return run


FLOAT64_JOBS = [job for job in BUGS if job not in FLOORED]


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT)
@pytest.mark.parametrize("job", FLOAT64_JOBS)
def test_each_job_on_its_ranks_trains_as_one_device(job, recorded):
    reference, _, _ = recorded(job, None)
    for world_size in WORLD_SIZES[job]:
        numbers, _, result = recorded(job, world_size)
        difference = largest_difference(numbers, reference)
        assert difference <= FLOAT64_BOUND, (job, world_size, difference)
        if job == "lightning_job":  # the ranks torchrun started, no launch of Lightning's own
            assert f"MEMBER: 1/{world_size}" in result.stdout + result.stderr  # (its launch's)


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT)
@pytest.mark.parametrize(("job", "bug"), [(job, bug) for job in FLOAT64_JOBS for bug in BUGS[job]])
def test_each_bug_switch_departs_from_one_device(job, bug, recorded):
    numbers, _, _ = recorded(job, 2, bug)
    difference = largest_difference(numbers, recorded(job, None, bug)[0])
    assert difference >= MISS_FACTOR * FLOAT64_BOUND, (job, bug, difference)


@pytest.mark.parametrize("job", list(BUGS))
def test_the_comparison_of_each_correct_job_is_exact(job, recorded):
    """The recordings of the runs above (no launch of its own); a float32 job (`FLOAT32`) is
    judged with its floor, recorded by its one-device command run again with the floor's
    variable (in this process), as its users record it: ``exact within float32``."""
    floor = recorded(job, None, "floor")[1] if job in FLOORED else None
    verdict = "exact within float32" if job in FLOORED else "exact"
    for world_size in WORLD_SIZES[job]:
        comparison = compare.compare(recorded(job, None)[1], recorded(job, world_size)[1],
                                     floor=floor)  # fmt: skip
        assert (comparison.verdict, comparison.status) == (verdict, 0), comparison.words
        assert comparison.departure is None and comparison.data is None


@pytest.mark.parametrize(("job", "bug"), [(job, bug) for job in BUGS for bug in BUGS[job]])
def test_the_comparison_names_each_bug_with_its_update_part_and_cause(job, bug, recorded):
    floor = recorded(job, None, "floor")[1] if job in FLOORED else None
    comparison = compare.compare(recorded(job, None, bug)[1], recorded(job, 2, bug)[1],
                                 floor=floor)  # fmt: skip
    verdict, update, part, gradient, cause = expected(job, bug)
    assert (comparison.verdict, comparison.status) == (verdict, 1), comparison.words
    assert comparison.departure == (update, part), comparison.words
    if bug == "sampler":
        assert comparison.data.startswith("update 4: the global batches differ"), comparison.data
        assert any("strided" in note for note in comparison.notes), comparison.notes
    table = comparison.table
    row = table.set_index("part").loc[part] if "part" in table else table.iloc[0]
    assert row["gradient"] == gradient, comparison.words
    if cause is not None:
        assert row["cause"] == cause, comparison.words
    if bug == "untied":  # the copies named from the copies alone, what they compare said
        words = " ".join(comparison.words.split())  # its lines wrapped anywhere
        assert (
            "what departs, W = 2: emb.weight on rank 0 and head.weight on rank 1, copies of "
            "one device's emb.weight, whose gradients differ by "
        ) in words


def test_a_switch_that_does_not_apply_is_refused_in_one_line(monkeypatch, capsys):
    """Lightning's job refuses what its DDP-wrapped module makes moot, in one line and exit
    status 2, from its command line alone (imported here, where the session has imported
    Lightning already: a launch costs a fresh interpreter's Lightning import)."""
    import importlib

    from bundled_jobs import JOBS

    monkeypatch.syspath_prepend(str(JOBS))
    job = importlib.import_module("lightning_job")
    monkeypatch.setattr("sys.argv", ["lightning_job.py", "--bug", "temperature-outside"])
    with pytest.raises(SystemExit) as exited:
        job.main()
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "lightning_job.py: --bug temperature-outside does not apply to this job; allowed: none, "
        "old-gather, local-batchnorm, sampler, divide-twice"
    )


@pytest.mark.parametrize(("job", "run"), [(job, run) for job in FLOAT32 for run in OWN_RUNS[job]])
def test_a_pipeline_and_experts_record_one_devices_numbers_in_float64(job, run, recorded):
    """The float32 jobs run in float64 at W = 4 (a pipeline of 2 stages, each with 2 replicas,
    and of 4 stages interleaved two a rank; 4 ranks of one expert each, a router and every other
    layer replicated): the recording made of the ranks' pieces is one device's recording, number
    by number, to float64's rounding: the rows (the first stages' only, in rank order), every
    update's loss (the last stages'), each part's sketch and norm, the first update's whole
    gradient assembled in one device's order, the final weights' sketches; no part unreduced or
    drifted; the comparison ``exact``."""
    from gatherlab.recording.format import read

    one, many = (read(recorded(job, w, run)[1]) for w in (None, 4))
    assert many.header["held"] and not one.header["held"] and many.parts == one.parts
    assert len(many.header["held"]) == 4
    for a, b in zip(one.updates, many.updates, strict=True):
        assert [row for rows in b.rows for row in rows] == a.rows[0]
        assert abs(b.loss - a.loss) <= 1e-12 * abs(a.loss)
        assert not b.unreduced and not b.drifted
        for part in one.parts:
            assert np.linalg.norm(b.sketches[part] - a.sketches[part]) <= 1e-12 * np.linalg.norm(
                a.sketches[part])  # fmt: skip
            assert abs(b.norms[part] - a.norms[part]) <= 1e-12 * a.norms[part]
    whole_a, whole_b = one.full_gradient(0), many.full_gradient(0)
    assert float((whole_b - whole_a).abs().max()) <= 1e-12 * float(whole_a.abs().max())
    for part in one.parts:
        final_a, final_b = one.weights_sketch[part], many.weights_sketch[part]
        assert np.linalg.norm(final_b - final_a) <= 1e-10 * np.linalg.norm(final_a)
    comparison = compare.compare(one.path, many.path)
    assert (comparison.verdict, comparison.status) == ("exact", 0), comparison.words
