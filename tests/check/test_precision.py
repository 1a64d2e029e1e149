"""A low precision judged against a measured floor (docs/design.md §2, "Low precision"): the floor's
perturbation, the verdicts of exact code and of each bug class in float32, bf16 and fp16 on real
gloo ranks, code that cannot run in float64, and what a precision cannot see."""

from __future__ import annotations

import functools
import math

import plain_steps
import precision_cases
import pytest
import torch
from torch import nn

from gatherlab.check import (
    check_gather,
    check_loss,
    check_training,
    explain,
    explain_training,
    measure,
)  # fmt: skip
from gatherlab.components.data import gaussian_pairs
from gatherlab.components.factory import Recipe
from gatherlab.core import floor
from gatherlab.core.terms import Precision
from gatherlab.gather import get
from gatherlab.losses import NTXentGlobalLoss
from gatherlab.runs.precision import FLOOR_ROW_BLOCKS, RowBlocks, blocked, in_float64

LOW = ("32-true", "bf16-mixed", "16-mixed")
MODEL = functools.partial(plain_steps.build_model, 8)


def _views(seed: int, rows: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    data = gaussian_pairs(num_samples=rows, dim=8, noise=0.5, seed=seed)
    pairs = [data[i] for i in range(rows)]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def _loss(gather, seed: int = 0) -> Recipe:
    return Recipe(NTXentGlobalLoss, {"temperature": 0.5}, gather, seed)


def _one_device(loss: Recipe, views, seed: int, precision: str, row_blocks: int = 1):
    return measure.measure(loss, MODEL, *views, seed, precision=precision, row_blocks=row_blocks)


# --- the floor's perturbation -------------------------------------------------------------------


def test_row_blocks_change_nothing_mathematically_and_keep_the_models_attributes():
    torch.manual_seed(0)
    model = MODEL().double()
    x = torch.randn(10, 8, dtype=torch.float64)
    whole = model(x)
    # three blocks of 3, 3, 4 rows: every row computed alone is the whole batch's row
    torch.testing.assert_close(blocked(model, 3, x), whole, rtol=0, atol=1e-15)
    pair = blocked(lambda a, b: (a * 2, {"b": b + 1}), 2, x, b=x[:, :2])
    torch.testing.assert_close(pair[0], 2 * x, rtol=0, atol=0)
    torch.testing.assert_close(pair[1]["b"], x[:, :2] + 1, rtol=0, atol=0)
    model.embedding_size = 16
    wrapped = RowBlocks(model, 2)
    assert wrapped.embedding_size == 16  # the model's attribute, as through DDP's module
    assert list(wrapped.parameters()) == list(model.parameters())
    with pytest.raises(ValueError, match="scalar"):
        blocked(lambda a: a.sum(), 2, x)


@pytest.mark.parametrize("precision", ["64-true", *LOW])
def test_the_floors_perturbation_adds_rounding_and_changes_nothing_mathematically(precision):
    # in float64 one device in row blocks is one device to summation order; in each low
    # precision it departs by about its rounding (measured 8e-8, 3e-3, 3e-4): a perturbation
    # that adds no rounding (row_blocks 1) fails here
    views = _views(0)
    one = _one_device(_loss(get("fixed")), views, 0, precision)
    perturbed = _one_device(_loss(get("fixed")), views, 0, precision, FLOOR_ROW_BLOCKS)
    departure = floor.relative(perturbed.gradient, one.gradient)
    u = Precision(precision).unit_roundoff
    if precision == "64-true":
        assert departure < 1e-13
    else:
        assert u / 4 < departure < 4 * u, (departure, u)


# --- the verdicts on real gloo ranks ------------------------------------------------------------


@pytest.fixture(scope="module")
def floored() -> dict:
    """The check of the global NT-Xent with the exact gather (10 seeds), the old gather and local
    negatives (``precision_cases.own_rows``; seed 0) on 2 and 4 ranks in each low precision: the
    row of its whole gradient per (precision, seed, W, case)."""
    cases = {"exact": "fixed", "old": "old", "local": precision_cases.own_rows}
    results = {}
    for precision in LOW:
        for seed in range(10):
            for name, gather in cases.items() if seed == 0 else [("exact", "fixed")]:
                table = check_loss(
                    NTXentGlobalLoss, (2, 4), gather=gather, steps=0, seed=seed,
                    precision=precision, temperature=0.5,
                ).table  # fmt: skip
                for _, row in table[table["part"] == "all"].iterrows():
                    results[precision, seed, row["world_size"], name] = row
    return results


@pytest.mark.slow
@pytest.mark.parametrize("precision", LOW)
def test_the_exact_gather_is_within_the_floor_in_every_precision_on_ten_seeds(floored, precision):
    # a floor taken from float64 instead of the same precision fails here (its exact runs score
    # ~1e13 floors in bf16)
    runs = [v for (p, _, _, name), v in floored.items() if p == precision and name == "exact"]
    assert len(runs) == 20
    word = Precision(precision).word
    assert {run["verdict"] for run in runs} == {"exact"}  # float64 judges: the loss runs in it
    assert {run["in_precision"] for run in runs} == {f"exact within {word}"}
    assert max(run["floors"] for run in runs) <= floor.FLOOR_THRESHOLD


@pytest.mark.slow
@pytest.mark.parametrize("precision", LOW)
def test_the_old_gather_and_local_negatives_are_beyond_the_floor_with_their_class(
    floored, precision
):
    for (p, seed, world_size, name), run in floored.items():
        if p != precision or name == "exact":
            continue
        assert run["floors"] > 2 * floor.FLOOR_THRESHOLD, (seed, world_size, name, run["floors"])
        if name == "old":  # a global loss through the old gather: each rank keeps 1/W (§1)
            assert (run["verdict"], run["in_precision"]) == ("1/W", "1/W"), (seed, world_size)
        else:  # float64 reproduces the cause of the differing loss
            assert (run["verdict"], run["cause"]) == ("loss differs", "local_negatives")
            assert run["in_precision"] == "biased", (seed, world_size)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "32-true"])
