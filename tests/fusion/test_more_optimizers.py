"""NAdam, RAdam, Adamax, Adadelta, Rprop and ASGD through the fused kernel, against torch.optim's own step.

Each case runs 100 steps (50 with bf16 params) of fresh random grads in lockstep with torch's optimizer on copies of
the same params, with two param groups of different values (and switches), a param that misses its grad on some
steps, one whose first grad comes late (after the LR scheduler has changed lr), one that never gets a grad, and
StepLR halving lr every 30 steps. Params and every state tensor, the per-tensor scalars included, are compared along
the way.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from twins import assert_close_params, assert_same_state, make_params, random_grads, trajectory

from kitsune import KitsuneOptimizer
from kitsune.fusion import Route

SIZES = [(3, 5), 7, 1, 4]  # 2-D, odd, single-element; one block each (the interpreter's cost is per block)
STEPS = 100
BF16_STEPS = 50
"""bf16 params (torch's step on fp32 copies, rounded to bf16 after each, is the reference): the same kernel paths as
fp32's 100 steps but for the rounding, past StepLR's first cut and the late param's first grads (step 45)."""
CHECKS = (1, 2, 10, 45, 60)  # and the last step

Make = Callable[[Any], torch.optim.Optimizer]


def _groups(first: dict[str, Any], second: dict[str, Any]) -> Callable[[list], list[dict[str, Any]]]:
    return lambda ps: [{"params": ps[:2], **first}, {"params": ps[2:], **second}]


# name -> factory: every option of each optimizer, split over two groups (maximize makes a second kernel variant)
CASES: dict[str, Make] = {
    "nadam": lambda ps: torch.optim.NAdam(
        _groups({"weight_decay": 0.1, "momentum_decay": 1e-2}, {"maximize": True, "betas": (0.8, 0.99), "eps": 1e-6})(
            ps
        ),
        lr=1e-2,
    ),
    "nadam_decoupled": lambda ps: torch.optim.NAdam(
        _groups({"lr": 2e-2}, {"weight_decay": 0.0, "momentum_decay": 8e-3})(ps),
        lr=1e-2,
        weight_decay=0.1,
        decoupled_weight_decay=True,
    ),
    "radam": lambda ps: torch.optim.RAdam(
        _groups({"weight_decay": 0.1}, {"maximize": True, "betas": (0.85, 0.995), "eps": 1e-6})(ps), lr=1e-2
    ),
    "radam_decoupled": lambda ps: torch.optim.RAdam(
        _groups({"lr": 3e-3}, {"weight_decay": 0.0})(ps), lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True
    ),
    "adamax": lambda ps: torch.optim.Adamax(
        _groups({"weight_decay": 0.1}, {"maximize": True, "betas": (0.8, 0.99), "eps": 1e-4, "lr": 2e-3})(ps), lr=1e-2
    ),
    "adadelta": lambda ps: torch.optim.Adadelta(
        _groups({"rho": 0.8, "weight_decay": 0.1}, {"maximize": True, "lr": 0.5, "eps": 1e-5})(ps), lr=1.0
    ),
    "rprop": lambda ps: torch.optim.Rprop(
        _groups({"etas": (0.3, 1.5), "step_sizes": (1e-4, 0.05)}, {"maximize": True, "lr": 3e-3})(ps), lr=1e-2
    ),
    "asgd": lambda ps: torch.optim.ASGD(  # t0 small enough that the averaging (ax, mu) starts within the run
        _groups(
            {"t0": 10.0, "lambd": 1e-3, "alpha": 0.6, "weight_decay": 0.05},
            {"maximize": True, "t0": 30.0, "lr": 5e-3, "lambd": 1e-2},
        )(ps),
        lr=1e-2,
    ),
}

ONE_EACH: dict[str, tuple[type, dict[str, Any]]] = {  # each class with plain settings, for the other sweeps
    "nadam": (torch.optim.NAdam, {"lr": 1e-2}),
    "radam": (torch.optim.RAdam, {"lr": 1e-2}),
    "adamax": (torch.optim.Adamax, {"lr": 1e-2}),
    "adadelta": (torch.optim.Adadelta, {}),
    "rprop": (torch.optim.Rprop, {"lr": 1e-2}),
    "asgd": (torch.optim.ASGD, {"lr": 1e-2, "t0": 5.0}),
}


def one(name: str, params: Any, **kwargs: Any) -> torch.optim.Optimizer:
    cls, settings = ONE_EACH[name]
    return cls(params, **{**settings, **kwargs})


def _has_grad(step: int, i: int) -> bool:
    """Param 0 misses every 7th step, param 2 gets its first grad at step 45 (after StepLR's first cut), param 3
    never gets one."""
    return (i != 0 or step % 7 != 3) and (i != 2 or step >= 45) and i != 3


def _step_lr(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=30, gamma=0.5)


def lockstep(
    make: Make,
    dtype: torch.dtype,
    device: torch.device,
    steps: int = STEPS,
    checks: tuple[int, ...] = CHECKS,
    has_grad: Callable[[int, int], bool] = _has_grad,
    schedule: Callable[[torch.optim.Optimizer], Any] | None = _step_lr,
    **kitsune_kwargs: Any,
) -> tuple[list[torch.nn.Parameter], KitsuneOptimizer, list[torch.nn.Parameter], torch.optim.Optimizer]:
    """``make`` fused and torch's own ``make`` side by side on the same params and grads, compared after each step in
    ``checks`` and the last. Below fp32 the reference is torch's step on fp32 copies, params and state rounded to
    ``dtype`` after every step (math in fp32, storage in ``dtype``: the fused kernel's semantics); the per-tensor
    scalars (step, mu_product, eta, mu) stay float32, as torch keeps them."""
    low = dtype != torch.float32
    ours = make_params(SIZES, dtype, device)
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in ours]
    opt = KitsuneOptimizer(make(ours), enable_fusion=True, **kitsune_kwargs)
    ref_opt = make(ref)
    scheds = [schedule(opt), schedule(ref_opt)] if schedule else []
    for step in range(steps):
        for i, (p, q, g) in enumerate(zip(ours, ref, random_grads(ours, step), strict=True)):
            if has_grad(step, i):
                p.grad, q.grad = g, g.float().clone()
        opt.step()
        ref_opt.step()
        if low:
            with torch.no_grad():
                for q in ref:
                    q.copy_(q.to(dtype))
                    for t in ref_opt.state.get(q, {}).values():
                        if isinstance(t, torch.Tensor) and t.dim():
                            t.copy_(t.to(dtype))
        opt.zero_grad()
        ref_opt.zero_grad()
        for sched in scheds:
            sched.step()
        if step + 1 in checks or step + 1 == steps:
            assert_close_params(ours, ref, dtype)
            assert_same_state(ref_opt, opt, dtype)
    assert all(b.route is Route.TRITON for b in opt.plan.buckets), opt.plan.to_dict()
    return ours, opt, ref, ref_opt


