"""The rows a job's model is given, fingerprinted: a 64-bit digest per row of the batch's first
tensor, of its elements' bits, its shape and dtype, equal for equal rows in every run
(docs/design.md §11, "What is recorded"). The rows' bits are copied when they are seen
(`sampled`) and digested many at once when the recording is written (`digests`).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["digests", "first_tensor", "hexadecimal", "row_digests", "sampled"]

_SAMPLED = 256
"""A row of more elements is digested from at most this many of them, evenly spaced (an image's, a
long sequence's): rows that differ anywhere differ in almost every element in practice (another
sample, crop or augmentation), and hashing whole rows cost a 10M-parameter MLP's update 6 %."""


def row_digests(batch: torch.Tensor) -> list[str]:
    """A 16-hex-digit digest of each row of ``batch`` (its first dimension), of its elements'
    bits, its shape and dtype; equal rows have equal digests in every run (`sampled`,
    `digests`)."""
    return hexadecimal(digests([sampled(batch)])[0])


def hexadecimal(numbers: np.ndarray) -> list[str]:
    """Each 64-bit digest as 16 hexadecimal digits."""
    text = numbers.astype(">u8").tobytes().hex()  # big-endian: each number's 16 digits in order
    return [text[i : i + 16] for i in range(0, len(text), 16)]


def sampled(batch: torch.Tensor) -> tuple[str, np.ndarray]:
    """What a row's digest is made of, copied when the rows are seen: the batch's description
    (its row shape and dtype) and each row's element bits (at most `_SAMPLED` of them, evenly
    spaced) as 64-bit integers, a row each. The digests of many are made at once (`digests`)."""
    rows = batch.detach()
    rows = rows.reshape(rows.shape[0], -1) if rows.dim() else rows.reshape(1, 1)
    if rows.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits as int16
        rows = rows.view(torch.int16)
    array = rows.cpu().numpy()
    width = array.shape[1]
    if width > _SAMPLED:  # every s-th element, s the least stride that leaves at most _SAMPLED
        array = array[:, :: -(-width // _SAMPLED)]  # (numpy's strided copy: torch's took 3 ms)
    return f"{tuple(batch.shape[1:])} {batch.dtype}", array.view(
        f"u{array.dtype.itemsize}").astype(np.uint64)  # fmt: skip


def digests(samples: list[tuple[str, np.ndarray]]) -> list[np.ndarray]:
    """Each sample's rows' 64-bit digests (`row_digests`' numbers), the samples of one
    description mixed in one pass. The digest, modulo 2⁶⁴: h = key + Σ_i mix(bits_i + r_i),
    with a random offset r_i per position and mix SplitMix64's finaliser (a bijection that spreads
    every input bit over the output); a sum of linear terms instead would let two sign flips of
    float64 cancel."""
    out: list[np.ndarray | None] = [None] * len(samples)
    kinds: dict[tuple[str, int], list[int]] = {}
    for position, (description, bits) in enumerate(samples):
        kinds.setdefault((description, bits.shape[1]), []).append(position)
    for (description, width), positions in kinds.items():
        key, offsets = _hash_of(description, width)
        mixed = np.concatenate([samples[i][1] for i in positions]) + offsets  # in place below
        mixed ^= mixed >> _SHIFTS[0]
        mixed *= _MULTIPLIERS[0]
        mixed ^= mixed >> _SHIFTS[1]
        mixed *= _MULTIPLIERS[1]
        mixed ^= mixed >> _SHIFTS[2]
        summed = mixed.sum(axis=1, dtype=np.uint64) + key
        ends = np.cumsum([len(samples[i][1]) for i in positions])
        for i, part in zip(positions, np.split(summed, ends[:-1]), strict=True):
            out[i] = part
    return out


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
