"""LARS's eager reference: a float64 hand computation of You et al. 2017, and torch SGD when adaptation is off."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from kitsune.optim import LARS

SHAPES = ((7,), (4, 5), (3,))
STEPS = 20
DEFAULTS = {
    "lr": 1.0,
    "momentum": 0.9,
    "dampening": 0.0,
    "weight_decay": 0.0,
    "nesterov": False,
    "trust_coefficient": 0.02,
    "eps": 1e-8,
    "layer_adaptation": True,
    "maximize": False,
}
"""lr and trust_coefficient are large enough that every tensor moves by a few percent of its norm per step."""


def make_data(seed: int, dtype: torch.dtype = torch.float64) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Initial params and STEPS fresh random grads per param, rounded to ``dtype`` and held in float64."""
    gen = torch.Generator().manual_seed(seed)
    p0 = [torch.randn(shape, dtype=torch.float64, generator=gen) for shape in SHAPES]
    grads = [[torch.randn(shape, dtype=torch.float64, generator=gen) for _ in range(STEPS)] for shape in SHAPES]
    return [p.to(dtype).double() for p in p0], [[g.to(dtype).double() for g in gs] for gs in grads]


def lars_reference(
    p0, grads, lr, momentum, dampening, weight_decay, nesterov, trust_coefficient, eps, layer_adaptation, maximize
):
    """One tensor in float64: (param, momentum buffer or None)."""
    p, buf = p0.clone(), None
    for grad in grads:
        g = -grad if maximize else grad
        trust = 1.0
        if layer_adaptation:
            w_norm, g_norm = p.norm().item(), g.norm().item()
            if w_norm > 0 and g_norm > 0:
                trust = trust_coefficient * w_norm / (g_norm + weight_decay * w_norm + eps)
        d = (g + weight_decay * p) * trust
        if momentum != 0:
            buf = d.clone() if buf is None else momentum * buf + (1 - dampening) * d
            d = d + momentum * buf if nesterov else buf
        p = p - lr * d
    return p, buf


def run(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer, grads, steps: range) -> None:
    for t in steps:
        for p, gs in zip(params, grads, strict=True):
            p.grad = gs[t].to(p.dtype)
        opt.step()


OPTIONS = {
    "no_momentum_wd": {"momentum": 0.0, "weight_decay": 0.1},
    "momentum_dampening_wd": {"dampening": 0.3, "weight_decay": 0.05},
    "nesterov_wd_eps": {"nesterov": True, "weight_decay": 0.1, "eps": 0.5},
    "maximize_nesterov": {"maximize": True, "nesterov": True, "momentum": 0.5},
    "no_layer_adaptation": {"layer_adaptation": False, "lr": 0.01, "weight_decay": 0.1},
}


@pytest.mark.parametrize("name", OPTIONS)
def test_matches_float64_hand_computation(name):
    kwargs = {**DEFAULTS, **OPTIONS[name]}
    p0, grads = make_data(seed=1)
    params = [torch.nn.Parameter(p.clone()) for p in p0]
    opt = LARS(params, **kwargs)
    run(params, opt, grads, range(STEPS))
    for p, start, gs in zip(params, p0, grads, strict=True):
        want_p, want_buf = lars_reference(start, gs, **kwargs)
        torch.testing.assert_close(p.detach(), want_p, atol=1e-13, rtol=1e-13)
        if kwargs["momentum"] == 0:
            assert p not in opt.state
        else:
            assert list(opt.state[p]) == ["momentum_buffer"]  # torch SGD's layout, nothing else
            torch.testing.assert_close(opt.state[p]["momentum_buffer"], want_buf, atol=1e-13, rtol=1e-13)


SGD_OPTIONS = [
    {"momentum": 0.0},
    {"momentum": 0.0, "weight_decay": 0.01, "maximize": True},
    {"momentum": 0.9, "dampening": 0.1, "weight_decay": 1e-3},
    {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-2, "maximize": True},
]