def _assert_state_layout(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], dtype: torch.dtype) -> None:
    """torch's layout: element state in the param's dtype, the per-tensor scalars 0-dim float32."""
    for p in params:
        for key, t in opt.state.get(p, {}).items():
            want = (torch.float32, ()) if key in ("step", "mu_product", "eta", "mu") else (dtype, p.shape)
            assert (t.dtype, t.shape) == want, f"{key}: {t.dtype} {tuple(t.shape)}"


@pytest.mark.parametrize(
    ("name", "dtype"),
    [(name, torch.float32) for name in CASES]
    + [(name, torch.bfloat16) for name in CASES if not name.endswith("_decoupled")],  # bf16: once per optimizer
    ids=lambda v: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v,
)
def test_trajectory_matches_torch(name, dtype, device):
    steps = STEPS if dtype == torch.float32 else BF16_STEPS
    ours, opt, ref, ref_opt = lockstep(CASES[name], dtype, device, steps=steps)
    assert opt.plan.fused_tensors == len(SIZES)
    assert opt.plan.launches == (2 if opt.param_groups[1]["maximize"] else 1)  # maximize: another kernel variant
    assert not opt.state.get(ours[3])  # never a grad: no state, as torch
    _assert_state_layout(opt, ours, dtype)
    counts = [opt.state[p]["step"].item() for p in ours[:3]]
    assert counts == [steps - len(range(3, steps, 7)), steps, steps - 45]
    if name.startswith("asgd"):  # the averaging started: ax is no longer the param, mu below 1
        for p in ours[:2]:
            assert opt.state[p]["mu"].item() < 1 and not torch.equal(opt.state[p]["ax"], p.detach())


@pytest.mark.parametrize("name", list(ONE_EACH))
def test_tensor_lr(name, device):
    """lr as a tensor on the params' device (on a GPU, copied into the hyperparameter buffer there each step);
    Rprop's step_size and ASGD's eta start from it."""
    lr = torch.tensor(3e-3, device=device)
    lockstep(lambda ps: one(name, ps, lr=lr.clone()), torch.float32, device, steps=25, schedule=None)


@pytest.mark.parametrize("name", list(ONE_EACH))
def test_foreach_and_capturable_are_noted(name, device):
    """foreach=True and capturable=True leave the math alone: noted in the plan, fused, same trajectory."""
    flags = {"foreach": True, "capturable": True}
    params, opt = trajectory(lambda ps: one(name, ps, **flags), SIZES, torch.float32, device, steps=12, fused=True)
    # torch's capturable path runs on accelerators only: the reference takes the default path on CPU
    ref_flags = flags if device.type == "cuda" else {}
    ref_params, ref = trajectory(lambda ps: one(name, ps, **ref_flags), SIZES, torch.float32, device, steps=12)
    (bucket,) = opt.plan.buckets
    assert bucket.route is Route.TRITON
    assert any("foreach=True ignored" in n for n in bucket.notes) and any("capturable" in n for n in bucket.notes)
    assert_close_params(params, ref_params, torch.float32)
    assert_same_state(ref, opt, torch.float32)


