"""The bundled jobs (``examples/jobs/``: a plain DDP loop, a Lightning ``Trainer``, FSDP2's
``fully_shard``, ``ZeroRedundancyOptimizer``) as a user runs them: plainly for one device (no
process group) and under ``torchrun --nproc-per-node W`` on CPU gloo. Correct, each trains at W = 2
and 4 exactly as one device does in float64 (every update's printed global loss and the final
weights' norms, to the float64 bound); each bug switch moves some update's loss or a final weight
by at least 100 times that bound.

These tests start fresh interpreters on purpose: torchrun starting the job's ranks, each process
building its own process group, is what they test (docs/testing.md, "Tests that start a fresh
interpreter"). Each launch costs torch's import on every rank, so the one-device runs are made once
per job and setting (a module-scoped cache), every job runs 5 updates of a tiny model, and the bug
switches run at W = 2 on the jobs where their code differs (``experiments/jobs.py`` runs the whole
matrix)."""

from __future__ import annotations

import pytest
from bounds import FLOAT64_BOUND, MISS_FACTOR
from bundled_jobs import LAUNCH_TIMEOUT, largest_difference, launch, printed

pytestmark = pytest.mark.slow

BUGS = {
    "ddp": ("old-gather", "local-batchnorm", "sampler", "temperature-outside", "divide-twice"),
    "fsdp2": ("local-batchnorm", "temperature-outside", "divide-twice"),
    "zero": ("temperature-outside", "divide-twice"),
    "lightning_job": ("old-gather", "sampler", "divide-twice"),
}
"""The switches tested per job: each one where its code is the job's own (the temperature's
place, the division, Lightning's sampler and gather), the shared ones once (on ``ddp``)."""


@pytest.fixture(scope="module")
def one_device():
    """(job, bug) → the one-device run's printed numbers, each launched once. Every switch but
    ``sampler`` leaves one device unchanged (a gather, batch norm or division over one rank is the
    identity), so those share the correct run."""
    runs = {}

    def run(job: str, bug: str = "none"):
        key = (job, bug if bug == "sampler" else "none")
        if key not in runs:
            runs[key] = printed(launch(job, None, "--bug", key[1]))
        return runs[key]

    return run


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT)
@pytest.mark.parametrize("job", list(BUGS))
def test_each_job_on_two_and_four_ranks_trains_as_one_device(job, one_device):
    reference = one_device(job)
    for world_size in (2, 4):
        result = launch(job, world_size)
        difference = largest_difference(printed(result), reference)
        assert difference <= FLOAT64_BOUND, (job, world_size, difference)
        if job == "lightning_job":  # the ranks torchrun started, no launch of Lightning's own
            assert f"MEMBER: 1/{world_size}" in result.stdout + result.stderr


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT)
@pytest.mark.parametrize(("job", "bug"), [(job, bug) for job in BUGS for bug in BUGS[job]])
def test_each_bug_switch_departs_from_one_device(job, bug, one_device):
    difference = largest_difference(printed(launch(job, 2, "--bug", bug)), one_device(job, bug))
    assert difference >= MISS_FACTOR * FLOAT64_BOUND, (job, bug, difference)


def test_a_switch_that_does_not_apply_is_refused_in_one_line():
    result = launch("lightning_job", None, "--bug", "temperature-outside")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "lightning_job.py: --bug temperature-outside does not apply to this job; allowed: none, "
        "old-gather, local-batchnorm, sampler, divide-twice"
    )
