"""The recording of a training job: its files, written by rank 0 (`Writer`) and read back whole
and checked (`read`), format ``gatherlab-recording`` version 2; version 1 (the rows' digests in
hexadecimal in each update's line) is still read (docs/recording.md §11, "The format").

A recording is a directory:

- ``header.json``, written when recording starts: the format and its version, the versions of
  gatherlab and torch, the world size, precision, dtype and device, the seed, the sketch's k and
  seed, how many updates keep their full gradient, the optimizer's settings, every parameter
  (name, shape, part, whether it is sharded) and the parts in order;
- ``updates.jsonl``, one line per optimizer update, appended after it: each rank's loss and the
  global loss (their mean), where its input rows' digests start in ``rows.u64`` and how many each
  rank has (version 1: each rank's digests in hexadecimal, in the line), each part's exact
  gradient norm, where its sketch starts in ``sketches.f64``, and the parts whose gradient differs
  between ranks (not reduced) with where each rank's sketch of it starts;
- ``sketches.f64``: the sketches, raw little-endian float64, appended in that order;
- ``rows.u64`` (version 2): each update's rows' 64-bit digests, raw little-endian, rank after
  rank, each rank's in the order its model was given them;
- ``full/update_<u>.pt``: the whole gradient of the first updates (float64, parameter order);
- ``trace.pt`` (when asked for): each rank's records of the first update's forward;
- ``final.json``, written when recording ends: the number of updates, the final weights'
  sketch and norms, and whether the model's forward returned rows (a floor's row blocks join
  them) or its loss. A recording without it is unfinished (the job stopped, or has not ended).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gatherlab.core.terms import Precision

__all__ = [
    "FINAL", "FORMAT", "FULL", "HEADER", "ROWS", "SKETCHES", "TRACE", "UPDATES", "VERSION",
    "Recording", "RecordingError", "Update", "Writer", "hexadecimal", "read",
]  # fmt: skip

FORMAT = "gatherlab-recording"
VERSION = 2
"""2: the rows' digests in ``rows.u64``, binary (an update's line says where they start and how
many each rank has), where version 1 wrote them in hexadecimal in the line: the recorder's JSON of
a small job's update took a third of its writing (issue 71)."""
HEADER, UPDATES, SKETCHES, ROWS, FINAL, FULL, TRACE = (
    "header.json", "updates.jsonl", "sketches.f64", "rows.u64", "final.json", "full", "trace.pt",
)  # fmt: skip
_BUFFER = 1 << 20
"""The bytes each of a recording's open files keeps before handing them to the system: an
update's sketches (8·k bytes a part) outgrew the default 8 KiB, so that each update's write was
a system call of its own; with this, one per file and batch of updates (`Writer.flush`)."""


def hexadecimal(numbers: np.ndarray) -> list[str]:
    """Each 64-bit digest as 16 hexadecimal digits (how a row's digest is shown and compared)."""
    text = numbers.astype(">u8").tobytes().hex()  # big-endian: each number's 16 digits in order
    return [text[i : i + 16] for i in range(0, len(text), 16)]


class RecordingError(ValueError):
    """A directory that cannot be compared as a recording: one line, what and why."""


@dataclass(frozen=True)
class Update:
    """One optimizer update as recorded: ``losses`` each rank's local loss (NaN where the job
    recorded none), ``loss`` the global loss (their mean, docs/design.md §2), ``rows`` each rank's
    input-row digests in order, ``sketches`` each part's sketch of the gradient the optimizer
    received (rank 0's for a part that is not reduced), ``norms`` its exact L2 norm per part,
    ``unreduced`` each rank's sketch (W × k) of the parts whose gradient differs between ranks,
    ``autocast`` the autocast dtype of its forward (None without autocast), ``micro_batches`` how
    many losses rank 0 recorded in it (its micro-batches; 0 where the job recorded none),
    ``calls`` each rank's calls of the model's forward (or batches given) whose rows it holds
    (None in recordings made before it was recorded), ``drifted`` the parts whose weights differ
    between the ranks after its step (the ranks step apart)."""

    index: int
    losses: list[float]
    loss: float
    rows: list[list[str]]
    sketches: dict[str, np.ndarray]
    norms: dict[str, float]
    unreduced: dict[str, np.ndarray]
    autocast: str | None
    micro_batches: int = 1
    calls: list[int] | None = None
    drifted: list[str] = dataclasses.field(default_factory=list)
    copies_apart: list[str] = dataclasses.field(default_factory=list)
    """Where the ranks hold different parameters, the copies of one that differ in the update's
    whole gradient, each in words (`gatherlab.core.held.Apart.words`: the ranks, the names they
    hold it under, by how much); recorded with the whole gradient (the first updates)."""
    loss_dtype: str | None = None
    """The dtype of the loss tensor the job's loss was (``float32`` where a float64 job computes
    its loss in float32: ``logits.float()``), whose rounding the comparison allows its losses;
    None where the loss was a number, or in a recording made before it was recorded."""


