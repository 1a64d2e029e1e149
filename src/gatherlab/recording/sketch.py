"""A linear sketch of a gradient: k numbers that keep what the comparison of two runs needs,
whatever the size of the gradient and however it is sharded (docs/recording.md §11, "The sketch").

A parameter of n elements, flattened row-major (global element index i), is cut into blocks of k
elements, block b = i // k; its sketch is the signed sum of its blocks,

    S(x)[j] = Σ_b σ_b · x[b·k + j]        (j = 0 … k−1; the last block zero-padded),

with a random sign σ_b = ±1 per block, drawn from a generator seeded by the sketch's seed and the
parameter's name (`signs`), the same in every run and on every rank. A part's sketch is the sum of
its parameters' sketches. It is linear, S(a·x + y) = a·S(x) + S(y), so:

- it is additive over shards: a rank that holds the elements [o, o + m) of a parameter sketches
  them at offset o (`sketch(shard, k, signs, offset=o)`), and the sum of the ranks' sketches is
  the whole gradient's, to rounding;
- it keeps equality and parallelism exactly: S(c·g) = c·S(g), so ``exact`` and a named factor
  (``1/W``, ``W``, …) read from two sketches are what the full gradients give;
- it estimates inner products without bias: E[⟨S(a), S(b)⟩] = ⟨a, b⟩ over the signs, with
  Var = Σ over pairs of elements sharing a column and not a block of (a_p² b_q² + a_p b_p a_q b_q),
  ≈ (‖a‖²‖b‖² + ⟨a,b⟩²)/k when the gradient's energy is spread over the k columns (i mod k).

One sketch costs one pass over the gradient (the signs against the blocks, `_signed_sum`) and k
numbers per part; what is kept per parameter is its n/k signs, nothing per element.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

__all__ = ["DEFAULT_K", "signs", "sketch"]

DEFAULT_K = 251
"""The sketch's size per part: 251 float64 numbers, 2 KB per part and update. A prime, so that no
power-of-two row length of a weight matrix lines up with the columns (element i's column is
i mod k): with k = 256 the rows of a 128 × 64 weight share their columns feature by feature, and
the cosine's measured standard deviation was 1.9 times the formula's (docs/recording.md §11)."""


def signs(name: str, numel: int, k: int, seed: int) -> torch.Tensor:
    """The random sign of each of the ceil(numel / k) blocks of parameter ``name`` (float64 ±1),
    the same in every run, on every rank, for the same (name, numel, k, seed)."""
    generator = np.random.default_rng([seed, zlib.crc32(name.encode()), len(name)])
    blocks = -(-numel // k)
    return torch.from_numpy(generator.integers(0, 2, blocks).astype(np.float64) * 2 - 1)


_PIECES = 16
"""The aligned blocks are summed as this many pieces of rows in one batched matrix product, and
the pieces' sums added in float64: a batched product (BLAS gemm) took 0.15 ms for a 1600 × 1600
float32 gradient here where the matrix-vector product took 1.5 ms, and each piece's sum is
shorter (float32's rounding 4e-7 of the sketch against 1.6e-6 in one piece)."""


def _signed_sum(blocks: torch.Tensor, block_signs: torch.Tensor) -> torch.Tensor:
    """Σ_b σ_b · blocks[b] in float64, the rows cut into `_PIECES` pieces."""
    rows = blocks.shape[0]
    pieces = _PIECES if rows >= 4 * _PIECES else 1
    even = rows // pieces * pieces
    summed = torch.bmm(
        block_signs[:even].view(pieces, 1, even // pieces),
        blocks[:even].view(pieces, even // pieces, blocks.shape[1]),
    ).double().sum(0).view(-1)  # fmt: skip
    if even < rows:
        summed += (block_signs[even:].view(1, -1) @ blocks[even:]).double().view(-1)
    return summed


def sketch(
    values: torch.Tensor, k: int, block_signs: torch.Tensor, offset: int = 0
) -> torch.Tensor:
    """The sketch (k float64 numbers on the CPU) of ``values``, the elements of a parameter from
    its flat index ``offset`` on (all of it at offset 0), with that parameter's `signs`.

    The aligned blocks are one batched product (`_signed_sum`); a shard whose ends fall inside a
    block adds its partial blocks at their columns."""
    flat = values.detach().reshape(-1)
    if flat.dtype not in (torch.float64, torch.float32):  # half precisions: summed in float32
        flat = flat.float()
    out = torch.zeros(k, dtype=torch.float64)
    start, stop = offset, offset + flat.numel()
    head_stop = min(stop, -(-start // k) * k)  # the end of the block that ``offset`` falls in
    if head_stop > start:
        block = start // k
        column = start - block * k
        out[column : column + head_stop - start] += (
            flat[: head_stop - start].double() * block_signs[block]
        )
    aligned_stop = head_stop + (stop - head_stop) // k * k
    if aligned_stop > head_stop:
        first, last = head_stop // k, aligned_stop // k
        blocks = flat[head_stop - start : aligned_stop - start].view(last - first, k)
        out += _signed_sum(blocks, block_signs[first:last].to(flat.dtype))
    if stop > aligned_stop:
        block = aligned_stop // k
        out[: stop - aligned_stop] += flat[aligned_stop - start :].double() * block_signs[block]
    return out
