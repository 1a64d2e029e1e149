"""The check of a loss, a gather or a training step on W real ranks against one device: the
functions `gatherlab.check` exports (docs/checking.md §6, §10)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from gatherlab.check import defaults, floors, hypotheses, measure, sizing, where
from gatherlab.check.judge import Recorded, judge, with_precision
from gatherlab.check.options import (
    CheckError,
    GatherOptions,
    LossOptions,
    TrainingOptions,
    options_of,
)  # fmt: skip
from gatherlab.check.reference import Reference, choose, loss_differs, one_device
from gatherlab.check.table import (
    COLUMNS,
    PRECISION_COLUMNS,
    TRAIN_COLUMN,
    CheckResult,
    Row,
    failed_row,
    frame,
    reference_notes,
)  # fmt: skip
from gatherlab.components import config
from gatherlab.components.factory import AttributeOf, Inputs, Recipe, locate
from gatherlab.core import cli, floor, imports, terms
from gatherlab.core.gradients import FLOAT64_TOLERANCE
from gatherlab.core.runfiles import Trained
from gatherlab.gather import GatherFn, registry
from gatherlab.ranks import forkstart, pool, watched
from gatherlab.ranks.external import launched_rank
from gatherlab.ranks.pool import RankError
from gatherlab.runs import removals
from gatherlab.runs.precision import InFloat64
from gatherlab.runs.spec import RunSpec

# The loss styles of docs/design.md §1, one loss each, for checking a gather.
STYLE_LOSSES = tuple(name for name, _, _ in defaults.LOSS_SETTING.style_losses)

__all__ = [
    "CheckError", "CheckResult", "GatherOptions", "LossOptions", "TrainingOptions", "check_gather",
    "check_loss", "check_training", "loss_check",
]  # fmt: skip


@contextlib.contextmanager
def warnings_once() -> Iterator[None]:
    """The warnings of a check, each distinct one (category, message, file, line) shown once in
    the caller when the check ends, with where it was raised: ``(in 6 of 6 rank jobs, and on one
    device)``. A rank job is one rank's part of one run on the pool (``pool.ranks_warnings``);
    one device is this process (the reference, whose filters decide as usual)."""
    with warnings.catch_warnings(record=True) as here, pool.ranks_warnings() as ranks:
        yield
    on_ranks: dict[tuple, str] = {
        (r.category, r.message, r.filename, r.lineno): f"in {r.count} of {r.total} rank jobs"
        for r in ranks.records()
    }
    here_keys = dict.fromkeys((w.category, str(w.message), w.filename, w.lineno) for w in here)
    for key in {**here_keys, **on_ranks}:
        category, message, filename, lineno = key
        if key in on_ranks:
            where = on_ranks[key] + (", and on one device" if key in here_keys else "")
            message = f"{message} ({where})"
        warnings.warn_explicit(message, category, filename, lineno)


# --- the check ----------------------------------------------------------------------------------


def _factory(target: str | Callable[..., Any], kind: str = "loss") -> Callable[..., Any]:
    """The class or function an import path names (``kind`` names it in the error), one the
    ranks can receive (`_sendable`)."""
    named = f"{kind} {target}" if isinstance(target, str) else kind
    if isinstance(target, str):
        try:
            target = locate(target)
        except ImportError as error:
            raise CheckError(f"{named}: {error}") from None
    if not callable(target):
        raise CheckError(f"{kind} {target!r} is not callable; allowed: a class or function")
    _sendable(target, named)
    return target


def _sendable(target: Any, named: str) -> None:
    """CheckError unless the ranks can receive ``target``: it pickles, and every module it is
    pickled by (the module of each class and function it holds, imported by name in each rank)
    is found by its name on the import path the ranks get (`imports.search_path`). A module
    imported from a file under another name (``importlib.util.spec_from_file_location``) is
    not."""
    try:
        _, modules = imports.pickled(target)
    except Exception as error:  # a lambda, a local function, an object that does not pickle
        raise CheckError(
            f"{named}: the ranks cannot receive it ({cli.error_line(error)}); allowed: a class "
            "or function of an importable module"
        ) from None
    missing = imports.unfindable(modules, imports.search_path(modules))
    if missing:
        file = getattr(sys.modules.get(missing[0]), "__file__", None)
        where = f" (imported here from {file})" if file else ""
        raise CheckError(
            f"{named}: the ranks import its module {missing[0]!r}{where} by that name, and no "
            f"directory of the import path holds it under that name; allowed: a module that "
            f"`import {missing[0]}` finds (on sys.path or PYTHONPATH)"
        )


def _gather(
    gather: str | GatherFn | None,
    loss: Callable[..., Any] | None = None,
    loss_name: str = "the loss",
) -> tuple[str, GatherFn | None]:
    """The gather's name in the table and the gather (None: native).

    A name is an option of the ``gather`` config group (``conf/gather/<name>.yaml``, the one
    registry of gathers), built from its file as Hydra builds it (`gatherlab.gather.get`); any
    other string is an import path. ``None`` or
    ``"native"`` passes no gather: refused without a loss (`check_gather`) and for a loss that
    would gather with its own default instead of communicating by itself
    (``config.native_refusal``). Its refusals name the Python argument, ``gather=``, which the
    command line's ``--gather`` passes.
    """
    if gather is None or gather == "native":
        if loss is None:
            gathers = ", ".join(option for option in _gather_options() if option != "native")
            raise CheckError(
                "gather=native is no gather (the loss communicates by itself); allowed: "
                f"{gathers}, or module:function"
            )
        refusal = config.native_refusal(loss, loss_name, "gather=")
        if refusal is not None:  # the command line's spelling too: no --gather is native
            raise CheckError(f"{refusal} (on the command line: --gather NAME; none given is "
                             "native)")  # fmt: skip
        return "native", None
    if isinstance(gather, str):
        options = _gather_options()
        if gather in options:
            return gather, registry.get(gather)
        allowed = f"{', '.join(options)}, or module:function"
        if not any(separator in gather for separator in ".:"):  # a name, not an import path
            raise CheckError(f"gather={gather} is unknown; allowed: {allowed}")
        try:
            located = _made(locate(gather), f"gather={gather}")
        except ImportError as error:
            raise CheckError(f"gather={gather}: {error}; allowed: {allowed}") from None
        _sendable(located, f"gather={gather}")
        return gather, located
    if not callable(gather):
        raise CheckError(f"gather {gather!r} is not callable; allowed: a function x -> gathered x")
    name = getattr(gather, "__qualname__", type(gather).__name__)
    gather = _made(gather, f"gather {name}")
    _sendable(gather, f"gather {name}")
    return name, gather


def _made(gather: Any, named: str) -> Any:
    """A gather class (a `gatherlab.gather.Gather` subclass, as a file of the gather group names
    it) made with no arguments, as Hydra makes it from that file; a function or an instance as
    it is."""
    if not isinstance(gather, type):
        return gather
    try:
        return gather()
    except Exception as error:
        raise CheckError(
            f"{named}: {cli.error_line(error)}; allowed: a gather class made with no arguments, "
            "an instance, or a function x -> gathered x"
        ) from None


def _gather_options() -> list[str]:
    """The options of the ``gather`` config group, ``native`` included, in the order Hydra lists
    them (`gatherlab.gather.registry`, which reads the group's files: no composition, which
    took 0.07–0.2 s a check)."""
    return sorted([*registry.names(), "native"])


@functools.cache
def _built(optim: str) -> tuple[measure.ModelFactory, Callable[..., Any], Any]:
    """The objects of the loss check's setting (`defaults.LOSS_SETTING`) with this optimizer: the
    model factory, the optimizer factory and the data set; built once per process (a test suite
    checks many losses)."""
    setting = defaults.LOSS_SETTING
    (model, model_kwargs), (data, data_kwargs) = setting.model, setting.data
    optimizer, optimizer_kwargs = defaults.LOSS_OPTIMIZERS[optim]
    return (
        functools.partial(locate(model), **model_kwargs),
        functools.partial(locate(optimizer), **optimizer_kwargs),
        locate(data)(**data_kwargs),
    )


def _setting(optim: str, world_sizes: Sequence[int], steps: int) -> tuple[Any, ...]:
    """The loss check's setting (`defaults.LOSS_SETTING`: the model, the data and the global
    batch), the model factory, the optimizer, and the global batches of the check."""
    setting = defaults.LOSS_SETTING
    model, optimizer, dataset = _built(optim)
    size = setting.global_batch_size
    batches = measure.global_batches(dataset, size, setting.seed, setting.shuffle, max(steps, 2))
    return setting, model, optimizer, batches


@warnings_once()
def _run(losses: Mapping[str, Recipe], gather_name: str, options: GatherOptions) -> CheckResult:
    """The loss check's result: each loss on each W judged against its one-device reference
    (`judge.judge`), with the hypotheses of a differing loss and where a W departs. In a low
    ``precision``, a loss that runs in float64 is judged there and its run in ``precision`` is
    measured in floors beside it; one that cannot is judged in floors of ``precision``
    (`floors.LossFloors`, docs/design.md §2, "Low precision")."""
    world_sizes, steps, precision = list(options.world_sizes), options.steps, options.precision
    cfg, model, optimizer, batches = _setting(options.optim, world_sizes, steps)
    # the batches whose global loss is compared: the first (with the gradient) and the second
    # (forward only), so that a cause holds on two batches, not on one number
    probed = batches[:2]
    view0, view1 = probed[0]
    low = floors.LossFloors.of(losses, model, probed, batches[:steps], optimizer, cfg.seed,
                               precision)  # fmt: skip
    # the loss on one device, forward only, for the hypotheses (built once, when one is tested)
    forwards = {
        name: measure.forward_on_one_device(loss, model, cfg.seed) for name, loss in losses.items()
    }
    chosen = {
        name: _reference(name, loss, model, probed, batches[:steps], optimizer, cfg.seed,
                         low.judged_in[name])
        for name, loss in losses.items()
    }  # fmt: skip

    def key(name: str, world_size: int) -> Row:
        return Row(name, gather_name, world_size, str(chosen[name].mode))

    rows: list[Row] = []
    for world_size in world_sizes:
        try:
            measured, in_low = _on_ranks(losses, low, model, probed, world_size, cfg.seed)
            trained = {
                name: measure.train(loss, model, batches[:steps], optimizer, world_size, cfg.seed,
                                    precision=low.judged_in[name])
                for name, loss in losses.items()
                if steps
            }  # fmt: skip
        except RankError as error:
            rows += [failed_row(key(name, world_size), error) for name in losses]
            continue
        for name, loss in losses.items():
            reference, reference_trained = chosen[name].value
            in_group, own = chosen[name].in_group, low.own(name)
            judged = judge(
                measured[name], reference, key(name, world_size),
                curves=(trained[name], reference_trained) if steps else None,
                reproduce=None if own else functools.partial(
                    _reproduce, measured[name], reference, forwards[name], probed, world_size,
                    in_group,
                ),
                where=None if own else functools.partial(
                    _located, loss, model, (view0, view1), world_size, cfg.seed, in_group
                ),
                recorded=Recorded(in_precision=low.in_precision(name, world_size)),
            )  # fmt: skip
            if name in in_low:  # float64 judges; the run in its precision measured beside it
                floored = low.beside(name, in_low[name], world_size)
                judged = with_precision(judged, floored, low.judged_in[name])
            rows += judged
    columns = list(COLUMNS) + ([TRAIN_COLUMN] if steps else [])
    return CheckResult(
        frame(rows, columns + (list(PRECISION_COLUMNS) if low.low else [])),
        reference_notes=reference_notes({name: (one.why, one.group_differs)
                                         for name, one in chosen.items()}),
        precision_notes=low.notes if low.low else {},
    )  # fmt: skip


def _on_ranks(
    losses: Mapping[str, Recipe],
    low: floors.LossFloors,
    model: measure.ModelFactory,
    probed: Sequence[measure.Batch],
    world_size: int,
    seed: int,
) -> tuple[dict[str, measure.Measured], dict[str, measure.Measured]]:
    """Each loss measured on W ranks in the precision it is judged in (one run on the pool per
    precision), and, in a low precision, each float64-judged loss in that precision too."""
    (view0, view1), further = probed[0], probed[1:]
    measured: dict[str, measure.Measured] = {}
    for judged in dict.fromkeys(low.judged_in.values()):
        cells = {n: loss for n, loss in losses.items() if low.judged_in[n] == judged}
        measured |= measure.measure_on_ranks(
            cells, model, view0, view1, world_size, seed, further=further, precision=judged
        )
    beside = {n: loss for n, loss in losses.items() if low.low and not low.own(n)}
    in_low = measure.measure_on_ranks(
        beside, model, view0, view1, world_size, seed, precision=low.precision
    ) if beside else {}  # fmt: skip
    return measured, in_low


def _reference(
    name: str,
    loss: Recipe,
    model: measure.ModelFactory,
    probed: Sequence[measure.Batch],
    batches: Sequence[measure.Batch],
    optimizer: Callable[..., Any],
    seed: int,
    precision: str = terms.Precision.FLOAT64,
) -> Reference[tuple[measure.Measured, Trained | None]]:
    """A loss's one-device reference (`reference.choose`): its measurement on the ``probed``
    batches and, with ``batches`` (the steps), its training run, in ``precision``; in this
    process, so that bad input is found here (CheckError)."""
    (view0, view1), further = probed[0], probed[1:]

    def reference_run() -> tuple[measure.Measured, Trained | None]:
        measured = measure.measure(loss, model, view0, view1, seed, False, further, precision)
        if not batches:
            return measured, None
        trained = measure.train(loss, model, batches, optimizer, 1, seed, precision=precision)
        return measured, trained

    try:
        return choose(reference_run, loss_differs)
    except measure.LossContractError as error:
        raise CheckError(f"loss {name}: {error}") from None
    except Exception as error:  # the factory refuses its arguments, the forward raises
        raise CheckError(f"loss {name}: {cli.error_line(error)}") from None


def _reproduce(
    measured: measure.Measured,
    reference: measure.Measured,
    forward: hypotheses.Forward,
    probed: Sequence[measure.Batch],
    world_size: int,
    in_group: bool,
) -> tuple[terms.Cause, float | None]:
    """The cause of a loss's differing global loss, reproduced on one device as its reference
    ran (`hypotheses.cause`, on the batches compared)."""
    with one_device(in_group):
        return hypotheses.cause(
            (measured.loss, *measured.forwards), (reference.loss, *reference.forwards),
            forward, probed, world_size,
        )  # fmt: skip


def _located(
    loss: Recipe,
    model: measure.ModelFactory,
    batch: measure.Batch,
    world_size: int,
    seed: int,
    in_group: bool,
) -> where.Departure | None:
    """Where a loss departs at one W: its operations recorded on one device (as its reference
    ran) and on the W ranks, and the first that departs (`gatherlab.check.where`); when none
    does, or the recording fails on a rank, no place and why (the verdict stands)."""
    view0, view1 = batch
    try:
        on_ranks = measure.traced_on_ranks({0: loss}, model, view0, view1, world_size, seed)
    except RankError as error:
        return where.unlocated(f"no line named: the trace failed on the ranks ({error})")
    with one_device(in_group):
        one = measure.traced(loss, model, view0, view1, seed)
    return where.departure(one, on_ranks[0], world_size, len(view0), FLOAT64_TOLERANCE)


def check_loss(
    factory: str | Callable[..., Any],
    world_sizes: Iterable[int] | None = None,
    *,
    options: LossOptions | None = None,
    **kwargs: Any,
) -> CheckResult:
    """Check a loss on real gloo ranks of the warm worker pool against the same loss on one
    device, in the gradient audit's setting (`gatherlab.check.defaults.LossSetting`;
    docs/checking.md §6).

    Every rank builds ``factory(**kwargs)``, adding ``rank=``/``world_size=`` when its signature
    takes them and ``kwargs`` does not set them, and ``gather=`` when the options give one.

    Args:
        factory: the loss class or function, or its import path (``module:attribute`` or a dotted
            path).
        world_sizes: the numbers of ranks to check, each an integer ≥ 2 that divides 16 (the
            options' when not given).
        options: the check's options (`LossOptions`: ``gather``, ``inputs``, ``steps``,
            ``optim``, ``seed``, ``collective_timeout_s``, ``precision``, each documented there).
        **kwargs: a keyword named like a field of `LossOptions` sets that option (over
            ``options``); every other one is the loss's own keyword argument (`loss_check` takes
            the loss's as one mapping, so that a key named like an option goes to the loss).

    Returns:
        The `CheckResult`, whose ``table`` has the columns of `COLUMNS` (and
        ``train_max_abs_loss_diff`` when ``steps`` > 0): per world size in the order given, the
        row of the whole gradient (``part`` ``all``), then, when the gradient has several parts,
        one per part (``model``, ``loss.<name>`` per trainable parameter of the loss). A world
        size whose ranks raise, or break the loss's contract, has one ``failed`` row with the
        rank's error line in ``error``. The ``loss`` column is the import path when ``factory``
        is one, else the factory's qualified name.

    Raises:
        CheckError: bad input, before any rank runs (``native`` refused where it cannot run
            included); also when the loss fails on one device.

    Example:
        >>> from gatherlab.check import check_loss
        >>> result = check_loss("gatherlab.losses:NTXentLoss", gather="old", temperature=0.5)
        >>> result.table["verdict"].tolist()
        ['biased', 'biased']
    """
    chosen = {key: value for key, value in kwargs.items() if key in _LOSS_OPTIONS}
    loss_kwargs = {key: value for key, value in kwargs.items() if key not in _LOSS_OPTIONS}
    return loss_check(factory, loss_kwargs, _options(LossOptions, options, world_sizes, chosen))


_LOSS_OPTIONS = frozenset(option.name for option in dataclasses.fields(LossOptions))


def _options(kind: type, options: Any, world_sizes: Iterable[int] | None, chosen: Any) -> Any:
    """The options of a check: ``options`` (the kind's defaults when None) with the world sizes
    and the keywords ``chosen`` over them, validated again (`CheckError` of one line)."""
    if options is not None and type(options) is not kind:  # a LossOptions' gather: not a gather's
        raise CheckError(
            f"options={type(options).__name__}(...) is not allowed; allowed: {kind.__name__}"
        )
    chosen = options_of(kind, chosen, kind.__name__)
    if world_sizes is not None:
        chosen["world_sizes"] = world_sizes
    if options is None:
        options = kind(**chosen)
    elif chosen:
        options = dataclasses.replace(options, **chosen)
    _startable(options.world_sizes)
    return options


def _startable(world_sizes: Sequence[int]) -> None:
    """CheckError of one line where the ranks this check starts would each run the user's
    script again and, from its top level, start ranks of their own (`forkstart.unguarded_main`):
    a script without ``if __name__ == "__main__":``. Ranks torchrun started are not started."""
    if max(world_sizes) == 1 or launched_rank() is not None:
        return
    statement = forkstart.unguarded_main()
    if statement is not None:
        raise CheckError(
            f"{statement} starts the check at the script's top level, which every rank the "
            'check starts runs again; allowed: the call under `if __name__ == "__main__":`'
        )


# The keyword arguments the check itself passes to a loss (`Recipe.arguments`), each with the
# option that sets it. ``rank=`` and ``world_size=`` are not among them: they are passed only
# where the loss's own arguments do not set them, so a user may set them.
PASSED_BY_THE_CHECK = {"gather": "--gather NAME or module:function (gather= in Python)"}


def loss_check(
    factory: str | Callable[..., Any],
    kwargs: Mapping[str, Any],
    options: LossOptions | None = None,
) -> CheckResult:
    """`check_loss` with the loss's keyword arguments as one mapping, ``kwargs`` (the command
    line's ``--kwargs``): a key named like one of the options (``seed``, ``steps``, …) goes to
    the loss; a key the check passes to the loss itself (`PASSED_BY_THE_CHECK`: ``gather``) is
    refused in one line (CheckError), before any rank runs."""
    options = LossOptions() if options is None else options
    for key, option in PASSED_BY_THE_CHECK.items():
        if key in kwargs:
            raise CheckError(
                f"--kwargs holds {key!r}, which the check passes to the loss itself; allowed: "
                f"{option}, and the loss's other keyword arguments in --kwargs"
            )
    function = _factory(factory)
    name = factory if isinstance(factory, str) else getattr(function, "__qualname__", "loss")
    gather_name, gather_fn = _gather(options.gather, function, name)
    loss = Recipe(function, dict(kwargs), gather_fn, options.seed,
                  _inputs(options.inputs, options.seed))  # fmt: skip
    with watched.watching(options.collective_timeout_s):
        return _run({name: loss}, gather_name, options)


# What a loss's inputs factory is given, where its signature takes it: the loss check's global
# batch and the width of its model's embeddings (`defaults.LOSS_SETTING`).
INPUTS_OFFERED = {
    "global_batch_size": defaults.LOSS_SETTING.global_batch_size,
    "embedding_dim": defaults.LOSS_SETTING.model[1]["out_features"],
}


def _inputs(inputs: Any, seed: int) -> Inputs | None:
    """A loss's further inputs (`Inputs`) as the user gives them (`check_loss`'s ``inputs``),
    made here with ``seed`` drawn, so that every rank and one device are given the same; or
    CheckError in one line, before any rank runs."""
    if inputs is None:
        return None
    named = f"--inputs {inputs}" if isinstance(inputs, str) else "inputs"
    made = inputs
    if isinstance(inputs, str) or (callable(inputs) and not isinstance(inputs, torch.Tensor)):
        try:
            factory = locate(inputs) if isinstance(inputs, str) else inputs
            try:
                accepted = inspect.signature(factory).parameters
            except ValueError:  # a builtin without a signature: given nothing
                accepted = {}
            offered = {key: value for key, value in INPUTS_OFFERED.items() if key in accepted}
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                made = factory(**offered)
        except Exception as error:  # it does not import, or raises
            raise CheckError(f"{named}: {cli.error_line(error)}") from None
    try:
        return Inputs.made(made, defaults.LOSS_SETTING.global_batch_size, named)
    except ValueError as error:
        raise CheckError(str(error)) from None


def check_gather(
    gather: str | GatherFn,
    world_sizes: Iterable[int] | None = None,
    *,
    options: GatherOptions | None = None,
    **chosen: Any,
) -> CheckResult:
    """Check a gather with gatherlab's three loss styles (local ``ntxent``, global
    ``ntxent_global``, mixed ``vicreg``, `defaults.LossSetting.style_losses`) against one
    device: one row per loss × world size.

    Args:
        gather: an option of the ``gather`` config group but ``native`` (gatherlab's are
            `gatherlab.gather.NAMES`), a function ``x -> gathered x``, or its import path.
        world_sizes: the numbers of ranks to check, each an integer ≥ 2 that divides 16 (the
            options' when not given).
        options: the check's options (`GatherOptions`: ``steps``, ``optim``, ``seed``,
            ``collective_timeout_s``, ``precision``, each documented there).
        **chosen: any of those fields, set over ``options``.

    Returns:
        The `CheckResult`, its ``table`` like `check_loss`'s, for each world size in the order
        given the three losses in the order above (a world size whose ranks raise: one
        ``failed`` row per loss); its ``gather`` column is the name or import path given, or
        the function's qualified name.

    Raises:
        CheckError: bad input, before any rank runs: ``None`` or ``"native"`` (no gather), a
            name that is no option of the ``gather`` group, a path that does not import, an
            object that is not callable, an option that is not allowed, or a keyword that is
            no option.

    Example:
        >>> from gatherlab.check import check_gather
        >>> result = check_gather("old", world_sizes=(2, 4))
        >>> result.table["verdict"].tolist()
        ['biased', '1/W', 'biased', 'biased', '1/W', 'biased']
    """
    options = _options(GatherOptions, options, world_sizes, chosen)
    gather_name, gather_fn = _gather(gather)
    losses = {
        name: Recipe(locate(target), dict(kwargs), gather_fn, options.seed)
        for name, target, kwargs in defaults.LOSS_SETTING.style_losses
    }
    with watched.watching(options.collective_timeout_s):
        return _run(losses, gather_name, options)


# --- the check of a training step (docs/checking.md §10)
# -------------------------------------------


def _path_name(factory: str | Callable[..., Any]) -> str:
    return factory if isinstance(factory, str) else getattr(factory, "__qualname__", "module")


def _plain(options: TrainingOptions) -> Any:
    """The plain PyTorch form to check, its parts imported: a ``step``
    (`gatherlab.runs.plainstep.Step`) or an ``update`` (`gatherlab.runs.update.Update`);
    CheckError for a path that does not import or an object that is not callable."""
    optimizer, optimizer_kwargs = options.optimizer, options.optimizer_kwargs
    if optimizer_kwargs is None:
        optimizer_kwargs = defaults.OPTIMIZER_KWARGS if optimizer == defaults.OPTIMIZER else {}
    from gatherlab.runs import plainstep, update

    kind = plainstep.Step if options.form == "step" else update.Update
    return kind(
        _factory(options.function, options.form),
        Recipe(_factory(options.model, "model"), dict(options.model_kwargs or {}), None,
               options.seed),
        _factory(optimizer, "optimizer"),
        dict(optimizer_kwargs),
    )  # fmt: skip


def check_training(
    module: str | Callable[..., Any] | None = None,
    data: str | Callable[..., Any] | None = None,
    world_sizes: Iterable[int] | None = None,
    *,
    options: TrainingOptions | None = None,
    **chosen: Any,
) -> CheckResult:
    """Check a training step (a ``LightningModule``, a plain PyTorch step or a whole update)
    trained on W real ranks against the same on one device, and name the part that breaks it:
    docs/checking.md §10 says how and what the table holds.

    Args:
        module: the ``LightningModule`` class or factory, or its import path (or give ``step=``
            or ``update=``).
        data: the map-style data set's class or factory, or its import path.
        world_sizes: the numbers of ranks (the options' when not given).
        options: the check's options (`TrainingOptions`, each field documented there).
        **chosen: any field of `TrainingOptions`, set over ``options`` (``step=``, ``model=``,
            ``steps=``, …).

    Returns:
        The `CheckResult`: its ``table`` (`gatherlab.check.table.TRAINING_COLUMNS`), ``trained``
        (how the command line names what was trained: ``--module M``, ``--step S``, ``--update
        U``), the notes the text prints, and ``loss_check`` where the loss attribute was checked.

    Raises:
        CheckError: bad input, before any rank runs.

    Example:
        >>> from gatherlab.check import check_training
        >>> result = check_training(  # examples/ssl_modules.py
        ...     "ssl_modules:SimCLRWithBatchNorm", "ssl_modules:GaussianPairs", steps=2
        ... )
        >>> result.table.groupby("world_size")["culprits"].first().tolist()
        ['batchnorm', 'batchnorm']
    """
    given = {"module": module, "data": data, "world_sizes": world_sizes}
    chosen = {key: value for key, value in given.items() if value is not None} | chosen
    options = _options(TrainingOptions, options, None, chosen)
    from gatherlab.check import training  # Lightning is imported only for a LightningModule

    setting = _training_setting(options)
    world_sizes, micro_batches = options.world_sizes, options.micro_batches
    applying, layout = _validated(setting, options.loss_attr, micro_batches, world_sizes)
    _experts_split(setting, world_sizes, options.collective_timeout_s)
    parameters = sum(stop - start for ranges in layout.values() for start, stop in ranges)
    alone = sizing.floors_alone(setting.spec.precision, parameters, options.judge_in)
    alone = alone and _unfloored(setting, applying) is None  # else float64's verdict at any size
    _fits(setting, parameters, max(world_sizes), alone)
    if setting.spec.pipeline_parallel > 1:  # on one pipeline's ranks, before any rank trains
        try:
            with watched.watching(options.collective_timeout_s):
                training.validate_pipeline(setting, micro_batches, world_sizes)
        except ValueError as error:
            raise CheckError(str(error)) from None
    at_size = None if options.judge_in == "floors" else parameters  # else asked for
    setting, precision_words = _in_precision(setting, applying, at_size if alone else None, alone)
    with warnings_once(), watched.watching(options.collective_timeout_s):
        try:  # one device, in this process: a training_step without a loss is found here
            first = training.first_reference(setting)
        except Exception as error:
            raise CheckError(f"{setting.label} on one device: {cli.error_line(error)}") from None
        result = training.check(setting, world_sizes, applying, first, layout, micro_batches)
    table = result.table
    blamed = table.loc[table["culprits"].str.contains(terms.Culprit.LOSS), "world_size"]
    loss_check = None
    if options.loss_attr is not None and len(blamed):
        loss = AttributeOf(setting.built, options.loss_attr)
        loss_check = check_loss(
            loss, sorted(set(blamed)), seed=options.seed,
            collective_timeout_s=options.collective_timeout_s,
        )  # fmt: skip
    notes = {} if precision_words is None else {setting.name: precision_words}
    return dataclasses.replace(
        result, trained=setting.label, precision_notes=notes, loss_check=loss_check
    )


def _experts_split(setting: Any, world_sizes: Sequence[int], timeout_s: float) -> None:
    """CheckError of one line where an expert-parallel model factory, built on the ranks of each
    W before any trains, does not split one device's model over them (`experts.split_refused`:
    it raises there, a rank holds a parameter one device does not have, no rank holds one, a
    rank holds no expert, every rank holds every parameter), docs/checking.md §10, "Expert
    parallelism"; the ranks' collectives watched (``timeout_s``: a rank that never comes is
    named, nothing hangs)."""
    if setting.spec.expert_parallel < 2:
        return
    from gatherlab.check import experts

    with watched.watching(timeout_s):
        refused = experts.split_refused(setting, world_sizes)
    if refused is not None:
        raise CheckError(refused)


def _fits(setting: Any, parameters: int, world_size: int, floors: bool) -> None:
    """CheckError of one line when the check at its largest W of a step of ``parameters``
    trainable parameters (judged in floors alone with ``floors``) would need more memory than
    this machine has left (`sizing.too_large`), before any rank starts; the ranks a launcher
    started are each on their own machine's memory and are not estimated here."""
    from gatherlab.ranks import external

    if external.launched():
        return
    precision = setting.spec.precision
    refused = sizing.too_large(parameters, world_size, sizing.available_bytes(), precision, floors)
    if refused is not None:
        raise CheckError(f"{setting.label}: {refused}")


