"""A Lightning ``Trainer`` job recorded by one callback,
``Trainer(callbacks=[LightningRecorder(DIR)])`` (docs/design.md §11, "The Lightning and Hugging
Face callbacks").

The recording is `gatherlab.recording.recorder.Recorder`'s, built when fitting starts over the
LightningModule and its one optimizer. The module is the model: its parts are its top-level
children, a criterion held as a child (``self.criterion = nn.CrossEntropyLoss()``, a learnt
temperature's module) included, and its direct parameters, as the check names them
(`gatherlab.check.training.parts`). Lightning, not the module's forward, says what an update saw:

- the rows: the first tensor (depth first) of every batch ``training_step`` is given
  (``on_train_batch_start``; with ``accumulate_grad_batches = K`` the K batches of one update, in
  order);
- the loss: what ``training_step`` returned for each of them, as Lightning hands it to the
  backward (``on_before_backward``: inside the step's closure, before the gradient is recorded;
  ``on_train_batch_end`` comes after the step). Lightning has divided it by K there and a
  gradient scaler has multiplied it by its scale: both undone (K × (L / K) is L to rounding, exactly
  for K a power of 2; the scale is a power of 2), so that the update's local loss is the mean of
  its micro-batches' losses at every K. Under manual optimization, each ``manual_backward``'s loss;
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

from gatherlab.recording.recorder import Recorder
from gatherlab.recording.sketch import DEFAULT_K

__all__ = ["LightningRecorder"]


class LightningRecorder(L.Callback):
    """Records every optimizer update of a Lightning ``Trainer.fit`` into ``out`` (only rank 0
    writes): each rank's rows and loss, each part's gradient sketch and norm, the first
    ``full_updates`` whole gradients, the final weights (docs/design.md §11, "The format").

    ``k``: the sketch's size per part; ``seed``: the run's seed written into the header (default:
    the one ``lightning.seed_everything`` set, else none); ``settings``: more of the job's
    settings for the header that must agree between two runs, beside the optimizer's and the
    Trainer's own (``max_steps``, ``gradient_clip_val``, ``gradient_clip_algorithm``; not the
    micro-batches, which may differ). The module must configure one optimizer.
    """

    def __init__(
        self,
        out: str | Path,
        *,
        k: int = DEFAULT_K,
        full_updates: int = 1,
        seed: int | None = None,
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        self.out = Path(out)
        self.k, self.full_updates, self.seed = k, full_updates, seed
        self.settings = dict(settings or {})
        self.recorder: Recorder | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(
                f"LightningRecorder records one optimizer; {type(pl_module).__name__}"
                f".configure_optimizers gave {len(trainer.optimizers)}"
            )
        seed = self.seed
        if seed is None and os.environ.get("PL_GLOBAL_SEED", "").lstrip("-").isdigit():
            seed = int(os.environ["PL_GLOBAL_SEED"])  # lightning.seed_everything's
        settings = {
            "trainer": "lightning",
            "max_steps": trainer.max_steps,
            "gradient_clip_val": trainer.gradient_clip_val,
            "gradient_clip_algorithm": trainer.gradient_clip_algorithm,
            **self.settings,
        }
        self.recorder = Recorder(
            pl_module,
            trainer.optimizers[0],
            self.out,
            k=self.k,
            full_updates=self.full_updates,
            seed=seed,
            settings=settings,
            precision=str(trainer.precision),
            batches=False,
            losses=False,
        )

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._recorder().batch(batch)

    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
    ) -> None:
        value = loss.detach()
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:  # 16-mixed: the loss was multiplied by the scale (a power of 2)
            value = value / scaler.get_scale()
        if pl_module.automatic_optimization:
            value = value * trainer.accumulate_grad_batches  # Lightning's division for backward
        self._recorder().loss(value)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        if self.recorder is not None:  # unfinished: the hooks removed, no final record
            self.recorder.__exit__(type(exception), exception, exception.__traceback__)
            self.recorder = None

    def _recorder(self) -> Recorder:
        if self.recorder is None:
            raise RuntimeError(
                "LightningRecorder records Trainer.fit only (its fit has not started)"
            )
        return self.recorder
