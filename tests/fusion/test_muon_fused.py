"""The planner's Muon route (``triton_matmul``): torch.optim.Muon and kitsune.optim.Muon, fused, against eager steps.

Under TRITON_INTERPRET=1 (CPU tensors) the planner fuses as it does on CUDA, so these run the Triton kernels. Shapes
are small and most runs use 1-2 Newton-Schulz iterations (the interpreter's cost is per launch and per matrix);
the iteration itself is checked at 5 steps and real sizes in tests/kernels/test_newton_schulz.py.

Tolerances:

* Against torch.optim.Muon: torch orthogonalises with its own bf16 matmuls, kitsune with its Triton kernels, which
  round their bf16 products in another order, so each step's orthogonalised update differs by bf16 rounding (about
  1% of it, relative Frobenius). The grads are fresh random tensors that do not depend on the params, so the
  momentum buffers agree to fp32 rounding, and the params drift apart by at most the sum of the per-step
  differences: ``steps * adjusted lr * 2% * sqrt(min(A, B))`` per param in the Frobenius norm (an update's singular
  values are about 1), as in tests/optim/test_muon.py. Weight decay only shrinks that difference.
* Against kitsune.optim.Muon's eager step: under the interpreter it calls the same Newton-Schulz kernels on the same
  bf16 updates, so the only differences are fp32 rounding orders in the elementwise math (torch's CPU kernels fuse
  multiply-adds, the interpreter does not): params and state agree to 1e-5 (fp32), one bf16 ulp (bf16).
"""

from __future__ import annotations

import copy
import math
from io import StringIO

import pytest
import torch
from rich.console import Console
from twins import (
    TOL,
    Uncompilable,
    assert_refused,
    assert_steps_as_the_wrapped_step,
    make_params,
    random_grads,
    set_grad,
    trajectory,
)

from kitsune import FusionConfig, GradConfig, KitsuneOptimizer, StreamConfig
from kitsune.fusion import Route, muon_unit
from kitsune.fusion.muon_unit import matrix_shape
from kitsune.kernels import newton_schulz as ns
from kitsune.kernels.newton_schulz import POLAR_EXPRESS_COEFFICIENTS
from kitsune.optim import Muon
from kitsune.optim.muon import adjust_lr

if not hasattr(torch.optim, "Muon"):  # torch < 2.9
    pytest.skip("torch.optim.Muon needs torch >= 2.9", allow_module_level=True)

LR = 0.02
INACTIVE = pytest.mark.filterwarnings("ignore:kitsune. fusion was asked for but is inactive:UserWarning")


def _fusion(opt: KitsuneOptimizer):
    return next(s for s in opt.subsystems if s.name == "fusion")


def _assert_within_band(ours, ref, steps: int, fns, lrs) -> None:
    """Each param's Frobenius distance to torch's is within the drift band of the module docstring."""
    for i, (p, q) in enumerate(zip(ours, ref, strict=True)):
        band = steps * adjust_lr(lrs[i], fns[i], matrix_shape(p)) * 0.02 * math.sqrt(min(matrix_shape(p)))
        diff = (p.detach() - q.detach()).norm().item()
        assert diff <= band, f"param {i} {tuple(p.shape)}: |diff|_F {diff:.3g} > band {band:.3g}"


