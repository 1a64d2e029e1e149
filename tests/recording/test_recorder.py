"""`gatherlab.record` on real gloo ranks of gatherlab's pool: a recorded plain loop under DDP,
FSDP2 and ZeroRedundancyOptimizer at W = 2 and 4 against the same loop recorded on one device
without a process group (`recorded_loops`), and the reader's refusals (docs/design.md §11)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import recorded_loops
import torch

from gatherlab.ranks import pool as pools
from gatherlab.recording import format
from gatherlab.recording.sketch import signs, sketch


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Record a loop (wrap, bug) on one device and on W ranks once per module."""
    base = tmp_path_factory.mktemp("recordings")
    made: dict[tuple, format.Recording] = {}

    def get(wrap: str, bug: str, world_size: int) -> format.Recording:
        key = (wrap, bug, world_size)
        if key not in made:
            out = str(base / f"{wrap}-{bug or 'clean'}-{world_size}")
            if world_size == 1:
                recorded_loops.loop(out, wrap, bug)
            else:
                pools.pool(world_size).run(recorded_loops.loop, out, wrap, bug)
            made[key] = format.read(out)
        return made[key]

    return get


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize(("wrap", "world_size"), [("ddp", 2), ("ddp", 4), ("fsdp2", 2),
                                                  ("fsdp2", 4), ("zero", 2)])  # fmt: skip
def test_a_clean_loop_records_what_one_device_records(recorded, wrap, world_size):
    """Losses, input rows, each part's sketch and norm, the full first gradient and the final
    weights: W ranks' recording is one device's to rounding (float64); an FSDP2 gradient is
    recorded from its shards, never gathered after the first update."""
    one, many = recorded(wrap, "", 1), recorded(wrap, "", world_size)
    assert many.world_size == world_size and many.parts == one.parts == ["body", "criterion"]
    sharded = [p["sharded"] for p in many.header["parameters"]]
    assert all(sharded) if wrap == "fsdp2" else not any(sharded)
    for a, b in zip(one.updates, many.updates, strict=True):
        assert abs(a.loss - b.loss) <= 1e-15
        assert [r for rows in b.rows for r in rows] == a.rows[0]  # in rank order: one device's
        assert not b.unreduced
        for part in one.parts:
            assert _relative(b.sketches[part], a.sketches[part]) <= 1e-14
            assert abs(b.norms[part] / a.norms[part] - 1) <= 1e-14
    assert float((many.full_gradient(0) - one.full_gradient(0)).abs().max()) <= 1e-15
    assert many.full_gradient(1) is None
    for part in one.parts:
        assert _relative(many.weights_sketch[part], one.weights_sketch[part]) <= 1e-14


def test_the_recorded_sketch_is_the_sketch_of_the_full_gradient(recorded):
    """Independently: the first update's full gradient, cut into its parameters and sketched here,
    gives the part sketches the ranks recorded from their shards."""
    many = recorded("fsdp2", "", 2)
    gradient, k, start = many.full_gradient(0), many.k, 0
    expected = {part: torch.zeros(k, dtype=torch.float64) for part in many.parts}
    for parameter in many.header["parameters"]:
        numel = int(np.prod(parameter["shape"]))
        block_signs = signs(parameter["name"], numel, k, many.header["sketch_seed"])
        expected[parameter["part"]] += sketch(gradient[start : start + numel], k, block_signs)
        start += numel
    for part in many.parts:
        assert _relative(many.updates[0].sketches[part], expected[part].numpy()) <= 1e-14


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2", "zero"])
def test_a_parameter_outside_every_wrapper_is_recorded_unreduced(recorded, wrap):
    """A scale outside DDP's forward, outside fully_shard, or beside a ZeRO optimizer: each
    rank's gradient of it is its own, so the ranks' sketches differ and each is kept; their mean
    at the first update is one device's gradient (the loss is a mean over equal slices)."""
    one, many = recorded(wrap, "temperature_outside", 1), recorded(wrap, "temperature_outside", 2)
    first = many.updates[0]
    assert list(first.unreduced) == ["loss.scale"] and first.unreduced["loss.scale"].shape[0] == 2
    mean = first.unreduced["loss.scale"].mean(axis=0)
    assert _relative(mean, one.updates[0].sketches["loss.scale"]) <= 1e-14
    assert _relative(first.sketches["loss.scale"], first.unreduced["loss.scale"][0]) == 0
    assert _relative(first.sketches["body"], one.updates[0].sketches["body"]) <= 1e-14


