"""What gatherlab's command lines share: an error as one line, the error's exit, and the end.

Every command line (``train``, ``audit``, ``scaling``, ``check``, ``report``) answers bad input
with one line, ``gatherlab.<command>: error: <what, which value, what is allowed>``, and exit
status 2 (``fail``), before any worker starts.
"""

from __future__ import annotations

import gc
import sys
from typing import NoReturn

__all__ = ["exiting", "fail", "first_line", "one_line"]


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
