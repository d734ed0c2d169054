"""The planner: every fallback reason, the cost model knobs, the plan object and the counters."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from rich.console import Console
from twins import assert_close_params, make_params, random_grads, trajectory

import kitsune.fusion.planner as fusion_planner
from kitsune import FusionConfig, KitsuneOptimizer
from kitsune.fusion import Route
from kitsune.kernels.spec import UpdateSpec
from kitsune.optim import Lion
from kitsune.subsystem import StepState

SIZES = [(4, 3), 5, 1]


def _adamw(ps):
    return torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)


def _fusion(opt: KitsuneOptimizer):
    return next(s for s in opt.subsystems if s.name == "fusion")


def _only_bucket(opt: KitsuneOptimizer):
    (bucket,) = opt.plan.buckets
    return bucket


@pytest.fixture(autouse=True)
def _no_inactive_warning(recwarn):
    """Fallback-only plans make the orchestrator warn that fusion is inactive: expected here."""


def _assert_identical(make, device, **kwargs) -> KitsuneOptimizer:
    """A fallback to the wrapped optimizer's own step: bit-identical trajectory."""
    ref_params, _ = trajectory(make, SIZES, torch.float32, device, steps=5)
    params, opt = trajectory(make, SIZES, torch.float32, device, steps=5, fused=True, **kwargs)
    for a, b in zip(params, ref_params, strict=True):
        assert torch.equal(a, b)
    return opt


def test_fused_by_default_under_the_interpreter(device):
    params, opt = trajectory(_adamw, SIZES, torch.float32, device, steps=1, fused=True)
    bucket = _only_bucket(opt)
    assert (bucket.route, bucket.tensors, bucket.elements, bucket.launches) == (Route.TRITON, 3, 18, 1)
    assert bucket.predicted_speedup > 1
    assert _fusion(opt).active and _fusion(opt).owned_params() == params


def test_enable_elementwise_false(device):
    opt = _assert_identical(_adamw, device, fusion_config=FusionConfig(enable_elementwise=False))
    assert _only_bucket(opt).route is Route.BASE_STEP
    assert "enable_elementwise=False" in _only_bucket(opt).reason
    assert not _fusion(opt).active


def test_cpu_without_interpreter_is_bit_identical(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for make in (_adamw, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), lambda ps: Lion(ps)):
        opt = _assert_identical(make, torch.device("cpu"))
        assert _only_bucket(opt).route is Route.BASE_STEP
        assert "need CUDA" in _only_bucket(opt).reason
        assert "need CUDA" in _fusion(opt).reason


def test_unknown_optimizer_class_keeps_its_own_step(device):
    class MyAdamW(torch.optim.AdamW):
        pass

    opt = _assert_identical(lambda ps: MyAdamW(ps, lr=1e-2), device)
    assert _only_bucket(opt).route is Route.BASE_STEP
    assert "unknown optimizer class" in _only_bucket(opt).reason and "MyAdamW" in _only_bucket(opt).reason


def test_sparse_adam_and_lbfgs_keep_their_own_step_and_say_why(device):
    params = make_params(SIZES, torch.float32, device)
    for make, why in (
        (lambda ps: torch.optim.SparseAdam(ps, lr=1e-2), "sparse grads only"),
        (lambda ps: torch.optim.LBFGS(ps, lr=0.5), "line search that evaluates the loss several times per step"),
    ):
        bucket = _only_bucket(KitsuneOptimizer(make(params), enable_fusion=True))
        assert bucket.route is Route.BASE_STEP and why in bucket.reason and "unknown" not in bucket.reason


