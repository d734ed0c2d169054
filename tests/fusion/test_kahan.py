"""bf16 params with Kahan compensation: ``FusionConfig(param_rounding="kahan")``.

The update is computed in fp32 as always; the store rounds the param to nearest and keeps what the rounding dropped
in a bf16 compensation tensor (state ``kahan_comp``) that the next step adds back, as torch-optimi's ``kahan_sum``
does. Checked here against an fp32 master copy of the params on fresh random grads over many steps, against the
nearest rounding it replaces (which must fall behind), on updates far below a bf16 step, with the memory pool, and
through checkpoints of plain torch.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kitsune import FusionConfig, KitsuneOptimizer
from kitsune.fusion import Route
from kitsune.fusion.algos import KAHAN_COMP

SIZES = [(24, 40), 700, 5]
STEPS = 60


def _params(dtype: torch.dtype, device: torch.device, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=gen) * 3).to(dtype).to(device)) for s in SIZES]


def _grads(step: int, device: torch.device) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(s, generator=gen) * torch.rand(s, generator=gen) ** 2).to(device) for s in SIZES]


MAKERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=2e-3, momentum=0.9, weight_decay=1e-2),
}


def _kitsune(params, make, rounding: str, **fusion) -> KitsuneOptimizer:
    config = FusionConfig(param_rounding=rounding, state_precision="fp32", **fusion)
    return KitsuneOptimizer(make(params), enable_fusion=True, fusion_config=config)


@pytest.mark.parametrize("name", list(MAKERS))
def test_kahan_tracks_fp32_master_weights_where_nearest_falls_behind(name, device):
    """bf16 params (state in fp32) against fp32 params of the same start, each stepped with the same fresh grads for
    60 steps: with Kahan the bf16 param stays within a bf16 step of the fp32 trajectory and, with its compensation,
    within half of one; with nearest rounding the updates under half a bf16 step are lost and it falls behind."""
    make = MAKERS[name]
    master = [torch.nn.Parameter(p.detach().float()) for p in _params(torch.bfloat16, device)]
    ref = make(master)
    runs = {r: _params(torch.bfloat16, device) for r in ("kahan", "nearest")}
    opts = {r: _kitsune(ps, make, r) for r, ps in runs.items()}
    for step in range(STEPS):
        grads = _grads(step, device)
        for p, g in zip(master, grads, strict=True):
            p.grad = g.to(torch.bfloat16).float()  # the grads the bf16 params get: only the params' rounding differs
        ref.step()
        for r, ps in runs.items():
            for p, g in zip(ps, grads, strict=True):
                p.grad = g.to(torch.bfloat16)
            opts[r].step()
    bucket = opts["kahan"].plan.buckets[0]
    assert bucket.route is Route.TRITON and "Kahan compensation" in bucket.options
    ulps = {}  # the largest distance from the master, in bf16 steps at the master's value
    for r, ps in runs.items():
        ulps[r] = max(
            float(((p.detach().float() - q.detach()).abs() / _ulp(q.detach())).max())
            for p, q in zip(ps, master, strict=True)
        )
    assert ulps["kahan"] <= 1.0 and ulps["nearest"] > 3.0, ulps
    for p, q in zip(runs["kahan"], master, strict=True):
        comp = opts["kahan"].state[p][KAHAN_COMP]
        assert comp.dtype == torch.bfloat16 and comp.shape == p.shape
        # the param plus its compensation: the master within half a bf16 step (weight decay reads the bf16 param)
        assert float(((p.detach().float() + comp.float() - q.detach()).abs() / _ulp(q.detach())).max()) < 0.5


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """bf16's step at each value of ``x`` (at least that of 1e-3)."""
    return torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(x.abs().clamp(min=1e-3))))


def test_updates_far_below_a_bf16_step_add_up(device):
    """SGD, lr 1, a grad of a tenth of p's bf16 step: nearest rounding never moves p; with Kahan p moves one step
    for every ten updates, exactly."""
    n = 4096
    step_down = 2.0**-8  # bf16's step just below 1.0
    for rounding, want in (("nearest", 1.0), ("kahan", 1.0 - 3 * step_down)):
        p = torch.nn.Parameter(torch.full((n,), 1.0, dtype=torch.bfloat16, device=device))
        opt = _kitsune([p], lambda ps: torch.optim.SGD(ps, lr=1.0), rounding)
        for _ in range(30):
            p.grad = torch.full((n,), step_down / 10, dtype=torch.bfloat16, device=device)
            opt.step()
        assert (p.detach().float() == want).all(), (rounding, p.detach().float().unique())


