"""The gradient audit on real gloo groups (W = 2, 4, 8): every cell's measured class (also of
``fixed`` with each backward collective, conf/gather/fixed_{all_reduce,reduce_scatter}.yaml: the
reduce-scatter is what NCCL runs, here on gloo), the same cells in the simulated world (its
validation, docs/design.md §9), and the classifier on gradients whose class is known by
construction."""

from __future__ import annotations

import math

import matplotlib
import numpy as np
import pytest
import torch
from helpers import capture_figures, compose

from gatherlab import gather
from gatherlab.analysis.figures import CLASS_COLORS
from gatherlab.check import measure
from gatherlab.components import config
from gatherlab.core import floor, gradients
from gatherlab.lab import audit

pytestmark = pytest.mark.slow

# The measured class of every cell, stated independently of the gathers' declared predictions. It
# agrees with them (docs/design.md §1) except for `nograd` on the global-loss style: there every
# use of the embeddings goes through the no-grad gather, so no gradient reaches the parameters at
# all ("none"), where "biased (direct uses only)" is predicted; a global NT-Xent has no direct use.
EXPECTED = {
    "fixed": {"ntxent": "exact", "ntxent_global": "exact", "vicreg": "exact"},
    "torch_nn": {"ntxent": "exact", "ntxent_global": "exact", "vicreg": "exact"},
    "functional": {"ntxent": "exact", "ntxent_global": "exact", "vicreg": "exact"},
    "lightning": {"ntxent": "exact", "ntxent_global": "exact", "vicreg": "exact"},
    "old": {"ntxent": "biased", "ntxent_global": "1/W", "vicreg": "biased"},
    "nograd_swap": {"ntxent": "biased", "ntxent_global": "1/W", "vicreg": "biased"},
    "avg": {"ntxent": "biased", "ntxent_global": "1/W", "vicreg": "biased"},
    "nograd": {"ntxent": "biased", "ntxent_global": "none", "vicreg": "biased"},
    "fixed_all_reduce": {"ntxent": "exact", "ntxent_global": "exact", "vicreg": "exact"},
    "fixed_reduce_scatter": {"ntxent": "exact", "ntxent_global": "exact", "vicreg": "exact"},
}
# ``fixed`` with a fixed backward collective, as the audit builds them from their configs; the
# simulated world has one rule (``sum``) for both, so they are measured on real ranks only.
COLLECTIVES = ("fixed_all_reduce", "fixed_reduce_scatter")


WORLD_SIZES = (2, 4, 8)
# The simulated world against real gloo ranks: the same arithmetic on every rank, only the
# collectives differ (gloo's sums vs the rank-ordered sums of the simulated world): a few units in
# the last place, far below a wrong gradient (≥ 1e-3 here).
SAME = 1e-12


@pytest.fixture(scope="module")
def measured():
    """The audit's setting (experiment=gather_audit: 16 Gaussian view pairs, the MLP, the local,
    global and mixed losses): every built-in gather × loss on W = 2, 4, 8 real gloo ranks and in
    the simulated world (``gatherlab.ranks.simworld``), `COLLECTIVES` × loss on the real ranks, and
    each loss on one device."""
    cfg, _ = compose("experiment=gather_audit")
    with config.composed():
        collectives = config.build_gathers(COLLECTIVES, ["experiment=gather_audit"])
    assert collectives == {
        "fixed_all_reduce": gather.Fixed("all_reduce"),
        "fixed_reduce_scatter": gather.Fixed("reduce_scatter"),
    }
    inputs = audit.audit_inputs(cfg)
    batch = (inputs.model_factory, inputs.view0, inputs.view1)
    gathers = {**{name: gather.get(name) for name in gather.NAMES}, **collectives}
    every_cell = {
        (name, loss_name): loss.with_gather(gathers[name])
        for name in gathers
        for loss_name, loss in inputs.losses.items()
    }
    cells = {cell: factory for cell, factory in every_cell.items() if cell[0] not in COLLECTIVES}
    one_device = {
        name: measure.measure(loss.with_gather(None), *batch, seed=0)
        for name, loss in inputs.losses.items()
    }
    real = {w: measure.measure_on_ranks(every_cell, *batch, w, 0) for w in WORLD_SIZES}
    simulated = {
        w: measure.measure_on_ranks(cells, *batch, w, 0, simulated=True) for w in WORLD_SIZES
    }
    styles = {name: measure.style(loss) for name, loss in inputs.losses.items()}
    return cells, one_device, real, simulated, styles, gathers


def _classes(measured) -> dict:
    _, one_device, real, _, _, _ = measured
    return {
        (name, loss, w): gradients.classify(
            real[w][name, loss].gradient, one_device[loss].gradient, w
        )
        for w in WORLD_SIZES
        for name, loss in real[w]
    }


