"""The samplers give every layout the same global batches in the same row order
(docs/design.md §2): gatherlab's own, and `gatherlab.data.LayoutInvariantSampler` held against
torch's permutation and against `DistributedSampler`, whose global batches it rearranges."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler, RandomSampler

from gatherlab.components.data import GlobalBatchSampler, arange_pairs, gaussian_pairs
from gatherlab.data import LayoutInvariantSampler


def _gathered_batches(world_size: int, **kwargs) -> list[list[int]]:
    """Each step's batches of all ranks concatenated in rank order, as a gather sees them."""
    per_rank = [
        list(GlobalBatchSampler(rank=r, world_size=world_size, **kwargs)) for r in range(world_size)
    ]
    return [
        list(itertools.chain.from_iterable(batches[step] for batches in per_rank))
        for step in range(len(per_rank[0]))
    ]


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_gathered_batches_equal_the_one_device_batches(world_size):
    settings = dict(num_samples=40, global_batch_size=8, num_batches=17, seed=3, shuffle=True)
    assert _gathered_batches(world_size, **settings) == _gathered_batches(1, **settings)


def test_each_epoch_is_a_new_permutation_of_all_samples():
    batches = _gathered_batches(
        1, num_samples=12, global_batch_size=4, num_batches=6, seed=0, shuffle=True
    )
    first_epoch = list(itertools.chain.from_iterable(batches[:3]))
    second_epoch = list(itertools.chain.from_iterable(batches[3:]))
    assert sorted(first_epoch) == sorted(second_epoch) == list(range(12))
    assert first_epoch != second_epoch


def test_order_depends_on_the_seed_and_can_be_fixed():
    settings = dict(num_samples=16, global_batch_size=8, num_batches=2, shuffle=True)
    assert _gathered_batches(1, seed=0, **settings) != _gathered_batches(1, seed=1, **settings)
    unshuffled = _gathered_batches(
        1, num_samples=8, global_batch_size=8, num_batches=2, seed=0, shuffle=False
    )
    assert unshuffled == [list(range(8))] * 2


def test_rank_takes_its_contiguous_slice():
    sampler = GlobalBatchSampler(
        num_samples=8, global_batch_size=8, num_batches=1, rank=1, world_size=4, shuffle=False
    )
    assert list(sampler) == [[2, 3]]


def test_sampler_rejects_batches_that_do_not_fit():
    with pytest.raises(ValueError, match="does not divide by 3 devices"):
        GlobalBatchSampler(num_samples=8, global_batch_size=8, num_batches=1, world_size=3)
    with pytest.raises(ValueError, match="exceeds the 8 samples"):
        GlobalBatchSampler(num_samples=8, global_batch_size=16, num_batches=1)


def test_arange_pairs_is_the_pr1531_case():
    data = arange_pairs()
    x, y = data[7]
    assert np.array_equal(x.numpy(), np.arange(70, 80).reshape(2, 5))
    assert np.array_equal(y.numpy(), np.arange(28, 32).reshape(2, 2))
    assert len(data) == 8 and not data.encode_second_view


def test_gaussian_pairs_are_seeded():
    first, again, other = (
        gaussian_pairs(10, 3, seed=0),
        gaussian_pairs(10, 3, seed=0),
        gaussian_pairs(10, 3, seed=1),
    )
    assert (first.view0 == again.view0).all() and (first.view1 == again.view1).all()
    assert not (first.view0 == other.view0).all()
    assert not (first.view0 == first.view1).all()


def test_the_few_shot_probe_is_seeded_and_not_saturated_on_raw_pixels():
    """docs/design.md §8: the same label draws for every model, and room above raw pixels."""
    from gatherlab.components.data import digits_pairs

    dataset = digits_pairs()
    raw = dataset.few_shot_accuracy()
    assert raw == dataset.few_shot_accuracy(lambda images: images.flatten(1))  # same draws
    assert 0.5 < raw < 0.8


def _loaded(sampler, batch_size: int, epoch: int) -> list[list[int]]:
    """One epoch of a sampler cut into batches of ``batch_size``, as a DataLoader cuts it."""
    sampler.set_epoch(epoch)
    indices = list(sampler)
    assert len(indices) == len(sampler)
    return [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]


def _global_batches(world_size, n, global_batch_size, epoch=0, **kwargs) -> list[list[int]]:
    """Each update's batches of the W ranks of a LayoutInvariantSampler, concatenated in rank
    order."""
    per_rank = [
        _loaded(
            LayoutInvariantSampler(range(n), global_batch_size, world_size, rank, **kwargs),
            global_batch_size // world_size,
            epoch,
        )
        for rank in range(world_size)
    ]
    return [list(itertools.chain.from_iterable(update)) for update in zip(*per_rank, strict=True)]


