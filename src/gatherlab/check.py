"""Check your own loss or gather: does it train on W ranks exactly like one device?

``python -m gatherlab.check mypkg.losses:MyLoss --kwargs '{"temperature": 0.1}' --world-sizes 2,4``
builds the loss inside every rank of a real gloo group (``gatherlab.factory``: with ``rank=`` and
``world_size=`` when its constructor takes them, ``gather=`` only with ``--gather``; without it the
loss communicates by itself), calls ``loss(z0, z1)`` on the rank's slice of the two views'
embeddings (the gradient audit's MLP and Gaussian view pairs, float64, the data order of
docs/design.md §2), and compares with the same loss on one device:

- ``forward``: the global loss (the mean over ranks of what each rank returns) is ``same`` or
  ``differs`` (relative tolerance 1e-10);
- ``gradient``: DDP's parameter gradient is ``exact``, ``1/W``, ``W``, ``biased``, ``none`` or
  ``other`` (``gradients.classify``);
- with ``--steps N``, a short training run's largest |Δloss|.

The verdict per W is ``exact`` when both are, ``loss differs`` when the forward already differs,
and otherwise the gradient's class; every other verdict comes with a diagnosis in plain words.
``--gather mod:fn`` without a loss checks a gather with gatherlab's three loss styles. It writes
``check.csv`` into ``--out`` and exits 0 when every W is exact, 1 otherwise, 2 for bad input.
"""

from __future__ import annotations

if __name__ == "__main__":  # the command line: its ranks' fork server imports torch beside it,
    # and what this module imports (each rank runs this module again as its main module); the
    # ranks of a training step's check (--module) run Lightning too
    import sys

    from gatherlab import forkstart

    _training = ("lightning.pytorch", "gatherlab.usermodule") if "--module" in sys.argv else ()
    forkstart.start(("gatherlab.gradients", "gatherlab.config", "gatherlab.runfiles", *_training))

import argparse
import functools
import json
import sys
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd

from gatherlab import cli, config, gradients, runfiles, terms
from gatherlab import gather as gathering
from gatherlab.config import ConfigError
from gatherlab.factory import LossFactory, locate
from gatherlab.pool import RankError

COLUMNS = (
    "loss", "gather", "world_size", "forward", "gradient", "verdict", "loss_diff", "cosine",
    "norm_ratio", "max_rel_err",
)  # fmt: skip
"""The columns of a check's table (``check.csv``), in order; with ``steps`` a last column,
``train_max_abs_loss_diff``, follows. ``forward`` is ``same`` or ``differs``; ``gradient`` one of
``exact``, ``1/W``, ``W``, ``biased``, ``none``, ``other``; ``verdict`` is ``exact``, ``loss
differs`` or the gradient's class; ``loss_diff`` is the relative difference of the global loss;
``gather`` is ``native`` when the loss communicates by itself (docs/design.md §5, §6)."""
TRAIN_COLUMN = "train_max_abs_loss_diff"
OPTIMIZERS = ("sgd", "adamw")
# The loss styles of docs/design.md §1, one loss each, for checking a gather (the audit's losses).
STYLE_LOSSES = ("ntxent", "ntxent_global", "vicreg")

__all__ = [
    "COLUMNS", "CheckError", "LossFailed", "check_gather", "check_loss", "check_training",
    "explain", "explain_training",
]  # fmt: skip


class CheckError(ValueError):
    """Bad input, found before any rank runs: the message is one line naming the part.

    Raised by `check_loss` and `check_gather` for a factory or gather that does not import or is
    not callable, a world size that is not an integer ≥ 2 dividing the global batch of 16, an
    unknown ``optim``, a ``steps`` that is not an integer ≥ 0, and a loss that fails on one device
    (its arguments are refused, its forward raises, or it returns no finite scalar).
    ``python -m gatherlab.check`` prints it and exits with status 2.
    """


class LossFailed(RuntimeError):
    """The loss raised, or broke its contract, on a rank; the message names the rank.

    Raised by `check_loss` and `check_gather` after the loss ran on one device, for example when
    its forward raises on one rank only, or when a parameter gets no gradient on a rank (DDP could
    not average it). The message starts with ``W=<world size>``, then the failing rank's first
    line. ``python -m gatherlab.check`` prints it and exits with status 1.
    """


