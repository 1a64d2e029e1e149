"""Pipeline parallelism in the check of a whole update (issue 70, docs/checking.md §10 "Pipeline
parallelism"): a causal language model that keeps its stages of the ranks' ``(dp, pp)`` mesh and
runs a schedule of ``torch.distributed.pipelining`` (examples/pp_updates.py), checked against
the whole model on one device. What each must get follows from the mathematics:

- each micro-batch's mean over equal token counts, its gradients ÷ M (``scale_grads``), the tied
  copies' gradients summed over the pipeline and the replicas' averaged; or the sum over tokens
  ÷ the global count with ragged padding: exact at pp 2 and dp 2 × pp 2, under GPipe, 1F1B and
  interleaved 1F1B (two stages a rank), with stages cut by hand or by ``pipeline()``;
  independently of the judge, each rank's gradient of each parameter it holds is the plain
  model's autograd;
- ÷ M left out (or made twice): every gradient M (or 1/M) times one device's;
- a per-micro-batch mean over ragged padding: the first loss is the mean over the micro-batches
  of one device's loss of each alone (computed here directly);
- the replicas of a stage not averaged over ``dp``: its ranks' gradients differ from the other
  pipeline's, and averaging them reproduces one device;
- the tied embedding and head not summed over the pipeline: their copies end apart, named with
  their ranks; the first holder's gradient is the embedding path's part of one device's
  (computed here by autograd on an untied copy of the plain model);
- the sum over tokens ÷ the global count, logged as the mean of the M micro-batches' losses:
  exact, its logged loss 1/M of one device's."""

from __future__ import annotations

import pytest
import torch
from pp_updates import IGNORE, Tokens, build, mean_token_loss

from gatherlab.check import CheckError, check_training, defaults, explain_training
from gatherlab.check.__main__ import _parser
from gatherlab.components.data import GlobalBatchSampler
from gatherlab.ranks import pool as pools

pytestmark = pytest.mark.slow

BATCH = 8
RUN = {"model": "pp_updates:build", "data": "pp_updates:Tokens", "global_batch_size": BATCH,
       "pipeline_parallel": 2, "steps": 2}  # fmt: skip
FLOAT64 = 1e-10  # docs/design.md §2's bound


def _whole(result) -> dict:
    """The rows of the whole gradient of the run without removals, (W, K) → row."""
    table = result.table
    kept = table[(table["removed"] == "none") & (table["part"] == "all")]
    return {(r["world_size"], r["micro_batches"]): r for r in kept.to_dict("records")}


def _part(result, part: str) -> dict:
    table = result.table
    return table[(table["removed"] == "none") & (table["part"] == part)].iloc[0].to_dict()


def _plain(tied: bool = True) -> torch.nn.Module:
    """One device's model, built as the check builds it (the seed, then float64)."""
    torch.manual_seed(defaults.SEED)
    model = build(tied=tied).double()
    return model


