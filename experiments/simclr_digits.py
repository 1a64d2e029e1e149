"""Figure (README, docs/results.md): full SimCLR on the 8×8 digits (``experiment=simclr_digits``):
the matched runs on 1, 2 and 4 CPU ranks and the three ablations, each breaking one guarantee, with
the k-NN test accuracy of every run.

Runs the sweep (12 jobs), draws ``figures/simclr_digits.{png,pdf}`` from it and copies its
comparison table (with ``knn_accuracy``) to ``figures/simclr_digits.csv``.
Usage: ``python experiments/simclr_digits.py``
"""

from _sweep import FIGURES, publish, run_sweep

from gatherlab import report, results
from gatherlab.analysis import figures
from gatherlab.core import gradients

if __name__ == "__main__":
    sweep_dir = run_sweep("simclr_digits")
    compared = report.compare_sweep(results.load_runs(sweep_dir), sweep_dir)
    figure = figures.ablation_figure(
        compared.table, compared.curves, variant="simclr_ablation", metric="knn_accuracy",
        tolerance=gradients.FLOAT64_TOLERANCE,
    )  # fmt: skip
    for path in figures.save(figure, FIGURES / "simclr_digits"):
        print(path)
    publish(sweep_dir, {"comparison.csv": "simclr_digits.csv"})
