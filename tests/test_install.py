"""gatherlab as another project uses it: built into a wheel, installed (not editable) into a new
virtual environment, and run in fresh interpreters from a directory outside the repository.

Fresh interpreters and a new environment are the point: the package must carry its configs, and
the module's ``__main__``, Hydra's own command-line handling and logging, and the report at the end
of a sweep run as a user starts them. This is also the suite's command-line smoke test. The
environment reuses this one's installed dependencies (a ``.pth`` file), so nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pandas as pd
import pytest
from helpers import REPO

from gatherlab import report

pytestmark = pytest.mark.slow

USER_TEST = """
import runpy
import sys
from pathlib import Path

import pandas as pd
import pytest

import gatherlab.config
from gatherlab.testing import assert_layout_invariant
from standins import GatherLayerNTXent


def test_gatherlab_and_its_configs_come_from_the_install():
    assert Path(gatherlab.config.CONFIG_DIR).is_relative_to(sys.prefix)
    assert (gatherlab.config.CONFIG_DIR / "gather" / "native.yaml").exists()


def test_my_loss_trains_like_one_device():
    assert_layout_invariant(GatherLayerNTXent, world_sizes=(2,), temperature=0.2)


def test_python_m_gatherlab_check(monkeypatch):
    # what `python -m gatherlab.check ...` runs, in this interpreter
    monkeypatch.setattr(sys, "argv", [
        "gatherlab.check", "standins:ClipLossForCheck", "--kwargs", '{"gather_with_grad": true}',
        "--world-sizes", "2", "--out", "check",
    ])
    with pytest.raises(SystemExit) as exit:
        runpy.run_module("gatherlab.check", run_name="__main__", alter_sys=True)
    assert exit.value.code == 0
    assert list(pd.read_csv("check/check.csv")["verdict"]) == ["exact"]
"""


def _run(*command: str | Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        [str(part) for part in command],
        cwd=cwd,
        env={**environment, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The python of a new virtual environment with gatherlab's wheel installed."""
    root = tmp_path_factory.mktemp("install")
    source = root / "source"  # a copy: building writes build/ and *.egg-info beside the sources
    source.mkdir()
    shutil.copy(REPO / "pyproject.toml", source)
    shutil.copytree(REPO / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__"))
    built = _run(
        sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
        "-w", root / "wheels", source, cwd=root,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    [wheel] = (root / "wheels").glob("gatherlab-*.whl")
    venv = root / "venv"
    assert _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=root).returncode == 0
    python = venv / "bin" / "python"
    site = Path(
        _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=root)
        .stdout.strip()
    )  # fmt: skip
    # This environment's packages after the new one's own: torch, Lightning, Hydra, ... (a path
    # from a .pth file is not scanned for .pth files, so the editable gatherlab stays out)
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = _run(
        sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
        "--no-index", wheel, cwd=root,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    return python


@pytest.fixture
def elsewhere(tmp_path) -> Path:
    """A user's directory outside the repository, holding their own loss module."""
    shutil.copy(REPO / "tests" / "standins.py", tmp_path)
    return tmp_path


def test_check_and_gatherlab_testing_run_in_a_users_pytest(installed, elsewhere):
    """A user's test file outside the repository: ``gatherlab.testing`` and the command line
    ``python -m gatherlab.check`` (through ``runpy``, as ``-m`` runs it), in one interpreter."""
    (elsewhere / "test_my_loss.py").write_text(USER_TEST)
    result = _run(installed, "-m", "pytest", "-q", "-p", "no:cacheprovider", cwd=elsewhere)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "3 passed" in result.stdout


def test_a_sweep_and_its_report_run_from_the_install(installed, elsewhere):
    """One device, so that it needs no worker processes (the other tests run sweeps on ranks)."""
    result = _run(
        installed, "-m", "gatherlab.train", "-m", "experiment=lightly_pr1531", "gather=old,fixed",
        "layout=cpu1", "steps=3", "hydra.sweep.dir=sweep", cwd=elsewhere,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "job 2/2: experiment=lightly_pr1531 gather=fixed layout=cpu1 steps=3" in output
    assert "comparison of 2 runs" in output
    sweep = elsewhere / "sweep"
    table = pd.read_csv(sweep / report.COMPARISON)
    assert list(table["verdict"]) == ["reference", "matches"]
    assert (sweep / "comparison.png").stat().st_size > 0
    assert (sweep / "0" / ".hydra" / "overrides.yaml").exists()
