"""Fused trajectories against torch.optim: every optimizer and option, three dtypes, 30 steps of fresh grads."""

from __future__ import annotations

import pytest
import torch
from twins import assert_close_params, assert_same_state, trajectory

from kitsune.fusion import Route
from kitsune.optim import Lion

SIZES = [(7, 3), 16, 5, 1]  # one block each: the interpreter's cost is per block

# name -> (factory, groups): each optimizer with its options split over two param groups where torch allows
CASES = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adam_l2_amsgrad_maximize": lambda ps: torch.optim.Adam(
        [{"params": ps[:2], "amsgrad": True, "weight_decay": 0.1}, {"params": ps[2:], "maximize": True}], lr=1e-2
    ),
    "adamw": lambda ps: torch.optim.AdamW(
        [{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3, "betas": (0.8, 0.99), "eps": 1e-6}],
        lr=1e-2,
        weight_decay=0.1,
    ),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, weight_decay=0.05),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "sgd_momentum_dampening_wd": lambda ps: torch.optim.SGD(
        [{"params": ps[:2], "dampening": 0.1}, {"params": ps[2:], "weight_decay": 1e-2}], lr=0.05, momentum=0.9
    ),
    "sgd_nesterov_maximize": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, maximize=True),
    "adagrad": lambda ps: torch.optim.Adagrad(
        [{"params": ps[:2], "lr_decay": 1e-2}, {"params": ps[2:], "weight_decay": 1e-2}],
        lr=0.1,
        initial_accumulator_value=0.1,
    ),
    "adagrad_maximize": lambda ps: torch.optim.Adagrad(ps, lr=0.1, maximize=True, eps=1e-8),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2),
    "rmsprop_centered_momentum_wd": lambda ps: torch.optim.RMSprop(
        [{"params": ps[:2], "centered": True}, {"params": ps[2:], "weight_decay": 1e-2}], lr=1e-2, momentum=0.5
    ),
    "rmsprop_maximize_alpha": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, alpha=0.9, maximize=True, centered=True),
    "lion": lambda ps: Lion(ps, lr=1e-3),
    "lion_wd_maximize": lambda ps: Lion(
        [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "maximize": True, "betas": (0.95, 0.98)}], lr=1e-3
    ),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP16_CASES = [
    "adam_l2_amsgrad_maximize",
    "adamw",
    "sgd_momentum_dampening_wd",
    "adagrad",
    "rmsprop_centered_momentum_wd",
    "lion",
]
"""float16 params take the same kernel paths as bfloat16 ones but for the final cast (bf16's rounding is the explicit
one in the interpreter): one case of each algorithm (its groups with other settings where it has such a case), and
AdamW, in float16; every case in the others."""


@pytest.mark.parametrize(
    ("name", "dtype"),
    [(name, dtype) for name in CASES for dtype in DTYPES if dtype != torch.float16 or name in FP16_CASES],
    ids=lambda v: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v,
)
def test_trajectory_matches_torch(name, dtype, device):
    make = CASES[name]
    params, opt = trajectory(make, SIZES, dtype, device, fused=True)
    assert opt.plan.fused_tensors == len(SIZES), opt.plan.to_dict()
    if dtype != torch.float32:
        # state keys, dtypes and step counts as torch's own run of this dtype; values as math in fp32
        assert_same_state(trajectory(make, SIZES, dtype, device, steps=2)[1], opt, dtype, values=False)
    ref_params, ref = trajectory(make, SIZES, dtype, device, rounded=dtype != torch.float32)
    assert_close_params(params, ref_params, dtype)
    assert_same_state(ref, opt, dtype)


@pytest.mark.parametrize(
    "name", ["adamw_amsgrad", "sgd_momentum_dampening_wd", "adagrad", "rmsprop_centered_momentum_wd", "lion"]
)
def test_odd_sizes(name, device):
    """Empty, single-element, odd and multi-block tensors in one launch (4097 = 4 full blocks + 1)."""
    sizes = [0, 1, 7, 4097]
    ref_params, ref = trajectory(CASES[name], sizes, torch.float32, device, steps=12)
    params, opt = trajectory(CASES[name], sizes, torch.float32, device, steps=12, fused=True)
    assert opt.plan.fused_tensors == 4
    assert_close_params(params, ref_params, torch.float32)
    assert_same_state(ref, opt, torch.float32)


