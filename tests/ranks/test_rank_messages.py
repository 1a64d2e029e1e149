"""What the ranks of the warm pools say: each distinct warning once, with the number of ranks
that raised it, and an error without a message named by the user's file and line."""

from __future__ import annotations

import inspect
import os
import queue
import warnings

import pytest
import rank_messages

from gatherlab.core import cli
from gatherlab.ranks import pool as pools


def _line_of(function, text: str) -> int:
    """The line of ``function``'s source that holds ``text`` (independent of the code tested)."""
    lines, first = inspect.getsourcelines(function)
    (index,) = [i for i, line in enumerate(lines) if text in line]
    return first + index


def _place(function, text: str) -> str:
    return f"{os.path.relpath(inspect.getsourcefile(function))}:{_line_of(function, text)}"


def test_a_warning_of_every_rank_is_collected_once_and_no_rank_prints_it():
    with pools.ranks_warnings() as collected:
        printed = pools.pool(2).run(rank_messages.warn_on_every_rank)
        printed += pools.pool(4).run(rank_messages.warn_on_every_rank)
    # What each rank printed on its stderr while it warned, read in the rank: the ranks' stderr is
    # the fork server's, which a capture fixture (capfd) sees only in the test that started it.
    assert printed == [""] * 6
    where = _place(rank_messages.warn_on_every_rank, "warnings.warn(")
    (record,) = collected.records()
    assert (record.category, record.message, record.count, record.total) == (
        UserWarning,
        rank_messages.MESSAGE,
        6,
        6,
    )
    assert (record.filename, record.lineno) == (
        inspect.getsourcefile(rank_messages.warn_on_every_rank),
        _line_of(rank_messages.warn_on_every_rank, "warnings.warn("),
    )
    assert collected.lines() == [
        f"UserWarning: {rank_messages.MESSAGE} ({where}), in 6 of 6 rank jobs"
    ]


def test_a_warning_of_one_rank_counts_one_of_two():
    with pools.ranks_warnings() as collected:
        pools.pool(2).run(rank_messages.warn_on_rank_one)
    (record,) = collected.records()
    assert (record.category, record.count, record.total) == (FutureWarning, 1, 2)


def test_outside_a_collector_each_call_warns_once_in_the_caller():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            pools.pool(2).run(rank_messages.warn_on_every_rank)
    assert [str(w.message) for w in caught] == [f"{rank_messages.MESSAGE} (on 2 of 2 ranks)"] * 2
    assert {w.category for w in caught} == {UserWarning}
    assert {(w.filename, w.lineno) for w in caught} == {
        (
            inspect.getsourcefile(rank_messages.warn_on_every_rank),
            _line_of(rank_messages.warn_on_every_rank, "warnings.warn("),
        )
    }


def test_an_error_without_a_message_names_the_users_line_in_the_rank():
    with pytest.raises(pools.RankError) as raised:
        pools.pool(2).run(rank_messages.bare_assert_on_rank_one)
    where = _place(rank_messages.bare_assert_on_rank_one, "assert ")
    assert (raised.value.rank, raised.value.line) == (1, f"AssertionError at {where}")
    assert str(raised.value).splitlines()[0] == f"rank 1: AssertionError at {where}"
    assert cli.first_line(raised.value) == f"rank 1: AssertionError at {where}"


def test_an_error_without_a_message_names_the_users_line_in_this_process():
    # A bare assert of a test module carries pytest's rewritten message: the helper's has none.
    with pytest.raises(AssertionError) as bare:
        rank_messages.bare_assert(0)
    where = _place(rank_messages.bare_assert, "assert value")
    assert cli.error_line(bare.value) == f"AssertionError at {where}"
    # Raised without a message in the standard library (queue.py): the deepest frame that is the
    # user's is this test's own line.
    with pytest.raises(queue.Empty) as empty:
        line = inspect.currentframe().f_lineno + 1
        queue.Queue().get_nowait()
    where = f"{os.path.relpath(__file__)}:{line}"
    assert cli.error_line(empty.value) == f"Empty at {where}"
    assert cli.error_line(ValueError("first\nsecond")) == "ValueError: first"
    assert cli.error_line(AssertionError()) == "AssertionError"  # never raised: no traceback


def test_a_job_runs_in_the_callers_current_directory_and_names_places_from_it(
    tmp_path, monkeypatch
):
    """The ranks were forked where the pool started; a caller that has since moved gets its own
    directory on every rank (a relative path opens there, a bare assert is named from there)."""
    pools.pool(2).run(os.getcwd)  # the pool is up before the caller moves
    monkeypatch.chdir(tmp_path)
    assert pools.pool(2).run(os.getcwd) == [str(tmp_path)] * 2
    monkeypatch.undo()
    with pytest.raises(pools.RankError) as raised:
        pools.pool(2).run(rank_messages.bare_assert_on_rank_one)
    assert raised.value.line == (
        f"AssertionError at {_place(rank_messages.bare_assert_on_rank_one, 'assert ')}"
    )
