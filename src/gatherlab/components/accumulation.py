"""How gatherlab's own module turns a rank's rows into one optimizer update over K micro-batches
(``layout.micro_batches``, ``layout.accumulation``; docs/design.md §2).

- ``none``: the rank's rows in one forward and one backward (K must be 1);
- ``naive``: each micro-batch's loss divided by K, one backward per micro-batch, one step. A loss
  that is a mean of per-sample terms is unchanged; a contrastive loss sees only the micro-batch's
  negatives (the mean over micro-batches of each micro-batch's own loss);
- ``cached``: GradCache (Gao et al., 2021): every micro-batch's embeddings without grad, the loss
  on all of them with grad (its own parameters, e.g. a learnt temperature, get their gradient
  here, once), then one recomputation per micro-batch that backpropagates the cached embeddings'
  gradients. The update equals the one of the whole batch.
"""

from __future__ import annotations

from enum import StrEnum

import torch


class Accumulation(StrEnum):
    """The values of ``layout.accumulation``."""

    NONE = "none"
    NAIVE = "naive"
    CACHED = "cached"


def micro_batches(tensor: torch.Tensor | None, count: int) -> list[torch.Tensor | None]:
    """``tensor``'s rows in ``count`` contiguous micro-batches of equal size (the row count
    divides, checked with the config); ``count`` Nones for no tensor."""
    if tensor is None:
        return [None] * count
    return list(tensor.chunk(count))