def test_naive_accumulation_is_beyond_the_floor_beside_float64s_verdict(precision):
    table = check_training(
        update="updates:naive", model="plain_steps:build_model", data="plain_steps:Pairs",
        world_sizes=(2, 4), micro_batches=(1, 2), steps=1, global_batch_size=32,
        precision=precision,
    ).table  # fmt: skip
    whole = table[(table["part"] == "all") & (table["removed"] == "none")].set_index(
        ["world_size", "micro_batches"]
    )
    word = Precision(precision).word
    assert set(whole["judged_in"]) == {"64-true"}  # it runs in float64, which judges it
    for world_size in (2, 4):
        assert whole.loc[(world_size, 1), "verdict"] == "exact"
        assert whole.loc[(world_size, 1), "in_precision"] == f"exact within {word}"
        assert whole.loc[(world_size, 2), "verdict"] == "loss differs"
        # at the resolution of 10 floors of a 4-block floor bf16 reads the direction no finer:
        # a departing gradient, biased or at a factor no name gives
        assert whole.loc[(world_size, 2), "in_precision"] in ("biased", "other")
        assert whole.loc[(world_size, 2), "floors"] > floor.FLOOR_THRESHOLD


# --- code that cannot run in float64, and what a precision cannot see ----------------------------


def test_the_float64_watch_names_the_line_that_leaves_float64():
    model = precision_cases.build_float32_scale().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    watched = in_float64(lambda: model(x).sum().backward())
    assert not watched.runs
    assert watched.lower.startswith("precision_cases.py:")
    assert watched.lower.endswith("float → float32")
    plain = MODEL().double()
    assert in_float64(lambda: plain(x).sum().backward()).runs

    class Autocasting(nn.Module):  # autocast leaves float64 alone on the CPU
        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return plain(x)

    watched = in_float64(lambda: Autocasting()(x).sum().backward())
    assert watched.runs and watched.autocast == "bfloat16"

    class OwnTemperature(nn.Module):  # float32 tensors it makes meet float64 data as float64
        def __init__(self):
            super().__init__()
            self.log_temperature = nn.Parameter(torch.tensor(-2.0))  # float32 when made

        def forward(self, z):
            weights = torch.ones(len(z))  # float32 factories, met by float64 rows
            logits = z @ z.T * torch.tensor(0.5) * torch.exp(-self.log_temperature)
            return (logits.logsumexp(1) * weights).mean()

    class Rescaled(OwnTemperature):  # a float32 tensor times a float64 number: float32
        def forward(self, z):
            return super().forward(z) * torch.ones(len(z))

    assert in_float64(lambda: OwnTemperature().double()(x).backward()).runs
    rescaled = in_float64(lambda: Rescaled().double()(x).sum().backward())
    assert rescaled.lower.startswith("test_precision.py:") and rescaled.lower.endswith(
        "mul → float32"
    )


