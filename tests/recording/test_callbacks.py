"""The recorder's refusals of what it cannot hook, each one line before any training: a trainer
given as the model, an optimizer with no step, a trainer's callback given to a trainer of another
kind (each trainer's own construction calls it, as it does), and a Hugging Face job whose loss the
recorder cannot see (docs/recording.md §11, "The Lightning and Hugging Face callbacks")."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import lightning as L
import pytest
import torch

import gatherlab.record
from gatherlab.recording.format import RecordingError, read

needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="needs the hf extra: pip install 'gatherlab[hf]'",
)
ARGS = SimpleNamespace(max_steps=1, max_grad_norm=1.0, seed=0, bf16=False, fp16=False)


def test_a_trainer_given_as_the_model_and_an_optimizer_without_a_step_are_refused(tmp_path):
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    model = torch.nn.Linear(3, 2)
    trainer_is_the_model = (
        r"model is a lightning\.pytorch\.trainer\.trainer\.Trainer, not a torch\.nn\.Module"
        r".*LightningRecorder"
    )
    with pytest.raises(RecordingError, match=trainer_is_the_model):
        gatherlab.record(trainer, torch.optim.SGD(model.parameters(), lr=0.1), tmp_path / "a")
    with pytest.raises(RecordingError, match=r"optimizer is a builtins\.dict, which has no step"):
        gatherlab.record(model, {"lr": 0.1}, tmp_path / "b")
    stages = [model, torch.nn.Linear(2, 2)]  # a rank's two stages, as a list of model parts
    with pytest.raises(RecordingError, match=r"model is a list of 2 modules \(a rank's stages\?\)"
                       r".*allowed: one module holding them under one device's names"):  # fmt: skip
        gatherlab.record(stages, torch.optim.SGD(model.parameters(), lr=0.1), tmp_path / "c")
    # a loss given by name: was a traceback from the parameters' names, 74 lines under torchrun
    with pytest.raises(RecordingError, match=r"loss is a builtins\.str, not a torch\.nn\.Module"
                       r".*allowed: the loss module the job calls"):  # fmt: skip
        gatherlab.record(model, torch.optim.SGD(model.parameters(), lr=0.1), tmp_path / "d",
                         loss="mse")  # fmt: skip
    assert not any((tmp_path / name).exists() for name in "abcd")
    (tmp_path / "notes.txt").write_text("mine")  # a file where the directory goes: an OSError's
    with pytest.raises(RecordingError, match=r"cannot write a recording into .*notes\.txt "
                       r"\(FileExistsError: .*\); allowed: a directory, new or empty"):  # fmt: skip
        gatherlab.record(model, torch.optim.SGD(model.parameters(), lr=0.1), tmp_path / "notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "mine"


@needs_transformers
def test_each_callback_in_a_trainer_of_the_other_kind_is_refused_when_the_trainer_is_built(
    tmp_path,
):
    from transformers.trainer_callback import CallbackHandler, TrainerControl, TrainerState

    handler = CallbackHandler([gatherlab.record.LightningRecorder(tmp_path / "l")], None, None,
                              None, None)  # fmt: skip
    with pytest.raises(RecordingError) as refused:  # what transformers.Trainer() calls first
        handler.on_init_end(ARGS, TrainerState(), TrainerControl())
    assert str(refused.value).startswith(
        "LightningRecorder is a callback of a Lightning Trainer (lightning.Callback), and this "
        "trainer asks it for 'on_init_end', a hook of another kind of trainer"
    )
    assert "HFRecorder(DIR) for a Hugging Face" in str(refused.value)
    with pytest.raises(
        RecordingError, match=r"^HFRecorder is a callback of a Hugging Face Trainer"
    ):
        L.Trainer(callbacks=[gatherlab.record.HFRecorder(tmp_path / "h")], logger=False,
                  enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    assert not (tmp_path / "l").exists() and not (tmp_path / "h").exists()


@needs_transformers
def test_a_model_without_a_loss_stops_at_its_first_forward_in_one_line(tmp_path):
    """HFRecorder without ``loss=`` on a trainer that computes the loss outside the model: the
    model's first training forward (called here as the Trainer calls it) stops the job before
    its backward, the recording left unfinished, its hooks removed."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = gatherlab.record.HFRecorder(tmp_path / "run")
    recorder.on_train_begin(ARGS, None, None, model=model, optimizer=optimizer)
    with pytest.raises(RecordingError, match=r"no loss in the model's first training forward"):
        model(torch.randn(4, 3))
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()  # the recorder's hooks are gone: nothing more is recorded
    assert recorder.recorder is None and (tmp_path / "run" / "updates.jsonl").read_text() == ""
    with pytest.raises(RecordingError, match="unfinished"):
        read(tmp_path / "run")


@needs_transformers
def test_a_loss_module_the_trainer_never_calls_stops_before_the_first_step(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = gatherlab.record.HFRecorder(tmp_path / "run", loss=torch.nn.MSELoss())
    recorder.on_train_begin(ARGS, None, None, model=model, optimizer=optimizer)
    model(torch.randn(4, 3)).pow(2).mean().backward()  # another loss than the one given
    with pytest.raises(RecordingError, match=r"the loss module given as loss= was never called"):
        recorder.on_pre_optimizer_step(ARGS, None, None)
    assert recorder.recorder is None
