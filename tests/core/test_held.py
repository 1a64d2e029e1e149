"""One device's parameters from the pieces ranks hold (gatherlab.core.held): the vector in one
device's order, the copies that differ named from the copies alone, and the pieces that make no
one-device model refused in one line. No process group: the pieces are made here."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gatherlab.core import held


class TiedLM(nn.Module):
    """An embedding, a layer and a head tied to the embedding (one parameter, two names)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.layer = nn.Linear(3, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight


def _one_device() -> tuple[TiedLM, list, dict[str, str]]:
    torch.manual_seed(0)
    model = TiedLM().double()
    names = held.aliases(model.named_parameters(remove_duplicate=False))
    return model, held.order_of(model.named_parameters()), names


def test_a_tied_weight_s_second_name_is_an_alias_of_its_first():
    _, order, names = _one_device()
    assert names == {"emb.weight": "emb.weight", "layer.weight": "layer.weight",
                     "layer.bias": "layer.bias", "head.weight": "emb.weight"}  # fmt: skip
    assert [name for name, _ in order] == ["emb.weight", "layer.weight", "layer.bias"]


def test_two_stages_pieces_make_one_device_s_vector_and_agreeing_copies_are_not_apart():
    model, order, names = _one_device()
    state = dict(model.named_parameters(remove_duplicate=False))
    # stage 0 holds the embedding and the layer, stage 1 the head: a copy of the embedding
    pieces = [held.Piece(1, "head.weight", state["emb.weight"].clone()),
              held.Piece(0, "emb.weight", state["emb.weight"]),
              held.Piece(0, "layer.weight", state["layer.weight"]),
              held.Piece(0, "layer.bias", state["layer.bias"])]  # fmt: skip
    expected = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(held.assemble(order, pieces, names), expected)
    assert held.copies_apart(pieces, names) == []


def test_copies_that_drift_apart_are_named_with_their_ranks_and_the_first_holder_is_taken():
    model, order, names = _one_device()
    state = dict(model.named_parameters(remove_duplicate=False))
    drifted = state["emb.weight"].detach() + 0.5  # the head's copy stepped with its own gradient
    pieces = [held.Piece(0, "emb.weight", state["emb.weight"]),
              held.Piece(0, "layer.weight", state["layer.weight"]),
              held.Piece(0, "layer.bias", state["layer.bias"]),
              held.Piece(1, "head.weight", drifted)]  # fmt: skip
    (apart,) = held.copies_apart(pieces, names, of="weights at the run's end")
    largest = float(state["emb.weight"].detach().abs().max())
    assert apart.name == "emb.weight" and apart.tied
    assert apart.copies == ((0, "emb.weight"), (1, "head.weight"))
    assert apart.difference == pytest.approx(0.5 / largest, rel=1e-12)
    assert apart.words() == (
        f"emb.weight on rank 0 and head.weight on rank 1, copies of one device's emb.weight, "
        f"whose weights at the run's end differ by {0.5 / largest:.2g} (max relative difference)"
    )
    vector = held.assemble(order, pieces, names)
    assert torch.equal(vector[:15], state["emb.weight"].detach().reshape(-1))  # rank 0's copy
    # replicas of one stage under one name (data-parallel copies) are not tied
    replicas = [
        held.Piece(0, "layer.bias", torch.zeros(3)),
        held.Piece(2, "layer.bias", torch.ones(3)),
    ]
    (apart,) = held.copies_apart(replicas, names)
    assert not apart.tied and apart.copies == ((0, "layer.bias"), (2, "layer.bias"))
    # many copies apart (a stage's replicas unreduced): three named, the rest counted
    words = [f"p{i} on rank 0 and p{i} on rank 2 differ" for i in range(73)]
    assert held.listed(words) == "; ".join(words[:3]) + "; and 70 more parameters' copies"
    assert held.listed(words[:3]) == "; ".join(words[:3])


def test_blocks_of_rows_fill_one_parameter_and_a_missing_row_is_named():
    experts = torch.arange(12.0).reshape(4, 3)  # 4 experts' rows, 2 on each of 2 ranks
    order = [("experts", (4, 3))]
    pieces = [held.Piece(1, "experts", experts[2:], start=2),
              held.Piece(0, "experts", experts[:2], start=0)]  # fmt: skip
    assert torch.equal(held.assemble(order, pieces), experts.double().reshape(-1))
    with pytest.raises(held.HeldError, match=r"^no rank holds row 2 of experts \(shape \(4, 3\)\)"):
        held.assemble(order, pieces[1:])


@pytest.mark.parametrize(
    ("pieces", "line"),
    [
        ([held.Piece(0, "module.layer.bias", torch.zeros(3))],
         "rank 0 holds module.layer.bias, which one device's model does not have; allowed: one "
         "device's names (emb.weight, layer.weight, layer.bias)"),
        ([held.Piece(1, "layer.bias", torch.zeros(4))],
         "rank 1 holds layer.bias of shape (4,); allowed: one device's shape (3,)"),
        ([held.Piece(0, "emb.weight", torch.zeros(5, 3))],
         "no rank holds layer.weight (shape (3, 3)) of one device's model; allowed: a split whose "
         "stages hold every parameter"),
    ],
    ids=["renamed", "reshaped", "missing"],
)  # fmt: skip
def test_pieces_that_make_no_one_device_model_are_one_line(pieces, line):
    _, order, names = _one_device()
    with pytest.raises(held.HeldError) as raised:
        held.assemble(order, pieces, names)
    assert str(raised.value) == line


def test_a_rank_s_flat_vector_is_cut_into_its_named_pieces():
    _, order, names = _one_device()
    flat = torch.arange(27.0)  # emb.weight (5, 3), layer.weight (3, 3), layer.bias (3,)
    cut = held.pieces_of(1, order, flat)
    assert [(p.rank, p.name, tuple(p.value.shape)) for p in cut] == [
        (1, "emb.weight", (5, 3)),
        (1, "layer.weight", (3, 3)),
        (1, "layer.bias", (3,)),
    ]
    assert torch.equal(held.assemble(order, cut, names), flat.double())
    with pytest.raises(held.HeldError, match="rank 1's vector has 26 values where its 3"):
        held.pieces_of(1, order, flat[:-1])
