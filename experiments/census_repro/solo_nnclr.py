"""solo-learn 1.0.2 NNCLR (``nnclr_loss_func``, solo/losses/nnclr.py): the logits are the rank's
nearest neighbours against the rank's own predictions only (``logits = nn @ p.T / temperature``,
nnclr.py:41, labels ``arange(n)``): on W ranks each rank's softmax has its own batch's
predictions as the negatives, n of them instead of the global batch's, so the loss and its
gradient are not one device's (loss differs). Its support set (``NNCLR.dequeue_and_enqueue``,
the gathered projections) is the same on every rank; the loss alone departs. The fix: every
rank's predictions as the columns (an all-gather whose backward sums), the labels offset by the
rank's first row.

``python experiments/census_repro/solo_nnclr.py`` (the loss, written here, of each view's
nearest neighbour in a fixed support set against the other view's predictions);
``PYTHONPATH=experiments python -m gatherlab.check census_cases.solo_learn:SoloNNCLR --steps 3``
(the released files, as the census unpacked them).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ranks import all_gather_rows, compare

SUPPORT = F.normalize(torch.randn(32, 8, generator=torch.Generator().manual_seed(1),
                                  dtype=torch.float64), dim=1)  # fmt: skip


def nearest(z):
    with torch.no_grad():
        z = F.normalize(z, dim=1)
        return SUPPORT[(z @ SUPPORT.T).argmax(dim=1)]


def contrast(nn, p, gathered, temperature=0.2):
    nn, p = F.normalize(nn, dim=1), F.normalize(p, dim=1)
    columns = all_gather_rows(p) if gathered else p
    rank = dist.get_rank() if gathered and dist.is_initialized() else 0
    labels = torch.arange(len(p)) + rank * len(p)
    return F.cross_entropy(nn @ columns.T / temperature, labels)


def nnclr(z0, z1, gathered=False):
    return (contrast(nearest(z0), z1, gathered) + contrast(nearest(z1), z0, gathered)) / 2


def nnclr_fixed(z0, z1):
    return nnclr(z0, z1, gathered=True)


if __name__ == "__main__":
    compare("released: the rank's own predictions as the negatives", nnclr)
    compare("fixed: every rank's predictions (gathered, backward summed)", nnclr_fixed)
