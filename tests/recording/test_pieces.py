"""The recorder's side of ranks that hold different parameters (`gatherlab.recording.pieces`,
docs/recording.md §11 "Pipeline and expert parallelism"), checked without ranks against what
torch and the sketch's definition give: one device's order of the ranks' parameters is the order
``named_parameters`` gives the whole model, and a part's sketch from its pieces is the sketch of
its whole gradient (the sketch is linear). The recorder itself on the ranks, against one device:
the bundled jobs ``pp.py`` and ``ep.py`` in tests/journeys/test_jobs.py. The pipeline's rows cut
in micro-batches: `rows.kept_together`."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from gatherlab.core.parts import part_of
from gatherlab.recording.pieces import Held, merged
from gatherlab.recording.rows import digests, kept, kept_together, sampled
from gatherlab.recording.sketch import signs, sketch


class _LM(nn.Module):
    """A model split as a pipeline splits it: embedding, four blocks, norm, a head tied to the
    embedding."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.layers = nn.ModuleDict({str(i): nn.Linear(4, 4) for i in range(4)})
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


class _MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.router = nn.Linear(4, 4)
        self.experts = nn.ModuleDict({str(e): nn.Linear(4, 4) for e in range(4)})
        self.head = nn.Linear(4, 10)


def _named(model: nn.Module, keep=lambda name: True, copies=()) -> list[tuple[str, tuple]]:
    """A rank's parameters as the recorder names them: its own, then a tied copy under one
    device's name (``copies``: the name it holds → one device's)."""
    held = [(n, tuple(p.shape)) for n, p in model.named_parameters() if keep(n)]
    return held + [(one, tuple(model.get_parameter(n).shape)) for n, one in copies]


def _holds(name: str, rank: int) -> bool:
    """Whether rank ``rank`` of two holds ``name``: every parameter but the experts, and experts
    2·rank and 2·rank + 1."""
    return not name.startswith("experts.") or int(name.split(".")[1]) // 2 == rank


def test_the_ranks_parameters_are_merged_in_one_devices_order():
    """Two stages (the last holding the tied head's weight as emb.weight, at the end of its
    order), two replicas of each (dp 2 × pp 2), and two expert-parallel ranks: merged, one
    device's ``named_parameters`` order."""
    lm = _LM()
    first = _named(lm, lambda n: n.startswith(("emb.", "layers.0.", "layers.1.")))
    last = _named(lm, lambda n: n.startswith(("layers.2.", "layers.3.", "norm.")),
                  copies=[("head.weight", "emb.weight")])  # fmt: skip
    whole = _named(lm)
    copies = [frozenset(), frozenset({"emb.weight"})]
    assert merged([first, last], copies) == whole
    assert merged([first, last, first, last], copies * 2) == whole
    moe = _MoE()
    ranks = [_named(moe, lambda n, r=r: _holds(n, r)) for r in range(2)]
    assert merged(ranks) == _named(moe)


def test_interleaved_stages_and_experts_dealt_in_turn_merge_in_one_devices_order():
    """Interleaved 1F1B's four stages on two ranks (rank 0 stages 0 and 2, rank 1 stages 1 and 3
    with the tied head's copy; and their replicas at dp 2 × pp 2), and four experts dealt in turn
    (rank r experts r and r + 2): merged, one device's ``named_parameters`` order, the numbered
    siblings in their numbers' order whichever rank holds them."""
    lm = _LM()
    first = _named(lm, lambda n: n.startswith(("emb.", "layers.0.", "layers.2.")))
    last = _named(lm, lambda n: n.startswith(("layers.1.", "layers.3.", "norm.")),
                  copies=[("head.weight", "emb.weight")])  # fmt: skip
    copies = [frozenset(), frozenset({"emb.weight"})]
    assert merged([first, last], copies) == _named(lm)
    assert merged([first, last, first, last], copies * 2) == _named(lm)
    moe = _MoE()
    dealt = [_named(moe, lambda n, r=r: not n.startswith("experts.") or int(n[8]) % 2 == r)
             for r in range(2)]  # fmt: skip
    assert merged(dealt) == _named(moe)


