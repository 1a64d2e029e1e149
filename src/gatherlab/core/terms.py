"""The terms every layer shares, each defined once: the closed vocabularies of docs/design.md, which
rows of the global batch a rank holds, and the rule of an integer option. The tolerances are
`gatherlab.core.gradients`'s.

A vocabulary is a ``StrEnum``: its members are the very strings the run files and tables hold
(``GradientClass.EXACT == "exact"``, written as ``exact``), a typo is an error
(``GradientClass("exakt")`` raises ``ValueError``), and the vocabulary is discoverable
(``list(Style)``).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

__all__ = [
    "COLLECTIVES_DIFFER",
    "DATA_DIFFERS",
    "DIVERGES",
    "EXACT_PRECISIONS",
    "FAILED",
    "LOSS_DIFFERS",
    "LOSS_SCALED",
    "PRECISIONS",
    "Accelerator",
    "Backend",
    "Cause",
    "Culprit",
    "DepartureKind",
    "Device",
    "Factor",
    "Forward",
    "GradientClass",
    "Launcher",
    "Precision",
    "ReferenceMode",
    "Rule",
    "RunVerdict",
    "Style",
    "World",
    "allowed_integer",
    "is_integer",
    "rows_of",
]


class Style(StrEnum):
    """How a loss splits over ranks (docs/design.md §1): each rank its own anchors against the
    gathered batch (``local``), every rank the full loss (``global``), or both (``mixed``)."""

    LOCAL = "local"
    GLOBAL = "global"
    MIXED = "mixed"


class GradientClass(StrEnum):
    """The parameter gradient after DDP's average against the 1-device gradient (docs/design.md
    §1): the same, 1/W or W times it, another direction, zero, or none of these (``other``: the
    right direction at a factor that no name gives, or a gradient where one device has none).
    With K micro-batches per rank the factors that involve K have their names in `Factor`."""

    EXACT = "exact"
    ONE_OVER_W = "1/W"
    W = "W"
    BIASED = "biased"
    NONE = "none"
    OTHER = "other"


class Factor(StrEnum):
    """The names of the constant factors c of a gradient (c × the 1-device gradient, cosine 1)
    that involve K, the micro-batches each rank accumulates (docs/design.md §1): a gradient's class
    is a `GradientClass` or one of these. They stand apart because a gather's backward alone never
    gives them (`gatherlab.gather.CLASSES`, the audit's classes): they appear only where
    ``micro_batches`` > 1. At W = K the factors 1/W and 1/K (W and K) are one number, named
    together: ``1/W = 1/K`` (``W = K``)."""

    ONE_OVER_K = "1/K"
    K = "K"
    ONE_OVER_W_K = "1/(W·K)"
    W_K = "W·K"
    W_OVER_K = "W/K"
    K_OVER_W = "K/W"
    ONE_OVER_W_OR_K = "1/W = 1/K"
    W_OR_K = "W = K"


LOSS_DIFFERS = "loss differs"
"""A check's verdict at a world size is a `GradientClass` (or a `Factor`), or this when the global
loss already differs from the 1-device loss (``gatherlab.check``)."""
LOSS_SCALED = "loss scaled"
"""A check's verdict when the global loss is a constant multiple c ≠ 1 of the 1-device loss and
the gradient is exact: the logged value is scaled, the training is exact."""
DIVERGES = "diverges"
"""A check's verdict at a world size: its first step agrees with one device (forward and
gradient), a later one does not (``gatherlab.check.check_training``, and a loss's check with
``steps``)."""
DATA_DIFFERS = "data differs"
"""A comparison's verdict when the run and its reference were not given the same global batch at
some update, as a set of rows (`gatherlab.check.recordings`): said before any gradient is judged, no
gradient being comparable while the data differs."""
NOT_JUDGED = "not judged"
"""A comparison's verdict when two recordings in a low precision have no floor recording beside
them (`gatherlab.check.recordings`): their rounding alone departs from one device, and without a
measured floor no departure can be told from it (docs/design.md §2, "Low precision"); its exit
status is `NOT_JUDGED_STATUS`, neither a pass nor a failure."""
NOT_JUDGED_STATUS = 3
"""The exit status of ``python -m gatherlab.compare`` whose verdict is `NOT_JUDGED`: 0 trains like
the reference, 1 does not, 2 bad input, 3 not judged."""
FAILED = "failed"
"""A check's verdict at a world size whose ranks raised: its ``error`` names the rank and the
error, or starts with `COLLECTIVES_DIFFER`."""
COLLECTIVES_DIFFER = "collectives differ:"
"""The start of a ``failed`` row's error when its ranks did not enter the same collectives: the
rest names each rank's call (``gatherlab.ranks.watched``, docs/checking.md §10)."""


