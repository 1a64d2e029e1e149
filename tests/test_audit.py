"""The gradient audit on real gloo groups (W = 2 and 4): every cell's measured class, and the
classifier on gradients whose class is known by construction."""

from __future__ import annotations

import pytest
import torch
from helpers import compose

from gatherlab import audit, gather, gradients

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
}


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    overrides = ["experiment=gather_audit", "audit.world_sizes=[2,4]"]
    cfg, _ = compose(*overrides)
    out = tmp_path_factory.mktemp("audit")
    return audit.run(cfg, overrides, out), out


def test_every_cell_has_its_expected_class(table):
    table, _ = table
    assert len(table) == 8 * 3 * 2
    for _, cell in table.iterrows():
        assert cell["measured"] == EXPECTED[cell["gather"]][cell["loss"]], dict(cell)


def test_one_over_w_cells_are_exactly_one_over_w(table):
    table, _ = table
    cells = table[table["measured"] == "1/W"]
    assert len(cells) == 3 * 2
    assert ((cells["norm_ratio"] - 1 / cells["world_size"]).abs() <= 1e-12).all()


def test_the_only_contradiction_is_nograd_on_the_global_loss(table):
    table, _ = table
    differing = table[table["measured"] != table["predicted"]]
    assert set(zip(differing["gather"], differing["loss"], strict=True)) == {
        ("nograd", "ntxent_global")
    }
    assert (differing["norm_ratio"] == 0).all()


def test_files_are_written(table):
    table, out = table
    for name in ("audit.csv", "audit.md", "audit.png", "audit.pdf"):
        assert (out / name).stat().st_size > 0
    written = (out / "audit.csv").read_text().splitlines()
    assert written[0].split(",")[: len(gradients.COLUMNS)] == list(gradients.COLUMNS)
    assert len(written) == 1 + len(table)
    assert "⚠ none (predicted biased)" in (out / "audit.md").read_text()


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


def test_a_gather_or_loss_that_declares_nothing_has_no_prediction():
    assert gradients.predicted(gather.Fixed(), "local") == "exact"
    assert gradients.predicted(gather.Fixed(), None) == "no prediction"
    assert gradients.predicted(lambda tensor: tensor, "global") == "no prediction"
    assert gradients.style(torch.nn.MSELoss) is None
