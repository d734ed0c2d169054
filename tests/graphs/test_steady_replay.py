"""The steady replay (``GraphSubsystem.replay_steady``): once a step has replayed the graph, the next steps replay
it after a few checks (the groups and their values, every grad and param where the last step found them, no
GradScaler) without the step's full host path. On the CPU the graph is the recording stand-in and torch's C++
address check a Python stand-in; every change that must leave the steady replay is made here, and every step is
compared with torch's own optimizer. Float16 AMP with zeroing in the step through it: tests/graphs/test_graphs.py."""

from __future__ import annotations

import pytest
import torch
from twins import (
    assert_close_params,
    grads_in_place,
    graphed_twins,
    make_params,
    ptrs_equal_stand_in,
    random_grads,
    record_graphs,
    structural_change,
)

from kitsune import FusionConfig, GraphConfig, KitsuneConfig, KitsuneOptimizer
from kitsune.fusion import units
from kitsune.optim import LARS

# every structural change, and every grad that moved, must be seen by either per-step address check
# (tests/conftest.py, check_path): the tests of what a check sees run on both; the others on the default one

SIZES = [(7, 3), 16, (4, 5), 9]


@pytest.fixture(autouse=True)
def cpp_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The units' fast address check exists (on a CPU build of torch, through the stand-in)."""
    monkeypatch.setattr(units, "_PTRS_EQUAL", units._PTRS_EQUAL or ptrs_equal_stand_in)


def _twins(device, make, **kwargs):
    return graphed_twins(device, SIZES, make, enable_fusion=True, **kwargs)


def _steady(opt: KitsuneOptimizer) -> int:
    return opt._subsystem("graphs").steady_replays


def test_steady_replays_follow_torch_with_onecyclelr_and_clip(device):
    """40 steps with OneCycleLR (lr and betas change every step: the steady replay refreshes the device buffer)
    and clipping in the step: torch's trajectory and grad norms, and every step after the first replay steady."""
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)  # noqa: E731
    ref, ours, ref_opt, opt, backend = _twins(device, make, max_grad_norm=0.5)
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=50) for o in (ref_opt, opt)]
    calls = []
    opt.base_optimizer.register_step_post_hook(lambda *_: calls.append(1))
    norms, wants = [], []
    for step in range(40):
        grads_in_place(ref, step)
        grads_in_place(ours, step)
        wants.append(torch.nn.utils.clip_grad_norm_(ref, 0.5))
        ref_opt.step()
        opt.step()
        norms.append(opt.last_grad_norm)
        for s in scheds:
            s.step()
        assert_close_params(ours, ref, torch.float32)
    # warm-up 3, capture (which replays and arms) 1, then 36 steady replays; each read norm is its own step's
    assert _steady(opt) == 36 and (backend.captured, backend.replayed) == (1, 37)
    torch.testing.assert_close(torch.stack(norms), torch.stack(wants), atol=1e-6, rtol=1e-6)
    assert len(calls) == 40 and opt.step_count == 40
    assert opt._subsystem("fusion").report()["steps"] == 40
    assert opt._subsystem("fusion")._contexts[ours[0].device].uploads >= 36  # the new lr reached the buffer


