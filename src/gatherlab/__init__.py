"""gatherlab: does a distributed contrastive loss train exactly like one big batch on one device?

gatherlab trains and audits contrastive losses (SimCLR's NT-Xent, DCL, Barlow Twins, VICReg,
TiCo, CLIP) on W ranks of real process groups and on one device, and compares the two: the loss
at every step, the final weights and the gradient of every gather implementation
(docs/design.md). Its command lines are ``python -m gatherlab.train``, ``gatherlab.report``,
``gatherlab.audit``, ``gatherlab.scaling`` and ``gatherlab.check``.

The public Python API, documented here:

- `gatherlab.check`: check a loss or a gather from any package against one device
  (`gatherlab.check.check_loss`, `gatherlab.check.check_gather`, `gatherlab.check.explain`);
- `gatherlab.testing`: the same check as an assertion for a test suite
  (`gatherlab.testing.assert_layout_invariant`);
- `gatherlab.gather`: the gather implementations (`gatherlab.gather.get`,
  `gatherlab.gather.Gather`, `gatherlab.gather.NAMES`);
- `gatherlab.results`: run and sweep files loaded into pandas;
- `gatherlab.simworld`: W simulated ranks as threads of one process (`gatherlab.simworld.run`).
"""

# The modules of the API reference (``make docs``); nothing in the package star-imports them.
__all__ = ["check", "gather", "results", "simworld", "testing"]

# How the package is layered (docs/design.md §4; import-linter enforces it, pyproject.toml): each
# module imports only from the layers below its own, so data flows one way.
#
#   entry points   train (+ hydra_plugins/gatherlab_sweeper), bench, testing, scaling
#   commands       audit, check, trainingcheck
#   reading        report; results, plotting
#   running        jobs, configcheck, config, usermodule, launch, gradients, module, pool
#   components     losses, models, data, factory, optimizers, ablate
#   primitives     tracking, batchnorm, augment, gather, runfiles, simworld
#   shared terms   forkstart, cli, terms
#
# One folder on purpose: the library other projects import (gather, check, testing, results,
# simworld, losses) and the harness that runs this repository's experiments share the layers in
# between (config, gradients, pool), and every ``python -m gatherlab.<name>`` and import path
# is public; the layers, not folders, are what the contract checks.
