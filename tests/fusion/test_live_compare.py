"""The profiler's live comparison: baseline steps run the wrapped optimizer's own step and training stays exact."""

from __future__ import annotations

import pytest
import torch
from twins import assert_close_params, assert_same_state, trajectory

from kitsune import FusionConfig, KitsuneConfig, ProfilerConfig

SIZES = [(7, 3), 16, 5]


def _config(sample_after: int = 2, compare_steps: int = 4, **profiler) -> dict:
    # the probe (which runs on CUDA only) would take steps from the windows these tests count, and every step is
    # timed on CUDA too, as on the CPU
    profiler.setdefault("probe_steps", 0)
    profiler.setdefault("device_time_every", 1)
    return {
        "config": KitsuneConfig(
            fusion=FusionConfig(enabled=True),
            profiler=ProfilerConfig(enabled=True, sample_after=sample_after, compare_steps=compare_steps, **profiler),
        )
    }


def _kitsune_trajectory(make_opt, steps: int, device: torch.device, **kwargs):
    # trajectory() wraps with enable_fusion=True itself when fused=True; pass the whole config instead
    from kitsune import KitsuneOptimizer

    return trajectory(lambda ps: KitsuneOptimizer(make_opt(ps), **kwargs), SIZES, torch.float32, device, steps)


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
        lambda ps: torch.optim.RMSprop(ps, lr=1e-2, centered=True, momentum=0.5),
        lambda ps: torch.optim.NAdam(ps, lr=1e-2),  # mu_product: on the host for torch's baseline steps
        lambda ps: torch.optim.ASGD(ps, lr=1e-2, t0=3.0),  # eta, mu: torch keeps them on the param's device
    ],
    ids=["adamw", "sgd_nesterov", "rmsprop_centered", "nadam", "asgd"],
)
def test_trajectory_through_the_comparison_window_equals_torch(make_opt, device):
    steps = 16  # warm-up 2, reference 3-6, baseline 7-10, then kitsune again
    ref_params, ref_opt = trajectory(make_opt, SIZES, torch.float32, device, steps)
    params, opt = _kitsune_trajectory(make_opt, steps, device, **_config())
    assert_close_params(params, ref_params, torch.float32)
    assert_same_state(ref_opt, opt, torch.float32)

    modes = [r.mode for r in opt.profiler.records]
    assert modes == ["kitsune"] * 6 + ["baseline"] * 4 + ["kitsune"] * 6
    assert opt.base_steps == 4  # only the baseline steps ran the wrapped optimizer's own step
    # after the baseline's stretch the fused executor took its steps back (step counts on the params' device)
    steps_kept = [(opt.state[p]["step"], p) for p in params if "step" in opt.state[p]]
    assert not opt._handed_over and all(t.device == p.device for t, p in steps_kept)
    fusion = next(s for s in opt.subsystem_status() if s["name"] == "fusion")
    assert fusion["name"] == "fusion" and fusion["report"]["fused_launches_total"] == steps - 4


def test_comparison_reports_measured_speedup_with_counts_and_spread(device):
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731
    _, opt = _kitsune_trajectory(make_opt, 12, device, **_config())
    metrics = opt.profiler.get_metrics()
    cmp = metrics.comparison
    assert cmp.status == "measured", cmp.reason
    assert cmp.kitsune.count == 3 and cmp.baseline_time.count == 3  # the first step of each half settles
    assert cmp.baseline.startswith("torch.optim.adamw.AdamW.step")
    assert cmp.speedup == pytest.approx(cmp.baseline_time.p50_ms / cmp.kitsune.p50_ms)
    assert cmp.speedup_low <= cmp.speedup <= cmp.speedup_high
    # baseline steps are not kitsune's step times, and the warm-up (sample_after=2) is left out
    assert metrics.step_time.count == 12 - 4 - 2 and metrics.warmup_left_out == 2
    import io

    from rich.console import Console

    out = io.StringIO()
    opt.print_summary(console=Console(file=out, width=200, color_system=None))
    words = " ".join(out.getvalue().split())  # the summary's title says what it left out, counted
    clock = "CUDA events" if device.type == "cuda" else "host clock"
    assert f"step time (6 of 12 steps: 2 warm-up, 4 comparison baseline left out; {clock})" in words


def test_comparison_is_pending_until_its_window_has_run(device):
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731
    _, opt = _kitsune_trajectory(make_opt, 7, device, **_config())
    cmp = opt.profiler.get_metrics().comparison
    assert cmp.status == "pending" and "steps 3-10" in cmp.reason and cmp.speedup is None


