"""Checkpoints move between kitsune and the plain torch optimizer, both ways, mid-run."""

from __future__ import annotations

import copy

import pytest
import torch
from twins import assert_close_params, assert_same_state, make_params, random_grads

from kitsune import KitsuneOptimizer
from kitsune.optim import Lion

SIZES = [(4, 3), 5, 1]
MAKERS = {
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.1),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01),
    "rmsprop_centered": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, centered=True),
    "lion": lambda ps: Lion(ps, lr=1e-3, weight_decay=0.1),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2, weight_decay=0.1),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2, weight_decay=0.1),
    "adadelta": lambda ps: torch.optim.Adadelta(ps, weight_decay=0.1),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2, etas=(0.4, 1.3)),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=1e-2, t0=4.0, weight_decay=0.1),
}


def _steps(opt: torch.optim.Optimizer, params: list[torch.Tensor], start: int, end: int) -> None:
    for step in range(start, end):
        for p, g in zip(params, random_grads(params, step), strict=True):
            p.grad = g
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("direction", ["kitsune_to_torch", "torch_to_kitsune", "kitsune_to_kitsune"])
@pytest.mark.parametrize("name", list(MAKERS))
def test_state_dict_round_trip(name, direction, device):
    make = MAKERS[name]
    ref_params = make_params(SIZES, torch.float32, device)
    ref = make(ref_params)
    _steps(ref, ref_params, 0, 8)  # 4 steps, saved, loaded, 4 more (ASGD averages from t0=4)

    first_fused, second_fused = {
        "kitsune_to_torch": (True, False),
        "torch_to_kitsune": (False, True),
        "kitsune_to_kitsune": (True, True),
    }[direction]
    params = make_params(SIZES, torch.float32, device)
    opt = make(params)
    opt = KitsuneOptimizer(opt, enable_fusion=True) if first_fused else opt
    _steps(opt, params, 0, 4)
    saved = copy.deepcopy(opt.state_dict())

    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = make(resumed)
    opt2 = KitsuneOptimizer(opt2, enable_fusion=True) if second_fused else opt2
    opt2.load_state_dict(saved)
    if second_fused:
        assert opt2.plan.fused_tensors == len(SIZES)
    _steps(opt2, resumed, 4, 8)
    assert_close_params(resumed, ref_params, torch.float32)
    assert_same_state(ref, opt2, torch.float32)


def test_load_state_dict_into_running_kitsune_rebinds(device):
    """Loading into a kitsune optimizer that already built its tables: the kernel must use the new tensors."""
    make = MAKERS["adamw_amsgrad"]
    ref_params = make_params(SIZES, torch.float32, device)
    ref = make(ref_params)
    _steps(ref, ref_params, 0, 12)

    params = make_params(SIZES, torch.float32, device)
    opt = KitsuneOptimizer(make(params), enable_fusion=True)
    _steps(opt, params, 0, 6)
    saved = copy.deepcopy(opt.state_dict())
    snapshot = [p.detach().clone() for p in params]
    _steps(opt, params, 6, 9)  # wander off, then go back to step 6
    with torch.no_grad():
        for p, s in zip(params, snapshot, strict=True):
            p.copy_(s)
    opt.load_state_dict(saved)
    _steps(opt, params, 6, 12)
    assert_close_params(params, ref_params, torch.float32)
    assert_same_state(ref, opt, torch.float32)