def test_a_parts_sketch_from_its_pieces_is_its_whole_gradients_and_copies_are_compared():
    """A part holding a replicated router (both ranks) and two experts per rank: the pieces'
    first copies summed give the sketch of the part's whole gradient (each parameter's signs
    from its name, the formula of recording.md §11), its squared norm the whole's; copies that
    differ make the part unreduced, each replica's view its j-th copies summed; the weights'
    digests drift only where copies differ."""
    moe, k = _MoE(), 7
    ranks = [_named(moe, lambda n, r=r: _holds(n, r)) for r in range(2)]
    order = merged(ranks)
    held = Held(tuple(map(tuple, ranks)), frozenset(n for n, _ in order), tuple(order))
    part = part_of([n for n, _ in order])
    parts = list(dict.fromkeys(part(n) for n, _ in order))
    found = held.pieces(lambda name: part(name))
    assert [(p.part, p.ranks) for p in found] == [("emb", (0, 1)), ("router", (0, 1)),
                                                  ("experts", (0,)), ("experts", (1,)),
                                                  ("head", (0, 1))]  # fmt: skip
    grads = {n: torch.randn(shape, dtype=torch.float64) for n, shape in order}

    def rank_views(values):
        views, squares = [], []
        for rank in range(2):
            view, square = np.zeros((len(found), k)), np.zeros(len(found))
            mine = {n for n, _ in ranks[rank]}
            for u, piece in enumerate(found):
                for name in piece.names:
                    if name in mine:
                        g = values[rank][name].reshape(-1)
                        view[u] += sketch(g, k, signs(name, g.numel(), k, 0)).numpy()
                        square[u] += float(g.square().sum())
            views.append(view)
            squares.append(square)
        return views, squares

    views, squares = rank_views([grads, grads])
    combined, norms, unreduced = Held.combined(found, parts, views, squares)
    for i, name in enumerate(parts):
        members = [n for n, _ in order if part(n) == name]
        whole = torch.cat([grads[n].reshape(-1) for n in members])
        expected = sum(sketch(grads[n].reshape(-1), k, signs(n, grads[n].numel(), k, 0))
                       for n in members)  # fmt: skip
        assert np.allclose(combined[i], expected.numpy(), rtol=0, atol=1e-12), name
        assert abs(norms[name] - float(whole.norm())) <= 1e-12 * float(whole.norm())
    assert unreduced == {}
    apart = {n: g * 3 if n.startswith("router.") else g for n, g in grads.items()}
    views, squares = rank_views([grads, apart])  # rank 1's router gradient not reduced
    _, _, unreduced = Held.combined(found, parts, views, squares)
    assert list(unreduced) == ["router"] and len(unreduced["router"]) == 2
    ratio = np.linalg.norm(unreduced["router"][1]) / np.linalg.norm(unreduced["router"][0])
    assert abs(ratio - 3) <= 1e-12  # each replica's view: its own copy
    digests_ = np.array([[1, 2, 3, 4, 5], [1, 9, 3, 7, 5]], dtype=np.uint64)
    assert Held.drifted(found, parts, digests_) == ["router"]  # experts' pieces are one rank's


def test_token_ids_cut_in_micro_batches_keep_the_positions_of_their_batch():
    """Rows padded to one length, cut in micro-batches of two as a pipeline's schedule cuts
    them: a micro-batch whose two rows are padded alike shows no padding of its own, and alone
    its digests would be of the padded rows; found with the update's other micro-batches, each
    row's digest is the one it has in the whole batch, and in a batch of its own unpadded."""
    pad = 0
    lengths = [5, 5, 8, 3, 6, 7, 4, 8]
    rows = torch.tensor([[1 + (3 * i + j) % 9 for j in range(n)] + [pad] * (8 - n)
                         for i, n in enumerate(lengths)])  # fmt: skip
    whole = digests([sampled(rows, kept(rows))])[0]
    micro = list(rows.split(2))
    assert kept(micro[0]) is None  # two rows of 5 tokens, padded alike: no padding seen alone
    alone = np.concatenate(digests([sampled(m, kept(m)) for m in micro]))
    assert not np.array_equal(alone, whole)
    together = np.concatenate(digests([sampled(m, keep) for m, keep in
                                       zip(micro, kept_together(micro), strict=True)]))  # fmt: skip
    assert np.array_equal(together, whole)
    unpadded = torch.tensor([[1 + (3 * 0 + j) % 9 for j in range(5)]])
    assert digests([sampled(unpadded)])[0][0] == whole[0]


