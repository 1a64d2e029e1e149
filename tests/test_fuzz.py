"""Random configurations, at most one bad value each (hypothesis, derandomized). A configuration
with a bad value stops in one line before anything starts, naming the value; one without trains,
except where docs/design.md §1 says training must fail (then it fails there, for that reason); a
run on 2 or 4 ranks is compared with its 1-device reference and gets the verdict its gather and
loss call for, with the differences measured from the run files."""

from __future__ import annotations

import shutil

import pytest
from helpers import compose
from test_training import FLOAT32_BOUND, FLOAT64_BOUND, MISS_FACTOR, _differences

from gatherlab.analysis import report, results
from gatherlab.core import runfiles
from gatherlab.lab import configcheck, jobs
from gatherlab.lab.configcheck import ConfigError

pytestmark = pytest.mark.slow


# docs/design.md §1 (the classes) and §3 (which losses are layout-invariant), stated here
# independently of what the classes declare
EXACT_GATHERS = {"fixed", "torch_nn", "functional", "lightning"}
INVARIANT_LOSSES = {"ntxent", "ntxent_global", "dcl", "dclw_global", "barlowtwins_global",
                    "vicreg", "tico", "clip"}  # fmt: skip
# docs/design.md §3's "distributed style" column: the losses that use their embeddings only
# through the gather (global style). With `nograd` on more than one device nothing connects such a
# loss to the parameters, and training fails at its first backward (§1, `nograd`).
GLOBAL_STYLE_LOSSES = {"ntxent_global", "barlowtwins", "tico"}
NO_GRAD_MESSAGE = "element 0 of tensors does not require grad"
BOUND = {"64-true": FLOAT64_BOUND, "32-true": FLOAT32_BOUND}  # docs/design.md §2, terms.TOLERANCE
# How far outside the bound a run that must differ is, at least: in float64 MISS_FACTOR (100) times;
# in float32, whose bound is 1e-5 (rounding after 2 steps: ~1e-7), 10 times, since in 1 or 2 steps
# a loss that depends on the split moves by as little as 3.5e-4 (dclw, fixed, 2 ranks)
MISS = {"64-true": MISS_FACTOR, "32-true": 10}

VALID = {
    "loss": ["ntxent", "ntxent_global", "dcl", "dclw", "barlowtwins", "vicreg", "tico", "clip"],
    "gather": ["fixed", "old", "torch_nn", "functional", "avg", "nograd_swap", "nograd"],
    # every run is held against its 1-device reference (layout=cpu1), which trains too
    "layout": ["cpu2", "cpu4"],
    "global_batch_size": ["8", "16"],
    "steps": ["1", "2"],
    "precision": ["64-true", "32-true"],
    "seed": ["0", "7"],
}
# Each bad value with what makes it bad: the other keys it needs (valid values), if any.
INVALID = {
    "loss": [("infonce", {})],
    "gather": [("nope", {})],
    "layout": [("cpu3", {})],
    "global_batch_size": [
        ("6", {"layout": "cpu4"}),
        ("0", {}),
        ("-4", {}),
        ("1000", {}),
        ("many", {}),
    ],
    "steps": [("0", {}), ("-1", {})],
    "precision": [("16-mixed", {})],
    "seed": [("-1", {})],
}
MAX_EXAMPLES = 30
MIN_COMPARED = 8  # measured: 10 (the original fuzzer of 40 examples compared 5)


def _overrides(draw_value, broken: str | None) -> dict[str, str]:
    drawn = {key: draw_value(VALID[key]) for key in VALID}
    if broken is not None:
        value, needs = draw_value(INVALID[broken])
        drawn.update(needs, **{broken: value})
    return drawn


def _must_fail(drawn: dict[str, str]) -> bool:  # on 2 or 4 ranks
    return drawn["gather"] == "nograd" and drawn["loss"] in GLOBAL_STYLE_LOSSES


