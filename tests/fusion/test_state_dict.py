"""Checkpoints move between kitsune and the plain torch optimizer, both ways, mid-run."""

from __future__ import annotations

import copy

import pytest
import torch
from twins import assert_close_params, assert_same_state, make_params, random_grads

from kitsune import FusionConfig, KitsuneOptimizer
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


NARROW_MAKERS = {name: MAKERS[name] for name in ("adamw_amsgrad", "nadam", "radam", "adamax", "lion", "sgd_momentum")}


@pytest.mark.parametrize("precision", ["param", "fp32"])
@pytest.mark.parametrize("name", list(NARROW_MAKERS))
def test_a_float32_checkpoint_loads_over_bf16_params_as_torchs_load(name, precision, device):
    """A run saved in float32, resumed with the model in bf16: torch's load casts the moments to bf16 and steps on.
    The fused one line did the same for SGD and refused the others (Adam's family, Lion), taking the loaded moments
    for state made before ``model.half()``. It loads now: the moments as torch's load leaves them, bit for bit,
    except where ``state_precision="fp32"`` keeps them in float32 (as saved), and the steps after it follow torch's
    fused step (CPU: the same rounding) or, where torch has none, its own."""
    make = NARROW_MAKERS[name]
    params = make_params(SIZES, torch.float32, device)
    saver = make(params)
    _steps(saver, params, 0, 3)
    saved = saver.state_dict()
    bf16 = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in params]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in bf16]
    opt = KitsuneOptimizer(make(bf16), enable_fusion=True, fusion_config=FusionConfig(state_precision=precision))
    ref = make(twins)
    ref.load_state_dict(copy.deepcopy(saved))
    opt.load_state_dict(copy.deepcopy(saved))
    wide = precision == "fp32"
    assert opt.plan.fused_tensors == len(SIZES)
    assert [b.state for b in opt.plan.buckets] == ["float32" if wide else "bfloat16"]
    for i, (p, t) in enumerate(zip(bf16, twins, strict=True)):
        for key, v in ref.state[t].items():
            if key == "step" or not v.dim():
                continue
            held = opt.state[p][key]
            expected = saved["state"][i][key] if wide else v
            assert held.dtype == expected.dtype and torch.equal(held.cpu(), expected.cpu()), (i, key)
    _steps(opt, bf16, 3, 6)
    _steps(ref, twins, 3, 6)
    assert_close_params(bf16, twins, torch.bfloat16)
