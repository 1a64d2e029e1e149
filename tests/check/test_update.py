"""The check of a whole optimizer update (``--update``, docs/checking.md §10) over W ranks × K
micro-batches, on the updates of ``examples/updates.py`` (written the way public training loops
accumulate), against one device with the whole batch and K = 1. What each must get follows from
the mathematics, not from a run:

- a feature cache (GradCache's scheme) computes the whole batch's loss and backpropagates its
  gradient through every micro-batch: exact at every (W, K), with a learnt temperature too;
- naive accumulation gives each micro-batch's loss only its own rows: its first loss is the mean
  of one device's loss on each micro-batch alone (computed here directly, to 1e-12);
- a cached loss divided by K has every gradient 1/K of one device's (norm ratio 1/K, cosine 1);
- a learnt temperature in a loss recomputed in each of K passes gets K times its gradient, the
  network's is exact;
- a per-sample mean loss accumulated with ÷K is exact;
- clipping before the step is what the optimizer takes: the measured gradient has the clipped
  norm."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import updates
from plain_steps import Pairs, build_model, nt_xent

from gatherlab import check
from gatherlab.check import api, training
from gatherlab.check.__main__ import main
from gatherlab.check.options import TrainingOptions
from gatherlab.runs import plainstep

pytestmark = pytest.mark.slow

BATCH = 16
RUN = {"steps": 2, "global_batch_size": BATCH, "data": "plain_steps:Pairs"}
FLOAT64 = 1e-10  # docs/design.md §2's bound


def checked(update: str, model: str = "plain_steps:build_model", **layout) -> dict:
    """The rows of the run without removals, ``part`` → (W, K) → row."""
    table = check.check_training(update=f"updates:{update}", model=model, **RUN, **layout).table
    kept = table[table["removed"] == "none"]
    return {
        part: {(r["world_size"], r["micro_batches"]): r for r in rows.to_dict("records")}
        for part, rows in kept.groupby("part")
    }


ALL_LAYOUTS = {"world_sizes": (1, 2, 4), "micro_batches": (1, 2, 4)}


@pytest.mark.parametrize("update", ["cached", "mean_squared"])
def test_a_feature_cache_and_a_per_sample_mean_are_exact_at_every_layout(update):
    rows = checked(update, **ALL_LAYOUTS)["all"]
    assert sorted(rows) == [(1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (4, 4)]
    for layout, row in rows.items():
        assert row["verdict"] == "exact", (layout, row)
        assert row["train_max_abs_loss_diff"] <= FLOAT64 and row["max_abs_param_diff"] <= FLOAT64


def test_a_feature_cache_with_a_learnt_temperature_counted_once_is_exact():
    """On one device: under DDP the temperature, used outside the model's forward (in the loss
    over the cached embeddings), stalls DDP's reducer, which then averages nothing (named in
    tests/check/test_sharded.py), so W = 1 here."""
    parts = checked("cached_learnt_temperature", "updates:build_with_temperature",
                    world_sizes=(1,), micro_batches=(1, 2, 4))  # fmt: skip
    for part in ("all", "net", "log_temperature"):
        for k in (2, 4):
            assert parts[part][1, k]["gradient"] == "exact", (part, k, parts[part][1, k])
    assert max(r["max_abs_param_diff"] for r in parts["all"].values()) <= FLOAT64


def test_naive_accumulation_is_the_mean_of_each_micro_batchs_own_loss():
    rows = checked("naive", world_sizes=(1, 2), micro_batches=(1, 2, 4))["all"]
    assert rows[2, 1]["verdict"] == "exact"  # one micro-batch: the gather makes it the whole batch
    for layout in [(1, 2), (1, 4), (2, 2), (2, 4)]:
        assert (rows[layout]["verdict"], rows[layout]["cause"]) == (
            "loss differs",
            "micro_negatives",
        )
    # the reproduced loss against one device's loss of each micro-batch's rows, computed here
    setting = api._training_setting(TrainingOptions(
        data="plain_steps:Pairs", model="plain_steps:build_model", steps=2,
        global_batch_size=BATCH, update="updates:naive",
    ))  # fmt: skip
    view0, view1 = plainstep.first_batch(Pairs(), setting.spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_model().double()

    def loss_of(rows: list[range]) -> float:
        index = torch.tensor([i for r in rows for i in r])
        z = model(torch.cat([view0[index], view1[index]]).double())
        return float(nt_xent(*z.chunk(2)))

    with torch.no_grad():
        # K = 4 on one device: four blocks of 4 rows; W = 2, K = 2: micro-batch j of both ranks
        one_device = sum(loss_of([range(4 * j, 4 * j + 4)]) for j in range(4)) / 4
        two_ranks = sum(loss_of([range(4 * j, 4 * j + 4), range(8 + 4 * j, 12 + 4 * j)])
                        for j in range(2)) / 2  # fmt: skip
    assert training.micro_negatives(setting, 1, 4, False)[0] == pytest.approx(one_device, rel=1e-12)
    assert training.micro_negatives(setting, 2, 2, False)[1] == pytest.approx(two_ranks, rel=1e-12)


def test_a_cached_loss_divided_by_k_is_named_by_its_factor_on_every_part():
    parts = checked("cached_divided", world_sizes=(1,), micro_batches=(1, 2, 4))
    for k in (2, 4):
        for part in ("0", "1"):  # the model's backbone and head
            row = parts[part][1, k]
            assert row["gradient"] == "1/K", row
            assert row["norm_ratio"] == pytest.approx(1 / k, rel=FLOAT64)


def test_a_temperature_counted_in_each_pass_is_k_times_and_the_network_exact():
    parts = checked("cached_temperature", "updates:build_with_temperature",
                    world_sizes=(1,), micro_batches=(1, 2, 4))  # fmt: skip
    for k in (2, 4):
        temperature, network = parts["log_temperature"][1, k], parts["net"][1, k]
        assert temperature["gradient"] == "K", temperature
        assert temperature["norm_ratio"] == pytest.approx(k, rel=FLOAT64)
        assert network["gradient"] == "exact", network
        assert (parts["all"][1, k]["gradient"], parts["all"][1, k]["cause"]) == ("biased", "parts")


def test_the_gradient_measured_is_the_one_the_step_takes_after_clipping():
    """torch's ``clip_grad_norm_`` multiplies a gradient of norm n > CLIP by CLIP / (n + 1e-6):
    the step hook sees the clipped norm CLIP·n/(n + 1e-6), n the unclipped update's norm."""
    options = TrainingOptions(data="plain_steps:Pairs", model="plain_steps:build_model", steps=1,
                              global_batch_size=BATCH, update="updates:cached")  # fmt: skip
    setting = api._training_setting(replace(options, update="updates:cached_clipped"))
    unclipped = api._training_setting(options)

    def first_norm(update, k: int) -> float:
        trained = update.train_on_rank(replace(setting.spec, micro_batches=k))
        return float(trained.first_gradient.norm())

    for k in (1, 2):
        n = first_norm(unclipped.update, k)
        assert n > updates.CLIP
        assert first_norm(setting.update, k) == pytest.approx(updates.CLIP * n / (n + 1e-6),
                                                              rel=1e-12)  # fmt: skip


@pytest.mark.parametrize("update, layout, words", [
    ("never_steps", "1,2", "never calls optimizer.step()"),
    ("steps_per_micro_batch", "1,2", "calls 2 times optimizer.step() with micro_batches=2"),
    ("steps_before_backward", "1", "called optimizer.step() before any backward"),
    ("cached", "1,3", "--micro-batches 3 does not divide the 8 rows of each of 2 ranks"),
])  # fmt: skip
def test_an_update_that_breaks_its_contract_is_one_line_exit_2(update, layout, words, capsys,
                                                                 tmp_path):  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        main(["--update", f"updates:{update}", "--model", "plain_steps:build_model", "--data",
              "plain_steps:Pairs", "--global-batch-size", str(BATCH), "--world-sizes", "2",
              "--micro-batches", layout, "--steps", "1",
              "--out", str(tmp_path / "out")])  # fmt: skip
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert not (tmp_path / "out").exists()