# --- what each verdict means --------------------------------------------------------------------

DIAGNOSES = {
    "loss differs": (
        "the loss itself is not the 1-device loss: the mean over ranks of what the ranks return "
        "differs from the loss of the whole batch (relative difference {loss_diff:.2g}). Usual "
        "causes: statistics of the rank's own batch (mean, standard deviation, covariance, batch "
        "norm), negatives or targets taken from the local batch only, or a normalisation by the "
        "local batch size. No backward can make it exact. Fix: compute every statistic over the "
        "gathered batch, through a gather whose backward sums the ranks' gradients "
        "(gatherlab.gather.Fixed, torch.distributed.nn.functional.all_gather)."
    ),
    "1/W": (
        "every rank computes the full loss but gradients reach only the local slice: the "
        "gradient is 1/W of one device's (norm ratio {norm_ratio:.6g}, cosine {cosine:.12g}); "
        "SGD's effective learning rate is divided by W, and anything added to the gradient "
        "outside the loss (L2 weight decay, another loss term) weighs W times more. Usual cause: "
        "an all_gather without gradient with the live local tensor put back in its slot "
        "(OpenCLIP's gather_with_grad=False), or a gather whose backward keeps only the own "
        "slice (lightly's GatherLayer before PR #1531). Fix: a gather whose backward sums every "
        "rank's gradient of each slice (gatherlab.gather.Fixed, "
        "torch.distributed.nn.functional.all_gather)."
    ),
    "W": (
        "the gradient is W times one device's (norm ratio {norm_ratio:.6g}): SGD's effective "
        "learning rate is multiplied by W. Usual cause: the loss multiplied by the world size to "
        "undo DDP's average, on top of a gather whose backward already sums the ranks' "
        "gradients. Fix: drop the factor."
    ),
    "biased": (
        "the gradient points in another direction than one device's (cosine {cosine:.6g}, norm "
        "ratio {norm_ratio:.4g}): part of the paths from the loss to the embeddings is missing or "
        "scaled differently from the rest, and no learning rate repairs that. Usual causes: a "
        "loss over the rank's own rows (its anchors against the gathered batch) with a gather "
        "that drops the other ranks' gradients of this rank's slice (no gradient, or the own "
        "slice only), or a gather that averages the gathered path while the direct use of the "
        "local embeddings keeps its size. Fix: a gather whose backward sums every rank's "
        "gradient of each slice (gatherlab.gather.Fixed, "
        "torch.distributed.nn.functional.all_gather)."
    ),
    "none": (
        "no gradient reaches the model's parameters on W ranks, while one device has one: the "
        "loss uses the embeddings only through a gather without gradient (a torch.no_grad "
        "all_gather such as MoCo's concat_all_gather), so nothing connects the loss to the "
        "model, and DDP training fails at its first backward. Fix: a gather whose backward sums "
        "every rank's gradient of each slice (exact); putting the live local tensor back in its "
        "slot gives 1/W."
    ),
    "other": (
        "the gradient has the right direction (cosine {cosine:.12g}) but a scale that is neither "
        "1, 1/W nor W (norm ratio {norm_ratio:.6g}): some factor depends on the layout, e.g. a "
        "loss divided by the local batch size in one place and by the global one in another."
    ),
}


# What each cause of docs/design.md §10 means, and its fix (the check of a training step).
CAUSE_DIAGNOSES = {
    "batchnorm": (
        "batch norm normalises each rank's batch with its own statistics (plain DDP's "
        "BatchNorm), so W ranks compute another function of the batch than one device. Fix: "
        "statistics over the global batch: torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) "
        "on GPUs (NCCL), gatherlab.batchnorm.GlobalBatchNorm on any backend; or no batch norm "
        "where the split batch passes."
    ),
    "dropout": (
        "dropout masks come from each process's random generator, so a sample's mask depends on "
        "the rank that holds it and on what that rank drew before. Fix: draw each sample's mask "
        "from a generator seeded by (seed, epoch, sample index) (gatherlab.models.SeededDropout), "
        "or accept the difference: noise of the same distribution, not a bias."
    ),
    "data_randomness": (
        "the data set's augmentations draw from each process's global random streams (random, "
        "numpy, torch), so a sample's views depend on the rank that loads it. Fix: seed each "
        "sample's augmentation from its index and the epoch, e.g. a torch.Generator seeded by "
        "(seed, epoch, index) in __getitem__."
    ),
    "loss": (
        "with batch norm, dropout and the data's randomness removed the run is still not exact: "
        "the loss itself, or how it communicates across ranks (its gather), breaks it."
    ),
}
DIAGNOSES["diverges"] = (
    "the first step agrees with one device, a later one does not: something besides the first "
    "step's loss and gradient depends on the layout (an optimizer state, a buffer updated per "
    "rank, randomness drawn after the first step)."
)


