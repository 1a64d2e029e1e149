"""The research harness: the command lines ``python -m gatherlab.train``, ``audit``, ``scaling``
and ``bench``, and their work: configs checked, jobs run, sweeps resumed and ended, benchmarks.

Modules:

- ``train``: the command line ``python -m gatherlab.train``, a Hydra app (``-m`` for a sweep)
- ``preflight``: every job of ``python -m gatherlab.train`` checked before the first starts
- ``validation``: the one validation of a composed job config, failing with one line
- ``resume``: a sweep resumed (``+resume=SWEEP_DIR``): the jobs it left to do
- ``jobs``: one training job of a checked config, run
- ``sweepend``: a sweep's end: its report written, its worker pools closed (Hydra callbacks)
- ``tracking``: Weights & Biases tracking (``logger=wandb``), one wandb run per job
- ``audit``: the gradient audit, every gather × loss style × world size, and its command line
- ``scaling``: the gradient error as W grows, on real and simulated ranks, beside its prediction
- ``bench``: the benchmarks of ``python -m gatherlab.bench``, apart from the tests
- ``recorder_cost``: ``bench record-fixed``: the recorder's fixed cost per update at W = 1, 2, 4
- ``recordtime``: one update plain and recorded in turns: the recorder's cost against the update
- ``sizes``: ``bench size``: what checking and recording cost at real model sizes
- ``sizemodels``: the size benchmark's models: a ResNet and a ViT of 1M-86M parameters, in code
- ``comparetime``: ``bench compare``: ``python -m gatherlab.compare`` from a fresh shell, timed
"""
