"""Graph capture's logic on the CPU: a stand-in backend whose "capture" records the device work and whose "replay"
runs the recording, so warm-up, capture, replay, the host/device split and every recapture trigger run here
against torch's own optimizer. Real CUDA graphs are tested in test_cuda.py."""

from __future__ import annotations

import copy

import pytest
import torch
from twins import RecordingBackend, make_params, ptrs_equal_stand_in, random_grads, record_graphs

from kitsune import AMPConfig, FusionConfig, GradConfig, GraphConfig, KitsuneConfig, KitsuneOptimizer
from kitsune.fusion import units
from kitsune.optim import Muon

SIZES = [(7, 3), 16, 5, 1]


def _set_grads(params, step, skip=()):
    for i, (p, g) in enumerate(zip(params, random_grads(params, step), strict=True)):
        p.grad = None if i in skip else g


def test_replay_equals_torch_with_onecyclelr_and_clip(device):
    """30 steps with OneCycleLR (lr and betas change every step, through the device buffer, no recapture) and
    clipping inside the step: the same trajectory as torch's AdamW after clip_grad_norm_."""
    ref, ours = make_params(SIZES, torch.float32, device), make_params(SIZES, torch.float32, device)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    opt = KitsuneOptimizer(torch.optim.AdamW(ours, lr=1e-2, weight_decay=0.1), enable_fusion=True, max_grad_norm=0.5)
    backend = record_graphs(opt)
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=40) for o in (ref_opt, opt)]
    norms, wants = [], []
    for step in range(30):
        _set_grads(ref, step)
        _set_grads(ours, step)
        want = torch.nn.utils.clip_grad_norm_(ref, 0.5)
        ref_opt.step()
        opt.step()
        norms.append(opt.last_grad_norm)
        wants.append(want)
        torch.testing.assert_close(opt.last_grad_norm, want, atol=1e-6, rtol=1e-6)
        for s in scheds:
            s.step()
    # a fresh tensor every step, not the graph's buffer: the norms kept from earlier steps still hold their values
    torch.testing.assert_close(torch.stack(norms), torch.stack(wants), atol=1e-6, rtol=1e-6)
    report = opt._subsystem("graphs").report()
    assert (backend.captured, backend.replayed) == (1, 27) and report["eager_steps"] == 3
    for p, q in zip(ref, ours, strict=True):
        torch.testing.assert_close(q.detach(), p.detach(), atol=1e-5, rtol=1e-5)


def _fp16_twins(device, zero_in_step: bool, steady_replay: bool):
    """Adam on two copies of the params: torch's with a GradScaler (`_grad_scaler_step`), kitsune's with the same
    float16 loss scaling and clipping to 0.8 in the step, on the recording graph backend. Returns ``ref, ours,
    ref_opt, scaler, opt``."""
    ref, ours = make_params(SIZES, torch.float32, device), make_params(SIZES, torch.float32, device)
    ref_opt = torch.optim.Adam(ref, lr=1e-2)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10, growth_interval=3)
    config = KitsuneConfig(
        fusion=FusionConfig(enabled=True),
        amp=AMPConfig(enabled=True, dtype=torch.float16, init_scale=2.0**10, growth_interval=3),
        grads=GradConfig(zero_in_step=zero_in_step, max_norm=0.8),
        graphs=GraphConfig(steady_replay=steady_replay),
    )
    opt = KitsuneOptimizer(torch.optim.Adam(ours, lr=1e-2), config=config)
    record_graphs(opt)
    return ref, ours, ref_opt, scaler, opt


def _grad_scaler_step(ref, ref_opt, scaler, step: int) -> list[torch.Tensor]:
    """torch's float16 step on ``ref``: this step's grads (an inf in steps 9 and 17) through GradScaler, unscaled,
    clipped to 0.8, stepped, the scale updated, the grads zeroed. Returns the grads, for kitsune's side."""
    grads = random_grads(ref, step)
    if step in (9, 17):
        grads[0].view(-1)[0] = float("inf")
    scaler.scale(sum((p * g).sum() for p, g in zip(ref, grads, strict=True))).backward()
    scaler.unscale_(ref_opt)
    torch.nn.utils.clip_grad_norm_(ref, 0.8)
    scaler.step(ref_opt)
    scaler.update()
    ref_opt.zero_grad()
    return grads


