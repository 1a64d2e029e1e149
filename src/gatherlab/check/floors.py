"""The loss check in a low precision (docs/design.md §2, "Low precision"): which losses float64
judges (those that run in it, `gatherlab.runs.precision.in_float64`), their one-device runs in the
precision (as they are, and with the model's forward in row blocks: the floor), and each W's run in
floors of it. `gatherlab.check.api` runs the check; the training check's runs in a low precision
are `gatherlab.check.training`'s, the arithmetic `gatherlab.core.floor`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gatherlab.check import measure
from gatherlab.check.judge import InPrecision
from gatherlab.check.reference import choose
from gatherlab.components.factory import Recipe
from gatherlab.core import cli, floor
from gatherlab.core.runfiles import Trained
from gatherlab.core.terms import Precision
from gatherlab.runs.precision import FLOOR_ROW_BLOCKS, InFloat64, in_float64

__all__ = ["LossFloors", "watched"]


def _one_device(run: Callable[[], Any]) -> Any:
    """``run()`` on one device as the check's reference runs it (`choose`): without a process
    group, or in a one-rank group where the code needs one (a gather's ``all_gather``; before,
    its floor raised "Default process group has not been initialized" as a traceback)."""
    return choose(run).value


def watched(function: Callable[[], Any]) -> InFloat64:
    """`in_float64` of ``function``, an error it raises in float64 as what leaves float64 (the
    reference, run in the precision asked for, says whether the code runs at all)."""
    try:
        return in_float64(function)
    except Exception as error:
        return InFloat64(f"in float64 it raises {cli.error_line(error)}", None)


@dataclass
class LossFloors:
    """A loss check's losses in ``precision``: ``judged_in``, per loss, the precision its verdict
    rests on; ``notes``, per loss that cannot run in float64, the line that leaves it; per loss,
    its one-device run in ``precision`` (``one``) and the floor's perturbed run with its training
    run (``perturbed``). In float64 every loss is judged in float64 and nothing else is run."""

    precision: str
    judged_in: dict[str, str]
    notes: dict[str, str] = field(default_factory=dict)
    one: dict[str, measure.Measured] = field(default_factory=dict)
    perturbed: dict[tuple[str, int], tuple[measure.Measured, Trained | None]] = field(
        default_factory=dict)  # fmt: skip
    """Per loss and row blocks, the floor's perturbed run and its training run, made when a W
    first asks for them (`floor_for`)."""
    make: Callable[[str, int], tuple[measure.Measured, Trained | None]] | None = None

    @property
    def low(self) -> bool:
        """Whether the check runs in a low precision."""
        return self.precision != Precision.FLOAT64

    @classmethod
    def of(
        cls,
        losses: Mapping[str, Recipe],
        model: measure.ModelFactory,
        probed: Sequence[measure.Batch],
        batches: Sequence[measure.Batch],
        optimizer: Callable[..., Any],
        seed: int,
        precision: str,
    ) -> LossFloors:
        """Each loss watched in float64 on the first probed batch, and in a low ``precision`` its
        one-device run there; its floor's perturbed runs (with ``batches``, the steps, their
        training too, for a loss judged in ``precision``) are made for each W when it asks, in as
        many row blocks as its ranks (`floor_for`)."""
        float64 = str(Precision.FLOAT64)
        if precision == float64:
            return cls(precision, dict.fromkeys(losses, float64))
        (view0, view1), further = probed[0], probed[1:]
        seen = {
            name: watched(lambda loss=loss: _one_device(
                lambda: measure.measure(loss, model, view0, view1, seed)))
            for name, loss in losses.items()
        }  # fmt: skip
        judged_in = {name: float64 if w.runs else precision for name, w in seen.items()}
        word = Precision(precision).word
        notes = {
            name: f"it cannot run in float64 ({w.lower}): judged in {word} against a measured floor"
            for name, w in seen.items() if not w.runs
        }  # fmt: skip
        floors = cls(precision, judged_in, notes)
        for name, loss in losses.items():
            floors.one[name] = _one_device(lambda loss=loss: measure.measure(
                loss, model, view0, view1, seed, False, further, precision))  # fmt: skip

        def make(name: str, blocks: int) -> tuple[measure.Measured, Trained | None]:
            loss = losses[name]
            perturbed = _one_device(lambda: measure.measure(
                loss, model, view0, view1, seed, False, further, precision, blocks))  # fmt: skip
            trained = (
                _one_device(lambda: measure.train(loss, model, batches, optimizer, 1, seed,
                                                  precision=precision, row_blocks=blocks))
                if batches and floors.own(name) else None
            )  # fmt: skip
            return perturbed, trained

        floors.make = make
        return floors

    def floor_for(
        self, name: str, world_size: int
    ) -> tuple[int, tuple[measure.Measured, Trained | None]]:
        """The row blocks of W's floor, as many as its ranks (at least `FLOOR_ROW_BLOCKS`), so
        that it is held to `floor.FLOOR_THRESHOLD` floors, and that floor's runs (made once)."""
        blocks = max(FLOOR_ROW_BLOCKS, world_size)
        if (name, blocks) not in self.perturbed:
            self.perturbed[name, blocks] = self.make(name, blocks)
        return blocks, self.perturbed[name, blocks]

    def own(self, name: str) -> bool:
        """Whether the loss is judged in floors of the low precision (it cannot run in float64)."""
        return self.low and self.judged_in[name] == self.precision

    def in_precision(self, name: str, world_size: int) -> InPrecision | None:
        """What the judge needs of a loss judged in its own precision at ``world_size`` (None for
        the others)."""
        if not self.own(name):
            return None
        blocks, runs = self.floor_for(name, world_size)
        return InPrecision(self.precision, *runs, blocks=blocks)

    def beside(self, name: str, measured: measure.Measured, world_size: int) -> floor.Floored:
        """A float64-judged loss's W-rank run in the low precision (``measured``) against its
        one device's there, in floors."""
        blocks, (perturbed, _) = self.floor_for(name, world_size)
        return floor.classify_floored(
            measured.gradient, self.one[name].gradient, perturbed.gradient, self.precision,
            world_size, threshold=floor.threshold(blocks, world_size),
        )  # fmt: skip
