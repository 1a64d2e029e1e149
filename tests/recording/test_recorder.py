"""`gatherlab.record` on real gloo ranks of gatherlab's pool: a recorded plain loop under DDP,
FSDP2 and ZeroRedundancyOptimizer at W = 2 and 4 against the same loop recorded on one device
without a process group (`recorded_loops`), and the reader's refusals (docs/recording.md §11)."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import recorded_loops
import torch
from recorded import relative, whole_sketches

import gatherlab.record
from gatherlab.ranks import pool as pools
from gatherlab.ranks import world
from gatherlab.recording import format
from gatherlab.recording.rows import row_digests
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
            assert relative(b.sketches[part], a.sketches[part]) <= 1e-14
            assert abs(b.norms[part] / a.norms[part] - 1) <= 1e-14
    assert float((many.full_gradient(0) - one.full_gradient(0)).abs().max()) <= 1e-15
    assert many.full_gradient(1) is None
    assert not any(u.drifted for u in many.updates)  # every rank's weights alike after each step
    for part in one.parts:
        assert relative(many.weights_sketch[part], one.weights_sketch[part]) <= 1e-14


def test_the_recorded_sketch_is_the_sketch_of_the_full_gradient(recorded):
    """Independently: the first update's full gradient, cut into its parameters and sketched here,
    gives the part sketches the ranks recorded from their shards."""
    many = recorded("fsdp2", "", 2)
    expected = whole_sketches(many)
    for part in many.parts:
        assert relative(many.updates[0].sketches[part], expected[part]) <= 1e-14


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2", "zero"])
def test_a_parameter_outside_every_wrapper_is_recorded_unreduced(recorded, wrap):
    """A scale outside DDP's forward, outside fully_shard, or beside a ZeRO optimizer: each
    rank's gradient of it is its own, so the ranks' sketches differ and each is kept; their mean
    at the first update is one device's gradient (the loss is a mean over equal slices)."""
    one, many = recorded(wrap, "temperature_outside", 1), recorded(wrap, "temperature_outside", 2)
    first = many.updates[0]
    assert list(first.unreduced) == ["loss.scale"] and first.unreduced["loss.scale"].shape[0] == 2
    mean = first.unreduced["loss.scale"].mean(axis=0)
    assert relative(mean, one.updates[0].sketches["loss.scale"]) <= 1e-14
    assert relative(first.sketches["loss.scale"], first.unreduced["loss.scale"][0]) == 0
    # the model (its loss outside) has one child, body: its parts are the body's layers
    assert many.parts == one.parts == ["body.0", "body.3", "body.5", "loss.scale"]
    for part in ("body.0", "body.3", "body.5"):
        assert relative(first.sketches[part], one.updates[0].sketches[part]) <= 1e-14


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
    second = lines.index("\n") + 1  # a whole line the recorder never writes, not a cut one
    (copy / format.UPDATES).write_text(
        lines[:second] + "garbage\n" + lines[lines.index("\n", second) + 1 :]
    )
    with pytest.raises(
        format.RecordingError, match=r"line 2 \(update 1\) is not a line the recorder"
    ):
        format.read(copy)
    (copy / format.UPDATES).write_text(lines + '{"update": 4}\n')
    with pytest.raises(
        format.RecordingError, match=r"holds 5 lines where final\.json records 4 updates"
    ):
        format.read(copy)
    (copy / format.UPDATES).write_text(lines)
    digests = (copy / format.ROWS).read_bytes()
    (copy / format.ROWS).write_bytes(digests[:-8])  # the last update's last row
    with pytest.raises(format.RecordingError, match=r"rows\.u64 is truncated: update 3's rows"):
        format.read(copy)
    (copy / format.ROWS).write_bytes(digests)
    data = (copy / format.SKETCHES).read_bytes()
    (copy / format.SKETCHES).write_bytes(data[:-8])
    with pytest.raises(format.RecordingError, match=r"sketches\.f64 is truncated: the final"):
        format.read(copy)
    (copy / format.FINAL).unlink()
    with pytest.raises(
        format.RecordingError,
        match=r"is unfinished: it has no final\.json \(the "
        r"job stopped before its recorder closed: a refusal the recorder printed",
    ):
        format.read(copy)