def test_plan_notes_and_which_params_take_it(device):
    from kitsune.optim import LAMB

    ps = [torch.nn.Parameter(torch.randn(300, device=device).to(dt)) for dt in (torch.bfloat16, torch.float32)]
    opt = _kitsune(ps, lambda q: torch.optim.AdamW(q, lr=1e-3), "kahan")
    by_dtype = {b.dtype: b for b in opt.plan.buckets}
    assert "Kahan compensation" in by_dtype["bfloat16"].options
    nearest = _kitsune(ps, lambda q: torch.optim.AdamW(q, lr=1e-3), "nearest")
    plain = {b.dtype: b for b in nearest.plan.buckets}["bfloat16"]
    assert (
        by_dtype["bfloat16"].bytes_per_step == plain.bytes_per_step + 2 * 2 * 300
    )  # the compensation, read and written
    assert "Kahan compensation" not in by_dtype["float32"].options  # fp32 params: nothing to compensate
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    assert KAHAN_COMP in opt.state[ps[0]] and KAHAN_COMP not in opt.state[ps[1]]
    lamb = _kitsune([ps[0]], lambda q: LAMB(q, lr=1e-3), "kahan")
    assert any("trust-ratio" in n for b in lamb.plan.buckets for n in b.notes)


def test_memory_pool_holds_the_compensation_and_changes_no_bit(device):
    runs = []
    for pool in (0, 64 << 20):
        ps = _params(torch.bfloat16, device)
        config = FusionConfig(param_rounding="kahan")
        opt = KitsuneOptimizer(
            MAKERS["adamw"](ps), enable_fusion=True, fusion_config=config, memory_pool_size=pool, capture_graph=False
        )
        for step in range(8):
            for p, g in zip(ps, _grads(step, device), strict=True):
                p.grad = g.to(torch.bfloat16)
            opt.step()
        memory = next(s for s in opt.subsystem_status() if s["name"] == "memory")
        runs.append((ps, opt, memory["active"]))
    assert runs[1][2] and not runs[0][2]
    for p, q in zip(runs[0][0], runs[1][0], strict=True):
        assert torch.equal(p, q)
        assert torch.equal(runs[0][1].state[p][KAHAN_COMP], runs[1][1].state[q][KAHAN_COMP])


@pytest.mark.parametrize("name", list(MAKERS))
def test_a_torch_checkpoint_carries_its_state_on(name, device):
    """Plain torch's checkpoint (no ``kahan_comp``) of bf16 params loaded into kitsune with Kahan: the loaded momentum
    and moments go on from where torch left them, as torch's own next steps take them (the compensation starts at
    zero). SGD's momentum buffer was taken as new on the first step after the load (``buf = grad``: 0.9 of it lost),
    because the missing compensation made the param look stateless."""
    make = MAKERS[name]
    ps = _params(torch.bfloat16, device)
    plain = make(ps)
    for step in range(4):
        for p, g in zip(ps, _grads(step, device), strict=True):
            p.grad = g.to(torch.bfloat16)
        plain.step()
    ours_ps = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ours = _kitsune(ours_ps, make, "kahan")
    ours.load_state_dict(copy.deepcopy(plain.state_dict()))
    for step in range(4, 7):
        for pair in ((ps, plain), (ours_ps, ours)):
            for p, g in zip(pair[0], _grads(step, device), strict=True):
                p.grad = g.to(torch.bfloat16)
            pair[1].step()
        assert all(b.route is Route.TRITON for b in ours.plan.buckets)
        for p, q in zip(ps, ours_ps, strict=True):
            want, got = plain.state[p], ours.state[q]
            assert KAHAN_COMP in got
            for key in ("momentum_buffer", "exp_avg", "exp_avg_sq"):
                if key in want:  # torch's state in bf16, ours in fp32: within bf16's rounding of each other
                    torch.testing.assert_close(got[key], want[key].float(), rtol=2e-2, atol=1e-2)
            if "step" in want:
                assert float(got["step"]) == float(want["step"])
            torch.testing.assert_close(q.float(), p.float(), rtol=2e-2, atol=1e-2)


