"""Inputs torch handles in its own way, step by step against torch: optimizers that need their closure inside the
step (LBFGS), a closure with float16 loss scaling, sparse grads under loss scaling and clipping, and a param listed
twice in the groups."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from helpers import routes
from twins import (
    assert_refused,
    assert_steps_as_the_wrapped_step,
    make_params,
    random_grads,
    set_grad,
    step_twins,
)

from kitsune import AMPConfig, FusionConfig, KitsuneOptimizer, StreamConfig

FP16 = {"enable_amp": True, "amp_config": AMPConfig(dtype=torch.float16, init_scale=2.0**10)}


def _regression(device: torch.device, seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # the layers' initial weights
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    x, y = torch.randn(16, 6, generator=gen), torch.randn(16, 2, generator=gen)
    return model.to(device), x.to(device), y.to(device)


class _LBFGSWithOptionalClosure(torch.optim.LBFGS):
    def step(self, closure: Any = None) -> Any:  # the signature no longer says the closure is needed
        return super().step(closure)


@pytest.mark.parametrize(
    "settings",
    [{"max_grad_norm": 1.0}, FP16, {"max_grad_norm": 1.0, **FP16}],
    ids=["clip", "fp16", "clip+fp16"],
)
@pytest.mark.parametrize("cls", [torch.optim.LBFGS, _LBFGSWithOptionalClosure], ids=["lbfgs", "subclass"])
def test_lbfgs_refuses_passes_that_would_run_between_its_evaluations(settings, cls, device):
    model, _, _ = _regression(device)
    inner = cls(model.parameters(), lr=0.5)
    with pytest.raises(ValueError, match="evaluates its closure several times inside one step") as err:
        KitsuneOptimizer(inner, **settings)
    assert "clip_grad_norm_" in str(err.value) and "bfloat16" in str(err.value)
    assert all(type(g["params"]) is list for g in inner.param_groups)  # untouched: nothing was wrapped


def test_lbfgs_with_bfloat16_autocast_steps_as_torch(device):
    """bfloat16 needs no scaling, so LBFGS wraps: the same trajectory as the plain LBFGS over 10 steps."""
    runs = []
    for wrap in (False, True):
        model, x, y = _regression(device)
        inner = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
        opt = KitsuneOptimizer(inner, enable_amp=True, amp_config=AMPConfig(dtype=torch.bfloat16)) if wrap else inner

        def closure(model=model, opt=opt, x=x, y=y) -> torch.Tensor:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        runs.append(
            ([float(opt.step(closure).detach()) for _ in range(10)], [p.detach().clone() for p in model.parameters()])
        )
    (losses, params), (ours, ours_params) = runs
    assert ours == losses and losses[-1] < losses[0]
    for p, q in zip(params, ours_params, strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_float16_scaling_with_a_closure_that_calls_optimizer_backward(fused, device):
    """The closure scales its loss through ``optimizer.backward``; the step runs it before unscaling (before, the
    unfused path unscaled first and told the user to call optimizer.backward, which the closure did). Powers of two
    scale exactly, so the unfused trajectory is plain SGD's bit for bit, the fused one to fp32 rounding."""
    trajectories = []
    for wrap in (False, True):
        model, x, y = _regression(device)
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        opt = KitsuneOptimizer(inner, enable_fusion=fused, **FP16) if wrap else inner
        losses = []
        for step in range(15):

            def closure(model=model, opt=opt, step=step, x=x, y=y) -> torch.Tensor:
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x * (1 + step / 10)), y)
                opt.backward(loss) if isinstance(opt, KitsuneOptimizer) else loss.backward()
                return loss

            losses.append(float(opt.step(closure)))
        trajectories.append((losses, [p.detach().clone() for p in model.parameters()]))
    (losses, params), (ours, ours_params) = trajectories
    tol = 1e-6 if fused else 0.0  # the fused kernel rounds its fp32 math in another order than torch's foreach
    assert ours == pytest.approx(losses, rel=tol, abs=tol)
    for p, q in zip(params, ours_params, strict=True):
        torch.testing.assert_close(q, p, rtol=tol, atol=tol)


def _embedding_steps(opt_cls, kitsune: bool, steps: int, dtype: torch.dtype = torch.float32, **kw):
    """An ``nn.Embedding(sparse=True)`` and a dense layer trained for ``steps`` steps with float16 loss scaling:
    kitsune's, or torch's GradScaler loop. Returns the losses and the final weights."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(20, 4, sparse=True).to(dtype)
    head = torch.nn.Linear(4, 1).to(dtype)
    inner = opt_cls([*emb.parameters(), *head.parameters()], **kw)
    opt = KitsuneOptimizer(inner, **FP16) if kitsune else inner
    scaler = None if kitsune else torch.amp.GradScaler("cpu", init_scale=2.0**10)
    gen = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, 20, (12,), generator=gen)  # repeated indices: uncoalesced sparse grads
        target = torch.randn(12, 1, generator=gen).to(dtype)
        loss = torch.nn.functional.mse_loss(head(emb(idx)).float(), target.float())
        opt.zero_grad()
        if kitsune:
            opt.backward(loss)
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        losses.append(float(loss))
    return losses, [emb.weight.detach().clone(), head.weight.detach().clone(), head.bias.detach().clone()]


@pytest.mark.parametrize(
    ("opt_cls", "kw"),
    [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), (torch.optim.Adagrad, {"lr": 0.1})],
    ids=["sgd", "adagrad"],
)
def test_sparse_grads_under_float16_scaling_follow_torchs_grad_scaler(opt_cls, kw):
    """GradScaler unscales a sparse grad's values; kitsune did not (a raw torch error). 25 steps, same trajectory."""
    want_losses, want = _embedding_steps(opt_cls, False, 25, **kw)
    losses, got = _embedding_steps(opt_cls, True, 25, **kw)
    assert losses == pytest.approx(want_losses, rel=1e-6)
    assert not torch.equal(want[0], _embedding_steps(opt_cls, False, 0, **kw)[1][0])  # the embedding trained
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_float16_sparse_grads_are_coalesced_before_unscaling():
    """As GradScaler does for float16 sparse grads: ``p.grad`` is coalesced (duplicate indices summed) first."""
    emb = torch.nn.Embedding(10, 3, sparse=True).half()
    opt = KitsuneOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), **FP16)
    opt.backward(emb(torch.tensor([1, 2, 2, 7])).float().pow(2).sum())
    assert not emb.weight.grad.is_coalesced()
    before = emb.weight.detach().clone()
    opt.step()
    assert emb.weight.grad.is_coalesced() and not torch.equal(emb.weight, before)


