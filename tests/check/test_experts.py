"""Expert parallelism in the check of a whole update (issue 70, docs/checking.md §10 "Expert
parallelism"): a mixture-of-experts model written as users write it on ``all_to_all_single``
(tests/cases/moe_steps.py), each rank its experts of the ("dp", "ep") mesh it is given, checked
against the plain model on one device, and each way such code departs named."""

from __future__ import annotations

import re

import moe_steps
import pytest
import torch
import torch.nn.functional as F

from gatherlab.check import CheckError, check_training, explain_training

UPDATE = {"update": "moe_steps:update", "model": "moe_steps:build", "data": "moe_steps:Tokens",
          "global_batch_size": 16, "expert_parallel": 2, "steps": 2}  # fmt: skip


def _whole(table):
    return table[(table["part"] == "all") & (table["removed"] == "none")]


def _part(table, world_size: int, part: str):
    rows = table[(table["world_size"] == world_size) & (table["part"] == part)]
    return rows[rows["removed"] == "none"].iloc[0]


def _one_device(
    rows: slice, bug: str = "", capacity_factor: float | None = None, aux_weight: float = 0.1
):
    """One device's first loss and gradient (by name) of the plain model on ``rows`` of the first
    global batch, computed here with torch's autograd: the check's data order (seed 0) is the
    sampler's, so the rows are read from it."""
    from gatherlab.components.data import GlobalBatchSampler

    data = moe_steps.Tokens()
    sampler = GlobalBatchSampler(num_samples=len(data), global_batch_size=16, num_batches=1)
    keys = next(iter(sampler))  # seed 0, shuffled: the check's first global batch
    x = torch.stack([data[key][0] for key in keys])[rows]
    y = torch.stack([data[key][1] for key in keys])[rows]
    torch.manual_seed(0)
    model = moe_steps.build(capacity_factor=capacity_factor, bug=bug)
    prediction, balance = model(x)
    loss = F.mse_loss(prediction, y) + aux_weight * balance
    loss.backward()
    return float(loss.detach()), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.slow