def test_one_bucket_per_kernel_variant(device):
    """Groups differing only in values share a launch; different switches need their own."""
    make = (
        lambda ps: torch.optim.Adam(  # noqa: E731
            [
                {"params": ps[:1], "amsgrad": True},
                {"params": ps[1:2], "lr": 1e-3, "weight_decay": 0.1},
                {"params": ps[2:], "maximize": True},
            ],
            lr=1e-2,
        )
    )
    ref_params, ref = trajectory(make, SIZES, torch.float32, device, steps=10)
    params, opt = trajectory(make, SIZES, torch.float32, device, steps=10, fused=True)
    fused = [b for b in opt.plan.buckets if b.route is Route.TRITON]
    assert sorted((b.options, b.tensors, b.groups) for b in fused) == [
        ("-", 1, [1]),
        ("amsgrad", 1, [0]),
        ("maximize", 2, [2]),
    ]
    assert opt.plan.launches == 3
    assert_close_params(params, ref_params, torch.float32)
    assert_same_state(ref, opt, torch.float32)


def test_grads_missing_on_some_steps(device):
    """None grads skip the param like torch (no state, no step); a late first grad creates state then."""

    def has_grad(step: int, i: int) -> bool:
        return (i != 0 or step % 3 != 1) and (i != 2 or step >= 5) and i != 3

    for make in (CASES["adamw"], CASES["sgd_momentum_dampening_wd"], CASES["rmsprop_centered_momentum_wd"]):
        ref_params, ref = trajectory(make, SIZES, torch.float32, device, steps=12, has_grad=has_grad)
        params, opt = trajectory(make, SIZES, torch.float32, device, steps=12, fused=True, has_grad=has_grad)
        assert params[3] not in opt.state or not opt.state[params[3]]
        assert_close_params(params, ref_params, torch.float32)
        assert_same_state(ref, opt, torch.float32)


def test_all_grads_none_launches_nothing(device):
    params, opt = trajectory(CASES["adam"], SIZES, torch.float32, device, steps=3, fused=True)
    before = [p.detach().clone() for p in params]
    opt.step()  # every grad is None after zero_grad
    fusion = next(s for s in opt.subsystems if s.name == "fusion")
    assert fusion.launches_last_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, params, strict=True))
    assert all(opt.state[p]["step"].item() == 3 for p in params)


def test_zero_grad_set_to_none_false(device):
    """Grads kept between steps (same addresses): the grad table is uploaded once."""
    make = CASES["adamw"]
    ref_params, _ = trajectory(make, SIZES, torch.float32, device, steps=10, set_to_none=False)
    params, opt = trajectory(make, SIZES, torch.float32, device, steps=10, fused=True, set_to_none=False)
    assert_close_params(params, ref_params, torch.float32)
    fusion = next(s for s in opt.subsystems if s.name == "fusion")
    unit = fusion._units[0]
    assert unit.tables._cached["grad"] == [p.grad.data_ptr() for p in params]


def test_lr_schedules(device):
    """Per-group LambdaLR, then OneCycleLR (which also writes betas) from step 25: no recompiles, same numbers."""

    def schedule(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 0.97**s, lambda s: 1.0 / (1 + s)])

    make = CASES["adamw"]
    ref_params, ref = trajectory(make, SIZES, torch.float32, device, schedule=schedule)
    params, opt = trajectory(make, SIZES, torch.float32, device, fused=True, schedule=schedule)
    assert_close_params(params, ref_params, torch.float32)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.param_groups]

    # OneCycleLR mid-run on the already-trained optimizers (it writes lr and betas / momentum every step)
    from twins import random_grads

    for make in (CASES["adamw"], CASES["sgd_momentum_dampening_wd"]):
        runs = []
        for fused in (False, True):
            ps, o = trajectory(make, SIZES, torch.float32, device, steps=25, fused=fused)
            sched = torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=30)
            for step in range(25, 50):
                for p, g in zip(ps, random_grads(ps, step), strict=True):
                    p.grad = g
                o.step()
                o.zero_grad()
                sched.step()
            runs.append((ps, o))
        assert_close_params(runs[1][0], runs[0][0], torch.float32)
        assert_same_state(runs[0][1], runs[1][1], torch.float32)


