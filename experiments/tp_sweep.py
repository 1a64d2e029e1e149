"""Figure (docs/results.md): the lab's sweep over tensor parallelism
(``experiment=tensor_parallel``, docs/checking.md §10 "Sharded code"): a transformer's pre-norm
block split with sequence parallelism over tp 2 alone and dp 2 × tp 2 CPU ranks against one
device, correct (``strategy=tp``) and with Megatron's sequence-parallel LayerNorm bug
(``tp_unreduced_norm``).

Runs the sweep, then copies its comparison to ``figures/tp_sweep.{png,pdf,csv}``.
Usage: ``python experiments/tp_sweep.py``
"""

from _sweep import publish, run_sweep

if __name__ == "__main__":
    sweep_dir = run_sweep("tensor_parallel")
    publish(
        sweep_dir,
        {
            "comparison.png": "tp_sweep.png",
            "comparison.pdf": "tp_sweep.pdf",
            "comparison.csv": "tp_sweep.csv",
        },
    )