def _distributed_global_batches(world_size, n, batch_size, epoch=0, **kwargs) -> list[list[int]]:
    """The same for DistributedSampler with ``batch_size`` rows per rank."""
    per_rank = [
        _loaded(DistributedSampler(range(n), world_size, rank, **kwargs), batch_size, epoch)
        for rank in range(world_size)
    ]
    return [list(itertools.chain.from_iterable(update)) for update in zip(*per_rank, strict=True)]


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
@pytest.mark.parametrize("epoch", [0, 3])
def test_layout_invariant_batches_are_the_consecutive_blocks_of_torchs_permutation(
    world_size, epoch
):
    n, global_batch_size, seed = 45, 8, 7
    permutation = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    blocks = [permutation[i : i + 8] for i in range(0, 40, 8)]  # 5 whole blocks, 5 left over
    assert _global_batches(world_size, n, global_batch_size, epoch, seed=seed) == blocks


def test_without_shuffle_the_blocks_are_the_data_sets_order():
    assert _global_batches(4, 16, 8, shuffle=False) == [list(range(8)), list(range(8, 16))]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_without_drop_last_the_last_block_is_completed_by_the_epochs_first_indices(world_size):
    permutation = torch.randperm(10, generator=torch.Generator().manual_seed(0)).tolist()
    expected = [permutation[:4], permutation[4:8], permutation[8:] + permutation[:2]]
    assert _global_batches(world_size, 10, 4, drop_last=False) == expected


def test_distributed_sampler_holds_the_same_sets_in_a_strided_order():
    """DistributedSampler gives rank r the positions r, r + W, r + 2W, … of the same permutation:
    the k-th batches of B rows of its W ranks hold positions kWB … (k+1)WB − 1, the k-th block
    of W·B, so the set of each global batch is the layout-invariant sampler's, in another order
    (positions kWB + jW + r in rank order instead of kWB + rB + j)."""
    n, world_size, batch_size, seed = 48, 4, 3, 5
    ours = _global_batches(world_size, n, world_size * batch_size, epoch=2, seed=seed)
    theirs = _distributed_global_batches(world_size, n, batch_size, epoch=2, seed=seed)
    assert [sorted(b) for b in theirs] == [sorted(b) for b in ours]
    permutation = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 2)).tolist()
    strided = [
        [permutation[k * 12 + j * world_size + r] for r in range(world_size) for j in range(3)]
        for k in range(4)
    ]
    assert theirs == strided and theirs != ours


def test_distributed_sampler_pads_or_drops_per_world_size_and_ours_does_not():
    """With n % W ≠ 0 DistributedSampler pads each epoch to a multiple of W with its first
    indices (``drop_last=False``) or drops its last n % W (``True``): what a run trains on depends
    on W. Ours depends on the global batch alone."""
    n = 10
    padded = [list(DistributedSampler(range(n), 3, rank, seed=0)) for rank in range(3)]
    total = list(itertools.chain.from_iterable(padded))
    assert len(total) == 12 and len(set(total)) == 10  # two indices twice
    dropped = [list(DistributedSampler(range(n), 4, r, seed=0, drop_last=True)) for r in range(4)]
    assert len(set(itertools.chain.from_iterable(dropped))) == 8  # two indices never
    one = _global_batches(1, n, 4, drop_last=False)
    assert all(_global_batches(w, n, 4, drop_last=False) == one for w in (2, 4))


def test_random_sampler_on_one_device_departs_from_distributed_sampler_after_its_first_epoch():
    """One device's RandomSampler with a generator seeded by ``seed`` draws epoch 0 as
    ``randperm(seed)``, DistributedSampler's epoch 0, but each further epoch from the same
    generator, not from ``seed + epoch``: the global batches differ from the second epoch on."""
    n, seed = 32, 3
    sampler = RandomSampler(range(n), generator=torch.Generator().manual_seed(seed))
    first, second = list(sampler), list(sampler)
    assert first == torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    assert second != torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1)).tolist()
    assert first == list(itertools.chain.from_iterable(_global_batches(1, n, 8, 0, seed=seed)))


def test_layout_invariant_sampler_defaults_to_one_device_without_a_process_group():
    sampler = LayoutInvariantSampler(range(8), 4)
    assert (sampler.num_replicas, sampler.rank, len(sampler)) == (1, 0, 8)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ((range(8), 6, 4, 0), "global_batch_size=6 does not divide by num_replicas=4; allowed: "
                              "a positive multiple of 4"),
        ((range(8), 0, 1, 0), "global_batch_size=0 does not divide"),
        ((range(8), 4, 2, 2), "rank=2 is not allowed; allowed: an integer in 0..1"),
        ((range(8), 4, 0, 0), "num_replicas=0 is not allowed; allowed: a positive integer"),
        ((range(3), 4, 1, 0), "exceeds the data set's 3 samples with drop_last=True"),
    ],
)  # fmt: skip
def test_layout_invariant_sampler_refuses_in_one_line(arguments, message):
    with pytest.raises(ValueError, match=message) as error:
        LayoutInvariantSampler(*arguments)
    assert "\n" not in str(error.value)