@pytest.mark.parametrize("kwargs", SGD_OPTIONS)
def test_without_layer_adaptation_is_torch_sgd_bit_for_bit(kwargs):
    p0, grads = make_data(seed=2, dtype=torch.float32)
    a = [torch.nn.Parameter(p.float()) for p in p0]
    b = [torch.nn.Parameter(p.float()) for p in p0]
    lars = LARS(a, lr=0.05, layer_adaptation=False, **{"momentum": 0.0, **kwargs})
    sgd = torch.optim.SGD(b, lr=0.05, foreach=False, **kwargs)
    run(a, lars, grads, range(STEPS // 2))
    run(b, sgd, grads, range(STEPS // 2))
    # the checkpoint has SGD's layout: continue the LARS run as a torch SGD run
    c = [torch.nn.Parameter(p.detach().clone()) for p in a]
    resumed = torch.optim.SGD(c, lr=1.0, foreach=False)
    resumed.load_state_dict(copy.deepcopy(lars.state_dict()))  # load_state_dict would share the buffers
    run(a, lars, grads, range(STEPS // 2, STEPS))
    run(b, sgd, grads, range(STEPS // 2, STEPS))
    run(c, resumed, grads, range(STEPS // 2, STEPS))
    for x, y, z in zip(a, b, c, strict=True):
        assert torch.equal(x, y) and torch.equal(x, z)
        if kwargs["momentum"]:
            assert torch.equal(lars.state[x]["momentum_buffer"], sgd.state[y]["momentum_buffer"])
    assert not torch.equal(a[0].detach(), p0[0].float())


def test_param_groups_skips_and_zero_param():
    p0, grads = make_data(seed=3)
    adapted, plain, no_grad = (torch.nn.Parameter(p.clone()) for p in p0)
    opt = LARS(
        [{"params": [adapted, no_grad], "weight_decay": 0.1}, {"params": [plain], "layer_adaptation": False}],
        lr=1.0,
        trust_coefficient=0.02,
    )
    for t in range(STEPS):
        adapted.grad, plain.grad = grads[0][t].clone(), grads[1][t].clone()
        opt.step()
    want_adapted = lars_reference(p0[0], grads[0], **{**DEFAULTS, "weight_decay": 0.1})[0]
    want_plain = lars_reference(p0[1], grads[1], **{**DEFAULTS, "layer_adaptation": False})[0]
    torch.testing.assert_close(adapted.detach(), want_adapted, atol=1e-13, rtol=1e-13)
    torch.testing.assert_close(plain.detach(), want_plain, atol=1e-13, rtol=1e-13)
    assert no_grad not in opt.state and torch.equal(no_grad.detach(), p0[2])  # grad None: no state, no update

    # ||p|| = 0: trust is 1, the param takes the plain SGD step and its momentum buffer starts
    zero = torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))
    g = grads[0][0][:5]
    opt = LARS([zero], lr=0.1, weight_decay=0.1)
    zero.grad = g.clone()
    opt.step()
    torch.testing.assert_close(zero.detach(), -0.1 * g, atol=1e-15, rtol=1e-15)
    torch.testing.assert_close(opt.state[zero]["momentum_buffer"], g, atol=1e-15, rtol=1e-15)


def test_state_dict_round_trip():
    p0, grads = make_data(seed=4)
    kwargs = {**DEFAULTS, "weight_decay": 0.05, "nesterov": True}
    straight = [torch.nn.Parameter(p.clone()) for p in p0]
    opt = LARS(straight, **kwargs)
    run(straight, opt, grads, range(STEPS))

    first = [torch.nn.Parameter(p.clone()) for p in p0]
    opt = LARS(first, **kwargs)
    run(first, opt, grads, range(STEPS // 2))
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt = LARS(resumed, lr=0.1)  # the loaded param groups bring back the hyperparameters
    opt.load_state_dict(torch.load(buffer))
    assert opt.param_groups[0]["trust_coefficient"] == 0.02
    run(resumed, opt, grads, range(STEPS // 2, STEPS))
    for p, q in zip(straight, resumed, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-6), (torch.bfloat16, 0.04)])
def test_low_precision_params_track_float64_reference(dtype, tol):
    kwargs = {**DEFAULTS, "weight_decay": 0.01}
    p0, grads = make_data(seed=5, dtype=dtype)
    params = [torch.nn.Parameter(p.to(dtype)) for p in p0]
    opt = LARS(params, **kwargs)
    run(params, opt, grads, range(STEPS))
    for p, start, gs in zip(params, p0, grads, strict=True):
        assert p.dtype == opt.state[p]["momentum_buffer"].dtype == dtype and p.isfinite().all()
        want = lars_reference(start, gs, **kwargs)[0]
        # every op rounds to the param's dtype (the norms sum in float32): for bf16 about 5 ulps of the
        # largest element, still a fraction of the distance the reference travels
        atol = tol * start.abs().max().item()
        torch.testing.assert_close(p.double(), want, atol=atol, rtol=0.0)
        assert (want - start).abs().max() > 4 * atol


def test_closure_tensor_lr_and_sparse_grads():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    q = torch.nn.Parameter(p.detach().clone())
    opt_p, opt_q = LARS([p], lr=torch.tensor(0.5)), LARS([q], lr=0.5)

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
        ({"momentum": -0.1}, "momentum"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"nesterov": True, "momentum": 0.0}, "Nesterov"),
        ({"nesterov": True, "dampening": 0.1}, "Nesterov"),
        ({"trust_coefficient": 0.0}, "trust_coefficient"),
        ({"eps": -1e-8}, "epsilon"),
    ],
)
def test_rejects_invalid_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LARS([torch.nn.Parameter(torch.ones(1))], **kwargs)
