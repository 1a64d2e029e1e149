"""NT-Xent against direct single-batch implementations of its formula."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from gatherlab.losses import NTXentGlobalLoss, NTXentLoss


def _ntxent_by_formula(out0: torch.Tensor, out1: torch.Tensor, temperature: float) -> torch.Tensor:
    """SimCLR's ℓ(i, j) = −log exp(s_ij/τ) / Σ_{k≠i} exp(s_ik/τ), averaged over all 2N anchors."""
    z = F.normalize(torch.cat([out0, out1]), dim=1)
    n = out0.shape[0]
    total = 0.0
    for i in range(2 * n):
        positive = (i + n) % (2 * n)
        similarities = [float(z[i] @ z[k]) / temperature for k in range(2 * n) if k != i]
        total += -float(z[i] @ z[positive]) / temperature + math.log(
            sum(math.exp(s) for s in similarities)
        )
    return torch.tensor(total / (2 * n), dtype=torch.float64)


def test_hand_computable_case():
    """Two orthogonal pairs, each pair's views identical: s = 1 for the positive, 0 for the rest."""
    out0 = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    temperature = 0.5
    expected = -2.0 + math.log(math.exp(2.0) + 2.0)  # −1/τ + log(e^{1/τ} + 2·e^0)
    for loss in (NTXentLoss(temperature, gather=None), NTXentGlobalLoss(temperature, gather=None)):
        assert float(loss(out0, out0.clone())) == pytest.approx(expected, abs=1e-15)


@pytest.mark.parametrize("temperature", [0.1, 0.5, 1.0])
def test_matches_formula_on_random_embeddings(temperature):
    generator = torch.Generator().manual_seed(0)
    out0, out1 = torch.randn(2, 6, 5, generator=generator, dtype=torch.float64)
    expected = _ntxent_by_formula(out0, out1, temperature)
    assert float(NTXentLoss(temperature, gather=None)(out0, out1)) == pytest.approx(
        float(expected), abs=1e-12
    )
    assert float(NTXentGlobalLoss(temperature, gather=None)(out0, out1)) == pytest.approx(
        float(expected), abs=1e-12
    )


@pytest.mark.parametrize("temperature", [0, -1.0])
def test_rejects_non_positive_temperature(temperature):
    with pytest.raises(ValueError, match="temperature must be positive"):
        NTXentLoss(temperature)


def test_rejects_a_gather_that_is_not_a_name_or_callable():
    with pytest.raises(TypeError, match="gather must be a name"):
        NTXentLoss(gather=3)