def verdict(forward: str, gradient: str) -> str:
    """``exact`` when forward and gradient are; ``loss differs`` when the forward differs; else
    the gradient's class."""
    if forward == terms.Forward.DIFFERS:
        return terms.LOSS_DIFFERS
    return gradient


def diagnosis(row: Mapping[str, Any]) -> str:
    """What a row's verdict means, its usual cause in code and what would make it exact."""
    return DIAGNOSES[row["verdict"]].format(**row) if row["verdict"] != "exact" else "exact"


class _PerWorldSize:
    """The numbers of several world sizes, formatted one after the other ("0.5, 0.25")."""

    def __init__(self, values: Iterable[float]):
        self.values = list(values)

    def __format__(self, spec: str) -> str:
        return ", ".join(format(value, spec) for value in self.values)


def explain(table: pd.DataFrame) -> str:
    """The check as text: the table, then for every verdict other than exact (per loss) its
    diagnosis, once for all the world sizes that share it.

    This is what ``python -m gatherlab.check`` prints and the message of
    `gatherlab.testing.assert_layout_invariant`'s ``AssertionError``.

    Args:
        table: a table of `check_loss` or `check_gather` (the columns of `COLUMNS`, and
            ``train_max_abs_loss_diff`` when present).

    Returns:
        The table as Markdown, then one paragraph per loss, gather and verdict other than
        ``exact``: the world sizes, the verdict, and what it means, its usual cause in code and
        the fix. When every verdict is exact, the last paragraph says so. The text ends with a
        newline.

    Example:
        >>> from gatherlab.check import check_loss, explain
        >>> text = explain(check_loss("gatherlab.losses:NTXentLoss", gather="fixed"))
        >>> text.splitlines()[-1]
        'Every world size trains like one device (float64, to 1e-10).'
        >>> print(explain(check_loss("gatherlab.losses:NTXentLoss", gather="old")))  # diagnoses
    """
    lines = [markdown(table)]
    failing = table[table["verdict"] != "exact"]
    for (loss, gather, verdict_), rows in failing.groupby(
        ["loss", "gather", "verdict"], sort=False
    ):
        sizes = ", ".join(str(size) for size in rows["world_size"])
        via = "" if gather == "native" else f" with gather {gather}"
        numbers = {"verdict": verdict_}
        numbers.update({c: _PerWorldSize(rows[c]) for c in ("loss_diff", "cosine", "norm_ratio")})
        text = diagnosis(numbers)
        text = textwrap.fill(
            text[0].upper() + text[1:], 100, initial_indent="  ", subsequent_indent="  "
        )
        lines.append(f"{loss}{via}, W = {sizes}: {verdict_}\n{text}")
    if failing.empty:
        lines.append("Every world size trains like one device (float64, to 1e-10).")
    return "\n\n".join(lines) + "\n"


# The columns the check of a training step prints (check.csv has them all).
TRAINING_COLUMNS = (
    "world_size", "variant", "forward", "gradient", "verdict", "first_diff_step",
    "train_max_abs_loss_diff", "max_abs_param_diff", "cosine", "norm_ratio",
)  # fmt: skip


def markdown(table: pd.DataFrame, columns: Sequence[str] = (*COLUMNS, TRAIN_COLUMN)) -> str:
    columns = [c for c in columns if c in table.columns]

    def cell(value: Any) -> str:
        if value is pd.NA:  # a step column with no such step
            return "—"
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    rows = [[cell(row[c]) for c in columns] for _, row in table.iterrows()]
    return runfiles.markdown_table(columns, rows)