@dataclass(frozen=True)
class Recording:
    """A recording read back whole (`read`)."""

    path: Path
    header: dict[str, Any]
    updates: list[Update]
    weights_sketch: dict[str, np.ndarray]
    weights_norms: dict[str, float]
    row_groups: list[list[int]] = dataclasses.field(default_factory=list)
    """The tensor-parallel groups whose rows were counted once, by their first rank (every rank
    of a group trains the same rows): the other ranks' rows are recorded empty."""

    @property
    def parts(self) -> list[str]:
        return list(self.header["parts"])

    @property
    def world_size(self) -> int:
        return int(self.header["world_size"])

    @property
    def precision(self) -> str:
        """The precision the job trained in, by Lightning's names: ``bf16-mixed`` or ``16-mixed``
        where its forwards ran under ``torch.autocast`` (recorded per update), else its
        parameters' (the header's ``precision``: ``64-true``, ``32-true``, ``bf16-true``,
        ``16-true``)."""
        autocast = next((u.autocast for u in self.updates if u.autocast), None)
        mixed = {"bfloat16": Precision.BF16_MIXED, "float16": Precision.FP16_MIXED}
        return str(mixed.get(autocast or "", self.header.get("precision", Precision.FLOAT64)))

    @property
    def k(self) -> int:
        return int(self.header["k"])

    @property
    def row_blocks(self) -> int:
        """The row blocks its model's forward ran in (a floor's: 2 by default, 1 for any other
        recording; recordings made before issue 59 say none: 1)."""
        return int(self.header.get("row_blocks") or 1)

    @property
    def full_updates(self) -> int:
        return min(int(self.header["full_updates"]), len(self.updates))

    def full_gradient(self, update: int):
        """The whole gradient of ``update`` (a float64 torch tensor in the header's parameter
        order), None where only its sketch was kept."""
        if update >= self.full_updates:
            return None
        import torch

        return torch.load(self.path / FULL / f"update_{update}.pt", weights_only=True)

    def trace(self) -> list | None:
        """Each rank's records of the first update's forward (`gatherlab.runs.trace.Op`, from
        the model's first call to the loss), None where the job did not trace it."""
        if not (self.path / TRACE).is_file():
            return None
        import torch

        return torch.load(self.path / TRACE, weights_only=False)["ranks"]  # gatherlab's own Ops

    def layout(self) -> dict[str, list[tuple[int, int]]]:
        """The parts of a full gradient: each part's ranges of it (`gatherlab.core.gradients`)."""
        parts: dict[str, list[tuple[int, int]]] = {}
        start = 0
        for parameter in self.header["parameters"]:
            stop = start + math.prod(parameter["shape"])
            parts.setdefault(parameter["part"], []).append((start, stop))
            start = stop
        return parts


