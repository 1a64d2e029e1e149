"""The rows a job's model is given, fingerprinted: a 64-bit digest per row of the batch's rows
(``input_ids`` where a call names them, else its first tensor), of its elements' bits, its shape
and dtype, equal for equal rows in every run (docs/recording.md §11, "What is recorded").

A row is the same row however its batch is padded. Text is padded to each device batch's longest
row (a tokenizer's ``padding=True``, a collator), so one sentence is a row of 9 tokens in one run
and of 12 in another; only its tokens are fingerprinted (`kept`): the positions its attention
mask keeps (the call's ``attention_mask``, or a tensor of 0s and 1s of the rows' positions given
beside them), else, for rows of integers (token ids) with no mask, the positions before a
trailing run of the batch's pad value, where the batch shows one (`_trailing_padding`). The rows
are copied when they are seen (`seen`: small rows whole, others their bits) and digested many at
once when the recording is written (`digests`).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gatherlab.recording.format import hexadecimal

__all__ = [
    "Padding", "Sampled", "Whole", "choice", "chosen", "digests", "first_tensor", "given_rows",
    "hexadecimal", "kept", "kept_together", "padding", "paddings_together", "resolved",
    "row_digests", "rows_of", "sampled", "sampled_bits", "seen", "unmasked_ids",
]  # fmt: skip

_SAMPLED = 256
"""A row of more elements is digested from at most this many of them, evenly spaced (an image's, a
long sequence's): rows that differ anywhere differ in almost every element in practice (another
sample, crop or augmentation), and hashing whole rows cost a 10M-parameter MLP's update 6 %."""


def row_digests(batch: Any) -> list[str]:
    """A 16-hex-digit digest of each row of ``batch`` (a tensor, or a call's inputs: `rows_of`),
    of its elements' bits (its padding left out: `kept`), its shape and dtype; equal rows have
    equal digests in every run (`sampled`, `digests`)."""
    found = rows_of(batch)
    if found is None:
        return []
    return hexadecimal(digests([sampled(*found)])[0])


# --- which rows, and which of their positions --------------------------------------------------


def given_rows(value: Any) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The rows a call's inputs ``value`` hold (as `rows_of` finds them) and the attention mask
    given beside them (None where there is none); None when ``value`` holds no tensor."""
    rows = _named_ids(value)
    rows = rows if rows is not None else first_tensor(value)
    return None if rows is None else (rows, _mask_in(value, rows))


def unmasked_ids(rows: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether ``rows`` are rows of integers (token ids) given without a mask, whose padding the
    batch shows (`_trailing_padding`)."""
    return (
        mask is None
        and rows.dim() >= 2
        and not (rows.is_floating_point() or rows.is_complex() or rows.dtype == torch.bool)
    )


