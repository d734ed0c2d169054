"""kitsune.optim.Muon against torch.optim.Muon (use_muon groups) and torch.optim.AdamW (use_muon=False groups).

Tolerances: on the torch path (CPU tensors without TRITON_INTERPRET) the orthogonalisation is torch's own
function op for op and the rest is the same ops in the same order, so the params match torch's to the bit over 50
steps. The Triton path (CUDA, or the interpreter) rounds its bf16 products in another order: each step's update
differs by bf16 rounding (~1% of the update, relative Frobenius), the momentum buffers stay bitwise equal (the grads
are fresh random tensors that do not depend on the params), so the params drift apart by at most the sum of the
per-step differences: ``steps * adjusted lr * 2% * ||update||``, which we check per param in the Frobenius norm.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from kitsune.kernels.newton_schulz import POLAR_EXPRESS_COEFFICIENTS
from kitsune.optim import Muon
from kitsune.optim import muon as muon_module

if not hasattr(torch.optim, "Muon"):  # torch < 2.9
    pytest.skip("torch.optim.Muon needs torch >= 2.9", allow_module_level=True)

SHAPES = [(16, 24), (24, 16), (16, 24), (32, 32)]  # wide, tall, wide again (batched with the first), square


def _params(shapes, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(device) for s in shapes]


def _twins(shapes, device):
    """Two lists of equal params, for kitsune and for torch."""
    values = _params(shapes, device)
    return [[torch.nn.Parameter(v.clone()) for v in values] for _ in range(2)]


def _set_grads(lists, step, device):
    gen = torch.Generator().manual_seed(1000 + step)
    grads = [torch.randn(p.shape, generator=gen).to(device) for p in lists[0]]
    for params in lists:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()


def _triton_path(device) -> bool:
    return muon_module._use_triton(device)


def _drift_bound(steps, lr, shape, adjust_lr_fn):
    """Frobenius bound on the param difference after ``steps`` Triton-path steps (module docstring)."""
    update_norm = math.sqrt(min(shape))  # an orthogonalised update has singular values ~1
    return steps * muon_module.adjust_lr(lr, adjust_lr_fn, shape) * 0.02 * update_norm


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
def test_matches_torch_muon_over_50_steps(adjust_lr_fn, nesterov, device):
    ours, theirs = _twins(SHAPES, device)
    kw = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": nesterov, "adjust_lr_fn": adjust_lr_fn}
    opt_ours, opt_theirs = Muon(ours, **kw), torch.optim.Muon(theirs, **kw)
    for step in range(50):
        _set_grads([ours, theirs], step, device)
        opt_ours.step()
        opt_theirs.step()
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(opt_ours.state[p]["momentum_buffer"], opt_theirs.state[q]["momentum_buffer"])
        if _triton_path(p.device):
            assert (p - q).norm().item() < _drift_bound(50, 0.02, p.shape, adjust_lr_fn)
        else:
            assert torch.equal(p, q)


def test_triton_path_in_the_interpreter_batches_same_shapes(device, monkeypatch):
    """CPU + TRITON_INTERPRET=1 runs the Triton kernels (as CUDA does), one call per shape, within the drift bound."""
    if device.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    real = muon_module._ns.newton_schulz
    monkeypatch.setattr(muon_module._ns, "newton_schulz", lambda x, *a, **k: calls.append(x.shape) or real(x, *a, **k))
    ours, theirs = _twins(SHAPES, device)
    kw = {"lr": 0.02, "weight_decay": 0.1}
    opt_ours, opt_theirs = Muon(ours, **kw), torch.optim.Muon(theirs, **kw)
    for step in range(3):
        _set_grads([ours, theirs], step, device)
        opt_ours.step()
        opt_theirs.step()
    assert sorted(calls) == sorted([(2, 16, 24), (1, 24, 16), (1, 32, 32)] * 3)
    for p, q in zip(ours, theirs, strict=True):
        assert 0 < (p - q).norm().item() < _drift_bound(3, 0.02, p.shape, None)


def test_adamw_groups_match_torch_adamw_exactly(device):
    """use_muon=False groups: torch's functional AdamW, so the very same bits, with AdamW's defaults filled in."""
    shapes = [(10,), (7, 5), (3, 4, 2)]
    ours, theirs = _twins(shapes, device)
    groups = [{"params": ours[:2], "betas": (0.9, 0.95)}, {"params": ours[2:], "lr": 3e-3}]
    opt_ours = Muon([dict(g, use_muon=False) for g in groups], lr=0.02)
    opt_theirs = torch.optim.AdamW([{"params": theirs[:2], "betas": (0.9, 0.95)}, {"params": theirs[2:], "lr": 3e-3}])
    group = opt_ours.param_groups[0]
    assert (group["lr"], group["eps"], group["weight_decay"]) == (1e-3, 1e-8, 1e-2)  # AdamW's, not Muon's
    for step in range(20):
        _set_grads([ours, theirs], step, device)
        opt_ours.step()
        opt_theirs.step()
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
        assert set(opt_ours.state[p]) == {"step", "exp_avg", "exp_avg_sq"}
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt_ours.state[p][key], opt_theirs.state[q][key])


def test_mixed_groups_skip_params_without_grads(device):
    """A model's usual split; params whose grad is None keep their values and get no state."""
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(device)
    matrices = [model[0].weight, model[2].weight]
    others = [model[0].bias, model[2].bias]
    opt = Muon([{"params": matrices}, {"params": others, "use_muon": False}], lr=0.02)
    model(torch.randn(8, 12, device=device)).sum().backward()
    model[2].weight.grad = None
    model[2].bias.grad = None
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    after = list(model.parameters())
    assert not torch.equal(before[0], after[0]) and not torch.equal(before[1], after[1])
    assert torch.equal(before[2], after[2]) and torch.equal(before[3], after[3])
    assert list(opt.state[model[0].weight]) == ["momentum_buffer"]
    assert model[2].weight not in opt.state and model[2].bias not in opt.state


