"""The options of every form of the check, each typed and documented once: `GatherOptions` (a
gather), `LossOptions` (a loss: a gather's options and what the loss is given), `TrainingOptions`
(a LightningModule, a plain PyTorch step or a whole update; its ``form``). Each is a frozen
dataclass whose ``__post_init__`` refuses a value that is not allowed with one line
(`CheckError`), before anything is built or any rank runs.

The Python API (`gatherlab.check.api`), the command line (`gatherlab.check.__main__`, which
generates its options from the fields' metadata) and `gatherlab.testing` read these definitions:
a new option is a field here and its use. It imports nothing heavy (no torch), so that the
command line can validate its arguments before it starts its ranks' fork server."""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import Field, dataclass, field, fields
from typing import Any

from gatherlab.check import defaults
from gatherlab.core import gradients, terms

__all__ = [
    "COMMON", "RANKS", "TRAINING", "CheckError", "GatherOptions", "LossOptions",
    "TrainingOptions", "dest", "options_of",
]  # fmt: skip


class CheckError(ValueError):
    """Bad input, found before any rank runs: the message is one line naming the option, its
    value and what is allowed.

    Raised by the options' own checks (``__post_init__``: a world size, ``steps``, ``optim``,
    ``precision``, a timeout or budget, a form's parts missing or doubled, a tensor-parallel
    degree) and by the check for what needs its parts imported: a factory or gather that does
    not import or is not callable, a gather name that is no option of the ``gather`` config
    group, ``native`` where it cannot run (no loss, or a loss that would gather with its own
    default), a world size that does not divide the global batch, a loss keyword argument that
    the check passes itself (``gather``), a factory or gather that the ranks cannot receive (it
    does not pickle, or its module is found under its name in no directory), and a loss or step
    that fails on one device. ``python -m gatherlab.check`` prints it and exits with status 2.
    """


# --- the command line's view of a field --------------------------------------------------------

TRAINING = "the check of a training step (docs/checking.md §10)"
"""The command line's group of the options only a training step's check has."""
RANKS = "where the ranks run (docs/checking.md §10)"
"""The command line's group of the options of where the ranks run."""
COMMON = ""
"""The options every form of the check has (no group of their own)."""


def _option(doc: str, flag: str | None, group: str = TRAINING, **cli: Any) -> dict[str, Any]:
    """A field's metadata: its one documentation, and how the command line takes it (``flag``,
    None for none; ``group``; ``kind``: ``text``, ``int``, ``float``, ``ints`` (comma-separated)
    or ``json``; ``cli_default``, ``help`` and ``metavar`` where the command line's differ from
    the field's)."""
    return {"doc": doc, "flag": flag, "group": group, **cli}


def dest(option: Field) -> str:
    """The attribute of the command line's parsed arguments that holds ``option``."""
    return option.metadata["flag"][2:].replace("-", "_")


def _documented(cls: type) -> type:
    """``cls`` with each field's doc appended to its docstring, for ``help(cls)`` and the API
    reference."""
    listed = "".join(
        textwrap.indent(textwrap.fill(f"{option.name}: {option.metadata['doc']}", 88), " " * 8)
        + "\n"
        for option in fields(cls)
    )
    cls.__doc__ = f"{(cls.__doc__ or '').rstrip()}\n{listed}"
    return cls


