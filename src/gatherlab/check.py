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

from gatherlab import config, gradients, report, runfiles
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

__all__ = ["COLUMNS", "CheckError", "LossFailed", "check_gather", "check_loss", "explain"]


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


def verdict(forward: str, gradient: str) -> str:
    """``exact`` when forward and gradient are; ``loss differs`` when the forward differs; else
    the gradient's class."""
    if forward == "differs":
        return "loss differs"
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


def markdown(table: pd.DataFrame) -> str:
    columns = [c for c in (*COLUMNS, TRAIN_COLUMN) if c in table.columns]

    def cell(value: Any) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    rows = [[cell(row[c]) for c in columns] for _, row in table.iterrows()]
    return report.markdown_table(columns, rows)


# --- the check ----------------------------------------------------------------------------------


def _factory(loss: str | Callable[..., Any]) -> Callable[..., Any]:
    if isinstance(loss, str):
        try:
            loss = locate(loss)
        except ImportError as error:
            raise CheckError(f"loss {loss}: {error}") from None
    if not callable(loss):
        raise CheckError(f"loss {loss!r} is not callable; allowed: a class or function")
    return loss


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
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise CheckError(f"--steps {steps!r} is not allowed; allowed: an integer ≥ 0")
    cfg, model, optimizer, dataset = _composed(optim)
    size = cfg.global_batch_size
    for world_size in world_sizes:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
            raise CheckError(f"world size {world_size!r} is not allowed; allowed: integers ≥ 2")
        if size % world_size:
            raise CheckError(
                f"world size {world_size} does not divide the global batch of {size}; allowed: "
                f"divisors of {size}"
            )
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
            raise LossFailed(f"W={world_size}, {str(error).splitlines()[0]}") from None
        for name in losses:
            same, loss_diff = gradients.same_forward(measured[name].loss, references[name].loss)
            gradient, cosine, norm_ratio, max_rel_err = gradients.classify(
                measured[name].gradient, references[name].gradient, world_size
            )
            forward = "same" if same else "differs"
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
    parser.add_argument("--steps", type=int, default=0, help="also train this many steps")
    parser.add_argument("--optim", choices=OPTIMIZERS, default="sgd", help="for --steps")
    parser.add_argument("--out", type=Path, help="output directory (default: a new outputs/ dir)")
    args = parser.parse_args(argv)
    if args.loss is None and args.gather is None:
        parser.error("name a loss (module:attribute), a gather (--gather), or both")
    out = args.out or Path("outputs") / "check" / f"{datetime.now():%Y-%m-%d_%H-%M-%S-%f}"
    try:
        if (out / runfiles.CHECK).exists():
            raise CheckError(f"--out {out} already holds a check; it is never overwritten")
        if args.loss is None:
            table = check_gather(args.gather, args.world_sizes, steps=args.steps, optim=args.optim)
        else:
            table = check_loss(
                args.loss,
                args.world_sizes,
                gather=args.gather,
                steps=args.steps,
                optim=args.optim,
                **args.kwargs,
            )
    except (CheckError, ConfigError) as error:
        print(f"gatherlab.check: error: {error}", file=sys.stderr)
        sys.exit(2)
    except LossFailed as error:
        print(f"gatherlab.check: the loss failed: {error}", file=sys.stderr)
        sys.exit(1)
    out.mkdir(parents=True, exist_ok=True)
    runfiles.write_table(table, out / runfiles.CHECK)
    print(explain(table))
    print(f"written: {out / runfiles.CHECK}")
    sys.exit(0 if (table["verdict"] == "exact").all() else 1)


if __name__ == "__main__":
    main()
