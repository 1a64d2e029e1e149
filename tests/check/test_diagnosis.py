"""The check's diagnosis (docs/checking.md §6): on losses written as public code writes them
(``examples/diagnosis_cases.py``), at W = 2 and 4, the per-part gradients, ``loss scaled`` with its
factor, the cause of a ``loss differs`` reproduced on one device, the reference run inside a
one-rank process group, a row for every W (``failed`` for the one whose ranks raise), and the exit
status, from Python, from ``gatherlab.testing`` and from the command line; then the same parts and
factor for a training step (docs/checking.md §10).

Every expected value comes from the mathematics of docs/design.md §1 (stated in
``diagnosis_cases``), not from a run: a gradient that reaches the model only through the rank's
own slice is exactly 1/W of one device's (norm ratio 1/W to rounding), a parameter used alike on
every rank after the gather is exact, a loss multiplied by W is W times one device's."""

from __future__ import annotations

import inspect
import re
import warnings

import diagnosis_cases
import pandas as pd
import pytest
import ssl_modules
import standins
import torch.distributed as dist
from helpers import run_command

from gatherlab import check
from gatherlab.check import hypotheses
from gatherlab.core import runfiles
from gatherlab.testing import assert_layout_invariant, assert_training_invariant

pytestmark = pytest.mark.slow

# A part's norm ratio is the mathematics' 1/W or 1 to rounding: float64 sums of a few hundred
# terms, relative 1e-10 (docs/design.md §2's bound).
RATIO = 1e-10
W = (2, 4)


def whole(table: pd.DataFrame) -> pd.DataFrame:
    """The rows of the whole gradient, one per W."""
    return table[table["part"] == "all"].set_index("world_size")


def part(table: pd.DataFrame, name: str) -> pd.DataFrame:
    return table[table["part"] == name].set_index("world_size")


def test_a_learnt_temperature_after_an_own_slice_gather_is_split_in_parts():
    result = check.check_loss(diagnosis_cases.LearntTemperatureOwnSlice, W, steps=2)
    assert list(result.table["part"]) == ["all", "model", "loss.log_temperature"] * 2
    rows = whole(result.table)
    assert list(rows["verdict"]) == ["biased", "biased"] and set(rows["cause"]) == {"parts"}
    model, temperature = part(result.table, "model"), part(result.table, "loss.log_temperature")
    assert list(model["gradient"]) == ["1/W", "1/W"]
    for world_size in W:
        assert model.loc[world_size, "norm_ratio"] == pytest.approx(1 / world_size, rel=RATIO)
        assert model.loc[world_size, "cosine"] == pytest.approx(1, rel=1e-12)
    assert list(temperature["gradient"]) == ["exact", "exact"]
    assert list(temperature["verdict"]) == ["exact", "exact"]  # a part has no curve to diverge
    assert (temperature["max_rel_err"] <= RATIO).all()
    assert result.table.loc[result.table["part"] != "all", "train_max_abs_loss_diff"].isna().all()
    assert not check.trains_like_one_device(result)
    text = " ".join(check.explain(result).split())
    assert "W = 2, 4: biased (parts)" in text
    assert "Measured per part: model 1/W (norm ratio 0.5, 0.25;" in text
    assert "loss.log_temperature exact (norm ratio 1, 1;" in text
    with pytest.raises(AssertionError, match="Measured per part: model 1/W"):
        assert_layout_invariant(diagnosis_cases.LearntTemperatureOwnSlice, W)


def test_a_loss_times_w_on_a_local_slot_gather_is_loss_scaled_and_trains_exactly():
    result = check.check_loss(diagnosis_cases.ScaledToUndoAverage, W, steps=3)
    rows = whole(result.table)
    assert list(result.table["part"]) == ["all", "all"]  # a loss without parameters: one part
    assert list(rows["verdict"]) == ["loss scaled", "loss scaled"]
    assert list(rows["gradient"]) == ["exact", "exact"] and set(rows["cause"]) == {"scaled"}
    for world_size in W:  # the constant W, on both batches, to rounding
        assert rows.loc[world_size, "scale"] == pytest.approx(world_size, rel=RATIO)
    # the training run's losses divided by c are one device's
    assert (rows["train_max_abs_loss_diff"] <= RATIO).all()
    assert check.trains_like_one_device(result)
    assert_layout_invariant(diagnosis_cases.ScaledToUndoAverage, W)  # passes: exit 0
    assert "| ×2 |" in check.explain(result) and "| ×4 |" in check.explain(result)