def test_checkpoints_through_plain_torch_and_back(device):
    """kitsune's state dict (with ``kahan_comp``) loads into plain torch AdamW, which steps and ignores it; a torch
    checkpoint (without it) loads into kitsune, which starts the compensation at zero; a kitsune checkpoint resumes
    bit for bit."""
    make = MAKERS["adamw"]
    ps = _params(torch.bfloat16, device)
    opt = _kitsune(ps, make, "kahan")
    for step in range(5):
        for p, g in zip(ps, _grads(step, device), strict=True):
            p.grad = g.to(torch.bfloat16)
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    assert all(KAHAN_COMP in s for s in sd["state"].values())
    plain_ps = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    plain = make(plain_ps)
    plain.load_state_dict(copy.deepcopy(sd))
    for p, g in zip(plain_ps, _grads(5, device), strict=True):
        p.grad = g.to(torch.bfloat16)
    plain.step()
    back_ps = [torch.nn.Parameter(p.detach().clone()) for p in plain_ps]
    back = _kitsune(back_ps, make, "kahan")
    torch_sd = plain.state_dict()
    for s in torch_sd["state"].values():
        s.pop(KAHAN_COMP, None)  # as a run of plain torch from the start would have it
    back.load_state_dict(torch_sd)
    for p, g in zip(back_ps, _grads(6, device), strict=True):
        p.grad = g.to(torch.bfloat16)
    back.step()
    assert all(KAHAN_COMP in back.state[p] for p in back_ps)
    resumed_ps = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    resumed = _kitsune(resumed_ps, make, "kahan")
    resumed.load_state_dict(sd)
    for pair in ((ps, opt), (resumed_ps, resumed)):
        for p, g in zip(pair[0], _grads(7, device), strict=True):
            p.grad = g.to(torch.bfloat16)
        pair[1].step()
    for p, q in zip(ps, resumed_ps, strict=True):
        assert torch.equal(p, q) and torch.equal(opt.state[p][KAHAN_COMP], resumed.state[q][KAHAN_COMP])


@pytest.mark.parametrize("name", list(MAKERS))
def test_a_param_made_float32_mid_run_takes_its_compensation_in(name, device):
    """``model.float()`` mid-run: the compensation kept the part of the trajectory the bf16 param could not hold,
    so the float32 param continues from param + compensation (as an fp32 master would), and the state drops it;
    from there the run is torch's fp32 step. A step that raises after that re-plan puts param and state back."""
    params = _params(torch.bfloat16, device)
    opt = _kitsune(params, MAKERS[name], "kahan")
    for step in range(4):
        for p, g in zip(params, _grads(step, device), strict=True):
            p.grad = g.to(torch.bfloat16)
        opt.step()
    held = [(p.detach().float() + opt.state[p][KAHAN_COMP].float()) for p in params]
    for p in params:
        p.data = p.data.float()
    # a step refused after the re-plan (an lr no step can read, checked when the values are uploaded): nothing moves
    good = opt.param_groups[0]["lr"]
    opt.param_groups[0]["lr"] = "fast"
    for p, g in zip(params, _grads(4, device), strict=True):
        p.grad = g
    before = [p.detach().clone() for p in params]
    with pytest.raises(TypeError):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert all(KAHAN_COMP in opt.state[p] for p in params)
    opt.param_groups[0]["lr"] = good
    twins = [torch.nn.Parameter(h.clone()) for h in held]
    ref = MAKERS[name](twins)
    ref.load_state_dict(opt.state_dict())  # the moments as the fused run holds them (fp32 state)
    for step in range(4, 8):
        for p, t, g in zip(params, twins, _grads(step, device), strict=True):
            p.grad, t.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    assert {b.route for b in opt.plan.buckets} == {Route.TRITON}
    for p, t in zip(params, twins, strict=True):
        assert p.dtype == torch.float32 and KAHAN_COMP not in opt.state[p]
        torch.testing.assert_close(p, t, rtol=1e-5, atol=1e-6)