def test_a_model_that_cannot_run_in_float64_is_judged_in_its_precision_and_says_so():
    result = check_training(
        step="plain_steps:training_step", model="precision_cases:build_float32_scale",
        data="plain_steps:Pairs", world_sizes=(2,), steps=2, precision="bf16-mixed",
    )  # fmt: skip
    row = result.table[(result.table["part"] == "all") & (result.table["removed"] == "none")].iloc[
        0
    ]
    assert (row["judged_in"], row["verdict"]) == ("bf16-mixed", "exact within bf16")
    assert row["floors"] <= floor.FLOOR_THRESHOLD
    text = " ".join(explain_training(result).split())  # the paragraph's lines joined
    assert "cannot run in float64 (precision_cases.py:" in text
    assert "float → float32): judged in bf16 against a measured floor" in text
    assert "In bf16 this check detects departures of the gradient of ~" in text
    assert text.rstrip().endswith(
        f"as far as bf16 can tell (within {floor.FLOOR_THRESHOLD:g} floors)."
    )


def test_a_model_that_returns_its_loss_is_judged_in_float64_with_no_floor_and_says_why():
    """No row blocks can cut a forward that returns a scalar: before, the floor's run raised a
    traceback after the check had started."""
    result = check_training(
        step="precision_cases:loss_step", model="precision_cases:build_loss_returning",
        data="plain_steps:Pairs", world_sizes=(2,), steps=2, precision="32-true",
    )  # fmt: skip
    row = result.table[(result.table["part"] == "all") & (result.table["removed"] == "none")].iloc[
        0
    ]
    assert row["verdict"] == "exact" and "judged_in" not in result.table  # float64's verdict
    text = " ".join(explain_training(result).split())
    assert ("The floor in float32 is not measured for a model whose forward returns its loss "
            "(row blocks cannot cut a scalar): judged in float64") in text  # fmt: skip


def test_a_loss_that_cannot_run_in_float64_is_judged_in_its_precision_and_says_so():
    result = check_loss(precision_cases.Float32TemperatureNTXent, (2, 4), steps=2,
                       precision="bf16-mixed")  # fmt: skip
    whole = result.table[result.table["part"] == "all"]
    assert set(whole["judged_in"]) == {"bf16-mixed"}
    assert set(whole["verdict"]) == {"exact within bf16"}
    text = " ".join(explain(result).split())
    assert "Loss Float32TemperatureNTXent: it cannot run in float64 (precision_cases.py:" in text
    assert "float → float32): judged in bf16 against a measured floor." in text
    assert text.endswith("Every world size trains like one device as far as bf16 can tell "
                         f"(within {floor.FLOOR_THRESHOLD:g} floors).")  # fmt: skip


def test_a_model_with_batch_norm_is_judged_in_float64_alone_and_says_why():
    # row blocks would split its statistics: no floor, float64's verdict and culprit stand
    result = check_training(
        step="plain_steps:training_step", model="precision_cases:build_with_batchnorm",
        data="plain_steps:Pairs", world_sizes=(2,), steps=1, precision="bf16-mixed",
    )  # fmt: skip
    assert "in_precision" not in result.table.columns
    assert set(result.table.loc[result.table["removed"] == "none", "culprits"]) == {"batchnorm"}
    text = " ".join(explain_training(result).split())
    assert (
        "Low precision: The floor in bf16 is not measured for a model with batch norm (row blocks "
        "would split its statistics): judged in float64." in text
    )


def test_a_departure_below_the_power_is_reported_as_undetectable_not_exact():
    # rank 1's slice scaled by 1 + 1e-4: float64 sees it (the embeddings and so the loss
    # differ), bf16 cannot (~1e-2 and larger): its bf16 run reads "exact within bf16" with the
    # power stated, never "exact"
    table = check_loss_scaled(1e-4)
    row = table.iloc[0]
    assert (row["verdict"], row["gradient"]) == ("loss differs", "biased")
    assert row["in_precision"] == "exact within bf16"
    text = " ".join(explain(table).split())
    assert "In bf16 this check detects departures of the gradient of ~" in text
    assert "run in float64 to see smaller ones" in text


def check_loss_scaled(epsilon: float):
    return check_loss(
        "gatherlab.losses:NTXentGlobalLoss", (2,),
        gather=precision_cases.ScaledSlice(epsilon), steps=0, precision="bf16-mixed",
        temperature=0.5,
    ).table  # fmt: skip


@pytest.mark.slow
def test_float32_judges_exact_code_exact_where_it_runs_in_float64():
    # before: --precision 32-true gave this exact step "other" and exit 1 (float64's bounds on
    # float32 numbers); float64 judges it now, and its float32 run is within its floor
    table = check_gather("fixed", (2,), steps=0, precision="32-true").table
    assert set(table["verdict"]) == {"exact"}
    assert set(table["in_precision"]) == {"exact within float32"}


