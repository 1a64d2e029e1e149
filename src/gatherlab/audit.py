"""The gradient audit: for every gather × loss style × world size, which gradient do the ranks get?

``python -m gatherlab.audit [--out DIR] [overrides]`` (the same as ``python -m gatherlab.train
experiment=gather_audit``) takes one global batch, computes the parameter gradient that DDP hands
to the optimizer on W real gloo ranks, and compares it with the 1-device gradient of the same
batch, in float64. Each cell is classified (DESIGN.md §1):

- ``exact``: max |g − g₁| / max |g₁| ≤ 1e-10 (summation order only);
- ``1/W``: same direction (cosine ≥ 1 − 1e-12) and norm ratio 1/W within 1e-10;
- ``biased``: a different direction (no rescaling repairs it);
- ``other``: anything else, e.g. no gradient at all.

It writes ``audit.csv``, ``audit.md`` and ``audit.png``/``.pdf`` (rows gathers, columns loss style
× W, the measured class, marked where it differs from the prediction).
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gatherlab import gather as gathering
from gatherlab import launch, plotting

log = logging.getLogger(__name__)

CLASSES = ("exact", "1/W", "biased", "other")
EXACT_RELATIVE_ERROR = 1e-10
PARALLEL_COSINE = 1 - 1e-12
NORM_RATIO_TOLERANCE = 1e-10
COLUMNS = (
    "gather", "loss", "style", "world_size", "predicted", "measured", "cosine", "norm_ratio",
    "max_rel_err",
)  # fmt: skip

# How each loss of the audit splits over ranks (DESIGN.md §1, §3).
STYLES = {"ntxent": "local", "ntxent_global": "global", "vicreg": "mixed"}
# DESIGN.md §1's table for the local- and global-loss styles. VICReg mixes both: its invariance
# term uses the local embeddings directly (local-loss style) and its variance and covariance terms
# the gathered ones (global-loss style), so a gather that scales the gathered path by 1/W (or
# drops it) changes the balance of the terms: biased.
PREDICTED = {
    "fixed": {"local": "exact", "global": "exact", "mixed": "exact"},
    "torch_nn": {"local": "exact", "global": "exact", "mixed": "exact"},
    "functional": {"local": "exact", "global": "exact", "mixed": "exact"},
    "lightning": {"local": "exact", "global": "exact", "mixed": "exact"},
    "old": {"local": "biased", "global": "1/W", "mixed": "biased"},
    "nograd_swap": {"local": "biased", "global": "1/W", "mixed": "biased"},
    "avg": {"local": "biased", "global": "1/W", "mixed": "biased"},
    "nograd": {"local": "biased", "global": "biased", "mixed": "biased"},
}

LossFactory = Callable[..., nn.Module]


class _BothViews(nn.Module):
    """Embeds both views in one forward, so that DDP sees one forward per backward."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, view0: torch.Tensor, view1: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.model(view0), self.model(view1)


def _flat_gradient(model: nn.Module) -> torch.Tensor:
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
            for p in model.parameters()
        ]
    )


def _gradient(
    model_factory: Callable[[], nn.Module],
    loss: nn.Module,
    view0: torch.Tensor,
    view1: torch.Tensor,
    seed: int,
    distributed: bool,
) -> torch.Tensor:
    """The parameter gradient of ``loss`` on these views (DDP-averaged when ``distributed``);
    zeros when no gradient reaches the parameters at all."""
    torch.manual_seed(seed)
    model = _BothViews(model_factory().double())
    wrapped = DistributedDataParallel(model) if distributed else model
    value = loss(*wrapped(view0, view1))
    if value.requires_grad:
        value.backward()
    return _flat_gradient(model)