class Cause(StrEnum):
    """Why a check's global loss differs, as reproduced on one device (docs/checking.md §6), or why
    its gradient is biased: ``scaled`` (c × the 1-device loss), ``local_negatives`` (the mean over
    ranks of the 1-device loss of each rank's slice alone), ``micro_negatives`` (with K
    micro-batches per rank: the mean over the W·K micro-batches of the 1-device loss of each
    micro-batch alone), ``pair_order`` (the 1-device loss of
    the rows in the order that concatenating the views per rank and gathering produces),
    ``local_statistic`` (none of these reproduces it, and the first operation whose result departs
    reduces or normalises over the rank's part of the batch: ``gatherlab.check.where``),
    ``unexplained`` (none of these); ``parts`` (a biased gradient whose parts each have one
    factor, different ones); ``unreduced`` (a recorded run's part whose gradient differs between
    its ranks: it is not reduced over them, `gatherlab.check.recordings`); ``desync`` (a recorded
    run's ranks whose weights differ after an update: they step apart); ``layout`` (a tensor of a
    tensor-parallel model that is not, over the ranks, the tensor one device holds: an input
    sharded on another dimension than its plan says, a shard taken as the whole,
    `gatherlab.check.where.layout_departure`); ``partial`` (a parameter replicated over a
    tensor-parallel mesh dimension whose gradient there is a partial sum, stepped unreduced: its
    replicas end apart, and making the sum whole reproduces one device); ``shard_as_whole`` (an
    operation of a tensor-parallel model's forward whose result on a rank is neither one device's
    nor its shard, though the shapes may be: the rank's shard taken as the whole, as a reshape by
    the model's head count or a mean over the rank's part of the sequence does,
    `gatherlab.check.where.shard_departure`); ``local_tokens`` (an expert-parallel run's global
    loss reproduced as the mean over ranks of one device's loss on each rank's rows alone: a
    load-balancing loss or an expert's capacity computed over the rank's own tokens);
    ``experts_mixed`` (two experts held by different ranks given one gradient where one device's
    differ: reduced over ranks that hold other experts); ``experts_scaled`` (the experts'
    gradient a constant other than 1 times one device's, every replicated parameter exact:
    `gatherlab.check.experts`)."""

    SCALED = "scaled"
    LOCAL_NEGATIVES = "local_negatives"
    MICRO_NEGATIVES = "micro_negatives"
    PAIR_ORDER = "pair_order"
    LOCAL_STATISTIC = "local_statistic"
    UNEXPLAINED = "unexplained"
    PARTS = "parts"
    UNREDUCED = "unreduced"
    DESYNC = "desync"
    LAYOUT = "layout"
    PARTIAL = "partial"
    SHARD_AS_WHOLE = "shard_as_whole"
    LOCAL_TOKENS = "local_tokens"
    EXPERTS_MIXED = "experts_mixed"
    EXPERTS_SCALED = "experts_scaled"
    COPIES_APART = "copies_apart"
    """A pipeline's parameter held by several ranks (a weight one device ties, held on two
    stages; a stage's replicas) whose copies end the run apart, named from the copies alone
    (`gatherlab.core.held.copies_apart`, docs/checking.md §10 "Pipeline parallelism")."""
    MICRO_MEAN = "micro_mean"
    """A pipeline's first loss reproduced as the mean over its micro-batches of one device's loss
    of each micro-batch alone: a mean over each micro-batch's own rows or tokens, which with
    ragged padding weighs them otherwise than one device's mean over all of them."""
    MICRO_SCALE = "micro_scale"
    """A pipeline's gradient, every part of it, K or 1/K times one device's (K its schedule's
    micro-batches): the schedule's ``scale_grads`` and its ``loss_fn`` divide by K both or
    neither."""


class Forward(StrEnum):
    """A check's global loss on W ranks against the 1-device loss (relative, to
    `gatherlab.core.gradients.FLOAT64_TOLERANCE`)."""

    SAME = "same"
    DIFFERS = "differs"


