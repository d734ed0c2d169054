"""The NVML sampler, on CPU through a fake ``pynvml`` module, and on a real GPU (cuda marker)."""

from __future__ import annotations

import gc
import math
import sys
import threading
import time
import types
from types import SimpleNamespace

import pytest
import torch

from kitsune.config import ProfilerConfig
from kitsune.profiler import Profiler
from kitsune.profiler import nvml as nvml_mod
from kitsune.profiler.nvml import NvmlReport, NvmlSampler, normalize_uuid


class FakeNVMLError(Exception):
    pass


class FakeNotSupported(FakeNVMLError):
    pass


def make_fake_nvml(uuids=(b"GPU-AAA-111", "GPU-bbb-222"), init_error: str | None = None) -> types.ModuleType:
    """A stand-in for pynvml: devices with the given UUIDs, utilisation counting up, power not supported."""
    m = types.ModuleType("pynvml")
    m.calls = {"init": 0, "shutdown": 0, "power": 0}
    m.NVMLError = FakeNVMLError
    m.NVMLError_NotSupported = FakeNotSupported
    m.NVML_TEMPERATURE_GPU, m.NVML_CLOCK_SM = 0, 1
    ticks = iter(range(10**9))

    def init():
        if init_error:
            raise FakeNVMLError(init_error)
        m.calls["init"] += 1

    def shutdown():
        m.calls["shutdown"] += 1

    def power(handle):
        m.calls["power"] += 1
        raise FakeNotSupported("Not Supported")

    m.nvmlInit, m.nvmlShutdown = init, shutdown
    m.nvmlDeviceGetCount = lambda: len(uuids)
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetUUID = lambda h: uuids[h]
    m.nvmlDeviceGetName = lambda h: f"Fake GPU {h}".encode()
    m.nvmlDeviceGetUtilizationRates = lambda h: SimpleNamespace(gpu=10 * (next(ticks) % 10), memory=0)
    m.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(used=3 * 2**30, total=80 * 2**30, free=77 * 2**30)
    m.nvmlDeviceGetPowerUsage = power
    m.nvmlDeviceGetTemperature = lambda h, sensor: 55
    m.nvmlDeviceGetClockInfo = lambda h, clock: 1980
    return m


@pytest.fixture
def fake_nvml(monkeypatch):
    fake = make_fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(nvml_mod, "cuda_uuid", lambda index: "bbb-222")  # cuda:0 is NVML's device 1
    return fake


def _threads() -> set[threading.Thread]:
    gc.collect()  # samplers that earlier tests dropped stop when collected
    return set(threading.enumerate())


def _wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_sampler_samples_stats_and_joins_its_thread(fake_nvml):
    before = _threads()
    sampler = NvmlSampler(0, interval_s=0.002)
    assert sampler.start() and sampler.available and sampler.running
    assert sampler.start()  # already running: no second thread
    assert len(_threads() - before) == 1
    _wait_for(lambda: len(sampler.samples) >= 5)
    sampler.stop()
    assert _threads() == before and not sampler.running
    assert fake_nvml.calls["init"] == fake_nvml.calls["shutdown"] == 1

    report = sampler.report()
    assert report.available and report.device == "Fake GPU 1" and report.uuid == "bbb-222"
    samples = report.samples
    assert [s.t_us for s in samples] == sorted(s.t_us for s in samples)
    utils = [s.util_pct for s in samples]
    assert report.stats["util_pct"].max == max(utils)
    assert report.stats["util_pct"].mean == pytest.approx(sum(utils) / len(utils))
    assert report.stats["mem_used_mib"].mean == 3 * 1024 and report.stats["temp_c"].max == 55
    assert report.stats["sm_clock_mhz"].mean == 1980
    # power is not supported: absent from every sample and from the stats, and asked only once
    assert all(s.power_w is None for s in samples) and "power_w" not in report.stats
    assert fake_nvml.calls["power"] == 1


def test_samples_are_bounded_and_clear(fake_nvml):
    sampler = NvmlSampler(0, interval_s=0.001, max_samples=3)
    sampler.start()
    _wait_for(lambda: sampler.report().dropped >= 3)
    sampler.stop()
    assert len(sampler.samples) == 3
    sampler.clear()
    assert sampler.samples == [] and sampler.stats() == {}


def test_the_kept_samples_are_the_newest_in_order_with_unread_fields_left_out():
    """The buffer past its size: the newest samples, oldest first, each field as read (a NaN, a field the GPU did
    not report, comes back as None), and the count of those dropped."""
    buffer = nvml_mod._Buffer(10)
    for k in range(25):
        buffer.add((10.0 * k, k % 7, 1024.0 + k, math.nan, 40.0 + k % 3, 1980.0))
    samples, dropped = buffer.snapshot()
    assert dropped == 15 and [s.t_us for s in samples] == [10.0 * k for k in range(15, 25)]
    assert [s.util_pct for s in samples] == [k % 7 for k in range(15, 25)]
    assert all(s.power_w is None and s.sm_clock_mhz == 1980.0 for s in samples)
    assert [s.mem_used_mib for s in samples] == [1024.0 + k for k in range(15, 25)]
    buffer.add((999.0, 1, 2, 3, 4, 5))
    assert buffer.snapshot()[0][-1].t_us == 999.0 and buffer.snapshot()[0][0].t_us == 160.0


