"""gatherlab as another project uses it: built into a wheel, installed (not editable) into a new
virtual environment, and run in a fresh interpreter from a directory outside the repository.

A fresh interpreter and a new environment are the point: the package must carry its configs, and
the modules' ``__main__``, Hydra's own command-line handling and logging, the one-line error of a
bad value as the terminal shows it, and the report at the end of a sweep run as a user starts
them. This is also the suite's command-line smoke test.

The wheel is installed with dependency resolution, constrained by the lock (``pip install WHEEL -c
requirements.txt``), offline: the new environment sees this one's packages through a ``.pth``
file, so pip resolves every dependency the wheel's metadata declares against the locked versions
and downloads nothing (a declared package missing from the lock fails the install), and ``pip
check`` must find every requirement met. deptry (tests/journeys/test_architecture.py) checks the
other direction: nothing is imported that the metadata does not declare. The install into an empty
environment, downloading every dependency, is ``make install-check`` (docs/testing.md).

The two locks (``requirements.txt``, the base lock that ``make demo`` installs, and
``requirements-dev.txt``, every extra on top of it, which ``make test`` installs) pin exactly what
the metadata reaches: the base lock every package the base dependencies need, recursively, and
nothing else (the demo installs nothing it does not import); both together every package an extra
needs; each one ``name==version``, once, at a version every requirement on it accepts.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from importlib import metadata
from pathlib import Path

import pandas as pd
import pytest
from bounds import FLOAT64_BOUND, MISS_FACTOR, differences
from helpers import REPO
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from gatherlab.analysis import report
from gatherlab.core import runfiles

# A user's script outside the repository, run by the environment's python: gatherlab.testing,
# then the command lines `python -m gatherlab.check` and `python -m gatherlab.train -m` through
# runpy, as `-m` runs them, in one interpreter (each fresh interpreter costs seconds of imports).
USER_SCRIPT = """
import os
import runpy
import sys
import tempfile


def python_m(module, *arguments):
    sys.argv = [module, *arguments]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit:
        return exit.code or 0
    return 0


def terminal(module, *arguments):
    # what the command writes to the terminal's stderr (file descriptor 2), and its exit status
    with tempfile.TemporaryFile(mode="w+") as captured:
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            status = python_m(module, *arguments)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
        captured.seek(0)
        return status, captured.read()


