"""Non-finite values through the fused kernels, step by step against the optimizer's own step: an inf param with
no weight decay, and nan or inf grads into Lion's sign."""

from __future__ import annotations

import math

import pytest
import torch
from twins import make_params, random_grads

from kitsune import KitsuneOptimizer
from kitsune.optim import LARS, Lion

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, interpreted

SIZES = [(6, 5), 9]

NO_DECAY = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "adam_l2": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5),
    "lars": lambda ps: LARS(ps, lr=0.05, momentum=0.9, layer_adaptation=False),
}


def _twins(make, device):
    params = make_params(SIZES, torch.float32, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = KitsuneOptimizer(make(params), enable_fusion=True)
    return params, twins, opt, make(twins)


def _run(params, twins, opt, ref, steps, poison=None):
    for step in range(steps):
        for p, t, g in zip(params, twins, random_grads(params, step), strict=True):
            p.grad, t.grad = g.clone(), g.clone()
        if poison is not None:
            poison(step, params[0].grad, twins[0].grad)
        opt.step()
        ref.step()
        for i, (p, t) in enumerate(zip(params, twins, strict=True)):
            torch.testing.assert_close(
                p, t, rtol=1e-5, atol=1e-6, equal_nan=True, msg=lambda m, i=i, step=step: f"step {step}, param {i}: {m}"
            )
    assert opt.plan.fused_tensors == len(params)


@pytest.mark.parametrize("name", list(NO_DECAY))
def test_an_inf_param_without_weight_decay_stays_inf(name, device):
    """torch adds weight_decay * p only when weight_decay is not 0; the kernel must not add 0 * inf = nan."""
    params, twins, opt, ref = _twins(NO_DECAY[name], device)
    with torch.no_grad():
        for p in (params[0], twins[0]):
            p[1, 2] = math.inf
            p[4, 0] = -math.inf
    _run(params, twins, opt, ref, steps=6)
    assert math.isinf(params[0][1, 2].item()) and not params[0].isnan().any()


@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
def test_lion_sign_of_a_non_finite_value_is_torchs(bad, device):
    """torch.sign(nan) is 0: Lion's own step leaves a nan-grad element unmoved (but for weight decay) and keeps
    going; the fused step must too, not write nan into the param."""
    params, twins, opt, ref = _twins(lambda ps: Lion(ps, lr=0.01, weight_decay=0.1), device)

    def poison(step, *grads):
        if step == 2:
            for g in grads:
                g[3, 1] = bad

    _run(params, twins, opt, ref, steps=6, poison=poison)
    assert not params[0].isnan().any()


NAN_GRAD = {
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=0.01, amsgrad=True, weight_decay=0.1),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=0.01),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=0.01),
    "rmsprop_centered": lambda ps: torch.optim.RMSprop(ps, lr=0.01, centered=True, momentum=0.5),
}


@pytest.mark.parametrize("name", list(NAN_GRAD))
def test_a_nan_grad_reaches_the_state_as_torchs_step_takes_it(name, device):
    """A nan grad element at step 2: torch's state holds nan where its maths puts one (torch.maximum keeps nan, so
    amsgrad's max_exp_avg_sq turns nan), and so must the fused step's (the params alone hide it: they turn nan either
    way)."""
    params, twins, opt, ref = _twins(NAN_GRAD[name], device)

    def poison(step, *grads):
        if step == 2:
            for g in grads:
                g[2, 3] = math.nan

    _run(params, twins, opt, ref, steps=4, poison=poison)
    ours, theirs = opt.state_dict()["state"], ref.state_dict()["state"]
    for k, state in theirs.items():
        for key, v in state.items():
            # (torch's own step keeps ``step`` on the CPU, the fused one on the param's device)
            torch.testing.assert_close(
                ours[k][key], v, rtol=1e-5, atol=1e-6, equal_nan=True, check_device=False, msg=f"{name} {k} {key}"
            )
    assert params[0].isnan().any()


NEGATIVE_BETA1 = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=0.01),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=0.01),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=0.01),
}


@pytest.mark.parametrize("name", NEGATIVE_BETA1)
def test_a_negative_beta1_set_after_construction_steps_as_torchs(name, device):
    """torch checks betas only when the optimizer is built; a negative beta1 set afterwards steps (its bias
    correction ``1 - beta1 ** step`` alternates sign). The kernels' power of a negative base was nan."""
    params, twins, opt, ref = _twins(NEGATIVE_BETA1[name], device)
    for o in (opt, ref):
        o.param_groups[0]["betas"] = (-0.5, 0.999)
    _run(params, twins, opt, ref, 12)
