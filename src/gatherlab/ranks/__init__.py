"""Running ranks: forked, pooled, simulated or started by a launcher.

Modules:

- ``forkstart``: the fork server the pools' ranks are forked from, started before torch is imported
- ``pool``: warm gloo worker pools: W processes kept alive to run many jobs
- ``simworld``: the simulated world: W ranks as threads of one process
- ``world``: what a rank knows of its world: ``rank()``, ``size()``, ``own_rows``; and ``alone()``
- ``launch``: Lightning's ``Trainer.fit`` on the pool, ``ddp_spawn`` or torchrun/SLURM ranks
- ``ports``: the port a rendezvous gatherlab starts listens on: one the kernel never lends
- ``external``: the ranks torchrun or srun started, driven from rank 0: ``ranks_for(W)``
- ``watched``: collectives compared across ranks before they run: a mismatch ends the job in a line
"""
