"""A transformer encoder that parallelizes itself with torch's DTensor (tensor and sequence
parallelism, as Megatron-style code does with ``parallelize_module``), and the ways such code
departs from one device (no gatherlab imports), for the check of a plain step or update with
``--tensor-parallel T`` (docs/design.md §10, "Tensor and sequence parallelism").

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
- ``cosine_update``: the whole update of the same loss over K micro-batches: exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


class Attention(nn.Module):
    """Causal multi-head self-attention (each position attends to itself and those before it):
    the number of heads a rank computes is what its q holds."""

    def __init__(self, features: int, heads: int) -> None:
        super().__init__()
        self.head_size = features // heads
        self.norm = nn.LayerNorm(features)
        self.q, self.k, self.v = (nn.Linear(features, features) for _ in range(3))
        self.out = nn.Linear(features, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)

        def heads(t: torch.Tensor) -> torch.Tensor:  # (batch, heads, sequence, head size)
            return t.unflatten(-1, (-1, self.head_size)).transpose(1, 2)

        q, k, v = heads(self.q(h)), heads(self.k(h)), heads(self.v(h))
        scores = q @ k.transpose(-1, -2) / self.head_size**0.5
        later = torch.ones(scores.shape[-2:], dtype=torch.bool, device=x.device).triu(1)
        weights = torch.softmax(scores.masked_fill(later, float("-inf")), dim=-1)  # causal
        return self.out((weights @ v).transpose(1, 2).flatten(-2))


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
    pooled over the sequence: (batch, sequence, features) → (batch, projection)."""

    def __init__(
        self, features: int = 8, hidden: int = 16, heads: int = 4, projection: int = 8,
        attention: bool = True, dropout: float = 0.0, output_dropout: float = 0.0,
    ) -> None:  # fmt: skip
        super().__init__()
        self.attention = Attention(features, heads) if attention else None
        self.mlp = Mlp(features, hidden, dropout)
        self.norm = nn.LayerNorm(features)
        self.head = nn.Linear(features, projection)
        self.drop = nn.Dropout(output_dropout) if output_dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.attention is not None:
            x = x + self.attention(x)
        x = x + self.mlp(x)
        return self.drop(self.head(self.norm(x)).mean(dim=1))


def plan(attention: bool, local_features: bool) -> dict:
    """The tensor- and sequence-parallel plan of `Encoder` (torch's public parallel styles)."""
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
    head = (
        ColwiseParallel(input_layouts=Shard(1))  # each rank its shard of the features
        if local_features
        else ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    )
    return block | {"norm": SequenceParallel(), "head": head}


def build(
    mesh=None, features: int = 8, hidden: int = 16, heads: int = 4, attention: bool = True,
    input_layout: str = "replicate", local_features: bool = False, dropout: float = 0.0,
    output_dropout: float = 0.0,
) -> nn.Module:  # fmt: skip
    """The encoder, parallelized over ``mesh["tp"]`` when a mesh is given (the check's
    ``--tensor-parallel``), sharded by FSDP2 over ``mesh["dp"]`` when it has several
    data-parallel groups. ``input_layout``: what the plan says each rank passes, ``replicate``
    (the whole sequence, sharded by the root) or ``shard`` (its shard of the sequence)."""
    model = Encoder(features, hidden, heads, attention=attention, dropout=dropout,
                    output_dropout=output_dropout)  # fmt: skip
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
    parallelize_module(model, mesh["tp"], plan(attention, local_features))
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