def _assert_buffers_close(opt, ref, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    ours = [p for g in opt.param_groups for p in g["params"]]
    theirs = [p for g in ref.param_groups for p in g["params"]]
    for i, (p, q) in enumerate(zip(ours, theirs, strict=True)):
        assert sorted(opt.state.get(p, {})) == sorted(ref.state.get(q, {})), f"param {i}: state keys"
        for key, t in ref.state.get(q, {}).items():
            # an eager AdamW keeps ``step`` on the CPU, the fused kernel on the param's device (as torch's fused does)
            device_too = key != "step"
            torch.testing.assert_close(
                opt.state[p][key], t, rtol=rtol, atol=atol, check_device=device_too, msg=lambda m, i=i: f"{i}: {m}"
            )


# -- torch.optim.Muon -------------------------------------------------------------------------------------------
SHAPES = [(16, 32), (32, 16), (16, 32), (32, 16), (16, 32)]
# nesterov on/off x both adjust_lr_fn, weight decay on and off; param 4 shares param 0's group and shape (one
# batched Newton-Schulz call) and has no grad before step 3 nor on every fifth step after
GROUPS = [
    {"nesterov": True, "adjust_lr_fn": None},
    {"nesterov": False, "adjust_lr_fn": "original", "weight_decay": 0.0},
    {"nesterov": True, "adjust_lr_fn": "match_rms_adamw"},
    {"nesterov": False, "adjust_lr_fn": "match_rms_adamw", "lr": 0.01},
]
MEMBERS = [[0, 4], [1], [2], [3]]


def _torch_groups(params):
    return [{**opts, "params": [params[i] for i in idx]} for opts, idx in zip(GROUPS, MEMBERS, strict=True)]


def _torch_muon(groups):
    return torch.optim.Muon(groups, lr=LR, weight_decay=0.1, ns_steps=2)


def _has_grad(step: int, i: int) -> bool:
    return i != 4 or (step >= 3 and step % 5 != 4)


def test_torch_muon_trajectory(device):
    steps = 12
    ref_params, ref = trajectory(_torch_muon, SHAPES, torch.float32, device, steps, groups=_torch_groups,
                                 has_grad=_has_grad)  # fmt: skip
    params, opt = trajectory(_torch_muon, SHAPES, torch.float32, device, steps, fused=True, groups=_torch_groups,
                             has_grad=_has_grad)  # fmt: skip

    plan = opt.plan
    assert {b.route for b in plan.buckets} == {Route.TRITON_MATMUL} and plan.fused_tensors == len(SHAPES)
    assert plan.launches == 4 * (2 + 1 + 3 * 2)  # per group: momentum, update, one Newton-Schulz call (1 shape)
    fns = [GROUPS[0]["adjust_lr_fn"], *(GROUPS[g]["adjust_lr_fn"] for g in (1, 2, 3)), GROUPS[0]["adjust_lr_fn"]]
    _assert_within_band(params, ref_params, steps, fns, [LR, LR, LR, 0.01, LR])
    _assert_buffers_close(opt, ref)
    # kitsune.optim.Muon's eager step has torch's semantics for matrices and shares the Newton-Schulz kernels
    eager = lambda groups: Muon(groups, lr=LR, weight_decay=0.1, ns_steps=2)  # noqa: E731
    eager_params, _ = trajectory(eager, SHAPES, torch.float32, device, steps, groups=_torch_groups, has_grad=_has_grad)
    for p, q in zip(params, eager_params, strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)
    # the last step had every grad: every launch eagerly, one graph launch on CUDA (the step replays its capture)
    assert _fusion(opt).launches_last_step == (1 if device.type == "cuda" else plan.launches)

    # a param whose grad is None is skipped: nothing moves, no state appears
    fresh = torch.nn.Parameter(torch.randn(16, 32, device=device))
    opt.add_param_group({"params": [fresh]})
    before = fresh.detach().clone()
    for p, g in zip(params, random_grads(params, steps), strict=True):
        p.grad = g
    opt.step()
    assert torch.equal(fresh, before) and fresh not in opt.state
    assert opt.plan.fused_tensors == len(SHAPES) + 1


def test_a_newton_schulz_kernel_that_fails_to_compile_leaves_muon_to_its_own_step(device, monkeypatch, caplog):
    """The Newton-Schulz calls run ahead on the units' own buffers before anything changes: a kernel that fails
    there sends every Muon bucket to torch.optim.Muon's own step (torch has no fused or foreach Muon), which then
    takes every step, bit for bit as without kitsune."""
    import logging

    monkeypatch.setattr(muon_unit, "NS_AHEAD_ON_CPU", True)
    monkeypatch.setattr(ns, "_poly_kernel", Uncompilable(ns._poly_kernel))
    steps = 6
    ref_params, ref = trajectory(_torch_muon, SHAPES, torch.float32, device, steps, groups=_torch_groups,
                                 has_grad=_has_grad)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="kitsune.fusion"):
        params, opt = trajectory(_torch_muon, SHAPES, torch.float32, device, steps, fused=True, groups=_torch_groups,
                                 has_grad=_has_grad)  # fmt: skip
    buckets = opt.plan.buckets
    assert len(buckets) == len(GROUPS)
    for b in buckets:
        assert b.route is Route.BASE_STEP and "failed to compile" in b.reason and "newton_schulz" in b.reason
    assert len([r for r in caplog.records if "failed to compile" in r.getMessage()]) == len(buckets)
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    _assert_buffers_close(opt, ref, rtol=0, atol=0)