def test_clipping_sparse_grads_is_refused_and_loses_nothing(device):
    emb = torch.nn.Embedding(10, 3, sparse=True).to(device)
    head = torch.nn.Linear(3, 1).to(device)
    opt = KitsuneOptimizer(
        torch.optim.SGD([*head.parameters(), *emb.parameters()], lr=0.1, momentum=0.9), max_grad_norm=0.5
    )
    for step in range(3):
        opt.zero_grad()
        head(emb(torch.tensor([1, 2, 2, 7], device=device) % (3 + step))).pow(2).sum().backward()
        if step < 2:
            emb.weight.grad = emb.weight.grad.to_dense()  # dense grads: steps as usual
            opt.step()
    params = [p.detach().clone() for p in (*head.parameters(), emb.weight)]
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    with pytest.raises(ValueError, match=r"param 2 \(in the groups' order\) has a sparse grad") as err:
        opt.step()
    assert "nn.Embedding(sparse=False)" in str(err.value)
    for p, before in zip((*head.parameters(), emb.weight), params, strict=True):
        assert torch.equal(p, before)
    assert opt.step_count == 2
    for p, s in opt.state.items():
        for k, v in s.items():
            assert torch.equal(v, state[id(p)][k])


def test_a_param_listed_twice_steps_as_torch_steps_it(device):
    """torch warns and updates it once per listing; kitsune leaves it to the optimizer's own step (the fused kernel
    would update it once, and race on a GPU), fuses the rest, and clips its grad once, as for model.parameters()."""
    sizes = [(5, 3), 16, 7]
    params = make_params(sizes, torch.float32, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]

    def make(ps: list) -> torch.optim.Optimizer:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch: "duplicate parameters; in future, an error"
            return torch.optim.SGD([{"params": [ps[0], ps[1], ps[0]]}, {"params": ps[2:]}], lr=0.05, momentum=0.9)

    opt, ref = KitsuneOptimizer(make(params), enable_fusion=True, max_grad_norm=1.0), make(twins)
    assert opt.plan.fused_tensors == 2
    assert any("listed more than once" in b.reason for b in opt.plan.buckets)
    for step in range(12):
        for p, t, g in zip(params, twins, random_grads(params, step), strict=True):
            p.grad, t.grad = g.clone(), g.clone()
        want = torch.nn.utils.clip_grad_norm_(twins, 1.0)
        ref.step()
        opt.step()
        torch.testing.assert_close(opt.last_grad_norm, want, rtol=1e-6, atol=1e-6)
        for i, (p, t) in enumerate(zip(params, twins, strict=True)):
            torch.testing.assert_close(p, t, rtol=1e-5, atol=1e-6, msg=lambda m, i=i, step=step: f"{step}/{i}: {m}")