class Writer:
    """The files of a recording, written by rank 0 as the job runs: updates are appended to open
    files, and `flush` (after each batch of updates) hands them to the system sketches first,
    so that a job that stops leaves every update written before the last flush, each line
    complete."""

    def __init__(self, out: Path, header: Mapping[str, Any]) -> None:
        self.out = Path(out)
        if (self.out / HEADER).exists():
            raise RecordingError(
                f"{self.out} already holds a recording: give each run its own directory"
            )
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / FULL).mkdir(exist_ok=True)
        header = {"format": FORMAT, "version": VERSION, **header}
        (self.out / HEADER).write_text(json.dumps(header, indent=1) + "\n")
        self._offset, self._rows_offset = 0, 0  # in float64 numbers, in digests
        # open while recording (noqa: SIM115); each file's writes kept until `flush`
        self._sketches = open(self.out / SKETCHES, "ab", buffering=_BUFFER)  # noqa: SIM115
        self._rows = open(self.out / ROWS, "ab", buffering=_BUFFER)  # noqa: SIM115
        self._updates = open(self.out / UPDATES, "a", buffering=_BUFFER)  # noqa: SIM115

    def sketch(self, values: np.ndarray) -> int:
        """Appends ``values`` (float64) to ``sketches.f64``; returns where they start."""
        start = self._offset
        array = np.ascontiguousarray(values, dtype="<f8")
        self._sketches.write(array.tobytes())
        self._offset += array.size
        return start

    def rows(self, digests: np.ndarray) -> int:
        """Appends an update's rows' digests (uint64) to ``rows.u64``; returns where they start."""
        start = self._rows_offset
        array = np.ascontiguousarray(digests, dtype="<u8")
        self._rows.write(array.tobytes())
        self._rows_offset += array.size
        return start

    def full(self, update: int, gradient) -> None:
        import torch

        torch.save(gradient, self.out / FULL / f"update_{update}.pt")

    def trace(self, ranks: list) -> None:
        """Each rank's records of the first update's forward (`gatherlab.runs.trace.Op`)."""
        import torch

        torch.save({"ranks": ranks}, self.out / TRACE)

    def update(self, line: Mapping[str, Any]) -> None:
        self._updates.write(json.dumps(line) + "\n")

    def flush(self) -> None:
        """The updates written so far handed to the system: their sketches and rows first, then
        their lines, so that a line is never read before its sketches and rows."""
        self._sketches.flush()
        self._rows.flush()
        self._updates.flush()

    def close(self, final: Mapping[str, Any]) -> None:
        self._sketches.close()
        self._rows.close()
        self._updates.close()
        (self.out / FINAL).write_text(json.dumps({**final, "complete": True}, indent=1) + "\n")


def _json(path: Path, what: str) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise RecordingError(f"{path}: {what} is not valid JSON ({error.msg})") from None


def _header(path: Path) -> dict[str, Any]:
    """The header of the recording in ``path``, checked: a directory that is not a recording, a
    format version newer than this gatherlab reads, an unfinished recording each raise
    `RecordingError` with one line."""
    if not path.is_dir():
        raise RecordingError(f"{path} is not a directory: a recording is the directory "
                             f"gatherlab.record wrote")  # fmt: skip
    if not (path / HEADER).is_file():
        raise RecordingError(f"{path} is not a recording: it has no {HEADER} "
                             f"(gatherlab.record writes one when recording starts)")  # fmt: skip
    header = _json(path / HEADER, "the header")
    if header.get("format") != FORMAT:
        raise RecordingError(f"{path} is not a recording: {HEADER} has format "
                             f"{header.get('format')!r}, not {FORMAT!r}")  # fmt: skip
    version = header.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise RecordingError(
            f"{path} is format version {version}; this gatherlab "
            f"({header.get('gatherlab', '?')} wrote it) reads versions up to {VERSION}: "
            f"upgrade gatherlab to compare it"
        )
    if not (path / FINAL).is_file():
        raise RecordingError(
            f"{path} is unfinished: it has no {FINAL} (the job stopped before its recorder "
            f"closed: a refusal the recorder printed in the job's output, or a failure; or it is "
            f"still running); record the job to its end"
        )
    return header


