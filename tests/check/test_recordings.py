"""The comparison of two recordings (`gatherlab.compare`, `gatherlab.check.recordings`,
docs/contract.md §5, docs/checking.md §6 "Comparing two recordings") on real recordings of plain
loops (``recorded_jobs``), made by `gatherlab.record.Recorder` on one device without a process group
and on real gloo ranks of the pool at W = 2 and 4: each case's verdict, class, factor and cause as
the mathematics gives them; the same run judged by the pooled check and by recording and comparing
gets the same verdict."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pandas as pd
import pytest
import recorded_jobs
import torch
from bounds import FLOAT64_BOUND
from helpers import line_of
from recorded import record, record_cases

import gatherlab
from gatherlab import check
from gatherlab.check import recordings as comparer
from gatherlab.check.recordings import NotComparable
from gatherlab.core import terms
from gatherlab.core.floor import WITHIN
from gatherlab.recording.format import SKETCHES, read
from gatherlab.testing import assert_runs_match

pytestmark = pytest.mark.slow

W = (2, 4)
STEPS = 4
# A factor of a linear sketch is the gradient's own: S(c·g) = c·S(g) to rounding.
ROUNDING = 1e-12
TRAIN, LOOP = "recorded_jobs:train", "recorded_loops:loop"


@pytest.fixture(scope="module")
def recordings(tmp_path_factory):
    root = tmp_path_factory.mktemp("recordings")
    cases = {
        "w1": (1, TRAIN, {}), "w1_sketched": (1, TRAIN, {"full_updates": 0}),
        "torch1": (1, TRAIN, {"sampler": "torch"}),
        "traced1": (1, TRAIN, {"trace": True}),
        "traced_twice1": (1, TRAIN, {"step": "divided_twice", "trace": True}),
        "traced_bn1": (1, TRAIN, {"model_kwargs": {"batchnorm": True}, "trace": True}),
        "traced_bn2": (2, TRAIN, {"model_kwargs": {"batchnorm": True}, "trace": True}),
        "loop1": (1, LOOP, {}), "outside1": (1, LOOP, {"bug": "temperature_outside"}),
        "batchnorm1": (1, LOOP, {"bug": "batchnorm"}),
        "zero2": (2, LOOP, {"wrap": "zero"}),
        "zero_outside2": (2, LOOP, {"wrap": "zero", "bug": "temperature_outside"}),
        "accumulated2": (2, LOOP, {"micro_batches": 2}),
        "summed1": (1, LOOP, {"bug": "accumulate_sum", "micro_batches": 2}),
        "summed2": (2, LOOP, {"bug": "accumulate_sum", "micro_batches": 2}),
        "accumulated1_k4": (1, LOOP, {"micro_batches": 4}),
        "summed2_k4": (2, LOOP, {"bug": "accumulate_sum", "micro_batches": 4}),
        "divided_in_loss1": (1, LOOP, {"bug": "divide_in_loss", "micro_batches": 2}),
        "float32_loss1": (1, LOOP, {"float32_loss": True}),
        "float32_loss2": (2, LOOP, {"float32_loss": True}),
        "float32_loss_bn2": (2, LOOP, {"float32_loss": True, "bug": "batchnorm"}),
        "float32_loss_bn1": (1, LOOP, {"float32_loss": True, "bug": "batchnorm"}),
    }  # fmt: skip
    for w in W:
        cases |= {
            f"w{w}": (w, TRAIN, {}),
            f"half{w}": (w, TRAIN, {"divide_gradients": True}),
            f"half{w}_sketched": (w, TRAIN, {"divide_gradients": True, "full_updates": 0}),
            f"traced{w}": (w, TRAIN, {"trace": True}),
            f"traced_twice{w}": (w, TRAIN, {"step": "divided_twice", "trace": True}),
            f"outside{w}": (w, LOOP, {"bug": "temperature_outside"}),
            f"fsdp{w}": (w, LOOP, {"wrap": "fsdp2"}),
            f"batchnorm{w}": (w, LOOP, {"bug": "batchnorm"}),
            f"torch{w}": (w, TRAIN, {"sampler": "torch"}),
        }
    return record_cases(root, cases)


def texts(column: pd.Series) -> list[str]:
    """A column of words, its empty cells (NaN) as empty strings."""
    return [value if isinstance(value, str) else "" for value in column]


def whole(comparison) -> pd.Series:
    return comparison.table.iloc[0]


@pytest.mark.parametrize("w", W)
def test_an_exact_job_is_exact_at_every_update(recordings, w):
    comparison = gatherlab.compare(recordings["w1"], recordings[f"w{w}"])  # the module is callable
    assert (comparison.verdict, comparison.status) == ("exact", 0), comparison.words
    assert comparison.departure is None and comparison.data is None
    updates = comparison.updates
    assert set(updates["gradient"]) == {"exact"}, updates.to_string()
    assert list(updates.loc[updates["part"] == "all", "source"]) == ["full"] + ["sketch"] * 3
    assert (updates["rel_err"] <= FLOAT64_BOUND).all()
    assert np.allclose(updates["norm_ratio"], 1, rtol=0, atol=ROUNDING)
    head = whole(comparison)
    assert head["train_max_abs_loss_diff"] <= FLOAT64_BOUND
    assert head["max_abs_param_diff"] <= FLOAT64_BOUND
    assert list(comparison.table["part"]) == ["all", "0", "1"]  # the model's two children
    # each rank holds its part of both views: the same rows, in the order a layout gives them
    assert any("2 blocks" in note for note in comparison.notes), comparison.notes
    assert comparison.words.endswith(
        "B trains like A (64-true, every update's loss and gradient).\n"
    )


def test_micro_batches_are_counted_and_their_sum_is_k_times_the_gradient(recordings):
    """K, the micro-batches of B's update per A's, is the number of losses each update recorded:
    averaged, two micro-batches per rank are exact; summed, the gradient is K = 2 times one
    device's on one rank and on two (DDP averages the ranks' K-fold gradients), where W = K names
    the factor, to rounding. A factor is named by B's own K: against an A that accumulates as
    many micro-batches, averaged, B's K = 4 summed read ``other``, "a factor that no name of the
    layout gives" (a user's job, whose A accumulated too)."""
    exact = comparer.compare_recordings(recordings["loop1"], recordings["accumulated2"])
    assert (exact.verdict, exact.status) == ("exact", 0), exact.words
    assert read(recordings["accumulated2"]).updates[0].micro_batches == 2
    for a, b, factor, ratio in (("loop1", "summed1", "K", 2), ("loop1", "summed2", "W = K", 2),
                                ("accumulated1_k4", "summed2_k4", "K", 4)):  # fmt: skip
        comparison = comparer.compare_recordings(recordings[a], recordings[b])
        first = comparison.updates[comparison.updates["update"] == 0].set_index("part")
        assert first.loc["all", "gradient"] == factor, comparison.words
        assert abs(first.loc["all", "norm_ratio"] - ratio) <= ratio * ROUNDING
        assert whole(comparison)["verdict"] == factor, comparison.words


