"""Step timing. Nothing here synchronises the device during training: CUDA events are read lazily.

On CUDA the profiler also runs the NVML sampler (`kitsune.profiler.nvml`) for GPU telemetry.

After ``sample_after`` steps come two sampled windows, and their steps stay out of the step-time statistics:

1. the probe (CUDA only, ``probe_steps``): launches, copies and host syncs inside ``step()`` are counted and the
   copy bandwidth is measured (`kitsune.profiler.probe`);
2. the live comparison (``compare_steps`` = N): N steps of kitsune (the reference), then N steps in which the
   wrapped optimizer's own step updates every param (the baseline; training stays exact, the same optimizer
   math runs on the same params and state). The first step of each half settles (the GPU may be idle after the
   window's set-up) and is not counted. The speedup shown is baseline median / reference median, with the
   spread from their 10th and 90th percentiles.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Literal

import torch
from pydantic import BaseModel

from kitsune.config import ProfilerConfig
from kitsune.profiler.nvml import NvmlReport, NvmlSampler
from kitsune.profiler.probe import Probe, ProbeReport
from kitsune.subsystem import StepState, Subsystem


class StepRecord(BaseModel):
    """One timed step."""

    step: int
    """Step number (1-based, counted by the wrapper)."""
    step_ms: float
    """Time of the whole step: device time between CUDA events on GPU, wall time on CPU."""
    host_ms: float
    """Host (Python + launch) time spent inside ``step()``."""
    host_start_us: float | None = None
    """When ``step()`` began on the host, in microseconds since the profiler started (None in old profiles)."""
    device_start_us: float | None = None
    """When the step's work began on the GPU, on the same clock as ``host_start_us`` (CUDA only)."""
    mode: Literal["kitsune", "probe", "baseline"] = "kitsune"
    """``probe``: a probe step (slowed by counting); ``baseline``: the wrapped optimizer's own step ran (the live
    comparison). Only ``kitsune`` steps enter the step-time statistics."""


class TimeStats(BaseModel):
    """Summary statistics of a series of times in milliseconds."""

    count: int
    mean_ms: float
    p10_ms: float | None = None
    p50_ms: float
    p90_ms: float
    min_ms: float
    max_ms: float

    @classmethod
    def of(cls, values: list[float]) -> TimeStats | None:
        if not values:
            return None
        ordered = sorted(values)
        return cls(
            count=len(ordered),
            mean_ms=sum(ordered) / len(ordered),
            p10_ms=quantile(ordered, 0.1),
            p50_ms=quantile(ordered, 0.5),
            p90_ms=quantile(ordered, 0.9),
            min_ms=ordered[0],
            max_ms=ordered[-1],
        )


