"""Compare two recordings of a training job (`gatherlab.record`): does run B train like reference A
(normally the one-device run) at every update, and where do they part?

    python -m gatherlab.compare A B [--out DIR] [--tolerance X] [--floor C] [--no-figure]

prints the verdict, the table and the first update and part that depart, then writes
``check.csv``, ``updates.csv`` and the figure ``compare.png``/``compare.pdf`` (not with
``--no-figure``) into ``--out``
(default: beside B, ``<B>-vs-<A's name>/``, `default_out`); exit status 0 when B trains like A, 1
when it does not (``data differs`` included), 2 for bad input (a directory that is no finished
recording, a newer format, recordings of different models or settings), each one line, 3 when
recordings in a low precision have no floor recording (``not judged``). From Python::

    import gatherlab
    comparison = gatherlab.compare("runs/w1", "runs/w4")   # the module is callable
    comparison.verdict, comparison.status, print(comparison.words)

The comparison is `gatherlab.check.recordings`'s, judged by the check's one judge
(docs/contract.md §5, docs/checking.md §6 "Comparing two recordings").
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from gatherlab.check.recordings import Comparison, NotComparable
from gatherlab.check.recordings import compare_recordings as _compare
from gatherlab.core import cli, gradients, runfiles, terms
from gatherlab.recording.format import FINAL, HEADER, Recording, RecordingError

__all__ = [
    "FIGURE", "UPDATES", "Comparison", "NotComparable", "compare", "default_out", "main", "write",
]  # fmt: skip

UPDATES = "updates.csv"
"""The per-update table of a comparison (`gatherlab.check.recordings.UPDATE_COLUMNS`)."""
FIGURE = "compare"
"""The figure of a comparison, ``compare.png`` and ``compare.pdf``."""


def compare(
    reference: str | Path | Recording,
    run: str | Path | Recording,
    *,
    out: str | Path | None = None,
    tolerance: float | None = None,
    floor: str | Path | Recording | None = None,
    figure: bool = True,
) -> Comparison:
    """Recording ``run`` (B) against ``reference`` (A); with ``out``, its files written there
    (`write`).

    Args:
        reference: the reference's recording directory (normally the one-device run), or it read.
        run: the run's recording directory, or it read.
        out: a directory for ``check.csv``, ``updates.csv`` and the figure (None: nothing
            written); one that holds a comparison is refused.
        tolerance: the largest |Δloss| of an update and |Δ| of the final weights' sketches
            (absolute; default the recordings' precision's, 1e-10 in float64).
        floor: in float32, bf16 or fp16, the recording of one device with its forward in row
            blocks (`gatherlab.record.in_row_blocks`): B is judged in floors of its departure
            from A (``exact within bf16``; docs/design.md §2, "Low precision").
        figure: with ``out``, draw the figure too (False: the two tables alone).

    Returns:
        The `Comparison`: ``table`` (``check.csv``'s rows), ``updates`` (``updates.csv``'s),
        ``verdict``, ``status`` (0 trains like A, 1 not), ``words`` (what the command prints),
        ``data`` (the data's difference in words, or None), ``departure`` (the first update and
        part that depart, or None).

    Raises:
        gatherlab.recording.format.RecordingError: a directory that is no finished recording of a
            version this gatherlab reads.
        NotComparable: recordings of different models or of settings that must agree.
        gatherlab.core.runfiles.RunFinished: ``out`` holds a comparison already.
    """
    if out is not None:
        _refuse_finished(Path(out))
    comparison = _compare(reference, run, tolerance=tolerance, floor=floor)
    if out is not None:
        write(comparison, Path(out), figure=figure)
    return comparison


def _refuse_finished(out: Path) -> None:
    """`runfiles.RunFinished` when ``out`` holds a comparison (its ``check.csv``), or where a
    file stands in its place."""
    if (out / runfiles.CHECK).exists():
        raise runfiles.RunFinished(
            f"--out {out} already holds a comparison; it is never overwritten"
        )
    if (file := runfiles.not_a_directory(out)) is not None:
        raise runfiles.RunFinished(
            f"--out {out}: {file} is a file; allowed: a directory, new or empty"
        )


def write(comparison: Comparison, out: Path, *, figure: bool = True) -> list[Path]:
    """Write ``check.csv``, ``updates.csv`` and, with ``figure``, the figure (PNG and PDF) into
    ``out``; the paths written."""
    _refuse_finished(out)
    out.mkdir(parents=True, exist_ok=True)
    runfiles.write_table(comparison.table, out / runfiles.CHECK)
    runfiles.write_table(comparison.updates, out / UPDATES)
    tables = [out / runfiles.CHECK, out / UPDATES]
    if not figure:
        return tables
    # matplotlib is imported to draw, not with the module: importing and drawing are about half
    # of a small comparison's time (docs/performance.md, "Comparing two recordings: its time").
    from gatherlab.analysis import figures

    sizes = [json.loads((Path(path) / HEADER).read_text())["world_size"]
             for path in (comparison.reference, comparison.run)]  # fmt: skip
    floored = "floor" in comparison.updates.columns
    drawn = figures.recordings_figure(
        comparison.updates, f"A (W = {sizes[0]})", f"B (W = {sizes[1]})",
        tolerance=None if floored or comparison.verdict == terms.NOT_JUDGED else
        gradients.FLOAT64_TOLERANCE,
        departure=None if comparison.departure is None else comparison.departure[0],
        threshold=comparison.threshold if floored else None,
    )  # fmt: skip
    return [*tables, *figures.save(drawn, out / FIGURE)]


# The help's description, plain text as a terminal shows it.
DESCRIPTION = (
    "Compare recording B (the run) against recording A (the reference, normally the one-device "
    "run), update by update; print the verdict, then write check.csv, updates.csv and the figure "
    "into --out (beside B by default) and exit 0 when B trains like A, 1 otherwise, 2 for bad "
    "input, 3 not judged (a low precision without --floor)."
)


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose every usage error is one line and exit status 2 (`cli.fail`)."""

    def error(self, message: str) -> NoReturn:
        cli.fail("compare", message)


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}; allowed: a number ≥ 0")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m gatherlab.compare", description=DESCRIPTION,
                     allow_abbrev=False)  # fmt: skip
    parser.add_argument("reference", type=Path, metavar="A",
                        help="recording A, the reference (e.g. the one-device run)")  # fmt: skip
    parser.add_argument("run", type=Path, metavar="B", help="recording B, the run compared with A")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="output directory (default: beside B, <B>-vs-<A's name>)")  # fmt: skip
    parser.add_argument(
        "--tolerance", type=_tolerance, default=None, metavar="X",
        help="largest |Δloss| per update and |Δ| of the final weights' sketches (default: the "
        "precision's, 1e-10 in float64)",
    )  # fmt: skip
    parser.add_argument(
        "--floor", type=Path, default=None, metavar="C",
        help="in float32, bf16 or fp16: recording C of one device with its forward in row blocks "
        "(gatherlab.record.in_row_blocks); B is judged in floors of C's departure from A",
    )  # fmt: skip
    parser.add_argument(
        "--no-figure", dest="figure", action="store_false",
        help="write the two tables alone, not compare.png and compare.pdf (drawing them is "
        "about half of a small comparison's time)",
    )  # fmt: skip
    return parser