def _first_batch(ragged: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One device's first global batch, drawn as docs/design.md §2 draws it."""
    data = Tokens(ragged=ragged)
    sampler = GlobalBatchSampler(num_samples=len(data), global_batch_size=BATCH, num_batches=2,
                                 rank=0, world_size=1, seed=defaults.SEED, shuffle=True,
                                 with_epoch=True)  # fmt: skip
    rows = [data[i] for _, i in next(iter(sampler))]  # (epoch, index) keys
    return torch.stack([t for t, _ in rows]), torch.stack([y for _, y in rows])


# (the update, the factory's keywords, W, M, ragged padding): GPipe and 1F1B at pp 2 and dp 2 ×
# pp 2, interleaved 1F1B at pp 2 (4 stages on 2 ranks), the sum ÷ the global count and the traced
# stages at dp 2 × pp 2
EXACT = {
    "gpipe": ("mean_update", {}, (2, 4), (4,), False),
    "1f1b": ("mean_update", {"schedule": "1f1b"}, (2, 4), (2,), False),
    "interleaved": ("mean_update", {"schedule": "interleaved", "stages_per_rank": 2}, (2,),
                    (2, 4), False),
    "token-sum-ragged": ("token_sum_update", {}, (4,), (2,), True),
    # torch's tracing front end: pipeline() and build_stage, its stages' shapes those of a
    # micro-batch of 2 rows
    "traced": ("mean_update", {"traced_rows": 2}, (4,), (2,), False),
}  # fmt: skip


def test_a_correct_pipeline_is_exact_at_pp_2_and_dp_2_by_pp_2_under_each_schedule():
    for name, (update, model_kwargs, world_sizes, micro_batches, ragged) in EXACT.items():
        result = check_training(
            update=f"pp_updates:{update}", **RUN, world_sizes=world_sizes,
            micro_batches=micro_batches, model_kwargs=model_kwargs,
            data_kwargs={"ragged": ragged},
        )  # fmt: skip
        rows = _whole(result)
        assert sorted(rows) == [(w, k) for w in world_sizes for k in micro_batches], name
        for layout, row in rows.items():
            assert row["verdict"] == "exact", (name, layout, row)
            assert row["max_rel_err"] <= FLOAT64 and row["max_abs_param_diff"] <= FLOAT64
            assert row["train_max_abs_loss_diff"] <= FLOAT64


def _gradients_on_rank() -> dict[str, dict[str, torch.Tensor]]:
    """This rank's gradient of each parameter it holds after one schedule step of
    ``mean_update`` (SGD at lr 0: the step leaves them), under each schedule, K = 2, on the
    first global batch: independent of the check (its own mesh, no gatherlab)."""
    import pp_updates
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "pp"))
    found = {}
    for name, kwargs in {
        "gpipe": {},
        "1f1b": {"schedule": "1f1b"},
        "interleaved": {"schedule": "interleaved", "stages_per_rank": 2},
    }.items():
        torch.manual_seed(defaults.SEED)
        model = pp_updates.build(mesh, **kwargs).double()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        pp_updates.mean_update(model, optimizer, _first_batch(), 2)
        found[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
    return found


def test_each_rank_s_gradient_is_the_plain_model_s_autograd_under_each_schedule():
    plain = _plain()
    tokens, targets = _first_batch()
    mean_token_loss(plain(tokens), targets).backward()
    one = dict(plain.named_parameters(remove_duplicate=False))  # head.weight is emb.weight
    for schedule in ("gpipe", "1f1b", "interleaved"):
        held = [rank[schedule] for rank in pools.pool(2).run(_gradients_on_rank)]
        assert set(held[0]) | set(held[1]) == set(one), schedule
        assert {"emb.weight", "head.weight"} <= set(held[0]) | set(held[1])
        for rank in held:
            for name, grad in rank.items():
                reference = one[name].grad
                assert (grad - reference).abs().max() <= 1e-15 * reference.abs().max(), name


@pytest.mark.parametrize(
    ("update", "ragged", "factor", "ratio"),
    [("unscaled_update", False, "K", 4.0), ("token_sum_scaled_update", True, "1/K", 0.25)],
    ids=["scale-grads-off", "divided-twice"],
)  # fmt: skip
def test_the_micro_batch_scale_is_every_gradient_m_or_1_over_m_times_one_device_s(
    update, ragged, factor, ratio
):
    result = check_training(update=f"pp_updates:{update}", **RUN, world_sizes=(2, 4),
                            micro_batches=(4,), data_kwargs={"ragged": ragged})  # fmt: skip
    for layout, row in _whole(result).items():
        assert (row["verdict"], row["gradient"], row["cause"]) == (factor, factor, "micro_scale")
        assert row["norm_ratio"] == pytest.approx(ratio, rel=1e-12), layout
        assert row["cosine"] == pytest.approx(1.0, abs=1e-12)
        assert row["loss_diff"] <= FLOAT64  # the first loss is one device's
    assert "scale_grads=True" in explain_training(result)


def test_a_per_micro_batch_mean_over_ragged_tokens_is_reproduced_on_one_device():
    result = check_training(update="pp_updates:mean_update", **RUN, world_sizes=(2,),
                            micro_batches=(4,), data_kwargs={"ragged": True})  # fmt: skip
    row = _whole(result)[2, 4]
    assert (row["verdict"], row["cause"]) == ("loss differs", "micro_mean")
    plain, (tokens, targets) = _plain(), _first_batch(ragged=True)
    with torch.no_grad():
        one = float(mean_token_loss(plain(tokens), targets))
        means = [float(mean_token_loss(plain(t), y))
                 for t, y in zip(tokens.chunk(4), targets.chunk(4), strict=True)]  # fmt: skip
    assert (targets != IGNORE).reshape(4, -1).sum(1).unique().numel() > 1  # ragged counts
    pipeline = sum(means) / 4
    assert row["loss_diff"] == pytest.approx(abs(pipeline - one) / one, rel=1e-9)
    assert "reduction='sum' / the global count" in explain_training(result)


@pytest.mark.parametrize("model_kwargs", [{}, {"traced_rows": 4}], ids=["cut", "traced"])
def test_tied_copies_not_summed_over_the_pipeline_are_named_from_the_copies(model_kwargs):
    # pipeline() also leaves a copy of the head's weight on the first stage, which its graph does
    # not use: not one of the copies compared
    result = check_training(update="pp_updates:untied_update", **RUN, world_sizes=(2,),
                            micro_batches=(2,), model_kwargs=model_kwargs)  # fmt: skip
    row, emb = _whole(result)[2, 2], _part(result, "emb")
    assert (row["verdict"], row["cause"], row["culprits"]) == (
        "biased", "copies_apart", "copies_apart")  # fmt: skip
    assert row["departs"].startswith("emb.weight on rank 0 and head.weight on rank 1, copies of "
                                     "one device's emb.weight, whose weights at the run's end "
                                     "differ by ")  # fmt: skip
    assert row["loss_diff"] <= FLOAT64  # the first forward is one device's
    # rank 0's copy: the embedding's part of one device's gradient of the tied weight
    untied, (tokens, targets) = _plain(tied=False), _first_batch()
    untied.head.weight = torch.nn.Parameter(untied.emb.weight.detach().clone())
    mean_token_loss(untied(tokens), targets).backward()
    path, whole = untied.emb.weight.grad, untied.emb.weight.grad + untied.head.weight.grad
    assert emb["norm_ratio"] == pytest.approx(float(path.norm() / whole.norm()), rel=1e-10)
    assert _part(result, "layers")["gradient"] == "exact"
    words = " ".join(explain_training(result).split())  # its lines wrapped anywhere
    assert "dist.all_reduce(p.grad, group=mesh['pp'].get_group())" in words


def test_replicas_not_averaged_over_dp_are_unreduced_and_averaging_them_reproduces_one_device():
    result = check_training(update="pp_updates:unreplicated_update", **RUN, world_sizes=(4,),
                            micro_batches=(2,))  # fmt: skip
    row = _whole(result)[4, 2]
    assert (row["verdict"], row["cause"], row["culprits"]) == ("biased", "unreduced", "unreduced")
    found = result.unreduced[4, 2]
    assert found.parts == ("emb", "layers", "norm") and found.reduced == "exact"
    # the final copies, rank 0's pipeline against rank 2's (its dp replica), named too
    assert row["departs"].startswith("emb.weight on rank 0, head.weight on rank 1, emb.weight on "
                                     "rank 2 and head.weight on rank 3, copies of one device's "
                                     "emb.weight, whose weights at the run's end differ by "
                                     )  # fmt: skip


def test_a_logged_mean_of_micro_batch_parts_is_a_correct_run_whose_loss_is_1_over_m():
    result = check_training(update="pp_updates:token_sum_mean_logged_update", **RUN,
                            world_sizes=(2,), micro_batches=(4,),
                            data_kwargs={"ragged": True})  # fmt: skip
    row = _whole(result)[2, 4]
    assert (row["verdict"], row["gradient"]) == ("loss scaled", "exact")
    assert row["scale"] == pytest.approx(0.25, rel=1e-12)
    assert "a correct run; log their sum" in explain_training(result)


@pytest.mark.parametrize(
    ("options", "line"),
    [
        ({"world_sizes": (2, 3)}, "--pipeline-parallel 2 does not divide --world-sizes 2,3 (W = "
         "3): a layout's mesh is W/P × P ranks; allowed: a P dividing every W (none)"),
        ({"micro_batches": (3,)}, "--micro-batches 3 does not divide the 8 rows of a pipeline at "
         "W = 2 (--global-batch-size 8 over W/P = 1 pipelines, --pipeline-parallel 2); allowed: "
         "W/P × K dividing 8"),
        ({"update": None, "step": "pp_updates:mean_update", "micro_batches": (1,)},
         "--pipeline-parallel 2 with --step: "
         "a pipeline's schedule runs every micro-batch's forward and backward and the update "
         "steps once; allowed: --pipeline-parallel with --update"),
        ({"pipeline_parallel": 1}, "--pipeline-parallel 1 is not allowed; allowed: an integer ≥ "
         "2"),
        ({"model": "pp_updates:CausalLM"}, "--pipeline-parallel 2: --model pp_updates:CausalLM "
         "takes no mesh argument, so it cannot keep its stages of the ranks' mesh"),
        # found on the pipeline's ranks, before any rank trains
        ({"model_kwargs": {"keep": "nothing"}}, "--pipeline-parallel 2: --model pp_updates:build: "
         "rank 1 keeps no parameter (its stage is empty); allowed: a split that gives each rank "
         "of a pipeline a stage with parameters"),
        ({"model_kwargs": {"keep": "renamed"}}, "--pipeline-parallel 2: --model pp_updates:build: "
         "rank 0 holds module.emb.weight, which one device's model does not have; allowed: one "
         "device's names (emb.weight, layers.0.norm.weight,"),
        ({"model_kwargs": {"schedule": "1f1b"}, "micro_batches": (1, 2)}, "--pipeline-parallel 2 "
         "--micro-batches 1 at W = 2: Schedule1F1B refuses --model pp_updates:build's stages: "
         "ValueError: Number of microbatches (1) must be greater than or equal to the number of "
         "stages (2)."),
    ],
    ids=["p-not-dividing", "k-not-dividing", "a-step", "degree-1", "no-mesh", "empty-stage",
         "renamed", "schedule-refuses"],
)  # fmt: skip
def test_bad_pipeline_input_is_one_line_before_any_rank_trains(options, line):
    given = {"update": "pp_updates:mean_update", **RUN, "world_sizes": (2,),
             "micro_batches": (2,), **options}  # fmt: skip
    with pytest.raises(CheckError) as raised:
        check_training(**{k: v for k, v in given.items() if v is not None})
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(line)


def test_the_command_line_takes_the_pipeline_parallel_degree():
    parsed = _parser().parse_args(["--update", "pp_updates:mean_update", "--model",
                                   "pp_updates:build", "--data", "pp_updates:Tokens",
                                   "--pipeline-parallel", "2"])  # fmt: skip
    assert parsed.pipeline_parallel == 2
