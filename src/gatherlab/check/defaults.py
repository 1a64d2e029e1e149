"""The check's defaults (the values of `gatherlab.check.options`' fields) and what the check of a
loss or a gather trains (`LossSetting`). It imports nothing heavy, so that the command line can
parse its arguments and start its ranks' fork server before it imports torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gatherlab.core import terms

WORLD_SIZES = (2, 4)
"""The numbers of ranks checked when none are given."""
LOSS_OPTIMIZERS = {
    "sgd": ("torch.optim:SGD", {"lr": 0.01}),
    "adamw": ("torch.optim:AdamW", {"lr": 0.001, "weight_decay": 0.01}),
}
"""The optimizers of a loss's or gather's short training run (``optim``), by name: the class's
import path and its keyword arguments besides the parameters (the lab's ``optim=sgd`` and
``optim=adamw``)."""
OPTIMIZERS = tuple(LOSS_OPTIMIZERS)
"""Their names."""
OPTIM = "sgd"
"""The optimizer of a loss's or gather's short training run when none is given."""
LOSS_STEPS = 0
"""The steps a loss or a gather is trained when none are given: none (gradient and loss only)."""
TRAINING_STEPS = 20
"""The optimizer steps of each run of a training step's check."""
GLOBAL_BATCH_SIZE = 32
"""The samples per step, over all ranks, of a training step's check."""
PRECISION = terms.Precision.FLOAT64
"""The precision of a training step's check (judged to ``gradients.TOLERANCE[PRECISION]``)."""
OPTIMIZER = "torch.optim:SGD"
"""The optimizer of a plain PyTorch step's check when none is given (as the loss check's SGD)."""
OPTIMIZER_KWARGS = {"lr": 0.01}
"""Its keyword arguments when the optimizer is the default one and none are given."""
ONE_MICRO_BATCH = (1,)
"""The micro-batches of each rank's update when none are given: one (no accumulation)."""
STEP_BUDGET_S = 10.0
"""The seconds a training step may take before the check says so (``--step-budget``): a step of
the one-device reference, or of rank 0, that takes longer prints one line with its time and the
steps done and to go, and the check goes on."""
JUDGE_IN = "auto"
"""How a training step's check in a low precision is judged when not told (``--judge-in``):
below `FLOORS_ALONE_PARAMETERS` trainable parameters as always (float64 judges code that runs in
it, its low-precision run measured in floors beside), at or above it in floors of the precision
alone (docs/design.md §2, "Low precision at size")."""
JUDGE_IN_CHOICES = ("auto", "float64", "floors")
"""``--judge-in``'s values: ``auto`` (by size, `JUDGE_IN`), ``float64`` (the float64 verdict
wherever the code runs in float64, at any size), ``floors`` (floors of the precision alone, at any
size)."""
FLOORS_ALONE_PARAMETERS = 20_000_000
"""The trainable parameters at and above which a low-precision check is judged in floors alone
by default: where the float64 verdict's check of float32 code passed 4× a plain rank's memory in
`python -m gatherlab.bench size` (25M: 4.17 and 4.52; 10M: 3.05 and 3.41, docs/performance.md)."""
COLLECTIVE_TIMEOUT_S = 30.0
"""How long a rank of the check waits at a collective for its peers to enter it before its W fails
with a line that says who did not come (``--collective-timeout``). A collective of the check's
small batches takes milliseconds, and ranks reach the same one within a fraction of a second of
each other (a rank's first job within its imports' seconds); ranks whose collectives differ, or a
peer that returned or raised instead, end the W at once, without waiting for it."""
SEED = 0
"""The seed of every initial weight, data order and random stream of a check."""


# --- what the check of a loss or a gather trains (docs/checking.md §6)
# ------------------------------


@dataclass(frozen=True)
class LossSetting:
    """What a loss is checked on, stated here (the gradient audit's setting,
    ``experiment=gather_audit``, which the lab's configs give the audit): each part as an import
    path and its keyword arguments, built by `gatherlab.check.api`."""

    model: tuple[str, dict[str, Any]] = (
        "gatherlab.components.models:MLP",
        {"in_features": 8, "hidden_features": 64, "out_features": 16, "depth": 2},
    )
    """An MLP 8 → 64 → 16 (depth 2), its initial weights drawn from ``seed``."""
    data: tuple[str, dict[str, Any]] = (
        "gatherlab.components.data:gaussian_pairs",
        {"num_samples": 16, "dim": 8, "noise": 0.5, "seed": 0},
    )
    """16 standard normal points of 8 dimensions, two views of each with noise 0.5 (drawn from
    seed 0): a global batch in all."""
    global_batch_size: int = 16
    """Samples per step over all ranks, in float64; W must divide it."""
    seed: int = SEED
    """The model's initial weights and the data order of its global batches (docs/design.md §2)."""
    shuffle: bool = True
    """Whether the data order is drawn from (seed, epoch)."""
    style_losses: tuple[tuple[str, str, dict[str, Any]], ...] = (
        ("ntxent", "gatherlab.losses:NTXentLoss", {"temperature": 0.5}),
        ("ntxent_global", "gatherlab.losses:NTXentGlobalLoss", {"temperature": 0.5}),
        ("vicreg", "gatherlab.losses:VICRegLoss",
         {"lambda_param": 25.0, "mu_param": 25.0, "nu_param": 1.0, "eps": 0.0001}),
    )  # fmt: skip
    """The loss styles of docs/design.md §1, one loss each (name, import path, keyword
    arguments), with which `check_gather` checks a gather: local, global, mixed."""


LOSS_SETTING = LossSetting()
"""The setting of every loss and gather check."""
