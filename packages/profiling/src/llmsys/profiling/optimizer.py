"""AdamW (Loshchilov and Hutter), written out one parameter at a time to be read.

For each parameter p with gradient g, at step t (from 1):

    m = beta1 * m + (1 - beta1) * g                  first moment
    v = beta2 * v + (1 - beta2) * g^2                second moment
    p = p - lr * weight_decay * p                     decoupled weight decay
    p = p - lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)

It matches ``torch.optim.AdamW`` (tested); use that one's ``fused=True`` for speed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.optim.optimizer import ParamsT


class AdamW(torch.optim.Optimizer):
    """AdamW with the defaults of ``torch.optim.AdamW`` (lr 1e-3, betas (0.9, 0.999), eps 1e-8,
    weight_decay 0.01). State per parameter: ``step`` (int), ``exp_avg`` and ``exp_avg_sq``."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ) -> None:
        if not lr >= 0:
            raise ValueError(f"AdamW: `lr` must be >= 0, got {lr}")
        if not all(0 <= beta < 1 for beta in betas) or len(betas) != 2:
            raise ValueError(f"AdamW: `betas` must be two numbers in [0, 1), got {betas}")
        if not eps >= 0 or not weight_decay >= 0:
            raise ValueError(
                f"AdamW: `eps` and `weight_decay` must be >= 0, got {eps} and {weight_decay}"
            )
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    # torch types step as two overloads (None -> None, a closure -> its float): the same contract
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2) = group["lr"], group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(p.grad, 1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                p.mul_(1 - lr * group["weight_decay"])
                step_size = lr / (1 - beta1**t)
                denom = (v / (1 - beta2**t)).sqrt_().add_(group["eps"])
                p.addcdiv_(m, denom, value=-step_size)
        return loss
