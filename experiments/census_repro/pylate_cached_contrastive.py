"""pylate 1.6.0 ``CachedContrastive(gather_across_devices=True)``: the rank's queries are scored
against every rank's documents, gathered with ``torch.distributed.nn``'s ``all_gather``
(``utils/distributed.py:91``), whose backward sums every rank's gradient of each slice; the
cross-entropy of each chunk of queries (``score_mini_batch_size`` rows), summed, is multiplied by
W (``losses/cached_contrastive.py:317``) before the sum over chunks is divided by the rank's
batch, as if the gather kept only the own slice. The loss is W times one device's, and after
DDP's average so is the gradient. GradCache (the model run in mini-batches, the gradient cached
at the embeddings) does not change this: the cached gradient is this loss's. The fix: do not
multiply by W.

``python experiments/census_repro/pylate_cached_contrastive.py`` (MaxSim over 2 tokens of 4
dimensions, query chunks of 4, written here); ``PYTHONPATH=experiments python -m
gatherlab.check census_cases.pylate:PylateCachedContrastive --kwargs
'{"gather_across_devices": true}'``.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ranks import all_gather_rows, compare

CHUNK = 4  # the query rows scored at a time


def maxsim(queries, documents):
    """Each query against each document: the sum over its tokens of the best token match."""
    return torch.einsum("qtd,psd->qpts", queries, documents).amax(dim=-1).sum(dim=-1)


def cached_contrastive(z0, z1, fixed=False):
    queries = F.normalize(z0.view(len(z0), 2, 4), dim=-1)
    documents = F.normalize(z1.view(len(z1), 2, 4), dim=-1)
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if world_size > 1:  # a gather whose backward sums the gradients, as torch.distributed.nn's
        documents = all_gather_rows(documents)
    labels = torch.arange(len(queries)) + rank * len(queries)
    total = 0
    for begin in range(0, len(queries), CHUNK):
        part = slice(begin, begin + CHUNK)
        chunk = F.cross_entropy(maxsim(queries[part], documents), labels[part], reduction="sum")
        total = total + (chunk if fixed or world_size == 1 else chunk * world_size)
    return total / len(queries)


def cached_contrastive_fixed(z0, z1):
    return cached_contrastive(z0, z1, fixed=True)


if __name__ == "__main__":
    compare("released: each query chunk's summed cross-entropy times W, over the rank's batch",
            cached_contrastive)  # fmt: skip
    compare("fixed: the summed cross-entropy over the rank's batch", cached_contrastive_fixed)
