"""The verdicts that exit 0 (``exact``, ``loss scaled``: `gatherlab.TRAINS_LIKE_ONE_DEVICE`)
refused on cases built to just miss them (``tests/cases/near_misses.py``): a loss W times one
device's whose gradient is W times too, one whose value is one device's (or W times it) while a
term of value 0 gives rank 0 a gradient one device never has, a run equal to one device's except
at its last update (the loss check with ``steps`` and a plain ``--step``); and a world size that
fails first, in the middle or last, the others keeping their verdicts. Each refusal is asserted
where a user meets it: the table's verdict, `gatherlab.check.trains_like_one_device`, the
command line's exit status or `gatherlab.testing`'s assertions.

Every expected number follows from docs/design.md §1 (stated in ``near_misses``): a gradient W·∇L
has cosine 1, norm ratio W and max. relative error W − 1; a global loss W·L has scale W and
relative difference W − 1; a term's gradient ε·v changes the max. relative error linearly in ε; a
constant ``offset`` added by rank 0 moves the global loss (the mean over ranks) by offset/W."""

from __future__ import annotations

import re

import near_misses
import pandas as pd
import pytest

from gatherlab import check
from gatherlab.check.__main__ import main
from gatherlab.check.table import TRAINS_LIKE_ONE_DEVICE
from gatherlab.testing import assert_layout_invariant, assert_training_invariant

pytestmark = pytest.mark.slow

W = (2, 4)
RATIO = 1e-10  # float64 rounding of a few hundred terms (docs/design.md §2)
LR = 0.01  # the plain step's and the loss check's SGD (gatherlab.check.defaults)
ROWS = 16  # the loss check's global batch, and the one the plain step is checked with here


def whole(table: pd.DataFrame) -> pd.DataFrame:
    return table[table["part"] == "all"].set_index("world_size")


def exit_status(arguments: list[str], tmp_path) -> int:
    with pytest.raises(SystemExit) as ended:
        main([*arguments, "--out", str(tmp_path / "check")])
    return ended.value.code


def test_a_loss_w_times_one_devices_with_a_gradient_w_times_too_is_not_loss_scaled(tmp_path):
    result = check.check_loss(near_misses.ScaledOverSummingGather, W)
    rows = whole(result.table)
    assert list(rows["forward"]) == ["differs", "differs"]
    assert list(rows["gradient"]) == ["W", "W"]
    assert list(rows["verdict"]) == ["loss differs", "loss differs"]
    assert list(rows["cause"]) == ["scaled", "scaled"]
    for size in W:
        assert rows.loc[size, "scale"] == pytest.approx(size, rel=RATIO)
        assert rows.loc[size, "loss_diff"] == pytest.approx(size - 1, rel=RATIO)
        assert rows.loc[size, "norm_ratio"] == pytest.approx(size, rel=RATIO)
        assert rows.loc[size, "cosine"] == pytest.approx(1, abs=1e-12)
        assert rows.loc[size, "max_rel_err"] == pytest.approx(size - 1, rel=RATIO)
    assert not check.trains_like_one_device(result)
    with pytest.raises(AssertionError, match=r"W = 2, 4: loss differs \(scaled\)"):
        assert_layout_invariant(near_misses.ScaledOverSummingGather, W)
    assert exit_status(["near_misses:ScaledOverSummingGather"], tmp_path) == 1


def test_a_zero_valued_term_with_a_gradient_on_rank_zero_is_neither_exact_nor_loss_scaled():
    """The same term on L (forward ``same``) and on W·L with an exact gradient (forward scaled
    by W): ``biased`` and ``loss differs``, with the same gradient numbers, since the gradient is
    ∇L plus the term's in both. The term at weight 1e-7 changes the max. relative error 1e-7
    times as much, and is still refused."""
    plain_table = check.check_loss(near_misses.StrayGradientOnRankZero, W)
    plain = whole(plain_table.table)
    assert not check.trains_like_one_device(plain_table)
    assert list(plain["forward"]) == ["same", "same"] and (plain["loss_diff"] <= RATIO).all()
    assert list(plain["verdict"]) == ["biased", "biased"] and plain["scale"].isna().all()
    scaled_table = check.check_loss(near_misses.StrayGradientOnRankZero, W, scaled=True)
    scaled = whole(scaled_table.table)
    assert not check.trains_like_one_device(scaled_table)
    assert list(scaled["forward"]) == ["differs", "differs"]
    assert list(scaled["gradient"]) == ["biased", "biased"]
    assert list(scaled["verdict"]) == ["loss differs", "loss differs"]
    assert list(scaled["cause"]) == ["scaled", "scaled"]
    for size in W:
        assert scaled.loc[size, "scale"] == pytest.approx(size, rel=RATIO)
        assert plain.loc[size, "cosine"] < 1 - 1e-3  # a direction one device never has
        for number in ("cosine", "norm_ratio", "max_rel_err"):
            assert scaled.loc[size, number] == pytest.approx(plain.loc[size, number], rel=RATIO)
    small = check.check_loss(near_misses.StrayGradientOnRankZero, W, weight=1e-7).table
    rows = whole(small)
    for size in W:
        expected = 1e-7 * plain.loc[size, "max_rel_err"]
        assert rows.loc[size, "max_rel_err"] == pytest.approx(expected, rel=1e-6)
    assert not rows["verdict"].isin(TRAINS_LIKE_ONE_DEVICE).any(), rows["verdict"]
    with pytest.raises(AssertionError, match="W = 2, 4: biased"):
        assert_layout_invariant(near_misses.StrayGradientOnRankZero, W)


