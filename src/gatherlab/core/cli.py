"""What gatherlab's command lines share: an error as one line, the error's exit, and the end.

Every command line (``train``, ``audit``, ``scaling``, ``check``, ``report``) answers bad input
with one line, ``gatherlab.<command>: error: <what, which value, what is allowed>``, and exit
status 2 (``fail``), before any worker starts. An error becomes one line with ``error_line``, which
is never empty after the error's type: an error without a message (a bare ``assert``) is named by
where the user's code raised it.
"""

from __future__ import annotations

import gc
import os
import sys
import sysconfig
import traceback
from pathlib import Path
from typing import NoReturn

__all__ = [
    "error_line",
    "exiting",
    "fail",
    "first_line",
    "is_users",
    "one_line",
    "place",
    "user_frame",
]

# The installed packages whose frames are never the user's (with gatherlab's own and Python's
# standard library): located through their modules' ``__file__`` once they are imported.
FRAMEWORKS = ("torch", "lightning", "lightning_fabric", "numpy", "pandas", "hydra", "omegaconf")


def first_line(error: BaseException) -> str:
    """An error's message as one line: its first line, and its last where the first only leads
    into the rest (ends with a colon); the error's type when it has no message."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[-1]}"
    return lines[0]


def one_line(error: BaseException) -> str:
    """An error as one line with its type: ``Type: first line of the message`` (``Type`` alone
    when it has no message)."""
    if not str(error).strip():
        return type(error).__name__
    return f"{type(error).__name__}: {first_line(error)}"


def error_line(error: BaseException) -> str:
    """An error as one line that is never empty after its type: ``Type: first line of the
    message`` (``first_line``'s rule); when the message is empty, ``Type at <file>:<line>``, the
    deepest frame of its traceback that is the user's (``user_frame``); ``Type`` alone when it has
    no traceback."""
    name = type(error).__name__
    if str(error).strip():
        return f"{name}: {first_line(error)}"
    frame = user_frame(error)
    return name if frame is None else f"{name} at {place(*frame)}"


def user_frame(error: BaseException) -> tuple[str, int] | None:
    """The file and line of the deepest frame of ``error``'s traceback that is the user's
    (``is_users``); the deepest frame when none is; None when the error has no traceback."""
    frames = [
        (frame.f_code.co_filename, line) for frame, line in traceback.walk_tb(error.__traceback__)
    ]
    for filename, line in reversed(frames):
        if is_users(filename):
            return filename, line
    return frames[-1] if frames else None


def is_users(filename: str) -> bool:
    """Whether a frame's file is the user's code: not inside gatherlab, not in Python's standard
    library (``sysconfig``'s stdlib and platstdlib, frozen modules included; installed packages
    are not the standard library even where a virtual environment puts them below it), not inside
    an installed package of ``FRAMEWORKS`` that this process has imported."""
    if filename.startswith("<frozen "):
        return False
    path = os.path.realpath(filename)
    if any(_below(path, directory) for directory in _framework_directories()):
        return False
    paths = sysconfig.get_paths()
    if any(_below(path, paths[key]) for key in ("purelib", "platlib")):
        return True
    return not any(_below(path, paths[key]) for key in ("stdlib", "platstdlib"))


def place(filename: str, line: int) -> str:
    """``<file>:<line>``, the file relative to the current directory when it is below it."""
    path, here = os.path.realpath(filename), os.path.realpath(os.getcwd())
    if _below(path, here):
        filename = os.path.relpath(path, here)
    return f"{filename}:{line}"


def _framework_directories() -> list[str]:
    """gatherlab's directory and those of the ``FRAMEWORKS`` imported in this process (none is
    imported here: core is below them all)."""
    directories = [str(Path(__file__).resolve().parents[1])]
    for name in FRAMEWORKS:
        filename = getattr(sys.modules.get(name), "__file__", None)
        if filename:
            directories.append(os.path.dirname(os.path.realpath(filename)))
    return directories


def _below(path: str, directory: str) -> bool:
    directory = os.path.realpath(directory)
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def fail(command: str, message: object, status: int = 2) -> NoReturn:
    """End the command line ``python -m gatherlab.<command>`` with ``message`` on one line."""
    print(f"gatherlab.{command}: error: {message}", file=sys.stderr)
    sys.exit(status)


def exiting() -> None:
    """A command line's work is done and its process is about to exit: its objects are frozen
    out of the garbage collector (``gc.freeze``), so that the interpreter's exit does not walk
    them all once more (~0.3 s with torch and pandas loaded). ``atexit`` handlers still run.
    Only for a process that ends now: frozen objects are never collected."""
    gc.freeze()


def exit_now(status: int) -> NoReturn:
    """End a command line's process with ``status`` now, its work done and its files closed: its
    ``atexit`` handlers run and its standard streams are flushed, then the process ends without
    the interpreter's teardown (``os._exit``), which with torch, pandas and matplotlib loaded
    takes ~0.1-0.4 s (its modules cleared, their objects freed one by one; `exiting` leaves that
    work). Only for a command that has no thread of its own left running and no file open:
    those would not be joined, or flushed."""
    import atexit
    import contextlib

    atexit._run_exitfuncs()  # CPython's, as the interpreter's exit calls it (logging's flush)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader gone, a stream closed
            stream.flush()
    os._exit(status)