def _in_precision(
    setting: Any,
    applying: Sequence[removals.Removal],
    at_size: int | None = None,
    alone: bool = False,
) -> tuple[Any, str | None]:
    """The setting with the precision its verdict rests on and the low precision measured in
    floors (`floor.judged_in`), from its first step run in float64 on one device
    (``training.float64_watch``), and the words of the printed text on its precision (None for
    plain float64). No floor is measured for a LightningModule (Lightning calls its forward: it
    cannot be split into row blocks from outside), for a model with batch norm (the blocks
    would split its statistics) nor for a tensor-parallel model (the blocks split rows, its ranks
    split the sums over features): such code is judged in float64 where it runs there, and
    refused with one line (CheckError) where it does not. A check judged in floors alone
    (``alone``: `sizing.floors_alone`, by its trainable parameters ``at_size`` or asked for where
    None, and a floor that is measured) is judged in its precision's floors without the watch
    (`_floors_alone`)."""
    from gatherlab.check import training

    requested, raised = setting.spec.precision, False
    if alone:
        return _floors_alone(setting, at_size)
    unfloored, scalar = _unfloored(setting, applying), False
    try:  # as the reference runs: in a one-rank group when it raises without one
        watched, scalar = choose(lambda: training.float64_watch(setting)).value
    except Exception as error:  # even in a one-rank group: the reference runs it as asked
        watched, raised = InFloat64(f"in float64 it raises {cli.error_line(error)}", None), True
    if unfloored is None and scalar:  # found running it: a floor's row blocks cannot cut it
        unfloored = "a model whose forward returns its loss (row blocks cannot cut a scalar)"
    if setting.spec.tensor_parallel > 1 and not (watched.runs or raised or watched.autocast):
        # its own casts (transformers' RMSNorm, rotary embedding and loss compute in float32
        # whatever the parameters' dtype): the rest runs in float64, which judges it
        spec = dataclasses.replace(setting.spec, precision=str(terms.Precision.FLOAT64))
        return dataclasses.replace(setting, spec=spec), (
            f"It computes some operations in float32 itself (the first: {watched.lower}), and "
            "the floor is not measured for a tensor-parallel model: judged in float64, its own "
            "float32 operations kept. One over rows that the data-parallel groups split (a mean "
            "loss in float32, as transformers' own) rounds otherwise than one device by a float32 "
            "unit: a loss computed from the logits in float64 is judged to float64's rounding"
        )
    judged, low = floor.judged_in(requested, watched.runs, watched.autocast)
    setting = dataclasses.replace(setting, spec=dataclasses.replace(setting.spec, precision=judged))
    if low is not None and unfloored is not None:
        if judged != terms.Precision.FLOAT64:
            raise CheckError(
                f"{setting.label} cannot run in float64 ({watched.lower}), and the floor in {low} "
                f"is not measured for {unfloored}; allowed: code that runs in float64"
            )
        word = terms.Precision(low).word
        return setting, f"The floor in {word} is not measured for {unfloored}: judged in float64"
    setting = dataclasses.replace(setting, low=low)
    return setting, None if low is None else _precision_words(setting, watched)


