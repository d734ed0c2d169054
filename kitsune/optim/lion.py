"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), torch.optim style.

Per param with a grad: ``c = beta1 * m + (1 - beta1) * g``; ``p *= 1 - lr * wd``; ``p -= lr * sign(c)``;
``m = beta2 * m + (1 - beta2) * g``. One state tensor, ``exp_avg``, in the param's dtype. This eager version is
the reference the fused kernel is tested against; with ``KitsuneOptimizer(..., enable_fusion=True)`` the
fusion planner runs it as one multi-tensor launch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import ParamsT

from kitsune.optim.base import EagerOptimizer, check_lr


class Lion(EagerOptimizer):
    """Sign-momentum optimizer with decoupled weight decay.

    Args:
        params: params or param groups.
        lr: step size (the update has unit magnitude per element, so typically 3-10x smaller than AdamW's).
        betas: ``(beta1, beta2)``: interpolation for the update direction and for the momentum.
        weight_decay: decoupled weight decay, ``p *= 1 - lr * weight_decay``.
        maximize: ascend instead of descend.
    """

    _numbers = ("weight_decay",)
    _pairs = ("betas",)

    def _takes_complex(self, group: dict[str, Any]) -> bool:
        return False  # sign() is not defined on complex numbers

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        maximize: bool = False,
    ) -> None:
        check_lr(lr)
        if not 0.0 <= betas[0] <= 1.0 or not 0.0 <= betas[1] <= 1.0:
            raise ValueError(f"Invalid betas: {betas} (each must be in [0, 1])")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = {"lr": lr, "betas": betas, "weight_decay": weight_decay, "maximize": maximize}
        super().__init__(params, defaults)

    def _one_dtype(self, group: dict[str, Any]) -> bool:
        return True  # lerp into exp_avg, made like the param

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        state = self.state[p]
        if len(state) == 0:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["exp_avg"]

    def _update(
        self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor], states: list[torch.Tensor]
    ) -> None:
        beta1, beta2 = group["betas"]
        lr = float(group["lr"])
        for p, grad, exp_avg in zip(params, grads, states, strict=True):
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(exp_avg.lerp(grad, 1 - beta1).sign_(), alpha=-lr)
            exp_avg.lerp_(grad, 1 - beta2)
