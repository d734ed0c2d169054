"""Profiler, summary and profile JSON on CPU."""

from __future__ import annotations

import io
import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from helpers import batches, small_model, train
from rich.console import Console

from kitsune import KitsuneConfig, KitsuneOptimizer, ProfilerConfig
from kitsune.profiler import TimeStats
from kitsune.profiler.schema import SCHEMA_VERSION, Profile, load_profile


def _trained(steps=12, **kwargs):
    m = small_model()
    opt = KitsuneOptimizer(torch.optim.AdamW(m.parameters()), **kwargs)
    train(m, opt, batches(steps))
    return opt


def _summary_text(opt) -> str:
    buf = io.StringIO()
    opt.print_summary(console=Console(file=buf, width=140, color_system=None))
    return buf.getvalue()


def test_metrics_are_typed_and_count_steps():
    opt = _trained(12, profile=True)
    metrics = opt.profiler.get_metrics()
    assert metrics.steps_timed == 12 and metrics.timing == "host_clock"
    # the warm-up's 10 steps (sample_after) are left out once a later one is timed
    assert metrics.step_time.count == 12 - 10 and metrics.warmup_left_out == 10
    assert 0 < metrics.step_time.min_ms <= metrics.step_time.p50_ms <= metrics.step_time.p90_ms
    assert metrics.step_time.p90_ms <= metrics.step_time.max_ms


def test_records_carry_increasing_host_start_times():
    records = _trained(6, profile=True).profiler.records
    starts = [r.host_start_us for r in records]
    assert all(s is not None and s >= 0 for s in starts)
    for a, b in zip(records, records[1:], strict=False):  # each step starts after the previous one ended
        assert b.host_start_us >= a.host_start_us + a.host_ms * 1e3
    assert all(r.device_start_us is None for r in records)  # CPU: no device clock


def test_a_post_hook_that_raises_keeps_the_steps_record():
    """The wrapped optimizer's post-hook raises after the update (torch applies the step and raises): the step
    counts, and its record is kept. It was lost (the profiler's stop ran after the hooks), and on a GPU a probe
    step's set-up (sync debug mode, a torch.profiler session, a warnings catcher) was never undone."""
    m = small_model()
    base = torch.optim.SGD(m.parameters(), lr=1e-2)
    opt = KitsuneOptimizer(base, profile=True)
    calls = {"n": 0}

    def post(*_):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("post-hook")

    base.register_step_post_hook(post)
    for i, (x, y) in enumerate(batches(6)):
        torch.nn.functional.mse_loss(m(x), y).backward()
        if i == 2:
            with pytest.raises(RuntimeError, match="post-hook"):
                opt.step()
        else:
            opt.step()
        opt.zero_grad()
    assert opt.step_count == 6
    assert [r.step for r in opt.profiler.records] == [1, 2, 3, 4, 5, 6]


def test_profiler_is_none_when_off():
    assert _trained(2).profiler is None


def test_time_stats_quantiles():
    stats = TimeStats.of([float(v) for v in range(1, 11)])
    assert stats.p50_ms == pytest.approx(5.5) and stats.p90_ms == pytest.approx(9.1)
    assert stats.mean_ms == pytest.approx(5.5) and stats.min_ms == 1 and stats.max_ms == 10
    assert TimeStats.of([]) is None


def test_max_step_records_keeps_the_latest():
    m = small_model()
    config = KitsuneConfig(profiler=ProfilerConfig(enabled=True, max_step_records=5))
    opt = KitsuneOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), config=config)
    train(m, opt, batches(9))
    assert [r.step for r in opt.profiler.records] == [5, 6, 7, 8, 9]
    assert opt.profiler.get_metrics().steps_timed == 9


def test_reset_forgets_records():
    opt = _trained(4, profile=True)
    opt.profiler.reset()
    assert opt.profiler.get_metrics().step_time is None


def test_summary_lists_subsystems_reasons_and_timings():
    text = _summary_text(_trained(5, profile=True))
    assert "AdamW" in text and "5 steps" in text
    for name in ("profiler", "amp", "fusion", "streams", "graphs", "memory"):
        assert name in text
    assert "enable_fusion=False" in text and "enable_amp=False" in text
    assert "step time (5 steps timed, host clock)" in text and "p50" in text


def test_summary_without_profiling_says_how_to_turn_it_on():
    text = _summary_text(_trained(2))
    assert "pass profile=True" in text


