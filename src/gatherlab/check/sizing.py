"""Whether a check of a training step fits in the memory this machine has left, told before any
rank starts (docs/checking.md §10, "At size").

The check holds whole float64 vectors of the trainable parameters (P of them, 8 bytes each,
whatever the step's own precision: the verdict is float64's wherever the code runs in it). The
command trains each one-device reference (the parameters and their gradient), keeps the
reference's first gradient and final parameters, receives rank 0's (both) and each other rank's
first gradient, and compares them; each of the W ranks trains its copy (the parameters, their
gradient, DDP's buckets) and sends its vectors. Its estimate of the command's and of each rank's
peak resident memory:

    command ≈ now + (8 + W) · 8 P            rank ≈ RANK_START + 5 · 8 P

(``now``: the command's resident memory when it asks), and in a low precision the command
``LOW_PRECISION_VECTORS`` more: the floor's runs in the step's own precision (one device, in row
blocks, W ranks) come on top of the float64 verdict's.

A low-precision check judged in floors alone (`floors_alone`: by default at or above
`defaults.FLOORS_ALONE_PARAMETERS` trainable parameters) trains only the three runs in its
precision and keeps their vectors in it (E bytes an element: 4 for float32 and for a mixed
precision's float32 parameters, 2 for bf16-true):

    command ≈ now + FLOORS_COMMAND · E P      rank ≈ RANK_START + FLOORS_RANK · E P

The coefficients are those peaks as
`python -m gatherlab.bench size` measured them at 86M parameters, W = 2 (docs/performance.md):
in float64 the command 7.5 (ResNet) and 8.4-9.5 (ViT) vectors over three runs, in float32 10.9
and 11.5, a rank 5.1 and 5.2 in both, so the estimate is at most 31 % over a peak and under
none. Judged in floors alone (2026-12-07, float32 and bf16-mixed): the command 8.4 (ResNet) and
9.7 (ViT) vectors of E bytes at 86M, a rank 5.1 to 5.5, and at 25M the ResNet's bf16-mixed
command 10.8 and rank 6.2, so 11 and 7: at 86M 12-27 % over the command's peak and 24-31 % over
a rank's, at 25M over both. Activations and an optimizer's state are not in them: a step with
large activations or Adam's two moments needs more than its estimate.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from gatherlab.check import defaults
from gatherlab.core.terms import Precision

__all__ = [
    "Estimate", "available_bytes", "element_bytes", "estimate", "floors_alone", "resident_bytes",
    "too_large",
]  # fmt: skip

FLOAT64 = 8
RANK_START = 300 * 2**20  # a pool rank's resident memory before its job (forked with torch loaded)
LOW_PRECISION_VECTORS = 4  # the command's vectors more when the step runs in a low precision
FLOORS_COMMAND = 11  # the command's vectors in the precision, judged in floors alone
FLOORS_RANK = 7  # a rank's, judged in floors alone


@dataclass(frozen=True)
class Estimate:
    """The check's estimated peak resident memory: the command's, one rank's, all of them."""

    command: int
    rank: int
    world_size: int

    @property
    def total(self) -> int:
        return self.command + self.world_size * self.rank


def resident_bytes() -> int:
    """This process's resident memory now (Linux: /proc/self/statm), 0 where it cannot be read."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def floors_alone(precision: str, parameters: int, judge_in: str = defaults.JUDGE_IN) -> bool:
    """Whether a check of a step asked to run in ``precision`` with ``parameters`` trainable
    parameters is judged in floors of that precision alone (docs/design.md §2, "Low precision at
    size"): never in float64; in a low precision where ``judge_in`` is ``floors``, or ``auto`` at
    or above `defaults.FLOORS_ALONE_PARAMETERS` parameters."""
    if precision == Precision.FLOAT64 or judge_in == "float64":
        return False
    return judge_in == "floors" or parameters >= defaults.FLOORS_ALONE_PARAMETERS


def element_bytes(precision: str) -> int:
    """The bytes of one element of the vectors a check judged in floors alone keeps in
    ``precision``: its parameters' dtype (2 for bf16-true; float32, 4, for float32 and the mixed
    precisions, whose parameters are float32)."""
    return 2 if precision == Precision.BF16_TRUE else 4


def estimate(
    parameters: int, world_size: int, precision: str = Precision.FLOAT64, floors: bool = False
) -> Estimate:
    """The estimate of the module's docstring for ``parameters`` trainable parameters on
    ``world_size`` ranks, of a step that runs in ``precision``, judged in floors alone with
    ``floors`` (`floors_alone`)."""
    if floors:
        vector = element_bytes(precision) * parameters
        return Estimate(resident_bytes() + FLOORS_COMMAND * vector,
                        RANK_START + FLOORS_RANK * vector, world_size)  # fmt: skip
    vector = FLOAT64 * parameters
    vectors = 8 + world_size + (LOW_PRECISION_VECTORS if precision != Precision.FLOAT64 else 0)
    return Estimate(resident_bytes() + vectors * vector, RANK_START + 5 * vector, world_size)


def available_bytes() -> int | None:
    """The memory this process may still take: the kernel's estimate of what is available
    without swapping (``MemAvailable``), or less where a cgroup (a container, a batch job) limits
    it (``memory.max`` − ``memory.current``); None where neither can be read (not Linux)."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            found.append(max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def _gib(count: int) -> str:
    return f"{count / 2**30:.1f} GiB"


def too_large(
    parameters: int, world_size: int, available: int | None, precision: str = Precision.FLOAT64,
    floors: bool = False,
) -> str | None:  # fmt: skip
    """The line that refuses a check whose estimate (`estimate`) exceeds the memory ``available``
    (None when it fits, or when nothing is known of the memory)."""
    needed = estimate(parameters, world_size, precision, floors)
    if available is None or needed.total <= available:
        return None
    return (
        f"a check of {parameters / 1e6:.1f}M trainable parameters at W = {world_size} needs about "
        f"{_gib(needed.total)} (the command {_gib(needed.command)}, each rank "
        f"{_gib(needed.rank)}), more than the {_gib(available)} of memory available; allowed: "
        "fewer ranks (--world-sizes), a smaller model, or a machine with more memory"
    )