def test_assert_layout_invariant_fails_a_1_over_w_gradient_with_its_diagnosis():
    """gatherlab's global NT-Xent with `old`: every rank computes the full loss and the backward
    keeps only the own slice, so the gradient is one device's divided by W, exactly parallel
    (docs/design.md §1). The public assertion fails, its message the verdict, the norm ratio 1/W
    and the fix; a version that let 1/W through (as ``loss scaled`` is) would return the table."""
    with pytest.raises(AssertionError) as failure:
        assert_layout_invariant("gatherlab.losses:NTXentGlobalLoss", W, gather="old")
    text = " ".join(str(failure.value).split())
    assert "| gatherlab.losses:NTXentGlobalLoss | old | 4 | same | 1/W | 1/W |" in text
    assert "gatherlab.losses:NTXentGlobalLoss with gather old, W = 2, 4: 1/W" in text
    assert "The gradient is 1/W of one device's (norm ratio 0.5, 0.25, cosine 1, 1)" in text
    assert (
        "Fix: a gather whose backward sums every rank's gradient of each slice "
        "(gatherlab.gather.Fixed, Lightning's self.all_gather(x, sync_grads=True), or an "
        "autograd Function whose backward sums the gradient over the ranks "
        "(torch.distributed.all_reduce) and returns the rank's own slice)" in text
    )
    assert "torch.distributed.nn" not in text  # deprecated by this torch: never recommended


def test_a_buffer_moved_by_the_ranks_own_rows_diverges_after_an_exact_first_step():
    result = check.check_loss(diagnosis_cases.CenterFromOwnRows, W, steps=3)
    rows = whole(result.table)
    assert list(rows["forward"]) == ["same", "same"] and list(rows["gradient"]) == ["exact"] * 2
    assert list(rows["verdict"]) == ["diverges", "diverges"]
    assert not check.trains_like_one_device(result)
    assert "W = 2, 4: diverges" in check.explain(result)


@pytest.mark.parametrize(
    ("loss", "cause"),
    [("ViewsConcatenatedThenGathered", "pair_order"), ("LocalNegativesOnly", "local_negatives")],
)
def test_the_cause_of_a_differing_loss_is_the_hypothesis_that_reproduces_it(loss, cause):
    table = check.check_loss(getattr(diagnosis_cases, loss), W).table
    rows = whole(table)
    assert list(rows["verdict"]) == ["loss differs", "loss differs"]
    assert list(rows["cause"]) == [cause, cause] and rows["scale"].isna().all()
    with pytest.raises(AssertionError, match=f"loss differs \\({cause}\\)"):
        assert_layout_invariant(getattr(diagnosis_cases, loss), W)


def test_hypotheses_reproduce_what_they_state_and_nothing_else():
    """Each hypothesis on a forward whose value names the rows it saw: the rows and their order
    are those the hypothesis states (an independent statement of docs/checking.md §6)."""
    import torch

    view0 = torch.arange(8.0).reshape(8, 1)
    view1 = 100 + view0
    seen = []

    def forward(a, b, rows):  # the rows of the global batch it is told the first view holds
        assert a[:, 0].remainder(100).tolist() == view0[rows, 0].tolist()
        seen.append((a[:, 0].tolist(), b[:, 0].tolist()))
        return float(a.sum() - b.sum())

    hypotheses.pair_order(forward, (view0, view1), 2)
    # per rank [view0 rows; view1 rows], ranks in order, split in halves
    assert seen[-1] == ([0, 1, 2, 3, 100, 101, 102, 103], [4, 5, 6, 7, 104, 105, 106, 107])
    value = hypotheses.local_negatives(forward, (view0, view1), 4)
    assert seen[-4:] == [([2 * r, 2 * r + 1], [100 + 2 * r, 101 + 2 * r]) for r in range(4)]
    assert value == -200.0  # the mean of the four slices' values
    assert hypotheses.scale([2.0, 4.0], [1.0, 2.0]) == 2.0
    assert hypotheses.scale([2.0, 4.1], [1.0, 2.0]) is None  # not one constant
    assert hypotheses.scale([1.0, 2.0], [1.0, 2.0]) is None  # c = 1 is no scale


