"""What the two trainer callbacks share: each is one trainer's callback, and a trainer of another
kind asks it for hooks it does not have (a Hugging Face ``Trainer`` asks a Lightning callback for
``on_init_end`` when it is built, a Lightning ``Trainer`` asks a Hugging Face callback for
``setup`` when fitting starts). `OneTrainer` answers that first question with the refusal in one
line, which names the callback that trainer takes, before any training; once refused, the
trainer's own clean-up (Lightning asks every callback for ``on_exception``) gets hooks that do
nothing, so that the refusal is the one error it raises."""

from __future__ import annotations

from typing import Any

from gatherlab.recording.refusal import refuse

__all__ = ["OneTrainer"]

_CALLBACKS = (
    "gatherlab.record.LightningRecorder(DIR) for a Lightning Trainer, "
    "gatherlab.record.HFRecorder(DIR) for a Hugging Face (or sentence-transformers) Trainer, "
    "gatherlab.record(model, optimizer, DIR) in a loop of one's own"
)


class OneTrainer:
    """A mixin of a trainer's callback: ``trainer`` names the trainer it hooks (for the refusal).
    A hook it lacks, asked for by another trainer, is refused once (`refusal.refuse`)."""

    trainer = "a trainer"

    def __getattr__(self, name: str) -> Any:  # only for names the callback does not have
        if name.startswith("__") or name.startswith("_"):
            raise AttributeError(name)
        if self.__dict__.get("_refused"):  # the trainer's clean-up after the refusal
            return _nothing
        self.__dict__["_refused"] = True
        refuse(
            f"{type(self).__name__} is a callback of {self.trainer}, and this trainer asks it for "
            f"{name!r}, a hook of another kind of trainer: it cannot record this trainer; "
            f"allowed: {_CALLBACKS}"
        )


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None
