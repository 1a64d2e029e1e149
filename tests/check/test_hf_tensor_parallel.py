"""Hugging Face's own tensor parallelism in the check of a plain step or update (issue 70,
docs/checking.md §10 "Tensor and sequence parallelism"): a tiny random Llama saved locally and
loaded with ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=T, ...))``
(examples/hf_tp_steps.py), its parameters DTensors where Llama's plan cuts them and plain
replicated tensors elsewhere, checked against the plain model on one device."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from gatherlab.check import CheckError, check_training
from gatherlab.ranks import pool as pools
from gatherlab.ranks import world

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("transformers") is None,
        reason="needs the hf extra: pip install 'gatherlab[hf]'",
    ),
]

STEP = {"step": "hf_tp_steps:causal_lm_step", "model": "hf_tp_steps:build",
        "data": "hf_tp_steps:Tokens", "global_batch_size": 8, "tensor_parallel": 2}  # fmt: skip

# Llama's own plan in transformers 5.23 (its model.tp_plan), as torch places a Linear's weight
# (out, in): cut by columns is Shard(0), by rows Shard(1); the embedding cut by vocabulary rows
CUT = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 0, "up_proj": 0,
       "down_proj": 1, "lm_head": 0, "embed_tokens": 0}  # fmt: skip


def _whole(table):
    return table[(table["part"] == "all") & (table["removed"] == "none")]


def _first_gradient_on_rank(directory: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The first step's gradient of the Llama parallelized over this rank's mesh, each
    parameter's read whole (``DTensor.full_tensor``), on the first 8 rows (tp 2: every rank of
    the group holds them all); and each parameter's placements (``plain`` for a plain tensor)."""
    import hf_tp_steps
    from torch.distributed.tensor import DTensor

    model = hf_tp_steps.build(world.mesh(2), directory=directory).double()
    rows = torch.stack([hf_tp_steps.Tokens()[i] for i in range(8)])
    hf_tp_steps.causal_lm_step(model, rows).backward()
    placed = {name: str(list(p.placements)) if isinstance(p, DTensor) else "plain"
              for name, p in model.named_parameters()}  # fmt: skip
    return {name: world.whole(p.grad) for name, p in model.named_parameters()}, placed


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    import hf_tp_steps

    return hf_tp_steps.saved(str(tmp_path_factory.mktemp("hf-tp") / "llama"))


def test_the_parallelized_llamas_gradient_is_the_plain_models_to_rounding(checkpoint):
    # independent of the check's judge: the plain model's autograd here, the parallelized
    # model's on 2 ranks of the pool, read whole
    import hf_tp_steps

    plain = hf_tp_steps.build(directory=checkpoint).double()
    rows = torch.stack([hf_tp_steps.Tokens()[i] for i in range(8)])
    hf_tp_steps.causal_lm_step(plain, rows).backward()
    ranks = pools.pool(2).run(_first_gradient_on_rank, checkpoint)
    for rank, (gradients, placed) in enumerate(ranks):
        for name, p in plain.named_parameters():
            cut = CUT.get(name.split(".")[-2])
            assert placed[name] == ("plain" if cut is None else f"[Shard(dim={cut})]"), name
            scale = max(float(p.grad.abs().max()), 1.0)
            assert float((gradients[name] - p.grad).abs().max()) <= 1e-15 * scale, (rank, name)
    # the plain replicated parameters, the RMSNorms' weights, whole on every rank: a column-cut
    # linear sums its input's gradient over the group
    plain_ones = {name for name, kind in ranks[0][1].items() if kind == "plain"}
    assert plain_ones == {
        name for name, _ in plain.named_parameters() if name.endswith("norm.weight")
    }
    assert len(plain_ones) == 5


def test_a_transformers_tensor_parallel_llama_is_exact_at_tp_2_and_dp_2_by_tp_2(checkpoint):
    options = {**STEP, "model_kwargs": {"directory": checkpoint}}
    table = check_training(**options, world_sizes=(2, 4), steps=3).table
    whole = _whole(table)
    assert whole["verdict"].tolist() == ["exact", "exact"]
    assert whole["max_rel_err"].max() <= 1e-12
    assert whole["max_abs_param_diff"].max() <= 1e-12  # after 3 updates


