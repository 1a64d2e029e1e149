"""Running ranks: the fork server the pools' ranks are forked from (`forkstart`), warm gloo worker
pools (`pool`), W simulated ranks as threads of one process (`simworld`), and Lightning's
launchers on the pool, ``ddp_spawn`` or torchrun/SLURM ranks (`launch`)."""