def _rank_gradients(
    cells: list[tuple[str, str]],
    losses: dict[str, LossFactory],
    model_factory: Callable[[], nn.Module],
    view0: torch.Tensor,
    view1: torch.Tensor,
    seed: int,
) -> dict[tuple[str, str], torch.Tensor] | None:
    """On every rank: its slice of the global batch; rank 0 returns each cell's gradient (after
    DDP's average it is the same on every rank)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    batch = len(view0) // world_size
    rows = slice(rank * batch, (rank + 1) * batch)
    gradients = {}
    for gather, loss in cells:
        gradients[gather, loss] = _gradient(
            model_factory, losses[loss](gather=gather), view0[rows], view1[rows], seed, True
        )
    return gradients if rank == 0 else None


def classify(
    gradient: torch.Tensor, reference: torch.Tensor, world_size: int
) -> tuple[str, float, float, float]:
    """The class of ``gradient`` against ``reference``, with cosine, norm ratio, max rel. error."""
    reference_norm = float(torch.linalg.vector_norm(reference))
    norm = float(torch.linalg.vector_norm(gradient))
    norm_ratio = norm / reference_norm
    cosine = float(gradient @ reference) / (norm * reference_norm) if norm > 0 else float("nan")
    max_rel_err = float((gradient - reference).abs().max() / reference.abs().max())
    if max_rel_err <= EXACT_RELATIVE_ERROR:
        measured = "exact"
    elif cosine >= PARALLEL_COSINE and abs(norm_ratio - 1 / world_size) <= NORM_RATIO_TOLERANCE:
        measured = "1/W"
    elif norm > 0 and cosine < PARALLEL_COSINE:
        measured = "biased"
    else:
        measured = "other"
    return measured, cosine, norm_ratio, max_rel_err


def audit(
    losses: dict[str, LossFactory],
    model_factory: Callable[[], nn.Module],
    view0: torch.Tensor,
    view1: torch.Tensor,
    world_sizes: Sequence[int] = (2, 4, 8),
    gathers: Sequence[str] = gathering.NAMES,
    seed: int = 0,
) -> pd.DataFrame:
    """One row per gather × loss × world size (``COLUMNS``). ``losses`` maps a loss name of
    ``STYLES`` to a factory taking ``gather=``; ``view0``/``view1`` are one global batch."""
    unknown = sorted(set(losses) - set(STYLES))
    if unknown:
        raise ValueError(f"audit losses {unknown} are unknown; allowed: {', '.join(STYLES)}")
    view0, view1 = view0.double(), view1.double()
    references = {
        loss: _gradient(model_factory, factory(gather=None), view0, view1, seed, False)
        for loss, factory in losses.items()
    }
    cells = [(gather, loss) for gather in gathers for loss in losses]
    rows = []
    for world_size in world_sizes:
        if len(view0) % world_size:
            raise ValueError(f"the global batch of {len(view0)} does not split over {world_size}")
        log.info("auditing %d cells on %d ranks", len(cells), world_size)
        gradients = launch.pool(world_size).run(
            _rank_gradients, cells, losses, model_factory, view0, view1, seed
        )[0]
        for gather, loss in cells:
            measured, cosine, norm_ratio, max_rel_err = classify(
                gradients[gather, loss], references[loss], world_size
            )
            style = STYLES[loss]
            rows.append(
                {
                    "gather": gather,
                    "loss": loss,
                    "style": style,
                    "world_size": world_size,
                    "predicted": PREDICTED[gather][style],
                    "measured": measured,
                    "cosine": cosine,
                    "norm_ratio": norm_ratio,
                    "max_rel_err": max_rel_err,
                }
            )
    return pd.DataFrame(rows, columns=list(COLUMNS))


def markdown(table: pd.DataFrame) -> str:
    """The audit as a Markdown table: rows gathers, columns loss × W, measured class per cell
    (with the prediction where they differ)."""
    losses = list(dict.fromkeys(table["loss"]))
    columns = sorted(
        dict.fromkeys(zip(table["loss"], table["world_size"], strict=True)),
        key=lambda column: (losses.index(column[0]), column[1]),
    )
    styles = dict(zip(table["loss"], table["style"], strict=True))
    header = ["gather"] + [
        f"`{loss}` ({styles[loss]}) W={world_size}" for loss, world_size in columns
    ]
    lines = [
        "Measured class of the parameter gradient after DDP's average against the 1-device "
        "gradient (float64); ⚠ marks a cell whose measurement differs from DESIGN.md §1's "
        "prediction, which follows it.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for gather in dict.fromkeys(table["gather"]):
        cells = []
        for loss, world_size in columns:
            row = table[
                (table["gather"] == gather)
                & (table["loss"] == loss)
                & (table["world_size"] == world_size)
            ].iloc[0]
            cell = row["measured"] + (" (no gradient)" if row["norm_ratio"] == 0 else "")
            if row["measured"] != row["predicted"]:
                cell = f"⚠ {cell} (predicted {row['predicted']})"
            cells.append(cell)
        lines.append("| " + " | ".join([f"`{gather}`", *cells]) + " |")
    return "\n".join(lines) + "\n"


def write(table: pd.DataFrame, out: str | Path) -> None:
    """``audit.csv``, ``audit.md``, ``audit.png`` and ``audit.pdf`` into ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "audit.csv", index=False, float_format="%.17g")
    (out / "audit.md").write_text(markdown(table))
    plotting.save(plotting.audit_figure(table, CLASSES), out / "audit")


def first_global_batch(dataset, global_batch_size: int, seed: int, shuffle: bool) -> tuple:
    """The views of the first global batch a training run with this data would take."""
    from gatherlab.data import epoch_order

    indices = torch.as_tensor(epoch_order(len(dataset), seed, 0, shuffle)[:global_batch_size])
    view0, view1 = zip(*(dataset[int(index)] for index in indices), strict=True)
    return torch.stack(view0), torch.stack(view1)


def run_config(cfg, out: Path) -> pd.DataFrame:
    """The audit a composed ``experiment=gather_audit`` config describes, written into ``out``."""
    import hydra.utils

    dataset = hydra.utils.instantiate(cfg.data.dataset)
    view0, view1 = first_global_batch(
        dataset, cfg.global_batch_size, cfg.seed, bool(cfg.data.shuffle)
    )
    losses = {
        name: functools.partial(hydra.utils.get_class(spec._target_), **_arguments(spec))
        for name, spec in cfg.audit.losses.items()
    }
    model_factory = functools.partial(
        hydra.utils.get_class(cfg.model._target_), **_arguments(cfg.model)
    )
    table = audit(
        losses,
        model_factory,
        view0,
        view1,
        world_sizes=list(cfg.audit.world_sizes),
        gathers=list(cfg.audit.gathers),
        seed=cfg.seed,
    )
    write(table, out)
    return table


def _arguments(spec) -> dict:
    from omegaconf import OmegaConf

    arguments = OmegaConf.to_container(spec, resolve=True)
    arguments.pop("_target_")
    return arguments


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m gatherlab.audit", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, help="output directory (default: a new outputs/ dir)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. audit.world_sizes=[2]")
    args = parser.parse_args(argv)
    from gatherlab import train

    command = ["experiment=gather_audit", *args.overrides]
    if args.out is not None:
        command.append(f"hydra.run.dir={args.out.resolve()}")
    train.main(command)


if __name__ == "__main__":
    sys.exit(main())