def test_every_cell_has_its_expected_class(measured):
    classes = _classes(measured)
    assert len(classes) == (8 + len(COLLECTIVES)) * 3 * 3
    for (name, loss, w), (measured_class, *_) in classes.items():
        assert measured_class == EXPECTED[name][loss], (name, loss, w)


def test_one_over_w_cells_are_exactly_one_over_w(measured):
    cells = {key: value for key, value in _classes(measured).items() if value[0] == "1/W"}
    assert len(cells) == 3 * 3
    for (_, _, w), (_, _, norm_ratio, _) in cells.items():
        assert abs(norm_ratio - 1 / w) <= 1e-12


def test_both_collectives_of_fixed_give_fixed_s_gradient(measured):
    """On gloo ``fixed`` all-reduces; the reduce-scatter that NCCL runs gives the same gradient."""
    real = measured[2]
    for w in WORLD_SIZES:
        for loss in ("ntxent", "ntxent_global", "vicreg"):
            expected = real[w]["fixed", loss].gradient
            for name in COLLECTIVES:
                measured_gradient = real[w][name, loss].gradient
                scale = float(expected.abs().max())
                assert float((measured_gradient - expected).abs().max()) <= SAME * scale, (name, w)


def test_the_only_contradiction_is_nograd_on_the_global_loss(measured):
    styles, gathers = measured[-2], measured[-1]
    differing = {
        (name, loss)
        for (name, loss, _), (measured_class, *_) in _classes(measured).items()
        if measured_class != measure.predicted(gathers[name], styles[loss])
    }
    assert differing == {("nograd", "ntxent_global")}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_the_simulated_world_has_the_real_ranks_gradient(measured, world_size):
    """docs/design.md §9: the simulated world is validated against real gloo ranks, for every
    built-in gather × loss style."""
    cells, _, real, simulated, styles, _ = measured
    assert set(styles.values()) == {"local", "global", "mixed"}
    for cell in cells:
        a, b = simulated[world_size][cell], real[world_size][cell]
        scale = float(b.gradient.abs().max())
        difference = float((a.gradient - b.gradient).abs().max())
        assert difference <= SAME * scale if scale > 0 else difference == 0, cell
        assert abs(a.loss - b.loss) <= SAME * abs(b.loss), cell


def test_files_are_written(tmp_path, monkeypatch):
    overrides = ["experiment=gather_audit", "audit.world_sizes=[2]", "audit.gathers=[fixed,nograd]"]
    cfg, _ = compose(*overrides)
    figures = capture_figures(monkeypatch)
    table = audit.run(cfg, overrides, tmp_path)
    for name in ("audit.csv", "audit.md", "audit.png", "audit.pdf"):
        assert (tmp_path / name).stat().st_size > 0
    written = (tmp_path / "audit.csv").read_text().splitlines()
    assert written[0].split(",")[: len(measure.COLUMNS)] == list(measure.COLUMNS)
    assert len(written) == 1 + len(table) == 1 + 2 * 3
    assert set(table["world"]) == {"real"}
    assert "⚠ none (predicted biased)" in (tmp_path / "audit.md").read_text()
    losses = ["ntxent", "ntxent_global", "vicreg"]
    _assert_audit_figure_draws(figures["audit"], ["fixed", "nograd"], losses)


def _cell_of(patch) -> tuple[int, int]:
    """The (row, column) of the heat-map cell a rectangle outlines."""
    x, y = patch.get_x() + patch.get_width() / 2, patch.get_y() + patch.get_height() / 2
    return round(y), round(x)


def _assert_audit_figure_draws(figure, gathers: list[str], losses: list[str]) -> None:
    """What the audit figure drew at W = 2, read back from its Figure: each cell's colour is the
    colour of the class `EXPECTED` states for it, its text names that class, and only the one
    contradiction (``nograd`` on the global loss) is outlined and names its prediction."""
    axis = figure.axes[0]
    [image] = axis.get_images()
    assert [label.get_text() for label in axis.get_yticklabels()] == gathers
    columns = [label.get_text().split("\n") for label in axis.get_xticklabels()]
    assert [(column[0], column[2]) for column in columns] == [(loss, "W=2") for loss in losses]
    colours = image.to_rgba(np.asarray(image.get_array()))
    texts = {(round(t.get_position()[1]), round(t.get_position()[0])): t for t in axis.texts}
    texts = {cell: text.get_text() for cell, text in texts.items()}
    outlined = {
        _cell_of(patch)
        for patch in axis.patches
        if isinstance(patch, matplotlib.patches.Rectangle) and not patch.get_fill()
    }
    assert outlined == {(gathers.index("nograd"), losses.index("ntxent_global"))}
    for row, name in enumerate(gathers):
        for column, loss in enumerate(losses):
            expected = EXPECTED[name][loss]
            assert tuple(colours[row, column]) == matplotlib.colors.to_rgba(CLASS_COLORS[expected])
            surprise = (row, column) in outlined
            assert texts[row, column] == expected + ("\npredicted biased" if surprise else "")