def test_torch_muon_state_dict_round_trip(device):
    """kitsune -> plain torch.optim.Muon -> kitsune, mid-run, against one uninterrupted torch run."""
    shapes, steps = [(16, 32), (32, 16)], 6
    ref_params, ref = trajectory(_torch_muon, shapes, torch.float32, device, 3 * steps)

    params = make_params(shapes, torch.float32, device)
    opt = KitsuneOptimizer(_torch_muon(params), enable_fusion=True)
    for leg in range(3):
        for step in range(leg * steps, (leg + 1) * steps):
            for p, g in zip(params, random_grads(params, step), strict=True):
                p.grad = g
            opt.step()
            opt.zero_grad()
        saved = copy.deepcopy(opt.state_dict())
        assert all(set(s) == {"momentum_buffer"} for s in saved["state"].values())  # torch's keys, no step
        if leg == 0:
            assert "kitsune" in saved
        opt = _torch_muon(params) if leg == 0 else KitsuneOptimizer(_torch_muon(params), enable_fusion=True)
        opt.load_state_dict(saved)
        if leg == 1:
            assert opt.plan.buckets[0].route is Route.TRITON_MATMUL
    _assert_within_band(params, ref_params, 2 * steps, [None, None], [LR, LR])  # 12 of the 18 steps fused
    _assert_buffers_close(opt, ref)


def test_a_loaded_momentum_of_transposed_strides_is_read_as_torch_reads_it(device):
    """A checkpoint whose momentum buffers have the param's shape but transposed strides (converted between
    layouts): torch.optim.Muon's ops read them as strided; the fused step must see the same values."""
    shapes = [(16, 32), (32, 16)]
    params, twins = make_params(shapes, torch.float32, device), make_params(shapes, torch.float32, device)
    opt, ref = KitsuneOptimizer(_torch_muon(params), enable_fusion=True), _torch_muon(twins)
    for step in range(2):
        for p, t, g in zip(params, twins, random_grads(params, step), strict=True):
            p.grad, t.grad = g.clone(), g.clone()
        ref.step()
    saved = copy.deepcopy(ref.state_dict())
    for s in saved["state"].values():
        s["momentum_buffer"] = s["momentum_buffer"].t().contiguous().t()
    with torch.no_grad():
        for p, t in zip(params, twins, strict=True):
            p.copy_(t)
    opt.load_state_dict(saved)
    for step in range(2, 6):
        for p, t, g in zip(params, twins, random_grads(params, step), strict=True):
            p.grad, t.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    assert opt.plan.buckets[0].route is Route.TRITON_MATMUL
    _assert_within_band(params, twins, 4, [None, None], [LR, LR])
    _assert_buffers_close(opt, ref)


def test_lr_scheduler_reads_lr_from_the_device_context(device):
    """A scheduler writes param_groups' lr: the fused path reads it from the device buffer, no re-plan."""
    shapes, steps = [(16, 32)], 20

    def schedule(o):
        return torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.9**s)

    def make(ps):
        return torch.optim.Muon(ps, lr=LR, weight_decay=0.1, ns_steps=1)

    ref_params, ref = trajectory(make, shapes, torch.float32, device, steps, schedule=schedule)
    params, opt = trajectory(make, shapes, torch.float32, device, steps, fused=True, schedule=schedule)
    fusion = _fusion(opt)
    assert fusion.plan_version == 1  # planned once: the lr is a value, not a switch
    assert fusion.report()["context_uploads"] == steps  # one small copy per lr change
    assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"] == pytest.approx(LR * 0.9**steps)
    # the band with the lr of the first step bounds every later one
    _assert_within_band(params, ref_params, steps, [None], [LR])
    _assert_buffers_close(opt, ref)


def test_found_inf_skips_and_zero_in_step(device):
    """An AMP overflow (a GradScaler's found_inf) skips the update on the device; zero_in_step zeroes the grads."""
    make = lambda ps: torch.optim.Muon(ps, lr=LR, ns_steps=1)  # noqa: E731
    params, opt = trajectory(make, [(16, 32)], torch.float32, device, steps=2, fused=True,
                             grad_config=GradConfig(zero_in_step=True))  # fmt: skip
    p = params[0]
    p.grad = random_grads(params, 2)[0]
    before, buf = p.detach().clone(), opt.state[p]["momentum_buffer"].clone()
    opt.grad_scale, opt.found_inf = None, torch.ones((), device=device)  # what GradScaler.step sets
    opt.step()
    del opt.grad_scale, opt.found_inf
    assert torch.equal(p, before) and torch.equal(opt.state[p]["momentum_buffer"], buf)
    assert opt.host_syncs == 0  # skipped on the device
    assert p.grad is not None and not p.grad.any()  # zeroed in the step, even a skipped one
    p.grad = random_grads(params, 3)[0]
    grad = p.grad.clone()
    opt.step()
    assert not torch.equal(p, before) and not p.grad.any()
    opt.zero_grad()
    assert p.grad is not None  # left as the kernel zeroed it
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], buf.lerp(grad, 0.05))


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_low_precision_params_match_eager(dtype, device):
    """bf16 params and momentum, rounded where torch's ops round: against kitsune's eager step (same kernels)."""

    def make(ps):
        return Muon(ps, lr=LR, weight_decay=0.1, ns_steps=2)

    ref_params, ref = trajectory(make, [(16, 32)], dtype, device, steps=10)
    params, opt = trajectory(make, [(16, 32)], dtype, device, steps=10, fused=True)
    assert opt.plan.buckets[0].route is Route.TRITON_MATMUL
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(params[0], ref_params[0], atol=atol, rtol=rtol)
    _assert_buffers_close(opt, ref, rtol=rtol, atol=atol)


