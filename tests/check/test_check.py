"""``gatherlab.check`` on real gloo ranks: stand-ins for public losses (``examples/standins.py``)
get the verdict the mathematics of docs/design.md §1 predicts, at W = 2 and 4; every option of the
``gather`` config group (conf/gather/, the one registry of gathers) through ``--gather``; bad input
is one line; ``assert_layout_invariant`` fails with its diagnosis; a foreign loss trains in a sweep
with ``loss=user gather=native``, and gatherlab's own losses are refused with it."""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types

import pandas as pd
import pytest
import standins
from bounds import FLOAT64_BOUND, MISS_FACTOR
from helpers import compose, run_command

from gatherlab import check
from gatherlab import gather as gathering
from gatherlab.analysis import report
from gatherlab.check import api
from gatherlab.check.table import TRAIN_COLUMN
from gatherlab.components import config
from gatherlab.components.config import ConfigError
from gatherlab.components.factory import Recipe
from gatherlab.core import gradients, runfiles
from gatherlab.lab import validation
from gatherlab.ranks import pool
from gatherlab.testing import assert_layout_invariant

pytestmark = pytest.mark.slow
pytest_plugins = ["pytester"]  # a user's failing test run by pytest in this process

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
    table = check.check_loss(f"standins:{name}", (2, 4), **kwargs).table
    table = table[table["part"] == "all"]  # a learnt scale's parts: tests/check/test_diagnosis.py
    assert list(table["world_size"]) == [2, 4]
    assert list(table["verdict"]) == [expected, expected], table.to_string()
    assert set(table["reference"]) == {"no group"}  # each runs without a group on one device
    if expected == "loss differs":
        assert (table["loss_diff"] > MISS_FACTOR * gradients.FLOAT64_TOLERANCE).all()
        return
    assert (table["forward"] == "same").all()
    assert (table["loss_diff"] <= gradients.FLOAT64_TOLERANCE).all()
    if expected == "exact":
        assert (table["max_rel_err"] <= gradients.FLOAT64_TOLERANCE).all()
    elif expected in ("1/W", "W"):
        scale = [1 / 2, 1 / 4] if expected == "1/W" else [2, 4]
        assert table["norm_ratio"].tolist() == pytest.approx(scale, rel=1e-12)
        assert (table["cosine"] >= gradients.PARALLEL_COSINE).all()
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
    """conf/gather/ is the one registry of gathers: every option of the group as Hydra lists it
    is a name that ``check_gather``/``--gather`` takes (``api._gather``, which reads the files
    through ``gatherlab.gather``, composing nothing), built as Hydra's composition builds it
    (``config.build_gather_option``, the audit's); ``native`` is an option but no gather, refused
    in one line. (No ranks: the real run is the command line's, ``--gather fixed_all_reduce``
    below.)"""
    with config.composed():
        options = config.group_options("gather")
        composed = {name: config.build_gather_option(name) for name in options}
    gathers = [name for name in options if name != "native"]
    assert set(gathers) == set(gathering.NAMES) and "fixed_all_reduce" in gathers
    for name in gathers:
        assert api._gather(name) == (name, composed[name]), name
    with pytest.raises(check.CheckError) as refusal:
        check.check_gather("native")
    message = str(refusal.value)
    assert message.startswith("gather=native is no gather (the loss communicates by itself); ")
    assert "\n" not in message and f"allowed: {', '.join(sorted(gathers))}, or" in message


def test_built_in_gathers_through_gather():
    fixed = check.check_gather("fixed", (2, 4)).table
    assert set(fixed["verdict"]) == {"exact"}
    old = check.check_gather("old", (2, 4)).table
    verdicts = {(row.loss, row.world_size): row.verdict for row in old.itertuples()}
    assert verdicts == {
        ("ntxent", 2): "biased", ("ntxent", 4): "biased",
        ("ntxent_global", 2): "1/W", ("ntxent_global", 4): "1/W",
        ("vicreg", 2): "biased", ("vicreg", 4): "biased",
    }  # fmt: skip


