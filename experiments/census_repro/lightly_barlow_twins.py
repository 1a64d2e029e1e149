"""lightly 1.6.0 (and 1.5.25, 1.5.26) ``BarlowTwinsLoss(gather_distributed=True)``: each view
is standardised with the rank's own batch statistics (``F.batch_norm`` in ``_normalize``,
``lightly/loss/barlow_twins_loss.py:94``) before the cross-correlation is all-reduced, so W
ranks compute another loss than one device (one device standardises over the whole batch). The
fix: the whole batch's mean and variance, all-reduced with an all-reduce whose backward sums
the gradients (``census_fixes.all_reduce_sum``). The cross-correlation's all-reduce, which
1.5.26 and later run with ``torch.distributed.nn`` (PR #1977), is written here with the same
``all_reduce_sum`` (the same forward and backward).

``python experiments/census_repro/lightly_barlow_twins.py``; ``PYTHONPATH=experiments python -m
gatherlab.check census_cases.lightly:lightly_loss --kwargs '{"loss": "BarlowTwinsLoss",
"gather_distributed": true}'``.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ranks import all_reduce_sum, compare


def standardised(z, over_everyone=False):
    if not (over_everyone and dist.is_initialized()):  # the release: the rank's rows
        return F.batch_norm(z, None, None, training=True)
    world_size = dist.get_world_size()
    mean = all_reduce_sum(z.mean(0)) / world_size
    var = all_reduce_sum((z - mean).pow(2).mean(0)) / world_size
    return (z - mean) / torch.sqrt(var + 1e-5)


def barlow_twins(z0, z1, lambda_param=5e-3, over_everyone=False):
    a, b = standardised(z0, over_everyone), standardised(z1, over_everyone)
    c = a.T @ b / len(a)
    if dist.is_initialized():  # as 1.5.26 and later: autograd-aware, divided by W
        c = all_reduce_sum(c / dist.get_world_size())
    off_diagonal = c - torch.diag(torch.diagonal(c))
    return (torch.diagonal(c) - 1).pow(2).sum() + lambda_param * off_diagonal.pow(2).sum()


def barlow_twins_fixed(z0, z1):
    return barlow_twins(z0, z1, over_everyone=True)


if __name__ == "__main__":
    compare("released: each rank standardises with its own rows", barlow_twins)
    compare("fixed: with the whole batch's mean and variance", barlow_twins_fixed)