def _reference() -> torch.Tensor:
    return torch.randn(50, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda g: g.clone(), "exact"),
        (lambda g: g * (1 + 1e-13), "exact"),
        (lambda g: g / 4, "1/W"),
        (lambda g: g * 4, "W"),
        (lambda g: g / 2, "other"),  # parallel but neither 1/W nor W for W = 4
        (lambda g: g / 4 * (1 + 1e-9), "other"),
        (lambda g: -g / 4, "biased"),  # the opposite direction
        (lambda g: g + 1e-3 * torch.roll(g, 1), "biased"),
        (lambda g: torch.zeros_like(g), "none"),
    ],
)
def test_classify(make, expected):
    reference = _reference()
    assert gradients.classify(make(reference), reference, world_size=4)[0] == expected


@pytest.mark.parametrize(
    ("factor", "world_size", "micro_batches", "expected"),
    [
        (0.25, 2, 2, "1/(W·K)"),
        (4.0, 2, 2, "W·K"),
        (0.5, 2, 2, "1/W = 1/K"),  # W = K: one number, both names
        (2.0, 2, 2, "W = K"),
        (2.0, 1, 2, "K"),  # accumulation on one device: no name with W
        (0.5, 1, 2, "1/K"),
        (0.5, 4, 2, "1/K"),  # also K/W: the name of one axis is kept
        (2.0, 4, 2, "K"),  # also W/K
        (0.25, 4, 2, "1/W"),
        (0.125, 4, 2, "1/(W·K)"),
        (0.5, 2, 4, "1/W"),  # also W/K
        (4.0, 2, 4, "K"),
        (1.5, 3, 2, "W/K"),
        (2 / 3, 3, 2, "K/W"),
        (0.3, 2, 2, "other"),  # parallel at a factor no name gives
        (0.5, 2, 1, "1/W"),  # micro_batches=1: the verdicts of ranks alone
        (2.0, 2, 1, "W"),
        (0.25, 2, 1, "other"),
        (2.0, 1, 1, "other"),
    ],
)
def test_classify_names_a_constant_factor_of_ranks_and_micro_batches(
    factor, world_size, micro_batches, expected
):
    reference = _reference()
    measured, cosine, norm_ratio, _ = gradients.classify(
        reference * factor, reference, world_size, micro_batches
    )
    assert (measured, cosine) == (expected, pytest.approx(1, abs=1e-12))
    assert norm_ratio == pytest.approx(factor, rel=1e-12)


def test_classify_reads_a_vector_of_several_blocks_as_the_whole_vector_formulas_do():
    """``classify``, ``largest_difference`` and ``floor.relative`` read their vectors in blocks
    (``gradients._BLOCK``): their numbers are numpy's whole-vector cosine, norm ratio, max rel.
    error, max |g − g₁| and ‖g − g₁‖ / ‖g₁‖ to rounding, with the one departure in the last,
    partial block, and a NaN in a middle block is the result's NaN."""
    size = 3 * gradients._BLOCK + 5
    generator = torch.Generator().manual_seed(1)
    reference = torch.randn(size, generator=generator, dtype=torch.float64)
    gradient = reference / 2
    gradient[-2] += 10.0  # beyond every |g₁| (at most ~5 in 10^5 normal draws): max |g − g₁| here
    a, b = reference.numpy(), gradient.numpy()
    cosine = np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b))
    norm_ratio = np.linalg.norm(b) / np.linalg.norm(a)
    max_rel_err = np.abs(b - a).max() / np.abs(a).max()
    measured = gradients.classify(gradient, reference, world_size=2)
    assert measured.gradient == "biased"
    assert measured.cosine == pytest.approx(cosine, rel=1e-14, abs=0)
    assert measured.norm_ratio == pytest.approx(norm_ratio, rel=1e-14, abs=0)
    assert measured.max_rel_err == max_rel_err  # peaks are exact: no rounding
    assert gradients.largest_difference(gradient, reference) == np.abs(b - a).max()
    relative = np.linalg.norm(b - a) / np.linalg.norm(a)  # what a floor is measured in
    assert floor.relative(gradient, reference) == pytest.approx(relative, rel=1e-14, abs=0)
    assert gradients.largest_difference(gradient) == np.abs(b).max()
    assert gradients.largest_difference(torch.zeros(0)) == 0.0
    gradient[gradients._BLOCK + 7] = math.nan
    assert math.isnan(gradients.classify(gradient, reference, world_size=2).max_rel_err)
    assert math.isnan(gradients.largest_difference(gradient, reference))