# -- kitsune.optim.Muon -----------------------------------------------------------------------------------------
K_SHAPES = [(16, 32), (16, 32), (16, 4, 2, 2), (16,), (10, 8)]


def _kitsune_groups(ps):
    return [
        {"params": ps[:3], "ns_coefficients": POLAR_EXPRESS_COEFFICIENTS},  # two matrices batched, a conv weight
        {"params": ps[3:], "use_muon": False, "lr": 1e-2, "betas": (0.9, 0.95)},
    ]


def _kitsune_muon(groups):
    return Muon(groups, lr=LR, weight_decay=0.1, ns_steps=2)


def test_kitsune_muon_matches_its_eager_step(device):
    """Muon groups on the matmul route (a 4-D conv weight flattened), AdamW groups on the fused AdamW kernel."""
    steps = 12
    ref_params, ref = trajectory(_kitsune_muon, K_SHAPES, torch.float32, device, steps, groups=_kitsune_groups)
    params, opt = trajectory(_kitsune_muon, K_SHAPES, torch.float32, device, steps, fused=True,
                             groups=_kitsune_groups)  # fmt: skip
    routes = {b.optimizer: (b.route, b.tensors, b.launches) for b in opt.plan.buckets}
    assert routes == {"Muon": (Route.TRITON_MATMUL, 3, 2 + 2 * (1 + 3 * 2)), "Muon/AdamW": (Route.TRITON, 2, 1)}
    assert opt.base_steps == 0  # kitsune updated every param
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)
    _assert_buffers_close(opt, ref)
    for key in ("momentum_buffer",):
        assert opt.state[params[2]][key].shape == (16, 4, 2, 2)


def test_a_channels_last_conv_weight_takes_muons_own_step_and_says_why(device):
    """kitsune.optim.Muon flattens a conv weight's row-major matrix; a channels_last one lies in another order, so it
    goes to the optimizer's own step (the same numbers), with a reason that says so, while the matrix stays fused."""
    steps = 4
    params = make_params([(16, 4, 2, 2), (16, 32)], torch.float32, device)
    with torch.no_grad():
        params[0].data = params[0].data.to(memory_format=torch.channels_last)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = KitsuneOptimizer(Muon(params, lr=LR, ns_steps=2), enable_fusion=True)
    ref = Muon(twins, lr=LR, ns_steps=2)
    for step in range(steps):
        for p, t, g in zip(params, twins, random_grads(params, step), strict=True):
            p.grad, t.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    routes = {b.route: b.reason for b in opt.plan.buckets}
    assert set(routes) == {Route.BASE_STEP, Route.TRITON_MATMUL}
    assert routes[Route.BASE_STEP].startswith("channels_last param: Muon's fused kernels orthogonalise the row-major")
    torch.testing.assert_close(params[0], twins[0], atol=0, rtol=0)  # its own step: torch's ops, bit for bit
    torch.testing.assert_close(params[1], twins[1], atol=1e-3, rtol=0)  # the fused bf16 Newton-Schulz


