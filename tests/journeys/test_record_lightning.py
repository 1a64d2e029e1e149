"""A Lightning ``Trainer`` job recorded with one callback (`gatherlab.record.LightningRecorder`):
what it records is what Lightning trained on, and the same job at one rank and at two records
the same updates.

One device trains in the test process; two ranks train on gatherlab's warm pool (real gloo
ranks, `gatherlab.ranks.launch.fit`), which costs no new interpreters.
"""

from __future__ import annotations

import sys

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import line_of
from torch import nn
from torch.utils.data import DataLoader, default_collate

from gatherlab.compare import compare
from gatherlab.ranks import launch
from gatherlab.record import LightningRecorder, read
from gatherlab.recording.rows import row_digests
from gatherlab.runs.fit import ItemsDataModule

pytestmark = pytest.mark.slow

FEATURES, HIDDEN, CLASSES, SAMPLES = 6, 12, 3, 48
CLIP = 0.05  # far below the gradient's norm at the start (asserted), so every update is clipped


class TemperedCrossEntropy(nn.Module):
    """Cross-entropy of the logits divided by a learnt temperature: a criterion with a parameter,
    held by the module as a child (a part of its own, ``criterion``)."""

    def __init__(self) -> None:
        super().__init__()
        self.log_temperature = nn.Parameter(torch.tensor(0.3))

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits / self.log_temperature.exp(), labels)


class Classifier(L.LightningModule):
    """Three parts: ``encoder``, ``head`` and its criterion; the same initial weights each time.
    ``seen``: every loss ``training_step`` returned, in order (what the recording must hold)."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.encoder = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh())
            self.head = nn.Linear(HIDDEN, CLASSES)
        self.criterion = TemperedCrossEntropy()
        self.seen: list[float] = []

    def training_step(self, batch, batch_idx):
        inputs, labels = batch
        loss = self.criterion(self.head(self.encoder(inputs)), labels)
        self.seen.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class Points(torch.utils.data.Dataset):
    """``SAMPLES`` fixed float64 points with a label each."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(7)
        self.inputs = torch.randn(SAMPLES, FEATURES, generator=generator, dtype=torch.float64)
        self.labels = torch.randint(0, CLASSES, (SAMPLES,), generator=generator)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int):
        return self.inputs[index], self.labels[index]


def _quiet_trainer(**options) -> L.Trainer:
    launch.quiet_frameworks()
    return L.Trainer(
        accelerator="cpu", devices=1, precision="64-true", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        **options,
    )  # fmt: skip


def _flat_gradient(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in module.parameters()])