def quantile(ordered: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class Comparison(BaseModel):
    """The live comparison: kitsune's step against the wrapped optimizer's own step, on the user's run."""

    status: Literal["measured", "pending", "off", "not_applicable"]
    reason: str | None = None
    """Why there is no figure (status other than "measured")."""
    baseline: str | None = None
    """What ran in the baseline steps, e.g. ``torch.optim.adamw.AdamW.step (foreach=None, fused=None)``."""
    kitsune: TimeStats | None = None
    """Step times of the reference steps (kitsune), settling step excluded."""
    baseline_time: TimeStats | None = None
    """Step times of the baseline steps, settling step excluded."""
    kitsune_host: TimeStats | None = None
    baseline_host: TimeStats | None = None
    speedup: float | None = None
    """Baseline median / kitsune median: above 1, kitsune's step is faster."""
    speedup_low: float | None = None
    """Baseline 10th percentile / kitsune 90th percentile: the pessimistic end of the spread."""
    speedup_high: float | None = None
    """Baseline 90th percentile / kitsune 10th percentile: the optimistic end."""
    host_speedup: float | None = None
    """The same ratio of the medians of host time inside ``step()``."""


class ProfilerMetrics(BaseModel):
    """What [`Profiler.get_metrics`][kitsune.profiler.Profiler.get_metrics] returns."""

    steps_timed: int
    """Steps timed since the profiler started (including any no longer kept in ``records``)."""
    timing: Literal["cuda_events", "host_clock"]
    """How ``step_time`` was measured."""
    step_time: TimeStats | None
    """Statistics of the kept per-step times."""
    host_time: TimeStats | None
    """Statistics of the kept per-step host times."""
    probe: ProbeReport | None = None
    """Launches, copies and syncs per step and the copy bandwidth, from the probe steps (None in old profiles)."""
    comparison: Comparison | None = None
    """The live-measured speedup over the wrapped optimizer's own step (None in old profiles)."""
    bytes_per_step: int | None = None
    """Bytes the optimizer update must move per step (params, grads and state), from the plan."""
    floor_ms: float | None = None
    """``bytes_per_step`` / the measured copy bandwidth: the time of a step at the memory's copy rate."""
    pct_of_floor: float | None = None
    """100 x ``floor_ms`` / the median step time (an AMP unscale or a clip moves more bytes than counted)."""


class Profiler(Subsystem):
    """Times every step: first to start, last to stop, so the whole step (fallbacks included) is covered."""

    name = "profiler"

    def __init__(self, config: ProfilerConfig) -> None:
        super().__init__()
        self.config = config
        self._records: deque[StepRecord] = deque(maxlen=config.max_step_records)
        # (step, start event, end event, host_ms, host_start_us, mode, window) of steps whose events were not read
        self._pending: deque[tuple[int, torch.cuda.Event, torch.cuda.Event, float, float, str, str | None]] = deque()
        self._timed = 0
        self._cuda = False
        self._device = torch.device("cpu")
        self._t0 = 0
        self._start_event: torch.cuda.Event | None = None
        self._free_events: list[torch.cuda.Event] = []
        self._origin_ns = time.perf_counter_ns()
        # a CUDA event recorded on an idle GPU at a known host time: maps device event times onto the host clock
        self._anchor: tuple[torch.cuda.Event, float] | None = None
        self._sampler: NvmlSampler | None = None
        self._nvml_reason = "params are not on a CUDA device"
        self._baseline_name: str | None = None
        self._bytes_per_step: int | None = None
        self._reset_windows()
        if config.enabled:
            self.activate()
        else:
            self.deactivate("profile=False")

    def _reset_windows(self) -> None:
        self._index = 0  # steps begun since the profiler started (or was reset): the windows' clock
        self._mode = "kitsune"
        self._window: str | None = None  # "reference" or "baseline" inside the comparison
        self._probe = Probe(self.config.probe_steps)
        self._compared: dict[str, list[StepRecord]] = {"reference": [], "baseline": []}
        self._comparable: bool | None = None

    def plan(self, params: list[torch.Tensor], baseline: str, bytes_per_step: int | None) -> None:
        """Time steps over ``params``; ``baseline`` names the step the live comparison runs (`describe_step`),
        ``bytes_per_step`` is what the plan's updates must move (the bandwidth floor's numerator)."""
        self._baseline_name, self._bytes_per_step = baseline, bytes_per_step
        self._cuda = bool(params) and params[0].is_cuda and torch.cuda.is_available()
        self._device = params[0].device if params else torch.device("cpu")
        if not self.active:
            return
        if self._cuda and self._anchor is None and not torch.cuda.is_current_stream_capturing():
            # once, at construction (not during training): the GPU ran the anchor between record() and the end
            # of the sync; taking the later bound never shows a step on the device before the host launched it
            for _ in range(2):  # the first round pays for lazy event/stream set-up
                anchor = torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                anchor.record()
                torch.cuda.synchronize()
                anchor_us = (time.perf_counter_ns() - self._origin_ns) / 1e3
            self._anchor = (anchor, anchor_us)
        self._plan_nvml(params[0].device.index if self._cuda else None)

    def _plan_nvml(self, device_index: int | None) -> None:
        interval = self.config.nvml_interval_s
        if device_index is None or interval <= 0:
            self.close()
            self._sampler = None
            self._nvml_reason = "params are not on a CUDA device" if device_index is None else "nvml_interval_s=0"
            return
        if self._sampler is not None and self._sampler.device_index == device_index:
            return
        self.close()
        self._sampler = NvmlSampler(device_index, interval_s=interval, origin_ns=self._origin_ns)
        self._sampler.start()  # when NVML is unavailable this only records why

    def close(self) -> None:
        """Stop the NVML sampler's thread (it also stops when the profiler is garbage-collected)."""
        if self._sampler is not None:
            self._sampler.stop()

    @property
    def nvml(self) -> NvmlReport:
        """GPU telemetry sampled so far, or why there is none."""
        if self._sampler is None:
            return NvmlReport.unavailable(self._nvml_reason)
        return self._sampler.report()

    # -- the sampled windows -------------------------------------------------------------------------------------
    def _windows(self) -> tuple[int, int, int]:
        """(last warm-up step, last probe step, last reference step) on the profiler's own step clock."""
        warm = self.config.sample_after
        probe = warm + (self.config.probe_steps if self._cuda else 0)
        return warm, probe, probe + self.config.compare_steps

    def _phase(self, index: int) -> str:
        warm, probe, reference = self._windows()
        if index <= warm:
            return "kitsune"
        if index <= probe:
            return "probe"
        if index <= reference:
            return "reference"
        if index <= reference + self.config.compare_steps:
            return "baseline"
        return "kitsune"

    def wants_baseline(self, comparable: bool) -> bool:
        """Asked by the orchestrator before each step: should the wrapped optimizer's own step run this one?

        ``comparable``: whether kitsune executes any update itself (otherwise both sides would be the same step).
        """
        phase = self._phase(self._index + 1)
        if phase in ("reference", "baseline"):
            self._comparable = comparable if self._comparable is None else self._comparable and comparable
        return phase == "baseline" and bool(self._comparable)

    def start(self, s: StepState) -> None:
        """The step begins: first of all (the whole step, fallbacks included, is timed)."""
        if not self.active:
            return
        self._index += 1
        phase = self._phase(self._index)
        self._mode = "baseline" if s.baseline else ("probe" if phase == "probe" else "kitsune")
        self._window = phase if phase in ("reference", "baseline") and self._comparable else None
        if self._mode == "probe":
            self._probe.begin(self._device)
            s.phases = self._probe.timer  # the stages mark the phase boundaries
        if self._cuda:
            self._start_event = self._event()
            self._start_event.record()
        self._t0 = time.perf_counter_ns()

    def _event(self) -> torch.cuda.Event:
        # events are reused once read: creating two per step costs more host time than recording them
        return self._free_events.pop() if self._free_events else torch.cuda.Event(enable_timing=True)

    def stop(self, s: StepState) -> None:
        """The step is done: last of all."""
        if not self.active:
            return
        host_ms = (time.perf_counter_ns() - self._t0) / 1e6
        start_us = (self._t0 - self._origin_ns) / 1e3
        self._timed += 1
        if self._cuda and self._start_event is not None:
            end = self._event()
            end.record()
            self._pending.append((s.step, self._start_event, end, host_ms, start_us, self._mode, self._window))
            if len(self._pending) > 64:
                self._collect(block=False)
        else:
            # model_construct: the values are ours and typed, so skip validation on the training path
            record = StepRecord.model_construct(
                step=s.step, step_ms=host_ms, host_ms=host_ms, host_start_us=start_us, mode=self._mode
            )
            self._keep(record, self._window)
        if self._mode == "probe":
            self._probe.complete()

    def abandon_step(self) -> None:
        """The step raised between [`start`][kitsune.profiler.Profiler.start] and
        [`stop`][kitsune.profiler.Profiler.stop]: undo what the probe changed."""
        if self.active and self._mode == "probe":
            self._probe.abandon()

    def _keep(self, record: StepRecord, window: str | None) -> None:
        self._records.append(record)
        if window is not None:
            self._compared[window].append(record)

    def _collect(self, block: bool) -> None:
        """Turn finished CUDA event pairs into records; with block=True wait for all of them."""
        while self._pending:
            step, start, end, host_ms, start_us, mode, window = self._pending[0]
            if not block and not end.query():
                break
            end.synchronize()
            device_us = None
            if self._anchor is not None:
                anchor, anchor_us = self._anchor
                device_us = anchor_us + anchor.elapsed_time(start) * 1e3
            record = StepRecord.model_construct(
                step=step,
                step_ms=start.elapsed_time(end),
                host_ms=host_ms,
                host_start_us=start_us,
                device_start_us=device_us,
                mode=mode,  # type: ignore[arg-type]
            )
            self._keep(record, window)
            self._pending.popleft()
            self._free_events += (start, end)

    @property
    def records(self) -> list[StepRecord]:
        """The kept per-step records (waits for outstanding CUDA events)."""
        self._collect(block=True)
        return list(self._records)

    def comparison(self) -> Comparison:
        """The live comparison as far as it has run (waits for outstanding CUDA events)."""
        n = self.config.compare_steps
        if n == 0:
            return Comparison(status="off", reason="compare_steps=0")
        _, probe, reference = self._windows()
        if self._comparable is False:
            return Comparison(
                status="not_applicable",
                reason="kitsune ran the wrapped optimizer's own step on every param: there is nothing to compare",
            )
        self._collect(block=True)
        ref, base = (self._compared[w][1:] for w in ("reference", "baseline"))  # the first step of each settles
        if self._index < reference + n or not ref or not base:
            return Comparison(
                status="pending",
                reason=f"the comparison runs at steps {probe + 1}-{reference + n} after the profiler starts "
                f"(sample_after={self.config.sample_after}); {self._index} step(s) so far",
                baseline=self._baseline_name,
            )
        k, b = TimeStats.of([r.step_ms for r in ref]), TimeStats.of([r.step_ms for r in base])
        kh, bh = TimeStats.of([r.host_ms for r in ref]), TimeStats.of([r.host_ms for r in base])
        assert k is not None and b is not None and kh is not None and bh is not None
        return Comparison(
            status="measured",
            baseline=self._baseline_name,
            kitsune=k,
            baseline_time=b,
            kitsune_host=kh,
            baseline_host=bh,
            speedup=_ratio(b.p50_ms, k.p50_ms),
            speedup_low=_ratio(b.p10_ms, k.p90_ms),
            speedup_high=_ratio(b.p90_ms, k.p10_ms),
            host_speedup=_ratio(bh.p50_ms, kh.p50_ms),
        )

    def probe_report(self) -> ProbeReport:
        if self.config.probe_steps == 0:
            return ProbeReport(status="off", reason="probe_steps=0")
        if not self._cuda:
            return ProbeReport(status="unavailable", reason="the probe counts CUDA launches and syncs: no CUDA params")
        return self._probe.report()

    def get_metrics(self) -> ProfilerMetrics:
        """Statistics of the steps timed so far (probe and baseline steps excluded), the probe and the comparison."""
        records = [r for r in self.records if r.mode == "kitsune"]
        step_time = TimeStats.of([r.step_ms for r in records])
        probe = self.probe_report()
        nbytes = self._bytes_per_step
        floor_ms = pct = None
        if nbytes and probe.copy_bandwidth_gbs:
            floor_ms = nbytes / (probe.copy_bandwidth_gbs * 1e9) * 1e3
            if step_time is not None and step_time.p50_ms > 0:
                pct = 100 * floor_ms / step_time.p50_ms
        return ProfilerMetrics(
            steps_timed=self._timed,
            timing="cuda_events" if self._cuda else "host_clock",
            step_time=step_time,
            host_time=TimeStats.of([r.host_ms for r in records]),
            probe=probe,
            comparison=self.comparison(),
            bytes_per_step=nbytes,
            floor_ms=floor_ms,
            pct_of_floor=pct,
        )

    def reset(self) -> None:
        """Forget every record and NVML sample (e.g. after warm-up); the sampled windows run again."""
        self._collect(block=True)
        self._records.clear()
        self._timed = 0
        self._reset_windows()
        if self._sampler is not None:
            self._sampler.clear()

    def report(self) -> dict[str, object]:
        return {"steps_timed": self._timed, "timing": "cuda_events" if self._cuda else "host_clock"}


def describe_step(opt: torch.optim.Optimizer) -> str:
    """``torch.optim.adamw.AdamW.step (foreach=None, fused=None)``: the step the comparison's baseline runs."""
    cls = type(opt)
    flags = ", ".join(f"{k}={opt.defaults[k]}" for k in ("foreach", "fused", "capturable") if k in opt.defaults)
    return f"{cls.__module__}.{cls.__qualname__}.step" + (f" ({flags})" if flags else "")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
