"""``python -m gatherlab.check``: a loss, a gather or a training step on W ranks against one device
(`gatherlab.check`); writes ``check.csv`` into ``--out`` and exits 0 when every W trains like one
device (``exact`` or ``loss scaled``), 1 otherwise, 2 for bad input.

The arguments are parsed first, and on the warm pool the ranks' fork server started (it imports
torch and the modules the ranks run beside this process's own imports, ~1 s sooner); only then
does this process import the check itself (torch, pandas, Lightning for ``--module``)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import fields
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from gatherlab.check import defaults, options
from gatherlab.core import cli, terms
from gatherlab.ranks import forkstart

if TYPE_CHECKING:
    from gatherlab.check.table import CheckResult

# The launchers of the check: the warm pool, or the ranks a launcher started (not spawn's).
LAUNCHERS = (terms.Launcher.POOL, terms.Launcher.EXTERNAL)


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


# The help's description, plain text as a terminal shows it (the module's docstring is markup).
DESCRIPTION = (
    "Check a loss, a gather or a training step on W ranks against one device; write check.csv "
    "into --out and exit 0 when every W trains like one device (exact or loss scaled), 1 "
    "otherwise, 2 for bad input."
)


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose every usage error is one line, ``gatherlab.check: error: ...``,
    and exit status 2 (`cli.fail`), as every other bad input of the command line; the usage is
    ``--help``'s."""

    def error(self, message: str) -> NoReturn:
        cli.fail("check", message)


# How the command line reads each kind of option of `options.TrainingOptions`.
_KINDS = {"text": None, "int": int, "float": float, "ints": _world_sizes, "json": _kwargs}


def _add(parser: Any, option: Any) -> None:
    """The command line's option of a field of `options.TrainingOptions`: its flag, kind,
    default (the command line's where it has its own), help (the field's doc, or the command
    line's own text) and metavar."""
    meta = option.metadata
    extra = {"metavar": meta["metavar"]} if "metavar" in meta else {}
    parser.add_argument(
        meta["flag"],
        dest=options.dest(option),
        type=_KINDS[meta.get("kind", "text")],
        default=meta.get("cli_default", option.default),
        help=meta.get("help", meta["doc"]),
        **extra,
    )


def _parser() -> argparse.ArgumentParser:
    """The command line's parser: a loss's and a gather's options here, a training step's
    generated from `options.TrainingOptions` (``_add``), in its groups."""
    parser = _Parser(prog="python -m gatherlab.check", description=DESCRIPTION, allow_abbrev=False)
    flagged = [field for field in fields(options.TrainingOptions) if field.metadata["flag"]]

    def group(name: str) -> list[Any]:
        return [field for field in flagged if field.metadata["group"] == name]

    parser.add_argument("loss", nargs="?", help="the loss factory, module:attribute")
    parser.add_argument("--kwargs", type=_kwargs, default={}, help="its keyword arguments (JSON)")
    parser.add_argument(
        "--inputs", metavar="MODULE:FUNCTION",
        help="what the loss takes besides the two views' embeddings: a function returning a "
        "tuple (positional) or dict (keyword) of them for the global batch of 16, e.g. masks; "
        "each rank is given its rows of a tensor with a row per sample, the rest whole",
    )  # fmt: skip
    parser.add_argument(
        "--gather",
        help="pass gather= to the loss: an option of the gather config group, module:function, "
        "or module:Class (a Gather subclass, made with no arguments); without a loss: "
        "check this gather with gatherlab's local, global and mixed losses",
    )
    for option in group(options.COMMON):
        _add(parser, option)
    parser.add_argument(
        "--optim", choices=defaults.OPTIMIZERS, default=defaults.OPTIM, help="for a loss's --steps"
    )
    training = parser.add_argument_group(options.TRAINING)
    for option in group(options.TRAINING):
        _add(training, option)
    parser.add_argument("--out", type=Path, help="output directory (default: a new outputs/ dir)")
    ranks = parser.add_argument_group(options.RANKS)
    ranks.add_argument(
        "--launcher", choices=LAUNCHERS, default=terms.Launcher.POOL,
        help="pool: warm worker processes started here (CPU, gloo); external: the ranks torchrun "
        "or srun started, this process one of them",
    )  # fmt: skip
    ranks.add_argument(
        "--device", choices=tuple(terms.Device), default=terms.Device.CPU,
        help="cuda: NCCL and each rank's own GPU (only with --launcher external)",
    )  # fmt: skip
    for option in group(options.RANKS):
        _add(ranks, option)
    return parser


def check_options(
    args: argparse.Namespace,
) -> options.TrainingOptions | options.LossOptions | options.GatherOptions:
    """The options of the check the parsed arguments ask for, validated (`options.CheckError` of
    one line): a training step's from every field of `options.TrainingOptions` the command line
    has (``--steps`` omitted: the training check's default), a loss's or a gather's from theirs.
    ``args.world_sizes`` None is the default's (`defaults.WORLD_SIZES`)."""
    world_sizes = args.world_sizes or defaults.WORLD_SIZES
    if any(getattr(args, form) is not None for form in ("module", "step", "update")):
        chosen = {
            field.name: getattr(args, options.dest(field))
            for field in fields(options.TrainingOptions)
            if field.metadata["flag"]
        }
        steps = defaults.TRAINING_STEPS if args.steps is None else args.steps
        return options.TrainingOptions(**chosen | {"world_sizes": world_sizes, "steps": steps})
    common = {
        "world_sizes": world_sizes, "optim": args.optim,
        "steps": defaults.LOSS_STEPS if args.steps is None else args.steps,
        "collective_timeout_s": args.collective_timeout, "precision": args.precision,
    }  # fmt: skip
    if args.loss is None:
        return options.GatherOptions(**common)
    return options.LossOptions(**common, gather=args.gather, inputs=args.inputs)


