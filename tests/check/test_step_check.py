"""The check of a plain PyTorch training step (``--step``, docs/checking.md §10) on steps written
the way public code writes them (``examples/plain_steps.py``), on real gloo ranks at W = 2 and 4:
each gets the verdict and the culprits its code predicts, from Python and from the command line; a
step that draws augmentations from the global generator is named ``step_randomness``, for a
LightningModule too; bad input is one line, exit status 2, before any rank runs."""

from __future__ import annotations

import json

import pandas as pd
import plain_steps
import pytest
import ssl_modules
import torch
from bounds import FLOAT64_BOUND, MISS_FACTOR
from helpers import line_of, run_command

from gatherlab import check
from gatherlab.core import runfiles
from gatherlab.testing import assert_training_invariant

pytestmark = pytest.mark.slow

RUN = {"steps": 4, "global_batch_size": 16}
W = (2, 4)

# step, model arguments, data → the verdict at W = 2 and 4 and the culprits, from what each step's
# code does (plain_steps' docstring), not from a run
EXPECTED = {
    "exact": ("training_step", {}, "Pairs", "exact", ""),
    "batch_norm": ("training_step", {"batchnorm": True}, "Pairs", "loss differs", "batchnorm"),
    "dropout": ("training_step", {"dropout": 0.2}, "Pairs", "loss differs", "dropout"),
    "augments_in_the_step": ("augmenting_step", {}, "Points", "loss differs", "step_randomness"),
}


def runs(table: pd.DataFrame) -> pd.DataFrame:
    return table[table["part"] == "all"]


# case → where its run without removals departs first (docs/checking.md §6, "Where it departs"): the
# line of the step's code, the operation, and what differs at W = 2 (two views of 16 concatenated)
WHERE = {
    "batch_norm": ("model(torch.cat([x0, x1]))", "batch_norm", "a batch_norm over dim 0 of the "
                   "rank's 16 rows, where one device takes all 32"),
    "dropout": ("model(torch.cat([x0, x1]))", "dropout", "a dropout whose inputs agree with one "
                "device's gives another result on rank 0"),
    "augments_in_the_step": ("x0 = batch + 0.1 * torch.randn_like(batch)", "randn_like",
                             "a randn_like whose inputs agree with one device's gives another"),
}  # fmt: skip


@pytest.mark.parametrize("case", EXPECTED)
def test_each_plain_step_gets_its_verdict_and_culprits(case):
    step, model_kwargs, data, verdict, culprits = EXPECTED[case]
    table = check.check_training(
        step=f"plain_steps:{step}", model="plain_steps:build_model", model_kwargs=model_kwargs,
        data=f"plain_steps:{data}", world_sizes=W, **RUN,
    ).table  # fmt: skip
    kept = runs(table)[runs(table)["removed"] == "none"].set_index("world_size")
    assert list(kept["verdict"]) == [verdict, verdict], table.to_string()
    assert set(table["culprits"]) == {culprits}, table.to_string()
    # the model's parts: its backbone and its projection head (nn.Sequential's children)
    assert set(table.loc[table["removed"] == "none", "part"]) == {"all", "0", "1"}
    if verdict == "exact":
        assert (kept["train_max_abs_loss_diff"] <= FLOAT64_BOUND).all()
        assert (kept["max_abs_param_diff"] <= FLOAT64_BOUND).all()
        return
    assert (kept["train_max_abs_loss_diff"] > MISS_FACTOR * FLOAT64_BOUND).all()
    text, op, words = WHERE[case]
    assert list(kept["where"]) == [f"{line_of(plain_steps, text)}  {op}"] * 2, table.to_string()
    assert kept.loc[2, "departs"].startswith(words), kept.loc[2, "departs"]
    if culprits != "step_randomness":  # with the cause removed, every step is exact again
        removed = runs(table)[runs(table)["removed"] == culprits]
        assert list(removed["verdict"]) == ["exact", "exact"], table.to_string()
        assert (removed["max_abs_param_diff"] <= FLOAT64_BOUND).all()


def test_a_local_losss_dropped_gradient_is_named_at_its_gather_not_at_the_ranks_mean():
    """A step whose loss is a mean over the rank's own anchors returns the rank's part of one
    device's loss (their mean over ranks is it): the walk reads the returned loss's path so. A
    user's such step with a gather that keeps its own slice alone was named at its
    cross_entropy, "over dim 0 of the rank's 8 rows", where the loss check named the gather's
    backward: the step's loss, reshaped by the check, was no record."""
    table = check.check_training(
        step="plain_steps:own_slice_step", model="plain_steps:build_model",
        data="plain_steps:Pairs", world_sizes=(2,), **RUN,
    ).table  # fmt: skip
    kept = runs(table)[runs(table)["removed"] == "none"].iloc[0]
    assert kept["verdict"] == "biased", table.to_string()
    assert kept["departs"].endswith(
        f"OwnSliceGather.backward at {line_of(plain_steps, 'def backward(ctx, grad)')} produces it"
    ), kept["departs"]


