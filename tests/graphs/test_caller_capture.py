"""``optimizer.step()`` inside a CUDA graph capture of the caller's (``torch.cuda.graph`` around the whole training
step): kitsune's own capture cannot run inside it, its uploads would be captured reading host slots that later
steps write again, and its steps' host work would not run on the caller's replays, so the step raises, naming the
fix, before anything changes; on the steady replay, where launching kitsune's graph into the caller's capture
fails. On a CPU the capture is stood in (the current stream said to be capturing, the plan's kernels said to run on
a CUDA device); on a GPU, the last test captures for real."""

from __future__ import annotations

import sys

import pytest
import torch
from twins import grads_in_place, graphed_twins, make_params, record_graphs

from kitsune import KitsuneOptimizer
from kitsune.graphs import CALLER_CAPTURE

SIZES = [(7, 3), 16, (4, 5), 9]


def _capturing(monkeypatch: pytest.MonkeyPatch, opt: KitsuneOptimizer) -> None:
    """From now on the current stream is capturing, and the plan's fused kernels are said to run on a CUDA device."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(opt._subsystem("graphs"), "_cuda_work", True)


def _snapshot(params, opt):
    return [p.detach().clone() for p in params], {
        i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
        for i, s in enumerate(opt.state[p] for p in params)
    }


def _assert_same(before, params, opt) -> None:
    values, state = before
    assert all(torch.equal(a, p) for a, p in zip(values, params, strict=True))
    for i, p in enumerate(params):
        now = opt.state[p]
        assert now.keys() == state[i].keys()
        for k, v in state[i].items():
            assert torch.equal(now[k], v) if torch.is_tensor(v) else now[k] == v


@pytest.mark.parametrize("when", ["first step", "warm-up", "capture step"])
def test_a_step_inside_the_callers_capture_raises_before_anything_changes(device, monkeypatch, when):
    """At the first step, during kitsune's warm-up or at the step kitsune would capture its graph: the error names
    the fix, the params and the state are as before, and the next step outside the capture follows torch."""
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)  # noqa: E731
    ref, ours, ref_opt, opt, backend = graphed_twins(device, SIZES, make, enable_fusion=True)
    steps = {"first step": 0, "warm-up": 2, "capture step": 3}[when]
    for step in range(steps):
        grads_in_place(ref, step)
        grads_in_place(ours, step)
        ref_opt.step()
        opt.step()
    grads_in_place(ours, steps)
    before = _snapshot(ours, opt)
    with monkeypatch.context() as m:
        _capturing(m, opt)
        with pytest.raises(RuntimeError, match="outside the captured region") as info:
            opt.step()
    assert str(info.value) == CALLER_CAPTURE
    _assert_same(before, ours, opt)
    assert backend.captured == 0 and opt.step_count == steps
    grads_in_place(ref, steps)
    ref_opt.step()
    opt.step()
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_steady_replay_launched_into_the_callers_capture_says_so(device, monkeypatch):
    """Past the capture, on the steady replay: the launch of kitsune's graph into the caller's capture fails, and
    the step raises the same error; the next step outside the capture replays and follows torch."""
    params = make_params(SIZES, torch.float32, device)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = KitsuneOptimizer(torch.optim.AdamW(params, lr=1e-2), enable_fusion=True)
    ref = torch.optim.AdamW(twin, lr=1e-2)
    backend = record_graphs(opt)
    for step in range(6):
        grads_in_place(params, step)
        grads_in_place(twin, step)
        opt.step()
        ref.step()
    steady = opt._subsystem("graphs").steady_replays
    assert steady > 0
    grads_in_place(params, 6)
    before = _snapshot(params, opt)

    def refused(graph):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    with monkeypatch.context() as m:
        _capturing(m, opt)
        m.setattr(backend, "replay", refused)
        with pytest.raises(RuntimeError, match="outside the captured region"):
            opt.step()
    _assert_same(before, params, opt)
    grads_in_place(twin, 6)
    ref.step()
    opt.step()
    for a, b in zip(params, twin, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_without_a_graph_of_kitsunes_a_step_inside_the_callers_capture_raises_too(device, monkeypatch):
    """``capture_graph=False``: the step's uploads would still be captured reading host slots that later steps
    write again, so the step refuses the capture as well, before anything changes."""
    params = make_params(SIZES, torch.float32, device)
    opt = KitsuneOptimizer(torch.optim.AdamW(params, lr=1e-2), enable_fusion=True, capture_graph=False)
    for step in range(2):
        grads_in_place(params, step)
        opt.step()
    grads_in_place(params, 2)
    before = _snapshot(params, opt)
    with monkeypatch.context() as m:
        _capturing(m, opt)
        with pytest.raises(RuntimeError, match="outside the captured region"):
            opt.step()
    _assert_same(before, params, opt)
    assert opt.step_count == 2


@pytest.mark.parametrize("fusion", [True, False])
def test_a_plan_without_fused_kernels_on_cuda_never_asks(device, monkeypatch, fusion):
    """A plan whose fused kernels run on no CUDA device (a CPU plan, or fusion off: torch's own step, whose capture
    rules are torch's) never asks about captures."""
    if device.type == "cuda" and fusion:
        pytest.skip("a CUDA plan asks")
    params = make_params(SIZES, torch.float32, device)
    opt = KitsuneOptimizer(torch.optim.AdamW(params, lr=1e-2), enable_fusion=fusion)
    real = torch.cuda.is_current_stream_capturing

    def asked() -> bool:  # torch's own step asks on CUDA (its capture health check): only kitsune's asking fails
        if sys._getframe(1).f_globals.get("__name__", "").startswith("kitsune"):
            pytest.fail("asked")
        return real()

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", asked)
    grads_in_place(params, 0)
    opt.step()
    assert opt.step_count == 1 and not opt._subsystem("graphs")._cuda_work


@pytest.mark.cuda
def test_a_step_inside_a_real_capture_raises_and_the_run_goes_on():
    """On a GPU: two steps (kitsune still warming up), then forward, backward and ``optimizer.step()`` inside
    ``torch.cuda.graph``: the step raises the error before anything changes (the caller's capture ends cleanly),
    and the training goes on outside it, as torch's optimizer does."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 4)).cuda()
    twin = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 4)).cuda()
    twin.load_state_dict(model.state_dict())
    opt = KitsuneOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), enable_fusion=True)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    x = torch.randn(8, 64, device="cuda")

    def step(m, o):
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()

    for _ in range(2):
        step(model, opt)
        step(twin, ref)
    torch.cuda.synchronize()
    before = _snapshot(list(model.parameters()), opt)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="outside the captured region"), torch.cuda.graph(graph):
        model(x).square().mean().backward()
        opt.step()
    torch.cuda.synchronize()
    _assert_same(before, list(model.parameters()), opt)
    for _ in range(3):
        step(model, opt)
        step(twin, ref)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