# --- the arithmetic -----------------------------------------------------------------------------


def test_judged_in_chooses_float64_where_the_code_runs_in_it():
    assert floor.judged_in("64-true", True, None) == ("64-true", None)
    assert floor.judged_in("64-true", True, "bfloat16") == ("64-true", "bf16-mixed")
    assert floor.judged_in("64-true", False, None) == ("32-true", "32-true")
    assert floor.judged_in("16-mixed", True, None) == ("64-true", "16-mixed")
    assert floor.judged_in("bf16-mixed", False, None) == ("bf16-mixed", "bf16-mixed")


def test_classify_at_reads_the_class_at_the_floors_resolution():
    torch.manual_seed(0)
    g = torch.randn(1000, dtype=torch.float64)
    noise = torch.randn(1000, dtype=torch.float64)
    noise *= 1e-3 * g.norm() / noise.norm()  # a departure of exactly 1e-3, relative
    within = floor.classify_at(g + noise, g, 1e-3, "bf16-mixed", 2)
    assert (within.gradient, within.verdict) == ("exact", "exact within bf16")
    assert math.isclose(within.floors, 1.0, rel_tol=1e-12)
    halved = floor.classify_at(g / 2 + noise, g, 1e-3, "bf16-mixed", 2)
    assert (halved.gradient, halved.verdict) == ("1/W", "1/W")
    assert floor.classify_at(g + 20 * noise, g, 1e-3, "bf16-mixed", 2).gradient == "biased"
    assert within.power == floor.FLOOR_THRESHOLD * 1e-3
    assert floor.floor_of(0.0, "bf16-mixed") == 2.0**-8  # a perturbation that changed no bit


# --- two recordings compared in floors of a third ----------------------------------------------


@pytest.fixture(scope="module")
def recorded_low(tmp_path_factory) -> dict:
    """A plain loop recorded in bf16-mixed and in float32 (`recorded_loops.loop`): on one device,
    its floor (one device, its body's forward in two row blocks: the model computes its loss
    itself), and on 2 ranks, correct and with the loss divided by W on top of DDP's average (the
    bug); and in float64 on one device."""
    from recorded import record_cases

    job, root = "recorded_loops:loop", tmp_path_factory.mktemp("low")
    bf16 = {"dtype": "float32", "autocast": "bfloat16"}
    return record_cases(root, {
        "one": (1, job, bf16), "floor": (1, job, {**bf16, "row_blocks": 2}),
        "two": (2, job, bf16),
        "divided": (2, job, {**bf16, "bug": "divide_twice"}),
        "one32": (1, job, {"dtype": "float32"}),
        "floor32": (1, job, {"dtype": "float32", "row_blocks": 2}),
        "two32": (2, job, {"dtype": "float32"}),
        "divided32": (2, job, {"dtype": "float32", "bug": "divide_twice"}),
        "float64": (1, job, {}),
    })  # fmt: skip


@pytest.mark.slow
def test_a_bf16_recording_without_a_floor_is_not_judged_and_says_how_to_record_one(
    recorded_low, capsys
):
    """A correct bf16 job without a floor: its departure is within what rounding gave correct
    runs (`floor.ROUNDING_CEILING`), so the verdict is ``not judged``, exit status 3, with how to
    record the floor: A's own command with GATHERLAB_RECORD_FLOOR (every recorder reads it)."""
    import gatherlab.compare

    runs = recorded_low
    compared = gatherlab.compare(runs["one"], runs["two"])
    assert (compared.verdict, compared.status) == ("not judged", 3)
    assert set(compared.table["gradient"]) == set(compared.updates["gradient"]) == {"not judged"}
    words = " ".join(compared.words.split())
    assert "not judged: A and B are recorded in bf16-mixed" in words
    assert "Record the floor, A's job on one device with its model's forward in 2 row" in words
    assert f"GATHERLAB_RECORD_FLOOR={runs['one']}-floor " in words
    assert f"--floor {runs['one']}-floor" in words
    with pytest.raises(SystemExit) as exit:
        gatherlab.compare.main([str(runs["one"]), str(runs["two"]), "--out",
                                str(runs["one"].parent / "not_judged_two")])  # fmt: skip
    assert exit.value.code == 3
    with pytest.raises(AssertionError, match="not judged"):
        from gatherlab.testing import assert_runs_match

        assert_runs_match(runs["one"], runs["two"])