def test_the_recording_holds_each_update_s_rows_losses_and_its_clipped_accumulated_gradient(
    tmp_path,
):
    """accumulate_grad_batches = 2, gradient_clip_val and trace: each update's rows are its two
    micro-batches' inputs in order, its loss the mean of the two losses ``training_step`` returned
    (not Lightning's, divided by 2 for the backward), and its gradient the one the optimizer steps
    on, clipped: Lightning clips inside the step's closure, after the step's pre-hook has run, so
    the recorder must read it when the closure returns. The first update's whole gradient is
    computed here by hand: the gradient of the mean of the micro-batch losses, scaled as
    ``torch.nn.utils.clip_grad_norm_`` scales it. The trace of the first update's forward names
    this file's line of the cross-entropy."""
    data, module, steps = Points(), Classifier(), 3
    start = Classifier().double()  # the same initial weights, untrained
    trainer = _quiet_trainer(
        max_steps=steps, accumulate_grad_batches=2, gradient_clip_val=CLIP,
        callbacks=[LightningRecorder(tmp_path, seed=3, trace=True)],
    )  # fmt: skip
    trainer.fit(module, DataLoader(data, batch_size=4))
    recording = read(tmp_path)

    assert recording.parts == ["encoder", "head", "criterion"]
    assert recording.header["precision"] == "64-true" and recording.header["seed"] == 3
    assert recording.header["settings"]["gradient_clip_val"] == CLIP
    assert len(recording.updates) == steps and len(module.seen) == 2 * steps
    for update in recording.updates:
        u = update.index
        assert update.rows == [row_digests(data.inputs[8 * u : 8 * u + 8])]
        assert update.loss == float(np.mean(module.seen[2 * u : 2 * u + 2]))
    assert "training_step" not in vars(module)  # the recorder's wrapper gone with the fit

    micro_batches = [(data.inputs[i : i + 4], data.labels[i : i + 4]) for i in (0, 4)]
    for inputs, labels in micro_batches:
        (start.criterion(start.head(start.encoder(inputs)), labels) / 2).backward()
    gradient = _flat_gradient(start)
    norm = float(torch.linalg.vector_norm(gradient))
    assert norm > 10 * CLIP  # the clipping is not a no-op
    expected = gradient * min(1.0, CLIP / (norm + 1e-6))
    recorded = recording.full_gradient(0)
    assert float((recorded - expected).abs().max()) <= 1e-12 * float(expected.abs().max())
    first = recording.updates[0]
    total = np.sqrt(sum(value**2 for value in first.norms.values()))
    assert total == pytest.approx(float(torch.linalg.vector_norm(expected)), rel=1e-12)

    # trace=True: the first update's forward, from its batch to the loss Lightning backpropagates
    (ops,) = recording.trace()
    assert ops[0].name == "input" and any(op.returned for op in ops)
    (cross_entropy,) = [op for op in ops if op.name.endswith("cross_entropy")]
    assert cross_entropy.where == line_of(sys.modules[__name__], "F.cross_entropy(")
    assert cross_entropy.grad is not None


class ManualClassifier(Classifier):
    """The same module under manual optimization: its own backward and step in each
    ``training_step``, the loss it backpropagates its own."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        inputs, labels = batch
        loss = self.criterion(self.head(self.encoder(inputs)), labels)
        self.seen.append(float(loss.detach()))
        self.manual_backward(loss)
        optimizer.step()
        return loss


def test_under_manual_optimization_the_loss_is_manual_backward_s_and_the_step_s_gradient(tmp_path):
    """``automatic_optimization = False``: the module's own ``manual_backward`` and step; each
    update's loss is the one it backpropagated and its gradient the one its step took (the first
    computed here by hand: the gradient of the first batch's loss at the initial weights)."""
    data, module, steps = Points(), ManualClassifier(), 2
    start = Classifier().double()
    trainer = _quiet_trainer(max_steps=steps, callbacks=[LightningRecorder(tmp_path)])
    trainer.fit(module, DataLoader(data, batch_size=4))
    recording = read(tmp_path)
    assert [u.loss for u in recording.updates] == module.seen
    assert [u.rows for u in recording.updates] == [
        [row_digests(data.inputs[4 * u : 4 * u + 4])] for u in range(steps)
    ]
    start.criterion(start.head(start.encoder(data.inputs[:4])), data.labels[:4]).backward()
    expected = _flat_gradient(start)
    recorded = recording.full_gradient(0)
    assert float((recorded - expected).abs().max()) <= 1e-12 * float(expected.abs().max())


def _record(out, world_size: int, steps: int) -> None:
    data = ItemsDataModule(
        Points(), global_batch_size=8, steps=steps, seed=5, shuffle=True, seeded=False,
        collate_fn=default_collate,
    )  # fmt: skip
    callbacks = [LightningRecorder(out, full_updates=steps)]
    launch.fit(Classifier(), data, world_size, "64-true", steps, callbacks)


