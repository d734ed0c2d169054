"""torch's LR schedulers on the wrapper, as a training loop steps them: every scheduler in torch.optim.lr_scheduler
that writes new values into the groups (lr every step or now and then, betas or momentum cycled, a scheduler that
reads the loss, schedulers chained or in sequence), and SWA's, each stepped on torch's optimizer and on the wrapper
of a twin: the same lr the scheduler reports and torch's trajectory at every step, through the graph's warm-up,
capture and steady replays (the recording backend on a CPU), with grads kept and with grads that move every step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from twins import assert_close_params, grads_in_place, graphed_twins

from kitsune import KitsuneOptimizer

lr_scheduler = torch.optim.lr_scheduler
SIZES = [(7, 3), 16, (4, 5), 9]
STEPS = 24


def _adamw(ps: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)


def _sgd(ps: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3)


def _sequential(o: torch.optim.Optimizer) -> Any:
    warm = lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=5)
    return lr_scheduler.SequentialLR(o, [warm, lr_scheduler.CosineAnnealingLR(o, T_max=20)], milestones=[5])


def _chained(o: torch.optim.Optimizer) -> Any:
    return lr_scheduler.ChainedScheduler([lr_scheduler.ExponentialLR(o, 0.9), lr_scheduler.StepLR(o, 4, 0.5)])


SCHEDULERS: dict[str, tuple[Callable[[Any], torch.optim.Optimizer], Callable[[torch.optim.Optimizer], Any]]] = {
    "StepLR": (_adamw, lambda o: lr_scheduler.StepLR(o, step_size=5, gamma=0.5)),
    "MultiStepLR": (_adamw, lambda o: lr_scheduler.MultiStepLR(o, milestones=[3, 9, 15], gamma=0.3)),
    "ExponentialLR": (_adamw, lambda o: lr_scheduler.ExponentialLR(o, gamma=0.93)),
    "CosineAnnealingWarmRestarts": (_adamw, lambda o: lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=5, T_mult=2)),
    "PolynomialLR": (_adamw, lambda o: lr_scheduler.PolynomialLR(o, total_iters=20, power=2.0)),
    "CyclicLR-betas": (_adamw, lambda o: lr_scheduler.CyclicLR(o, 1e-3, 3e-2, step_size_up=4, max_momentum=0.95)),
    "CyclicLR-momentum": (_sgd, lambda o: lr_scheduler.CyclicLR(o, 1e-3, 3e-2, step_size_up=4, base_momentum=0.8)),
    "OneCycleLR-sgd": (_sgd, lambda o: lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=STEPS)),
    "ReduceLROnPlateau": (_adamw, lambda o: lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=1)),
    "SequentialLR": (_adamw, _sequential),
    "ChainedScheduler": (_adamw, _chained),
    "SWALR": (_sgd, lambda o: torch.optim.swa_utils.SWALR(o, swa_lr=0.05, anneal_epochs=6)),
}


def _new_grads(params: list[torch.nn.Parameter], step: int) -> None:
    """A training loop's grads: ``zero_grad()`` freed the last ones and backward made new ones elsewhere."""
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    grads_in_place(params, step)
    del grads  # held until the new grads were made, as the forward's activations hold the freed blocks


@pytest.mark.parametrize("grads", ["kept", "moving"])
@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_schedulers_follow_torch(device, name, grads):
    make, schedule = SCHEDULERS[name]
    ref, ours, ref_opt, opt, backend = graphed_twins(device, SIZES, make, enable_fusion=True)
    scheds = [schedule(ref_opt), schedule(opt)]
    assert "triton" in str(opt.plan)  # fused: the values reach the kernels through the device buffer
    plateau = name == "ReduceLROnPlateau"
    for step in range(STEPS):
        for ps in (ref, ours):
            (grads_in_place if grads == "kept" else _new_grads)(ps, step)
        ref_opt.step()
        opt.step()
        assert_close_params(ours, ref, torch.float32)
        losses = [torch.stack([p.detach().square().sum() for p in ps]).sum() for ps in (ref, ours)]
        for sched, loss in zip(scheds, losses, strict=True):
            sched.step(float(loss) if step < 8 else 1.0) if plateau else sched.step()
        assert scheds[1].get_last_lr() == scheds[0].get_last_lr()
        for g, h in zip(opt.param_groups, ref_opt.param_groups, strict=True):
            assert {k: v for k, v in g.items() if k != "params"} == {k: v for k, v in h.items() if k != "params"}
    assert backend.captured >= 1 and opt._subsystem("graphs").steady_replays > 0  # through the steady replay too
    lrs = {round(g["lr"], 12) for g in ref_opt.param_groups}
    assert lrs != {1e-2}  # the scheduler moved the lr


def test_scheduler_state_round_trip(device):
    """A scheduler's and the wrapper's state dicts saved mid-run and loaded into fresh ones (a resumed run): the
    resumed pair follows the uninterrupted torch pair."""
    make, schedule = SCHEDULERS["CyclicLR-betas"]
    ref, ours, ref_opt, opt, _ = graphed_twins(device, SIZES, make, enable_fusion=True)
    ref_sched, sched = schedule(ref_opt), schedule(opt)
    for step in range(10):
        for ps in (ref, ours):
            grads_in_place(ps, step)
        ref_opt.step()
        opt.step()
        ref_sched.step()
        sched.step()
    saved = opt.state_dict(), sched.state_dict()
    resumed = KitsuneOptimizer(make(ours), enable_fusion=True)
    resumed_sched = schedule(resumed)
    resumed.load_state_dict(saved[0])
    resumed_sched.load_state_dict(saved[1])
    for step in range(10, 20):
        for ps in (ref, ours):
            grads_in_place(ps, step)
        ref_opt.step()
        resumed.step()
        ref_sched.step()
        resumed_sched.step()
        assert resumed_sched.get_last_lr() == ref_sched.get_last_lr()
        assert_close_params(ours, ref, torch.float32)
