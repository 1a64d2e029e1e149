"""A mixture-of-experts model with expert parallelism written as users write it on
``torch.distributed.all_to_all_single`` (no gatherlab imports), for the check of a whole update
with ``--expert-parallel E`` (docs/checking.md §10, "Expert parallelism").

``build(mesh=None, ...)`` is the model factory. The model: an input projection, a top-1 router
over ``experts`` experts (each a two-layer MLP) whose output is added to its input scaled by the
router's probability of the chosen expert, and a linear head; the loss (``update``) a mean squared
error over the rank's rows plus a Switch-style load-balancing loss, ``experts`` × Σ_e f_e · P_e
(f_e: the fraction of tokens routed to expert e; P_e: the mean router probability of e), and each
expert takes at most ``capacity_factor`` × tokens / ``experts`` tokens, the later ones in token
order dropped (they keep the residual alone).

- One device (``mesh`` None): every expert, every token routed, counted and dropped here.
- On W ranks (``mesh`` a (W/E) × E mesh named ("dp", "ep")): each rank builds the whole model
  after the same seed and keeps its ``experts``/E experts under their one-device names
  (``experts.2``); its tokens go to the rank of their expert in its ep group and back through
  `AllToAll`, an autograd all-to-all. The load-balancing loss and the capacity are computed over
  the global batch: the counts and the router's probabilities summed over all ranks (`AllReduce`,
  an autograd all-reduce, for the probabilities), a token's place in its expert's queue counted
  after the tokens of the ranks before its own (the global batch in rank order).
- ``update`` reduces the gradients as such code does after its backward: a replicated parameter
  summed over all W ranks and divided by W; an expert summed over its replicas (the ranks of its
  ``dp`` group) and divided by W, since its ep group's ranks already sent it their tokens'
  gradients (DeepSpeed's and Megatron-LM's expert scaling).

The flags (``bug=``) are the departures found in such code:

- ``world_mean``: every parameter all-reduced over all W ranks and divided by W, experts too:
  each rank's expert averaged with the experts the other ranks hold at its place;
- ``replica_mean``: each expert averaged over its replicas (divided by W/E, not W);
- ``ddp``: the whole model wrapped in DDP over all ranks (its broadcast gives every rank rank 0's
  experts' weights, its average mixes the experts);
- ``local_aux``: the load-balancing loss over each rank's own tokens;
- ``local_capacity``: each expert's capacity ``capacity_factor`` × the rank's tokens /
  ``experts``, a token's place counted among the rank's tokens only;
- ``replicated_unreduced``: the replicated parameters not reduced (each rank steps its own);
- ``replicas_unreduced``: each expert divided by W but not summed over its replicas.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

FEATURES, HIDDEN, EXPERTS = 4, 8, 4
BUGS = (
    "",
    "world_mean",
    "replica_mean",
    "ddp",
    "local_aux",
    "local_capacity",
    "replicated_unreduced",
    "replicas_unreduced",
)


class AllToAll(torch.autograd.Function):
    """Rows exchanged between the ranks of ``group``: this rank sends ``send[s]`` consecutive rows
    to rank s and receives ``receive[s]`` from it (``all_to_all_single``). Backward: the reverse
    exchange, each received row's gradient sent back to the rank the row came from (the gradient
    of a movement of rows is the reverse movement)."""

    @staticmethod
    def forward(ctx, rows, send, receive, group):
        ctx.send, ctx.receive, ctx.group = send, receive, group
        out = rows.new_empty((sum(receive), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.receive, group=ctx.group)
        return back, None, None, None


class AllReduce(torch.autograd.Function):
    """The sum over every rank (``all_reduce``). Backward: the sum over every rank of the
    gradient, since every rank's loss depends on the one sum."""

    @staticmethod
    def forward(ctx, tensor):
        summed = tensor.clone()
        dist.all_reduce(summed)
        return summed

    @staticmethod
    def backward(ctx, grad):
        summed = grad.clone()
        dist.all_reduce(summed)
        return summed


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(h)))