def test_amsgrad_switched_on_mid_run_raises_as_torch_then_follows_a_maximum_added_by_hand(device):
    """torch raises KeyError('max_exp_avg_sq') when amsgrad is switched on after the first step, and so does the
    fused path, before anything changes; with the maximum added by hand as zeros, both go on alike."""
    params = make_params([(4, 3), 9], torch.float32, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = KitsuneOptimizer(torch.optim.AdamW(params, lr=0.01, weight_decay=0.1), enable_fusion=True)
    ref = torch.optim.AdamW(twins, lr=0.01, weight_decay=0.1)
    assert opt.plan.fused_tensors == 2
    for step in range(10):
        for p, t, g in zip(params, twins, random_grads(params, step), strict=True):
            p.grad, t.grad = g.clone(), g.clone()
        if step == 4:
            for o in (opt, ref):
                o.param_groups[0]["amsgrad"] = True
            before = [p.detach().clone() for p in params], [dict(opt.state[p]) for p in params]
            for o in (opt, ref):
                with pytest.raises(KeyError, match="max_exp_avg_sq"):
                    o.step()
            assert opt.step_count == 4 and opt.plan.fused_tensors == 2
            for p, b, st in zip(params, *before, strict=True):
                assert torch.equal(p, b) and opt.state[p].keys() == st.keys()
                assert all(opt.state[p][k] is v or torch.equal(opt.state[p][k], v) for k, v in st.items())
            for o, ps in ((opt, params), (ref, twins)):
                for p in ps:
                    o.state[p]["max_exp_avg_sq"] = torch.zeros_like(p)
        opt.step()
        ref.step()
        for p, t in zip(params, twins, strict=True):
            torch.testing.assert_close(p, t, rtol=1e-5, atol=1e-6)
            if step >= 4:
                torch.testing.assert_close(opt.state[p]["max_exp_avg_sq"], ref.state[t]["max_exp_avg_sq"])


def test_amsgrad_switched_on_mid_run_over_torchs_route_raises_before_the_wrapped_step_updates_anything(device):
    """The same KeyError where a param of the group is on torch's foreach route (non-contiguous), which runs after the
    wrapped optimizer's own step (here a param listed twice): checked before that step, so nothing changes."""
    q = torch.nn.Parameter(torch.randn(4, 3, device=device).t())  # torch's foreach route
    p, f = make_params([3, (2, 5)], torch.float32, device, seed=7)  # listed twice: the own step; fused
    base = torch.optim.Adam([{"params": [q]}, {"params": [p, p]}, {"params": [f]}], lr=0.1)
    opt = KitsuneOptimizer(base, enable_fusion=True)
    assert sorted(b.route.value for b in opt.plan.buckets) == ["base_step", "torch_foreach", "triton"]
    params = [q, p, f]
    for step in range(3):
        for t, g in zip(params, random_grads(params, step), strict=True):
            t.grad = g
        opt.step()
    opt.param_groups[0]["amsgrad"] = True
    assert_refused(opt, params, "max_exp_avg_sq", error=KeyError)
    assert opt.step_count == 3
    opt.param_groups[0]["amsgrad"] = False  # the run goes on as it was
    opt.step()
    assert opt.step_count == 4 and all(float(opt.state[t]["step"]) == 4 for t in (q, f))


@pytest.mark.parametrize("amp", [False, True], ids=["plain", "float16"])
def test_sparse_grads_on_torchs_fused_route_go_to_the_optimizers_own_step(amp, device):
    """A bucket the planner leaves to torch's ``fused=True`` step (float64 params; or a min_fusion_benefit above the
    model's prediction): ``_fused_sgd`` raises on a sparse grad, so those params take SGD's own step, as on the
    Triton route. 15 steps against torch, with float16 scaling against its GradScaler loop."""

    def run(kitsune: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        emb = torch.nn.Embedding(20, 4, sparse=True).double().to(device)
        head = torch.nn.Linear(4, 1).double().to(device)
        inner = torch.optim.SGD([*emb.parameters(), *head.parameters()], lr=0.1, momentum=0.9)
        extra = FP16 if amp else {}
        fusion = {"enable_fusion": True, "fusion_config": FusionConfig(min_fusion_benefit=1e9)}
        opt = KitsuneOptimizer(inner, **fusion, **extra) if kitsune else inner
        if kitsune:
            assert {b.route.value for b in opt.plan.buckets} == {"torch_fused"}
        scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10) if amp and not kitsune else None
        gen = torch.Generator().manual_seed(5)
        for _ in range(15):
            idx = torch.randint(0, 20, (12,), generator=gen).to(device)
            target = torch.randn(12, 1, generator=gen).double().to(device)
            loss = torch.nn.functional.mse_loss(head(emb(idx)), target)
            opt.zero_grad()
            if kitsune and amp:
                opt.backward(loss)
                opt.step()
            elif scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
        return [emb.weight.detach(), head.weight.detach(), head.bias.detach()]

    for a, b in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("name", "route"), [("Adam", "torch_fused"), ("AdamW", "torch_fused"), ("NAdam", "torch_foreach")]
)
def test_params_cast_to_float64_mid_run_go_to_torchs_path_with_their_state_cast(name, route, device):
    """``model.double()`` after some steps: torch's own step raises (float32 state, float64 grads); kitsune casts the
    state (a widening cast loses nothing; narrowing ones: the test below), and the plan routes the params as it would
    have from the start (torch's fused or foreach path: the plan was stale on the wrapped step before). The
    trajectory equals torch's with its state cast by hand at the same step."""
    cls = getattr(torch.optim, name)
    params = make_params([7, (3, 5)], torch.float32, device)
    twins = [p.detach().clone().requires_grad_() for p in params]
    opt = KitsuneOptimizer(cls(params, lr=0.05, weight_decay=0.1), enable_fusion=True)
    ref = cls(twins, lr=0.05, weight_decay=0.1)
    routes = []
    for step in range(8):
        if step == 3:
            for ps in (params, twins):
                for p in ps:
                    p.data = p.data.double()
            for t in twins:  # by hand for torch, which would raise
                st = ref.state[t]
                for key in ("exp_avg", "exp_avg_sq"):
                    st[key] = st[key].double()
        for p, t, g in zip(params, twins, random_grads(params, step), strict=True):
            p.grad, t.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        routes.append({b.route.value for b in opt.plan.buckets})
    assert routes == [{"triton"}] * 3 + [{route}] * 5
    for p, t in zip(params, twins, strict=True):
        assert p.dtype == torch.float64 and opt.state[p]["exp_avg"].dtype == torch.float64
        torch.testing.assert_close(p, t, rtol=1e-6, atol=1e-7)


def _fused_then_cast(make, dtype: torch.dtype, device: torch.device) -> tuple[list[torch.nn.Parameter], Any]:
    """Two float32 params under ``KitsuneOptimizer(make(params))``: three fused steps (their state made in float32),
    then the params cast to ``dtype`` (``model.half()``, ``model.bfloat16()``)."""
    params = make_params([7, (3, 5)], torch.float32, device)
    opt = KitsuneOptimizer(make(params), enable_fusion=True)
    for step in range(3):
        for p, g in zip(params, random_grads(params, step), strict=True):
            p.grad = g
        opt.step()
    assert {b.route.value for b in opt.plan.buckets} == {"triton"}
    for p in params:
        p.data = p.data.to(dtype)
    return params, opt


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["SGD", "RMSprop", "Adagrad", "LARS"])
def test_params_cast_narrower_mid_run_keep_their_state_as_torchs_step_does(name, dtype, device):
    """``model.half()`` / ``model.bfloat16()`` after some fused steps, for the optimizers whose own step carries on
    with its float32 state (SGD, RMSprop but centered, Adagrad; kitsune.optim's LARS): the params go to the wrapped
    optimizer's own step, the plan says why, and the state stays float32, as torch keeps it (the fused kernel would
    round it to the params' dtype). From the cast on, the steps are the plain optimizer's bit for bit: a twin given
    kitsune's params and state at the cast follows them exactly."""
    from kitsune.optim import LARS

    make = {
        "SGD": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=1e-3),
        "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5),
        "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, weight_decay=1e-3),
        "LARS": lambda ps: LARS(ps, lr=1e-2, momentum=0.9, weight_decay=1e-3),
    }[name]
    params, opt = _fused_then_cast(make, dtype, device)
    twins = [p.detach().clone().requires_grad_() for p in params]
    ref = make(twins)
    ref.load_state_dict(opt.state_dict())  # kitsune's state at the cast; torch's load casts it to the twins' dtype
    for t, p in zip(twins, params, strict=True):
        ref.state[t] = {k: v.clone() for k, v in opt.state[p].items()}  # ... so set it as kitsune holds it
    for step in range(3, 9):
        for p, t, g in zip(params, twins, random_grads(params, step), strict=True):
            p.grad, t.grad = g.to(dtype), g.to(dtype)
        opt.step()
        ref.step()
        for p, t in zip(params, twins, strict=True):
            assert torch.equal(p, t), step
    (bucket,) = opt.plan.buckets
    assert bucket.route.value == "base_step" and "keeps the state in float32" in bucket.reason, opt.plan
    for p, t in zip(params, twins, strict=True):
        for key, value in ref.state[t].items():
            mine = opt.state[p][key]
            assert mine.dtype == value.dtype and torch.equal(mine, value), key
            assert value.dim() == 0 or value.dtype == torch.float32, key  # kept as it was made


