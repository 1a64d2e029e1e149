"""`gatherlab.record` of DTensor-parallel training (`gatherlab.recording.placed`): a tensor- and
sequence-parallel block (`tp_loops`) on real gloo ranks of gatherlab's pool at tp = 2 and at
dp 2 × tp 2 (FSDP2 over tensor parallelism), against the whole gradient's sketch and against one
device's recording; and the placements' index semantics against torch's own splitting
(docs/recording.md §11, "What is recorded")."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tp_loops
import vocab_parallel
from recorded import relative, whole_sketches

from gatherlab.compare import compare
from gatherlab.ranks import pool as pools
from gatherlab.recording import format, placed
from gatherlab.recording.sketch import signs, sketch


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """(W, bug) → (the recording, rank 0's gradient placements), each run once; W 1 is one
    device (no process group, in this process)."""
    base = tmp_path_factory.mktemp("tp")
    made: dict[tuple, tuple[format.Recording, dict[str, str]]] = {}

    def get(world_size: int, bug: str = "") -> tuple[format.Recording, dict[str, str]]:
        if (world_size, bug) not in made:
            out = str(base / f"tp-{bug or 'clean'}-{world_size}")
            if world_size == 1:
                placements = tp_loops.loop(out)
            else:
                placements = pools.pool(world_size).run(tp_loops.loop, out, 2, bug)[0]
            made[world_size, bug] = (format.read(out), placements)
        return made[world_size, bug]

    return get


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_tensor_parallel_block_records_what_one_device_records(recorded, world_size):
    """Each rank sketches its shard's elements at their global positions: the recorded sketch is
    the whole gradient's (1e-12 relative), and the losses, sketches, norms, whole first gradient
    and final weights are one device's; at tp = 2 the norm's gradient is ``Partial(sum)`` and
    the row-parallel weight is cut on dimension 1, at dp 2 × tp 2 FSDP2 adds ``_StridedShard``."""
    one, _ = recorded(1)
    many, placements = recorded(world_size)
    expected = {
        2: {"norm.weight": "(Partial(sum),)", "down.weight": "(Shard(dim=1),)",
            "down.bias": "(Replicate(),)", "up.weight": "(Shard(dim=0),)"},
        4: {"norm.weight": "(Shard(dim=0), Replicate())",
            "down.weight": "(Shard(dim=0), Shard(dim=1))",
            "up.weight": "(_StridedShard(dim=0, sf=2), Shard(dim=0))"},
    }[world_size]  # fmt: skip
    assert {name: placements[name] for name in expected} == expected
    assert all(p["sharded"] == ("Shard" in placements[p["name"]])
               for p in many.header["parameters"])  # fmt: skip
    whole = whole_sketches(many)
    for part in many.parts:
        assert relative(many.updates[0].sketches[part], whole[part]) <= 1e-12, part
    assert many.parts == one.parts == ["norm", "up", "down", "head"]
    for a, b in zip(one.updates, many.updates, strict=True):
        assert abs(a.loss - b.loss) <= 1e-15
        assert [r for rows in b.rows for r in rows] == a.rows[0]
        assert not b.unreduced and not b.drifted
        for part in one.parts:
            assert relative(b.sketches[part], a.sketches[part]) <= 1e-12, (b.index, part)
            assert abs(b.norms[part] / a.norms[part] - 1) <= 1e-12, (b.index, part)
    assert float((many.full_gradient(0) - one.full_gradient(0)).abs().max()) <= 1e-15
    for part in one.parts:
        assert relative(many.weights_sketch[part], one.weights_sketch[part]) <= 1e-12


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_norm_left_out_of_the_plan_is_recorded_unreduced_over_tp(recorded, world_size):
    """The LayerNorm outside the plan, its input the sequence shard: each tp rank's gradient is
    its own positions' sum. At tp = 2 its parameters are plain tensors (the ranks' sketches
    differ, and the ranks drift apart); at dp 2 × tp 2 FSDP2 shards them over dp alone, and the
    two copies along tp differ. The recorded norm is one rank's, not one device's."""
    one, _ = recorded(1)
    many, _ = recorded(world_size, "norm_outside")
    assert len(many.updates) == len(one.updates)
    for b in many.updates:
        assert list(b.unreduced) == ["norm"], b.index
        assert len(b.unreduced["norm"]) == world_size
        assert b.drifted == (["norm"] if world_size == 2 else [])
    assert relative(many.updates[0].sketches["norm"], one.updates[0].sketches["norm"]) > 1e-3
    assert relative(many.updates[0].sketches["up"], one.updates[0].sketches["up"]) <= 1e-12
    # each tp group's sum of its ranks' norm gradients is one device's: the comparison measures
    # it and names the sum over the group as the fix, not DDP's mean
    groups = {2: [[0, 1]], 4: [[0, 1], [2, 3]]}[world_size]
    assert many.row_groups == groups
    for group in groups:
        summed = np.asarray(many.updates[0].unreduced["norm"])[group].sum(axis=0)
        assert relative(summed, one.updates[0].sketches["norm"]) <= 1e-12
    words = " ".join(compare(one, many).words.split())
    assert (f"The sum over each tensor-parallel group's ranks ({', '.join(map(str, groups))}) "
            "of norm's gradients is A's (update 0") in words, words  # fmt: skip


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_one_documented_line_counts_a_tensor_parallel_groups_rows_once(tmp_path, world_size):
    """``gatherlab.record(model, optimizer, DIR, loss=criterion)`` on every rank, every rank's
    model given its group's whole rows (the plan cuts the sequence): the groups are read off the
    parameters' mesh ((0, 1) at tp 2; (0, 1) and (2, 3) at dp 2 × tp 2), each group's rows are
    its first rank's, and the recording is one device's, rows, losses and sketches."""
    tp_loops.loop(str(tmp_path / "one"), given="whole")
    one = format.read(tmp_path / "one")
    pools.pool(world_size).run(tp_loops.loop, str(tmp_path / "many"), 2, "", "whole")
    many = format.read(tmp_path / "many")
    groups = {2: [[0, 1]], 4: [[0, 1], [2, 3]]}[world_size]
    assert many.row_groups == groups
    for a, b in zip(one.updates, many.updates, strict=True):
        assert [rows for rank, rows in enumerate(b.rows) if rank % 2] == [[]] * len(groups)
        assert [r for rows in b.rows for r in rows] == a.rows[0]
        assert abs(a.loss - b.loss) <= 1e-15
        for part in one.parts:
            assert relative(b.sketches[part], a.sketches[part]) <= 1e-12, (b.index, part)


def test_the_one_line_with_each_rank_given_its_own_shard_is_refused_in_one_line(tmp_path):
    """Each tp rank's model given its own sequence shard: the group's ranks give different rows,
    which cannot be counted as its samples: every rank stops at update 0, in one line."""
    refused = pools.pool(2).run(_refused_shards, str(tmp_path / "shards"))
    assert refused[0] == refused[1]
    assert refused[0].startswith("the ranks [0, 1] of one tensor-parallel group (their "
                                 "parameters cut over one mesh dimension) give their model "
                                 "different rows at update 0")  # fmt: skip
    assert "recorder.batch(<the group's whole rows>)" in refused[0]


def _refused_shards(out: str) -> str:
    try:
        tp_loops.loop(out, 2, "", "shards")
    except format.RecordingError as error:
        return str(error)
    return "recorded"


@pytest.mark.parametrize(("length", "factor", "pieces"),
                         [(8, 2, 2), (7, 2, 2), (5, 2, 2), (3, 2, 2), (10, 4, 2), (6, 4, 2),
                          (9, 2, 4), (13, 3, 4), (2, 2, 4)])  # fmt: skip
def test_the_placements_index_semantics_are_torchs(length, factor, pieces):
    """`placed`'s indices for ``Shard`` and ``_StridedShard`` are the elements torch's own
    splitting gives each coordinate (``_split_tensor``, private: read here so that this test
    fails where torch changes the layout that the recorder computes from the placements)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    values = torch.arange(length)
    strided_shard = _StridedShard(0, split_factor=factor)
    strided, _ = strided_shard._split_tensor(values, pieces, with_padding=False)
    plain, _ = Shard(0)._split_tensor(values, pieces, with_padding=False)
    for index in range(pieces):
        assert placed._strided(values, factor, pieces, index).tolist() == strided[index].tolist()
        assert placed._chunk(values, pieces, index).tolist() == plain[index].tolist()