def test_a_gather_class_is_made_as_a_file_of_the_gather_group_makes_it():
    """A `Gather` subclass (as docs/design.md §4 has a newcomer write one, and as a file of the
    gather group names it), by its import path or as the class: made with no arguments, as Hydra
    makes it. It was called on the embeddings as they were, and the refusal blamed the loss; a
    class that needs arguments is one line naming the gather."""
    by_path = check.check_gather("gatherlab.gather.inexact:Old", (2,)).table
    assert list(by_path["verdict"]) == ["biased", "1/W", "biased"]
    assert set(by_path["gather"]) == {"gatherlab.gather.inexact:Old"}
    by_class = check.check_loss(
        "gatherlab.losses:NTXentLoss", (2,), gather=gathering.inexact.Old, temperature=0.5
    ).table
    assert by_class.loc[by_class["part"] == "all", "verdict"].tolist() == ["biased"]

    class Needs(gathering.Gather):
        def __init__(self, group):
            self.group = group

    with pytest.raises(check.CheckError) as refusal:
        check.check_gather(Needs)
    assert str(refusal.value) == (
        "gather test_a_gather_class_is_made_as_a_file_of_the_gather_group_makes_it.<locals>.Needs:"
        " TypeError: test_a_gather_class_is_made_as_a_file_of_the_gather_group_makes_it.<locals>."
        "Needs.__init__() missing 1 required positional argument: 'group'; allowed: a gather "
        "class made with no arguments, an instance, or a function x -> gathered x"
    )


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
    exact = check.check_loss(standins.ClipLossForCheck, (2,), steps=5, gather_with_grad=True).table
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
        (
            ["gatherlab.losses:NTXentLoss", "--gather", "fixed", "--kwargs", '{"gather": "old"}'],
            2,
            "--kwargs holds 'gather', which the check passes to the loss itself; allowed: "
            "--gather NAME or module:function",
        ),
        (
            ["standins:ClipLossForCheck", "--kwargs", '{"gather": "old"}'],
            2,
            "--kwargs holds 'gather', which the check passes to the loss itself",
        ),
        # a key named like a parameter of check_loss is the loss's: refused by the loss itself
        (
            ["standins:ClipLossForCheck", "--kwargs", '{"seed": 3}'],
            2,
            "unexpected keyword argument 'seed'",
        ),
        (["standins:PerSampleLoss"], 2, "the loss returned (16,); allowed: a scalar tensor"),
        (["standins:NanLoss"], 2, "the loss returned nan; allowed: a finite value"),
        (
            ["standins:ClipLossForCheck", "--world-sizes", "3"],
            2,
            "does not divide the global batch",
        ),
        (["--gather", "nowhere:gather"], 2, "gather=nowhere:gather: cannot import nowhere"),
        (["--gather", "nope"], 2, "gather=nope is unknown; allowed: avg, fixed, fixed_all"),
        (["--gather", "native"], 2, "gather=native is no gather (the loss communicates by"),
        (
            ["gatherlab.losses:NTXentLoss"],
            2,
            "gather=native passes no gather, but gatherlab.losses:NTXentLoss takes gather= and "
            "would gather with its default, 'fixed', not by itself; allowed: gather=fixed",
        ),
        (  # the command line's spelling, where no --gather was given (a user's first check)
            ["gatherlab.losses:NTXentLoss"],
            2,
            "(on the command line: --gather NAME; none given is native)",
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


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["x:y", "--kwargs", "{oops"], "argument --kwargs: '{oops' is not JSON: Expecting"),
        (["x:y", "--kwargs", "[1]"], "argument --kwargs: '[1]' is not a JSON object of keyword"),
        (["x:y", "--world-sizes", "2,x"], "argument --world-sizes: '2,x' is not a list of world"),
        (["x:y", "--gathr", "fixed"], "unrecognized arguments: --gathr fixed"),
        (["x:y", "--world-size", "2"], "unrecognized arguments: --world-size 2"),  # no abbrev.
        (  # read by a training step's check alone: a loss's ignored it, exit 0
            ["x:y", "--global-batch-size", "7"],
            "--global-batch-size is an option of the check of a training step; allowed: with "
            "--module, --step or --update",
        ),
        (
            ["mypkg/losses.py"],
            "loss mypkg/losses.py is a file path; allowed: module:attribute, e.g. "
            "mypkg.losses:MyLoss",
        ),
    ],
)
def test_a_usage_error_is_one_line_without_the_usage_block(arguments, message):
    result = run_command("check", *arguments)
    assert result.returncode == 2 and result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith(f"gatherlab.check: error: {message}"), result.stderr