def test_enable_matmul_false_falls_back_with_its_reason(device, recwarn):
    fusion_config = {"fusion_config": FusionConfig(enable_matmul=False)}
    opt = KitsuneOptimizer(_torch_muon(make_params([(16, 32)], torch.float32, device)), enable_fusion=True,
                           **fusion_config)  # fmt: skip
    (bucket,) = opt.plan.buckets
    assert bucket.route is Route.BASE_STEP and bucket.reason.startswith("enable_matmul=False")
    assert not _fusion(opt).active and "enable_matmul=False" in _fusion(opt).reason
    assert any("fusion was asked for but is inactive" in str(w.message) for w in recwarn)

    # kitsune.optim.Muon: the Muon groups take its own step, its AdamW groups the fused AdamW kernel
    def make(ps):
        return Muon(_kitsune_groups(ps), lr=LR, ns_steps=1)

    ref_params, _ = trajectory(make, K_SHAPES, torch.float32, device, steps=2)
    params, opt = trajectory(make, K_SHAPES, torch.float32, device, steps=2, fused=True, **fusion_config)
    routes = {b.optimizer: b.route for b in opt.plan.buckets}
    assert routes == {"Muon": Route.BASE_STEP, "Muon/AdamW": Route.TRITON}
    assert opt.base_steps == 2
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)


@INACTIVE
def test_cpu_without_interpreter_keeps_torch_step(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.device("cpu")
    ref_params, _ = trajectory(_torch_muon, SHAPES[:2], torch.float32, cpu, steps=5)
    params, opt = trajectory(_torch_muon, SHAPES[:2], torch.float32, cpu, steps=5, fused=True)
    assert opt.plan.buckets[0].route is Route.BASE_STEP and "CPU tensors" in opt.plan.buckets[0].reason
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params, strict=True))


@INACTIVE
def test_plan_shows_the_route_and_counts(device):
    params = make_params([(16, 32), (16, 32), (32, 16), (8, 8)], torch.float32, device)
    opt = KitsuneOptimizer(torch.optim.Muon(params, ns_steps=5), enable_fusion=True)
    (bucket,) = opt.plan.buckets
    assert (bucket.route, bucket.tensors, bucket.launches) == (Route.TRITON_MATMUL, 4, 2 + 3 * 16)
    assert "Newton-Schulz batched by shape (3 shape(s), 16 launches each)" in bucket.reason
    assert bucket.options == "nesterov, 5 NS steps" and bucket.predicted_speedup > 1
    assert opt.plan.to_dict()["buckets"][0]["route"] == "triton_matmul"
    assert opt.plan.to_dict()["launches_per_step"] == 50
    out = StringIO()
    Console(file=out, width=250).print(opt.plan)
    assert "triton_matmul" in out.getvalue() and "batched by shape" in out.getvalue()
    fusion = _fusion(opt)
    assert "Muon" in fusion.grad_pass and fusion.graphable is None  # captured when nothing needs a grad pass
    # on CUDA the 3 shapes spread over 3 of the 4 default streams; off CUDA everything runs on one
    assert [u.num_streams for u in fusion._muon] == [3 if device.type == "cuda" else 1]

    # max_fusion_size: launch units of at most 2 params, each with its own Newton-Schulz calls
    opt = KitsuneOptimizer(torch.optim.Muon(params, ns_steps=5), enable_fusion=True,
                           fusion_config=FusionConfig(max_fusion_size=2))  # fmt: skip
    assert [len(u.params) for u in _fusion(opt)._muon] == [2, 2]
    assert opt.plan.buckets[0].launches == (2 + 16) + (2 + 2 * 16)

    # a high min_fusion_benefit keeps Muon's own per-matrix loop
    cfg = FusionConfig(min_fusion_benefit=1000.0)
    opt = KitsuneOptimizer(torch.optim.Muon(params), enable_fusion=True, fusion_config=cfg)
    assert opt.plan.buckets[0].route is Route.BASE_STEP
    assert "below min_fusion_benefit=1000; Muon has no torch fused/foreach path" in opt.plan.buckets[0].reason


@INACTIVE
def test_settings_torch_rejects_keep_its_step(device):
    """A per-iteration schedule is kitsune's; torch.optim.Muon's own step runs (and raises) as without kitsune."""
    params = make_params([(16, 32)], torch.float32, device)
    opt = KitsuneOptimizer(torch.optim.Muon(params, ns_coefficients=POLAR_EXPRESS_COEFFICIENTS), enable_fusion=True)
    assert opt.plan.buckets[0].route is Route.BASE_STEP and "ns_coefficients" in opt.plan.buckets[0].reason
    params[0].grad = torch.ones_like(params[0])
    with pytest.raises(ValueError, match="Coefficients"):
        opt.step()