def _floors_alone(setting: Any, at_size: int | None) -> tuple[Any, str]:
    """A low-precision check judged in floors of its precision alone (docs/design.md §2, "Low
    precision at size"), by its trainable parameters ``at_size`` (None: asked for): its verdict
    rests on the precision (``exact within float32`` where float64's would be ``exact``), its
    runs keep their vectors in it and the one-device reference runs once
    (`training.Setting.floors_alone`); the words of the printed text."""
    low = setting.spec.precision
    spec = dataclasses.replace(setting.spec, keep_precision=True)
    setting = dataclasses.replace(setting, spec=spec, low=low, floors_alone=True)
    word = terms.Precision(low).word
    why = (
        "Asked for (--judge-in floors), it" if at_size is None
        else f"At {at_size:,} trainable parameters (from {defaults.FLOORS_ALONE_PARAMETERS:,}) it"
    )  # fmt: skip
    return setting, (
        f"{why} is judged in {word} against a measured floor alone: three runs in {word}, no "
        "float64 verdict, no line named where a run departs; --judge-in float64 "
        "(judge_in='float64') asks for the float64 verdict"
    )


def _unfloored(setting: Any, applying: Sequence[removals.Removal]) -> str | None:
    """Why no floor is measured for what the setting trains, in words (None: one is)."""
    return (
        "a LightningModule (Lightning calls its forward)" if setting.form.option == "--module"
        else "a model with batch norm (row blocks would split its statistics)"
        if removals.Removal.BATCHNORM in applying
        else "a tensor-parallel model (row blocks do not split its sums over features as its "
        "ranks do)" if setting.spec.tensor_parallel > 1
        else "a pipeline (its stages are built on its ranks alone)"
        if setting.spec.pipeline_parallel > 1
        else "an expert-parallel model (row blocks would split its routing's statistics)"
        if setting.spec.expert_parallel > 1 else None
    )  # fmt: skip


