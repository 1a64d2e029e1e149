"""The sampler gives every layout the same global batches in the same row order
(docs/design.md §2)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from gatherlab.components.data import GlobalBatchSampler, arange_pairs, gaussian_pairs


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
