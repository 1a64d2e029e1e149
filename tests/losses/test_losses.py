"""Every loss with ``gather=None`` on one process against a direct single-batch implementation
of its formula: hand-computable cases first, then loops over random embeddings."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gatherlab import losses
from gatherlab.losses import (
    BarlowTwinsGlobalLoss,
    BarlowTwinsLoss,
    CLIPLoss,
    DCLLoss,
    DCLWGlobalLoss,
    DCLWLoss,
    NTXentGlobalLoss,
    NTXentLoss,
    TiCoLoss,
    VICRegLoss,
)
from gatherlab.losses.dcl import dcl

EXACT = 1e-12  # the formulas below sum in another order; float64 agrees to ~1e-15

# Two orthogonal pairs whose views are identical: every positive similarity is 1, every other 0.
ORTHOGONAL = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
# Four samples whose two dimensions are centred and uncorrelated: ZᵀZ = 4·I.
SQUARE = torch.tensor([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)


def _random_views(batch: int = 6, dim: int = 5, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, batch, dim, generator=generator, dtype=torch.float64))


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b) / (float(a.norm()) * float(b.norm()))


# --- NT-Xent ------------------------------------------------------------------------------------


def _ntxent_by_formula(out0: torch.Tensor, out1: torch.Tensor, temperature: float) -> float:
    """SimCLR's ℓ(i, j) = −log exp(s_ij/τ) / Σ_{k≠i} exp(s_ik/τ), averaged over all 2N anchors."""
    z = torch.cat([out0, out1])
    n = out0.shape[0]
    total = 0.0
    for i in range(2 * n):
        positive = (i + n) % (2 * n)
        others = [_cosine(z[i], z[k]) / temperature for k in range(2 * n) if k != i]
        total += -_cosine(z[i], z[positive]) / temperature + math.log(
            sum(math.exp(s) for s in others)
        )
    return total / (2 * n)


def test_ntxent_hand_computable_case():
    expected = -2.0 + math.log(math.exp(2.0) + 2.0)  # −1/τ + log(e^{1/τ} + 2·e^0), τ = 0.5
    for loss in (NTXentLoss(0.5, gather=None), NTXentGlobalLoss(0.5, gather=None)):
        assert float(loss(ORTHOGONAL, ORTHOGONAL.clone())) == pytest.approx(expected, abs=EXACT)


@pytest.mark.parametrize("temperature", [0.1, 0.5, 1.0])
def test_ntxent_matches_formula(temperature):
    out0, out1 = _random_views()
    expected = _ntxent_by_formula(out0, out1, temperature)
    for loss in (NTXentLoss(temperature, gather=None), NTXentGlobalLoss(temperature, gather=None)):
        assert float(loss(out0, out1)) == pytest.approx(expected, abs=EXACT)


# --- DCL and DCLW -------------------------------------------------------------------------------


def _dcl_by_formula(out0, out1, temperature, sigma=None) -> float:
    """Yeh et al.: ℓ_i = −w_i s(z_i, z'_i)/τ + log Σ_{k≠i, v∈{z, z'}} exp(s(z_i, v_k)/τ), both
    views as anchors; w_i = 2 − exp(s_i/σ) / mean_k exp(s_k/σ) for DCLW, else 1."""
    n = out0.shape[0]
    positives = [_cosine(out0[i], out1[i]) for i in range(n)]
    if sigma is None:
        weights = [1.0] * n
    else:
        mean = sum(math.exp(s / sigma) for s in positives) / n
        weights = [2 - math.exp(s / sigma) / mean for s in positives]
    total = 0.0
    for anchors, others in ((out0, out1), (out1, out0)):
        for i in range(n):
            negatives = [
                math.exp(_cosine(anchors[i], view[k]) / temperature)
                for view in (anchors, others)
                for k in range(n)
                if k != i
            ]
            total += -weights[i] * positives[i] / temperature + math.log(sum(negatives))
    return total / (2 * n)


def test_dcl_hand_computable_case():
    # τ = 0.1: −1/τ for the positive; the negatives are the other sample in both views, e^0 each.
    assert float(DCLLoss(0.1, gather=None)(ORTHOGONAL, ORTHOGONAL.clone())) == pytest.approx(
        -10.0 + math.log(2.0), abs=EXACT
    )


def test_dclw_weights_are_one_when_every_positive_is_alike():
    # equal positive similarities: softmax 1/B, weight 2 − B/B = 1, so DCLW equals DCL
    for loss in (DCLWLoss(0.1, gather=None), DCLWGlobalLoss(0.1, gather=None)):
        assert float(loss(ORTHOGONAL, ORTHOGONAL.clone())) == pytest.approx(
            -10.0 + math.log(2.0), abs=EXACT
        )