def test_a_loss_divided_by_k_where_it_is_recorded_is_scaled_and_its_curve_read_divided(
    recordings,
):
    """K = 2 micro-batches whose loss is divided by K in the loss itself, then by K again by the
    loop (a pipeline's loss function divided while its schedule scales too): update 0's loss and
    gradient are 1/K of one device's, the cause ``scaled``, named alone (no guess about
    micro-batches' negatives beside it); divided by the scale the loss of update 0 is one
    device's, and the half step moves update 1's first."""
    comparison = comparer.compare_recordings(recordings["loop1"], recordings["divided_in_loss1"])
    head = whole(comparison)
    assert (head["verdict"], head["cause"], head["gradient"]) == ("loss differs", "scaled", "1/K")
    assert math.isclose(head["scale"], 0.5, rel_tol=1e-12)
    assert head["first_diff_step"] == 1
    words = " ".join(comparison.words.split())
    assert "its loss (divided by its scale, 0.5) first leaves A's at update 1" in words, words
    assert "micro-batches per update" not in words, words


def test_a_float64_jobs_float32_loss_is_held_to_float32s_rounding_its_gradient_to_float64s(
    recordings,
):
    """A float64 job whose loss is a float32 mean (``logits.float()`` before the loss, as users
    write it): one device and 2 ranks round its mean otherwise (a user's correct Lightning job
    read ``loss differs``, 3e-8 apart, its gradients 2.5e-16), so the losses are held to 64 unit
    roundoffs of float32 (the recorder records the loss tensor's dtype), with a note; the
    gradients and weights keep float64's bound, and a per-rank batch norm still departs."""
    a = read(recordings["float32_loss1"])
    assert {u.loss_dtype for u in a.updates} == {"float32"}
    assert {u.loss_dtype for u in read(recordings["loop1"]).updates} == {"float64"}
    correct = comparer.compare_recordings(recordings["float32_loss1"], recordings["float32_loss2"])
    differences = [abs(x.loss - y.loss) for x, y in zip(a.updates, read(
        recordings["float32_loss2"]).updates, strict=True)]  # fmt: skip
    assert 0 < max(differences) <= 64 * 2**-24 * max(abs(u.loss) for u in a.updates)
    assert (correct.verdict, correct.status) == ("exact", 0), correct.words
    assert "note: the job's loss is a float32 number" in " ".join(correct.words.split())
    bug = comparer.compare_recordings(recordings["float32_loss_bn1"],
                                      recordings["float32_loss_bn2"])  # fmt: skip
    assert bug.status == 1 and bug.verdict not in ("exact", *WITHIN), bug.words


@pytest.mark.parametrize("w", W)
@pytest.mark.parametrize("sketched", [False, True], ids=["full", "sketched"])
def test_a_gradient_divided_by_w_is_1_over_w_to_rounding(recordings, w, sketched):
    suffix = "_sketched" if sketched else ""
    comparison = comparer.compare_recordings(
        recordings[f"w1{suffix}"], recordings[f"half{w}{suffix}"]
    )
    assert (comparison.verdict, comparison.status) == ("1/W", 1), comparison.words
    first = comparison.updates[comparison.updates["update"] == 0].set_index("part")
    assert set(first["source"]) == {"sketch" if sketched else "full"}
    assert set(first["gradient"]) == {"1/W"}  # the whole and each part
    assert np.allclose(first["norm_ratio"], 1 / w, rtol=ROUNDING, atol=0)
    assert (first["cosine"] >= 1 - ROUNDING).all()
    if sketched:  # ‖S(g/W − g)‖ / ‖g‖ = (1 − 1/W) ‖S g‖ / ‖g‖, the sketch's own estimate
        update = read(recordings["w1_sketched"]).updates[0]
        estimate = {p: np.linalg.norm(update.sketches[p]) / update.norms[p] for p in ("0", "1")}
        sketch = np.concatenate([update.sketches["0"], update.sketches["1"]])
        estimate["all"] = np.linalg.norm(sketch) / math.hypot(*update.norms.values())
        expected = [(1 - 1 / w) * estimate[part] for part in first.index]
    else:  # max |g/W − g| / max |g| = 1 − 1/W
        expected = [1 - 1 / w] * len(first)
    assert np.allclose(first["rel_err"], expected, rtol=1e-9, atol=0)
    assert comparison.departure == (0, "all")  # every part alike: the whole departs
    head = whole(comparison)
    assert head["first_update"] == 0 and head["first_part"] == "all"
    assert (
        "B departs from A first at update 0: its gradient is 1/W; its loss first leaves A's "
        "at update 1 (first_diff_step: the first computed with the weights of update 0's "
        "step)"
    ) in " ".join(comparison.words.split())


@pytest.mark.parametrize("w", W)
def test_the_pooled_check_and_recording_and_comparing_give_one_verdict(recordings, w):
    """The same run (the check's plain-step loop, its data, seed and SGD) judged by
    `check_training` on the pool and by recording it at W = 1 and W (its first update traced)
    and comparing: the same verdict, class, numbers and place, exact for the clean step and
    ``loss differs`` with the gradient 1/W for a loss divided by W twice, at its division."""
    for step, name in (
        ("plain_steps:training_step", "traced"),
        ("recorded_jobs:divided_twice", "traced_twice"),
    ):
        pooled = check.check_training(
            step=step, model="plain_steps:build_model", data="plain_steps:Pairs",
            world_sizes=(w,), steps=STEPS, global_batch_size=16,
        ).table  # fmt: skip
        pooled = pooled[pooled["removed"] == "none"].set_index("part")
        compared = comparer.compare_recordings(recordings[f"{name}1"], recordings[f"{name}{w}"])
        table = compared.table.set_index("part")
        assert list(table.index) == list(pooled.index) == ["all", "0", "1"]
        for column in ("forward", "gradient", "verdict", "cause"):
            assert list(table[column]) == list(pooled[column]), (column, compared.words)
        for column in ("loss_diff", "cosine", "norm_ratio", "max_rel_err"):
            assert np.allclose(table[column], pooled[column], rtol=1e-12, atol=1e-15), column
        assert np.allclose(table["train_max_abs_loss_diff"], pooled["train_max_abs_loss_diff"],
                           rtol=1e-9, atol=1e-14)  # fmt: skip
        assert list(table["first_diff_step"]) == list(pooled["first_diff_step"])
        # the same place (empty where the run is exact); the words differ where the traces do:
        # the check's ends at its reshape of the step's loss, the recording's at the loss itself
        assert texts(table["where"]) == texts(pooled["where"])
        assert bool(texts(table["departs"])[0]) == bool(texts(pooled["departs"])[0])
        expected = "exact" if name == "traced" else "loss differs"
        assert table.loc["all", "verdict"] == expected
        assert compared.status == (0 if name == "traced" else 1)
    assert table.loc["all", "gradient"] == "1/W"
    assert table.loc["all", "where"] == f"{line_of(recorded_jobs, '/ world_size()')}  div"
    # the division on the loss's path: the ranks' mean is 1/W of one device's value there
    assert table.loc["all", "departs"].startswith("a div on the loss's path: the mean over ranks")
    assert table.loc["all", "departs"].endswith(f"({1 / w:g} times)")
    assert math.isclose(table.loc["all", "norm_ratio"], 1 / w, rel_tol=ROUNDING)


def test_a_per_rank_batch_norm_departs_at_its_line_as_the_check_names_it(recordings):
    """Both runs traced: the place is the batch norm of the model's forward, in the check's words
    (tests/check/test_step_check.py names the same line for the same step), and its cause
    ``local_statistic`` with a batch norm's fix (a user's Lightning job read no cause, and that
    the loss itself must change)."""
    import plain_steps

    comparison = comparer.compare_recordings(recordings["traced_bn1"], recordings["traced_bn2"])
    head = whole(comparison)
    assert (head["verdict"], head["cause"]) == ("loss differs", "local_statistic"), comparison.words
    words = " ".join(comparison.words.split())
    assert "Fix: a batch norm synchronised over the ranks" in words, words
    assert head["where"] == f"{line_of(plain_steps, 'model(torch.cat([x0, x1]))')}  batch_norm"
    assert head["departs"] == (
        "a batch_norm over dim 0 of the rank's 16 rows, where one device takes all 32"
    )
    assert f"where it departs, W = 2: {head['where']}" in comparison.words


