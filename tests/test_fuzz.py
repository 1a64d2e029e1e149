"""Random configurations, at most one bad value each (hypothesis, derandomized): each either runs
(and, for 2 and 4 ranks in float64, gets the verdict its gather and loss call for) or stops in one
line before anything starts."""

from __future__ import annotations

import shutil

import pytest
from helpers import compose

from gatherlab import configcheck, jobs, report, results, runfiles
from gatherlab.configcheck import ConfigError

pytestmark = pytest.mark.slow


EXACT_GATHERS = {"fixed", "torch_nn", "functional", "lightning"}
INVARIANT_LOSSES = {"ntxent", "ntxent_global", "dcl", "dclw_global", "barlowtwins_global",
                    "vicreg", "tico", "clip"}  # fmt: skip
VALID = {
    "loss": ["ntxent", "ntxent_global", "dcl", "dclw", "barlowtwins", "vicreg", "tico", "clip"],
    "gather": ["fixed", "old", "torch_nn", "functional", "avg", "nograd_swap", "nograd"],
    "layout": ["cpu1", "cpu2", "cpu4"],
    "global_batch_size": ["8", "16"],
    "steps": ["1", "2"],
    "precision": ["64-true", "32-true"],
    "seed": ["0", "7"],
}
INVALID = {
    "loss": ["infonce"],
    "gather": ["nope"],
    "layout": ["cpu3"],
    "global_batch_size": ["6", "0", "-4", "1000", "many"],
    "steps": ["0", "-1"],
    "precision": ["16-mixed"],
    "seed": ["-1"],
}


def _overrides(draw_value, broken: str | None) -> dict[str, str]:
    return {key: draw_value(INVALID[key] if key == broken else VALID[key]) for key in VALID}


@pytest.fixture(scope="module")
def fuzz_root(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def test_random_configurations_run_or_fail_in_one_line(fuzz_root):
    import itertools

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    counter = itertools.count()
    seen = {"ran": 0, "refused": 0, "failed": 0, "compared": 0}

    @settings(max_examples=40, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(st.data(), st.sampled_from([None] * 7 + list(VALID)))  # at most one key broken
    def check(data, broken):
        drawn = _overrides(lambda values: data.draw(st.sampled_from(values)), broken)
        overrides = [f"{key}={value}" for key, value in drawn.items()]
        run_dir = fuzz_root / str(next(counter))
        try:
            cfg, choices = compose(*overrides)
            configcheck.check(cfg)
        except ConfigError as error:  # refused before anything starts, in one line
            message = str(error)
            assert "\n" not in message and "allowed" in message, message
            assert any(value in message for value in drawn.values()), (message, drawn)
            seen["refused"] += 1
            return
        try:
            jobs.run(cfg, run_dir, choices, overrides)
        except jobs.RunFailed as error:  # training stopped: one line, recorded as failed
            assert "\n" not in str(error)
            assert runfiles.read_summary(run_dir)["status"] == "failed"
            seen["failed"] += 1
            return
        seen["ran"] += 1
        if cfg.layout.devices == 1 or cfg.precision != "64-true":
            return
        reference = fuzz_root / f"{run_dir.name}-reference"
        reference_cfg, reference_choices = compose(*overrides, "layout=cpu1")
        jobs.run(reference_cfg, reference, reference_choices, overrides)
        pair = fuzz_root / f"pair-{run_dir.name}"
        shutil.copytree(run_dir, pair / "run")
        shutil.copytree(reference, pair / "reference")
        table = report.compare(results.load_runs(pair), pair)[0].set_index("run_dir")
        exact = drawn["gather"] in EXACT_GATHERS and drawn["loss"] in INVARIANT_LOSSES
        assert table.loc["run", "verdict"] == ("matches" if exact else "differs"), drawn
        seen["compared"] += 1

    check()
    print(seen)
    assert seen["refused"] and seen["ran"], seen  # both sides of the surface were exercised