VERSION_1 = Path(__file__).parent / "recording_v1"
"""`recorded_loops.loop` (DDP) at W = 1 and 2, recorded by gatherlab in format version 1 (the rows'
digests in hexadecimal in each line), before version 2 (README.md there: how it was made)."""


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_version_1_recording_is_read_as_the_same_loop_recorded_now(recorded, world_size):
    """A recording of format version 1 reads as today's recording of the same loop (version 2,
    its digests in rows.u64): the same rows' digests and calls rank by rank; losses, norms and
    sketches (float64, the same operations: to the last bits' rounding); and the two compare
    exact."""
    old, new = format.read(VERSION_1 / f"w{world_size}"), recorded("ddp", "", world_size)
    assert (old.header["version"], new.header["version"]) == (1, 2) == (1, format.VERSION)
    assert not (old.path / format.ROWS).exists() and (new.path / format.ROWS).is_file()
    assert len(old.updates) == len(new.updates) == recorded_loops.STEPS
    for a, b in zip(old.updates, new.updates, strict=True):
        assert [len(rows) for rows in a.rows] == [recorded_loops.GLOBAL // world_size] * world_size
        assert a.rows == b.rows and a.calls == b.calls
        # the losses too are float64 sums whose last bit follows the CPU's kernels (this machine's
        # AVX-512 ones differ from those the old recording was made with in the 16th digit)
        assert a.losses == pytest.approx(b.losses, rel=1e-14, abs=0)
        for part in old.parts:
            assert relative(b.sketches[part], a.sketches[part]) <= 1e-14
            assert abs(b.norms[part] / a.norms[part] - 1) <= 1e-14
    from gatherlab import compare

    assert compare(old.path, new.path).verdict == "exact"
    assert compare(new.path, VERSION_1 / "w1").verdict == "exact"


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


class _CachedLoss(torch.nn.Module):
    """A GradCache loss as cached ranking losses write it: the model's embeddings of the rows
    made in chunks without gradients, the loss over all of them and its gradient of them kept;
    then, in the loss's backward (a hook on the loss it returns), the model called again chunk by
    chunk with gradients, each chunk's embeddings backpropagated with the kept gradient; or
    (``in_forward``) that done at once in its forward, which returns the loss detached.
    ``shift``: a term that makes the loss another function (a bug)."""

    def __init__(self, model: torch.nn.Module, shift: float = 0.0, in_forward=False) -> None:
        super().__init__()
        self.model, self.shift, self.in_forward = model, shift, in_forward

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            embedded = torch.cat([self.model(chunk) for chunk in rows.split(2)])
        embedded.requires_grad_()
        with torch.enable_grad():
            loss = embedded.pow(2).sum(1).mean() + self.shift * embedded.sum()
            (kept,) = torch.autograd.grad(loss, embedded)
        cached = loss.detach().requires_grad_(not self.in_forward)

        def again(grad: torch.Tensor) -> torch.Tensor:
            with torch.enable_grad():
                for chunk, gradient in zip(rows.split(2), kept.split(2), strict=True):
                    (self.model(chunk) * gradient).sum().mul(grad).backward()
            return grad

        if self.in_forward:
            again(torch.ones((), dtype=loss.dtype))
        else:
            cached.register_hook(again)
        return cached


def _cached_job(out, shift: float = 0.0, in_forward: bool = False) -> None:
    """Two updates of an MLP trained through `_CachedLoss`, recorded with ``trace=True``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model.double()
    loss = _CachedLoss(model, shift, in_forward)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = torch.randn(2, 8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with gatherlab.record(model, optimizer, out, loss=loss, trace=True):
        for update in range(2):
            optimizer.zero_grad()
            value = loss(rows[update])
            if not in_forward:
                value.backward()
            optimizer.step()


@pytest.mark.parametrize("in_forward", [False, True], ids=["from-its-backward", "in-its-forward"])
def test_a_loss_that_calls_its_model_again_is_recorded_untraced_in_one_line(
    in_forward, tmp_path, caplog
):
    """A cached loss calls the model with gradients only from its backward hook, where autograd
    keeps the trace's mode for the hook alone: ``trace=True`` said a traceback at the first step
    ("trying to pop from empty mode stack", a user's sentence-transformers job). One that does
    so inside its forward and returns its loss detached (a user's DDP job) was traced, and the
    comparison named its embedding's line for every bug, the labels' included: the trace held
    the model's last chunk, not what the loss was computed from. Now either recording goes on
    untraced with one line said, its gradients still recorded; the comparison of two such runs
    says why it names no line, and does not ask for a trace."""
    from gatherlab import compare

    with caplog.at_level("WARNING", logger="gatherlab.recording.recorder"):
        _cached_job(tmp_path / "one", in_forward=in_forward)
    said = [r.getMessage() for r in caplog.records if "trace" in r.getMessage()]
    assert len(said) == 1 and "loss was not computed from the model's calls" in said[0], said
    one = format.read(tmp_path / "one")
    assert one.trace() == [[]] and len(one.updates) == 2
    _cached_job(tmp_path / "shifted", shift=0.1, in_forward=in_forward)
    compared = compare(tmp_path / "one", tmp_path / "shifted")
    assert compared.verdict == "loss differs", compared.words
    assert compared.table.iloc[0]["departs"].startswith(
        "no line named: both runs were recorded with trace=True and their traces hold no operation"
    )
    assert "Record both runs with trace=True" not in " ".join(compared.words.split())


def test_the_recorded_norms_are_the_full_gradients_norms(recorded):
    """Each part's recorded norm at the first update against its full gradient's, summed in
    float64 here, on one device and from FSDP2's shards."""
    for recording in (recorded("ddp", "", 1), recorded("fsdp2", "", 2)):
        gradient = recording.full_gradient(0)
        for part, ranges in recording.layout().items():
            exact = math.sqrt(math.fsum(float(gradient[a:b].pow(2).sum()) for a, b in ranges))
            assert abs(recording.updates[0].norms[part] / exact - 1) <= 1e-14


def test_a_float32_gradients_norm_is_exact_to_float64_rounding_of_its_squares():
    """In float32 the squares are summed in rows of 256 and the rows in float64: against the
    float64 sum of the same values, 1e-9 relative, where a float32 sum is 1e-4 away."""
    from gatherlab.recording.recorder import _norm

    values = torch.randn(2_560_001, generator=torch.Generator().manual_seed(0))
    values = values * torch.rand(2_560_001, generator=torch.Generator().manual_seed(1))
    exact = math.sqrt(math.fsum(values.double().pow(2).tolist()))
    assert abs(_norm(values) / exact - 1) <= 1e-9
    assert abs(float(torch.linalg.vector_norm(values)) / exact - 1) > 1e-6  # what it avoids


def test_row_digests_tell_rows_apart_and_equal_rows_alike():
    """Equal rows, equal digests (in any batch, at any position); a row changed in one element or
    in two sign bits (which a linear hash modulo 2⁶⁴ would cancel) gets another; the dtype and the
    row's shape are part of it."""
    rows = torch.randn(64, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    digests = row_digests(rows)
    assert len(set(digests)) == 64 and all(len(d) == 16 for d in digests)
    assert row_digests(rows[10:20]) == digests[10:20]
    changed = rows.clone()
    changed[3, 5] = torch.nextafter(changed[3, 5], torch.tensor(math.inf, dtype=torch.float64))
    changed[4, [0, 7]] *= -1
    assert [a == b for a, b in zip(row_digests(changed)[:6], digests[:6], strict=True)] == [
        True, True, True, False, False, True,
    ]  # fmt: skip
    assert row_digests(rows.float())[0] != digests[0]
    assert row_digests(rows.reshape(64, 4, 10))[0] != digests[0]


def test_a_forward_without_gradients_between_updates_is_not_recorded(tmp_path):
    """An evaluation between updates (``torch.no_grad``): its rows and loss are not the update's."""
    torch.manual_seed(0)
    model, criterion = torch.nn.Linear(3, 1).double(), torch.nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 1, dtype=torch.float64)
    with gatherlab.record(model, optimizer, tmp_path / "run", loss=criterion):
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        with torch.no_grad():
            criterion(model(2 * x), y)  # a monitor's forward
        optimizer.step()
    update = format.read(tmp_path / "run").updates[0]
    assert update.rows == [row_digests(x)] and update.losses == [loss.item()]


# --- the recorder's own rules, on one device -----------------------------------------------------


class _Encoder(torch.nn.Module):
    """A model of one child (``encoder``) whose forward returns embeddings, rows of its input."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Sequential(
            torch.nn.Linear(6, 300), torch.nn.Tanh(), torch.nn.Linear(300, 4)
        )

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.encoder(rows)


def _job(out, updates: int = 3, autocast: bool = False, names: bool = False, **recorder):
    """A plain job on one device: the encoder's embeddings of two calls (two views), a mean
    squared error between them, a learnt scale outside the model and the loss, SGD."""
    torch.manual_seed(0)
    model, criterion = _Encoder(), torch.nn.MSELoss()
    scale = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([*model.parameters(), scale], lr=0.1)
    x = torch.randn(updates, 2, 8, 6, generator=torch.Generator().manual_seed(1))
    named = {"scale": scale} if names else None
    mixed = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with gatherlab.record(model, optimizer, out, loss=criterion, names=named, **recorder):
        for update in range(updates):
            optimizer.zero_grad()
            with mixed:
                loss = criterion(model(x[update, 0]) * scale[0], model(x[update, 1]) * scale[1])
            loss.backward()
            optimizer.step()
    return model, scale


def test_a_model_of_one_child_is_cut_into_its_childs_parts_and_names_are_taken(tmp_path):
    """Parts: the one child's layers, not one part that no table would show apart from the
    whole; a parameter outside the model and the loss is its optimizer slot, or its given name;
    each update's rows are the two calls' (2 × 8 per rank), counted."""
    _job(tmp_path / "slot")
    slot = format.read(tmp_path / "slot")
    assert slot.parts == ["encoder.0", "encoder.2", "optimizer.0.4"]
    assert [p["shape"] for p in slot.header["parameters"]][-1] == [2]
    assert [len(rows) for rows in slot.updates[0].rows] == [16] and slot.updates[0].calls == [2]
    _job(tmp_path / "named", names=True)
    assert format.read(tmp_path / "named").parts == ["encoder.0", "encoder.2", "scale"]
    from gatherlab import compare

    words = compare(tmp_path / "slot", tmp_path / "slot").words
    assert "(W = 1, 3 updates, 32-true, k = 251; 16 rows per rank and update, from 2 calls of " \
        "its model's forward)" in words  # fmt: skip
    assert "note: part optimizer.0.4 is a parameter of shape [2] that the optimizer updates " \
        "outside the model and the loss" in " ".join(words.split())  # fmt: skip
    with pytest.raises(ValueError, match=r"names=\{'encoder.0.weight': \.\.\.\}: the model"):
        model = _Encoder()
        gatherlab.record(model, torch.optim.SGD(model.parameters(), lr=0.1), tmp_path / "x",
                         names={"encoder.0.weight": model.encoder[0].weight})  # fmt: skip


def test_every_part_is_sketched_as_the_formula_gives_whatever_path_sketches_it(tmp_path):
    """A small parameter is sketched with the others of its part in one product, a large one on
    its own: each part's recorded sketch and norm against the formula applied here, parameter
    by parameter, to the full gradient (`sketch.sketch`; k = 7, so that blocks and padding
    matter)."""
    _job(tmp_path / "run", k=7)
    recording = format.read(tmp_path / "run")
    gradient, start = recording.full_gradient(0), 0
    expected = {part: torch.zeros(7, dtype=torch.float64) for part in recording.parts}
    squares = dict.fromkeys(recording.parts, 0.0)
    for parameter in recording.header["parameters"]:
        numel = int(np.prod(parameter["shape"]))
        values = gradient[start : start + numel]
        expected[parameter["part"]] += sketch(values, 7, signs(parameter["name"], numel, 7, 0))
        squares[parameter["part"]] += float(values.pow(2).sum())
        start += numel
    for part in recording.parts:
        assert relative(recording.updates[0].sketches[part], expected[part].numpy()) <= 1e-6
        assert abs(recording.updates[0].norms[part] / math.sqrt(squares[part]) - 1) <= 1e-6


def test_the_floor_is_recorded_by_its_variable_and_compared(tmp_path, monkeypatch):
    """GATHERLAB_RECORD_FLOOR=DIR: the job run again unchanged records its floor into DIR, its
    model's forward in two row blocks (the same function, bf16's rounding of two partial sums);
    the comparison without it (of a run one bit apart: the same bits need none) names that exact
    command, with it judges in floors."""
    import shlex
    import shutil
    import sys

    from gatherlab import compare
    from gatherlab.recording.recorder import FLOOR_VARIABLE

    _job(tmp_path / "one", autocast=True)
    assert compare(tmp_path / "one", tmp_path / "one").verdict == "exact"  # the same bits
    shutil.copytree(tmp_path / "one", tmp_path / "apart")  # one bit of one sketch apart
    values = np.fromfile(tmp_path / "apart" / format.SKETCHES, dtype="<u8")
    values[0] ^= 1
    values.tofile(tmp_path / "apart" / format.SKETCHES)
    not_judged = compare(tmp_path / "one", tmp_path / "apart")
    assert (not_judged.verdict, not_judged.status) == ("not judged", 3)
    command = f"GATHERLAB_RECORD_FLOOR={tmp_path / 'one'}-floor {shlex.join(sys.orig_argv)}"
    assert command in not_judged.words
    monkeypatch.setenv(FLOOR_VARIABLE, f"{tmp_path / 'one'}-floor")
    floored, _ = _job(tmp_path / "one", autocast=True)  # its out holds a recording: not written
    floor = format.read(f"{tmp_path / 'one'}-floor")
    assert floor.header["row_blocks"] == 2 and floor.precision == "bf16-mixed"
    floored.double()  # its forward in two row blocks: the encoder's own function, in float64
    rows = torch.randn(6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert float((floored(rows) - floored.encoder(rows)).abs().max()) <= 1e-15
    judged = compare(tmp_path / "one", tmp_path / "one", floor=f"{tmp_path / 'one'}-floor")
    assert (judged.verdict, judged.status) == ("exact within bf16", 0)
    again = compare(tmp_path / "one", tmp_path / "apart")  # its floor recorded: named, not over
    assert f"A's floor in 2 row blocks is recorded in {tmp_path / 'one'}-floor; " in again.words
    assert "GATHERLAB_RECORD_FLOOR=" not in again.words


def test_a_floor_is_refused_on_ranks_and_for_batch_norm_and_one_rank_is_one_device(
    tmp_path, monkeypatch, capsys
):
    """The floor's refusals, each one line said once (on rank 0) and a `SystemExit` of status 2
    (0 under torchrun, `refusal`); a process group of one rank (``torchrun --nproc-per-node
    1``) is one device, whose floor is recorded."""
    from gatherlab.recording.recorder import FLOOR_VARIABLE, Recorder

    monkeypatch.setenv(FLOOR_VARIABLE, str(tmp_path / "floor"))
    norm = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.SGD(norm.parameters(), lr=0.1)
    with pytest.raises(format.RecordingError, match=r"the model has batch norm \(1\), whose"
                       ) as refused:  # fmt: skip
        Recorder(norm, optimizer, tmp_path / "run")
    assert isinstance(refused.value, SystemExit) and refused.value.code == 2
    assert capsys.readouterr().err == f"gatherlab.record: {refused.value}\n"
    refused = pools.pool(2).run(_floor_on_ranks, str(tmp_path / "ranks"))
    assert refused == ["a floor is one device's run, and this job runs on 2 ranks"] * 2
    assert not (tmp_path / "floor").exists() and not (tmp_path / "run").exists()
    with world.alone():  # this process, rank 0 of a process group of one
        assert _floor_on_ranks(str(tmp_path / "one")) == "recorded"
    header = json.loads((tmp_path / "one" / "header.json").read_text())
    assert (header["world_size"], header["row_blocks"]) == (1, 2)


def _floor_on_ranks(out: str) -> str:
    import os

    from gatherlab.recording.recorder import FLOOR_VARIABLE, Recorder

    os.environ[FLOOR_VARIABLE] = out
    model = torch.nn.Linear(3, 3)
    try:
        Recorder(model, torch.optim.SGD(model.parameters(), lr=0.1), out)
    except format.RecordingError as error:
        return str(error).split(": ", 1)[1].split(";")[0]
    finally:
        del os.environ[FLOOR_VARIABLE]
    return "recorded"


class _TokenMean(torch.nn.Module):
    """A model that returns its loss, a mean over its rows' tokens (as many as each row's mask
    keeps: a causal language model's, which its Trainer calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Linear(4, 4).double()

    def forward(self, rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return ((self.backbone(rows) ** 2).sum(-1) * mask).sum() / mask.sum()


def _token_job(out, cut: bool = False) -> None:
    """Two updates of `_TokenMean` in float64; ``cut``: its backbone in row blocks, cut by the
    job itself (`gatherlab.record.in_row_blocks`)."""
    torch.manual_seed(0)
    model = _TokenMean()
    if cut:
        gatherlab.record.in_row_blocks(model.backbone)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    rows = torch.randn(2, 8, 5, 4, dtype=torch.float64, generator=generator)
    mask = (torch.arange(5) < torch.randint(1, 6, (2, 8, 1), generator=generator)).double()
    with gatherlab.record(model, optimizer, out, full_updates=1):
        for update in range(2):
            optimizer.zero_grad()
            model(rows[update], mask[update]).backward()
            optimizer.step()


def test_the_floor_of_a_job_that_cuts_its_model_itself_is_that_cut(tmp_path, monkeypatch):
    """A model whose loss is a mean over its rows' tokens cannot be cut whole (the joined loss
    is no token mean): refused in one line that says what works, the part before the loss in
    ``in_row_blocks`` in the job. With the floor's variable set, such a job's floor is its own
    cut, recorded into the variable's directory (the recorder cut the whole model again and
    refused it), and in float64 its first gradient is one call's to rounding."""
    from gatherlab.recording.recorder import FLOOR_VARIABLE

    _token_job(tmp_path / "one")
    monkeypatch.setenv(FLOOR_VARIABLE, str(tmp_path / "whole"))
    with pytest.raises(format.RecordingError, match=r"a mean over tokens\), and row blocks"):
        _token_job(tmp_path / "one")
    monkeypatch.setenv(FLOOR_VARIABLE, str(tmp_path / "floor"))
    _token_job(tmp_path / "one", cut=True)
    floor, one = format.read(tmp_path / "floor"), format.read(tmp_path / "one")
    a, b = one.full_gradient(0), floor.full_gradient(0)
    assert floor.row_blocks == 2 and float((b - a).norm() / a.norm()) <= 1e-14


def _fsdp2_under_autocast(out, policy: bool = False) -> None:
    """One update of an MLP whose layers and root are FSDP2's (``fully_shard``, on this
    process's one-rank group: ``torchrun --nproc-per-node 1``) under bf16 autocast, recorded;
    ``policy``: no autocast, FSDP2's own mixed precision (bf16 weights in the forward)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 3)]
    model = torch.nn.Sequential(layers[0], torch.nn.Tanh(), layers[1], torch.nn.Tanh(), layers[2])
    mesh = init_device_mesh("cpu", (1,))
    mixed = {"mp_policy": MixedPrecisionPolicy(torch.bfloat16, torch.float32)} if policy else {}
    for layer in layers[1:]:
        fully_shard(layer, mesh=mesh, **mixed)
    fully_shard(model, mesh=mesh, **mixed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    with gatherlab.record(model, optimizer, out, full_updates=1):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not policy):
            loss = model(rows).float().pow(2).mean()
        loss.backward()
        optimizer.step()


def test_an_fsdp2_models_floor_under_autocast_keeps_every_weights_gradient(tmp_path, monkeypatch):
    """The floor's first call measures its row blocks without gradients, inside the step's
    autocast: FSDP2's modules then re-used those casts of their weights, which had no gradient
    path, and every weight of an FSDP2 layer trained without a gradient (a user's floor departed
    from A by 0.51). Its update-0 gradient is A's to bf16's rounding (2.8e-3 measured; 1e-2 held,
    where the lost layers made it 0.97)."""
    from gatherlab.recording.recorder import FLOOR_VARIABLE

    with world.alone():
        _fsdp2_under_autocast(tmp_path / "one")
        monkeypatch.setenv(FLOOR_VARIABLE, str(tmp_path / "floor"))
        _fsdp2_under_autocast(tmp_path / "one")  # its floor, into tmp_path / "floor"
    one, floor = format.read(tmp_path / "one"), format.read(tmp_path / "floor")
    assert floor.row_blocks == 2 and one.precision == floor.precision == "bf16-mixed"
    a, b = one.full_gradient(0), floor.full_gradient(0)
    assert float((b - a).norm() / a.norm()) <= 1e-2, float((b - a).norm() / a.norm())


def _fsdp2_or_plain(out, fsdp2: bool) -> torch.nn.Module:
    """Three float32 updates of an MLP, its layers and root FSDP2's on this process's one-rank
    group where ``fsdp2`` (``torchrun --nproc-per-node 1``), else plain (``python``); returns
    the model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 3)]
    model = torch.nn.Sequential(layers[0], torch.nn.Tanh(), layers[1], torch.nn.Tanh(), layers[2])
    if fsdp2:
        mesh = init_device_mesh("cpu", (1,))
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = torch.randn(3, 8, 4, generator=torch.Generator().manual_seed(1))
    with gatherlab.record(model, optimizer, out):
        for update in range(3):
            optimizer.zero_grad()
            model(rows[update]).pow(2).mean().backward()
            optimizer.step()
    return model


def test_a_one_rank_fsdp2_job_and_its_plain_run_equal_bit_for_bit_are_exact(tmp_path):
    """FSDP2 on one rank (``torchrun --nproc-per-node 1``) trains what the plain model trains,
    to the bit; its recording is then the plain run's, and their comparison ``exact``. A user's
    such pair read ``not judged`` (float32, no floor): its DTensors, each its shard and here the
    whole, were sketched one by one, the plain parameters together, summed in another order."""
    from gatherlab import compare

    plain = _fsdp2_or_plain(tmp_path / "plain", fsdp2=False)
    with world.alone():
        sharded = _fsdp2_or_plain(tmp_path / "fsdp2", fsdp2=True)
        weights = [p.full_tensor() for p in sharded.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), weights, strict=True))
    one, two = format.read(tmp_path / "plain"), format.read(tmp_path / "fsdp2")
    for a, b in zip(one.updates, two.updates, strict=True):
        assert all(np.array_equal(a.sketches[part], b.sketches[part]) for part in one.parts)
        assert a.norms == b.norms
    compared = compare(tmp_path / "plain", tmp_path / "fsdp2")
    assert (compared.verdict, compared.status) == ("exact", 0), compared.words


