"""LARS (You et al. 2017, "Large Batch Training of Convolutional Networks"), torch.optim style.

torch.optim.SGD with the (weight-decayed) gradient scaled per tensor by the trust ratio
``trust_coefficient * ||p|| / (||g|| + weight_decay * ||p|| + eps)``. The only state is SGD's
``momentum_buffer``, so with ``layer_adaptation=False`` checkpoints move between LARS and torch SGD. This eager
version is the reference a fused kernel must reproduce; the class docstring gives the exact order of operations.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import ParamsT

from kitsune.optim.base import EagerOptimizer, check_lr
from kitsune.optim.lamb import tensor_norm


class LARS(EagerOptimizer):
    """SGD with a layer-wise (per-tensor) trust ratio.

    Per param with a grad (a param whose grad is None gets no state and no update), in order:

    ```text
    g = -grad if maximize else grad
    trust = trust_coefficient * ||p|| / (||g|| + weight_decay * ||p|| + eps)
                if ||p|| > 0 and ||g|| > 0 else 1      # L2 norms in float32 (see below)
    d = g + weight_decay * p                           # skipped when weight_decay == 0
    d = d * trust                                      # skipped when layer_adaptation=False
    if momentum != 0:                                  # state["momentum_buffer"], param dtype
        buf = clone(d) on its first step, else buf = buf * momentum + (1 - dampening) * d
        d = d + momentum * buf if nesterov else buf
    p = p - lr * d
    ```

    Each line runs in the param's dtype and rounds to it, except the norms and ``trust``: 0-dim float32 tensors
    on the param's device (the norms sum the float32-cast values), float64 for float64 params, never read on the
    host. Both norms are taken before weight decay. The lines after the trust ratio are torch.optim.SGD's, op
    for op, so with ``layer_adaptation=False`` the result equals SGD's bit for bit, and the state dict loads into
    SGD.

    Leave biases and norm weights out of the trust ratio (and of weight decay) with a second param group:

    ```python
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    LARS(
        [
            {"params": matrices, "weight_decay": 5e-4},
            {"params": others, "weight_decay": 0.0, "layer_adaptation": False},
        ],
        lr=1.0,
    )
    ```

    Args:
        params: params or param groups; every argument below is also a per-group option.
        lr: step size, a float or a 1-element tensor. The trust ratio makes each adapted tensor move by about
            ``lr * trust_coefficient * ||p||`` per step (before momentum), so LARS takes a much larger ``lr``
            than SGD.
        momentum: momentum factor, as in SGD.
        dampening: dampening for momentum, as in SGD.
        weight_decay: L2 penalty added to the gradient before the trust ratio scales it.
        nesterov: Nesterov momentum, as in SGD (needs ``momentum > 0`` and ``dampening == 0``).
        trust_coefficient: ``eta`` in the paper: how far, relative to ``||p||``, one step moves the tensor.
        eps: added to the trust ratio's denominator.
        layer_adaptation: scale by the trust ratio; False gives plain torch.optim.SGD for the group.
        maximize: ascend instead of descend.
    """

    _numbers = ("momentum", "dampening", "weight_decay", "trust_coefficient", "eps")

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 0.1,
        momentum: float = 0.9,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        trust_coefficient: float = 0.001,
        eps: float = 1e-8,
        layer_adaptation: bool = True,
        maximize: bool = False,
    ) -> None:
        check_lr(lr)
        if not 0.0 <= momentum:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        if not 0.0 < trust_coefficient:
            raise ValueError(f"Invalid trust_coefficient value: {trust_coefficient} (must be > 0)")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "trust_coefficient": trust_coefficient,
            "eps": eps,
            "layer_adaptation": layer_adaptation,
            "maximize": maximize,
        }
        super().__init__(params, defaults)

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor | None:
        # torch SGD's: no state without momentum, and a missing buffer starts from the first update
        return self.state[p].get("momentum_buffer") if group["momentum"] != 0 else None

    def _update(
        self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor], states: list[Any]
    ) -> None:
        lr, wd, momentum = float(group["lr"]), group["weight_decay"], group["momentum"]
        for p, grad, buf in zip(params, grads, states, strict=True):
            if group["layer_adaptation"]:
                w_norm, g_norm = tensor_norm(p), tensor_norm(grad)
                ratio = group["trust_coefficient"] * w_norm / (g_norm + wd * w_norm + group["eps"])
                trust = torch.where((w_norm > 0) & (g_norm > 0), ratio, 1.0)
            # the rest is torch.optim.SGD's _single_tensor_sgd op for op, plus the trust multiply
            if wd != 0:
                grad = grad.add(p, alpha=wd)
            if group["layer_adaptation"]:
                grad = grad.mul(trust)
            if momentum != 0:
                if buf is None:
                    self.state[p]["momentum_buffer"] = buf = grad.detach().clone()
                else:
                    buf.mul_(momentum).add_(grad, alpha=1 - group["dampening"])
                grad = grad.add(buf, alpha=momentum) if group["nesterov"] else buf
            p.add_(grad, alpha=-lr)
