"""torch 2.13 (CPU), gloo: ``torch.distributed.nn.all_gather``'s backward gives a wrong gradient
when the gradients it receives are not contiguous. On gloo it emulates a reduce-scatter with
``_AlltoAll``, which ``dist.scatter``s the gradients into buffers made by
``torch.empty_like(gradient)`` (``torch/distributed/nn/functional.py:420``): they keep the
gradients' strides, and gloo's scatter gives a wrong result for tensors that are not
contiguous: the third line below shows the same sum exact once the gradient is made contiguous
before the collective (``census_fixes.all_gather_rows``). A gathered tensor used through a
permutation (``.permute``, as BLIP-2's loss uses its gathered image features) hands its backward
such gradients. NCCL takes the reduce-scatter path instead (not run here).

``python experiments/census_repro/torch_gloo_all_gather.py``: ``sum(gathered · w)`` on every
rank, whose gradient of each rank's x is W · its block of w.
"""

import torch
import torch.distributed as dist
from _ranks import all_gather_rows, compare
from torch.distributed.nn import all_gather

WEIGHTS = torch.randn(16, 4, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def plain(z0, z1):  # the same sum, its gradient contiguous
    gathered = torch.cat(all_gather(z0.view(len(z0), 2, 4))) if dist.is_initialized() else z0
    return (gathered.view(len(gathered), 2, 4) * WEIGHTS.permute(0, 2, 1).contiguous()).sum()


def permuted(z0, z1):
    gathered = torch.cat(all_gather(z0.view(len(z0), 2, 4))) if dist.is_initialized() else z0
    return (gathered.view(len(gathered), 2, 4).permute(0, 2, 1) * WEIGHTS).sum()


def permuted_contiguous(z0, z1):  # census_fixes.all_gather_rows: the gradient made contiguous
    gathered = all_gather_rows(z0.view(len(z0), 2, 4))
    return (gathered.view(len(gathered), 2, 4).permute(0, 2, 1) * WEIGHTS).sum()


if __name__ == "__main__":
    compare("the gathered tensor times the permuted weights (a contiguous gradient)", plain)
    compare("the gathered tensor permuted (its gradient is not contiguous)", permuted)
    compare("the same, gathered with census_fixes.all_gather_rows", permuted_contiguous)