def test_state_the_wrapped_step_updates_keeps_its_dtype_when_the_params_narrow(device):
    """Params kitsune leaves to the wrapped optimizer's own step (a group with ``differentiable=True``) beside fused
    ones, after ``model.half()``: the re-plan the fused params' new storage brings leaves their float32 momentum as
    the wrapped step keeps it (it was rounded to float16, so the steps left the bare optimizer's), and the fused
    params join them there. The wrapped step's params equal the bare optimizer's bit for bit."""

    def make(fused, own):
        return torch.optim.SGD([{"params": fused}, {"params": own, "differentiable": True}], lr=1e-2, momentum=0.9)

    params = make_params([7, (3, 5), 6, (2, 4)], torch.float32, device)
    twins = [p.detach().clone().requires_grad_() for p in params]
    opt = KitsuneOptimizer(make(params[:2], params[2:]), enable_fusion=True)
    ref = make(twins[:2], twins[2:])
    for step in range(6):
        if step == 2:
            assert {b.route.value for b in opt.plan.buckets} == {"triton", "base_step"}
            for p in (*params, *twins):
                p.data = p.data.half()
        for p, t, g in zip(params, twins, random_grads(params, step), strict=True):
            p.grad, t.grad = g.to(p.dtype), g.to(t.dtype)
        opt.step()
        ref.step()
        for p, t in zip(params[2:], twins[2:], strict=True):
            assert torch.equal(p, t), step
    assert {b.route.value for b in opt.plan.buckets} == {"base_step"}
    assert all(opt.state[p]["momentum_buffer"].dtype == torch.float32 for p in params)


def test_a_narrowed_scalar_param_keeps_its_state_and_a_cast_back_fuses_again(device):
    """A 0-d param (a learned temperature) beside others, narrowed after SGD's state was made: its 0-d momentum is
    seen as its state (not as a step counter) and kept float32 on the wrapped step; ``model.float()`` afterwards,
    on part of the model only, plans again (the wrapped step's params are watched while they wait there) and every
    param is fused once more, its state converted. The narrowed steps equal torch's bit for bit."""
    params = [torch.nn.Parameter(torch.tensor(0.3, device=device))] + make_params([7, (3, 5), 6], torch.float32, device)
    twins = [p.detach().clone().requires_grad_() for p in params]

    def make(ps):
        return torch.optim.SGD(ps, lr=1e-2, momentum=0.9)

    opt, ref = KitsuneOptimizer(make(params), enable_fusion=True), make(twins)
    routes = []
    for step in range(9):
        if step == 0:
            ref.load_state_dict(opt.state_dict())
        if step == 3:  # the first two and the scalar narrowed; the last one stays float32 and fused
            for ps in (params, twins):
                for p in ps[:3]:
                    p.data = p.data.half()
            for p, t in zip(params, twins, strict=True):  # the twin starts from kitsune's values and state here
                t.data.copy_(p.data)
                ref.state[t] = {k: v.clone() for k, v in opt.state[p].items()}
        if step == 6:
            for ps in (params, twins):
                for p in ps[:3]:
                    p.data = p.data.float()
        for p, t, g in zip(params, twins, random_grads(params, step), strict=True):
            p.grad, t.grad = g.to(p.dtype), g.to(t.dtype)
        opt.step()
        ref.step()
        routes.append(sorted({(b.route.value, b.tensors) for b in opt.plan.buckets}))
        if 3 <= step < 6:
            for p, t in zip(params[:3], twins[:3], strict=True):
                assert torch.equal(p, t), step
            assert opt.state[params[0]]["momentum_buffer"].dtype == torch.float32
    assert routes[3:6] == [[("base_step", 3), ("triton", 1)]] * 3, routes
    assert routes[6:] == [[("triton", 4)]] * 3, routes
    for p, t in zip(params, twins, strict=True):
        assert opt.state[p]["momentum_buffer"].dtype == torch.float32
        torch.testing.assert_close(p, t, rtol=1e-5, atol=1e-6)


def test_adams_state_of_params_the_wrapped_step_updates_stays_as_torchs_step_keeps_it(device):
    """Params of Adam's family the wrapped step updates for another reason (a ``differentiable=True`` group) keep
    their float32 state through the re-plan a fused param's moved storage brings, after ``model.half()``: a step
    with float16 grads is refused before anything changes (torch's would raise halfway), and one with float32 grads
    runs (before, their state was cast to float16 at the re-plan, and their steps left torch's)."""
    params = make_params([7, (3, 5)], torch.float32, device)
    opt = KitsuneOptimizer(
        torch.optim.Adam([{"params": params[:1]}, {"params": params[1:], "differentiable": True}], lr=1e-2),
        enable_fusion=True,
    )
    for step in range(3):
        for p, g in zip(params, random_grads(params, step), strict=True):
            p.grad = g
        opt.step()
    params[1].data = params[1].data.half()  # the wrapped step's param only
    params[0].data = params[0].data.clone()  # a fused param's storage moves: the next step plans again
    grads = random_grads(params, 3)
    for p, g in zip(params, grads, strict=True):
        p.grad = None
        p.grad = g.to(p.dtype)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="'exp_avg' of a \\(3, 5\\) torch.float16 param is torch.float32.*Nothing"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert opt.state[params[1]]["exp_avg"].dtype == torch.float32
    set_grad(params[1], grads[1].float())
    opt.step()
    assert opt.state[params[1]]["exp_avg"].dtype == torch.float32
    assert not any(torch.equal(p, b) for p, b in zip(params, before, strict=True))


