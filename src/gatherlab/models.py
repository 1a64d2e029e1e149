"""Models that map a view to its embedding. Weights are initialised from torch's global RNG, which
the runner seeds before construction, so every layout starts from the same weights."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn


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
