"""The per-step address check (``FusedUnit._unchanged``): whether every param and grad sits where the unit's tables
point, so the step can skip the full check.

Two implementations answer it: the native one (`kitsune._native`, one C++ call per unit, compiled in the background)
and, while that builds or where it cannot, torch's C++ ``data_ptr`` comparison (CUDA builds; on a CPU build a Python
stand-in with its contract). Every scenario runs on both (the ``check_path`` fixture), and every change that moves a
grad or a param must leave the fast path and give torch's numbers.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Collection
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils import cpp_extension
from twins import assert_close_params, make_params, random_grads

from kitsune import KitsuneOptimizer, _native
from kitsune.config import FusionConfig, KitsuneConfig
from kitsune.fusion import units

SIZES = [(7, 3), 16, (4, 4), 5, (2, 2, 3)]


class _Counting:
    """The native module, counting the grads' checks it answered 'unchanged'."""

    def __init__(self, real, hits: list[int]) -> None:
        self.real, self.hits, self.same = real, hits, real.same

    def __getattr__(self, name: str):  # the rest of the module (the state watch's calls) as it is
        return getattr(self.real, name)

    def unchanged(self, params, table, grads: bool, dtype: torch.dtype) -> bool:
        same = self.real.unchanged(params, table, grads, dtype)
        if same and grads:
            self.hits.append(1)
        return same

    def follow(self, params, table, what: int, out, dtype: torch.dtype) -> int:
        found = self.real.follow(params, table, what, out, dtype)
        if found == _native.SAME:
            self.hits.append(1)
        return found