@pytest.mark.slow
@pytest.mark.parametrize(("run", "precision"), [("divided", "bf16-mixed"),
                                                ("divided32", "32-true")])  # fmt: skip
def test_a_departure_beyond_any_rounding_is_judged_without_a_floor(recorded_low, run, precision):
    """The loss divided by W at W = 2, without a floor: its first gradient departs by 0.5, far
    beyond the rounding of any correct run measured (20 unit roundoffs of bf16, 500 of
    float32): it is ``1/W``, exit status 1, read at that resolution, and the words say so."""
    import gatherlab.compare

    runs = recorded_low
    one = runs["one"] if precision == "bf16-mixed" else runs["one32"]
    compared = gatherlab.compare(one, runs[run])
    head = compared.table.iloc[0]
    assert (compared.verdict, compared.status, head["gradient"]) == ("1/W", 1, "1/W"), (
        compared.words
    )
    assert head["forward"] == "not judged"  # the loss module's output: within rounding
    assert compared.departure == (0, "all")
    words = " ".join(compared.words.split())
    ceiling = floor.ROUNDING_CEILING[Precision(precision)]
    assert f"beyond {ceiling:g} unit roundoffs of {Precision(precision).word}" in words


def test_a_correct_bf16_job_is_within_its_floor_and_the_words_say_by_how_much(recorded_low):
    import gatherlab.compare

    runs = recorded_low
    compared = gatherlab.compare(runs["one"], runs["two"], floor=runs["floor"])
    assert (compared.verdict, compared.status, compared.departure) == ("exact within bf16", 0, None)
    first = compared.updates[compared.updates["part"] == "all"].iloc[0]
    head = compared.table.iloc[0]
    assert first["floors"] == pytest.approx(head["floors"], rel=1e-12) and first["floors"] <= 3
    words = " ".join(compared.words.split())
    assert f"No update departs: update 0's gradient is {first['floors']:.3g} floors" in words
    assert f"its final weights' {head['max_abs_param_diff']:.3g}" in words  # the weights' |Δ|
    assert "departs from A first" not in words
    assert words.endswith(
        f"as far as bf16 can tell (within {floor.FLOOR_THRESHOLD:g} floors of the floor recording)."
    )


def test_a_buggy_bf16_job_departs_at_update_0_in_floors_of_its_floor(recorded_low):
    import gatherlab.compare

    runs = recorded_low
    compared = gatherlab.compare(runs["one"], runs["divided"], floor=runs["floor"])
    assert (compared.verdict, compared.status, compared.departure) == ("1/W", 1, (0, "all"))
    first = compared.updates[compared.updates["part"] == "all"].iloc[0]
    assert first["norm_ratio"] == pytest.approx(0.5, rel=2**-7)  # bf16's rounding of a halving
    assert first["floors"] > 10 * floor.FLOOR_THRESHOLD
    assert (
        f"B departs from A first at update 0: its gradient is 1/W, {first['floors']:.3g} "
        "floors of the floor recording's departure there"
    ) in " ".join(compared.words.split())


def test_recordings_in_float32_are_judged_in_floors_of_the_floor_recording(recorded_low):
    import gatherlab.compare

    runs = recorded_low
    assert gatherlab.compare(runs["one32"], runs["two32"]).verdict == "not judged"
    exact = gatherlab.compare(runs["one32"], runs["two32"], floor=runs["floor32"])
    assert (exact.verdict, exact.status) == ("exact within float32", 0)
    assert exact.table.iloc[0]["floors"] <= floor.FLOOR_THRESHOLD
    assert "In float32 this check detects departures of the gradient of ~" in " ".join(
        exact.words.split()
    )
    assert exact.words.rstrip().endswith(
        f"as far as float32 can tell (within {floor.FLOOR_THRESHOLD:g} floors of the floor "
        "recording)."
    )
    divided = gatherlab.compare(runs["one32"], runs["divided32"], floor=runs["floor32"])
    assert (divided.verdict, divided.status) == ("1/W", 1)


def test_a_floor_recording_of_float64_or_of_several_ranks_is_refused_in_one_line(recorded_low):
    import gatherlab.compare

    runs = recorded_low
    with pytest.raises(gatherlab.compare.NotComparable, match="judged to 1e-10; allowed: a floor"):
        gatherlab.compare(runs["float64"], runs["float64"], floor=runs["float64"])
    with pytest.raises(gatherlab.compare.NotComparable, match="was recorded on 2 ranks"):
        gatherlab.compare(runs["one"], runs["divided"], floor=runs["two"])