def _precision_words(setting: Any, watched: InFloat64) -> str:
    """Why a check is judged in the precision it is, for the printed text."""
    word = terms.Precision(setting.low).word
    if setting.in_own_precision:
        return (
            f"it cannot run in float64 ({watched.lower}): judged in {word} against a measured floor"
        )
    asked = f"its own torch.autocast asks for {watched.autocast}; " if watched.autocast else ""
    return (
        f"{asked}it runs in float64, which judges it (autocast leaves float64 alone); its {word} "
        "run is measured in floors beside it"
    )


def _training_setting(options: TrainingOptions) -> Any:
    """What `check_training` trains (``training.Setting``: the form and its `RunSpec`), its parts
    imported; CheckError for a path that does not import."""
    from gatherlab.check import training

    data_factory = _factory(options.data, "data")
    seed = options.seed
    if options.form == "module":
        from gatherlab.runs import fit  # Lightning: only for a LightningModule

        module = Recipe(_factory(options.module, "module"), dict(options.module_kwargs or {}),
                        None, seed)  # fmt: skip
        form = fit.Module(module)
    else:
        form = _plain(options)
    spec = RunSpec(
        data=Recipe(data_factory, dict(options.data_kwargs or {}), None, seed),
        global_batch_size=options.global_batch_size, steps=options.steps, seed=seed,
        precision=options.precision, strategy=options.strategy,
        step_budget_s=options.step_budget_s,
        tensor_parallel=_tensor_parallel(options),
        pipeline_parallel=_pipeline_parallel(options),
        expert_parallel=_expert_parallel(options),
    )  # fmt: skip
    return training.Setting(form, spec, _path_name(options.function))


