"""The research harness: the command lines ``python -m gatherlab.train`` (`train`), ``audit``,
``scaling`` and ``bench``; the one check of a composed config (`configcheck`), one training run or
audit (`jobs`), and wandb mirroring (`tracking`)."""
