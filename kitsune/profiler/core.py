"""Step timing. Nothing here synchronises the device during training: CUDA events are read lazily.

On CUDA the profiler also runs the NVML sampler (:mod:`kitsune.profiler.nvml`) for GPU telemetry.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Literal

import torch
from pydantic import BaseModel

from kitsune.config import ProfilerConfig
from kitsune.profiler.nvml import NvmlReport, NvmlSampler
from kitsune.subsystem import StepContext, Subsystem

if TYPE_CHECKING:
    from kitsune.optimizer import KitsuneOptimizer


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


class TimeStats(BaseModel):
    """Summary statistics of a series of times in milliseconds."""

    count: int
    mean_ms: float
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


class ProfilerMetrics(BaseModel):
    """What :meth:`Profiler.get_metrics` returns."""

    steps_timed: int
    """Steps timed since the profiler started (including any no longer kept in ``records``)."""
    timing: Literal["cuda_events", "host_clock"]
    """How ``step_time`` was measured."""
    step_time: TimeStats | None
    """Statistics of the kept per-step times."""
    host_time: TimeStats | None
    """Statistics of the kept per-step host times."""


class Profiler(Subsystem):
    """Times every step: first to start, last to stop, so the whole step (fallbacks included) is covered."""

    name = "profiler"

    def __init__(self, config: ProfilerConfig) -> None:
        super().__init__()
        self.config = config
        self._records: deque[StepRecord] = deque(maxlen=config.max_step_records)
        # (step, start event, end event, host_ms, host_start_us) of steps whose events have not been read
        self._pending: deque[tuple[int, torch.cuda.Event, torch.cuda.Event, float, float]] = deque()
        self._timed = 0
        self._cuda = False
        self._t0 = 0
        self._start_event: torch.cuda.Event | None = None
        self._origin_ns = time.perf_counter_ns()
        # a CUDA event recorded on an idle GPU at a known host time: maps device event times onto the host clock
        self._anchor: tuple[torch.cuda.Event, float] | None = None
        self._sampler: NvmlSampler | None = None
        self._nvml_reason = "params are not on a CUDA device"
        if config.enabled:
            self.activate()
        else:
            self.deactivate("profile=False")

    def plan(self, opt: KitsuneOptimizer) -> None:
        params = [p for g in opt.param_groups for p in g["params"]]
        self._cuda = bool(params) and params[0].is_cuda and torch.cuda.is_available()
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

    def before_step(self, ctx: StepContext) -> None:
        if self._cuda:
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()
        self._t0 = time.perf_counter_ns()

    def after_step(self, ctx: StepContext) -> None:
        host_ms = (time.perf_counter_ns() - self._t0) / 1e6
        start_us = (self._t0 - self._origin_ns) / 1e3
        self._timed += 1
        if self._cuda and self._start_event is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((ctx.step, self._start_event, end, host_ms, start_us))
            if len(self._pending) > 64:
                self._collect(block=False)
        else:
            self._records.append(StepRecord(step=ctx.step, step_ms=host_ms, host_ms=host_ms, host_start_us=start_us))

    def _collect(self, block: bool) -> None:
        """Turn finished CUDA event pairs into records; with block=True wait for all of them."""
        while self._pending:
            step, start, end, host_ms, start_us = self._pending[0]
            if not block and not end.query():
                break
            end.synchronize()
            device_us = None
            if self._anchor is not None:
                anchor, anchor_us = self._anchor
                device_us = anchor_us + anchor.elapsed_time(start) * 1e3
            record = StepRecord(
                step=step,
                step_ms=start.elapsed_time(end),
                host_ms=host_ms,
                host_start_us=start_us,
                device_start_us=device_us,
            )
            self._records.append(record)
            self._pending.popleft()

    @property
    def records(self) -> list[StepRecord]:
        """The kept per-step records (waits for outstanding CUDA events)."""
        self._collect(block=True)
        return list(self._records)

    def get_metrics(self) -> ProfilerMetrics:
        """Statistics of the steps timed so far."""
        records = self.records
        return ProfilerMetrics(
            steps_timed=self._timed,
            timing="cuda_events" if self._cuda else "host_clock",
            step_time=TimeStats.of([r.step_ms for r in records]),
            host_time=TimeStats.of([r.host_ms for r in records]),
        )

    def reset(self) -> None:
        """Forget every record and NVML sample (e.g. after warm-up)."""
        self._collect(block=True)
        self._records.clear()
        self._timed = 0
        if self._sampler is not None:
            self._sampler.clear()

    def report(self) -> dict[str, object]:
        return {"steps_timed": self._timed, "timing": "cuda_events" if self._cuda else "host_clock"}
