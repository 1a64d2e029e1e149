"""Table (docs/checking.md §10 "Expert parallelism"): expert-parallel code against one device,
measured without the check. The stand-in's top-1 mixture of experts (``tests/cases/moe_steps.py``:
4 experts, a load-balancing loss of weight 0.1, float64) takes one update's first gradient on
W real gloo ranks, each rank its experts of the ("dp", "ep") mesh and its rows of a global batch
of 32, and on one device with the whole batch. The ranks' gradients are joined by name (the first
holder's copy), and each part's against one device's: norm ratio, cosine, largest relative
difference. Also: the loss's difference, whether the copies of a parameter on several ranks
agree, whether a rank's initial weights are one device's, and the routing (the smallest gap
between a token's top two probabilities, the tokens a capacity keeps).

For each flag of the stand-in (the correct code, a capacity factor of 1, and each departure) at
(W, E) ∈ {(2, 2), (4, 2), (4, 4)}. Writes ``figures/expert_parallel_stand_in.{csv,md}``.

Usage: ``python experiments/expert_parallel_stand_in.py``
"""

from __future__ import annotations

import sys

import pandas as pd
import torch
import torch.nn.functional as F
from _sweep import FIGURES, REPO

sys.path.insert(0, str(REPO / "tests" / "cases"))  # the stand-in, imported by name on every rank

import moe_steps

from gatherlab.core import runfiles
from gatherlab.ranks import pool as pools

GLOBAL_BATCH = 32
LAYOUTS = ((2, 2), (4, 2), (4, 4))
PARTS = ("embed", "router", "experts", "head")
CASES = {
    "correct": {},
    "correct, capacity factor 1": {"capacity_factor": 1.0},
    "every parameter averaged over all ranks": {"bug": "world_mean"},
    "experts averaged over their replicas": {"bug": "replica_mean"},
    "the model in DDP": {"bug": "ddp"},
    "load-balancing loss over the rank's tokens": {"bug": "local_aux"},
    "capacity per rank (factor 1)": {"bug": "local_capacity", "capacity_factor": 1.0},
    "replicated parameters not reduced": {"bug": "replicated_unreduced"},
    "experts not summed over their replicas": {"bug": "replicas_unreduced"},
}  # fmt: skip


