"""The grads' passes fused into the step: clipping, unscaling and inf/nan skips in the norm and update kernels, and
zeroing in the update kernel. Each is checked against torch's own loop over many steps of fresh random grads."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import batches, small_model
from torch import nn
from twins import make_params, random_grads

from kitsune import AMPConfig, FusionConfig, GradConfig, KitsuneOptimizer

SIZES = [(7, 5), 33, 1, (4, 4097 // 4), 0]


def _grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    """Fresh grads whose global norm swings between about 0.2x and 1.7x of 1.0, so some steps clip and some do not."""
    scale = 0.005 * (1.0 + 9.0 * ((step * 7) % 11) / 10.0)
    return [g * scale for g in random_grads(params, step)]


@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["l2", "inf"])
@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    ],
    ids=["adamw", "sgd_nesterov"],
)
def test_clip_in_step_equals_torch_clip_then_step(device, make_opt, norm_type):
    max_norm = 1.0 if norm_type == 2.0 else 0.05
    ref = make_params(SIZES, torch.float32, device)
    ours = make_params(SIZES, torch.float32, device)
    ref_opt = make_opt(ref)
    opt = KitsuneOptimizer(  # eager: this test also counts the step's launches
        make_opt(ours),
        enable_fusion=True,
        grad_config=GradConfig(max_norm=max_norm, norm_type=norm_type),
        capture_graph=False,
    )
    assert opt.plan.fused_tensors == len(SIZES)
    clipped = 0
    for step in range(30):
        grads = _grads(ref, step)
        for p, q, g in zip(ref, ours, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        # torch refuses the inf-norm of an empty grad (no identity for max); |x| >= 0 makes 0 one here
        want = torch.nn.utils.clip_grad_norm_([p for p in ref if p.numel()], max_norm, norm_type)
        want_grads = [p.grad.clone() for p in ref]  # torch's foreach nesterov SGD adds to the grads in its step
        ref_opt.step()
        opt.step()
        clipped += bool(want > max_norm)
        torch.testing.assert_close(opt.last_grad_norm, want, atol=1e-6, rtol=1e-6)
        for g, q in zip(want_grads, ours, strict=True):  # the grads hold what torch's clip left in them
            torch.testing.assert_close(q.grad, g, atol=1e-7, rtol=1e-6)
    assert 5 < clipped < 25  # both branches of the clip coefficient ran
    for p, q in zip(ref, ours, strict=True):
        torch.testing.assert_close(q.detach(), p.detach(), atol=1e-5, rtol=1e-5)
    status = {s["name"]: s for s in opt.subsystem_status()}
    assert status["fusion"]["report"]["fused_launches_per_step"] == 2  # norm pass + update


@pytest.mark.parametrize("fallback", [False, True], ids=["fused", "torch_route"])
def test_a_step_with_no_grads_reports_a_norm_of_zero_as_torchs_clip(device, fallback):
    """A step in which no param has a grad (every layer frozen for a step): ``last_grad_norm`` is 0 on the params'
    device, as torch's ``clip_grad_norm_`` returns for no grads, not None (a loop logging ``.item()`` would fail),
    and the next step with grads reports their norm again."""
    params = make_params([(6, 4), 9], torch.float32, device, seed=4)
    fusion = {"fusion_config": FusionConfig(min_fusion_benefit=1e9)} if fallback else {}
    opt = KitsuneOptimizer(torch.optim.AdamW(params, lr=1e-2), enable_fusion=True, max_grad_norm=1.0, **fusion)
    assert opt.plan.fused_tensors == (0 if fallback else 2)
    for step in range(4):
        grads = random_grads(params, step) if step != 2 else [None] * len(params)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        live = [g.flatten() for g in grads if g is not None]
        want = torch.linalg.vector_norm(torch.cat(live)) if live else torch.nn.utils.clip_grad_norm_([], 1.0)
        opt.step()
        norm = opt.last_grad_norm
        assert norm is not None and norm.device == params[0].device and norm.dtype == torch.float32
        torch.testing.assert_close(norm, want.to(norm.device), atol=1e-6, rtol=1e-6)
        assert (norm.item() == 0) == (step == 2)


def test_zero_in_step_zeroes_grads_and_zero_grad_keeps_them(device):
    ref = make_params(SIZES, torch.float32, device)
    ours = make_params(SIZES, torch.float32, device)
    ref_opt = torch.optim.Adam(ref, lr=1e-2)
    opt = KitsuneOptimizer(
        torch.optim.Adam(ours, lr=1e-2), enable_fusion=True, grad_config=GradConfig(max_norm=1.0, zero_in_step=True)
    )
    for step in range(20):
        grads = _grads(ref, step)
        for p, q, g in zip(ref, ours, grads, strict=True):
            p.grad = g.clone()
            if q.grad is None:
                q.grad = g.clone()
            else:  # accumulate into the zeroed grad, as backward does
                q.grad.add_(g)
        torch.nn.utils.clip_grad_norm_(ref, 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        assert all(torch.count_nonzero(q.grad) == 0 for q in ours)
        ptrs = [q.grad.data_ptr() for q in ours]
        opt.zero_grad()  # set_to_none=True, yet the zeroed grads stay allocated where the kernel knows them
        assert [q.grad.data_ptr() for q in ours] == ptrs
    for p, q in zip(ref, ours, strict=True):
        torch.testing.assert_close(q.detach(), p.detach(), atol=1e-5, rtol=1e-5)


def test_zero_grad_after_zero_in_step_still_clears_grads_changed_since(device):
    ours = make_params([5, 6], torch.float32, device)
    opt = KitsuneOptimizer(torch.optim.SGD(ours, lr=0.1), enable_fusion=True, grad_config=GradConfig(zero_in_step=True))
    for q, g in zip(ours, _grads(ours, 0), strict=True):
        q.grad = g
    opt.step()
    ours[0].grad.add_(1.0)  # a backward after the step accumulates into the zeroed grad
    ours[1].grad = torch.ones_like(ours[1])  # a new grad object
    opt.zero_grad(set_to_none=False)
    assert torch.count_nonzero(ours[0].grad) == 0 and torch.count_nonzero(ours[1].grad) == 0
    opt.step()
    opt.zero_grad()  # nothing changed since this step: nothing to do, the grads stay
    assert ours[0].grad is not None


@pytest.mark.parametrize("set_to_none", [False, True])
def test_zero_grad_after_zero_in_step_clears_a_grad_replaced_by_a_new_tensor(set_to_none, device):
    """After the step zeroed the grads, each is replaced by a new tensor (the old one freed): CPython often hands the
    new tensor the old one's id, and both version counters read alike, so zero_grad took it for the grad the step
    zeroed and left it (36 of 40 rounds before). It clears each one as torch does, every round."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3).to(device)
    opt = KitsuneOptimizer(
        torch.optim.SGD(lin.parameters(), lr=0.1), enable_fusion=True, grad_config=GradConfig(zero_in_step=True)
    )
    assert {b.route.value for b in opt.plan.buckets} == {"triton"}
    x = torch.randn(2, 4, device=device)
    for _ in range(40):
        lin(x).sum().backward()
        opt.step()
        for p in lin.parameters():
            p.grad = None
            p.grad = torch.ones_like(p)
        opt.zero_grad(set_to_none=set_to_none)
        for p in lin.parameters():
            assert p.grad is None if set_to_none else not p.grad.any()
        lin.zero_grad()


