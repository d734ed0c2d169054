"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes"), torch.optim style.

Adam's bias-corrected update plus decoupled weight decay, scaled per tensor by the trust ratio
``||p|| / ||u||`` (Algorithm 2). State has torch Adam's keys: ``step``, ``exp_avg``, ``exp_avg_sq``. This eager
version is the reference a fused kernel must reproduce; the class docstring gives the exact order of operations.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import ParamsT

from kitsune.optim.base import EagerOptimizer, check_lr


class LAMB(EagerOptimizer):
    """Layer-wise adaptive Adam with decoupled weight decay.

    Per param with a grad (a param whose grad is None gets no state, no update and no step count), in order:

    ```text
    g = -grad if maximize else grad
    step += 1                                      # state["step"]: 0-dim float32 on the param's device
    m = lerp(m, g, 1 - beta1)                      # state["exp_avg"], param dtype
    v = v * beta2 + (1 - beta2) * g * g            # state["exp_avg_sq"], param dtype
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step    # Python floats; both 1 when bias_correction=False
    u = (m / bc1) / (sqrt(v / bc2) + eps)
    u = u + weight_decay * p                       # skipped when weight_decay == 0
    trust = ||p|| / ||u|| if ||p|| > 0 and ||u|| > 0 else 1    # L2 norms in float32 (see below)
    trust = min(trust, max_trust_ratio)            # when max_trust_ratio is not None
    p = p - (lr * trust) * u                       # p - lr * u when layer_adaptation=False
    ```

    Weight decay enters the update before the trust ratio, as in the paper. Each line runs in the param's
    dtype and rounds to it, except the norms and ``trust``: 0-dim float32 tensors on the param's device (the
    norms sum the float32-cast values), float64 for float64 params, never read on the host. Reading ``step``
    into the Python-float bias corrections syncs, as torch Adam's default path does. With
    ``layer_adaptation=False`` and ``bias_correction=True`` this is AdamW up to rounding.

    Leave biases and norm weights out of the trust ratio (and of weight decay) with a second param group:

    ```python
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    LAMB(
        [
            {"params": matrices, "weight_decay": 0.01},
            {"params": others, "weight_decay": 0.0, "layer_adaptation": False},
        ],
        lr=1e-3,
    )
    ```

    Args:
        params: params or param groups; every argument below is also a per-group option.
        lr: step size, a float or a 1-element tensor.
        betas: ``(beta1, beta2)``: decay rates of the first and second moments, each in [0, 1).
        eps: added to ``sqrt(v / bc2)`` for numerical stability.
        weight_decay: decoupled weight decay, added to the update before the trust ratio.
        bias_correction: divide the moments by ``1 - beta**step`` as Adam does.
        max_trust_ratio: upper bound on the trust ratio, or None for no bound.
        layer_adaptation: scale the update by the trust ratio; False gives plain Adam(W) for the group.
        maximize: ascend instead of descend.
    """

    _numbers = ("eps", "weight_decay")
    _pairs = ("betas",)

    def _takes_complex(self, group: dict[str, Any]) -> bool:
        return False  # its second moment would square a complex grad, not its magnitude

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        max_trust_ratio: float | None = None,
        layer_adaptation: bool = True,
        maximize: bool = False,
    ) -> None:
        check_lr(lr)
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if max_trust_ratio is not None and not max_trust_ratio > 0.0:
            raise ValueError(f"Invalid max_trust_ratio value: {max_trust_ratio} (must be > 0 or None)")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "bias_correction": bias_correction,
            "max_trust_ratio": max_trust_ratio,
            "layer_adaptation": layer_adaptation,
            "maximize": maximize,
        }
        super().__init__(params, defaults)

    def _one_dtype(self, group: dict[str, Any]) -> bool:
        return True  # lerp into exp_avg, made like the param

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        state = self.state[p]
        if len(state) == 0:
            state["step"] = self._new_step(p)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["step"], state["exp_avg"], state["exp_avg_sq"]

    def _update(
        self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor], states: list[tuple]
    ) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
        for p, grad, (step_t, exp_avg, exp_avg_sq) in zip(params, grads, states, strict=True):
            step_t += 1
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            if group["bias_correction"]:
                step = float(step_t)
                bc1, bc2 = 1 - beta1**step, 1 - beta2**step
            else:
                bc1 = bc2 = 1.0
            update = (exp_avg / bc1).div_((exp_avg_sq / bc2).sqrt_().add_(eps))
            if wd != 0:
                update.add_(p, alpha=wd)
            if group["layer_adaptation"]:
                p.sub_(update.mul_(lr * _trust_ratio(p, update, group["max_trust_ratio"])))
            else:
                p.sub_(update.mul_(lr))


def _trust_ratio(p: torch.Tensor, update: torch.Tensor, max_trust_ratio: float | None) -> torch.Tensor:
    """``||p|| / ||update||`` as a 0-dim tensor, 1 where either norm is 0, clamped to max_trust_ratio."""
    w_norm, u_norm = tensor_norm(p), tensor_norm(update)
    trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, 1.0)
    return trust if max_trust_ratio is None else trust.clamp_(max=max_trust_ratio)


def tensor_norm(x: torch.Tensor) -> torch.Tensor:
    """L2 norm of a whole tensor as a 0-dim float32 tensor (float64 for a float64 tensor: torch refuses to narrow)."""
    return torch.linalg.vector_norm(x, dtype=torch.promote_types(x.dtype, torch.float32))