def test_a_scattered_shard_is_sketched_as_its_elements_at_their_positions():
    """The element-by-element path (a shard that is no contiguous range) against the sketch of
    the whole tensor with the other elements zero, and a contiguous shard's offset."""
    whole = torch.randn(6, 9, dtype=torch.float64)
    block_signs = signs("w", whole.numel(), 7, 0)
    rows, columns = torch.arange(1, 5), torch.tensor([0, 2, 3, 8])
    local = whole[rows][:, columns]
    held = placed.Placed(local, (6, 9), (rows, columns), (0,))
    zeroed = torch.zeros_like(whole)
    zeroed[rows.unsqueeze(-1), columns] = local
    assert held.offset() is None
    expected = sketch(zeroed, 7, block_signs)
    assert float((placed.sketched(held, 7, block_signs) - expected).abs().max()) <= 1e-14
    contiguous = placed.Placed(whole[2:4], (6, 9), (torch.arange(2, 4), torch.arange(9)), (0,))
    assert contiguous.offset() == 18


def test_a_tensor_parallel_job_recorded_with_trace_is_recorded_untraced_in_one_line(tmp_path):
    """``trace=True`` on a vocabulary-parallel embedding's ranks stopped a user's job at its first
    forward with a bare AssertionError: the trace's copy of the embedding's pending sum consumed
    the mask its plan's redistribution needs. A trace does not read shards against one device's
    tensors anyway: each rank now records untraced, the job trains on, and the comparison says
    why no line is named. Code that depends on the rank gives the group's replicated weights
    different gradients: said so, without DDP's mean as the fix."""
    runs = {}
    for name, world_size, trace, bug in (("one", 1, True, ""), ("two", 2, True, ""),
                                         ("offset", 2, True, "rank_offset")):  # fmt: skip
        runs[name] = out = str(tmp_path / name)
        if world_size == 1:
            vocab_parallel.loop(out, trace, bug)
        else:
            pools.pool(world_size).run(vocab_parallel.loop, out, trace, bug)
    assert format.read(runs["one"]).trace()[0], "one device's run traced"
    assert format.read(runs["two"]).trace() == [[], []]
    assert format.read(runs["two"]).row_groups == [[0, 1]]
    assert compare(runs["one"], runs["two"]).verdict == "exact"
    offset = compare(runs["one"], runs["offset"])
    assert offset.verdict == "loss differs", offset.words
    assert offset.table.iloc[0]["departs"].startswith(
        "no line named: B was recorded with trace=True and its trace holds no operation"
    )
    assert "tensor-parallel (groups [0, 1]), and the ranks of a group must compute" in " ".join(
        offset.words.split()
    )  # the mean over ranks, DDP's fix, is no fix there: not offered
    assert "the mean over ranks) before the optimizer's step" not in " ".join(offset.words.split())


