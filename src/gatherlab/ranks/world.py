"""What a rank knows of its world: its rank, the number of ranks, and which rows of a global batch
it holds, in a real process group or in the simulated world (`simworld`), and 0 of 1 outside any.
"""

from __future__ import annotations

import torch.distributed as dist

from gatherlab.core import terms
from gatherlab.ranks import simworld

__all__ = ["own_rows", "rank", "size"]


def size() -> int:
    """Number of ranks: of the simulated world in one of its ranks (``simworld``), else of the
    default process group, 1 when there is none.

    Returns:
        The world size, an integer ≥ 1.
    """
    simulated = simworld.size()
    if simulated is not None:
        return simulated
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This rank: in the simulated world (``simworld``), else in the default process group, 0
    when there is none.

    Returns:
        The rank, an integer from 0 to `size` − 1.
    """
    simulated = simworld.rank()
    if simulated is not None:
        return simulated
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def own_rows(total: int) -> slice:
    """This rank's rows of a global batch or a gathered tensor of ``total`` rows (`rank` of
    `size`: in the simulated world too)."""
    return terms.rows_of(rank(), size(), total)
