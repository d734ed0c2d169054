"""Fused LAMB and LARS (per-tensor trust ratios from the norm pass) against their eager references."""

from __future__ import annotations

import pytest
import torch
from twins import assert_close_params, assert_same_state, make_params, random_grads, trajectory

from kitsune import AMPConfig, KitsuneOptimizer
from kitsune.fusion import Route
from kitsune.optim import LAMB, LARS

SIZES = [(7, 3), 16, 5, 1, 0]

CASES = {
    "lamb": lambda ps: LAMB(ps, lr=1e-2, weight_decay=0.01),
    "lamb_groups": lambda ps: LAMB(
        [
            {"params": ps[:2], "max_trust_ratio": 1.5, "maximize": True},
            {"params": ps[2:], "layer_adaptation": False, "weight_decay": 0.0, "bias_correction": False},
        ],
        lr=1e-2,
        weight_decay=0.1,
    ),
    "lars": lambda ps: LARS(ps, lr=0.1, weight_decay=1e-3),
    "lars_groups": lambda ps: LARS(
        [
            {"params": ps[:2], "nesterov": True, "trust_coefficient": 0.01},
            {"params": ps[2:], "layer_adaptation": False, "dampening": 0.1, "maximize": True},
        ],
        lr=0.1,
        momentum=0.9,
        weight_decay=1e-2,
    ),
    "lars_no_momentum": lambda ps: LARS(ps, lr=0.1, momentum=0.0, eps=1e-3),
}
# the norms come from another summation order than torch.linalg.vector_norm: a few fp32 ulps per step
TOL32 = (5e-5, 5e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_fused_trajectory_matches_eager(name, dtype, device):
    make = CASES[name]
    params, opt = trajectory(make, SIZES, dtype, device, fused=True)
    assert opt.plan.fused_tensors == len(SIZES) and opt.plan.buckets[0].route is Route.TRITON
    ref_params, ref = trajectory(make, SIZES, dtype, device, rounded=dtype != torch.float32)
    if dtype == torch.float32:
        for a, b in zip(params, ref_params, strict=True):
            torch.testing.assert_close(a.detach(), b.detach(), atol=TOL32[0], rtol=TOL32[1])
    else:
        assert_close_params(params, ref_params, dtype)
    assert_same_state(ref, opt, dtype, values=dtype != torch.float32)


def test_trust_ratio_changes_the_update(device):
    """The trust ratio is not a no-op: LAMB with and without layer adaptation part ways, fused as eager."""
    adapted, _ = trajectory(lambda ps: LAMB(ps, lr=1e-2), SIZES, torch.float32, device, steps=5, fused=True)
    plain, _ = trajectory(
        lambda ps: LAMB(ps, lr=1e-2, layer_adaptation=False), SIZES, torch.float32, device, steps=5, fused=True
    )
    assert any(not torch.allclose(a, b) for a, b in zip(adapted, plain, strict=True) if a.numel())


@pytest.mark.parametrize("make", [CASES["lamb"], CASES["lars_groups"]], ids=["lamb", "lars"])
def test_with_amp_and_clip_equals_eager_on_unscaled_clipped_grads(make, device):
    """fp16 loss scaling and clipping fused into the same two passes: the eager optimizer after torch's
    unscale and clip_grad_norm_ gives the same params; an overflow step changes nothing."""
    sizes = [(6, 5), 17, 9]
    ref = make_params(sizes, torch.float32, device)
    ours = make_params(sizes, torch.float32, device)
    ref_opt = make(ref)
    opt = KitsuneOptimizer(make(ours), enable_fusion=True, enable_amp=True, amp_config=AMPConfig(), max_grad_norm=0.5)
    fusion = next(s for s in opt.subsystem_status() if s["name"] == "fusion")
    assert fusion["report"]["grad_pass"].startswith("fused")
    for step in range(25):
        grads = random_grads(ref, step)
        if step == 7:
            grads[1][0] = float("inf")
        opt.backward(sum((q * g).sum() for q, g in zip(ours, grads, strict=True)))
        opt.step()
        opt.zero_grad()
        if step != 7:
            for p, g in zip(ref, grads, strict=True):
                p.grad = g.clone()
            torch.nn.utils.clip_grad_norm_(ref, 0.5)
            ref_opt.step()
    assert opt.skipped_steps == 1
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), atol=TOL32[0], rtol=TOL32[1])


@pytest.mark.parametrize("name, updates", [("lamb", 2), ("lars", 1)])
def test_the_plan_and_the_report_count_lambs_two_stages(name, updates, device):
    """LAMB's update runs in two launches (stage 1 reduces its direction's norm, stage 2 applies it), LARS's in one;
    both after the norm pass. The plan counts a bucket's update launches, the report every launch of the step."""
    params, opt = trajectory(CASES[name], SIZES, torch.float32, device, steps=3, fused=True, capture_graph=False)
    assert [b.route for b in opt.plan.buckets] == [Route.TRITON]
    assert opt.plan.buckets[0].launches == opt.plan.launches == updates
    fusion = next(s for s in opt.subsystems if s.name == "fusion").report()
    assert fusion["fused_launches_per_step"] == updates + 1 and fusion["fused_launches_total"] == 3 * (updates + 1)
