"""The fork server that the ranks of every worker pool are forked from (``gatherlab.ranks.pool``).

It lives apart from the pools and imports nothing heavy, so that a command can start it before it
imports torch itself: the server's imports (torch, ``torch._dynamo`` for DDP, the command's own
modules) then run beside the command's instead of after them (``python -m gatherlab.check``).

It ends by itself once the command and every rank forked from it are gone (multiprocessing hands
each rank the pipe whose end tells the server that its last client has left), so a command that is
killed leaves no fork server once its ranks have ended (``pool``: they end with the command).
"""

from __future__ import annotations

import multiprocessing
import signal
import sys
import threading
from collections.abc import Sequence
from multiprocessing import forkserver

# What the fork server imports before it forks any worker: what every job runs (DDP's first use
# imports torch._dynamo, ~1–3 s), and of the rest what the starting process has imported itself: a
# training process has Lightning and gatherlab's training modules (a pool started again after a
# failed job then runs its next job without importing them in every rank), a gradient check does
# not need them and does not pay their seconds.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo")
PRELOAD_IF_IMPORTED = ("lightning.pytorch", "gatherlab.ranks.launch", "gatherlab.check.measure")

__all__ = ["PRELOAD", "PRELOAD_IF_IMPORTED", "start"]


def start(also: Sequence[str] = ()) -> None:
    """Start the fork server unless it runs: it imports ``PRELOAD``, what of
    ``PRELOAD_IF_IMPORTED`` this process has imported, and ``also``.

    SIGINT is ignored in it from its first instruction (it imports for seconds before it sets its
    own handlers), so that every worker it forks inherits that too: the starting process answers
    Ctrl-C. Only the main thread can set a handler, and only one set from Python can be put back;
    elsewhere the server starts with the first worker, and the workers' own handler suffices."""
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