@pytest.mark.parametrize("case", ["clip", "clip_two_units", "trust"])
def test_grads_that_move_every_step_stay_on_the_steady_replay(device, check_path, case):
    """A training loop's grads move every step (``zero_grad()`` frees them, and backward allocates the new ones while
    the forward's activations hold the old blocks). With the native check the steady replay reads where they went,
    points the update's tables and the norm pass (clipping, over one launch unit or two; LARS's trust ratios, which
    read the grads' and the params' norms) at them and replays: 16 steps of torch's trajectory and grad norms, one
    capture. Without it every step takes the full path, with the same results."""
    fusion = {"enabled": True, "max_fusion_size": 2} if case == "clip_two_units" else {"enabled": True}
    config = KitsuneConfig(fusion=FusionConfig(**fusion), grads={"max_norm": None if case == "trust" else 0.5})
    if case == "trust":
        make = lambda ps: LARS(ps, lr=1e-2, momentum=0.9, weight_decay=0.01)  # noqa: E731
    else:
        make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)  # noqa: E731
    ref, ours, ref_opt, opt, backend = graphed_twins(device, SIZES, make, config=config)
    assert len(opt._subsystem("fusion").units) == (2 if case == "clip_two_units" else 1)
    held: list[list] = [[], []]
    moved, norms, wants = 0, [], []
    for step in range(16):
        before = [p.grad.data_ptr() if p.grad is not None else 0 for p in ours]
        for side, params in enumerate((ref, ours)):
            last = [p.grad for p in params]  # held while the new grads are made, as activations would be
            for p, g in zip(params, random_grads(params, step), strict=True):
                p.grad = g
            held[side] = last
        moved += before != [p.grad.data_ptr() for p in ours]
        if case != "trust":
            wants.append(torch.nn.utils.clip_grad_norm_(ref, 0.5))
        ref_opt.step()
        opt.step()
        if case != "trust":
            norms.append(opt.last_grad_norm)
        assert_close_params(ours, ref, torch.float32)
    assert moved == 16 and opt.plan.fused_tensors == len(ours)
    if norms:
        torch.testing.assert_close(torch.stack(norms), torch.stack(wants), atol=1e-6, rtol=1e-6)
    # warm-up 3, capture 1, then steady replays of moved grads; the full path replays without the steady check
    assert _steady(opt) == (12 if check_path == "native" else 0) and backend.captured == 1
    assert backend.replayed == 13


def test_a_steady_replay_that_follows_moved_grads_changes_nothing_when_the_step_cannot_replay(device, check_path):
    """Grads that moved in one unit while another unit's param moved: the steady check answers for the first (its
    table follows the grads) and sends the step through the full path for the second, which re-plans: torch's
    result, no replay of the old graph."""
    make = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
    config = KitsuneConfig(fusion=FusionConfig(enabled=True, max_fusion_size=2))
    ref, ours, ref_opt, opt, backend = graphed_twins(device, SIZES, make, config=config)
    assert len(opt._subsystem("fusion").units) == 2
    for step in range(8):
        for params, o in ((ref, ref_opt), (ours, opt)):
            grads_in_place(params, step)
            o.step()
    steady, captured = _steady(opt), backend.captured
    for params in (ref, ours):
        for p, g in zip(params, random_grads(params, 8), strict=True):
            p.grad = g  # every grad moved
        params[-1].data = params[-1].data.clone()  # and the last unit's last param
    ref_opt.step()
    opt.step()
    assert_close_params(ours, ref, torch.float32)
    assert _steady(opt) == steady and backend.captured == captured  # the full path, which re-planned
    for step in range(9, 16):
        for params, o in ((ref, ref_opt), (ours, opt)):
            grads_in_place(params, step)
            o.step()
        assert_close_params(ours, ref, torch.float32)
    assert backend.captured == captured + 1


def test_one_unit_follows_moved_grads_while_another_has_a_grad_that_is_none(device, check_path):
    """Every grad moved, and one param of the second unit has none this step (torch skips it): the steady check
    re-points the first unit and sends the step through the full path for the second, without a re-plan. Torch's
    result and grad norms on that step and the next ones, and the steady replay back afterwards (moved grads take it
    with the native check only)."""
    config = KitsuneConfig(fusion=FusionConfig(enabled=True, max_fusion_size=2), grads={"max_norm": 0.5})
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)  # noqa: E731
    ref, ours, ref_opt, opt, backend = graphed_twins(device, SIZES, make, config=config)
    assert len(opt._subsystem("fusion").units) == 2
    for step in range(16):
        for params in (ref, ours):
            for i, (p, g) in enumerate(zip(params, random_grads(params, step), strict=True)):
                p.grad = None if step == 9 and i == 3 else g  # moved every step; the last param skips step 9
        want = torch.nn.utils.clip_grad_norm_([p for p in ref if p.grad is not None], 0.5)
        ref_opt.step()
        steady, captured = _steady(opt), backend.captured
        opt.step()
        torch.testing.assert_close(opt.last_grad_norm, want, atol=1e-6, rtol=1e-6)
        assert_close_params(ours, ref, torch.float32)
        if step == 9:
            assert _steady(opt) == steady  # the full path took the None grad
        if step > 4:  # warmed up (3 steps) and captured
            assert backend.captured == captured  # no re-plan, no capture again
    # steps 4-8 and 10-15: step 9 took the full path, whose replay armed the steady one again
    assert _steady(opt) == (11 if check_path == "native" else 0)


