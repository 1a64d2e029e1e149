"""The diagnosis's advice to name a loss attribute (``--loss-attr``) is given for a LightningModule
whose culprit is its loss, and not for a plain step, which has no module to name it of."""

from __future__ import annotations

import pytest

from gatherlab import check

pytestmark = pytest.mark.slow

ADVICE = "Name the module's loss attribute (--loss-attr) to check the loss alone."


def test_a_step_whose_culprit_is_its_loss_gets_no_loss_attribute_advice():
    table = check.check_training(
        step="test_diagnosis:no_grad_negatives_step", model="plain_steps:build_model",
        data="plain_steps:Pairs", world_sizes=(2,), steps=2, global_batch_size=16,
    )  # fmt: skip
    assert set(table["culprits"]) == {"loss"}
    text = check.explain_training(table)
    assert "loss, W = 2:" in text  # the culprit is explained
    assert "--loss-attr" not in text, text


def test_a_module_whose_culprit_is_its_loss_is_told_to_name_its_loss_attribute():
    table = check.check_training(
        "ssl_modules:SimCLRPre1531", "ssl_modules:GaussianPairs", (2,), steps=2,
        global_batch_size=16, data_kwargs={"size": 64},
    )  # fmt: skip
    assert set(table["culprits"]) == {"loss"}
    text = check.explain_training(table)
    assert "loss, W = 2:" in text
    assert text.count(ADVICE) == 1, text
