"""``gatherlab.check`` on real gloo ranks: stand-ins for public losses (``tests/standins.py``) get
the verdict the mathematics of docs/design.md §1 predicts, at W = 2 and 4; every option of the
``gather`` config group (conf/gather/, the one registry of gathers) through ``--gather``; bad input
is one line; ``assert_layout_invariant`` fails with its diagnosis; a foreign loss trains in a sweep
with ``loss=user gather=native``, and gatherlab's own losses are refused with it."""

from __future__ import annotations

import pandas as pd
import pytest
import standins
from helpers import compose, run_command
from test_training import FLOAT64_BOUND, MISS_FACTOR

from gatherlab import check
from gatherlab import gather as gathering
from gatherlab.analysis import report
from gatherlab.check import api, measure
from gatherlab.check.table import TRAIN_COLUMN
from gatherlab.components import config
from gatherlab.components.config import ConfigError
from gatherlab.components.factory import Recipe
from gatherlab.core import runfiles
from gatherlab.lab import validation
from gatherlab.testing import assert_layout_invariant

pytestmark = pytest.mark.slow

# stand-in, its arguments → the verdict at W = 2 and 4, from docs/design.md §1 (not from a run)
EXPECTED = {
    "autograd_gather": ("GatherLayerNTXent", {}, "exact"),
    "nograd_swap_global": ("ClipLossForCheck", {}, "1/W"),
    "nograd_swap_local": ("ClipLossForCheck", {"local_loss": True}, "biased"),
    "clip_gather_with_grad": ("ClipLossForCheck", {"gather_with_grad": True}, "exact"),
    "nograd_swap_learnt_scale": ("ClipLossForCheck", {"learn_logit_scale": True}, "biased"),
    "rank_statistics": ("LocallyStandardisedBarlowTwins", {}, "loss differs"),
    "nograd_global": ("MocoStyleGlobalLoss", {}, "none"),
    "times_w": ("CompensatedGlobalLoss", {}, "W"),
}


@pytest.mark.parametrize("case", EXPECTED)
def test_each_stand_in_gets_its_predicted_verdict(case):
    name, kwargs, expected = EXPECTED[case]
    table = check.check_loss(f"standins:{name}", (2, 4), **kwargs)
    table = table[table["part"] == "all"]  # a learnt scale's parts: tests/test_diagnosis.py
    assert list(table["world_size"]) == [2, 4]
    assert list(table["verdict"]) == [expected, expected], table.to_string()
    if expected == "loss differs":
        assert (table["loss_diff"] > MISS_FACTOR * measure.FORWARD_RELATIVE_TOLERANCE).all()
        return
    assert (table["forward"] == "same").all()
    assert (table["loss_diff"] <= measure.FORWARD_RELATIVE_TOLERANCE).all()
    if expected == "exact":
        assert (table["max_rel_err"] <= measure.EXACT_RELATIVE_ERROR).all()
    elif expected in ("1/W", "W"):
        scale = [1 / 2, 1 / 4] if expected == "1/W" else [2, 4]
        assert table["norm_ratio"].tolist() == pytest.approx(scale, rel=1e-12)
        assert (table["cosine"] >= measure.PARALLEL_COSINE).all()
    elif expected == "biased":  # far from parallel, not a rounding effect
        assert (table["cosine"] < 1 - 1e-6).all()
    elif expected == "none":
        assert (table["norm_ratio"] == 0).all()


def test_a_loss_gets_rank_and_world_size_when_it_takes_them_and_the_user_did_not_set_them():
    assert Recipe(standins.ClipLossForCheck).arguments() == {"rank": 0, "world_size": 1}
    assert Recipe(standins.ClipLossForCheck, {"world_size": 3}).arguments() == {
        "world_size": 3,
        "rank": 0,
    }
    assert Recipe(standins.GatherLayerNTXent).arguments() == {}
    gather = standins.gather_with_grad
    assert Recipe(standins.PerSampleLoss, {}, gather).arguments() == {"gather": gather}


def test_every_option_of_the_gather_group_is_a_gather_the_check_takes():
    """conf/gather/ is the one registry of gathers: every option of the group is a name that
    ``check_gather``/``--gather`` takes (``api._gather``: built by Hydra as the audit composes it,
    ``config.build_gather_option``), the same gather ``gatherlab.gather.get`` reads from the file;
    ``native`` is an option but no gather, refused in one line. (No ranks: the real run is the
    command line's, ``--gather fixed_all_reduce`` below.)"""
    with config.composed():
        options = config.group_options("gather", list(api.GATHER_SETTING))
    gathers = [name for name in options if name != "native"]
    assert set(gathers) == set(gathering.NAMES) and "fixed_all_reduce" in gathers
    for name in gathers:
        assert api._gather(name) == (name, gathering.get(name)), name
    with pytest.raises(check.CheckError) as refusal:
        check.check_gather("native")
    message = str(refusal.value)
    assert message.startswith("--gather native is no gather (the loss communicates by itself); ")
    assert "\n" not in message and f"allowed: {', '.join(sorted(gathers))}, or" in message