def test_a_hypothesis_whose_replay_breaks_the_loss_s_contract_holds_no_cause():
    """A loss that is not finite on a slice alone (rows a memory bank never held) raises the
    contract's error in the local replays; the pair-order replay still names its cause, and
    where nothing reproduces the losses the cause is unexplained, not an error."""
    import torch

    from gatherlab.runs.loss import LossContractError

    view0 = torch.arange(8.0).reshape(8, 1)
    view1 = 100 + view0

    def forward(a, b, rows):  # finite only on the whole batch's eight rows
        if len(a) < 8:
            raise LossContractError("the loss returned nan")
        return float(a[:4].sum() - b[:4].sum())

    batches = [(view0, view1), (2 * view0, view1)]
    pair_ordered = [hypotheses.pair_order(forward, batch, 2) for batch in batches]
    references = [1.0, 5.0]  # no one constant: not scaled
    assert hypotheses.cause(pair_ordered, references, forward, batches, 2) == ("pair_order", None)
    assert hypotheses.cause([3.0, 4.0], references, forward, batches, 2) == ("unexplained", None)
    assert hypotheses.cause([3.0, 4.0], references, forward, batches, 2, 2) == (
        "unexplained", None,
    )  # fmt: skip


def test_code_that_asserts_a_process_group_runs_unchanged_on_one_device():
    """Without a group the reference raises (its bare assert), so it runs in a one-rank group,
    and the column and the text say so with the plain run's error."""
    result = check.check_loss(diagnosis_cases.NeedsProcessGroup, W)
    assert list(whole(result.table)["verdict"]) == ["exact", "exact"]
    assert set(result.table["reference"]) == {"one-rank group"}
    lines, start = inspect.getsourcelines(diagnosis_cases.asserting_gather)
    line = start + next(i for i, text in enumerate(lines) if "assert dist.is_initialized()" in text)
    assert (
        "Its one-device reference ran in a one-rank process group: without one it raises "
        f"AssertionError at examples/diagnosis_cases.py:{line}."
    ) in " ".join(check.explain(result).split())
    gathered = check.check_gather(diagnosis_cases.asserting_gather, W).table
    assert set(gathered["verdict"]) == {"exact"}
    assert set(gathered["reference"]) == {"one-rank group"}  # each of the three losses
    assert not dist.is_initialized()  # the one-rank group is gone afterwards
    # in float32 its floor's one-device runs too (they raised "Default process group has not
    # been initialized" as a traceback, exit 1): judged in float64, its float32 run in floors
    low = check.check_loss(diagnosis_cases.NeedsProcessGroup, (2,), precision="32-true")
    assert list(whole(low.table)["verdict"]) == ["exact"], low.table.to_string()
    assert list(whole(low.table)["in_precision"]) == ["exact within float32"]
    assert not dist.is_initialized()


@pytest.fixture(scope="module")
def no_grad_gathers() -> dict[str, check.CheckResult]:
    """The check of the two losses whose ``concat_all_gather`` drops the gradient whenever a
    process group exists, at W = 2, 4."""
    cases = ("NoGradGatherNegatives", "GlobalNoGradGather")
    return {case: check.check_loss(getattr(diagnosis_cases, case), W) for case in cases}