def test_save_profile_json_contents(tmp_path):
    opt = _trained(7, profile=True)
    path = opt.save_profile(tmp_path / "sub" / "profile.json")
    data = json.loads(path.read_text())
    assert data["schema_version"] == SCHEMA_VERSION
    assert data["optimizer"] == "AdamW" and data["step_count"] == 7
    env = data["environment"]
    assert env["torch"] == torch.__version__ and env["device"] == "cpu" and env["python"]
    assert data["config"]["profiler"]["enabled"] is True
    names = {s["name"] for s in data["subsystems"]}
    assert names == {"profiler", "shard", "amp", "memory", "fusion", "streams", "graphs"}
    inactive = {s["name"]: s["reason"] for s in data["subsystems"] if not s["active"]}
    assert inactive["fusion"] == "enable_fusion=False"
    assert [s["step"] for s in data["steps"]] == list(range(1, 8))
    assert data["metrics"]["step_time"]["count"] == 7
    again = load_profile(path)
    assert isinstance(again, Profile) and again.step_count == 7


def test_profile_without_profiling_has_no_timings_and_says_so_where_it_is_saved(tmp_path):
    opt = _trained(3)
    with pytest.warns(UserWarning, match=r"p\.json holds the environment, config and plan but no step timings") as w:
        path = opt.save_profile(tmp_path / "p.json")
    assert [Path(x.filename).name for x in w] == [Path(__file__).name]  # the caller's line
    data = json.loads(path.read_text())
    assert data["metrics"] is None and data["steps"] == []
    prof = next(s for s in data["subsystems"] if s["name"] == "profiler")
    assert prof["active"] is False and prof["reason"] == "profile=False"


def test_profile_json_schema_is_published():
    schema = Profile.model_json_schema()
    assert {"schema_version", "environment", "config", "subsystems", "steps"} <= set(schema["properties"])
    published = Path(__file__).resolve().parents[2] / "docs" / "profile-schema.json"
    expected = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    assert published.read_text() == expected, "docs/profile-schema.json is stale: regenerate it (see docs/profiler.md)"


def test_gpu_only_request_on_cpu_warns_once_and_shows_inactive():
    m = small_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = KitsuneOptimizer(torch.optim.AdamW(m.parameters()), enable_fusion=True)
        train(m, opt, batches(3))
    fusion_warnings = [w for w in caught if "fusion was asked for" in str(w.message)]
    assert len(fusion_warnings) == 1
    fusion = next(s for s in opt.subsystem_status() if s["name"] == "fusion")
    assert fusion["active"] is False and fusion["reason"]


