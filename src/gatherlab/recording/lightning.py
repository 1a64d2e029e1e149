"""A Lightning ``Trainer`` job recorded by one callback,
``Trainer(callbacks=[LightningRecorder(DIR)])`` (docs/recording.md §11, "The Lightning and Hugging
Face callbacks").

The recording is `gatherlab.recording.recorder.Recorder`'s, built when fitting starts over the
LightningModule and its one optimizer. The module is the model: its parts are its top-level
children, a criterion held as a child (``self.criterion = nn.CrossEntropyLoss()``, a learnt
temperature's module) included, and its direct parameters, as the check names them
(`gatherlab.check.training.parts`). Lightning, not the module's forward, says what an update saw:

- the rows: the first tensor (depth first) of every batch ``training_step`` is given
  (``on_train_batch_start``; with ``accumulate_grad_batches = K`` the K batches of one update, in
  order);
- the loss: what ``training_step`` returned for each of them, as the module computed it (its
  ``training_step`` wrapped on this instance while fitting, as `gatherlab.runs.fit`'s trace
  wraps it): Lightning divides it by K for the backward and a gradient scaler multiplies it, and
  ``on_train_batch_end``'s ``outputs["loss"]`` comes after the step. The update's local loss is
  the mean of its micro-batches' losses at every K. Under manual optimization, the loss given to
  each ``manual_backward`` (``on_before_backward``, a gradient scaler's scale divided out);
- the gradient: the one the optimizer steps on, after Lightning's precision plugin has unscaled
  it and its gradient clipping (``gradient_clip_val``) has clipped it. Lightning runs the
  forward, the backward and the clipping inside ``optimizer.step(closure)`` (the closure), so the
  recorder reads the gradient when that closure returns, not when ``step`` is entered
  (`Recorder`'s step pre-hook wraps a closure it is given). With a gradient scaler (``16-mixed``
  on a GPU) Lightning runs the closure, unscales and clips before ``step``, which the pre-hook
  then sees directly.

A fit that raises leaves the recording unfinished (no ``final.json``), every update it finished
readable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch

from gatherlab.recording.callbacks import OneTrainer
from gatherlab.recording.record_options import RecordOptions, record_options
from gatherlab.recording.recorder import Recorder
from gatherlab.recording.refusal import refuse

__all__ = ["LightningRecorder"]


class LightningRecorder(OneTrainer, L.Callback):
    """Records every optimizer update of a Lightning ``Trainer.fit`` into ``out`` (only rank 0
    writes): each rank's rows and loss, each part's gradient sketch and norm, the first
    ``full_updates`` whole gradients, the final weights (docs/recording.md §11, "The format").

    ``k``: the sketch's size per part; ``seed``: the run's seed written into the header (default:
    the one ``lightning.seed_everything`` set, else none); ``settings``: more of the job's
    settings for the header that must agree between two runs, beside the optimizer's and the
    Trainer's own (``max_steps``, ``gradient_clip_val``, ``gradient_clip_algorithm``; not the
    micro-batches, which may differ); ``trace``: keep each rank's operations of the first
    update's forward, from its batch to the loss it backpropagates (`Recorder`'s ``trace``). The
    module must configure one optimizer. Given to a trainer of another kind, it refuses in one
    line when that trainer first asks it for a hook (`gatherlab.recording.callbacks.OneTrainer`).
    """

    trainer = "a Lightning Trainer (lightning.Callback)"

    def __init__(
        self,
        out: str | Path,
        *,
        options: RecordOptions | None = None,
        **chosen: Any,
    ) -> None:
        self.out = Path(out)
        self.options = record_options(options, chosen)
        self.recorder: Recorder | None = None
        self._wrapped: Any = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            refuse(
                f"LightningRecorder records one optimizer; {type(pl_module).__name__}"
                f".configure_optimizers gave {len(trainer.optimizers)}; allowed: one optimizer"
            )
        seed = self.options.seed
        if seed is None and os.environ.get("PL_GLOBAL_SEED", "").lstrip("-").isdigit():
            seed = int(os.environ["PL_GLOBAL_SEED"])  # lightning.seed_everything's
        settings = {
            "trainer": "lightning",
            "max_steps": trainer.max_steps,
            "gradient_clip_val": trainer.gradient_clip_val,
            "gradient_clip_algorithm": trainer.gradient_clip_algorithm,
            **self.options.settings,
        }
        self.recorder = Recorder(
            pl_module,
            trainer.optimizers[0],
            self.out,
            options=self.options,
            seed=seed,
            settings=settings,
            precision=str(trainer.precision),
            batches=False,
            losses=False,
        )
        if pl_module.automatic_optimization:
            self._record_losses(pl_module)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._recorder().batch(batch)

    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
    ) -> None:
        if pl_module.automatic_optimization:
            return  # the loss training_step returned is recorded (`_record_losses`)
        value = loss  # manual optimization: the loss given to manual_backward
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:  # 16-mixed: the loss was multiplied by the scale (a power of 2)
            value = value / scaler.get_scale()
        self._recorder().loss(value)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore(pl_module)
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._restore(pl_module)
        if self.recorder is not None:  # unfinished: the hooks removed, no final record
            self.recorder.__exit__(type(exception), exception, exception.__traceback__)
            self.recorder = None

    def _record_losses(self, pl_module: L.LightningModule) -> None:
        """Wraps this instance's ``training_step`` (automatic optimization) so that the loss it
        returns goes to the recorder as the module computed it: before Lightning divides it by
        ``accumulate_grad_batches`` and a gradient scaler multiplies it, inside the step's closure
        (before the gradient is recorded), and, with ``trace``, the tensor the trace ends at.
        ``on_train_batch_end``'s ``outputs["loss"]`` would come after the step, divided by K."""
        step, recorder = pl_module.training_step, self._recorder()

        def training_step(*args: Any, **kwargs: Any) -> Any:
            output = step(*args, **kwargs)
            loss = output.get("loss") if isinstance(output, Mapping) else output
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                recorder.loss(loss)
            return output

        pl_module.training_step = training_step  # the instance's, until fitting ends
        self._wrapped = training_step

    def _restore(self, pl_module: L.LightningModule) -> None:
        if self._wrapped is not None:
            if vars(pl_module).get("training_step") is self._wrapped:
                del pl_module.training_step
            self._wrapped = None

    def _recorder(self) -> Recorder:
        if self.recorder is None:
            raise RuntimeError(
                "LightningRecorder records Trainer.fit only (its fit has not started)"
            )
        return self.recorder
