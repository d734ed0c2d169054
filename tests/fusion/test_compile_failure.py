"""A fused kernel that fails to compile on the user's GPU: the step compiles every kernel it launches before anything
changes, routes the failing bucket to torch's step (a warning, the reason in the plan) and runs on; no param is left
updated by one route and not another. The failure is injected (Triton's interpreter compiles nothing); on a GPU the
compile ahead is checked to compile exactly what the launch then runs."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import triton.language as tl
from twins import Uncompilable, make_params, random_grads

from kitsune import AMPConfig, GradConfig, KitsuneOptimizer
from kitsune.fusion import Route
from kitsune.fusion.algos import ALGOS
from kitsune.fusion.planner import torch_route
from kitsune.kernels import update

STEPS = 8


def _broken(real: Any, dtype: Any) -> Uncompilable:
    """``real``'s launches whose ``DTYPE`` is ``dtype`` (None: every one) fail as a kernel Triton cannot compile or
    load on this GPU (at the compile ahead, and at a launch); the others run."""
    return Uncompilable(real, lambda args, kwargs: dtype is None or kwargs["DTYPE"] == dtype)


def _params(device: torch.device) -> list[torch.nn.Parameter]:
    """fp32 and bf16 params (two fused units) and a complex one (the wrapped optimizer's own step)."""
    params = make_params([(16, 24), 40], torch.float32, device, seed=3)
    params += make_params([(8, 32), 24], torch.bfloat16, device, seed=4)
    gen = torch.Generator().manual_seed(5)
    params.append(torch.nn.Parameter(torch.randn(12, generator=gen, dtype=torch.complex64).to(device)))
    return params


def _grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    grads = random_grads(params[:-1], step)
    gen = torch.Generator().manual_seed(1000 + step)
    return [*grads, torch.randn(12, generator=gen, dtype=torch.complex64).to(params[-1].device)]


def _routes(opt: KitsuneOptimizer) -> dict[str, str]:
    return {b.dtype: b.route for b in opt.plan.buckets}


def _assert_matches(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    for a, b in zip(ours, theirs, strict=True):
        tol = 1e-2 if a.dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("clip", [None, 0.5], ids=["plain", "clipped"])
def test_a_kernel_that_fails_to_compile_goes_to_torch_and_the_run_matches_torch(monkeypatch, caplog, device, clip):
    broken = _broken(update._update_kernel, tl.bfloat16)
    monkeypatch.setattr(update, "_update_kernel", broken)
    params = _params(device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    kwargs: dict[str, Any] = {} if clip is None else {"max_grad_norm": clip}
    opt = KitsuneOptimizer(torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1), enable_fusion=True, **kwargs)
    # torch's route for the bf16 params, as the planner picks it (fused and foreach round bf16 differently)
    route = torch_route(ALGOS[torch.optim.AdamW], device, torch.bfloat16)
    flag = {"fused": True} if route is Route.TORCH_FUSED else {"foreach": True}
    refs = [
        torch.optim.AdamW([*twins[:2], twins[4]], lr=1e-2, weight_decay=0.1),
        torch.optim.AdamW(twins[2:4], lr=1e-2, weight_decay=0.1, **flag),
    ]
    assert _routes(opt) == {"float32": Route.TRITON, "bfloat16": Route.TRITON, "complex64": Route.BASE_STEP}
    with caplog.at_level(logging.WARNING, logger="kitsune.fusion"):
        for step in range(STEPS):
            for ps in (params, twins):
                for p, g in zip(ps, _grads(ps, step), strict=True):
                    p.grad = g
            opt.step()
            if clip is not None:  # kitsune clips every grad (the bf16 ones now on torch's route too)
                torch.nn.utils.clip_grad_norm_(twins, clip)
            for ref in refs:
                ref.step()
            _assert_matches(params, twins)  # each step: the fp32 params updated once, none left behind
    routes = _routes(opt)
    assert routes["float32"] is Route.TRITON and routes["complex64"] is Route.BASE_STEP
    assert routes["bfloat16"] is route
    (bf16,) = [b for b in opt.plan.buckets if b.dtype == "bfloat16"]
    assert "failed to compile" in bf16.reason and "out of resource" in bf16.reason
    warnings = [r for r in caplog.records if "failed to compile" in r.getMessage()]
    assert len(warnings) == 1 and "2 param(s)" in warnings[0].getMessage()
    assert opt.step_count == STEPS
    for p, q in zip(params, twins, strict=True):
        st, ts = opt.state[p], next(r.state[q] for r in refs if q in r.state)
        assert st.keys() == ts.keys()
        assert float(st["step"]) == float(ts["step"]) == STEPS


def test_a_norm_kernel_that_fails_to_compile_sends_every_fused_bucket_to_torch(monkeypatch, device):
    """The norm pass (clipping inside the fused kernels) cannot run: every bucket goes to torch's route, and the
    grads' own pass clips."""
    from kitsune.kernels import norms

    monkeypatch.setattr(norms, "_norm_kernel", _broken(norms._norm_kernel, None))
    params = make_params([(16, 24), 40, (4, 4, 3)], torch.float32, device, seed=9)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = KitsuneOptimizer(torch.optim.Adam(params, lr=1e-2), enable_fusion=True, max_grad_norm=0.3)
    route = torch_route(ALGOS[torch.optim.Adam], device, torch.float32)
    ref = torch.optim.Adam(twins, lr=1e-2, **({"fused": True} if route is Route.TORCH_FUSED else {"foreach": True}))
    assert {b.route for b in opt.plan.buckets} == {Route.TRITON}
    for step in range(STEPS):
        for ps in (params, twins):
            for p, g in zip(ps, random_grads(ps, step), strict=True):
                p.grad = g
        opt.step()
        norm = torch.nn.utils.clip_grad_norm_(twins, 0.3)
        ref.step()
        _assert_matches(params, twins)
        assert float(opt.last_grad_norm) == pytest.approx(float(norm), rel=1e-6)
    assert {b.route for b in opt.plan.buckets} == {route}
    assert all("_norm_kernel" in b.reason for b in opt.plan.buckets)


def test_the_closure_runs_once_in_a_step_that_moves_a_bucket_to_torch(monkeypatch, device):
    monkeypatch.setattr(update, "_update_kernel", _broken(update._update_kernel, tl.float32))
    params = make_params([(6, 10), 30], torch.float32, device, seed=7)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = KitsuneOptimizer(torch.optim.Adam(params, lr=1e-2), enable_fusion=True)
    ref = torch.optim.Adam(twins, lr=1e-2)
    calls = []

    def closure(ps: list[torch.Tensor], step: int) -> Any:
        calls.append(step)
        for p, g in zip(ps, random_grads(ps, step), strict=True):
            p.grad = g
        return torch.tensor(float(step))

    for step in range(3):
        loss = opt.step(lambda step=step: closure(params, step))
        assert float(loss) == step
        ref.step(lambda step=step: closure(twins, step))
        assert len(calls) == 2 * (step + 1)
    assert {b.route for b in opt.plan.buckets} <= {Route.TORCH_FUSED, Route.TORCH_FOREACH}
    _assert_matches(params, twins)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["plain", "clip", "amp", "zero_in_step", "muon"])
def test_the_compile_ahead_compiles_what_the_launch_runs(monkeypatch, case):
    """The kernels compiled before the wrapped step are those the launch finds in Triton's cache: the launch compiles
    nothing more (a compile there could fail after other params were updated). Muon: its momentum and update kernels
    (its Newton-Schulz calls run ahead, and compile at that launch)."""
    from kitsune.fusion.executor import FusionSubsystem
    from kitsune.kernels import muon_update, norms

    kernels = (update._update_kernel, norms._norm_kernel, muon_update._muon_kernel)

    def cached() -> int:
        return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())

    seen: list[int] = []
    ahead = FusionSubsystem._compile_ahead

    def spy(self: Any, *args: Any) -> None:
        ahead(self, *args)
        seen.append(cached())

    monkeypatch.setattr(FusionSubsystem, "_compile_ahead", spy)
    device = torch.device("cuda")
    params = make_params([(64, 48), 1000, 7], torch.float32, device, seed=11)
    params += make_params([(32, 40), 96], torch.bfloat16, device, seed=12)
    kwargs: dict[str, Any] = {
        "plain": {},
        "clip": {"max_grad_norm": 1.0},
        "amp": {"enable_amp": True, "amp_config": AMPConfig(dtype=torch.float16)},
        "zero_in_step": {"grad_config": GradConfig(max_norm=1.0, zero_in_step=True)},
        "muon": {"max_grad_norm": 1.0},
    }[case]
    if case == "muon":
        params = make_params([(64, 48), (64, 48), (32, 96)], torch.float32, device, seed=13)
        base: torch.optim.Optimizer = torch.optim.Muon(params, lr=1e-3)
    else:
        base = torch.optim.AdamW(params, lr=1e-3)
    opt = KitsuneOptimizer(base, enable_fusion=True, **kwargs)
    for step in range(3):
        grads = random_grads(params, step)
        opt.backward(sum((p * g).sum() for p, g in zip(params, grads, strict=True)))  # (scaled with float16 AMP)
        opt.step()
        opt.zero_grad()
        assert seen, "the step compiled nothing ahead"
        assert cached() == seen[-1], f"step {step}: the launch compiled a kernel the compile ahead did not"
    assert {b.route for b in opt.plan.buckets} == {Route.TRITON_MATMUL if case == "muon" else Route.TRITON}


