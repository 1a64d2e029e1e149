"""Accumulation's causes reproduced on one device and its factors in words (issue 39): naive
accumulation's loss (`hypotheses.micro_negatives`) against losses computed here block by block, the
causes `hypotheses.cause` names with K micro-batches, and the diagnosis of each named factor
(docs/design.md §1, docs/checking.md §6). No ranks: one-device forwards on small tensors."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from gatherlab.check import diagnosis, hypotheses
from gatherlab.core import terms
from gatherlab.losses import NTXentLoss


def _views(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    view0 = torch.randn(rows, 8, generator=generator, dtype=torch.float64)
    return view0, view0 + 0.1 * torch.randn(rows, 8, generator=generator, dtype=torch.float64)


def _local_ntxent(view0: torch.Tensor, view1: torch.Tensor, rows: object = None) -> float:
    return float(NTXentLoss(gather=None)(view0, view1))


def test_micro_negatives_is_the_mean_of_each_micro_batchs_own_loss():
    """16 rows on W = 2 ranks × K = 2 micro-batches: four blocks of 4 rows, each its own loss."""
    view0, view1 = _views(16)
    blocks = [_local_ntxent(view0[4 * i : 4 * i + 4], view1[4 * i : 4 * i + 4]) for i in range(4)]
    value = hypotheses.micro_negatives(_local_ntxent, (view0, view1), 2, 2)
    assert value == pytest.approx(sum(blocks) / 4, rel=1e-12)
    # a different number from the whole batch's loss and from the ranks' halves (local_negatives)
    assert abs(value - _local_ntxent(view0, view1)) > 0.1
    assert abs(value - hypotheses.local_negatives(_local_ntxent, (view0, view1), 2)) > 0.01


def test_micro_negatives_splits_rank_r_micro_batch_k_as_rows_r_k_times_b():
    """The rows each micro-batch sees: block r·K + k of b = N/(W·K) contiguous rows."""
    view0 = torch.arange(12.0).reshape(12, 1)
    seen = []

    def forward(a: torch.Tensor, b: torch.Tensor, rows: slice) -> float:
        assert a[:, 0].tolist() == list(range(12))[rows]  # the rows it is told it holds
        seen.append(a[:, 0].tolist())
        return float(a.sum())

    value = hypotheses.micro_negatives(forward, (view0, 100 + view0), 2, 3)
    assert seen == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert value == sum(range(12)) / 6
    with pytest.raises(ValueError, match="does not split into 2 ranks × 4 micro-batches"):
        hypotheses.micro_negatives(forward, (view0, view0), 2, 4)


def test_cause_names_naive_accumulation_and_a_loss_not_divided_by_k():
    batches = [_views(16), _views(16, seed=1)]  # a cause must hold on both, as in the check
    references = [_local_ntxent(*batch) for batch in batches]
    naive = [hypotheses.micro_negatives(_local_ntxent, batch, 2, 2) for batch in batches]
    found = hypotheses.cause(naive, references, _local_ntxent, batches, 2, micro_batches=2)
    assert found == (terms.Cause.MICRO_NEGATIVES, None)
    # micro_batches=1 (today's callers): not tested, so nothing reproduces it
    assert hypotheses.cause(naive, references, _local_ntxent, batches, 2)[0] == "unexplained"
    # the ranks' halves alone are still local_negatives, tested first
    ranks = [hypotheses.local_negatives(_local_ntxent, batch, 2) for batch in batches]
    found = hypotheses.cause(ranks, references, _local_ntxent, batches, 2, micro_batches=2)
    assert found == (terms.Cause.LOCAL_NEGATIVES, None)
    # each of K = 4 micro-batches' losses undivided, summed: K times the loss
    summed = [4 * reference for reference in references]
    found = hypotheses.cause(summed, references, _local_ntxent, batches, 1, micro_batches=4)
    assert found == (terms.Cause.SCALED, pytest.approx(4.0, rel=1e-12))


def _rows(verdict: str, part: str = "all", gradient: str | None = None) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "world_size": [2], "part": [part], "verdict": [verdict], "cause": [""],
            "gradient": [gradient or verdict], "loss_diff": [0.0], "cosine": [1.0],
            "norm_ratio": [0.25], "max_rel_err": [0.75], "scale": [float("nan")], "error": [""],
        }
    )  # fmt: skip


@pytest.mark.parametrize("factor", list(terms.Factor))
def test_every_named_factor_has_its_words_with_what_it_does_per_optimizer(factor):
    text = diagnosis.diagnosis(_rows(factor))
    assert text.startswith(f"the gradient is {factor} times one device's (norm ratio 0.25")
    assert "SGD" in text and "Adam" in text and "Usual causes (not tested here)" in text
    assert "fix:" in text.lower()
    assert diagnosis.PART_MEANINGS[factor].startswith(f"a part at {factor}")


def test_parts_at_k_and_exact_say_what_each_optimizer_makes_of_them():
    """A learnt temperature accumulated once per micro-batch: K on its part, the model exact."""
    whole = _rows(terms.GradientClass.BIASED)
    whole["cause"] = str(terms.Cause.PARTS)
    parts = pd.concat(
        [
            _rows(terms.GradientClass.BIASED, "model", terms.GradientClass.EXACT),
            _rows(terms.GradientClass.BIASED, "loss.log_temperature", terms.Factor.K),
        ]
    )
    text = diagnosis.diagnosis(whole, parts)
    assert "model exact (norm ratio" in text and "loss.log_temperature K (norm ratio" in text
    assert diagnosis.PART_MEANINGS[terms.Factor.K] in text and diagnosis.PART_FACTORS in text
    # an accumulation's fix, not a gather's: nothing here goes through the ranks
    assert "divide the loss by K exactly once" in text and "gatherlab.gather.Fixed" not in text


def test_the_words_of_a_scaled_loss_and_of_naive_accumulation_say_what_k_is():
    scaled = diagnosis.CAUSES[terms.Cause.SCALED]
    assert "not divided by K (c = K) or divided by K twice (c = 1/K)" in scaled
    micro = diagnosis.CAUSES[terms.Cause.MICRO_NEGATIVES]
    assert "(r·K + k)-th block of N/(W·K) rows" in micro
    assert "the k-th micro-batch of every rank together" in micro  # a loss gathering each one