def test_a_gather_without_gradient_under_a_group_is_judged_against_the_plain_run(
    no_grad_gathers,
):
    """The reference is the plain run (no group), whose keys keep their gradient; in a one-rank
    group they lose it, as on W ranks. So the W-rank gradient is biased, by the very numbers of
    the one-rank group's against the plain run (the W-rank gradient is the query path's only,
    the one-rank group's too: docs/checking.md §6), and the text reports that finding. A reference
    run in a one-rank group would call it exact."""
    result = no_grad_gathers["NoGradGatherNegatives"]
    table = result.table
    rows = whole(table)
    assert list(rows["forward"]) == ["same", "same"]
    assert list(rows["verdict"]) == ["biased", "biased"]
    assert set(table["reference"]) == {"no group"}
    cosine, norm_ratio = rows.loc[2, "cosine"], rows.loc[2, "norm_ratio"]
    assert cosine < 1 - 1e-3 and abs(norm_ratio - 1) > 1e-3  # far from exact
    assert rows.loc[4, "cosine"] == pytest.approx(cosine, rel=RATIO)  # the same at every W
    assert rows.loc[4, "norm_ratio"] == pytest.approx(norm_ratio, rel=RATIO)
    text = " ".join(check.explain(result).split())
    assert (
        "NoGradGatherNegatives: differs in a one-rank process group This loss "
        "trains differently on one device inside a process group than without one: the gradient "
        f"in a one-rank group is biased (cosine {cosine:.3g}, norm ratio {norm_ratio:.3g}) "
        "against the plain run's; the W-rank runs are judged against the plain run (no group)."
    ) in text
    assert "W = 2, 4: biased" in text


def test_a_global_loss_of_rows_gathered_without_gradient_gets_none_against_the_plain_run(
    no_grad_gathers,
):
    result = no_grad_gathers["GlobalNoGradGather"]
    table = result.table
    rows = whole(table)
    assert list(rows["verdict"]) == ["none", "none"] and (rows["norm_ratio"] == 0).all()
    assert set(table["reference"]) == {"no group"}
    text = " ".join(check.explain(result).split())
    assert "the gradient in a one-rank group is none (norm ratio 0) against the plain run's" in text
    assert "while one device has one" in text  # no gradient on W ranks only


def test_a_loss_that_trains_nothing_is_none_not_exact():
    """No gradient on either side: ``none`` (never ``exact``), its numbers undefined, and the
    diagnosis says that nothing trains, not that W ranks lost a gradient one device has."""
    result = check.check_loss(diagnosis_cases.TrainsNothing, W)
    rows = whole(result.table)
    assert list(rows["forward"]) == ["same", "same"]
    assert list(rows["verdict"]) == ["none", "none"]
    assert rows[["cosine", "norm_ratio", "max_rel_err"]].isna().all().all()
    assert not check.trains_like_one_device(result)
    text = " ".join(check.explain(result).split())
    assert "W = 2, 4: none No gradient reaches the model's parameters, on W ranks or on one" in text
    assert "differs in a one-rank process group" not in text  # both have none: they agree


def no_grad_negatives_step(model, batch):
    """A plain PyTorch step whose loss takes its negatives through ``concat_all_gather``."""
    x0, x1 = batch
    return diagnosis_cases.NoGradGatherNegatives()(model(x0), model(x1))


def needs_a_group_step(model, batch):
    """A plain PyTorch step whose loss gathers behind ``assert dist.is_initialized()``."""
    x0, x1 = batch
    return diagnosis_cases.NeedsProcessGroup()(model(x0), model(x1))


def test_a_training_step_that_needs_a_group_runs_every_one_device_run_in_one():
    """Its reference, and the reference of each removal, run in a one-rank group: the batch
    norm of its head is named, the removal's run exact against a reference that could not run
    without a group."""
    result = check.check_training(
        step="test_diagnosis:needs_a_group_step", model="plain_steps:build_model",
        model_kwargs={"batchnorm": True}, data="plain_steps:Pairs", world_sizes=W, steps=2,
        global_batch_size=16,
    )  # fmt: skip
    assert set(result.table["reference"]) == {"one-rank group"} and set(
        result.table["culprits"]
    ) == {"batchnorm"}
    removed = whole(result.table[result.table["removed"] == "batchnorm"])
    assert list(removed["verdict"]) == ["exact", "exact"]
    assert "needs_a_group_step: reference in a one-rank process group" in check.explain_training(
        result
    )


def test_a_training_step_is_judged_against_its_plain_one_device_run():
    """The check of a training step chooses its reference as the loss check does: the plain
    run, and the one-rank group's difference from it in words, with its numbers."""
    result = check.check_training(
        step="test_diagnosis:no_grad_negatives_step", model="plain_steps:build_model",
        data="plain_steps:Pairs", world_sizes=W, steps=2, global_batch_size=16,
    )  # fmt: skip
    assert set(result.table["reference"]) == {"no group"}
    rows = whole(result.table[result.table["removed"] == "none"])
    assert list(rows["verdict"]) == ["biased", "biased"] and set(result.table["culprits"]) == {
        "loss"
    }
    cosine, norm_ratio = rows.loc[2, "cosine"], rows.loc[2, "norm_ratio"]
    text = " ".join(check.explain_training(result).split())
    assert (
        "This training step trains differently on one device inside a process group than "
        f"without one: the gradient in a one-rank group is biased (cosine {cosine:.3g}, norm "
        f"ratio {norm_ratio:.3g}) against the plain run's; its losses depart from step 1 on"
    ) in text


