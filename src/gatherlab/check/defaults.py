"""The check's defaults and the options of the check of a training step (`TrainingOptions`), read
by its Python API (`gatherlab.check.api`), its command line (`gatherlab.check.__main__`) and
`gatherlab.testing` alike. It imports nothing heavy, so that the command line can parse
its arguments and start its ranks' fork server before it imports torch."""

from __future__ import annotations

import json
import textwrap
from dataclasses import Field, dataclass, field, fields
from typing import Any

from gatherlab.core import gradients, terms

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
COLLECTIVE_TIMEOUT_S = 30.0
STEP_BUDGET_S = 10.0
"""How long a rank of the check waits at a collective for its peers to enter it before its W fails
with a line that says who did not come (``--collective-timeout``). A collective of the check's
small batches takes milliseconds, and ranks reach the same one within a fraction of a second of
each other (a rank's first job within its imports' seconds); ranks whose collectives differ, or a
peer that returned or raised instead, end the W at once, without waiting for it."""
SEED = 0
"""The seed of every initial weight, data order and random stream of a check."""


# --- what the check of a loss or a gather trains (docs/design.md §6) ------------------------------


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


# --- the options of the check of a training step ------------------------------------------------

TRAINING = "the check of a training step (docs/design.md §10)"
"""The command line's group of the options only a training step's check has."""
RANKS = "where the ranks run (docs/design.md §10)"
"""The command line's group of the options of where the ranks run."""
COMMON = ""
"""The options a loss's or gather's check shares (no group of their own)."""


def _option(doc: str, flag: str | None, group: str = TRAINING, **cli: Any) -> dict[str, Any]:
    """A field's metadata in `TrainingOptions`: its one documentation, and how the command line
    takes it (``flag``, None for none; ``group``; ``kind``: ``text``, ``int``, ``float``, ``ints``
    (comma-separated) or ``json``; ``cli_default``, ``help`` and ``metavar`` where the command
    line's differ from the field's)."""
    return {"doc": doc, "flag": flag, "group": group, **cli}


_PRECISIONS = (
    f"{', '.join(terms.PRECISIONS)}: code that runs in float64 is judged there (to "
    f"{gradients.FLOAT64_TOLERANCE:g}) and its run in this precision measured in floors beside "
    'it; code that cannot, in floors of this precision (docs/design.md §2, "Low precision")'
)