@pytest.fixture(scope="module")
def fuzz_root(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


# Always checked, before the drawn ones: the configuration docs/design.md §1 says must fail (the
# draws reach it in about one of 25 valid examples).
EXAMPLES = [
    {"loss": "ntxent_global", "gather": "nograd", "layout": "cpu2", "global_batch_size": "8",
     "steps": "2", "precision": "64-true", "seed": "0"},
]  # fmt: skip


def _check_one(drawn: dict[str, str], broken: str | None, run_dir, seen: dict[str, int]) -> None:
    """Refused in one line naming the bad value; or failed where it must; or trained, and on
    several ranks held against its 1-device reference."""
    overrides = [f"{key}={value}" for key, value in drawn.items()]
    try:
        cfg, choices = compose(*overrides)
        configcheck.check(cfg)
    except ConfigError as error:  # refused before anything starts, in one line
        message = str(error)
        assert broken is not None, (message, drawn)  # a valid configuration is not refused
        assert "\n" not in message and "allowed" in message, message
        assert drawn[broken] in message, (message, drawn)  # it names the bad value
        assert not run_dir.exists()
        seen["refused"] += 1
        return
    assert broken is None, f"the bad value {broken}={drawn[broken]} passed the check"
    reference = run_dir.with_name(f"{run_dir.name}-reference")
    reference_cfg, reference_choices = compose(*overrides, "layout=cpu1")
    assert jobs.run(reference_cfg, reference, reference_choices, overrides)["status"] == "ok"
    seen["ran"] += 1
    if _must_fail(drawn):  # while its 1-device reference trains (above)
        with pytest.raises(jobs.RunFailed, match=NO_GRAD_MESSAGE) as failure:
            jobs.run(cfg, run_dir, choices, overrides)
        assert "\n" not in str(failure.value)
        summary = runfiles.read_summary(run_dir)
        assert summary["status"] == "failed" and NO_GRAD_MESSAGE in summary["error"]
        assert not (run_dir / runfiles.CURVES).exists()
        seen["failed"] += 1
        return
    summary = jobs.run(cfg, run_dir, choices, overrides)  # any other failure fails the test
    assert summary["status"] == "ok" and summary["devices"] == cfg.layout.devices
    assert runfiles.read_curves(run_dir)["step"] == list(range(cfg.steps))
    seen["ran"] += 1
    pair = run_dir.with_name(f"pair-{run_dir.name}")
    shutil.copytree(run_dir, pair / "run")
    shutil.copytree(reference, pair / "reference")
    table = report.compare(results.load_runs(pair), pair)[0].set_index("run_dir")
    assert table.loc["reference", "verdict"] == "reference"
    assert table.loc["run", "reference"] == "reference", drawn
    loss_diff, param_diff = _differences(run_dir, reference)  # read here, not by the report
    # the report subtracts float32 weights in float64, _differences in their own precision
    assert table.loc["run", "max_abs_loss_diff"] == loss_diff
    assert table.loc["run", "max_abs_param_diff"] == pytest.approx(param_diff, rel=1e-6, abs=1e-12)
    bound = BOUND[drawn["precision"]]
    if drawn["gather"] in EXACT_GATHERS and drawn["loss"] in INVARIANT_LOSSES:
        assert table.loc["run", "verdict"] == "matches", drawn
        assert loss_diff <= bound and param_diff <= bound, (drawn, loss_diff, param_diff)
    else:  # a wrong gradient, or a loss that depends on the split: far outside the bound
        assert table.loc["run", "verdict"] == "differs", drawn
        miss = MISS[drawn["precision"]] * bound
        assert max(loss_diff, param_diff) >= miss, (drawn, loss_diff, param_diff)
    seen["compared"] += 1


def test_random_configurations_run_compare_or_fail_in_one_line(fuzz_root):
    import itertools

    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    counter = itertools.count()
    seen = {"ran": 0, "refused": 0, "failed": 0, "compared": 0}  # ran: references included
    for drawn in EXAMPLES:
        _check_one(drawn, None, fuzz_root / f"example-{next(counter)}", seen)

    # no shrinking: a failing example is reported as drawn, within the test's time limit
    @settings(
        max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
        phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(st.data(), st.sampled_from([None] * 7 + list(VALID)))  # at most one key broken
    def check(data, broken):
        drawn = _overrides(lambda values: data.draw(st.sampled_from(values)), broken)
        _check_one(drawn, broken, fuzz_root / str(next(counter)), seen)

    check()
    print(seen)
    # every side of the surface was exercised, and enough runs were held against one device
    assert seen["refused"] and seen["ran"] and seen["failed"], seen
    assert seen["compared"] >= MIN_COMPARED, seen
