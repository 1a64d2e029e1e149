"""A command leaves nothing behind: Ctrl-C while a sweep's pool starts ends it with the one line
that says how to resume, and no process of a command (the check, a sweep, a single run, a failed
one, an interrupted one) is alive once the command has returned.

Each test runs the command in a fresh interpreter in a session of its own: only a real process
group shows what its processes print and which of them outlive it (the pools' fork server,
multiprocessing's resource tracker)."""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import process_group, pythonpath

pytestmark = pytest.mark.slow


def _sigint_as_in_a_terminal() -> None:
    # A process started with SIGINT ignored passes that on; the command in a terminal has the
    # default disposition, so its test does too.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _started(command: list[str], tmp_path: Path) -> tuple[subprocess.Popen, Path, Path]:
    """``command`` in a session of its own, its temporary files (the pools' directories) in a
    directory of its own, what it prints going into one file as a terminal shows it. The
    temporary directory is a short path of its own beside pytest's (the fork server's socket,
    ``TMPDIR/pymp-…/listener-…``, must fit a Unix socket's 107 bytes, which
    ``/tmp/pytest-of-USER/pytest-NNN/popen-gwN/<test name>/`` leaves too few of)."""
    terminal = tmp_path / "terminal.txt"
    temporary = Path(tempfile.mkdtemp(prefix="gl-"))
    atexit.register(shutil.rmtree, temporary, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": pythonpath(), "TMPDIR": str(temporary)}
    with open(terminal, "w") as output:
        process = subprocess.Popen(
            command, cwd=tmp_path, env=env, stdout=output, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_sigint_as_in_a_terminal,
        )  # fmt: skip
    return process, temporary, terminal


def _returned(process: subprocess.Popen, timeout_s: float = 300) -> tuple[int, dict[int, str]]:
    """The command's exit status and what of its session is alive the moment it has returned.
    What is left is given up to a minute to end (and print what it prints) before it is killed."""
    try:
        returncode = process.wait(timeout=timeout_s)
        left = process_group(process.pid)
        deadline = time.monotonic() + 60
        while process_group(process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    return returncode, {pid: command[:120] for pid, command in left.items()}


def _fork_server(session: int) -> bool:
    """Whether the pools' fork server of the command in session ``session`` runs."""
    return any("multiprocessing.forkserver" in c for c in process_group(session).values())


def _train(*arguments: str) -> list[str]:
    return [sys.executable, "-m", "gatherlab.train", *arguments]


SWEEP = ("-m", "experiment=lightly_pr1531", "gather=fixed", "layout=cpu2", "precision=64-true")


def test_ctrl_c_while_a_sweeps_pool_starts_says_one_line_and_leaves_nothing(tmp_path):
    """SIGINT to the whole group (a terminal's Ctrl-C) once the fork server runs and the pool's
    temporary directory exists: the pool is starting its first rank, which the server forks once
    it has imported torch (seconds)."""
    sweep = tmp_path / "sweep"
    command = _train(*SWEEP, f"hydra.sweep.dir={sweep}")
    process, temporary, terminal = _started(command, tmp_path)
    try:
        deadline = time.monotonic() + 300  # a bound for a hang, not a measured time
        while not (_fork_server(process.pid) and list(temporary.glob("gatherlab-pool-*"))):
            assert process.poll() is None, terminal.read_text()[-3000:]
            assert time.monotonic() < deadline, terminal.read_text()[-3000:]
            time.sleep(0.01)
        time.sleep(0.1)  # the server's start over (SIGINT is ignored while it is started)
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C
    finally:
        returncode, left = _returned(process)
    printed = terminal.read_text()

    assert returncode == 130, printed[-3000:]
    again = _train(*SWEEP, f"+resume={sweep.resolve()}")
    said = f"gatherlab.train: interrupted at job 1/1; resume with: {shlex.join(again)}"
    lines = [line for line in printed.splitlines() if not line.startswith("[20")]  # not the log
    assert lines == [said], printed[-3000:]
    assert not left, f"processes left behind: {left}"
    assert not list(temporary.glob("gatherlab-pool-*"))


# Each a command as a user types it (``tests/`` on the path for ``faulty``), and its exit status:
# the check; a sweep whose one job fails (a rank of its pool of 2 raises at step 2: its report is
# written, the command exits 1; that a sweep goes on after a failed job is test_reliability.py's).
# A single run on one device is not among them: it trains in the command's own process, starting
# no pool, fork server or resource tracker, so it passed with ``forkstart.stop`` removed; a run
# with a pool ends through the same exit hooks as this sweep (docs/testing.md).
FAILING_SWEEP = (
    "-m", "gatherlab.train", "-m", "experiment=lightly_pr1531", "layout=cpu2",
    "loss._target_=faulty.RankFault", "+loss.how=raise", "steps=2", "hydra.sweep.dir=sweep",
)  # fmt: skip
COMMANDS = {
    "check": (("-m", "gatherlab.check", "--gather", "fixed", "--world-sizes", "2"), 0),
    "failed sweep": (FAILING_SWEEP, 1),
}


@pytest.mark.parametrize("name", COMMANDS)
def test_nothing_of_a_command_is_alive_once_it_has_returned(tmp_path, name):
    """Not the pools' fork server, not multiprocessing's resource tracker: left to themselves they
    outlived the command by 3–8 s here (the server's own exit with torch loaded; more on a busier
    machine), the tracker waiting for the server."""
    arguments, status = COMMANDS[name]
    process, _, terminal = _started([sys.executable, *arguments], tmp_path)
    returncode, left = _returned(process)
    assert returncode == status, terminal.read_text()[-3000:]
    assert not left, f"processes left behind: {left}"
    assert "Traceback" not in terminal.read_text(), terminal.read_text()[-3000:]


def test_the_private_names_that_end_multiprocessings_helpers_are_there():
    """``forkstart.stop`` reads multiprocessing's private singletons (docs/design.md §4): this
    fails first if a Python release changes them."""
    from multiprocessing import forkserver, resource_tracker

    assert callable(forkserver._forkserver._stop)
    assert hasattr(forkserver._forkserver, "_forkserver_pid")
    assert {"_fd", "_pid"} <= vars(resource_tracker._resource_tracker).keys()