def test_one_rank_and_two_ranks_record_the_same_updates(tmp_path):
    """The same job (the same global batches, each rank its slice) on one device and on two gloo
    ranks: the same rows of every update (rank 0's then rank 1's are one device's, in order), the
    same global loss, the same sketch of every part's gradient and the same final weights, to
    float64 rounding; at W = 2 no part is left unreduced (DDP averaged every gradient); and
    `gatherlab.compare` judges the two ``exact``."""
    steps = 3
    for world_size in (1, 2):
        _record(tmp_path / f"w{world_size}", world_size, steps)
    one, two = read(tmp_path / "w1"), read(tmp_path / "w2")
    assert (one.world_size, two.world_size) == (1, 2)
    assert one.parts == two.parts == ["encoder", "head", "criterion"]
    assert len(one.updates) == len(two.updates) == steps
    for a, b in zip(one.updates, two.updates, strict=True):
        assert len(b.rows) == 2 and b.rows[0] + b.rows[1] == a.rows[0]
        assert len(b.losses) == 2 and b.unreduced == {}
        assert abs(a.loss - b.loss) <= 1e-10 * abs(a.loss)
        for part in one.parts:
            scale = float(np.abs(a.sketches[part]).max())
            assert float(np.abs(a.sketches[part] - b.sketches[part]).max()) <= 1e-10 * scale
            assert b.norms[part] == pytest.approx(a.norms[part], rel=1e-10)
        difference = (one.full_gradient(a.index) - two.full_gradient(b.index)).abs().max()
        assert float(difference) <= 1e-10 * float(one.full_gradient(a.index).abs().max())
    for part in one.parts:
        scale = float(np.abs(one.weights_sketch[part]).max())
        assert float(np.abs(one.weights_sketch[part] - two.weights_sketch[part]).max()) <= (
            1e-10 * scale
        )
    comparison = compare(one, two)  # python -m gatherlab.compare's judgement of the same
    assert (comparison.verdict, comparison.status, comparison.data) == ("exact", 0, None), (
        comparison.words
    )


class CalledClassifier(Classifier):
    """The classifier in float32 whose ``training_step`` calls the module itself (``self(x)``,
    its ``forward``: the encoder and the head), as many LightningModules do."""

    def __init__(self) -> None:
        super().__init__()
        self.float()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(inputs))

    def training_step(self, batch, batch_idx):
        inputs, labels = batch
        return self.criterion(self(inputs.float()), labels)


class PartsClassifier(CalledClassifier):
    """The same, its training_step calling the module's parts itself (never its forward)."""

    def training_step(self, batch, batch_idx):
        inputs, labels = batch
        return self.criterion(self.head(self.encoder(inputs.float())), labels)


def _record_float32(out, world_size: int, module: L.LightningModule) -> None:
    data = ItemsDataModule(
        Points(), global_batch_size=8, steps=3, seed=5, shuffle=True, seeded=False,
        collate_fn=default_collate,
    )  # fmt: skip
    launch.fit(module, data, world_size, "32-true", 3, [LightningRecorder(out)])


def test_the_floor_through_the_lightning_callback_cuts_the_modules_forward(
    tmp_path, monkeypatch, capsys
):
    """GATHERLAB_RECORD_FLOOR with LightningRecorder: the LightningModule's forward, which its
    training_step calls, in two row blocks; two ranks in float32 are then exact within float32.
    A module whose training_step never calls its forward is refused before the first step, in
    one line that says what works instead."""
    from gatherlab.recording.format import RecordingError
    from gatherlab.recording.recorder import FLOOR_VARIABLE

    _record_float32(tmp_path / "w2", 2, CalledClassifier())  # before the variable is set
    _record_float32(tmp_path / "w1", 1, CalledClassifier())
    monkeypatch.setenv(FLOOR_VARIABLE, str(tmp_path / "w1-floor"))
    _record_float32(tmp_path / "w1", 1, CalledClassifier())
    floor = read(tmp_path / "w1-floor")
    assert (floor.header["row_blocks"], floor.precision) == (2, "32-true")
    judged = compare(tmp_path / "w1", tmp_path / "w2", floor=tmp_path / "w1-floor")
    assert (judged.verdict, judged.status) == ("exact within float32", 0), judged.words
    capsys.readouterr()
    monkeypatch.setenv(FLOOR_VARIABLE, str(tmp_path / "parts-floor"))
    with pytest.raises(RecordingError, match="the first update never called the model's forward"):
        _record_float32(tmp_path / "parts", 1, PartsClassifier())
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith("gatherlab.record: GATHERLAB_RECORD_FLOOR=")
