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

The top-level modules are the public face of the commands and of the folders' work; the folders
hold the work, one role each, layered as docs/design.md §4 draws them (the import-linter contract
in pyproject.toml enforces it).

Modules:

- ``audit``: ``python -m gatherlab.audit``, the gradient audit (its work: ``lab.audit``)
- ``bench``: ``python -m gatherlab.bench``, the benchmarks (its work: ``lab.bench``)
- ``compare``: two recordings compared update by update: ``gatherlab.compare(a, b)``, its command
- ``data``: ``LayoutInvariantSampler``, one global batch at every world size (``components.data``)
- ``record``: ``gatherlab.record(model, optimizer, out)``, a user's job recorded where it runs
- ``report``: every run of a sweep against its 1-device reference (its work: ``analysis.report``)
- ``results``: run and sweep files loaded into pandas (its work: ``analysis.results``)
- ``scaling``: ``python -m gatherlab.scaling``, the gradient error as W grows (``lab.scaling``)
- ``testing``: the check as assertions for other projects' test suites
- ``train``: ``python -m gatherlab.train``, the configured runs and sweeps (its work: ``lab.train``)

Folders:

- ``analysis``: reading what runs wrote: results, the report, figures
- ``check``: a loss, gather or training step measured against one device, and its diagnoses
- ``components``: what a run is made of: models, data, optimizers, the LightningModule, configs
- ``core``: the words, errors and run files every layer shares
- ``gather``: the gather implementations and their registry
- ``lab``: the research harness: configs checked, jobs, sweeps, the audit, scaling, benchmarks
- ``losses``: the contrastive losses, one family per file
- ``ranks``: running ranks: the fork server, warm pools, simulated ranks, launchers
- ``recording``: a user's training job recorded where it runs
- ``runs``: the training layer: a run trained on a rank, whatever it trains
"""

# The modules of the API reference (``make docs``); nothing in the package star-imports them.
__all__ = ["check", "compare", "gather", "losses", "report", "results", "testing"]


# What ``import gatherlab`` reaches as an attribute, imported when first used: the API
# reference's modules, the two callable ones and the sampler's (``gatherlab.data.
# LayoutInvariantSampler``, as the docs write it).
_LAZY = (*__all__, "record", "data")


def __getattr__(name: str):
    """``gatherlab.record(...)``, ``gatherlab.compare(...)``, ``gatherlab.data.…`` and every module
    of `__all__` after ``import gatherlab`` alone (`_LAZY`), imported when first used."""
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"gatherlab.{name}")
    raise AttributeError(f"module 'gatherlab' has no attribute {name!r}")
