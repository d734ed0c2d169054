"""Shared test fixtures: a small model, fresh random data, trajectory comparison."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def recording_tracing(
    fn: Callable[..., Any], seen: list[bool], when: Callable[..., bool] | None = None
) -> Callable[..., Any]:
    """``fn``, recording at each call (where ``when(*args, **kwargs)`` holds) whether torch.compile is tracing it: a
    traced call records True. Set it in place of a method, and put the method back after."""

    def spy(*args: Any, **kwargs: Any) -> Any:
        if when is None or when(*args, **kwargs):
            seen.append(torch.compiler.is_compiling())
        return fn(*args, **kwargs)

    return spy


def small_model(seed: int = 0, device: torch.device | str = "cpu") -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 16), nn.Tanh(), nn.Linear(16, 5)).to(device)


def batches(n: int, seed: int = 1, device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    data = [(torch.randn(9, 7, generator=gen), torch.randn(9, 5, generator=gen)) for _ in range(n)]
    return [(x.to(device), y.to(device)) for x, y in data]


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    sched: torch.optim.lr_scheduler.LRScheduler | None = None,
    set_to_none: bool = True,
) -> list[list[torch.Tensor]]:
    """Run the steps; return a snapshot of every param after each step."""
    snaps = []
    for x, y in data:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        if sched is not None:
            sched.step()
        snaps.append([p.detach().clone() for p in model.parameters()])
    return snaps


def routes(opt: torch.optim.Optimizer) -> set[str]:
    """The routes of a KitsuneOptimizer's plan (``{"triton"}`` where every bucket runs the fused kernel): a test that
    could pass while fusion fell back asserts them."""
    return {b.route.value for b in opt.plan.buckets}  # type: ignore[attr-defined]


def assert_identical(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> None:
    assert len(a) == len(b)
    for step, (sa, sb) in enumerate(zip(a, b, strict=True)):
        for i, (x, y) in enumerate(zip(sa, sb, strict=True)):
            assert torch.equal(x, y), f"param {i} differs at step {step}: max diff {(x - y).abs().max().item()}"


def twin_runs(
    make_opt: Callable[[nn.Module], torch.optim.Optimizer], steps: int = 50, **kitsune_kwargs
) -> tuple[list, list]:
    """The same training run with the plain optimizer and with it wrapped by KitsuneOptimizer."""
    from kitsune import KitsuneOptimizer

    data = batches(steps)
    m1 = small_model()
    ref = train(m1, make_opt(m1), data)
    m2 = small_model()
    ours = train(m2, KitsuneOptimizer(make_opt(m2), **kitsune_kwargs), data)
    return ref, ours


def no_grad_step(device: torch.device, fusion: bool) -> None:
    """A float16 AMP step after ``zero_grad()`` dropped the scaled grads, then a clean step, then a second step()."""
    import pytest

    from kitsune import AMPConfig, KitsuneOptimizer

    model = small_model(device=device)
    cfg = AMPConfig(dtype=torch.float16, init_scale=2.0**10, growth_interval=1)
    opt = KitsuneOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), enable_amp=True, amp_config=cfg, enable_fusion=fusion
    )
    assert ("triton" in str(opt.plan)) == fusion
    x, y = batches(1, device=device)[0]
    opt.backward(nn.functional.mse_loss(model(x), y))
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert opt.loss_scale == 2.0**10 and opt.skipped_steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    opt.backward(nn.functional.mse_loss(model(x), y))
    opt.step()
    assert opt.loss_scale == 2.0**11  # a clean step with grads grows it, as GradScaler's would
    with pytest.raises(RuntimeError, match="a second step\\(\\) without a new backward"):
        opt.step()