@pytest.mark.filterwarnings("ignore:kitsune. fusion was asked for but is inactive")
@pytest.mark.parametrize("name", list(ONE_EACH))
def test_differentiable_keeps_its_own_step(name, device):
    params = [p.requires_grad_(False) for p in make_params(SIZES, torch.float32, device)]
    twins = [p.detach().clone() for p in params]
    opt = KitsuneOptimizer(one(name, params, differentiable=True), enable_fusion=True)
    ref = one(name, twins, differentiable=True)
    (bucket,) = opt.plan.buckets
    assert bucket.route is Route.BASE_STEP and "differentiable=True" in bucket.reason
    for step in range(3):
        for ps in (params, twins):
            for p, g in zip(ps, random_grads(ps, step), strict=True):
                p.grad = g
        opt.step()
        ref.step()
    assert all(torch.equal(a, b) for a, b in zip(params, twins, strict=True))


@pytest.mark.parametrize("name", list(ONE_EACH))
def test_odd_sizes_in_one_launch(name, device):
    """Empty, single-element, odd and multi-block tensors (4097 = 4 full blocks + 1): the per-tensor scalars are
    read by every block and written once, by the tensor's last."""
    sizes = [0, 1, 7, 4097]
    params, opt = trajectory(lambda ps: one(name, ps), sizes, torch.float32, device, steps=6, fused=True)
    ref_params, ref = trajectory(lambda ps: one(name, ps), sizes, torch.float32, device, steps=6)
    assert opt.plan.fused_tensors == 4
    assert_close_params(params, ref_params, torch.float32)
    assert_same_state(ref, opt, torch.float32)


@pytest.mark.parametrize("pool", [True, False], ids=["pool", "no_pool"])
def test_per_tensor_scalars_with_and_without_the_memory_pool(pool, device):
    """NAdam's mu_product and ASGD's eta and mu live beside ``step``: in the memory pool's step arena, or (pool off)
    in their own float32 tensors on the param's device."""
    for name, keys in (("nadam", ("step", "mu_product")), ("asgd", ("step", "eta", "mu"))):
        off = {} if pool else {"memory_pool_size": 0}
        ours, opt, _, _ = lockstep(CASES[name], torch.float32, device, steps=8, checks=(8,), **off)
        storages = {opt.state[p][k].untyped_storage().data_ptr() for p in ours[:2] for k in keys}
        assert len(storages) == (1 if pool else 2 * len(keys))  # params 2 and 3 have had no grad yet
        assert all(opt.state[p][k].device == p.device for p in ours[:2] for k in keys)


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(ONE_EACH))
def test_gpt2_shapes_match_torch_foreach(name):
    """On a GPU: GPT-2 block shapes (multi-block tensors), against torch's default (foreach) path."""
    shapes = [(768,), (2304, 768), (2304,), (768, 768), (3072, 768), (768, 3072)] * 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    init = [torch.randn(s, device="cuda", generator=gen) for s in shapes]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    wd = {} if name == "rprop" else {"weight_decay": 0.01}  # Rprop has none
    opt = KitsuneOptimizer(one(name, ours, **wd), enable_fusion=True)
    ref_opt = one(name, ref, **wd)
    assert opt.plan.fused_tensors == len(shapes)
    for _ in range(20):
        for a, b in zip(ours, ref, strict=True):
            g = torch.randn(a.shape, device="cuda", generator=gen)
            a.grad, b.grad = g, g.clone()
        opt.step()
        ref_opt.step()
    assert_close_params(ours, ref, torch.float32)
    assert_same_state(ref_opt, opt, torch.float32)


# -- checkpoints ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ONE_EACH))
def test_state_dict_through_torch_and_back(name, device):
    """kitsune -> plain torch -> kitsune, mid-run: the torch keys (mu_product, eta, mu, step_size, ...) carry the
    whole state, and the resumed run keeps matching torch's uninterrupted one."""
    wd = {} if name == "rprop" else {"weight_decay": 0.01}  # Rprop has none

    def run(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], start: int, end: int) -> None:
        for step in range(start, end):
            for p, g in zip(params, random_grads(params, step), strict=True):
                p.grad = g
            opt.step()
            opt.zero_grad()

    ref_params = make_params(SIZES, torch.float32, device)
    ref = one(name, ref_params, **wd)
    run(ref, ref_params, 0, 18)

    params = make_params(SIZES, torch.float32, device)
    opt = KitsuneOptimizer(one(name, params, **wd), enable_fusion=True)
    run(opt, params, 0, 6)
    plain_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    plain = one(name, plain_params, **wd)
    plain.load_state_dict(copy.deepcopy(opt.state_dict()))
    run(plain, plain_params, 6, 12)  # torch's own step on kitsune's state
    back_params = [torch.nn.Parameter(p.detach().clone()) for p in plain_params]
    back = KitsuneOptimizer(one(name, back_params, **wd), enable_fusion=True)
    back.load_state_dict(copy.deepcopy(plain.state_dict()))
    assert back.plan.fused_tensors == len(SIZES)
    run(back, back_params, 12, 18)
    assert_close_params(back_params, ref_params, torch.float32)
    assert_same_state(ref, back, torch.float32)
