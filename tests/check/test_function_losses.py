"""A loss written as a plain function (``def loss(z0, z1, temperature=0.5)``) is checked as it is
written, from the command line and the Python API, with no wrapper (docs/checking.md §6, issue 51);
before, the check called it as its own factory and failed with ``missing 2 required positional
arguments``."""

from __future__ import annotations

import inspect

import function_losses
import pandas as pd
import pytest
from bounds import FLOAT64_BOUND
from helpers import run_command

from gatherlab.check import check_loss
from gatherlab.components.factory import FunctionLoss, Recipe, is_loss_function


def test_a_plain_function_with_an_exact_gather_is_exact_from_the_command_line(tmp_path):
    result = run_command(
        "check", "function_losses:gathered_nt_xent", "--world-sizes", "2,4",
        "--kwargs", '{"temperature": 0.2}', "--out", str(tmp_path / "out"),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    table = pd.read_csv(tmp_path / "out" / "check.csv")
    assert table["verdict"].tolist() == ["exact", "exact"]
    assert table["max_rel_err"].max() <= FLOAT64_BOUND


@pytest.mark.parametrize("loss", ["local_sigmoid_loss", "CallableSigmoidLoss"])
def test_a_plain_local_function_is_named_at_its_line_from_the_python_api(loss):
    # a callable object that is no nn.Module too: before, the trace asked it for its buffers and
    # where stayed empty
    table = check_loss(getattr(function_losses, loss), (2, 4), steps=0).table
    assert table["verdict"].tolist() == ["loss differs", "loss differs"]
    assert set(table["cause"]) == {"local_negatives"}
    # the line that sums over the rank's own rows: found in the file, not taken from the check
    lines, first = inspect.getsourcelines(function_losses.local_sigmoid_loss)
    line = first + next(i for i, text in enumerate(lines) if ".sum()" in text)
    assert set(table["where"].str.split().str[0]) == {f"function_losses.py:{line}"}


def test_a_function_is_the_loss_itself_only_when_its_inputs_are_left_unfilled():
    assert is_loss_function(function_losses.gathered_nt_xent, {})
    assert is_loss_function(function_losses.gathered_nt_xent, {"temperature": 0.1})
    # a factory: every parameter has a default, or the arguments fill it; a class never
    assert not is_loss_function(lambda temperature=0.5: None, {})
    assert not is_loss_function(function_losses.gathered_nt_xent, {"z0": 1, "z1": 2})
    assert not is_loss_function(FunctionLoss, {})
    built = Recipe(function_losses.gathered_nt_xent, {"temperature": 0.25})()
    assert isinstance(built, FunctionLoss) and built.kwargs == {"temperature": 0.25}


@pytest.mark.parametrize("temperature", [0.1, 0.5])
def test_the_functions_keyword_arguments_reach_it(temperature):
    import torch

    z0, z1 = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    built = Recipe(function_losses.local_sigmoid_loss, {"temperature": temperature})()
    expected = function_losses.local_sigmoid_loss(z0, z1, temperature=temperature)
    assert float(built(z0, z1)) == float(expected)
