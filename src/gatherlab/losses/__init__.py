"""Losses, one family per file (docs/design.md §3); each takes ``gather`` (a name of
`gatherlab.gather.NAMES`, by default ``fixed``: ``_common.DEFAULT_GATHER``; a callable; or None,
no gathering) and its ``forward(out0, out1)`` returns the rank's scalar loss. None of them
communicates by itself, so ``gather=native`` is refused with them.

Modules:

- ``_common``: what every family shares: argument checks, the gathering of the two views
- ``ntxent``: NT-Xent, SimCLR's loss (``NTXentLoss``, ``NTXentGlobalLoss``)
- ``dcl``: decoupled contrastive learning, with and without its weighting of the positives (DCLW)
- ``barlowtwins``: Barlow Twins (``BarlowTwinsLoss``, ``BarlowTwinsGlobalLoss``)
- ``vicreg``: VICReg (``VICRegLoss``)
- ``tico``: TiCo (``TiCoLoss``)
- ``clip``: CLIP's loss, distributed as OpenCLIP's ``ClipLoss(local_loss=True)`` (``CLIPLoss``)
"""

from gatherlab.losses.barlowtwins import BarlowTwinsGlobalLoss, BarlowTwinsLoss
from gatherlab.losses.clip import CLIPLoss
from gatherlab.losses.dcl import DCLLoss, DCLWGlobalLoss, DCLWLoss
from gatherlab.losses.ntxent import NTXentGlobalLoss, NTXentLoss
from gatherlab.losses.tico import TiCoLoss
from gatherlab.losses.vicreg import VICRegLoss

__all__ = [
    "BarlowTwinsGlobalLoss",
    "BarlowTwinsLoss",
    "CLIPLoss",
    "DCLLoss",
    "DCLWGlobalLoss",
    "DCLWLoss",
    "NTXentGlobalLoss",
    "NTXentLoss",
    "TiCoLoss",
    "VICRegLoss",
]