@pytest.fixture
def fast_check(check_path: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the steps the fast path answered 'unchanged', on the check ``check_path`` names."""
    hits: list[int] = []
    if check_path == "native":
        monkeypatch.setattr(_native, "CHECKS", _Counting(_native.CHECKS, hits))
        return hits
    real = units._PTRS_EQUAL

    def counting(tensors, ptrs, indices) -> bool:
        same = real(tensors, ptrs, indices)
        if same and tensors and tensors[0] is not None and not isinstance(tensors[0], torch.nn.Parameter):
            hits.append(1)  # the grads' call answered "unchanged"
        return same

    monkeypatch.setattr(units, "_PTRS_EQUAL", counting)
    return hits


def _twins(device, make=lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), **kwargs):
    ours, ref = make_params(SIZES, torch.float32, device), make_params(SIZES, torch.float32, device)
    opt = KitsuneOptimizer(make(ours), enable_fusion=True, **kwargs)
    return ours, opt, ref, make(ref)


def _train(ours, opt, ref, ref_opt, steps: int, in_place: bool, skip: Collection[int] = (), start: int = 0) -> None:
    """``steps`` steps of both optimizers on the same fresh grads (those of steps ``start`` on), written into the old
    grads or as new tensors; the params in ``skip`` get no grad (None)."""
    for step in range(start, start + steps):
        for params in (ours, ref):
            for i, (p, g) in enumerate(zip(params, random_grads(params, step), strict=True)):
                p.grad = None if i in skip else p.grad.copy_(g) if in_place and p.grad is not None else g
        opt.step()
        ref_opt.step()


def test_steady_grads_take_the_fast_path_and_match_torch(device, fast_check, check_path):
    """Grads kept in place (zero_grad(set_to_none=False)): after the first step every step is answered by the fast
    check, and 30 steps give torch's trajectory."""
    ours, opt, ref, ref_opt = _twins(device)
    assert all(u.plain_tensors for u in opt._subsystem("fusion").units)
    _train(ours, opt, ref, ref_opt, 30, in_place=True)
    assert len(fast_check) == 29
    assert_close_params(ours, ref, torch.float32)
    want = "native (one C++ call per unit)" if check_path == "native" else "Python: native check "
    assert opt._subsystem("fusion").report()["address_checks"].startswith(want)


def test_every_change_leaves_the_fast_path(device, fast_check):
    """Grads re-allocated (set_to_none), None on some steps, a param's storage replaced, non-contiguous grads: each
    is caught, and the 30 steps still equal torch's."""
    ours, opt, ref, ref_opt = _twins(device, max_grad_norm=0.7)
    for step in range(30):
        for params in (ours, ref):
            for i, (p, g) in enumerate(zip(params, random_grads(params, step), strict=True)):
                if step % 7 == 3 and i == 1:
                    p.grad = None  # unused this step
                elif step % 5 == 4:
                    p.grad = g  # re-allocated, as after model.zero_grad()
                elif step == 11 and p.dim() == 2:
                    p.grad = g.t().contiguous().t() if g.shape[0] == g.shape[1] else g  # same values
                else:
                    p.grad = g if p.grad is None else p.grad.copy_(g)
        if step == 17:
            for p, t in zip(ours, ref, strict=True):
                fresh = torch.randn_like(p)
                p.data, t.data = fresh, fresh.clone()
        want = torch.nn.utils.clip_grad_norm_([p for p in ref if p.grad is not None], 0.7)
        opt.step()
        ref_opt.step()
        torch.testing.assert_close(opt.last_grad_norm, want, atol=1e-5, rtol=1e-5)
        assert_close_params(ours, ref, torch.float32)
    assert 0 < len(fast_check) < 29


def test_an_eager_step_reads_each_address_once_natively(device, monkeypatch):
    """Outside a replayed graph a step checks the params before it decides how to clip (`FusedUnit.moved`), and reads
    the grads in the same native call (``what`` = 1), whose answer its prepare takes: one call, one read of each
    address a step. Where a step found a grad that is None, the next one checks the params alone (``what`` = 0) and
    its prepare the grads (``what`` = 2), as a None grad would end the first call early; a step whose grads are all
    there again goes back to one call. New grads are caught by the one call (the step re-points its table and gives
    torch's result)."""
    checks = _native.wait(timeout=600)
    assert checks is not None, _native.reason()
    calls: list[int] = []
    read: list[bool] = []

    class Recording:
        same, unchanged_local = checks.same, checks.unchanged_local
        mark_state, state_unchanged, unmark_dicts = checks.mark_state, checks.state_unchanged, checks.unmark_dicts

        def unchanged(self, params, table, what, dtype):
            calls.append(int(what))
            return checks.unchanged(params, table, what, dtype)

        def follow(self, params, table, what, out, dtype):
            calls.append(int(what))
            read.append(checks.follow(params, table, what, out, dtype))
            return read[-1]

    monkeypatch.setattr(_native, "CHECKS", Recording())
    ours, opt, ref, ref_opt = _twins(device, capture_graph=False)
    _train(ours, opt, ref, ref_opt, 3, in_place=True)
    calls.clear()
    _train(ours, opt, ref, ref_opt, 2, in_place=True)
    assert calls == [1, 1], calls
    read.clear()
    _train(ours, opt, ref, ref_opt, 1, in_place=False)  # new grads: the one call answers "moved"
    assert calls[-1:] == [1], calls
    assert [_native.moved_low_bits(r) is not None for r in read] == [True]  # and read the new grads' addresses
    calls.clear()
    # a grad that is None: the one call ends there, the params are checked alone, the prepare's call finds the grad
    # missing and the full check reads the others (natively)
    _train(ours, opt, ref, ref_opt, 1, in_place=True, skip={1})
    assert calls == [1, 0, 2, 2], calls
    _train(ours, opt, ref, ref_opt, 2, in_place=True)  # the params alone while a grad was None, then one call
    assert calls[4:] == [0, 2, 1], calls
    assert_close_params(ours, ref, torch.float32)


def test_a_grad_swapped_for_a_sparse_one_or_a_view_leaves_the_fast_path(device, check_path):
    """Changes the per-step check must see one by one: a grad moved to another buffer of the same size (a view into a
    larger one: natively the table follows it, else the full check takes it), a param's storage replaced between
    steps, a non-contiguous or a sparse grad (the optimizer's own step takes the sparse one)."""
    ours, opt, ref, ref_opt = _twins(device)
    _train(ours, opt, ref, ref_opt, 3, in_place=True)
    unit = opt._subsystem("fusion").units[0]
    assert unit.follow() == _native.SAME
    big = torch.empty(ours[1].numel() + 8, device=device)
    ours[1].grad = big[8:].view_as(ours[1]).copy_(ours[1].grad)
    assert unit.follow() == (_native.MOVED if check_path == "native" else _native.OTHER)  # the unit's answer
    assert unit.grad_addresses[1] == ours[1].grad.data_ptr() or check_path != "native"
    _train(ours, opt, ref, ref_opt, 1, in_place=True)
    assert unit.follow() == _native.SAME
    ours[2].data = ours[2].data.clone()
    assert unit.follow() == _native.OTHER
    _train(ours, opt, ref, ref_opt, 1, in_place=True)  # planned again: a new unit
    unit = opt._subsystem("fusion").units[0]
    assert unit.follow() == _native.SAME
    square = next(p for p in ours if p.dim() == 2 and p.shape[0] == p.shape[1])
    square.grad = square.grad.t().contiguous().t()  # its values, not contiguous
    assert unit.follow() == _native.OTHER
    _train(ours, opt, ref, ref_opt, 1, in_place=True)
    ours[0].grad = ours[0].grad.to_sparse()
    assert unit.follow() == _native.OTHER
    assert_close_params(ours, ref, torch.float32)


def test_the_plan_check_sees_a_swapped_param_natively(device, check_path):
    """The plan's identity check (`PlannedGroups.fits`): a param swapped into a group's list, or the list grown,
    re-plans on either implementation."""
    ours, opt, ref, ref_opt = _twins(device)
    _train(ours, opt, ref, ref_opt, 2, in_place=False)
    assert opt._plan_fits()
    group = opt.param_groups[0]["params"]
    group[0], group[1] = group[1], group[0]
    assert not opt._plan_fits()
    group[0], group[1] = group[1], group[0]
    assert opt._plan_fits()
    group.append(group[0])
    assert not opt._plan_fits()


def test_fast_path_off_without_any_cpp_check(device, monkeypatch):
    """No native check and no torch C++ check (a CPU build of torch, a machine without a compiler): every step takes
    the full check, with torch's numbers, and the report says why."""
    monkeypatch.setattr(_native, "CHECKS", None)
    monkeypatch.setattr(units, "_PTRS_EQUAL", None)
    ours, opt, ref, ref_opt = _twins(device)
    assert all(u.plain_tensors for u in opt._subsystem("fusion").units)
    _train(ours, opt, ref, ref_opt, 5, in_place=False)
    assert opt._subsystem("fusion").units[0].follow() == _native.OTHER
    assert_close_params(ours, ref, torch.float32)


def test_native_checks_can_be_switched_off(device):
    config = KitsuneConfig(fusion=FusionConfig(native_checks=False))
    ours, ref = make_params(SIZES, torch.float32, device), make_params(SIZES, torch.float32, device)
    opt, ref_opt = KitsuneOptimizer(torch.optim.AdamW(ours), config=config), torch.optim.AdamW(ref)
    _train(ours, opt, ref, ref_opt, 3, in_place=True)
    assert opt._subsystem("fusion").units and not any(u.native for u in opt._subsystem("fusion").units)
    assert opt._subsystem("fusion").report()["address_checks"] == "Python (FusionConfig.native_checks=False)"
    assert_close_params(ours, ref, torch.float32)


def test_the_native_check_builds_here_and_refuses_what_it_cannot_read():
    """CI has a compiler: the build must succeed there. Its contract: True by address, layout, dtype, size and shape;
    False (never an error or a crash) for a None or sparse grad, a non-tensor, a table of the wrong size or dtype, and
    a tensor re-strided, re-typed, resized or reshaped where it sat (a grad too: it must have its param's shape)."""
    checks = _native.wait(timeout=600)
    assert checks is not None, _native.reason()
    f32 = torch.float32
    ps = [torch.nn.Parameter(torch.randn(4)) for _ in range(3)]
    for p in ps:
        p.grad = torch.randn(4)
    keys = [_native.shape_key((4,))] * 3
    table = torch.tensor(
        [p.data_ptr() for p in ps] + [p.grad.data_ptr() for p in ps] + [4] * 3 + keys, dtype=torch.int64
    )
    assert checks.unchanged(ps, table, True, f32)
    assert not checks.unchanged(ps, table, True, torch.bfloat16) and not checks.unchanged(ps, table, 0, torch.float64)
    assert not checks.unchanged(ps, table[:9], True, f32)
    assert not checks.unchanged(ps, table.to(torch.int32), True, f32)
    # 2: the grads alone (the step checked the params before): a param's address is not read, a grad's is
    moved_param, moved_grad = table.clone(), table.clone()
    moved_param[1] += 16
    moved_grad[4] += 16
    assert checks.unchanged(ps, moved_param, 2, f32) and not checks.unchanged(ps, moved_param, 1, f32)
    assert not checks.unchanged(ps, moved_param, 0, f32)
    assert not checks.unchanged(ps, moved_grad, 2, f32) and checks.unchanged(ps, moved_grad, 0, f32)
    resized = table.clone()
    resized[7] = 3  # the plan's numel of ps[1]
    assert not any(checks.unchanged(ps, resized, what, f32) for what in (0, 1, 2))
    reshaped = table.clone()
    reshaped[10] = _native.shape_key((2, 2))  # the plan's shape of ps[1]: the param's own is (4,)
    assert not any(checks.unchanged(ps, reshaped, what, f32) for what in (0, 1, 2))  # a grad has the param's shape
    g = ps[1].grad
    ps[1].grad.data = g.data.view(2, 2)  # the grad reshaped where it sits: the param's numel, not its shape
    assert not any(checks.unchanged(ps, table, what, f32) for what in (1, 2)) and checks.unchanged(ps, table, 0, f32)
    ps[1].grad.data = g.data.view(4)
    assert checks.unchanged(ps, table, 2, f32)
    ps[1].grad = torch.randn(4).to_sparse()
    assert not checks.unchanged(ps, table, True, f32) and checks.unchanged(ps, table, False, f32)
    ps[1].grad = None
    assert not checks.unchanged(ps, table, True, f32) and not checks.unchanged(ps, table, 2, f32)
    assert not checks.unchanged([ps[0], "x", ps[2]], table, False, f32)
    assert checks.same(ps, list(ps)) and not checks.same(ps, ps[::-1]) and not checks.same(ps, ps[:2])
    assert not checks.unchanged_local(ps, ps, table, False, f32)  # no local shards to read: the full check, no error
    sparse = torch.randn(4).to_sparse()  # a param without strided storage: its address cannot be read
    assert not checks.unchanged([sparse], torch.tensor([0, 0, 4, _native.shape_key((4,))]), 0, f32)

    # where they sat, another layout: a transposed view, a shrunk view, another dtype
    square = [torch.nn.Parameter(torch.randn(3, 3))]
    square[0].grad = torch.randn(3, 3)
    table = torch.tensor([square[0].data_ptr(), square[0].grad.data_ptr(), 9, _native.shape_key((3, 3))])
    assert checks.unchanged(square, table, 1, f32)
    grad = square[0].grad
    square[0].grad = grad.t()
    assert not checks.unchanged(square, table, 2, f32) and checks.unchanged(square, table, 0, f32)
    square[0].grad = grad
    square[0].data = square[0].data.t()
    assert not checks.unchanged(square, table, 0, f32) and checks.unchanged(square, table, 2, f32)
    square[0].data = square[0].data.t()
    assert checks.unchanged(square, table, 1, f32)
    square[0].data = square[0].data.view(-1)[:4]
    assert not checks.unchanged(square, table, 0, f32)
    square[0].data = torch.randn(3, 3)  # nine floats, then nine bf16 where they sat
    table[0] = square[0].data_ptr()
    square[0].data = square[0].data.view(torch.bfloat16).view(-1)[:9]
    table[3] = _native.shape_key((9,))
    assert not checks.unchanged(square, table, 0, f32) and checks.unchanged(square, table, 0, torch.bfloat16)

    # the reads go in passes over every param: a change anywhere in a long list is seen, in each mode
    gen = torch.Generator().manual_seed(3)
    many = [torch.nn.Parameter(torch.randn(int(n), generator=gen)) for n in torch.randint(1, 9, (300,), generator=gen)]
    for p in many:
        p.grad = torch.randn(p.shape, generator=gen)
    table = torch.tensor(
        [p.data_ptr() for p in many]
        + [p.grad.data_ptr() for p in many]
        + [p.numel() for p in many]
        + [_native.shape_key(p.shape) for p in many],
        dtype=torch.int64,
    )
    assert all(checks.unchanged(many, table, what, f32) for what in (0, 1, 2))
    for i in (0, 151, 299):
        grad = many[i].grad
        many[i].grad = grad.clone()
        assert not checks.unchanged(many, table, 1, f32) and not checks.unchanged(many, table, 2, f32)
        assert checks.unchanged(many, table, 0, f32)
        many[i].grad = grad
        data = many[i].data
        many[i].data = data.clone()
        assert not checks.unchanged(many, table, 0, f32) and not checks.unchanged(many, table, 1, f32)
        assert checks.unchanged(many, table, 2, f32)
        many[i].data = data
    assert all(checks.unchanged(many, table, what, f32) for what in (0, 1, 2))


def test_the_native_follow_reads_moved_grads_only_as_the_kernels_take_them():
    """``follow``: SAME where the params (``what`` 1) and the grads sit where the table says; where only grads moved,
    each present, dense, contiguous, of the dtype and of its param's planned numel and shape, MOVED plus the OR of
    their addresses' low six bits, with every grad's address in ``out``; OTHER (never an error) for anything else: a
    param moved, such a grad, a table or ``out`` of the wrong size, dtype or device, ``what`` 0 (the params alone
    are `unchanged`'s). It never writes the table (the caller does, once its tables point at the new grads). A
    change anywhere in a long list is seen."""
    checks = _native.wait(timeout=600)
    assert checks is not None, _native.reason()
    f32, SAME, OTHER = torch.float32, _native.SAME, _native.OTHER
    gen = torch.Generator().manual_seed(5)
    shapes = [(int(n), 3) for n in torch.randint(1, 6, (300,), generator=gen)]
    ps = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in shapes]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen)
    n = len(ps)
    table = torch.tensor(
        [p.data_ptr() for p in ps] + [0] * n + [p.numel() for p in ps] + [_native.shape_key(p.shape) for p in ps]
    )

    def moved(found: int) -> bool:  # MOVED, with the low bits of every grad's address; the table then follows them
        addresses = [p.grad.data_ptr() for p in ps]
        bits = 0
        for a in addresses:
            bits |= a & 63
        ok = _native.moved_low_bits(found) == bits and out.tolist() == addresses != table[n : 2 * n].tolist()
        table[n : 2 * n] = out
        return ok

    out = torch.full((n,), -7, dtype=torch.int64)
    assert checks.follow(ps, table, 0, out, f32) == OTHER and table[n : 2 * n].tolist() == [0] * n
    assert moved(checks.follow(ps, table, 1, out, f32))
    assert checks.follow(ps, table, 1, out, f32) == SAME and checks.follow(ps, table, 2, out, f32) == SAME
    assert checks.unchanged(ps, table, 1, f32)
    moved_param = table.clone()
    moved_param[7] += 16
    assert checks.follow(ps, moved_param, 1, out, f32) == OTHER and checks.follow(ps, moved_param, 2, out, f32) == SAME
    assert checks.follow(ps, table, 1, out, torch.float64) == OTHER
    assert checks.follow(ps, table[:-1], 1, out, f32) == OTHER and checks.follow(ps, table, 1, out[:-1], f32) == OTHER
    assert checks.follow(ps, table.to(torch.int32), 1, out, f32) == OTHER
    assert checks.follow(ps, table, 1, out.to(torch.int32), f32) == OTHER
    assert checks.follow(ps, table, 1, torch.empty(2 * n, dtype=torch.int64)[::2], f32) == OTHER
    for i in (0, 151, 299):
        grad = ps[i].grad
        rows = grad.shape[0]
        kept = table.clone()
        for other in (None, grad.to_sparse(), torch.randn(3, rows).t()):  # the last: the shape, not contiguous
            ps[i].grad = other
            assert checks.follow(ps, table, 1, out, f32) == OTHER, (i, other)
            assert checks.follow(ps, table, 2, out, f32) == OTHER, (i, other)
        for data in (grad.view(-1), grad[:, :2].clone()):  # where torch lets it in: the numel not the shape; a size
            ps[i].grad = grad.clone()
            ps[i].grad.data = data
            assert checks.follow(ps, table, 1, out, f32) == OTHER, (i, data.shape)
        assert torch.equal(table, kept)  # an OTHER answer leaves the table as it was
        ps[i].grad = torch.cat([grad, grad])[rows:]  # moved: read (a view some rows in: other low bits too)
        assert moved(checks.follow(ps, table, 1, out, f32)), i
        assert checks.follow(ps, table, 2, out, f32) == SAME
        ps[i].grad = grad
        assert moved(checks.follow(ps, table, 1, out, f32)), i
    assert checks.follow([ps[0], "x"], table[: 4 * 2], 1, out[:2], f32) == OTHER


