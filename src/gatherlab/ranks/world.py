"""What a rank knows of its world: its rank, the number of ranks, and which rows of a global batch
it holds, in a real process group or in the simulated world (`simworld`), and 0 of 1 outside any;
and a one-rank process group for code that runs as "one device" but asks for one (`alone`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist

from gatherlab.core import terms
from gatherlab.ranks import simworld

__all__ = [
    "EXPERT_MESH_DIMS", "MESH_DIMS", "PIPELINE_MESH_DIMS", "REDISTRIBUTE_LOGGER", "alone",
    "data_parallel", "device", "mesh", "own_rows", "quiet_two_gathers", "rank", "size", "whole",
]  # fmt: skip

MESH_DIMS = ("dp", "tp")
"""The names of the dimensions of a tensor-parallel layout's mesh: data-parallel groups (the ranks
holding the same rows of a global batch) by tensor-parallel groups (the ranks sharing one
replica of the model), docs/checking.md §10 "Tensor and sequence parallelism"."""


EXPERT_MESH_DIMS = ("dp", "ep")
"""The names of the dimensions of an expert-parallel layout's mesh: the replicas of each expert
(the ranks that hold the same experts) by expert-parallel groups (the ranks that hold every
expert between them and exchange their tokens), docs/checking.md §10 "Expert parallelism"."""


PIPELINE_MESH_DIMS = ("dp", "pp")
"""The names of the dimensions of a pipeline-parallel layout's mesh: data-parallel groups (the
replicas of each stage) by pipelines (the ranks that hold every stage between them and take the
same rows), docs/checking.md §10 "Pipeline parallelism"."""


def size() -> int:
    """Number of ranks: of the simulated world in one of its ranks (``simworld``), else of the
    default process group, 1 when there is none.

    Returns:
        The world size, an integer ≥ 1.
    """
    simulated = simworld.size()
    if simulated is not None:
        return simulated
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This rank: in the simulated world (``simworld``), else in the default process group, 0
    when there is none.

    Returns:
        The rank, an integer from 0 to `size` − 1.
    """
    simulated = simworld.rank()
    if simulated is not None:
        return simulated
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def device() -> torch.device:
    """Where this rank computes: its GPU in an NCCL process group (the one
    ``torch.cuda.set_device`` chose), else the CPU (gloo, the simulated world, no group)."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == terms.Backend.NCCL:
        return torch.device(terms.Device.CUDA, torch.cuda.current_device())
    return torch.device(terms.Device.CPU)


def mesh(tensor_parallel: int, names: tuple[str, str] = MESH_DIMS):
    """The ranks as a (W / T) × T ``DeviceMesh`` named ``names`` (`MESH_DIMS`, or
    `EXPERT_MESH_DIMS`; ``init_device_mesh``: rank r is data-parallel group r // T, rank r % T of
    the second dimension) for a layout of tensor-parallel (or expert-parallel) degree T =
    ``tensor_parallel`` ≥ 2; None on one device and without a degree (1). Its sub-groups are
    made by every rank of the default process group (a collective)."""
    if tensor_parallel < 2 or size() == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    shape = (size() // tensor_parallel, tensor_parallel)
    return init_device_mesh(device().type, shape, mesh_dim_names=names)


def data_parallel(tensor_parallel: int) -> tuple[int, int]:
    """This rank's data-parallel group and the number of them (`rank` // T of `size` // T): the
    T ranks of a tensor-parallel group hold the same rows of a global batch (§2, §10); one
    device, or no tensor-parallel degree (1): `rank` of `size`."""
    if tensor_parallel < 2 or size() == 1:
        return rank(), size()
    return rank() // tensor_parallel, size() // tensor_parallel


def own_rows(total: int) -> slice:
    """This rank's rows of a global batch or a gathered tensor of ``total`` rows (`rank` of
    `size`: in the simulated world too)."""
    return terms.rows_of(rank(), size(), total)


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """This process as rank 0 of a one-rank gloo process group while the block runs, when it has
    no default process group: code that asks for its rank or world size, or calls a collective,
    runs unchanged on one device as on W ranks (~20 ms; the store is in this process). A group
    that exists already is left as it is."""
    if not dist.is_available() or dist.is_initialized():
        yield
        return
    # init_process_group wraps sys.excepthook to prefix tracebacks with the rank, and never
    # unwraps it: the process's own hook is put back with the group's end
    hook = sys.excepthook
    dist.init_process_group(terms.Backend.GLOO, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor as one device holds it: a sharded one (a ``DTensor`` of FSDP2 or tensor
    parallelism) gathered whole from its shards (a collective: every rank of its mesh calls it),
    any other as it is."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor
    quiet_two_gathers()
    return tensor.full_tensor()


REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"
"""The logger of torch's private module that logs a warning when a redistribution takes two
all-gathers in sequence (its ``__name__``; tests/lab/test_tensor_parallel_sweep.py fails when
torch renames it, docs/checking.md §10)."""


def quiet_two_gathers() -> None:
    """torch's warning off in this process that reading a parameter or gradient of FSDP2 over
    tensor parallelism whole (``DTensor.full_tensor`` of ``_StridedShard``) takes two all-gathers
    in sequence: given on every rank at every read, and about nothing a check or a run compares
    (gathering sums nothing: exact in any order). torch logs it from a private module, whose
    logger is the only handle on it (`REDISTRIBUTE_LOGGER`)."""
    import logging

    logging.getLogger(REDISTRIBUTE_LOGGER).setLevel(logging.ERROR)
