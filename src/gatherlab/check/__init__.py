"""Check your own loss or gather: does it train on W ranks exactly like one device?

``python -m gatherlab.check mypkg.losses:MyLoss --kwargs '{"temperature": 0.1}' --world-sizes 2,4``
builds the loss inside every rank of a real gloo group (``gatherlab.components.factory``: with
``rank=`` and ``world_size=`` when its constructor takes them, ``gather=`` only with ``--gather``;
without it the loss communicates by itself), calls ``loss(z0, z1)`` on the rank's slice of the two
views' embeddings (the gradient audit's MLP and Gaussian view pairs, float64, the data order of
docs/design.md §2), and compares with the same loss on one device:

- ``forward``: the global loss (the mean over ranks of what each rank returns) is ``same`` or
  ``differs`` (relative tolerance 1e-10);
- ``gradient``: DDP's parameter gradient is ``exact``, ``1/W``, ``W``, ``biased``, ``none`` or
  ``other`` (``measure.classify``);
- with ``--steps N``, a short training run's largest |Δloss|.

The verdict per W is ``exact`` when both are, ``loss differs`` when the forward already differs,
and otherwise the gradient's class; every other verdict comes with a diagnosis in plain words.
``--gather mod:fn`` without a loss checks a gather with gatherlab's three loss styles. It writes
``check.csv`` into ``--out`` and exits 0 when every W is exact, 1 otherwise, 2 for bad input.
"""

from __future__ import annotations

import sys

_external = "--launcher=external" in sys.argv or any(
    pair == ("--launcher", "external") for pair in zip(sys.argv, sys.argv[1:], strict=False)
)
if sys.argv[:1] == ["-m"] and not _external:
    # ``python -m gatherlab.check``: Python imports this package to find its ``__main__`` while
    # ``sys.argv[0]`` is "-m" (documented for -m). The ranks' fork server starts first and imports
    # torch and the modules the ranks run beside this process's own imports (~1 s sooner); the
    # ranks of a training step's check (--module) run Lightning too. Under --launcher external
    # this process is a rank itself: no pool, no fork server.
    from gatherlab.ranks import forkstart

    _training = (
        ("lightning.pytorch", "gatherlab.check.usermodule") if "--module" in sys.argv else ()
    ) + (("gatherlab.check.steprun",) if "--step" in sys.argv else ())
    forkstart.start(("gatherlab.check.measure", "gatherlab.components.config", *_training))

__all__ = [
    "COLUMNS", "CheckError", "check_gather", "check_loss", "check_training",
    "explain", "explain_training", "trains_like_one_device",
]  # fmt: skip

from gatherlab.check.api import CheckError, check_gather, check_loss, check_training
from gatherlab.check.diagnosis import COLUMNS, explain, explain_training, trains_like_one_device
