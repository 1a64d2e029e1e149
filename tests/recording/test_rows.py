"""The rows' fingerprints (`gatherlab.recording.rows`): a row is the same row however its batch is
padded, by its attention mask (named, or given beside the rows) or, without one, by the batch's
pad value where the batch shows it; rows that differ are told apart; and a plain loop over text
padded per device batch, recorded on one device and on two ranks, is one device's data."""

from __future__ import annotations

import pytest
import torch

from gatherlab.recording.rows import padding, paddings_together, resolved, row_digests, rows_of

SENTENCES = [[2, 7, 9, 3], [2, 5, 3], [2, 8, 8, 6, 11, 3], [2, 4, 3]]  # [CLS] … [SEP], pad 0


def padded(rows: list[list[int]], length: int | None = None, left: bool = False) -> torch.Tensor:
    """The rows padded with 0 to ``length`` (default the longest), on the right or the left."""
    length = length or max(len(row) for row in rows)
    pads = [[0] * (length - len(row)) for row in rows]
    return torch.tensor(
        [pad + row if left else row + pad for row, pad in zip(rows, pads, strict=True)]
    )


def alone(row: list[int]) -> str:
    """A row's digest computed on the row by itself, unpadded: what every padding must give."""
    return row_digests(torch.tensor([row]))[0]


@pytest.mark.parametrize("left", [False, True])
def test_a_row_is_the_same_row_however_its_batch_pads_it_by_its_attention_mask(left):
    expected = [alone(row) for row in SENTENCES]
    for batch in (SENTENCES, SENTENCES[:2], SENTENCES[1:], [SENTENCES[3], SENTENCES[2]]):
        for length in (None, 8, 12):
            ids = padded(batch, length, left)
            digests = row_digests({"input_ids": ids, "attention_mask": (ids != 0).long()})
            assert digests == [expected[SENTENCES.index(row)] for row in batch]
    assert len(set(expected)) == len(expected)  # the sentences are told apart


def test_a_mask_given_beside_the_rows_and_a_mapping_without_one_are_found():
    ids = padded(SENTENCES, 10)
    mask = (ids != 0).long()
    expected = [alone(row) for row in SENTENCES]
    assert row_digests(((ids, mask), {})) == expected  # model(ids, mask)
    assert row_digests(((), {"input_ids": ids, "attention_mask": mask.bool()})) == expected
    found, keep = rows_of(((ids,), {"labels": torch.zeros(4)}))  # no mask: the batch shows 0
    assert found is ids and keep is not None and row_digests(ids) == expected


def test_without_a_mask_the_pad_value_is_read_from_the_batch_where_it_shows():
    expected = [alone(row) for row in SENTENCES]
    # the end token 3 appears inside the padded rows: 0 is the pad, whichever ends more rows
    assert row_digests(padded(SENTENCES)) == expected
    assert row_digests(padded([SENTENCES[2], SENTENCES[1]])) == [expected[2], expected[1]]
    # one row padded by one 0 shows no pad alone: an unpadded row's end token, found nowhere
    # else, ends it in a run of one as often (random ids of one length, every batch "padded" by
    # another value: data differs at W = 2); the run's batches decide (`choice`, below)
    two = torch.tensor([[2, 8, 3, 0], [2, 9, 9, 3]])
    assert row_digests(two)[0] == alone([2, 8, 3, 0])
    assert padding(two).candidates[0][0] == (0,)
    # a pad value of the collator's own (-1 after a row ending in 0)
    other = torch.tensor([[5, 6, 0, -1, -1], [5, 7, 7, 7, 1]])
    assert row_digests(other) == [alone([5, 6, 0]), alone([5, 7, 7, 7, 1])]
    # no padding shown: rows of one length, one row; rows of floats are never cut
    assert row_digests(torch.tensor([[2, 5, 3], [2, 4, 3]])) == [expected[1], expected[3]]
    assert row_digests(torch.tensor([[2, 8, 3, 0, 0]]))[0] != alone([2, 8, 3])
    floats = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    assert rows_of(floats)[1] is None