def test_differentiable_keeps_its_own_step(device):
    params = [p.requires_grad_(False) for p in make_params(SIZES, torch.float32, device)]
    twins = [p.detach().clone() for p in params]
    opt = KitsuneOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9, differentiable=True), enable_fusion=True)
    ref = torch.optim.SGD(twins, lr=0.1, momentum=0.9, differentiable=True)
    assert _only_bucket(opt).route is Route.BASE_STEP
    assert "differentiable=True" in _only_bucket(opt).reason
    for step in range(3):
        for ps in (params, twins):
            for p, g in zip(ps, random_grads(ps, step), strict=True):
                p.grad = g
        opt.step()
        ref.step()
    assert all(torch.equal(a, b) for a, b in zip(params, twins, strict=True))


def test_differentiable_set_mid_run_goes_to_its_own_step_and_back(device):
    """``differentiable`` is a group's route, as a kernel switch is its variant: set or cleared between steps, the
    next step plans again (the plan says so), and the params follow torch's SGD either way."""
    params = [p.requires_grad_(False) for p in make_params(SIZES, torch.float32, device)]
    twins = [p.detach().clone() for p in params]
    opt = KitsuneOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9), enable_fusion=True)
    ref = torch.optim.SGD(twins, lr=0.1, momentum=0.9)
    routes = []
    for step in range(6):
        if step in (2, 4):
            for o in (opt, ref):
                o.param_groups[0]["differentiable"] = step == 2
        for ps in (params, twins):
            for p, g in zip(ps, random_grads(ps, step), strict=True):
                p.grad = g
        opt.step()
        ref.step()
        routes.append(_only_bucket(opt).route)
    assert routes == [Route.TRITON] * 2 + [Route.BASE_STEP] * 2 + [Route.TRITON] * 2
    for a, b in zip(params, twins, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_complex_params_keep_their_own_step(device):
    real = make_params([3], torch.float32, device)
    cplx = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64, device=device))
    opt = KitsuneOptimizer(torch.optim.Adam([*real, cplx], lr=1e-2), enable_fusion=True)
    routes = {b.dtype: b.route for b in opt.plan.buckets}
    assert routes == {"float32": Route.TRITON, "complex64": Route.BASE_STEP}
    assert "complex" in next(b.reason for b in opt.plan.buckets if b.dtype == "complex64")
    ref = torch.optim.Adam([torch.nn.Parameter(cplx.detach().clone())], lr=1e-2)
    for _ in range(3):
        for p in real:
            p.grad = torch.randn_like(p)
        g = torch.randn(3, dtype=torch.complex64, device=device)
        cplx.grad, ref.param_groups[0]["params"][0].grad = g, g.clone()
        opt.step()
        ref.step()
    assert torch.equal(cplx, ref.param_groups[0]["params"][0])  # the complex param went through torch's step