def test_float32_vectors_and_their_parts_are_read_in_float64_as_numpy_reads_them():
    """A precision's vectors kept in it (float32, a check judged in floors alone) are read in
    float64 block by block: ``largest_difference`` is numpy's float64 number of the float32
    values, and ``floor.relative`` and ``part_moments``' sums are the exact sums (`math.fsum` of
    the terms, each exact in float64 here: a float32 product has 48 bits) to within n unit
    roundoffs of float64 for n positive terms, the bound of any order of summation (7e-12 here,
    where float32 arithmetic's sums are ~1e-7 off; the order, and so the last digits, follow the
    CPU's kernels); ``part_moments`` reads each part and the whole in one pass, the whole's
    numbers those of the whole vectors; torch's threads are as they were."""
    size = 2 * gradients._BLOCK + 9
    generator = torch.Generator().manual_seed(2)
    reference = (1 + torch.rand(size, generator=generator)).float()
    gradient = reference.clone()
    gradient[::3] += torch.finfo(torch.float32).eps  # 2⁻²³ where the entry is in [1, 2)
    a, b = reference.double().numpy(), gradient.double().numpy()
    threads = torch.get_num_threads()
    assert gradients.largest_difference(gradient, reference) == np.abs(b - a).max()

    def exact(x, y):  # the sum of x·y, correctly rounded, and its bound for positive terms
        return pytest.approx(math.fsum((x * y).tolist()), rel=len(x) * 2.0**-53, abs=0)

    relative = math.sqrt(exact(b - a, b - a).expected / exact(a, a).expected)
    assert floor.relative(gradient, reference) == pytest.approx(relative, rel=size * 2.0**-53)
    layout = {"first": [(0, 5), (size - 4, size)], "second": [(5, size - 4)]}
    whole, parts = gradients.part_moments(gradient, reference, layout)
    pieces = {"first": np.r_[0:5, size - 4 : size], "second": np.r_[5 : size - 4]}
    for read, rows in [(whole, np.r_[0:size]), *((parts[n], r) for n, r in pieces.items())]:
        x, y = b[rows], a[rows]
        assert read.squares == exact(x, x) and read.reference_squares == exact(y, y)
        assert read.product == exact(x, y) and read.difference_squares == exact(x - y, x - y)
        assert (read.peak, read.reference_peak) == (np.abs(x).max(), np.abs(y).max())
        assert read.departure == np.abs(x - y).max()
    assert torch.get_num_threads() == threads


def test_without_micro_batches_no_name_needs_k():
    """micro_batches=1, every caller before accumulation: 1/W and W only, at each W."""
    for world_size in range(1, 9):
        expected = {"1/W": 1 / world_size, "W": world_size} if world_size > 1 else {}
        assert gradients.factors(world_size) == pytest.approx(expected)
    assert gradients.factor_name(4.0, 2, 2) == "W·K" and gradients.factor_name(3.0, 2, 2) is None


def test_no_gradient_on_either_side_is_none_and_a_gradient_against_none_is_other():
    """Nothing trains on either side: ``none``, never ``exact``; its numbers are undefined."""
    zero = torch.zeros(50, dtype=torch.float64)
    measured, *numbers = gradients.classify(zero, zero.clone(), world_size=4)
    assert measured == "none" and all(math.isnan(number) for number in numbers)
    assert gradients.classify(_reference(), zero, world_size=4)[0] == "other"


def test_a_gather_or_loss_that_declares_nothing_has_no_prediction():
    assert measure.predicted(gather.Fixed(), "local") == "exact"
    assert measure.predicted(gather.Fixed(), None) == "no prediction"
    assert measure.predicted(lambda tensor: tensor, "global") == "no prediction"
    assert measure.style(torch.nn.MSELoss) is None


class MisStyledLoss(torch.nn.Module):
    """A newcomer's loss whose declared style is misspelt (docs/design.md §1 names three)."""

    style = "globl"

    def forward(self, z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
        return (z0 * z1).sum()


def test_a_misspelt_loss_style_is_one_line_before_the_audit_runs():
    """train refused it in one line; the audit raised it from inside its measurement, a
    22-line traceback with exit status 1."""
    from gatherlab.components.config import ConfigError
    from gatherlab.lab import audit

    cfg, _ = compose("experiment=gather_audit", "audit.world_sizes=[2]",
                     "+loss@audit.losses.mine=ntxent",
                     "audit.losses.mine._target_=test_audit.MisStyledLoss",
                     "~audit.losses.mine.temperature")  # fmt: skip
    with pytest.raises(ConfigError) as error:
        audit.audit_inputs(cfg)
    assert str(error.value) == (
        "audit.losses.mine (test_audit.MisStyledLoss): MisStyledLoss declares style='globl'; "
        "allowed: local, global, mixed (docs/design.md §1), or no style"
    )