def test_a_tied_models_recording_names_its_tied_weights_and_a_copy_under_its_own_name_is_refused(
    tmp_path,
):
    """One device's recording of a model whose head is tied to its embedding writes the tie
    (``named_parameters(remove_duplicate=False)`` lists the one parameter under both names);
    compared with it, a pipeline's recording that holds the head's copy under its own name is
    refused in one line that gives the ``names=`` to record it under one device's."""
    import gatherlab.record
    from gatherlab.check import recordings
    from gatherlab.recording.format import read

    model = _LM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gatherlab.record(model, optimizer, tmp_path / "one"):
        for _ in range(2):
            optimizer.zero_grad()
            model.head(model.norm(model.emb(torch.tensor([[1, 2, 3]])))).sum().backward()
            optimizer.step()
    one = read(tmp_path / "one")
    assert one.header["tied"] == {"head.weight": "emb.weight"}
    assert [p["name"] for p in one.header["parameters"]].count("emb.weight") == 1
    stage = {"parameters": [*one.header["parameters"],
                            {"name": "head.weight", "shape": [10, 4], "part": "head"}]}  # fmt: skip
    with pytest.raises(recordings.NotComparable) as refused:
        recordings._same_model(one, SimpleNamespace(header=stage))
    assert "which A's model ties to emb.weight" in str(refused.value)
    assert "names={'emb.weight': <its head.weight>}" in str(refused.value)


def test_ranks_holding_different_parameters_beside_a_dtensor_are_refused_alike(tmp_path):
    """Pipeline or expert parallelism beside a DTensor (here on rank 0 alone) is refused in one
    line on every rank, before any update (each rank decides from every rank's parameters: a
    rank that went on would wait for the others at its first collective). On the pool's real
    gloo ranks."""
    from gatherlab.ranks import pool as pools

    refused = pools.pool(2).run(_stage_beside_a_shard, str(tmp_path / "run"))
    assert refused == ["the ranks hold different parameters (pipeline stages or experts) and "
                       "some are DTensors (FSDP2, tensor parallelism): the recorder does not "
                       "combine the two"] * 2  # fmt: skip
    assert not (tmp_path / "run").exists()


def _stage_beside_a_shard(out: str) -> str:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from gatherlab.recording.format import RecordingError
    from gatherlab.recording.recorder import Recorder

    mesh = init_device_mesh("cpu", (2,))
    rank = dist.get_rank()
    model = nn.Module()
    setattr(model, f"stage{rank}", nn.Linear(3, 3))  # each rank its own stage
    if rank == 0:  # and a shard of a parameter beside it
        model.shard = nn.Parameter(DTensor.from_local(torch.zeros(1, 3), mesh, [Shard(0)],
                                                      run_check=False))  # fmt: skip
    try:
        Recorder(model, torch.optim.SGD(model.parameters(), lr=0.1), out)
    except RecordingError as error:
        return str(error).removeprefix("gatherlab.record: ").split(";")[0]
    return "recorded"


def test_a_bad_name_given_on_one_rank_is_refused_on_every_rank(tmp_path):
    """``names=`` differs between a pipeline's ranks (its last stage names the tied copy): a bad
    one on rank 1 alone is refused in its one line on both ranks, before any update, where rank
    0 would otherwise wait for rank 1 at the recorder's first collective."""
    from gatherlab.ranks import pool as pools

    refused = pools.pool(2).run(_named_on_rank_one, str(tmp_path / "run"))
    assert refused == ["names={'emb.weight': ...}: not a tensor the optimizer updates"] * 2
    assert not (tmp_path / "run").exists()


def _named_on_rank_one(out: str) -> str:
    import torch.distributed as dist

    from gatherlab.recording.format import RecordingError
    from gatherlab.recording.recorder import Recorder

    model = nn.Linear(3, 3)
    names = {"emb.weight": torch.zeros(3)} if dist.get_rank() == 1 else {}
    try:
        Recorder(model, torch.optim.SGD(model.parameters(), lr=0.1), out, names=names)
    except RecordingError as error:
        return str(error).split(";")[0]
    return "recorded"