def test_a_retry_on_a_new_plan_does_not_unscale_a_user_grad_scalers_grads_twice(monkeypatch, device):
    """A plan with a route of torch's own unscales a user's GradScaler's grads in place before any update; the try on
    the new plan after a kernel failed to compile takes them as they are."""
    monkeypatch.setattr(update, "_update_kernel", _broken(update._update_kernel, tl.float32))
    gen = torch.Generator().manual_seed(21)
    params = make_params([(8, 12), 30], torch.float32, device, seed=22)
    params.append(torch.nn.Parameter(torch.randn(6, generator=gen, dtype=torch.float64).to(device)))  # torch's
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = KitsuneOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9), enable_fusion=True)
    ref = torch.optim.SGD(twins, lr=0.1, momentum=0.9)
    scalers = [torch.amp.GradScaler(device.type, init_scale=1024.0) for _ in range(2)]
    for step in range(4):
        grads = [*random_grads(params[:2], step), torch.randn(6, generator=gen, dtype=torch.float64).to(device)]
        for ps, o, scaler in ((params, opt, scalers[0]), (twins, ref, scalers[1])):
            scaler.scale(sum((p * g).sum() for p, g in zip(ps, grads, strict=True))).backward()
            scaler.step(o)
            scaler.update()
            o.zero_grad()
        _assert_matches(params, twins)
    assert [b.route for b in opt.plan.buckets if b.dtype == "float32"] != [Route.TRITON]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_probe_step_that_runs_again_on_a_new_plan_times_the_failed_try_as_one_phase(monkeypatch):
    """The profiler's probe step is the step that meets the failure: its phases are the failed try (``rerouted``)
    and then the new plan's, each once (not the failed try's time added to the phases the retry marks again)."""
    from kitsune import FusionConfig, KitsuneConfig, ProfilerConfig

    monkeypatch.setattr(update, "_update_kernel", _broken(update._update_kernel, None))
    device = torch.device("cuda")
    params = make_params([(64, 48), 1000, 7], torch.float32, device, seed=21)
    config = KitsuneConfig(
        fusion=FusionConfig(enabled=True),
        grads=GradConfig(max_norm=0.5),
        profiler=ProfilerConfig(enabled=True, nvml_interval_s=0, sample_after=0, probe_steps=1, compare_steps=0),
    )
    opt = KitsuneOptimizer(torch.optim.AdamW(params, lr=1e-3), config=config)
    for step in range(3):
        for p, g in zip(params, random_grads(params, step), strict=True):
            p.grad = g
        opt.step()
    assert {b.route for b in opt.plan.buckets} <= {Route.TORCH_FUSED, Route.TORCH_FOREACH}
    probe = opt.profiler.get_metrics().probe
    assert probe.status == "measured" and probe.phases_ms is not None
    # the retry clips as a pass of its own (no fused norm pass on the new plan), then torch's step
    assert list(probe.phases_ms) == ["rerouted", "clip", "fallback"], probe.phases_ms