def test_a_loss_divided_twice_records_a_gradient_of_one_over_w(recorded):
    one, many = recorded("ddp", "divide_twice", 1), recorded("ddp", "divide_twice", 4)
    assert abs(many.updates[0].loss - one.updates[0].loss) <= 1e-15  # the loss module's output
    for part in one.parts:
        assert abs(many.updates[0].norms[part] / one.updates[0].norms[part] - 0.25) <= 1e-14


# the reader's refusals ------------------------------------------------------------------------
def _copy(recording: format.Recording, tmp_path):
    import shutil

    return shutil.copytree(recording.path, tmp_path / "copy")


def test_the_reader_refuses_what_is_not_a_finished_recording(recorded, tmp_path):
    source = recorded("ddp", "", 1)
    with pytest.raises(format.RecordingError, match="is not a directory"):
        format.read(tmp_path / "nothing")
    with pytest.raises(format.RecordingError, match="is not a recording: it has no header"):
        format.read(tmp_path)
    copy = _copy(source, tmp_path)
    header = json.loads((copy / format.HEADER).read_text())
    (copy / format.HEADER).write_text(json.dumps({**header, "version": format.VERSION + 1}))
    with pytest.raises(format.RecordingError, match=f"format version {format.VERSION + 1}; "
                       f"this gatherlab .* reads versions up to {format.VERSION}"):  # fmt: skip
        format.read(copy)
    (copy / format.HEADER).write_text(json.dumps(header))
    lines = (copy / format.UPDATES).read_text()
    (copy / format.UPDATES).write_text(lines[: len(lines) - 40])
    with pytest.raises(format.RecordingError, match="is truncated at update 3"):
        format.read(copy)
    (copy / format.UPDATES).write_text(lines)
    data = (copy / format.SKETCHES).read_bytes()
    (copy / format.SKETCHES).write_bytes(data[:-8])
    with pytest.raises(format.RecordingError, match=r"sketches\.f64 is truncated: the final"):
        format.read(copy)
    (copy / format.FINAL).unlink()
    with pytest.raises(format.RecordingError, match=r"is unfinished: it has no final\.json"):
        format.read(copy)


def test_a_directory_holding_a_recording_is_never_written_again(recorded):
    with pytest.raises(format.RecordingError, match="already holds a recording"):
        recorded_loops.loop(str(recorded("ddp", "", 1).path))


def test_a_traced_recording_names_the_line_where_per_rank_statistics_depart(tmp_path):
    """``trace=True``: each rank's records of the first update's forward, from the model's first
    call to the loss; `gatherlab.check.where` finds the per-rank batch norm in them as it does in
    the check's own traces."""
    from gatherlab.check import where

    recorded_loops.loop(str(tmp_path / "one"), bug="batchnorm", trace=True)
    pools.pool(2).run(recorded_loops.loop, str(tmp_path / "two"), "ddp", "batchnorm", 64, 1, True)
    one, two = format.read(tmp_path / "one").trace(), format.read(tmp_path / "two").trace()
    assert len(one) == 1 and len(two) == 2 and one[0][0].name == "input"
    found = where.departure(one[0], two, 2, recorded_loops.GLOBAL, 1e-10)
    assert found.where.endswith("batch_norm") and found.where.startswith("recorded_loops.py:")
    assert found.words == (
        "a batch_norm over dim 0 of the rank's 8 rows, where one device takes all 16"
    )
    recorded_loops.loop(str(tmp_path / "untraced"))
    assert format.read(tmp_path / "untraced").trace() is None
