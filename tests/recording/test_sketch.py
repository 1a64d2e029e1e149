"""The sketch of docs/recording.md §11: its definition against a loop written from the formula, its
linearity and additivity over shards, what it keeps exactly (equality, parallelism, a factor), and
its estimates of the cosine and the relative error within the bounds §11 states for k, on random
and on real gradients."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from gatherlab.recording.sketch import DEFAULT_K, signs, sketch


def _by_the_formula(x: torch.Tensor, k: int, block_signs: torch.Tensor) -> torch.Tensor:
    """S(x)[j] = Σ_b σ_b · x[b·k + j], one element at a time."""
    out = [0.0] * k
    for i, value in enumerate(x.tolist()):
        out[i % k] += float(block_signs[i // k]) * value
    return torch.tensor(out, dtype=torch.float64)


def test_the_sketch_is_the_signed_sum_of_the_blocks():
    x = torch.randn(1000, dtype=torch.float64)
    block_signs = signs("layer.weight", 1000, 64, seed=3)
    assert block_signs.abs().eq(1).all() and len(block_signs) == 16  # ceil(1000 / 64)
    assert torch.allclose(sketch(x, 64, block_signs), _by_the_formula(x, 64, block_signs),
                          rtol=0, atol=1e-12)  # fmt: skip
    assert not torch.equal(block_signs, signs("layer.bias", 1000, 64, seed=3))
    assert not torch.equal(block_signs, signs("layer.weight", 1000, 64, seed=4))


@pytest.mark.parametrize("cuts", [(0, 1000), (0, 37, 500, 999, 1000), (0, 64, 128, 1000),
                                  (0, 3, 4, 5, 1000)])  # fmt: skip
def test_the_shards_sketches_add_up_to_the_whole_ones(cuts):
    """A rank holding elements [o, o + m) sketches them at offset o; the sum is the whole's."""
    x = torch.randn(1000, dtype=torch.float64)
    block_signs = signs("w", 1000, 64, seed=0)
    whole = sketch(x, 64, block_signs)
    shards = sum(sketch(x[a:b], 64, block_signs, offset=a) for a, b in itertools.pairwise(cuts))
    assert float((shards - whole).abs().max()) <= 1e-13 * float(whole.abs().max())


def test_the_sketch_is_linear_and_keeps_a_factor_exactly():
    a, b = torch.randn(777, dtype=torch.float64), torch.randn(777, dtype=torch.float64)
    block_signs = signs("w", 777, 32, seed=1)
    s = lambda v: sketch(v, 32, block_signs)  # noqa: E731
    assert torch.allclose(s(2.5 * a + b), 2.5 * s(a) + s(b), rtol=0, atol=1e-12)
    quarter = s(a / 4)
    assert torch.equal(quarter, s(a) / 4)  # a power of two: bit for bit
    cosine = float(quarter @ s(a) / (quarter.norm() * s(a).norm()))
    assert abs(cosine - 1) <= 1e-15


def _pair(cosine: float, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    b = torch.randn(n, dtype=torch.float64, generator=generator)
    noise = torch.randn(n, dtype=torch.float64, generator=generator)
    noise -= (noise @ b) / (b @ b) * b
    a = cosine * b / b.norm() + math.sqrt(1 - cosine**2) * noise / noise.norm()
    return 1.3 * float(b.norm()) * a, b


def _real_gradients() -> tuple[torch.Tensor, torch.Tensor]:
    """An MLP's gradient on a batch and on its first half (what a local-only backward gives)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(),
                                torch.nn.Linear(128, 32)).double()  # fmt: skip
    x, y = torch.randn(32, 64, dtype=torch.float64), torch.randn(32, 32, dtype=torch.float64)

    def gradient(rows: slice) -> torch.Tensor:
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    return gradient(slice(0, 16)), gradient(slice(0, 32))


def _estimates(a: torch.Tensor, b: torch.Tensor, k: int, seeds: int):
    """Over sketch seeds: the cosine from the two sketches, the relative error ‖a − b‖ / ‖b‖ from
    the sketch of the difference and the exact ‖b‖ (docs/recording.md §11)."""
    cosines, errors = [], []
    for seed in range(seeds):
        block_signs = signs("g", len(a), k, seed)
        sa, sb = sketch(a, k, block_signs), sketch(b, k, block_signs)
        cosines.append(float(sa @ sb / (sa.norm() * sb.norm())))
        errors.append(float((sa - sb).norm() / b.norm()))
    return torch.tensor(cosines), torch.tensor(errors)


CASES = {
    **{f"random, cosine {c}": c for c in (0.0, 0.5, 0.9, 0.99)},
    "real: half-batch gradient": None,
}


@pytest.mark.parametrize("case", CASES)
def test_the_estimates_are_within_the_bounds_for_k(case):
    """§11: the cosine's standard deviation is (1 − c²)/√k, the relative error's 1/√(2k) of it;
    every estimate lies within 5 of them. Over 300 sketch seeds the measured standard deviations
    are those of the formula to 25 % (the error of a standard deviation from 300 draws is ~4 %)."""
    k, seeds = DEFAULT_K, 300
    if CASES[case] is None:
        a, b = _real_gradients()
    else:
        a, b = _pair(CASES[case], 5_000, torch.Generator().manual_seed(7))
    true_cosine = float(a @ b / (a.norm() * b.norm()))
    true_error = float((a - b).norm() / b.norm())
    cosines, errors = _estimates(a, b, k, seeds)
    cosine_sd, error_sd = (1 - true_cosine**2) / math.sqrt(k), true_error / math.sqrt(2 * k)
    assert float((cosines - true_cosine).abs().max()) <= 5 * cosine_sd
    assert float((errors - true_error).abs().max()) <= 5 * error_sd
    measured = (float((cosines - true_cosine).pow(2).mean().sqrt()),
                float((errors - true_error).pow(2).mean().sqrt()))  # fmt: skip
    assert 0.75 * cosine_sd <= measured[0] <= 1.25 * cosine_sd, (measured, cosine_sd)
    assert 0.75 * error_sd <= measured[1] <= 1.25 * error_sd, (measured, error_sd)
