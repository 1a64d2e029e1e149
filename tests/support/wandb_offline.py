"""Reading an offline wandb run back, for the tracking tests: wandb 0.31 has no Python reader
for its ``.wandb`` files, which are a LevelDB-style log of protobuf records."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_BLOCK, _HEADER = 32768, 7  # wandb's run file is a LevelDB-style log of protobuf records


def offline_runs(directory: str | Path) -> list[Path]:
    """The offline wandb runs below ``directory`` (their ``offline-run-*`` folders)."""
    return sorted(Path(directory).glob("wandb/offline-run-*"))


def _records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a wandb run file")
    offset, pending = _HEADER, b""
    while offset + _HEADER <= len(data):
        if _BLOCK - offset % _BLOCK < _HEADER:  # a block's tail too short for a header
            offset += _BLOCK - offset % _BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + _HEADER])
        chunk = data[offset + _HEADER : offset + _HEADER + length]
        offset += _HEADER + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending + chunk)
            pending = b""
            yield record
        elif kind in (2, 3):  # first and middle pieces
            pending += chunk
        else:  # zero padding
            offset += -offset % _BLOCK


def read_offline_run(run_folder: str | Path) -> dict[str, Any]:
    """What an offline run holds: ``name``, ``group``, ``config`` and ``history`` (one dict per
    logged step)."""
    (path,) = Path(run_folder).glob("run-*.wandb")
    found: dict[str, Any] = {"name": None, "group": None, "config": {}, "history": []}
    for record in _records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            found["name"], found["group"] = record.run.display_name, record.run.run_group
            for item in record.run.config.update:
                found["config"][item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                found["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            found["history"].append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                 for item in record.history.item}
            )  # fmt: skip
    return found