@pytest.mark.parametrize("flat", [False, True], ids=["grads", "flat_grads"])
def test_zero_grad_after_zero_in_step_clears_grads_left_to_the_wrapped_step(flat, device):
    """A sparse embedding grad goes to SGD's own step beside the fused Linear: the kernel never zeroed it, so
    zero_grad must clear it (it was kept, and each backward added onto the last: 0.1 off torch after 6 steps)."""
    from kitsune import FusionConfig, KitsuneConfig, MemoryConfig

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 3)).to(device)

    ref_model, ours = model(), model()
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.05)
    config = KitsuneConfig(
        fusion=FusionConfig(), grads=GradConfig(zero_in_step=True), memory=MemoryConfig(flat_grads=flat)
    )
    opt = KitsuneOptimizer(torch.optim.SGD(ours.parameters(), lr=0.05), config=config)
    assert "triton" in {b.route.value for b in opt.plan.buckets}
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        idx = torch.randint(0, 10, (5, 3), generator=gen).to(device)
        y = torch.randn(5, 3, 3, generator=gen).to(device)
        for m, o in ((ref_model, ref), (ours, opt)):
            nn.functional.mse_loss(m(idx), y).backward()
            o.step()
            o.zero_grad()
        assert ours[0].weight.grad is None
        for a, b in zip(ref_model.parameters(), ours.parameters(), strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def _scaled_backward(params: list[torch.Tensor], grads: list[torch.Tensor], scale_loss) -> None:
    # d/dp sum(p * g) = g, so each param's grad is the loss scale times g (exact: the scale is a power of two)
    loss = sum((p * g).sum() for p, g in zip(params, grads, strict=True))
    scale_loss(loss).backward()


def _poisoned(grads: list[torch.Tensor], step: int, bad: set[int]) -> list[torch.Tensor]:
    if step in bad:
        grads[step % len(grads)].view(-1)[0] = float("nan") if step % 2 else float("inf")
    return grads


@pytest.mark.parametrize("clip", [None, 1.0], ids=["no_clip", "clip"])
def test_fp16_loop_equals_grad_scaler_and_torch_fused_adamw(device, clip):
    """100 steps: kitsune's own loss scaler (unscale and inf check fused into the norm pass, skip and clip in the
    update kernel) against GradScaler + torch.nn.utils.clip_grad_norm_ + torch's fused AdamW, with forced
    overflows: the same skip pattern, the same scale trajectory, the same params."""
    steps, bad = 100, {3, 4, 60, 61, 62, 95}  # the scale grows past its start between them (1000 steps: slow, below)
    sizes = [(6, 5), 17, 64]
    ref = make_params(sizes, torch.float32, device)
    ours = make_params(sizes, torch.float32, device)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**12, growth_interval=16)
    amp = AMPConfig(dtype=torch.float16, init_scale=2.0**12, growth_interval=16)
    opt = KitsuneOptimizer(
        torch.optim.AdamW(ours, lr=1e-2, weight_decay=0.1),
        enable_fusion=True,
        enable_amp=True,
        amp_config=amp,
        max_grad_norm=clip,
    )
    ref_scales, scales = [], []
    for step in range(steps):
        grads = _poisoned(_grads(ref, step), step, bad)
        _scaled_backward(ref, grads, scaler.scale)
        if clip is not None:
            scaler.unscale_(ref_opt)
            torch.nn.utils.clip_grad_norm_(ref, clip)
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad()
        ref_scales.append(scaler.get_scale())

        opt.backward(sum((p * g).sum() for p, g in zip(ours, grads, strict=True)))
        opt.step()
        opt.zero_grad()
        scales.append(opt.loss_scale)
    assert scales == ref_scales
    assert opt.skipped_steps == len(bad) and opt.host_syncs == 0
    assert max(scales) > 2.0**12  # the scale grew between the overflows, as well as backing off
    assert int(opt.state[ours[0]]["step"]) == steps - len(bad) == int(ref_opt.state[ref[0]]["step"])
    for p, q in zip(ref, ours, strict=True):
        torch.testing.assert_close(q.detach(), p.detach(), atol=2e-5, rtol=2e-5)