# --- the check ----------------------------------------------------------------------------------


def _factory(target: str | Callable[..., Any], kind: str = "loss") -> Callable[..., Any]:
    """The class or function an import path names (``kind`` names it in the error)."""
    if isinstance(target, str):
        try:
            target = locate(target)
        except ImportError as error:
            raise CheckError(f"{kind} {target}: {error}") from None
    if not callable(target):
        raise CheckError(f"{kind} {target!r} is not callable; allowed: a class or function")
    return target


def _gather(gather: str | gathering.GatherFn | None) -> tuple[str, gathering.GatherFn | None]:
    """The gather's name in the table and the gather (None: native)."""
    if gather is None or gather == "native":
        return "native", None
    if isinstance(gather, str):
        if gather in gathering.NAMES:
            return gather, gathering.get(gather)
        try:
            return gather, locate(gather)
        except ImportError as error:
            allowed = ", ".join(gathering.NAMES)
            raise CheckError(
                f"--gather {gather}: {error}; allowed: {allowed}, native, or module:function"
            ) from None
    if not callable(gather):
        raise CheckError(f"gather {gather!r} is not callable; allowed: a function x -> gathered x")
    return getattr(gather, "__qualname__", type(gather).__name__), gather


@functools.cache
def _composed(optim: str) -> tuple[Any, ...]:
    """The audit's config (experiment=gather_audit) with this optimizer, and the objects it names;
    composed once per process (a test suite checks many losses)."""
    with config.composed():
        cfg, _ = config.compose(["experiment=gather_audit", f"optim={optim}"])
    model = config.instantiate("model", cfg.model, _partial_=True, _convert_="all")
    return cfg, model, config.build_optimizer(cfg), config.build_dataset(cfg)


def _setting(optim: str, world_sizes: Sequence[int], steps: int) -> tuple[Any, ...]:
    """The audit's model, data and global batch (experiment=gather_audit), the optimizer, and the
    global batches of the check."""
    if optim not in OPTIMIZERS:
        raise CheckError(f"--optim {optim!r} is unknown; allowed: {', '.join(OPTIMIZERS)}")
    if not terms.is_integer(steps, 0):
        raise CheckError(f"--steps {steps!r} is not allowed; allowed: {terms.allowed_integer(0)}")
    cfg, model, optimizer, dataset = _composed(optim)
    size = cfg.global_batch_size
    try:
        gradients.check_world_sizes(world_sizes, size, f"the global batch of {size}")
    except ValueError as error:
        raise CheckError(str(error)) from None
    batches = gradients.global_batches(
        dataset, size, cfg.seed, bool(cfg.data.shuffle), max(steps, 1)
    )
    return cfg, model, optimizer, batches


def _run(
    losses: Mapping[str, LossFactory],
    gather_name: str,
    world_sizes: Sequence[int],
    steps: int,
    optim: str,
) -> pd.DataFrame:
    world_sizes = list(world_sizes)
    cfg, model, optimizer, batches = _setting(optim, world_sizes, steps)
    view0, view1 = batches[0]
    references, curves = {}, {}
    for name, loss in losses.items():  # one device, in this process: bad input is found here
        try:
            references[name] = gradients.measure(loss, model, view0, view1, cfg.seed)
            if steps:
                curves[name] = gradients.train(loss, model, batches, optimizer, 1, cfg.seed).losses
        except gradients.LossContractError as error:
            raise CheckError(f"loss {name}: {error}") from None
        except Exception as error:  # the factory refuses its arguments, the forward raises
            raise CheckError(f"loss {name}: {type(error).__name__}: {error}") from None
    rows = []
    for world_size in world_sizes:
        try:
            measured = gradients.measure_on_ranks(losses, model, view0, view1, world_size, cfg.seed)
            trained = {
                name: gradients.train(loss, model, batches, optimizer, world_size, cfg.seed).losses
                for name, loss in losses.items()
                if steps
            }
        except RankError as error:
            raise LossFailed(f"W={world_size}, {cli.first_line(error)}") from None
        for name in losses:
            same, loss_diff = gradients.same_forward(measured[name].loss, references[name].loss)
            gradient, cosine, norm_ratio, max_rel_err = gradients.classify(
                measured[name].gradient, references[name].gradient, world_size
            )
            forward = terms.Forward.SAME if same else terms.Forward.DIFFERS
            row = {
                "loss": name,
                "gather": gather_name,
                "world_size": world_size,
                "forward": forward,
                "gradient": gradient,
                "verdict": verdict(forward, gradient),
                "loss_diff": loss_diff,
                "cosine": cosine,
                "norm_ratio": norm_ratio,
                "max_rel_err": max_rel_err,
            }
            if steps:
                row[TRAIN_COLUMN] = max(
                    abs(a - b) for a, b in zip(trained[name], curves[name], strict=True)
                )
            rows.append(row)
    return pd.DataFrame(rows, columns=list(COLUMNS) + ([TRAIN_COLUMN] if steps else []))