@pytest.mark.parametrize(("name", "route"), [("SGD", "torch_fused"), ("NAdam", "torch_foreach")])
def test_params_cast_back_from_float64_leave_torchs_route(name, route, device):
    """``model.double()`` then ``model.float()``: the params went to torch's fused or foreach path with their state
    cast up; the cast back plans again (a torch route's params are watched for a new dtype; before, every later step
    raised in torch's kernels). SGD, whose own step carries on with wider state, goes to the wrapped step with its
    float64 momentum as it is; NAdam, whose own step would raise halfway, refuses before anything changes."""
    make = {
        "SGD": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
        "NAdam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    }[name]
    params = make_params([7, (3, 5)], torch.float32, device)
    opt = KitsuneOptimizer(make(params), enable_fusion=True)
    routes = []
    for step in range(5):
        if step in (2, 4):
            for p in params:
                p.data = p.data.double() if step == 2 else p.data.float()
        for p, g in zip(params, random_grads(params, step), strict=True):
            p.grad = g.to(p.dtype)
        if step == 4 and name == "NAdam":
            assert_refused(opt, params, "is torch.float64: the param's dtype changed.*Nothing was updated")
            return
        opt.step()
        routes.append({b.route.value for b in opt.plan.buckets})
    assert routes == [{"triton"}] * 2 + [{route}] * 2 + [{"base_step"}], routes
    assert all(opt.state[p]["momentum_buffer"].dtype == torch.float64 for p in params)
    assert "float64 state of float32 params" in opt.plan.buckets[0].reason


@pytest.mark.parametrize("refusal", ["grad_dtype", "unscaled"])
def test_a_step_refused_after_a_cast_leaves_the_state_as_it_found_it(refusal, device):
    """``model.double()``, then a step that raises: a float32 grad on an Adam param (``p.grad_dtype``), or, under
    float16 AMP, grads from a loss that was not scaled. The re-plan the cast brings converts the state to float64;
    the step that raises puts it back (the same tensors, float32), so a refused step changes nothing. The next step,
    its grads right, converts it again and steps on torch's path."""
    amp = refusal == "unscaled"
    params = make_params([7, (3, 5)], torch.float32, device)
    opt = KitsuneOptimizer(torch.optim.Adam(params, lr=1e-2), enable_fusion=True, enable_amp=amp)
    for step in range(3):
        loss = sum((p * g).sum() for p, g in zip(params, random_grads(params, step), strict=True))
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    for p in params:
        p.data = p.data.double()
    grads = random_grads(params, 3)
    if amp:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.double()  # as loss.backward() leaves them: unscaled
    else:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.double()
        set_grad(params[0], grads[0].float())
    before = [p.detach().clone() for p in params]
    held = [dict(opt.state[p]) for p in params]
    with pytest.raises((ValueError, RuntimeError)):
        opt.step()
    for p, b, h in zip(params, before, held, strict=True):
        assert torch.equal(p, b)
        assert opt.state[p].keys() == h.keys() and all(opt.state[p][k] is v for k, v in h.items())
        assert opt.state[p]["exp_avg"].dtype == torch.float32
    opt.zero_grad()
    params[0].grad_dtype = None
    opt.backward(sum((p * g.double()).sum() for p, g in zip(params, grads, strict=True)))
    opt.step()
    assert {b.route.value for b in opt.plan.buckets} == {"torch_fused"}
    assert all(opt.state[p]["exp_avg"].dtype == torch.float64 for p in params)
    assert not any(torch.equal(p, b) for p, b in zip(params, before, strict=True))


def _in_backward(make, params):
    from kitsune import FusionConfig, KitsuneConfig, StreamConfig

    streams = StreamConfig(step_in_backward=True, bucket_bytes=700)  # a unit a param
    return KitsuneOptimizer(make(params), config=KitsuneConfig(fusion=FusionConfig(enabled=True), streams=streams))


def _backward_steps(opt, params, steps, dtype=None):
    for step in steps:
        grads = random_grads(params, step)
        opt.backward(sum((p * g.to(dtype or p.dtype)).sum() for p, g in zip(params, grads, strict=True)))
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("name", ["SGD", "Adam"])
def test_updates_inside_backward_then_a_narrowing_cast_step_every_param(name, device):
    """With updates inside backward the plan changes inside the step's prepare: ``model.half()`` after the state was
    made sends the params to the wrapped step (SGD's with its state as it is; Adam's with float32 grads), and that
    very step updates them (it updated nothing: the step still took the old plan's word that nothing was left to
    the wrapped step). A twin given kitsune's params and state at the cast follows them, bit for bit."""
    make = {"SGD": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9), "Adam": lambda ps: torch.optim.Adam(ps)}[name]
    params = make_params([7, (3, 5)], torch.float32, device)
    opt = _in_backward(make, params)
    _backward_steps(opt, params, range(3))
    for p in params:
        p.data = p.data.half()
    twins = [p.detach().clone().requires_grad_() for p in params]
    ref = make(twins)
    for t, p in zip(twins, params, strict=True):
        ref.state[t] = {k: v.clone() for k, v in opt.state[p].items()}
    grad_dtype = torch.float32 if name == "Adam" else torch.float16
    for step in range(3, 6):
        for p, t, g in zip(params, twins, random_grads(params, step), strict=True):
            for x in (p, t):
                set_grad(x, g.to(grad_dtype))
        before = [p.detach().clone() for p in params]
        opt.step()
        ref.step()
        for p, t, b in zip(params, twins, before, strict=True):
            assert torch.equal(p, t) and not torch.equal(p, b), step
    assert {b.route.value for b in opt.plan.buckets} == {"base_step"}