def _tensor_parallel(options: TrainingOptions) -> int:
    """The tensor-parallel degree T of a plain form's layout (1: none; its value checked by the
    options); CheckError of one line for a model factory without a ``mesh`` argument (code that
    does not parallelize itself), docs/checking.md §10, "Tensor and sequence parallelism"."""
    degree = options.tensor_parallel
    if degree is None:
        return 1
    model = _factory(options.model, "model")
    if not Recipe(model).accepts("mesh"):
        raise CheckError(
            f"--tensor-parallel {degree}: --model {_path_name(options.model)} takes no mesh "
            "argument, so it cannot parallelize itself; allowed: a factory build(mesh=None, ...) "
            "that calls parallelize_module(model, mesh['tp'], plan) when a mesh is given, or no "
            "--tensor-parallel"
        )
    return degree


def _pipeline_parallel(options: TrainingOptions) -> int:
    """The pipeline-parallel degree P of a whole update's layout (1: none; its value checked by
    the options); CheckError of one line for a model factory without a ``mesh`` argument (code
    that cannot keep its stages of the ranks' mesh), docs/checking.md §10, "Pipeline
    parallelism"."""
    degree = options.pipeline_parallel
    if degree is None:
        return 1
    if not Recipe(_factory(options.model, "model")).accepts("mesh"):
        raise CheckError(
            f"--pipeline-parallel {degree}: --model {_path_name(options.model)} takes no mesh "
            "argument, so it cannot keep its stages of the ranks' mesh; allowed: a factory "
            "build(mesh=None, ...) that keeps this rank's stages of mesh['pp'] when given a mesh, "
            "or no --pipeline-parallel"
        )
    return degree


