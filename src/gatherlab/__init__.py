"""gatherlab: does a distributed contrastive loss train exactly like one big batch on one device?

gatherlab trains and audits contrastive losses (SimCLR's NT-Xent, DCL, Barlow Twins, VICReg,
TiCo, CLIP) on W ranks of real process groups and on one device, and compares the two: the loss
at every step, the final weights and the gradient of every gather implementation
(docs/design.md).

The public face is this package's top level: its command lines ``python -m gatherlab.train``,
``gatherlab.check``, ``gatherlab.report``, ``gatherlab.audit``, ``gatherlab.scaling`` and
``gatherlab.bench``, and its Python API, documented here:

- `gatherlab.check`: check a loss, a gather or a training step from any package against one
  device (`gatherlab.check.check_loss`, `gatherlab.check.check_gather`,
  `gatherlab.check.check_training`, `gatherlab.check.explain`);
- `gatherlab.testing`: the same check as an assertion for a test suite
  (`gatherlab.testing.assert_layout_invariant`, `gatherlab.testing.assert_training_invariant`);
- `gatherlab.gather`: the gather implementations (`gatherlab.gather.get`,
  `gatherlab.gather.Gather`, `gatherlab.gather.NAMES`);
- `gatherlab.losses`: the contrastive losses of docs/design.md §3;
- `gatherlab.results`: run and sweep files loaded into pandas;
- `gatherlab.report`: every run of a sweep against its 1-device reference;
- `gatherlab.compare`: two recordings of a training job compared update by update
  (``gatherlab.compare(a, b)``: the module is callable).

The folders hold the work, one role each, layered as docs/design.md §4 draws them (the
import-linter contract in pyproject.toml enforces it): ``core`` (terms, errors, run files),
``ranks`` (fork server, pools, simulated ranks, launchers), ``gather``, ``losses``,
``components`` (models, data, optimizers, the LightningModule, configs), ``check`` (measuring a
loss, gather or training step, its diagnoses), ``analysis`` (results, report, figures) and
``lab`` (the commands' work: configs checked, jobs, sweeps, audit, scaling, benchmarks).
"""

# The modules of the API reference (``make docs``); nothing in the package star-imports them.
__all__ = ["check", "compare", "gather", "losses", "report", "results", "testing"]


def __getattr__(name: str):
    """``gatherlab.record(...)`` and ``gatherlab.compare(...)`` after ``import gatherlab``: the two
    callable modules, imported when first used."""
    if name in ("record", "compare"):
        import importlib

        return importlib.import_module(f"gatherlab.{name}")
    raise AttributeError(f"module 'gatherlab' has no attribute {name!r}")
