"""Optimizers that torch does not ship: LARS (You et al., 2017, "Large Batch Training of
Convolutional Networks"), the optimizer of SimCLR's large-batch runs.

Written here because no well-kept implementation installs beside this torch: torchvision's
reference scripts and lightly hold copies, and lightly does not install here (docs/design.md §7).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class LARS(torch.optim.Optimizer):
    """SGD with momentum whose step for each parameter tensor is scaled by the trust ratio
    ``trust_coefficient · ‖p‖ / ‖g + weight_decay · p‖`` (1 where either norm is 0):

        d = g + weight_decay · p
        v ← momentum · v + lr · trust · d
        p ← p − v

    The trust ratio divides by the gradient's norm, so a uniform factor on g cancels, except
    against the weight decay added to it (and the norms' zero guard).
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
    ):
        for name, value in (("lr", lr), ("trust_coefficient", trust_coefficient)):
            if not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        for name, value in (("momentum", momentum), ("weight_decay", weight_decay)):
            if not value >= 0:
                raise ValueError(f"{name} must be a non-negative number, got {value!r}")
        defaults = {
            "lr": lr, "momentum": momentum, "weight_decay": weight_decay,
            "trust_coefficient": trust_coefficient,
        }  # fmt: skip
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                d = p.grad.add(p, alpha=group["weight_decay"])
                p_norm, d_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(d)
                trust = torch.where(
                    (p_norm > 0) & (d_norm > 0),
                    group["trust_coefficient"] * p_norm / d_norm,
                    torch.ones_like(p_norm),
                )
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                velocity = state["momentum_buffer"]
                velocity.mul_(group["momentum"]).add_(d * trust, alpha=group["lr"])
                p.sub_(velocity)
        return loss