def test_built_in_gathers_through_gather():
    fixed = check.check_gather("fixed", (2, 4))
    assert set(fixed["verdict"]) == {"exact"}
    old = check.check_gather("old", (2, 4))
    verdicts = {(row.loss, row.world_size): row.verdict for row in old.itertuples()}
    assert verdicts == {
        ("ntxent", 2): "biased", ("ntxent", 4): "biased",
        ("ntxent_global", 2): "1/W", ("ntxent_global", 4): "1/W",
        ("vicreg", 2): "biased", ("vicreg", 4): "biased",
    }  # fmt: skip


def test_the_command_line_checks_a_foreign_gather_and_writes_check_csv(tmp_path):
    out = tmp_path / "check"
    result = run_command("check", "--gather", "standins:gather_with_grad", "--out", str(out))
    assert result.returncode == 0, result.stderr
    table = pd.read_csv(out / runfiles.CHECK)
    assert list(table.columns) == list(check.COLUMNS)
    assert len(table) == 6 and set(table["verdict"]) == {"exact"}
    assert "Every world size trains like one device" in result.stdout
    forced = tmp_path / "fixed_all_reduce"  # an option of conf/gather/ that only its YAML names
    result = run_command(
        "check", "--gather", "fixed_all_reduce", "--world-sizes", "2", "--out", str(forced)
    )
    assert result.returncode == 0, result.stderr
    table = pd.read_csv(forced / runfiles.CHECK)
    assert set(table["gather"]) == {"fixed_all_reduce"} and set(table["verdict"]) == {"exact"}
    assert list(table["loss"]) == ["ntxent", "ntxent_global", "vicreg"]
    again = run_command("check", "--gather", "fixed", "--out", str(out))
    assert again.returncode == 2
    assert "already holds a check; it is never overwritten" in again.stderr


def test_the_command_line_prints_the_diagnosis_and_exits_1_with_training_steps(tmp_path):
    out = tmp_path / "check"
    result = run_command(
        "check",
        "standins:ClipLossForCheck",
        "--world-sizes",
        "2",
        "--steps",
        "5",
        "--out",
        str(out),
    )
    assert result.returncode == 1, result.stderr
    assert "standins:ClipLossForCheck, W = 2: 1/W" in result.stdout
    assert "SGD's effective learning rate is divided by W" in " ".join(result.stdout.split())
    table = pd.read_csv(out / runfiles.CHECK)
    assert table[TRAIN_COLUMN].iloc[0] > MISS_FACTOR * FLOAT64_BOUND
    exact = check.check_loss(standins.ClipLossForCheck, (2,), steps=5, gather_with_grad=True)
    assert exact[TRAIN_COLUMN].iloc[0] <= FLOAT64_BOUND


@pytest.mark.parametrize(
    ("arguments", "status", "message"),
    [
        (["nopkg.losses:Loss"], 2, "loss nopkg.losses:Loss: cannot import nopkg.losses"),
        (["standins:Nope"], 2, "loss standins:Nope: standins has no attribute 'Nope'"),
        (["standins:ClipLossForCheck", "--kwargs", "{oops"], 2, "is not JSON"),
        (
            ["standins:ClipLossForCheck", "--kwargs", '{"temperature": 1}'],
            2,
            "unexpected keyword argument 'temperature'",
        ),
        (["standins:PerSampleLoss"], 2, "the loss returned (16,); allowed: a scalar tensor"),
        (["standins:NanLoss"], 2, "the loss returned nan; allowed: a finite value"),
        (
            ["standins:ClipLossForCheck", "--world-sizes", "3"],
            2,
            "does not divide the global batch",
        ),
        (["--gather", "nowhere:gather"], 2, "--gather nowhere:gather: cannot import nowhere"),
        (["--gather", "nope"], 2, "--gather nope is unknown; allowed: avg, fixed, fixed_all"),
        (["--gather", "native"], 2, "--gather native is no gather (the loss communicates by"),
        (
            ["gatherlab.losses:NTXentLoss"],
            2,
            "--gather native passes no gather, but gatherlab.losses:NTXentLoss takes gather= and "
            "would gather with its default, 'fixed', not by itself; allowed: --gather fixed",
        ),
        ([], 2, "name a loss (module:attribute), a gather (--gather), --module and --data, or"),
    ],
)
def test_bad_input_is_one_line(arguments, status, message, tmp_path, no_leftover_processes):
    result = run_command("check", *arguments, "--out", str(tmp_path / "check"))
    assert result.returncode == status, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line or "failed:" in line]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert not (tmp_path / "check" / runfiles.CHECK).exists()


