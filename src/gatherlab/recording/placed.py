"""Where each element of a ``DTensor``'s local shard lies in the whole tensor, so that a rank
sketches its shard at the elements' global positions and the ranks' sketches add up to the whole
tensor's (docs/recording.md §11, "What is recorded" and "The sketch").

A DTensor's ``placements`` say, per mesh dimension, how the whole tensor is laid out over it:

- ``Shard(d)``: tensor dimension d cut with ``torch.chunk``'s semantics over the mesh dimension
  (the last pieces empty where it does not divide), as DTensor's ``Shard`` documents;
  placements are applied left to right, each cutting what the previous left on this rank;
- ``_StridedShard(d, split_factor=f)``: FSDP2 over tensor parallelism (``fully_shard`` after
  ``parallelize_module``), a right-to-left sharding written left to right: dimension d cut in f
  pieces, each piece cut over the mesh dimension, and the rank's pieces concatenated (its
  docstring's definition, which ``Shard._split_tensor`` implements with ``torch.chunk``). The
  class is private to torch; it is the only description torch gives of that layout, read here by
  its ``dim`` and ``split_factor`` (``tests/recording/test_placed.py`` fails if its meaning or
  its name changes);
- ``Replicate()``: every coordinate holds the same values. The ranks along a replicated mesh
  dimension are copies: each copy's ranks sum to the whole tensor, and the copies are compared
  (an unreduced gradient is one whose copies differ);
- ``Partial()``: the whole tensor is the reduction of the ranks' values. A partial gradient (a
  replicated parameter's under sequence parallelism, ``Partial(sum)``) is reduced first
  (``DTensor.redistribute`` to ``Replicate`` on those mesh dimensions, an all-reduce of the
  shard that every rank of the mesh makes, as the optimizer's own step makes it): its norm is
  not the sum of the parts' norms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gatherlab.recording import sketch

__all__ = [
    "Placed", "RowGroup", "is_sharded", "local", "placed", "row_group", "sketched", "whole_here",
]  # fmt: skip

_CHUNK = 1 << 22
"""The most elements whose global positions are made at once (8 bytes each) for a shard that is
not one contiguous range of the whole tensor."""


@dataclass(frozen=True)
class Placed:
    """A rank's values of a tensor and where they lie in the whole: ``indices`` (one per tensor
    dimension, the global index of each local position along it), ``group`` (the global ranks
    whose values sum to the whole tensor: this rank's copy; a plain tensor's is this rank)."""

    local: torch.Tensor
    shape: tuple[int, ...]
    indices: tuple[torch.Tensor, ...] | None
    group: tuple[int, ...]

    def offset(self) -> int | None:
        """The flat global index of the first local element when the local elements are one
        contiguous range of the whole tensor (row-major), else None."""
        if self.indices is None:
            return 0
        shape, indices = self.shape, self.indices
        if self.local.numel() == 0:
            return 0
        if not all(bool((i.diff() == 1).all()) for i in indices):  # each a run of indices
            return None
        # contiguous: the dims before the first cut one hold one index, the ones after it are whole
        cut = next((d for d, i in enumerate(indices) if len(i) != shape[d]), len(shape))
        if any(len(i) != 1 for i in indices[:cut]) or any(
            len(i) != shape[d] for d, i in enumerate(indices) if d > cut
        ):
            return None
        strides = _strides(shape)
        return sum(int(i[0]) * s for i, s in zip(indices, strides, strict=True))


def _strides(shape: tuple[int, ...]) -> list[int]:
    return [math.prod(shape[d + 1 :]) for d in range(len(shape))]


def _dtensor() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


def _strided_type() -> type:
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard


def _chunk(indices: torch.Tensor, pieces: int, index: int) -> torch.Tensor:
    """``torch.chunk``'s piece ``index`` of ``pieces``, empty where chunk gives fewer."""
    chunks = torch.chunk(indices, pieces)
    return chunks[index] if index < len(chunks) else indices[:0]


