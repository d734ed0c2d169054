"""Step hooks around a fused step, as torch's hook runner calls them: the arguments as the caller passed them,
pre-hooks that replace them (on the wrapper and on the wrapped optimizer), a bad return value refused before
anything changes, and the profiler label a step carries."""

from __future__ import annotations

import inspect

import pytest
import torch
from helpers import batches, small_model
from torch import nn

from kitsune import KitsuneOptimizer


def _hooked_run(wrap: bool, enable_fusion: bool, device: torch.device) -> tuple[list, list, list[torch.Tensor]]:
    """Step hooks on the optimizer the user calls and on the wrapped one, each recording the arguments it got; the
    wrapped one's pre-hook replaces a keyword closure with one that scales its loss, the outer one wraps a
    positional closure. Five steps: keyword closure, positional closure, none, ``step(None)``, keyword again."""
    m = small_model(device=device)
    data = batches(5, device=device)
    base = torch.optim.Adam(m.parameters(), lr=0.05)
    opt = KitsuneOptimizer(base, enable_fusion=enable_fusion) if wrap else base
    outer, inner, losses = [], [], []

    def loss_of(x, y):
        def closure():
            opt.zero_grad()
            loss = nn.functional.mse_loss(m(x), y)
            loss.backward()
            return loss

        return closure

    def outer_pre(o, args, kwargs):
        outer.append(("pre", len(args), sorted(kwargs)))
        if len(args) == 2 and args[1] is not None:
            fn = args[1]
            return (args[0], lambda: fn() + 1), kwargs

    def inner_pre(o, args, kwargs):
        inner.append(("pre", o is base, len(args), sorted(kwargs)))
        if "closure" in kwargs:
            fn = kwargs["closure"]
            return args, {"closure": lambda: fn() * 10}

    opt.register_step_pre_hook(outer_pre)
    opt.register_step_post_hook(lambda o, a, k: outer.append(("post", len(a), sorted(k))))
    base.register_step_pre_hook(inner_pre)  # unwrapped: both hooks on the one optimizer, in kitsune's order
    base.register_step_post_hook(lambda o, a, k: inner.append(("post", o is base, len(a), sorted(k))))
    (x0, y0), (x1, y1), (x2, y2), (x3, y3), (x4, y4) = data
    losses.append(_detached(opt.step(closure=loss_of(x0, y0))))
    losses.append(_detached(opt.step(loss_of(x1, y1))))
    loss_of(x2, y2)()
    losses.append(_detached(opt.step()))
    loss_of(x3, y3)()
    losses.append(_detached(opt.step(None)))
    losses.append(_detached(opt.step(closure=loss_of(x4, y4))))
    if wrap and enable_fusion:
        assert {b.route.value for b in opt.plan.buckets} == {"triton"}
    return outer, inner, [*losses, *(p.detach().clone() for p in m.parameters())]


def _detached(loss: torch.Tensor | None) -> torch.Tensor | None:
    return None if loss is None else loss.detach()


@pytest.mark.parametrize("enable_fusion", [False, True])
def test_step_hooks_get_the_arguments_as_passed_and_may_replace_them(enable_fusion, device):
    """As torch's hook runner: a closure passed by keyword reaches every hook as a keyword, ``step(None)`` as a
    positional None; what a pre-hook returns (here wrapped closures, on the wrapper and on the wrapped optimizer)
    is what the step runs and what the later hooks get."""
    outer, inner, got = _hooked_run(True, enable_fusion, device)
    t_outer, t_inner, want = _hooked_run(False, False, device)
    assert outer == t_outer and inner == t_inner
    assert [x if x is None else x.item() for x in got[:5]] == [x if x is None else x.item() for x in want[:5]]
    assert float(got[0]) > 10 * 0.01  # the wrapped optimizer's hook scaled the keyword closure's loss
    for a, b in zip(got[5:], want[5:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_step_pre_hook_returning_something_else_raises_before_anything_changes(device):
    m = small_model(device=device)
    base = torch.optim.Adam(m.parameters(), lr=0.1)
    opt = KitsuneOptimizer(base, enable_fusion=True)
    m(torch.randn(2, 7, device=device)).sum().backward()
    before = [p.detach().clone() for p in m.parameters()]
    handle = base.register_step_pre_hook(lambda o, a, k: "not a tuple")
    with pytest.raises(RuntimeError, match="must return None or a tuple"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before, strict=True)) and not opt.state
    handle.remove()
    opt.step()
    assert opt.step_count == 1 and {b.route.value for b in opt.plan.buckets} == {"triton"}


def test_step_has_torch_profiler_label_without_hooks(device):
    m = small_model(device=device)
    opt = KitsuneOptimizer(torch.optim.AdamW(m.parameters()), enable_fusion=True)
    m(torch.randn(2, 7, device=device)).sum().backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    assert "Optimizer.step#KitsuneOptimizer.step" in {e.name for e in prof.events()}


def test_step_signature_is_torchs():
    opt = KitsuneOptimizer(torch.optim.SGD(small_model().parameters(), lr=0.1))
    assert list(inspect.signature(opt.step).parameters) == ["closure"]
    with pytest.raises(TypeError):
        opt.step(None, None)
