"""A loss that takes more than the two views' embeddings (masks, a teacher's outputs by keyword,
prototypes held whole) is checked as it is written, from the command line and the Python API, with
no wrapper (docs/checking.md §6, "A loss's inputs"; issue 51): each rank is given its rows of every
tensor with a row per sample, the rest whole, and the one-device forwards of the hypotheses the rows
of the slice they compute."""

from __future__ import annotations

import inspect

import input_losses
import pandas as pd
import pytest
import torch
from bounds import FLOAT64_BOUND
from helpers import run_command

from gatherlab.check import check_loss
from gatherlab.components.factory import Inputs


def _line(function, text: str) -> str:
    """``input_losses.py:N``, N the line of ``function`` that holds ``text`` (found in the file)."""
    lines, first = inspect.getsourcelines(function)
    return f"input_losses.py:{first + next(i for i, line in enumerate(lines) if text in line)}"


def _keep(n: int = 16) -> torch.Tensor:
    torch.manual_seed(0)  # as the check makes them: its seed drawn
    return input_losses.kept_rows(n)[0]


def test_a_masked_loss_from_the_command_line_is_named_at_its_mean_over_the_ranks_kept_rows(
    tmp_path,
):
    """Each rank's mean over its own kept rows: the ranks keep different numbers of rows, so the
    mean of their means is not one device's mean; the mean is named."""
    result = run_command(
        "check", "input_losses:masked_nt_xent", "--inputs", "input_losses:kept_rows",
        "--world-sizes", "2", "--steps", "0", "--out", str(tmp_path / "out"),
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    table = pd.read_csv(tmp_path / "out" / "check.csv")
    assert table["verdict"].tolist() == ["loss differs"]
    line = _line(input_losses.masked_nt_xent, "mean")
    assert table["where"].str.split().str[0].tolist() == [line]
    keep = _keep()
    assert keep[:8].sum() != keep[8:].sum()  # the ranks keep different numbers of rows
    assert table["loss_diff"].iloc[0] > 1e-3


def test_the_same_loss_divided_by_every_ranks_kept_rows_is_exact_from_the_python_api():
    table = check_loss(
        input_losses.masked_nt_xent_counted, (2, 4), inputs=input_losses.kept_rows, steps=2
    ).table
    assert table["verdict"].tolist() == ["exact", "exact"]
    assert table["max_rel_err"].max() <= FLOAT64_BOUND
    assert table["train_max_abs_loss_diff"].max() <= FLOAT64_BOUND


@pytest.mark.parametrize(
    ("loss", "inputs"),
    [
        (input_losses.distilled, input_losses.teacher_outputs),  # a dict: by keyword
        (input_losses.assigned, input_losses.prototypes),  # 10 rows, not 16: whole to every rank
    ],
)
def test_keyword_inputs_and_inputs_held_whole_are_exact(loss, inputs):
    table = check_loss(loss, (2, 4), inputs=inputs, steps=0).table
    assert table["verdict"].tolist() == ["exact", "exact"]
    assert table["max_rel_err"].max() <= FLOAT64_BOUND


def test_the_inputs_themselves_are_taken_too_and_split_only_where_they_have_a_row_per_sample():
    teacher = torch.randn(16, 16)
    table = check_loss(input_losses.distilled, (2,), inputs={"teacher": teacher}, steps=0).table
    assert table["verdict"].tolist() == ["exact"]
    inputs = Inputs.made((teacher, torch.ones(32), torch.arange(10), 0.5), 16)
    like = torch.zeros(1, dtype=torch.float64)
    args, kwargs = inputs.of_rows(slice(8, 16), like)
    assert torch.equal(args[0], teacher[8:16].double()) and args[0].dtype == torch.float64
    assert len(args[1]) == 32 and torch.equal(args[2], torch.arange(10)) and args[3] == 0.5
    assert args[2].dtype == torch.int64  # integers are positions: never cast
    assert kwargs == {}
    assert inputs.names() == ["argument 3", "argument 4", "argument 5", "argument 6"]


def test_a_local_masked_loss_is_reproduced_by_local_negatives_on_its_slices_inputs():
    """The one-device forward of each rank's slice alone is given that slice's rows of the mask
    (`hypotheses.local_negatives`): the cause is reproduced, and the sum over the rank's rows
    named."""
    table = check_loss(
        input_losses.masked_sigmoid, (2, 4), inputs=input_losses.kept_rows, steps=0
    ).table
    assert table["verdict"].tolist() == ["loss differs", "loss differs"]
    assert table["cause"].tolist() == ["local_negatives", "local_negatives"]
    line = _line(input_losses.masked_sigmoid, ".sum()")
    assert table["where"].str.split().str[0].tolist() == [line, line]


@pytest.mark.parametrize(
    ("arguments", "words"),
    [
        (["--inputs", "input_losses:no_such"], "--inputs input_losses:no_such: "),
        (["--inputs", "builtins:str"], "--inputs builtins:str are a str; allowed: a tuple"),
    ],
)
def test_inputs_that_are_no_inputs_are_one_line_before_any_rank_runs(arguments, words, tmp_path):
    result = run_command(
        "check", "input_losses:masked_nt_xent", *arguments, "--out", str(tmp_path / "out")
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and words in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_inputs_without_a_loss_are_refused():
    result = run_command("check", "--gather", "fixed", "--inputs", "input_losses:kept_rows")
    assert result.returncode == 2
    assert "--inputs are a loss's; allowed: with a loss (module:attribute)" in result.stderr