def test_zero_in_step_zeroes_the_grads_that_moved_and_leaves_the_old_ones(device, check_path):
    """``GradConfig(zero_in_step=True)`` with grads that are new tensors every step (the old ones still held, as a
    loop that builds its grads elsewhere holds them): the update reads and zeroes the new grads, never the old ones
    (filled with a marker after each step: a stale table would read the marker and zero it), and ``zero_grad()``
    keeps the zeroed grads allocated. 30 steps of torch's trajectory and grad norms, steady replays with the native
    check."""
    config = KitsuneConfig(fusion=FusionConfig(enabled=True), grads={"max_norm": 0.5, "zero_in_step": True})
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)  # noqa: E731
    ref, ours, ref_opt, opt, backend = graphed_twins(device, SIZES, make, config=config)
    old: list[torch.Tensor] = []
    for step in range(30):
        grads = random_grads(ref, step)
        for p, q, g in zip(ref, ours, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()  # new grads; ``old`` holds last step's
        want = torch.nn.utils.clip_grad_norm_(ref, 0.5)
        ref_opt.step()
        opt.step()
        torch.testing.assert_close(opt.last_grad_norm, want, atol=1e-6, rtol=1e-6)
        assert_close_params(ours, ref, torch.float32)
        assert all(torch.count_nonzero(g) == g.numel() for g in old)  # the marker: untouched
        assert all(torch.count_nonzero(q.grad) == 0 for q in ours)  # this step's grads: zeroed by the update
        zeroed = [q.grad for q in ours]
        opt.zero_grad()  # set_to_none, yet the grads the step zeroed stay
        assert all(q.grad is g for q, g in zip(ours, zeroed, strict=True))
        old = [g.fill_(7.0) for g in zeroed]
    assert _steady(opt) == (26 if check_path == "native" else 0) and backend.captured == 1


@pytest.mark.parametrize("where", ["grad_table", "norm"])
def test_a_step_cut_short_while_it_points_the_tables_at_moved_grads_is_checked_in_full_next(
    device, where, monkeypatch, check_path
):
    """A Ctrl-C (or any exception) while a step points the tables at grads that moved, before a unit's upload (on the
    steady path with the native check, on the full path without) or before the norm pass's: the retried step must
    not take the tables for current (a wrong result). It finds the grads moved again and gives torch's result and
    grad norm."""
    config = KitsuneConfig(fusion=FusionConfig(enabled=True, max_fusion_size=2), grads={"max_norm": 0.5})
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)  # noqa: E731
    ref, ours, ref_opt, opt, backend = graphed_twins(device, SIZES, make, config=config)
    fusion = opt._subsystem("fusion")
    for step in range(8):
        grads_in_place(ref, step)
        grads_in_place(ours, step)
        torch.nn.utils.clip_grad_norm_(ref, 0.5)
        ref_opt.step()
        opt.step()
    for params in (ref, ours):
        for p, g in zip(params, random_grads(params, 8), strict=True):
            p.grad = g  # every grad moved
    if where == "grad_table":
        tables = fusion.units[1].tables
        target, name = tables, "set_role"
    else:
        target, name = fusion._norm, "bind_addresses"
    real = getattr(target, name)

    def cut(*args, **kwargs):
        if where == "norm" or args[0] == "grad":
            raise KeyboardInterrupt  # before the upload: the tables (or the norm's) still point at the old grads
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, cut)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    monkeypatch.setattr(target, name, real)
    want = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    ref_opt.step()
    opt.step()
    assert_close_params(ours, ref, torch.float32)
    torch.testing.assert_close(opt.last_grad_norm, want, atol=1e-6, rtol=1e-6)
    for step in range(9, 14):
        for params in (ref, ours):
            for p, g in zip(params, random_grads(params, step), strict=True):
                p.grad = g
        torch.nn.utils.clip_grad_norm_(ref, 0.5)
        ref_opt.step()
        opt.step()
        assert_close_params(ours, ref, torch.float32)


