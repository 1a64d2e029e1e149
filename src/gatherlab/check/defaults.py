"""The check's defaults, read by its Python API (`gatherlab.check.api`) and its command line
(`gatherlab.check.__main__`) alike. It imports nothing heavy, so that the command line can parse
its arguments and start its ranks' fork server before it imports torch."""

from __future__ import annotations

from gatherlab.core import terms

WORLD_SIZES = (2, 4)
"""The numbers of ranks checked when none are given."""
OPTIMIZERS = ("sgd", "adamw")
"""The optimizers of a loss's or gather's short training run (``optim``: the ``optim`` config
group's options, SGD with lr 0.01, AdamW with lr 1e-3 and weight decay 0.01)."""
OPTIM = "sgd"
"""The optimizer of a loss's or gather's short training run when none is given."""
LOSS_STEPS = 0
"""The steps a loss or a gather is trained when none are given: none (gradient and loss only)."""
TRAINING_STEPS = 20
"""The optimizer steps of each run of a training step's check."""
GLOBAL_BATCH_SIZE = 32
"""The samples per step, over all ranks, of a training step's check."""
PRECISION = terms.Precision.FLOAT64
"""The precision of a training step's check (judged to ``gradients.TOLERANCE[PRECISION]``)."""
OPTIMIZER = "torch.optim:SGD"
"""The optimizer of a plain PyTorch step's check when none is given (as the loss check's SGD)."""
OPTIMIZER_KWARGS = {"lr": 0.01}
"""Its keyword arguments when the optimizer is the default one and none are given."""
COLLECTIVE_TIMEOUT_S = 30.0
"""How long a rank of the check waits at a collective for its peers to enter it before its W fails
with a line that says who did not come (``--collective-timeout``). A collective of the check's
small batches takes milliseconds, and ranks reach the same one within a fraction of a second of
each other (a rank's first job within its imports' seconds); ranks whose collectives differ, or a
peer that returned or raised instead, end the W at once, without waiting for it."""
SEED = 0
"""The seed of every initial weight, data order and random stream of a check."""
