"""The simulated world (``gatherlab.ranks.simworld``) is a model of the collectives, so it is
validated against them: a training run on real gloo ranks and in the simulated world has the same
curve and weights (the gradients of every built-in gather × loss style at W = 2, 4, 8 are compared
in ``test_audit.py``, beside the real audit's own measurements). Then its own guarantees (no hang,
one line for what it cannot run) and the predictions of docs/design.md §9 that the scaling figure
draws."""

from __future__ import annotations

import functools

import pandas as pd
import pytest
import torch
from helpers import compose

from gatherlab import gather
from gatherlab.check import measure
from gatherlab.components.config import ConfigError
from gatherlab.components.factory import Recipe
from gatherlab.lab import audit, scaling, validation
from gatherlab.ranks import simworld, world

pytestmark = pytest.mark.slow

# Same arithmetic on every rank, only the collectives differ (gloo's sums vs the rank-ordered
# sums of the simulated world): a few units in the last place, far below a wrong gradient (≥ 1e-3).
SAME = 1e-12
FLOAT64_BOUND = 1e-10  # docs/design.md §2


@pytest.fixture(scope="module")
def audit_setting():
    """The gradient audit's setting (experiment=gather_audit): 16 Gaussian view pairs, the MLP,
    the local, global and mixed losses."""
    cfg, _ = compose("experiment=gather_audit")
    return audit.audit_inputs(cfg)


@pytest.mark.parametrize("name", ["fixed", "old"])
def test_a_simulated_training_run_has_the_real_runs_curve(audit_setting, name):
    inputs = audit_setting
    loss = inputs.losses["ntxent"].with_gather(gather.get(name))
    batches = [(inputs.view0, inputs.view1), (inputs.view1, inputs.view0)] * 5
    optimizer = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9)
    arguments = (loss, inputs.model_factory, batches, optimizer, 4, 0)
    real = measure.train(*arguments)
    simulated = measure.train(*arguments, simulated=True)
    assert len(real.losses) == 10
    difference = max(abs(a - b) for a, b in zip(real.losses, simulated.losses, strict=True))
    assert difference <= FLOAT64_BOUND
    assert float((real.parameters - simulated.parameters).abs().max()) <= FLOAT64_BOUND
    one_device = measure.train(loss, inputs.model_factory, batches, optimizer, 1, 0)
    off = max(abs(a - b) for a, b in zip(one_device.losses, simulated.losses, strict=True))
    assert (off <= FLOAT64_BOUND) == (name == "fixed"), off


def test_each_rank_knows_its_place():
    def where():
        return world.rank(), world.size()

    assert simworld.run(3, where) == [(0, 3), (1, 3), (2, 3)]
    assert where() == (0, 1)  # outside the world: one device again


def test_a_rank_that_raises_ends_the_world_with_its_rank():
    def fails_on_two():
        if world.rank() == 2:
            raise ValueError("broken")
        return gather.get("fixed")(torch.ones(1, 1))

    with pytest.raises(RuntimeError, match=r"simulated rank 2 of 4: ValueError: broken"):
        simworld.run(4, fails_on_two)


def test_a_rank_that_skips_a_collective_breaks_the_world_instead_of_hanging():
    def rank_one_skips():
        if world.rank() != 1:
            gather.get("fixed")(torch.ones(1, 1))

    with pytest.raises(RuntimeError, match=r"rank 1 returned while others wait at a collective"):
        simworld.run(3, rank_one_skips)


def test_a_gather_without_a_rule_is_refused_in_one_line(audit_setting):
    inputs = audit_setting

    def foreign(tensor):
        return tensor

    cell = {"foreign": inputs.losses["ntxent"].with_gather(foreign)}
    with pytest.raises(ValueError, match=r"cannot be simulated; allowed: a gatherlab.gather"):
        measure.measure_on_ranks(
            cell, inputs.model_factory, inputs.view0, inputs.view1, 2, 0, simulated=True
        )
    native = Recipe(inputs.losses["ntxent"].factory)  # communicates by itself
    with pytest.raises(ValueError, match=r"cannot be simulated"):
        measure.require_simulatable(native)


def test_the_closed_form_predictions_hold_at_every_world_size(tmp_path, capsys):
    """``python -m gatherlab.scaling`` on the audit's batch of 16, real ranks at W = 2 and the
    simulated world at W = 2, 4 and N = 16: g, D + C/W, D and C/W (docs/design.md §9) hold in
    every row but `old` on the local loss, whose prediction is an expectation over partitions."""
    overrides = [
        "global_batch_size=16", "data.num_samples=16", "audit.world_sizes=[2]",
        "audit.simulated_world_sizes=[2,4,16]",
    ]  # fmt: skip
    scaling.main(["--out", str(tmp_path), *overrides])
    assert "written:" in capsys.readouterr().out
    for name in ("audit.csv", "scaling.csv", "scaling.md", "scaling.png", "scaling.pdf"):
        assert (tmp_path / name).stat().st_size > 0
    predicted = pd.read_csv(tmp_path / "scaling.csv")
    assert list(predicted.columns) == list(scaling.COLUMNS)
    assert len(predicted) == 4 * 3 * 4  # gathers × losses × (1 real + 3 simulated sizes)
    exact = predicted[predicted["prediction"] == "exact"]
    with_gradient = exact[exact["norm_ratio"] > 0]
    assert len(exact) == len(predicted) - 4  # all but old on the local loss
    assert (with_gradient["cosine"] - with_gradient["predicted_cosine"]).abs().max() <= SAME
    ratio = with_gradient["norm_ratio"] / with_gradient["predicted_norm_ratio"] - 1
    assert ratio.abs().max() <= SAME
    assert (exact[exact["norm_ratio"] == 0]["predicted_norm_ratio"] == 0).all()
    # not vacuous: the biased cells are far from the 1-device direction
    assert with_gradient["cosine"].min() < 0
    # old on the local loss: an expectation, exact at W = N by construction (C_self is that very
    # measurement); at W = 2, 4 it is checked against real ranks in
    # test_old_on_the_local_loss_is_its_predicted_expectation_on_real_ranks
    expected = predicted[predicted["prediction"] == "expectation"]
    assert sorted(expected["world_size"]) == [2, 2, 4, 16]
    at_n = expected[expected["world_size"] == 16].iloc[0]
    assert abs(at_n["cosine"] - at_n["predicted_cosine"]) <= SAME
    # and a second run into the same directory is refused before anything runs
    with pytest.raises(SystemExit) as refused:
        scaling.main(["--out", str(tmp_path), *overrides])
    assert refused.value.code == 2
    assert "never overwritten" in capsys.readouterr().err


