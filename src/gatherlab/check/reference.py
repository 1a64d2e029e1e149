"""The one-device reference of a check: the user's plain run, without a process group, whenever
the code runs without one (docs/checking.md §6, §10). Decided here and only here.

The reference runs first as a user's one-GPU script runs it: in this process, no process group
(``no group``). Only when that raises is it run again as rank 0 of a one-rank gloo group
(`gatherlab.ranks.world.alone`, ``one-rank group``): code that asks for its rank, asserts
``dist.is_initialized()`` or calls a collective needs one, and the reference is then the group's
run. When the plain run works, the same run in a one-rank group is compared with it (~10 ms
more): code that does otherwise whenever a group exists (an all_gather under ``torch.no_grad``
that returns its input, with its gradient, when there is no group) trains a user's plain run
differently from a run in a group, a finding of its own (`Reference.group_differs`). The W-rank
runs are judged against the plain run whenever it works.

Everything else the check runs on one device for the same code (the hypotheses' forwards, the
training curve, the removals' references, the step's randomness) runs as the reference ran:
``with one_device(reference.in_group)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from gatherlab.check import measure
from gatherlab.core import cli, gradients
from gatherlab.core.runfiles import Trained
from gatherlab.core.terms import GradientClass, ReferenceMode
from gatherlab.ranks import world

__all__ = [
    "Reference", "choose", "loss_differs", "one_device", "training_differs",
]  # fmt: skip

T = TypeVar("T")


def one_device(in_group: bool) -> contextlib.AbstractContextManager[None]:
    """The setting of a run on one device: a one-rank gloo process group (`world.alone`) when
    the code needs one, else none (the plain run)."""
    return world.alone() if in_group else contextlib.nullcontext()


@dataclass(frozen=True)
class Reference(Generic[T]):
    """A one-device reference as `choose` chose it: its ``value`` (the plain run's, or the
    group's when the code needs a group); ``in_group``, True only when it needs one; ``why``,
    the plain run's error line when it needed one (else empty); ``group_differs``, what differs
    between the run in a one-rank group and the plain run, in words with their numbers (None
    when they agree, or when only one of them could run)."""

    value: T
    in_group: bool = False
    why: str = ""
    group_differs: str | None = None

    @property
    def mode(self) -> ReferenceMode:
        return ReferenceMode.ONE_RANK_GROUP if self.in_group else ReferenceMode.NO_GROUP


def choose(
    run: Callable[[], T], differs: Callable[[T, T], str | None] | None = None
) -> Reference[T]:
    """``run()`` as the one-device reference: without a process group; when that raises, in a
    one-rank group (``in_group``; the plain run's error line is ``why``). When the plain run
    works and ``differs`` is given, ``run()`` again in a one-rank group, and
    ``differs(group's value, plain value)`` is ``group_differs``. When both raise, the plain
    run's error is raised."""
    try:
        with one_device(False):
            plain = run()
    except Exception as error:
        try:
            with one_device(True):
                grouped = run()
        except Exception:
            raise error from None
        return Reference(grouped, in_group=True, why=cli.error_line(error))
    if differs is None:
        return Reference(plain)
    try:
        with one_device(True):
            grouped = run()
    except Exception:  # it runs only without a group: nothing to compare
        return Reference(plain)
    return Reference(plain, group_differs=differs(grouped, plain))


# --- what differs between a run in a one-rank group and the plain run ----------------------------


def _gradient(grouped: torch.Tensor, plain: torch.Tensor) -> str | None:
    """The group's gradient against the plain run's (`gradients.classify` with W = 1), in words;
    None when they agree (the same to 1e-10, or no gradient in either)."""
    if not grouped.any() and not plain.any():
        return None
    if not plain.any():
        return "the gradient in a one-rank group is not zero, while the plain run has none"
    measured, cosine, norm_ratio, _ = gradients.classify(grouped, plain, 1)
    if measured == GradientClass.EXACT:
        return None
    if measured == GradientClass.NONE:
        return "the gradient in a one-rank group is none (norm ratio 0) against the plain run's"
    if measured in (GradientClass.ONE_OVER_W, GradientClass.W):  # W = 1: neither is a factor
        measured = GradientClass.OTHER
    return (
        f"the gradient in a one-rank group is {measured} (cosine {cosine:.3g}, norm ratio "
        f"{norm_ratio:.3g}) against the plain run's"
    )


def _losses(grouped: Sequence[float], plain: Sequence[float], what: str) -> str | None:
    """The group's losses against the plain run's (`gradients.same_forward`), in words; None when
    each is the same to a relative 1e-10."""
    differences = [gradients.same_forward(g, p)[1] for g, p in zip(grouped, plain, strict=True)]
    if all(d <= gradients.FLOAT64_TOLERANCE for d in differences):
        return None
    return f"{what} in a one-rank group differs (relative difference up to {max(differences):.2g})"


def _trained(grouped: Trained, plain: Trained, tolerance: float, steps: str) -> list[str]:
    """A training run in a one-rank group against the plain run: every step's loss and the final
    parameters, each to ``tolerance`` (absolute), in words."""
    found = []
    differences = [abs(g - p) for g, p in zip(grouped.losses, plain.losses, strict=True)]
    first = next((step for step, d in enumerate(differences) if d > tolerance), None)
    if first is not None:
        found.append(
            f"its {steps} depart from step {first} on (max |Δloss| {max(differences):.2g})"
        )
    parameters = gradients.largest_difference(grouped.parameters, plain.parameters)
    if parameters > tolerance:
        found.append(f"its final parameters differ (max |Δ| {parameters:.2g})")
    return found


def loss_differs(
    grouped: tuple[measure.Measured, Trained | None], plain: tuple[measure.Measured, Trained | None]
) -> str | None:
    """A loss's one-device measurement (and training run, with ``steps``) in a one-rank group
    against the plain run's: the loss of each batch compared (relative 1e-10), the gradient
    (`gradients.classify`), every step's loss and the final parameters (1e-10); in words, None when
    they agree."""
    (measured, trained), (reference, reference_trained) = grouped, plain
    found = [
        _losses((measured.loss, *measured.forwards), (reference.loss, *reference.forwards),
                "the loss of the batches compared"),
        _gradient(measured.gradient, reference.gradient),
    ]  # fmt: skip
    if trained is not None and reference_trained is not None:
        found += _trained(
            trained, reference_trained, gradients.FLOAT64_TOLERANCE, "training losses"
        )
    found = [words for words in found if words]
    return "; ".join(found) if found else None


def training_differs(grouped: Trained, plain: Trained, tolerance: float) -> str | None:
    """A training step's one-device run in a one-rank group against the plain run: the first
    gradient (`gradients.classify`), every step's loss and the final parameters (to
    ``tolerance``); in words, None when they agree."""
    found = [_gradient(grouped.first_gradient, plain.first_gradient)]
    found += _trained(grouped, plain, tolerance, "losses")
    found = [words for words in found if words]
    return "; ".join(found) if found else None
