"""Collectives compared across ranks before they run (`gatherlab.ranks.watched`,
docs/checking.md §10, "Collectives that differ"): each pattern of ``examples/collective_cases.py``
at W = 2 and 4 ends its W with the line that names every rank's call, found here by reading the
source's ``# enters:`` marks; a rank that raised is named by its own error, one that hangs after the
collective timeout, one killed by a signal by the signal and its last line on stderr; the line
itself (`disagreement`) on entries built by hand; bad timeouts refused in one line.

Each pattern runs with a collective timeout of 10 minutes (the suite's own per-test limit is 2):
a line that names the calls cannot have come from a timeout."""

from __future__ import annotations

import collective_cases
import pytest
import torch
import torch.distributed as dist
from helpers import line_of

from gatherlab import check
from gatherlab.check import CheckError
from gatherlab.check.__main__ import main
from gatherlab.core import terms
from gatherlab.ranks import pool, watched
from gatherlab.ranks.watched import Ended, Entered, disagreement

W = (2, 4)
NEVER = 600.0  # seconds: a timeout no test of the suite can reach
ROWS = 16  # the check's global batch (rows per rank: 16/W), 16 features


def marked(text: str) -> str:
    return line_of(collective_cases, f"# enters: {text}")


def errors(name: str, timeout_s: float = NEVER) -> dict[int, str]:
    table = check.check_loss(f"collective_cases:{name}", W, collective_timeout_s=timeout_s).table
    assert (table["verdict"] == terms.FAILED).all(), table
    return dict(zip(table["world_size"], table["error"], strict=True))


def others(size: int) -> str:
    return "rank 1" if size == 2 else "ranks " + ", ".join(map(str, range(1, size)))


def test_an_extra_collective_on_rank_zero_is_named_against_the_peers_next_one():
    found = errors("ExtraAllReduceOnRankZero")
    for size in W:
        rows = ROWS // size
        assert found[size] == (
            f"collectives differ: rank 0 entered all_reduce at "
            f"{marked('ExtraAllReduceOnRankZero (rank 0)')} ((1,) float64); {others(size)} "
            f"entered all_gather at {marked('ExtraAllReduceOnRankZero (all)')} "
            f"(({size}, {rows}, 16) float64)"
        )


def test_a_gather_on_rank_zero_against_a_reduce_elsewhere_names_both():
    found = errors("GatherOnZeroReduceElsewhere")
    for size in W:
        rows = ROWS // size
        assert found[size] == (
            f"collectives differ: rank 0 entered all_gather at "
            f"{marked('GatherOnZeroReduceElsewhere (rank 0)')} (({size}, {rows}, 16) float64); "
            f"{others(size)} entered all_reduce at {marked('GatherOnZeroReduceElsewhere (others)')}"
            f" (({rows}, 16) float64)"
        )


def test_a_rank_that_returns_early_is_met_by_its_next_collective_ddps():
    """The last rank skips the loss's all_reduce; its next collective is DDP's all-reduce of the
    gradients (the check's MLP 8 → 64 → 16 and nothing else trainable: 8·64 + 64 + 64·16 + 16 =
    1616 float64 in one bucket)."""
    found = errors("LastRankReturnsEarly")
    for size in W:
        peers = "rank 0" if size == 2 else "ranks " + ", ".join(map(str, range(size - 1)))
        assert found[size] == (
            f"collectives differ: {peers} entered all_reduce at "
            f"{marked('the peers of the last rank')} (() float64); rank {size - 1} entered "
            "all_reduce of DDP's gradient bucket ((1616,) float64)"
        )


def test_a_rank_that_raises_is_named_by_its_own_error_not_by_its_waiting_peers():
    found = errors("LastRankRaises")
    for size in W:
        assert found[size] == f"rank {size - 1}: ValueError: the last rank stops here"


def test_an_error_from_inside_a_collective_closes_the_pool_and_the_next_check_is_judged():
    """A job's error raised inside torch.distributed (a collective that timed out, or whose
    peer left, can leave half an operation in the group's transport: a user's correct loss read
    `failed`, "Connection closed by peer", after a loss whose rank 0 alone all-reduced) closes
    the pool, where an error of the job's own code before any collective keeps it; the next check
    at that W is judged on a pool that works."""
    kept = pool.pool(2)
    errors("LastRankRaises")
    assert pool.pool(2) is kept  # every rank answered, none from inside a collective
    found = errors("CollectiveRaises")
    assert set(found) == set(W) and pool.pool(2) is not kept
    table = check.check_loss("gatherlab.losses:NTXentLoss", (2,), gather="fixed").table
    assert list(table["verdict"]) == ["exact"], table


def test_ranks_that_all_raise_are_named_by_the_lowest_whichever_answers_first():
    found = errors("EveryRankRaises")
    for size in W:
        assert found[size] == "rank 0: NameError: name 'exists' is not defined (rank 0)"


@pytest.mark.slow
def test_a_rank_that_never_comes_is_named_after_the_collective_timeout():
    found = errors("LastRankSleeps", timeout_s=1.0)
    for size in W:
        assert found[size].endswith(
            f"waited 1 s (the collective timeout) in all_reduce at "
            f"{marked('the peers of the last rank')} (() float64) for rank {size - 1}, which "
            "neither entered it nor ended"
        ), found[size]