@pytest.mark.parametrize("w", W)
def test_a_temperature_outside_ddp_is_named_unreduced(recordings, w):
    reference, run = read(recordings["outside1"]), read(recordings[f"outside{w}"])
    # measured from the recordings, independently of the comparer: the ranks' own sketches of the
    # scale differ, and their mean is one device's (each rank's loss is the mean over its rows,
    # so the mean over ranks of their gradients is the one-device gradient)
    ranks = run.updates[0].unreduced["loss.scale"]
    assert ranks.shape == (w, run.k) and not np.allclose(ranks[0], ranks[1])
    one_device = reference.updates[0].sketches["loss.scale"]
    assert np.allclose(ranks.mean(axis=0), one_device, rtol=0, atol=1e-14 * abs(one_device).max())
    comparison = comparer.compare_recordings(recordings["outside1"], recordings[f"outside{w}"])
    table = comparison.table.set_index("part")
    assert comparison.status == 1 and table.loc["all", "cause"] == "unreduced", comparison.words
    assert table.loc["loss.scale", "cause"] == "unreduced"
    for part in ("body.0", "body.3", "body.5"):  # DDP reduces the model's (one child: its layers)
        assert table.loc[part, "gradient"] == "exact"
    assert comparison.departure == (0, "loss.scale")
    words = " ".join(comparison.words.split())
    assert "the gradient of loss.scale differs between the run's ranks" in words
    assert "The mean over the ranks of loss.scale's gradients is A's" in words
    assert "reducing it is the fix" in words


@pytest.mark.parametrize(("run", "verdict"), [("fsdp2", "exact"), ("fsdp4", "exact"),
                                              ("zero2", "exact"), ("batchnorm2", "loss differs"),
                                              ("batchnorm4", "loss differs")])  # fmt: skip
def test_sharded_and_per_rank_jobs_get_their_verdicts(recordings, run, verdict):
    """FSDP2's sharded gradient and ZeRO's are recorded from the ranks and are one device's;
    a per-rank batch norm's loss is not."""
    reference = "batchnorm1" if run.startswith("batchnorm") else "loop1"
    comparison = comparer.compare_recordings(recordings[reference], recordings[run])
    assert comparison.verdict == verdict, comparison.words
    assert comparison.status == (0 if verdict == "exact" else 1)
    if verdict == "exact":
        assert (comparison.updates["rel_err"] <= FLOAT64_BOUND).all()
    else:
        assert comparison.departure[0] == 0


def test_zero_with_a_temperature_outside_ddp_is_not_exact(recordings):
    """ZeRO steps each parameter on one rank and broadcasts it, so the ranks agree with each other;
    the temperature's gradient on its rank is that rank's own, not one device's."""
    comparison = comparer.compare_recordings(recordings["outside1"], recordings["zero_outside2"])
    assert comparison.verdict != "exact" and comparison.status == 1, comparison.words
    assert comparison.table.iloc[0]["cause"] == "unreduced"
    assert comparison.departure == (0, "loss.scale")
    # its fix says how ZeRO's ranks step (a per-rank clipping's norm read as unreduced too), and
    # keeps DDP's for a parameter outside the module DDP wraps
    words = " ".join(comparison.words.split())
    assert "Under ZeroRedundancyOptimizer each rank steps only its own shard" in words, words
    assert "clip_grad_norm_ over every parameter" in words and "by putting it inside" in words