@pytest.mark.parametrize("steady", [False, True], ids=["full_path", "steady_replay"])
def test_fp16_amp_clip_and_zeroing_replay_like_grad_scaler(device, steady, monkeypatch):
    """The whole float16 phase in the step (unscale, clip, update, skip on overflow, zero the grads, the loss-scale
    update) replays with the graph, through the full host path or the steady replay (torch's C++ address check,
    stood in for on a CPU build): GradScaler's scale trajectory and skips and torch's params; the grads the update
    zeroed stay allocated through zero_grad(); a backward that skipped optimizer.backward is refused."""
    if steady:
        monkeypatch.setattr(units, "_PTRS_EQUAL", units._PTRS_EQUAL or ptrs_equal_stand_in)
    ref, ours, ref_opt, scaler, opt = _fp16_twins(device, zero_in_step=True, steady_replay=steady)
    for step in range(24):
        grads = _grad_scaler_step(ref, ref_opt, scaler, step)
        opt.backward(sum((p * g).sum() for p, g in zip(ours, grads, strict=True)))
        kept = [q.grad for q in ours]
        opt.step()
        opt.zero_grad()
        assert opt.loss_scale == scaler.get_scale()
        # zeroed by the replayed update, and left allocated by zero_grad() (set_to_none notwithstanding)
        assert all(q.grad is g and torch.count_nonzero(g) == 0 for q, g in zip(ours, kept, strict=True))
        _close(ref, ours)
    # warm-up 3, capture 1, then 20 replays: with the steady replay all of them, the overflow steps included
    graphs = opt._subsystem("graphs").report()
    assert (graphs["replays"], graphs["steady_replays"]) == (21, 20 if steady else 0)
    assert opt.skipped_steps == 2 and opt.host_syncs == 0
    sum((q * g).sum() for q, g in zip(ours, random_grads(ours, 30), strict=True)).backward()  # not scaled
    with pytest.raises(RuntimeError, match="optimizer.backward"):
        opt.step()


def test_fp16_amp_with_grads_that_move_every_step_replays_like_grad_scaler(device, check_path):
    """The float16 phase (unscale, clip, skip on overflow, the loss-scale update) with the grads freed by zero_grad()
    and re-allocated elsewhere by every backward, as a training loop's: with the native check every step after the
    capture takes the steady replay, pointed at the new grads, the overflow steps included; GradScaler's scale
    trajectory and skips and torch's params either way."""
    ref, ours, ref_opt, scaler, opt = _fp16_twins(device, zero_in_step=False, steady_replay=True)
    held: list = []
    moved = 0
    for step in range(24):
        grads = _grad_scaler_step(ref, ref_opt, scaler, step)
        before = [q.grad.data_ptr() if q.grad is not None else 0 for q in ours]
        opt.backward(sum((p * g).sum() for p, g in zip(ours, grads, strict=True)))
        moved += before != [q.grad.data_ptr() for q in ours]
        opt.step()
        held = [q.grad for q in ours]  # the last grads' blocks stay taken while the next ones are made
        opt.zero_grad()
        assert opt.loss_scale == scaler.get_scale()
        _close(ref, ours)
    del held
    graphs = opt._subsystem("graphs").report()
    assert moved == 24
    assert (graphs["replays"], graphs["steady_replays"]) == (21, 20 if check_path == "native" else 0)
    assert opt.skipped_steps == 2 and opt.host_syncs == 0


def _twins(device):
    ref, ours = make_params(SIZES, torch.float32, device), make_params(SIZES, torch.float32, device)
    ref_opt = torch.optim.SGD(ref, lr=0.05, momentum=0.9)
    opt = KitsuneOptimizer(torch.optim.SGD(ours, lr=0.05, momentum=0.9), enable_fusion=True)
    return ref, ours, ref_opt, opt


def _both(ref, ours, ref_opt, opt, step, skip=()):
    _set_grads(ref, step, skip)
    _set_grads(ours, step, skip)
    ref_opt.step()
    opt.step()


def _close(ref, ours):
    for p, q in zip(ref, ours, strict=True):
        torch.testing.assert_close(q.detach(), p.detach(), atol=1e-5, rtol=1e-5)


def test_grads_reallocated_or_none_need_no_recapture(device):
    ref, ours, ref_opt, opt = _twins(device)
    backend = record_graphs(opt)
    for step in range(12):
        # new grad tensors every step (as after zero_grad(set_to_none=True)), and some params without a grad
        _both(ref, ours, ref_opt, opt, step, skip={1} if step % 3 == 0 else ())
    assert backend.captured == 1
    _close(ref, ours)
    assert not opt._subsystem("graphs").recaptures


