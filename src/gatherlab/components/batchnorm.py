"""Batch normalisation over the global batch on any backend, built on a differentiable all-reduce.

torch's ``SyncBatchNorm`` refuses CPU tensors, so on gloo gatherlab normalises with its own
``GlobalBatchNorm``: the statistics of the whole global batch, computed with two all-reduces, and
a backward that is exact across ranks. On one process it is ``BatchNorm``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from gatherlab.ranks import world


class _AllReduceSum(torch.autograd.Function):
    """Forward: all_reduce SUM. Backward: all_reduce SUM of the gradients.

    Every rank's output is the same sum S = Σ_s x_s and every rank's loss depends on it, so the
    gradient of x_s is Σ_r ∂L_r/∂S, which the backward's all-reduce delivers to every rank.
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        total = tensor.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        total = grad.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor`` over all ranks, differentiable; the identity on one process."""
    return _AllReduceSum.apply(tensor) if world.size() > 1 else tensor


class GlobalBatchNorm(nn.Module):
    """``BatchNorm1d``/``2d``/``3d`` with statistics over the global batch of all ranks.

    In training, mean and (biased) variance per channel are taken over every rank's samples (and
    positions): one all-reduce for the sums and the sample count, one for the squared deviations
    from the global mean, so the variance is computed as on one device, not as E[x²] − E[x]².
    Running statistics follow ``BatchNorm`` (momentum, unbiased running variance) and are the same
    on every rank. In evaluation it normalises with the running statistics, without collectives.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1):
        super().__init__()
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim < 2 or x.shape[1] != self.num_features:
            raise ValueError(
                f"GlobalBatchNorm({self.num_features}) expects (N, {self.num_features}, ...), got "
                f"{tuple(x.shape)}"
            )
        dims = [0, *range(2, x.ndim)]  # every axis but the channels
        shape = [1, -1] + [1] * (x.ndim - 2)
        if self.training:
            mean, var = self._global_statistics(x, dims, shape)
        else:
            mean, var = self.running_mean, self.running_var
        centred = x - mean.reshape(shape)
        scale = self.weight / torch.sqrt(var + self.eps)
        return centred * scale.reshape(shape) + self.bias.reshape(shape)

    def _global_statistics(
        self, x: torch.Tensor, dims: list[int], shape: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and biased variance over every rank's batch; updates the running statistics."""
        count_column = x.new_full((1,), float(x.numel() // self.num_features))
        sums = all_reduce_sum(torch.cat([x.sum(dim=dims), count_column]))
        count = sums[-1].detach()
        mean = sums[:-1] / count
        centred = x - mean.reshape(shape)
        var = all_reduce_sum((centred * centred).sum(dim=dims)) / count
        with torch.no_grad():
            self.num_batches_tracked += 1
            # momentum None: the cumulative average, as BatchNorm keeps it
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
            else:
                factor = self.momentum
            self.running_mean.lerp_(mean, factor)
            self.running_var.lerp_(var * count / (count - 1), factor)
        return mean, var