class RunVerdict(StrEnum):
    """What the report says of a run of a sweep against its 1-device reference (docs/contract.md
    §5); only ``reference`` and ``matches`` count as a match."""

    REFERENCE = "reference"
    MATCHES = "matches"
    DIFFERS = "differs"
    NO_REFERENCE = "no reference"
    NOT_COMPARABLE = "not comparable"
    FAILED = "failed"
    UNREADABLE = "unreadable"


class Rule(StrEnum):
    """What a gather's backward hands each rank for its own slice (docs/design.md §1, §9): the
    sum of every rank's slice gradient, its own rank's only, their mean, or nothing."""

    SUM = "sum"
    OWN = "own"
    MEAN = "mean"
    NONE = "none"


class World(StrEnum):
    """Where an audit cell was measured: on real gloo ranks or in the simulated world (§9)."""

    REAL = "real"
    SIMULATED = "simulated"


class Launcher(StrEnum):
    """How a run's W ranks are started (the options of ``conf/launcher/``,
    `gatherlab.ranks.launch`): the warm worker pools (``pool``, CPU only), a fresh Lightning
    ``ddp_spawn`` run per job (``spawn``), or ranks that torchrun or SLURM started
    (``external``)."""

    POOL = "pool"
    SPAWN = "spawn"
    EXTERNAL = "external"


class Strategy(StrEnum):
    """How the lab distributes its module over W ranks (the options of ``conf/strategy/``,
    `gatherlab.components.sharding`): Lightning's DDP (``ddp``), FSDP2's ``fully_shard`` under
    Lightning's ``ModelParallelStrategy`` (``fsdp2``), DDP with torch's
    ``ZeroRedundancyOptimizer`` (``zero``), or tensor parallelism over the tensor-parallel mesh
    of that strategy and FSDP2 over its data-parallel mesh (``tp``), or pipeline parallelism
    (``pp``: the model's stages over the pipeline ranks, `gatherlab.components.pipeline`), or
    expert parallelism (``ep``: a mixture of experts' experts spread over the ranks). One device
    trains the plain run whatever it says."""

    DDP = "ddp"
    FSDP2 = "fsdp2"
    ZERO = "zero"
    TP = "tp"
    PP = "pp"
    EP = "ep"


class Backend(StrEnum):
    """A process group's backend, by ``torch.distributed``'s name."""

    GLOO = "gloo"
    NCCL = "nccl"
    XCCL = "xccl"


class Device(StrEnum):
    """Where a rank computes, by torch's device type (``torch.device``, ``--device`` of
    ``python -m gatherlab.check``)."""

    CPU = "cpu"
    CUDA = "cuda"

    @property
    def backend(self) -> Backend:
        """The backend of a process group between ranks on this device: gloo between CPUs, NCCL
        between GPUs."""
        return Backend.GLOO if self is Device.CPU else Backend.NCCL


class Accelerator(StrEnum):
    """A layout's accelerator, by Lightning's name (``layout.accelerator`` of ``conf/layout/``)."""

    CPU = "cpu"
    GPU = "gpu"

    @property
    def device(self) -> Device:
        """Its torch device type: ``cpu``, or ``cuda`` for ``gpu``."""
        return Device.CPU if self is Accelerator.CPU else Device.CUDA


class Precision(StrEnum):
    """A run's floating-point precision, by Lightning's name: the dtype its parameters are kept in
    and, for the ``-mixed`` ones, the dtype ``torch.autocast`` computes its operations in
    (docs/design.md §2, "Low precision")."""

    FLOAT64 = "64-true"
    FLOAT32 = "32-true"
    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "16-mixed"
    BF16_TRUE = "bf16-true"

    @property
    def dtype_name(self) -> str:
        """The name of its parameters' torch dtype: ``float64``, ``float32`` (and for the mixed
        precisions) or ``bfloat16``."""
        return {Precision.FLOAT64: "float64", Precision.BF16_TRUE: "bfloat16"}.get(self, "float32")

    @property
    def autocast_dtype_name(self) -> str | None:
        """The torch dtype ``torch.autocast`` runs its operations in: ``bfloat16`` or ``float16``
        for a mixed precision, None for the others."""
        return {Precision.BF16_MIXED: "bfloat16", Precision.FP16_MIXED: "float16"}.get(self)

    @property
    def word(self) -> str:
        """How a verdict names it: ``float64``, ``float32``, ``bf16`` or ``fp16``."""
        return {Precision.FLOAT64: "float64", Precision.FLOAT32: "float32",
                Precision.FP16_MIXED: "fp16"}.get(self, "bf16")  # fmt: skip

    @property
    def unit_roundoff(self) -> float:
        """Half the distance from 1 to the next number of the dtype its operations round to:
        2^-53, 2^-24, 2^-8 (bf16) or 2^-11 (fp16)."""
        return {"float64": 2.0**-53, "float32": 2.0**-24, "bf16": 2.0**-8, "fp16": 2.0**-11}[
            self.word
        ]