def check_loss(
    factory: str | Callable[..., Any],
    world_sizes: Iterable[int] = (2, 4),
    *,
    gather: str | gathering.GatherFn | None = None,
    steps: int = 0,
    optim: str = "sgd",
    seed: int = 0,
    **kwargs: Any,
) -> pd.DataFrame:
    """Check a loss on real gloo ranks of the warm worker pool: one row per world size
    (``COLUMNS``, and ``train_max_abs_loss_diff`` with ``steps``).

    The loss is built in every rank as ``factory(**kwargs)``, with ``rank=``/``world_size=``
    when its signature takes them and ``kwargs`` does not set them, and ``gather=`` when
    ``gather`` is given. It runs in the gradient audit's setting (an MLP 8 → 64 → 16, Gaussian
    view pairs, a global batch of 16 in float64) and is compared with the same loss on one device
    in this process (docs/design.md §6).

    Args:
        factory: the loss class or function, or its import path (``module:attribute`` or a dotted
            path).
        world_sizes: the numbers of ranks to check, each an integer ≥ 2 that divides 16.
        gather: passed to the loss as ``gather=``: a name of `gatherlab.gather.NAMES`, a function
            ``x -> gathered x``, or its import path. ``None`` or ``"native"`` passes none: the
            loss communicates by itself.
        steps: also train this many steps of plain DDP and compare the losses with one device
            (0: no training).
        optim: the optimizer of those steps, ``"sgd"`` (lr 0.01) or ``"adamw"`` (lr 1e-3,
            weight decay 0.01).
        seed: the seed the loss's own parameters, if any, are drawn from, the same in every rank
            and on one device.
        **kwargs: the loss's own keyword arguments.

    Returns:
        A pandas DataFrame with the columns of `COLUMNS` (and ``train_max_abs_loss_diff`` when
        ``steps`` > 0), one row per world size in the order given. Its ``loss`` column is the
        import path when ``factory`` is one, else the factory's qualified name.

    Raises:
        CheckError: bad input, before any rank runs; also when the loss fails on one device.
        LossFailed: the loss raised or broke its contract on a rank.

    Example:
        >>> from gatherlab.check import check_loss
        >>> table = check_loss("gatherlab.losses:NTXentLoss", (2, 4), gather="old", temperature=0.5)
        >>> table["verdict"].tolist()
        ['biased', 'biased']
    """
    function = _factory(factory)
    gather_name, gather_fn = _gather(gather)
    name = factory if isinstance(factory, str) else getattr(function, "__qualname__", "loss")
    loss = LossFactory(function, kwargs, gather_fn, seed)
    return _run({name: loss}, gather_name, tuple(world_sizes), steps, optim)