CHANGES = [
    "zero_grad",  # model.zero_grad(): grads set to None, new ones allocated by the next backward
    "some_none",  # one param without a grad for a step
    "storage",  # p.data = ...
    "value",  # weight decay changed by hand: a refreshed buffer, still steady
    "switch",  # nesterov on: another kernel variant, a new plan and graph
    "add_param_group",
    "load_state_dict",
    "swap_param",  # a param swapped into a group's list in place
    "tensor_lr",  # a CPU tensor lr changed in place, as LRScheduler does with one
    "grad_scaler",
]


@pytest.mark.parametrize("change", CHANGES)
def test_every_change_leaves_the_steady_replay_and_matches_torch(device, change, check_path):
    make = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01)  # noqa: E731
    ref, ours, ref_opt, opt, backend = _twins(device, make)
    pairs = [(ref, ref_opt), (ours, opt)]
    for step in range(8):
        for params, o in pairs:
            grads_in_place(params, step)
            o.step()
    assert _steady(opt) == 4
    steady, captured = _steady(opt), backend.captured
    structural_change(change, pairs)
    for _, o in pairs:
        if change in ("value", "switch"):
            o.param_groups[0].update({"weight_decay": 0.2} if change == "value" else {"nesterov": True})
        elif change == "tensor_lr":
            o.param_groups[0]["lr"] = torch.tensor(0.05)
    kept = []
    for step in range(8, 20):
        for params, o in pairs:
            if change == "zero_grad" and step % 3 == 0:
                # the old grads stay referenced, so the new ones get new addresses (a caching allocator would
                # otherwise hand the same blocks back, and the steady replay would rightly go on)
                kept += [p.grad for p in params]
                for p in params:
                    p.grad = None
            grads_in_place(params, step, skip={1} if change == "some_none" and step % 4 == 0 else ())
            if change == "tensor_lr":
                o.param_groups[0]["lr"].fill_(0.05 * 0.9 ** (step - 7))  # in place: the same tensor object
            if change == "grad_scaler" and step < 14 and o is opt:
                o.grad_scale, o.found_inf = None, torch.zeros(())  # what GradScaler.step hands a fused step
                o.step()
                del o.grad_scale, o.found_inf
            else:
                o.step()
        assert_close_params(ours, ref, torch.float32)
    if change == "value" or (change == "zero_grad" and check_path == "native"):
        # a refreshed buffer; grads that moved, read natively, the tables pointed at them: still steady
        assert _steady(opt) == steady + 12 and backend.captured == captured
    elif change == "tensor_lr":
        assert _steady(opt) == steady
    else:
        assert steady < _steady(opt) < steady + 12  # left for the steps that needed it, back afterwards
    if change in ("switch", "add_param_group", "load_state_dict", "storage", "swap_param"):
        assert backend.captured == captured + 1


def _swap_keys(group: dict, a: str, b: str) -> None:
    """The same dict holding the same values in the same order, keys ``a`` and ``b`` trading places: each now holds
    the other's value."""
    items = [(b if k == a else a if k == b else k, v) for k, v in group.items()]
    group.clear()
    group.update(items)


def test_keys_that_trade_places_with_the_same_values_leave_the_steady_replay(device):
    """``nesterov`` and ``maximize`` trade places in the group (the same values, in the same order, under each
    other's key): the groups' values compare equal place by place, so only their keys show the switch change."""
    make = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True)  # noqa: E731
    ref, ours, ref_opt, opt, backend = _twins(device, make)
    pairs = [(ref, ref_opt), (ours, opt)]
    for step in range(14):
        if step == 7:  # after steady replays began (warm-up 3, the capture)
            steady = _steady(opt)
            for _, o in pairs:
                _swap_keys(o.param_groups[0], "nesterov", "maximize")
            assert (opt.param_groups[0]["nesterov"], opt.param_groups[0]["maximize"]) == (False, True)
        for params, o in pairs:
            grads_in_place(params, step)
            o.step()
        assert_close_params(ours, ref, torch.float32)
    assert steady > 0 and _steady(opt) > steady and backend.captured == 2  # left, planned again, back


