"""Where a run departs from one device (`gatherlab.check.where`, docs/checking.md §6): the line and
the operation of each pattern of ``tests/cases/departures.py`` at W = 2 and 4, and the words of what
differs, with the numbers the mathematics gives (B = 16/W rows per rank, one device all 16; a
gradient through the own slice only is exactly 1/W of one device's); then the alignment and the
rank's part, on records built by hand.

The expected line is the one the pattern marks ``# departs: <class>`` in its source, found here
by reading the file, not by the code under test."""

from __future__ import annotations

import re
from pathlib import Path

import departures
import pytest
import torch
from helpers import line_of

from gatherlab import check
from gatherlab.check import where
from gatherlab.runs.trace import Op

pytestmark = pytest.mark.slow

SOURCE = Path(departures.__file__)
W = (2, 4)


def marked(name: str) -> str:
    """``departures.py:<line>`` of the line marked ``# departs: name`` (relative to ``tests/``,
    the import path entry the module is found under)."""
    return line_of(departures, f"# departs: {name}")


def located(name: str, steps: int = 0) -> dict[int, tuple[str, str, str, str]]:
    table = check.check_loss(f"departures:{name}", W, steps=steps).table
    rows = table[table["part"] == "all"].set_index("world_size")
    return {w: tuple(rows.loc[w, ["verdict", "cause", "where", "departs"]]) for w in W}