@pytest.mark.parametrize("temperature", [0.1, 0.5])
def test_dcl_family_matches_formula(temperature):
    out0, out1 = _random_views()
    assert float(DCLLoss(temperature, gather=None)(out0, out1)) == pytest.approx(
        _dcl_by_formula(out0, out1, temperature), abs=EXACT
    )
    weighted = _dcl_by_formula(out0, out1, temperature, sigma=0.5)
    assert weighted != pytest.approx(_dcl_by_formula(out0, out1, temperature), abs=1e-3)
    for loss in (DCLWLoss(temperature, 0.5, gather=None), DCLWGlobalLoss(temperature, 0.5, None)):
        assert float(loss(out0, out1)) == pytest.approx(weighted, abs=EXACT)


def test_dclw_weights_carry_no_gradient():
    out0, out1 = (view.requires_grad_() for view in _random_views())
    DCLWLoss(gather=None)(out0, out1).backward()
    weighted = out0.grad.clone()
    out0.grad = None
    # the same loss with the weights fixed as constants has the same gradient
    similarity = (F.normalize(out0, dim=1) * F.normalize(out1, dim=1)).sum(dim=1).detach()
    weights = 2 - len(out0) * torch.softmax(similarity / 0.5, dim=0)

    z0, z1 = F.normalize(out0, dim=1), F.normalize(out1, dim=1)
    dcl(z0, z1, z0, z1, 0, 0.1, weights).backward()
    assert torch.allclose(out0.grad, weighted, rtol=0, atol=EXACT)


# --- Barlow Twins -------------------------------------------------------------------------------


def _barlowtwins_by_formula(out0, out1, lambda_param) -> float:
    a, b = out0.numpy(), out1.numpy()
    a = (a - a.mean(0)) / a.std(0, ddof=1)
    b = (b - b.mean(0)) / b.std(0, ddof=1)
    c = a.T @ b / len(a)
    on = sum((1 - c[i, i]) ** 2 for i in range(len(c)))
    off = sum(c[i, j] ** 2 for i in range(len(c)) for j in range(len(c)) if i != j)
    return float(on + lambda_param * off)


def test_barlowtwins_hand_computable_cases():
    # standardised with the unbiased std: C = (N − 1)/N · I = 3/4 · I, loss 2 · (1/4)²
    swapped = SQUARE[:, [1, 0]]  # C = 3/4 · [[0, 1], [1, 0]]: on-diagonal 2 · 1, off λ · 2 · 9/16
    for loss in (BarlowTwinsLoss(0.5, gather=None), BarlowTwinsGlobalLoss(0.5, gather=None)):
        assert float(loss(SQUARE, SQUARE.clone())) == pytest.approx(0.125, abs=EXACT)
        assert float(loss(SQUARE, swapped)) == pytest.approx(2 + 0.5 * 2 * 9 / 16, abs=EXACT)


@pytest.mark.parametrize("lambda_param", [5e-3, 1.0])
def test_barlowtwins_matches_formula(lambda_param):
    out0, out1 = _random_views()
    expected = _barlowtwins_by_formula(out0, out1, lambda_param)
    for loss in (BarlowTwinsLoss(lambda_param, None), BarlowTwinsGlobalLoss(lambda_param, None)):
        assert float(loss(out0, out1)) == pytest.approx(expected, abs=EXACT)


# --- VICReg -------------------------------------------------------------------------------------


def _vicreg_by_formula(out0, out1, lam=25.0, mu=25.0, nu=1.0, eps=1e-4) -> float:
    a, b = out0.numpy(), out1.numpy()
    d = a.shape[1]
    invariance = ((a - b) ** 2).mean()
    variance = sum(
        max(0.0, 1 - math.sqrt(z[:, j].var(ddof=1) + eps)) for z in (a, b) for j in range(d)
    )
    covariance = 0.0
    for z in (a, b):
        cov = np.cov(z, rowvar=False)
        covariance += sum(cov[i, j] ** 2 for i in range(d) for j in range(d) if i != j) / d
    return float(lam * invariance + mu * variance / (2 * d) + nu * covariance)


def test_vicreg_hand_computable_case():
    assert float(VICRegLoss(gather=None)(SQUARE, SQUARE.clone())) == pytest.approx(0, abs=EXACT)
    # views z and z/2: invariance mean(0.25) = 0.25; the second view's variance is 1/3 in each
    # dimension, below 1: its hinge is 1 − sqrt(1/3 + ε) (halved: the term is the views' mean)
    expected = 25 * 0.25 + 25 * 0.5 * (1 - math.sqrt(1 / 3 + 1e-4))
    assert float(VICRegLoss(gather=None)(SQUARE, SQUARE / 2)) == pytest.approx(expected, abs=EXACT)


def test_vicreg_matches_formula():
    out0, out1 = _random_views(batch=8, dim=4)
    out1 = 0.3 * out1  # some variances below 1, so the hinge is active
    assert float(VICRegLoss(gather=None)(out0, out1)) == pytest.approx(
        _vicreg_by_formula(out0, out1), abs=EXACT
    )


# --- TiCo ---------------------------------------------------------------------------------------


