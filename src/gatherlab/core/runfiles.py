"""The files every run writes into its directory (docs/contract.md §5), and how they are read back.

Writers (training) and readers (report, results) share this module so that file names and columns
are defined once.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

CURVES = "curves.csv"
SUMMARY = "summary.json"
FINAL_STATE = "final_state.pt"
CURVE_COLUMNS = ("step", "loss", "grad_norm")
SUMMARY_CHOICES = (
    "experiment", "module", "model", "loss", "data", "optim", "gather", "layout", "strategy",
    "launcher", "logger",
)  # fmt: skip
"""The fields of summary.json that name a run: its config groups' choices (docs/contract.md §5)."""
SUMMARY_SIZES = ("devices", "batch_size", "global_batch_size", "precision", "steps", "seed")
"""The fields of summary.json that size a run."""
SUMMARY_OUTCOMES = ("final_loss", "wall_s", "loss_layout_invariant")
"""The fields of summary.json that say what a run gave."""
SUMMARY_COLUMNS = (*SUMMARY_CHOICES, *SUMMARY_SIZES, *SUMMARY_OUTCOMES)
"""The fields of summary.json that describe a run, the first columns of the run table of
``gatherlab.results`` and of ``comparison.csv``: `SUMMARY_CHOICES`, then `SUMMARY_SIZES`, then
`SUMMARY_OUTCOMES`, each in its own order."""
# What a sweep's report and an audit write into their directories.
COMPARISON = "comparison.csv"
AUDIT = "audit.csv"
CHECK = "check.csv"
SCALING = "scaling.csv"


@dataclass(frozen=True)
class Trained:
    """A trained run as the checks compare it, before or instead of its files: the global loss of
    each step (the mean over ranks, docs/design.md §2), the first step's parameter gradient as the
    optimizer got it (after DDP's average; None where it is not kept), and the final parameters,
    flattened in float64 (the same on every rank after DDP); and the parameters DDP holds whose
    gradient its first forward's output does not reach (``outside_forward``, the check's DDP only:
    its reducer waits for them, docs/checking.md §10 "Sharded code")."""

    losses: list[float]
    first_gradient: torch.Tensor | None
    parameters: torch.Tensor
    outside_forward: tuple[str, ...] = ()
    replicas_apart: tuple[tuple[str, str], ...] = ()
    """Parameters replicated over a dimension of a tensor-parallel mesh whose replicas differ
    between its ranks at the end, each with the dimension's name (docs/checking.md §10, "Tensor and
    sequence parallelism")."""
    partial: tuple[tuple[str, str], ...] = ()
    """Parameters whose first gradient is a partial sum over a mesh dimension (a DTensor
    ``Partial(sum)``), each with the dimension's name."""
    held: tuple[tuple[str, tuple[int, ...], bool], ...] = ()
    """The parameters the rank trained, in the order of ``parameters`` (the trainable ones, in
    that order, are ``first_gradient``'s): each one's name (one device's, where the rank holds a
    part of the model: its experts), its shape and whether it trains. Empty where not kept."""
    rank_gradients: tuple[tuple[Any, ...], ...] = ()
    """A run made one device's from its ranks' parts (expert parallelism: each rank holds some of
    one device's parameters): each rank's first gradient as the pieces it holds
    (`gatherlab.core.held.Piece`, one device's names), in rank order. Empty otherwise."""
    copies_apart: tuple[Any, ...] = ()
    """The parameters held by several ranks whose copies ended the run apart (`core.held.Apart`:
    the copies' ranks and names and by how much; a pipeline's tied weights and stage replicas,
    docs/checking.md §10, "Pipeline parallelism"), found from the copies alone."""


