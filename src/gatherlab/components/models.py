"""Models that map a view to its embedding, and the small language model that ``strategy=pp`` cuts
into pipeline stages (`TinyLM`). Weights are initialised from torch's global RNG, which
the runner seeds before construction, so every layout starts from the same weights."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn

from gatherlab.components.augment import DROPOUT_STREAM, sample_generator
from gatherlab.components.batchnorm import GlobalBatchNorm


class Linear(nn.Module):
    """A bias-free linear map on the last dimension (the model of lightly PR #1531's test).

    ``weight`` (out_features × in_features nested lists) sets the initial weight exactly; without
    it the weight is drawn like ``nn.Linear``'s.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        weight: Sequence[Sequence[float]] | None = None,
    ):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        if weight is not None:
            initial = torch.tensor([list(row) for row in weight], dtype=torch.float64)
            if initial.shape != self.linear.weight.shape:
                raise ValueError(
                    f"model.weight has shape {tuple(initial.shape)}, expected "
                    f"(out_features, in_features) = {tuple(self.linear.weight.shape)}"
                )
            with torch.no_grad():
                self.linear.weight.copy_(initial)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class MLP(nn.Module):
    """Linear → ReLU → … → Linear on the last dimension; no normalisation layers, so a sample's
    embedding depends on that sample alone."""

    def __init__(self, in_features: int, hidden_features: int, out_features: int, depth: int = 2):
        super().__init__()
        if depth < 1:
            raise ValueError(f"model.depth must be at least 1, got {depth}")
        widths = [in_features] + [hidden_features] * (depth - 1) + [out_features]
        layers: list[nn.Module] = []
        for index, (width_in, width_out) in enumerate(itertools.pairwise(widths)):
            if index:
                layers.append(nn.ReLU())
            layers.append(nn.Linear(width_in, width_out))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class NormMLP(nn.Module):
    """LayerNorm → Linear → ReLU → Linear on the last dimension: a transformer's pre-norm
    feed-forward block (without its residual), the block that Megatron's tensor and sequence
    parallelism splits. LayerNorm normalises each row over its features, so a sample's embedding
    depends on that sample alone, as `MLP`'s. `tensor_parallel_plan` says how ``strategy=tp``
    splits it (docs/checking.md §10 "Sharded code")."""

    def __init__(self, in_features: int, hidden_features: int, out_features: int):
        super().__init__()
        self.norm = nn.LayerNorm(in_features)
        self.up = nn.Linear(in_features, hidden_features)
        self.down = nn.Linear(hidden_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.norm(x))))

    def tensor_parallel_plan(self, tensor_parallel: int, sequence_parallel: bool) -> dict:
        """torch's ``parallelize_module`` plan over a tensor-parallel mesh of ``tensor_parallel``
        ranks, which all hold the same rows (their data-parallel group's): ``up`` split by its
        output features (``ColwiseParallel``), ``down`` by its input features
        (``RowwiseParallel``), and each rank's output its own consecutive part of the rows (the
        loss's rows: rank r of W holds the r-th part of the global batch, as under DDP).

        With ``sequence_parallel`` (Megatron's sequence parallelism, the rows as the sequence):
        the rows split before the norm (``SequenceParallel(sequence_dim=0)``: its parameters
        replicated, their gradient a partial sum over the tensor-parallel ranks), gathered for
        ``up`` and reduce-scattered back by ``down``. Without it: the norm runs on every row on
        every rank (not parallelized), ``down``'s output is all-reduced and each rank keeps its
        part. A ValueError when ``hidden_features`` does not divide by ``tensor_parallel``."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            PrepareModuleOutput,
            RowwiseParallel,
            SequenceParallel,
        )  # fmt: skip

        hidden = self.up.out_features
        if hidden % tensor_parallel:
            raise ValueError(
                f"model.hidden_features={hidden} does not divide by strategy.tensor_parallel="
                f"{tensor_parallel}; allowed: a multiple of {tensor_parallel}"
            )
        rows = Shard(0)
        if sequence_parallel:
            return {
                "": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=rows),
                "norm": SequenceParallel(sequence_dim=0),
                "up": ColwiseParallel(input_layouts=rows),
                "down": RowwiseParallel(output_layouts=rows),
            }
        return {
            "": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=rows),
            "up": ColwiseParallel(),
            "down": RowwiseParallel(output_layouts=Replicate()),
        }


class MoEMLP(nn.Module):
    """Linear → ReLU → a top-1 mixture of experts (a residual: each row plus its gate times its
    expert's output) → Linear, on the last dimension. The router sends each row to its most
    probable of ``experts`` experts (each Linear → ReLU) and weights the expert's output by that
    probability; a row's embedding depends on that row alone.

    On one device every expert computes its own rows. After `expert_parallel` (``strategy=ep``)
    the experts are spread over the ranks of a group (rank r computes experts r·E/W to
    (r+1)·E/W − 1): each rank sends each of its rows to the rank of its expert and gets the
    outputs back, with ``all_to_all_single`` and its autograd form, as users write token
    dispatch (docs/checking.md §10, "Expert parallelism in the lab")."""

    def __init__(self, in_features: int, hidden_features: int, out_features: int, experts: int):
        super().__init__()
        if experts < 1:
            raise ValueError(f"model.experts must be at least 1, got {experts}")
        self.up = nn.Linear(in_features, hidden_features)
        self.router = nn.Linear(hidden_features, experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden_features, hidden_features), nn.ReLU())
            for _ in range(experts)
        )
        self.down = nn.Linear(hidden_features, out_features)
        self.group = None  # the expert-parallel group, once `expert_parallel` set it

    def expert_parallel(self, group) -> None:
        """Spread the experts over the ranks of ``group`` (a process group whose size divides
        ``experts``; every rank keeps every expert's parameters and computes its own experts')."""
        import torch.distributed as dist

        size = dist.get_world_size(group)
        if len(self.experts) % size:
            raise ValueError(
                f"model.experts={len(self.experts)} does not divide over {size} ranks; allowed: "
                f"a multiple of {size}"
            )
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.up(x))
        gate, choice = torch.softmax(self.router(hidden), dim=-1).max(dim=-1)
        if self.group is None:
            expert_out = self._own_experts(hidden, choice, range(len(self.experts)))
        else:
            expert_out = self._dispatched(hidden, choice)
        return self.down(hidden + gate[:, None] * expert_out)

    def _own_experts(self, rows: torch.Tensor, choice: torch.Tensor, experts) -> torch.Tensor:
        """Each row through its expert (one of ``experts``), each expert on its own rows."""
        out = torch.zeros_like(rows)
        for index in experts:
            # an expert without rows takes part too (a zero gradient: DDP waits for every one)
            chosen = (choice == index).nonzero().squeeze(1)
            out = out.index_put((chosen,), self.experts[index](rows[chosen]))
        return out

    def _dispatched(self, hidden: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
        """The experts' outputs of this rank's rows, each row computed on its expert's rank: the
        rows sorted by expert, sent (``all_to_all_single``, the counts first), computed by the
        receiving rank's experts, sent back and put in their places."""
        import torch.distributed as dist

        size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        per_rank = len(self.experts) // size
        order = torch.argsort(choice, stable=True)
        counts = torch.bincount(choice // per_rank, minlength=size)
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.group)
        sent, received = counts.tolist(), received_counts.tolist()
        experts = torch.empty(sum(received), dtype=choice.dtype, device=choice.device)
        dist.all_to_all_single(experts, choice[order], received, sent, group=self.group)
        rows = _AllToAll.apply(hidden[order], sent, received, self.group)
        computed = self._own_experts(rows, experts, range(rank * per_rank, (rank + 1) * per_rank))
        return _unsorted(_AllToAll.apply(computed, received, sent, self.group), order)


class _AllToAll(torch.autograd.Function):
    """Rows sent to the ranks of ``group`` (``dist.all_to_all_single``): ``sent[r]`` rows of
    ``rows`` to rank r, in order, and ``received[r]`` rows from it. Its backward sends each
    received row's gradient back to the rank that sent the row (the same collective with the
    counts swapped), so every rank gets its own rows' gradients, summed over nothing: each row
    went to one rank."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, sent: list[int], received: list[int], group):
        import torch.distributed as dist

        ctx.sent, ctx.received, ctx.group = sent, received, group
        out = rows.new_empty(sum(received), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), received, sent, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        back = grad.new_empty(sum(ctx.sent), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), ctx.sent, ctx.received, group=ctx.group)
        return back, None, None, None


def _unsorted(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``rows`` (sorted by ``order``) back in their places: row ``order[i]`` is ``rows[i]``."""
    return rows[torch.argsort(order)]


class CausalBlock(nn.Module):
    """A pre-norm residual block over a sequence: each position normalised, replaced by the mean
    of the positions up to it (causal: position t reads positions ≤ t, so a sequence's outputs
    depend on that sequence alone), then Linear → ReLU → Linear added back."""

    def __init__(self, features: int, hidden_features: int):
        super().__init__()
        self.norm = nn.LayerNorm(features)
        self.up = nn.Linear(features, hidden_features)
        self.down = nn.Linear(hidden_features, features)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.norm(hidden)
        seen = torch.arange(1, x.shape[1] + 1, dtype=x.dtype, device=x.device)
        x = x.cumsum(dim=1) / seen[:, None]
        return hidden + self.down(torch.relu(self.up(x)))


class TinyLM(nn.Module):
    """A small causal language model whose head is tied to its embedding: token ids (batch ×
    length) → embedding → ``depth`` `CausalBlock` s → LayerNorm → logits over the vocabulary by
    the embedding's own weight (one parameter, ``embed.weight``, used first and last).
    `pipeline_stages` cuts it for ``strategy=pp`` (docs/checking.md §10, "Pipeline parallelism in
    the lab")."""

    def __init__(self, vocab_size: int, features: int, hidden_features: int, depth: int):
        super().__init__()
        if depth < 1:
            raise ValueError(f"model.depth must be at least 1, got {depth}")
        self.embed = nn.Embedding(vocab_size, features)
        nn.init.normal_(self.embed.weight, std=features**-0.5)  # logits of order 1 at the start
        self.blocks = nn.ModuleList(CausalBlock(features, hidden_features) for _ in range(depth))
        self.norm = nn.LayerNorm(features)

    @property
    def tied_weight(self) -> nn.Parameter:
        """The parameter the first stage embeds with and the last stage's head reads."""
        return self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        for block in self.blocks:
            hidden = block(hidden)
        return nn.functional.linear(self.norm(hidden), self.embed.weight)

    def pipeline_stages(self, count: int, head_weight: nn.Parameter | None = None) -> list:
        """The model cut into ``count`` stages of consecutive blocks (the earlier stages one block
        more where ``depth`` does not divide evenly): the first embeds, the last normalises and
        computes the logits with ``head_weight`` (its own copy of the tied weight, on another rank
        than the first stage's; the embedding's when None). Each stage holds the model's own
        modules (its parameters are the model's, under the model's names), and maps the previous
        stage's output (the token ids for the first) to its own. A ValueError of one line when a
        stage would hold no block."""
        depth = len(self.blocks)
        if not 1 <= count <= depth:
            raise ValueError(
                f"{count} pipeline stages of a model of model.depth={depth} blocks leave a stage "
                f"without a block; allowed: at most {depth} stages (model.depth ≥ "
                "strategy.pipeline_parallel × the schedule's stages per rank)"
            )
        sizes = [depth // count + (index < depth % count) for index in range(count)]
        starts = list(itertools.accumulate([0, *sizes]))
        head = self.embed.weight if head_weight is None else head_weight
        return [
            _Stage(
                embed=self.embed if index == 0 else None,
                blocks=list(self.blocks[starts[index] : starts[index + 1]]),
                norm=self.norm if index == count - 1 else None,
                head_weight=head if index == count - 1 else None,
            )
            for index in range(count)
        ]


class _Stage(nn.Module):
    """One pipeline stage of `TinyLM`: its embedding (first stage), its blocks, its final norm and
    head (last stage), each the model's own module; the head's weight registered here."""

    def __init__(
        self,
        embed: nn.Embedding | None,
        blocks: list[nn.Module],
        norm: nn.LayerNorm | None,
        head_weight: nn.Parameter | None,
    ):
        super().__init__()
        self.embed, self.blocks, self.norm = embed, nn.ModuleList(blocks), norm
        self.head_weight = head_weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            hidden = self.embed(hidden)
        for block in self.blocks:
            hidden = block(hidden)
        if self.norm is not None:
            hidden = nn.functional.linear(self.norm(hidden), self.head_weight)
        return hidden


NORMS = ("global", "local", "sync")


def batch_norm(kind: str, num_features: int, dims: int) -> nn.Module:
    """The normalisation layer of ``model.norm``: ``global`` (gatherlab's global batch norm, any
    backend), ``local`` (per-rank statistics, what plain DDP does), ``sync`` (torch's
    SyncBatchNorm: global statistics on NCCL; it refuses CPU tensors)."""
    if kind == "global":
        return GlobalBatchNorm(num_features)
    if kind == "local":
        return nn.BatchNorm1d(num_features) if dims == 1 else nn.BatchNorm2d(num_features)
    if kind == "sync":
        return nn.SyncBatchNorm(num_features)
    raise ValueError(f"model.norm={kind!r} is unknown; allowed: {', '.join(NORMS)}")


class SeededDropout(nn.Module):
    """Dropout whose mask for a sample is drawn from (seed, epoch, sample index, view, layer),
    like the augmentations, so a sample is dropped the same way on any layout.

    ``sample_keys`` rows are ``[epoch, index, view]``; without keys (evaluation of a single batch,
    or data without keys) it is the identity in evaluation and plain dropout in training.
    """

    def __init__(self, p: float, seed: int, layer: int):
        super().__init__()
        if not 0 <= p < 1:
            raise ValueError(f"model.dropout must be in [0, 1), got {p}")
        self.p, self.seed, self.layer = p, seed, layer

    def forward(self, x: torch.Tensor, sample_keys: torch.Tensor | None = None) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if sample_keys is None:
            return nn.functional.dropout(x, self.p, training=True)
        keep = torch.stack(
            [
                torch.rand(
                    x.shape[1:],
                    generator=sample_generator(
                        self.seed, epoch, index, DROPOUT_STREAM + 2 * self.layer + view
                    ),
                    dtype=torch.float64,
                )
                >= self.p
                for epoch, index, view in sample_keys.tolist()
            ]
        )
        return x * keep.to(x.dtype) / (1 - self.p)


class SimCLRNet(nn.Module):
    """A small SimCLR network for 8×8 images: a CNN backbone with batch norm (3 conv layers,
    global average pooling to ``4·width`` features) and a projection head Linear → batch norm →
    ReLU → (seeded dropout) → Linear. ``norm`` chooses the batch norm (``batch_norm``)."""

    takes_sample_keys = True

    def __init__(
        self,
        in_channels: int = 1,
        width: int = 16,
        hidden_features: int = 64,
        out_features: int = 32,
        norm: str = "global",
        dropout: float = 0.0,
        seed: int = 0,
    ):
        super().__init__()
        channels = [in_channels, width, 2 * width, 4 * width]
        layers: list[nn.Module] = []
        for index, (width_in, width_out) in enumerate(itertools.pairwise(channels)):
            stride = 1 if index == 0 else 2
            layers += [
                nn.Conv2d(width_in, width_out, 3, stride=stride, padding=1, bias=False),
                batch_norm(norm, width_out, dims=2),
                nn.ReLU(),
            ]
        self.backbone = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.projection = nn.Linear(channels[-1], hidden_features, bias=False)
        self.projection_norm = batch_norm(norm, hidden_features, dims=1)
        self.dropout = SeededDropout(dropout, seed, layer=0)
        self.head = nn.Linear(hidden_features, out_features)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The backbone's features (what the k-NN evaluation reads)."""
        return self.backbone(x)

    def forward(self, x: torch.Tensor, sample_keys: torch.Tensor | None = None) -> torch.Tensor:
        hidden = torch.relu(self.projection_norm(self.projection(self.features(x))))
        return self.head(self.dropout(hidden, sample_keys))
