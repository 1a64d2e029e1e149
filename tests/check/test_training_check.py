"""The check of a training step (docs/checking.md §10) on modules written the way public SSL code
writes them (``examples/ssl_modules.py``), on real gloo ranks at W = 2 and 4: each gets the verdict
and the causes that its code predicts, an exact module agrees with one device to the float64 bound
at every step, the command line exits 0, 1 or 2, and bad input is one line before any rank runs."""

from __future__ import annotations

import pandas as pd
import pytest
import ssl_modules
import standins
import torch
from bounds import FLOAT64_BOUND, MISS_FACTOR
from helpers import def_line, line_of, run_command

from gatherlab import check
from gatherlab.core import runfiles
from gatherlab.testing import assert_training_invariant

pytestmark = pytest.mark.slow

# A short run: 4 steps of a global batch of 16 over 64 samples (the data sets' own sizes).
RUN = {"steps": 4, "global_batch_size": 16, "data_kwargs": {"size": 64}}

# module, data → the verdict at W = 2 and 4 and the causes, from what each module's code does
# (docs/checking.md §10), not from a run
EXPECTED = {
    "exact": ("SimCLR", "GaussianPairs", "exact", ""),
    "ema_teacher": ("BYOL", "GaussianPairs", "exact", ""),
    "batch_norm": ("SimCLRWithBatchNorm", "GaussianPairs", "loss differs", "batchnorm"),
    "dropout": ("SimCLRWithDropout", "GaussianPairs", "loss differs", "dropout"),
    "global_rng_data": ("SimCLR", "AugmentedGaussians", "loss differs", "data_randomness"),
    "two_causes": (
        "SimCLRWithBatchNorm",
        "AugmentedGaussians",
        "loss differs",
        "batchnorm;data_randomness",
    ),
    "pre_1531_gather": ("SimCLRPre1531", "GaussianPairs", "biased", "loss"),
}


# case → where its run without removals departs first (docs/checking.md §6, "Where it departs"): the
# line of the module's code and the operation, and what differs at W = 2 (each view through the
# model on its own: 16 rows on one device, 8 per rank; rank 0 draws from the streams what one device
# draws for its first rows, so randomness shows on rank 1 first)
FORWARD = "return self.projection_head(self.backbone(x))"
WHERE = {
    "batch_norm": (FORWARD, "batch_norm", "a batch_norm over dim 0 of the rank's 8 rows, where "
                   "one device takes all 16"),
    "dropout": (FORWARD, "dropout", "a dropout whose inputs agree with one device's gives another "
                "result on rank 1"),
    "global_rng_data": (None, "input", "the batch[0] that rank 1 is given is not its part of what "
                        "one device is given"),
    "two_causes": (None, "input", "the batch[0] that rank 1 is given is not its part"),
    "pre_1531_gather": (standins.OwnSliceGather.backward, "OwnSliceGather.backward",
                        "the gradient of the result of normalize at standins.py"),
}  # fmt: skip


@pytest.mark.parametrize("case", EXPECTED)
def test_each_module_gets_its_verdict_and_causes(case):
    module, data, verdict, culprits = EXPECTED[case]
    table = check.check_training(
        f"ssl_modules:{module}", f"ssl_modules:{data}", (2, 4), **RUN
    ).table
    table = table[table["part"] == "all"]  # the runs (their parts: tests/check/test_diagnosis.py)
    baseline = table[table["removed"] == "none"].set_index("world_size")
    assert list(baseline.index) == [2, 4]
    assert list(baseline["verdict"]) == [verdict, verdict], table.to_string()
    assert set(table["culprits"]) == {culprits}, table.to_string()
    if verdict == "exact":  # every step and every weight, to the float64 bound
        assert (baseline["train_max_abs_loss_diff"] <= FLOAT64_BOUND).all()
        assert (baseline["max_abs_param_diff"] <= FLOAT64_BOUND).all()
        assert len(table) == 2  # nothing else was run
        return
    assert (baseline["train_max_abs_loss_diff"] > MISS_FACTOR * FLOAT64_BOUND).all()
    text, op, words = WHERE[case]
    if text is None or isinstance(text, str):
        place = "batch[0]" if text is None else line_of(ssl_modules, text)
    else:  # a custom backward: its def line
        place = def_line(text)
    assert list(baseline["where"]) == [f"{place}  {op}"] * 2, table.to_string()
    assert baseline.loc[2, "departs"].startswith(words), baseline.loc[2, "departs"]
    removed = table[table["removed"] == ("all" if ";" in culprits else culprits)]
    if culprits != "loss":  # with the causes removed, the run is exact again
        assert list(removed["verdict"]) == ["exact", "exact"], table.to_string()
        assert (removed["train_max_abs_loss_diff"] <= FLOAT64_BOUND).all()
    if ";" in culprits:  # neither removal alone is enough: each leaves the other cause
        alone = table[table["removed"].isin(culprits.split(";"))]
        assert (alone["verdict"] == "loss differs").all(), table.to_string()