if __name__ == "__main__":  # the pool's ranks import this file again: nothing else at the top
    import gatherlab.components.config
    from gatherlab.testing import assert_layout_invariant
    from standins import GatherLayerNTXent

    print("configs:", gatherlab.components.config.CONFIG_DIR, flush=True)
    # a bad value in a sweep stops it in one line
    status, stderr = terminal("gatherlab.train", "-m", "optim.lr=0.1,-1", "layout=cpu2",
                              "hydra.sweep.dir=refused")
    print("bad value:", status, repr(stderr), flush=True)
    # a sweep of 4 jobs: old and fixed, 2 ranks against their 1-device reference (first: the
    # pool it starts preloads Lightning, which the checks' pool then reuses)
    print("train:", python_m(
        "gatherlab.train", "-m", "experiment=lightly_pr1531", "gather=old,fixed",
        "layout=cpu1,cpu2", "steps=3", "precision=64-true", "hydra.sweep.dir=sweep",
    ), flush=True)
    assert_layout_invariant(GatherLayerNTXent, world_sizes=(2,), temperature=0.2)
    runpy.run_path("install_check.py", run_name="install_check")  # make install-check's Python
    print("check:", python_m(
        "gatherlab.check", "standins:ClipLossForCheck", "--kwargs", '{"gather_with_grad": true}',
        "--world-sizes", "2", "--out", "check",
    ), flush=True)
    from gatherlab.testing import assert_training_invariant

    table = assert_training_invariant(
        "ssl_modules:BYOL", "ssl_modules:GaussianPairs", (2,), steps=2, global_batch_size=8,
        data_kwargs={"size": 16},
    ).table
    print("training check:", list(table.loc[table["part"] == "all", "verdict"]), flush=True)
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
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source)
    for folder in ("src", "conf"):
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pyc*"))
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
    pip = [sys.executable, "-m", "pip", "--python", python]
    installed = _run(
        *pip, "install", "--no-index", wheel, "-c", REPO / "requirements.txt", cwd=root
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    for requirement in ("torch", "lightning", "hydra-core", "pandas", "matplotlib"):
        assert f"Requirement already satisfied: {requirement}" in installed.stdout
    checked = _run(*pip, "check", cwd=root)
    assert checked.returncode == 0 and "No broken requirements found." in checked.stdout, (
        checked.stdout + checked.stderr
    )
    return python


def _install_check_python() -> str:
    """The Python that ``make install-check`` runs in its new environment: the Makefile's
    ``INSTALL_CHECK_TESTING``, which its recipe passes to ``python -c``."""
    makefile = (REPO / "Makefile").read_text()
    assert '../venv/bin/python -c "$$INSTALL_CHECK_TESTING"' in makefile
    return re.search(r"^define INSTALL_CHECK_TESTING\n(.*?)^endef$", makefile, re.M | re.S)[1]


@pytest.mark.slow
def test_testing_check_and_a_sweep_run_from_the_install(installed, tmp_path):
    elsewhere = tmp_path  # a user's directory outside the repository, with their own code
    for name in ("standins.py", "ssl_modules.py", "summing_gather.py"):  # their own losses and
        shutil.copy(REPO / "examples" / name, elsewhere)  # LightningModules
    (elsewhere / "use_gatherlab.py").write_text(USER_SCRIPT)
    (elsewhere / "install_check.py").write_text(_install_check_python())
    result = _run(installed, "use_gatherlab.py", cwd=elsewhere)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    output = result.stdout + result.stderr
    # The one-line contract is about what a user's terminal shows: exit status 2, one line, no
    # traceback, nothing written, no process started.
    status, stderr = re.search(r"bad value: (\d+) (.*)", output).groups()
    assert status == "2" and ast.literal_eval(stderr) == (
        "gatherlab.train: error: optim (torch.optim.SGD): Invalid learning rate: -1\n"
    )
    assert not (elsewhere / "refused").exists()

    config_dir = Path(output.split("configs: ")[1].split()[0])
    assert config_dir.is_relative_to(installed.parents[1]), output  # the wheel's, not the repo's
    assert (config_dir / "gather" / "native.yaml").exists()

    assert "gatherlab.testing: NTXentLoss with the fixed gather is layout-invariant on 2 ranks" in (
        output
    )
    assert "gatherlab.record and assert_runs_match: two recordings of a job match" in output
    assert "check: 0" in output
    assert "training check: ['exact']" in output
    assert list(pd.read_csv(elsewhere / "check" / runfiles.CHECK)["verdict"]) == ["exact"]

    assert "train: 0" in output
    assert (
        "job 4/4: experiment=lightly_pr1531 gather=fixed layout=cpu2 steps=3 precision=64-true"
        in output
    )
    assert "comparison of 4 runs" in output
    sweep = elsewhere / "sweep"
    table = pd.read_csv(sweep / report.COMPARISON)
    # every run is held against job 0 (old on one device: every gather is the identity there);
    # the numbers are read from the run files, not taken from the report
    assert list(zip(table["gather"], table["devices"], table["verdict"], strict=True)) == [
        ("old", 1, "reference"), ("old", 2, "differs"), ("fixed", 1, "matches"),
        ("fixed", 2, "matches"),
    ]  # fmt: skip
    for job, (loss_diff, param_diff) in {
        job: differences(sweep / str(job), sweep / "0") for job in (1, 2, 3)
    }.items():
        assert table.loc[job, "max_abs_loss_diff"] == loss_diff
        assert table.loc[job, "max_abs_param_diff"] == param_diff
        if job == 1:  # old on 2 ranks: the gradient is wrong from the first update
            assert max(loss_diff, param_diff) >= MISS_FACTOR * FLOAT64_BOUND
        else:
            assert loss_diff <= FLOAT64_BOUND and param_diff <= FLOAT64_BOUND
    assert (sweep / "comparison.png").stat().st_size > 0
    assert (sweep / "0" / ".hydra" / "overrides.yaml").exists()


def _pins(lock: Path) -> dict[str, Version]:
    """A lock's own pins (canonical name: version); a line ``-r FILE`` is left to the caller."""
    pins = {}
    for line in lock.read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line or line.startswith("-r "):
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][0-9A-Za-z.+!-]*)", line)
        assert match, f"{lock.name}: {line!r} is not an exact pin (name==version)"
        name = canonicalize_name(match[1])
        assert name not in pins, f"{lock.name}: {name} pinned twice"
        pins[name] = Version(match[2])
    return pins


def _reached(requirements: list[str], pins: dict[str, Version]) -> set[str]:
    """Every package that ``requirements`` need, recursively, read from the installed packages'
    metadata (markers evaluated here, for the extras asked); each must be pinned in ``pins`` at a
    version its requirement accepts. gatherlab's own extras (``gatherlab[hf]``) are followed in
    pyproject.toml."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    reached, seen = set(), set()
    todo = [Requirement(requirement) for requirement in requirements]
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if name == "gatherlab":
            todo += [Requirement(r) for extra in requirement.extras for r in extras[extra]]
            continue
        assert name in pins, f"{requirement} is needed and not pinned"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"{name}=={pins[name]} is pinned, and {requirement} is needed"
        )
        if (name, frozenset(requirement.extras)) in seen:
            continue
        seen.add((name, frozenset(requirement.extras)))
        reached.add(name)
        for line in metadata.requires(name) or []:
            needed = Requirement(line)
            if needed.marker is None or any(
                needed.marker.evaluate({"extra": extra}) for extra in requirement.extras or {""}
            ):
                todo.append(needed)
    return reached


def test_the_locks_pin_exactly_what_the_package_and_its_extras_need():
    """The base lock is what ``make demo`` installs: the base dependencies' packages, all, and
    only those; the full lock adds what the extras need, all of it, and nothing stale."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    base = _pins(REPO / "requirements.txt")
    full_lock = REPO / "requirements-dev.txt"
    assert "-r requirements.txt" in full_lock.read_text().splitlines()
    rest = _pins(full_lock)
    assert not base.keys() & rest.keys(), f"pinned in both locks: {base.keys() & rest.keys()}"
    assert _reached(project["dependencies"], base) == base.keys()
    extras = [f"gatherlab[{extra}]" for extra in project["optional-dependencies"]]
    assert _reached(project["dependencies"] + extras, base | rest) == base.keys() | rest.keys()