def test_grads_that_alternate_between_two_places_follow_torch_through_the_native_read(device, check_path):
    """As a real loop's grads do (``zero_grad()`` frees them, forward's activations take their blocks, backward
    allocates the new grads elsewhere): every step's grads sit where the step before last left them. Each step
    re-points the tables (natively where the native check is on) and matches torch over 30 steps."""
    reads: list[int] = []
    if check_path == "native":
        real = _native.CHECKS

        class Reading:
            same, unchanged, unchanged_local = real.same, real.unchanged, real.unchanged_local
            mark_state, state_unchanged, unmark_dicts = real.mark_state, real.state_unchanged, real.unmark_dicts

            def follow(self, params, table, what, out, dtype):
                reads.append(real.follow(params, table, what, out, dtype))
                return reads[-1]

        _native.CHECKS = Reading()
    try:
        ours, opt, ref, ref_opt = _twins(device)
        for step in range(30):
            for params in (ours, ref):
                held = [p.grad for p in params]  # the last grads' blocks stay taken while the new grads are made
                for p, g in zip(params, random_grads(params, step), strict=True):
                    p.grad = g.clone()
                del held
            opt.step()
            ref_opt.step()
            assert_close_params(ours, ref, torch.float32)
    finally:
        if check_path == "native":
            _native.CHECKS = real
    assert opt.plan.fused_tensors == len(ours)
    # every step's grads moved and were read natively
    assert [_native.moved_low_bits(r) is not None for r in reads] == ([True] * 30 if check_path == "native" else [])