def test_the_help_is_plain_text():
    result = run_command("check", "--help")
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith("usage: python -m gatherlab.check [-h]")
    assert "Check a loss, a gather or a training step on W ranks against one device;" in (
        result.stdout
    )
    assert "`" not in result.stdout


def test_assert_layout_invariant_fails_with_the_diagnosis():
    table = assert_layout_invariant(standins.GatherLayerNTXent, (2,), temperature=0.2).table
    assert list(table["verdict"]) == ["exact"]
    with pytest.raises(AssertionError) as failure:
        assert_layout_invariant("standins:ClipLossForCheck", (2,), local_loss=True)
    message = str(failure.value)
    assert "| standins:ClipLossForCheck | native | 2 | same | biased | biased |" in message
    assert "points in another direction than one device's" in message


def test_a_failing_assert_layout_invariant_shows_the_callers_line_not_gatherlabs(pytester):
    """pytest's traceback of a failing `assert_layout_invariant` is the test's call and the
    diagnosis: the helper's own frame is hidden (``__tracebackhide__``), not printed as source."""
    pytester.makepyfile(
        test_user="""
        from gatherlab.testing import assert_layout_invariant


        def test_clip_local_loss():
            assert_layout_invariant("standins:ClipLossForCheck", (2,), local_loss=True)
        """
    )
    result = pytester.runpytest_inprocess("-p", "no:randomly", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    output = result.stdout.str()
    call = 'assert_layout_invariant("standins:ClipLossForCheck", (2,), local_loss=True)'
    assert f">       {call}\nE       AssertionError: | loss | gather |" in output
    assert "points in another direction" in output and "test_user.py:5: AssertionError" in output
    assert "table = check.check_loss(" not in output and "gatherlab/testing.py" not in output


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


def _as_main(script, monkeypatch, spec_name=None) -> dict:
    """``script`` run as ``python SCRIPT`` runs it (``python -m NAME`` with ``spec_name``), in
    this process: its namespace is that of ``__main__``, named ``__main__``."""
    main = types.ModuleType("__main__")
    main.__file__ = str(script)
    main.__spec__ = None if spec_name is None else importlib.machinery.ModuleSpec(spec_name, None)
    monkeypatch.setitem(sys.modules, "__main__", main)
    exec(compile(script.read_text(), str(script), "exec"), vars(main))
    return vars(main)


def test_a_script_that_starts_the_check_at_its_top_level_is_refused_in_one_line(
    tmp_path, monkeypatch
):
    """multiprocessing prepares each rank it starts by running the script that started it: a
    check started at a script's top level was started again by each rank, which printed a page
    of multiprocessing's traceback and left a ``failed`` row. It is refused before any rank
    starts, naming the statement. Under ``if __name__ == "__main__":``, in a package's
    ``__main__`` (which multiprocessing never runs again), on one rank, or on ranks torchrun
    started, nothing is refused."""
    found = tmp_path / "found.py"
    found.write_text(
        "from gatherlab.ranks import forkstart\n"
        "def where():\n"
        "    return forkstart.unguarded_main()\n"
        "top = where()\n"
        "if __name__ == '__main__':\n"
        "    guarded = where()\n"
    )
    ran = _as_main(found, monkeypatch)
    assert (ran["top"], ran["guarded"]) == (f"{found}:4", None)
    assert _as_main(found, monkeypatch, spec_name="mypackage.__main__")["top"] is None
    assert _as_main(found, monkeypatch, spec_name="mypackage.mine")["top"] == f"{found}:4"

    script = tmp_path / "my_check.py"
    script.write_text(
        "from gatherlab import check\n"
        "from gatherlab.check import api\n"
        "api._startable((1,))\n"
        "result = check.check_loss('gatherlab.losses:NTXentLoss', gather='fixed')\n"
    )
    with pytest.raises(check.CheckError) as refusal:
        _as_main(script, monkeypatch)
    assert str(refusal.value) == (
        f"{script}:4 starts the check at the script's top level, which every rank the check "
        'starts runs again; allowed: the call under `if __name__ == "__main__":`'
    )
    launched = tmp_path / "launched.py"  # as torchrun starts it: no rank for the check to start
    launched.write_text("from gatherlab.check import api\napi._startable((2,))\n")
    monkeypatch.setenv("RANK", "0")
    _as_main(launched, monkeypatch)


def test_the_command_line_trains_adamw_steps_exact_with_fixed_and_biased_with_old(tmp_path):
    """``--gather NAME --optim adamw --steps N`` end to end: gatherlab's local NT-Xent (lightly's
    style) with `fixed` trains 20 AdamW steps on 2 ranks like one device to the float64 bound
    (README; the verdict is the first gradient's, docs/checking.md §6: a later step that went wrong
    shows only in the training column, asserted here); with `old` its first gradient is biased
    (§1, local style) and 5 steps leave the bound. AdamW ran: the 1-device runs, which train in
    this process (twice: the reference without a process group, and the same in a one-rank group
    to compare with it, §6), step torch's AdamW with lr 1e-3 and weight decay 0.01 (the
    README's), keeping its moments (stepped.optimizer_steps), and the 2-rank `fixed` run
    matches them."""
    from stepped import STEPPED, optimizer_steps

    tables = {}
    for gather, steps, status in (("fixed", 20, 0), ("old", 5, 1)):
        out = tmp_path / gather
        with optimizer_steps() as stepped:
            result = run_command(
                "check", "gatherlab.losses:NTXentLoss", "--gather", gather, "--world-sizes", "2",
                "--optim", "adamw", "--steps", str(steps), "--out", str(out),
            )  # fmt: skip
        assert result.returncode == status, result.stderr[-3000:]
        assert stepped == [STEPPED["adamw"]] * 2 * steps, stepped
        tables[gather] = pd.read_csv(out / runfiles.CHECK).iloc[0]
    fixed, old = tables["fixed"], tables["old"]
    assert (fixed["gather"], fixed["forward"], fixed["verdict"]) == ("fixed", "same", "exact")
    assert fixed["max_rel_err"] <= gradients.FLOAT64_TOLERANCE
    assert fixed[TRAIN_COLUMN] <= FLOAT64_BOUND
    assert (old["gather"], old["forward"], old["verdict"]) == ("old", "same", "biased")
    assert old["cosine"] < 1 - 1e-6  # far from parallel, not a rounding effect
    assert old[TRAIN_COLUMN] >= MISS_FACTOR * FLOAT64_BOUND


# A gather in a module of its own, and a module that names it: by an alias, through an entry of
# the import path that it removes again, and under another module name (loaded from its file).
GATHER_MODULE = """
import torch
import torch.distributed as dist


class AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.rank, ctx.rows = dist.get_rank(), len(x)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)  # every rank's gradient of each slice
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows]


def gather(x):
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return x
    return AllGather.apply(x)
"""
NAMING_MODULE = """
import importlib.util
import sys

sys.path.insert(0, {directory!r})
from checked_gather_module import gather as alias
sys.path.remove({directory!r})

spec = importlib.util.spec_from_file_location("renamed_gather_module", {file!r})
renamed_module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = renamed_module
spec.loader.exec_module(renamed_module)
renamed = renamed_module.gather


def direct(x):
    return alias(x)
"""
NAMED = ("checked_gather_module", "naming_module", "renamed_gather_module")


def test_the_ranks_import_a_gather_as_the_caller_imported_it(tmp_path, monkeypatch):
    """The ranks import by name the module of each function a job holds (pickle names a function
    by its module), with the import path and the directory the caller had when their pool
    started. An alias whose own module the caller found through an entry since removed, and a
    module found through a relative entry of the caller's import path ('' as python -c and
    Jupyter have it) after the caller changed directory, are imported there as here
    (`core.imports.search_path`); a module imported from a file under another name is found by
    no directory, and refused in one line before any rank runs."""
    pool.pool(2)  # started here, before the change of directory (as the suite's may be)
    library, work = tmp_path / "library", tmp_path / "work"
    library.mkdir(), work.mkdir()
    (library / "checked_gather_module.py").write_text(GATHER_MODULE)
    (work / "naming_module.py").write_text(NAMING_MODULE.format(
        directory=str(library), file=str(library / "checked_gather_module.py")
    ))  # fmt: skip
    monkeypatch.chdir(work)
    monkeypatch.setattr(sys, "path", ["", *sys.path])
    importlib.invalidate_caches()
    try:
        for name in ("alias", "direct"):  # the alias first: `direct` imports its module too
            out = tmp_path / name
            result = run_command(
                "check", "gatherlab.losses:NTXentLoss", "--gather", f"naming_module:{name}",
                "--world-sizes", "2", "--out", str(out),
            )  # fmt: skip
            assert result.returncode == 0, (name, result.stdout, result.stderr)
            table = pd.read_csv(out / runfiles.CHECK, keep_default_na=False)
            assert (list(table["verdict"]), list(table["error"])) == (["exact"], [""]), name
        result = run_command(
            "check", "gatherlab.losses:NTXentLoss", "--gather", "naming_module:renamed",
            "--world-sizes", "2", "--out", str(tmp_path / "renamed"),
        )  # fmt: skip
        assert result.returncode == 2
        assert result.stderr.strip() == (
            "gatherlab.check: error: gather=naming_module:renamed: the ranks import its module "
            "'renamed_gather_module' (imported here from "
            f"{library / 'checked_gather_module.py'}) by that name, and no directory of the "
            "import path holds it under that name; allowed: a module that `import "
            "renamed_gather_module` finds (on sys.path or PYTHONPATH)"
        )
        assert not (tmp_path / "renamed").exists()
    finally:
        for name in NAMED:
            sys.modules.pop(name, None)


def test_torchs_autograd_all_gather_is_wrong_on_gloo_when_its_gradient_is_not_contiguous():
    """A finding of the census (docs/results.md): on gloo, ``torch.distributed.nn``'s all_gather
    (the ``torch_nn`` gather, and ``lightning``'s, which runs it) scatters a gradient that is not
    contiguous into buffers of the same strides, and the sum comes out wrong; gatherlab's ``fixed``
    and torch's ``functional`` are exact. Should torch fix it, this test fails, and design §1 and
    docs/results.md's words on ``torch_nn`` change with it."""
    loss = "standins:PermutedGatheredFeatures"
    verdicts = {
        name: check.check_loss(loss, (2, 4), gather=name).table.set_index("world_size")
        for name in ("fixed", "functional", "torch_nn", "lightning")
    }
    for name in ("fixed", "functional"):
        assert verdicts[name]["verdict"].tolist() == ["exact", "exact"], name
        assert (verdicts[name]["max_rel_err"] <= 1e-10).all(), name
    for name in ("torch_nn", "lightning"):
        assert verdicts[name]["verdict"].tolist() == ["biased", "biased"], name
        assert (verdicts[name]["cosine"] < 0.5).all(), verdicts[name]["cosine"]


def test_ctrl_c_in_the_checks_command_is_one_line_and_status_130(monkeypatch, capsys):
    """Ctrl-C during a check printed a page of KeyboardInterrupt traceback (44–51 lines); the
    command says in one line that nothing was written and ends with 130, as the sweeps' and the
    comparison's do. (That no process outlives it: tests/ranks/test_interrupt.py.)"""
    from gatherlab.check import __main__ as command

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(command, "_written", interrupted)
    with pytest.raises(SystemExit) as ended:
        command.main(["--gather", "fixed", "--world-sizes", "2"])
    assert ended.value.code == 130
    assert capsys.readouterr().err.splitlines() == [
        "gatherlab.check: interrupted; nothing was written: run the command again"
    ]
