"""simclr 1.0.2 ``NT_Xent(batch_size, temperature, world_size)`` with ``world_size`` > 1: three
lines make W ranks depart from one device (``simclr/modules/nt_xent.py``, ``gather.py``):

- ``z = torch.cat(GatherLayer.apply(torch.cat((z_i, z_j))))`` (nt_xent.py:36) orders the rows
  [view 0 of rank 0; view 1 of rank 0; view 0 of rank 1; …], while the positives are taken at an
  offset of ``batch_size · world_size`` as if the rows were [all of view 0; all of view 1];
- ``mask_correlated_samples`` masks the positives at ``batch_size + i``, not
  ``batch_size · world_size + i``, so the negatives hold the positive and miss a negative;
- ``GatherLayer.backward`` keeps only the own slice of the gradient (no sum over ranks).

The fix: gather each view on its own, mask at ``batch_size · world_size + i``, all-reduce the
gradient in the backward. Each rank computes the whole loss; this script keeps the release's
arithmetic with those three lines switched.

``python experiments/census_repro/simclr_nt_xent.py``; ``PYTHONPATH=experiments python -m
gatherlab.check census_cases.simclr:SimclrNTXent``.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ranks import compare


class OwnSlice(torch.autograd.Function):  # simclr's GatherLayer: the own slice's gradient
    @staticmethod
    def forward(ctx, x):
        out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        return grads[dist.get_rank()].clone()


class Summed(OwnSlice):  # the fix: every rank's gradient of the own slice, summed
    @staticmethod
    def backward(ctx, *grads):
        stacked = torch.stack(grads)
        dist.all_reduce(stacked)
        return stacked[dist.get_rank()]


def nt_xent(z_i, z_j, temperature=0.5, fixed=False):
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    b, n = len(z_i), 2 * len(z_i) * world_size
    if world_size == 1:
        z = torch.cat((z_i, z_j))
    elif fixed:
        z = torch.cat((*Summed.apply(z_i), *Summed.apply(z_j)))
    else:
        z = torch.cat(OwnSlice.apply(torch.cat((z_i, z_j))))
    offset = b * world_size if fixed else b  # where mask_correlated_samples puts the positives
    mask = torch.ones(n, n, dtype=torch.bool).fill_diagonal_(False)
    for i in range(b * world_size):
        mask[i, offset + i] = mask[offset + i, i] = False
    sim = F.cosine_similarity(z.unsqueeze(1), z.unsqueeze(0), dim=2) / temperature
    positives = torch.cat((torch.diag(sim, b * world_size), torch.diag(sim, -b * world_size)))
    logits = torch.cat((positives.view(n, 1), sim[mask].view(n, -1)), 1)
    return F.cross_entropy(logits, torch.zeros(n, dtype=torch.long), reduction="sum") / n


def nt_xent_fixed(z_i, z_j):
    return nt_xent(z_i, z_j, fixed=True)


if __name__ == "__main__":
    compare(
        "released: views concatenated then gathered, mask at batch_size + i, own slice", nt_xent
    )
    compare("fixed: each view gathered, mask at batch_size·world_size + i, summed", nt_xent_fixed)