def _arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line's arguments, or its usage error (exit status 2)."""
    parser = _parser()
    args = parser.parse_args(argv)
    forms = [f"--{f}" for f in ("module", "step", "update") if getattr(args, f) is not None]
    trains = bool(forms)
    if len(forms) > 1:
        parser.error(f"{' and '.join(forms)} are forms of one check; name one of them")
    if args.loss is not None and (args.loss.endswith(".py") or "/" in args.loss):
        parser.error(
            f"loss {args.loss} is a file path; allowed: module:attribute, e.g. mypkg.losses:MyLoss"
        )
    if trains and (args.loss is not None or args.gather is not None):
        parser.error(f"{forms[0]} checks a training step; a loss or --gather without it")
    if args.inputs is not None and args.loss is None:
        parser.error("--inputs are a loss's; allowed: with a loss (module:attribute)")
    unread = [] if trains else [flag for field in fields(options.TrainingOptions)
                                if field.metadata["group"] == options.TRAINING
                                and (flag := _flag_given(args, field))]  # fmt: skip
    if unread:  # a training step's option given to a loss's or a gather's check
        parser.error(f"{unread[0]} is an option of the check of a training step; allowed: with "
                     "--module, --step or --update")  # fmt: skip
    if not trains and args.loss is None and args.gather is None:
        parser.error(
            "name a loss (module:attribute), a gather (--gather), --module and --data, or --step "
            "(or --update), --model and --data"
        )
    if args.world_sizes is not None or args.launcher == terms.Launcher.POOL:
        try:  # every option's own check, before the fork server starts
            check_options(args)
        except options.CheckError as error:
            parser.error(str(error))
    if args.device != terms.Device.CPU and args.launcher != terms.Launcher.EXTERNAL:
        parser.error(f"--device {args.device} runs on the ranks a launcher started; allowed: "
                     "--launcher external with it, or --device cpu")  # fmt: skip
    return args


def _flag_given(args: argparse.Namespace, field: Any) -> str | None:
    """The flag of a field of `options.TrainingOptions` given another value than its default."""
    meta = field.metadata
    if not meta["flag"]:
        return None
    given = getattr(args, options.dest(field))
    return meta["flag"] if given != meta.get("cli_default", field.default) else None


def _check(args: argparse.Namespace) -> tuple[CheckResult, str]:
    """The check the arguments ask for: its result and its text."""
    from gatherlab.check.api import check_gather, check_training, loss_check
    from gatherlab.check.diagnosis import explain, explain_training

    chosen = check_options(args)
    if isinstance(chosen, options.TrainingOptions):
        result = check_training(options=chosen)
        return result, explain_training(result)
    if isinstance(chosen, options.LossOptions):  # --kwargs whole: each of its keys goes to the loss
        result = loss_check(args.loss, args.kwargs, chosen)
    else:
        result = check_gather(args.gather, options=chosen)
    return result, explain(result)


def _written(args: argparse.Namespace) -> int:
    """The check, its ``check.csv`` written and its text printed: the exit status (0 when every W
    trains like one device, else 1). Bad input raises (``CheckError``, ``ConfigError``)."""
    from gatherlab.check.options import CheckError
    from gatherlab.check.table import trains_like_one_device
    from gatherlab.core import runfiles

    out = args.out or Path("outputs") / "check" / f"{datetime.now():%Y-%m-%d_%H-%M-%S-%f}"
    if (out / runfiles.CHECK).exists():
        raise CheckError(f"--out {out} already holds a check; it is never overwritten")
    if (file := runfiles.not_a_directory(out)) is not None:
        raise CheckError(f"--out {out}: {file} is a file; allowed: a directory, new or empty")
    result, text = _check(args)
    out.mkdir(parents=True, exist_ok=True)
    runfiles.write_table(result.table, out / runfiles.CHECK)
    print(text)
    print(f"written: {out / runfiles.CHECK}")
    return 0 if trains_like_one_device(result) else 1


def _ranks_run(args: argparse.Namespace) -> tuple[str, ...]:
    """The modules the ranks of this check run, for the fork server to import once: the
    measurement and the configs, and the training layer's for a training step."""
    common = ("gatherlab.check.measure", "gatherlab.components.config")
    if args.module is not None:
        return *common, "lightning.pytorch", "gatherlab.runs.fit"
    if args.step is not None:
        return *common, "gatherlab.runs.plainstep"
    if args.update is not None:
        return *common, "gatherlab.runs.update"
    return common


def main(argv: Sequence[str] | None = None) -> None:
    """The command line (``argv``: its arguments, ``sys.argv`` when not given): exit status 0 when
    every W trains like one device, 1 when one does not or a rank failed, 2 for bad input."""
    as_program = argv is None
    args = _arguments(argv)
    if args.launcher == terms.Launcher.EXTERNAL:  # this process is one of the ranks; rank 0 writes
        from gatherlab.check import launched

        status = launched.run(args, _written)
    else:
        forkstart.start(_ranks_run(args))
        from gatherlab.check.options import CheckError
        from gatherlab.components.config import ConfigError

        args.world_sizes = args.world_sizes or defaults.WORLD_SIZES
        try:
            status = _written(args)
        except (CheckError, ConfigError) as error:
            cli.fail("check", error)
        except KeyboardInterrupt:  # the pools end with the process (their exit hook)
            print("gatherlab.check: interrupted; nothing was written: run the command again",
                  file=sys.stderr)  # fmt: skip
            status = 130
    if as_program:
        cli.exiting()
    sys.exit(status)


if __name__ == "__main__":
    main()
