"""Which gradient do the ranks get? The parameter gradient that DDP hands to the optimizer on W
real gloo ranks, against the 1-device gradient of the same global batch, in float64, classified
(docs/design.md §1):

- ``exact``: max |g − g₁| / max |g₁| ≤ 1e-10 (summation order only);
- ``none``: no gradient reaches the parameters at all (g = 0);
- ``1/W``: same direction (cosine ≥ 1 − 1e-12) and norm ratio 1/W to a relative 1e-10;
- ``W``: same direction and norm ratio W to a relative 1e-10;
- ``biased``: a different direction (no rescaling repairs it);
- ``other``: anything else: the same direction at another scale.

``audit`` measures every gather × loss × world size (the gradient audit); its ranks run in the warm
worker pools.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gatherlab.data import epoch_order
from gatherlab.gather import CLASSES, GatherFn
from gatherlab.pool import pool

log = logging.getLogger(__name__)

EXACT_RELATIVE_ERROR = 1e-10
PARALLEL_COSINE = 1 - 1e-12
NORM_RATIO_TOLERANCE = 1e-10
NO_PREDICTION = "no prediction"
COLUMNS = (
    "gather", "loss", "style", "world_size", "predicted", "measured", "cosine", "norm_ratio",
    "max_rel_err",
)  # fmt: skip

LossFactory = Callable[..., nn.Module]

__all__ = ["CLASSES", "COLUMNS", "audit", "classify", "first_global_batch"]


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
    gathers: Mapping[str, GatherFn],
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
            model_factory,
            losses[loss](gather=gathers[gather]),
            view0[rows],
            view1[rows],
            seed,
            True,
        )
    return gradients if rank == 0 else None


def _near(ratio: float, expected: float) -> bool:
    return abs(ratio / expected - 1) <= NORM_RATIO_TOLERANCE


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
    elif norm == 0:
        measured = "none"
    elif cosine >= PARALLEL_COSINE and _near(norm_ratio, 1 / world_size):
        measured = "1/W"
    elif cosine >= PARALLEL_COSINE and _near(norm_ratio, world_size):
        measured = "W"
    elif cosine < PARALLEL_COSINE:
        measured = "biased"
    else:
        measured = "other"
    return measured, cosine, norm_ratio, max_rel_err


def style(factory: LossFactory) -> str | None:
    """The loss style a loss class declares (``style``: local, global or mixed), if any."""
    target = getattr(factory, "func", factory)  # a functools.partial of the class
    return getattr(target, "style", None)


def predicted(gather: GatherFn, loss_style: str | None) -> str:
    """The class a gather declares for a loss style (``Gather.predicted``), or "no prediction"."""
    declared = getattr(gather, "predicted", None) or {}
    return declared.get(loss_style, NO_PREDICTION) if loss_style else NO_PREDICTION


def audit(
    losses: Mapping[str, LossFactory],
    model_factory: Callable[[], nn.Module],
    view0: torch.Tensor,
    view1: torch.Tensor,
    gathers: Mapping[str, GatherFn],
    world_sizes: Sequence[int] = (2, 4, 8),
    seed: int = 0,
) -> pd.DataFrame:
    """One row per gather × loss × world size (``COLUMNS``). ``losses`` maps a loss name to a
    factory taking ``gather=``, ``gathers`` a gather name to the gather; ``view0``/``view1`` are
    one global batch."""
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
        gradients = pool(world_size).run(
            _rank_gradients, cells, dict(losses), dict(gathers), model_factory, view0, view1, seed
        )[0]
        for gather, loss in cells:
            measured, cosine, norm_ratio, max_rel_err = classify(
                gradients[gather, loss], references[loss], world_size
            )
            loss_style = style(losses[loss])
            rows.append(
                {
                    "gather": gather,
                    "loss": loss,
                    "style": loss_style or "unknown",
                    "world_size": world_size,
                    "predicted": predicted(gathers[gather], loss_style),
                    "measured": measured,
                    "cosine": cosine,
                    "norm_ratio": norm_ratio,
                    "max_rel_err": max_rel_err,
                }
            )
    return pd.DataFrame(rows, columns=list(COLUMNS))


def first_global_batch(dataset, global_batch_size: int, seed: int, shuffle: bool) -> tuple:
    """The views of the first global batch a training run with this data would take."""
    indices = torch.as_tensor(epoch_order(len(dataset), seed, 0, shuffle)[:global_batch_size])
    view0, view1 = zip(*(dataset[int(index)] for index in indices), strict=True)
    return torch.stack(view0), torch.stack(view1)