# GF(4) = {0, 1, a, a + 1} as 0, 1, 2, 3: addition is XOR, a² = a + 1.
GF4_TIMES = ((0, 0, 0, 0), (0, 1, 2, 3), (0, 2, 3, 1), (0, 3, 1, 2))


def _balanced_partitions(world_size: int) -> list[torch.Tensor]:
    """Partitions of 16 samples into W slices of B = 16/W, each as the slice of every sample, in
    which every pair of samples shares a slice in the same fraction of the partitions: λ_W =
    (B − 1)/(N − 1), the chance under a uniformly random partition. Averaged over them, anything
    linear in "samples i and j share a slice" takes its expectation over random partitions.

    W = 2: the 15 hyperplanes a·x = 0 of F₂⁴ (sample i's slice: the parity of a·i); a nonzero
    difference i ⊕ j lies in 7 of them, 7/15 = λ_2. W = 4: the 5 parallel classes of the affine
    plane over GF(4), the samples as points (u, v); slope m puts (u, v) in slice v + m·u, the
    vertical class in slice u; two points share exactly one line, 1/5 = 3/15 = λ_4."""
    samples = [(index >> 2, index & 3) for index in range(16)]
    if world_size == 2:
        slices = [[bin(a & index).count("1") % 2 for index in range(16)] for a in range(1, 16)]
    else:
        slices = [[v ^ GF4_TIMES[m][u] for u, v in samples] for m in range(4)]
        slices.append([u for u, _ in samples])
    return [torch.tensor(partition) for partition in slices]


@pytest.mark.parametrize("world_size", [2, 4])
def test_old_on_the_local_loss_is_its_predicted_expectation_on_real_ranks(
    audit_setting, world_size
):
    """The one prediction of docs/design.md §9 that is an expectation (``old``, or any own-slice
    gather, on a local loss: D + C_self + λ_W (C − C_self), with C_self measured in the simulated
    world at W = N) against real gloo ranks, not the simulated world that supplies C_self: the
    real ``old`` gradient averaged over a balanced set of partitions of the batch into slices is
    the expectation exactly, so it must equal the prediction to the order of float64 sums. One
    partition alone (the audit's) is off by far more."""
    inputs, seed = audit_setting, 0
    loss = inputs.losses["ntxent"]
    assert measure.style(loss) == "local"
    old = {"old": loss.with_gather(gather.get("old"))}
    batch = (inputs.model_factory, inputs.view0, inputs.view1)
    predictor = scaling.Predictor(loss, inputs, seed)
    samples = len(inputs.view0)
    assert samples == 16
    predictor.own_sample = measure.measure_on_ranks(old, *batch, samples, seed, simulated=True)[
        "old"
    ].gradient
    predicted, how = predictor.gradient("own", world_size)
    assert how == "expectation"

    partitions = _balanced_partitions(world_size)
    together = sum((p[:, None] == p[None, :]).double() for p in partitions) / len(partitions)
    off_diagonal = together[~torch.eye(samples, dtype=torch.bool)]
    share = (samples // world_size - 1) / (samples - 1)
    assert torch.allclose(off_diagonal, torch.full_like(off_diagonal, share), rtol=0, atol=1e-15)
    measured = []
    for partition in partitions:
        assert torch.bincount(partition).tolist() == [samples // world_size] * world_size
        order = torch.argsort(partition, stable=True)  # rank r holds the samples of slice r
        view0, view1 = inputs.view0[order], inputs.view1[order]
        on_ranks = measure.measure_on_ranks(
            old, inputs.model_factory, view0, view1, world_size, seed
        )
        measured.append(on_ranks["old"].gradient)
    average = torch.stack(measured).mean(dim=0)

    scale = float(predicted.abs().max())
    assert float((average - predicted).abs().max()) <= SAME * scale
    audited = measure.measure_on_ranks(old, *batch, world_size, seed)["old"].gradient
    assert float((audited - predicted).abs().max()) > 1e-6 * scale  # one partition: not it
    assert float((predictor.full - predicted).abs().max()) > 1e-3 * scale  # not `fixed`'s


def test_an_audit_refuses_unsimulatable_gathers_and_bad_sizes_in_the_check():
    cfg, _ = compose("experiment=gather_audit", "audit.simulated_world_sizes=[4]")
    validation.validate(cfg)
    with pytest.raises(ConfigError, match=r"^audit.simulated_world_sizes: gather mine names no "):
        validation.validate_audit_gathers(cfg, {"fixed": gather.get("fixed"), "mine": _identity})
    validation.validate_audit_gathers(cfg, {"fixed": gather.get("fixed")})
    cfg, _ = compose("experiment=gather_audit", "audit.simulated_world_sizes=[3]")
    with pytest.raises(ConfigError, match=r"holds 3; allowed: integers ≥ 2 that divide "):
        validation.validate(cfg)


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