def _strided(indices: torch.Tensor, factor: int, pieces: int, index: int) -> torch.Tensor:
    """``_StridedShard``'s piece ``index``: ``indices`` cut in ``factor`` pieces, each cut in
    ``pieces``, this rank's piece of each concatenated."""
    return torch.cat([_chunk(part, pieces, index) for part in _chunk_all(indices, factor)])


def _chunk_all(indices: torch.Tensor, pieces: int) -> list[torch.Tensor]:
    return [_chunk(indices, pieces, i) for i in range(pieces)]


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor cut over a mesh dimension (``Shard``, ``_StridedShard``)."""
    if not isinstance(tensor, _dtensor()):
        return False
    return any(p.is_shard() or isinstance(p, _strided_type()) for p in tensor.placements)


def whole_here(tensor: torch.Tensor) -> bool:
    """Whether this rank holds all of ``tensor``'s values as one tensor: a plain tensor, or a
    DTensor on a mesh of one rank (FSDP2 under ``torchrun --nproc-per-node 1``), whose local
    tensor is the whole, to the bit (one shard, one copy, a sum of one)."""
    return not isinstance(tensor, _dtensor()) or tensor.device_mesh.size() == 1


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor, a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, _dtensor()) else tensor


def placed(tensor: torch.Tensor, rank: int) -> Placed:
    """This rank's values of ``tensor`` and where they lie (`Placed`): a plain tensor whole, on its
    own, as a DTensor on a mesh of one rank (`whole_here`); a DTensor's local shard at its global
    indices, its group the ranks of its mesh that differ from this one only along cut or partial
    mesh dimensions. A placement of another kind, or a local shard of another shape than the
    placements give, is a NotImplementedError."""
    if whole_here(tensor):  # a plain tensor's values, whatever holds them
        return Placed(local(tensor), tuple(tensor.shape), None, (rank,))
    from torch.distributed.tensor import Replicate

    placements = tensor.placements
    if any(p.is_partial() for p in placements):  # reduced first: an all-reduce of the shard
        with torch.no_grad():
            reduced = [Replicate() if p.is_partial() else p for p in placements]
            tensor = tensor.redistribute(tensor.device_mesh, reduced)
        placements = tensor.placements
    mesh, shape = tensor.device_mesh, tuple(tensor.shape)
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank holds none of it
        return Placed(tensor.to_local()[:0], shape, None, (rank,))
    indices = [torch.arange(n) for n in shape]
    for mesh_dim, placement in enumerate(placements):
        pieces, index = mesh.size(mesh_dim), coordinate[mesh_dim]
        if isinstance(placement, _strided_type()):
            factor = int(placement.split_factor)
            indices[placement.dim] = _strided(indices[placement.dim], factor, pieces, index)
        elif placement.is_shard():
            indices[placement.dim] = _chunk(indices[placement.dim], pieces, index)
        elif not placement.is_replicate():
            raise NotImplementedError(
                f"gatherlab.record cannot place a DTensor with placement {placement} "
                f"({placements}); allowed: Shard, _StridedShard, Replicate, Partial"
            )
    shard = tensor.to_local()
    if tuple(shard.shape) != tuple(len(i) for i in indices):
        raise NotImplementedError(
            f"a DTensor shard of shape {tuple(shard.shape)} where its placements {placements} "
            f"give {tuple(len(i) for i in indices)}: gatherlab.record cannot place it"
        )
    at = tuple(slice(None) if not p.is_replicate() else c
               for p, c in zip(placements, coordinate, strict=True))  # fmt: skip
    group = tuple(int(r) for r in mesh.mesh[at].reshape(-1).tolist())
    return Placed(shard, shape, tuple(indices), group)


def sketched(held: Placed, k: int, block_signs: torch.Tensor) -> torch.Tensor:
    """The sketch (k float64 numbers) of the whole tensor's values that ``held`` holds, each at
    its global position (the others zero): one contiguous range in one call of
    `gatherlab.recording.sketch.sketch`, else element by element (each element's block and
    column from its flat global index, `_CHUNK` elements at a time)."""
    offset = held.offset()
    if offset is not None:
        return sketch.sketch(held.local, k, block_signs, offset)
    local = held.local.detach()
    if local.dtype not in (torch.float64, torch.float32):
        local = local.float()
    strides = _strides(held.shape)
    rest = torch.zeros((), dtype=torch.long)  # the flat offsets of the dimensions after the first
    for d in range(1, len(held.shape)):
        rest = rest.unsqueeze(-1) + held.indices[d] * strides[d]
    rest = rest.reshape(-1)
    rows = max(1, _CHUNK // max(rest.numel(), 1))
    flat_local = local.reshape(len(held.indices[0]), -1)
    out = torch.zeros(k, dtype=torch.float64)
    for start in range(0, len(held.indices[0]), rows):
        first = held.indices[0][start : start + rows] * strides[0]
        flat = (first.unsqueeze(-1) + rest).reshape(-1)
        block = torch.div(flat, k, rounding_mode="floor")
        values = flat_local[start : start + rows].reshape(-1).double() * block_signs[block]
        out.index_add_(0, flat - block * k, values)
    return out


@dataclass(frozen=True)
class RowGroup:
    """The ranks that train the same rows as this one under tensor parallelism (``ranks``, in
    order, this rank among them; just this rank without it) and how sure the parameters make it
    (``sure``: some parameter is cut on a dimension other than 0, partial, or replicated beside
    others that are cut, along the group's mesh dimension; else only cut on dimension 0 while
    other parameters are not on the mesh, as FSDP2 over a part of the model also leaves them)."""

    ranks: tuple[int, ...]
    sure: bool = True


def row_group(parameters: list[torch.Tensor], rank: int, fsdp: bool = True) -> RowGroup:
    """This rank's tensor-parallel group, read from the model's ``DTensor`` parameters
    (docs/recording.md §11, "Tensor parallelism's rows"). A mesh dimension is tensor-parallel when
    its parameters are laid out unevenly along it: some cut on another dimension than 0
    (``RowwiseParallel``), partial, or some replicated and some cut (a sequence-parallel norm
    beside column-cut linears); FSDP2 cuts every parameter it holds on dimension 0 alike, and
    HSDP replicates every one. Only cut on dimension 0 (``ColwiseParallel`` alone) while some of
    the model's parameters are not on the mesh, it may be either (``sure`` False): the recorder
    decides by the rows themselves. Where no module is FSDP2's (``fsdp`` False), a cut is tensor
    parallelism's alone (a vocabulary-parallel embedding beside a column-cut head)."""
    dtensor = _dtensor()
    meshes: dict[int, tuple] = {}
    for parameter in parameters:
        if isinstance(parameter, dtensor):
            mesh = parameter.device_mesh
            meshes.setdefault(id(mesh), (mesh, []))[1].append(parameter.placements)
    on_mesh = sum(len(layouts) for _, layouts in meshes.values())
    members: set[int] = set()
    sure = True
    for mesh, layouts in meshes.values():
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            continue
        for dim in range(mesh.ndim):
            kind = _dimension_kind([layout[dim] for layout in layouts],
                                   partly=on_mesh < len(parameters), fsdp=fsdp)  # fmt: skip
            if kind is None:
                continue
            sure = sure and kind
            index = [*coordinate[:dim], slice(None), *coordinate[dim + 1 :]]
            members.update(int(r) for r in mesh.mesh[tuple(index)].flatten())
    return RowGroup(tuple(sorted(members | {rank})), sure)


def _dimension_kind(placements: list, partly: bool, fsdp: bool = True) -> bool | None:
    """Whether a mesh dimension with these placements of its parameters is tensor-parallel: True
    (surely; any cut where no module is FSDP2's), False (perhaps: all cut on dimension 0 while
    ``partly`` the model's parameters are on the mesh), None (not: data-parallel, or every
    parameter replicated)."""
    from torch.distributed.tensor import Partial, Replicate

    if any(isinstance(p, Partial) for p in placements):
        return True
    # Shard, and FSDP2's _StridedShard over tensor parallelism (not a Shard): each has a dim
    cut = [p for p in placements if getattr(p, "dim", None) is not None]
    if any(p.dim != 0 for p in cut):
        return True
    if cut and (not fsdp or any(isinstance(p, Replicate) for p in placements)):
        return True
    if cut and partly:
        return False
    return None
