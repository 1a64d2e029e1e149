"""Tensor and sequence parallelism in the check of a plain step or update (issue 62,
docs/checking.md §10 "Tensor and sequence parallelism"): a model its factory parallelizes with
``parallelize_module`` over the ``tp`` dimension of the mesh it is given (examples/tp_steps.py),
checked against the plain model on one device, and each way such code departs named with its
line."""

from __future__ import annotations

import inspect

import pytest
import torch
import tp_steps

from gatherlab.check import CheckError, check_training, explain_training, where
from gatherlab.core.terms import DepartureKind
from gatherlab.ranks import pool as pools
from gatherlab.ranks import world
from gatherlab.runs.tensorparallel import LayoutWatch

STEP = {"step": "tp_steps:cosine_step", "model": "tp_steps:build", "data": "tp_steps:Views",
        "global_batch_size": 8, "tensor_parallel": 2}  # fmt: skip


def _line(text: str) -> str:
    """``tp_steps.py:N`` of the first line of examples/tp_steps.py that holds ``text``."""
    lines = inspect.getsource(tp_steps).splitlines()
    return f"tp_steps.py:{next(i for i, line in enumerate(lines, 1) if text in line)}"


def _whole(table):
    return table[(table["part"] == "all") & (table["removed"] == "none")]


def _batch(rows: range) -> list[torch.Tensor]:
    data = tp_steps.Views()
    return [torch.stack([data[i][v] for i in rows]).double() for v in (0, 1)]


def _first_step(model: torch.nn.Module, batch) -> list:
    """The first step's backward, its first forward recorded (`LayoutWatch`)."""
    watch = LayoutWatch(model)
    with watch:
        loss = tp_steps.cosine_step(model, batch)
    seen, _ = watch.close()
    loss.backward()
    return seen