def test_a_batch_that_cannot_show_its_pad_is_padded_as_the_runs_other_batches_show():
    """A job pads with one value. Two rows of a device's batch, the first padded by one 0 and the
    second ending in 17, a token nowhere else: 0 and 17 each end one row in a run of one, so
    either could pad the other row; the batch alone keeps every position (as before), the run's
    other batches, in which 0 padded, choose 0; seen as often, or neither seen, every position.
    Two unpadded rows of one length ending in 27 and in 27, 27 show 27 as their pad; where the
    run pads with 0, which ends no row here, every position is kept."""
    tied = torch.tensor([[5, 6, 7, 0], [8, 9, 10, 17]])
    found = padding(tied)
    assert found.keep is None and found.pad is None
    assert sorted(pad for pad, _ in found.candidates) == [(0,), (17,)]
    zero = dict(found.candidates)[(0,)]
    assert zero.tolist() == [[True, True, True, False], [True, True, True, True]]
    assert resolved(found, {(0,): 3}).tolist() == zero.tolist()
    assert resolved(found, {}) is None and resolved(found, {(0,): 2, (17,): 2}) is None
    assert row_digests(tied[:1, :3])[0] == alone([5, 6, 7])
    ending = torch.tensor([[4, 5, 27, 27], [6, 7, 8, 27]])
    shown = padding(ending)
    assert shown.pad == (27,) and shown.keep.tolist() == [[True, True, False, False]] * 1 + [
        [True, True, True, False]]  # fmt: skip
    assert resolved(shown, {(0,): 5}) is None  # the run's pad ends no row: none is padded
    assert resolved(shown, {}).tolist() == shown.keep.tolist()  # no run yet: the batch's own
    assert resolved(shown, {(0,): 5, (27,): 1}) is None
    padded_batch = padding(padded(SENTENCES))  # a batch that shows the run's pad
    assert resolved(padded_batch, {(0,): 9}).tolist() == padded_batch.keep.tolist()
    # micro-batches of one batch: each candidate's positions cut as the calls are
    halves = paddings_together([tied[:1], tied[1:]])
    assert [dict(h.candidates)[(0,)].tolist() for h in halves] == [[zero[0].tolist()],
                                                                   [zero[1].tolist()]]  # fmt: skip


def test_rows_that_differ_inside_or_in_their_tokens_count_are_told_apart():
    batch = padded([[2, 7, 9, 3], [2, 7, 9, 9, 3], [2, 7, 3]], 6)
    digests = row_digests({"input_ids": batch, "attention_mask": (batch != 0).long()})
    assert len(set(digests)) == 3


def test_padded_feature_sequences_with_a_mask_keep_their_real_positions():
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(3, 4, 5, generator=generator, dtype=torch.float64)
    lengths = [4, 2, 3]
    mask = torch.tensor([[1] * n + [0] * (4 - n) for n in lengths])
    batch = features * mask.unsqueeze(-1)
    digests = row_digests({"input_ids": batch, "attention_mask": mask})
    assert digests == [row_digests(batch[i : i + 1, :n])[0] for i, n in enumerate(lengths)]


@pytest.mark.slow
@pytest.mark.parametrize("mask", [False, True])
def test_a_loop_over_text_padded_per_device_batch_is_one_devices_data_at_w_2_and_4(tmp_path, mask):
    """Each rank pads its part of every global batch to its own longest; the comparison finds
    one device's rows at every update (no ``data differs``) and the run exact in float64. At
    W = 4 without a mask (two rows a rank) the batches' own ends cannot show the pad at three of
    the twelve: two rows whose ends tie at updates 0 and 2, and two unpadded rows ending in 27
    and in 27, 27 at update 2; the run's other batches show 0 (`rows.choice`)."""
    _is_one_devices_data_at_w_2_and_4(tmp_path, mask=mask)


@pytest.mark.slow
def test_unpadded_ids_of_one_length_without_a_mask_are_one_devices_data_at_w_2_and_4(tmp_path):
    """Random ids of one length, no padding and no mask (a language model's synthetic data): a
    batch's end tokens that appear nowhere else look like padding in runs of one, a different
    value in each device batch; a batch shows its own pad only in a run of two or more, and a
    run whose batches show none pads none (`rows.choice`), so the rows are one device's and the
    run exact (it was `data differs` at W = 2, a user's tensor-parallel job's false alarm)."""
    _is_one_devices_data_at_w_2_and_4(tmp_path, fixed=True)


def _is_one_devices_data_at_w_2_and_4(tmp_path, **loop) -> None:
    """`padded_loops.loop` (with ``loop``'s options) recorded on one device and on 2 and 4 ranks:
    the comparison finds one device's rows (no ``data differs``) and the run exact."""
    from recorded import record

    from gatherlab.compare import compare

    one = record(tmp_path / "one", 1, "padded_loops:loop", **loop)
    for world_size in (2, 4):
        many = record(tmp_path / f"w{world_size}", world_size, "padded_loops:loop", **loop)
        compared = compare(one, many)
        assert compared.data is None and (compared.verdict, compared.status) == ("exact", 0), (
            world_size, compared.words)  # fmt: skip


@pytest.mark.parametrize("width", [8, 300])
def test_rows_are_copied_when_seen_a_buffer_refilled_in_place_keeps_each_updates(tmp_path, width):
    """A job that refills one input tensor in place for every update (a reused buffer): each
    update's recorded digests are those of the rows it trained on, made by `row_digests` of each
    batch alone; rows of 8 elements are copied whole (`rows.Whole`), rows of 300 as their bits
    (`rows.sampled`)."""
    import gatherlab
    from gatherlab.recording.format import read

    torch.manual_seed(0)
    model = torch.nn.Linear(width, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.randn(4, width) for _ in range(3)]
    buffer = torch.empty(4, width)
    with gatherlab.record(model, optimizer, tmp_path / "run"):
        for batch in batches:
            buffer.copy_(batch)
            optimizer.zero_grad()
            model(buffer).square().mean().backward()
            optimizer.step()
    recorded = [update.rows[0] for update in read(tmp_path / "run").updates]
    assert recorded == [row_digests(batch) for batch in batches]
    assert len({digest for rows in recorded for digest in rows}) == 12