@pytest.mark.parametrize(
    ("make", "route"),
    [
        (_adamw, Route.TORCH_FUSED),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), Route.TORCH_FUSED),
        (lambda ps: torch.optim.RMSprop(ps, lr=1e-2), Route.TORCH_FOREACH),
        (lambda ps: Lion(ps, lr=1e-3), Route.BASE_STEP),
    ],
    ids=["adamw", "sgd", "rmsprop", "lion"],
)
def test_float64_goes_to_torch(make, route, device):
    ref_params, ref = trajectory(make, SIZES, torch.float64, device, steps=5)
    params, opt = trajectory(make, SIZES, torch.float64, device, steps=5, fused=True)
    bucket = _only_bucket(opt)
    assert bucket.route is route and "float64" in bucket.reason
    for a, b in zip(params, ref_params, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_triton_not_importable(monkeypatch, device):
    monkeypatch.setattr(fusion_planner, "triton_error", lambda: "Triton is not importable (test)")
    for make, route in ((_adamw, Route.TORCH_FUSED), (lambda ps: Lion(ps), Route.BASE_STEP)):
        params, opt = trajectory(make, SIZES, torch.float32, device, steps=3, fused=True)
        assert _only_bucket(opt).route is route
        assert "Triton is not importable" in _only_bucket(opt).reason


def test_non_contiguous_param_goes_to_torch(device):
    base = torch.randn(3, 4, device=device)
    p = torch.nn.Parameter(base.t())  # (4, 3) with transposed strides
    q = make_params([5], torch.float32, device)[0]
    opt = KitsuneOptimizer(_adamw([p, q]), enable_fusion=True)
    routes = sorted((b.route.value, b.tensors) for b in opt.plan.buckets)
    assert routes == [("torch_foreach", 1), ("triton", 1)]  # torch's fused kernels need grads laid out as params
    assert any("non-contiguous" in b.reason for b in opt.plan.buckets)


@pytest.mark.parametrize("make", [_adamw, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)], ids=["adamw", "sgd"])
def test_non_contiguous_param_with_a_contiguous_grad_matches_torch(make, device):
    """A transposed param whose grads come contiguous (assigned by hand, or from a flat buffer): torch's own path
    reads each grad by its strides, and so must the route kitsune picks."""
    ps = [torch.nn.Parameter(torch.randn(3, 4, device=device).t()) for _ in range(2)]
    twins = [torch.nn.Parameter(p.detach().clone().t().contiguous().t()) for p in ps]
    opt, ref = KitsuneOptimizer(make(ps), enable_fusion=True), make(twins)
    for step, grads in enumerate(random_grads(ps, s) for s in range(10)):
        for p, t, g in zip(ps, twins, grads, strict=True):
            p.grad, t.grad = g.contiguous(), g.contiguous()
        opt.step()
        ref.step()
        for p, t in zip(ps, twins, strict=True):
            torch.testing.assert_close(p, t, rtol=1e-6, atol=1e-6, msg=f"step {step}")


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_foreach_false_keeps_what_the_kernel_does_not_take_on_the_optimizers_own_loop(cls, device):
    """A group that says foreach=False: a param the fused kernel does not take (non-contiguous) goes to the
    optimizer's own step, torch's per-param loop, not to torch's foreach path, which refuses tensor betas without
    capturable (the loop takes them) and rounds otherwise. The other group (foreach left to torch) keeps the foreach
    path; setting foreach=False there later re-plans."""

    def make(ps):
        betas = (torch.tensor(0.9), torch.tensor(0.99))
        groups = [{"params": ps[:2], "foreach": False, "betas": betas}, {"params": ps[2:], "amsgrad": True}]
        return cls(groups, lr=1e-2, weight_decay=0.1)

    ps = [torch.nn.Parameter(torch.randn(3, 5, device=device).t()), *make_params([7], torch.float32, device, seed=2)]
    ps += [torch.nn.Parameter(torch.randn(4, 2, device=device).t()), *make_params([6], torch.float32, device, seed=3)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt, ref = KitsuneOptimizer(make(ps), enable_fusion=True), make(twins)

    def routes():
        return sorted((b.groups[0], b.route.value) for b in opt.plan.buckets)

    assert routes() == [(0, "base_step"), (0, "triton"), (1, "torch_foreach"), (1, "triton")]
    (loop,) = [b for b in opt.plan.buckets if b.route is Route.BASE_STEP]
    assert "foreach=False" in loop.reason and "non-contiguous" in loop.reason
    for step in range(12):
        if step == 6:  # the second group's non-contiguous param leaves torch's foreach path too
            for o in (opt, ref):
                o.param_groups[1]["foreach"] = False
        for p, t, g in zip(ps, twins, random_grads(ps, step), strict=True):
            p.grad, t.grad = g, g.clone()
        opt.step()
        ref.step()
        assert_close_params(ps, twins, torch.float32)
    assert routes() == [(0, "base_step"), (0, "triton"), (1, "base_step"), (1, "triton")]


def test_sparse_grads_at_plan_time(device):
    emb = torch.nn.Embedding(6, 3, sparse=True).to(device)
    emb(torch.tensor([1, 2], device=device)).sum().backward()
    opt = KitsuneOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), enable_fusion=True)
    assert _only_bucket(opt).route is Route.BASE_STEP and "sparse" in _only_bucket(opt).reason
    before = emb.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, emb.weight)