def _first_gradient_on_rank(options: dict) -> tuple[dict[str, torch.Tensor], list]:
    """The first step's gradient of the encoder parallelized over this rank's mesh, each
    parameter's read whole (``DTensor.full_tensor``), on this rank's rows of the first 8
    samples; and the record of its first forward."""
    torch.manual_seed(0)
    model = tp_steps.build(world.mesh(2), **options).double()
    group, groups = world.data_parallel(2)
    seen = _first_step(model, _batch(range(group * 8 // groups, (group + 1) * 8 // groups)))
    return {name: p.grad.full_tensor() for name, p in model.named_parameters()}, seen


# The encoder's correct forms: the MLP block alone, with attention, with q, k and v split into
# heads by a head count the factory sets to the rank's, and with the head's output kept a DTensor
# sharded on the sequence and read whole before its mean.
CORRECT = {"mlp": {"attention": False}, "attention": {}, "rank-heads": {"head_view": "count"},
           "whole-pool": {"pool": "whole"}}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("options", CORRECT.values(), ids=CORRECT.keys())
def test_the_parallelized_encoders_gradient_is_the_plain_models_to_rounding(world_size, options):
    # independent of the check's judge: the plain model's autograd on the whole batch here, the
    # parallelized model's on tp (W = 2) and dp 2 × tp 2 (W = 4, FSDP2 over dp) ranks
    torch.manual_seed(0)
    plain = tp_steps.build(**options).double()
    one = _first_step(plain, _batch(range(8)))
    ranks = pools.pool(world_size).run(_first_gradient_on_rank, options)
    for name, p in plain.named_parameters():
        # FSDP2 averages over its dp groups, each of whose loss is its rows' mean: one device's
        assert (ranks[0][0][name] - p.grad).abs().max() <= 1e-15 * max(p.grad.abs().max(), 1), name
        assert torch.equal(ranks[0][0][name], ranks[-1][0][name])
    # and every result of the first forward on every rank is one device's or its shard: the
    # operations of the user's code, none of DTensor's or FSDP2's own, each paired with one
    # device's, each compared but a RowwiseParallel's partial sums (its output hook reduces them)
    ones = [seen.op for seen in one if seen.op is not None]
    compared = []
    for rank, (_, seen) in enumerate(ranks):
        mine = [s.op for s in seen if s.op is not None]
        assert [(op.name, op.where) for op in mine] == [(op.name, op.where) for op in ones]
        pairs = [
            (op, theirs) for op, theirs in zip(ones, mine, strict=True) if op.value is not None
        ]
        assert {theirs.short for _, theirs in pairs if theirs.value is None} == {"linear"}
        group, index = divmod(rank, 2)
        compared += [where.as_shard(op.value, theirs.value, group, world_size // 2, index, 2)
                     for op, theirs in pairs if theirs.value is not None]  # fmt: skip
    assert len(compared) >= 6 * world_size and all(c is not None for c in compared)
    assert max(c.difference for c in compared) <= 1e-15  # measured 4.4e-16 (2.3e-16 the MLP's)
    departure = where.layout_departure(one, [seen for _, seen in ranks], world_size // 2, 2)
    assert departure.kind == DepartureKind.NONE


@pytest.mark.slow
def test_a_tensor_and_sequence_parallel_encoder_is_exact_at_tp_2_and_dp_2_by_tp_2():
    table = check_training(**STEP, world_sizes=(2, 4), steps=3).table
    whole = _whole(table)
    assert whole["verdict"].tolist() == ["exact", "exact"]
    assert whole["max_rel_err"].max() <= 1e-12
    assert whole["max_abs_param_diff"].max() <= 1e-12  # after 3 updates


@pytest.mark.slow
def test_a_tensor_parallel_whole_update_is_exact_with_micro_batches():
    options = {**STEP, "update": "tp_steps:cosine_update", "step": None}
    table = check_training(**options, world_sizes=(2,), micro_batches=(1, 2), steps=2).table
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
         "dropout", "return self.drop(pooled)", "  drop", "draws another mask on each rank"),
        # the identity on one device; on a rank, its 2 heads' features split as 4 heads over
        # half the sequence: the shapes of a sequence shard, not its values
        ({"model_kwargs": {"head_view": "count", "rank_heads": False}}, "shard_as_whole",
         "shard_as_whole", "t.view(batch, -1, self.heads, self.head_size)", "  view",
         "of shape (8, 4, 4, 2), is neither one device's result, of shape (8, 8, 4, 2), nor its "
         "shard: it differs from the nearest, one device's chunk 0 of 2 along dimension 1, by "
         "1.5 (max relative difference); its input holds the rank's shard of dimension 2 (4 of "
         "one device's 8)"),
        ({"model_kwargs": {"pool": "local"}}, "shard_as_whole", "shard_as_whole",
         "(y.to_local() if", "  mean", "it differs from the nearest, one device's whole, by 0.53 "
         "(max relative difference); a mean over dim 1 of the rank's 4 entries, where one device "
         "takes all 8"),
    ],
    ids=["whole-sequence", "local-features", "partial-norm", "same-dropout", "per-rank-dropout",
         "model-heads", "local-pool"],
)  # fmt: skip
def test_each_way_tensor_parallel_code_departs_is_named_with_its_line(
    options, cause, culprit, line, op, words
):
    result = check_training(**{**STEP, **options}, world_sizes=(2,), steps=3)
    head = _whole(result.table).iloc[0]
    assert head["verdict"] != "exact"
    assert (head["cause"] if isinstance(head["cause"], str) else "") == cause
    assert head["culprits"] == culprit
    assert head["where"] == _line(line) + op
    assert words in head["departs"]
    if cause == "partial":  # the reproduction: the partial sums made whole, exact
        found = result.unreduced[2, 1]
        assert found.reduced == "exact" and found.over == "tp"
        assert found.partial == (
            "attention.norm.weight",
            "attention.norm.bias",
            "mlp.norm.weight",
            "mlp.norm.bias",
            "norm.weight",
            "norm.bias",
        )
        assert f"LocalSGD.step at {_line('def step(self, closure')}" in explain_training(result)


@pytest.mark.parametrize(
    ("options", "line"),
    [
        ({"world_sizes": (2, 6), "global_batch_size": 24, "tensor_parallel": 4},
         "--tensor-parallel 4 does not divide "
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


def test_a_vocabulary_parallel_embeddings_forward_is_recorded_without_redistributing_it():
    """The record of the first forward copied each result through DTensor's own operations: a
    vocabulary-parallel embedding's pending sum had its mask consumed there, the plan's own
    redistribution then failed with a bare AssertionError, and ``departs`` printed its page of
    traceback. Copied from its local tensor, the forward is read: a loss that depends on the
    rank, outside the model, is said to be outside its first forward."""
    table = check_training(
        step="vocab_parallel:rank_offset_step", model="vocab_parallel:build",
        data="vocab_parallel:Ids", world_sizes=(2,), tensor_parallel=2, steps=2,
        global_batch_size=8,
    ).table  # fmt: skip
    kept = _whole(table).iloc[0]
    assert kept["verdict"] == "loss differs", table.to_string()
    assert kept["departs"].startswith(
        "no line named: every module's input and the model's output have one device's shapes on "
        "the ranks, and every result of the first forward compared is one device's or its shard"
    ), kept["departs"]
