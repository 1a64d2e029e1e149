"""vissl 0.1.6 ``BarlowTwinsCriterion``: the cross-correlation is averaged over ranks with
classy_vision's ``all_reduce_mean`` (``vissl/losses/barlow_twins_loss.py:140``), an in-place
``torch.distributed.all_reduce`` autograd does not see: each rank's gradient reaches only its
own share of the correlation, while every rank computes the whole loss: the gradient is 1/W of
one device's (its standardisation, ``SyncNormalizeFunction``, is synchronised and exact). The
fix: an all-reduce whose backward sums the gradients (``census_fixes.all_reduce_sum``).

``python experiments/census_repro/vissl_barlow.py`` (the criterion written here, each view
standardised over the whole batch: vissl standardises both views together, over all ranks
too); ``PYTHONPATH=experiments python -m gatherlab.check census_cases.vissl:VisslBarlow``.
"""

import torch
import torch.distributed as dist
from _ranks import all_reduce_sum, compare
from lightly_barlow_twins import standardised


def criterion(z0, z1, lambda_=0.0051, scale_loss=0.024, fixed=False):
    a, b = standardised(z0, over_everyone=True), standardised(z1, over_everyone=True)
    correlation = a.T @ b / len(a)
    if dist.is_initialized():
        if fixed:
            correlation = all_reduce_sum(correlation) / dist.get_world_size()
        else:  # the release: classy_vision's all_reduce_mean, in place
            dist.all_reduce(correlation)
            correlation = correlation / dist.get_world_size()
    off_diagonal = correlation - torch.diag(torch.diagonal(correlation))
    on = torch.diagonal(correlation).add(-1).pow(2).sum().mul(scale_loss)
    return on + lambda_ * off_diagonal.pow(2).sum().mul(scale_loss)


def criterion_fixed(z0, z1):
    return criterion(z0, z1, fixed=True)


if __name__ == "__main__":
    compare("released: the correlation averaged in place", criterion)
    compare("fixed: census_fixes.all_reduce_sum", criterion_fixed)