def test_a_moved_step_keeps_the_native_read_and_later_python_checks_see_every_change(device):
    """A step whose grads moved records their addresses as the native read left them, a tensor, with no list made
    (`FusedUnit._follow`). What runs after it reads that record: a step with a None grad (the full check), the
    native check switched off (torch's C++ compare, or its stand-in, against the list made from the tensor then),
    grads kept in place, and grads that move again. Every step matches torch."""
    assert _native.CHECKS is not None, f"the native address check is unavailable: {_native.reason()}"
    ours, opt, ref, ref_opt = _twins(device)
    unit = opt._subsystem("fusion")._units[0]
    train = partial(_train, ours, opt, ref, ref_opt)  # each call's ``start``: new draws of grads
    train(4, in_place=False, start=0)  # new grads every step: after the first, each step is MOVED
    assert unit._grads_read and unit.tables._cached.get("grad") is None  # recorded as the read's tensor alone
    assert unit.grad_addresses == [p.grad.data_ptr() for p in ours]  # the list, made when asked
    train(1, in_place=False, skip={2}, start=4)  # a None grad: the full check
    train(2, in_place=False, start=5)  # moved again, natively
    assert unit.tables._cached.get("grad") is None
    real = _native.CHECKS
    try:
        _native.CHECKS = None  # the Python checks now read the recorded tensor as a list
        train(2, in_place=True, start=7)  # in place: unchanged
        train(2, in_place=False, start=9)  # moved: seen
    finally:
        _native.CHECKS = real
    train(3, in_place=False, start=11)
    assert_close_params(ours, ref, torch.float32)
    assert opt.plan.fused_tensors == len(ours)
    assert unit.grad_addresses == [p.grad.data_ptr() for p in ours]


