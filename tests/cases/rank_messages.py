"""Functions that tests/ranks/test_rank_messages.py runs on every rank of a pool: warnings and an
error without a message. Apart from the tests, so that a worker unpickling them imports torch
alone."""

from __future__ import annotations

import contextlib
import io
import warnings

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