@pytest.mark.parametrize("w", W)
def test_torchs_samplers_are_a_data_difference_said_before_any_gradient(recordings, w):
    import plain_steps
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

    comparison = comparer.compare_recordings(recordings["torch1"], recordings[f"torch{w}"])
    assert (comparison.verdict, comparison.status) == ("data differs", 1), comparison.words
    assert comparison.table["verdict"].iloc[0] == "data differs"
    # the rows each rank holds that one device's first batch lacks, from the samplers themselves:
    # RandomSampler's seed drawn from the global generator after the loop's seeding (seed 0), and
    # DistributedSampler's own permutation per rank; two views per sample, each a row
    indices = range(len(plain_steps.Pairs()))
    torch.manual_seed(0)  # a DataLoader draws its base seed, then RandomSampler its own
    first = set(next(iter(DataLoader(indices, batch_size=16, sampler=RandomSampler(indices)))))
    first = {int(i) for i in first}
    ranks = [list(DistributedSampler(indices, w, r, seed=0))[: 16 // w] for r in range(w)]
    lacking = [sum(i not in first for i in rank) for rank in ranks]
    said = [f"B's rank {r} holds {2 * n} rows A's batch lacks" for r, n in enumerate(lacking) if n]
    assert said and comparison.data.startswith("update 0: the global batches differ: " + said[0])
    for line in said:
        assert line in comparison.data
    lines = comparison.words.splitlines()
    data_line = next(i for i, line in enumerate(lines) if line.startswith("update 0: the global"))
    table_line = next(i for i, line in enumerate(lines) if line.startswith("|"))
    assert data_line < table_line  # said first, before any gradient
    words = " ".join(comparison.words.split())
    assert "gatherlab.data.LayoutInvariantSampler" in words
    # RandomSampler's permutation is another from the first update on: its seed is not the
    # DistributedSampler's, and the words say so rather than blame the striding or padding
    assert "the two runs' samplers start from different permutations" in words
    assert "departs from A first" not in comparison.words  # no gradient read from other data


def test_assert_runs_match_passes_an_exact_run_and_fails_with_the_words(recordings):
    assert assert_runs_match(recordings["w1"], recordings["w2"]).verdict == "exact"
    with pytest.raises(AssertionError) as raised:
        assert_runs_match(recordings["w1"], recordings["half2"])
    assert "B against A, W = 2: 1/W" in str(raised.value)


def test_a_comparison_writes_its_tables_and_figure_and_refuses_to_write_twice(recordings, tmp_path):
    out = tmp_path / "out"
    comparison = gatherlab.compare(recordings["w1"], recordings["half2"], out=out)
    written = pd.read_csv(out / "check.csv")
    assert list(written.columns) == list(comparison.table.columns)
    assert written["verdict"].iloc[0] == "1/W"
    updates = pd.read_csv(out / "updates.csv")
    assert len(updates) == STEPS * 3 and list(updates.columns) == list(comparer.UPDATE_COLUMNS)
    assert np.allclose(updates["norm_ratio"].iloc[0], 0.5, rtol=ROUNDING)  # exactly read back
    assert (out / "compare.png").stat().st_size > 0 and (out / "compare.pdf").stat().st_size > 0
    from gatherlab.core.runfiles import RunFinished

    with pytest.raises(RunFinished, match="already holds a comparison"):
        gatherlab.compare(recordings["w1"], recordings["w2"], out=out)


def test_a_recorded_one_rank_recording_needs_no_process_group(tmp_path):
    """W = 1 records without a process group (a one-GPU script), twice the same: exact."""
    first, again = record(tmp_path / "a", 1), record(tmp_path / "b", 1)
    comparison = comparer.compare_recordings(first, again)
    assert comparison.verdict == "exact"
    assert (comparison.updates["rel_err"] == 0).all()  # the same arithmetic: bit for bit


# --- one rule of a class, from full gradients and from sketches --------------------------------


@pytest.mark.parametrize(
    ("make", "expected"),
    [(lambda g, noise: g.clone(), "exact"), (lambda g, noise: g / 4, "1/W"),
     (lambda g, noise: 4 * g, "W"), (lambda g, noise: torch.zeros_like(g), "none"),
     (lambda g, noise: g + 0.3 * noise, "biased"), (lambda g, noise: 3 * g, "other")],
    ids=["exact", "1/W", "W", "none", "biased", "other"],
)  # fmt: skip
def test_a_sketch_reads_the_class_the_full_gradients_give(make, expected):
    """`gradients.class_of` is the one rule: the class of a gradient against one device's from
    its full vectors (`classify`) and from its linear sketch and exact norm (`classify_sketched`)
    is the same, at W = 4; a factor is read exactly (S(c·g) = c·S(g))."""
    from gatherlab.core import gradients
    from gatherlab.recording.sketch import signs, sketch

    generator = torch.Generator().manual_seed(3)
    reference = torch.randn(1000, generator=generator, dtype=torch.float64)
    gradient = make(reference, torch.randn(1000, generator=generator, dtype=torch.float64))
    block_signs = signs("w", 1000, 251, 0)
    full = gradients.classify(gradient, reference, 4)
    sketched = gradients.classify_sketched(
        sketch(gradient, 251, block_signs).numpy(), sketch(reference, 251, block_signs).numpy(),
        float(gradient.norm()), float(reference.norm()), 4,
    )  # fmt: skip
    assert full.gradient == sketched.gradient == expected
    if expected in ("1/W", "W", "other"):
        assert math.isclose(sketched.norm_ratio, full.norm_ratio, rel_tol=ROUNDING)
        assert sketched.cosine >= 1 - ROUNDING


# --- what the recordings name: the check's causes (issue 68) ------------------------------------

CONTRASTIVE = "contrastive_loops:loop"


@pytest.fixture(scope="module")
def contrastive(tmp_path_factory):
    """An in-batch contrastive loop (`contrastive_loops`) recorded on one device and on 2 ranks,
    each traced unless named ``untraced``: gathered (correct), local negatives, the loss divided
    by W, naive accumulation of K = 2 gathered micro-batches; one device in 4 calls (chunks)."""
    return record_cases(tmp_path_factory.mktemp("contrastive"), {
        "one": (1, CONTRASTIVE, {"trace": True}),
        "one_untraced": (1, CONTRASTIVE, {}),
        "one_chunked": (1, CONTRASTIVE, {"trace": True, "chunks": 4}),
        "gathered": (2, CONTRASTIVE, {"trace": True}),
        "local": (2, CONTRASTIVE, {"bug": "local", "trace": True}),
        "local_untraced": (2, CONTRASTIVE, {"bug": "local"}),
        "scaled": (2, CONTRASTIVE, {"bug": "scaled", "trace": True}),
        "micro": (2, CONTRASTIVE, {"micro_batches": 2, "trace": True}),
    })  # fmt: skip


@pytest.mark.parametrize(
    ("run", "cause", "op"),
    [("local", "local_negatives", "cross_entropy"), ("micro", "micro_negatives", "cross_entropy"),
     ("scaled", "scaled", "div")],
)  # fmt: skip
def test_the_comparison_names_the_checks_cause_from_the_traces(contrastive, run, cause, op):
    """Negatives local to a rank and split by accumulation are named from the traces: the first
    result that departs reduces over the rank's (the micro-batch's) part of the entries its rows
    meet, at the loss's line; a loss divided by W is named from the first update's loss and
    gradient, both 1/W of one device's at the same weights."""
    import contrastive_loops

    assert whole(comparer.compare_recordings(contrastive["one"], contrastive["gathered"]))[
        "verdict"
    ] == ("exact")
    compared = comparer.compare_recordings(contrastive["one"], contrastive[run])
    head = whole(compared)
    assert (head["verdict"], head["cause"]) == ("loss differs", cause), compared.words
    line = "F.cross_entropy(logits" if op == "cross_entropy" else "return loss / world"
    assert head["where"] == f"{line_of(contrastive_loops, line)}  {op}"
    words = " ".join(compared.words.split())
    if cause == "scaled":
        assert math.isclose(head["scale"], 0.5, rel_tol=1e-12) and head["gradient"] == "1/W"
        assert "B's global loss of update 0, computed at A's weights on A's rows, is 0.5 times" in (
            words
        )  # and the first departure's words compare B's losses divided by that scale, as it does
        # divided by 0.5 its update-0 loss is A's (the same weights and rows); its half step
        # moves the loss of update 1 first
        assert head["first_diff_step"] == 1
        assert "its loss (divided by its scale, 0.5) first leaves A's at update 1" in words, words
    else:
        assert "of the rank's 8 entries, where one device takes all 16" in head["departs"]
        assert "Named from the traces of the first update" in words


def test_a_trace_of_calls_that_do_not_align_names_no_rows_and_keeps_the_loss_line(
    contrastive, monkeypatch
):
    """One device embedding its rows in 4 calls (chunks) against ranks in one call each: a trace
    reads the rows given call against call, so a departure of the rows it reads is no finding
    (a user's GradCache job was told "the data differs before any code runs", where the rows'
    digests were the same): no line, and the words say why. The loss's line, read after the
    calls are joined, still names the local negatives; the verdict is unchanged."""
    from gatherlab.check import where

    compared = comparer.compare_recordings(contrastive["one_chunked"], contrastive["local"])
    head = whole(compared)
    assert head["verdict"] == "loss differs" and compared.data is None, compared.words
    assert head["where"].startswith("contrastive_loops.py:") and "cross_entropy" in head["where"]
    given = where.Departure("batch 0  input", "differs", terms.DepartureKind.INPUT)
    monkeypatch.setattr(where, "departure", lambda *args: given)  # as the user's trace read it
    compared = comparer.compare_recordings(contrastive["one_chunked"], contrastive["local"])
    words = " ".join(compared.words.split())
    assert "no line named: A's first update called its model's forward 4 times and B's ranks" in (
        words
    )
    assert whole(compared)["where"] in ("", None) or pd.isna(whole(compared)["where"]), words


def test_in_bf16_a_loss_ratio_that_is_no_layouts_factor_is_not_named_scaled(tmp_path, monkeypatch):
    """Local negatives in bf16, judged in floors: B's loss is 0.64 of A's at both updates, a
    ratio the floors' loose tolerance of the losses reads as constant; no layout's factor gives
    it, so the cause is not ``scaled`` (whose words say "drop the factor": a user's
    sentence-transformers job without its gather read so), and the verdict stays."""
    from gatherlab.recording.recorder import FLOOR_VARIABLE

    one = record(tmp_path / "one", 1, CONTRASTIVE, dtype="bfloat16")
    monkeypatch.setenv(FLOOR_VARIABLE, str(tmp_path / "floor"))
    record(tmp_path / "one", 1, CONTRASTIVE, dtype="bfloat16")  # its floor, into tmp_path/floor
    monkeypatch.delenv(FLOOR_VARIABLE)
    local = record(tmp_path / "local", 2, CONTRASTIVE, bug="local", dtype="bfloat16")
    compared = comparer.compare_recordings(one, local, floor=tmp_path / "floor")
    head = whole(compared)
    assert compared.status == 1 and head["verdict"] == "loss differs", compared.words
    assert head["cause"] != "scaled" and "drop the factor" not in compared.words, compared.words


def test_without_traces_the_comparison_says_what_it_cannot_tell_and_how_to_find_out(
    contrastive,
):
    compared = comparer.compare_recordings(
        contrastive["one_untraced"], contrastive["local_untraced"]
    )
    head = whole(compared)
    assert (head["verdict"], head["cause"]) == ("loss differs", ""), compared.words
    words = " ".join(compared.words.split())
    assert "The recordings cannot tell which part of the forward departs" in words
    assert "Record both runs with trace=True" in words
    one_traced = comparer.compare_recordings(contrastive["one"], contrastive["local_untraced"])
    assert whole(one_traced)["departs"] == (
        "no line named: only A traced its first update; record B with trace=True too"
    )


def test_a_tied_weights_unsummed_copies_are_named_from_their_sum_where_only_sketches_are_kept():
    """A pipeline recorded without its whole gradient (a model of more than 2²⁰ parameters keeps
    sketches alone): a part whose copies hold distinct gradients that sum to one device's (a
    tied weight's copies on two stages, each its stage's share) is said to want the sum; equal
    replicas, or distinct copies whose sum is not one device's, are not."""
    from types import SimpleNamespace

    rng = np.random.default_rng(0)
    embedding, head = rng.standard_normal(251), rng.standard_normal(251)
    pipeline = SimpleNamespace(header={"held": [["emb.weight"], ["emb.weight"]]})
    summed = comparer._copies_summed(pipeline, np.stack([embedding, head]), embedding + head)
    assert summed is not None and "2 different gradients whose sum is A's" in summed
    twice = np.stack([embedding, head, embedding, head])  # dp 2 × pp 2: two copies of each
    assert comparer._copies_summed(pipeline, twice, embedding + head) is not None
    assert comparer._copies_summed(pipeline, np.stack([embedding, head]), embedding) is None
    assert comparer._copies_summed(pipeline, np.stack([embedding, embedding]), embedding) is None
    replicated = SimpleNamespace(header={"held": None})  # DDP: every rank holds every parameter
    apart = np.stack([embedding, head])
    assert comparer._copies_summed(replicated, apart, embedding + head) is None


def test_the_printed_comparison_runs_with_the_python_that_ran_a():
    """A job run as ``.venv/bin/python job.py`` is compared again by that Python, where
    gatherlab is installed (a user's bare ``python`` was another); a launcher's, ``python``."""
    assert comparer._interpreter([".venv/bin/python", "job.py"]) == ".venv/bin/python"
    assert comparer._interpreter(["python3.11", "job.py"]) == "python3.11"
    assert comparer._interpreter(["torchrun", "--nproc-per-node", "2", "job.py"]) == "python"
    assert comparer._interpreter(None) == "python"


def test_the_floor_command_records_into_no_directory_that_exists(tmp_path):
    """The directory the printed floor command records into is A's ``-floor`` beside it, or
    the first numbered one that does not exist (the recorder refuses to write into one that
    does): a recording of B's or a floor of other row blocks there is never recorded over."""
    taken = tmp_path / "one-floor"
    assert comparer._unused(taken) == taken
    taken.mkdir()
    (tmp_path / "one-floor-2").mkdir()
    assert comparer._unused(taken) == tmp_path / "one-floor-3"
    assert not comparer._floor_recorded(taken, 2)  # not a recording


@pytest.fixture(scope="module")
def float32_recordings(tmp_path_factory):
    """The plain loop in float32: twice on one device (the same bits), and with its learnt scale
    outside DDP on one device and on two ranks."""
    cases = {
        "one": (1, LOOP, {"dtype": "float32"}), "again": (1, LOOP, {"dtype": "float32"}),
        "outside1": (1, LOOP, {"dtype": "float32", "bug": "temperature_outside"}),
        "outside2": (2, LOOP, {"dtype": "float32", "bug": "temperature_outside"}),
    }  # fmt: skip
    return record_cases(tmp_path_factory.mktemp("float32"), cases)


def test_float32_recordings_equal_to_the_last_bit_are_exact_without_a_floor(
    float32_recordings, tmp_path
):
    """Two float32 runs whose every recorded number is the same (the job run twice, or with
    torchrun and with python) need no floor: they are ``exact`` (status 0). One bit of one
    sketch changed, they are ``not judged`` again (status 3), as any two float32 runs without a
    floor."""
    same = comparer.compare_recordings(float32_recordings["one"], float32_recordings["again"])
    assert (same.verdict, same.status) == ("exact", 0), same.words
    assert "A's to the last bit" in " ".join(same.words.split())
    flipped = tmp_path / "flipped"
    shutil.copytree(float32_recordings["again"], flipped)
    values = np.fromfile(flipped / SKETCHES, dtype="<u8")
    values[0] ^= 1  # the last bit of the first update's first sketch number
    values.tofile(flipped / SKETCHES)
    apart = comparer.compare_recordings(float32_recordings["one"], flipped)
    assert (apart.verdict, apart.status) == ("not judged", 3), apart.words


def test_in_float32_an_unreduced_gradients_mean_within_rounding_is_named_the_fix(
    float32_recordings,
):
    """In float32 the mean over the ranks of an unreduced gradient is one device's to rounding,
    not to float64's 1e-10: its sketch departs by more than 1e-10 and by less than 500 unit
    roundoffs of float32 (the resolution without a floor), and the diagnosis names reducing it as
    the fix. Whether float32's sums round the mean away from A's depends on the CPU's kernels
    (1.4 unit roundoffs on one machine here, 0 on another's AVX-512 ones), so each rank's sketch
    is moved by 3 unit roundoffs, as rounding moves it, before the two are compared."""
    reference = read(float32_recordings["outside1"])
    run = read(float32_recordings["outside2"])
    run.updates[0].unreduced["loss.scale"] *= 1 + 3 * 2.0**-24
    mean = run.updates[0].unreduced["loss.scale"].mean(axis=0)
    one_device = reference.updates[0].sketches["loss.scale"]
    error = np.linalg.norm(mean - one_device) / np.linalg.norm(one_device)
    assert 1e-10 < error < 500 * 2.0**-24, error
    comparison = comparer.compare_recordings(reference, run)
    words = " ".join(comparison.words.split())
    assert comparison.status == 1 and whole(comparison)["cause"] == "unreduced", words
    assert "The mean over the ranks of loss.scale's gradients is A's" in words
    assert "unit roundoffs of float32): reducing it is the fix" in words
    assert "is not A's either" not in words
    # judged without a floor, the table's max_rel_err is update 0's, as updates.csv gives it
    updates = comparison.updates
    first = updates[(updates["update"] == 0) & (updates["part"] == "all")].iloc[0]
    assert whole(comparison)["max_rel_err"] == first["rel_err"], (comparison.table, updates)


def test_a_floor_that_departs_beyond_rounding_is_set_aside_and_b_judged_without_it(tmp_path):
    """A job whose forward draws at random from its call's rows (mixup: dropout in a transformer's
    attention did it to a user's BERT): its floor recording (the forward in row blocks) draws
    otherwise, so it departs from A far beyond any rounding of float32 (500 unit roundoffs are
    3e-5), and T times it would let any departure through: a learnt scale outside DDP,
    unreduced on two ranks, read `exact within float32` (status 0) so. The floor is set aside
    with a note that says why, and B is judged as without one: not one device's (status 1)."""
    job = {"dtype": "float32", "mixed": True, "bug": "temperature_outside"}
    cases = {"one": (1, LOOP, job), "floor": (1, LOOP, {**job, "row_blocks": 2}),
             "outside": (2, LOOP, job)}  # fmt: skip
    paths = record_cases(tmp_path, cases)
    compared = comparer.compare_recordings(paths["one"], paths["outside"], floor=paths["floor"])
    said = " ".join(compared.words.split())
    assert f"note: the floor recording {paths['floor']} departs from A by" in said
    assert "so it is no floor; B is judged without it" in said
    assert compared.status == 1, compared.words
    assert compared.verdict not in WITHIN and compared.verdict != "exact", compared.words
    apart = tmp_path / "apart"  # A one bit apart: within any rounding, so not judged without
    shutil.copytree(paths["one"], apart)  # a floor, and the words say how to record one that is
    values = np.fromfile(apart / SKETCHES, dtype="<u8")
    values[0] ^= 1
    values.tofile(apart / SKETCHES)
    unjudged = comparer.compare_recordings(paths["one"], apart, floor=paths["floor"])
    said = " ".join(unjudged.words.split())
    assert unjudged.status == 3 and "so it is no floor; B is judged without it" in said, said
    assert "The floor recording given is no floor (the note above): record A and its" in said
    assert "GATHERLAB_RECORD_FLOOR=" not in said and "compare again with it" not in said


def test_a_floor_whose_calls_do_not_span_bs_holds_b_to_20_floors_and_says_why(tmp_path):
    """The floor is A's calls of the forward cut into row blocks: it rounds as calls of A's
    smallest block to A's largest call. Ranks whose calls are larger (a GradCache job embedding
    16 rows at once against one device's chunks of 8 read 8.2 floors, `other`, exit 1, where
    its weights were as close as two one-device runs in other chunks) round in matrix kernels
    the floor never measured: T is then 20, with a note that says why; ranks whose calls lie
    within keep 5. Here one device in 4 micro-batches (calls of 4 rows, the floor's blocks 2),
    against ranks of 8 rows in one call, and of 4 in two."""
    job = {"dtype": "float32", "micro_batches": 4}
    cases = {"one": (1, LOOP, job), "floor": (1, LOOP, {**job, "row_blocks": 2}),
             "whole": (2, LOOP, {"dtype": "float32"}),
             "chunked": (2, LOOP, {"dtype": "float32", "micro_batches": 2})}  # fmt: skip
    paths = record_cases(tmp_path, cases)
    larger = comparer.compare_recordings(paths["one"], paths["whole"], floor=paths["floor"])
    said = " ".join(larger.words.split())
    assert larger.threshold == 20, said
    assert ("B's calls of the model's forward hold 8 rows a rank, and the floor recording rounds "
            "as calls of 2 to 4 rows") in said  # fmt: skip
    assert (larger.verdict, larger.status) == ("exact within float32", 0), said
    within = comparer.compare_recordings(paths["one"], paths["chunked"], floor=paths["floor"])
    assert within.threshold == 5, within.words
    assert "B's calls of the model's forward" not in within.words
    assert (within.verdict, within.status) == ("exact within float32", 0), within.words


def test_a_floor_whose_blocks_are_larger_than_bs_calls_says_how_many_blocks_span_them(tmp_path):
    """Ranks whose calls are smaller than the floor's row blocks (a pipeline's micro-batches:
    2 ranks of 4 calls of 2 rows, against one device's one call of 16 in 2 blocks of 8) are held
    to 20 floors, and the note names the blocks whose calls span B's: 8 (16 rows in blocks of
    2); the floor recorded in 8 blocks keeps 5 (a user's pipeline job was told the variable,
    not its value)."""
    cases = {"one": (1, LOOP, {"dtype": "float32"}),
             "floor": (1, LOOP, {"dtype": "float32", "row_blocks": 2}),
             "floor8": (1, LOOP, {"dtype": "float32", "row_blocks": 8}),
             "micro": (2, LOOP, {"dtype": "float32", "micro_batches": 4})}  # fmt: skip
    paths = record_cases(tmp_path, cases)
    noted = comparer.compare_recordings(paths["one"], paths["micro"], floor=paths["floor"])
    said = " ".join(noted.words.split())
    assert noted.threshold == 20, said
    assert "hold 2 rows a rank, and the floor recording rounds as calls of 8 to 16 rows" in said
    assert "(GATHERLAB_RECORD_FLOOR_BLOCKS=8)" in said, said
    spanned = comparer.compare_recordings(paths["one"], paths["micro"], floor=paths["floor8"])
    assert spanned.threshold == 5, spanned.words
    assert "B's calls of the model's forward" not in spanned.words
    assert (spanned.verdict, spanned.status) == ("exact within float32", 0), spanned.words
    # without a floor, the command that records it asks for the 8 blocks at once
    unfloored = " ".join(comparer.compare_recordings(paths["one"], paths["micro"]).words.split())
    assert f"GATHERLAB_RECORD_FLOOR={paths['one']}-floor8 GATHERLAB_RECORD_FLOOR_BLOCKS=8" in (
        unfloored), unfloored  # fmt: skip


def _float32_run(name: str, world_size: int, apart: list[float], row_blocks: int = 1,
                 loss_apart: float | list[float] | None = None):  # fmt: skip
    """A float32 recording in memory of one part over 3 updates: its gradient each update one
    direction plus ``apart[u]`` (relative) along another, its loss (``loss_apart`` where given,
    one for every update or one each)
    and final weights as far from one device's (``apart`` all 0: one device's own numbers), 8
    rows of the same global batch at every W."""
    from pathlib import Path

    from gatherlab.recording.format import Recording, Update

    direction, other = np.array([1.0, -2.0, 0.5, 3.0]), np.array([3.0, 1.0, -1.0, 0.5])
    rows = [[f"{i:016x}" for i in range(r * 8 // world_size, (r + 1) * 8 // world_size)]
            for r in range(world_size)]  # fmt: skip
    header = {"world_size": world_size, "k": 4, "parts": ["w"], "seed": 0, "sketch_seed": 0,
              "parameters": [{"name": "w", "shape": [4], "part": "w", "sharded": False}],
              "precision": "32-true", "full_updates": 0, "settings": {"optimizer": "AdamW"},
              "row_blocks": row_blocks}  # fmt: skip
    updates = []
    for u, by in enumerate(apart):
        sketch = direction + by * np.linalg.norm(direction) * other / np.linalg.norm(other)
        apart_by = loss_apart[u] if isinstance(loss_apart, list) else loss_apart
        loss = 0.7 * (1 + (by if apart_by is None else apart_by))
        updates.append(Update(u, [loss] * world_size, loss, rows, {"w": sketch},
                              {"w": float(np.linalg.norm(sketch))}, {}, None))  # fmt: skip
    weights = direction * (1 + apart[-1])
    return Recording(Path(f"/nonexistent/{name}"), header, updates, {"w": weights},
                     {"w": float(np.linalg.norm(weights))})  # fmt: skip


def test_a_float32_run_within_floors_at_its_first_update_that_departs_later_is_not_judged():
    """In a low precision the floor recording is one run of rounding, and training can amplify
    rounding past it (AdamW steps an element of the gradient that rounding sets near zero by the
    learning rate in either sign: a user's correct Lightning job read `diverges` at 2 of 6 seeds
    in float32, `exact` in float64 at every seed). B within floors at its first update and
    beyond them later is `not judged` (status 3), with the float64 recording that judges it; a
    departure at the first update stays judged."""
    a = _float32_run("one", 1, [0.0, 0.0, 0.0])
    floor = _float32_run("floor", 1, [1e-7, 1e-7, 1e-7], row_blocks=2)
    later = comparer.compare_recordings(a, _float32_run("two", 2, [2e-7, 1e-3, 1e-3]),
                                        floor=floor)  # fmt: skip
    words = " ".join(later.words.split())
    assert (later.verdict, later.status) == ("not judged", 3), words
    assert later.departure[0] == 1 and "Record both runs in float64" in words, words
    # no class where no verdict is given: its floors said, not "its gradient is biased"
    assert "B leaves A's floors first at update 1: its gradient is " in words, words
    assert "its class not judged" in words and "departs from A first" not in words, words
    assert whole(later)["in_precision"] == "not judged", words
    # its gradient beyond floors at update 1, its loss at update 2: update 1 named, its floors
    sooner = comparer.compare_recordings(
        a, _float32_run("two", 2, [2e-7, 1e-3, 1e-3], loss_apart=[2e-7, 2e-7, 1e-3]), floor=floor
    )
    words = " ".join(sooner.words.split())
    assert (sooner.status, sooner.departure) == (3, (1, "all")), words
    assert "B leaves A's floors first at update 1: its gradient is " in words, words
    assert "its loss first leaves A's at update 2" in words, words
    first = comparer.compare_recordings(a, _float32_run("two", 2, [1e-3, 1e-3, 1e-3]),
                                        floor=floor)  # fmt: skip
    assert (first.status, first.departure[0]) == (1, 0), first.words
    # only the final weights beyond the tolerance (a user's clipped tensor-parallel job): said so,
    # where "No update departs" began the words
    weights = comparer.compare_recordings(
        a, _float32_run("two", 2, [2e-7, 2e-7, 1e-3], loss_apart=2e-7), floor=floor
    )
    words = " ".join(weights.words.split())
    assert weights.status == 3 and words.count("Update 0 is within floors: ") == 1, words
    assert "beyond it: its final weights." in words and "No update departs" not in words, words


def test_without_a_floor_a_first_loss_beyond_any_rounding_differs_though_the_gradients_agree():
    """A clipping that binds makes the first gradients of a loss W times one device's equal (a
    user's Hugging Face job with a summed loss: its loss half one device's at W = 2, its clipped
    gradient 1.1e-7 apart), where the losses are not: beyond any rounding of float32 without a
    floor, judged (``loss differs``, status 1), not ``not judged``; a first loss within rounding
    of A's largest leaves it not judged."""
    a = _float32_run("one", 1, [0.0, 0.0, 0.0])
    halved = comparer.compare_recordings(a, _float32_run("two", 2, [0.0] * 3, loss_apart=-0.5))
    assert (halved.verdict, halved.status) == ("loss differs", 1), halved.words
    assert whole(halved)["forward"] == "differs", halved.words
    rounded = comparer.compare_recordings(a, _float32_run("two", 2, [0.0] * 3, loss_apart=1e-6))
    assert (rounded.verdict, rounded.status) == ("not judged", 3), rounded.words


def _two_part_run(name: str, world_size: int, small_apart: float, row_blocks: int = 1,
                  both_apart: float = 0.0):  # fmt: skip
    """A float32 recording in memory of two parts over 3 updates, ``big`` 10⁵ times ``small``'s
    norm: each update ``small``'s gradient moved by ``small_apart`` (relative) along another
    direction, both by ``both_apart`` (the floor recording's rounding)."""
    from pathlib import Path

    from gatherlab.recording.format import Recording, Update

    direction, other = np.array([1.0, -2.0, 0.5, 3.0]), np.array([3.0, 1.0, -1.0, 0.5])
    unit = other / np.linalg.norm(other)

    def moved(scale: float, by: float) -> np.ndarray:
        return scale * (direction + by * np.linalg.norm(direction) * unit)

    rows = [[f"{i:016x}" for i in range(r * 8 // world_size, (r + 1) * 8 // world_size)]
            for r in range(world_size)]  # fmt: skip
    parameters = [{"name": p, "shape": [4], "part": p, "sharded": False} for p in ("big", "small")]
    header = {"world_size": world_size, "k": 4, "parts": ["big", "small"], "seed": 0,
              "sketch_seed": 0, "parameters": parameters, "precision": "32-true",
              "full_updates": 0, "settings": {"optimizer": "AdamW"},
              "row_blocks": row_blocks}  # fmt: skip
    sketches = {"big": moved(1e5, both_apart), "small": moved(1.0, both_apart + small_apart)}
    norms = {part: float(np.linalg.norm(sketch)) for part, sketch in sketches.items()}
    updates = [Update(u, [0.7] * world_size, 0.7, rows, sketches, norms, {}, None)
               for u in range(3)]  # fmt: skip
    weights = {part: moved(1.0, 0.0) for part in ("big", "small")}
    return Recording(Path(f"/nonexistent/{name}"), header, updates, weights,
                     {part: float(np.linalg.norm(w)) for part, w in weights.items()})  # fmt: skip


def test_a_part_beyond_its_floors_beside_a_whole_within_them_is_no_exact_within():
    """A part whose gradient departs beyond its floors while the whole's, diluted, stays within
    them (a user's bf16 MoE router, 31.7 floors, 0.07 relative, beside a whole at 3.9, read `exact
    within bf16`, exit 0): beyond any rounding of the precision it is ``biased``, named at the
    part; within that ceiling, one floor recording cannot tell it from rounding: ``not judged``,
    exit status 3, the words say why."""
    a = _two_part_run("one", 1, 0.0)
    floor = _two_part_run("floor", 1, 0.0, row_blocks=2, both_apart=1e-7)
    little = comparer.compare_recordings(a, _two_part_run("two", 2, 1e-5), floor=floor)
    words = " ".join(little.words.split())
    assert (little.verdict, little.status, little.departure) == ("not judged", 3, (0, "small"))
    assert "one part's is not: small at " in words and "cannot tell it from rounding" in words
    assert whole(little)["in_precision"] == "not judged", words
    far = comparer.compare_recordings(a, _two_part_run("two", 2, 1e-2), floor=floor)
    assert (far.verdict, far.status, far.departure) == ("biased", 1, (0, "small")), far.words
    within = comparer.compare_recordings(a, _two_part_run("two", 2, 1e-8), floor=floor)
    assert (within.verdict, within.status) == ("exact within float32", 0), within.words


def test_a_data_difference_in_floors_adds_no_usual_causes_of_a_loss():
    """Where the data differs, the words say so and guess no loss: the paragraph on a first loss
    that floors cannot resolve ("the usual causes above are not all there is") followed a data
    difference's, which lists none (a user's samplers seeded per rank, in bf16)."""
    a = _float32_run("one", 1, [0.0] * 3)
    floor = _float32_run("floor", 1, [1e-7] * 3, row_blocks=2)
    b = _float32_run("two", 2, [1e-3] * 3, loss_apart=2e-7)
    for update in b.updates:  # another row on rank 1 at every update
        update.rows[1][0] = "0123456789abcdef"
    compared = comparer.compare_recordings(a, b, floor=floor)
    words = " ".join(compared.words.split())
    assert compared.verdict == "data differs", words
    assert "usual causes above" not in words, words


def test_without_a_floor_an_unnamed_factor_says_its_direction_is_read_at_roundings_resolution():
    """Judged beyond any rounding without a floor, a class reads at that coarse resolution: a
    gradient `other` (its direction one device's to it) may point elsewhere, and its usual cause
    is a guess (a user's bf16 gather without its gradients' sum read `other`, a loss divided by
    the local batch its cause; `biased` with the floor)."""
    b = _float32_run("two", 2, [0.0] * 3)
    for update in b.updates:  # 0.75 times one device's: a factor no name of the layout gives
        update.sketches["w"] *= 0.75
        update.norms["w"] *= 0.75
    compared = comparer.compare_recordings(_float32_run("one", 1, [0.0] * 3), b)
    words = " ".join(compared.words.split())
    assert (whole(compared)["gradient"], compared.status) == ("other", 1), words
    assert "at the resolution of any rounding in float32" in words, words
    assert "the usual cause above is a guess" in words, words


def test_two_one_device_runs_apart_by_rounding_are_not_said_to_be_ranks():
    """A one-device B launched otherwise (a trainer's strategy under torchrun with one process)
    sums in another order: not judged without a floor, in words about its runs, not W ranks."""
    apart = comparer.compare_recordings(_float32_run("one", 1, [0.0] * 3),
                                        _float32_run("again", 1, [1e-7] * 3))  # fmt: skip
    words = " ".join(apart.words.split())
    assert apart.status == 3 and "one device's runs depart that sum in another order" in words
    assert "W ranks depart" not in words, words


def test_a_first_loss_beyond_floors_differs_though_the_runs_curves_allow_it():
    """Update 0's loss, computed at A's weights on A's rows, is judged in floors of the floor
    recording's loss there (at least the unit roundoff), as a check's measured loss is; the
    curves' tolerance, T times the floor's largest departure of any loss or weight over the run,
    holds the later updates. A user's bf16 job whose mean-pool forgot the padding mask read
    `forward same` beside a first loss 0.034 apart, where its floor's was 0, and was told to fix
    its gather."""
    a = _float32_run("one", 1, [0.0, 0.0, 0.0])
    floor = _float32_run("floor", 1, [1e-7, 1e-7, 1e-7], row_blocks=2)
    b = _float32_run("two", 2, [1e-3, 1e-3, 1e-3], loss_apart=1e-6)  # within the curves' 2e-6
    compared = comparer.compare_recordings(a, b, floor=floor)
    assert (whole(compared)["forward"], compared.verdict) == ("differs", "loss differs"), (
        compared.words
    )
    words = " ".join(compared.words.split())  # the first loss said apart, not "no update's"
    assert "its first loss departs from A's beyond the floors of the floor recording's" in words
    assert "; no update's loss leaves" not in words, words
    within = _float32_run("two", 2, [2e-7, 2e-7, 2e-7], loss_apart=2e-7)  # 2 floors of the loss
    assert whole(comparer.compare_recordings(a, within, floor=floor))["forward"] == "same"


def test_a_departing_gradient_beside_a_loss_within_floors_says_what_the_loss_cannot_show():
    """A loss within floors reads the same, yet may differ by less than they resolve: a user's
    bf16 job whose positives' labels missed the rank's offset (its loss 1.4 % apart, 5 floors
    of 0.4 % each) read `biased` with the gather's usual causes alone. The words now say how
    far the first loss is held, T floors of the floor recording's (its relative departure,
    1e-7 here, above float32's unit roundoff), and that float64 recordings tell the two apart."""
    a = _float32_run("one", 1, [0.0, 0.0, 0.0])
    floor = _float32_run("floor", 1, [1e-7, 1e-7, 1e-7], row_blocks=2)
    b = _float32_run("two", 2, [1e-3, 1e-3, 1e-3], loss_apart=2e-7)
    compared = comparer.compare_recordings(a, b, floor=floor)
    assert (whole(compared)["forward"], compared.verdict) == ("same", "biased"), compared.words
    threshold = compared.threshold
    words = " ".join(compared.words.split())
    assert (
        f"In float32 the first loss is held to {threshold:g} floors of the floor recording's "
        f"({threshold * 1e-7:.1e} relative): a loss that differs by less"
    ) in words, words
    assert "compare float64 recordings to tell a loss that differs" in words


def test_a_floor_of_other_settings_is_named_as_the_floor():
    """A floor recorded at another learning rate was refused as "A and B record different
    settings", though A and B agreed: the refusal names the floor first."""
    a = _float32_run("one", 1, [0.0, 0.0, 0.0])
    floor = _float32_run("floor", 1, [1e-7, 1e-7, 1e-7], row_blocks=2)
    floor.header["settings"] = {"optimizer": "SGD"}
    with pytest.raises(NotComparable) as refused:
        comparer.compare_recordings(a, _float32_run("two", 2, [0.0] * 3), floor=floor)
    assert str(refused.value).startswith(
        "--floor /nonexistent/floor, read as B here, is no floor of A: A and B record different "
        "settings: settings optimizer is 'AdamW' in A, 'SGD' in B"
    ), refused.value


def _clipping_run(norm: float, world_size: int, max_grad_norm: float | None,
                  turned: bool = False):  # fmt: skip
    """A float64 recording in memory of one part whose gradient at its 2 updates is one
    direction at ``norm`` (``turned``: another), the same rows and loss at every W, its header's
    clipping bound."""
    from pathlib import Path

    from gatherlab.recording.format import Recording, Update

    direction = np.array([3.0, -2.0, 0.5, 1.0] if turned else [1.0, -2.0, 0.5, 3.0])
    sketch = norm * direction / np.linalg.norm(direction)
    rows = [[f"{i:016x}" for i in range(r * 4, r * 4 + 4)] for r in range(world_size)]
    settings = {"optimizer": "AdamW"} | ({} if max_grad_norm is None else
                                         {"max_grad_norm": max_grad_norm})  # fmt: skip
    header = {"world_size": world_size, "k": 4, "parts": ["w"], "seed": 0, "sketch_seed": 0,
              "parameters": [{"name": "w", "shape": [4], "part": "w", "sharded": False}],
              "precision": "64-true", "full_updates": 0, "settings": settings}  # fmt: skip
    updates = [Update(u, [0.7] * world_size, 0.7, rows, {"w": sketch}, {"w": norm}, {}, None)
               for u in range(2)]  # fmt: skip
    return Recording(Path(f"/nonexistent/w{world_size}"), header, updates, {"w": sketch},
                     {"w": 1.0})  # fmt: skip


def test_a_gradient_clipped_to_its_bound_says_the_factor_read_is_after_clipping():
    """A Hugging Face Trainer at its defaults on 2 ranks (its loss W times one device's) with
    max_grad_norm 1.0: one device's gradient of norm 0.552 is left alone, B's of 1.10 is clipped
    to 1.0, and reads as a factor 1.81 that no layout gives (`other`, a user's job). The words
    say that B's norm is its bound, and to read the factor with clipping off; B's gradient at
    another norm, a recording without a bound, or a gradient in another direction (biased,
    which no clipping makes: a user's job read the paragraph there) says nothing of clipping."""
    a = _clipping_run(0.551741, 1, 1.0)
    clipped = comparer.compare_recordings(a, _clipping_run(1.0 - 1e-6, 2, 1.0))
    words = " ".join(clipped.words.split())
    assert (whole(clipped)["gradient"], clipped.status) == ("other", 1), words
    assert ("B clips its gradient (max_grad_norm 1 in its recording): its norm at update 0 is "
            "0.999999, the bound, where A's is 0.551741") in words, words  # fmt: skip
    unbound = _clipping_run(0.551741, 1, None)
    for one, b in ((a, _clipping_run(0.99, 2, 1.0)), (unbound, _clipping_run(1.0, 2, None))):
        assert "clips its gradient" not in comparer.compare_recordings(one, b).words
    turned = comparer.compare_recordings(a, _clipping_run(1.0 - 1e-6, 2, 1.0, turned=True))
    assert whole(turned)["gradient"] == "biased", turned.words  # clipping turns no direction
    assert "clips its gradient" not in turned.words, turned.words
