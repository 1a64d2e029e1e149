"""Data loading that gives every world size the same global batch at every update.

`LayoutInvariantSampler` is a drop-in for ``torch.utils.data.DistributedSampler``: the same
arguments (and ``global_batch_size``), ``set_epoch``, ``len``; rank r of W yields the r-th
contiguous slice of each global batch of DistributedSampler's own permutation, so the ranks'
batches, concatenated in rank order, are the one-device run's batch. How it differs from
DistributedSampler (strided indices, padding, ``drop_last``) and from one device's
``RandomSampler``: docs/design.md §2.

    sampler = gatherlab.data.LayoutInvariantSampler(dataset, global_batch_size=64, seed=0)
    loader = DataLoader(dataset, batch_size=64 // world_size, sampler=sampler)
"""

from __future__ import annotations

from gatherlab.components.data import LayoutInvariantSampler

__all__ = ["LayoutInvariantSampler"]
