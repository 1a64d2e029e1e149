"""The fork server that the ranks of every worker pool are forked from (``gatherlab.ranks.pool``).

It lives apart from the pools and imports nothing heavy, so that a command can start it before it
imports torch itself: the server's imports (torch, ``torch._dynamo`` for DDP, the command's own
modules) then run beside the command's instead of after them (``python -m gatherlab.check``).

A command that exits ends it, and multiprocessing's resource tracker, before it returns (``stop``,
an exit hook registered by the first ``start``, run after the pools' own): left to themselves they
end seconds later (the server's interpreter exit with torch loaded takes 3–6 s, and more on a busy
machine; the tracker waits for the server). A command that is killed closes nothing: the server
then ends by itself once every rank forked from it is gone (multiprocessing hands each rank the
pipe whose end tells the server that its last client has left; ``pool``: the ranks end with the
command).
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import inspect
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing import forkserver, resource_tracker
from pathlib import Path

# What the fork server imports before it forks any worker: what every job runs (DDP's first use
# imports torch._dynamo, ~1–3 s), and of the rest what the starting process has imported itself: a
# training process has Lightning and gatherlab's training modules (a pool started again after a
# failed job then runs its next job without importing them in every rank), a gradient check does
# not need them and does not pay their seconds.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo")
PRELOAD_IF_IMPORTED = ("lightning.pytorch", "gatherlab.ranks.launch", "gatherlab.check.measure")

__all__ = ["PRELOAD", "PRELOAD_IF_IMPORTED", "start", "stop", "unguarded_main"]

# How long ``stop`` waits for the resource tracker to end once its last client has (it ends in
# milliseconds; a process that still holds its pipe would make it wait forever).
TRACKER_EXIT_S = 5.0
# The process that registered ``stop`` (a process forked from it inherits the fork server's pid,
# not the server).
_stopper: int | None = None


def start(also: Sequence[str] = ()) -> None:
    """Start the fork server unless it runs: it imports ``PRELOAD``, what of
    ``PRELOAD_IF_IMPORTED`` this process has imported, and ``also``.

    SIGINT is ignored in it from its first instruction (it imports for seconds before it sets its
    own handlers), so that every worker it forks inherits that too: the starting process answers
    Ctrl-C. Only the main thread can set a handler, and only one set from Python can be put back;
    elsewhere the server starts with the first worker, and the workers' own handler suffices."""
    global _stopper
    if _stopper is None:
        _stopper = os.getpid()
        atexit.register(stop)
    preload = [*PRELOAD, *(name for name in PRELOAD_IF_IMPORTED if name in sys.modules), *also]
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    handler = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or handler is None:
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, handler)


def unguarded_main() -> str | None:
    """``FILE:LINE`` of the statement of the running script that is starting ranks now, when
    each rank would run that statement again: multiprocessing prepares every process it starts by
    running the script that started it (not a ``python -m pkg`` package's ``__main__``, nor a
    session without a file), and the statement is not under ``if __name__ == "__main__":``. The
    rank would then start ranks of its own while it starts, and fail with a traceback."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    if path is None or name == "__main__" or name.endswith(".__main__"):
        return None
    frame, line = inspect.currentframe(), None
    while frame is not None:  # the script's own outermost frame: the statement running in it
        if frame.f_globals is vars(main) and frame.f_code.co_name == "<module>":
            line = frame.f_lineno
        frame = frame.f_back
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    guarded = [node for node in tree.body if isinstance(node, ast.If) and _names_main(node.test)]
    if line is None or any(node.lineno <= line <= node.end_lineno for node in guarded):
        return None
    return f"{path}:{line}"


def _names_main(test: ast.expr) -> bool:
    """``__name__ == "__main__"``, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    sides = {ast.unparse(test.left), ast.unparse(test.comparators[0])}
    return isinstance(test.ops[0], ast.Eq) and sides == {"__name__", "'__main__'"}


def stop() -> None:
    """End this process's fork server and multiprocessing's resource tracker now, once its pools
    are closed (the exit hook ``start`` registers; a Ctrl-C's ``os._exit`` calls it too). The
    server, whose ranks have ended, is killed: it has nothing to finish, and its own exit would
    take seconds. The tracker is waited for (``TRACKER_EXIT_S``, then killed): it ends once no
    process holds its pipe, having removed what leaked.

    multiprocessing has no public way to stop either; ``forkserver._forkserver`` and
    ``resource_tracker._resource_tracker`` are its private singletons (docs/design.md §4;
    tests/ranks/test_interrupt.py fails if they change)."""
    if _stopper != os.getpid():
        return
    server = forkserver._forkserver
    if server._forkserver_pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server._forkserver_pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError, OSError):
            server._stop()  # closes its pipe and reaps it
        server._forkserver_pid = None
    tracker = resource_tracker._resource_tracker
    if tracker._fd is None or tracker._pid is None:
        return
    with contextlib.suppress(OSError):
        os.close(tracker._fd)
    tracker._fd = None
    deadline = time.monotonic() + TRACKER_EXIT_S
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(tracker._pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(tracker._pid, signal.SIGKILL)
                os.waitpid(tracker._pid, 0)
                break
            time.sleep(0.005)
    tracker._pid = None