@pytest.mark.slow  # a long run (minutes in the CPU interpreter): `make test-all` and the GPU check
def test_thousand_steps_with_injected_inf_and_nan_skip_exactly_those(device):
    gen = torch.Generator().manual_seed(7)
    bad = set(torch.randperm(1000, generator=gen)[:100].tolist())
    ours = make_params([9, 40], torch.float32, device)
    opt = KitsuneOptimizer(
        torch.optim.Adam(ours, lr=1e-3),
        enable_fusion=True,
        enable_amp=True,
        amp_config=AMPConfig(init_scale=2.0**8, growth_interval=50),
        max_grad_norm=1.0,
    )
    for step in range(1000):
        grads = _grads(ours, step)
        if step in bad:
            grads[step % 2].view(-1)[-1] = float("nan") if step % 3 else float("-inf")
        opt.backward(sum((p * g).sum() for p, g in zip(ours, grads, strict=True)))
        opt.step()
        opt.zero_grad()
    assert opt.skipped_steps == len(bad)
    for q in ours:
        assert torch.isfinite(q).all()
        assert all(torch.isfinite(v).all() for v in opt.state[q].values())
        assert int(opt.state[q]["step"]) == 1000 - len(bad)


def test_user_grad_scaler_with_fused_unscale_and_clip(device):
    """A user's own GradScaler (grad_scale/found_inf protocol) with in-step clipping: the update kernel divides by
    the scaler's scale, so the loop equals torch's unscale_ + clip + step."""
    sizes = [(6, 5), 17]
    ref = make_params(sizes, torch.float32, device)
    ours = make_params(sizes, torch.float32, device)
    ref_opt = torch.optim.Adam(ref, lr=1e-2)
    opt = KitsuneOptimizer(torch.optim.Adam(ours, lr=1e-2), enable_fusion=True, max_grad_norm=0.5)
    s1 = torch.amp.GradScaler(device.type, init_scale=2.0**6, growth_interval=5)
    s2 = torch.amp.GradScaler(device.type, init_scale=2.0**6, growth_interval=5)
    for step in range(30):
        grads = _poisoned(_grads(ref, step), step, {7, 8, 20})
        _scaled_backward(ref, grads, s1.scale)
        s1.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref, 0.5)
        s1.step(ref_opt)
        s1.update()
        ref_opt.zero_grad()
        _scaled_backward(ours, grads, s2.scale)
        s2.step(opt)
        s2.update()
        opt.zero_grad()
        assert s1.get_scale() == s2.get_scale()
    for p, q in zip(ref, ours, strict=True):
        torch.testing.assert_close(q.detach(), p.detach(), atol=1e-5, rtol=1e-5)