def test_fsdp2s_mixed_precision_policy_is_recorded_as_bf16_mixed(tmp_path):
    """FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` keeps float32 parameters and
    computes the forward in bf16, as an autocast does: the recording is ``bf16-mixed``, judged in
    bf16's rounding (labelled ``32-true``, a user's correct two-rank job read ``biased``, beyond
    float32's); the same job without the policy is ``32-true``."""
    with world.alone():
        _fsdp2_under_autocast(tmp_path / "policy", policy=True)
    policy = format.read(tmp_path / "policy")
    assert (policy.header["precision"], policy.precision) == ("32-true", "bf16-mixed")
    assert policy.updates[0].autocast == "bfloat16"
    model = torch.nn.Linear(3, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gatherlab.record(model, optimizer, tmp_path / "plain"):
        model(torch.ones(2, 3)).sum().backward()
        optimizer.step()
    assert format.read(tmp_path / "plain").precision == "32-true"


def test_updates_are_written_in_batches_and_every_one_is_there_at_the_end(tmp_path):
    """The ranks keep their updates and rank 0 writes them every few (at most FLUSH_UPDATES):
    more than two batches' updates are as many lines once the recorder closes, in order."""
    from gatherlab.recording.recorder import FLUSH_UPDATES

    updates = 2 * FLUSH_UPDATES + 5
    _job(tmp_path / "run", updates=updates)
    recording = format.read(tmp_path / "run")
    assert [u.index for u in recording.updates] == list(range(updates))


def test_a_model_of_large_sketches_is_written_in_batches_of_at_most_flush_bytes(tmp_path):
    """Each update's sketches are 8·k bytes a part: 8 parts at k = 20,000 are 1.28 MB an update,
    so the recorder keeps FLUSH_BYTES // 1.28 MB of them (6) before writing, not FLUSH_UPDATES:
    the lines appear after the first update (written at once), then 6 at a time."""
    from gatherlab.recording.recorder import FLUSH_BYTES, FLUSH_UPDATES

    parts, k = 8, 20_000
    kept = FLUSH_BYTES // (parts * k * 8)
    assert kept == 6 < FLUSH_UPDATES
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(parts)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    lines = []
    with gatherlab.record(model, optimizer, tmp_path / "run", k=k):
        for _ in range(14):
            optimizer.zero_grad()
            model(torch.randn(3, 4)).square().sum().backward()
            optimizer.step()
            lines.append(len((tmp_path / "run" / format.UPDATES).read_text().splitlines()))
    assert lines == [1] * kept + [1 + kept] * kept + [1 + 2 * kept] * 2


def test_ranks_that_part_only_at_the_last_update_are_diverges_with_exit_status_1(recorded):
    """The last rank's learning rate 1 % larger at the last update only: rank 0's every loss,
    gradient and final weights are one device's (the recording keeps rank 0's), yet the ranks'
    weights differ after that step, and the comparison says ``diverges`` (exit status 1)."""
    from gatherlab import compare

    one, many = recorded("ddp", "", 1), recorded("ddp", "desync_last", 2)
    last = len(many.updates) - 1
    assert [u.drifted for u in many.updates] == [[]] * last + [many.parts]
    assert [u.loss for u in many.updates] == pytest.approx([u.loss for u in one.updates],
                                                           rel=1e-12, abs=0)  # fmt: skip
    for part in one.parts:
        assert relative(many.weights_sketch[part], one.weights_sketch[part]) <= 1e-12
    compared = compare(one, many)
    assert (compared.verdict, compared.status, compared.table.iloc[0]["cause"]) == (
        "diverges", 1, "desync")  # fmt: skip
    assert compared.departure == (last, many.parts[0])


def test_ranks_that_step_apart_are_recorded_at_the_update_they_part(recorded):
    """The last rank's learning rate 1 % larger from update 2 (DDP, W = 2): the ranks' weights
    differ after update 2's step, every part (each rank's fingerprint compared), and not before;
    the comparison says ``diverges`` (cause ``desync``) at update 2 though every gradient rank 0
    recorded is one device's."""
    from gatherlab import compare

    one, many = recorded("ddp", "desync", 1), recorded("ddp", "desync", 2)
    assert [u.drifted for u in many.updates] == [[], [], many.parts, many.parts]
    compared = compare(one, many)
    head = compared.table.iloc[0]
    assert (compared.verdict, head["cause"], compared.departure) == (
        "diverges",
        "desync",
        (2, many.parts[0]),
    )
    assert head["gradient"] == "exact"
    assert "B's ranks part from each other first at update 2: their weights differ after its " \
        "step" in " ".join(compared.words.split())  # fmt: skip


class _Coupled(torch.nn.Module):
    """A model whose forward returns an in-batch contrastive loss over its rows: its rows meet,
    so row blocks change what it computes."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.nn.functional.normalize(self.layer(x), dim=1)
        return torch.nn.functional.cross_entropy(z @ z.T / 0.1, torch.arange(len(x)))


class _Classifier(torch.nn.Module):
    """A per-row model returning a dict of its loss (the rows' mean) and its logits, as a Hugging
    Face model does."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict:
        logits = self.layer(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def _one_floor_update(model, out, x, *args) -> None:
    from gatherlab.recording.recorder import Recorder

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(model, optimizer, out):
        output = model(x, *args)
        (output["loss"] if isinstance(output, dict) else output).backward()
        optimizer.step()


def test_the_floors_join_is_checked_on_its_first_call_and_its_blocks_are_set(
    tmp_path, monkeypatch, capsys
):
    """GATHERLAB_RECORD_FLOOR: a per-row model returning its loss and logits is joined (its loss
    as the rows' mean: the floor's first gradient is one call's to float64 rounding); a model
    whose rows meet is refused in one line naming its output and the distance; the blocks are
    GATHERLAB_RECORD_FLOOR_BLOCKS's, refused in one line unless an integer ≥ 2."""
    from gatherlab.recording.recorder import FLOOR_BLOCKS_VARIABLE, FLOOR_VARIABLE

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 3, (8,), generator=generator)
    torch.manual_seed(0)
    whole = _Classifier().double()
    whole(x, labels)["loss"].backward()
    expected = torch.cat([p.grad.reshape(-1) for p in whole.parameters()])
    monkeypatch.setenv(FLOOR_VARIABLE, str(tmp_path / "floor"))
    monkeypatch.setenv(FLOOR_BLOCKS_VARIABLE, "4")
    torch.manual_seed(0)
    _one_floor_update(_Classifier().double(), tmp_path / "run", x, labels)
    floor = format.read(tmp_path / "floor")
    assert floor.row_blocks == 4
    assert float((floor.full_gradient(0) - expected).abs().max()) <= 1e-15
    monkeypatch.setenv(FLOOR_VARIABLE, str(tmp_path / "coupled"))
    with pytest.raises(format.RecordingError, match=r"its output departs from one call's by "):
        _one_floor_update(_Coupled().double(), tmp_path / "run2", x)
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "its rows meet" in said[0]
    monkeypatch.setenv(FLOOR_BLOCKS_VARIABLE, "1")
    with pytest.raises(format.RecordingError, match="GATHERLAB_RECORD_FLOOR_BLOCKS=1"):
        _one_floor_update(_Classifier().double(), tmp_path / "run3", x, labels)


class _AutocastInside(torch.nn.Module):
    """A model whose forward enters bf16 autocast itself, inside its call, as accelerate wraps a
    Trainer's model: a hook on the model's call runs before it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.body(x).float().pow(2).mean()


def test_an_autocast_inside_the_models_call_labels_the_recording_bf16_mixed(tmp_path):
    """The recording's precision is the one the job ran in: bf16-mixed, seen by the hook on the
    model's child, though the model's own call is outside the autocast (a trainer's callback
    gives the rows itself: ``batches=False``)."""
    from gatherlab.recording.recorder import Recorder

    model = _AutocastInside()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(model, optimizer, tmp_path / "run", batches=False) as recorder:
        x = torch.randn(4, 4)
        recorder.batch(x)
        model(x).backward()
        optimizer.step()
    recording = format.read(tmp_path / "run")
    assert recording.header["precision"] == "32-true"  # its parameters'
    assert recording.precision == "bf16-mixed"  # as it ran


class _AutocastLater(torch.nn.Module):
    """Two children; from ``mixed_from`` on, its forward enters bf16 autocast inside its call,
    around its first child only."""

    def __init__(self, mixed_from: int) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)
        self.mixed_from, self.calls = mixed_from, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed = self.calls >= self.mixed_from
        self.calls += 1
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
            hidden = self.first(x).float()
        return self.second(hidden).pow(2).mean()


def test_an_autocast_that_starts_later_inside_the_models_call_is_seen_by_its_first_child(tmp_path):
    """After the first update the autocast's hooks stay on the model and the first child its
    forward called: an autocast that starts at update 2, inside the model's call, around that
    child, labels updates 2 and 3 (none before) and the recording bf16-mixed."""
    from gatherlab.recording.recorder import Recorder

    model = _AutocastLater(mixed_from=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(model, optimizer, tmp_path / "run", batches=False) as recorder:
        for _ in range(4):
            x = torch.randn(4, 4)
            recorder.batch(x)
            optimizer.zero_grad()
            model(x).backward()
            optimizer.step()
    recording = format.read(tmp_path / "run")
    assert [u.autocast for u in recording.updates] == [None, None, "bfloat16", "bfloat16"]
    assert recording.precision == "bf16-mixed"


def test_the_recording_options_are_one_typed_object_every_recorder_reads(tmp_path, capsys):
    """`RecordOptions` is what `gatherlab.record` and both callbacks read: keywords and an
    options object give the same header; a bad value or an unknown keyword is one line."""
    from gatherlab.record import LightningRecorder, RecordOptions

    model = torch.nn.Linear(4, 2).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    chosen = RecordOptions(k=7, seed=3, settings={"lr": 0.1})
    with gatherlab.record(model, optimizer, tmp_path / "by_keywords", k=7, seed=3,
                          settings={"lr": 0.1}):  # fmt: skip
        pass
    with gatherlab.record(model, optimizer, tmp_path / "by_options", options=chosen):
        pass
    headers = [format.read(tmp_path / name).header for name in ("by_keywords", "by_options")]
    assert headers[0] == headers[1] and (headers[0]["k"], headers[0]["seed"]) == (7, 3)
    assert LightningRecorder(tmp_path, options=chosen, trace=True).options == RecordOptions(
        k=7, seed=3, settings={"lr": 0.1}, trace=True
    )
    for given, line in (
        ({"k": 1}, "k=1: the sketch's size per part; allowed: an integer ≥ 2"),
        ({"full_updates": -1}, "full_updates=-1: allowed: an integer ≥ 0, or None"),
        ({"sketch_k": 8}, "sketch_k= is no option of a recording; allowed: batches, full_updates"),
    ):
        with pytest.raises(gatherlab.record.RecordingError) as refused:
            gatherlab.record(model, optimizer, tmp_path / "refused", **given)
        assert str(refused.value).startswith(line)
        assert capsys.readouterr().err.count("\n") == 1
    assert not (tmp_path / "refused").exists()


def test_a_launchers_console_script_is_recorded_as_a_shell_starts_it(tmp_path, monkeypatch):
    """torchrun's agent reads ``python …/bin/torchrun --nproc-per-node 1 job.py`` (its console
    script run by the interpreter its first line names); the recorded command, which the floor's
    command repeats, is the script by its name where the PATH finds it by that name, else by
    its path; a module run with ``-m`` and a Python file stay as they are."""
    from gatherlab.recording.recorder import _as_typed

    script = tmp_path / "bin" / "launch"
    script.parent.mkdir()
    script.write_text("#!/usr/bin/env python\nprint('launch')\n")
    script.chmod(0o755)
    agent = ["/venv/bin/python3.11", str(script), "--nproc-per-node", "1", "job.py"]
    monkeypatch.setenv("PATH", "/nonexistent")
    assert _as_typed(agent) == [str(script), "--nproc-per-node", "1", "job.py"]
    monkeypatch.setenv("PATH", str(script.parent))
    assert _as_typed(agent) == ["launch", "--nproc-per-node", "1", "job.py"]
    module = ["/venv/bin/python", "-m", "torch.distributed.run", "job.py"]
    source = ["/venv/bin/python", str(tmp_path / "job.py"), "--steps", "2"]
    (tmp_path / "job.py").write_text("#!/usr/bin/env python\n")
    (tmp_path / "job.py").chmod(0o755)
    assert _as_typed(module) == module and _as_typed(source) == source


def test_a_recording_left_unclosed_is_said_at_the_processs_exit(tmp_path, capsys):
    """A job that forgot ``close()`` ended with status 0 and an unfinished recording, nothing
    said until a comparison refused it; the exit hook the recorder registers (called here as the
    interpreter's exit calls it) says so in one line, and nothing once the recording is closed."""
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = gatherlab.record(model, optimizer, tmp_path / "rec")
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 3)).pow(2).mean().backward()
        optimizer.step()
    recorder._unclosed()
    assert capsys.readouterr().err.splitlines() == [
        f"gatherlab.record: {tmp_path / 'rec'} is unfinished: the job ended without "
        "recorder.close(), and gatherlab.compare refuses it; allowed: recorder.close() after the "
        "last update on every rank, or `with gatherlab.record(...)`"
    ]
    recorder.close()
    recorder._unclosed()
    assert capsys.readouterr().err == ""
