"""The check of a training step (docs/design.md §10): a user's ``LightningModule`` and data set
trained N steps on W ranks of the warm pool and on one device, compared step by step; when a W is
not exact, the same again with each removal that applies made (``gatherlab.check.removals``) and
with all of them made, and the culprits named: the removals that make it exact.

``gatherlab.check.check_training`` is the API and ``python -m gatherlab.check --module`` the
command line; this module trains and compares, and says nothing in words.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

from gatherlab.check import hypotheses, measure, removals, steprun
from gatherlab.check.diagnosis import ALL_PARTS, TRAIN_COLUMN, verdict
from gatherlab.check.diagnosis import COLUMNS as LOSS_COLUMNS
from gatherlab.components.factory import Recipe
from gatherlab.core import cli, terms
from gatherlab.core.runfiles import Trained
from gatherlab.ranks import world
from gatherlab.ranks.external import ranks_for
from gatherlab.ranks.pool import RankError

EXACT = terms.GradientClass.EXACT

COLUMNS = (
    *LOSS_COLUMNS, TRAIN_COLUMN, "removed", "culprits", "first_diff_step", "max_abs_param_diff",
)  # fmt: skip

__all__ = [
    "COLUMNS", "Setting", "check", "reference",
    "validate",
]  # fmt: skip


@dataclass(frozen=True)
class Setting:
    """What is trained: a ``LightningModule`` (``module``) or a plain PyTorch step (``step``: its
    function, model and optimizer), and the data set, as factories built inside each rank; and
    the run's size (``steps`` optimizer steps of ``global_batch_size`` samples, ``precision``)."""

    module: Recipe | None
    data: Recipe
    name: str
    global_batch_size: int
    steps: int
    seed: int
    precision: str
    step: steprun.Step | None = None

    @property
    def label(self) -> str:
        """How the command line names what is trained (``--module M`` or ``--step S``)."""
        return f"--step {self.name}" if self.step is not None else f"--module {self.name}"

    def checked(self, built: Any) -> torch.nn.Module:
        """What the module's or the model's factory built, when it keeps its contract (a
        LightningModule with ``training_step`` and ``configure_optimizers``; an ``nn.Module``);
        a ValueError of one line otherwise."""
        if self.step is not None:
            if not isinstance(built, torch.nn.Module):
                raise ValueError(
                    f"--model {self.step.model.name} returned a {type(built).__name__}; "
                    "allowed: a torch.nn.Module"
                )
            return built
        from gatherlab.check import usermodule  # Lightning: only for a LightningModule

        return usermodule.check_module(built, self.label)


def _same(a: Any, b: Any) -> bool:
    """Whether two data set items are equal (tensors, arrays, numbers, nested containers)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.shape == b.shape and bool(np.array_equal(a, b))
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _draws_randomness(data: Any) -> bool:
    """Whether the data set's items depend on the global random streams: item 0 read twice under
    two different seeds of them."""
    first = removals.PerSample(data, seed=1, seeded=True)[(0, 0)]
    second = removals.PerSample(data, seed=2, seeded=True)[(0, 0)]
    return not _same(first, second)


def _top_level(name: str) -> str:
    """A parameter's part in a training step's check: the module's child that holds it (its
    backbone, projection head, criterion, …), or the parameter itself when the module holds it
    directly."""
    return name.split(".", 1)[0]


def parts(module: torch.nn.Module) -> measure.Layout:
    """The parts of the first step's gradient (its trainable parameters in order, as
    ``StepRecorder`` flattens them): each top-level child module, and each direct parameter."""
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    return measure.layout(trainable, _top_level)


def validate(
    setting: Setting, world_sizes: Sequence[int]
) -> tuple[tuple[removals.Removal, ...], measure.Layout]:
    """Build the module and the data set here (rank 0 of 1) and check what can be checked before
    any rank starts; a ValueError of one line otherwise. Returns the removals that apply (the
    module's batch norms and dropout layers, the data set's own randomness) and the parts of the
    module's gradient (`parts`)."""
    if setting.precision not in terms.PRECISIONS:
        allowed = ", ".join(terms.PRECISIONS)
        raise ValueError(f"--precision {setting.precision!r} is not allowed; allowed: {allowed}")
    for key, value, minimum in (
        ("--steps", setting.steps, 1), ("--global-batch-size", setting.global_batch_size, 1),
    ):  # fmt: skip
        if not terms.is_integer(value, minimum):
            allowed = terms.allowed_integer(minimum)
            raise ValueError(f"{key} {value!r} is not allowed; allowed: {allowed}")
    recipe = setting.module if setting.step is None else setting.step.model
    label = setting.label if setting.step is None else f"--model {recipe.name}"
    try:
        built = recipe()
    except Exception as error:
        raise ValueError(f"{label}: cannot be built: {type(error).__name__}: {error}") from None
    module = setting.checked(built)
    try:
        data = setting.data()
    except Exception as error:
        raise ValueError(f"--data: cannot be built: {type(error).__name__}: {error}") from None
    size, batch = steprun.data_size(data, "--data"), setting.global_batch_size
    if batch > size:
        raise ValueError(
            f"--global-batch-size {batch} exceeds the {size} samples of the data set; allowed: at "
            f"most {size}"
        )
    measure.check_world_sizes(world_sizes, batch, f"--global-batch-size {batch}")
    applies = {
        removals.Removal.BATCHNORM: bool(removals.batch_norms(module)),
        removals.Removal.DROPOUT: bool(removals.dropouts(module)),
        removals.Removal.DATA_RANDOMNESS: _draws_randomness(data),
    }
    return tuple(removal for removal in removals.Removal if applies[removal]), parts(module)