class _Sketches:
    """``sketches.f64`` (or ``rows.u64``) read whole; a block of it, or one line saying it is
    truncated."""

    def __init__(self, path: Path, name: str = SKETCHES, dtype: str = "<f8") -> None:
        self.path = path / name
        self.values = np.fromfile(self.path, dtype=dtype) if self.path.exists() else np.zeros(
            0, dtype)  # fmt: skip

    def block(self, start: int, count: int, what: str) -> np.ndarray:
        if start + count > self.values.size:
            raise RecordingError(
                f"{self.path} is truncated: {what} needs numbers {start}…{start + count} "
                f"of {self.values.size}"
            )
        return self.values[start : start + count]


def _update(number: int, text: str, path: Path, sketches: _Sketches, parts: list[str], k: int,
            rows: _Sketches | None = None, cut: bool = False):  # fmt: skip
    """Line ``number`` of ``updates.jsonl`` as an `Update`, its sketches read, and its rows'
    digests from ``rows`` (version 2; version 1's are in the line); ``cut``: the file's last
    line, which ends without its newline."""
    try:
        line = json.loads(text)
    except json.JSONDecodeError:
        if cut:
            raise RecordingError(f"{path / UPDATES} is truncated at update {number}") from None
        raise RecordingError(
            f"{path / UPDATES}: line {number + 1} (update {number}) is not a line the recorder "
            f"writes (not JSON); record the job again"
        ) from None
    if rows is not None:
        start, counts = line["rows"]["start"], line["rows"]["counts"]
        digests = hexadecimal(rows.block(start, sum(counts), f"update {number}'s rows"))
        ends = np.cumsum([0, *counts]).tolist()
        line["rows"] = [digests[a:b] for a, b in itertools.pairwise(ends)]
    values = sketches.block(line["sketch"], k * len(parts), f"update {number}'s sketch")
    unreduced = {
        part: np.stack([sketches.block(s, k, f"update {number}'s rank sketch of {part}")
                        for s in starts])
        for part, starts in line["unreduced"].items()
    }  # fmt: skip
    return Update(
        index=line["update"], losses=[_float(v) for v in line["losses"]],
        loss=_float(line["loss"]), rows=line["rows"],
        sketches={p: values[i * k : (i + 1) * k] for i, p in enumerate(parts)},
        norms=line["norms"], unreduced=unreduced, autocast=line.get("autocast"),
        micro_batches=line.get("micro_batches", 1), calls=line.get("calls"),
        drifted=line.get("drifted", []), copies_apart=line.get("copies_apart", []),
        loss_dtype=line.get("loss_dtype"),
    )  # fmt: skip


def read(path: str | Path) -> Recording:
    """The recording in ``path``, read whole and checked: a directory that is not a recording, a
    format version newer than this gatherlab reads, an unfinished or truncated recording each
    raise `RecordingError` with one line."""
    path = Path(path)
    header = _header(path)
    final = _json(path / FINAL, "the final record")
    sketches = _Sketches(path)
    rows = _Sketches(path, ROWS, "<u8") if header["version"] >= 2 else None
    k, parts = int(header["k"]), list(header["parts"])
    text = (path / UPDATES).read_text() if (path / UPDATES).exists() else ""
    lines = text.splitlines()
    if len(lines) < final["updates"]:
        raise RecordingError(f"{path / UPDATES} is truncated: {len(lines)} updates of the "
                             f"{final['updates']} that {FINAL} records")  # fmt: skip
    if len(lines) > final["updates"]:
        raise RecordingError(
            f"{path / UPDATES} holds {len(lines)} lines where {FINAL} records "
            f"{final['updates']} updates: lines were added after the recording closed; record the "
            f"job again"
        )
    cut = len(lines) - 1 if not text.endswith("\n") else None
    updates = [_update(n, line, path, sketches, parts, k, rows, n == cut)
               for n, line in enumerate(lines)]  # fmt: skip
    weights = sketches.block(final["weights_sketch"], k * len(parts), "the final weights' sketch")
    return Recording(
        path=path, header=header, updates=updates,
        weights_sketch={p: weights[i * k : (i + 1) * k] for i, p in enumerate(parts)},
        weights_norms=final["weights_norms"],
        row_groups=[list(group) for group in final.get("row_groups", [])],
    )  # fmt: skip


def _float(value: float | None) -> float:
    return math.nan if value is None else float(value)
