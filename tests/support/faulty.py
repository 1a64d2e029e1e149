"""A loss that breaks one rank on purpose, to test what a sweep does when a rank fails or is
interrupted.

Selected from the command line with ``loss._target_=faulty.RankFault`` (``tests/`` on the
``PYTHONPATH``); it behaves as NT-Xent until rank ``rank`` reaches step ``step``, then raises or
kills its own process, or, with ``how="pause"``, writes the file that ``$GATHERLAB_TEST_PAUSE``
names and waits there for good: a rank stopped mid-training, its peers waiting in a collective,
until its process is ended. Without that variable a paused loss trains on, so the same command
resumed elsewhere completes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from gatherlab.losses import NTXentLoss
from gatherlab.ranks import world

PAUSE = "GATHERLAB_TEST_PAUSE"


class RankFault(NTXentLoss):
    def __init__(self, temperature: float = 0.5, gather="fixed", rank: int = 1, step: int = 2,
                 how: str = "kill"):  # fmt: skip
        super().__init__(temperature, gather)
        self.rank, self.step, self.how, self.calls = rank, step, how, 0

    def forward(self, out0, out1):
        self.calls += 1
        if world.rank() == self.rank and self.calls == self.step:
            if self.how == "pause":
                if os.environ.get(PAUSE):
                    Path(os.environ[PAUSE]).touch()
                    while True:
                        time.sleep(1.0)
            elif self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            else:
                raise ValueError(f"fault injected on rank {self.rank}")
        return super().forward(out0, out1)