@pytest.mark.parametrize("where", ["same_group", "other_group"])
def test_a_switch_changed_in_the_step_an_lr_scheduler_changes_the_lr_is_seen(device, where):
    """An LR scheduler changes every group's lr every step, which compares no switches (only keys a switch is read
    from ask for that); ``nesterov`` turned on in the same step, in that group or another, is still seen."""
    from kitsune.fusion.executor import FusionSubsystem

    def make(ps):
        return torch.optim.SGD([{"params": ps[:2]}, {"params": ps[2:], "lr": 0.02}], lr=0.05, momentum=0.9)

    ref, ours, ref_opt, opt, backend = _twins(device, make)
    pairs = [(ref, ref_opt), (ours, opt)]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.95**s) for o in (ref_opt, opt)]
    compared = []
    real = FusionSubsystem._switches_changed
    FusionSubsystem._switches_changed = lambda self, groups: compared.append(1) or real(self, groups)
    try:
        for step in range(16):
            if step == 9:
                before = (len(compared), _steady(opt))
                for _, o in pairs:
                    o.param_groups[0 if where == "same_group" else 1]["nesterov"] = True
            for params, o in pairs:
                grads_in_place(params, step)
                o.step()
            for sched in scheds:
                sched.step()
            assert_close_params(ours, ref, torch.float32)
            if step == 3:  # warm-up 3, then the capture: the full path, which compares the switches
                planned = len(compared)
            if step == 8:  # steady replays with a new lr each step, and no comparison of the switches
                assert _steady(opt) == 5 and len(compared) == planned > 0
    finally:
        FusionSubsystem._switches_changed = real
    assert len(compared) > before[0] and backend.captured == 2
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] != 0.05


def test_a_value_refused_on_the_steady_replay_replays_nothing(device):
    """``betas[0]=1.0`` (a scheduler's ``max_momentum=1.0``) set between steady replays: the replay's refresh refuses
    it as torch's step does (ZeroDivisionError) with nothing replayed or changed; set back, the next step takes the
    full path and the steady replays go on as torch's."""
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)  # noqa: E731
    ref, ours, ref_opt, opt, backend = _twins(device, make)
    for step in range(12):
        if step == 8:
            replays = _steady(opt)
            assert replays > 0
            opt.param_groups[0]["betas"] = (1.0, 0.999)
            grads_in_place(ours, step)
            before = [p.detach().clone() for p in ours]
            with pytest.raises(ZeroDivisionError, match="beta1 < 1"):
                opt.step()
            assert _steady(opt) == replays and all(torch.equal(p, b) for p, b in zip(ours, before, strict=True))
            opt.param_groups[0]["betas"] = (0.9, 0.999)
        for params, o in ((ref, ref_opt), (ours, opt)):
            grads_in_place(params, step)
            o.step()
        assert_close_params(ours, ref, torch.float32)
    assert _steady(opt) > replays + 1 and backend.captured == 1


@pytest.mark.parametrize("graphed", [True, False])
def test_a_numpy_lr_changed_in_place_reaches_the_step(device, graphed):
    """An lr held in a 0-d NumPy array (torch's step takes one), changed in place between steps (``lr[...] = x``: the
    same object, another number): every step is torch's, on the fused route, with or without the graph. An identity
    comparison of the groups' values misses such a change, so the steady replay is never armed over it and the full
    path compares its value."""
    numpy = pytest.importorskip("numpy")
    ref, ours = make_params(SIZES, torch.float32, device), make_params(SIZES, torch.float32, device)
    ref_lr, lr = numpy.array(1e-2), numpy.array(1e-2)
    ref_opt = torch.optim.AdamW(ref, lr=ref_lr, weight_decay=0.1)
    opt = KitsuneOptimizer(torch.optim.AdamW(ours, lr=lr, weight_decay=0.1), enable_fusion=True, capture_graph=graphed)
    if graphed:
        record_graphs(opt)
    for step in range(14):
        for params, o in ((ref, ref_opt), (ours, opt)):
            grads_in_place(params, step)
            o.step()
        assert_close_params(ours, ref, torch.float32)
        ref_lr[...] = lr[...] = 1e-2 * 0.7**step
    assert opt.plan.buckets[0].route.fused and _steady(opt) == 0