def write_curves(run_dir: Path, rows: Iterable[Mapping[str, float]]) -> None:
    """One row per optimizer step. Floats are written with repr, which round-trips exactly."""
    with open(Path(run_dir) / CURVES, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(CURVE_COLUMNS)
        for row in rows:
            writer.writerow(
                [int(row["step"]), repr(float(row["loss"])), repr(float(row["grad_norm"]))]
            )


def read_curves(run_dir: Path) -> dict[str, list[float]]:
    """The columns of ``curves.csv`` as lists (``step`` as ints)."""
    columns: dict[str, list[float]] = {name: [] for name in CURVE_COLUMNS}
    with open(Path(run_dir) / CURVES, newline="") as file:
        for row in csv.DictReader(file):
            columns["step"].append(int(row["step"]))
            columns["loss"].append(float(row["loss"]))
            columns["grad_norm"].append(float(row["grad_norm"]))
    return columns


def write_table(table: Any, path: Path) -> None:
    """A pandas table as CSV, floats with 17 significant digits (they round-trip exactly)."""
    table.to_csv(path, index=False, float_format="%.17g")


def write_final_state(run_dir: Path, state_dict: Mapping[str, torch.Tensor]) -> None:
    torch.save(
        {key: value.detach().cpu() for key, value in state_dict.items()},
        Path(run_dir) / FINAL_STATE,
    )


def read_final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(Path(run_dir) / FINAL_STATE, map_location="cpu", weights_only=True)


def package_versions() -> dict[str, str]:
    """The versions that decide a run's numbers, saved with every run."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for package in ("gatherlab", "torch", "lightning", "hydra-core", "omegaconf", "numpy"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    return found


def write_summary(run_dir: Path, summary: Mapping[str, Any]) -> None:
    with open(Path(run_dir) / SUMMARY, "w") as file:
        json.dump(dict(summary), file, indent=2, sort_keys=True)
        file.write("\n")


def read_summary(run_dir: Path) -> dict[str, Any]:
    with open(Path(run_dir) / SUMMARY) as file:
        return json.load(file)


class RunFinished(ValueError):
    """The directory holds a finished run (its summary): a run is never overwritten."""


def refuse_finished(run_dir: Path) -> None:
    """``RunFinished`` when ``run_dir`` holds a finished run (its summary). The command line
    checks it before Hydra writes into the directory, so that every rank torchrun or SLURM
    started refuses in the same one line, and a job again before it trains."""
    if (Path(run_dir) / SUMMARY).exists():
        raise RunFinished(
            f"run directory {run_dir} already holds a finished run; it is never overwritten"
        )


def not_a_directory(out: Path) -> Path | None:
    """The nearest of ``out`` and its parents that exists and is no directory (a file where a
    command would write its directory), None where each that exists is one."""
    for path in (Path(out), *Path(out).parents):
        if path.exists():
            return None if path.is_dir() else path
    return None


LOCK = ".running"


class DirectoryInUse(RuntimeError):
    """Another live process is writing a run into this directory."""


@contextlib.contextmanager
def claimed(run_dir: Path) -> Iterator[None]:
    """Hold ``run_dir`` for this process while a run writes into it: two runs never share a
    directory, even when they start in the same microsecond. A lock left by a process that no
    longer exists is taken over."""
    lock = Path(run_dir) / LOCK
    while True:
        try:
            descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            break
        except FileExistsError:
            owner = _lock_owner(lock)
            if owner is not None and _alive(owner):
                message = f"run directory {run_dir} is in use by process {owner}"
                raise DirectoryInUse(message) from None
            lock.unlink(missing_ok=True)
    os.write(descriptor, str(os.getpid()).encode())
    os.close(descriptor)
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def _lock_owner(lock: Path) -> int | None:
    try:
        return int(lock.read_text())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_complete(run_dir: Path) -> bool:
    """A run that finished: its summary says so (older summaries without a status count)."""
    try:
        return read_summary(run_dir).get("status", "ok") == "ok"
    except (OSError, ValueError):
        return False


def set_aside_failed(run_dir: Path) -> None:
    """Rename an incomplete run's summary to ``summary.failed-<k>.json`` before it runs again."""
    summary = Path(run_dir) / SUMMARY
    if summary.exists():
        attempt = 1 + len(list(Path(run_dir).glob("summary.failed-*.json")))
        summary.rename(Path(run_dir) / f"summary.failed-{attempt}.json")


def find_runs(directory: Path) -> list[Path]:
    """Every run directory below ``directory`` (one holding a summary), in a stable order."""
    runs = {path.parent for path in Path(directory).rglob(SUMMARY)}
    return sorted(
        runs, key=lambda path: [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.parts]
    )


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table: every table gatherlab writes (``*.md``) or prints comes from here."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
