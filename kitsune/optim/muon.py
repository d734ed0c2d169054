"""Muon (Keller Jordan 2024, "Muon: An optimizer for hidden layers in neural networks"), torch.optim style, with an
auxiliary AdamW for the params Muon is not for.

Param groups with ``use_muon=True`` (the default) hold 2-D weight matrices, or 4-D conv weights, orthogonalised as
``(out, in * kh * kw)`` and reshaped back. Per param with a grad, exactly as torch.optim.Muon (torch >= 2.9)::

    buf.lerp_(grad, 1 - momentum)                          # state["momentum_buffer"]
    update = grad.lerp(buf, momentum) if nesterov else buf
    O = NS(update)                                         # ns_steps Newton-Schulz iterations, bf16
    p.mul_(1 - lr * weight_decay)
    p.add_(O, alpha=-adjust_lr(lr, shape))                 # "original": sqrt(max(1, A / B)); "match_rms_adamw":
                                                           # 0.2 sqrt(max(A, B)), for the (A, B) matrix
Groups with ``use_muon=False`` (embeddings, the head, biases, norms) run AdamW with the group's ``lr``, ``betas``,
``eps`` and ``weight_decay`` (torch.optim.AdamW's defaults where the group leaves them out), through torch's own
functional AdamW, so they match torch.optim.AdamW to the bit. State keys are torch's: ``momentum_buffer`` for Muon
params, ``step``, ``exp_avg`` and ``exp_avg_sq`` for AdamW params, so checkpoints move between the two.

On CUDA (or on the CPU under ``TRITON_INTERPRET=1``) the Newton-Schulz step runs in kitsune's Triton kernels
([`kitsune.kernels.newton_schulz.newton_schulz`][kitsune.kernels.newton_schulz.newton_schulz]), one call per group for
all of its matrices of one shape; elsewhere it is torch's own bf16 iteration, op for op. The two agree to bf16 rounding,
not bit for bit.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch.optim.adamw import adamw
from torch.optim.optimizer import ParamsT

from kitsune.distributed import fsdp
from kitsune.kernels.coefficients import MUON_COEFFICIENTS, Coefficients, schedule
from kitsune.optim.base import EagerOptimizer, check_lr, check_pair

try:  # Triton is optional: without it every step takes the torch path
    from kitsune.kernels import newton_schulz as _ns
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    _ns = None

ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
ADAMW_DEFAULTS: dict[str, Any] = {"lr": 1e-3, "eps": 1e-8, "weight_decay": 1e-2}
"""What a ``use_muon=False`` group gets for these keys when it leaves them out: torch.optim.AdamW's defaults, not
Muon's (``betas`` comes from the constructor, whose default is AdamW's too)."""


def zeropower_via_newtonschulz(grad: torch.Tensor, coefficients: list[Coefficients], eps: float) -> torch.Tensor:
    """torch.optim.Muon's ``_zeropower_via_newtonschulz``, op for op (same bits), one triple per iteration."""
    ortho_grad = grad.bfloat16()
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    ortho_grad.div_(ortho_grad.norm().clamp(min=eps))
    for a, b, c in coefficients:
        gram_matrix = ortho_grad @ ortho_grad.T
        gram_update = torch.addmm(gram_matrix, gram_matrix, gram_matrix, beta=b, alpha=c)
        ortho_grad = torch.addmm(ortho_grad, gram_update, ortho_grad, beta=a)
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    return ortho_grad