@pytest.mark.parametrize("how", ["list", "tuple_then_list", "tensors"])
def test_betas_changed_inside_their_container_reach_the_step(device, how):
    """``group["betas"][0] = x`` on a list, or betas given as CPU tensors changed with ``fill_``: the same container
    object every step, whose items changed. A list's new items refresh the buffer and the replay stays steady;
    tensor betas, like a tensor lr, take the full path, which reads their values each step. ``tuple_then_list``:
    a tuple (compared as it is) replaced by a list after steady replays began, then changed in place."""

    ref, ours, ref_opt, opt, _ = _twins(device, lambda ps: torch.optim.Adam(ps, lr=1e-2))
    # torch's Adam keeps its betas as a tuple; tensor betas need its capturable step on a GPU, so its side takes the
    # same values as floats
    ours_betas = {
        "list": [0.9, 0.99],
        "tuple_then_list": (0.9, 0.99),
        "tensors": (torch.tensor(0.9), torch.tensor(0.99)),
    }[how]
    opt.param_groups[0]["betas"], ref_opt.param_groups[0]["betas"] = ours_betas, (0.9, 0.99)
    for step in range(14):
        for params, o in ((ref, ref_opt), (ours, opt)):
            grads_in_place(params, step)
            o.step()
        beta1, beta2 = 0.5 + 0.03 * step, 0.9 + 0.005 * step
        ref_opt.param_groups[0]["betas"] = (beta1, beta2)
        if how == "tuple_then_list" and step < 6:
            opt.param_groups[0]["betas"] = (beta1, beta2)  # a new tuple each step while steady replays begin
        elif how == "tuple_then_list" and step == 6:
            ours_betas = opt.param_groups[0]["betas"] = [beta1, beta2]
        elif how in ("list", "tuple_then_list"):
            ours_betas[0], ours_betas[1] = beta1, beta2
        else:
            ours_betas[0].fill_(beta1)
            ours_betas[1].fill_(beta2)
        assert_close_params(ours, ref, torch.float32)
    assert _steady(opt) == (0 if how == "tensors" else 10)  # warm-up 3, the capture, then steady


def test_no_steady_replay_when_turned_off(device):
    """GraphConfig(steady_replay=False) sends every step through the full path (with the profiler on, the steady
    replay runs outside its sampled windows: tests/profiler/test_cost.py)."""
    ref, ours = make_params(SIZES, torch.float32, device), make_params(SIZES, torch.float32, device)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2)
    config = KitsuneConfig(fusion=FusionConfig(enabled=True), graphs=GraphConfig(steady_replay=False))
    opt = KitsuneOptimizer(torch.optim.AdamW(ours, lr=1e-2), config=config)
    backend = record_graphs(opt)
    for step in range(10):
        for params, o in ((ref, ref_opt), (ours, opt)):
            grads_in_place(params, step)
            o.step()
    assert backend.replayed > 0 and _steady(opt) == 0
    assert_close_params(ours, ref, torch.float32)


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")
def test_muon_steady_replays_equal_the_eager_fused_step(device):
    """Muon's fused step (momentum, Newton-Schulz by shape, update) through the steady replay, with StepLR: the bits
    of the eager fused step."""
    shapes = [(16, 32), (16, 32), (32, 16)]

    def run(graphed: bool) -> tuple[list[torch.Tensor], KitsuneOptimizer]:
        params = make_params(shapes, torch.float32, device)
        opt = KitsuneOptimizer(
            torch.optim.Muon(params, lr=0.02, weight_decay=0.1, ns_steps=2), enable_fusion=True, capture_graph=graphed
        )
        if graphed:
            record_graphs(opt)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        for step in range(12):
            grads_in_place(params, step)
            opt.step()
            sched.step()
        return params, opt

    eager, _ = run(False)
    graphed, opt = run(True)
    assert _steady(opt) == 8
    assert all(torch.equal(p, q) for p, q in zip(eager, graphed, strict=True))


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")
def test_muon_follows_grads_that_move_every_step(device, check_path):
    """Muon's fused step with grads that are new tensors every step (the last ones still held): the bits of the eager
    fused step given the same grads in place, and steady replays with the native check."""
    shapes = [(16, 32), (16, 32), (32, 16)]

    def run(graphed: bool) -> tuple[list[torch.Tensor], KitsuneOptimizer]:
        params = make_params(shapes, torch.float32, device)
        opt = KitsuneOptimizer(
            torch.optim.Muon(params, lr=0.02, weight_decay=0.1, ns_steps=1), enable_fusion=True, capture_graph=graphed
        )
        held: list = []
        if graphed:
            record_graphs(opt)
        for step in range(8):
            if graphed:
                held = [p.grad for p in params]  # held while the new grads are made
                for p, g in zip(params, random_grads(params, step), strict=True):
                    p.grad = g
            else:
                grads_in_place(params, step)
            opt.step()
        del held
        return params, opt

    eager, _ = run(False)
    graphed, opt = run(True)
    assert opt.plan.fused_tensors == len(shapes)
    assert _steady(opt) == (4 if check_path == "native" else 0)
    assert all(torch.equal(p, q) for p, q in zip(eager, graphed, strict=True))