def test_the_profiler_keeps_nvml_max_samples(fake_nvml):
    prof = Profiler(ProfilerConfig(enabled=True, nvml_interval_s=0.001, nvml_max_samples=4))
    prof._plan_nvml(0)
    _wait_for(lambda: prof.nvml.dropped >= 4)
    prof.close()
    report = prof.nvml
    assert len(report.samples) == 4 and report.dropped >= 4
    assert [s.t_us for s in report.samples] == sorted(s.t_us for s in report.samples)


def test_sampler_thread_stops_when_the_sampler_is_collected(fake_nvml):
    before = _threads()
    sampler = NvmlSampler(0, interval_s=0.002)
    sampler.start()
    del sampler
    gc.collect()
    assert _threads() == before
    assert fake_nvml.calls["shutdown"] == 1


@pytest.mark.parametrize(
    "setup, reason",
    [
        (lambda mp: mp.setitem(sys.modules, "pynvml", None), "nvidia-ml-py is not installed"),
        (
            lambda mp: mp.setitem(sys.modules, "pynvml", make_fake_nvml(init_error="Driver Not Loaded")),
            "NVML init failed: Driver Not Loaded",
        ),
        (
            lambda mp: mp.setitem(sys.modules, "pynvml", make_fake_nvml(uuids=("GPU-ccc",))),
            "no NVML device has the UUID of cuda:0 (bbb-222)",
        ),
    ],
)
def test_unavailable_says_why_and_never_raises(monkeypatch, setup, reason):
    monkeypatch.setattr(nvml_mod, "cuda_uuid", lambda index: "GPU-BBB-222")
    setup(monkeypatch)
    before = _threads()
    sampler = NvmlSampler(0, interval_s=0.01)
    assert sampler.start() is False and not sampler.available
    assert reason in sampler.reason
    assert _threads() == before
    assert sampler.stats() == {} and sampler.samples == []
    report = sampler.report()
    assert report.model_dump(mode="json") == {"available": False, "reason": sampler.reason}
    sampler.stop()  # harmless
    fake = sys.modules.get("pynvml")
    if fake is not None:  # every successful init was shut down again
        assert fake.calls["init"] == fake.calls["shutdown"]


def test_uuid_forms_match():
    assert normalize_uuid(b"GPU-6EA3e4ea-d1e2") == normalize_uuid("6ea3e4ea-d1e2") == "6ea3e4ea-d1e2"
    assert normalize_uuid("MIG-abc") == "abc"
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="interval_s must be a finite number of seconds greater than 0"):
            NvmlSampler(0, interval_s=bad)


def test_report_round_trips_through_json():
    report = NvmlReport(
        available=True, device="Fake", interval_s=0.5, samples=[{"t_us": 1.5, "util_pct": 40.0}], stats={}
    )
    assert NvmlReport.model_validate_json(report.model_dump_json()) == report
    gone = NvmlReport.unavailable("no GPU")
    assert NvmlReport.model_validate_json(gone.model_dump_json()) == gone


def _cuda_profiler(interval_s: float) -> Profiler:
    return Profiler(ProfilerConfig(enabled=True, max_step_records=100, nvml_interval_s=interval_s))


def test_profiler_on_cpu_reports_why_there_is_no_telemetry():
    prof = _cuda_profiler(0.5)
    prof.plan([torch.zeros(2)], "torch.optim.sgd.SGD.step", None)
    assert prof.nvml.model_dump(mode="json") == {"available": False, "reason": "params are not on a CUDA device"}


def test_profiler_runs_the_sampler_for_a_cuda_device(fake_nvml):
    before = _threads()
    prof = _cuda_profiler(0.002)
    prof._plan_nvml(0)  # what plan() does for params on cuda:0
    _wait_for(lambda: len(prof.nvml.samples) >= 2)
    prof.close()
    assert _threads() == before
    assert prof.nvml.available and prof.nvml.stats["util_pct"].max >= 0
    prof.reset()
    assert prof.nvml.samples == []

    off = _cuda_profiler(0.0)
    off._plan_nvml(0)
    assert off.nvml.reason == "nvml_interval_s=0" and _threads() == before


@pytest.mark.cuda
def test_real_sampler_on_the_gpu(tmp_path):
    from helpers import small_model

    from kitsune import KitsuneOptimizer
    from kitsune.profiler.trace import export_chrome_trace

    before = _threads()
    sampler = NvmlSampler(torch.cuda.current_device(), interval_s=0.02)
    assert sampler.start(), sampler.reason
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(20):
        x = x @ x / 2048
    torch.cuda.synchronize()
    _wait_for(lambda: len(sampler.samples) >= 3)
    sampler.stop()
    assert _threads() == before
    stats = sampler.stats()
    assert stats["mem_used_mib"].max > 0 and "util_pct" in stats and "sm_clock_mhz" in stats
    assert sampler.uuid == normalize_uuid(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)

    m = small_model().cuda()
    opt = KitsuneOptimizer(torch.optim.AdamW(m.parameters()), profile=True)
    try:
        for _ in range(5):
            m(torch.randn(4, 7, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
        _wait_for(lambda: len(opt.profiler.nvml.samples) >= 1)
        data = opt.save_profile(tmp_path / "p.json").read_text()
        assert '"available": true' in data
        trace = export_chrome_trace(opt, tmp_path / "t.json").read_text()
        assert '"ph": "C"' in trace
    finally:
        opt.profiler.close()
    assert _threads() == before
