"""The census's cases of pytorch-metric-learning 2.9.0: ``NTXentLoss`` alone and through
``DistributedLossWrapper``, with and without ``efficient``."""

from __future__ import annotations

import torch
from torch import nn

from census_cases.common import Case, Fix, importable, root_of

PML = "2.9.0"


class PmlDistributed(nn.Module):
    """pytorch-metric-learning's released ``DistributedLossWrapper(NTXentLoss(temperature=0.5),
    efficient)``, imported as a package (its imports need no torchvision). Its loss takes one
    set of embeddings and labels: here both views, ``cat(z0, z1)``, labelled by the sample's
    index in the global batch (rank·B + i on rank r; gatherlab passes rank), so that the two views
    of a sample are the positive pair. Without the wrapper (``wrap=False``) the same NTXentLoss
    on the rank's rows alone."""

    def __init__(self, root=None, rank=0, efficient=False, wrap=True):
        super().__init__()
        importable(root_of(root, "pytorch-metric-learning", PML), "pytorch_metric_learning")
        from pytorch_metric_learning import losses
        from pytorch_metric_learning.utils.distributed import DistributedLossWrapper

        loss = losses.NTXentLoss(temperature=0.5)
        self.loss = DistributedLossWrapper(loss, efficient=efficient) if wrap else loss
        self.rank = rank

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        samples = torch.arange(len(z0), device=z0.device) + self.rank * len(z0)
        return self.loss(torch.cat((z0, z1)), torch.cat((samples, samples)))


PML_EFFICIENT = Fix(
    "with efficient=True, gather the references with a gather whose backward sums the "
    "gradients (census_fixes.all_gather_rows), the own rows first as before, instead of the "
    "no-grad all_gather, and return the loss not multiplied by W",
    "pytorch_metric_learning/efficient.patch",
)
LOSS_SCALED = (
    "`loss scaled`: the loss is W × one device's (`return loss * world_size`) and the gradient "
    "exact after DDP's average: training is one device's, the logged loss W times it"
)
CASES = [
    Case("pytorch-metric-learning", PML, "NTXentLoss", "no wrapper", PmlDistributed,
         {"wrap": False}, note="DistributedLossWrapper (next rows)"),
    Case("pytorch-metric-learning", PML, "DistributedLossWrapper(NTXentLoss)", "efficient=False",
         PmlDistributed, remark=LOSS_SCALED),
    Case("pytorch-metric-learning", PML, "DistributedLossWrapper(NTXentLoss)", "efficient=True",
         PmlDistributed, {"efficient": True}, fix=PML_EFFICIENT, repro="pml_efficient.py"),
]  # fmt: skip