def test_conv_weights_are_flattened(device):
    """A 4-D conv weight steps as torch.optim.Muon steps its (out, in * kh * kw) matrix, LR adjusted for that."""
    conv = torch.nn.Parameter(_params([(8, 3, 3, 3)], device)[0])
    flat = torch.nn.Parameter(conv.detach().reshape(8, 27).clone())
    opt_ours, opt_theirs = Muon([conv], lr=0.02), torch.optim.Muon([flat], lr=0.02)
    for step in range(5):
        g = _params([(8, 3, 3, 3)], device, seed=step)[0]
        conv.grad, flat.grad = g.clone(), g.reshape(8, 27).clone()
        opt_ours.step()
        opt_theirs.step()
    assert opt_ours.state[conv]["momentum_buffer"].shape == (8, 3, 3, 3)
    if _triton_path(conv.device):
        assert (conv.reshape(8, 27) - flat).norm().item() < _drift_bound(5, 0.02, (8, 27), None)
    else:
        assert torch.equal(conv.reshape(8, 27), flat)


def test_state_dict_round_trip_with_torch(device):
    """Checkpoints move both ways: kitsune -> torch.optim.Muon and kitsune -> kitsune continue identically."""
    ours, theirs = _twins(SHAPES[:2], device)
    opt = Muon(ours, lr=0.02)
    for step in range(3):
        _set_grads([ours, theirs], step, device)
        opt.step()
    with torch.no_grad():
        for p, q in zip(ours, theirs, strict=True):
            q.copy_(p)
    saved = copy.deepcopy(opt.state_dict())  # a checkpoint: its own tensors
    torch_opt = torch.optim.Muon(theirs, lr=0.02)
    torch_opt.load_state_dict(copy.deepcopy(saved))
    again = Muon([torch.nn.Parameter(p.detach().clone()) for p in ours], lr=0.02)
    again.load_state_dict(saved)
    twins = list(again.param_groups[0]["params"])
    for step in range(3, 6):
        _set_grads([ours, theirs, twins], step, device)
        opt.step()
        torch_opt.step()
        again.step()
    for p, q, r in zip(ours, theirs, twins, strict=True):
        assert torch.equal(p, r)
        if not _triton_path(p.device):
            assert torch.equal(p, q)
    back = Muon([torch.nn.Parameter(q.detach().clone()) for q in theirs], lr=0.02)
    back.load_state_dict(copy.deepcopy(torch_opt.state_dict()))  # torch's groups lack use_muon: the default holds
    assert back.param_groups[0]["use_muon"] and "momentum_buffer" in back.state[back.param_groups[0]["params"][0]]


