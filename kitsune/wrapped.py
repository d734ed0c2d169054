"""The wrapped optimizer's own step: the executor of every param no kitsune executor owns, and its step hooks."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks as _global_post
from torch.optim.optimizer import _global_optimizer_pre_hooks as _global_pre


def run_hooked(
    opt: torch.optim.Optimizer,
    body: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    pre_hooks: Mapping[int, Callable[..., Any]],
    post_hooks: Mapping[int, Callable[..., Any]],
) -> Any:
    """``body(*args[1:], **kwargs)`` (``args[0]`` is ``opt``, the rest as the caller passed them) as torch's hook
    runner runs a step: under the profiler label torch gives a step, the global pre-hooks, then ``opt``'s
    ``pre_hooks`` (each may return new ``(args, kwargs)``), the body, then ``opt``'s ``post_hooks`` and the global
    ones, with the arguments the pre-hooks left."""
    with torch.autograd.profiler.record_function(f"Optimizer.step#{type(opt).__name__}.step"):
        args, kwargs = run_pre_hooks(opt, (*_global_pre.values(), *pre_hooks.values()), args, kwargs)
        out = body(*args[1:], **kwargs)
        opt._optimizer_step_code()  # where torch's memory profiler reads the optimizer's state (OPTIMIZER_STATE)
        for hook in (*post_hooks.values(), *_global_post.values()):
            hook(opt, args, kwargs)
    return out


def run_pre_hooks(
    opt: torch.optim.Optimizer, hooks: Iterable[Callable[..., Any]], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Step pre-hooks in order, each given ``(opt, args, kwargs)`` and free to return new ``(args, kwargs)`` for the
    next hook and the step; anything else but None raises, as torch's hook runner does."""
    for hook in hooks:
        result = hook(opt, args, kwargs)
        if result is not None:
            if not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(
                    f"{type(opt).__name__}.step's pre-hook {getattr(hook, '__qualname__', hook)} must return None or "
                    f"a tuple of (new_args, new_kwargs), but got {result!r}"
                )
            args, kwargs = result
    return args, kwargs


def step_closure(closure: Callable[[], Any] | None = None) -> Callable[[], Any] | None:
    """The closure of ``step(*args, **kwargs)``, bound as torch's ``Optimizer.step(closure=None)`` binds it (a
    TypeError for anything else)."""
    return closure


class WrappedStep:
    """Runs ``base``'s own step beneath torch's hook runner, so each hook runs once per step at torch's place: the
    wrapped optimizer's step pre-hooks before kitsune changes anything, its post-hooks after everything."""

    def __init__(self, base: torch.optim.Optimizer) -> None:
        self.base = base
        self.steps = 0
        """Steps in which the wrapped optimizer's own step ran."""

    def pre_hooks(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The wrapped optimizer's step pre-hooks (registered on it, not on the wrapper), as its own step would run
        them: given ``(base, *args)`` and ``kwargs`` (the step's arguments as the caller passed them), each free to
        return new ones. Returns the arguments, without ``base``, that the step then takes."""
        base = self.base
        hooks = base._optimizer_step_pre_hooks
        if not hooks:  # (no list to copy on the common step)
            return args, kwargs
        args, kwargs = run_pre_hooks(base, list(hooks.values()), (base, *args), kwargs)
        return tuple(args[1:]), kwargs

    def post_hooks(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Its step post-hooks, given the arguments its pre-hooks left; and the mark LR schedulers built on the
        wrapped optimizer look for."""
        base = self.base
        base._opt_called = True  # type: ignore[attr-defined]
        hooks = base._optimizer_step_post_hooks
        if hooks:
            for hook in list(hooks.values()):
                hook(base, (base, *args), kwargs)

    def run(self, handled: Collection[torch.Tensor], closure: Callable[[], Any] | None) -> Any:
        """The wrapped step for every param not in ``handled`` (their grads are hidden from it meanwhile)."""
        base = self.base
        fn = type(base).step
        # torch wraps every Optimizer.step with its hook runner; call beneath it (the hooks run from the wrapper)
        raw = fn.__wrapped__ if getattr(fn, "hooked", False) and hasattr(fn, "__wrapped__") else fn
        mine = [p for g in base.param_groups for p in g["params"] if p in handled] if handled else []
        with grads_hidden(mine):
            out = raw(base, closure) if closure is not None else raw(base)
        self.steps += 1
        return out


@contextlib.contextmanager
def grads_hidden(params: Iterable[torch.Tensor]) -> Iterator[None]:
    """The grads of ``params`` set to None for the block, so that a step inside skips them (another route updates
    them), and put back afterwards, whatever the block raised."""
    hidden = [(p, p.grad) for p in params]
    for p, _ in hidden:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in hidden:
            p.grad = grad


def refuse_per_evaluation_passes(optimizer: torch.optim.Optimizer, clip: bool, scaling: bool) -> None:
    """An optimizer whose step needs its closure (LBFGS) evaluates it several times inside one step: clipping and
    float16 unscaling, which kitsune runs once on the grads before the step, cannot run between those evaluations."""
    if not isinstance(optimizer, torch.optim.LBFGS):  # LBFGS and its subclasses, whatever their signature says
        try:
            closure = inspect.signature(optimizer.step).parameters.get("closure")
        except (TypeError, ValueError):
            return
        if closure is None or closure.default is not inspect.Parameter.empty:
            return
    passes = []
    if clip:
        passes.append("max_grad_norm")
    if scaling:
        passes.append("float16 loss scaling (enable_amp with AMPConfig(dtype=torch.float16))")
    if passes:
        raise ValueError(
            f"{type(optimizer).__name__} evaluates its closure several times inside one step, so kitsune cannot "
            f"clip or unscale the grads between those evaluations: {' and '.join(passes)} cannot wrap it. Clip "
            "inside the closure (torch.nn.utils.clip_grad_norm_) and use AMPConfig(dtype=torch.bfloat16), which "
            "needs no loss scaling."
        )