@dataclass(frozen=True)
class TrainingOptions:
    """The options of the check of a training step (docs/design.md §10), each documented once
    here: `gatherlab.check.check_training` takes them as its keyword arguments (in this order),
    ``python -m gatherlab.check`` generates its options from them (``__main__._parser``), and
    `gatherlab.testing.assert_training_invariant` passes them on. A test fails when the three
    differ (tests/test_check_options.py).

    Fields:
    """

    module: Any = field(
        default=None,
        metadata=_option(
            "a LightningModule class or factory, or its import path module:attribute, built inside "
            "every rank as module(**module_kwargs) (with rank= and world_size= when it takes them)",
            "--module",
        ),
    )
    data: Any = field(
        default=None,
        metadata=_option(
            "a map-style data set (len, data[index]) class or factory, or its import path, built "
            "as data(**data_kwargs); its items collated by the module's or the data set's "
            "collate_fn, else PyTorch's default",
            "--data",
        ),
    )
    world_sizes: Any = field(
        default=WORLD_SIZES,
        metadata=_option(
            "the numbers of ranks, each an integer ≥ 2 dividing global_batch_size (≥ 1 with "
            "update)",
            "--world-sizes",
            COMMON,
            kind="ints",
            cli_default=None,
            help=f"e.g. 2,4 (default {','.join(map(str, WORLD_SIZES))}; with --launcher external "
            "the launcher's WORLD_SIZE)",
        ),
    )
    step: Any = field(
        default=None,
        metadata=_option(
            "or a plain PyTorch step: training_step(model, batch) -> loss, module:attr",
            "--step",
        ),
    )
    update: Any = field(
        default=None,
        metadata=_option(
            "or a whole optimizer update: update(model, optimizer, batch, micro_batches) -> loss, "
            "module:attr",
            "--update",
        ),
    )
    micro_batches: Any = field(
        default=ONE_MICRO_BATCH,
        metadata=_option(
            "for --update: the micro-batches K of each rank's update, e.g. 1,2,4 (each crossed "
            "with --world-sizes, which may then include 1)",
            "--micro-batches",
            kind="ints",
        ),
    )
    model: Any = field(
        default=None,
        metadata=_option("for --step, --update: the function building the nn.Module", "--model"),
    )
    tensor_parallel: Any = field(
        default=None,
        metadata=_option(
            "for --step, --update: the tensor-parallel degree T dividing every W; the W ranks a "
            "(W/T) × T DeviceMesh named ('dp', 'tp') given to the model factory as mesh= (None on "
            "one device) to parallelize itself with parallelize_module, the T ranks of a "
            'tensor-parallel group given the same rows (docs/design.md §10, "Tensor and sequence '
            'parallelism")',
            "--tensor-parallel",
            kind="int",
            metavar="T",
        ),
    )
    model_kwargs: Any = field(
        default=None,
        metadata=_option(
            "the model factory's keyword arguments (JSON)", "--model-kwargs", kind="json"
        ),
    )
    optimizer: Any = field(
        default=OPTIMIZER,
        metadata=_option(
            f"the optimizer class of --step, --update (default {OPTIMIZER})", "--optimizer"
        ),
    )
    optimizer_kwargs: Any = field(
        default=None,
        metadata=_option(
            "the optimizer's keyword arguments besides the parameters (JSON; default "
            f"{json.dumps(OPTIMIZER_KWARGS)} for the default optimizer)",
            "--optimizer-kwargs",
            kind="json",
        ),
    )
    steps: int = field(
        default=TRAINING_STEPS,
        metadata=_option(
            "optimizer steps of each run",
            "--steps",
            COMMON,
            kind="int",
            cli_default=None,
            help=f"train this many steps (a loss: {LOSS_STEPS} by default; --module, --step: "
            f"{TRAINING_STEPS})",
        ),
    )
    global_batch_size: int = field(
        default=GLOBAL_BATCH_SIZE,
        metadata=_option("samples per step, over all ranks", "--global-batch-size", kind="int"),
    )
    module_kwargs: Any = field(
        default=None,
        metadata=_option("the module's keyword arguments (JSON)", "--module-kwargs", kind="json"),
    )
    data_kwargs: Any = field(
        default=None,
        metadata=_option("the data set's keyword arguments (JSON)", "--data-kwargs", kind="json"),
    )
    precision: str = field(
        default=PRECISION,
        metadata=_option(_PRECISIONS, "--precision", COMMON),
    )
    strategy: str = field(
        default=str(terms.Strategy.DDP),
        metadata=_option(
            "the Lightning strategy a --module trains under on W ranks: ddp (Lightning's DDP) or "
            "fsdp2 (its ModelParallelStrategy: the module shards itself with fully_shard in "
            "configure_model, over self.device_mesh['data_parallel']); a --step or --update is "
            'distributed by its own model factory (docs/design.md §10, "Sharded code")',
            "--strategy",
        ),
    )
    seed: int = field(
        default=SEED,
        metadata=_option(
            "the initial weights, the data order and every process's random streams (the command "
            f"line checks with {SEED})",
            None,
        ),
    )
    loss_attr: Any = field(
        default=None,
        metadata=_option(
            "the module's attribute holding its loss: with loss among the culprits it is checked "
            "too (check_loss, on gatherlab's MLP), callable as loss(z0, z1)",
            "--loss-attr",
        ),
    )
    step_budget_s: float = field(
        default=STEP_BUDGET_S,
        metadata=_option(
            "the seconds a training step may take before the check says so: a step of the one-"
            "device reference, or of rank 0, that takes longer prints one line with its time and "
            'the steps done and to go, and the check goes on (docs/design.md §10, "At size")',
            "--step-budget",
            kind="float",
            metavar="SECONDS",
            help=f"a step that takes longer prints its progress (default {STEP_BUDGET_S:g})",
        ),
    )
    collective_timeout_s: float = field(
        default=COLLECTIVE_TIMEOUT_S,
        metadata=_option(
            "how long a rank waits at a collective for its peers to enter it before its W fails "
            'with a line that names who did not come (docs/design.md §10, "Collectives that '
            "differ\"); the process group's own timeout in the check's jobs",
            "--collective-timeout",
            RANKS,
            kind="float",
            metavar="SECONDS",
            help="how long a rank waits at a collective for its peers before its W fails "
            f"(default {COLLECTIVE_TIMEOUT_S:g})",
        ),
    )


def dest(option: Field) -> str:
    """The attribute of the command line's parsed arguments that holds ``option``."""
    return option.metadata["flag"][2:].replace("-", "_")


TrainingOptions.__doc__ += "".join(  # each field's doc, for help(TrainingOptions)
    textwrap.indent(textwrap.fill(f"{option.name}: {option.metadata['doc']}", 88), " " * 8) + "\n"
    for option in fields(TrainingOptions)
)