def kept_together(calls: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """`kept` of each of an update's calls of token ids without a mask (`unmasked_ids`), their
    padding found over every call of one shape together (`paddings_together`)."""
    return [found.keep for found in paddings_together(calls)]


def paddings_together(calls: list[torch.Tensor]) -> list[Padding]:
    """The `Padding` of each of an update's calls of token ids without a mask (`unmasked_ids`),
    found over every call of one shape together: a pipeline's micro-batches are cut from one
    padded batch, and a micro-batch of two rows padded alike shows no padding of its own, where
    the batch does (a digest of its padded rows would differ from one device's)."""
    found = [Padding(None)] * len(calls)
    shapes: dict[tuple, list[int]] = {}
    for i, rows in enumerate(calls):
        shapes.setdefault((tuple(rows.shape[1:]), rows.dtype), []).append(i)
    for members in shapes.values():
        together = padding(torch.cat([calls[i] for i in members]).detach().cpu())
        counts = [len(calls[i]) for i in members]
        pieces = [None] * len(members) if together.keep is None else together.keep.split(counts)
        cut = [(pad, keep.split(counts)) for pad, keep in together.candidates]
        for j, (i, piece) in enumerate(zip(members, pieces, strict=True)):
            found[i] = Padding(piece, together.pad, tuple((pad, keeps[j]) for pad, keeps in cut))
    return found


@dataclass(frozen=True)
class Padding:
    """What a batch of token ids without a mask shows of its padding (`padding`): the positions
    before each row's trailing run of its pad value (``keep``; None: every position) and that
    value (``pad``, its elements as a tuple; None where the batch shows none), and every value
    that could pad it (``candidates``: each and the positions it would leave; a value that ends
    rows and appears nowhere else). Which of them pads only the run's other batches tell where
    the batch cannot (`choice`): two rows of a device's batch, one ending in one pad and the
    other in a token that appears nowhere else, tie; rows of one length ending alike in runs of
    other lengths show a pad that is none."""

    keep: torch.Tensor | None
    pad: tuple | None = None
    candidates: tuple[tuple[tuple, torch.Tensor], ...] = ()


def resolved(found: Padding, seen: Mapping[tuple, int]) -> torch.Tensor | None:
    """The positions a call's rows keep, as `choice` chooses their pad value."""
    pad = choice(found.pad, [value for value, _ in found.candidates], seen)
    return None if pad is None else dict(found.candidates)[pad]


NO_PAD: tuple = ()
"""What a batch of token ids without a mask counts in a run's ``seen`` where it shows no pad of its
own (`choice`): a run whose batches mostly show none pads none, whatever a batch's ends suggest."""


def choice(
    own: tuple | None, candidates: Sequence[tuple], seen: Mapping[tuple, int]
) -> tuple | None:
    """The pad value whose trailing runs a call's rows leave out (None: none): the run's, the
    value that padded the most of its batches on every rank so far (``seen``: each value's
    number of batches that showed it as their pad), if it could pad this batch (``candidates``),
    else none (the value this batch alone shows, ``own``, pads nothing elsewhere); none where
    the run's batches mostly showed no pad (`NO_PAD`); the batch's own where the run has none
    yet, or several as often. A job pads with one value."""
    run = chosen(list(seen), seen)
    if run == NO_PAD:
        return None
    if run is None:
        return own
    return run if run in candidates else None


def chosen(values: Sequence[tuple], seen: Mapping[tuple, int]) -> tuple | None:
    """Of ``values``, the one that padded the most of the run's batches (``seen``); None where
    none did, or several as often."""
    counts = sorted(((seen.get(value, 0), value) for value in values), reverse=True)
    if not counts:
        return None
    best, second = counts[0][0], counts[1][0] if len(counts) > 1 else 0
    return counts[0][1] if best > second else None


def rows_of(value: Any) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The rows a call's inputs ``value`` hold (a tensor, or tuples, lists and mappings of them:
    ``(args, kwargs)``, a batch) and the positions of each row to fingerprint (`kept`): the
    ``input_ids`` of the first mapping that names them, else the first tensor; None when ``value``
    holds no tensor."""
    named = _named_ids(value)
    if named is not None:
        return named, kept(named, _mask_in(value, named))
    rows = first_tensor(value)
    if rows is None:
        return None
    return rows, kept(rows, _mask_in(value, rows))


def _named_ids(value: Any) -> torch.Tensor | None:
    """The ``input_ids`` tensor of the first mapping in ``value`` (depth first) that has one."""
    if isinstance(value, Mapping):
        ids = value.get("input_ids")
        if isinstance(ids, torch.Tensor):
            return ids
    items = value.values() if isinstance(value, Mapping) else value
    if isinstance(value, Mapping | list | tuple):
        for item in items:
            if (found := _named_ids(item)) is not None:
                return found
    return None


def _tensors(value: Any, named: str | None = None) -> list[tuple[str | None, torch.Tensor]]:
    """Every tensor in ``value``, depth first, with the key it is held under in a mapping."""
    if isinstance(value, torch.Tensor):
        return [(named, value)]
    if isinstance(value, Mapping):
        return [pair for key, item in value.items() for pair in _tensors(item, str(key))]
    if isinstance(value, list | tuple):
        return [pair for item in value for pair in _tensors(item)]
    return []


def _is_mask(tensor: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether ``tensor`` can be the attention mask of ``rows``: one entry per row and position,
    0s and 1s (bool or integer)."""
    if rows.dim() < 2 or tuple(tensor.shape) != tuple(rows.shape[:2]):
        return False
    if tensor.dtype != torch.bool and (tensor.is_floating_point() or tensor.is_complex()):
        return False
    return bool(((tensor == 0) | (tensor == 1)).all())


