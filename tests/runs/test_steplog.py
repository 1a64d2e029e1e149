"""The one record of a run's steps (gatherlab.runs.steplog, docs/design.md §4): the global loss as
the mean over ranks, computed one way in the calling process and inside the ranks, and what the
recorder keeps of a step."""

from __future__ import annotations

import logging
import math
import re

import pytest
import ranks
import torch
from torch import nn

from gatherlab.ranks import pool as pools
from gatherlab.ranks import world
from gatherlab.runs.steplog import NonFiniteLoss, StepLog, mean_over_ranks


def test_the_global_loss_is_the_correctly_rounded_mean_over_ranks():
    assert mean_over_ranks([[1.0, 2.0], [3.0, 5.0]]) == [2.0, 3.5]
    # 1e16 + 1 rounds to 1e16 in float64: summed left to right these four give 1/4, the exact
    # sum is 2, so the mean is 1/2.
    assert mean_over_ranks([[1e16], [1.0], [-1e16], [1.0]]) == [0.5]


def test_the_ranks_compute_the_same_mean_after_one_all_gather():
    # Rank 0's local losses [1e16, 3, 0.25], rank 1's [1, 5, 0.5]: (1e16 + 1) / 2 is 5e15 + 0.5,
    # which float64 holds exactly; 4 and 0.375 exactly too. Both ranks return all three.
    expected = [5e15 + 0.5, 4.0, 0.375]
    assert pools.pool(2).run(ranks.global_losses_of_rank) == [expected, expected]


def test_the_recorder_keeps_the_first_gradient_with_zeros_where_none_arrived():
    model = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 1, bias=False)).double()
    recorder = StepLog(keep_first_gradient=True)
    for step in range(2):
        model.zero_grad()
        loss = model[0](torch.ones(1, 2, dtype=torch.float64)).sum() * (step + 1)  # layer 1 unused
        recorder.loss(loss, step, rank=0)
        loss.backward()
        recorder.gradient(model.parameters(), step, rank=0)
    recorder.finish(model.parameters())
    trained = recorder.trained()
    # d(sum W x)/dW = 1 for each of layer 0's four weights at step 0, nothing for layer 1's two
    assert trained.first_gradient.tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    assert recorder.grad_norms == [2.0, 4.0]  # ‖(1,1,1,1)‖ and ‖(2,2,2,2)‖
    expected = float(model[0].weight.detach().sum())
    assert trained.losses == pytest.approx([expected, 2 * expected], abs=0)
    with pytest.raises(NonFiniteLoss, match=r"^the loss is nan at step 2 \(rank 1\)$"):
        recorder.loss(torch.tensor(float("nan")), 2, rank=1)


def _steps_of(recorder: StepLog, steps: int, rank: int = 0) -> None:
    model = nn.Linear(2, 1).double()
    for step in range(steps):
        model.zero_grad()
        loss = model(torch.ones(1, 2, dtype=torch.float64)).sum()
        recorder.loss(loss, step, rank)
        loss.backward()
        recorder.gradient(model.parameters(), step, rank)


def test_a_step_over_its_budget_is_one_line_with_the_steps_done_and_to_go(caplog, monkeypatch):
    logger = logging.getLogger("gatherlab.runs.steplog")
    # a logging.config.dictConfig elsewhere in the test session (its default disables the loggers
    # that exist then) must not hide what the recorder says
    monkeypatch.setattr(logger, "disabled", False)
    caplog.set_level(logging.WARNING, logger="gatherlab.runs.steplog")
    _steps_of(StepLog(step_budget_s=1e-12, steps=3), 3)  # every step takes longer than 1e-12 s
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 3
    for step, line in enumerate(lines):
        left = 3 - step - 1
        pattern = (rf"^one device: step {step} took \d+\.\d s, over the step budget of 1e-12 s; "
                   rf"{step + 1} done, {left} to go$")  # fmt: skip
        assert re.match(pattern, line), line
    caplog.clear()
    with world.alone():  # the check's second reference: one device in a one-rank group
        _steps_of(StepLog(step_budget_s=1e-12, steps=1), 1)
    grouped = caplog.records[0].getMessage()
    assert re.match(r"^one device in a one-rank group: step 0 took \d+\.\d s, over the step "
                    r"budget of 1e-12 s; 1 done, 0 to go$", grouped)  # fmt: skip
    caplog.clear()
    _steps_of(StepLog(step_budget_s=math.inf, steps=3), 3)  # the default: no budget
    _steps_of(StepLog(step_budget_s=1e-12, steps=3), 3, rank=1)  # rank 0 alone says it
    assert caplog.records == []