@pytest.mark.cuda
def test_cuda_events_time_steps():
    m = small_model().cuda()
    opt = KitsuneOptimizer(torch.optim.AdamW(m.parameters()), profile=True)
    for _ in range(5):
        m(torch.randn(4, 7, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.profiler.close()  # the NVML sampler's thread
    metrics = opt.profiler.get_metrics()
    assert metrics.timing == "cuda_events" and metrics.step_time.count == 5 and metrics.step_time.min_ms > 0
    text = _summary_text(opt)
    assert "CUDA events" in text
    records = opt.profiler.records
    # the device runs the steps in order, each after the last one ended (one stream's order; the slack covers the
    # events' resolution, about half a microsecond a reading). The device and host clocks are not compared: how far
    # apart they read depends on when the host thread runs (that arithmetic is checked on fake events in test_cost)
    for a, b in zip(records, records[1:], strict=False):
        assert b.device_start_us >= a.device_start_us + a.step_ms * 1e3 - 5.0
    assert all(math.isfinite(r.device_start_us) for r in records), records


@pytest.mark.cuda
def test_cuda_events_time_one_step_in_n_past_the_windows():
    m = small_model().cuda()
    config = _sampled_config(sample_after=0, probe_steps=0, device_time_every=4)
    opt = KitsuneOptimizer(torch.optim.AdamW(m.parameters()), config=config)
    for _ in range(13):
        m(torch.randn(4, 7, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
    records = opt.profiler.records
    assert [r.step for r in records] == list(range(1, 14)) and all(r.host_ms > 0 for r in records)
    timed = [r for r in records if r.step_ms is not None]
    assert [r.step for r in timed] == [1, 4, 8, 12] and all(r.step_ms > 0 for r in timed)
    assert all(r.device_start_us is None for r in records if r.step_ms is None)
    for a, b in zip(timed, timed[1:], strict=False):  # in order (the slack: the events' resolution)
        assert b.device_start_us >= a.device_start_us + a.step_ms * 1e3 - 5.0
    metrics = opt.profiler.get_metrics()
    assert metrics.step_time.count == 4 and metrics.host_time.count == 13


def _sampled_config(**profiler) -> KitsuneConfig:
    from kitsune import FusionConfig

    return KitsuneConfig(
        fusion=FusionConfig(enabled=True), profiler=ProfilerConfig(enabled=True, nvml_interval_s=0, **profiler)
    )


@pytest.mark.filterwarnings("ignore:kitsune. fusion was asked for")
def test_cpu_comparison_is_not_applicable_when_kitsune_runs_the_wrapped_step():
    # on a CPU without the Triton interpreter every param goes to the wrapped optimizer's own step
    opt = _trained(30, config=_sampled_config(sample_after=2, compare_steps=3))
    metrics = opt.profiler.get_metrics()
    assert metrics.comparison.status == "not_applicable" and metrics.comparison.speedup is None
    assert metrics.probe.status == "unavailable" and metrics.probe.launches_per_step is None
    assert metrics.step_time.count == 30 - 2  # nothing was replaced by a baseline step; the warm-up left out
    text = " ".join(_summary_text(opt).split())
    assert "pass-through: AdamW's own step updated every param" in text  # said once, at the top
    assert "nothing to compare" not in text


@pytest.mark.cuda
def test_probe_and_live_comparison_on_gpu():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in (4096, 1000, 7, 65536)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref = torch.optim.AdamW(twins, lr=1e-2, weight_decay=0.1)  # torch's default (foreach) implementation
    opt = KitsuneOptimizer(
        torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
        config=_sampled_config(sample_after=3, probe_steps=2, compare_steps=6, device_time_every=1),
    )
    syncs = torch.ones((), device="cuda")
    for step in range(30):
        for p, t in zip(params, twins, strict=True):
            p.grad = torch.randn_like(p)
            t.grad = p.grad.clone()
        if step == 12:  # inside the baseline stretch: steps moved to the host for torch's foreach path
            assert all(opt.state[p]["step"].device.type == "cpu" for p in params)
        if step == 4:  # a probe step: a sync inside step() is caught and located

            def sync(*_):  # a host sync before the step (its return value must be None, as for torch's hooks)
                syncs.item()

            handle = opt.base_optimizer.register_step_pre_hook(sync)
        opt.step()
        ref.step()
        if step == 4:
            handle.remove()
    for p, t in zip(params, twins, strict=True):
        torch.testing.assert_close(p, t, atol=1e-5, rtol=1e-5)
        assert opt.state[p]["step"].device.type == "cuda" and opt.state[p]["step"].item() == 30
    metrics = opt.profiler.get_metrics()
    probe = metrics.probe
    assert probe.status == "measured" and probe.steps == 2
    assert probe.syncs_per_step == 0.5 and any("test_profiler.py" in s for s in probe.sync_sites), probe
    assert 1 <= probe.launches_per_step <= 4, probe  # the fused launch, plus at most a few small uploads
    # measured, not asserted against a rate (another process's copies on a shared GPU would slow it)
    assert math.isfinite(probe.copy_bandwidth_gbs) and probe.copy_bandwidth_gbs > 0
    assert metrics.floor_ms > 0 and 0 < metrics.pct_of_floor
    assert metrics.bytes_per_step == 28 * sum(p.numel() for p in params)
    cmp = metrics.comparison
    assert cmp.status == "measured" and cmp.kitsune.count == 5 and cmp.baseline_time.count == 5
    assert cmp.speedup > 0 and "foreach=None" in cmp.baseline
    # the 3 warm-up steps, the 2 probe steps and the 6 compared stay out of the statistics
    assert metrics.step_time.count == 30 - 3 - 2 - 6 and metrics.warmup_left_out == 3
    text = _summary_text(opt)
    assert "live comparison" in text and "kernel launch" in text and "bandwidth floor" in text
    assert f"runs at {metrics.pct_of_floor:.0f}% of that speed (floor / median)" in " ".join(text.split())


@pytest.mark.cuda
def test_probe_times_each_phase_with_amp_clip_and_graphs():
    from kitsune import AMPConfig, FusionConfig, GradConfig

    params = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in (1 << 20, 4096, 77)]
    config = KitsuneConfig(
        fusion=FusionConfig(enabled=True),
        amp=AMPConfig(dtype=torch.float16),
        grads=GradConfig(max_norm=1.0, zero_in_step=True),
        profiler=ProfilerConfig(enabled=True, nvml_interval_s=0, sample_after=6, probe_steps=2, compare_steps=0),
    )
    opt = KitsuneOptimizer(torch.optim.AdamW(params), config=config)
    for _ in range(12):
        opt.backward(sum((p * torch.randn_like(p)).sum() for p in params))
        opt.step()
        opt.zero_grad()
    probe = opt.profiler.get_metrics().probe
    assert probe.status == "measured" and probe.phases_ms is not None
    assert list(probe.phases_ms) == ["unscale", "norm", "update", "scale_update"], probe.phases_ms
    # every phase timed (their sizes are the bench's business: a comparison here failed under parallel workers)
    assert all(ms > 0 and math.isfinite(ms) for ms in probe.phases_ms.values()), probe.phases_ms
    graphs = opt._subsystem("graphs").report()
    assert graphs["replays"] >= 6 and "probe" in graphs["last_eager_reason"]  # graphed around the probe steps
    assert "device ms per phase" in _summary_text(opt)