def test_tensor_lr(device):
    make = lambda ps: torch.optim.Adam(ps, lr=torch.tensor(1e-2), weight_decay=0.1)  # noqa: E731
    ref_params, _ = trajectory(make, SIZES, torch.float32, device, steps=10)
    params, opt = trajectory(make, SIZES, torch.float32, device, steps=10, fused=True)
    assert opt.plan.fused_tensors == len(SIZES)
    assert_close_params(params, ref_params, torch.float32)


def test_betas_as_a_tensor_of_two_set_and_changed_in_place_step_as_torch(device):
    """torch's Adam unpacks ``betas`` given as a tensor of two (``beta1, beta2 = group["betas"]``): set mid-run, then
    changed in place, the fused step reads the values torch's reads (its for-loop step and its fused one take them;
    its foreach step without capturable refuses them)."""
    from twins import random_grads

    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False)  # noqa: E731
    params, opt = trajectory(make, SIZES, torch.float32, device, steps=2, fused=True)
    ref_params, ref = trajectory(make, SIZES, torch.float32, device, steps=2)
    for step in range(2, 8):
        for o in (opt, ref):
            if step == 2:
                o.param_groups[0]["betas"] = torch.tensor([0.8, 0.95])
            elif step == 5:
                o.param_groups[0]["betas"][0] = 0.5
        for ps in (params, ref_params):
            for p, g in zip(ps, random_grads(ps, step), strict=True):
                p.grad = g
        opt.step()
        ref.step()
        assert_close_params(params, ref_params, torch.float32)
    assert {b.route for b in opt.plan.buckets} == {Route.TRITON}
    assert_same_state(ref, opt, torch.float32)


def test_adamw_set_to_coupled_decay_mid_run_decays_as_torchs_step(device):
    """torch's AdamW reads its group's ``decoupled_weight_decay`` (an Adam with the flag on): set to False, the
    weight decay goes into the grad, as Adam's. The fused step follows it (a re-plan), not the class's default."""
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.5)  # noqa: E731
    params, opt = trajectory(make, SIZES, torch.float32, device, steps=2, fused=True)
    ref_params, ref = trajectory(make, SIZES, torch.float32, device, steps=2)
    for o in (opt, ref):
        o.param_groups[0]["decoupled_weight_decay"] = False
    from twins import random_grads

    for step in range(2, 8):
        for ps in (params, ref_params):
            for p, g in zip(ps, random_grads(ps, step), strict=True):
                p.grad = g
        opt.step()
        ref.step()
    assert {b.route for b in opt.plan.buckets} == {Route.TRITON}
    assert_close_params(params, ref_params, torch.float32)
    assert_same_state(ref, opt, torch.float32)


def test_switch_change_mid_run_replans(device):
    """A group option that is a compile-time switch (amsgrad here) changes the kernel variant on the next step."""
    params, opt = trajectory(CASES["sgd"], SIZES, torch.float32, device, steps=2, fused=True)
    ref_params, ref = trajectory(CASES["sgd"], SIZES, torch.float32, device, steps=2)
    for o in (opt, ref):
        o.param_groups[0]["momentum"] = 0.9
    from twins import random_grads

    for step in range(2, 8):
        for ps in (params, ref_params):
            for p, g in zip(ps, random_grads(ps, step), strict=True):
                p.grad = g
        opt.step()
        ref.step()
    assert opt.plan.buckets[0].options == "momentum"
    assert_close_params(params, ref_params, torch.float32)
    assert_same_state(ref, opt, torch.float32)
