"""lightly 1.6.0 ``DCLWLoss(gather_distributed=True)``: the negative von Mises-Fisher weights
are a softmax over the rank's own rows (``lightly/loss/dcl_loss.py:38``,
``2 - out0.shape[0] * softmax(similarity, dim=0)``), so W ranks weigh each positive otherwise
than one device does, though the negatives are gathered. The fix: the softmax over the gathered
batch, then the rank's slice. (Both versions gather with ``census_fixes.all_gather_rows``,
whose backward sums the gradients, as lightly's ``GatherLayer`` does since 1.5.4.)

``python experiments/census_repro/lightly_dclw.py`` (plain torch, gloo ranks on this machine);
``python -m gatherlab.check census_cases.lightly:lightly_loss --kwargs
'{"loss": "DCLWLoss", "gather_distributed": true}'`` with ``PYTHONPATH=experiments`` checks the
released class itself once ``python experiments/census.py`` has unpacked it.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ranks import all_gather_rows, compare


def rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def gathered(x: torch.Tensor) -> torch.Tensor:  # every rank's rows; the backward sums
    return all_gather_rows(x)


def weights(z0, z1, sigma=0.5, over_everyone=False):
    similarity = (z0 * z1).sum(1).detach() / sigma
    if not over_everyone:  # the release: the rank's rows
        return 2 - len(z0) * F.softmax(similarity, 0)
    rank, _ = rank_and_world()
    everyone = gathered(similarity)
    return (2 - len(everyone) * F.softmax(everyone, 0))[rank * len(z0) : (rank + 1) * len(z0)]


def dclw(z0, z1, temperature=0.1, over_everyone=False):
    z0, z1 = F.normalize(z0, dim=1), F.normalize(z1, dim=1)
    rank, _ = rank_and_world()
    loss = 0
    for a, b in ((z0, z1), (z1, z0)):
        a_all, b_all = gathered(a), gathered(b)
        own = torch.zeros(len(a), len(a_all), dtype=torch.bool)
        own[torch.arange(len(a)), torch.arange(len(a)) + rank * len(a)] = True
        sim_aa, sim_ab = a @ a_all.T / temperature, a @ b_all.T / temperature
        positive = -sim_ab[own] * weights(a, b, over_everyone=over_everyone)
        negatives = torch.cat((sim_aa[~own].view(len(a), -1), sim_ab[~own].view(len(a), -1)), 1)
        loss = loss + 0.5 * (positive + torch.logsumexp(negatives, 1)).mean()
    return loss


def dclw_fixed(z0, z1):
    return dclw(z0, z1, over_everyone=True)


if __name__ == "__main__":
    compare("released: the weights' softmax over the rank's rows", dclw)
    compare("fixed: over the gathered batch, then the rank's slice", dclw_fixed)
