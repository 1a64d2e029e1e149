"""vissl 0.1.6 ``DeepClusterV2Loss``: its distributed k-means (``cluster_memory``) starts from K
rows drawn by rank 0 from its own memory bank alone (``torch.randperm(len(
self.local_memory_embeddings[j]))``, ``vissl/losses/deepclusterv2_loss.py:158``), then
broadcast: a 1/W share of the samples one device draws its start from. The k-means steps that
follow are distributed (counts and sums all-reduced), but they start elsewhere, so the
centroids, the assignments and the loss depend on W: the forward differs from one device's
(and K can be at most the rows of one rank's bank). The fix: draw the start from the whole
memory bank, every rank's rows gathered in rank order (``gather_from_all``).

``python experiments/census_repro/vissl_deepclusterv2.py`` (a k-means and loss written here:
the memory bank is the rank's normalised z0, two clusters, ten steps, each sample's two views
scored against the centroids at temperature 0.1); ``PYTHONPATH=experiments python -m
gatherlab.check census_cases.vissl:VisslDeepClusterV2 --steps 3 --inputs
census_cases.vissl:sample_indices`` (on vissl's release patched for CPU).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ranks import compare


def _all_reduce(tensor):
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor


def criterion(z0, z1, fixed=False, clusters=2, steps=10, temperature=0.1):
    memory = F.normalize(z0.detach(), dim=1)  # the rank's memory bank: its samples' embeddings
    torch.manual_seed(0)  # the same random state on every rank and on one device
    if fixed:  # the start drawn from every rank's rows
        bank = memory
        if dist.is_initialized():
            parts = [torch.empty_like(memory) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, memory)
            bank = torch.cat(parts)
        start = bank[torch.randperm(len(bank))[:clusters]]
    else:  # the release: rank 0 draws from its own rows
        start = memory[torch.randperm(len(memory))[:clusters]]
    if dist.is_initialized():
        dist.broadcast(start, 0)
    centroids = start.clone()
    for _ in range(steps):
        assigned = (memory @ centroids.T).argmax(dim=1)
        counts = _all_reduce(torch.bincount(assigned, minlength=clusters).double())
        sums = _all_reduce(torch.zeros_like(centroids).index_add_(0, assigned, memory))
        moved = counts > 0
        centroids[moved] = sums[moved] / counts[moved, None]
        centroids = F.normalize(centroids, dim=1)
    assigned = (memory @ centroids.T).argmax(dim=1)
    crops = F.normalize(torch.cat((z0, z1)), dim=1)
    return F.cross_entropy(crops @ centroids.T / temperature, torch.cat((assigned, assigned)))


def criterion_fixed(z0, z1):
    return criterion(z0, z1, fixed=True)


if __name__ == "__main__":
    compare("released: the k-means start drawn from rank 0's memory bank", criterion)
    compare("fixed: the start drawn from the whole memory bank", criterion_fixed)