def test_a_mixture_of_experts_is_exact_at_ep_2_and_dp_2_by_ep_2():
    # the load-balancing loss and the capacity over the global batch (the counts and the
    # router's probabilities all-reduced, a token's place counted after the earlier ranks'), the
    # replicated parameters averaged over all ranks, each expert summed over its replicas ÷ W
    options = {**UPDATE, "model_kwargs": {"capacity_factor": 1.0}, "steps": 3}
    result = check_training(**options, world_sizes=(2, 4))
    whole = _whole(result.table)
    assert whole["verdict"].tolist() == ["exact", "exact"]
    assert whole["max_rel_err"].max() <= 1e-12  # measured 3.3e-16
    assert whole["max_abs_param_diff"].max() <= 1e-12  # after 3 updates
    assert set(result.table["part"]) == {"all", "embed", "router", "experts", "head"}
    # a plain step: the check runs its backward and step, each parameter's hook reduces it
    step = {**options, "update": None, "step": "moe_steps:step", "model": "moe_steps:build_hooked"}
    whole = _whole(check_training(**step, world_sizes=(2, 4)).table)
    assert whole["verdict"].tolist() == ["exact", "exact"]
    assert whole["max_rel_err"].max() <= 1e-12
    # the capacity drops tokens (19 of 32 kept at factor 1 in the measurement), so the global
    # count is what makes it exact: the same code counting per rank is not (below)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("options", "world_sizes", "cause"),
    [
        ({"model_kwargs": {"bug": "world_mean"}}, (2,), "experts_mixed"),
        ({"model_kwargs": {"bug": "ddp"}}, (2,), "experts_mixed"),
        ({"model_kwargs": {"bug": "replica_mean"}}, (2, 4), "experts_scaled"),
        ({"model_kwargs": {"bug": "local_aux"}}, (2,), "local_tokens"),
        ({"model_kwargs": {"bug": "local_capacity", "capacity_factor": 1.0, "aux_weight": 0}},
         (2,), "local_tokens"),
        ({"model_kwargs": {"bug": "replicated_unreduced"}}, (2, 4), "unreduced"),
        ({"model_kwargs": {"bug": "replicas_unreduced"}}, (4,), "copies_apart"),
        # a capacity per rank beside a global load-balancing loss: no one-device loss of the
        # ranks' rows reproduces it (each rank's rows alone count both per rank)
        ({"model_kwargs": {"bug": "local_capacity", "capacity_factor": 1.0}}, (2,), ""),
    ],
    ids=["world-mean", "ddp", "replica-mean", "local-aux", "local-capacity",
         "replicated-unreduced", "replicas-unreduced", "local-capacity-global-aux"],
)  # fmt: skip
def test_each_way_expert_parallel_code_departs_is_named(options, world_sizes, cause):
    result = check_training(**{**UPDATE, **options}, world_sizes=world_sizes)
    whole = _whole(result.table)
    assert whole["verdict"].map(lambda v: v != "exact").all()
    assert whole["cause"].fillna("").tolist() == [cause] * len(world_sizes)
    assert whole["culprits"].tolist() == [cause or "loss"] * len(world_sizes)
    assert not cause or f"({cause})" in explain_training(result)
    kwargs = options["model_kwargs"]
    bug, aux = kwargs["bug"], kwargs.get("aux_weight", 0.1)
    one_loss, one = _one_device(slice(0, 16), "" if bug == "ddp" else bug,
                                kwargs.get("capacity_factor"), aux)  # fmt: skip
    experts = torch.cat([one[n].reshape(-1) for n in one if n.startswith("experts.")])
    if bug == "world_mean":
        # every parameter averaged over W = E = 2: rank 0's experts.0 gets one device's
        # gradient of experts.0 plus that of experts.2, rank 1's experts at the same places
        # (each rank's own is W times its share: its ep group sums its tokens' gradients)
        mixed = torch.cat([(one[n] + one[n.replace(f"experts.{e}", f"experts.{e + 2}")])
                           .reshape(-1) for e in (0, 1) for n in one
                           if n.startswith(f"experts.{e}.")] * 2)  # fmt: skip
        ratio = float(mixed.norm() / experts.norm())
        assert _part(result.table, 2, "experts")["norm_ratio"] == pytest.approx(ratio, rel=1e-12)
        assert _part(result.table, 2, "router")["verdict"] == "exact"
    if bug == "replica_mean":  # averaged over their W/E replicas: E = 2 times one device's
        for world_size in world_sizes:
            row = _part(result.table, world_size, "experts")
            assert row["norm_ratio"] == pytest.approx(2, rel=1e-12)
            assert row["cosine"] == pytest.approx(1, abs=1e-12)
        assert " = E times one device's" in whole["departs"].iloc[-1]
    if bug == "replicated_unreduced":  # all-reduced, the replicated parts: reproduced exact
        assert {found.parts for found in result.unreduced.values()} == {("embed", "router", "head")}
        assert {found.reduced for found in result.unreduced.values()} == {"exact"}
    if bug == "replicas_unreduced":  # each expert's two replicas (ranks 0 and 2) named
        assert (
            "experts.0.up.weight on rank 0 and experts.0.up.weight on rank 2"
            in (whole["departs"].iloc[0])
        )
    if cause == "local_tokens":
        # the run's first loss is the mean of one device's losses on each rank's rows alone
        local = sum(_one_device(rows, "", kwargs.get("capacity_factor"), aux)[0]
                    for rows in (slice(0, 8), slice(8, 16))) / 2  # fmt: skip
        assert whole["loss_diff"].iloc[0] == pytest.approx(abs(local - one_loss) / abs(one_loss),
                                                           rel=1e-9)  # fmt: skip


