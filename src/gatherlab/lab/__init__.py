"""The research harness: the command lines ``python -m gatherlab.train`` (`train`), ``audit``,
``scaling`` and ``bench``; the one check of a composed config (`validation`), every job of the
training command checked before the first starts (`preflight`), a sweep resumed (`resume`) and
ended with its report (`sweepend`), one training run or audit (`jobs`), and wandb mirroring
(`tracking`)."""