def test_the_native_check_reads_fsdp2_local_shards(tmp_path):
    """``unchanged_local`` on real DTensors (a one-process gloo mesh): each param still holds the shard planned, at
    its address, and its grad's shard sits where the table says; any other answer (a shard replaced, a grad that is
    None or moved, an object that is no DTensor) is False, never an error."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    checks = _native.wait(timeout=600)
    assert checks is not None, _native.reason()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        shards, grads = [torch.randn(4) for _ in range(3)], [torch.randn(4) for _ in range(3)]
        params = [torch.nn.Parameter(DTensor.from_local(s, mesh, [Shard(0)])) for s in shards]
        shards = [p._local_tensor for p in params]
        for p, g in zip(params, grads, strict=True):
            p.grad = DTensor.from_local(g, mesh, [Shard(0)])
        ptrs = [t.data_ptr() for t in shards + [p.grad._local_tensor for p in params]]
        table = torch.tensor(ptrs + [4] * 3 + [_native.shape_key((4,))] * 3)
        assert checks.unchanged_local(params, shards, table, True, torch.float32)
        # the slot's offset, cached, reads the same
        assert checks.unchanged_local(params, shards, table, True, torch.float32)
        assert not checks.unchanged_local(params, shards[:2], table, True, torch.float32)
        assert not checks.unchanged_local(params, shards, table[:11], True, torch.float32)
        reshaped = table.clone()
        reshaped[10] = _native.shape_key((2, 2))  # the plan's shape of params[1]'s shard: its own is (4,)
        assert not checks.unchanged_local(params, shards, reshaped, False, torch.float32)
        assert not checks.unchanged_local(params, shards, table, True, torch.float16)
        g = params[0].grad._local_tensor
        params[0].grad._local_tensor = g.view(2, 2).t()  # the grad's shard re-strided where it sat
        assert not checks.unchanged_local(params, shards, table, True, torch.float32)
        params[0].grad._local_tensor = g
        old = params[1].grad
        params[1].grad = DTensor.from_local(grads[1].clone(), mesh, [Shard(0)])  # a new grad: another address
        assert not checks.unchanged_local(params, shards, table, True, torch.float32)
        assert checks.unchanged_local(params, shards, table, False, torch.float32)
        params[1].grad = None
        assert not checks.unchanged_local(params, shards, table, True, torch.float32)
        params[1].grad = old
        assert checks.unchanged_local(params, shards, table, True, torch.float32)
        moved = list(shards)
        moved[2] = shards[2].clone()  # the plan's shard is no longer the param's
        assert not checks.unchanged_local(params, moved, table, False, torch.float32)
        plain = [torch.nn.Parameter(s.clone()) for s in shards]  # no local shards to read
        assert not checks.unchanged_local(plain, shards, table, False, torch.float32)
        assert not checks.unchanged_local([params[0], "x", params[2]], shards, table, False, torch.float32)
        # a plain tensor in between left the cache sound
        assert checks.unchanged_local(params, shards, table, True, torch.float32)
    finally:
        dist.destroy_process_group()
    assert _native.name().startswith("kitsune_native_" + torch.__version__.replace(".", "_").replace("+", "_"))


def test_a_build_killed_midway_blocks_no_later_one(tmp_path, monkeypatch):
    """Each build runs in a directory of its own and moves its library into place whole: what a process killed
    mid-build leaves (its directory, torch's lock file in it) is never waited on, and a later process loads the
    library without compiling. (torch's shared build directory kept such a lock, and every later build waited on it
    for ever.)"""
    built = _native.wait(timeout=600)
    assert built is not None, _native.reason()
    real = _native.cache_dir() / f"{_native.name()}.so"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lib = _native.cache_dir() / f"{_native.name()}.so"
    stale = lib.parent / f"{_native.name()}.build-killed"
    stale.mkdir(parents=True)
    (stale / "lock").touch()
    dirs: list[str] = []

    def load_inline(name, *, build_directory, **kwargs):  # a build that takes no compiler: the library built already
        dirs.append(build_directory)
        out = shutil.copy(real, f"{build_directory}/{name}.so")
        return _native._load(Path(out))

    monkeypatch.setattr(cpp_extension, "load_inline", load_inline)
    module = _native._compile()
    assert lib.is_file() and len(dirs) == 1 and dirs[0] != str(stale) and not Path(dirs[0]).exists()
    assert module.same([real], [real])

    def no_compiler(*args, **kwargs):
        raise AssertionError("a built library is loaded, not compiled again")

    monkeypatch.setattr(cpp_extension, "load_inline", no_compiler)
    assert _native._compile().same([lib], [lib])


def test_a_script_that_ends_while_the_build_runs_exits_cleanly(tmp_path):
    """A short script ends while the build thread is inside torch's C++ code with the GIL released: Python's exit
    waits for it, where a daemon thread stopped there aborted the process ("terminate called without an active
    exception", exit code 134). The build's work stands in here: matrix products for 2 s, then a failed build."""
    done = tmp_path / "done"
    script = tmp_path / "short.py"
    script.write_text(
        "import sys, time\n"
        "import torch\n"
        "from kitsune import _native\n"
        "def build():\n"
        "    t0, a = time.time(), torch.randn(400, 400)\n"
        "    while time.time() - t0 < 2:\n"
        "        a = (a @ a).tanh_()\n"
        f"    open({str(done)!r}, 'w').write('built')\n"
        "    raise RuntimeError('no build here')\n"
        "_native._compile = build\n"
        "_native.start()\n"
        "time.sleep(0.3)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert done.read_text() == "built"  # the build ran to its end before the process exited


@pytest.mark.cuda
def test_torch_has_the_cpp_check_on_cuda_and_it_refuses_none():
    """The contract the fallback relies on, on the torch this GPU runs: present, True/False by address, and an
    error (not a crash) for a None entry."""
    assert units._PTRS_EQUAL is not None
    ts = [torch.randn(4, device="cuda") for _ in range(3)]
    ptrs = [t.data_ptr() for t in ts]
    assert units._PTRS_EQUAL(ts, ptrs, [0, 1, 2])
    assert not units._PTRS_EQUAL(ts, [*ptrs[:2], ptrs[2] + 4], [0, 1, 2])
    with pytest.raises((TypeError, RuntimeError, ValueError)):
        units._PTRS_EQUAL([ts[0], None, ts[2]], ptrs, [0, 1, 2])


@pytest.mark.cuda
def test_the_native_check_reads_cuda_tensors():
    checks = _native.wait(timeout=600)
    assert checks is not None, _native.reason()
    ps = [torch.nn.Parameter(torch.randn(2, 2, device="cuda")) for _ in range(3)]
    for p in ps:
        p.grad = torch.randn_like(p)
    keys = [_native.shape_key((2, 2))] * 3
    table = torch.tensor(
        [p.data_ptr() for p in ps] + [p.grad.data_ptr() for p in ps] + [4] * 3 + keys, dtype=torch.int64
    )
    assert checks.unchanged(ps, table, True, torch.float32)
    assert not checks.unchanged(ps, table, True, torch.bfloat16)
    grad = ps[1].grad
    ps[1].grad = grad.t()  # where it sat, transposed
    assert not checks.unchanged(ps, table, True, torch.float32)
    ps[1].grad = grad
    ps[2].grad = torch.randn_like(ps[2])
    assert not checks.unchanged(ps, table, True, torch.float32)


def test_the_native_self_test_passes_under_a_float64_default_dtype():
    """The build's self-test made its probes in torch's default dtype and checked them as float32: built while the
    default was float64 (a model built in double first), it failed, and every step ran the slower Python checks."""
    if _native.wait(timeout=600) is None:
        pytest.skip(f"the native check cannot build here: {_native.reason()}")
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert _native._compile() is not None  # loads the built module and runs the self-test; raises if wrong
    finally:
        torch.set_default_dtype(saved)