class MoE(nn.Module):
    """The model (see the module); ``forward(x)`` returns the prediction and the load-balancing
    loss."""

    def __init__(
        self, experts: int, capacity_factor: float | None, bug: str, mesh=None, aux_weight=0.1
    ) -> None:
        super().__init__()
        self.aux_weight = aux_weight
        self.embed = nn.Linear(FEATURES, HIDDEN)
        self.router = nn.Linear(HIDDEN, experts, bias=False)
        self.experts = nn.ModuleDict({str(e): Expert() for e in range(experts)})
        self.head = nn.Linear(HIDDEN, 1)
        self.count, self.capacity_factor, self.bug, self.mesh = experts, capacity_factor, bug, mesh
        self.local = list(range(experts))
        if mesh is not None:  # this rank's experts, built as one device builds them
            ranks, index = mesh["ep"].size(), mesh["ep"].get_local_rank()
            if experts % ranks:
                raise ValueError(f"{experts} experts do not split evenly over {ranks} ep ranks")
            per_rank = experts // ranks
            self.local = list(range(index * per_rank, (index + 1) * per_rank))
            self.experts = nn.ModuleDict({str(e): self.experts[str(e)] for e in self.local})

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(x)
        probs = torch.softmax(self.router(h), dim=-1)
        gate, chosen = probs.max(dim=-1)
        kept = self._kept(chosen)
        y = self._here(h, chosen, kept) if self.mesh is None else self._dispatched(h, chosen, kept)
        return self.head(h + gate[:, None] * y), self._balance(probs, chosen)

    def _global(self, local: bool) -> bool:
        return self.mesh is not None and not local

    def _kept(self, chosen: torch.Tensor) -> torch.Tensor:
        """Whether each token fits its expert's capacity (all do without a capacity factor)."""
        if self.capacity_factor is None:
            return torch.ones_like(chosen, dtype=torch.bool)
        counts = torch.bincount(chosen, minlength=self.count)
        before, tokens = torch.zeros_like(counts), len(chosen)
        if self._global(self.bug == "local_capacity"):  # the ranks before this one come first
            every = [torch.empty_like(counts) for _ in range(dist.get_world_size())]
            dist.all_gather(every, counts)
            before = sum(every[: dist.get_rank()], torch.zeros_like(counts))
            tokens = int(sum(c.sum() for c in every))
        capacity = int(self.capacity_factor * tokens / self.count)
        place = (F.one_hot(chosen, self.count).cumsum(0) - 1 + before).gather(1, chosen[:, None])
        return place.squeeze(1) < capacity

    def _balance(self, probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Switch's load-balancing loss: experts × Σ_e f_e · P_e."""
        counts = torch.bincount(chosen, minlength=self.count).to(probs.dtype)
        summed, tokens = probs.sum(0), len(chosen)
        if self._global(self.bug == "local_aux"):
            dist.all_reduce(counts)
            summed, tokens = AllReduce.apply(summed), tokens * dist.get_world_size()
        return self.count * ((counts / tokens) * (summed / tokens)).sum()

    def _here(self, h: torch.Tensor, chosen: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        y = torch.zeros_like(h)
        for e in range(self.count):
            rows = ((chosen == e) & kept).nonzero().squeeze(1)
            y = y.index_copy(0, rows, self.experts[str(e)](h[rows]))
        return y

    def _dispatched(self, h: torch.Tensor, chosen: torch.Tensor, kept: torch.Tensor):
        """Each kept token sent to the rank of its expert in the ep group, computed there, and
        sent back (`AllToAll`)."""
        ep = self.mesh["ep"]
        group, ranks, per_rank = ep.get_group(), ep.size(), len(self.local)
        sent = kept.nonzero().squeeze(1)
        order = sent[torch.argsort(chosen[sent], stable=True)]  # by expert: by their rank
        counts = torch.bincount(chosen[order], minlength=self.count)
        arriving = torch.empty_like(counts)  # [s · per_rank + j]: from rank s for my expert j
        dist.all_to_all_single(arriving, counts, group=group)
        send = counts.view(ranks, per_rank).sum(1).tolist()
        arriving = arriving.view(ranks, per_rank)
        rows = AllToAll.apply(h[order], send, arriving.sum(1).tolist(), group)
        pieces = rows.split(arriving.reshape(-1).tolist())  # rank-major, then expert
        done = [
            self.experts[str(e)](torch.cat([pieces[s * per_rank + j] for s in range(ranks)]))
            .split(arriving[:, j].tolist())
            for j, e in enumerate(self.local)
        ]  # fmt: skip
        back = torch.cat([done[j][s] for s in range(ranks) for j in range(per_rank)])
        returned = AllToAll.apply(back, arriving.sum(1).tolist(), send, group)
        return torch.zeros_like(h).index_copy(0, order, returned)


def build(
    mesh=None,
    experts: int = EXPERTS,
    capacity_factor: float | None = None,
    bug: str = "",
    aux_weight: float = 0.1,
) -> nn.Module:
    """The model in float64; on W ranks, this rank's experts of it (in DDP with ``bug="ddp"``);
    ``aux_weight``: the load-balancing loss's weight in the update's loss."""
    if bug not in BUGS:
        raise ValueError(f"bug={bug!r}; allowed: {', '.join(map(repr, BUGS))}")
    model = MoE(experts, capacity_factor, bug, mesh, aux_weight).double()
    if bug == "ddp" and mesh is not None:
        return DistributedDataParallel(model)
    return model


def build_without_mesh(experts: int = EXPERTS) -> nn.Module:
    """A factory that takes no mesh: it cannot split its experts over the ranks."""
    return MoE(experts, None, "", None).double()


def build_keeping_every_expert(mesh=None) -> nn.Module:
    """A factory that takes the mesh and ignores it: every rank holds every expert."""
    return MoE(EXPERTS, None, "", None).double()


def reduce_gradients(model: nn.Module) -> None:
    """After the backward: each replicated parameter summed over all ranks, each expert over its
    replicas (its dp group), both divided by W (see the module; the flags' forms)."""
    if isinstance(model, DistributedDataParallel) or not dist.is_initialized():
        return  # DDP reduced everything; one device has nothing to reduce
    world, dp = dist.get_world_size(), model.mesh["dp"]
    for name, p in model.named_parameters():
        if p.grad is None:  # an expert no token reached: its replicas still reduce
            p.grad = torch.zeros_like(p)
        if name.startswith("experts.") and model.bug != "world_mean":
            if model.bug != "replicas_unreduced":
                dist.all_reduce(p.grad, group=dp.get_group())
            p.grad /= dp.size() if model.bug == "replica_mean" else world
        elif model.bug != "replicated_unreduced":
            dist.all_reduce(p.grad)
            p.grad /= world


def update(model: nn.Module, optimizer, batch, micro_batches: int):
    """One update: each micro-batch's mean squared error plus the model's ``aux_weight`` × its
    load-balancing loss, divided by K, backpropagated; the gradients reduced; one step."""
    x, y = batch
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    aux_weight = inner.aux_weight
    logged = torch.zeros((), dtype=torch.float64)
    for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True):
        prediction, balance = model(xs)
        loss = (F.mse_loss(prediction, ys) + aux_weight * balance) / micro_batches
        loss.backward()
        logged += loss.detach()
    reduce_gradients(model)
    optimizer.step()
    return logged


class Tokens(torch.utils.data.Dataset):
    """``size`` tokens of FEATURES Gaussian features, each with a Gaussian target."""

    def __init__(self, size: int = 64, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, FEATURES, generator=generator, dtype=torch.float64)
        self.y = torch.randn(size, 1, generator=generator, dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def build_strided(mesh=None, experts: int = 2) -> nn.Module:
    """A factory that keeps the experts e with e % E equal to its ep rank (and raises nothing):
    with fewer experts than E, some ranks hold none."""
    model = MoE(experts, None, "", None).double()
    if mesh is not None:
        ranks, index = mesh["ep"].size(), mesh["ep"].get_local_rank()
        kept = {k: v for k, v in model.experts.items() if int(k) % ranks == index}
        model.experts = nn.ModuleDict(kept)
    return model


def build_hooked(mesh=None, capacity_factor: float | None = None) -> nn.Module:
    """The model for a plain step, whose caller runs the backward and the optimizer's step: on W
    ranks each parameter reduces its own gradient as soon as it is accumulated (a hook, the rule
    of `reduce_gradients`), since no code of the step runs after the backward."""
    model = build(mesh, capacity_factor=capacity_factor)
    if mesh is None:
        return model
    world, dp = dist.get_world_size(), mesh["dp"]

    def reduced(group):
        def hook(p: torch.Tensor) -> None:
            dist.all_reduce(p.grad, group=group)
            p.grad /= world

        return hook

    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(
            reduced(dp.get_group() if name.startswith("experts.") else None)
        )
    return model


def step(model: nn.Module, batch) -> torch.Tensor:
    """A plain step's loss: the mean squared error plus the model's ``aux_weight`` × its
    load-balancing loss."""
    x, y = batch
    prediction, balance = model(x)
    return F.mse_loss(prediction, y) + model.aux_weight * balance
