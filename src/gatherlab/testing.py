"""Assertions for other projects' test suites: does a loss, or a whole training step, train on W
ranks like one device?

    from gatherlab.testing import assert_layout_invariant, assert_training_invariant

    def test_my_loss_is_layout_invariant():
        assert_layout_invariant(MyLoss, world_sizes=(2, 4), temperature=0.1)

    def test_my_module_trains_like_one_device():
        assert_training_invariant(MyModule, make_dataset, world_sizes=(2, 4), steps=20)

    def test_my_job_at_four_ranks_trains_like_one(recordings):  # made with gatherlab.record
        assert_runs_match(recordings / "w1", recordings / "w4")

The check runs on real gloo ranks of gatherlab's warm worker pool (``gatherlab.check``), so a
test session pays the pool's start-up once. A test module that calls it from a script, not from
pytest, needs ``if __name__ == "__main__":`` (the ranks are forked from a fork server). In a
failing pytest test, pytest's traceback leaves out these helpers' own frames
(``__tracebackhide__``): it shows the test's call and the check's diagnosis.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from gatherlab import check
from gatherlab.check import defaults
from gatherlab.check.options import TrainingOptions
from gatherlab.check.table import CheckResult

__all__ = ["assert_layout_invariant", "assert_runs_match", "assert_training_invariant"]


def assert_layout_invariant(
    factory: str | Callable[..., Any],
    world_sizes: Iterable[int] = defaults.WORLD_SIZES,
    **arguments: Any,
) -> CheckResult:
    """`gatherlab.check.check_loss`, failing with its table and diagnosis unless every world size
    trains like one device (`gatherlab.check.trains_like_one_device`); the result when it does.

    Args:
        factory: the loss class or function, or its import path (``module:attribute``).
        world_sizes: the numbers of ranks to check, each an integer ≥ 2 that divides 16.
        **arguments: `gatherlab.check.check_loss`'s keyword arguments: ``options=`` (a
            `gatherlab.check.LossOptions`), any of its fields (``gather=``, ``steps=``,
            ``optim=``, ``seed=``, ``precision=``, …) and the loss's own keyword arguments.

    Returns:
        The check's `gatherlab.check.CheckResult` (its ``table``: one row per world size), every
        verdict ``exact`` or ``loss scaled`` (``exact within bf16``, …, for a loss that cannot
        run in float64, judged in its ``precision``).

    Raises:
        AssertionError: some world size's verdict is neither ``exact`` nor ``loss scaled``; the
            message is `gatherlab.check.explain` of the table.
        gatherlab.check.CheckError: bad input, before any rank runs.

    Example:
        >>> from gatherlab.testing import assert_layout_invariant
        >>> result = assert_layout_invariant(
        ...     "gatherlab.losses:NTXentLoss", (2, 4), gather="fixed", temperature=0.5
        ... )
        >>> result.table["verdict"].tolist()
        ['exact', 'exact']
    """
    __tracebackhide__ = True  # pytest shows the caller's line and the message, not this frame
    result = check.check_loss(factory, world_sizes, **arguments)
    if not check.trains_like_one_device(result):
        raise AssertionError(check.explain(result))
    return result


def assert_training_invariant(
    module: str | Callable[..., Any] | None = None,
    data: str | Callable[..., Any] | None = None,
    world_sizes: Iterable[int] = defaults.WORLD_SIZES,
    *,
    options: TrainingOptions | None = None,
    **arguments: Any,
) -> CheckResult:
    """`gatherlab.check.check_training` of a ``LightningModule`` (or a plain PyTorch step
    ``step=``, or a whole update ``update=``, with ``model=``), failing with its tables and the
    causes it names unless every world size's run without removals trains like one device
    (docs/checking.md §10); the result when it does.

    Args:
        module: the ``LightningModule`` class or factory, or its import path (None with
            ``step=``).
        data: the map-style data set's class or factory, or its import path.
        world_sizes: the numbers of ranks, each an integer ≥ 2 dividing the global batch.
        options: the check's options (`gatherlab.check.TrainingOptions`).
        **arguments: any field of `gatherlab.check.TrainingOptions`, set over ``options``
            (``step=``, ``model=``, ``steps=``, …), each documented there.

    Returns:
        The check's `gatherlab.check.CheckResult`, every run without removals ``exact`` or
        ``loss scaled``.

    Raises:
        AssertionError: some world size does not train like one device; the message is
            `gatherlab.check.explain_training` of the table (the culprits and their fixes).
        gatherlab.check.CheckError: bad input, before any rank runs.

    Example:
        >>> from gatherlab.testing import assert_training_invariant
        >>> result = assert_training_invariant(  # examples/ssl_modules.py: an exact SimCLR
        ...     "ssl_modules:SimCLR", "ssl_modules:GaussianPairs", (2, 4), steps=2
        ... )
        >>> result.table["verdict"].unique().tolist()
        ['exact']
    """
    __tracebackhide__ = True  # pytest shows the caller's line and the message, not this frame
    result = check.check_training(module, data, world_sizes, options=options, **arguments)
    if not check.trains_like_one_device(result):
        raise AssertionError(check.explain_training(result))
    return result


def assert_runs_match(
    reference: str | Path,
    run: str | Path,
    *,
    tolerance: float | None = None,
    floor: str | Path | None = None,
) -> Any:
    """`gatherlab.compare` of two recordings (`gatherlab.record`), failing with its words unless
    the run trains like the reference (docs/contract.md §5): for a CI job that records a short run
    at W = 1 and at W = 4 and compares them.

    Args:
        reference: recording A, the reference (normally the one-device run).
        run: recording B, the run.
        tolerance: as `gatherlab.compare.compare`'s.
        floor: in float32, bf16 or fp16, the floor recording (``GATHERLAB_RECORD_FLOOR``), as
            `gatherlab.compare.compare`'s; without it such recordings are not judged, and fail.

    Returns:
        The `gatherlab.check.recordings.Comparison`, its verdict ``exact``, ``loss scaled`` or
        ``exact within …``.

    Raises:
        AssertionError: B does not train like A (``data differs`` included), or it is ``not
            judged`` (a low precision without ``floor``); the message is the comparison's words:
            the data's difference, the table, the first update and part that depart, the
            diagnosis, or the command that records the floor.
        gatherlab.recording.format.RecordingError: a directory that is no finished recording.
        gatherlab.check.recordings.NotComparable: recordings of different models or settings.
    """
    __tracebackhide__ = True  # pytest shows the caller's line and the message, not this frame
    from gatherlab.check.recordings import compare_recordings  # it writes no files

    comparison = compare_recordings(reference, run, tolerance=tolerance, floor=floor)
    if comparison.status != 0:
        raise AssertionError(comparison.words)
    return comparison
