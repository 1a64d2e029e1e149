"""Figure (README, docs/results.md): the GatherLayer bug and its fix (``experiment=bug_demo``).

Runs the sweep, then copies its comparison figure to ``figures/bug_demo.{png,pdf}``.
Usage: ``python experiments/bug_demo.py``
"""

from _sweep import publish, run_sweep

if __name__ == "__main__":
    sweep_dir = run_sweep("bug_demo")
    publish(
        sweep_dir,
        {
            "comparison.png": "bug_demo.png",
            "comparison.pdf": "bug_demo.pdf",
            "comparison.csv": "bug_demo.csv",
        },
    )