@pytest.mark.parametrize(("sync_grads", "verdict"), [(True, "exact"), (False, "biased")])
def test_a_module_that_gathers_with_lightnings_own_all_gather_is_checked(sync_grads, verdict):
    """``self.all_gather(z, sync_grads=True)``, Lightning's own gather, sums every rank's gradient
    of the rank's rows: exact at W = 2, every step and weight to the float64 bound; with
    ``sync_grads=False`` the other ranks' gradients are dropped: biased. Its step run alone (the
    check's first step in float64) reaches one device's ``all_gather`` and ``self.log``; it
    raised "not attached to a Trainer", and the check refused the module in one line."""
    table = check.check_training(
        "ssl_modules:LightningGatherCLIP", "ssl_modules:GaussianPairs", (2,), **RUN,
        module_kwargs={"sync_grads": sync_grads},
    ).table  # fmt: skip
    run = table[(table["part"] == "all") & (table["removed"] == "none")].iloc[0]
    assert run["verdict"] == verdict, table.to_string()
    if verdict == "exact":
        assert run["train_max_abs_loss_diff"] <= FLOAT64_BOUND
        assert run["max_abs_param_diff"] <= FLOAT64_BOUND
    else:
        assert run["train_max_abs_loss_diff"] > MISS_FACTOR * FLOAT64_BOUND


def test_the_gather_that_breaks_a_module_is_checked_as_a_loss_on_its_own():
    result = check.check_training(
        "ssl_modules:SimCLRPre1531", "ssl_modules:GaussianPairs", (2, 4), loss_attr="criterion",
        **RUN,
    )  # fmt: skip
    # the module's first step is the first step of the loss on the module's embeddings: the same
    # loss value, a gradient that is not the 1-device one
    first = result.table[result.table["part"] == "all"].set_index("world_size")
    assert (first["forward"] == "same").all() and (first["first_diff_step"] == 1).all()
    # the loss attribute checked alone equals the stand-in checked directly (same class, same
    # embeddings of gatherlab's MLP): biased, as lightly's issue #1528 describes
    loss_check = result.loss_check.table
    direct = check.check_loss(standins.Pre1531NTXent, (2, 4), temperature=0.5).table
    assert list(loss_check["verdict"]) == ["biased", "biased"]
    for column in ("cosine", "norm_ratio", "max_rel_err"):
        assert loss_check[column].tolist() == pytest.approx(direct[column].tolist(), rel=1e-12)
    text = " ".join(check.explain_training(result).split())
    assert "loss, W = 2, 4:" in text and "Fix: a gather whose backward sums every rank" in text


def test_the_command_line_exits_by_its_verdict_and_writes_its_table(tmp_path):
    arguments = ["--world-sizes", "2", "--steps", "4", "--global-batch-size", "16",
                 "--data-kwargs", '{"size": 64}']  # fmt: skip
    exact = run_command(
        "check", "--module", "ssl_modules:SimCLR", "--data", "ssl_modules:GaussianPairs",
        *arguments, "--out", str(tmp_path / "exact"),
    )  # fmt: skip
    assert exact.returncode == 0, exact.stderr
    assert "Every world size trains like one device." in exact.stdout
    broken = run_command(
        "check", "--module", "ssl_modules:SimCLRWithDropout", "--data",
        "ssl_modules:GaussianPairs", *arguments, "--out", str(tmp_path / "dropout"),
    )  # fmt: skip
    assert broken.returncode == 1, broken.stderr
    assert "| 2 | loss differs | dropout | exact |" in broken.stdout
    table = pd.read_csv(tmp_path / "dropout" / runfiles.CHECK)
    table = table[table["part"] == "all"]
    assert list(table["removed"]) == ["none", "dropout"]
    assert list(table["culprits"]) == ["dropout", "dropout"]
    again = run_command(
        "check", "--module", "ssl_modules:SimCLR", "--data", "ssl_modules:GaussianPairs",
        *arguments, "--out", str(tmp_path / "exact"),
    )  # fmt: skip
    assert again.returncode == 2 and "never overwritten" in again.stderr