def test_tico_hand_computable_steps():
    loss = TiCoLoss(beta=0.9, rho=20.0, gather=None)
    # step 1: C = 0.1 · ZᵀZ/2 = 0.05·I, loss −1 + 20 · 0.05
    assert float(loss(ORTHOGONAL, ORTHOGONAL.clone())) == pytest.approx(0.0, abs=EXACT)
    # step 2: C = 0.9 · 0.05·I + 0.05·I = 0.095·I
    assert float(loss(ORTHOGONAL, ORTHOGONAL.clone())) == pytest.approx(0.9, abs=EXACT)
    loss.eval()  # evaluation reads the covariance without updating it
    assert float(loss(ORTHOGONAL, ORTHOGONAL.clone())) == pytest.approx(-1 + 20 * 0.1355, abs=EXACT)
    assert float(loss(ORTHOGONAL, ORTHOGONAL.clone())) == pytest.approx(-1 + 20 * 0.1355, abs=EXACT)


def test_tico_matches_formula_over_steps():
    loss, covariance = TiCoLoss(beta=0.8, rho=5.0, gather=None), np.zeros((5, 5))
    for step in range(3):
        out0, out1 = _random_views(seed=step)
        a = F.normalize(out0, dim=1).numpy()
        b = F.normalize(out1, dim=1).numpy()
        covariance = 0.8 * covariance + 0.2 * a.T @ a / len(a)
        expected = -np.mean(np.sum(a * b, 1)) + 5.0 * np.mean(np.sum((a @ covariance) * a, 1))
        assert float(loss(out0, out1)) == pytest.approx(float(expected), abs=EXACT)


# --- CLIP ---------------------------------------------------------------------------------------


def test_clip_hand_computable_case():
    # scale 1/τ = 2: each row's logits are [2, 0] with the target first
    expected = -2.0 + math.log(math.exp(2.0) + 1.0)
    loss = CLIPLoss(0.5, gather=None).double()
    assert float(loss(ORTHOGONAL, ORTHOGONAL.clone()).detach()) == pytest.approx(
        expected, abs=EXACT
    )


def test_clip_matches_formula_and_learns_its_scale():
    out0, out1 = _random_views()
    loss = CLIPLoss(0.07, gather=None).double()  # as training in float64 converts it
    value = loss(out0, out1)
    n, scale = len(out0), 1 / 0.07
    total = 0.0
    for a, b in ((out0, out1), (out1, out0)):
        for i in range(n):
            logits = [scale * _cosine(a[i], b[k]) for k in range(n)]
            total += -logits[i] + math.log(sum(math.exp(x) for x in logits))
    assert float(value.detach()) == pytest.approx(total / (2 * n), abs=EXACT)
    value.backward()
    assert loss.logit_scale.grad is not None and float(loss.logit_scale.grad) != 0


def test_clip_clamps_the_logit_scale_at_100():
    with torch.no_grad():
        asked = CLIPLoss(0.001, gather=None).double()(ORTHOGONAL, ORTHOGONAL)  # scale 1000
        expected = CLIPLoss(0.01, gather=None).double()(ORTHOGONAL, ORTHOGONAL)  # scale 100
    assert float(asked) == pytest.approx(float(expected), abs=EXACT)


# --- arguments ----------------------------------------------------------------------------------

ALL = [getattr(losses, name) for name in losses.__all__]


@pytest.mark.parametrize(
    ("loss_class", "argument", "value", "message"),
    [
        (NTXentLoss, "temperature", 0, "temperature must be a positive number"),
        (NTXentGlobalLoss, "temperature", -1.0, "temperature must be a positive number"),
        (DCLLoss, "temperature", "0.1", "temperature must be a positive number"),
        (DCLWLoss, "sigma", 0, "sigma must be a positive number"),
        (BarlowTwinsLoss, "lambda_param", -1, "lambda_param must be a non-negative number"),
        (VICRegLoss, "eps", 0, "eps must be a positive number"),
        (VICRegLoss, "nu_param", float("nan"), "nu_param must be a non-negative number"),
        (TiCoLoss, "beta", 1.0, r"beta must be a number in \[0, 1\)"),
        (CLIPLoss, "temperature", 0.0, "temperature must be a positive number"),
    ],
)
def test_rejects_bad_arguments(loss_class, argument, value, message):
    with pytest.raises(ValueError, match=message):
        loss_class(**{argument: value})


@pytest.mark.parametrize("loss_class", ALL)
def test_rejects_a_gather_that_is_not_a_name_or_callable(loss_class):
    with pytest.raises(TypeError, match="gather must be a name"):
        loss_class(gather=3)
    with pytest.raises(ValueError, match="gather='nope' is unknown"):
        loss_class(gather="nope")


@pytest.mark.parametrize("loss_class", ALL)
def test_rejects_views_of_different_shapes(loss_class):
    with pytest.raises(ValueError, match=r"two views must be \(batch, dim\) tensors of one shape"):
        loss_class(gather=None)(SQUARE, SQUARE[:3])


@pytest.mark.parametrize("loss_class", ALL)
def test_every_loss_states_its_predicted_layout_invariance(loss_class):
    assert isinstance(loss_class.layout_invariant, bool)
    assert loss_class.__doc__ and len(loss_class.__doc__.split()) > 20