def test_a_checkpoint_of_torchs_muon_loads_and_steps(device):
    """torch.optim.Muon's own groups have no ``use_muon`` or ``betas``: loaded into kitsune's Muon they are Muon
    groups with its defaults for those, and the run goes on as torch's."""
    ours, theirs = _twins(SHAPES[:2], device)
    torch_opt = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1)
    for step in range(3):
        _set_grads([theirs], step, device)
        torch_opt.step()
    saved = copy.deepcopy(torch_opt.state_dict())
    assert "use_muon" not in saved["param_groups"][0]
    with torch.no_grad():
        for p, q in zip(ours, theirs, strict=True):
            p.copy_(q)
    opt = Muon(ours, lr=0.02)
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["use_muon"] and opt.param_groups[0]["weight_decay"] == 0.1
    for step in range(3, 6):
        _set_grads([ours, theirs], step, device)
        opt.step()
        torch_opt.step()
    for p, q in zip(ours, theirs, strict=True):
        if _triton_path(p.device):
            torch.testing.assert_close(p, q, rtol=1e-2, atol=1e-3)  # bf16 Newton-Schulz on the GPU
        else:
            assert torch.equal(p, q)


def test_coefficient_schedules(device):
    """A per-iteration schedule of one triple is that triple; Polar Express runs and gives another update."""
    results = []
    for coefficients in [(3.4445, -4.7750, 2.0315), [(3.4445, -4.7750, 2.0315)] * 5, POLAR_EXPRESS_COEFFICIENTS]:
        (p,) = [torch.nn.Parameter(v) for v in _params([(16, 24)], device)]
        p.grad = _params([(16, 24)], device, seed=1)[0]
        Muon([p], lr=0.02, ns_coefficients=coefficients).step()
        results.append(p.detach())
    assert torch.equal(results[0], results[1]) and not torch.equal(results[0], results[2])


def test_validation_names_the_parameter():
    bias = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match="parameter 1 of param group 0 has shape \\(4,\\)"):
        Muon([torch.nn.Parameter(torch.zeros(4, 4)), bias])
    with pytest.raises(ValueError, match="parameter 'head.bias' of param group 0"):
        Muon([("head.bias", bias)])
    with pytest.raises(ValueError, match="param group 1"):
        Muon([{"params": [torch.nn.Parameter(torch.zeros(4, 4))]}, {"params": [bias], "use_muon": True}])
    Muon([{"params": [bias], "use_muon": False}])  # AdamW takes any shape
    p = [torch.nn.Parameter(torch.zeros(4, 4))]
    for kwargs, match in [
        ({"lr": -1.0}, "learning rate"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"momentum": -0.5}, "momentum"),
        ({"adjust_lr_fn": "sqrt"}, "adjust_lr_fn"),
        ({"ns_steps": 100}, "ns_steps"),
        ({"ns_coefficients": (1.0, 2.0)}, "ns_coefficients"),
    ]:
        with pytest.raises(ValueError, match=match):
            Muon(p, **kwargs)
    with pytest.raises(ValueError, match="betas"):
        Muon([{"params": [bias], "use_muon": False, "betas": (1.0, 0.9)}])
    for betas in [(0.9,), None, 0.9]:  # read as a pair before the ranges: not Python's unpacking error
        with pytest.raises(ValueError, match=r"Invalid betas in param group 0: .* \(two numbers"):
            Muon([{"params": [bias], "use_muon": False, "betas": betas}])


# ---- GPU ----


