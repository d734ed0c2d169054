"""``GraphConfig(static_addresses=True)``: the units watch their grads and their params' storages through weak
references instead of checking every address each step. Every change that frees a watched tensor must send the
next step through the full check, and every step must stay torch's. On the CPU the graph is the recording
stand-in (tests/twins.py); real captures: tests/fusion/test_cuda.py."""

from __future__ import annotations

import pytest
import torch
from twins import (
    assert_close_params,
    grads_in_place,
    graphed_twins,
    make_params,
    ptrs_equal_stand_in,
    record_graphs,
    structural_change,
)

from kitsune import GradConfig, GraphConfig, KitsuneConfig, KitsuneOptimizer, MemoryConfig, _native
from kitsune.fusion import units

SIZES = [(7, 3), 16, (4, 5), 9]


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the per-step C++ address checks: the native one's, and torch's own function's (the stand-in on CPU)
    that units use while the native one builds. The full check's read of the grads (in `FusedUnit._prepare`, after
    a watch broke or on a first step) is not a per-step check: not counted."""
    calls: list[int] = []
    full: list[bool] = []
    prepare = units.FusedUnit._prepare

    def full_check(self, *args):
        full.append(True)
        try:
            return prepare(self, *args)
        finally:
            full.pop()

    inner = units._PTRS_EQUAL or ptrs_equal_stand_in

    def counted(tensors, ptrs, indices):
        calls.append(len(indices))
        return inner(tensors, ptrs, indices)

    class Native:
        same = _native.CHECKS.same if _native.CHECKS is not None else None
        mark_state = getattr(_native.CHECKS, "mark_state", None)
        state_unchanged = getattr(_native.CHECKS, "state_unchanged", None)
        unmark_dicts = getattr(_native.CHECKS, "unmark_dicts", None)

        @staticmethod
        def unchanged(params, table, grads, dtype):
            calls.append(len(params))
            return _native_module.unchanged(params, table, grads, dtype)

        @staticmethod
        def follow(params, table, what, out, dtype):
            if not full:
                calls.append(len(params))
            return _native_module.follow(params, table, what, out, dtype)

    _native_module = _native.CHECKS
    monkeypatch.setattr(units, "_PTRS_EQUAL", counted)
    monkeypatch.setattr(units.FusedUnit, "_prepare", full_check)
    if _native_module is not None:
        monkeypatch.setattr(_native, "CHECKS", Native)
    return calls


def _config(static: bool = True, **parts) -> KitsuneConfig:
    return KitsuneConfig(fusion={"enabled": True}, graphs=GraphConfig(static_addresses=static), **parts)


def _twins(device, make, config: KitsuneConfig):
    return graphed_twins(device, SIZES, make, config=config)


def _static(opt: KitsuneOptimizer) -> dict:
    return opt._subsystem("fusion").report()["static_addresses"]


def _steady(opt: KitsuneOptimizer) -> int:
    return opt._subsystem("graphs").steady_replays


def test_static_steps_check_no_address_and_follow_torch(device, checks):
    """40 steps with OneCycleLR and clipping, grads kept in place: torch's trajectory, every step after the first
    replay steady, and not one per-step address check (the default runs one per unit and step)."""
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)  # noqa: E731
    ref, ours, ref_opt, opt, backend = _twins(device, make, _config(grads=GradConfig(max_norm=0.5)))
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=50) for o in (ref_opt, opt)]
    for step in range(40):
        grads_in_place(ref, step)
        grads_in_place(ours, step)
        torch.nn.utils.clip_grad_norm_(ref, 0.5)
        ref_opt.step()
        opt.step()
        for s in scheds:
            s.step()
        assert_close_params(ours, ref, torch.float32)
    assert _steady(opt) == 36 and backend.replayed == 37
    assert checks == []
    assert _static(opt) == {"units_watching": 1, "units": 1, "rechecks": 0, "stopped": []}


def test_default_checks_every_step(device, checks):
    """The control for the test above: without the promise, each steady step runs the C++ checks."""
    ours = make_params(SIZES, torch.float32, device)
    opt = KitsuneOptimizer(torch.optim.AdamW(ours, lr=1e-2), config=_config(static=False))
    record_graphs(opt)
    for step in range(10):
        grads_in_place(ours, step)
        opt.step()
    # a check on every full step after the first (steps 2 to 4: warm-up and capture) and on every steady replay
    assert _steady(opt) == 6 and len(checks) >= 3 + 6
    assert _static(opt) is None


CHANGES = [
    "model_zero_grad",  # every p.grad set to None (nothing else holding them), new grads from the next backward
    "kitsune_zero_grad",  # optimizer.zero_grad() (set_to_none=True)
    "grad_data",  # p.grad.data = a copy: the same grad object over new memory (the old storage freed)
    "grad_set",  # p.grad.set_(a copy's storage): the same
    "some_none",  # one param without a grad for a step: torch skips it
    "storage",  # p.data = ... (the old storage freed): a re-plan
    "flat_grads",  # grads in the pool's arena, set to None by model.zero_grad(): the pool holds its views weakly
    "add_param_group",
    "load_state_dict",
    "swap_param",  # a param swapped into a group's list in place
]


@pytest.mark.parametrize("change", CHANGES)
def test_every_freed_grad_or_storage_is_noticed_and_matches_torch(device, change):
    make = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01)  # noqa: E731
    parts = {"memory": MemoryConfig(flat_grads=True)} if change == "flat_grads" else {}
    ref, ours, ref_opt, opt, backend = _twins(device, make, _config(**parts))
    pairs = [(ref, ref_opt), (ours, opt)]
    for step in range(8):
        for params, o in pairs:
            grads_in_place(params, step)
            o.step()
    assert _steady(opt) == 4 and _static(opt)["units_watching"] == 1
    steady, captured = _steady(opt), backend.captured
    structural_change(change, pairs)
    for step in range(8, 20):
        for params, o in pairs:
            if step % 4 == 0 and change in ("model_zero_grad", "flat_grads"):
                for p in params:
                    p.grad = None
            if step % 4 == 0 and change == "kitsune_zero_grad":
                o.zero_grad()
            if step % 4 == 0 and change in ("grad_data", "grad_set"):
                for p in params:
                    if change == "grad_data":
                        p.grad.data = p.grad.data.clone()
                    else:
                        p.grad.set_(p.grad.clone())
            grads_in_place(params, step, skip={1} if change == "some_none" and step % 4 == 0 else ())
            o.step()
        assert_close_params(ours, ref, torch.float32)
    report = _static(opt)
    assert steady < _steady(opt) < steady + 12  # left for the steps that needed it, back afterwards
    assert report["stopped"] == [] and report["units_watching"] >= 1
    if change in ("add_param_group", "load_state_dict", "storage", "swap_param"):
        assert backend.captured == captured + 1  # a re-plan: new units, watching again
    else:
        assert report["rechecks"] == 3  # one for each step that freed grads: 8, 12 and 16
    if change == "flat_grads":
        pool = opt._subsystem("memory")
        assert all(pool.active and u.slots.holds_grad(i, p.grad) for u in pool._units for i, p in enumerate(u.params))


def test_stops_watching_grads_freed_before_every_step(device, checks):
    """zero_grad(set_to_none=True) each step frees the grads before the watch is ever used: after three such steps
    the unit checks addresses every step again (and says why), with the same results."""
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731
    ref, ours, ref_opt, opt, _ = _twins(device, make, _config())
    for step in range(12):
        for params, o in ((ref, ref_opt), (ours, opt)):
            grads_in_place(params, step)
            o.step()
            o.zero_grad()
        assert_close_params(ours, ref, torch.float32)
    report = _static(opt)
    assert report["units_watching"] == 0 and report["rechecks"] == 3
    assert len(report["stopped"]) == 1 and "set_to_none=True" in report["stopped"][0]
    n = len(checks)
    grads_in_place(ours, 12)
    opt.step()
    assert len(checks) > n  # the per-step check is back


def test_static_addresses_is_validated():
    with pytest.raises(ValueError, match="static_addresses"):
        GraphConfig(static_addresses="sometimes")