@pytest.mark.parametrize(
    ("options", "line"),
    [
        ({"world_sizes": (2, 6), "global_batch_size": 24, "expert_parallel": 4},
         "--expert-parallel 4 does not divide --world-sizes 2,6 (W = 2): a layout's mesh is "
         "W/E × E ranks; allowed: an E dividing every W (2)"),
        ({"expert_parallel": 1}, "--expert-parallel 1 is not allowed; allowed: an integer ≥ 2"),
        ({"model": "moe_steps:build_without_mesh"}, "--expert-parallel 2: --model "
         "moe_steps:build_without_mesh takes no mesh argument"),
        ({"model_kwargs": {"experts": 3}}, "--model moe_steps:build with a (dp, ep) mesh on 2 "
         "ranks: rank N: ValueError: 3 experts do not split evenly over 2 ep ranks"),
        ({"model": "moe_steps:build_strided", "world_sizes": (4,), "expert_parallel": 4},
         "--expert-parallel 4: rank 2 (ep rank 2 of 4) holds no expert: the model's 2 experts "
         "(experts.0, experts.1) are fewer than the 4 ranks of an ep group; allowed: an E of at "
         "most 2"),
        ({"model": "moe_steps:build_keeping_every_expert"}, "--model "
         "moe_steps:build_keeping_every_expert was given a mesh and every rank holds every "
         "parameter: it does not split its experts over mesh['ep']"),
    ],
    ids=["not-dividing", "degree-1", "no-mesh-argument", "factory-raises", "more-ranks",
         "no-split"],
)  # fmt: skip
def test_bad_expert_parallel_input_is_one_line_before_any_rank_trains(options, line):
    with pytest.raises(CheckError) as raised:
        check_training(**{**UPDATE, "world_sizes": (2,), **options})
    message = str(raised.value)
    assert "\n" not in message
    # the rank that raises first is named (either may)
    assert re.sub(r"ranks: rank \d", "ranks: rank N", message).startswith(line), message


def _held_recording(path, gradient, held):
    """A recording on disk of a model of a router (``router.w``, every rank's) and two experts
    (``experts.0.w`` on rank 0, ``experts.1.w`` on rank 1, where ``held`` says so), whose whole
    first gradient is ``gradient`` (a dict of each parameter's values)."""
    from gatherlab.recording.format import FULL, Recording, Update

    names = ["router.w", "experts.0.w", "experts.1.w"]
    (path / FULL).mkdir(parents=True)
    torch.save(torch.cat([gradient[n] for n in names]), path / FULL / "update_0.pt")
    header = {"world_size": len(held or [0]), "held": held, "full_updates": 1,
              "parameters": [{"name": n, "shape": [3], "part": n.split(".")[0],
                              "sharded": False} for n in names]}  # fmt: skip
    update = Update(0, [1.0], 1.0, [[]], {}, {}, {}, None)  # its first, whose gradient is kept
    return Recording(path, header, [update], {}, {})


def test_a_recordings_experts_w_times_one_devices_with_the_router_exact_are_experts_scaled(
    tmp_path,
):
    """A user's expert-parallel job that leaves its experts' gradients undivided by W (each
    rank's loss a mean over its own rows, the all-to-all's backward summing every rank's
    tokens): the router, every rank's, is one device's; the two experts, each a rank's, twice
    theirs. Its part ``moe`` mixes router and experts (norm ratio 1.96, ``biased``), and the
    comparison named a gather's causes; from the whole first gradients it is ``experts_scaled``,
    c = 2 = E. Experts at one device's with a router that departs, or a factor only on one
    expert, name nothing."""
    from gatherlab.check import recordings as comparer
    from gatherlab.check.table import Row

    one = {"router.w": torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64),
           "experts.0.w": torch.tensor([1.0, 0.25, -3.0], dtype=torch.float64),
           "experts.1.w": torch.tensor([-0.5, 4.0, 1.5], dtype=torch.float64)}  # fmt: skip
    held = [["router.w", "experts.0.w"], ["router.w", "experts.1.w"]]
    a = _held_recording(tmp_path / "a", one, None)
    rows = [Row("b", "native", 2, "a", verdict="biased", gradient="biased")]
    twice = {name: 2 * one[name] for name in ("experts.0.w", "experts.1.w")}
    cases = {
        "scaled": {**one, **twice},
        "router": {**one, "router.w": 1.5 * one["router.w"]},
        "one expert": {**one, "experts.0.w": twice["experts.0.w"]},
    }
    named = {name: comparer._experts_scaled(a, _held_recording(tmp_path / name, g, held), rows)[0]
             for name, g in cases.items()}  # fmt: skip
    assert named["scaled"].cause == "experts_scaled", named["scaled"]
    assert "is 2 = E times one device's" in named["scaled"].departs
    assert "(E = 2)" in named["scaled"].departs
    assert named["router"].cause == "" and named["one expert"].cause == ""
