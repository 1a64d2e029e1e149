"""Benchmarks, apart from the tests: ``python -m gatherlab.bench launcher [--jobs N] [--steps S]``.

Each benchmark measures everything it compares in one invocation and prints ratios; nothing here
asserts a time.

``launcher``: the same N distributed training jobs (``experiment=bug_demo``, cpu2) run through
``train.run`` once with ``launcher=spawn`` (fresh processes per job) and once with
``launcher=pool`` (one warm group). The marginal cost of a job is the mean wall time of jobs 2..N;
the first job is shown apart (for the pool it includes starting the group).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

from gatherlab import launch, train


def _job_times(launcher: str, jobs: int, steps: int, root: Path) -> list[float]:
    overrides = ["experiment=bug_demo", "layout=cpu2", f"steps={steps}", f"launcher={launcher}"]
    with train.composed():
        cfg, choices = train.compose(overrides)
    times = []
    for job in range(jobs):
        start = time.perf_counter()
        train.run(cfg, root / f"{launcher}-{job}", choices, overrides)
        times.append(time.perf_counter() - start)
    return times


def launcher(jobs: int, steps: int) -> float:
    """Print the per-job cost of ``spawn`` and ``pool``; return their ratio."""
    if jobs < 2:
        raise SystemExit("gatherlab.bench: error: --jobs must be at least 2 (job 1 is start-up)")
    launch.close_pools()
    marginal = {}
    with tempfile.TemporaryDirectory(prefix="gatherlab-bench-") as root:
        print(f"{jobs} jobs of {steps} steps each, 2 CPU ranks (experiment=bug_demo layout=cpu2)")
        print(f"{'launcher':<8} {'first job [s]':>14} {'per job, jobs 2..N [s]':>23}")
        for name in ("spawn", "pool"):
            times = _job_times(name, jobs, steps, Path(root))
            marginal[name] = statistics.mean(times[1:])
            print(f"{name:<8} {times[0]:>14.3f} {marginal[name]:>23.3f}")
    launch.close_pools()
    ratio = marginal["pool"] / marginal["spawn"]
    print(f"pool/spawn per-job cost ratio: {ratio:.4f}")
    return ratio


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m gatherlab.bench", description=__doc__.splitlines()[0]
    )
    commands = parser.add_subparsers(dest="benchmark", required=True)
    launcher_parser = commands.add_parser(
        "launcher", help="per-job cost of the pool against ddp_spawn"
    )
    launcher_parser.add_argument(
        "--jobs", type=int, default=6, help="jobs per launcher (default 6)"
    )
    launcher_parser.add_argument(
        "--steps", type=int, default=50, help="optimizer steps per job (default 50)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.benchmark == "launcher":
        launcher(args.jobs, args.steps)


if __name__ == "__main__":
    main()
