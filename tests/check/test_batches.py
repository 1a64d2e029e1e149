"""The global batches of two recordings (`gatherlab.check.batches`, docs/checking.md §6 "Comparing
two recordings", item 2) on recordings built in memory, their rows drawn by torch's own samplers
and `gatherlab.data.LayoutInvariantSampler` as a job's DataLoaders draw them (a sample's row is its
index): which run's order or rows changed, and what explains it, read from the fingerprints."""

from __future__ import annotations

import math

import pytest
import torch
from recorded import in_memory
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from gatherlab.check import batches
from gatherlab.check import recordings as comparer
from gatherlab.data import LayoutInvariantSampler

N = 8  # the global batch
ROWS = [f"{i:016x}" for i in range(16)]


def loaded(samplers, updates: int, epochs: bool = True) -> list[list[list[str]]]:
    """Each update's rows per rank, the ranks' DataLoaders of N / W rows each drawn epoch after
    epoch (``set_epoch(epoch)`` before each where the sampler has it and ``epochs``)."""
    world = len(samplers)
    loaders = [DataLoader(range(64), batch_size=N // world, sampler=s, drop_last=False)
               for s in samplers]  # fmt: skip
    out, epoch = [], 0
    while len(out) < updates:
        for sampler in samplers:
            if epochs and hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
        for ranks in zip(*loaders, strict=True):
            out.append([[f"{int(i):016x}" for i in rows] for rows in ranks])
            if len(out) == updates:
                break
        epoch += 1
    return out


def data(size: int) -> range:
    return range(size)


def explained(a, b) -> batches.Batches:
    return batches.compare_batches(in_memory(a), in_memory(b))


def test_an_unseeded_random_sampler_against_a_distributed_sampler_is_another_permutation():
    """One device's RandomSampler without a generator (seeded from torch's global RNG, here
    another seed) against DistributedSampler(seed=0) on 2 ranks: they part at update 0, and the
    words name the permutations, not DistributedSampler's striding or padding."""
    torch.manual_seed(12345)
    one = loaded([RandomSampler(data(32))], 6)
    two = loaded([DistributedSampler(data(32), 2, r, seed=0) for r in range(2)], 6)
    compared = explained(one, two)
    assert compared.update == 0
    assert compared.explanation.startswith(
        "From the fingerprints: the two runs' samplers start from different permutations"
    )
    assert "RandomSampler(data) without generator=" in compared.explanation


def test_a_per_device_batch_that_is_not_the_global_batch_over_w_is_named_before_any_sampler():
    """One device at a global batch of 8 against 2 ranks given 8 rows each (a trainer's
    per_device_train_batch_size left at one device's): the global batches differ from update 0,
    and the words name the sizes, not the samplers' permutations (which a user then chases)."""
    one = [[ROWS[:8]], [ROWS[8:]]]
    two = [[ROWS[:8], ROWS[8:]], [ROWS[:8], ROWS[8:]]]
    compared = explained(one, two)
    assert compared.update == 0
    assert compared.explanation.startswith(
        "From the fingerprints: B's global batch holds 16 rows an update, A's 8"
    ), compared.explanation


def test_a_seeded_random_sampler_reshuffles_otherwise_from_the_second_epoch():
    """RandomSampler(generator seeded 0) on one device draws DistributedSampler(seed=0)'s first
    permutation (torch.randperm on a generator seeded 0), then continues its generator where
    DistributedSampler draws seed + 1: the same batches for the first epoch (32 / 8 = 4 updates,
    strided over B's ranks), parting at update 4, where both start epoch 1."""
    one = loaded([RandomSampler(data(32), generator=torch.Generator().manual_seed(0))], 8)
    two = loaded([DistributedSampler(data(32), 2, r, seed=0) for r in range(2)], 8)
    compared = explained(one, two)
    assert compared.update == 4
    assert compared.explanation.startswith(
        "From the fingerprints: both runs give the same global batches until update 4 (B's "
        "ranks holding A's rows strided over them, a DistributedSampler's order), where both "
        "start epoch 1 (its rows repeat epoch 0's): they reshuffle differently between epochs."
    )
    assert "gives epoch 1 in epoch 0's order" not in compared.explanation


def test_a_sampler_never_told_its_epoch_is_named_for_repeating_it():
    """DistributedSampler without set_epoch repeats its first epoch's order; the layout-invariant
    sampler told each epoch draws seed + 1: B is named."""
    one = loaded([LayoutInvariantSampler(data(32), N, 1, 0, seed=0)], 8)
    two = loaded([DistributedSampler(data(32), 2, r, seed=0) for r in range(2)], 8, epochs=False)
    compared = explained(one, two)
    assert compared.update == 4
    assert "B gives epoch 1 in epoch 0's order: its sampler is never told the new epoch" in (
        compared.explanation
    )
    assert "A gives epoch 1" not in compared.explanation


def test_padding_names_the_run_and_rank_that_hold_a_row_twice():
    """DistributedSampler(drop_last=False) on 4 ranks pads 30 samples to 32 with its first two
    indices: rank 2 and 3 of B hold them at the epoch's last update (3), which one device's 6
    rows there lack."""
    one = loaded([RandomSampler(data(30), generator=torch.Generator().manual_seed(0))], 4)
    four = loaded([DistributedSampler(data(30), 4, r, seed=0) for r in range(4)], 4)
    compared = explained(one, four)
    assert compared.update == 3
    given = {row for update in four[:3] for rank in update for row in rank}
    assert [r for r in range(4) if set(four[3][r]) & given] == [2, 3]  # the sampler's padding
    assert compared.explanation.startswith(
        "From the fingerprints: B's rank 2 holds 1 row at update 3 that its epoch 0 has given "
        "already: its sampler pads the data set with repeated rows"
    )


def test_equal_samples_in_a_batch_whose_epoch_goes_on_are_not_blamed_on_padding():
    """A data set whose samples repeat (equal texts, as a tokenizer that maps every word to one
    token makes them): one device's first batch holds row 0 three times, and its next update
    rows never given, so its epoch goes on, where a sampler's padding (the epoch's first rows
    again, at its end) cannot be; B's 2 ranks drew other permutations (a data seed set per
    rank). The words name the permutations (a user's Trainer job with its data seed per rank
    read "A's rank 0 ... its sampler pads the data set")."""
    one = [[[ROWS[0], ROWS[1], ROWS[0], ROWS[2], ROWS[3], ROWS[0], ROWS[4], ROWS[5]]],
           [ROWS[6:14]]]  # fmt: skip
    two = [
        [[ROWS[0], ROWS[2], ROWS[7], ROWS[8]], [ROWS[4], ROWS[5], ROWS[9], ROWS[10]]],
        [[ROWS[1], ROWS[3], ROWS[6], ROWS[11]], [ROWS[12], ROWS[13], ROWS[14], ROWS[15]]],
    ]
    compared = explained(one, two)
    assert compared.update == 0
    assert compared.explanation.startswith(
        "From the fingerprints: the two runs' samplers start from different permutations"
    ), compared.explanation


def _deduplicated(order: list[int], per_batch: int) -> list[list[int]]:
    """``order`` cut into batches of ``per_batch`` samples, a sample equal to one the batch holds
    moved to the next (a sampler that keeps duplicates out of a batch); samples 3 and 9 are
    equal (one text twice)."""
    text = {9: 3}
    batches, waiting = [], list(order)
    while waiting:
        batch, later = [], []
        for sample in waiting:
            if len(batch) < per_batch and text.get(sample, sample) not in {
                text.get(s, s) for s in batch
            }:
                batch.append(sample)
            else:
                later.append(sample)
        batches.append(batch)
        waiting = later
    return batches


def _rows_of(samples: list[int]) -> list[str]:
    return [ROWS[{9: 3}.get(s, s)] for s in samples]


def test_equal_samples_grouped_per_device_are_named_where_the_batches_hold_the_same_rows():
    """One text twice in the data set (samples 3 and 9): one device keeps the second out of its
    batch of 8 (a no-duplicates batch sampler), each of B's 2 ranks decides over its own 4 rows
    and both hold it at update 0, the global batch otherwise A's: the words name the per-device
    decision."""
    order = [0, 3, 1, 9, 2, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15]
    one = [[_rows_of(batch)] for batch in _deduplicated(order, 8)]
    halves = [_deduplicated(order[:8], 4), _deduplicated(order[8:], 4)]
    two = [[_rows_of(halves[u][0]), _rows_of(halves[u][1])] for u in range(2)]
    assert two[0] == [[ROWS[0], ROWS[3], ROWS[1], ROWS[2]], [ROWS[3], ROWS[4], ROWS[5], ROWS[6]]]
    compared = explained(one, two)
    assert compared.update == 0
    assert compared.explanation.startswith(
        "From the fingerprints: B's rank 1 holds 1 row at update 0 that its epoch 0 has given "
        "already, and that A's epoch 0 gives twice too"
    ), compared.explanation


def test_equal_samples_in_batches_of_another_permutation_are_not_blamed_on_grouping():
    """The same data set, B's ranks drawing another permutation (a data seed per rank) whose
    update 0 holds the equal text on both ranks: its global batch shares one row with A's, so the
    words name the permutations, not a per-device grouping of equal samples (which moves a few
    rows of one batch, not most)."""
    order = [0, 3, 1, 9, 2, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15]
    one = [[_rows_of(batch)] for batch in _deduplicated(order, 8)]
    two = [[_rows_of([8, 3, 10, 11]), _rows_of([9, 12, 13, 14])],
           [_rows_of([0, 1, 2, 4]), _rows_of([5, 6, 7, 15])]]  # fmt: skip
    compared = explained(one, two)
    assert compared.update == 0
    assert compared.explanation.startswith(
        "From the fingerprints: the two runs' samplers start from different permutations"
    ), compared.explanation


def test_epochs_cut_differently_are_said_with_their_sizes():
    """One device's DataLoader keeps the last 6 of 30 rows as a short batch (4 updates an epoch);
    the layout-invariant sampler drops them (3): they part at update 3."""
    one = loaded([LayoutInvariantSampler(data(30), N, 1, 0, seed=0, drop_last=False)], 6)
    one[3] = [one[3][0][:6]]  # what a DataLoader's last short batch holds: the epoch's rest
    one[4:] = loaded([LayoutInvariantSampler(data(30), N, 1, 0, seed=0)], 8)[4:6]
    two = loaded([LayoutInvariantSampler(data(30), N, 2, r, seed=0) for r in range(2)], 6)
    compared = explained(one, two)
    assert compared.update == 3
    assert compared.explanation.startswith(
        "From the fingerprints: A's first epoch gives 30 rows in 4 updates, B's 24 in 3"
    )


def test_rows_a_run_never_gives_are_other_inputs_not_another_order():
    """B's rows are other inputs (randomness drawn per run: each row's digest salted), after A
    gave its whole data set: the words say the inputs differ."""
    one = loaded([LayoutInvariantSampler(data(16), N, 1, 0, seed=0)], 4)
    two = [[["f" + row[1:] for row in rank] for rank in update] for update in one]
    compared = explained(one, two)
    assert compared.update == 0
    assert compared.explanation.startswith(
        "From the fingerprints: B's global batch at update 0 holds 8 rows that A gives at no "
        "update, although A covered its data set (an epoch): the inputs themselves differ"
    )


def test_epoch_starts_are_where_most_rows_repeat():
    # 16 rows, batch 8: epochs of 2 updates; a padded update repeats a minority and starts none
    order = [ROWS[0:8], ROWS[8:16], ROWS[3:11], [*ROWS[11:16], *ROWS[0:3]], [*ROWS[5:12], ROWS[5]]]
    assert batches.epoch_starts(order) == [0, 2, 4]
    assert batches.epoch_starts([ROWS[0:8], ROWS[0:2] + ROWS[8:14]]) == [0]
    assert batches.epoch_starts([ROWS[0:8], ROWS[0:5] + ROWS[8:11]]) == [0, 1]  # 5 of 8 again
    assert batches.epoch_starts([ROWS[0:8], ROWS[0:4] + ROWS[8:12]]) == [0]  # half is no epoch


def test_a_padded_batch_names_the_row_held_twice_and_the_row_missing():
    """DistributedSampler's padding: rank 3 repeats a row of rank 0 where one device has row 15."""
    padded = [ROWS[0:4], ROWS[4:8], ROWS[8:12], [*ROWS[12:15], ROWS[0]]]
    compared = comparer.compare_recordings(in_memory([[ROWS]]), in_memory([padded]))
    assert compared.verdict == "data differs" and compared.status == 1
    assert compared.data == (
        "update 0: the global batches differ: B's rank 3 holds 1 row more often than A's batch; "
        "A's batch holds 1 row B's lacks"
    )
    assert "B's rank 3 holds 1 row at update 0 that its epoch 0 has given already" in " ".join(
        compared.words.split()
    )


@pytest.mark.parametrize(
    ("ranks", "words"),
    [([ROWS[0::2], ROWS[1::2]], "strided over the ranks (rank r its rows r, r + 2"),
     ([ROWS[0:4] + ROWS[8:12], ROWS[4:8] + ROWS[12:16]], "each of its 2 blocks in turn"),
     ([ROWS[8:16], ROWS[0:8]], "the same global batch in another order")],
    ids=["strided", "views", "other"],
)  # fmt: skip
def test_the_same_rows_in_another_order_are_a_note_not_a_failure(ranks, words):
    compared = comparer.compare_recordings(in_memory([[ROWS]]), in_memory([ranks]))
    assert (compared.verdict, compared.status) == ("exact", 0), compared.words
    assert len(compared.notes) == 1 and words in compared.notes[0], compared.notes


def test_updates_without_a_recorded_loss_compare_their_gradients_alone():
    """A job that gave its recorder no loss (NaN in the recording): a note, and the verdict of
    the gradients (here the same: exact), not a differing loss."""
    halves = [ROWS[0:8], ROWS[8:16]]
    compared = comparer.compare_recordings(
        in_memory([[ROWS]] * 2), in_memory([halves] * 2, math.nan)
    )
    assert (compared.verdict, compared.status) == ("exact", 0), compared.words
    assert any("2 of 2 updates have no recorded loss" in note for note in compared.notes)


def _trainer_rows(samples: int, world: int, drop_last: bool, updates: int) -> list:
    """What a Hugging Face Trainer's data loader gives each rank, as accelerate shards it: one
    seeded sampler's batches of N / W rows (reseeded with seed + epoch), rank r given every W-th
    from the r-th (`accelerate.data_loader.BatchSamplerShard`, ``even_batches`` as the Trainer
    leaves it); ``drop_last``: ``TrainingArguments(dataloader_drop_last=...)``."""
    shards = pytest.importorskip("accelerate.data_loader")
    from torch.utils.data import BatchSampler

    samplers = [shards.SeedableRandomSampler(range(samples), data_seed=0) for _ in range(world)]
    ranks = [BatchSampler(s, N // world, drop_last) for s in samplers]
    if world > 1:  # accelerate shards only for several processes
        ranks = [shards.BatchSamplerShard(b, world, r) for r, b in enumerate(ranks)]
    out, epoch = [], 0
    while len(out) < updates:  # each rank's own sampler, told the epoch as the Trainer tells it
        for sampler in samplers:
            sampler.set_epoch(epoch)
        for update in zip(*(list(rank) for rank in ranks), strict=True):
            out.append([[f"{int(i):016x}" for i in rows] for rows in update])
        epoch += 1
    return out[:updates]


def test_a_trainers_own_sampler_is_the_one_device_batch_with_drop_last_and_padded_without():
    """60 rows, a global batch of 8: with ``dataloader_drop_last=True`` two ranks give one
    device's 7 global batches an epoch, the second epoch too; without it accelerate completes the
    epoch's last update on W ranks with its first rows, and the words say which rank pads."""
    one = _trainer_rows(60, 1, True, 10)
    assert (
        batches.compare_batches(in_memory(one), in_memory(_trainer_rows(60, 2, True, 10))).update
        is None
    )
    padded = batches.compare_batches(in_memory(_trainer_rows(60, 1, False, 9)),
                             in_memory(_trainer_rows(60, 2, False, 9)))  # fmt: skip
    assert padded.update == 7  # the epoch's eighth update: 4 rows left, and 4 repeated
    assert padded.explanation.startswith(
        "From the fingerprints: B's rank 1 holds 4 rows at update 7 that its epoch 0 has given "
        "already: its sampler pads the data set with repeated rows"
    )


# --- the cause only from evidence; batches as multisets (issue 68) -------------------------------


def test_rows_no_update_of_a_holds_are_not_blamed_on_seeds_without_evidence():
    """B's update 0 holds rows that A, which never covered its data set, gives at no update: the
    fingerprints cannot tell another permutation from other inputs, and the words say both;
    where B's rows are A's at a later update, the permutation is what the evidence shows."""
    one = [[ROWS[0:8]], [ROWS[8:16]]]
    other_inputs = [
        [[f"{i:016x}" for i in range(100, 108)]],
        [[f"{i:016x}" for i in range(108, 116)]],
    ]
    compared = explained(one, other_inputs)
    assert compared.update == 0
    assert compared.explanation.startswith(
        "From the fingerprints: none of the 8 rows of B's global batch at update 0 that A's "
        "lacks appears at any update of A"
    )
    assert "seeds differ" not in compared.explanation.lower()
    permuted = [[ROWS[8:16]], [ROWS[0:8]]]
    assert explained(one, permuted).explanation.startswith(
        "From the fingerprints: the two runs' samplers start from different permutations"
    )


def test_a_global_batch_holding_one_of_as_rows_twice_is_data_differs():
    """A multiset: W = 2 ranks whose global batch holds one of A's rows twice (and lacks one)
    differ from A's, though the two batches' sets of rows differ by one row only, and the words
    say which rank holds a row more often."""
    one = [[ROWS[0:8]]]
    twice = [[ROWS[0:4], [ROWS[4], ROWS[5], ROWS[6], ROWS[6]]]]
    compared = explained(one, twice)
    assert compared.update == 0
    assert "B's rank 1 holds 1 row more often than A's batch" in compared.words
    assert "A's batch holds 1 row B's lacks" in compared.words
    # the same set of rows, other counts: A holds row 0 twice, B row 1 twice
    held_twice = [[[ROWS[0], ROWS[0], *ROWS[1:7]]]]
    same_set = [[[ROWS[0], ROWS[1], ROWS[1], *ROWS[2:4]], ROWS[4:7]]]
    assert set(held_twice[0][0]) == {row for rank in same_set[0] for row in rank}
    assert explained(held_twice, same_set).update == 0


@pytest.mark.parametrize(("samples", "global_batch"), [(32, 8), (30, 6)])
def test_the_layout_invariant_sampler_without_drop_last_gives_each_index_once_per_epoch(
    samples, global_batch
):
    """drop_last=False where the global batch divides the data: every index once per epoch, no
    extra batch, and the ranks' batches concatenated are one device's, at W = 1, 2 and 4 (the
    last only where W divides the global batch)."""
    one = list(LayoutInvariantSampler(data(samples), global_batch, num_replicas=1, rank=0,
                                      seed=3, drop_last=False))  # fmt: skip
    assert sorted(one) == list(range(samples)) and len(one) == samples
    for world in (w for w in (2, 4) if global_batch % w == 0):
        ranks = [list(LayoutInvariantSampler(data(samples), global_batch, num_replicas=world,
                                             rank=r, seed=3, drop_last=False))
                 for r in range(world)]  # fmt: skip
        assert all(len(rows) == samples // world for rows in ranks)
        part = global_batch // world
        rebuilt = [row for start in range(0, samples // world, part)
                   for rows in ranks for row in rows[start : start + part]]  # fmt: skip
        assert rebuilt == one