def test_updates_inside_backward_go_on_after_a_step_refused_in_a_replan(device):
    """With updates inside backward, a step refused after the re-plan in its prepare (``model.double()``, then a
    float32 grad on an Adam param) leaves the stream hooks on the new plan, so the next backward and step run (every
    later backward raised an IndexError from the old plan's hooks); the trajectory follows torch's."""
    params = make_params([7, (3, 5)], torch.float32, device)
    twins = [p.detach().clone().requires_grad_() for p in params]
    opt, ref = _in_backward(lambda ps: torch.optim.Adam(ps, lr=1e-2), params), torch.optim.Adam(twins, lr=1e-2)
    _backward_steps(opt, params, range(3))
    for step in range(3):
        for t, g in zip(twins, random_grads(twins, step), strict=True):
            t.grad = g
        ref.step()
    for x in (*params, *twins):
        x.data = x.data.double()
    for t in twins:
        ref.state[t] = {k: (v.double() if k != "step" else v) for k, v in ref.state[t].items()}
    grads = random_grads(params, 3)
    for p, g in zip(params, grads, strict=True):
        p.grad = g.double()
    set_grad(params[0], grads[0].float())
    assert_refused(opt, params, "Nothing was updated")
    opt.zero_grad()
    params[0].grad_dtype = None
    for step in range(3, 6):
        _backward_steps(opt, params, [step])
        for t, g in zip(twins, random_grads(twins, step), strict=True):
            t.grad = g.double()
        ref.step()
    for p, t in zip(params, twins, strict=True):
        torch.testing.assert_close(p, t, rtol=1e-7, atol=1e-8)


def test_a_closure_is_evaluated_before_the_narrowed_grads_are_checked(device):
    """Adam's params narrowed and on the wrapped step: ``step(closure)`` evaluates the closure before it checks the
    grads against the state's dtype (it checked the grads from before, and torch's step raised halfway on the
    closure's float16 grads, one param's step counted)."""
    params, opt = _fused_then_cast(lambda ps: torch.optim.Adam(ps, lr=1e-2), torch.float16, device)
    for p, g in zip(params, random_grads(params, 3), strict=True):
        set_grad(p, g.float())
    opt.step()  # float32 grads: the wrapped step takes them
    opt.zero_grad()
    for p in params:
        p.grad_dtype = None

    def closure():
        for p, g in zip(params, random_grads(params, 4), strict=True):
            p.grad = g.half()
        return torch.tensor(0.0)

    assert_refused(opt, params, "the grad is torch.float16.*Nothing was updated", closure)


def test_a_grad_of_another_dtype_on_torchs_foreach_route_is_refused_where_its_step_needs_one(device):
    """Centered RMSprop on torch's foreach path (fusion declined by ``min_fusion_benefit``) with a bf16 param whose
    grad is float32 (``p.grad_dtype``): torch's foreach step would lerp it into ``grad_avg`` and raise halfway, with
    ``square_avg`` and ``step`` already changed; kitsune refuses first, nothing changed."""
    from kitsune import FusionConfig

    params = make_params([7, (3, 5)], torch.bfloat16, device)
    opt = KitsuneOptimizer(
        torch.optim.RMSprop(params, lr=1e-3, momentum=0.5, centered=True),
        enable_fusion=True,
        fusion_config=FusionConfig(min_fusion_benefit=1e9),
    )
    for step in range(2):
        for p, g in zip(params, random_grads(params, step), strict=True):
            p.grad = g.to(p.dtype)
        opt.step()
    assert {b.route.value for b in opt.plan.buckets} == {"torch_foreach"}, opt.plan
    for p, g in zip(params, random_grads(params, 2), strict=True):
        p.grad = g.to(p.dtype)
    set_grad(params[1], params[1].grad.float())
    assert_refused(opt, params, "has a torch.float32 grad .*Nothing was updated")


@pytest.mark.parametrize("route", ["fused", "eager"])
@pytest.mark.parametrize("name", ["Lion", "LAMB"])
def test_a_narrowed_scalar_params_state_is_refused_before_anything_changes(name, route, device):
    """Only a 0-d param (a learned temperature) cast to float16 after its state was made: its 0-d ``exp_avg`` is a
    moment, not a step counter, so the step refuses before any param moves (the bare step refused only the
    moments of more than 0 dims, and raised halfway in the lerp, the params before it updated)."""
    from kitsune.optim import LAMB, Lion

    def make(ps):
        return Lion(ps, lr=1e-3, weight_decay=0.1) if name == "Lion" else LAMB(ps, lr=1e-2, weight_decay=0.1)

    params = make_params([7], torch.float32, device) + [torch.nn.Parameter(torch.tensor(0.3, device=device))]
    opt = KitsuneOptimizer(make(params), enable_fusion=True) if route == "fused" else make(params)
    for step in range(3):
        for p, g in zip(params, random_grads(params, step), strict=True):
            p.grad = g
        opt.step()
    params[1].data = params[1].data.half()
    for p, g in zip(params, random_grads(params, 3), strict=True):
        p.grad = g.to(p.dtype)
    assert_refused(opt, params, "'exp_avg' of a \\(\\) torch.float16 param is torch.float32")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["Adam", "AdamW", "NAdam", "RMSprop-centered"])
def test_params_cast_narrower_mid_run(name, dtype, device):
    """``model.half()`` / ``model.bfloat16()`` after some steps. Adam's family and centered RMSprop lerp the grad
    into their float32 state: torch's step takes the cast params only with float32 grads (``p.grad_dtype``) and
    raises halfway with grads in the params' dtype; rounding the state would lose it (float16 flushes small second
    moments to zero). So the params go to the wrapped step with their state as it is, a step with grads in their
    dtype refuses before anything changes, naming the fix, and with float32 grads the steps are torch's, bit for
    bit. (SGD's family: the test above.)"""
    make = {
        "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
        "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
        "NAdam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
        "RMSprop-centered": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, centered=True),
    }[name]
    params, opt = _fused_then_cast(make, dtype, device)
    grads = random_grads(params, 3)
    for p, g in zip(params, grads, strict=True):
        p.grad = g.to(dtype)
    assert_refused(opt, params, "param is torch.float32: the param's dtype changed.*p.grad_dtype.*Nothing")
    assert_steps_as_the_wrapped_step(
        opt, params, make, lambda step: grads if step == 3 else random_grads(params, step), range(3, 6)
    )


