"""Functions that tests/ranks/test_rank_messages.py and test_watched.py run on every rank of a pool:
warnings, an error without a message, and a job that does more each time it is sent. Apart from
the tests, so that a worker unpickling them imports torch alone."""

from __future__ import annotations

import contextlib
import io
import time
import warnings

import torch
import torch.distributed as dist

MESSAGE = "every rank warns here"


def warn_on_every_rank() -> str:
    """Warn once, and return what the rank printed on its stderr meanwhile."""
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        warnings.warn(MESSAGE, UserWarning, stacklevel=1)
    return printed.getvalue()


def warn_on_rank_one() -> None:
    if dist.get_rank() == 1:
        warnings.warn("only rank one warns", FutureWarning, stacklevel=1)


def bare_assert_on_rank_one() -> None:
    assert dist.get_rank() != 1


def bare_assert(value: object) -> None:
    assert value


_sent = 0  # how many times this rank ran `one_more_all_reduce_each_time`


def one_more_all_reduce_each_time() -> int:
    """All-reduces as many times as this rank has run it (the same job, sent again, does more):
    the second run's collectives are ones the first never entered."""
    global _sent
    _sent += 1
    total = torch.ones(1)
    for _ in range(_sent):
        dist.all_reduce(total)
    return int(total.item())


def raises_on_two_while_three_waits_elsewhere() -> None:
    """Rank 2 raises; ranks 0 and 1 wait for it in an all-reduce over ranks 0-2 and pass its error
    on; rank 3 comes late to an all-reduce with rank 0, which rank 0 never entered: what rank 3
    reads of rank 0 is its end, with the error it passed on."""
    first, other = dist.new_group([0, 1, 2]), dist.new_group([0, 3])
    rank = dist.get_rank()
    if rank == 2:
        raise ValueError("rank two's own error")
    if rank == 3:
        time.sleep(1.0)
        dist.all_reduce(torch.ones(1), group=other)
    else:
        dist.all_reduce(torch.ones(1), group=first)
