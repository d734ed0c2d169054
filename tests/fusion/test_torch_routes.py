"""The params kitsune hands to torch's own fused or foreach implementations, and the switches of torch's groups: each
steps as the wrapped optimizer steps them, or raises where its step raises, before anything changes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers import routes

from kitsune import KitsuneOptimizer


def _state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("late", ["first_grad_later", "buffer_set_to_none"])
def test_sgd_momentum_on_torchs_fused_route_starts_a_late_buffer_as_torch(late, device):
    """torch's fused SGD starts every momentum buffer of a call or none (it raised on a mix, every step from then
    on): a param whose first grad comes after the others', or whose buffer was set to None, steps as the wrapped
    SGD steps it."""
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(12, generator=gen, dtype=torch.float64).to(device) for _ in range(3)]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    theirs = [torch.nn.Parameter(t.clone()) for t in start]
    opt = KitsuneOptimizer(torch.optim.SGD(ours, lr=0.05, momentum=0.9, nesterov=True), enable_fusion=True)
    ref = torch.optim.SGD(theirs, lr=0.05, momentum=0.9, nesterov=True)
    assert routes(opt) == {"torch_fused"}  # float64: torch's fused SGD
    for step in range(8):
        grads = [torch.randn(12, generator=gen, dtype=torch.float64).to(device) for _ in range(3)]
        for params in (ours, theirs):
            for i, (p, g) in enumerate(zip(params, grads, strict=True)):
                p.grad = None if (late == "first_grad_later" and i == 1 and step < 3) else g.clone()
        if late == "buffer_set_to_none" and step == 4:
            opt.state[ours[2]]["momentum_buffer"] = None
            ref.state[theirs[2]]["momentum_buffer"] = None
        opt.step()
        ref.step()
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        for a, b in zip(ours, theirs, strict=True):
            if step >= 3 or late != "first_grad_later":
                torch.testing.assert_close(opt.state[a]["momentum_buffer"], ref.state[b]["momentum_buffer"])


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize("when", ["from_the_start", "mid_run"])
def test_adam_with_a_tensor_lr_on_torchs_foreach_route_steps_as_torch(cls, when, device):
    """A param laid out column-major (a transposed weight) takes torch's foreach route, whose Adam refuses a tensor lr
    without capturable (it raised every step): that group steps as torch's default does there, one tensor at a
    time."""

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(108, 4), torch.nn.Linear(4, 2)).to(device)
        net[1].weight = torch.nn.Parameter(net[1].weight.detach().t().contiguous().t())  # dense, column-major
        return net

    lr: Callable[[], float | torch.Tensor] = (lambda: torch.tensor(2e-3)) if when == "from_the_start" else lambda: 2e-3
    net, twin = model(), model()
    opt = KitsuneOptimizer(cls(net.parameters(), lr=lr(), weight_decay=0.01), enable_fusion=True)
    ref = cls(twin.parameters(), lr=lr(), weight_decay=0.01)
    assert "torch_foreach" in routes(opt) and "triton" in routes(opt)
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        if when == "mid_run" and step == 3:
            opt.param_groups[0]["lr"] = torch.tensor(5e-3)
            ref.param_groups[0]["lr"] = torch.tensor(5e-3)
        x = torch.randn(2, 3, 6, 6, generator=gen).to(device=device)
        for m, o in ((net, opt), (twin, ref)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
        for a, b in zip(net.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


CASES = [
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True), "nesterov"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, maximize=True), "maximize"),
    (lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True), "amsgrad"),
    (lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=0.1, decoupled_weight_decay=True), "decoupled_weight_decay"),
    (lambda ps: torch.optim.AdamW(ps, lr=0.1, maximize=True), "maximize"),
    (lambda ps: torch.optim.RMSprop(ps, lr=0.1, centered=True), "centered"),
    (lambda ps: torch.optim.NAdam(ps, lr=0.1, decoupled_weight_decay=True), "decoupled_weight_decay"),
]


@pytest.mark.parametrize(("make", "key"), CASES, ids=[f"{i}-{k}" for i, (_, k) in enumerate(CASES)])
def test_a_switch_deleted_from_a_torch_group_raises_keyerror_as_torch(make, key, device):
    """torch's step reads each switch as ``group[key]``: a deleted one is a KeyError, before anything changes. The
    fused step read it with a default and stepped as if the switch were off (a nesterov group without nesterov)."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(16, generator=gen).to(device)
    params = [torch.nn.Parameter(start.clone())]
    twins = [torch.nn.Parameter(start.clone())]
    opt = KitsuneOptimizer(make(params), enable_fusion=True)
    ref = make(twins)
    assert routes(opt) == {"triton"}
    for step in range(3):
        g = torch.randn(16, generator=gen).to(device)
        params[0].grad, twins[0].grad = g.clone(), g.clone()
        if step == 2:
            del opt.param_groups[0][key]
            del ref.param_groups[0][key]
            before, state = params[0].detach().clone(), _state(opt)
            with pytest.raises(KeyError, match=key):
                ref.step()
            with pytest.raises(KeyError, match=key):
                opt.step()
            assert torch.equal(params[0], before)
            assert all(torch.equal(a, b) for a, b in zip(_state(opt), state, strict=True))
        else:
            opt.step()
            ref.step()


def test_sgd_on_torchs_fused_route_skips_an_overflowing_first_step_as_grad_scaler(device):
    """float16 AMP whose first step overflows, on torch's fused SGD route: torch's fused step makes the momentum
    buffer (empty_like) before it reads found_inf and leaves it unwritten, so the next step read garbage (params at
    1e30). A step that would start state is skipped on the host, as GradScaler skips a non-fused optimizer."""
    from kitsune import AMPConfig, FusionConfig, KitsuneConfig

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(16, device=device))
    config = KitsuneConfig(fusion=FusionConfig(min_fusion_benefit=1e9), amp=AMPConfig(dtype=torch.float16))
    opt = KitsuneOptimizer(torch.optim.SGD([p], lr=0.05, momentum=0.9), config=config)
    assert routes(opt) == {"torch_fused"}
    before = p.detach().clone()
    opt.backward((p * float("inf")).sum())  # an overflow on the first step
    opt.step()
    assert torch.equal(p, before) and not opt.state[p]
    opt.zero_grad()
    opt.backward((p * torch.randn(16, device=device)).sum())
    opt.step()
    assert torch.isfinite(p).all() and (p - before).abs().max() < 1.0