def _expert_parallel(options: TrainingOptions) -> int:
    """The expert-parallel degree E of a plain form's layout (1: none; its value checked by the
    options); CheckError of one line for a model factory without a ``mesh`` argument (code that
    cannot keep its experts of the ranks' mesh), docs/checking.md §10, "Expert parallelism"."""
    degree = options.expert_parallel
    if degree is None:
        return 1
    model = _factory(options.model, "model")
    if not Recipe(model).accepts("mesh"):
        raise CheckError(
            f"--expert-parallel {degree}: --model {_path_name(options.model)} takes no mesh "
            "argument, so it cannot keep its experts of the ranks' mesh; allowed: a factory "
            "build(mesh=None, ...) that keeps this rank's experts of mesh['ep'] when given a "
            "mesh, or no --expert-parallel"
        )
    return degree


def _validated(
    setting: Any,
    loss_attr: str | None,
    micro_batches: tuple[int, ...] = (1,),
    world_sizes: tuple[int, ...] = (),
) -> tuple[tuple[removals.Removal, ...], measure.Layout]:
    """The setting validated as on one device (``training.validate``: the removals that apply
    and the parts of the gradient), and ``loss_attr`` a callable attribute of what it builds;
    CheckError otherwise. Built as the reference runs (`reference.choose`): without a process
    group, or in a one-rank group when the module's construction raises without one."""
    from gatherlab.check import training

    def validated() -> tuple[tuple[removals.Removal, ...], measure.Layout, Any]:
        applying, layout = training.validate(setting, micro_batches, world_sizes)
        attribute = None if loss_attr is None else getattr(setting.built(), loss_attr, None)
        return applying, layout, attribute

    try:
        applying, layout, attribute = choose(validated).value
    except ValueError as error:
        raise CheckError(str(error)) from None
    if loss_attr is not None and not callable(attribute):
        raise CheckError(
            f"--loss-attr {loss_attr}: {setting.name} has no callable attribute {loss_attr!r}; "
            "allowed: the attribute that holds its loss"
        )
    return applying, layout