@pytest.mark.cuda
def test_gpu_step_over_same_shape_matrices_matches_torch():
    """8 matrices of 2048^2 (the benchmark's set) plus a tall one: one batched Newton-Schulz per shape."""
    device = torch.device("cuda")
    shapes = [(2048, 2048)] * 8 + [(2048, 512)]
    ours, theirs = _twins(shapes, device)
    opt_ours, opt_theirs = Muon(ours, lr=0.02), torch.optim.Muon(theirs, lr=0.02)
    for step in range(10):
        _set_grads([ours, theirs], step, device)
        opt_ours.step()
        opt_theirs.step()
    for p, q in zip(ours, theirs, strict=True):
        assert (p - q).norm().item() < _drift_bound(10, 0.02, p.shape, None)


def test_flipping_use_muon_mid_run_starts_the_new_algorithm_fresh(device):
    """A group flipped from Muon to AdamW follows torch.optim.AdamW from fresh state, one flipped from AdamW to Muon
    follows a fresh Muon, and each keeps the state keys of the algorithm it left untouched."""
    gen = torch.Generator().manual_seed(3)
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 6)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    model.to(device)
    to_adamw = [model[0].weight, model[2].weight]
    to_muon = [model[4].weight]
    biases = [model[0].bias, model[2].bias, model[4].bias]
    opt = Muon(
        [{"params": to_adamw}, {"params": to_muon, "use_muon": False}, {"params": biases, "use_muon": False}],
        lr=0.02,
    )

    def backward():
        opt.zero_grad()
        model(torch.randn(8, 12, generator=gen).to(device)).square().mean().backward()

    for _ in range(3):
        backward()
        opt.step()
    left = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in to_adamw + to_muon}
    opt.param_groups[0]["use_muon"] = False
    opt.param_groups[1]["use_muon"] = True
    adamw_twins = [torch.nn.Parameter(p.detach().clone()) for p in to_adamw]
    muon_twins = [torch.nn.Parameter(p.detach().clone()) for p in to_muon]
    group = opt.param_groups[0]
    torch_adamw = torch.optim.AdamW(
        adamw_twins, lr=group["lr"], betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"]
    )
    fresh_muon = Muon([{**opt.param_groups[1], "params": muon_twins}])
    for _ in range(4):
        backward()
        for p, twin in zip(to_adamw + to_muon, adamw_twins + muon_twins, strict=True):
            twin.grad = p.grad.clone()
        opt.step()
        torch_adamw.step()
        fresh_muon.step()
        for p, twin in zip(to_adamw + to_muon, adamw_twins + muon_twins, strict=True):
            torch.testing.assert_close(p.detach(), twin.detach())
    for p, twin in zip(to_adamw, adamw_twins, strict=True):
        assert list(opt.state[p]) == ["momentum_buffer", "step", "exp_avg", "exp_avg_sq"]
        assert torch.equal(opt.state[p]["momentum_buffer"], left[p]["momentum_buffer"])
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][key], torch_adamw.state[twin][key])
    for p, twin in zip(to_muon, muon_twins, strict=True):
        assert list(opt.state[p]) == ["step", "exp_avg", "exp_avg_sq", "momentum_buffer"]
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], left[p][key])
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], fresh_muon.state[twin]["momentum_buffer"])


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="this torch has no torch.optim.Muon")
def test_an_empty_matrix_steps_as_torchs_muon_on_torchs_iteration(monkeypatch):
    """A (0, 5) matrix (a layer with no rows, e.g. a vocabulary cut to nothing) through torch's Newton-Schulz
    iteration (no Triton kernel for it): ``reshape(len(u), -1)`` cannot infer the columns of 0 elements and raised,
    where torch.optim.Muon steps it (nothing to move)."""
    monkeypatch.setattr(muon_module, "_use_triton", lambda device: False)
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((0, 5), (4, 5))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ref = Muon(params, lr=0.02), torch.optim.Muon(twins, lr=0.02)
    for _ in range(3):
        for p, t in zip(params, twins, strict=True):
            p.grad = torch.randn(p.shape, generator=gen)
            t.grad = p.grad.clone()
        opt.step()
        ref.step()
    for p, t in zip(params, twins, strict=True):
        torch.testing.assert_close(p, t, rtol=1e-6, atol=1e-6)