def _rows(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    data = moe_steps.Tokens()
    return data.x[rows], data.y[rows]


def _update(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """One update's loss and gradient, reduced as the stand-in's update reduces it."""
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    prediction, balance = model(x)
    loss = F.mse_loss(prediction, y) + inner.aux_weight * balance
    loss.backward()
    moe_steps.reduce_gradients(model)
    return float(loss.detach())


def _on_rank(experts_parallel: int, kwargs: dict) -> tuple[float, dict, dict]:
    """On each rank: its loss, and its gradient and initial weights by one device's names."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    shape = (world // experts_parallel, experts_parallel)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "ep"))
    torch.manual_seed(0)
    model = moe_steps.build(mesh=mesh, **kwargs)
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    initial = {n: p.detach().clone() for n, p in inner.named_parameters()}
    rows = GLOBAL_BATCH // world
    loss = _update(model, *_rows(slice(rank * rows, (rank + 1) * rows)))
    return loss, {n: p.grad.clone() for n, p in inner.named_parameters()}, initial


def _compared(mine: torch.Tensor, one: torch.Tensor) -> tuple[float, float, float]:
    ratio = float(mine.norm() / one.norm())
    cosine = float(F.cosine_similarity(mine, one, dim=0))
    return ratio, cosine, float((mine - one).abs().max() / one.abs().max())


def measure() -> pd.DataFrame:
    """One row per case, layout and part (``all`` first)."""
    found = []
    for case, kwargs in CASES.items():
        one_kwargs = {**kwargs, "bug": "" if kwargs.get("bug") == "ddp" else kwargs.get("bug", "")}
        torch.manual_seed(0)
        plain = moe_steps.build(**one_kwargs)
        x, y = _rows(slice(0, GLOBAL_BATCH))
        with torch.no_grad():
            probs = torch.softmax(plain.router(plain.embed(x)), dim=-1)
            top = probs.topk(2, dim=-1).values
            kept = int(plain._kept(probs.argmax(dim=-1)).sum())
        one_loss = _update(plain, x, y)
        one = {n: p.grad for n, p in plain.named_parameters()}
        first = {n: p.detach() for n, p in plain.named_parameters()}
        for world_size, experts_parallel in LAYOUTS:
            ranks = pools.pool(world_size).run(_on_rank, experts_parallel, kwargs)
            joined, apart, moved = {}, set(), set()
            for _loss, gradient, initial in ranks:
                for name, value in gradient.items():
                    if name in joined and (joined[name] - value).abs().max() > 1e-12:
                        apart.add(name.rsplit(".", 2)[0])
                    joined.setdefault(name, value)
                    if (initial[name] - first[name]).abs().max() > 0:
                        moved.add(name.rsplit(".", 2)[0])
            loss_difference = sum(r[0] for r in ranks) / world_size - one_loss
            for part in ("all", *PARTS):
                names = [n for n in one if part == "all" or n.startswith(f"{part}.")]
                numbers = _compared(torch.cat([joined[n].reshape(-1) for n in names]),
                                    torch.cat([one[n].reshape(-1) for n in names]))  # fmt: skip
                found.append({
                    "case": case, "world_size": world_size, "expert_parallel": experts_parallel,
                    "part": part, "loss_difference": loss_difference,
                    "norm_ratio": numbers[0], "cosine": numbers[1], "max_rel_err": numbers[2],
                    "copies_apart": ";".join(sorted(apart)),
                    "initial_weights_moved": ";".join(sorted(moved)),
                    "smallest_top_two_gap": float((top[:, 0] - top[:, 1]).min()),
                    "tokens_kept": f"{kept}/{GLOBAL_BATCH}",
                })  # fmt: skip
    return pd.DataFrame(found)


def table(results: pd.DataFrame) -> str:
    """The Markdown table: each case and layout, its loss difference and each part's numbers."""
    header = ["case", "W", "E", "Δloss", *(f"{p}: ratio, cosine" for p in ("all", *PARTS)),
              "copies apart", "initial weights moved"]  # fmt: skip
    lines = []
    for (case, w, e), rows in results.groupby(["case", "world_size", "expert_parallel"],
                                              sort=False):  # fmt: skip
        by_part = rows.set_index("part")
        first = rows.iloc[0]
        lines.append([
            case, str(w), str(e), f"{first['loss_difference']:.2g}",
            *(f"{by_part.loc[p, 'norm_ratio']:.4g}, {by_part.loc[p, 'cosine']:.4g}"
              for p in ("all", *PARTS)),
            first["copies_apart"] or "—", first["initial_weights_moved"] or "—",
        ])  # fmt: skip
    return runfiles.markdown_table(header, lines)


def main() -> None:
    results = measure()
    FIGURES.mkdir(exist_ok=True)
    runfiles.write_table(results, FIGURES / "expert_parallel_stand_in.csv")
    first = results.iloc[0]
    text = (
        "# Expert parallelism against one device "
        "(`python experiments/expert_parallel_stand_in.py`)\n\n"
        "One update of `tests/cases/moe_steps.py` (float64, global batch "
        f"{GLOBAL_BATCH}); the smallest gap between a token's top two router probabilities "
        f"{first['smallest_top_two_gap']:.2g}; with a capacity factor of 1, "
        f"{results.loc[results['case'] == 'correct, capacity factor 1', 'tokens_kept'].iloc[0]} "
        "tokens kept.\n\n" + table(results) + "\n"
    )
    (FIGURES / "expert_parallel_stand_in.md").write_text(text)
    print(text)
    pools.close_pools()


if __name__ == "__main__":
    main()
