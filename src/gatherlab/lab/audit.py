"""The gradient audit: for every gather × loss style × world size, which gradient do the ranks get?

``python -m gatherlab.audit [--out DIR] [overrides]`` composes ``experiment=gather_audit`` with the
overrides (the same job as ``python -m gatherlab.train experiment=gather_audit``), takes one global
batch, computes the parameter gradient that DDP hands to the optimizer on W real gloo ranks and
compares it with the 1-device gradient of the same batch, in float64 (``run_audit``, measured by
``gatherlab.check.measure.audit``). Each gather of the ``gather`` group is audited (also one a
directory on ``hydra.searchpath`` adds), with the prediction it declares. It writes ``audit.csv``,
``audit.md`` and ``audit.png``/``.pdf`` into the output directory (rows gathers, columns loss × W,
the measured class, marked where it differs from the prediction).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pandas as pd
import torch
from omegaconf import DictConfig

from gatherlab.analysis import report
from gatherlab.check import measure
from gatherlab.components import config
from gatherlab.components.config import ConfigError
from gatherlab.components.factory import Recipe
from gatherlab.core import cli, runfiles
from gatherlab.lab import validation


@dataclass(frozen=True)
class AuditInputs:
    """What an audit measures on: one global batch, the losses (name → factory, each rank builds
    its own with the gather under audit) and the model factory."""

    view0: torch.Tensor
    view1: torch.Tensor
    losses: dict[str, Recipe]
    model_factory: Callable[[], torch.nn.Module]


def audit_inputs(cfg: DictConfig) -> AuditInputs:
    """The global batch, losses and model of a checked ``experiment=gather_audit`` config."""
    dataset = config.build_dataset(cfg)
    [(view0, view1)] = measure.global_batches(
        dataset, cfg.global_batch_size, cfg.seed, bool(cfg.data.shuffle), steps=1
    )
    losses = {
        name: config.loss_factory_of(spec, None, cfg.seed)
        for name, spec in cfg.audit.losses.items()
    }
    for name, factory in losses.items():  # a style the loss declares, checked as train checks it
        try:
            measure.style(factory)
        except ValueError as error:
            raise ConfigError(f"audit.losses.{name} ({cfg.audit.losses[name]._target_}): "
                              f"{error}") from None  # fmt: skip
    model_factory = config.instantiate("model", cfg.model, _partial_=True, _convert_="all")
    return AuditInputs(view0, view1, losses, model_factory)


def run_audit(
    cfg: DictConfig,
    out: Path,
    gathers: Mapping[str, Callable[[torch.Tensor], torch.Tensor]],
    inputs: AuditInputs | None = None,
) -> pd.DataFrame:
    """The audit a checked ``experiment=gather_audit`` config describes, for ``gathers`` (name →
    gather, checked with it: ``validation.validate_audit_gathers``), on ``inputs`` (built from the
    config when not given); writes ``audit.csv`` into ``out`` and returns the table."""
    out = Path(out)
    if (out / runfiles.AUDIT).exists():
        raise ConfigError(f"{out} already holds an audit; it is never overwritten")
    simulated_world_sizes = list(cfg.audit.get("simulated_world_sizes") or [])
    if inputs is None:
        inputs = audit_inputs(cfg)
    table = measure.audit(
        inputs.losses,
        inputs.model_factory,
        inputs.view0,
        inputs.view1,
        gathers=gathers,
        world_sizes=list(cfg.audit.world_sizes),
        seed=cfg.seed,
        simulated_world_sizes=simulated_world_sizes,
    )
    out.mkdir(parents=True, exist_ok=True)
    runfiles.write_table(table, out / runfiles.AUDIT)
    return table


def run(cfg: DictConfig, overrides: Sequence[str], out: Path) -> pd.DataFrame:
    """The audit of a checked ``experiment=gather_audit`` config composed from ``overrides``,
    for the gathers of ``audit.gathers`` (None: every option of the group); writes its files
    into ``out`` and returns its table."""
    names = cfg.audit.gathers
    with config.composed():
        gathers = config.build_gathers(None if names is None else list(names), overrides)
    validation.validate_audit_gathers(cfg, gathers)
    table = run_audit(cfg, out, gathers)
    report.write_audit(table, out)
    return table


def command_line(
    argv: Sequence[str] | None,
    *,
    name: str,
    description: str,
    experiment: str,
    example: str,
    run: Callable[[DictConfig, Sequence[str], Path], pd.DataFrame],
    markdown: Callable[[pd.DataFrame], str],
) -> None:
    """``python -m gatherlab.<name> [--out DIR] [overrides]``: composes ``experiment=<experiment>``
    with the overrides, checks it, runs ``run`` into a new directory (one that already holds
    ``<name>.csv`` is refused) and prints ``markdown`` of its table. A bad value is one line and
    exit status 2."""
    parser = argparse.ArgumentParser(prog=f"python -m gatherlab.{name}", description=description)
    parser.add_argument("--out", type=Path, help="output directory (default: a new outputs/ dir)")
    parser.add_argument("overrides", nargs="*", help=f"Hydra overrides, e.g. {example}")
    args = parser.parse_args(argv)
    overrides = [f"experiment={experiment}", *args.overrides]
    out = args.out or Path("outputs") / name / f"{datetime.now():%Y-%m-%d_%H-%M-%S-%f}"
    try:
        if (out / f"{name}.csv").exists():
            raise ConfigError(f"--out {out} already holds {name}.csv; it is never overwritten")
        with config.composed():
            cfg, choices = config.compose(overrides)
        validation.validate_command(cfg, choices["experiment"], f"python -m gatherlab.{name}")
        validation.validate(cfg)
        table = run(cfg, overrides, out)
    except ConfigError as error:
        cli.fail(name, error)
    print(markdown(table))
    print(f"written: {out}/{name}.{{csv,md,png,pdf}}")


def main(argv: Sequence[str] | None = None) -> None:
    command_line(
        argv,
        name="audit",
        description=__doc__.splitlines()[0],
        experiment="gather_audit",
        example="audit.world_sizes=[2]",
        run=run,
        markdown=report.audit_markdown,
    )


if __name__ == "__main__":
    main()
