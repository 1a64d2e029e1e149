"""solo-learn 1.0.2 ``barlow_loss_func``: whenever a process group exists it standardises each
view with the rank's own batch (a ``BatchNorm1d`` built in the function,
``solo/losses/barlow.py:45``) and averages the cross-correlation with ``dist.all_reduce(corr)``
(barlow.py:52), an in-place collective autograd does not see: the loss is not one device's, and
its gradient reaches only the rank's own share of the correlation. The fix: the whole batch's
mean and variance, and an all-reduce whose backward sums the gradients
(``census_fixes.all_reduce_sum``).

``python experiments/census_repro/solo_barlow.py``; ``PYTHONPATH=experiments python -m
gatherlab.check census_cases.solo_learn:SoloBarlow`` (in float64 the released BatchNorm1d refuses
the input: the census patches its dtype, see docs/results.md).
"""

import torch
import torch.distributed as dist
from _ranks import all_reduce_sum, compare
from lightly_barlow_twins import standardised


def barlow(z1, z2, lamb=5e-3, scale_loss=0.025, fixed=False):
    z1, z2 = standardised(z1, over_everyone=fixed), standardised(z2, over_everyone=fixed)
    corr = torch.einsum("bi, bj -> ij", z1, z2) / len(z1)
    if dist.is_initialized():
        if fixed:
            corr = all_reduce_sum(corr / dist.get_world_size())
        else:  # the release: in place, unseen by autograd
            dist.all_reduce(corr)
            corr /= dist.get_world_size()
    diag = torch.eye(len(corr), dtype=corr.dtype)
    cdif = (corr - diag).pow(2)
    cdif[~diag.bool()] *= lamb
    return scale_loss * cdif.sum()


def barlow_fixed(z1, z2):
    return barlow(z1, z2, fixed=True)


if __name__ == "__main__":
    compare("released: the rank's statistics, dist.all_reduce(corr)", barlow)
    compare("fixed: the whole batch's statistics, census_fixes.all_reduce_sum", barlow_fixed)