def test_graph_steps_cut_large_batches_in_two():
    """In a CUDA graph's steps a CUDA batch with a wave of tiles per half runs as two half-batch calls (views of the
    unit's buffers); smaller batches, a single matrix and CPU tensors stay whole."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def cut(batch: int, rows: int, cols: int, device: torch.device = cuda) -> list[tuple[int, ...]]:
        inp = torch.empty(batch, rows, cols, device="meta")
        ins, outs = muon_unit._cut(inp, torch.empty_like(inp), device)
        assert all(i.is_contiguous() and o.is_contiguous() for i, o in zip(ins, outs, strict=True))
        assert [i.shape for i in ins] == [o.shape for o in outs] and sum(i.shape[0] for i in ins) == batch
        return [tuple(i.shape) for i in ins]

    assert cut(8, 2048, 2048) == [(4, 2048, 2048)] * 2  # 4 x 16 x 8 = 512 tiles of 128 x 256 per half
    assert cut(5, 1024, 4096) == [(2, 1024, 4096), (3, 1024, 4096)]  # 2 x 8 x 16 = 256
    assert cut(5, 4096, 1024) == [(2, 4096, 1024), (3, 4096, 1024)]  # tall: the same (m, m) Grams
    assert cut(5, 1024, 2048) == [(5, 1024, 2048)]  # 2 x 8 x 8 = 128 tiles per half: below a wave
    assert cut(1, 8192, 8192) == [(1, 8192, 8192)]
    assert cut(8, 2048, 2048, cpu) == [(8, 2048, 2048)]


# -- CUDA ------------------------------------------------------------------------------------------------------
@pytest.mark.cuda
def test_side_streams_give_the_same_result():
    """Several shapes: their Newton-Schulz calls on side streams give the bits of one stream."""
    shapes = [(256, 512), (512, 256), (128, 128), (256, 512), (64, 1024)]
    runs = []
    for num_streams, compute in ((1, []), (3, []), (4, [2])):
        cfg = StreamConfig(num_streams=num_streams, compute_streams=compute)
        params, opt = trajectory(_torch_muon, shapes, torch.float32, torch.device("cuda"), steps=10, fused=True,
                                 stream_config=cfg)  # fmt: skip
        (unit,) = _fusion(opt)._muon
        assert unit.num_streams == min(len(compute) or num_streams, 4)
        runs.append(params)
    for params in runs[1:]:
        assert all(torch.equal(p, q) for p, q in zip(params, runs[0], strict=True))


@pytest.mark.cuda
@pytest.mark.parametrize("shape, count", [((2048, 2048), 8), ((1024, 1024), 16)])
def test_cut_batches_in_graph_steps_match_whole_ones(monkeypatch, shape, count):
    """Captured steps with a batch cut in two halves on two streams against steps with the whole batch in one call:
    the same bits where the halves pick the whole batch's tiles (8 x 2048^2, the bench's Muon step); where they
    pick others (16 x 1024^2: the halves' kernels first compile in the graph's warm-up steps, not in its capture)
    the same result up to the order of the products' roundings."""
    runs = []
    ns.clear_graph_cache()
    for cut in (True, False):
        if not cut:
            monkeypatch.setattr(muon_unit, "CUT_MIN_TILES", 2**62)
        params, opt = trajectory(_torch_muon, [shape] * count, torch.float32, torch.device("cuda"), steps=8,
                                 fused=True, set_to_none=False)  # fmt: skip
        (unit,) = _fusion(opt)._muon
        assert len(unit.graph_calls) == (2 if cut else 1)
        graphs = next(s for s in opt.subsystems if s.name == "graphs")
        assert (graphs.captures, graphs.replays) == (1, 5), graphs.report()
        # the warm-up steps launch directly: no graph of newton_schulz's own is kept beside the step's
        assert not len(ns._graphs[params[0].device])
        runs.append(params)
    if shape == (2048, 2048):
        assert all(torch.equal(p, q) for p, q in zip(*runs, strict=True))
    else:
        for p, q in zip(*runs, strict=True):
            torch.testing.assert_close(p, q, atol=2e-4, rtol=0)  # lr 0.02 x 8 steps of bf16 orthogonal updates


@pytest.mark.cuda
def test_real_sizes_against_torch_muon():
    shapes = [(1024, 1024)] * 4 + [(1024, 4096), (4096, 1024)]

    def make(ps):
        return torch.optim.Muon(ps, lr=LR, weight_decay=0.1)

    ref_params, ref = trajectory(make, shapes, torch.float32, torch.device("cuda"), steps=20)
    params, opt = trajectory(make, shapes, torch.float32, torch.device("cuda"), steps=20, fused=True)
    assert opt.plan.buckets[0].route is Route.TRITON_MATMUL
    _assert_within_band(params, ref_params, 20, [None] * 6, [LR] * 6)
    _assert_buffers_close(opt, ref)