def test_a_switch_nested_in_lists_changed_in_place_leaves_the_steady_replay(device):
    """kitsune.optim.Muon's per-iteration ``ns_coefficients`` as a list of lists, one inner item changed in place: the
    steady replay sees it (nested lists are copied for the comparison, not only the outer one), re-plans, and the
    steps equal the eager fused step's."""
    from kitsune.optim import Muon

    shapes = [(8, 16), (8, 16)]

    def run(graphed: bool) -> tuple[list[torch.Tensor], KitsuneOptimizer]:
        params = make_params(shapes, torch.float32, device)
        coefficients = [[3.4445, -4.7750, 2.0315], [3.4445, -4.7750, 2.0315]]
        base = Muon([{"params": params, "ns_coefficients": coefficients, "ns_steps": 2}], lr=0.02)
        opt = KitsuneOptimizer(base, enable_fusion=True, capture_graph=graphed)
        if graphed:
            record_graphs(opt)
        for step in range(8):
            if step == 5:  # after a steady replay (warm-up 3, the capture)
                opt.param_groups[0]["ns_coefficients"][0][0] = 2.0
            grads_in_place(params, step)
            opt.step()
        return params, opt

    eager, _ = run(False)
    graphed, opt = run(True)
    assert _steady(opt) > 0
    for p, q in zip(eager, graphed, strict=True):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6)


def test_two_optimizers_stepped_in_turn_each_keep_their_plan_and_graph(device):
    """A GAN's loop: two one-line wrappers (generator, discriminator) stepped in turn with fresh grads each step.
    Neither re-plans, compares its state entries again or captures again because of the other: each keeps its first
    plan and graph and replays it steady, and each follows its torch twin. On CUDA through real graphs and the
    native dict watch; on the CPU through the recording stand-in."""
    sizes = {"g": [(7, 3), 16, (4, 5)], "d": [9, (3, 3)]}
    makes = {"g": lambda ps: torch.optim.AdamW(ps, lr=1e-2), "d": lambda ps: torch.optim.Adam(ps, lr=2e-2)}
    twins = {}
    for name in ("g", "d"):
        ref, ours = make_params(sizes[name], torch.float32, device), make_params(sizes[name], torch.float32, device)
        opt = KitsuneOptimizer(makes[name](ours), enable_fusion=True)
        if device.type == "cpu":
            record_graphs(opt)
        twins[name] = (ref, ours, makes[name](ref), opt)
    plans, compares = {}, {}
    for step in range(30):
        for name, (ref, ours, ref_opt, opt) in twins.items():
            for a, b, g in zip(ref, ours, random_grads(ref, 100 * step + len(name)), strict=True):
                a.grad, b.grad = g.clone(), g.clone()  # new grads every step, as backward makes them
            ref_opt.step()
            opt.step()
            if step == 5:  # past the warm-up and the first capture
                plans[name], compares[name] = opt.plan, opt._subsystem("fusion").report()["state_compares"]
    for name, (ref, ours, _, opt) in twins.items():
        assert_close_params(ours, ref, torch.float32)
        assert opt.plan is plans[name], name
        graphs = opt._subsystem("graphs").report()
        assert graphs["captures"] == 1 and not graphs["recaptures"], (name, graphs)
        assert graphs["replays"] >= 24 and graphs["eager_steps"] == graphs["warmup_steps"], (name, graphs)
        assert opt._subsystem("fusion").report()["state_compares"] == compares[name], name
        assert _steady(opt) >= 23, name
