"""The files every run writes into its directory (DESIGN.md §5), and how they are read back.

Writers (training) and readers (report, results) share this module so that file names and columns
are defined once.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

CURVES = "curves.csv"
SUMMARY = "summary.json"
FINAL_STATE = "final_state.pt"
CURVE_COLUMNS = ("step", "loss", "grad_norm")


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


def write_final_state(run_dir: Path, state_dict: Mapping[str, torch.Tensor]) -> None:
    torch.save(
        {key: value.detach().cpu() for key, value in state_dict.items()},
        Path(run_dir) / FINAL_STATE,
    )


def read_final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(Path(run_dir) / FINAL_STATE, map_location="cpu", weights_only=True)


def write_summary(run_dir: Path, summary: Mapping[str, Any]) -> None:
    with open(Path(run_dir) / SUMMARY, "w") as file:
        json.dump(dict(summary), file, indent=2, sort_keys=True)
        file.write("\n")


def read_summary(run_dir: Path) -> dict[str, Any]:
    with open(Path(run_dir) / SUMMARY) as file:
        return json.load(file)


def find_runs(directory: Path) -> list[Path]:
    """Every run directory below ``directory`` (one holding a summary), in a stable order."""
    runs = {path.parent for path in Path(directory).rglob(SUMMARY)}
    return sorted(
        runs, key=lambda path: [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.parts]
    )