def _train(setting: Setting, removed: str, world_size: int) -> Trained:
    """The run that makes the removals ``removed`` names on one device (in this process) or on W
    ranks of the pool."""
    arguments = (
        setting.module, setting.data, removals.Removals.named(removed), setting.global_batch_size,
        setting.steps, setting.seed, setting.precision,
    )  # fmt: skip
    if setting.step is not None:
        function, arguments = steprun.train_on_rank, (setting.step, *arguments[1:])
    else:
        from gatherlab.check import usermodule  # Lightning: only for a LightningModule

        function = usermodule.train_on_rank
    if world_size == 1:
        with world.alone():  # the module may ask for its rank or call a collective
            return function(*arguments)
    return ranks_for(world_size).run(function, *arguments)[0]


def _compare(
    run: Trained, reference: Trained, world_size: int, tolerance: float, layout: measure.Layout
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A W-rank run against its 1-device reference: the row's numbers and its verdict, and the
    numbers of each part of the first gradient when it has several. Losses that are c × one
    device's at every step are compared divided by c (``loss scaled`` when the rest is exact)."""
    scale = hypotheses.scale(run.losses, reference.losses, tolerance)
    factor = scale or 1.0
    differences = [abs(a / factor - b) for a, b in zip(run.losses, reference.losses, strict=True)]
    first = next((step for step, d in enumerate(differences) if d > tolerance), None)
    same, loss_diff = measure.same_forward(run.losses[0], reference.losses[0])
    forward = terms.Forward.SAME if same else terms.Forward.DIFFERS
    classified = measure.classify(run.first_gradient, reference.first_gradient, world_size)
    gradient = classified[0]
    parameters = float((run.parameters - reference.parameters).abs().max())
    if first is None and parameters <= tolerance and gradient == EXACT:
        verdict_ = EXACT if scale is None else terms.LOSS_SCALED
    elif not same:
        verdict_ = terms.LOSS_DIFFERS
    elif gradient != EXACT:
        verdict_ = gradient
    else:  # the first step agrees, a later one does not
        verdict_ = terms.DIVERGES
    numbers = {
        # the table holds the words as plain strings (each a member's value)
        "forward": str(forward),
        "verdict": str(verdict_),
        "scale": scale,
        "cause": str(terms.Cause.SCALED) if scale is not None else "",
        "loss_diff": loss_diff,
        "error": "",
        TRAIN_COLUMN: max(differences),
        "first_diff_step": first,
        "max_abs_param_diff": parameters,
        **_gradient_numbers(classified),
    }
    by_part = []
    total = sum(stop - start for ranges in layout.values() for start, stop in ranges)
    classified_parts = {}
    if len(run.first_gradient) == total:  # the removals keep the module's parameters
        classified_parts = measure.classify_parts(
            run.first_gradient, reference.first_gradient, layout, world_size
        )
    if gradient == terms.GradientClass.BIASED and measure.single_factors(classified_parts):
        numbers["cause"] = str(terms.Cause.PARTS)
    if classified_parts:
        for part, part_numbers in classified_parts.items():
            by_part.append({
                "part": part, **_gradient_numbers(part_numbers),
                "verdict": str(verdict(forward, part_numbers[0], scale)),
            })  # fmt: skip
    return numbers, by_part


def _gradient_numbers(classified: tuple[str, float, float, float]) -> dict[str, Any]:
    gradient, cosine, norm_ratio, max_rel_err = classified
    return {"gradient": str(gradient), "cosine": cosine, "norm_ratio": norm_ratio,
            "max_rel_err": max_rel_err}  # fmt: skip


def _culprits(
    verdicts: dict[str, str], applying: Sequence[removals.Removal], step_random: bool
) -> list[str]:
    """The removals that alone make the run exact or change its verdict; when none does but all
    of them together do, all of them; when all of them leave it inexact, ``step_randomness`` if
    the step draws from the global random streams (``step_random``), else ``loss``."""
    kept = verdicts[removals.NONE]
    found = [r for r in applying if verdicts[r] == EXACT or verdicts[r] != kept]
    if len(applying) > 1:
        everything = verdicts[removals.ALL]
    else:
        everything = verdicts[applying[0]] if applying else kept
    if not found and everything == EXACT:
        found = list(applying)
    if everything != EXACT:
        found.append(removals.STEP_RANDOMNESS if step_random else removals.LOSS)
    return found


def step_draws_randomness(setting: Setting) -> bool:
    """Whether the training step draws from the global random streams (``random``, ``numpy``,
    ``torch``): the first step's loss on one device, computed twice from the same weights and the
    same global batch, with only the streams' seed changed. Dropout layers are off for it (they
    are a removal of their own); a step that cannot run outside training says no."""
    recipe = setting.module if setting.step is None else setting.step.model
    data = setting.data()
    if setting.step is not None:
        collate = getattr(data, "collate_fn", None)
    else:
        from gatherlab.check import usermodule  # Lightning: only for a LightningModule

        collate = usermodule.collate_fn_of(recipe(), data)
    batch = steprun.first_batch(data, setting.global_batch_size, setting.seed, collate)
    batch = steprun.as_precision(batch, setting.precision)
    values = []
    with world.alone(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log outside a Trainer
        for streams in (1, 2):
            module = setting.checked(recipe())
            removals.Removals(dropout=True).apply(module)
            if setting.precision == terms.Precision.FLOAT64:
                module = module.double()
            steprun.seed_processes(setting.seed + streams)
            try:
                if setting.step is not None:
                    output = setting.step.step(module, batch)
                else:
                    output = module.training_step(batch, 0)
                loss = output.get("loss") if isinstance(output, dict) else output
                values.append(float(loss.detach()))
            except Exception:
                return False
    return values[0] != values[1]


def reference(setting: Setting, removed: str) -> Trained:
    """The 1-device run that makes the removals ``removed`` names, in this process."""
    return _train(setting, removed, 1)


def check(
    setting: Setting,
    world_sizes: Sequence[int],
    applying: Sequence[removals.Removal],
    references: dict[str, Trained] | None = None,
    layout: measure.Layout | None = None,
) -> pd.DataFrame:
    """The check's table (``COLUMNS``): for every W the row of its run without removals, its
    parts' rows (``layout``, when the gradient has several) and, when that run is not exact, a
    row per run with removals (each that applies, then all); ``culprits`` on every row of a W; a
    W whose ranks raised has one ``failed`` row. ``references`` holds the 1-device runs already
    made, by what they remove."""
    tolerance = terms.TOLERANCE[setting.precision]
    references = dict(references or {})
    rows = []

    def row(removed: str, world_size: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        if removed not in references:
            references[removed] = reference(setting, removed)
        numbers, by_part = _compare(_train(setting, removed, world_size), references[removed],
                                    world_size, tolerance, layout or {})  # fmt: skip
        key = {"loss": setting.name, "gather": "native", "world_size": world_size,
               "removed": removed}  # fmt: skip
        whole = {**key, "part": ALL_PARTS, **numbers}
        return whole, [{**whole, **part} for part in by_part]

    with_removals = [*applying, removals.ALL] if len(applying) > 1 else list(applying)
    step_random = functools.cache(lambda: step_draws_randomness(setting))  # once, if needed
    for world_size in world_sizes:
        try:
            kept, by_part = row(removals.NONE, world_size)
            measured = [kept]
            if kept["verdict"] not in (EXACT, terms.LOSS_SCALED):
                measured += [row(removed, world_size)[0] for removed in with_removals]
        except RankError as error:
            rows.append({
                "loss": setting.name, "gather": "native", "world_size": world_size,
                "removed": removals.NONE, "part": ALL_PARTS, "forward": "", "gradient": "",
                "verdict": terms.FAILED, "cause": "", "error": cli.first_line(error),
                "culprits": "",
            })  # fmt: skip
            continue
        verdicts = {r["removed"]: r["verdict"] for r in measured}
        exact = verdicts[removals.NONE] in (EXACT, terms.LOSS_SCALED)
        culprits = ";".join([] if exact else _culprits(verdicts, applying, step_random()))
        rows += [{**r, "culprits": culprits} for r in [kept, *by_part, *measured[1:]]]
    table = pd.DataFrame(rows, columns=list(COLUMNS))
    table["first_diff_step"] = table["first_diff_step"].astype("Int64")  # none: every step agrees
    return table
