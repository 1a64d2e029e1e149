"""``python -m gatherlab.check ... --launcher external``: the check on the ranks that torchrun or
srun started, this process one of them (docs/checking.md §10, the external launcher).

Rank 0 runs the check as the command runs it on the warm pool: its one-device references without
a process group (between jobs none exists), or, for code that needs one, in a one-rank group of
its own (``check.reference``), its W-rank runs on the launcher's ranks (``ranks.external.Ranks``:
gloo on CPUs, NCCL and each rank's own GPU with ``--device cuda``), and it alone writes
``check.csv`` and prints the table. Every other rank runs
rank 0's jobs, prints and writes nothing, and exits with rank 0's status. The world size checked
is the launcher's (``--world-sizes`` omitted or equal to it). Bad input, found by rank 0 before any
process group is joined, stops every rank with the same one line and status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch

from gatherlab.check.options import CheckError
from gatherlab.components.config import ConfigError
from gatherlab.core import cli, terms
from gatherlab.ranks import external

__all__ = ["run"]

COMMAND = "check"


def _launched() -> external.Launched:
    """This process's place among the launcher's ranks, or the command's end in one line (every
    rank finds the same: it reads its own environment)."""
    try:
        place = external.launched()
    except ValueError as error:
        cli.fail(COMMAND, f"--launcher external: {error}")
    if place is None:
        cli.fail(
            COMMAND,
            "--launcher external: no launcher started this process (neither torchrun's RANK and "
            "WORLD_SIZE nor SLURM_PROCID and SLURM_NTASKS are set); allowed: torchrun "
            "--nproc_per_node=W -m gatherlab.check ..., srun with MASTER_ADDR and MASTER_PORT "
            "set, or --launcher pool",
        )
    return place


def _world_sizes(chosen: tuple[int, ...] | None, place: external.Launched) -> tuple[int, ...]:
    """The world sizes checked: the launcher's, when ``--world-sizes`` is omitted or names it."""
    if chosen is not None and tuple(chosen) != (place.world_size,):
        given = ",".join(str(size) for size in chosen)
        raise CheckError(
            f"--world-sizes {given} under {place.launcher}, which started {place.world_size} "
            f"ranks; allowed: {place.world_size}, or no --world-sizes"
        )
    return (place.world_size,)


def run(args: argparse.Namespace, written: Callable[[argparse.Namespace], int]) -> int:
    """This rank's part of the check the arguments ask for: on rank 0 ``written(args)`` (the
    check, written and printed), on the others rank 0's jobs. Returns the exit status, the same
    on every rank; bad input ends every rank with rank 0's line (status 2)."""
    place = _launched()
    try:
        store = external.connect(place)
    except Exception as error:  # rank 0's store is not there (srun without MASTER_ADDR's host)
        cli.fail(
            COMMAND,
            f"--launcher external: rank {place.rank} cannot reach the store at "
            f"{place.address}:{place.port}: {cli.first_line(error)}",
            1,
        )
    if place.rank != 0:
        try:
            status, line = external.serve(place, store, args.device)
        except external.RankZeroGone as error:
            cli.fail(COMMAND, f"rank 0 is gone ({error}); rank {place.rank} stops", 1)
        if line is not None:
            print(f"gatherlab.{COMMAND}: error: {line}", file=sys.stderr)
        return status
    ranks = external.Ranks(place, store, args.device)
    status, line = 1, None
    try:
        with external.active(ranks):
            args.world_sizes = _world_sizes(args.world_sizes, place)
            if args.device == terms.Device.CUDA and not torch.cuda.is_available():
                raise CheckError("--device cuda: rank 0 sees no CUDA GPU; allowed: --device cpu")
            status = written(args)
    except (CheckError, ConfigError) as error:
        status, line = 2, str(error)
    except BaseException as error:  # rank 0's own failure: the others name it, rank 0 raises
        ranks.stop(1, f"rank 0: {cli.error_line(error)}")
        raise
    ranks.stop(status, line)
    if line is not None:
        cli.fail(COMMAND, line)
    return status
