"""pylate 1.6.0 ``Contrastive(gather_across_devices=True)``: the rank's queries are scored against
every rank's documents, gathered with ``torch.distributed.nn``'s ``all_gather``
(``utils/distributed.py:91``), whose backward sums every rank's gradient of each slice; the loss,
the mean cross-entropy over the rank's queries, is then multiplied by W
(``losses/contrastive.py:231``), as if the gather kept only the own slice. The loss is W times
one device's, and after DDP's average so is the gradient. The fix: do not multiply by W.

``python experiments/census_repro/pylate_contrastive.py`` (MaxSim over 2 tokens of 4 dimensions,
written here); ``PYTHONPATH=experiments python -m gatherlab.check
census_cases.pylate:PylateContrastive --kwargs '{"gather_across_devices": true}'``.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ranks import all_gather_rows, compare


def maxsim(queries, documents):
    """Each query against each document: the sum over its tokens of the best token match."""
    q, d = F.normalize(queries, dim=-1), F.normalize(documents, dim=-1)
    return torch.einsum("qtd,psd->qpts", q, d).amax(dim=-1).sum(dim=-1)


def contrastive(z0, z1, fixed=False):
    queries, documents = z0.view(len(z0), 2, 4), z1.view(len(z1), 2, 4)
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if world_size > 1:  # a gather whose backward sums the gradients, as torch.distributed.nn's
        documents = all_gather_rows(documents)
    labels = torch.arange(len(queries)) + rank * len(queries)
    loss = F.cross_entropy(maxsim(queries, documents), labels)
    return loss if fixed or world_size == 1 else loss * world_size


def contrastive_fixed(z0, z1):
    return contrastive(z0, z1, fixed=True)


if __name__ == "__main__":
    compare("released: the mean over the rank's queries, times W", contrastive)
    compare("fixed: the mean over the rank's queries", contrastive_fixed)