def check_gather(
    gather: str | gathering.GatherFn,
    world_sizes: Iterable[int] = (2, 4),
    *,
    steps: int = 0,
    optim: str = "sgd",
    seed: int = 0,
) -> pd.DataFrame:
    """Check a gather with gatherlab's three loss styles (local ``ntxent``, global
    ``ntxent_global``, mixed ``vicreg``, as the gradient audit configures them) against one
    device: one row per loss × world size.

    Args:
        gather: a name of `gatherlab.gather.NAMES`, a function ``x -> gathered x``, or its import
            path.
        world_sizes: the numbers of ranks to check, each an integer ≥ 2 that divides 16.
        steps: also train this many steps of plain DDP and compare the losses with one device
            (0: no training).
        optim: the optimizer of those steps, ``"sgd"`` or ``"adamw"``.
        seed: the seed the losses are built with.

    Returns:
        A pandas DataFrame like `check_loss`'s, one row per world size and loss (for each world
        size in the order given, the three losses in the order above); its ``gather`` column is
        the name or import path given, or the function's qualified name.

    Raises:
        CheckError: bad input, before any rank runs: ``None`` or ``"native"`` (no gather), a
            path that does not import, an object that is not callable, or a world size, ``steps``
            or ``optim`` that is not allowed.
        LossFailed: a loss raised or broke its contract on a rank.

    Example:
        >>> from gatherlab.check import check_gather
        >>> table = check_gather("old", world_sizes=(2, 4))
        >>> table["verdict"].tolist()
        ['biased', '1/W', 'biased', 'biased', '1/W', 'biased']
    """
    gather_name, gather_fn = _gather(gather)
    if gather_fn is None:
        raise CheckError("--gather native is no gather; allowed: a name or module:function")
    cfg = _composed("sgd")[0]
    losses = {
        name: config.loss_factory_of(cfg.audit.losses[name], gather_fn, seed)
        for name in STYLE_LOSSES
    }
    return _run(losses, gather_name, tuple(world_sizes), steps, optim)


# --- the check of a training step (docs/design.md §10) -------------------------------------------


def _path_name(factory: str | Callable[..., Any]) -> str:
    return factory if isinstance(factory, str) else getattr(factory, "__qualname__", "module")


def check_training(
    module: str | Callable[..., Any],
    data: str | Callable[..., Any],
    world_sizes: Iterable[int] = (2, 4),
    *,
    steps: int = 20,
    global_batch_size: int = 32,
    module_kwargs: Mapping[str, Any] | None = None,
    data_kwargs: Mapping[str, Any] | None = None,
    precision: str = "64-true",
    seed: int = 0,
    loss_attr: str | None = None,
) -> pd.DataFrame:
    """Check a training step: a ``LightningModule`` trained ``steps`` steps on W real gloo ranks
    (Lightning's DDP strategy on the warm pool) against the same on one device, and, for a W that
    is not exact, the part that breaks it (docs/design.md §10).

    The module is built inside every rank as ``module(**module_kwargs)`` (with ``rank=`` and
    ``world_size=`` when its constructor takes them; its initial weights drawn from ``seed``, the
    same everywhere) and the data set as ``data(**data_kwargs)``, a map-style data set (``len``,
    ``data[index]``) whose items the module's or the data set's ``collate_fn`` collates (else
    PyTorch's default). Every layout takes the same global batches in the same order, rank r its
    r-th contiguous slice (docs/design.md §2). A W that is not exact is trained again with each
    cause that applies removed (``batchnorm``, ``dropout``, ``data_randomness``) and with all of
    them removed; the causes whose removal makes it exact, or changes its verdict, are its
    culprits, and ``loss`` when removing all of them is not enough.

    Args:
        module: the ``LightningModule`` class or factory, or its import path.
        data: the data set class or factory, or its import path.
        world_sizes: the numbers of ranks, each an integer ≥ 2 dividing ``global_batch_size``.
        steps: optimizer steps of each run.
        global_batch_size: samples per step, over all ranks.
        module_kwargs: the module's keyword arguments.
        data_kwargs: the data set's keyword arguments.
        precision: ``"64-true"`` (judged to 1e-10) or ``"32-true"`` (to 1e-5).
        seed: the module's initial weights, the data order and every process's random streams.
        loss_attr: the attribute of the module that holds its loss; with ``loss`` among the
            culprits, that loss is checked too (`check_loss`, on gatherlab's MLP), and its
            verdict joins the diagnosis. It must be callable as ``loss(z0, z1)``.

    Returns:
        A pandas DataFrame: for each W the ``baseline`` row and, when it is not exact, one row
        per variant run; the columns of `COLUMNS`, ``train_max_abs_loss_diff``, then
        ``variant``, ``culprits`` (``;``-separated, empty when exact), ``first_diff_step`` and
        ``max_abs_param_diff``. ``verdict`` is one of `check_loss`'s or ``diverges`` (the first
        step agrees, a later one does not). With ``loss_attr``, ``table.attrs["loss_check"]``
        holds the loss check's table when it ran.

    Raises:
        CheckError: bad input, before any rank runs: a module that is no LightningModule or
            cannot be built, a data set without ``__len__``/``__getitem__``, a global batch that
            a W does not divide or larger than the data set, a ``training_step`` that returns no
            loss (found on one device).
        LossFailed: a rank raised; the message names it.

    Example:
        >>> from gatherlab.check import check_training
        >>> table = check_training("ssl_modules:SimCLRWithBatchNorm", "ssl_modules:GaussianPairs")
        >>> table.groupby("world_size")["culprits"].first().tolist()
        ['batchnorm', 'batchnorm']
    """
    # Lightning: imported when a training step is checked
    from gatherlab import trainingcheck, usermodule

    module_factory, data_factory = _factory(module, "module"), _factory(data, "data")
    name = _path_name(module)
    setting = trainingcheck.Setting(
        module=LossFactory(module_factory, dict(module_kwargs or {}), None, seed),
        data=LossFactory(data_factory, dict(data_kwargs or {}), None, seed),
        name=name, global_batch_size=global_batch_size, steps=steps, seed=seed,
        precision=precision,
    )  # fmt: skip
    world_sizes = tuple(world_sizes)
    try:
        causes = trainingcheck.validate(setting, world_sizes)
    except ValueError as error:
        raise CheckError(str(error)) from None
    if loss_attr is not None and not callable(getattr(setting.module(), loss_attr, None)):
        raise CheckError(
            f"--loss-attr {loss_attr}: {name} has no callable attribute {loss_attr!r}; allowed: "
            "the attribute that holds its loss"
        )
    try:  # one device, in this process: a training_step without a loss is found here
        references = {"baseline": trainingcheck.reference(setting, "baseline")}
    except Exception as error:
        raise CheckError(f"--module {name} on one device: {cli.first_line(error)}") from None
    try:
        table = trainingcheck.check(setting, world_sizes, causes, references)
    except RankError as error:
        raise LossFailed(cli.first_line(error)) from None
    blamed = table.loc[table["culprits"].str.contains(trainingcheck.LOSS), "world_size"]
    if loss_attr is not None and len(blamed):
        loss = usermodule.loss_of(setting.module, loss_attr)
        table.attrs["loss_check"] = check_loss(loss, sorted(set(blamed)), seed=seed)
    return table