def test_sparse_grad_at_step_time_is_left_to_torch(device):
    emb = torch.nn.Embedding(6, 3, sparse=True).to(device)
    dense = make_params([4], torch.float32, device)[0]
    opt = KitsuneOptimizer(torch.optim.SGD([emb.weight, dense], lr=0.1), enable_fusion=True)
    assert opt.plan.fused_tensors == 2  # no grads yet: nothing says sparse
    emb(torch.tensor([1, 2], device=device)).sum().backward()
    dense.grad = torch.ones_like(dense)
    ctx = StepState(step=1)
    _fusion(opt).prepare(ctx)
    assert ctx.unhandled == [emb.weight]
    assert dense in ctx.handled and emb.weight not in ctx.handled


def test_sparse_grad_at_step_time_end_to_end(device):
    emb = torch.nn.Embedding(6, 3, sparse=True).to(device)
    dense = make_params([4], torch.float32, device)[0]
    opt = KitsuneOptimizer(torch.optim.SGD([emb.weight, dense], lr=0.1), enable_fusion=True)
    emb(torch.tensor([1, 2], device=device)).sum().backward()
    dense.grad = torch.ones_like(dense)
    before = emb.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, emb.weight)


def test_sparse_momentum_from_a_late_sparse_grad_stays_with_torchs_step_through_copies_and_loads(device):
    """A param planned dense whose grad turns out sparse: SGD's own step makes its momentum buffer sparse, as torch's
    does. From then on the param is torch's (the kernels read dense memory), and a re-plan, a copy, a load of the
    optimizer's own state dict or a group added go on with it where they raised; 12 steps follow torch's."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2)).to(device)
    twin = copy.deepcopy(model)
    opt = KitsuneOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), enable_fusion=True)
    ref = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    assert opt.plan.fused_tensors == 3  # no grads yet: nothing says sparse
    for step in range(12):
        x = torch.randint(0, 10, (8,), device=device)
        for m, o in ((model, opt), (twin, ref)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
        if step == 3:
            assert opt.state[model[0].weight]["momentum_buffer"].is_sparse  # torch's own, as the plain SGD's
            copied = copy.deepcopy(opt)
            assert copied.state[copied.param_groups[0]["params"][0]]["momentum_buffer"].is_sparse
            opt.load_state_dict(opt.state_dict())
            opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3, device=device))]})
            ref.add_param_group({"params": [torch.nn.Parameter(torch.randn(3, device=device))]})
    assert_close_params(list(model.parameters()), list(twin.parameters()), torch.float32)
    sparse = [b for b in opt.plan.buckets if b.route is Route.BASE_STEP]
    assert len(sparse) == 1 and sparse[0].tensors == 1 and sparse[0].reason.startswith("sparse state")
    assert opt.plan.fused_tensors == 3  # the Linear's two and the group added


def test_flags_are_noted_not_refused(device):
    make = (
        lambda ps: torch.optim.Adam(  # noqa: E731
            [{"params": ps[:1], "foreach": True}, {"params": ps[1:], "capturable": True}], lr=1e-2
        )
    )
    opt = KitsuneOptimizer(make(make_params(SIZES, torch.float32, device)), enable_fusion=True)
    bucket = _only_bucket(opt)
    assert bucket.route is Route.TRITON
    assert any("foreach=True" in n for n in bucket.notes) and any("capturable=True" in n for n in bucket.notes)
    fused = KitsuneOptimizer(
        torch.optim.SGD(make_params([3], torch.float32, device), lr=0.1, fused=True), enable_fusion=True
    )
    assert any("fused=True" in n for n in _only_bucket(fused).notes)


def test_min_fusion_benefit_changes_the_plan(device):
    params, opt = trajectory(_adamw, SIZES, torch.float32, device, steps=1, fused=True)
    speedup = _only_bucket(opt).predicted_speedup
    ref_params, _ = trajectory(_adamw, SIZES, torch.float32, device, steps=5)
    for threshold, route in ((speedup * 0.9, Route.TRITON), (speedup * 1.1, Route.TORCH_FUSED)):
        config = FusionConfig(min_fusion_benefit=threshold)
        params, opt = trajectory(_adamw, SIZES, torch.float32, device, steps=5, fused=True, fusion_config=config)
        bucket = _only_bucket(opt)
        assert bucket.route is route and bucket.predicted_speedup == speedup
        if route is Route.TORCH_FUSED:
            assert "below min_fusion_benefit" in bucket.reason
        assert_close_params(params, ref_params, torch.float32)


def test_min_fusion_benefit_favours_many_tensors(device):
    """More tensors per launch pay more: a threshold can fuse the big bucket and not the small one."""
    small = make_params([5], torch.float32, device)
    many = make_params([5] * 40, torch.bfloat16, device)
    opt = KitsuneOptimizer(_adamw(small + many), enable_fusion=True)
    speed = {b.tensors: b.predicted_speedup for b in opt.plan.buckets}
    assert speed[40] > speed[1]
    config = FusionConfig(min_fusion_benefit=(speed[40] + speed[1]) / 2)
    opt = KitsuneOptimizer(_adamw(small + many), fusion_config=config, enable_fusion=True)
    assert {b.tensors: b.route for b in opt.plan.buckets} == {1: Route.TORCH_FUSED, 40: Route.TRITON}


@pytest.mark.parametrize(("size", "launches"), [(None, 1), (2, 2), (1, 3)])
def test_max_fusion_size_changes_launches_not_results(size, launches, device):
    config = FusionConfig(max_fusion_size=size, min_fusion_benefit=0.0)  # tiny launches would not pay
    ref_params, _ = trajectory(_adamw, SIZES, torch.float32, device, steps=5, fused=True)
    params, opt = trajectory(
        _adamw, SIZES, torch.float32, device, steps=5, fused=True, fusion_config=config, capture_graph=False
    )
    assert opt.plan.launches == launches == _fusion(opt).report()["fused_launches_per_step"]
    for a, b in zip(params, ref_params, strict=True):
        assert torch.equal(a, b)


def test_plan_renders_and_serialises(device):
    cplx = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64, device=device))
    opt = KitsuneOptimizer(_adamw([*make_params(SIZES, torch.float32, device), cplx]), enable_fusion=True)
    data = json.loads(json.dumps(opt.plan.to_dict()))
    assert data["fused_tensors"] == 3 and data["fallback_tensors"] == 1
    assert {b["route"] for b in data["buckets"]} == {"triton", "base_step"}
    console = Console(record=True, width=200)
    console.print(opt.plan)
    text = console.export_text()
    assert "triton" in text and "complex params" in text


def test_report_counts(device):
    params, opt = trajectory(_adamw, SIZES, torch.float32, device, steps=4, fused=True)
    report = _fusion(opt).report()
    assert report["params_fused"] == 3 and report["params_fallen_back"] == 0
    assert report["fused_launches_per_step"] == 1 and report["fused_launches_total"] == 4
    assert report["steps"] == 4
    assert report["context_uploads"] == 1  # constant lr: the hyperparameter buffer is uploaded once
    json.dumps(report)


def test_context_refreshes_only_when_a_value_changes(device):
    params = make_params(SIZES, torch.float32, device)
    opt = KitsuneOptimizer(_adamw(params), enable_fusion=True)
    for step in range(4):
        for p, g in zip(params, random_grads(params, step), strict=True):
            p.grad = g
        if step == 2:
            opt.param_groups[0]["lr"] = 5e-3
        opt.step()
    assert _fusion(opt).report()["context_uploads"] == 2


def test_each_fallback_reason_is_logged_once(caplog, device):
    cplx = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64, device=device))
    with caplog.at_level(logging.INFO, logger="kitsune.fusion"):
        opt = KitsuneOptimizer(_adamw([cplx]), enable_fusion=True)
        opt.add_param_group({"params": make_params([2], torch.float32, device)})  # re-plans
    assert sum("complex params" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("set_to_none", [False, True])
def test_param_storage_replaced_mid_run_is_updated_where_it_now_lives(set_to_none, device):
    # an EMA swap or model.half() replaces p.data; the grads may stay at their old addresses (set_to_none=False,
    # or the caching allocator handing back the same blocks), so the fused path must notice the param itself
    params = make_params([(7, 3), 16], torch.float32, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = KitsuneOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9), enable_fusion=True)
    ref = torch.optim.SGD(twins, lr=0.1, momentum=0.9)
    for step in range(6):
        for p, t, g in zip(params, twins, random_grads(params, step), strict=True):
            for x in (p, t):
                x.grad = g.clone() if set_to_none or x.grad is None else x.grad.copy_(g)
        if step == 3:
            for p, t in zip(params, twins, strict=True):
                fresh = torch.randn_like(p)
                p.data, t.data = fresh, fresh.clone()
        opt.step()
        ref.step()
    assert_close_params(params, twins, torch.float32)


# (tensors, elements): a few small tensors, GPT-2 124M's 148 tensors, 2000 tensors of 4096, llama 1B's 146 tensors
_SHAPES = [(3, 300), (148, 124_439_808), (2000, 2000 * 4096), (146, 1_235_814_400)]


@pytest.mark.parametrize(("tensors", "elements"), _SHAPES)
@pytest.mark.parametrize(
    # Muon's matrices are weighed with their Newton-Schulz work (tests/fusion/test_muon_fused.py)
    "cls",
    [c for c in fusion_planner.ALGOS if "Muon" not in c.__qualname__],
    ids=lambda c: c.__qualname__,
)
def test_cost_model_fuses_every_known_optimizer_on_cuda(cls, tensors, elements):
    """Every optimizer kitsune has a kernel for is predicted faster fused than on its fallback (torch's fused or
    foreach path, or its own per-param loop where torch has neither, as for Lion, LAMB and LARS), small sets and
    large, so the default min_fusion_benefit=1 fuses it: a per-param loop is weighed as one launch per op and
    param, never as a single foreach launch (which predicted Lion on GPT-2's shapes at 0.85x)."""
    info = fusion_planner.ALGOS[cls]
    fallback = fusion_planner.torch_route(info, torch.device("cuda"), torch.float32)
    spec = info.spec(_default_group(cls))
    assert isinstance(spec, UpdateSpec)
    nbytes = elements * 4 * info.bytes_per_element(spec)
    fused, other = fusion_planner.weigh(fusion_planner.CostModel(), info, fallback, tensors, nbytes, 1)
    assert other / fused > FusionConfig().min_fusion_benefit, (fallback, fused, other)


def _default_group(cls) -> dict:
    """A param group with ``cls``'s defaults (torch.optim.Muon and kitsune's Muon need a matrix)."""
    p = torch.nn.Parameter(torch.randn(2, 2))
    return cls([p]).param_groups[0]


def test_lion_fused_by_default_and_the_plan_shows_the_model(device):
    params, opt = trajectory(lambda ps: Lion(ps, lr=1e-3), SIZES, torch.float32, device, steps=2, fused=True)
    bucket = _only_bucket(opt)
    assert bucket.route is Route.TRITON
    assert set(bucket.predicted_ms) == {"triton", "base_step"}
    assert bucket.predicted_ms["triton"] < bucket.predicted_ms["base_step"]
    console = Console(record=True, width=200)
    console.print(opt.plan)
    table = console.export_text()
    assert f"({bucket.predicted_ms['triton']:g} vs {bucket.predicted_ms['base_step']:g} ms)" in table
    assert json.loads(json.dumps(opt.plan.to_dict()))["buckets"][0]["predicted_ms"] == bucket.predicted_ms


def test_params_moved_where_the_kernel_runs_after_wrapping_are_fused(device, monkeypatch):
    """An optimizer built over CPU params and the model moved to the GPU afterwards, before the first step
    (``model.cuda()`` replaces each param's storage): the plan that fused nothing ("CPU tensors") is made again at
    the next step, and the params take the fused kernel, their trajectory torch's. On the CPU the interpreter stands
    in for the GPU: off while the optimizer is built, on when the storages move."""
    model = torch.nn.Linear(6, 4)
    twin = torch.nn.Linear(6, 4)
    twin.load_state_dict(model.state_dict())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    opt = KitsuneOptimizer(torch.optim.AdamW(model.parameters(), lr=0.05), enable_fusion=True)
    ref = torch.optim.AdamW(twin.parameters(), lr=0.05)
    assert {b.route for b in opt.plan.buckets} == {Route.BASE_STEP}
    assert "CPU tensors" in _only_bucket(opt).reason
    if device.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    routes = []
    for step in range(6):
        if step == 0:  # as model.cuda() does: every param's storage replaced
            for m in (model, twin):
                for p in m.parameters():
                    p.data = p.data.to(device, copy=True)
        for m in (model, twin):
            for p, g in zip(m.parameters(), random_grads(list(m.parameters()), step), strict=True):
                p.grad = g.to(p.device)
        opt.step()
        ref.step()
        routes.append({b.route for b in opt.plan.buckets})
    assert routes == [{Route.TRITON}] * 6
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_switch_keys_are_the_keys_the_switches_are_read_from():
    """`switch_keys`: the keys `group_switches` reads, found by running it (an LR scheduler's lr is not one, so its
    steady replays compare no switches); None where it reads every key or raises, so that every change compares."""
    from dataclasses import replace

    from kitsune.fusion.algos import ALGOS
    from kitsune.fusion.planner import group_switches, switch_keys
    from kitsune.optim import Muon

    params = [torch.zeros(4, 4, requires_grad=True)]
    adamw = torch.optim.AdamW(params, lr=1e-3)
    sgd = torch.optim.SGD([{"params": params}, {"params": [], "nesterov": True}], lr=0.1, momentum=0.9)
    muon = Muon(params, lr=0.02)
    adamw_keys = {"amsgrad", "maximize", "differentiable", "foreach", "decoupled_weight_decay"}
    assert switch_keys(ALGOS[torch.optim.AdamW], adamw.param_groups) == adamw_keys
    sgd_keys = {"momentum", "nesterov", "maximize", "differentiable", "foreach"}
    assert switch_keys(ALGOS[torch.optim.SGD], sgd.param_groups) == sgd_keys
    muon_keys = switch_keys(ALGOS[Muon], muon.param_groups)
    assert {"ns_coefficients", "ns_steps", "nesterov"} <= muon_keys and "lr" not in muon_keys
    assert switch_keys(None, adamw.param_groups) == frozenset()
    info = ALGOS[torch.optim.AdamW]
    every = replace(info, spec=lambda g: (info.spec(g), sorted(g.items(), key=str)))
    assert switch_keys(every, adamw.param_groups) is None
    defaulted = replace(info, spec=lambda g: (info.spec(g), g.setdefault("momentum_decay", 4e-3), g.pop("eps")))
    assert switch_keys(defaulted, adamw.param_groups) == adamw_keys | {"momentum_decay", "eps"}
    assert "momentum_decay" not in adamw.param_groups[0] and "eps" in adamw.param_groups[0]
    group = dict(adamw.param_groups[0])
    del group["amsgrad"]  # torch's step raises KeyError: so do the switches
    with pytest.raises(KeyError):
        group_switches(info, [group])
    assert switch_keys(info, [group]) is None
    # the groups themselves are read, not changed
    assert adamw.param_groups[0]["amsgrad"] is False and type(adamw.param_groups[0]) is dict
