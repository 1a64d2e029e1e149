"""Random configurations, at most one bad value each (hypothesis, derandomized). A configuration
with a bad value stops in one line before anything starts, naming the value; one without trains,
except where docs/design.md §1 says training must fail (then it fails there, for that reason); a
run on 2 or 4 ranks is compared with its 1-device reference and gets the verdict its gather and
loss call for, with the differences measured from the run files. The valid configurations are
stratified over the gathers: each takes the option of conf/gather (but native, which gatherlab's
losses refuse) held to its verdict least so far, with a loss that tells the verdict (an exact
gather with a layout-invariant loss), and every gather is held to it once."""

from __future__ import annotations

import shutil

import pytest
from bounds import FLOAT32_BOUND, FLOAT64_BOUND, MISS_FACTOR, differences
from helpers import compose

from gatherlab.analysis import report, results
from gatherlab.core import runfiles
from gatherlab.lab import jobs, validation
from gatherlab.lab.validation import ConfigError

pytestmark = pytest.mark.slow


# docs/design.md §1 (the classes) and §3 (which losses are layout-invariant), stated here
# independently of what the classes declare
EXACT_GATHERS = {"fixed", "fixed_all_reduce", "fixed_reduce_scatter", "torch_nn", "functional",
                 "lightning"}  # fmt: skip
INVARIANT_LOSSES = {"ntxent", "ntxent_global", "dcl", "dclw_global", "barlowtwins_global",
                    "vicreg", "tico", "clip"}  # fmt: skip
# docs/design.md §3's "distributed style" column: the losses that use their embeddings only
# through the gather (global style). With `nograd` on more than one device nothing connects such a
# loss to the parameters, and training fails at its first backward (§1, `nograd`).
GLOBAL_STYLE_LOSSES = {"ntxent_global", "barlowtwins", "tico"}
NO_GRAD_MESSAGE = "element 0 of tensors does not require grad"
BOUND = {"64-true": FLOAT64_BOUND, "32-true": FLOAT32_BOUND}  # design §2, gradients.TOLERANCE
# How far outside the bound a run that must differ is, at least: in float64 MISS_FACTOR (100) times;
# in float32, whose bound is 1e-5 (rounding after 2 steps: ~1e-7), 10 times, since in 1 or 2 steps
# a loss that depends on the split moves by as little as 3.5e-4 (dclw, fixed, 2 ranks)
MISS = {"64-true": MISS_FACTOR, "32-true": 10}

VALID = {
    "loss": ["ntxent", "ntxent_global", "dcl", "dclw", "barlowtwins", "vicreg", "tico", "clip"],
    # every option of conf/gather but native, which gatherlab's losses refuse (INVALID)
    "gather": ["fixed", "fixed_all_reduce", "fixed_reduce_scatter", "torch_nn", "functional",
               "lightning", "old", "nograd_swap", "avg", "nograd"],
    # every run is held against its 1-device reference (layout=cpu1), which trains too
    "layout": ["cpu2", "cpu4"],
    "global_batch_size": ["8", "16"],
    "steps": ["1", "2"],
    "precision": ["64-true", "32-true"],
    "seed": ["0", "7"],
}  # fmt: skip
# Each bad value with what makes it bad: the other keys it needs (valid values), if any.
INVALID = {
    "loss": [("infonce", {})],
    "gather": [("nope", {}), ("native", {})],
    "layout": [("cpu3", {})],
    "global_batch_size": [
        ("6", {"layout": "cpu4"}),
        ("0", {}),
        ("-4", {}),
        ("1000", {}),
        ("many", {}),
    ],
    "steps": [("0", {}), ("-1", {})],
    "precision": [("8-mixed", {})],
    "seed": [("-1", {})],
}
# Drawn: valid configurations, stratified over the gathers (one each), and configurations with
# one bad value each (refused before any run: cheap).
VALID_EXAMPLES = len(VALID["gather"])
INVALID_EXAMPLES = 20
MIN_COMPARED = len(VALID["gather"])