def adjust_lr(lr: float, adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """torch.optim.Muon's LR adjustment for an ``(A, B)`` matrix (a conv weight's is ``(out, in * kh * kw)``); a
    function it does not know (set in a group after it was checked) leaves lr as it is, as torch's does."""
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _use_triton(device: torch.device) -> bool:
    if _ns is None:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and _ns.INTERPRETED and os.environ.get("TRITON_INTERPRET") == "1"


def _refuse_shapes(group: dict[str, Any], where: str) -> None:
    """Every param of a ``use_muon`` group (``where``: "param group i") is a 2-D matrix or a 4-D conv weight."""
    names = group.get("param_names")
    for i, p in enumerate(group["params"]):
        if p.ndim not in (2, 4):
            name = f"'{names[i]}'" if names else f"{i}"
            raise ValueError(
                f"Muon takes 2-D matrices and 4-D conv weights, but parameter {name} of {where} has shape "
                f"{tuple(p.shape)}: put it in a group with use_muon=False (AdamW)"
            )


def _check_schedule(group: dict[str, Any], where: str) -> None:
    """The Newton-Schulz coefficients of a ``use_muon`` group read as the math reads them (`schedule`), or a ValueError
    naming them. ``where``: " in <group>"."""
    try:
        schedule(group["ns_coefficients"], max(group["ns_steps"], 1))
    except (TypeError, ValueError) as err:
        raise ValueError(f"Invalid ns_coefficients{where}: {err}") from None


class Muon(EagerOptimizer):
    """MomentUm Orthogonalized by Newton-Schulz for matrix params, AdamW for the rest.

    A group's ``use_muon`` may change between steps: each algorithm creates the state keys it needs where they are
    missing (zeros, and a zero ``step``) and leaves the other algorithm's keys as they are, so a flipped group starts
    its new algorithm from fresh state (and one flipped back picks up the state it left).

    Args:
        params: params or param groups; a group's ``use_muon`` (default True) picks Muon or AdamW for it.
        lr: Muon's learning rate (the AdamW groups default to 1e-3, as torch.optim.AdamW).
        weight_decay: decoupled weight decay, ``p *= 1 - lr * weight_decay`` (AdamW groups: 0.01 by default).
        momentum: Muon's momentum (an EMA: ``buf.lerp_(grad, 1 - momentum)``).
        nesterov: orthogonalise ``grad.lerp(buf, momentum)`` instead of ``buf``.
        ns_coefficients: ``(a, b, c)`` of the quintic iteration, or one triple per iteration (the last repeats),
            e.g. `kitsune.kernels.newton_schulz.POLAR_EXPRESS_COEFFICIENTS`.
        eps: the Frobenius norm is clamped to at least this before the iteration (AdamW groups: their eps, 1e-8
            by default).
        ns_steps: Newton-Schulz iterations (fewer than 100, as torch).
        adjust_lr_fn: ``"original"`` (None: the same), ``sqrt(max(1, A / B))``, or ``"match_rms_adamw"``,
            ``0.2 sqrt(max(A, B))``: the factor on ``lr`` for an ``(A, B)`` matrix.
        betas: AdamW's betas for the ``use_muon=False`` groups.
        process_group: distributed Muon for a replicated (DDP) model: the ranks of this torch.distributed group
            (``torch.distributed.group.WORLD`` for all) each orthogonalise a share of the matrices and exchange the
            results (`kitsune.distributed.muon`); the grads must be equal on every rank. None: every rank
            orthogonalises every matrix.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: Coefficients | Sequence[Coefficients] = MUON_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
        process_group: Any = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "betas": betas,
            "use_muon": True,
        }
        self._check(defaults, "defaults")
        super().__init__(params, defaults)
        self.process_group = process_group

    def _new_step(self, p: torch.Tensor, value: float = 0.0) -> torch.Tensor:
        """The AdamW params' step count, as torch.optim.AdamW's: on the CPU, float64 under a float64 default."""
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        return torch.tensor(value, dtype=scalar)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """torch's ``load_state_dict`` (and unpickling) land here with the saved groups: a ``torch.optim.Muon``
        checkpoint's groups have no ``use_muon`` and no ``betas``; they are Muon groups, given this optimizer's
        defaults for what they leave out, as torch's optimizers fill keys added since a checkpoint was saved."""
        super().__setstate__(state)
        defaults = getattr(self, "defaults", {})
        for group in self.param_groups:
            group.setdefault("use_muon", True)
            if not group["use_muon"]:
                for key, value in ADAMW_DEFAULTS.items():
                    group.setdefault(key, value)
            for key, value in defaults.items():
                group.setdefault(key, value)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not param_group.get("use_muon", self.defaults["use_muon"]):
            for key, value in ADAMW_DEFAULTS.items():  # before the Muon defaults fill them in
                param_group.setdefault(key, value)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        where = f"param group {len(self.param_groups) - 1}"
        try:
            self._check(group, where)
            if group["use_muon"]:
                _refuse_shapes(group, where)
        except BaseException:  # a group refused is not kept (it would step, and its params could not be added again)
            self.param_groups.pop()
            raise

    def _group_numbers(self, group: dict[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        if group["use_muon"]:
            return ("weight_decay", "eps", "momentum", "ns_steps"), ()
        return ("weight_decay", "eps"), ("betas",)

    def _check_group(self, group: dict[str, Any], where: str) -> None:
        # what the math reads must be there and readable; ranges and names are checked when a group is added, not
        # when set by hand later, as torch.optim.Muon's (an adjust_lr_fn it does not know then leaves lr as it is)
        super()._check_group(group, where)
        if group["use_muon"]:
            for key in ("nesterov", "adjust_lr_fn"):
                group[key]  # noqa: B018  (a KeyError now, not halfway through the groups)
            steps = group["ns_steps"]
            if isinstance(steps, bool) or not isinstance(steps, int):  # (range(2.5) would raise mid-step)
                raise TypeError(f"Invalid ns_steps{where}: {steps!r} (a whole number of Newton-Schulz steps)")
            _check_schedule(group, where)  # (an edit to two numbers, or text, raised after earlier groups moved)
            _refuse_shapes(group, where.removeprefix(" in "))  # a group flipped to use_muon, a param appended

    def _takes_complex(self, group: dict[str, Any]) -> bool:
        return not group["use_muon"]  # torch's AdamW takes complex params as real pairs; Newton-Schulz does not

    @staticmethod
    def _check(group: dict[str, Any], where: str) -> None:
        check_lr(group["lr"], f" in {where}")
        if not 0.0 <= group["weight_decay"]:
            raise ValueError(f"Invalid weight_decay value in {where}: {group['weight_decay']}")
        if not 0.0 <= group["eps"]:
            raise ValueError(f"Invalid eps value in {where}: {group['eps']}")
        if group["use_muon"]:
            if not 0.0 <= group["momentum"]:
                raise ValueError(f"Invalid momentum value in {where}: {group['momentum']}")
            if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
                raise ValueError(
                    f"Invalid adjust_lr_fn in {where}: {group['adjust_lr_fn']!r} (one of 'original', 'match_rms_adamw')"
                )
            steps = group["ns_steps"]
            if not isinstance(steps, int) or not 0 <= steps < 100:
                raise ValueError(f"Invalid ns_steps in {where}: {steps!r} (an int in [0, 100))")
            _check_schedule(group, f" in {where}")
        else:
            beta1, beta2 = check_pair("betas", group["betas"], f" in {where}")
            if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
                raise ValueError(f"Invalid betas in {where}: {group['betas']} (each in [0, 1))")

    def _algorithm(self, group: dict[str, Any]) -> str:
        return "Muon" if group["use_muon"] else "AdamW"

    def _one_dtype(self, group: dict[str, Any]) -> bool:
        return not group["use_muon"]  # torch's AdamW math; Muon's momentum is made like the grad

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> Any:
        state = self.state[p]
        if group["use_muon"]:
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            if buf.dtype != p.grad.dtype:  # lerp_ would raise halfway through the step
                raise ValueError(
                    f"Muon needs each grad in its momentum buffer's dtype: a {tuple(p.shape)} param has a "
                    f"{p.grad.dtype} grad and a {buf.dtype} buffer (made like its first grad). Keep the grads in "
                    "one dtype (p.grad_dtype), or convert the buffer. Nothing was updated."
                )
            return buf
        if "step" not in state:  # torch.optim.AdamW's state: a CPU float step, moments like the param
            state["step"] = self._new_step(p)
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state:
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["step"], state["exp_avg"], state["exp_avg_sq"]

    def _update(
        self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor], states: list[Any]
    ) -> None:
        if group["use_muon"]:
            self._muon_group(group, params, grads, states)
        else:
            self._adamw_group(group, params, grads, states)

    def _muon_group(
        self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor], bufs: list[torch.Tensor]
    ) -> None:
        lr = float(group["lr"])
        momentum = group["momentum"]
        plan = schedule(group["ns_coefficients"], group["ns_steps"])
        sharded = getattr(self, "process_group", None) is not None  # distributed Muon batches every matrix
        # same-shape matrices on one device go through the Triton kernels together
        batches: dict[tuple, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        for p, grad, buf in zip(params, grads, bufs, strict=True):
            buf.lerp_(grad, 1 - momentum)
            if fsdp.is_dtensor(p):  # FSDP2: each rank gathers the whole matrix, orthogonalises it, keeps its share
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                whole = update.full_tensor()
                ortho = self._orthogonalize(whole.flatten(1)[None], group, plan, alone=True)[0]
                self._apply(p, fsdp.like_param(ortho.view(whole.shape), p), group, lr, ortho.shape)
                continue
            if group["ns_steps"] > 0 and (sharded or (grad.dtype in _TRITON_DTYPES and _use_triton(p.device))):
                batches.setdefault((p.shape, grad.dtype, p.device), []).append((p, grad, buf))
                continue
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            ortho = zeropower_via_newtonschulz(update.flatten(1), plan, group["eps"])
            self._apply(p, ortho, group, lr)
        for (shape, dtype, device), members in batches.items():
            updates = torch.empty((len(members), shape[0], math.prod(shape[1:])), dtype=dtype, device=device)
            for u, (_, grad, buf) in zip(updates, members, strict=True):
                if group["nesterov"]:
                    torch.lerp(grad, buf, momentum, out=u.view(shape))
                else:
                    u.view(shape).copy_(buf)
            ortho = self._orthogonalize(updates, group, plan)
            for o, (p, _, _) in zip(ortho, members, strict=True):
                self._apply(p, o, group, lr)

    def _orthogonalize(
        self, updates: torch.Tensor, group: dict[str, Any], plan: list[Coefficients], alone: bool = False
    ) -> torch.Tensor:
        """Newton-Schulz for a ``(n, rows, cols)`` batch of one shape: kitsune's Triton kernels where they run, else
        torch's iteration per matrix; with ``process_group`` (unless ``alone``: a batch every rank computes whole),
        each rank computes its share of the batch."""

        def run(batch: torch.Tensor) -> torch.Tensor:
            if group["ns_steps"] > 0 and batch.dtype in _TRITON_DTYPES and _use_triton(batch.device):
                return _ns.newton_schulz(batch, group["ns_steps"], plan, group["eps"])
            return torch.stack([zeropower_via_newtonschulz(m, plan, group["eps"]) for m in batch])

        process_group = getattr(self, "process_group", None)
        if process_group is None or alone:
            return run(updates)
        from kitsune.distributed.muon import orthogonalize_sharded

        return orthogonalize_sharded(updates, run, process_group)

    @staticmethod
    def _apply(
        p: torch.Tensor, ortho: torch.Tensor, group: dict[str, Any], lr: float, shape: torch.Size | None = None
    ) -> None:
        """``p`` decayed and moved by ``ortho`` at Muon's lr for a matrix of ``shape`` (``ortho``'s own where None:
        an FSDP2 shard's is its whole matrix's)."""
        p.mul_(1 - lr * group["weight_decay"])
        p.add_(ortho.view(p.shape), alpha=-adjust_lr(lr, group["adjust_lr_fn"], shape or ortho.shape))

    @staticmethod
    def _adamw_group(
        group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor], states: list[tuple]
    ) -> None:
        steps, exp_avgs, exp_avg_sqs = (list(s) for s in zip(*states, strict=True))
        beta1, beta2 = group["betas"]
        adamw(
            params, grads, exp_avgs, exp_avg_sqs, [], steps,
            has_complex=any(torch.is_complex(p) for p in params),
            amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
            eps=group["eps"], maximize=False,
        )  # fmt: skip
