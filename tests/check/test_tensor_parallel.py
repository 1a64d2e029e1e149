"""Tensor and sequence parallelism in the check of a plain step or update (issue 62,
docs/design.md §10 "Tensor and sequence parallelism"): a model its factory parallelizes with
``parallelize_module`` over the ``tp`` dimension of the mesh it is given (examples/tp_steps.py),
checked against the plain model on one device, and each way such code departs named with its
line."""

from __future__ import annotations

import inspect

import pytest
import torch
import tp_steps

from gatherlab.check import CheckError, check_training, explain_training
from gatherlab.ranks import pool as pools
from gatherlab.ranks import world

STEP = {"step": "tp_steps:cosine_step", "model": "tp_steps:build", "data": "tp_steps:Views",
        "global_batch_size": 8, "tensor_parallel": 2}  # fmt: skip


def _line(text: str) -> str:
    """``tp_steps.py:N`` of the first line of examples/tp_steps.py that holds ``text``."""
    lines = inspect.getsource(tp_steps).splitlines()
    return f"tp_steps.py:{next(i for i, line in enumerate(lines, 1) if text in line)}"


def _whole(table):
    return table[(table["part"] == "all") & (table["removed"] == "none")]


def _first_gradient_on_rank(attention: bool) -> dict[str, torch.Tensor]:
    """The first step's gradient of the encoder parallelized over this rank's mesh, each
    parameter's read whole (``DTensor.full_tensor``), on this rank's rows of the first 8
    samples."""
    torch.manual_seed(0)
    model = tp_steps.build(world.mesh(2), attention=attention).double()
    data = tp_steps.Views()
    group, groups = world.data_parallel(2)
    rows = [data[i] for i in range(group * 8 // groups, (group + 1) * 8 // groups)]
    batch = [torch.stack([r[v] for r in rows]).double() for v in (0, 1)]
    tp_steps.cosine_step(model, batch).backward()
    return {name: p.grad.full_tensor() for name, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("attention", [False, True], ids=["mlp", "attention"])
def test_the_parallelized_encoders_gradient_is_the_plain_models_to_rounding(world_size, attention):
    # independent of the check's judge: the plain model's autograd on the whole batch here, the
    # parallelized model's on tp (W = 2) and dp 2 × tp 2 (W = 4, FSDP2 over dp) ranks
    torch.manual_seed(0)
    plain = tp_steps.build(attention=attention).double()
    data = tp_steps.Views()
    batch = [torch.stack([data[i][v] for i in range(8)]).double() for v in (0, 1)]
    tp_steps.cosine_step(plain, batch).backward()
    ranks = pools.pool(world_size).run(_first_gradient_on_rank, attention)
    for name, p in plain.named_parameters():
        # FSDP2 averages over its dp groups, each of whose loss is its rows' mean: one device's
        assert (ranks[0][name] - p.grad).abs().max() <= 1e-15 * max(p.grad.abs().max(), 1), name
        assert torch.equal(ranks[0][name], ranks[-1][name])


@pytest.mark.slow
def test_a_tensor_and_sequence_parallel_encoder_is_exact_at_tp_2_and_dp_2_by_tp_2():
    table = check_training(**STEP, world_sizes=(2, 4), steps=3)
    whole = _whole(table)
    assert whole["verdict"].tolist() == ["exact", "exact"]
    assert whole["max_rel_err"].max() <= 1e-12
    assert whole["max_abs_param_diff"].max() <= 1e-12  # after 3 updates


@pytest.mark.slow
def test_a_tensor_parallel_whole_update_is_exact_with_micro_batches():
    options = {**STEP, "update": "tp_steps:cosine_update", "step": None}
    table = check_training(**options, world_sizes=(2,), micro_batches=(1, 2), steps=2)
    assert _whole(table)["verdict"].tolist() == ["exact", "exact"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("options", "cause", "culprit", "line", "op", "words"),
    [
        ({"model_kwargs": {"input_layout": "shard"}}, "layout", "layout",
         "z1, z2 = model(first)", "  attention.norm",
         "shape (8, 16, 8) where one device's is (8, 8, 8)"),
        ({"model_kwargs": {"local_features": True}}, "layout", "layout",
         "F.cosine_similarity(z1", "  cosine_similarity",
         "shape (8, 4) on each rank where one device's is (8, 8)"),
        ({"optimizer": "tp_steps:local_sgd"}, "partial", "partial",
         "def step(self, closure", "  LocalSGD.step", "a partial sum over tp"),
        ({"model_kwargs": {"dropout": 0.1}}, "", "dropout", "self.down(self.drop(", "  mlp.drop",
         "draws the same mask on every rank"),
        ({"model_kwargs": {"output_dropout": 0.1}, "step": "tp_steps:seeded_per_rank_step"}, "",
         "dropout", "return self.drop(self.head", "  drop", "draws another mask on each rank"),
    ],
    ids=["whole-sequence", "local-features", "partial-norm", "same-dropout", "per-rank-dropout"],
)  # fmt: skip
def test_each_way_tensor_parallel_code_departs_is_named_with_its_line(
    options, cause, culprit, line, op, words
):
    table = check_training(**{**STEP, **options}, world_sizes=(2,), steps=3)
    head = _whole(table).iloc[0]
    assert head["verdict"] != "exact"
    assert (head["cause"] if isinstance(head["cause"], str) else "") == cause
    assert head["culprits"] == culprit
    assert head["where"] == _line(line) + op
    assert words in head["departs"]
    if cause == "partial":  # the reproduction: the partial sums made whole, exact
        found = table.attrs["unreduced"]["2,1"]
        assert found.reduced == "exact" and found.over == "tp"
        assert found.partial == (
            "attention.norm.weight",
            "attention.norm.bias",
            "mlp.norm.weight",
            "mlp.norm.bias",
            "norm.weight",
            "norm.bias",
        )
        assert f"LocalSGD.step at {_line('def step(self, closure')}" in explain_training(table)


@pytest.mark.parametrize(
    ("options", "line"),
    [
        ({"world_sizes": (2, 6), "tensor_parallel": 4}, "--tensor-parallel 4 does not divide "
         "--world-sizes 2,6 (W = 2): a layout's mesh is W/T × T ranks; allowed: a T dividing every "
         "W (2)"),
        ({"model": "tp_steps:build_plain"}, "--tensor-parallel 2: --model tp_steps:build_plain "
         "takes no mesh argument, so it cannot parallelize itself"),
        ({"model": "tp_steps:build_misnamed"}, "--model tp_steps:build_misnamed: "
         "parallelize_module: Parallelize plan key 'fc1' could not be resolved: no submodule "
         "matching token 'fc1'; allowed: a plan whose keys name the model's modules (attention, "
         "attention.norm,"),
        ({"model": "tp_steps:build", "model_kwargs": {"features": 8}, "tensor_parallel": 1},
         "--tensor-parallel 1 is not allowed; allowed: an integer ≥ 2"),
        ({"model": "tp_steps:build_plain_with_mesh"}, "--model tp_steps:build_plain_with_mesh was "
         "given a mesh and made no parameter a DTensor over mesh['tp']: it does not parallelize "
         "itself"),
    ],
    ids=["mesh-not-dividing", "no-mesh-argument", "misnamed-plan", "degree-1", "no-dtensor"],
)  # fmt: skip
def test_bad_tensor_parallel_input_is_one_line_before_any_rank(options, line):
    with pytest.raises(CheckError) as raised:
        check_training(**{**STEP, "world_sizes": (2,), **options})
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(line)
