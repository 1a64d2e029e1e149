"""Models that map a view to its embedding. Weights are initialised from torch's global RNG, which
the runner seeds before construction, so every layout starts from the same weights."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn

from gatherlab.components.augment import DROPOUT_STREAM, sample_generator
from gatherlab.components.batchnorm import GlobalBatchNorm


class Linear(nn.Module):
    """A bias-free linear map on the last dimension (the model of lightly PR #1531's test).

    ``weight`` (out_features × in_features nested lists) sets the initial weight exactly; without
    it the weight is drawn like ``nn.Linear``'s.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        weight: Sequence[Sequence[float]] | None = None,
    ):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        if weight is not None:
            initial = torch.tensor([list(row) for row in weight], dtype=torch.float64)
            if initial.shape != self.linear.weight.shape:
                raise ValueError(
                    f"model.weight has shape {tuple(initial.shape)}, expected "
                    f"(out_features, in_features) = {tuple(self.linear.weight.shape)}"
                )
            with torch.no_grad():
                self.linear.weight.copy_(initial)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class MLP(nn.Module):
    """Linear → ReLU → … → Linear on the last dimension; no normalisation layers, so a sample's
    embedding depends on that sample alone."""

    def __init__(self, in_features: int, hidden_features: int, out_features: int, depth: int = 2):
        super().__init__()
        if depth < 1:
            raise ValueError(f"model.depth must be at least 1, got {depth}")
        widths = [in_features] + [hidden_features] * (depth - 1) + [out_features]
        layers: list[nn.Module] = []
        for index, (width_in, width_out) in enumerate(itertools.pairwise(widths)):
            if index:
                layers.append(nn.ReLU())
            layers.append(nn.Linear(width_in, width_out))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class NormMLP(nn.Module):
    """LayerNorm → Linear → ReLU → Linear on the last dimension: a transformer's pre-norm
    feed-forward block (without its residual), the block that Megatron's tensor and sequence
    parallelism splits. LayerNorm normalises each row over its features, so a sample's embedding
    depends on that sample alone, as `MLP`'s. `tensor_parallel_plan` says how ``strategy=tp``
    splits it (docs/checking.md §10 "Sharded code")."""

    def __init__(self, in_features: int, hidden_features: int, out_features: int):
        super().__init__()
        self.norm = nn.LayerNorm(in_features)
        self.up = nn.Linear(in_features, hidden_features)
        self.down = nn.Linear(hidden_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.norm(x))))

    def tensor_parallel_plan(self, tensor_parallel: int, sequence_parallel: bool) -> dict:
        """torch's ``parallelize_module`` plan over a tensor-parallel mesh of ``tensor_parallel``
        ranks, which all hold the same rows (their data-parallel group's): ``up`` split by its
        output features (``ColwiseParallel``), ``down`` by its input features
        (``RowwiseParallel``), and each rank's output its own consecutive part of the rows (the
        loss's rows: rank r of W holds the r-th part of the global batch, as under DDP).

        With ``sequence_parallel`` (Megatron's sequence parallelism, the rows as the sequence):
        the rows split before the norm (``SequenceParallel(sequence_dim=0)``: its parameters
        replicated, their gradient a partial sum over the tensor-parallel ranks), gathered for
        ``up`` and reduce-scattered back by ``down``. Without it: the norm runs on every row on
        every rank (not parallelized), ``down``'s output is all-reduced and each rank keeps its
        part. A ValueError when ``hidden_features`` does not divide by ``tensor_parallel``."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            PrepareModuleOutput,
            RowwiseParallel,
            SequenceParallel,
        )  # fmt: skip

        hidden = self.up.out_features
        if hidden % tensor_parallel:
            raise ValueError(
                f"model.hidden_features={hidden} does not divide by strategy.tensor_parallel="
                f"{tensor_parallel}; allowed: a multiple of {tensor_parallel}"
            )
        rows = Shard(0)
        if sequence_parallel:
            return {
                "": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=rows),
                "norm": SequenceParallel(sequence_dim=0),
                "up": ColwiseParallel(input_layouts=rows),
                "down": RowwiseParallel(output_layouts=rows),
            }
        return {
            "": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=rows),
            "up": ColwiseParallel(),
            "down": RowwiseParallel(output_layouts=Replicate()),
        }


NORMS = ("global", "local", "sync")


def batch_norm(kind: str, num_features: int, dims: int) -> nn.Module:
    """The normalisation layer of ``model.norm``: ``global`` (gatherlab's global batch norm, any
    backend), ``local`` (per-rank statistics, what plain DDP does), ``sync`` (torch's
    SyncBatchNorm: global statistics on NCCL; it refuses CPU tensors)."""
    if kind == "global":
        return GlobalBatchNorm(num_features)
    if kind == "local":
        return nn.BatchNorm1d(num_features) if dims == 1 else nn.BatchNorm2d(num_features)
    if kind == "sync":
        return nn.SyncBatchNorm(num_features)
    raise ValueError(f"model.norm={kind!r} is unknown; allowed: {', '.join(NORMS)}")


class SeededDropout(nn.Module):
    """Dropout whose mask for a sample is drawn from (seed, epoch, sample index, view, layer),
    like the augmentations, so a sample is dropped the same way on any layout.

    ``sample_keys`` rows are ``[epoch, index, view]``; without keys (evaluation of a single batch,
    or data without keys) it is the identity in evaluation and plain dropout in training.
    """

    def __init__(self, p: float, seed: int, layer: int):
        super().__init__()
        if not 0 <= p < 1:
            raise ValueError(f"model.dropout must be in [0, 1), got {p}")
        self.p, self.seed, self.layer = p, seed, layer

    def forward(self, x: torch.Tensor, sample_keys: torch.Tensor | None = None) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if sample_keys is None:
            return nn.functional.dropout(x, self.p, training=True)
        keep = torch.stack(
            [
                torch.rand(
                    x.shape[1:],
                    generator=sample_generator(
                        self.seed, epoch, index, DROPOUT_STREAM + 2 * self.layer + view
                    ),
                    dtype=torch.float64,
                )
                >= self.p
                for epoch, index, view in sample_keys.tolist()
            ]
        )
        return x * keep.to(x.dtype) / (1 - self.p)


class SimCLRNet(nn.Module):
    """A small SimCLR network for 8×8 images: a CNN backbone with batch norm (3 conv layers,
    global average pooling to ``4·width`` features) and a projection head Linear → batch norm →
    ReLU → (seeded dropout) → Linear. ``norm`` chooses the batch norm (``batch_norm``)."""

    takes_sample_keys = True

    def __init__(
        self,
        in_channels: int = 1,
        width: int = 16,
        hidden_features: int = 64,
        out_features: int = 32,
        norm: str = "global",
        dropout: float = 0.0,
        seed: int = 0,
    ):
        super().__init__()
        channels = [in_channels, width, 2 * width, 4 * width]
        layers: list[nn.Module] = []
        for index, (width_in, width_out) in enumerate(itertools.pairwise(channels)):
            stride = 1 if index == 0 else 2
            layers += [
                nn.Conv2d(width_in, width_out, 3, stride=stride, padding=1, bias=False),
                batch_norm(norm, width_out, dims=2),
                nn.ReLU(),
            ]
        self.backbone = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.projection = nn.Linear(channels[-1], hidden_features, bias=False)
        self.projection_norm = batch_norm(norm, hidden_features, dims=1)
        self.dropout = SeededDropout(dropout, seed, layer=0)
        self.head = nn.Linear(hidden_features, out_features)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The backbone's features (what the k-NN evaluation reads)."""
        return self.backbone(x)

    def forward(self, x: torch.Tensor, sample_keys: torch.Tensor | None = None) -> torch.Tensor:
        hidden = torch.relu(self.projection_norm(self.projection(self.features(x))))
        return self.head(self.dropout(hidden, sample_keys))