class BareAssertBelowEightRows(diagnosis_cases.LocalNegativesOnly):
    def forward(self, z0, z1):
        assert len(z0) >= 8
        return super().forward(z0, z1)


def test_a_loss_failing_at_one_w_gets_a_failed_row_and_the_others_their_verdicts(tmp_path):
    result = run_command(
        "check", "diagnosis_cases:FailsAtFourRanks", "--out", str(tmp_path / "check")
    )
    assert result.returncode == 1, result.stderr
    table = pd.read_csv(tmp_path / "check" / runfiles.CHECK, keep_default_na=False)
    assert list(table["world_size"]) == [2, 4]
    assert list(table["verdict"]) == ["exact", "failed"]
    # every rank raises; the first answer names its rank
    assert re.fullmatch(
        r"rank [0-3]: ValueError: needs at least 8 rows per rank \(its block size\), got 4",
        table["error"][1],
    )
    assert "W = 4: failed" in result.stdout
    with pytest.raises(AssertionError, match="W = 4: failed"):
        assert_layout_invariant(diagnosis_cases.FailsAtFourRanks, W)
    # an exception without a message: its type and the user's file:line, never an empty line
    table = check.check_loss(BareAssertBelowEightRows, W).table
    line = inspect.getsourcelines(BareAssertBelowEightRows.forward)[1] + 1
    assert list(table["verdict"]) == ["loss differs", "failed"]
    assert re.fullmatch(f"rank [0-3]: AssertionError at tests/check/test_diagnosis.py:{line}",
                        table["error"][1])  # fmt: skip


def test_a_rank_that_raises_while_its_peer_waits_in_a_collective_fails_its_w(
    no_leftover_processes,
):
    table = check.check_loss(standins.FailsOnRankOne, (2,)).table
    assert list(table["verdict"]) == ["failed"]
    assert table["error"][0] == "rank 1: RuntimeError: rank-local failure"


def deprecated_gather(x):
    """An exact gather that warns on every call, as a deprecated collective does."""
    warnings.warn("this collective is deprecated", FutureWarning, stacklevel=1)
    return diagnosis_cases.asserting_gather(x)


def test_each_distinct_warning_of_the_ranks_is_shown_once_with_its_count(recwarn):
    table = check.check_gather(deprecated_gather, W).table
    assert set(table["verdict"]) == {"exact"}
    shown = [w for w in recwarn if "this collective is deprecated" in str(w.message)]
    # one run per W on the pool: 2 + 4 rank jobs, each raised it; and the reference, here
    assert [str(w.message) for w in shown] == [
        "this collective is deprecated (in 6 of 6 rank jobs, and on one device)"
    ]
    assert shown[0].category is FutureWarning


# case → the verdicts at W = 2, 4 and the exit status of the command line (docs/contract.md §5)
COMMAND_LINE = {
    "LearntTemperatureOwnSlice": (["biased", "biased"], 1),
    "ScaledToUndoAverage": (["loss scaled", "loss scaled"], 0),
    "ViewsConcatenatedThenGathered": (["loss differs", "loss differs"], 1),
    "NeedsProcessGroup": (["exact", "exact"], 0),
    "FailsAtFourRanks": (["exact", "failed"], 1),
    "LocalNegativesOnly": (["loss differs", "loss differs"], 1),
    "TrainsNothing": (["none", "none"], 1),
}


def test_the_command_line_exits_by_the_verdicts_of_each_pattern(tmp_path):
    for case, (verdicts, status) in COMMAND_LINE.items():
        out = tmp_path / case
        result = run_command("check", f"diagnosis_cases:{case}", "--out", str(out))
        assert result.returncode == status, (case, result.stdout, result.stderr)
        table = pd.read_csv(out / runfiles.CHECK)
        assert list(table.loc[table["part"] == "all", "verdict"]) == verdicts, case


