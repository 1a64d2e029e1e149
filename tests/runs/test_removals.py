"""The removals of docs/checking.md §10 on one process, against torch's own layers: a batch norm
swapped for the global one computes what it computed (its settings, parameters and buffers carried
over), dropout is gone, and a data set's draws become a function of (seed, epoch, index) while the
process's random streams go on as before. (The global batch norm across ranks: test_simclr.py.)"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from gatherlab.components.batchnorm import GlobalBatchNorm
from gatherlab.runs import removals

EXACT = 1e-12  # float64, the same arithmetic up to summation order


class Net(nn.Module):
    def __init__(self, momentum: float | None = 0.1, affine: bool = True):
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 1)
        self.norm1 = nn.BatchNorm1d(3, momentum=momentum, affine=affine)
        self.head = nn.Sequential(nn.Linear(15, 4), nn.BatchNorm1d(4, eps=1e-3), nn.Dropout(0.5))
        self.drop = nn.Dropout1d(0.3)

    def forward(self, x):
        return self.head(self.drop(self.norm1(self.conv(x))).flatten(1))


@pytest.mark.parametrize(("momentum", "affine"), [(0.1, True), (None, True), (0.3, False)])
def test_global_batch_norm_computes_what_torchs_computed(momentum, affine):
    torch.manual_seed(0)
    original = Net(momentum, affine).double()
    with torch.no_grad():  # parameters and buffers other than the defaults, to be carried over
        for norm in (original.norm1, original.head[1]):
            norm.running_mean.normal_()
            norm.running_var.uniform_(0.5, 2)
            if norm.affine:
                norm.weight.normal_()
                norm.bias.normal_()
    swapped = Net(momentum, affine).double()
    swapped.load_state_dict(original.state_dict())
    assert removals.batch_norms(swapped) == ["norm1", "head.1"]
    assert removals.global_batch_norm(swapped) == 2
    assert removals.batch_norms(swapped) == [] and isinstance(swapped.head[1], GlobalBatchNorm)
    assert swapped.head[1].eps == 1e-3 and swapped.norm1.momentum == momentum
    removals.no_dropout(original)
    removals.no_dropout(swapped)
    inputs = torch.randn(3, 8, 2, 5, dtype=torch.float64)
    for x in inputs:  # training: batch statistics, running statistics updated
        assert torch.allclose(swapped(x), original(x), rtol=0, atol=EXACT)
    for ours, theirs in zip(swapped.buffers(), original.buffers(), strict=True):
        assert torch.allclose(ours.double(), theirs.double(), rtol=0, atol=EXACT)
    trainable = [n for n, p in swapped.named_parameters() if p.requires_grad]
    assert trainable == [n for n, p in original.named_parameters()]
    original.eval()
    swapped.eval()  # evaluation: the running statistics
    assert torch.allclose(swapped(inputs[0]), original(inputs[0]), rtol=0, atol=EXACT)


def test_no_dropout_leaves_the_identity():
    net = Net().double()
    assert removals.dropouts(net) == ["head.2", "drop"]
    assert removals.no_dropout(net) == 2 and removals.dropouts(net) == []
    x = torch.randn(8, 2, 5, dtype=torch.float64)
    net.train()
    first = net(x)
    torch.manual_seed(123)  # no draw left in the forward: any state gives the same output
    assert torch.equal(net(x), first)


class RandomItems(torch.utils.data.Dataset):
    """A data set that augments with every global stream, as public code does."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> tuple[float, float, float]:
        return random.random() + index, float(np.random.rand()), float(torch.rand(()))


def test_per_sample_seeding_makes_an_item_a_function_of_its_key():
    seeded = removals.PerSample(RandomItems(), seed=7, seeded=True)
    torch.manual_seed(1)
    first = [seeded[(0, i)] for i in range(10)]
    torch.manual_seed(2)
    random.seed(5)
    backwards = [seeded[(0, i)] for i in reversed(range(10))][::-1]
    assert first == backwards  # whichever order, rank or state loads them
    assert seeded[(1, 3)] != first[3]  # another epoch, other draws
    assert removals.PerSample(RandomItems(), seed=8, seeded=True)[(0, 3)] != first[3]


def test_per_sample_seeding_leaves_the_process_streams_where_they_were():
    seeded = removals.PerSample(RandomItems(), seed=7, seeded=True)
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    expected = random.random(), float(np.random.rand()), float(torch.rand(()))
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    seeded[(0, 4)]
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == expected


def test_unseeded_items_come_from_the_process_streams():
    plain = removals.PerSample(RandomItems(), seed=7, seeded=False)
    torch.manual_seed(1)
    first = plain[(0, 2)]
    torch.manual_seed(2)
    assert plain[(0, 2)][2] != first[2]


def test_a_run_names_its_removals_and_a_sweep_asks_for_them_by_value():
    # The training check's runs: nothing removed, one removal, every one (docs/checking.md §10).
    assert removals.Removals.named(removals.NONE).made() == ()
    assert removals.Removals.named("dropout") == removals.Removals(
        frozenset({removals.Removal.DROPOUT})
    )
    assert removals.Removals.named(removals.ALL).made() == tuple(removals.Removal)
    # A sweep's removals.* keys: the first value of each keeps the cause.
    assert removals.Removals.from_config(None) == removals.Removals()
    chosen = {"batchnorm": "global", "dropout": "on", "data_randomness": "per_sample"}
    assert removals.Removals.from_config(chosen).made() == ("batchnorm", "data_randomness")
    with pytest.raises(
        ValueError, match=r"^removals\.dropout='no' is not allowed; allowed: on, off$"
    ):
        removals.Removals.from_config({"dropout": "no"})
    with pytest.raises(
        ValueError, match=r"^removals\.bn is unknown; allowed: batchnorm, dropout, "
    ):
        removals.Removals.from_config({"bn": "global"})


def test_a_removal_is_one_member_and_its_config_line():
    # docs/design.md §4: a new removal is its member of Removal and its line in conf/config.yaml;
    # the sweep's keys, their defaults and the check's words all come from the member.
    from omegaconf import OmegaConf

    from gatherlab.check.diagnosis import CULPRIT_DIAGNOSES

    conf = Path(__file__).parents[2] / "conf" / "config.yaml"
    configured = OmegaConf.to_container(OmegaConf.load(conf)["removals"])
    assert configured == {removal.value: removal.config_values[0] for removal in removals.Removal}
    assert [str(r) for r in removals.Removal] == ["batchnorm", "dropout", "data_randomness"]
    for removal in removals.Removal:
        assert CULPRIT_DIAGNOSES[removal] == removal.diagnosis and "Fix:" in removal.diagnosis
    assert [r.make for r in removals.Removal] == [
        removals.global_batch_norm,
        removals.no_dropout,
        None,
    ]