def test_a_loss_check_whose_run_leaves_one_device_only_at_its_last_update_diverges():
    """Every step's loss is one device's; the last update is not, and only the final weights
    show it: rank 0's extra gradient of 1 on each of its N/W rows of z0, averaged over W ranks,
    moves the last layer's bias by lr · (N/W) / W, at least the largest change. With
    2 steps the term never fires: exact (at W = 2). A constant added to rank 0's loss at the last
    step moves that step's global loss by offset/W: the curve's own departure (at W = 4)."""
    result = check.check_loss(near_misses.StrayGradientAtCall, W, steps=3)
    rows = whole(result.table)
    assert list(rows["gradient"]) == ["exact", "exact"]  # the first step is one device's
    assert list(rows["verdict"]) == ["diverges", "diverges"]
    assert (rows["train_max_abs_loss_diff"] <= RATIO).all()
    for size in W:
        departs = rows.loc[size, "departs"]
        words = re.fullmatch(
            r"every step's loss is one device's, the final weights are not \(max \|Δ\| (.+)\)",
            departs,
        )
        assert words, departs
        assert float(words[1]) >= LR * ROWS / size / size * (1 - 5e-3)  # 3 digits shown
    assert not check.trains_like_one_device(result)
    with pytest.raises(AssertionError, match="W = 2, 4: diverges"):
        assert_layout_invariant(near_misses.StrayGradientAtCall, W, steps=3)
    control = check.check_loss(near_misses.StrayGradientAtCall, (2,), steps=2).table
    assert list(control["verdict"]) == ["exact"]
    value = whole(check.check_loss(near_misses.StrayValueAtCall, (4,), steps=3).table)
    assert list(value["verdict"]) == ["diverges"]
    assert value.loc[4, "train_max_abs_loss_diff"] == pytest.approx(1e-6 / 4, rel=1e-6)
    assert value.loc[4, "departs"] == "step 2 is the first whose loss leaves one device's"


def test_a_plain_step_whose_run_leaves_one_device_only_at_its_last_update_diverges():
    arguments = {
        "step": "near_misses:stray_gradient_at_last_step", "model": "plain_steps:build_model",
        "data": "plain_steps:Pairs", "steps": near_misses.LAST_STEP + 1, "global_batch_size": ROWS,
    }  # fmt: skip
    result = check.check_training(world_sizes=W, **arguments)
    rows = whole(result.table[result.table["removed"] == "none"])
    assert list(rows["gradient"]) == ["exact", "exact"]
    assert list(rows["verdict"]) == ["diverges", "diverges"]
    assert rows["first_diff_step"].isna().all()  # no step's loss departs
    assert (rows["train_max_abs_loss_diff"] <= RATIO).all()
    for size in W:
        # the last layer's bias moves by lr · (N/W) / W (as in the loss check above): in this
        # model the largest change of any weight
        expected = LR * ROWS / size / size
        assert rows.loc[size, "max_abs_param_diff"] == pytest.approx(expected, rel=1e-9)
    assert not check.trains_like_one_device(result)
    with pytest.raises(AssertionError, match="W = 2, 4: diverges"):
        assert_training_invariant(world_sizes=W, **arguments)


@pytest.mark.parametrize("failing_at", [2, 4, 8], ids=["first", "middle", "last"])
def test_a_world_size_that_fails_first_in_the_middle_or_last_leaves_the_others_theirs(
    failing_at, tmp_path
):
    result = check.check_loss(near_misses.FailsAtWorldSize, (2, 4, 8), failing_at=failing_at)
    assert list(result.table["world_size"]) == [2, 4, 8]
    assert list(result.table["verdict"]) == [
        "failed" if size == failing_at else "exact" for size in (2, 4, 8)
    ]
    assert list(result.table["error"]) == [
        f"rank {size - 1}: ValueError: fails at world size {size}" if size == failing_at else ""
        for size in (2, 4, 8)
    ]
    assert not check.trains_like_one_device(result)
    text = " ".join(check.explain(result).split())
    assert (
        f"FailsAtWorldSize, W = {failing_at}: failed The ranks failed (W = {failing_at}: rank "
        f"{failing_at - 1}: ValueError: fails at world size {failing_at})"
    ) in text
    if failing_at == 4:  # the command line's status (the same rule as trains_like_one_device)
        arguments = ["near_misses:FailsAtWorldSize", "--world-sizes", "2,4,8", "--kwargs",
                     '{"failing_at": 4}']  # fmt: skip
        assert exit_status(arguments, tmp_path) == 1