@pytest.mark.parametrize("route", ["fused", "eager"])
@pytest.mark.parametrize("name", ["Lion", "LAMB"])
def test_kitsune_optim_state_follows_the_params_dtype_as_adams_does(name, route, device):
    """kitsune.optim's Lion and LAMB lerp the grad into state made like the param, as AdamW does: after
    ``model.half()`` their state is refused before anything changes (the eager step used to raise torch's bare lerp
    error, the fused one rounded the state); ``model.float()`` after state made in float16 converts it (nothing is
    lost) and steps on. The fused route and the bare optimizer agree on both."""
    from kitsune.optim import LAMB, Lion

    def make(ps):
        return Lion(ps, lr=1e-3, weight_decay=0.1) if name == "Lion" else LAMB(ps, lr=1e-2, weight_decay=0.1)

    params = make_params([7, (3, 5)], torch.float32, device)
    opt = KitsuneOptimizer(make(params), enable_fusion=True) if route == "fused" else make(params)
    for step in range(3):
        for p, g in zip(params, random_grads(params, step), strict=True):
            p.grad = g
        opt.step()
    if route == "fused":
        assert {b.route.value for b in opt.plan.buckets} == {"triton"}
    for p in params:
        p.data = p.data.half()
    for p, g in zip(params, random_grads(params, 3), strict=True):
        p.grad = g.half()
    before = [p.detach().clone() for p in params]
    state = {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(params)}
    with pytest.raises(ValueError, match="'exp_avg' of a .* torch.float16 param is torch.float32.*Nothing was updated"):
        opt.step()
    for i, p in enumerate(params):
        assert torch.equal(p, before[i])
        for k, v in state[i].items():
            assert opt.state[p][k].dtype == v.dtype and torch.equal(opt.state[p][k], v), (i, k)
    # the way out the message names: reloading the state rounds it to the params' dtype, as torch's load does
    opt.load_state_dict(opt.state_dict())
    opt.step()
    assert all(opt.state[p]["exp_avg"].dtype == torch.float16 for p in params)
    assert not any(torch.equal(p, b) for p, b in zip(params, before, strict=True))

    # made in float16, then the params widened: the state follows, on either route
    half = make_params([7, (3, 5)], torch.float16, device)
    twins = [p.detach().clone().requires_grad_() for p in half]
    opt, ref = make(half), make(twins)  # ref: the same route, its state widened by hand
    if route == "fused":
        opt, ref = KitsuneOptimizer(opt, enable_fusion=True), KitsuneOptimizer(ref, enable_fusion=True)
    for step in range(6):
        if step == 2:
            for p, t in zip(half, twins, strict=True):
                p.data, t.data = p.data.float(), t.data.float()
            for s in ref.state.values():  # the reference's state widened by hand, before its step sees it
                s.update({k: v.float() for k, v in s.items() if v.dim()})
        for p, t, g in zip(half, twins, random_grads(half, 10 + step), strict=True):
            p.grad, t.grad = g.to(p.dtype), g.to(t.dtype)
        opt.step()
        ref.step()
    for p, t in zip(half, twins, strict=True):
        assert p.dtype == torch.float32 and all(v.dtype == torch.float32 for v in opt.state[p].values() if v.dim())
        torch.testing.assert_close(p, t, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
@pytest.mark.parametrize("name", ["Adam", "SGD"])
def test_a_param_reshaped_where_it_sits_is_refused_as_torch_refuses_it(name, native, device):
    """``p.data = p.data.view(...)`` keeps the storage and the size: only the shape tells. torch's step raises (its
    state keeps the old shape); the fused step refuses it before anything changes, and steps on as torch once the
    param has its shape back."""
    import copy

    def make(ps):
        return torch.optim.Adam(ps, lr=0.05) if name == "Adam" else torch.optim.SGD(ps, lr=0.05, momentum=0.9)

    params = make_params([(4, 6), 5], torch.float32, device)
    twins = [p.detach().clone().requires_grad_() for p in params]
    opt = KitsuneOptimizer(make(params), enable_fusion=True, fusion_config=FusionConfig(native_checks=native))
    ref = make(twins)
    for step in range(6):
        for p, t, g in zip(params, twins, random_grads(params, step), strict=True):
            p.grad, t.grad = g.clone(), g.clone()
        if step == 3:
            torch_copy = copy.deepcopy(ref)  # torch's own step raises too (on a copy: it may change state first)
            p0 = torch_copy.param_groups[0]["params"][0]
            p0.data, p0.grad = p0.data.view(6, 4), p0.grad.view(6, 4)
            with pytest.raises(RuntimeError, match="size"):
                torch_copy.step()
            p = params[0]
            p.data, p.grad = p.data.view(6, 4), p.grad.view(6, 4)
            before = [q.detach().clone() for q in params]
            state = {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
            with pytest.raises(ValueError, match=r"has shape \(4, 6\), its param \(6, 4\)"):
                opt.step()
            assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))
            assert all(torch.equal(opt.state[p][k], v) for k, v in state.items())
            p.data, p.grad = p.data.view(4, 6), p.grad.view(4, 6)
        opt.step()
        ref.step()
        assert {b.route.value for b in opt.plan.buckets} == {"triton"}
    for p, t in zip(params, twins, strict=True):
        torch.testing.assert_close(p, t, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("name", "options", "key"),
    [
        ("LAMB", {"bias_correction": False}, "bias_correction"),
        ("LAMB", {"max_trust_ratio": 0.5}, "max_trust_ratio"),
        ("LAMB", {}, "layer_adaptation"),
        ("LARS", {"momentum": 0.9, "nesterov": True}, "nesterov"),
        ("LARS", {}, "layer_adaptation"),
    ],
)
def test_a_kitsune_optim_group_key_deleted_raises_as_the_eager_step_before_anything_changes(name, options, key, device):
    """LAMB's and LARS's own steps read these keys from the group (a KeyError when one is gone); the fused step read
    them with defaults and went on, with bias correction back on. Now it raises the same KeyError, changing
    nothing."""
    import kitsune.optim

    params = make_params([(4, 6), 5], torch.float32, device)
    opt = KitsuneOptimizer(getattr(kitsune.optim, name)(params, lr=0.01, **options), enable_fusion=True)
    for step in range(2):
        for p, g in zip(params, random_grads(params, step), strict=True):
            p.grad = g
        if step == 1:
            del opt.param_groups[0][key]
            before = [p.detach().clone() for p in params]
            with pytest.raises(KeyError, match=key):
                opt.step()
            assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
        else:
            opt.step()
            assert {b.route.value for b in opt.plan.buckets} == {"triton"}