def test_the_command_line_checks_each_step_and_exits_by_its_verdict(tmp_path):
    """Each step with ``--optimizer torch.optim:AdamW``: the 1-device runs, in this process, step
    AdamW with lr 1e-3 and its default weight decay 0.01 (stepped.optimizer_steps)."""
    from stepped import STEPPED, optimizer_steps

    for case, (step, model_kwargs, data, verdict, culprits) in EXPECTED.items():
        out = tmp_path / case
        with optimizer_steps() as stepped:
            result = run_command(
                "check", "--step", f"plain_steps:{step}", "--model", "plain_steps:build_model",
                "--model-kwargs", json.dumps(model_kwargs), "--data", f"plain_steps:{data}",
                "--world-sizes", "2,4", "--steps", "3", "--global-batch-size", "16",
                "--optimizer", "torch.optim:AdamW", "--optimizer-kwargs", '{"lr": 0.001}',
                "--out", str(out),
            )  # fmt: skip
        assert result.returncode == (0 if verdict == "exact" else 1), result.stdout
        assert stepped and all(one == STEPPED["adamw"] for one in stepped), (case, stepped)
        written = runs(pd.read_csv(out / runfiles.CHECK, keep_default_na=False))
        kept = written[written["removed"] == "none"]
        assert list(kept["verdict"]) == [verdict, verdict], (case, result.stdout)
        assert set(written["culprits"]) == {culprits}, (case, result.stdout)
        if culprits:
            assert f"| 2 | {verdict} | {culprits} |" in result.stdout
            assert f"{culprits}, W = 2, 4:" in result.stdout


class AugmentingSimCLR(ssl_modules.SimCLR):
    """A LightningModule that draws its two views in ``training_step`` (global generator)."""

    def training_step(self, batch, batch_index):
        x = batch
        x0, x1 = x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x)
        return self.criterion(self(x0), self(x1))


def test_a_lightning_step_that_draws_randomness_is_named_too():
    with pytest.raises(AssertionError, match="step_randomness, W = 2:"):
        assert_training_invariant(
            "test_step_check:AugmentingSimCLR", "plain_steps:Points", (2,), **RUN
        )


def test_assert_training_invariant_fails_a_plain_step_naming_its_culprit():
    """The public assertion on a plain PyTorch step (``step=``, ``model=``) that must fail: a model
    with dropout draws each sample's mask on the rank that holds it (docs/checking.md §10). The
    message names the culprit at both W, the run with it removed exact, and the fix; the rows
    with the removal made (exact) must not let the step pass."""
    with pytest.raises(AssertionError) as failure:
        assert_training_invariant(
            step="plain_steps:training_step", model="plain_steps:build_model",
            model_kwargs={"dropout": 0.2}, data="plain_steps:Pairs", world_sizes=W, **RUN,
        )  # fmt: skip
    text = " ".join(str(failure.value).split())
    assert "| 2 | loss differs | dropout | exact |" in text
    assert "| 4 | loss differs | dropout | exact |" in text
    assert "dropout, W = 2, 4: Dropout masks come from each process's random generator" in text
    assert "Fix: draw each sample's mask from a generator seeded by" in text


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--step", "plain_steps:returns_nothing"],
         "--step plain_steps:returns_nothing on one device: TypeError: the step returned nothing; "
         "allowed: the loss, a scalar tensor"),
        (["--step", "plain_steps:returns_per_sample"],
         "the step returned a tensor of shape (16,); allowed: the loss, a scalar tensor"),
        (["--step", "plain_steps:training_step", "--model", "plain_steps:builds_a_dict"],
         "--model plain_steps:builds_a_dict returned a dict; allowed: a torch.nn.Module"),
        (["--step", "plain_steps:training_step", "--optimizer", "torch.optim:Nope"],
         "optimizer torch.optim:Nope: torch.optim has no attribute 'Nope'"),
    ],
)  # fmt: skip
def test_bad_input_to_a_step_is_one_line_before_any_rank(
    arguments, message, tmp_path, no_leftover_processes
):
    if "--model" not in arguments:
        arguments = [*arguments, "--model", "plain_steps:build_model"]
    result = run_command(
        "check", *arguments, "--data", "plain_steps:Pairs", "--world-sizes", "2,4",
        "--steps", "2", "--global-batch-size", "16", "--out", str(tmp_path / "check"),
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not (tmp_path / "check").exists()