class NotAModule:
    pass


class RaisesOnRankOne(ssl_modules.SimCLR):
    def training_step(self, batch, batch_index):
        if self.global_rank == 1:
            raise ValueError("rank one refuses")
        return super().training_step(batch, batch_index)


def test_a_rank_that_raises_fails_its_w_with_its_rank_named(tmp_path, no_leftover_processes):
    failed = run_command(
        "check", "--module", "test_training_check:RaisesOnRankOne", "--data",
        "ssl_modules:GaussianPairs", "--world-sizes", "2", "--steps", "2", "--global-batch-size",
        "8", "--data-kwargs", '{"size": 16}', "--out", str(tmp_path / "check"),
    )  # fmt: skip
    assert failed.returncode == 1 and failed.stderr == ""
    table = pd.read_csv(tmp_path / "check" / runfiles.CHECK, keep_default_na=False)
    assert list(table["verdict"]) == ["failed"]
    assert table["error"][0] == "rank 1: ValueError: rank one refuses"
    assert "W = 2: failed" in failed.stdout


class NoLoss(ssl_modules.SimCLR):
    def training_step(self, batch, batch_index):
        self(batch[0])  # forgets to return the loss


class Unsized(torch.utils.data.Dataset):
    def __init__(self, size: int = 64):
        self.size = size

    def __getitem__(self, index):
        return index


@pytest.mark.parametrize(
    ("module", "data", "extra", "message"),
    [
        ("test_training_check:NotAModule", "ssl_modules:GaussianPairs", {},
         "--module test_training_check:NotAModule built a NotAModule; allowed: a "
         "lightning.LightningModule"),
        ("ssl_modules:SimCLR", "test_training_check:Unsized", {},
         "--data built a Unsized without __len__ and __getitem__; allowed: a map-style data set"),
        ("ssl_modules:SimCLR", "ssl_modules:GaussianPairs", {"global_batch_size": 18},
         "world size 4 does not divide --global-batch-size 18"),
        ("ssl_modules:SimCLR", "ssl_modules:GaussianPairs", {"global_batch_size": 512},
         "--global-batch-size 512 exceeds the 64 samples of the data set"),
        ("ssl_modules:SimCLR", "ssl_modules:GaussianPairs", {"module_kwargs": {"depth": 3}},
         "--module ssl_modules:SimCLR: cannot be built: TypeError"),
        ("test_training_check:NoLoss", "ssl_modules:GaussianPairs", {},
         "training_step returned nothing; allowed: the loss tensor or a dict with 'loss'"),
        ("ssl_modules:Nope", "ssl_modules:GaussianPairs", {},
         "module ssl_modules:Nope: ssl_modules has no attribute 'Nope'"),
    ],
)  # fmt: skip
@pytest.mark.filterwarnings("ignore:`training_step` returned `None`")
def test_bad_input_is_one_line_before_any_rank(module, data, extra, message, no_leftover_processes):
    arguments = {**RUN, **extra}
    with pytest.raises(check.CheckError) as error:
        check.check_training(module, data, (2, 4), **arguments)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_assert_training_invariant_fails_with_the_diagnosis():
    assert_training_invariant("ssl_modules:BYOL", "ssl_modules:GaussianPairs", (2,), **RUN)
    with pytest.raises(AssertionError, match="batchnorm, W = 2:"):
        assert_training_invariant(
            "ssl_modules:SimCLRWithBatchNorm", "ssl_modules:GaussianPairs", (2,), **RUN
        )


def test_batches_are_collated_by_the_module_then_the_data_set_then_pytorch():
    from torch.utils.data import default_collate

    from gatherlab.runs.fit import collate_fn_of

    def by_module(items):
        return "module"

    def by_data(items):
        return "data"

    module, data = ssl_modules.SimCLR(), ssl_modules.GaussianPairs(size=8)
    assert collate_fn_of(module, data) is default_collate
    data.collate_fn = by_data
    assert collate_fn_of(module, data) is by_data
    module.collate_fn = by_module
    assert collate_fn_of(module, data) is by_module