def test_clip_with_a_fallback_bucket_runs_as_its_own_pass(device):
    """A float64 param goes to torch's path: the grads cannot all be clipped inside the fused kernel, so the
    clip runs first as its own pass, with the same result."""
    model = small_model(device=device)
    extra = nn.Parameter(torch.randn(5, dtype=torch.float64, device=device))
    ref_model = small_model(device=device)
    ref_extra = nn.Parameter(extra.detach().clone())
    opt = KitsuneOptimizer(
        torch.optim.AdamW([*model.parameters(), extra], lr=1e-2), enable_fusion=True, max_grad_norm=0.1
    )
    ref_opt = torch.optim.AdamW([*ref_model.parameters(), ref_extra], lr=1e-2)
    status = {s["name"]: s for s in opt.subsystem_status()}
    assert "fall back" in status["fusion"]["report"]["grad_pass"]
    for x, y in batches(10, device=device):
        for m, e, o in ((model, extra, opt), (ref_model, ref_extra, ref_opt)):
            (nn.functional.mse_loss(m(x), y) + (e * e).sum()).backward()
            if o is ref_opt:
                want = torch.nn.utils.clip_grad_norm_([*m.parameters(), e], 0.1)
            o.step()
            o.zero_grad()
        torch.testing.assert_close(opt.last_grad_norm.double(), want.double(), atol=1e-6, rtol=1e-6)
    for p, q in zip(ref_model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q.detach(), p.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("setting", ["zero_in_step", "flat_grads"])
def test_zero_grad_carries_torchs_profiler_label_when_the_step_zeroed_already(setting, device):
    """torch's zero_grad always runs under its profiler label; with the grads already zeroed (by the fused step, or
    the arena's one fill) kitsune's returned before it, and the trace had no zero_grad."""
    from kitsune import FusionConfig, KitsuneConfig, MemoryConfig

    params = make_params([6, 5], torch.float32, device)
    config = KitsuneConfig(
        fusion=FusionConfig(),
        grads=GradConfig(zero_in_step=setting == "zero_in_step"),
        memory=MemoryConfig(flat_grads=setting == "flat_grads"),
    )
    opt = KitsuneOptimizer(torch.optim.Adam(params, lr=0.1), config=config)
    assert {b.route.value for b in opt.plan.buckets} == {"triton"}
    for q, g in zip(params, _grads(params, 0), strict=True):
        q.grad = g
    opt.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.zero_grad()
    names = [e.name for e in prof.events()]
    assert names.count("Optimizer.zero_grad#KitsuneOptimizer.zero_grad") == 1


def test_zero_in_step_zeroes_on_the_profilers_comparison_steps_too(device):
    """The live comparison runs the wrapped optimizer's own step on some steps; with zero_in_step the grads stayed
    as they were there, and a loop that leaves zeroing to the step added the next backward onto them."""
    from kitsune import FusionConfig, KitsuneConfig, ProfilerConfig

    ours, theirs = small_model(device=device), small_model(device=device)
    config = KitsuneConfig(
        fusion=FusionConfig(),
        grads=GradConfig(zero_in_step=True),
        profiler=ProfilerConfig(compare_steps=2, sample_after=0),
    )
    opt = KitsuneOptimizer(torch.optim.AdamW(ours.parameters(), lr=1e-2), config=config)
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    assert {b.route.value for b in opt.plan.buckets} == {"triton"}
    for x, y in batches(6, device=device):
        for model, o in ((ours, opt), (theirs, ref)):
            nn.functional.mse_loss(model(x), y).backward()
            o.step()
        ref.zero_grad()  # kitsune's loop leaves it to the step
        assert all(not p.grad.any() for p in ours.parameters())
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