def test_its_whole_update_with_the_auto_plan_is_exact_with_micro_batches(checkpoint):
    options = {**STEP, "update": "hf_tp_steps:causal_lm_update", "step": None,
               "model_kwargs": {"directory": checkpoint, "plan": "auto"}}  # fmt: skip
    table = check_training(**options, world_sizes=(2,), micro_batches=(1, 2), steps=2).table
    assert _whole(table)["verdict"].tolist() == ["exact", "exact"]


def test_a_factory_that_loads_it_plain_on_the_ranks_too_is_refused_in_one_line(checkpoint):
    # plain on the 1 × 1 mesh, as transformers' own is: built on the ranks, plain there too
    options = {**STEP, "model": "hf_tp_steps:build_plain",
               "model_kwargs": {"directory": checkpoint}}  # fmt: skip
    with pytest.raises(CheckError) as raised:
        check_training(**options, world_sizes=(2,))
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(
        "--model hf_tp_steps:build_plain was given a mesh and made no parameter a DTensor over "
        "mesh['tp']: it does not parallelize itself"
    )


Q_NORM = "model.layers.0.self_attn.q_norm.weight"


def _accumulated_q_norm_gradient_on_rank(directory: str) -> torch.Tensor:
    """Qwen3's first q_norm's gradient on this rank (tp 2) after two micro-batches of the first
    8 rows, each loss divided by 2, as `hf_tp_steps.causal_lm_update` accumulates them."""
    import hf_tp_steps

    model = hf_tp_steps.build(world.mesh(2), directory=directory, family="qwen3").double()
    rows = torch.stack([hf_tp_steps.Tokens()[i] for i in range(8)])
    for micro_batch in rows.chunk(2):
        (hf_tp_steps.causal_lm_step(model, micro_batch) / 2).backward()
    return dict(model.named_parameters())[Q_NORM].grad.clone()


def test_transformers_sums_a_per_head_norms_gradient_again_at_each_micro_batch(tmp_path):
    # transformers 5.23 itself: Qwen3's q_norm and k_norm, replicated, see the rank's heads only;
    # its plan all-reduces their gradient in a hook after each backward that accumulates into
    # it, so K micro-batches sum the earlier ones' share again (fails when transformers fixes it)
    import hf_tp_steps

    directory = hf_tp_steps.saved(str(tmp_path / "qwen3"), family="qwen3")
    options = {**STEP, "update": "hf_tp_steps:causal_lm_update", "step": None,
               "model_kwargs": {"directory": directory, "family": "qwen3"}}  # fmt: skip
    table = check_training(**options, world_sizes=(2,), micro_batches=(1, 2), steps=2).table
    kept = table[table["removed"] == "none"].set_index(["micro_batches", "part"])
    assert kept.loc[(1, "all"), "verdict"] == "exact"
    assert (kept.loc[(2, "all"), "verdict"], kept.loc[(2, "model"), "gradient"]) == ("biased",) * 2
    assert kept.loc[(2, "lm_head"), "gradient"] == "exact"
    # independently: each micro-batch's gradient on one device, G1 and G2; the ranks hold
    # 2·G1 + G2 where one device's update holds G1 + G2
    ranks = pools.pool(2).run(_accumulated_q_norm_gradient_on_rank, directory)
    rows = torch.stack([hf_tp_steps.Tokens()[i] for i in range(8)])
    shares = []
    for micro_batch in rows.chunk(2):
        plain = hf_tp_steps.build(directory=directory, family="qwen3").double()
        (hf_tp_steps.causal_lm_step(plain, micro_batch) / 2).backward()
        shares.append(dict(plain.named_parameters())[Q_NORM].grad)
    first, second = shares
    for gradient in ranks:
        scale = float((first + second).abs().max())
        assert float((gradient - (2 * first + second)).abs().max()) <= 1e-12 * scale
        assert float((gradient - (first + second)).abs().max()) >= 0.1 * scale