def explain_training(table: pd.DataFrame) -> str:
    """The check of a training step as text: one row per W (its baseline verdict, the causes
    found, the verdict with all of them removed), the variants' table, then what each cause
    means and its fix.

    Args:
        table: a table of `check_training`.

    Returns:
        The text ``python -m gatherlab.check --module`` prints, ending with a newline.
    """
    summary = []
    for world_size, rows in table.groupby("world_size", sort=False):
        by_variant = rows.set_index("variant")["verdict"]
        culprits = rows["culprits"].iloc[0]
        removed = [v for v in ("all", *CAUSE_DIAGNOSES) if v in by_variant.index]
        after = by_variant[removed[0]] if removed else "—"
        summary.append([str(world_size), by_variant["baseline"], culprits or "—", after])
    header = ["world_size", "verdict", "culprits", "verdict without the removable causes"]
    lines = [runfiles.markdown_table(header, summary), markdown(table, TRAINING_COLUMNS)]
    found = [c for c in table["culprits"].str.split(";").explode().unique() if c]
    for cause in found:
        sizes = ", ".join(
            str(w) for w in table.loc[table["culprits"].str.contains(cause), "world_size"].unique()
        )
        text = textwrap.fill(CAUSE_DIAGNOSES[cause][0].upper() + CAUSE_DIAGNOSES[cause][1:], 100,
                             initial_indent="  ", subsequent_indent="  ")  # fmt: skip
        lines.append(f"{cause}, W = {sizes}:\n{text}")
    loss_check = table.attrs.get("loss_check")
    if loss_check is not None:
        lines.append("The loss on its own (gatherlab.check on the loss attribute):\n"
                     + explain(loss_check).rstrip())  # fmt: skip
    elif "loss" in found:
        lines.append("  Name the module's loss attribute (--loss-attr) to check the loss alone.")
    baseline = table[table["variant"] == "baseline"]
    if (baseline["verdict"] == "exact").all():
        lines.append("Every world size trains like one device.")
    return "\n\n".join(lines) + "\n"