PRECISIONS = tuple(Precision)
"""The precisions a check takes (``--precision``): float64 is judged to 1e-10, every other one
also against a measured floor of its own rounding (docs/design.md §2, "Low precision")."""
EXACT_PRECISIONS = (Precision.FLOAT64, Precision.FLOAT32)
"""The precisions a lab run is judged in by a fixed tolerance (float64 1e-10, float32 1e-5:
`gatherlab.core.gradients.TOLERANCE`)."""


class DepartureKind(StrEnum):
    """What sort of departure from one device `gatherlab.check.where` found: a reduction or
    normalisation over the rank's part of one device's input (``statistic``), one device's rows
    in another order (``order``), what the code is given differs (``input``), a scalar on the
    loss's path whose mean over ranks differs (``scalar``), the same inputs giving another result
    (``rank``), or the backward (``gradient``); a tensor of a tensor-parallel model whose layout
    over the ranks is not one device's shape (``layout``, docs/checking.md §10), a dropout layer
    whose masks agree or differ across a tensor-parallel group where they must not
    (``randomness``), an operation of a tensor-parallel model whose result on a rank is neither
    one device's nor its shard (``shard``); or no place, and why (``none``)."""

    STATISTIC = "statistic"
    ORDER = "order"
    INPUT = "input"
    SCALAR = "scalar"
    RANK = "rank"
    GRADIENT = "gradient"
    LAYOUT = "layout"
    RANDOMNESS = "randomness"
    SHARD = "shard"
    NONE = "none"


class Culprit(StrEnum):
    """The culprits of a training step's check that are no removal (docs/checking.md §10): the loss
    itself (or how it communicates across ranks), left when every removal is made and the run is
    still not exact; the step's own draws from the global random streams, named instead of the
    loss when the step makes them (no removal takes that out); a parameter whose gradient no one
    reduces over the ranks, named when reducing it makes the run exact; a tensor-parallel model's
    partial-sum gradient stepped unreduced, a tensor whose shape, or an operation whose result,
    is not one device's over the ranks (``partial``, ``layout``, ``shard_as_whole``: measured on
    the ranks, named instead of the loss); an expert-parallel run's routing statistics over the
    rank's own tokens, or its experts' gradients reduced over the wrong ranks or by the wrong
    count (``local_tokens``, ``experts_mixed``, ``experts_scaled``: reproduced or measured from
    the ranks' pieces, named instead of the loss)."""

    LOSS = "loss"
    STEP_RANDOMNESS = "step_randomness"
    UNREDUCED = "unreduced"
    PARTIAL = "partial"
    LAYOUT = "layout"
    SHARD_AS_WHOLE = "shard_as_whole"
    LOCAL_TOKENS = "local_tokens"
    EXPERTS_MIXED = "experts_mixed"
    EXPERTS_SCALED = "experts_scaled"
    COPIES_APART = "copies_apart"
    """A pipeline's copies of one parameter that end the run apart (measured on the ranks, named
    instead of the loss)."""


class ReferenceMode(StrEnum):
    """How the one-device reference ran (the ``reference`` column of ``check.csv``,
    `gatherlab.check.reference`)."""

    NO_GROUP = "no group"
    ONE_RANK_GROUP = "one-rank group"


def rows_of(rank: int, world_size: int, total: int) -> slice:
    """The rows of a global batch (or of a gathered tensor) of ``total`` rows that rank ``rank``
    of ``world_size`` holds: the ``rank``-th of ``world_size`` equal, consecutive parts (§2)."""
    rows = total // world_size
    return slice(rank * rows, (rank + 1) * rows)


def is_integer(value: Any, minimum: int) -> bool:
    """Whether an option's value is an integer (``True`` is not) of at least ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def allowed_integer(minimum: int) -> str:
    """What an integer option of at least ``minimum`` allows, as the error messages say it."""
    return {0: "an integer ≥ 0", 1: "a positive integer"}.get(minimum, f"an integer ≥ {minimum}")
