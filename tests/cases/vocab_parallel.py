"""A vocabulary-parallel embedding (``RowwiseParallel`` on an ``nn.Embedding``: each rank holds
its rows of the table, looks up the ids it holds and gives zeros elsewhere, a pending sum that
DTensor marks with a mask only the plan's own redistribution may consume) under a linear head,
as torchtitan's and transformers' plans cut token embeddings. For the check of a step
(``build``, ``step``, ``Ids``) and for `gatherlab.record` (``loop``).

Bugs: ``rank_offset``, each rank adds its rank to its outputs before the loss (code that depends
on the rank, outside the model's forward); ``local_features``, the head cut by columns too and its
output left each rank's shard of the features, over which the loss's log-sum-exp runs."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

import gatherlab.record

VOCABULARY, WIDTH, SEQUENCE, OUTPUTS = 16, 8, 6, 4


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, WIDTH)
        self.head = nn.Linear(WIDTH, OUTPUTS)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids)).mean(dim=1)


def build(mesh=None, local_features: bool = False) -> nn.Module:
    """The model, its embedding cut by rows of the vocabulary over ``mesh["tp"]`` when given
    (and with ``local_features`` its head by columns, each rank given its shard of the output)."""
    torch.manual_seed(0)
    model = Tokens()
    if mesh is not None:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        plan = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
        if local_features:
            plan["head"] = ColwiseParallel()
        parallelize_module(model, mesh["tp"], plan)
    return model


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def step(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


def rank_offset_step(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return (model(batch) + _rank()).pow(2).mean()


class Ids(Dataset):
    def __init__(self, size: int = 64) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCABULARY, (size, SEQUENCE), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.ids[index]


def loop(out: str, trace: bool = True, bug: str = "") -> None:
    """Two SGD updates of 8 rows recorded with the one documented line (a loss module's output
    as the loss), on one device or with the embedding cut over every rank (tp = W; each rank
    given the same rows)."""
    from gatherlab.ranks import world

    grouped = dist.is_available() and dist.is_initialized()
    mesh = world.mesh(dist.get_world_size()) if grouped else None
    model = build(mesh, local_features=bug == "local_features").double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    criterion = _Loss(bug)
    data = Ids()
    with gatherlab.record(model, optimizer, out, loss=criterion, trace=trace):
        for update in range(2):
            optimizer.zero_grad()
            criterion(model(data.ids[8 * update : 8 * (update + 1)])).backward()
            optimizer.step()


class _Loss(nn.Module):
    def __init__(self, bug: str) -> None:
        super().__init__()
        self.bug = bug

    def forward(self, outputs: torch.Tensor) -> torch.Tensor:
        if self.bug == "local_features":
            return torch.logsumexp(outputs, dim=-1).mean()
        return (outputs + (_rank() if self.bug == "rank_offset" else 0)).pow(2).mean()