class LearntTemperatureSimCLR(ssl_modules.SimCLR):
    def loss(self, temperature):
        return diagnosis_cases.LearntTemperatureOwnSlice(temperature)


class ScaledLossSimCLR(ssl_modules.SimCLR):
    def loss(self, temperature):
        rank, size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        return diagnosis_cases.ScaledToUndoAverage(temperature, rank=rank, world_size=size)


RUN = {"steps": 2, "global_batch_size": 16, "data_kwargs": {"size": 64}}


def test_a_training_step_is_split_in_its_top_level_parts():
    result = check.check_training(
        "test_diagnosis:LearntTemperatureSimCLR", "ssl_modules:GaussianPairs", W, **RUN
    )
    kept = result.table[result.table["removed"] == "none"]
    assert list(kept["part"]) == ["all", "backbone", "projection_head", "criterion"] * 2
    rows = whole(kept)
    assert list(rows["verdict"]) == ["biased", "biased"] and set(rows["cause"]) == {"parts"}
    for name in ("backbone", "projection_head"):
        for world_size in W:
            assert part(kept, name).loc[world_size, "gradient"] == "1/W"
            assert part(kept, name).loc[world_size, "norm_ratio"] == pytest.approx(
                1 / world_size, rel=RATIO
            )
    assert list(part(kept, "criterion")["gradient"]) == ["exact", "exact"]
    assert "W = 2, 4: biased (parts)" in check.explain_training(result)


class ConcatenatedViewsSimCLR(ssl_modules.SimCLR):
    def loss(self, temperature):
        return diagnosis_cases.ViewsConcatenatedThenGathered(temperature)


def test_a_training_step_whose_loss_pairs_rows_wrongly_names_the_cause_through_its_loss():
    result = check.check_training(
        "test_diagnosis:ConcatenatedViewsSimCLR", "ssl_modules:GaussianPairs", W,
        loss_attr="criterion", **RUN,
    )  # fmt: skip
    rows = whole(result.table)
    assert list(rows["verdict"]) == ["loss differs", "loss differs"]
    assert set(result.table["culprits"]) == {"loss"}
    loss_check = whole(result.loss_check.table)
    assert list(loss_check["cause"]) == ["pair_order", "pair_order"]
    assert "loss differs (pair_order)" in check.explain_training(result)


def test_a_training_step_whose_logged_loss_is_scaled_trains_like_one_device():
    table = assert_training_invariant(
        "test_diagnosis:ScaledLossSimCLR", "ssl_modules:GaussianPairs", W, **RUN
    ).table
    rows = whole(table)
    assert list(rows["verdict"]) == ["loss scaled", "loss scaled"]
    for world_size in W:
        assert rows.loc[world_size, "scale"] == pytest.approx(world_size, rel=RATIO)
    assert (rows["max_abs_param_diff"] <= RATIO).all()


# The advice to name a loss attribute (--loss-attr): for a LightningModule whose culprit is its
# loss, not for a plain step, which has no module to name it of.
LOSS_ATTR_ADVICE = "self.criterion), name it (--loss-attr) to check the loss alone."


def test_a_step_whose_culprit_is_its_loss_gets_no_loss_attribute_advice():
    result = check.check_training(
        step="test_diagnosis:no_grad_negatives_step", model="plain_steps:build_model",
        data="plain_steps:Pairs", world_sizes=(2,), steps=2, global_batch_size=16,
    )  # fmt: skip
    assert set(result.table["culprits"]) == {"loss"}
    text = check.explain_training(result)
    assert "loss, W = 2:" in text  # the culprit is explained
    assert "--loss-attr" not in text, text


def test_a_module_whose_culprit_is_its_loss_is_told_to_name_its_loss_attribute():
    result = check.check_training(
        "ssl_modules:SimCLRPre1531", "ssl_modules:GaussianPairs", (2,), steps=2,
        global_batch_size=16, data_kwargs={"size": 64},
    )  # fmt: skip
    assert set(result.table["culprits"]) == {"loss"}
    text = check.explain_training(result)
    assert "loss, W = 2:" in text
    assert text.count(LOSS_ATTR_ADVICE) == 1, text