def test_assert_layout_invariant_fails_with_the_diagnosis():
    table = assert_layout_invariant(standins.GatherLayerNTXent, (2,), temperature=0.2)
    assert list(table["verdict"]) == ["exact"]
    with pytest.raises(AssertionError) as failure:
        assert_layout_invariant("standins:ClipLossForCheck", (2,), local_loss=True)
    message = str(failure.value)
    assert "| standins:ClipLossForCheck | native | 2 | same | biased | biased |" in message
    assert "points in another direction than one device's" in message


def test_a_foreign_loss_trains_in_a_sweep_with_gather_native(tmp_path):
    """``loss=user`` names any loss class; ``gather=native`` passes no gather, so the loss
    communicates by itself and is built inside each rank (with its rank and world size, without
    which each rank would compute a 1-device loss of its slice and differ). Its default flags give
    1/W, which the check above measures."""
    sweep = tmp_path / "sweep"
    result = run_command(
        "train", "-m", "loss=user", "loss._target_=standins:ClipLossForCheck", "gather=native",
        "+loss.gather_with_grad=true", "layout=cpu1,cpu2", "steps=5",
        f"hydra.sweep.dir={sweep}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    table = pd.read_csv(sweep / report.COMPARISON)
    assert list(zip(table.devices, table.verdict, strict=True)) == [
        (1, "reference"),
        (2, "matches"),
    ]
    assert table["max_abs_loss_diff"].max() <= FLOAT64_BOUND
    assert set(table["gather"]) == {"native"} and set(table["loss"]) == {"user"}


def test_gather_native_is_refused_with_a_loss_that_would_gather_with_its_default():
    """``native`` is for a loss that communicates by itself. gatherlab's losses never do: given no
    gather they would gather with their default, ``fixed``, under a sweep table's ``native``. So
    the check of a command's configs (``validation``, before any worker starts) refuses it in
    one line."""
    cfg, _ = compose("gather=native")
    with pytest.raises(ConfigError) as refusal:
        validation.validate(cfg)
    assert str(refusal.value) == (
        "gather=native passes no gather, but loss (gatherlab.losses.NTXentLoss) takes gather= and "
        "would gather with its default, 'fixed', not by itself; allowed: gather=fixed (or another "
        "option of the gather group), or native with a loss that communicates by itself"
    )


def test_the_command_line_trains_adamw_steps_exact_with_fixed_and_biased_with_old(tmp_path):
    """``--gather NAME --optim adamw --steps N`` end to end: gatherlab's local NT-Xent (lightly's
    style) with `fixed` trains 20 AdamW steps on 2 ranks like one device to the float64 bound
    (README; the verdict is the first gradient's, docs/design.md §6: a later step that went wrong
    shows only in the training column, asserted here); with `old` its first gradient is biased
    (§1, local style) and 5 steps leave the bound. AdamW ran: the 1-device runs, which train in
    this process, step torch's AdamW with lr 1e-3 and weight decay 0.01 (the README's), keeping
    its moments (test_optimizers.optimizer_steps), and the 2-rank `fixed` run matches them."""
    from test_optimizers import STEPPED, optimizer_steps

    tables = {}
    for gather, steps, status in (("fixed", 20, 0), ("old", 5, 1)):
        out = tmp_path / gather
        with optimizer_steps() as stepped:
            result = run_command(
                "check", "gatherlab.losses:NTXentLoss", "--gather", gather, "--world-sizes", "2",
                "--optim", "adamw", "--steps", str(steps), "--out", str(out),
            )  # fmt: skip
        assert result.returncode == status, result.stderr[-3000:]
        assert stepped == [STEPPED["adamw"]] * steps, stepped
        tables[gather] = pd.read_csv(out / runfiles.CHECK).iloc[0]
    fixed, old = tables["fixed"], tables["old"]
    assert (fixed["gather"], fixed["forward"], fixed["verdict"]) == ("fixed", "same", "exact")
    assert fixed["max_rel_err"] <= measure.EXACT_RELATIVE_ERROR
    assert fixed[TRAIN_COLUMN] <= FLOAT64_BOUND
    assert (old["gather"], old["forward"], old["verdict"]) == ("old", "same", "biased")
    assert old["cosine"] < 1 - 1e-6  # far from parallel, not a rounding effect
    assert old[TRAIN_COLUMN] >= MISS_FACTOR * FLOAT64_BOUND
