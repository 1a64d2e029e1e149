"""The functions that decide what a user is told, on inputs built by hand, each against what the
mathematics or an independent computation gives: the integer options' rule, a row's verdict and
whether a table trains like one device, the gradient's class at the edges of its bounds, the
hypotheses' constant, the diagnosis a verdict gets, the check's text, and the report's verdict of a
run against its reference. No ranks: these run in the test process, where ``make mutants`` changes
them (docs/testing.md, "Mutation testing")."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pandas as pd
import pytest
import torch

from gatherlab.analysis import report
from gatherlab.check import diagnosis, hypotheses, judge, table, where
from gatherlab.check.measure import Measured
from gatherlab.core import gradients, terms
from gatherlab.core.runfiles import Trained
from gatherlab.core.terms import DepartureKind, RunVerdict

# --- the integer options --------------------------------------------------------------------------


def test_an_integer_option_is_an_int_of_at_least_its_minimum_and_says_so():
    assert [terms.is_integer(v, 2) for v in (2, 3, 1, 0, -2)] == [True, True, False, False, False]
    assert terms.is_integer(0, 0) and not terms.is_integer(-1, 0)
    assert not terms.is_integer(True, 1) and not terms.is_integer(2.0, 1)  # a bool, a float
    assert not terms.is_integer("2", 1)
    assert terms.allowed_integer(0) == "an integer ≥ 0"
    assert terms.allowed_integer(1) == "a positive integer"
    assert terms.allowed_integer(2) == "an integer ≥ 2"
    assert terms.allowed_integer(5) == "an integer ≥ 5"


# --- a row's verdict, a table's "trains like one device" ------------------------------------------


@pytest.mark.parametrize(
    ("forward", "gradient", "scale", "apart", "expected"),
    [
        ("same", "exact", None, False, "exact"),
        ("differs", "exact", 2.0, False, "loss scaled"),
        ("differs", "exact", None, False, "loss differs"),  # no constant: not scaled
        # a loss scaled with a gradient one factor or one direction off is no pass
        ("differs", "W", 2.0, False, "loss differs"),
        ("differs", "biased", 2.0, False, "loss differs"),
        ("same", "1/W", None, False, "1/W"),
        ("same", "biased", None, False, "biased"),
        ("same", "exact", None, True, "diverges"),
        ("differs", "exact", 2.0, True, "diverges"),  # a scaled run that leaves one device's
        ("same", "1/W", None, True, "1/W"),  # a later step changes no failing verdict
        ("differs", "biased", None, True, "loss differs"),
    ],
)
def test_a_rows_verdict(forward, gradient, scale, apart, expected):
    decided = table.verdict(forward, gradient, scale, apart)
    assert decided == expected and type(decided) is str  # check.csv holds plain strings


def test_a_rows_verdict_by_default_is_not_apart():
    assert table.verdict("differs", "exact", 2.0) == "loss scaled"
    assert table.verdict("same", "exact") == "exact"


def _check_table(verdicts: list[str], parts: list[str] | None = None, removed=None):
    rows = {"verdict": verdicts}
    if parts is not None:
        rows["part"] = parts
    if removed is not None:
        rows["removed"] = removed
    return pd.DataFrame(rows)


def test_only_exact_loss_scaled_and_exact_within_a_precision_train_like_one_device():
    within = {"exact within float32", "exact within bf16", "exact within fp16"}
    assert frozenset({"exact", "loss scaled", *within}) == table.TRAINS_LIKE_ONE_DEVICE
    assert table.trains_like_one_device(_check_table(["exact", "loss scaled"]))
    assert table.trains_like_one_device(_check_table(["exact within bf16", "exact within fp16"]))
    for failing in ("1/W", "W", "biased", "none", "other", "loss differs", "diverges", "failed"):
        assert not table.trains_like_one_device(_check_table(["exact", failing])), failing
        assert not table.trains_like_one_device(_check_table([failing, "exact"])), failing


def test_trains_like_one_device_reads_the_whole_gradient_of_the_runs_without_removals():
    # the parts of an exact whole are not read, nor are the runs with a removal made
    parts = ["all", "model", "loss.t", "all"]
    assert table.trains_like_one_device(_check_table(["exact", "1/W", "W", "exact"], parts))
    assert not table.trains_like_one_device(_check_table(["biased", "exact", "exact", "exact"],
                                                         parts))  # fmt: skip
    removed = ["none", "batch_norm", "all"]
    assert table.trains_like_one_device(_check_table(["exact", "biased", "1/W"], None, removed))
    assert not table.trains_like_one_device(_check_table(["biased", "exact", "exact"], None,
                                                         removed))  # fmt: skip
    both = _check_table(["exact", "1/W", "biased"], ["all", "model", "all"],
                        ["none", "none", "batch_norm"])  # fmt: skip
    assert table.trains_like_one_device(both)
    assert type(table.trains_like_one_device(both)) is bool


# --- the forward, the cosine and norm ratio, the named factors ------------------------------------


def test_the_forward_is_the_same_to_a_relative_1e_10_inclusive():
    assert gradients.same_forward(2.0, 2.0) == (True, 0.0)
    # 1 + 2^-34: relative difference 5.8e-11; 1 + 2^-33: 1.16e-10 (both exact in binary)
    assert gradients.same_forward(1 + 2**-34, 1.0) == (True, 2**-34)
    assert gradients.same_forward(1 + 2**-33, 1.0) == (False, 2**-33)
    assert gradients.same_forward(-3.0, -2.0) == (False, 0.5)  # relative to |reference|
    assert gradients.same_forward(6.0, 4.0) == (False, 0.5)
    assert gradients.same_forward(0.0, 0.0) == (True, 0.0)
    # a pair whose relative difference is 1e-10 to the last bit (found by search): the same
    assert gradients.same_forward(9.313225747086108, 9.313225746154785) == (True, 1e-10)
    same, difference = gradients.same_forward(1e-300, 0.0)  # a reference of 0: never divided by 0
    assert not same and difference == 1e-300 / torch.finfo(torch.float64).tiny


def test_cosine_and_norm_ratio_of_vectors_computed_by_hand():
    def tensor(*values):
        return torch.tensor(values, dtype=torch.float64)

    assert gradients.cosine_and_norm_ratio(tensor(3, 4), tensor(4, 3)) == (24 / 25, 1.0)
    assert gradients.cosine_and_norm_ratio(tensor(6, 8), tensor(3, 4)) == (1.0, 2.0)
    assert gradients.cosine_and_norm_ratio(tensor(-3, -4), tensor(6, 8)) == (-1.0, 0.5)
    cosine, ratio = gradients.cosine_and_norm_ratio(tensor(0, 0), tensor(3, 4))
    assert math.isnan(cosine) and ratio == 0.0


def test_the_named_factors_of_each_layout_in_order():
    """Every name with its c; a c that an earlier name has, or 1, gets none (docs/design.md §1)."""
    assert gradients.factors(1) == {} and gradients.factors(1, 1) == {}
    assert list(gradients.factors(3).items()) == [("1/W", 1 / 3), ("W", 3)]
    assert list(gradients.factors(1, 3).items()) == [("1/K", 1 / 3), ("K", 3)]
    assert list(gradients.factors(2, 2).items()) == [
        ("1/W = 1/K", 0.5), ("W = K", 2), ("1/(W·K)", 0.25), ("W·K", 4),
    ]  # W/K = K/W = 1: no name  # fmt: skip
    assert list(gradients.factors(3, 2).items()) == [
        ("1/W", 1 / 3), ("W", 3), ("1/K", 0.5), ("K", 2), ("1/(W·K)", 1 / 6), ("W·K", 6),
        ("W/K", 1.5), ("K/W", 2 / 3),
    ]  # fmt: skip
    assert list(gradients.factors(4, 2)) == ["1/W", "W", "1/K", "K", "1/(W·K)", "W·K"]  # W/K = K
    assert gradients.factor_name(0.5, 2) == "1/W"  # without micro-batches: no K
    assert gradients.factor_name(2.0, 2) == "W"
    assert gradients.factor_name(1.0, 2, 2) is None and gradients.factor_name(1.0, 4) is None


# --- the class of a gradient at the edges of its bounds -------------------------------------------


def _tensor(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_max_rel_err_is_the_largest_difference_over_the_largest_reference_entry():
    measured, cosine, ratio, max_rel_err = gradients.classify(_tensor(2, -3), _tensor(2, -4), 2)
    assert max_rel_err == 0.25 and ratio == pytest.approx(math.sqrt(13 / 20), rel=1e-15)
    assert cosine == pytest.approx(16 / math.sqrt(13 * 20), rel=1e-15) and measured == "biased"
    # exact is relative: 1e-5 off on entries of a million is 1e-11 of the largest
    reference = 1e6 * _tensor(1, -2, 3)
    assert gradients.classify(reference + 1e-5, reference, 2)[0] == "exact"
    assert gradients.classify(reference + 1e-3, reference, 2)[0] == "other"  # 3.3e-10


def test_exact_includes_a_relative_error_of_exactly_1e_10():
    measured, *_, max_rel_err = gradients.classify(_tensor(1, 1e-10), _tensor(1, 0), 2)
    assert max_rel_err == 1e-10 and measured == "exact"


# cosine(v, [1, 0]) is exactly PARALLEL_COSINE = 1 − 1e-12 in float64 for this v (found by search)
_ON_THE_COSINE_BOUND = (3.0, 4.24230976114569e-06)


def test_a_cosine_of_exactly_one_minus_1e_12_is_parallel():
    vector, reference = _tensor(*_ON_THE_COSINE_BOUND), _tensor(1, 0)
    cosine, _ = gradients.cosine_and_norm_ratio(vector, reference)
    assert cosine == gradients.PARALLEL_COSINE == 1 - 1e-12
    assert gradients.classify(vector, reference, 3)[0] == "W"  # norm ratio 3 (to 1e-12)
    assert gradients.classify(vector, reference, 2)[0] == "other"  # parallel, no name gives 3


def test_a_reference_of_norm_one_is_a_gradient_like_any_other():
    unit = _tensor(1, 0, 0)
    assert gradients.classify(unit.clone(), unit, 2)[0] == "exact"
    assert gradients.classify(unit / 2, unit, 2)[:3] == ("1/W", 1.0, 0.5)


def test_a_gradient_against_no_reference_gradient_has_no_numbers():
    measured, *numbers = gradients.classify(_tensor(1, 2), _tensor(0, 0), 2)
    assert measured == "other" and all(math.isnan(n) for n in numbers)


def test_each_part_is_classified_against_the_references_same_part():
    reference = _tensor(1, 2, 3, 4, 5)
    # model: entries 0 and 3 (two ranges), exact; loss.t: entries 1, 2 at 1/2; loss.s: 4 at 2
    gradient = _tensor(1, 1, 1.5, 4, 10)
    parts = {"model": [(0, 1), (3, 4)], "loss.t": [(1, 3)], "loss.s": [(4, 5)]}
    classes = gradients.classify_parts(gradient, reference, parts, 2)
    assert list(classes) == ["model", "loss.t", "loss.s"]
    assert classes["model"] == ("exact", pytest.approx(1.0), 1.0, 0.0)
    assert classes["loss.t"] == ("1/W", pytest.approx(1.0), 0.5, 0.5)  # |1.5 − 3| / 3
    assert classes["loss.s"] == ("W", pytest.approx(1.0), 2.0, 1.0)
    # with K = 2 micro-batches per rank at W = 2 the same factors are named for both axes
    assert gradients.classify_parts(gradient, reference, parts, 2, 2)["loss.t"][0] == "1/W = 1/K"
    assert gradients.classify_parts(gradient, reference, None, 2) == {}
    assert gradients.classify_parts(gradient, reference, {"model": [(0, 5)]}, 2) == {}
    two = gradients.classify_parts(gradient, reference, {"model": [(0, 1)], "loss.t": [(1, 5)]}, 2)
    assert [numbers[0] for numbers in two.values()] == ["exact", "biased"]  # [1, 1.5, 4, 10]


def test_single_factors_are_named_factors_that_differ():
    def parts(*classes):
        return {f"part{i}": (c, 1.0, 1.0, 0.0) for i, c in enumerate(classes)}

    assert gradients.single_factors(parts("exact", "1/W"))
    assert gradients.single_factors(parts("K", "exact", "none"))
    assert not gradients.single_factors(parts("exact", "exact"))  # one factor
    assert not gradients.single_factors(parts("exact", "biased"))  # a direction, not a factor
    assert not gradients.single_factors(parts("other", "1/W"))
    assert not gradients.single_factors({})


# --- the hypotheses' constant and cause -----------------------------------------------------------


def test_a_scale_is_one_constant_to_the_tolerance_given():
    assert hypotheses.scale([2.0, 4.0], [1.0, 2.0]) == 2.0
    # the relative tolerance is inclusive and relative to the reference times c: |3 − 2·1| = 1 =
    # 0.5 × 2; a loss that misses by more is refused
    assert hypotheses.scale([2.0, 3.0], [1.0, 1.0], tolerance=0.5) == 2.0
    assert hypotheses.scale([2.0, 3.1], [1.0, 1.0], tolerance=0.5) is None
    assert hypotheses.scale([2.0, 4.1], [1.0, 2.0], tolerance=0.05) == 2.0
    assert hypotheses.scale([2.0, 4.1], [1.0, 2.0]) is None
    # within the tolerance given of 1, c is no scale
    assert hypotheses.scale([1.1, 2.2], [1.0, 2.0], tolerance=0.2) is None
    assert hypotheses.scale([1.1, 2.2], [1.0, 2.0]) == pytest.approx(1.1, rel=1e-15)


def test_no_scale_of_no_losses_or_of_a_reference_of_zero():
    assert hypotheses.scale([], []) is None
    assert hypotheses.scale([2.0, 0.0], [1.0, 0.0]) is None
    assert hypotheses.scale([0.0, 2.0], [0.0, 1.0]) is None


def test_a_loss_and_a_batch_missing_their_partners_are_refused():
    with pytest.raises(ValueError, match="zip"):
        hypotheses.scale([2.0, 4.0], [1.0])
    view0 = torch.arange(8.0).reshape(8, 1)
    batch = (view0, view0 + 100)

    def forward(a, b, rows):
        return float(a.sum() - b.sum())

    local = hypotheses.local_negatives(forward, batch, 2)
    # two losses, one batch: the first reproduces local_negatives, the second has no batch (the
    # references make c = 1 on the first: no scale)
    with pytest.raises(ValueError, match="zip"):
        hypotheses.cause([local, 7.0], [local, 5.0], forward, [batch], 2)
    assert hypotheses.cause([local], [local], forward, [batch], 2) == (
        terms.Cause.LOCAL_NEGATIVES,
        None,
    )


# --- the judge: a run against its reference, every form ------------------------------------------


def _trained(losses, gradient, parameters=(0.0, 0.0)) -> Trained:
    return Trained(list(losses), torch.tensor(gradient, dtype=torch.float64),
                   torch.tensor(parameters, dtype=torch.float64))  # fmt: skip


def _measured(loss, gradient, forwards=(), parts=None) -> Measured:
    return Measured(loss, torch.tensor(gradient, dtype=torch.float64), tuple(forwards), parts)


KEY = table.Row("L", "native", 2, "no group")


def test_a_trained_run_equal_to_its_reference_is_exact_with_its_curves_numbers():
    one = _trained([1.0, 0.5], [3.0, 4.0])
    (row,) = judge.judge(one, one, KEY)
    assert (row.verdict, row.forward, row.gradient, row.cause) == ("exact", "same", "exact", "")
    assert row.first_diff_step is None and row.max_abs_param_diff == 0.0
    assert row.train_max_abs_loss_diff == 0.0 and row.scale is None and row.first_loss == 1.0
    assert (row.loss_diff, row.cosine, row.norm_ratio, row.max_rel_err) == (0.0, 1.0, 1.0, 0.0)
    assert (row.part, row.error) == ("all", "") and math.isnan(row.where)


def test_a_trained_runs_scaled_losses_are_loss_scaled_and_its_later_steps_divided():
    run, one = _trained([2.0, 1.0], [1.0, -2.0]), _trained([1.0, 0.5], [1.0, -2.0])
    (row,) = judge.judge(run, one, KEY)
    assert (row.verdict, row.forward, row.cause, row.scale) == ("loss scaled", "differs",
                                                                "scaled", 2.0)  # fmt: skip
    assert row.train_max_abs_loss_diff == 0.0 and row.first_diff_step is None
    assert row.loss_diff == 1.0  # relative: |2 − 1| / 1
    later = _trained([2.0, 1.5], [1.0, -2.0])  # step 1 is 3 × one device's: no one constant
    assert judge.judge(later, one, KEY)[0].verdict == "loss differs"


def test_a_trained_run_apart_at_a_later_step_or_in_its_final_weights_diverges():
    one = _trained([1.0, 0.5, 0.25], [1.0, -2.0])
    step = judge.judge(_trained([1.0, 0.5, 0.25 + 1e-6], [1.0, -2.0]), one, KEY)[0]
    assert (step.verdict, step.first_diff_step) == ("diverges", 2)
    assert step.train_max_abs_loss_diff == pytest.approx(1e-6, rel=1e-6)
    weights = judge.judge(_trained([1.0, 0.5, 0.25], [1.0, -2.0], (0.0, 1e-9)), one, KEY)[0]
    assert (weights.verdict, weights.first_diff_step) == ("diverges", None)
    assert weights.max_abs_param_diff == 1e-9
    within = judge.judge(_trained([1.0, 0.5, 0.25 + 1e-11], [1.0, -2.0], (0.0, 1e-10)), one, KEY)
    assert within[0].verdict == "exact"  # the tolerance inclusive, given as 1e-10
    loose = judge.judge(_trained([1.0, 0.5, 0.25 + 1e-6], [1.0, -2.0]), one, KEY, tolerance=1e-5)
    assert loose[0].verdict == "exact" and loose[0].first_diff_step is None
    first = judge.judge(_trained([1.0 + 1e-6, 0.5, 0.25], [1.0, -2.0]), one, KEY, tolerance=1e-5)
    assert first[0].forward == "same"  # a trained run's first loss: absolute, to its tolerance


def test_a_biased_whole_of_single_factor_parts_is_caused_by_its_parts_each_classified():
    layout = {"model": [(0, 2)], "loss.t": [(2, 3)]}
    one = _trained([1.0], [1.0, -2.0, 3.0])
    run = _trained([1.0], [1.0, -2.0, 6.0])  # the model's exact, the temperature's W = 2 times
    rows = judge.judge(run, one, KEY, layout=layout)
    assert [(r.part, r.gradient, r.verdict) for r in rows] == [
        ("all", "biased", "biased"), ("model", "exact", "exact"), ("loss.t", "W", "W"),
    ]  # fmt: skip
    assert {r.cause for r in rows} == {"parts"}
    assert {r.first_diff_step for r in rows} == {None}  # every row of a trained run: its curve
    other = _trained([1.0], [1.0, -3.0, 6.0])  # the model's biased too: no single factors
    assert {r.cause for r in judge.judge(other, one, KEY, layout=layout)} == {""}
    removed = judge.judge(run, one, KEY, layout={"model": [(0, 2)], "loss.t": [(2, 4)]})
    assert len(removed) == 1  # a layout the run no longer has: the whole alone


def test_a_measured_losss_cause_is_reproduced_only_when_its_forward_differs():
    asked = []

    def reproduce():
        asked.append(1)
        return terms.Cause.LOCAL_NEGATIVES, None

    one = _measured(1.0, [1.0, -2.0])
    (row,) = judge.judge(_measured(1.0, [1.0, -2.0]), one, KEY, reproduce=reproduce)
    assert (row.verdict, row.cause, asked) == ("exact", "", [])
    (row,) = judge.judge(_measured(1.5, [1.0, -2.0]), one, KEY, reproduce=reproduce)
    assert (row.verdict, row.cause, row.forward, asked) == ("loss differs", "local_negatives",
                                                            "differs", [1])  # fmt: skip
    assert math.isnan(row.train_max_abs_loss_diff)  # no training run given
    scaled = judge.judge(_measured(2.0, [1.0, -2.0]), one, KEY,
                         reproduce=lambda: (terms.Cause.SCALED, 2.0))  # fmt: skip
    assert (scaled[0].verdict, scaled[0].scale) == ("loss scaled", 2.0)
    parts = {"model": [(0, 1)], "loss.t": [(1, 2)]}
    halves = judge.judge(_measured(1.0, [1.0, -1.0]), _measured(1.0, [1.0, -2.0], parts=parts),
                         KEY)  # fmt: skip
    assert [r.gradient for r in halves] == ["biased", "exact", "1/W"]
    assert [r.cause for r in halves] == ["parts"] * 3


def test_a_departure_is_placed_on_every_row_only_when_the_whole_is_not_exact():
    one = _measured(1.0, [1.0, -2.0], parts={"model": [(0, 1)], "loss.t": [(1, 2)]})
    found = where.Departure("x.py:1  mean", "a mean over the rank's rows", DepartureKind.STATISTIC)

    def nowhere():
        raise AssertionError("an exact run is not located")

    assert math.isnan(judge.judge(one, one, KEY, where=nowhere)[0].departs)
    unexplained = lambda: (terms.Cause.UNEXPLAINED, None)  # noqa: E731
    rows = judge.judge(_measured(1.5, [1.0, 1.0]), one, KEY, reproduce=unexplained,
                       where=lambda: found)  # fmt: skip
    assert [(r.where, r.departs, r.cause) for r in rows] == [
        ("x.py:1  mean", "a mean over the rank's rows", "local_statistic")
    ] * 3
    rank = where.Departure("x.py:2  sin", "another result", DepartureKind.RANK)
    rows = judge.judge(_measured(1.5, [1.0, -1.0]), one, KEY, reproduce=unexplained,
                       where=lambda: rank)  # fmt: skip
    assert {r.cause for r in rows} == {"parts"} and {r.where for r in rows} == {"x.py:2  sin"}
    rows = judge.judge(_measured(1.5, [1.0, -2.0]), one, KEY, reproduce=unexplained,
                       where=lambda: rank)  # fmt: skip
    assert [r.cause for r in rows] == ["unexplained"] * 3  # only a statistic explains it
    assert math.isnan(judge.judge(_measured(1.5, [1.0, -2.0]), one, KEY,
                                  where=lambda: None)[0].where)  # fmt: skip


def test_a_measured_losss_training_run_that_leaves_one_device_says_where_in_departs():
    one = _measured(1.0, [1.0, -2.0])
    curve = _trained([1.0, 0.5], [1.0, -2.0])
    later = (_trained([1.0, 0.5 + 1e-6], [1.0, -2.0]), curve)
    (row,) = judge.judge(one, one, KEY, curves=later)
    assert (row.verdict, row.departs) == ("diverges", "step 1 is the first whose loss leaves one "
                                                      "device's")  # fmt: skip
    assert row.train_max_abs_loss_diff == pytest.approx(1e-6, rel=1e-6)
    assert math.isnan(row.first_diff_step)  # the loss check's table has no such column
    last = (_trained([1.0, 0.5], [1.0, -2.0], (0.0, 0.25)), curve)
    (row,) = judge.judge(one, one, KEY, curves=last)
    assert (
        row.departs == "every step's loss is one device's, the final weights are not (max |Δ| 0.25)"
    )
    place = where.Departure("x.py:3  add_", "a buffer", DepartureKind.GRADIENT)
    (row,) = judge.judge(one, one, KEY, curves=later, where=lambda: place)
    assert row.departs == "step 1 is the first whose loss leaves one device's; at step 0: a buffer"
    parts = {"model": [(0, 1)], "loss.t": [(1, 2)]}
    rows = judge.judge(one, _measured(1.0, [1.0, -2.0], parts=parts), KEY, curves=later)
    assert rows[1].verdict == "exact" and math.isnan(rows[1].train_max_abs_loss_diff)
    scaled = (_trained([2.0, 1.0], [1.0, -2.0]), curve)
    (row,) = judge.judge(_measured(2.0, [1.0, -2.0]), one, KEY, curves=scaled,
                         reproduce=lambda: (terms.Cause.SCALED, 2.0))  # fmt: skip
    assert (row.verdict, row.train_max_abs_loss_diff) == ("loss scaled", 0.0)  # divided by c


def test_an_updates_differing_first_loss_is_micro_negatives_when_accumulation_reproduces_it():
    key = dataclasses.replace(KEY, micro_batches=2)
    one = _trained([1.0, 0.5], [1.0, -2.0])
    run = _trained([1.5, 0.5], [1.0, -2.0])  # no one constant: not scaled
    assert judge.judge(run, one, key, accumulated=lambda: [0.5, 1.5])[0].cause == "micro_negatives"
    near = lambda: [1.5 * (1 + 1e-11)]  # noqa: E731
    assert judge.judge(run, one, key, accumulated=near)[0].cause == "micro_negatives"
    far = lambda: [1.5 * (1 + 1e-9)]  # noqa: E731
    assert judge.judge(run, one, key, accumulated=far)[0].cause == ""
    assert judge.judge(one, one, key, accumulated=lambda: [1.0])[0].cause == ""  # the same loss
    scaled = _trained([2.0, 1.0], [1.0, -2.0])
    assert judge.judge(scaled, one, key, accumulated=lambda: [2.0])[0].cause == "scaled"


def test_the_judges_bounds_are_inclusive_and_its_curves_must_pair_every_step():
    one = _trained([1.0, 5.0], [3.0, 4.0], (1.0, 2.0))
    run = _trained([1.25, 1.0], [3.0, 4.0], (1.0, 2.0))  # step 0 at the tolerance, step 1 off
    (row,) = judge.judge(run, one, KEY, tolerance=0.25)
    assert (row.forward, row.first_diff_step, row.scale) == ("same", 1, None)
    assert row.max_abs_param_diff == 0.0 and row.verdict == "diverges"
    at = _trained([1.0, 5.25], [3.0, 4.0], (1.0, 2.0))  # every step within 0.25, one at it
    (row,) = judge.judge(at, one, KEY, tolerance=0.25)
    assert (row.verdict, row.first_diff_step, row.train_max_abs_loss_diff) == ("exact", None, 0.25)
    with pytest.raises(ValueError):  # a step without its partner
        judge.judge(_trained([1.0], [3.0, 4.0], (1.0, 2.0)), one, KEY)
    noisy = _trained([2.0, 10.0 * (1 + 1e-8)], [3.0, 4.0], (1.0, 2.0))
    (row,) = judge.judge(noisy, one, KEY, tolerance=1e-5)  # a constant to the tolerance given
    assert (row.scale, row.cause, row.verdict) == (2.0, "scaled", "loss scaled")
    tiny = _measured(2e-20, [3.0, 4.0])  # a measured loss: relative, whatever its size
    assert judge.judge(tiny, _measured(1e-20, [3.0, 4.0]), KEY)[0].forward == "differs"


def test_the_judge_names_the_factor_of_its_layout():
    one = _trained([1.0], [3.0, 4.0])
    half = _trained([1.0], [1.5, 2.0])
    assert judge.judge(half, one, KEY)[0].gradient == "1/W"
    accumulating = dataclasses.replace(KEY, micro_batches=2)
    assert judge.judge(half, one, accumulating)[0].gradient == "1/W = 1/K"
    quarter = _trained([1.0], [0.75, 1.0])
    assert judge.judge(quarter, one, accumulating)[0].gradient == "1/(W·K)"
    layout = {"model": [(0, 1)], "loss.t": [(1, 2)]}
    parts = judge.judge(_trained([1.0], [3.0, 2.0]), one, accumulating, layout=layout)
    assert [r.gradient for r in parts] == ["biased", "exact", "1/W = 1/K"]


def test_micro_negatives_reproduce_a_first_loss_to_a_relative_tolerance_inclusive():
    key = dataclasses.replace(KEY, micro_batches=2)
    one = _trained([3.0, 30.0], [3.0, 4.0])
    run = _trained([1.0, 1.0], [3.0, 4.0])  # differs from one device's, by no constant
    at = judge.judge(run, one, key, tolerance=0.5, accumulated=lambda: [2.0])  # |1 − 2| = 0.5·2
    assert at[0].cause == "micro_negatives"
    small = _trained([1e-3 + 1e-12, 1.0], [3.0, 4.0])  # relative to the small value: 1e-9 apart
    assert judge.judge(small, one, key, accumulated=lambda: [1e-3])[0].cause == ""


def test_rows_become_the_table_in_their_columns_a_failed_rows_numbers_empty():
    failed = table.failed_row(KEY, RuntimeError("rank 1: boom\nmore"))
    (ok,) = judge.judge(_trained([1.0], [1.0, -2.0]), _trained([1.0], [1.0, -2.0]), KEY)
    frame = table.frame([ok, failed], table.TRAINING_COLUMNS)
    assert list(frame.columns) == list(table.TRAINING_COLUMNS)
    assert frame["verdict"].tolist() == ["exact", "failed"]
    assert frame["error"].tolist() == ["", "rank 1: boom"]
    assert str(frame["first_diff_step"].dtype) == "Int64" and frame["cosine"].isna().tolist() == [
        False, True,
    ]  # fmt: skip
    assert frame["where"].isna().all() and frame["part"].tolist() == ["all", "all"]
    assert list(table.frame([ok], table.COLUMNS).columns) == list(table.COLUMNS)


# --- the diagnosis of a verdict -------------------------------------------------------------------


def _rows(**fields) -> pd.DataFrame:
    row = {
        "world_size": 2,
        "verdict": "exact",
        "cause": "",
        "gradient": "exact",
        "scale": None,
        "loss_diff": 0.0,
        "cosine": 1.0,
        "norm_ratio": 1.0,
        "max_rel_err": 0.0,
        "error": "",
    }
    return pd.DataFrame([{**row, **fields}])  # fmt: skip


def test_none_without_a_one_device_gradient_trains_nothing_and_with_one_is_disconnected():
    nan = float("nan")
    nothing = _rows(verdict="none", gradient="none", cosine=nan, norm_ratio=nan, max_rel_err=nan)
    assert diagnosis.diagnosis(nothing) == diagnosis.TRAINS_NOTHING
    disconnected = diagnosis.diagnosis(_rows(verdict="none", gradient="none", cosine=nan,
                                             norm_ratio=0.0, max_rel_err=1.0))  # fmt: skip
    assert disconnected.startswith("no gradient reaches the model's parameters on W ranks, while")
    # a failed W has no numbers either, and is no gradient of none
    failed = diagnosis.diagnosis(
        _rows(
            verdict="failed",
            gradient="",
            cosine=nan,
            norm_ratio=nan,
            max_rel_err=nan,
            error="rank 1: RuntimeError: boom",
        )
    )
    assert failed.startswith("the ranks failed (W = 2: rank 1: RuntimeError: boom): the check")


def test_a_differing_loss_is_followed_by_the_cause_that_reproduced_it():
    text = diagnosis.diagnosis(_rows(verdict="loss differs", cause="local_negatives",
                                     gradient="biased", loss_diff=0.25))  # fmt: skip
    assert text.startswith("the loss itself is not the 1-device loss: the mean over ranks of")
    assert ("(relative difference 0.25); no gather's backward can make it exact: what computes "
            "the loss must change (the loss, or the model's forward before it). Reproduced on "
            "one ") in text  # fmt: skip
    assert text.endswith("compute the loss, or its statistics, over the gathered batch; a "
                         "library's loss that has an option to gather across devices does it "
                         "when the option is set.")  # fmt: skip
    # without a cause: the loss's diagnosis alone
    alone = diagnosis.diagnosis(_rows(verdict="loss differs", gradient="biased", loss_diff=0.25))
    assert alone.endswith(
        "no gather's backward can make it exact: what computes the loss must change (the loss, "
        "or the model's forward before it)."
    )


def test_parts_are_described_only_for_the_cause_parts():
    parts = pd.DataFrame([
        {"part": "model", "gradient": "exact", "norm_ratio": 1.0, "cosine": 1.0},
        {"part": "loss.t", "gradient": "1/W", "norm_ratio": 0.5, "cosine": 1.0},
    ])  # fmt: skip
    one_over_w = diagnosis.diagnosis(_rows(verdict="1/W", gradient="1/W", norm_ratio=0.5), parts)
    assert one_over_w.startswith("the gradient is 1/W of one device's (norm ratio 0.5, cosine 1)")
    split = diagnosis.diagnosis(
        _rows(verdict="biased", cause="parts", gradient="biased", cosine=0.9, norm_ratio=0.75),
        parts,
    )
    assert split.startswith("the gradient points in another direction than one device's (cosine "
                            "0.9, norm ratio 0.75). Measured per part: model exact")  # fmt: skip
    no_parts = diagnosis.diagnosis(
        _rows(verdict="biased", cause="parts", gradient="biased", cosine=0.9, norm_ratio=0.75),
        parts.iloc[:0],
    )
    assert no_parts.startswith("the gradient points in another direction than one device's "
                               "(cosine 0.9, norm ratio 0.75): no learning rate")  # fmt: skip


# --- the report's verdict of a run against its reference ------------------------------------------


def _curves(*losses: float, steps=None) -> pd.DataFrame:
    return pd.DataFrame({"step": steps or list(range(len(losses))), "loss": list(losses)})


def _state(*values: float) -> dict:
    return {"w": torch.tensor(values, dtype=torch.float64)}


def _held(run_files, reference_files=None, precision="64-true", run_dir="run", steps=None):
    reference_files = reference_files or (_curves(0.0, 0.0), _state(0.0))
    run = pd.Series({"run_dir": run_dir, "precision": precision,
                     "steps": len(run_files[0]) if steps is None else steps})  # fmt: skip
    reference = pd.Series({"run_dir": "reference", "precision": precision,
                           "steps": len(reference_files[0])})  # fmt: skip
    return report._held_against(run, run_files, reference, reference_files)


def test_a_run_matches_within_its_precisions_tolerance_inclusive():
    held = _held((_curves(0.0, 1e-10), _state(-1e-10)))  # both differences exactly 1e-10
    assert held == {"max_abs_loss_diff": 1e-10, "max_abs_param_diff": 1e-10, "verdict": "matches"}
    assert _held((_curves(0.0, 2e-10), _state(0.0)))["verdict"] == "differs"
    assert _held((_curves(0.0, 0.0), _state(2e-10)))["verdict"] == "differs"
    # float32: 1e-5
    assert _held((_curves(0.0, 1e-6), _state(1e-6)), precision="32-true")["verdict"] == "matches"
    assert _held((_curves(0.0, 1e-6), _state(0.0)))["verdict"] == "differs"
    assert _held((_curves(0.0, 2e-5), _state(0.0)), precision="32-true")["verdict"] == "differs"


def test_a_runs_differences_are_the_largest_over_steps_and_weights():
    held = _held((_curves(0.5, -0.25, 0.125), {"w": _tensor(1, -3), "b": _tensor(0.5)}),
                 (_curves(0.0, 0.0, 0.0), {"w": _tensor(1, 1), "b": _tensor(0)}))  # fmt: skip
    assert held == {"max_abs_loss_diff": 0.5, "max_abs_param_diff": 4.0, "verdict": "differs"}


def test_the_reference_is_its_own_reference():
    files = (_curves(1.0, 2.0), _state(3.0))
    held = _held(files, files, run_dir="reference")
    assert held == {"max_abs_loss_diff": 0.0, "max_abs_param_diff": 0.0, "verdict": "reference"}


def test_a_run_that_cannot_be_held_against_its_reference_says_why():
    fewer = _held((_curves(0.0), _state(0.0)))
    assert fewer == {"verdict": "not comparable", "error": "1 steps against the reference's 2"}
    configured = _held((_curves(0.0, 0.0), _state(0.0)), steps=3)  # its config says 3 steps
    assert configured["verdict"] == "not comparable"
    other_steps = _held((_curves(0.0, 0.0, steps=[0, 2]), _state(0.0)))
    assert other_steps == {
        "verdict": "not comparable",
        "error": "its steps are not the reference's",
    }
    renamed = _held((_curves(0.0, 0.0), {"v": _tensor(0.0)}))
    assert renamed["verdict"] == "not comparable" and math.isnan(renamed["max_abs_param_diff"])
    assert renamed["error"] == "its final weights are not the reference's"
    assert renamed["max_abs_loss_diff"] == 0.0


def test_max_abs_weight_difference_in_float64_over_the_keys_given():
    # in float32 both would be 1.0: the difference 2^-30 exists only in float64
    state = {"w": torch.tensor([1.0], dtype=torch.float32), "b": torch.tensor([4.0])}
    other = {"w": torch.tensor([1.0 + 2**-30], dtype=torch.float64), "b": torch.tensor([1.0])}
    assert report.max_abs_weight_difference(state, other, keys=["w"]) == 2**-30
    assert report.max_abs_weight_difference(state, other) == 3.0
    assert report.max_abs_weight_difference(state, other, keys=["b", "w"]) == 3.0
    assert math.isnan(report.max_abs_weight_difference(state, {"w": other["w"]}))


def test_the_common_tolerance_is_the_one_precision_of_the_runs():
    def precisions(*values):
        return pd.DataFrame({"precision": list(values)})

    assert report.common_tolerance(precisions("64-true", "64-true")) == 1e-10
    assert report.common_tolerance(precisions("32-true", None)) == 1e-5  # a failed run's none
    assert report.common_tolerance(precisions("64-true", "32-true")) is None
    assert report.common_tolerance(precisions(None)) is None


def test_a_reference_is_one_device_whatever_its_config_holds():
    def run(devices, config):
        return pd.Series({"devices": devices, "config": config})

    assert report.one_device_whole_batch(run(1, None))  # no readable config: no micro-batches
    assert report.one_device_whole_batch(run(1, {}))  # a config without a layout
    assert report.one_device_whole_batch(run(1, {"layout": {"micro_batches": 1}}))
    assert not report.one_device_whole_batch(run(1, {"layout": {"micro_batches": 2}}))
    assert not report.one_device_whole_batch(run(2, {}))


def test_a_loss_matrix_has_the_multi_device_layouts_and_empty_cells_say_so():
    runs = pd.DataFrame([
        {"loss": "a", "gather": "fixed", "devices": 1, "batch_size": 16, "max_abs_loss_diff": 0.0,
         "matches_reference": True, "verdict": RunVerdict.REFERENCE},
        {"loss": "a", "gather": "fixed", "devices": 2, "batch_size": 8, "max_abs_loss_diff": 0.0,
         "matches_reference": True, "verdict": RunVerdict.MATCHES},
        {"loss": "b", "gather": "old", "devices": 4, "batch_size": 4, "max_abs_loss_diff": 0.5,
         "matches_reference": False, "verdict": RunVerdict.DIFFERS},
    ])  # fmt: skip
    diff, matches, verdicts = report.loss_matrix(runs)
    columns = [("fixed", 2, 8), ("old", 4, 4)]
    for frame in (diff, matches, verdicts):
        assert list(frame.index) == ["a", "b"] and list(frame.columns) == columns
    assert diff.to_numpy().tolist()[1] == [pytest.approx(float("nan"), nan_ok=True), 0.5]
    assert math.isnan(diff.loc["b", ("fixed", 2, 8)]) and diff.loc["a", ("fixed", 2, 8)] == 0.0
    assert list(diff.dtypes) == [np.float64] * 2 and list(matches.dtypes) == [np.bool_] * 2
    assert matches.to_numpy().tolist() == [[True, False], [False, False]]  # no run: no match
    assert pd.isna(verdicts.loc["a", ("old", 4, 4)]) and pd.isna(verdicts.loc["b", ("fixed", 2, 8)])


# --- the check's text -----------------------------------------------------------------------------


def _check_row(loss, gather, world_size, verdict, part="all", gradient=None, **fields) -> dict:
    row = dict.fromkeys(table.COLUMNS, "")
    row.update(loss=loss, gather=gather, world_size=world_size, part=part, forward="same",
               gradient=gradient or verdict, verdict=verdict, scale=float("nan"), loss_diff=0.0,
               cosine=1.0, norm_ratio=1.0, max_rel_err=0.0, reference="no group")  # fmt: skip
    return {**row, **fields}


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_the_checks_text_has_a_paragraph_per_loss_gather_verdict_and_cause():
    rows = [
        _check_row("L1", "old", 2, "biased", cause="parts", cosine=0.9, norm_ratio=0.75),
        _check_row("L1", "old", 2, "exact", part="model"),
        _check_row("L1", "old", 2, "1/W", part="loss.t", norm_ratio=0.5),
        _check_row("L1", "old", 4, "biased", cause="parts", cosine=0.8, norm_ratio=0.625),
        _check_row("L1", "old", 4, "exact", part="model"),
        _check_row("L1", "old", 4, "1/W", part="loss.t", norm_ratio=0.25),
        _check_row("L1", "old", 8, "1/W", norm_ratio=0.125, where="loss.py:3  mean",
                   departs="the mean over the rank's rows"),
        _check_row("L1", "old", 8, "1/W", part="model", norm_ratio=0.125),
        _check_row("L2", "native", 2, "loss scaled", gradient="exact", forward="differs",
                   cause="scaled", scale=2.0, loss_diff=1.0),
        _check_row("L3", "fixed", 2, "exact"),
    ]  # fmt: skip
    checked = table.CheckResult(
        pd.DataFrame(rows),
        reference_notes={
            "L1": table.ReferenceNote(group_differs="its loss, by 0.5"),
            "L2": table.ReferenceNote(why="RuntimeError: no group"),
        },
    )
    blocks = diagnosis.explain(checked).split("\n\n")
    assert diagnosis.explain(checked).endswith(".\n")
    shown = [line.split("|")[1:5] for line in blocks[0].splitlines()[2:]]
    assert [[cell.strip() for cell in row] for row in shown] == [
        ["L1", "old", "2", "all"], ["L1", "old", "2", "model"], ["L1", "old", "2", "loss.t"],
        ["L1", "old", "4", "all"], ["L1", "old", "4", "model"], ["L1", "old", "4", "loss.t"],
        ["L1", "old", "8", "all"], ["L2", "native", "2", "all"], ["L3", "fixed", "2", "all"],
    ]  # the part of W = 8 has the whole's class: not shown  # fmt: skip
    assert blocks[1].startswith("L1 with gather old: differs in a one-rank process group\n  This")
    assert _flat(blocks[1]).endswith(
        "This loss trains differently on one device inside a process group than without one: its "
        "loss, by 0.5; the W-rank runs are judged against the plain run (no group)."
    )
    assert blocks[2].startswith("L2: reference in a one-rank process group\n  Its one-device")
    assert blocks[3].startswith("L1 with gather old, W = 2, 4: biased (parts)\n  The gradient ")
    assert _flat(blocks[3]).startswith(
        "L1 with gather old, W = 2, 4: biased (parts) The gradient points in another direction "
        "than one device's (cosine 0.9, 0.8, norm ratio 0.75, 0.625). Measured per part: model "
        "exact (norm ratio 1, 1; cosine 1, 1); loss.t 1/W (norm ratio 0.5, 0.25; cosine 1, 1)."
    )  # the parts of W = 2 and 4, not of W = 8
    assert blocks[4].startswith("L1 with gather old, W = 8: 1/W\n  The gradient is 1/W of one ")
    assert blocks[4].endswith(
        "\n  where it departs, W = 8: loss.py:3  mean\n    the mean over the rank's rows"
    )
    assert _flat(blocks[5]).startswith(
        "L2, W = 2: loss scaled The global loss is 2 times the 1-device loss on every batch"
    )  # a scaled loss's heading does not repeat its cause
    assert len(blocks) == 6  # no paragraph for L3 (exact), and no "Every world size …"
    # a result whose table its caller filtered keeps every loss's notes: a loss with no row left
    # is named alone
    rows_of_l3 = checked.table[checked.table["loss"] == "L3"]
    only_l3 = diagnosis.explain(dataclasses.replace(checked, table=rows_of_l3)).split("\n\n")
    assert only_l3[1].startswith("L1: differs in a one-rank process group\n")
    assert only_l3[2].startswith("L2: reference in a one-rank process group\n")


def test_the_checks_text_ends_by_saying_every_world_size_trains_like_one_device():
    checked = pd.DataFrame([
        _check_row("L", "fixed", 2, "exact"),
        _check_row("L", "fixed", 4, "loss scaled", gradient="exact", forward="differs",
                   cause="scaled", scale=4.0, loss_diff=3.0),
    ])  # fmt: skip
    blocks = diagnosis.explain(checked).split("\n\n")
    assert len(blocks) == 3 and blocks[1].startswith("L with gather fixed, W = 4: loss scaled\n")
    assert blocks[2] == "Every world size trains like one device (float64, to 1e-10).\n"
    exact = pd.DataFrame([_check_row("L", "fixed", 2, "exact")])
    assert diagnosis.explain(exact).split("\n\n")[1:] == [
        "Every world size trains like one device (float64, to 1e-10).\n"
    ]


def test_one_over_w_names_an_in_place_all_reduce_and_its_fixes():
    """A released Barlow Twins whose cross-correlation is completed by an in-place all_reduce
    reads 1/W; its words led with a gather's fix and "drop the division by W", which neither
    applies: the all_reduce is a usual cause, multiplying the loss by W (or an all-reduce whose
    backward all-reduces too) its fix."""
    text = " ".join(diagnosis.diagnosis(_rows(verdict="1/W", gradient="1/W", norm_ratio=0.5,
                                              max_rel_err=0.5)).split())  # fmt: skip
    assert "an in-place dist.all_reduce that completes a sum over the rank's rows" in text
    assert (
        "(GradCache's cached embeddings, or after an in-place all_reduce), multiply it by W" in text
    )
    assert "all-reduce in an autograd Function whose backward all-reduces the gradient too" in text
    assert "torch.distributed.nn" not in text  # deprecated in torch 2.13: never recommended