def _mask_in(value: Any, rows: torch.Tensor) -> torch.Tensor | None:
    """The attention mask the call gives beside ``rows``: a tensor held as ``attention_mask``,
    else the first tensor after the rows of 0s and 1s at the rows' positions; None when there is
    none."""
    tensors = _tensors(value)
    for key, tensor in tensors:
        if key == "attention_mask" and _is_mask(tensor, rows):
            return tensor
    after = False
    for key, tensor in tensors:
        if tensor is rows:
            after = True
        elif after and key is None and _is_mask(tensor, rows):
            return tensor
    return None


def kept(rows: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """Which positions (dimension 1) of each row are fingerprinted, a (rows, positions) bool
    tensor, or None for all of them: those ``mask`` keeps (an attention mask; left or right
    padding alike), else, for rows of integers with no mask, those before the trailing run of
    the batch's pad value (`_trailing_padding`)."""
    if mask is not None:
        return mask.detach().bool().cpu()
    if rows.dim() < 2 or rows.is_floating_point() or rows.is_complex() or rows.dtype == torch.bool:
        return None
    return _trailing_padding(rows.detach().cpu())


def _trailing_padding(rows: torch.Tensor) -> torch.Tensor | None:
    """`padding`'s positions: None where the batch shows no padding or values tie."""
    return padding(rows).keep


def padding(rows: torch.Tensor) -> Padding:
    """The positions before each row's trailing run of the pad value, where the batch shows which
    value pads it. A pad value appears in no row but in its trailing run (a sentence's end token
    appears inside every padded row, before its padding), and some row ends otherwise (the
    longest, which padding to the batch's longest leaves whole); of the values that qualify, the
    one that ends the most rows, with the longest run, unless another ends as many with runs as
    long, and only where that run is two or more long (an unpadded row's end token, found nowhere
    else in the batch, ends it in a run of one as often: every such value is a candidate, for the
    run's batches to choose, `choice`); where every row ends alike (all padded, to a length
    past the longest), that value if its runs differ in length. None (every position kept) where
    the batch shows no padding: one row, rows that all end alike in runs of one length, runs of
    one alone, or an ambiguous end. Two runs' batches of one row then keep the same positions: a
    padded row its own tokens, an unpadded row all of them. What it cannot tell: rows of one
    length all padded by as many (kept padded), and, in a batch of unpadded rows of one length
    whose end tokens repeat only at the ends (no end token appended), the commonest end is taken
    for padding where it repeats there; an attention mask given with the rows decides instead
    (`kept`). Values that qualify alike are `Padding.ties`."""
    count, length = rows.shape[:2]
    if count < 2 or length < 2:
        return Padding(None)
    positions = rows.reshape(count, length, -1)
    ends, ending = torch.unique(positions[:, -1], dim=0, return_counts=True)
    qualified = []
    for candidate in ending.argsort(descending=True)[:_CANDIDATES].tolist():
        equal = (positions == ends[candidate]).all(-1)
        trailing = equal.flip(1).cumprod(1).flip(1).bool()
        if not (equal & ~trailing).any():  # only in trailing runs: it may be padding
            runs = trailing.sum(1)
            pad = tuple(ends[candidate].tolist())
            qualified.append((int(ending[candidate]), int(runs.max()), trailing, runs, pad))
    candidates = tuple((found[4], ~found[2]) for found in qualified)
    if len(ends) == 1:  # every row ends alike: padding where the runs differ in length
        if qualified and len(set(qualified[0][3].tolist())) > 1:
            return Padding(~qualified[0][2], qualified[0][4], candidates)
        return Padding(None, None, candidates)
    qualified.sort(key=lambda found: found[:2], reverse=True)
    if len(qualified) > 1 and qualified[0][:2] == qualified[1][:2]:  # values tie: none shows
        return Padding(None, None, candidates)
    if not qualified or qualified[0][1] < 2:  # runs of one: what unpadded rows' ends make too
        return Padding(None, None, candidates)
    return Padding(~qualified[0][2], qualified[0][4], candidates)


_CANDIDATES = 4
"""The most common ends of a batch's rows weighed as its pad value (`_trailing_padding`)."""


# --- the rows' bits, copied when seen; their digests, made many at once -------------------------


@dataclass(frozen=True)
class Sampled:
    """What the digests of a call's rows are made of, copied when the rows are seen: ``pieces``,
    each a description (the rows' kept shape and dtype) and its rows' element bits (at most
    `_SAMPLED` of them, evenly spaced) as 64-bit integers, a row each; ``order``, the position of
    each row of the pieces (concatenated) in the call (None: in order)."""

    pieces: list[tuple[str, np.ndarray]]
    order: np.ndarray | None = None

    def __len__(self) -> int:
        return sum(len(bits) for _, bits in self.pieces)


class Whole:
    """A call's rows copied whole when seen, their bits taken (`Whole.sampled`) when they are
    digested: rows of at most `_SAMPLED` elements with no positions to leave out (`seen`)."""

    __slots__ = ("rows",)

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def sampled(self) -> Sampled:
        """`sampled` of the rows, as it would have been made when they were seen."""
        return Sampled([_piece(self.rows)])


def seen(rows: torch.Tensor, mask: torch.Tensor | None) -> Sampled | Whole | torch.Tensor:
    """A call's rows as the recorder keeps them until they are digested, copied now (the job may
    change the tensor in place afterwards): token ids without a mask whole (`unmasked_ids`: their
    padding is found with the update's other calls', `paddings_together`); rows with nothing to
    leave out and at most `_SAMPLED` elements each in one copy (`Whole`: one torch operation on
    the training's thread, 25 µs after a backward here where `sampled`'s took 60); any other the
    bits `sampled` keeps of them."""
    if unmasked_ids(rows, mask):
        return rows.detach().to("cpu", copy=True)
    if mask is None and rows.dim() and rows.numel() <= _SAMPLED * len(rows):
        return Whole(rows.detach().to("cpu", copy=True))
    return sampled(rows, kept(rows, mask))


def sampled(batch: torch.Tensor, keep: torch.Tensor | None = None) -> Sampled:
    """The rows of ``batch`` (its first dimension), each cut to the positions ``keep`` marks
    (`kept`; None: whole), as `Sampled`: rows of one kept length are one piece."""
    if keep is None or batch.dim() < 2:
        return Sampled([_piece(batch)])
    lengths = keep.sum(1)
    pieces, order = [], []
    for length in torch.unique(lengths).tolist():
        members = (lengths == length).nonzero().flatten()
        cut = torch.stack([batch[i][keep[i].to(batch.device)] for i in members.tolist()])
        pieces.append(_piece(cut))
        order.append(members.numpy())
    return Sampled(pieces, np.concatenate(order))


def _piece(batch: torch.Tensor) -> tuple[str, np.ndarray]:
    """One description and its rows' bits (`Sampled`'s pieces)."""
    rows = batch.detach()
    if rows.dim() != 2:
        rows = rows.reshape(rows.shape[0], -1) if rows.dim() else rows.reshape(1, 1)
    if rows.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits as int16
        rows = rows.view(torch.int16)
    array = rows.numpy() if rows.device.type == "cpu" else rows.cpu().numpy()
    return _bits(f"{tuple(batch.shape[1:])} {batch.dtype}", array)


def _bits(description: str, array: np.ndarray) -> tuple[str, np.ndarray]:
    """A piece of rows (a 2-D array) as `_piece` makes it: at most `_SAMPLED` elements of each
    row, their bits as 64-bit integers (a copy)."""
    width = array.shape[1]
    if width > _SAMPLED:  # every s-th element, s the least stride that leaves at most _SAMPLED
        array = array[:, :: -(-width // _SAMPLED)]  # (numpy's strided copy: torch's took 3 ms)
    return description, array.view(_UNSIGNED[array.dtype.itemsize]).astype(np.uint64)


_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
"""The unsigned integers of each width, whose values are an element's bits (`_bits`)."""


def sampled_bits(matrix: np.ndarray) -> Sampled:
    """`sampled` of a float64 torch tensor's rows, given as the numpy array of its values
    (the recorder's samples of its weights, `Recorder._weights_digests`): the same digests."""
    return Sampled([_bits(f"{tuple(matrix.shape[1:])} {torch.float64}",
                          np.ascontiguousarray(matrix, dtype=np.float64))])  # fmt: skip


def digests(samples: list[Sampled]) -> list[np.ndarray]:
    """Each sample's rows' 64-bit digests, in the call's order (`row_digests`' numbers), the
    pieces of one description mixed in one pass. The digest, modulo 2⁶⁴: h = key + Σ_i
    mix(bits_i + r_i), with a random offset r_i per position and mix SplitMix64's finaliser (a
    bijection that spreads every input bit over the output); a sum of linear terms instead would
    let two sign flips of float64 cancel."""
    pieces = [piece for sample in samples for piece in sample.pieces]
    made: list[np.ndarray | None] = [None] * len(pieces)
    kinds: dict[tuple[str, int], list[int]] = {}
    for position, (description, bits) in enumerate(pieces):
        kinds.setdefault((description, bits.shape[1]), []).append(position)
    for (description, width), positions in kinds.items():
        key, offsets = _hash_of(description, width)
        summed = _mixed_sums(np.concatenate([pieces[i][1] for i in positions]), offsets) + key
        ends = np.cumsum([len(pieces[i][1]) for i in positions])
        for i, part in zip(positions, np.split(summed, ends[:-1]), strict=True):
            made[i] = part
    out, taken = [], 0
    for sample in samples:
        joined = np.concatenate(made[taken : taken + len(sample.pieces)])
        taken += len(sample.pieces)
        if sample.order is not None:
            ordered = np.empty_like(joined)
            ordered[sample.order] = joined
            joined = ordered
        out.append(joined)
    return out


def _mixed_sums(bits: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Σ_i mix(bits_i + r_i) of each row (modulo 2⁶⁴), in chunks of `_CHUNK` elements that stay
    in the cache, each step in place (`digests`): 1.9 times faster than whole-array steps on 2,048
    rows of 64 measured here (0.38 ms, 0.72 before)."""
    rows = max(1, _CHUNK // max(bits.shape[1], 1))
    out = np.empty(len(bits), np.uint64)
    mixed = np.empty((min(rows, len(bits)), bits.shape[1]), np.uint64)
    shifted = np.empty_like(mixed)
    for start in range(0, len(bits), rows):
        chunk = bits[start : start + rows]
        m, t = mixed[: len(chunk)], shifted[: len(chunk)]
        np.add(chunk, offsets, out=m)
        for shift, multiplier in zip(_SHIFTS, (*_MULTIPLIERS, None), strict=True):
            np.right_shift(m, shift, out=t)
            m ^= t
            if multiplier is not None:
                m *= multiplier
        np.sum(m, axis=1, dtype=np.uint64, out=out[start : start + len(chunk)])
    return out


_CHUNK = 1 << 14
"""The elements `_mixed_sums` mixes at once (128 KiB of 64-bit numbers, twice)."""
_SHIFTS = (np.uint64(30), np.uint64(27), np.uint64(31))
_MULTIPLIERS = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


@functools.lru_cache(maxsize=64)
def _hash_of(description: str, width: int) -> tuple[np.uint64, np.ndarray]:
    """The key and the positions' random offsets for rows of this shape and dtype (drawn once)."""
    key = int.from_bytes(hashlib.blake2b(description.encode(), digest_size=8).digest(), "little")
    generator = np.random.default_rng([key & 0xFFFFFFFF, key >> 32, width])
    return np.uint64(key), generator.integers(0, 2**64, width, dtype=np.uint64, endpoint=False)


def first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, Mapping) else value
    if isinstance(items, list | tuple) or isinstance(value, Mapping):
        for item in items:
            if (found := first_tensor(item)) is not None:
                return found
    return None
