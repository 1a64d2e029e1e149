"""A transformer encoder that parallelizes itself with torch's DTensor (tensor and sequence
parallelism, as Megatron-style code does with ``parallelize_module``), and the ways such code
departs from one device (no gatherlab imports), for the check of a plain step or update with
``--tensor-parallel T`` (docs/checking.md §10, "Tensor and sequence parallelism").

``build(mesh=None, ...)`` is the model factory: on one device (``mesh`` None) the plain encoder;
on W ranks the encoder parallelized over ``mesh["tp"]`` (and sharded by FSDP2 over ``mesh["dp"]``
when there are several data-parallel groups). The plan, per block: its LayerNorm
``SequenceParallel`` (each rank normalises its shard of the sequence), the attention's q, k, v and
the MLP's up projection ``ColwiseParallel`` from a sequence shard (an all-gather of the sequence,
then each rank its heads or hidden features), the attention's output and the MLP's down projection
``RowwiseParallel`` back to a sequence shard (a reduce-scatter). The step gives each rank the
whole sequences of its rows; the root's ``PrepareModuleInput`` shards them.

- ``cosine_step``: the two views' pooled features, a per-sample cosine loss (BYOL-style): exact;
- ``build(attention=False)``: the MLP block alone: exact;
- ``build(input_layout="shard")``: the plan says the step gives each rank its shard of the
  sequence, the step gives the whole: every rank trains on a sequence T times as long;
- ``build(local_features=True)``: the projection head ``ColwiseParallel`` with its default local
  output, each rank's shard of the features, fed to a loss that normalises over the features
  (not a parallel loss);
- ``local_sgd``: SGD that steps each parameter's local tensor with its gradient's local tensor,
  as a hand-written or fused optimizer working on shards does: a sequence-parallel LayerNorm's
  gradient is a partial sum over the tensor-parallel group, which it never reduces;
- ``build(dropout=0.1)``: dropout on the MLP's hidden features, each rank's shard drawn from the
  same seed on every rank of the group: the shards' masks agree where they must differ;
- ``build(output_dropout=0.1)`` with ``seeded_per_rank_step``: dropout on the pooled output,
  which every rank of the group holds whole, after seeding each rank with its rank: the masks
  differ where they must agree;
- ``build(head_view="count", rank_heads=False)``: q, k and v split into heads by ``view`` with
  the model's head count (``t.view(batch, -1, self.heads, head_size)``), where each rank's q
  holds heads // T heads: the identity on one device, on a rank its heads' features taken as
  every head over a 1/T of the sequence (the shapes of a sequence shard, not its values). Its
  correct forms: ``build()`` (-1 on the heads dimension, ``unflatten``) and
  ``build(head_view="count")`` (the factory sets the head count to the rank's, heads // T);
- ``build(pool="local")``: the head applied to each rank's shard of the sequence (its output a
  DTensor sharded on the sequence) and pooled by each rank's local tensor,
  ``y.to_local().mean(dim=1)``: the mean of the rank's shard, not of the sequence. Its correct
  form: ``build(pool="whole")`` (``y.full_tensor().mean(dim=1)``);
- ``cosine_update``: the whole update of the same loss over K micro-batches: exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import Dataset


class Attention(nn.Module):
    """Causal multi-head self-attention (each position attends to itself and those before it):
    the number of heads a rank computes is what its q holds. ``head_view``: how q, k and v are
    split into heads, ``unflatten`` (-1 on the heads dimension: whatever the rank holds) or
    ``count`` (``view`` by ``self.heads``, the head count, which a tensor-parallel factory must
    set to the rank's)."""

    def __init__(self, features: int, heads: int, head_view: str = "unflatten") -> None:
        super().__init__()
        self.heads, self.head_size, self.head_view = heads, features // heads, head_view
        self.norm = nn.LayerNorm(features)
        self.q, self.k, self.v = (nn.Linear(features, features) for _ in range(3))
        self.out = nn.Linear(features, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        q, k, v = self.q(h), self.k(h), self.v(h)  # on a rank: its heads' features, whole sequence
        batch, sequence = q.shape[:2]
        if self.head_view == "count":  # (batch, sequence, heads, head size) by the head count
            q, k, v = (t.view(batch, -1, self.heads, self.head_size) for t in (q, k, v))
        else:
            q, k, v = (t.unflatten(-1, (-1, self.head_size)) for t in (q, k, v))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, sequence, head size)
        scores = q @ k.transpose(-1, -2) / self.head_size**0.5
        later = torch.ones(scores.shape[-2:], dtype=torch.bool, device=x.device).triu(1)
        weights = torch.softmax(scores.masked_fill(later, float("-inf")), dim=-1)  # causal
        return self.out((weights @ v).transpose(1, 2).reshape(batch, sequence, -1))


class Mlp(nn.Module):
    def __init__(self, features: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(features)
        self.up = nn.Linear(features, hidden)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.down = nn.Linear(hidden, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.drop(F.gelu(self.up(self.norm(x)))))


class Encoder(nn.Module):
    """One pre-norm transformer block (attention, MLP), a final LayerNorm and a projection head,
    pooled over the sequence: (batch, sequence, features) → (batch, projection). ``pool``: how
    the head's output is pooled, ``mean`` (the plan replicates it: a plain tensor on every rank),
    or, where the plan keeps it a DTensor sharded on the sequence, ``whole`` (read whole first)
    or ``local`` (each rank's local tensor)."""

    def __init__(
        self, features: int = 8, hidden: int = 16, heads: int = 4, projection: int = 8,
        attention: bool = True, dropout: float = 0.0, output_dropout: float = 0.0,
        head_view: str = "unflatten", pool: str = "mean",
    ) -> None:  # fmt: skip
        super().__init__()
        self.attention = Attention(features, heads, head_view) if attention else None
        self.mlp = Mlp(features, hidden, dropout)
        self.norm = nn.LayerNorm(features)
        self.head = nn.Linear(features, projection)
        self.drop = nn.Dropout(output_dropout) if output_dropout else nn.Identity()
        self.pool = pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.attention is not None:
            x = x + self.attention(x)
        x = x + self.mlp(x)
        y = self.head(self.norm(x))  # on a rank: replicated, or a DTensor of its sequence shard
        if self.pool == "whole":  # the whole sequence's mean
            pooled = (y.full_tensor() if isinstance(y, DTensor) else y).mean(dim=1)
        elif self.pool == "local":  # the mean of the rank's shard of the sequence
            pooled = (y.to_local() if isinstance(y, DTensor) else y).mean(dim=1)
        else:
            pooled = y.mean(dim=1)
        return self.drop(pooled)


def plan(attention: bool, local_features: bool, sharded_head: bool = False) -> dict:
    """The tensor- and sequence-parallel plan of `Encoder` (torch's public parallel styles);
    ``sharded_head``: the head applied to each rank's shard of the sequence, its weights
    replicated and its output a DTensor sharded on the sequence (``SequenceParallel``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    gathered = ColwiseParallel(input_layouts=Shard(1))  # the sequence gathered, features split
    scattered = RowwiseParallel(output_layouts=Shard(1))  # summed, the sequence scattered
    block = {"mlp.norm": SequenceParallel(), "mlp.up": gathered, "mlp.down": scattered}
    if attention:
        block |= {"attention.norm": SequenceParallel(), "attention.out": scattered}
        block |= {f"attention.{name}": ColwiseParallel(input_layouts=Shard(1)) for name in "qkv"}
    if sharded_head:
        head = SequenceParallel()
    elif local_features:
        head = ColwiseParallel(input_layouts=Shard(1))  # each rank its shard of the features
    else:
        head = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    return block | {"norm": SequenceParallel(), "head": head}


def build(
    mesh=None, features: int = 8, hidden: int = 16, heads: int = 4, attention: bool = True,
    input_layout: str = "replicate", local_features: bool = False, dropout: float = 0.0,
    output_dropout: float = 0.0, head_view: str = "unflatten", rank_heads: bool = True,
    pool: str = "mean",
) -> nn.Module:  # fmt: skip
    """The encoder, parallelized over ``mesh["tp"]`` when a mesh is given (the check's
    ``--tensor-parallel``), sharded by FSDP2 over ``mesh["dp"]`` when it has several
    data-parallel groups. ``input_layout``: what the plan says each rank passes, ``replicate``
    (the whole sequence, sharded by the root) or ``shard`` (its shard of the sequence).
    ``head_view="count"``: the attention splits heads by its head count, which the factory sets
    to the rank's (``heads // tp``, as torchtitan's once did) unless ``rank_heads`` is False.
    ``pool``: ``mean`` (the head's output replicated), ``whole`` or ``local`` (the head's output
    kept sharded on the sequence, read whole or taken locally, `Encoder`)."""
    model = Encoder(features, hidden, heads, attention=attention, dropout=dropout,
                    output_dropout=output_dropout, head_view=head_view, pool=pool)  # fmt: skip
    if mesh is None:
        return model
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module

    given = Shard(1) if input_layout == "shard" else Replicate()
    root = PrepareModuleInput(
        input_layouts=(given,), desired_input_layouts=(Shard(1),), use_local_output=True
    )
    parallelize_module(model, mesh["tp"], root)
    parallelize_module(model, mesh["tp"], plan(attention, local_features, pool != "mean"))
    if attention and rank_heads:  # the rank's heads: q, k and v each hold heads // tp of them
        model.attention.heads = heads // mesh["tp"].size()
    if mesh["dp"].size() > 1:
        fully_shard(model, mesh=mesh["dp"])
    return model


def build_misnamed(mesh=None) -> nn.Module:
    """A plan naming a module the encoder does not have (``mlp.fc1``; it has ``mlp.up``)."""
    model = Encoder()
    if mesh is not None:
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        parallelize_module(model, mesh["tp"], {"mlp.fc1": ColwiseParallel()})
    return model


def build_plain(features: int = 8) -> nn.Module:
    """The encoder with no mesh argument: code that does not parallelize itself."""
    return Encoder(features)


def build_plain_with_mesh(mesh=None) -> nn.Module:
    """The encoder, a mesh taken and not used: code that does not parallelize itself either."""
    return Encoder()


def cosine_step(model: nn.Module, batch) -> torch.Tensor:
    """BYOL-style: 2 − 2 cos(z₁, z₂) of each sample's two views, averaged."""
    first, second = batch
    z1, z2 = model(first), model(second)
    return (2 - 2 * F.cosine_similarity(z1, z2, dim=-1)).mean()


def seeded_per_rank_step(model: nn.Module, batch) -> torch.Tensor:
    """`cosine_step` after seeding each rank's random streams with its rank (for diverse
    augmentations, say): dropout on a replicated tensor then draws another mask on each rank."""
    import torch.distributed as dist

    torch.manual_seed(1234 + (dist.get_rank() if dist.is_initialized() else 0))
    return cosine_step(model, batch)


def cosine_update(model: nn.Module, optimizer, batch, micro_batches: int) -> torch.Tensor:
    """One whole update of `cosine_step`'s loss over ``micro_batches`` micro-batches of the
    rank's rows (a per-sample mean: each micro-batch's loss divided by K)."""
    first, second = batch
    total = 0.0
    for a, b in zip(first.chunk(micro_batches), second.chunk(micro_batches), strict=True):
        loss = cosine_step(model, (a, b)) / micro_batches
        loss.backward()
        total += float(loss.detach())
    optimizer.step()
    return total


def local_sgd(parameters, lr: float = 0.05) -> torch.optim.Optimizer:
    """SGD stepping each parameter's local tensor (a DTensor's ``to_local()``) with its
    gradient's local tensor: on one device, plain SGD."""
    return LocalSGD(parameters, lr=lr)


class LocalSGD(torch.optim.Optimizer):
    def __init__(self, parameters, lr: float) -> None:
        super().__init__(parameters, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                local = p.to_local() if hasattr(p, "to_local") else p
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                local.add_(grad, alpha=-group["lr"])


class Views(Dataset):
    """Two views of random sequences (batch, sequence, features): a sequence and the same plus
    fixed noise, each drawn from its index."""

    def __init__(self, size: int = 32, sequence: int = 8, features: int = 8) -> None:
        self.size, self.sequence, self.features = size, sequence, features

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        g = torch.Generator().manual_seed(index)
        x = torch.randn(self.sequence, self.features, generator=g)
        return x, x + 0.1 * torch.randn(self.sequence, self.features, generator=g)
