"""Helpers shared by the tests: composing real configs, running the command lines, this test
process's descendants.

gatherlab is imported where it is used: ``conftest.py`` imports this module in every pytest
process, also in xdist's controller, which runs no test and need not spend seconds importing
Lightning."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import os
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
# The folders that tests import support code, cases and the docs' examples from by module name
# (``faulty``, ``standins:GatherLayerNTXent``, ``updates:naive``): pytest's ``pythonpath``
# (pyproject.toml), and the PYTHONPATH of every fresh interpreter a test starts (``pythonpath``).
IMPORT_PATH = tuple(str(REPO / folder) for folder in ("tests/support", "tests/cases", "examples"))
# The small sweep the session shares (conftest.pr1531_sweep), and that resuming repeats.
PR1531_SWEEP = (
    "-m", "experiment=lightly_pr1531", "gather=old,fixed", "layout=cpu1,cpu2", "precision=64-true",
)  # fmt: skip


def pythonpath(env=os.environ) -> str:
    """PYTHONPATH for a fresh interpreter that imports the package's source and the tests' modules
    by name as the test process does (``env``'s own entries last)."""
    return os.pathsep.join([str(REPO / "src"), *IMPORT_PATH, env.get("PYTHONPATH", "")])


def line_of(module, text: str) -> str:
    """``<file>:<line>`` of the first line of a test module's source that contains ``text``: the
    place a check must name (relative to the import path entry the module is found under:
    ``tests/cases/`` or ``examples/``), read from the source, not from the code under test."""
    path = Path(module.__file__)
    lines = path.read_text().splitlines()
    line = next(number for number, line in enumerate(lines, 1) if text in line)
    return f"{path.name}:{line}"


def def_line(function) -> str:
    """``<file>:<line>`` of a test module's function's ``def`` line (below its decorators)."""
    lines, first = inspect.getsourcelines(function)
    offset = next(i for i, line in enumerate(lines) if line.lstrip().startswith("def "))
    return f"{Path(inspect.getsourcefile(function)).name}:{first + offset}"


def compose(*overrides: str):
    """A run config composed from the real configs, with its config group choices."""
    from gatherlab.components import config

    with config.composed():
        return config.compose(list(overrides))


def run_training(run_dir: Path, *overrides: str) -> dict:
    """One checked run in this process (its ranks in the shared pool unless ``launcher=spawn``)."""
    from gatherlab.lab import jobs, validation

    cfg, choices = compose(*overrides)
    validation.validate(cfg)
    return jobs.run(cfg, run_dir, choices, overrides)


@dataclass
class Finished:
    """What a command did: its exit status and what it printed and logged."""

    returncode: int
    stdout: str
    stderr: str


def train_cases(root: Path, cases: dict[str, list[str]], *common: str) -> dict[str, Path]:
    """Train each case (its overrides after the common ones) into ``root / name``."""
    for name, overrides in cases.items():
        run_training(root / name, *common, *overrides)
    return {name: root / name for name in cases}


def run_command(module: str, *args: str) -> Finished:
    """``python -m gatherlab.<module> args`` run in this process, the way the command line runs it
    (its ``main``, its exit status, its output), on the session's warm worker pools: the sweep
    callback that closes the pools is left out."""
    arguments = list(args)
    if module == "train" and ("-m" in arguments or "--multirun" in arguments):
        arguments.append("~hydra.callbacks.close_pools")
    command = "gatherlab.check.__main__" if module == "check" else f"gatherlab.{module}"
    main = importlib.import_module(command).main
    stdout, stderr, returncode = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            main(arguments)
        except SystemExit as exit:
            returncode = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
    return Finished(returncode, stdout.getvalue(), stderr.getvalue())


def capture_figures(monkeypatch) -> dict[str, object]:
    """Every figure that ``gatherlab.analysis.figures.save`` writes from now on (still written), by
    the name of its files without suffix: a test reads back what was drawn (a closed Figure keeps
    its artists)."""
    from gatherlab.analysis import figures

    drawn: dict[str, object] = {}
    save = figures.save

    def capturing(figure, path_without_suffix):
        drawn[Path(path_without_suffix).name] = figure
        return save(figure, path_without_suffix)

    monkeypatch.setattr(figures, "save", capturing)
    return drawn


def descendants() -> dict[int, str]:
    """The live processes this test process started, directly or not (pid → command line); not
    multiprocessing's own helpers (its resource tracker, and the fork server the worker pools are
    forked from), which live as long as this process and end with it."""
    from multiprocessing import forkserver, resource_tracker

    helpers = {forkserver._forkserver._forkserver_pid, resource_tracker._resource_tracker._pid}
    found = {}
    for child in psutil.Process().children(recursive=True):
        try:
            if child.pid in helpers or child.status() == psutil.STATUS_ZOMBIE:
                continue
            found[child.pid] = " ".join(child.cmdline())
        except psutil.Error:  # it ended meanwhile
            continue
    return found


def process_group(pgid: int) -> dict[int, str]:
    """The live processes of process group ``pgid`` (pid → command line), zombies not counted: a
    command started in a session of its own and whatever it started, also once they have lost
    their parent and are no longer anyone's descendants here."""
    found = {}
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE:
                found[process.pid] = " ".join(process.cmdline())
        except (psutil.Error, ProcessLookupError):  # it ended meanwhile
            continue
    return found