def default_out(reference: Path, run: Path, floor: Path | None = None) -> Path:
    """Where a comparison's files go without ``--out``: beside recording B, named after both
    recordings (and the floor's), so that a comparison lives with what it compares and a second
    one of the same recordings finds it: ``runs/four-vs-one``."""
    name = f"{run.name}-vs-{reference.name}" + (f"-floor-{floor.name}" if floor else "")
    return run.parent / name


def _older(out: Path, recordings: Sequence[Path | None]) -> bool:
    """Whether the comparison in ``out`` was written before one of the ``recordings`` it names
    was finished (a run recorded again into the same directory)."""
    written = (out / runfiles.CHECK).stat().st_mtime
    finished = [(path / FINAL).stat().st_mtime for path in recordings
                if path is not None and (path / FINAL).exists()]  # fmt: skip
    return any(time > written for time in finished)


def main(argv: Sequence[str] | None = None) -> None:
    """The command line (``argv``: its arguments, ``sys.argv`` when not given): exit status 0 when
    B trains like A, 1 when it does not, 2 for bad input, 3 when a low precision without a floor
    is not judged, 130 on Ctrl-C. Without ``--out`` the files go beside B (`default_out`), and a
    comparison already there is kept: the verdict is printed, nothing is written. The verdict is
    printed before the files are written (the figure takes as long as the rest)."""
    as_program = argv is None
    args = _parser().parse_args(argv)
    out = args.out or default_out(args.reference, args.run, args.floor)
    kept = args.out is None and (out / runfiles.CHECK).exists()
    try:
        if not kept:  # refused before comparing, as `compare` does
            _refuse_finished(out)
        comparison = compare(args.reference, args.run, tolerance=args.tolerance, floor=args.floor)
        print(comparison.words, flush=True)
        written = [] if kept else write(comparison, out, figure=args.figure)
    except (RecordingError, NotComparable, runfiles.RunFinished) as error:
        cli.fail("compare", cli.first_line(error))
    except KeyboardInterrupt:
        said = "nothing was written" if kept or not out.exists() else f"{out} may be incomplete"
        print(f"gatherlab.compare: interrupted; {said}", file=sys.stderr)
        sys.exit(130)
    if kept and _older(out, [args.reference, args.run, args.floor]):
        print(f"not written: {out}/ holds a comparison of earlier recordings (a recording's "
              f"final.json is newer than its {runfiles.CHECK}): its files are not this verdict's; "
              "remove it, or --out DIR writes this one elsewhere")  # fmt: skip
    elif kept:
        print(f"not written: {out}/ holds a comparison already (never overwritten; --out DIR "
              "writes this one elsewhere)")  # fmt: skip
    else:
        print(f"written: {out}/ ({', '.join(path.name for path in written)})")
    if as_program:  # its files are closed, no thread of its own runs: no teardown
        cli.exit_now(comparison.status)
    sys.exit(comparison.status)


class _CallableModule(types.ModuleType):
    """This module, callable: ``gatherlab.compare(a, b)`` is `compare` (a module's class may be
    replaced by a subclass of ``ModuleType``, Python's data model, "Customizing module attribute
    access")."""

    def __call__(self, *args: Any, **kwargs: Any) -> Comparison:
        return compare(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    main()
