"""Step timing. Nothing here synchronises the device during training: CUDA events are read lazily."""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Literal

import torch
from pydantic import BaseModel

from kitsune.config import ProfilerConfig
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
            p50_ms=_quantile(ordered, 0.5),
            p90_ms=_quantile(ordered, 0.9),
            min_ms=ordered[0],
            max_ms=ordered[-1],
        )


def _quantile(ordered: list[float], q: float) -> float:
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
        self._pending: deque[tuple[int, torch.cuda.Event, torch.cuda.Event, float]] = deque()
        self._timed = 0
        self._cuda = False
        self._t0 = 0
        self._start_event: torch.cuda.Event | None = None
        if config.enabled:
            self.activate()
        else:
            self.deactivate("profile=False")

    def plan(self, opt: KitsuneOptimizer) -> None:
        params = [p for g in opt.param_groups for p in g["params"]]
        self._cuda = bool(params) and params[0].is_cuda and torch.cuda.is_available()

    def before_step(self, ctx: StepContext) -> None:
        if self._cuda:
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()
        self._t0 = time.perf_counter_ns()

    def after_step(self, ctx: StepContext) -> None:
        host_ms = (time.perf_counter_ns() - self._t0) / 1e6
        self._timed += 1
        if self._cuda and self._start_event is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((ctx.step, self._start_event, end, host_ms))
            if len(self._pending) > 64:
                self._collect(block=False)
        else:
            self._records.append(StepRecord(step=ctx.step, step_ms=host_ms, host_ms=host_ms))

    def _collect(self, block: bool) -> None:
        """Turn finished CUDA event pairs into records; with block=True wait for all of them."""
        while self._pending:
            step, start, end, host_ms = self._pending[0]
            if not block and not end.query():
                break
            end.synchronize()
            self._records.append(StepRecord(step=step, step_ms=start.elapsed_time(end), host_ms=host_ms))
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
        """Forget every record (e.g. after warm-up)."""
        self._collect(block=True)
        self._records.clear()
        self._timed = 0

    def report(self) -> dict[str, object]:
        return {"steps_timed": self._timed, "timing": "cuda_events" if self._cuda else "host_clock"}