def _overrides(draw_value, broken: str | None) -> dict[str, str]:
    drawn = {key: draw_value(VALID[key]) for key in VALID}
    if broken is not None:
        value, needs = draw_value(INVALID[broken])
        drawn.update(needs, **{broken: value})
    return drawn


def _must_fail(drawn: dict[str, str]) -> bool:  # on 2 or 4 ranks
    return drawn["gather"] == "nograd" and drawn["loss"] in GLOBAL_STYLE_LOSSES


def _telling(gather: str) -> list[str]:
    """The losses whose run against its reference tells the gather's verdict: with an exact
    gather the layout-invariant ones (a loss that depends on the split differs with any gather),
    with `nograd` those it trains with (with the others training fails: EXAMPLES), else any."""
    if gather in EXACT_GATHERS:
        return [loss for loss in VALID["loss"] if loss in INVARIANT_LOSSES]
    if gather == "nograd":
        return [loss for loss in VALID["loss"] if loss not in GLOBAL_STYLE_LOSSES]
    return VALID["loss"]


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
        validation.validate(cfg)
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
    table = report.compare_sweep(results.load_runs(pair), pair).table.set_index("run_dir")
    assert table.loc["reference", "verdict"] == "reference"
    assert table.loc["run", "reference"] == "reference", drawn
    loss_diff, param_diff = differences(run_dir, reference)  # read here, not by the report
    # the report subtracts float32 weights in float64, differences in their own precision
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
    import collections
    import itertools

    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    from gatherlab.components import config

    with config.composed():  # the fuzzer draws every gather of the config group
        assert set(VALID["gather"]) | {"native"} == set(config.group_options("gather"))
    counter = itertools.count()
    seen = {"ran": 0, "refused": 0, "failed": 0, "compared": 0}  # ran: references included
    # by gather: the valid configurations, and those held against their reference with a loss
    # that tells the gather's verdict (_telling)
    gathers, held = collections.Counter(), collections.Counter()

    def check_valid(drawn: dict[str, str], run_dir) -> None:
        before = seen["compared"]
        _check_one(drawn, None, run_dir, seen)
        gathers[drawn["gather"]] += 1
        if drawn["loss"] in _telling(drawn["gather"]):
            held[drawn["gather"]] += seen["compared"] - before

    for drawn in EXAMPLES:
        check_valid(drawn, fuzz_root / f"example-{next(counter)}")

    # no shrinking: a failing example is reported as drawn, within the test's time limit
    drawing = settings(
        deadline=None, derandomize=True, database=None,
        phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
    )  # fmt: skip

    @settings(drawing, max_examples=VALID_EXAMPLES)
    @given(st.data())
    def check_valid_drawn(data):
        # stratified: the gather held to its verdict least so far (ties: VALID's order), with a
        # loss that tells it, the other values drawn (the draws' strategies must not depend on the
        # gather: the loss is drawn as an index below 840, which every list length up to 8 divides)
        gather = min(VALID["gather"], key=held.__getitem__)
        telling, index = _telling(gather), data.draw(st.integers(0, 839))
        drawn = {"loss": telling[index % len(telling)], "gather": gather}
        drawn.update(
            {key: data.draw(st.sampled_from(VALID[key])) for key in VALID if key not in drawn}
        )
        check_valid(drawn, fuzz_root / str(next(counter)))

    @settings(drawing, max_examples=INVALID_EXAMPLES)
    @given(st.data(), st.sampled_from(list(VALID)))  # one key broken
    def check_invalid_drawn(data, broken):
        drawn = _overrides(lambda values: data.draw(st.sampled_from(values)), broken)
        _check_one(drawn, broken, fuzz_root / str(next(counter)), seen)

    check_valid_drawn()
    check_invalid_drawn()
    print(seen, dict(gathers), dict(held))
    # every side of the surface was exercised, and enough runs were held against one device
    assert seen["refused"] and seen["ran"] and seen["failed"], seen
    assert seen["compared"] >= MIN_COMPARED, seen
    # every gather trained in a valid configuration and was held to its verdict
    assert set(held) == set(VALID["gather"]) and all(held.values()), (gathers, held)