def test_params_over_overlapping_memory_take_the_optimizers_own_step(device):
    """Two Parameters over overlapping memory (made from views of one tensor): one fused launch would update both at
    once, a race on a GPU, so both take the wrapped optimizer's own step, the plan saying why; a param beside them,
    and disjoint views of one tensor, stay fused. 10 steps equal torch's for-loop (``foreach=False``, which updates
    them one after the other: torch's foreach and fused kernels race on the shared elements on a GPU as well, so a
    reference through them differs run to run)."""

    def params():
        base = torch.arange(12, dtype=torch.float32, device=device) / 7 - 0.5
        halves = torch.linspace(-1, 1, 8, device=device)
        return [
            torch.nn.Parameter(base[:8]),
            torch.nn.Parameter(base[4:]),  # overlaps the first
            torch.nn.Parameter(halves[:4]),
            torch.nn.Parameter(halves[4:]),  # disjoint from the one before
            torch.nn.Parameter(torch.randn(5, generator=torch.Generator().manual_seed(0)).to(device)),
        ]

    ours, ref = params(), params()
    opt = KitsuneOptimizer(torch.optim.SGD(ours, lr=0.1, momentum=0.9, foreach=False), enable_fusion=True)
    ref_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9, foreach=False)
    assert opt.plan.fused_tensors == 3
    own = [b for b in opt.plan.buckets if not b.route.fused]
    assert len(own) == 1 and "overlaps another param's" in own[0].reason
    for step in range(10):
        for params_, o in ((ours, opt), (ref, ref_opt)):
            for p, g in zip(params_, random_grads(params_, step), strict=True):
                p.grad = g
            o.step()
    for p, q in zip(ours, ref, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["LAMB", "LARS"])
def test_trust_ratio_optimizers_leave_unreadable_grads_to_their_own_step(name, device):
    """Without clipping or float16 scaling, a grad the fused kernels cannot read goes to the optimizer's own step,
    so the error (or the update) is the one without kitsune. LAMB and LARS always launch the norm pass (their
    trust ratios), which made kitsune refuse such a grad with a message about clipping and loss scaling neither run
    used: a sparse grad got it instead of "<name> does not support sparse gradients", and LARS refused a float64
    grad its own step takes (as torch's SGD does)."""
    from kitsune.optim import LAMB, LARS

    def make(ps):
        return LAMB(ps, lr=1e-2, weight_decay=0.1) if name == "LAMB" else LARS(ps, lr=0.5, trust_coefficient=0.02)

    params = make_params([(4, 5), (6, 3)], torch.float32, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ref = KitsuneOptimizer(make(params), enable_fusion=True), make(twins)

    def grads(step, sparse=False, wide=False):
        for p, t, g in zip(params, twins, random_grads(params, step), strict=True):
            p.grad = t.grad = None
            if p is params[1] and sparse:
                g = g.to_sparse()
            if p is params[1]:
                p.grad_dtype = t.grad_dtype = torch.float64 if wide else None
                g = g.double() if wide else g
            p.grad, t.grad = g, g.clone()

    for step in range(2):
        grads(step)
        opt.step()
        ref.step()
    assert routes(opt) == {"triton"}
    grads(2, sparse=True)
    before = [p.detach().clone() for p in params]
    for o in (opt, ref):  # the same error with the wrapper and without
        with pytest.raises(RuntimeError, match=f"^{name} does not support sparse gradients$"):
            o.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    grads(3, wide=True)
    if name == "LAMB":  # its own step needs the param's dtype: its own refusal
        with pytest.raises(ValueError, match="which LAMB's step cannot take"):
            opt.step()
        return
    opt.step()
    ref.step()
    for p, t in zip(params, twins, strict=True):
        torch.testing.assert_close(p, t, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "in-backward"])
@pytest.mark.parametrize("all_lazy", [True, False], ids=["all-lazy", "one-lazy"])
def test_lazy_modules_are_planned_after_their_first_forward_and_train_as_torch(all_lazy, in_backward, device):
    """A lazy module's params are uninitialized until its first forward (torch's optimizer takes them so): the plan
    leaves them out, with no warning where nothing else is there to fuse, and the step after the forward plans them
    in, matching torch from there."""

    def build() -> torch.nn.Module:
        last = torch.nn.LazyLinear(2) if all_lazy else torch.nn.Linear(4, 2)
        return torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.Tanh(), last).to(device)

    model, twin = build(), build()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        streams = StreamConfig(step_in_backward=in_backward, bucket_bytes=64)
        opt = KitsuneOptimizer(
            torch.optim.AdamW(model.parameters(), lr=0.01), enable_fusion=True, stream_config=streams
        )
    ref = torch.optim.AdamW(twin.parameters(), lr=0.01)
    assert opt.plan.fused_tensors == (0 if all_lazy else 2)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 5, generator=gen).to(device)
    model(x), twin(x)
    twin.load_state_dict(model.state_dict())
    for _ in range(4):
        step_twins(model, twin, opt, ref, torch.randn(3, 5, generator=gen).to(device))
    assert opt.plan.fused_tensors == 4
