"""Which optimizer a run stepped, seen from torch's own hook: what the optimizer tests of
``tests/components/test_optimizers.py`` and the checks' ``--optimizer`` tests
(``tests/check/test_check.py``, ``tests/check/test_step_check.py``) hold each run to."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

HYPERPARAMETERS = ("lr", "momentum", "weight_decay")
ADAM_STATE = ("exp_avg", "exp_avg_sq", "step")  # the moments only Adam and AdamW keep
# each option of conf/optim: the optimizer class, its settings and the state it keeps per
# parameter after a step, as the YAML files and torch's documentation state them
STEPPED = {
    "sgd_momentum": ("SGD", {"lr": 0.01, "momentum": 0.9, "weight_decay": 0}, ("momentum_buffer",)),
    "adam": ("Adam", {"lr": 1e-3, "weight_decay": 0}, ADAM_STATE),
    "adam_l2": ("Adam", {"lr": 1e-3, "weight_decay": 0.01}, ADAM_STATE),
    "adamw": ("AdamW", {"lr": 1e-3, "weight_decay": 0.01}, ADAM_STATE),
    "lars": ("LARS", {"lr": 1.0, "momentum": 0.9, "weight_decay": 1e-4}, ("momentum_buffer",)),
}


@contextlib.contextmanager
def optimizer_steps() -> Iterator[list[tuple[str, dict, tuple[str, ...]]]]:
    """Every optimizer step this process takes meanwhile (torch's hook on every optimizer's
    step, ``torch.optim.optimizer.register_optimizer_step_post_hook``): the optimizer's class, its
    first group's settings of ``HYPERPARAMETERS``, and the names of the state it then keeps for
    its first parameter (AdamW's ``exp_avg_sq``, SGD's ``momentum_buffer``: only that kind of
    optimizer keeps them)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = []

    def record(optimizer, args, kwargs) -> None:
        group = optimizer.param_groups[0]
        state = optimizer.state.get(group["params"][0], {})
        settings = {name: group[name] for name in HYPERPARAMETERS if name in group}
        steps.append((type(optimizer).__name__, settings, tuple(sorted(state))))

    handle = register_optimizer_step_post_hook(record)
    try:
        yield steps
    finally:
        handle.remove()
