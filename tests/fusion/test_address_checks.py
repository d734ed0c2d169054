"""The per-step address check's fast path (``FusedUnit._unchanged``): torch's C++ ``data_ptr`` comparison.

CUDA builds of torch have ``torch._C._tensors_data_ptrs_at_indices_equal``; CPU builds do not, so on a CPU the
tests put a Python stand-in with the same contract in its place (True when every listed tensor sits at its address,
an error for an entry that is not a tensor). On a GPU they run against torch's own function. Every scenario that
moves a grad or a param must leave the fast path and give torch's numbers.
"""

from __future__ import annotations

import pytest
import torch
from twins import assert_close_params, make_params, ptrs_equal_stand_in, random_grads

from kitsune import KitsuneOptimizer
from kitsune.fusion import units

SIZES = [(7, 3), 16, (4, 4), 5, (2, 2, 3)]


@pytest.fixture
def fast_check(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make sure the fast path exists here; count the steps it answered 'unchanged'."""
    real = units._PTRS_EQUAL or ptrs_equal_stand_in
    hits: list[int] = []

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


def _train(ours, opt, ref, ref_opt, steps: int, in_place: bool) -> None:
    """``steps`` steps of both optimizers on the same fresh grads, written into the old grads or as new tensors."""
    for step in range(steps):
        for params in (ours, ref):
            for p, g in zip(params, random_grads(params, step), strict=True):
                p.grad = p.grad.copy_(g) if in_place and p.grad is not None else g
        opt.step()
        ref_opt.step()


def test_steady_grads_take_the_fast_path_and_match_torch(device, fast_check):
    """Grads kept in place (zero_grad(set_to_none=False)): after the first step every step is answered by the fast
    check, and 30 steps give torch's trajectory."""
    ours, opt, ref, ref_opt = _twins(device)
    assert all(u._fast for u in opt._subsystem("fusion").units)
    _train(ours, opt, ref, ref_opt, 30, in_place=True)
    assert len(fast_check) == 29
    assert_close_params(ours, ref, torch.float32)


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


def test_fast_path_off_for_fsdp_shards_and_without_the_cpp_check(device, monkeypatch):
    monkeypatch.setattr(units, "_PTRS_EQUAL", None)
    ours, opt, ref, ref_opt = _twins(device)
    assert not any(u._fast for u in opt._subsystem("fusion").units)
    _train(ours, opt, ref, ref_opt, 5, in_place=False)
    assert_close_params(ours, ref, torch.float32)


@pytest.mark.cuda
def test_torch_has_the_cpp_check_on_cuda_and_it_refuses_none():
    """The contract the fast path relies on, on the torch this GPU runs: present, True/False by address, and an
    error (not a crash) for a None entry."""
    assert units._PTRS_EQUAL is not None
    ts = [torch.randn(4, device="cuda") for _ in range(3)]
    ptrs = [t.data_ptr() for t in ts]
    assert units._PTRS_EQUAL(ts, ptrs, [0, 1, 2])
    assert not units._PTRS_EQUAL(ts, [*ptrs[:2], ptrs[2] + 4], [0, 1, 2])
    with pytest.raises((TypeError, RuntimeError, ValueError)):
        units._PTRS_EQUAL([ts[0], None, ts[2]], ptrs, [0, 1, 2])
