"""The port a rendezvous listens on, when gatherlab chooses it.

The common choice, a port the kernel lends to ``bind(("", 0))`` and takes back when the probe
closes, can be lent again to another process's outgoing connection (every gloo rank opens
several) before rank 0 listens on it; rank 0 then fails with EADDRINUSE. A port outside the
kernel's ephemeral range is never lent that way, so only a process that binds it on purpose can
take it: ``unclaimed_port`` draws one at random below Linux's (32768–60999) and IANA's
(49152–65535) default ranges, and keeps it only if nothing listens there now.
"""

from __future__ import annotations

import errno
import random
import socket

LOWEST, HIGHEST = 20000, 32767  # below the ephemeral ranges, above the registered services' usual
TRIES = 64


def unclaimed_port() -> int:
    """A port in ``LOWEST..HIGHEST`` that no socket holds now, drawn from the system's entropy (a
    seeded ``random`` would give two jobs of one seed the same port)."""
    draw = random.SystemRandom()
    for _ in range(TRIES):
        port = draw.randint(LOWEST, HIGHEST)
        with socket.socket() as probe:
            try:
                probe.bind(("", port))
            except OSError as error:
                if error.errno != errno.EADDRINUSE:
                    raise
                continue
        return port
    raise OSError(errno.EADDRINUSE, f"no free port in {LOWEST}..{HIGHEST} after {TRIES} tries")
