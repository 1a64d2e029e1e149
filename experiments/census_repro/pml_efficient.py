"""pytorch-metric-learning 2.9.0 ``DistributedLossWrapper(loss, efficient=True)``: the rank's
embeddings are scored against references gathered with ``torch.distributed.all_gather``, which
carries no gradient (``utils/distributed.py:22``; the own rows are the live tensor), and the
loss is multiplied by W. The other ranks' loss terms never reach the rank's rows as references:
the gradient is biased, and the loss is W × one device's. The fix: gather the references with
a gather whose backward sums the gradients (``census_fixes.all_gather_rows``) and do not
multiply by W.
(``efficient=False`` computes the whole loss on every rank, multiplied by W: the gradient is
exact after DDP's average and only the logged loss is W × one device's.)

``python experiments/census_repro/pml_efficient.py`` (pml's NTXentLoss, temperature 0.5, on both
views labelled by sample, written here); ``PYTHONPATH=experiments python -m gatherlab.check
census_cases.pytorch_metric_learning:PmlDistributed --kwargs '{"efficient": true}'``.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ranks import all_gather_rows, compare


def ntxent(emb, labels, ref, ref_labels, own, temperature=0.5):
    """pml's NTXentLoss: each positive pair (same label, not the same row) against the anchor's
    negatives (other labels), averaged over the positive pairs."""
    sim = F.normalize(emb, dim=1) @ F.normalize(ref, dim=1).T / temperature
    same = labels[:, None] == ref_labels[None, :]
    positive = same & ~own
    negatives = torch.where(same, -torch.inf, sim).logsumexp(1, keepdim=True)
    per_pair = -(sim - torch.logaddexp(sim, negatives))
    return per_pair[positive].mean()


def efficient(z0, z1, fixed=False):
    emb = torch.cat((z0, z1))
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    labels = (torch.arange(len(z0)) + rank * len(z0)).repeat(2)
    if world_size == 1:
        return ntxent(emb, labels, emb, labels, torch.eye(len(emb), dtype=torch.bool))
    if fixed:
        refs = list(all_gather_rows(emb).split(len(emb)))
    else:  # the release: no gradient but the live own rows
        refs = [torch.zeros_like(emb) for _ in range(world_size)]
        dist.all_gather(refs, emb)
    ref_labels = [torch.zeros_like(labels) for _ in range(world_size)]
    dist.all_gather(ref_labels, labels)
    own_ref = refs.pop(rank) if fixed else emb  # the release puts its live rows first
    if not fixed:
        refs.pop(rank)
    ref, ref_label = torch.cat((own_ref, *refs)), torch.cat((ref_labels.pop(rank), *ref_labels))
    own = torch.eye(len(emb), len(ref), dtype=torch.bool)
    loss = ntxent(emb, labels, ref, ref_label, own)
    return loss if fixed else loss * world_size


def efficient_fixed(z0, z1):
    return efficient(z0, z1, fixed=True)


if __name__ == "__main__":
    compare("released: no-grad references, loss × W", efficient)
    compare("fixed: references gathered with their gradient, no × W", efficient_fixed)
