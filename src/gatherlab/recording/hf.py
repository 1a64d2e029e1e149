"""A Hugging Face ``Trainer`` job recorded by one callback:
``Trainer(..., callbacks=[HFRecorder(DIR)])`` (docs/recording.md §11, "The Lightning and Hugging
Face callbacks"). Needs the optional extra ``hf`` (``pip install 'gatherlab[hf]'``: transformers
and accelerate); this module is imported only when ``gatherlab.record.HFRecorder`` is first used,
so that ``gatherlab.record`` imports without them.

The recording is `gatherlab.recording.recorder.Recorder`'s, built when training begins over the
model the Trainer trains (its unwrapped module, whatever DDP or accelerate wrap around it) and the
torch optimizer inside accelerate's ``AcceleratedOptimizer``. What an update saw:

- the rows: the model's forward is called with keyword arguments (``model(**inputs)``), so a
  forward pre-hook with keyword arguments takes ``input_ids``, else the first tensor argument
  (positional, then by keyword), each row without its padding (its ``attention_mask``:
  `gatherlab.recording.rows`), of every training forward (``gradient_accumulation_steps = K``:
  the K forwards of one update, in order);
- the loss: the model output's ``loss`` (``.loss``, ``["loss"]`` or the first element of a
  tuple) of each of those forwards, before the Trainer divides it by K for the backward, so that
  the update's local loss is the mean of its micro-batches' losses; or, where the Trainer computes
  the loss outside the model (a sentence-transformers trainer's loss module, a
  ``compute_loss_func``), the output of the loss module given as ``loss=``, whose trainable
  parameters are parts of their own. A model whose output has no loss, with no ``loss=``, stops
  the job at its first update, before any step, in one line;
- the gradient: the one the optimizer steps on, read by the optimizer's step pre-hook, after the
  Trainer's gradient clipping (``max_grad_norm``) and accelerate's unscaling.

Forwards outside training (evaluation, ``model.eval()`` or no gradient) are not recorded.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from gatherlab.recording.callbacks import OneTrainer
from gatherlab.recording.record_options import RecordOptions, record_options
from gatherlab.recording.recorder import Recorder
from gatherlab.recording.refusal import refuse

try:
    from transformers import TrainerCallback
except ImportError as error:  # the optional extra is not installed
    raise ImportError(
        f"gatherlab.record.HFRecorder needs transformers and accelerate ({error}); install them "
        f"with: pip install 'gatherlab[hf]'"
    ) from error

__all__ = ["HFRecorder", "output_loss", "precision_of"]

NO_LOSS = (
    "HFRecorder saw no loss in the model's first training forward: its output carries none, as "
    "where the Trainer computes the loss outside the model (a sentence-transformers trainer, a "
    "compute_loss_func, a Trainer subclass's own compute_loss); allowed: HFRecorder(DIR, "
    "loss=<the loss module the Trainer calls>), a loss function (F.cross_entropy) called "
    "through an nn.Module that wraps it"
)
NOT_CALLED = (
    "HFRecorder saw no loss in the first update: the loss module given as loss= was never called "
    "by the Trainer (another module computes the loss); allowed: HFRecorder(DIR, loss=<the loss "
    "module the Trainer calls>), or no loss= where the model's output carries the loss"
)


def output_loss(output: Any) -> torch.Tensor | None:
    """The loss of a model's output: a ``ModelOutput``'s or mapping's ``loss``, a tuple's first
    element (``return_dict=False``), or the output itself when it is a scalar tensor."""
    if isinstance(output, Mapping):
        loss = output.get("loss")
    elif hasattr(output, "loss"):
        loss = output.loss
    elif isinstance(output, tuple | list) and output:
        loss = output[0]
    else:
        loss = output
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


_TRUE = {torch.float64: "64-true", torch.float32: "32-true", torch.bfloat16: "bf16-true",
         torch.float16: "16-true"}  # fmt: skip


def precision_of(args: Any, model: torch.nn.Module) -> str:
    """The job's precision in Lightning's words: ``bf16-mixed`` and ``16-mixed`` for the Trainer's
    ``bf16``/``fp16`` (autocast), else the parameters' dtype (``64-true`` for float64)."""
    if getattr(args, "bf16", False):
        return "bf16-mixed"
    if getattr(args, "fp16", False):
        return "16-mixed"
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    return _TRUE.get(dtype, str(dtype).removeprefix("torch."))


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (and any wrapper that
    keeps it as ``.optimizer``): its step is the one whose pre-hook sees the gradient."""
    while not type(optimizer).__module__.startswith("torch.") and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        refuse(
            f"HFRecorder records a torch.optim.Optimizer's step; the Trainer's optimizer is a "
            f"{type(optimizer).__name__}, whose step it cannot hook: allowed: an optimizer of "
            f"torch.optim (or a wrapper that holds one as .optimizer)"
        )
    return optimizer


class HFRecorder(OneTrainer, TrainerCallback):
    """Records every optimizer update of a Hugging Face ``Trainer.train`` into ``out`` (only the
    main process writes): each rank's rows and loss, each part's gradient sketch and norm, the
    first ``full_updates`` whole gradients, the final weights (docs/recording.md §11, "The format").

    ``k``: the sketch's size per part; ``seed``: the run's seed written into the header (default:
    ``TrainingArguments.seed``); ``settings``: more of the job's settings for the header that must
    agree between two runs, beside the optimizer's and the Trainer's own (``max_steps``,
    ``max_grad_norm``; not the micro-batches, which may differ); ``trace``: keep each rank's
    operations of the first update's forward, from the model's call to its loss (`Recorder`'s
    ``trace``); ``loss``: the module that computes the loss where the model's output carries none
    (its output recorded per micro-batch, as `gatherlab.record`'s ``loss``).

    Given to a trainer of another kind, it refuses in one line when that trainer first asks it
    for a hook (`gatherlab.recording.callbacks.OneTrainer`)."""

    trainer = "a Hugging Face Trainer (transformers.TrainerCallback)"

    def __init__(
        self,
        out: str | Path,
        *,
        loss: torch.nn.Module | None = None,
        options: RecordOptions | None = None,
        **chosen: Any,
    ) -> None:
        self.out = Path(out)
        self.options = record_options(options, chosen)
        self.loss_module = loss
        self.recorder: Recorder | None = None
        self._hooks: list[Any] = []

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if model is None or optimizer is None:
            refuse(
                "HFRecorder needs the Trainer's model and optimizer at on_train_begin; "
                "allowed: a transformers Trainer, which passes both to its callbacks"
            )
        settings = {
            "trainer": "transformers",
            "max_steps": args.max_steps,
            "max_grad_norm": args.max_grad_norm,
            **self.options.settings,
        }
        self.recorder = Recorder(
            model,
            torch_optimizer(optimizer),
            self.out,
            loss=self.loss_module,
            options=self.options,
            seed=args.seed if self.options.seed is None else self.options.seed,
            settings=settings,
            precision=precision_of(args, model),
            batches=False,
            losses=self.loss_module is not None,  # the loss module's output, by its own hook
        )
        self._hooks = [model.register_forward_pre_hook(self._rows, with_kwargs=True)]
        if self.loss_module is None:
            self._hooks.append(model.register_forward_hook(self._loss, with_kwargs=True))

    def _rows(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self.recorder is not None and module.training and torch.is_grad_enabled():
            self.recorder.batch((args, kwargs))

    def _loss(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self.recorder is not None and module.training and torch.is_grad_enabled():
            loss = output_loss(output)
            if loss is not None:
                self.recorder.loss(loss)  # with ``trace``, the first update's trace ends here
            elif self.recorder.updates == 0 and not self.recorder.seen_loss:
                self._refuse(NO_LOSS)  # the first forward, before its backward

    def _refuse(self, why: str) -> None:
        """The recording abandoned, its hooks removed, and `RecordingError` raised: ``why``."""
        self.recorder.abandon()
        for hook in self._hooks:
            hook.remove()
        self._hooks, self.recorder = [], None
        refuse(why)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        """Before the first step: a job whose update gave the recorder no loss (a ``loss=``
        module the Trainer never calls) stops, in one line, before its weights move."""
        if self.recorder is not None and self.recorder.updates == 0 and not self.recorder.seen_loss:
            self._refuse(NOT_CALLED)

    def on_train_end(self, args, state, control, **kwargs):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None