@pytest.mark.parametrize("clip", [None, 0.5], ids=["update", "update_and_norm_pass"])
def test_grads_moved_off_16_byte_multiples_are_captured_again(device, clip, check_path):
    """The update and the norm pass read grads at 16-byte multiples in vectors, a variant a graph freezes. Grads
    that move to views at an 8-byte offset of one buffer (a misaligned vector read is a CUDA error) make the step
    capture again, not replay the vector variant (the recording backend raises on a replay of another variant);
    moved back, the same. The trajectory stays torch's, whether the steady replay follows the moved grads (the
    native check: their alignment from its low bits) or the full path takes them."""
    sizes = [(8, 4), 16, 24, 8]  # numels of multiples of 8: the vector variants apply
    ref, ours = make_params(sizes, torch.float32, device), make_params(sizes, torch.float32, device)
    ref_opt = torch.optim.SGD(ref, lr=0.05, momentum=0.9)
    opt = KitsuneOptimizer(torch.optim.SGD(ours, lr=0.05, momentum=0.9), enable_fusion=True, max_grad_norm=clip)
    backend = record_graphs(opt)
    assert opt.plan.fused_tensors == len(ours)
    flat = torch.zeros(sum(p.numel() for p in ours) + 2, device=device)
    for step in range(16):
        _set_grads(ref, step)
        grads = random_grads(ours, step)
        if 5 <= step < 11:  # views of one buffer at an 8-byte offset, as a bucketed all-reduce may hand them
            offset = 2
            for p, g in zip(ours, grads, strict=True):
                p.grad = flat[offset : offset + p.numel()].view_as(p).copy_(g)
                offset += p.numel()
        else:
            for p, g in zip(ours, grads, strict=True):
                p.grad = g
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref, clip)
        ref_opt.step()
        opt.step()
    assert backend.captured == 3
    assert any("alignment" in reason for reason in opt._subsystem("graphs").recaptures)
    _close(ref, ours)


def test_a_run_that_reloads_often_keeps_the_last_ten_recapture_reasons(device):
    """A load_state_dict every few steps drops the graph each time: the reasons kept are the last 10 (the list grew
    by one a load for as long as the run went on), and the steps follow torch's throughout."""
    ref, ours, ref_opt, opt = _twins(device)
    backend = record_graphs(opt)
    graphs = opt._subsystem("graphs")
    step = 0
    for _ in range(14):
        for _ in range(6):  # warm-up, capture, replays
            _both(ref, ours, ref_opt, opt, step)
            step += 1
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    _both(ref, ours, ref_opt, opt, step)
    assert backend.captured >= 14
    assert len(graphs.recaptures) == 10 and graphs.report()["recaptures"] == list(graphs.recaptures)
    _close(ref, ours)


@pytest.mark.parametrize("change", ["add_param_group", "load_state_dict", "storage", "switch"])
def test_structural_changes_replan_and_recapture(device, change):
    ref, ours, ref_opt, opt = _twins(device)
    backend = record_graphs(opt)
    for step in range(6):
        _both(ref, ours, ref_opt, opt, step)
    assert backend.captured == 1
    if change == "add_param_group":
        extra_ref, extra = make_params([9], torch.float32, device, seed=5), make_params([9], torch.float32, device, 5)
        ref_opt.add_param_group({"params": extra_ref, "lr": 0.01})
        opt.add_param_group({"params": extra, "lr": 0.01})
        ref, ours = ref + extra_ref, ours + extra
    elif change == "load_state_dict":
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    elif change == "storage":  # p.data = ...: the kernel must not keep writing the old storage
        for p, q in zip(ref, ours, strict=True):
            p.data = p.data.clone()
            q.data = q.data.clone()
    else:  # a kernel switch: nesterov on, a new compiled variant
        for o in (ref_opt, opt):
            o.param_groups[0]["nesterov"] = True
    for step in range(6, 14):
        _both(ref, ours, ref_opt, opt, step)
    assert backend.captured == 2, opt._subsystem("graphs").report()
    assert opt._subsystem("graphs").recaptures
    _close(ref, ours)


def test_grad_scaler_steps_run_eagerly_and_keep_the_graph(device):
    ref, ours, ref_opt, opt = _twins(device)
    backend = record_graphs(opt)
    for step in range(6):
        _both(ref, ours, ref_opt, opt, step)
    s1, s2 = (torch.amp.GradScaler(device.type, init_scale=4.0) for _ in range(2))
    for step in range(6, 9):
        grads = random_grads(ref, step)
        for params, o, s in ((ref, ref_opt, s1), (ours, opt, s2)):
            s.scale(sum((p * g).sum() for p, g in zip(params, grads, strict=True))).backward()
            s.step(o)
            s.update()
            o.zero_grad()
    graphs = opt._subsystem("graphs")
    assert "GradScaler" in graphs.report()["last_eager_reason"] and backend.captured == 1
    _close(ref, ours)


