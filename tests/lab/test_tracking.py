"""logger=wandb, offline, as a user runs it (in-process, on the session's pools): a 2-job multirun
gives each job its own wandb run below its run directory with every step's loss and grad norm,
and the sweep's figures in one more run; nothing is written outside the sweep and no wandb process
outlives the command."""

from __future__ import annotations

import pytest
import wandb_offline
from helpers import descendants, run_command

from gatherlab.core import runfiles
from gatherlab.lab import tracking

pytestmark = pytest.mark.slow


def _wandb_processes() -> list[str]:
    """The wandb services this test process started (wandb-core runs as a child process)."""
    return [
        command
        for command in descendants().values()
        if "wandb-core" in command or "wandb/bin" in command
    ]


@pytest.fixture(scope="module")
def wandb_sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("wandb")
    home = root / "home"  # wandb's defaults would write below $HOME; nothing may land there
    home.mkdir()
    before = _wandb_processes()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(home))
        patch.delenv("WANDB_MODE", raising=False)  # unset: offline by default
        result = run_command(
            "train", "-m", "logger=wandb", "layout=cpu1,cpu2", "steps=6",
            f"hydra.sweep.dir={root / 'sweep'}",
        )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return root, before


def test_each_job_has_its_own_offline_run_with_its_history(wandb_sweep):
    root, _ = wandb_sweep
    names, groups = [], set()
    for job in ("0", "1"):
        run_dir = root / "sweep" / job
        (offline,) = wandb_offline.offline_runs(run_dir)
        logged = wandb_offline.read_offline_run(offline)
        curves = runfiles.read_curves(run_dir)
        assert [h["_step"] for h in logged["history"]] == curves["step"] == list(range(6))
        assert [h["loss"] for h in logged["history"]] == curves["loss"]
        assert [h["grad_norm"] for h in logged["history"]] == curves["grad_norm"]
        assert (
            logged["config"]["steps"] == 6 and logged["config"]["layout"]["devices"] == int(job) + 1
        )
        names.append(logged["name"])
        groups.add(logged["group"])
    assert names == ["logger=wandb,layout=cpu1,steps=6", "logger=wandb,layout=cpu2,steps=6"]
    assert groups == {f"{root.name}/sweep"}


def test_the_sweep_figures_are_uploaded_as_media(wandb_sweep):
    root, _ = wandb_sweep
    (offline,) = wandb_offline.offline_runs(root / "sweep")
    logged = wandb_offline.read_offline_run(offline)
    assert logged["name"] == "report"
    (media,) = logged["history"]
    assert media["comparison/_type"] == "image-file"  # nested keys read back as "a/b"
    assert media["comparison_table/_type"] == "table-file"
    assert list((offline / "files" / "media" / "images").glob("comparison_*.png"))


def test_nothing_is_written_outside_and_no_wandb_process_remains(wandb_sweep):
    root, before = wandb_sweep
    home = root / "home"
    written = [p for p in home.rglob("*") if "wandb" in str(p.relative_to(home)).lower()]
    assert written == []
    assert _wandb_processes() == before


def test_the_mode_is_offline_unless_the_user_says_otherwise(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert tracking.mode() == "offline"
    monkeypatch.setenv("WANDB_MODE", "")
    assert tracking.mode() == "offline"
    monkeypatch.setenv("WANDB_MODE", "online")
    assert tracking.mode() == "online"


def test_run_names_leave_out_the_experiment():
    assert tracking.run_name(["experiment=bug_demo", "gather=old", "layout=cpu2"]) == (
        "gather=old,layout=cpu2"
    )
    assert tracking.run_name([]) == "defaults"
