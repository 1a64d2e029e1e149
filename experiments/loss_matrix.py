"""Figure (README, docs/results.md): the loss matrix (``experiment=loss_matrix``): every loss with
``old`` and ``fixed`` on 1, 2 and 4 CPU ranks, each against its 1-device reference.

Runs the sweep (60 jobs), then copies its matrix figure and table to
``figures/loss_matrix.{png,pdf,md}`` and the comparison table to ``figures/loss_matrix.csv``.
Usage: ``python experiments/loss_matrix.py``
"""

from _sweep import publish, run_sweep

if __name__ == "__main__":
    sweep_dir = run_sweep("loss_matrix")
    publish(
        sweep_dir,
        {
            "loss_matrix.png": "loss_matrix.png",
            "loss_matrix.pdf": "loss_matrix.pdf",
            "loss_matrix.md": "loss_matrix.md",
            "comparison.csv": "loss_matrix.csv",
        },
    )