@INACTIVE
def test_kitsune_muon_maximize_takes_its_own_step(device):
    """kitsune.optim.Muon's ``maximize`` negates the grads in its own step; the fused kernels descend only, so such
    a group takes that step (the plan says why), set from the start or between steps, and the params climb as the
    eager optimizer's do."""
    steps = 3

    def groups(ps):
        return [{"params": ps[:2], "maximize": True}, {"params": ps[2:]}]

    ref_params, _ = trajectory(_kitsune_muon, K_SHAPES[:3], torch.float32, device, steps, groups=groups)
    params, opt = trajectory(_kitsune_muon, K_SHAPES[:3], torch.float32, device, steps, fused=True, groups=groups)
    routes = sorted((b.route.value, b.tensors) for b in opt.plan.buckets)
    assert routes == [("base_step", 2), ("triton_matmul", 1)]
    assert any("maximize=True" in b.reason for b in opt.plan.buckets)
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)
    opt.param_groups[1]["maximize"] = True  # between steps: planned again
    for p, g in zip(params, random_grads(params, steps), strict=True):
        p.grad = g
    opt.step()
    assert {b.route.value for b in opt.plan.buckets} == {"base_step"}


def test_kitsune_muon_adamw_groups_ignore_amsgrad_as_its_step_does(device):
    """The eager step runs AdamW without amsgrad whatever the group says; so does the fused kernel."""
    steps = 4

    def groups(ps):
        return [{"params": ps[:3]}, {"params": ps[3:], "use_muon": False, "lr": 1e-2, "amsgrad": True}]

    ref_params, ref = trajectory(_kitsune_muon, K_SHAPES, torch.float32, device, steps, groups=groups)
    params, opt = trajectory(_kitsune_muon, K_SHAPES, torch.float32, device, steps, fused=True, groups=groups)
    assert {b.optimizer: b.route for b in opt.plan.buckets}["Muon/AdamW"] is Route.TRITON
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)
    assert sorted(opt.state[params[3]]) == sorted(ref.state[ref_params[3]]) == ["exp_avg", "exp_avg_sq", "step"]


