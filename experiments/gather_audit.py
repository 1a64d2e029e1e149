"""Figure (README, docs/results.md): the gradient audit (``python -m gatherlab.audit``): every
gather × loss style × world size 2, 4, 8, the parameter gradient against the 1-device gradient.

Copies ``audit.{png,pdf,md,csv}`` to ``figures/gather_audit.*``.
Usage: ``python experiments/gather_audit.py``
"""

from _sweep import publish, run_audit

if __name__ == "__main__":
    out = run_audit()
    publish(
        out, {f"audit.{suffix}": f"gather_audit.{suffix}" for suffix in ("png", "pdf", "md", "csv")}
    )