@pytest.mark.parametrize(
    "name, op, words",
    [
        ("OwnBatchStatistic", "mean", "a mean over dim 0 of the rank's {b} rows, where one device "
         "takes all 16"),
        ("SoftmaxWeightedRows", "softmax", "a softmax over dim 0 of the rank's {b} rows, where one "
         "device takes all 16"),
        # after an all_reduce that completes partial sums (compared by their sum over ranks), not
        # that partial sum
        ("EntropyOwnMean", "mean", "a mean over dim 0 of the rank's {b} rows, where one device "
         "takes all 16"),
        # past a departure a later result heals: the Sinkhorn's intermediates are W times one
        # device's (divided by the rank's own column count, multiplied back at the end), and the
        # cross-entropy's mean is on the loss's path through an in-place ``loss +=``
        ("SinkhornMeMax", "mean", "a mean over dim 0 of the rank's {b} rows, where one device "
         "takes all 16"),
    ],
)  # fmt: skip
def test_a_statistic_over_the_ranks_own_rows_is_named_at_its_line(name, op, words):
    found = located(name)
    for world_size in W:
        verdict, cause, at, departs = found[world_size]
        assert (verdict, cause) == ("loss differs", "local_statistic")
        assert at == f"{marked(name)}  {op}"
        assert departs == words.format(b=16 // world_size)


def test_a_buffer_of_per_rank_statistics_names_its_step_line_and_buffer():
    found = located("MeanOfRankStds", steps=3)
    lines = SOURCE.read_text().splitlines()
    update = next(i for i, text in enumerate(lines, 1) if text.strip().startswith("self.scale ="))
    for world_size in W:
        verdict, _, at, departs = found[world_size]
        assert verdict == "diverges"
        assert at == f"{marked('MeanOfRankStds')}  std"
        assert departs == (
            "step 1 is the first whose loss leaves one device's; at step 0: a std over dim 0 of "
            f"the rank's {32 // world_size} rows, where one device takes all 32, from which add at "
            f"departures.py:{update} updates the buffer scale"
        )


def test_a_gather_whose_backward_keeps_the_own_slice_is_named_with_its_factor():
    found = located("OwnSliceGatherGlobal")
    for world_size in W:
        verdict, _, at, departs = found[world_size]
        assert verdict == "1/W"
        assert at == f"{marked('OwnSliceGatherGlobal')}  _OwnSliceGather.backward"
        ratio = re.search(r"1/W of one device's \(norm ratio ([0-9.]+), cosine 1\)", departs)
        assert ratio is not None, departs
        assert float(ratio.group(1)) == pytest.approx(1 / world_size, rel=1e-6)


def test_a_local_loss_behind_an_own_slice_backward_is_named_at_that_backward():
    # the sum over the rank's pairs is its part of one device's sum (the division by the rank's
    # rows follows): the exact loss holds the same line and is exact; before, that sum was named
    assert {v for v, *_ in located("SigmoidExact").values()} == {"exact"}
    found = located("SigmoidOwnSlice")
    for world_size in W:
        verdict, _, at, departs = found[world_size]
        assert verdict == "biased"
        assert at == f"{marked('OwnSliceGatherGlobal')}  _OwnSliceGather.backward"  # its line
        assert departs.endswith("_OwnSliceGather.backward at " + marked("OwnSliceGatherGlobal")
                                + " produces it")  # fmt: skip


def test_an_in_place_all_reduce_of_partial_sums_is_named_for_its_unsummed_gradient():
    # the column sums are each rank's part of one device's (their sum over ranks, not their mean):
    # the forward agrees; autograd passes the regulariser's gradient back through the all_reduce
    # unsummed, so that term's gradient is exactly 1/W of one device's
    found = located("EntropyRegularised")
    total = line_of(departures, "total = probs.sum(dim=0)")
    for world_size in W:
        verdict, _, at, departs = found[world_size]
        assert verdict == "biased"
        assert at == f"{marked('EntropyRegularised')}  all_reduce"
        ratio = re.search(rf"the gradient of the result of sum at {total} on the ranks is 1/W of "
                          r"one device's \(norm ratio ([0-9.]+), cosine 1\)", departs)  # fmt: skip
        assert ratio is not None, departs
        assert float(ratio.group(1)) == pytest.approx(1 / world_size, rel=1e-6)
        assert "passes back through it unsummed" in departs and "without gradient" not in departs


def test_a_queue_written_in_place_with_the_ranks_own_keys_is_named_at_the_write():
    # the write returns nothing; it is compared as the buffer it writes. Before, where was empty
    found = located("QueueOwnKeys", steps=3)
    for world_size in W:
        verdict, _, at, departs = found[world_size]
        assert verdict == "diverges"
        assert at == f"{marked('QueueOwnKeys')}  __setitem__"
        assert departs.startswith("step 1 is the first whose loss leaves one device's; at step 0: "
                                  "a __setitem__ (it writes the buffer queue) given the rank's "
                                  f"{16 // world_size} rows of an input where one device is given "
                                  "all 16: its result on rank 0 is not its part")  # fmt: skip


def test_a_gather_without_gradient_under_a_group_is_named_against_the_plain_run():
    found = located("NoGradGatherNegatives")
    for world_size in W:
        verdict, _, at, departs = found[world_size]
        assert verdict == "biased"  # the plain run passes the keys their gradient; the ranks do not
        assert at == f"{marked('NoGradGatherNegatives')}  all_gather"
        assert departs.endswith(
            f"all_gather at {marked('NoGradGatherNegatives')} runs without gradient, so what it "
            "passes on carries no gradient back"
        )


def test_a_gather_of_detached_rows_is_named_at_the_detach_not_at_the_list_it_fills():
    """A user's gather (a plain all_gather of ``z.detach()`` into ``empty_like`` tensors, its own
    rows put back) was named at the ``empty_like``, whose backward it said produced the
    gradient; the ``detach`` on the all_gather's line is where the gradient is cut."""
    found = located("DetachedGatherLocal")
    for world_size in W:
        verdict, _, at, departs = found[world_size]
        assert verdict == "biased"
        assert at == f"{marked('DetachedGatherLocal')}  detach", departs
        assert departs.endswith(
            f"detach at {marked('DetachedGatherLocal')} runs without "
            "gradient, so what it passes on carries no gradient back"
        )


# --- the alignment and the rank's part, on records built by hand ---------------------------------


def op(index: int, name: str, line: int, value=None, inputs=()) -> Op:
    return Op(index, name, f"x.py:{line}", value, tuple(inputs))


def test_alignment_pairs_the_same_calls_around_an_operation_only_the_ranks_run():
    one = [op(0, "input", 0), op(1, "torch.mean", 3), op(2, "Tensor.sum", 4)]
    ranks = [op(0, "input", 0), op(1, "torch.distributed.all_gather", 2), op(2, "torch.mean", 3),
             op(3, "Tensor.sum", 4)]  # fmt: skip
    assert where.align(one, ranks) == {0: 0, 1: 2, 2: 3}


def test_the_ranks_part_is_its_block_or_its_rows_of_each_view():
    # 16 rows on one device, 2 ranks of 8: rank 1 holds rows 8..15
    assert where.part_of((16, 4), (8, 4), 2, 1, 16) == [(slice(8, 16), slice(None))]
    # two views of 16 concatenated (32 rows): rank 1 holds rows 8..15 and 24..31
    (block, rows) = where.part_of((32, 4), (16, 4), 2, 1, 16)
    assert block == (slice(16, 32), slice(None))
    assert rows[0].tolist() == [*range(8, 16), *range(24, 32)]
    assert where.part_of((16, 4), (5, 4), 2, 0, 16) == []


def test_a_rank_whose_rows_equal_one_devices_rows_agrees_and_other_rows_depart():
    values = torch.arange(32.0, dtype=torch.float64).reshape(16, 2)
    one = [op(0, "input", 0, values), op(1, "torch.sin", 1, values.sin(), [0])]
    ranks = [
        [
            op(0, "input", 0, values[r * 8 : (r + 1) * 8]),
            op(1, "torch.sin", 1, values[r * 8 : (r + 1) * 8].sin(), [0]),
        ]
        for r in range(2)
    ]
    assert where.departure(one, ranks, 2, 16, 1e-10) is where.NOWHERE  # no line, and why
    ranks[1][1] = op(1, "torch.sin", 1, values[:8].sin(), [0])  # rank 1 computes rank 0's rows
    found = where.departure(one, ranks, 2, 16, 1e-10)
    assert found is not None and found.where == "x.py:1  sin" and found.kind == "rank"


def test_a_loss_whose_gradient_departs_says_what_scales_it_comes_after_the_trace():
    """A loss divided by W after the traced loss (a user's BERT job) was named at the loss's own
    line without saying that the division is further on, outside the trace."""
    import dataclasses

    values = torch.arange(32.0, dtype=torch.float64).reshape(16, 2)
    loss = torch.tensor(3.0, dtype=torch.float64)

    def returned(gradient: float) -> Op:
        traced = op(1, "torch.nn.functional.mse_loss", 96, loss, [0])
        return dataclasses.replace(traced, returned=True,
                                   grad=torch.tensor(gradient, dtype=torch.float64))  # fmt: skip

    one = [op(0, "input", 0, values), returned(1.0)]
    ranks = [[op(0, "input", 0, values[r * 8 : (r + 1) * 8]), returned(0.5)] for r in range(2)]
    found = where.departure(one, ranks, 2, 16, 1e-10)
    assert found.where == "x.py:96  mse_loss", found
    assert found.words.startswith("the gradient of the result of mse_loss at x.py:96 on the "
                                  "ranks is 1/W of one device's"), found.words  # fmt: skip
    assert (
        "it is the loss the traced code returned, so what changes its gradient comes after "
        "it, outside the trace"
    ) in found.words, found.words