def test_torch_muon_takes_2d_params_only_as_its_own_step(device):
    """torch.optim.Muon rejects a param of other than two dims (kitsune's flattens it): the bucket goes to torch's
    step, which raises its own error and leaves the params as it leaves them without kitsune."""
    params = make_params([(16, 32), (16, 32)], torch.float32, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = KitsuneOptimizer(torch.optim.Muon(params, lr=LR), enable_fusion=True)
    ref = torch.optim.Muon(twins, lr=LR)
    for step in range(2):
        if step == 1:
            for ps, o in ((params, opt), (twins, ref)):
                ps[1].data = ps[1].data.view(16, 4, 8)  # its state dropped: a new param as far as Muon knows
                del o.state[ps[1]]
        for ps in (params, twins):
            for p, g in zip(ps, random_grads(ps, step), strict=True):
                p.grad = g.view(p.shape)
        if step == 0:
            opt.step()
            ref.step()
            assert {b.route for b in opt.plan.buckets} == {Route.TRITON_MATMUL}
            continue
        for o in (opt, ref):
            with pytest.raises(ValueError, match="2D"):
                o.step()
    assert {b.route for b in opt.plan.buckets} == {Route.BASE_STEP}
    assert "3-D param in a Muon group" in opt.plan.buckets[0].reason
    for p, t in zip(params, twins, strict=True):  # the fused first step's bf16 Newton-Schulz against torch's fp32
        torch.testing.assert_close(p, t, atol=1e-3, rtol=0)


def test_an_adjust_lr_fn_set_by_hand_that_muon_does_not_know_leaves_lr_as_torch(device):
    """Checked when a group is added, not when set by hand later: torch's Muon then leaves lr as it is; kitsune's
    eager and fused steps do the same."""
    assert adjust_lr(0.1, "Original", (64, 64)) == 0.1 == 0.1 * muon_unit.adjust_ratio("Original", (64, 64))
    assert adjust_lr(0.1, "match_rms_adamw", (64, 16)) == pytest.approx(0.1 * 0.2 * 8)
    steps = 4

    def groups(ps):
        return [{"params": ps}]

    def make(groups):
        opt = _kitsune_muon(groups)
        opt.param_groups[0]["adjust_lr_fn"] = "Original"
        return opt

    ref_params, _ = trajectory(make, [(32, 32)], torch.float32, device, steps, groups=groups)
    params, opt = trajectory(make, [(32, 32)], torch.float32, device, steps, fused=True, groups=groups)
    assert opt.plan.buckets[0].route is Route.TRITON_MATMUL
    torch.testing.assert_close(params[0], ref_params[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("muon", ["torch", "kitsune"])
def test_muon_params_cast_narrower_step_on_the_wrapped_step_with_their_float32_momentum(muon, device):
    """``model.half()`` after Muon's momentum was made: Muon's own step lerps the grad into its float32 buffer, so it
    takes the cast params with float32 grads (``p.grad_dtype``) and raises halfway with grads in their dtype, and
    rounding the buffer would lose it. The params go to the wrapped step with their momentum as it is: a step with
    float16 grads is refused before anything changes, naming the fix; with float32 grads the steps are the wrapped
    optimizer's, bit for bit; a cast back (``model.float()``) fuses them again (kitsune refused every such step)."""

    def make(ps):
        if muon == "torch":
            return torch.optim.Muon(ps, lr=LR, weight_decay=0.1)
        return Muon([{"params": ps, "use_muon": True}], lr=LR, weight_decay=0.1)

    params = make_params([(24, 16), (16, 16)], torch.float32, device)
    opt = KitsuneOptimizer(make(params), enable_fusion=True)
    for step in range(3):
        for p, g in zip(params, random_grads(params, step), strict=True):
            p.grad = g
        opt.step()
    assert opt.plan.buckets[0].route is Route.TRITON_MATMUL
    for p, g in zip(params, random_grads(params, 3), strict=True):
        p.data = p.data.half()
        p.grad = g.half()
    assert_refused(opt, params, "'momentum_buffer' of a .* torch.float16 param is torch.float32.*p.grad_dtype.*Nothing")
    assert_steps_as_the_wrapped_step(opt, params, make, lambda step: random_grads(params, step), range(3, 6))
    for p, g in zip(params, random_grads(params, 6), strict=True):  # cast back: fused again, from that momentum
        p.data = p.data.float()
        set_grad(p, g.float())
    before = [p.detach().clone() for p in params]
    opt.step()
    assert opt.plan.buckets[0].route is Route.TRITON_MATMUL
    assert not any(torch.equal(p, b) for p, b in zip(params, before, strict=True))


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda g, b: g.update(use_muon=True), ValueError, r"parameter 0 of param group 1 has shape \(16,\)"),
        (lambda g, b: g["params"].append(b), ValueError, r"parameter 1 of param group 0 has shape \(2, 4, 4\)"),
        (lambda g, b: g.update(ns_coefficients=(1.0, 2.0)), ValueError, "Invalid ns_coefficients in param group"),
        (lambda g, b: g.update(ns_coefficients="abc"), ValueError, "Invalid ns_coefficients in param group"),
        (lambda g, b: g.update(ns_steps=2.5), TypeError, "Invalid ns_steps in param group"),
    ],
    ids=["flipped_to_muon_over_a_bias", "a_3d_param_appended", "two_coefficients", "text", "fractional_steps"],
)
def test_a_group_changed_by_hand_to_what_muon_cannot_read_is_refused_before_any_update(change, error, match, device):
    """A group edited between steps (flipped to ``use_muon=True`` over a bias, a 3-D param appended, coefficients
    or a step count the schedule cannot read) raises at the next step before any group moves, on the eager route and
    on the fused one: Muon ran on the (16,) bias as a (16, 1) matrix, flattened the 3-D param, or raised after the
    groups before the changed one had updated."""
    for fused in (False, True):
        weight, bias = torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(16))
        weight, bias = torch.nn.Parameter(weight.detach().to(device)), torch.nn.Parameter(bias.detach().to(device))
        base = Muon([{"params": [weight]}, {"params": [bias], "use_muon": False}], lr=0.02)
        opt = KitsuneOptimizer(base, enable_fusion=True) if fused else base
        assert not fused or "triton_matmul" in str(opt.plan)
        extra = torch.nn.Parameter(torch.randn(2, 4, 4, device=device))
        for step in range(3):
            for p in (weight, bias, extra):
                p.grad = torch.randn_like(p)
            if step == 2:
                change(opt.param_groups[1] if "group 1" in match else opt.param_groups[0], extra)
                before = [p.detach().clone() for p in (weight, bias)]
                state = {k: v.clone() for k, v in opt.state[weight].items()}
                with pytest.raises(error, match=match):
                    opt.step()
                assert all(torch.equal(p, b) for p, b in zip((weight, bias), before, strict=True))
                assert all(torch.equal(opt.state[weight][k], v) for k, v in state.items())
            else:
                opt.step()