def options_of(cls: type, given: Mapping[str, Any], named: str) -> dict[str, Any]:
    """``given`` split off as ``cls``'s fields, or CheckError of one line naming a keyword that is
    none of them (``named``: the function the keywords were given to)."""
    known = {option.name for option in fields(cls)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise CheckError(
            f"{named}: {unknown[0]}= is no option; allowed: {', '.join(sorted(known))}"
        )
    return dict(given)


_PRECISIONS = (
    f"{', '.join(terms.PRECISIONS)}: code that runs in float64 is judged there (to "
    f"{gradients.FLOAT64_TOLERANCE:g}) and its run in this precision measured in floors beside "
    'it; code that cannot, in floors of this precision (docs/design.md §2, "Low precision")'
)


def _set(options: Any, name: str, value: Any) -> None:
    """A normalized value stored in a frozen options object (its ``__post_init__`` only)."""
    object.__setattr__(options, name, value)


def _world_sizes(value: Any, minimum: int) -> tuple[int, ...]:
    """``world_sizes`` as a tuple of integers ≥ ``minimum``, or CheckError of one line."""
    sizes = tuple(value) if isinstance(value, Iterable) and not isinstance(value, str) else None
    if not sizes or not all(terms.is_integer(size, minimum) for size in sizes):
        raise CheckError(
            f"world_sizes={value!r} (--world-sizes) is not allowed; allowed: integers ≥ {minimum}"
        )
    return sizes


def _dividing(world_sizes: tuple[int, ...], batch: int, named: str) -> None:
    """CheckError of one line for a world size that does not divide the global batch (``named``
    names it in the message, e.g. "the global batch of 16")."""
    for world_size in world_sizes:
        if batch % world_size:
            raise CheckError(
                f"world size {world_size} does not divide {named}; allowed: divisors of {batch}"
            )


def _positive(key: str, value: Any) -> None:
    """CheckError of one line unless ``value`` is an integer ≥ 1."""
    if not terms.is_integer(value, 1):
        raise CheckError(f"{key} {value!r} is not allowed; allowed: {terms.allowed_integer(1)}")


# --- what every form has -----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _Common:
    """What every form of the check has: its precision, seed and how long a rank waits for its
    peers."""

    precision: str = field(
        default=defaults.PRECISION, metadata=_option(_PRECISIONS, "--precision", COMMON)
    )
    seed: int = field(
        default=defaults.SEED,
        metadata=_option(
            "the initial weights, the data order and every process's random streams (the command "
            f"line checks with {defaults.SEED})",
            None,
        ),
    )
    collective_timeout_s: float = field(
        default=defaults.COLLECTIVE_TIMEOUT_S,
        metadata=_option(
            "how long a rank waits at a collective for its peers to enter it before its W fails "
            'with a line that names who did not come (docs/checking.md §10, "Collectives that '
            "differ\"); the process group's own timeout in the check's jobs",
            "--collective-timeout",
            RANKS,
            kind="float",
            metavar="SECONDS",
            help="how long a rank waits at a collective for its peers before its W fails "
            f"(default {defaults.COLLECTIVE_TIMEOUT_S:g})",
        ),
    )

    def __post_init__(self) -> None:
        if self.precision not in terms.PRECISIONS:
            allowed = ", ".join(terms.PRECISIONS)
            raise CheckError(f"--precision {self.precision!r} is not allowed; allowed: {allowed}")
        timeout = self.collective_timeout_s
        number = isinstance(timeout, int | float) and not isinstance(timeout, bool)
        if not number or not 0 < timeout < math.inf:
            raise CheckError(
                f"collective_timeout_s={timeout!r} (--collective-timeout); allowed: a number of "
                "seconds > 0"
            )


# --- a gather, a loss --------------------------------------------------------------------------


@_documented
@dataclass(frozen=True, kw_only=True)
class GatherOptions(_Common):
    """The options of the check of a gather (`gatherlab.check.check_gather`), in the loss
    check's setting (`defaults.LossSetting`; docs/checking.md §6).

    Fields:
    """

    world_sizes: tuple[int, ...] = field(
        default=defaults.WORLD_SIZES,
        metadata=_option(
            "the numbers of ranks to check, each an integer ≥ 2 dividing the global batch of "
            f"{defaults.LOSS_SETTING.global_batch_size}",
            None,
        ),
    )
    steps: int = field(
        default=defaults.LOSS_STEPS,
        metadata=_option(
            "also train this many steps of plain DDP and compare the losses with one device (0: "
            "the gradient and the loss only)",
            None,
        ),
    )
    optim: str = field(
        default=defaults.OPTIM,
        metadata=_option(
            "the optimizer of those steps: sgd (lr 0.01) or adamw (lr 1e-3, weight decay 0.01)",
            None,
        ),
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        _set(self, "world_sizes", _world_sizes(self.world_sizes, 2))
        batch = defaults.LOSS_SETTING.global_batch_size
        _dividing(self.world_sizes, batch, f"the global batch of {batch}")
        if self.optim not in defaults.OPTIMIZERS:
            allowed = ", ".join(defaults.OPTIMIZERS)
            raise CheckError(f"--optim {self.optim!r} is unknown; allowed: {allowed}")
        if not terms.is_integer(self.steps, 0):
            raise CheckError(
                f"--steps {self.steps!r} is not allowed; allowed: {terms.allowed_integer(0)}"
            )


@_documented
@dataclass(frozen=True, kw_only=True)
class LossOptions(GatherOptions):
    """The options of the check of a loss (`gatherlab.check.check_loss`): a gather's, and what
    the loss is given besides its own keyword arguments.

    Fields:
    """

    gather: str | Callable[..., Any] | None = field(
        default=None,
        metadata=_option(
            "passed to the loss as gather=: an option of the gather config group (gatherlab's "
            "are gatherlab.gather.NAMES), a function x -> gathered x, or its import path; None or "
            "'native' passes none, for a loss that communicates by itself (refused for a loss "
            "whose gather= has a default, which would gather with it)",
            None,
        ),
    )
    inputs: Any = field(
        default=None,
        metadata=_option(
            "what the loss takes besides the two views' embeddings, for the whole global batch "
            "(gatherlab.components.factory.Inputs; docs/checking.md §6): a tuple or list (given "
            "positionally after them), a dict (by keyword) or one tensor; or a function that "
            "makes them, or its import path, called once with the seed drawn and with "
            "global_batch_size= and embedding_dim= where it takes them; each rank is given its "
            "rows of every tensor with a row per sample, the rest whole",
            None,
        ),
    )


# --- a training step ---------------------------------------------------------------------------

_FORMS = ("module", "step", "update")


@_documented
@dataclass(frozen=True, kw_only=True)
class TrainingOptions(_Common):
    """The options of the check of a training step (docs/checking.md §10), each documented once
    here: `gatherlab.check.check_training` takes them as one object or as keyword arguments,
    ``python -m gatherlab.check`` generates its options from them (``__main__._parser``), and
    `gatherlab.testing.assert_training_invariant` passes them on. A test fails when the three
    differ (tests/check/test_check_options.py).

    Fields:
    """

    module: str | Callable[..., Any] | None = field(
        default=None,
        metadata=_option(
            "a LightningModule class or factory, or its import path module:attribute, built inside "
            "every rank as module(**module_kwargs) (with rank= and world_size= when it takes them)",
            "--module",
        ),
    )
    data: str | Callable[..., Any] | None = field(
        default=None,
        metadata=_option(
            "a map-style data set (len, data[index]) class or factory, or its import path, built "
            "as data(**data_kwargs); its items collated by the module's or the data set's "
            "collate_fn, else PyTorch's default",
            "--data",
        ),
    )
    world_sizes: tuple[int, ...] = field(
        default=defaults.WORLD_SIZES,
        metadata=_option(
            "the numbers of ranks, each an integer ≥ 2 dividing global_batch_size (≥ 1 with "
            "update)",
            "--world-sizes",
            COMMON,
            kind="ints",
            cli_default=None,
            help=f"e.g. 2,4 (default {','.join(map(str, defaults.WORLD_SIZES))}; with --launcher "
            "external the launcher's WORLD_SIZE)",
        ),
    )
    step: str | Callable[..., Any] | None = field(
        default=None,
        metadata=_option(
            "or a plain PyTorch step: training_step(model, batch) -> loss, module:attr",
            "--step",
        ),
    )
    update: str | Callable[..., Any] | None = field(
        default=None,
        metadata=_option(
            "or a whole optimizer update: update(model, optimizer, batch, micro_batches) -> loss, "
            "module:attr",
            "--update",
        ),
    )
    micro_batches: tuple[int, ...] = field(
        default=defaults.ONE_MICRO_BATCH,
        metadata=_option(
            "for --update: the micro-batches K of each rank's update, e.g. 1,2,4 (each crossed "
            "with --world-sizes, which may then include 1)",
            "--micro-batches",
            kind="ints",
        ),
    )
    model: str | Callable[..., Any] | None = field(
        default=None,
        metadata=_option("for --step, --update: the function building the nn.Module", "--model"),
    )
    tensor_parallel: int | None = field(
        default=None,
        metadata=_option(
            "for --step, --update: the tensor-parallel degree T dividing every W; the W ranks a "
            "(W/T) × T DeviceMesh named ('dp', 'tp') given to the model factory as mesh= (None on "
            "one device) to parallelize itself with parallelize_module, the T ranks of a "
            'tensor-parallel group given the same rows (docs/checking.md §10, "Tensor and sequence '
            'parallelism")',
            "--tensor-parallel",
            kind="int",
            metavar="T",
        ),
    )
    expert_parallel: int | None = field(
        default=None,
        metadata=_option(
            "for --step, --update: the expert-parallel degree E dividing every W; the W ranks a "
            "(W/E) × E DeviceMesh named ('dp', 'ep') given to the model factory as mesh= (None on "
            "one device, which holds every expert), each rank keeping its experts under one "
            "device's names and its own rows of each global batch; the code reduces its "
            'gradients itself, no DDP (docs/checking.md §10, "Expert parallelism")',
            "--expert-parallel",
            kind="int",
            metavar="E",
        ),
    )
    pipeline_parallel: int | None = field(
        default=None,
        metadata=_option(
            "for --update: the pipeline-parallel degree P dividing every W; the W ranks a (W/P) "
            "× P DeviceMesh named ('dp', 'pp') given to the model factory as mesh= (None on one "
            "device) to keep this rank's stages of the model under one device's parameter names, "
            "the update running their schedule (torch.distributed.pipelining) over its "
            "micro-batches (--micro-batches: the schedule's M) and reducing over 'dp' itself; the "
            'P ranks of a pipeline given the same rows (docs/checking.md §10, "Pipeline '
            'parallelism")',
            "--pipeline-parallel",
            kind="int",
            metavar="P",
        ),
    )
    context_parallel: int | None = field(
        default=None,
        metadata=_option(
            "for --step, --update: the context-parallel degree C (ring attention over sequence "
            "shards, torch.distributed.tensor.experimental.context_parallel): refused, since on "
            "a CPU, where the check's ranks run, torch cannot run it (docs/checking.md §10, "
            '"Pipeline parallelism")',
            "--context-parallel",
            kind="int",
            metavar="C",
        ),
    )
    model_kwargs: Mapping[str, Any] | None = field(
        default=None,
        metadata=_option(
            "the model factory's keyword arguments (JSON)", "--model-kwargs", kind="json"
        ),
    )
    optimizer: str | Callable[..., Any] = field(
        default=defaults.OPTIMIZER,
        metadata=_option(
            f"the optimizer class of --step, --update (default {defaults.OPTIMIZER})",
            "--optimizer",
        ),
    )
    optimizer_kwargs: Mapping[str, Any] | None = field(
        default=None,
        metadata=_option(
            "the optimizer's keyword arguments besides the parameters (JSON; default "
            f"{json.dumps(defaults.OPTIMIZER_KWARGS)} for the default optimizer)",
            "--optimizer-kwargs",
            kind="json",
        ),
    )
    steps: int = field(
        default=defaults.TRAINING_STEPS,
        metadata=_option(
            "optimizer steps of each run",
            "--steps",
            COMMON,
            kind="int",
            cli_default=None,
            help=f"train this many steps (a loss: {defaults.LOSS_STEPS} by default; --module, "
            f"--step: {defaults.TRAINING_STEPS})",
        ),
    )
    global_batch_size: int = field(
        default=defaults.GLOBAL_BATCH_SIZE,
        metadata=_option("samples per step, over all ranks", "--global-batch-size", kind="int"),
    )
    module_kwargs: Mapping[str, Any] | None = field(
        default=None,
        metadata=_option("the module's keyword arguments (JSON)", "--module-kwargs", kind="json"),
    )
    data_kwargs: Mapping[str, Any] | None = field(
        default=None,
        metadata=_option("the data set's keyword arguments (JSON)", "--data-kwargs", kind="json"),
    )
    strategy: str = field(
        default=str(terms.Strategy.DDP),
        metadata=_option(
            "the Lightning strategy a --module trains under on W ranks: ddp (Lightning's DDP) or "
            "fsdp2 (its ModelParallelStrategy: the module shards itself with fully_shard in "
            "configure_model, over self.device_mesh['data_parallel']); a --step or --update is "
            'distributed by its own model factory (docs/checking.md §10, "Sharded code")',
            "--strategy",
        ),
    )
    loss_attr: str | None = field(
        default=None,
        metadata=_option(
            "the module's attribute holding its loss: with loss among the culprits it is checked "
            "too (check_loss, on gatherlab's MLP), callable as loss(z0, z1)",
            "--loss-attr",
        ),
    )
    judge_in: str = field(
        default=defaults.JUDGE_IN,
        metadata=_option(
            "how a step checked in a low precision (32-true, bf16-mixed, …) is judged: auto (below "
            f"{defaults.FLOORS_ALONE_PARAMETERS / 1e6:g}M trainable parameters in float64 where "
            "the code runs in it, its run in the precision measured in floors beside; at or above, "
            "in floors of the precision alone: three runs in it, no float64 verdict), float64 "
            "(the float64 verdict at any size) or floors (floors alone at any size); "
            'docs/design.md §2, "Low precision at size"',
            "--judge-in",
            metavar="{auto,float64,floors}",
            help="a low precision judged by float64 with its floors beside, or in floors alone "
            f"(auto: floors alone from {defaults.FLOORS_ALONE_PARAMETERS / 1e6:g}M parameters)",
        ),
    )
    step_budget_s: float = field(
        default=defaults.STEP_BUDGET_S,
        metadata=_option(
            "the seconds a training step may take before the check says so: a step of the one-"
            "device reference, or of rank 0, that takes longer prints one line with its time and "
            'the steps done and to go, and the check goes on (docs/checking.md §10, "At size")',
            "--step-budget",
            kind="float",
            metavar="SECONDS",
            help="a step that takes longer prints its progress (default "
            f"{defaults.STEP_BUDGET_S:g})",
        ),
    )

    @property
    def form(self) -> str:
        """What is trained: ``module``, ``step`` or ``update`` (the one given)."""
        return next(name for name in _FORMS if getattr(self, name) is not None)

    @property
    def function(self) -> str | Callable[..., Any]:
        """The LightningModule, step or update given (its factory or import path)."""
        return getattr(self, self.form)

    def __post_init__(self) -> None:
        super().__post_init__()
        given = [f"--{name}" for name in _FORMS if getattr(self, name) is not None]
        if len(given) != 1:
            raise CheckError(
                "name one of a LightningModule (--module), a plain PyTorch step (--step with "
                "--model) or a whole update (--update with --model)"
                + (f"; {' and '.join(given)} are forms of one check" if given else "")
            )
        form = self.form
        if self.data is None:
            raise CheckError(f"--{form} needs --data (a map-style data set, module:attribute)")
        if form != "module" and self.model is None:
            raise CheckError(
                f"--{form} needs --model (a function or class returning the nn.Module)"
            )
        _positive("--steps", self.steps)
        _positive("--global-batch-size", self.global_batch_size)
        self._check_layouts()
        if self.judge_in not in defaults.JUDGE_IN_CHOICES:
            raise CheckError(
                f"--judge-in {self.judge_in!r} is not allowed; allowed: "
                f"{', '.join(defaults.JUDGE_IN_CHOICES)}"
            )
        budget = self.step_budget_s
        if not (isinstance(budget, int | float) and 0 < budget <= math.inf):
            raise CheckError(f"--step-budget {budget!r}; allowed: a number of seconds > 0")
        strategies = (terms.Strategy.DDP, terms.Strategy.FSDP2)  # Lightning's; ZeRO: an optimizer
        if self.strategy not in strategies or (form != "module" and self.strategy != "ddp"):
            raise CheckError(
                f"--strategy {self.strategy}: allowed: {', '.join(strategies)} with --module (a "
                "--step's or --update's model factory distributes the model itself)"
            )
        self._check_tensor_parallel()
        self._check_pipeline_parallel()
        self._check_expert_parallel()
        self._check_context_parallel()

    def _check_layouts(self) -> None:
        """The world sizes and micro-batches as tuples, or CheckError of one line: W ≥ 2 dividing
        the global batch; for a whole update W ≥ 1 and K ≥ 1 whose product divides it (each rank
        splits its rows into K micro-batches), at least one layout besides (1, 1), the reference
        itself; micro-batches only for a whole update."""
        batch, update = self.global_batch_size, self.form == "update"
        world_sizes = _world_sizes(self.world_sizes, 1 if update else 2)
        micro_batches = _world_sizes(self.micro_batches, 1)
        _set(self, "world_sizes", world_sizes)
        _set(self, "micro_batches", micro_batches)
        if not update:
            if micro_batches != (1,):
                raise CheckError(
                    f"--micro-batches {','.join(map(str, micro_batches))}: micro-batches are the "
                    "whole update's (--update); allowed: --update with them, or 1"
                )
            _dividing(world_sizes, batch, f"--global-batch-size {batch}")
            return
        if self.pipeline_parallel is not None:
            return  # a pipeline's ranks share their rows: `_check_pipeline_parallel`
        for w in world_sizes:
            for k in micro_batches:
                if batch % (w * k):
                    raise CheckError(
                        f"--micro-batches {k} does not divide the {batch // w} rows of each of {w} "
                        f"ranks (--global-batch-size {batch}); allowed: W × K dividing {batch}"
                    )
        if set(world_sizes) == {1} and set(micro_batches) == {1}:
            raise CheckError(
                "--world-sizes 1 with --micro-batches 1 is the reference itself; allowed: a world "
                "size ≥ 2 or a number of micro-batches ≥ 2"
            )

    def _check_tensor_parallel(self) -> None:
        """CheckError of one line for a tensor-parallel degree T that is not an integer ≥ 2
        dividing every W ≥ 2, or asked of a LightningModule (docs/checking.md §10, "Tensor and
        sequence parallelism")."""
        degree = self.tensor_parallel
        if degree is None:
            return
        _integer_degree("--tensor-parallel", degree)
        if self.form == "module":
            raise CheckError(
                f"--tensor-parallel {degree} with --module: a LightningModule is distributed by "
                "its strategy; allowed: --tensor-parallel with --step or --update, whose model "
                "factory parallelizes the model over the mesh it is given"
            )
        ranks = [w for w in self.world_sizes if w != 1]
        _dividing_every_w("--tensor-parallel", degree, "a T", self.world_sizes, ranks)

    def _check_expert_parallel(self) -> None:
        """CheckError of one line for an expert-parallel degree E that is not an integer ≥ 2
        dividing every W ≥ 2, asked of a LightningModule, or beside a tensor-parallel degree
        (docs/checking.md §10, "Expert parallelism")."""
        degree = self.expert_parallel
        if degree is None:
            return
        _integer_degree("--expert-parallel", degree)
        if self.form == "module":
            raise CheckError(
                f"--expert-parallel {degree} with --module: a LightningModule is distributed by "
                "its strategy; allowed: --expert-parallel with --step or --update, whose model "
                "factory keeps its experts of the mesh it is given"
            )
        if self.tensor_parallel is not None:
            raise CheckError(
                f"--expert-parallel {degree} with --tensor-parallel {self.tensor_parallel}: one "
                "mesh of the ranks at a time; allowed: one of them"
            )
        ranks = [w for w in self.world_sizes if w != 1]
        _dividing_every_w("--expert-parallel", degree, "an E", self.world_sizes, ranks)

    def _check_pipeline_parallel(self) -> None:
        """CheckError of one line for a pipeline-parallel degree P that is not an integer ≥ 2
        dividing every W, asked of another form than a whole update or beside another
        model-parallel degree, or micro-batches that do not divide a pipeline's rows
        (docs/checking.md §10, "Pipeline parallelism")."""
        degree = self.pipeline_parallel
        if degree is None:
            return
        _integer_degree("--pipeline-parallel", degree)
        if self.form != "update":
            raise CheckError(
                f"--pipeline-parallel {degree} with --{self.form}: a pipeline's schedule runs "
                "every micro-batch's forward and backward and the update steps once; allowed: "
                "--pipeline-parallel with --update"
            )
        other = next((f"--{name.replace('_', '-')} {getattr(self, name)}"
                      for name in ("tensor_parallel", "expert_parallel")
                      if getattr(self, name, None) is not None), None)  # fmt: skip
        if other is not None:
            raise CheckError(
                f"--pipeline-parallel {degree} with {other}: one mesh of the ranks at a time; "
                "allowed: one of them"
            )
        _dividing_every_w("--pipeline-parallel", degree, "a P", self.world_sizes, self.world_sizes)
        batch = self.global_batch_size
        for w in self.world_sizes:
            pipelines = w // degree
            for k in self.micro_batches:
                if batch % (pipelines * k):
                    raise CheckError(
                        f"--micro-batches {k} does not divide the {batch // pipelines} rows of "
                        f"a pipeline at W = {w} (--global-batch-size {batch} over W/P = "
                        f"{pipelines} pipelines, --pipeline-parallel {degree}); allowed: W/P × K "
                        f"dividing {batch}"
                    )

    def _check_context_parallel(self) -> None:
        """CheckError of one line for any context-parallel degree: the check's ranks run on CPUs
        (gloo), where torch's ring attention has no sharding strategy for the CPU's attention
        kernel (`CONTEXT_PARALLEL_ON_CPU`; tests/check/test_check_options.py runs it, and fails
        once torch can)."""
        degree = self.context_parallel
        if degree is None:
            return
        _integer_degree("--context-parallel", degree)
        raise CheckError(
            f"--context-parallel {degree}: context parallelism does not run on a CPU, where the "
            f"check's ranks run: {CONTEXT_PARALLEL_ON_CPU}; allowed: no --context-parallel "
            "(the sequence's shards of tensor parallelism: --tensor-parallel)"
        )


CONTEXT_PARALLEL_ON_CPU = (
    "torch 2.13's context_parallel has no sharding strategy for the CPU's scaled-dot-product "
    "attention (aten._scaled_dot_product_flash_attention_for_cpu)"
)
"""Why a context-parallel check is refused: what torch says when asked, measured here."""


def _integer_degree(option: str, degree: Any) -> None:
    """CheckError of one line for a model-parallel degree (``option``'s) that is not an integer
    ≥ 2."""
    if not terms.is_integer(degree, 2):
        raise CheckError(f"{option} {degree!r} is not allowed; allowed: an integer ≥ 2")


def _dividing_every_w(
    option: str, degree: int, named: str, world_sizes: Sequence[int], ranks: Sequence[int]
) -> None:
    """CheckError of one line for a model-parallel degree (``option``'s, ``named`` "a T" in the
    words) that does not divide every W of ``ranks`` (the layouts of ``world_sizes`` that have a
    mesh): a layout's mesh is W/degree × degree ranks."""
    apart = [w for w in ranks if w % degree]
    if apart:
        allowed = ", ".join(str(d) for d in range(2, min(ranks) + 1)
                            if all(w % d == 0 for w in ranks)) or "none"  # fmt: skip
        letter = named.split()[-1]
        raise CheckError(
            f"{option} {degree} does not divide --world-sizes "
            f"{','.join(map(str, world_sizes))} (W = {apart[0]}): a layout's mesh is "
            f"W/{letter} × {letter} ranks; allowed: {named} dividing every W ({allowed})"
        )