def test_failed_capture_falls_back_to_eager_with_the_reason(device):
    ref, ours, ref_opt, opt = _twins(device)
    record_graphs(opt, RecordingBackend(fail=True))
    for step in range(8):
        _both(ref, ours, ref_opt, opt, step)
    graphs = opt._subsystem("graphs")
    assert not graphs.active and "capture failed" in graphs.reason and "not permitted" in graphs.reason
    _close(ref, ours)
    opt._replan()  # a later re-plan does not try again
    assert not graphs.active


def test_inactive_with_reasons(device):
    p = make_params([4], torch.float32, device)
    opt = KitsuneOptimizer(torch.optim.AdamW(p), enable_fusion=True, capture_graph=False)
    assert opt._subsystem("graphs").reason == "capture_graph=False"
    opt = KitsuneOptimizer(torch.optim.AdamW(p))
    assert "fusion is inactive" in opt._subsystem("graphs").reason
    q = torch.nn.Parameter(torch.randn(3, dtype=torch.float64, device=device))
    opt = KitsuneOptimizer(torch.optim.AdamW([*p, q]), enable_fusion=True)
    assert "not all fused" in opt._subsystem("graphs").reason


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")
def test_muon_steps_are_captured_unless_the_grads_need_a_pass(device):
    """Muon's fused step (momentum, Newton-Schulz by shape, update) is captured and replayed with the bits of the
    eager fused step, an LR schedule and a param without a grad included; with clipping or loss scaling the grads
    need a pass of torch ops first, so those steps stay eager and the reason says why."""
    shapes = [(16, 32), (16, 32), (32, 16), 24]

    def run(graphed: bool, aux: bool = False) -> tuple[list[torch.Tensor], RecordingBackend | None]:
        params = make_params(shapes if aux else shapes[:3], torch.float32, device)
        if aux:  # kitsune.optim.Muon: the vector in an AdamW group of its own
            base = Muon([{"params": params[:3]}, {"params": params[3:], "use_muon": False}], lr=0.02, ns_steps=1)
        else:  # one Newton-Schulz iteration: two, captured, in tests/graphs/test_steady_replay.py
            base = torch.optim.Muon(params, lr=0.02, weight_decay=0.1, ns_steps=1)
        opt = KitsuneOptimizer(base, enable_fusion=True, capture_graph=graphed)
        backend = record_graphs(opt) if graphed else None
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        for step in range(10):
            _set_grads(params, step, skip={2} if step == 5 else ())
            opt.step()
            sched.step()
        return params, backend

    for aux in (False, True):
        eager, _ = run(False, aux)
        graphed, backend = run(True, aux)
        assert backend is not None and (backend.captured, backend.replayed) == (1, 7)
        assert all(torch.equal(p, q) for p, q in zip(eager, graphed, strict=True))

    params = make_params(shapes[:3], torch.float32, device)
    opt = KitsuneOptimizer(torch.optim.Muon(params, ns_steps=2), enable_fusion=True, max_grad_norm=1.0)
    graphs = opt._subsystem("graphs")
    graphs.backend = RecordingBackend()
    opt._replan()
    reason = graphs.reason
    assert "grads' passes are not fused" in reason and "Muon's momentum kernel" in reason


@pytest.mark.cuda
def test_a_warm_up_step_that_raises_midway_leaves_the_caller_after_what_it_queued():
    """The graph's eager warm-up steps run on a side stream: one whose launch raises midway (an out-of-memory error,
    a kernel that fails to compile) had the caller's stream never wait for the launches queued before it, so the
    next work on it (a read of the params) raced them. The side stream is kept busy, so a missing wait would show."""
    from kitsune.graphs.backend import CudaGraphBackend

    device = torch.device("cuda")
    x = torch.zeros(1 << 20, device=device)
    torch.cuda.synchronize()

    def fails_midway() -> None:
        torch.cuda._sleep(100_000_000)  # about 50 ms of GPU time on the side stream
        x.fill_(1.0)
        raise RuntimeError("a launch failed (simulated)")

    with pytest.raises(RuntimeError, match="simulated"):
        CudaGraphBackend().eager(fails_midway, device)
    assert bool(x.clone().eq(1.0).all())  # queued on the caller's stream: after the side stream's fill