# --- the command line ---------------------------------------------------------------------------


def _world_sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of world sizes; allowed: e.g. 2,4"
        ) from None


def _kwargs(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object of keyword arguments")
    return value


def main(argv: Sequence[str] | None = None) -> None:
    as_program = argv is None
    parser = argparse.ArgumentParser(
        prog="python -m gatherlab.check", description=__doc__.splitlines()[0]
    )
    parser.add_argument("loss", nargs="?", help="the loss factory, module:attribute")
    parser.add_argument("--kwargs", type=_kwargs, default={}, help="its keyword arguments (JSON)")
    parser.add_argument(
        "--gather",
        help="pass gather= to the loss: a built-in name or module:function; without a loss: "
        "check this gather with gatherlab's local, global and mixed losses",
    )
    parser.add_argument("--world-sizes", type=_world_sizes, default=(2, 4), help="e.g. 2,4")
    parser.add_argument(
        "--steps", type=int, help="train this many steps (a loss: 0 by default; --module: 20)"
    )
    parser.add_argument("--optim", choices=OPTIMIZERS, default="sgd", help="for a loss's --steps")
    training = parser.add_argument_group("the check of a training step (docs/design.md §10)")
    training.add_argument("--module", help="a LightningModule, module:attribute")
    training.add_argument("--module-kwargs", type=_kwargs, default={}, help="its arguments (JSON)")
    training.add_argument("--data", help="a map-style data set (class or factory), module:attr")
    training.add_argument("--data-kwargs", type=_kwargs, default={}, help="its arguments (JSON)")
    training.add_argument("--global-batch-size", type=int, default=32, help="over all ranks")
    training.add_argument("--precision", default="64-true", help="64-true or 32-true")
    training.add_argument("--loss-attr", help="the module's attribute holding its loss")
    parser.add_argument("--out", type=Path, help="output directory (default: a new outputs/ dir)")
    args = parser.parse_args(argv)
    if args.module is not None and (args.loss is not None or args.gather is not None):
        parser.error("--module checks a training step; a loss or --gather is checked without it")
    if args.module is not None and args.data is None:
        parser.error("--module needs --data (a map-style data set, module:attribute)")
    if args.module is None and args.loss is None and args.gather is None:
        parser.error("name a loss (module:attribute), a gather (--gather), or --module and --data")
    out = args.out or Path("outputs") / "check" / f"{datetime.now():%Y-%m-%d_%H-%M-%S-%f}"
    try:
        if (out / runfiles.CHECK).exists():
            raise CheckError(f"--out {out} already holds a check; it is never overwritten")
        if args.module is not None:
            table = check_training(
                args.module,
                args.data,
                args.world_sizes,
                steps=20 if args.steps is None else args.steps,
                global_batch_size=args.global_batch_size,
                module_kwargs=args.module_kwargs,
                data_kwargs=args.data_kwargs,
                precision=args.precision,
                loss_attr=args.loss_attr,
            )
            exact = (table.loc[table["variant"] == "baseline", "verdict"] == "exact").all()
            text = explain_training(table)
        else:
            if args.loss is None:
                table = check_gather(
                    args.gather, args.world_sizes, steps=args.steps or 0, optim=args.optim
                )
            else:
                table = check_loss(
                    args.loss,
                    args.world_sizes,
                    gather=args.gather,
                    steps=args.steps or 0,
                    optim=args.optim,
                    **args.kwargs,
                )
            exact, text = (table["verdict"] == "exact").all(), explain(table)
    except (CheckError, ConfigError) as error:
        cli.fail("check", error)
    except LossFailed as error:
        failed = "a rank" if args.module is not None else "the loss"
        print(f"gatherlab.check: {failed} failed: {error}", file=sys.stderr)
        sys.exit(1)
    out.mkdir(parents=True, exist_ok=True)
    runfiles.write_table(table, out / runfiles.CHECK)
    print(text)
    print(f"written: {out / runfiles.CHECK}")
    if as_program:
        cli.exiting()
    sys.exit(0 if exact else 1)


if __name__ == "__main__":
    main()
