"""solo-learn 1.0.2 ``solo.utils.misc.gather`` (its ``GatherLayer``, with which NNCLR, NNBYOL,
NNSiam, ReSSL and MoCo v2+ gather): the backward keeps the rank's own slice of the gradient
(``grad_out[:] = grads[dist.get_rank()]``, misc.py:186), the other ranks' losses' gradients of
its rows are dropped: with a loss of the rank's rows against the gathered batch the gradient is
biased (as lightly's before 1.5.4). The fix: all-reduce the gradients, then take the own slice.

``python experiments/census_repro/solo_gather.py`` (an NT-Xent of the rank's rows against the
gathered batch, written here); ``PYTHONPATH=experiments python -m gatherlab.check
gatherlab.losses:NTXentLoss --gather census_cases.solo_learn:solo_gather --kwargs
'{"temperature": 0.5}'``.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ranks import compare
from simclr_nt_xent import OwnSlice, Summed


def nt_xent(z0, z1, gather=OwnSlice, temperature=0.5):
    z0, z1 = F.normalize(z0, dim=1), F.normalize(z1, dim=1)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if dist.is_initialized():
        everyone = torch.cat((*gather.apply(z0), *gather.apply(z1)))
    else:
        everyone = torch.cat((z0, z1))
    n, b = len(everyone) // 2, len(z0)
    own = torch.arange(b) + rank * b
    logits = torch.cat((z0, z1)) @ everyone.T / temperature
    logits[torch.arange(b), own] = logits[torch.arange(b, 2 * b), own + n] = -torch.inf
    return F.cross_entropy(logits, torch.cat((own + n, own)))


def nt_xent_fixed(z0, z1):
    return nt_xent(z0, z1, gather=Summed)


if __name__ == "__main__":
    compare("released: GatherLayer keeps the own slice", nt_xent)
    compare("fixed: every rank's gradient summed", nt_xent_fixed)
