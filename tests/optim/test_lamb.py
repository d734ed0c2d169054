"""LAMB's eager reference against a float64 hand computation of You et al. 2019, Algorithm 2."""

from __future__ import annotations

import io

import pytest
import torch

from kitsune.optim import LAMB

SHAPES = ((7,), (4, 5), (3,))
SCALES = (5.0, 1.0, 0.3)  # ||p|| / ||u|| is about the scale early on, so max_trust_ratio=2 clamps some tensors only
STEPS = 20
DEFAULTS = {
    "lr": 0.01,
    "betas": (0.9, 0.999),
    "eps": 1e-6,
    "weight_decay": 0.0,
    "bias_correction": True,
    "max_trust_ratio": None,
    "layer_adaptation": True,
    "maximize": False,
}


def make_data(seed: int, dtype: torch.dtype = torch.float64) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Initial params and STEPS fresh random grads per param, rounded to ``dtype`` and held in float64."""
    gen = torch.Generator().manual_seed(seed)
    p0 = [s * torch.randn(shape, dtype=torch.float64, generator=gen) for shape, s in zip(SHAPES, SCALES, strict=True)]
    grads = [[torch.randn(shape, dtype=torch.float64, generator=gen) for _ in range(STEPS)] for shape in SHAPES]
    return [p.to(dtype).double() for p in p0], [[g.to(dtype).double() for g in gs] for gs in grads]


def lamb_reference(
    p0, grads, lr, betas, eps, weight_decay, bias_correction, max_trust_ratio, layer_adaptation, maximize
):
    """One tensor in float64: (param, exp_avg, exp_avg_sq, how many steps the trust ratio was clamped)."""
    b1, b2 = betas
    p, m, v, clamped = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0), 0
    for t, grad in enumerate(grads, start=1):
        g = -grad if maximize else grad
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        bc1, bc2 = (1 - b1**t, 1 - b2**t) if bias_correction else (1.0, 1.0)
        u = (m / bc1) / (torch.sqrt(v / bc2) + eps) + weight_decay * p
        trust = 1.0
        if layer_adaptation:
            w_norm, u_norm = p.norm().item(), u.norm().item()
            trust = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
            if max_trust_ratio is not None and trust > max_trust_ratio:
                trust, clamped = max_trust_ratio, clamped + 1
        p = p - lr * trust * u
    return p, m, v, clamped


def run(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer, grads, steps: range) -> None:
    for t in steps:
        for p, gs in zip(params, grads, strict=True):
            p.grad = gs[t].to(p.dtype)
        opt.step()


OPTIONS = {
    "defaults": {},
    "no_bias_correction_wd": {"bias_correction": False, "weight_decay": 0.01},
    "clamped_wd": {"weight_decay": 0.1, "max_trust_ratio": 2.0, "eps": 1e-3},
    "maximize_clamped_no_bc": {"maximize": True, "max_trust_ratio": 2.0, "bias_correction": False},
    "no_layer_adaptation": {"layer_adaptation": False, "weight_decay": 0.05, "betas": (0.8, 0.99)},
}


@pytest.mark.parametrize("name", OPTIONS)
def test_matches_float64_hand_computation(name):
    kwargs = {**DEFAULTS, **OPTIONS[name]}
    p0, grads = make_data(seed=1)
    params = [torch.nn.Parameter(p.clone()) for p in p0]
    opt = LAMB(params, **kwargs)
    run(params, opt, grads, range(STEPS))
    clamped = 0
    for p, start, gs in zip(params, p0, grads, strict=True):
        want_p, want_m, want_v, n = lamb_reference(start, gs, **kwargs)
        clamped += n
        torch.testing.assert_close(p.detach(), want_p, atol=1e-13, rtol=1e-13)
        torch.testing.assert_close(opt.state[p]["exp_avg"], want_m, atol=1e-14, rtol=1e-14)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], want_v, atol=1e-14, rtol=1e-14)
        step = opt.state[p]["step"]
        assert step.shape == () and step.dtype == torch.float32 and step.item() == STEPS
    if kwargs["max_trust_ratio"] is not None:  # the clamp must be exercised, but not on every step
        assert 0 < clamped < STEPS * len(params)


def test_without_layer_adaptation_is_adamw():
    p0, grads = make_data(seed=2)
    a = [torch.nn.Parameter(p.clone()) for p in p0]
    b = [torch.nn.Parameter(p.clone()) for p in p0]
    lamb = LAMB(a, lr=0.01, eps=1e-6, weight_decay=0.1, layer_adaptation=False)
    adamw = torch.optim.AdamW(b, lr=0.01, eps=1e-6, weight_decay=0.1, foreach=False)
    run(a, lamb, grads, range(STEPS))
    run(b, adamw, grads, range(STEPS))
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-12)  # eps inside vs outside the bias correction


def test_param_groups_skips_and_zero_param():
    p0, grads = make_data(seed=3)
    adapted, plain, no_grad = (torch.nn.Parameter(p.clone()) for p in p0)
    opt = LAMB(
        [{"params": [adapted, no_grad], "weight_decay": 0.01}, {"params": [plain], "layer_adaptation": False}],
        lr=0.01,
    )
    for t in range(STEPS):
        adapted.grad, plain.grad = grads[0][t].clone(), grads[1][t].clone()
        opt.step()
    want_adapted = lamb_reference(p0[0], grads[0], **{**DEFAULTS, "weight_decay": 0.01})[0]
    want_plain = lamb_reference(p0[1], grads[1], **{**DEFAULTS, "layer_adaptation": False})[0]
    torch.testing.assert_close(adapted.detach(), want_adapted, atol=1e-13, rtol=1e-13)
    torch.testing.assert_close(plain.detach(), want_plain, atol=1e-13, rtol=1e-13)
    assert no_grad not in opt.state and torch.equal(no_grad.detach(), p0[2])  # grad None: no state, no update
    assert list(opt.state[adapted]) == ["step", "exp_avg", "exp_avg_sq"]

    # ||p|| = 0: trust is 1, the param takes the plain Adam step and its state advances
    zero = torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))
    g = grads[0][0][:5]
    opt = LAMB([zero], lr=0.01, weight_decay=0.1)
    zero.grad = g.clone()
    opt.step()
    m, v = (1 - 0.9) * g, (1 - 0.999) * g * g
    torch.testing.assert_close(zero.detach(), -0.01 * (m / (1 - 0.9)) / (torch.sqrt(v / (1 - 0.999)) + 1e-6))
    assert opt.state[zero]["step"].item() == 1
    torch.testing.assert_close(opt.state[zero]["exp_avg"], m, atol=1e-15, rtol=1e-15)


def test_state_dict_round_trip():
    p0, grads = make_data(seed=4)
    kwargs = {"lr": 0.01, "weight_decay": 0.01, "max_trust_ratio": 2.0}
    straight = [torch.nn.Parameter(p.clone()) for p in p0]
    opt = LAMB(straight, **kwargs)
    run(straight, opt, grads, range(STEPS))

    first = [torch.nn.Parameter(p.clone()) for p in p0]
    opt = LAMB(first, **kwargs)
    run(first, opt, grads, range(STEPS // 2))
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt = LAMB(resumed, lr=1.0)  # the loaded param groups bring back the hyperparameters
    opt.load_state_dict(torch.load(buffer))
    assert opt.param_groups[0]["max_trust_ratio"] == 2.0
    run(resumed, opt, grads, range(STEPS // 2, STEPS))
    for p, q in zip(straight, resumed, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-6), (torch.bfloat16, 0.04)])
def test_low_precision_params_track_float64_reference(dtype, tol):
    kwargs = {**DEFAULTS, "lr": 0.05, "weight_decay": 0.01}
    p0, grads = make_data(seed=5, dtype=dtype)
    params = [torch.nn.Parameter(p.to(dtype)) for p in p0]
    opt = LAMB(params, **kwargs)
    run(params, opt, grads, range(STEPS))
    for p, start, gs in zip(params, p0, grads, strict=True):
        assert p.dtype == opt.state[p]["exp_avg"].dtype == dtype and p.isfinite().all()
        want = lamb_reference(start, gs, **kwargs)[0]
        # every op rounds to the param's dtype (the norms sum in float32): for bf16 about 5 ulps of the
        # largest element, still a fraction of the distance the reference travels
        atol = tol * start.abs().max().item()
        torch.testing.assert_close(p.double(), want, atol=atol, rtol=0.0)
        assert (want - start).abs().max() > 4 * atol


def test_closure_tensor_lr_and_sparse_grads():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    q = torch.nn.Parameter(p.detach().clone())
    opt_p, opt_q = LAMB([p], lr=torch.tensor(0.01)), LAMB([q], lr=0.01)

    def closure():
        opt_p.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    assert opt_p.step(closure).item() == 14.0
    q.grad = 2 * q.detach()
    opt_q.step()
    assert torch.equal(p, q) and not torch.equal(p.detach(), torch.tensor([1.0, -2.0, 3.0]))
    p.grad = torch.sparse_coo_tensor([[0]], [1.0], (3,), check_invariants=True)
    with pytest.raises(RuntimeError, match="sparse"):
        opt_p.step()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1.0}, "learning rate"),
        ({"lr": torch.tensor([0.1, 0.2])}, "a tensor lr must have one element"),
        ({"betas": (1.0, 0.999)}, "beta parameter at index 0"),
        ({"betas": (0.9, -0.1)}, "beta parameter at index 1"),
        ({"eps": -1e-6}, "epsilon"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"max_trust_ratio": 0.0}, "max_trust_ratio"),
    ],
)
def test_rejects_invalid_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LAMB([torch.nn.Parameter(torch.ones(1))], **kwargs)
