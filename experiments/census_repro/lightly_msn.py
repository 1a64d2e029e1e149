"""lightly 1.6.0 ``MSNLoss(gather_distributed=True)``: the Sinkhorn of the targets is
all-reduced, but the me-max regularisation takes the mean anchor probabilities over the rank's
rows (``mean_anchor_probs = torch.mean(anchor_probs, dim=0)``, ``lightly/loss/msn_loss.py:236``)
and its entropy: a function of the batch mean that is not linear, so the mean over ranks is not
one device's. The fix: all-reduce that mean, then / W, with an all-reduce whose backward sums
the gradients (``census_fixes.all_reduce_sum``). gatherlab's ``where`` names that mean
(``msn_loss.py:236``), past the Sinkhorn's partial sums and its scale by the rank's own count.

``python experiments/census_repro/lightly_msn.py`` (the regularisation alone, written here: the
entropy of the mean softmax over 8 prototypes); ``PYTHONPATH=experiments python -m
gatherlab.check census_cases.lightly:LightlyMSN --kwargs '{"gather_distributed": true}'``.
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ranks import all_reduce_sum, compare

PROTOTYPES = F.normalize(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)), dim=1)


def me_max(z0, z1, temperature=0.1, fixed=False):
    anchor_probs = F.softmax(F.normalize(z1, dim=1) @ PROTOTYPES.double().T / temperature, 1)
    mean_anchor_probs = torch.mean(anchor_probs, dim=0)
    if fixed and dist.is_initialized():
        mean_anchor_probs = all_reduce_sum(mean_anchor_probs / dist.get_world_size())
    loss = -torch.sum(torch.log(mean_anchor_probs ** (-mean_anchor_probs)))
    return loss + math.log(float(len(mean_anchor_probs)))


def me_max_fixed(z0, z1):
    return me_max(z0, z1, fixed=True)


if __name__ == "__main__":
    compare("released: the mean anchor probabilities of the rank's rows", me_max)
    compare("fixed: all-reduced", me_max_fixed)
