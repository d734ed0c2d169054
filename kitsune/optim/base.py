"""The step the kitsune.optim optimizers share: check and gather every group first, then one group's math at a time."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import torch


def check_lr(lr: Any, where: str = "") -> None:
    """Refuse an lr that is not a number or a one-element tensor (a string ``"1e-3"``: TypeError, as torch.optim's
    comparison raises), or that is negative (ValueError). ``where``: " in <group>" for a message about one group."""
    if type(lr) is float:  # as most are (checked on the fused route whenever a scheduler changes it)
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate{where}: {lr}")
        return
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"Invalid learning rate{where}: a tensor lr must have one element")
    elif isinstance(lr, bool) or not isinstance(lr, numbers.Real):
        raise TypeError(f"Invalid learning rate{where}: {lr!r} (a number or a one-element tensor, e.g. lr=1e-3)")
    if not 0.0 <= float(lr):
        raise ValueError(f"Invalid learning rate{where}: {float(lr)}")


def widens(held: torch.dtype, to: torch.dtype) -> bool:
    """Whether every ``held`` float is one of ``to`` (float16 or bfloat16 into float32 or float64, float32 into
    float64): a cast that loses nothing."""
    a, b = torch.finfo(held), torch.finfo(to)
    return a.bits < b.bits and a.max <= b.max and a.eps >= b.eps


def refuse_narrowing(key: str, held: torch.Tensor, p: torch.Tensor) -> None:
    """Raise for state ``key`` of param ``p`` held in a float dtype that ``p``'s does not widen (``model.half()`` after
    the state was made), for an algorithm whose math needs its state in the param's dtype: rounding it loses what it
    holds (float16 flushes small second moments to zero), and torch's own step refuses such state."""
    if held.is_floating_point() and held.dtype != p.dtype and not widens(held.dtype, p.dtype):
        raise ValueError(
            f"optimizer state {key!r} of a {tuple(p.shape)} {p.dtype} param is {held.dtype}: the param's dtype "
            "changed after its state was made (model.half() or model.to(dtype) after the optimizer was built?). "
            "torch's step refuses that state, and rounding it to the param's dtype loses what it holds (float16 "
            "flushes small second moments to zero). Cast the params back, or, to round the state as torch's "
            "load_state_dict does, reload it: optimizer.load_state_dict(optimizer.state_dict()). Better: convert the "
            "model before building the optimizer, or keep the params in float32 and train in float16/bfloat16 with "
            "autocast (enable_amp=True). Nothing was updated"
        )


def float_state(s: Mapping[str, Any], counters: Collection[str] = ("step",)) -> Iterator[tuple[str, torch.Tensor]]:
    """The float tensors of one param's state but its ``counters`` (``step``, kept in float32 whatever the param's
    dtype; a 0-d param's moments are 0-d too, so the key tells them apart): what follows the param's dtype."""
    for key, t in s.items():
        if key not in counters and isinstance(t, torch.Tensor) and t.is_floating_point():
            yield key, t


def check_pair(key: str, value: Any, where: str) -> tuple[Any, Any]:
    """``value`` (group option ``key``) as the two numbers a step unpacks (``beta1, beta2 = group["betas"]``), or a
    ValueError naming it. ``where``: " in <group>"."""
    if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == 2:
        return value[0], value[1]  # torch's steps unpack a tensor of two into two 0-d tensors
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"Invalid {key}{where}: {value!r} (two numbers, e.g. (0.9, 0.999)). Nothing was changed")
    return value[0], value[1]


def _check_number(key: str, value: Any, where: str) -> None:
    """A group option the math reads as a number: a real number or a one-element tensor (TypeError otherwise)."""
    if type(value) is float or type(value) is int:  # most are (bool is not: its type is bool)
        return
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"Invalid {key}{where}: {value!r} (a number)")


class EagerOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer whose ``step`` does the bookkeeping, so that a subclass holds only its own math.

    ``step(closure)`` evaluates the closure with grad enabled, refuses sparse grads in any group, gathers every
    group (its params with a grad, their grads, and what `_init_state` returns for each), then calls
    `_update` group by group with the grads negated where the group has ``maximize``, and returns the
    closure's loss. Whatever can raise does so before the first update of any group (torch.optim checks one group
    at a time): a step that raises leaves every param as it was, and one refusing a sparse grad, or a grad of
    another dtype than its param where `_one_dtype` says the math cannot take one, every state too. Where
    `_one_dtype` holds, state made before the params' dtype changed is converted to the param's dtype when that
    loses nothing (``model.float()`` after ``model.half()``) and refused otherwise (`refuse_narrowing`), as the
    fused route does.
    """

    _numbers: tuple[str, ...] = ()
    """The group options the math reads as numbers (besides ``lr``): see `_check_group`."""
    _pairs: tuple[str, ...] = ()
    """The group options the math reads as two numbers (``betas``): see `_check_group`."""

    def _group_numbers(self, group: dict[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """``group``'s options its math reads as numbers and as pairs of numbers: `_numbers` and `_pairs`."""
        return self._numbers, self._pairs

    def _check_group(self, group: dict[str, Any], where: str) -> None:
        """Read ``group``'s options as the math will (every group, before the first update): ``lr`` and
        `_group_numbers`. A key deleted, or a value set to something the math cannot read (``weight_decay=None``,
        ``betas=(0.9,)``), raises here, while nothing has changed, not halfway through the groups."""
        check_lr(group["lr"], where)
        numbers, pairs = self._group_numbers(group)
        for key in numbers:
            _check_number(key, group[key], where)
        for key in pairs:
            for v in check_pair(key, group[key], where):
                _check_number(key, v, where)

    def _check_values(self, group: dict[str, Any], where: str) -> None:
        """What the fused route checks in ``group`` whenever its values change (an LR scheduler: every step): the
        numbers and pairs the math reads, as `_check_group` does, without what a subclass checks beyond them for its
        own step alone (Muon's shapes and schedule, which the fused route reads through its own plan)."""
        EagerOptimizer._check_group(self, group, where)

    def _takes_complex(self, group: dict[str, Any]) -> bool:
        """Whether ``group``'s math is defined on complex params (torch.optim's own optimizers treat one as a real
        pair); False: a complex param with a grad is refused before anything changes."""
        return True

    def _one_dtype(self, group: dict[str, Any]) -> bool:
        """Whether ``group``'s math needs each grad and state tensor in its param's dtype (``lerp`` into state made
        like the param, as torch.optim.AdamW's): a grad of another dtype (``p.grad_dtype``) or state of a narrower
        one is then refused before anything changes, state of a wider one converted. False: the math takes them as
        they are."""
        return False

    def _algorithm(self, group: dict[str, Any]) -> str:
        """The name a refusal gives for ``group``'s algorithm."""
        return type(self).__name__

    def _new_step(self, p: torch.Tensor, value: float = 0.0) -> torch.Tensor:
        """A step count for ``p``'s state (an optimizer that keeps one): 0-dim float32 on the param's device."""
        return torch.tensor(value, dtype=torch.float32, device=p.device)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """``load_state_dict`` (and unpickling) land here: a step count saved as a number (an older checkpoint's, or
        one written by hand) becomes a tensor, as torch.optim's optimizers make theirs, so that the step counts on."""
        super().__setstate__(state)
        for p, s in self.state.items():
            step = s.get("step") if isinstance(s, dict) else None
            if step is not None and not torch.is_tensor(step) and torch.is_tensor(p):
                s["step"] = self._new_step(p, float(step))

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> Any:
        """Create ``p``'s missing state in ``self.state[p]`` and return what `_update` reads from it; a check
        that can raise (a missing state key: KeyError) belongs here."""
        raise NotImplementedError

    def _update(
        self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor], states: list[Any]
    ) -> None:
        """One group's math over its params with a grad (at least one), their grads and ``_init_state``'s values."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        widened: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        for i, group in enumerate(self.param_groups):
            self._check_group(group, f" in param group {i}")
            if any(p.grad is not None and p.grad.is_sparse for p in group["params"]):
                raise RuntimeError(f"{self._algorithm(group)} does not support sparse gradients")
            if not self._takes_complex(group) and any(p.grad is not None and p.is_complex() for p in group["params"]):
                raise RuntimeError(f"{self._algorithm(group)} does not support complex parameters")
            if self._one_dtype(group):
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if p.grad.dtype != p.dtype:
                        raise ValueError(
                            f"{self._algorithm(group)} needs each grad in its param's dtype: a {tuple(p.shape)} "
                            f"{p.dtype} param has a {p.grad.dtype} grad. Keep the grads in the params' dtype "
                            "(p.grad_dtype = None). Nothing was updated."
                        )
                    state = self.state.get(p, {})
                    for key, t in float_state(state):
                        if t.dtype != p.dtype:
                            refuse_narrowing(key, t, p)
                            widened.append((state, key, p))
        for state, key, p in widened:  # every check passed: the lossless casts
            state[key] = state[key].to(p.dtype)
        gathered = [self._gather_group(group) for group in self.param_groups]
        for group, (params, grads, states) in zip(self.param_groups, gathered, strict=True):
            if params:
                grads = [-g for g in grads] if group.get("maximize", False) else grads
                self._update(group, params, grads, states)
        return loss

    def _gather_group(self, group: dict[str, Any]) -> tuple[list[torch.Tensor], list[torch.Tensor], list[Any]]:
        params, grads, states = [], [], []
        for p in group["params"]:
            if p.grad is not None:  # no grad: no state, no update
                params.append(p)
                grads.append(p.grad)
                states.append(self._init_state(p, group))
        return params, grads, states