def test_comparison_off(device):
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731
    _, opt = _kitsune_trajectory(make_opt, 12, device, **_config(compare_steps=0))
    assert {r.mode for r in opt.profiler.records} == {"kitsune"}
    cmp = opt.profiler.get_metrics().comparison
    assert cmp.status == "off" and cmp.speedup is None and opt.base_steps == 0


def test_a_step_that_raises_inside_the_window_leaves_training_usable(device):
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731
    from kitsune import KitsuneOptimizer

    params = [torch.nn.Parameter(torch.randn(5, device=device)) for _ in range(2)]
    opt = KitsuneOptimizer(make_opt(params), **_config(sample_after=1, compare_steps=2))

    def boom(*_):
        raise RuntimeError("boom")

    for step in range(8):
        for p in params:
            p.grad = torch.randn_like(p)
        if step == 4:  # a baseline step
            handle = opt.register_step_pre_hook(boom)
            with pytest.raises(RuntimeError, match="boom"):
                opt.step()
            handle.remove()
        opt.step()
    assert all(torch.isfinite(p).all() for p in params)


def test_failed_calls_use_up_no_slot_of_the_windows(device):
    """A ``step()`` that raises (here the wrapped optimizer's own pre-hook, inside kitsune's step) is no step: torch's
    step count does not move, and neither does the windows' clock. It did: each failed call took a slot, so the
    comparison measured fewer steps than ``compare_steps`` on each side."""
    from kitsune import KitsuneOptimizer

    params = [torch.nn.Parameter(torch.randn(8, device=device)) for _ in range(2)]
    opt = KitsuneOptimizer(torch.optim.AdamW(params, lr=1e-2), **_config(sample_after=1, compare_steps=3))
    refuse = {"now": False}

    def pre(*_):
        if refuse["now"]:
            raise RuntimeError("refused by the pre-hook")

    opt.base_optimizer.register_step_pre_hook(pre)
    gen = torch.Generator().manual_seed(3)
    for call in range(12):
        for p in params:
            p.grad = torch.randn(8, generator=gen).to(device)
        refuse["now"] = call in (2, 6)  # one in the reference window, one in the baseline window
        if refuse["now"]:
            with pytest.raises(RuntimeError, match="refused"):
                opt.step()
        else:
            opt.step()
    assert opt.step_count == 10
    assert [r.mode for r in opt.profiler.records] == ["kitsune"] * 4 + ["baseline"] * 3 + ["kitsune"] * 3
    comparison = opt.profiler.get_metrics().comparison  # the first step of each half settles
    assert comparison.kitsune.count == 2 and comparison.baseline_time.count == 2


@pytest.mark.parametrize("copied_after", [3, 8], ids=["inside-the-windows", "past-them"])
def test_a_copy_goes_on_where_the_windows_stood(copied_after, device):
    """``copy.deepcopy(optimizer)`` continues bit for bit (docs/step.md). The copy's profiler started its windows
    again: its comparison's baseline steps (the wrapped optimizer's own step, which rounds differently) fell where
    the original ran kitsune's, and the two runs parted. The copy's windows now go on where the original's stood."""
    import copy

    from kitsune import KitsuneOptimizer

    params = [torch.nn.Parameter(torch.randn(37, device=device)) for _ in range(3)]
    opt = KitsuneOptimizer(torch.optim.AdamW(params, lr=1e-2), **_config(sample_after=1, compare_steps=2))
    gen = torch.Generator().manual_seed(1)
    grads = [[torch.randn(37, generator=gen).to(device) for _ in params] for _ in range(16)]

    def step(o, i):
        for p, g in zip(o.param_groups[0]["params"], grads[i], strict=True):
            p.grad = g.clone()
        o.step()

    for i in range(copied_after):
        step(opt, i)
    twin = copy.deepcopy(opt)
    for i in range(copied_after, 16):
        step(opt, i)
        step(twin, i)
        assert twin.profiler.records[-1].mode == opt.profiler.records[-1].mode, i
        for a, b in zip(opt.param_groups[0]["params"], twin.param_groups[0]["params"], strict=True):
            assert torch.equal(a, b), i
    assert "baseline" in {r.mode for r in opt.profiler.records}
    assert opt.plan.fused_tensors == twin.plan.fused_tensors == 3
