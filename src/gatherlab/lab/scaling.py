"""The gradient error as W grows: the audit on real ranks and in the simulated world, each row
next to the gradient that the mathematics predicts for it (docs/design.md §9).

``python -m gatherlab.scaling [--out DIR] [overrides]`` composes ``experiment=gather_scaling``
with the overrides, runs its audit (``audit.world_sizes`` on real gloo ranks,
``audit.simulated_world_sizes`` in ``simworld``) and writes ``scaling.csv``, ``scaling.md`` and
``scaling.png``/``.pdf``: for every gather and loss, the cosine and norm ratio to the 1-device
gradient against W, measured and predicted. The predictions are docs/design.md §9's table, per
backward rule, computed from one-device gradients (g, its direct part D and gathered part C; for
``own`` on a local loss C_self, taken from the simulated world at W = N).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum
from pathlib import Path

import pandas as pd
import torch
from omegaconf import DictConfig

from gatherlab.analysis import figures, report
from gatherlab.check import measure
from gatherlab.components import config
from gatherlab.components.factory import Recipe
from gatherlab.core import gradients, runfiles
from gatherlab.core.terms import Rule, Style
from gatherlab.gather import GatherFn, rule
from gatherlab.lab import audit, validation


class Prediction(StrEnum):
    """How a row's prediction was made: a closed form, an expectation over the partitions of the
    batch, or none (the ``prediction`` column)."""

    EXACT = "exact"
    EXPECTATION = "expectation"
    NONE = "none"


COLUMNS = (*measure.COLUMNS, "prediction", "predicted_cosine", "predicted_norm_ratio")


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    """A gather on one device that cuts the gathered path: only direct uses carry a gradient."""
    return tensor.detach()


class Predictor:
    """The predicted DDP gradient of each gather rule, loss style and W for one loss on one batch
    (the module docstring); ``own_sample`` is the own-rule gradient at W = N when known."""

    def __init__(self, loss: Recipe, inputs: audit.AuditInputs, seed: int):
        def one_device(gather):
            measured = measure.measure(
                loss.with_gather(gather), inputs.model_factory, inputs.view0, inputs.view1, seed
            )
            return measured.gradient

        self.full, self.direct = one_device(None), one_device(_detached)
        self.style = measure.style(loss)
        self.samples = len(inputs.view0)
        self.own_sample: torch.Tensor | None = None

    def gradient(
        self, rule: Rule | None, world_size: int
    ) -> tuple[torch.Tensor | None, Prediction]:
        full, direct = self.full, self.direct
        through_gather = full - direct
        if rule == Rule.SUM:
            return full, Prediction.EXACT
        if rule == Rule.MEAN:
            return direct + through_gather / world_size, Prediction.EXACT
        if rule == Rule.NONE:
            return direct, Prediction.EXACT
        if rule == Rule.OWN and self.style in (Style.GLOBAL, Style.MIXED):
            return direct + through_gather / world_size, Prediction.EXACT
        if rule == Rule.OWN and self.style == Style.LOCAL and self.own_sample is not None:
            own = self.own_sample - direct
            shared = (self.samples / world_size - 1) / (self.samples - 1)
            return direct + own + shared * (through_gather - own), Prediction.EXPECTATION
        return None, Prediction.NONE


def predict(
    table: pd.DataFrame,
    inputs: audit.AuditInputs,
    gathers: Mapping[str, GatherFn],
    seed: int,
) -> pd.DataFrame:
    """``table`` (an audit's) with the predicted cosine and norm ratio of every row (``COLUMNS``).

    For a local loss, the own-rule gradient at W = N is measured in the simulated world (one cell)
    to give C_self, when some gather of ``gathers`` has the own rule."""
    rows = []
    own_gathers = [gather for gather in gathers.values() if rule(gather) == Rule.OWN]
    for name, loss in inputs.losses.items():
        predictor = Predictor(loss, inputs, seed)
        if predictor.style == Style.LOCAL and own_gathers:
            cell = {Rule.OWN: loss.with_gather(own_gathers[0])}
            predictor.own_sample = measure.measure_on_ranks(
                cell, inputs.model_factory, inputs.view0, inputs.view1, predictor.samples, seed,
                simulated=True,
            )[Rule.OWN].gradient  # fmt: skip
        for _, row in table[table["loss"] == name].iterrows():
            backward = rule(gathers.get(row["gather"]))
            vector, how = predictor.gradient(backward, int(row["world_size"]))
            cosine, ratio = (None, None)
            if vector is not None:
                cosine, ratio = gradients.cosine_and_norm_ratio(vector, predictor.full)
            rows.append(
                {
                    **row,
                    "prediction": how,
                    "predicted_cosine": cosine,
                    "predicted_norm_ratio": ratio,
                }
            )
    return pd.DataFrame(rows, columns=list(COLUMNS))


def run(cfg: DictConfig, overrides: Sequence[str], out: Path) -> pd.DataFrame:
    """The audit of a checked ``experiment=gather_scaling`` config, with its predictions; writes
    ``audit.csv`` and ``scaling.{csv,md,png,pdf}`` into ``out`` and returns the table."""
    names = cfg.audit.gathers
    with config.composed():
        gathers = config.build_gathers(None if names is None else list(names), overrides)
    validation.validate_audit_gathers(cfg, gathers)
    inputs = audit.audit_inputs(cfg)
    audited = audit.run_audit(cfg, out, gathers, inputs)
    table = predict(audited, inputs, gathers, cfg.seed)
    write(table, out)
    return table


def write(table: pd.DataFrame, out: Path) -> None:
    """``scaling.csv``, ``scaling.md`` and the figure ``scaling.png``/``.pdf`` in ``out``."""
    runfiles.write_table(table, out / runfiles.SCALING)
    (out / "scaling.md").write_text(report.scaling_markdown(table))
    figures.save(figures.scaling_figure(table), out / "scaling")


def main(argv: Sequence[str] | None = None) -> None:
    audit.command_line(
        argv,
        name="scaling",
        description=__doc__.splitlines()[0],
        experiment="gather_scaling",
        example="audit.simulated_world_sizes=[64]",
        run=run,
        markdown=report.scaling_markdown,
    )


if __name__ == "__main__":
    main()
