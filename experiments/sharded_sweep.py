"""Figure (docs/results.md): the lab's sweep over the strategy (``experiment=sharded``): DDP, ZeRO
and FSDP2 against one device, and FSDP2 with each of its traps, on 2 and 4 CPU ranks.

Runs the sweep, then copies its comparison to ``figures/sharded_sweep.{png,pdf,csv}``.
Usage: ``python experiments/sharded_sweep.py``
"""

from _sweep import publish, run_sweep

if __name__ == "__main__":
    sweep_dir = run_sweep("sharded")
    publish(
        sweep_dir,
        {
            "comparison.png": "sharded_sweep.png",
            "comparison.pdf": "sharded_sweep.pdf",
            "comparison.csv": "sharded_sweep.csv",
        },
    )
