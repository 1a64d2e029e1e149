"""A loss that calls the model itself (`gatherlab.runs.loss.calls_model`), as GradCache's losses
do, is checked on the path training takes: its forward (which embeds the views in chunks without
a graph, backpropagates the loss to the embeddings and caches their gradients) and the backward
of what it returns (a hook that embeds every chunk again through the model DDP wraps and
backpropagates its cached gradient). Real gloo ranks of the pool, float64.

The stand-in, `ChunkCachedLoss`, is written here: the mean over the rank's rows of the squared
distance between a row's two embeddings, a loss of each row alone, so that one device's global
loss is the mean of the ranks' and its gradient the DDP average of theirs. What it reports and
what it caches are set apart: reported W times, cached as computed, the check must read the
value as scaled by W (``loss scaled``, scale 2 and 4) and the gradient as one device's; cached
divided by W (as the patch the census once published for pylate's ``CachedContrastive``), the
gradient 1/W (norm ratio 0.5 and 0.25). Had the check differentiated the returned value, which
is detached, no gradient would reach the model at all."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from bounds import FLOAT64_BOUND
from helpers import REPO
from torch import nn

from gatherlab.check import check_loss
from gatherlab.check.api import CheckError

sys.path.insert(0, str(REPO / "experiments"))
import census

pytestmark = pytest.mark.slow  # checks on the pool: seconds each

CHUNK = 2  # rows embedded at a time: a rank's 8 or 4 rows are 4 or 2 chunks, one device's 16 are 8


class _Rows(nn.Module):
    """The model the stand-in is handed: the check's MLP on a chunk of a view's rows."""

    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.encoder = encoder

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.encoder(rows)


class ChunkCachedLoss(nn.Module):
    """A loss in GradCache's form: it reports its value times ``reported`` and caches the
    gradient of its value times ``cached`` ("W": the world size, "1/W", or "1")."""

    def __init__(self, reported: str = "1", cached: str = "1"):
        super().__init__()
        self.reported, self.cached = reported, cached

    def model_for(self, encoder: nn.Module) -> nn.Module:
        return _Rows(encoder)

    @staticmethod
    def _factor(name: str) -> float:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        return {"1": 1.0, "W": float(world_size), "1/W": 1.0 / world_size}[name]

    @staticmethod
    def _value(chunks: list[torch.Tensor]) -> torch.Tensor:
        """The loss of the embedded chunks, view 0's then view 1's: the mean over the rows of
        the squared distance between a row's two embeddings."""
        half = len(chunks) // 2
        return ((torch.cat(chunks[:half]) - torch.cat(chunks[half:])) ** 2).sum(1).mean()

    def forward(self, model: nn.Module, view0: torch.Tensor, view1: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # every chunk embedded without a graph
            chunks = [model(rows) for view in (view0, view1) for rows in view.split(CHUNK)]
        if not torch.is_grad_enabled():  # a forward alone: nothing to cache
            return self._value(chunks) * self._factor(self.reported)
        leaves = [chunk.requires_grad_() for chunk in chunks]
        value = self._value(leaves)
        (value * self._factor(self.cached)).backward()  # the gradients cached at the embeddings
        cache = [leaf.grad for leaf in leaves]
        returned = (value.detach() * self._factor(self.reported)).requires_grad_()

        def replay(grad: torch.Tensor) -> None:
            with torch.enable_grad():  # a hook runs in the backward, without a graph
                rows = [*view0.split(CHUNK), *view1.split(CHUNK)]
                for again, gradient in zip(rows, cache, strict=True):
                    ((model(again) * gradient).sum() * grad).backward()

        returned.register_hook(replay)
        return returned


def _whole(table):
    return table[table["part"] == "all"].set_index("world_size")


def test_a_value_reported_w_times_with_its_gradient_replayed_exact_reads_loss_scaled():
    table = check_loss(ChunkCachedLoss, (2, 4), steps=0, reported="W", cached="1").table
    whole = _whole(table)
    assert whole["verdict"].tolist() == ["loss scaled", "loss scaled"]
    assert whole["scale"].tolist() == pytest.approx([2.0, 4.0], rel=1e-12)
    assert set(whole["gradient"]) == {"exact"}
    assert whole["cosine"].tolist() == pytest.approx([1.0, 1.0], abs=1e-12)
    assert whole["norm_ratio"].tolist() == pytest.approx([1.0, 1.0], abs=1e-12)
    assert whole["max_rel_err"].max() <= FLOAT64_BOUND
    # the census reads it so: training exact, the value alone W times, a fix of it still tried
    assert census.verdicts(table) == ["loss scaled (×2)", "loss scaled (×4)"]
    assert census.exact(table) and not census.one_devices(table)


def test_the_gradient_cached_over_w_is_read_one_over_w_whatever_the_value():
    table = check_loss(ChunkCachedLoss, (2, 4), steps=0, reported="1", cached="1/W").table
    whole = _whole(table)
    assert whole["forward"].tolist() == ["same", "same"]
    assert whole["verdict"].tolist() == ["1/W", "1/W"]
    assert whole["norm_ratio"].tolist() == pytest.approx([0.5, 0.25], abs=1e-12)
    assert whole["cosine"].tolist() == pytest.approx([1.0, 1.0], abs=1e-12)
    assert not census.exact(table)


class _WithTemperature(ChunkCachedLoss):
    """The stand-in with a trainable parameter of its own, which no DDP would average."""

    def __init__(self):
        super().__init__()
        self.temperature = nn.Parameter(torch.ones(()))


def test_a_loss_that_calls_the_model_and_holds_a_trainable_parameter_is_refused_in_one_line():
    with pytest.raises(CheckError, match=r"parameter of its own \(temperature\)") as refused:
        check_loss(_WithTemperature, (2,), steps=0)
    assert "\n" not in str(refused.value)