@pytest.mark.slow
def test_a_rank_killed_by_a_signal_is_named_by_it_with_its_last_line_on_stderr(capfd):
    found = errors("LastRankAborts")
    for size in W:
        assert found[size] == (
            f"rank {size - 1}: process killed by SIGABRT; its last line on stderr: "
            f"{collective_cases.ABORT_LINE}"
        )
    assert collective_cases.ABORT_LINE in capfd.readouterr().err  # relayed as the rank wrote it


def _gradients_of_ddp() -> torch.Tensor:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    model = watched.visible(torch.nn.parallel.DistributedDataParallel(model.double()))
    torch.manual_seed(1 + dist.get_rank())
    model(torch.randn(8, 8, dtype=torch.float64)).pow(2).sum().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_ddps_all_reduce_seen_by_the_watch_is_its_own_bit_for_bit():
    plain = pool.pool(2).run(_gradients_of_ddp)
    with watched.watching(NEVER):
        seen = pool.pool(2).run(_gradients_of_ddp)
    assert all(torch.equal(a, b) for a, b in zip(plain, seen, strict=True))
    assert not torch.equal(plain[0], torch.zeros_like(plain[0]))


ENTRY = Entered(0, "world", 3, "all_reduce", (4, 16), "float32", "mine.py:17")


@pytest.mark.parametrize(
    ("seen", "line"),
    [
        ({1: Entered(1, "world", 3, "all_reduce", (4, 16), "float32", "mine.py:17")}, None),
        ({1: None}, None),  # not yet told
        (
            {1: Entered(1, "world", 3, "all_reduce", (4, 16), "float64", "mine.py:17")},
            "rank 0 entered all_reduce at mine.py:17 ((4, 16) float32); rank 1 entered "
            "all_reduce at mine.py:17 ((4, 16) float64)",
        ),
        (
            {
                1: Entered(1, "world", 3, "all_reduce", (1,), "float32", "mine.py:19"),
                2: Entered(2, "world", 3, "all_reduce", (1,), "float32", "mine.py:19"),
                3: Ended(3, {"world": 3}, None),
            },
            "rank 0 entered all_reduce at mine.py:17 ((4, 16) float32); ranks 1, 2 entered "
            "all_reduce at mine.py:19 ((1,) float32); rank 3 never entered it and returned",
        ),
        (
            {1: Ended(1, {"world": 1}, "KeyError: 'x'")},
            "rank 0 entered all_reduce at mine.py:17 ((4, 16) float32); rank 1 raised before "
            "it: KeyError: 'x'",
        ),
    ],
)
def test_the_line_names_each_call_once_with_its_ranks(seen, line):
    assert disagreement(ENTRY, seen) == line


def test_uneven_splits_may_differ_in_shape_where_torch_allows_it():
    mine = Entered(0, "world", 0, "all_to_all", (2,), "float32", "a.py:1")
    theirs = Entered(1, "world", 0, "all_to_all", (3,), "float32", "a.py:1")
    assert disagreement(mine, {1: theirs}) is None
    other = Entered(1, "world", 0, "all_gather", (2,), "float32", "a.py:1")
    assert disagreement(mine, {1: other}) is not None


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), True, "30"])
def test_a_collective_timeout_that_is_no_positive_number_is_refused_before_any_rank(bad):
    with pytest.raises(CheckError, match=r"^collective_timeout_s=.*allowed: a number of seconds"):
        check.check_loss("gatherlab.losses:NTXentLoss", (2,), gather="fixed",
                         collective_timeout_s=bad)  # fmt: skip


@pytest.mark.parametrize("bad", ["0", "-3", "nan", "inf"])
def test_the_command_refuses_a_bad_collective_timeout_in_one_line(bad, capsys):
    with pytest.raises(SystemExit) as ended:
        main(["gatherlab.losses:NTXentLoss", "--gather", "fixed", "--collective-timeout", bad])
    assert ended.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--collective-timeout" in err[0] and "allowed" in err[0], err


def test_the_same_job_sent_again_is_watched_afresh():
    """A job's watch keys are its own run's: a warm pool sent the same job twice (the same check
    run again) must not read the first run's marks, where each rank had ended after one
    all-reduce, as peers that returned before the second run's second all-reduce."""
    import rank_messages

    ranks = pool.pool(2)
    with watched.watching(NEVER):
        first = ranks.run(rank_messages.one_more_all_reduce_each_time)
        second = ranks.run(rank_messages.one_more_all_reduce_each_time)
    assert first == [2, 2] and second == [4, 4]  # 1 × 2, then (1 × 2) × 2


def test_a_peers_error_passed_on_is_named_by_the_rank_that_raised_it():
    """Rank 2 raises; ranks 0 and 1, waiting for it, pass its error on; rank 3, waiting for rank 0
    in another group, reads rank 0's end with the error it passed on: the job's error is still rank
    2's, not rank 0's."""
    import rank_messages

    with watched.watching(NEVER), pytest.raises(pool.RankError) as raised:
        pool.pool(4).run(rank_messages.raises_on_two_while_three_waits_elsewhere)
    assert (raised.value.rank, raised.value.line) == (2, "ValueError: rank two's own error")