def test_a_tensor_parallel_jobs_departures_are_told_in_tensor_parallel_terms(recorded):
    """Two users' tensor-parallel bugs, each told what a data-parallel job would be told. A loss
    over each rank's shard of the head's features (``local_head``), recorded untraced: the words
    named trace=True, which a tensor-parallel model's DTensors cannot give; they name the check
    of the step, which reads shards against one device's. Each rank clipping by the norm of its
    own shards (``local_clip``): the fix offered was DDP's mean of the gradient over the ranks;
    the words name the group's sum, losses of their own and clipping by the rank's own norm."""
    compared = compare(recorded(1, "local_head")[0].path, recorded(2, "local_head")[0].path)
    assert compared.verdict == "loss differs", compared.words
    words = " ".join(compared.words.split())
    assert "a trace does not follow a tensor-parallel model's DTensors" in words
    assert "Record both runs with trace=True" not in words
    clipped = compare(recorded(1, "local_clip")[0].path, recorded(2, "local_clip")[0].path)
    assert (clipped.verdict, clipped.table.iloc[0]["cause"]) == ("biased", "unreduced")
    words = " ".join(clipped.words.split())
    assert "as clipping by the norm of the rank's own shards does" in words
    assert "(the mean over ranks) before the optimizer's step" not in words


def test_a_plan_that_cuts_every_parameter_on_dimension_0_counts_its_groups_rows_once(tmp_path):
    """A vocabulary-parallel embedding beside a column-cut head: every parameter a DTensor cut on
    dimension 0, as FSDP2 cuts them, which read as data parallelism: each rank's copy of the
    group's rows counted, and the comparison said `data differs` (16 rows against 8). No module
    is FSDP2's: the cut is tensor parallelism's, the group's rows counted once."""
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    vocab_parallel.loop(one, False, "local_features")
    pools.pool(2).run(vocab_parallel.loop, two, False, "local_features")
    assert format.read(two).row_groups == [[0, 1]]
    compared = compare(one, two)
    assert compared.data is None and compared.verdict == "loss differs", compared.words
