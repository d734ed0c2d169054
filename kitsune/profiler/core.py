"""Step timing. Nothing here synchronises the device during training: CUDA events are read lazily.

On CUDA the profiler also runs the NVML sampler (`kitsune.profiler.nvml`) for GPU telemetry.

The first ``sample_after`` steps are the warm-up (Triton compiles, state is created, a CUDA graph is captured): once a
later step has been timed they stay out of the step-time statistics. After them come two sampled windows, and their
steps stay out of the statistics too:

1. the probe (CUDA only, ``probe_steps``): launches, copies and host syncs inside ``step()`` are counted and the
   copy bandwidth is measured (`kitsune.profiler.probe`);
2. the live comparison (``compare_steps`` = N): N steps of kitsune (the reference), then N steps in which the
   wrapped optimizer's own step updates every param (the baseline; training stays exact, the same optimizer
   math runs on the same params and state). The first step of each half settles (the GPU may be idle after the
   window's set-up) and is not counted. The speedup shown is baseline median / reference median, with the
   spread from their 10th and 90th percentiles.

Both windows run once (again after `Profiler.reset`), and the metrics say what share of the run's steps and time
each took (`WindowShare`). Outside them a step costs the profiler O(1) host work and builds no pydantic model: on
most steps two clock reads and three numbers appended to a list (`Profiler._marks`), turned into records in a batch
before the next step seen whole or a report; on one step in ``device_time_every``, one C call for the current stream
and two CUDA events from a pool recorded, its record a list whose device time is filled in when the events are read:
after every 64 such steps, the finished ones in one batch (on one stream a bisection finds them). Records stay plain
rows until a report asks for them. Those steps take the graphed executor's steady replay, as unprofiled ones do;
the windows' probe and baseline steps take the full path.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict

from kitsune.config import ProfilerConfig
from kitsune.profiler.nvml import NvmlReport, NvmlSampler
from kitsune.profiler.probe import Probe, ProbeReport
from kitsune.subsystem import StepState, Subsystem


class StepRecord(BaseModel):
    """One timed step."""

    model_config = ConfigDict(allow_inf_nan=False)  # a time is finite: a profile holding nan was edited by hand

    step: int
    """Step number (1-based, counted by the wrapper)."""
    step_ms: float | None
    """Time of the whole step: device time between CUDA events on GPU, wall time on CPU; None for a CUDA step whose
    device time was not sampled (``ProfilerConfig.device_time_every``)."""
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

    @property
    def figures(self) -> bool:
        """Whether the figures a report lays out are here: measured, with both sides' times (a file edited by hand
        may say measured and hold none)."""
        return self.status == "measured" and all(
            (self.kitsune, self.baseline_time, self.kitsune_host, self.baseline_host)
        )


class WindowShare(BaseModel):
    """How much of the run a sampled window took: its steps, and the host time it spanned."""

    window: Literal["probe", "comparison"]
    steps: int
    """Steps of the window that ran (the comparison's reference and baseline halves together)."""
    ms: float
    """Host time from the start of the window's first step to the end of its last, everything in between included
    (the probe's set-up and counting, and the training between the window's steps): an upper bound of what the
    window cost the run."""
    pct_of_steps: float
    """100 x ``steps`` / the steps timed."""
    pct_of_time: float | None = None
    """100 x ``ms`` / the metrics' ``run_ms``."""


class ProfilerMetrics(BaseModel):
    """What [`Profiler.get_metrics`][kitsune.profiler.Profiler.get_metrics] returns."""

    steps_timed: int
    """Steps timed since the profiler started (including any no longer kept in ``records``)."""
    timing: Literal["cuda_events", "host_clock"]
    """How ``step_time`` was measured."""
    step_time: TimeStats | None
    """Statistics of the kept per-step times (on CUDA, of the steps timed on the device: see
    ``ProfilerConfig.device_time_every``)."""
    host_time: TimeStats | None
    """Statistics of the kept per-step host times."""
    warmup_left_out: int = 0
    """Records of the warm-up (the first ``sample_after`` steps: compiles, graph capture) left out of ``step_time``
    and ``host_time``, as they are once a later step has been timed (0 in old profiles)."""
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
    run_ms: float | None = None
    """Host time from the start of the first timed step to the end of the last, the training between them
    included (None in old profiles)."""
    windows: list[WindowShare] | None = None
    """The share of the run each sampled window that ran took (None in old profiles)."""


_ROW = ("step", "step_ms", "host_ms", "host_start_us", "device_start_us", "mode")
"""A kept record is a plain tuple of these `StepRecord` fields, in this order, until a report asks for models; a step
timed on the device is kept as a list when it ends, its ``step_ms`` and ``device_start_us`` filled in when its events
are read."""

_STEP_MS, _DEVICE_START_US = _ROW.index("step_ms"), _ROW.index("device_start_us")

_clock = time.perf_counter_ns

_QUICK_MAX = 255
"""The most quick steps in a row: then a step seen whole (timed on the device or not) makes their records, so the
marks stay bounded whatever ``device_time_every`` is."""

_COLLECT_AFTER = 64
"""Pending CUDA event pairs that trigger a non-blocking read of the finished ones."""


def _current_stream_key(device_index: int | None) -> tuple[int, int, int]:
    """``torch._C._cuda_getCurrentStream``'s answer through the public API."""
    stream = torch.cuda.current_stream(device_index)
    return stream.stream_id, stream.device_index, stream.device_type


class Profiler(Subsystem):
    """Times every step: first to start, last to stop, so the whole step (fallbacks included) is covered."""

    name = "profiler"

    def __init__(self, config: ProfilerConfig) -> None:
        super().__init__()
        self.config = config
        self._records: deque[tuple | list] = deque(maxlen=config.max_step_records)  # _ROW rows, in step order
        # (kept row, start event, end event) of the steps timed on the device whose events were not read yet
        self._pending: deque[tuple[list, torch.cuda.Event, torch.cuda.Event]] = deque()
        self._timed = 0
        self._cuda = False
        self._device = torch.device("cpu")
        self._device_index: int | None = None
        self._t0 = 0
        self._start_event: torch.cuda.Event | None = None
        self._free_events: list[torch.cuda.Event] = []
        # the stream the step runs on: torch.cuda.current_stream() costs microseconds of Python, so a step reads the
        # current stream's identity with one C call and builds a Stream only when that changed
        self._current_stream: Any = None
        self._record: Any = None  # Event.record and Event.elapsed_time without their Python wrappers (see _bind_cuda)
        self._elapsed: Any = None
        self._stream_key: tuple[int, int, int] | None = None
        self._stream: torch.cuda.Stream | None = None
        self._mixed_streams = False  # some pending events were recorded on another stream than the newest
        self._origin_ns = _clock()
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
        self._warming = False  # the step under way is in the warm-up (the first sample_after)
        self._warm_kept = 0  # records kept of warm-up steps since the profiler started (or was reset)
        self._mode = "kitsune"
        self._window: str | None = None  # "reference" or "baseline" inside the comparison
        self._probe = Probe(self.config.probe_steps)
        self._compared: dict[str, list[tuple | list]] = {"reference": [], "baseline": []}  # _ROW rows
        self._comparable: bool | None = None
        self._incomparable = "kitsune ran the wrapped optimizer's own step on every param: there is nothing to compare"
        self._last_sampled = max(1, self._windows()[2] + self.config.compare_steps)  # later steps: the fast path
        self.sampling = True
        """Whether the next step can fall in a sampled window (probe or comparison); past them, the fast path. An
        attribute, not a property: every step reads it."""
        # the steps past the windows that need only their clocks, before the next one `start` sees whole (the next
        # one timed on the device): granted by that step, counted down by the quick path; `_index` counts them in
        # when the next step is seen whole (`_settle`)
        self._plain = self._granted = 0
        self._quick = False  # the step under way took the quick path: `stop` appends its marks
        self._marks: list[int] = []  # (step, start ns, end ns) of each quick step since the last flush
        self._span: str | None = None  # the window ("probe" or "comparison") the step under way belongs to
        self._span_t0 = 0
        self._spans: dict[str, list[int]] = {}  # window -> [steps, first start ns, last end ns]
        self._run_t0: int | None = None
        self._run_t1 = 0

    def plan(self, params: list[torch.Tensor], baseline: str, bytes_per_step: int | None) -> None:
        """Time steps over ``params``; ``baseline`` names the step the live comparison runs (`describe_step`),
        ``bytes_per_step`` is what the plan's updates must move (the bandwidth floor's numerator)."""
        self._settle()  # the next step is seen whole: the windows may move with the device
        self._flush_marks()  # their device time is CPU's or the events', by the device they ran on
        self._baseline_name, self._bytes_per_step = baseline, bytes_per_step
        device = params[0].device if params else torch.device("cpu")
        if device != self._device and self._cuda:
            # events (and the anchor) belong to the device they were first recorded on
            self._collect(block=True)
            self._free_events.clear()
            self._anchor, self._stream_key, self._stream = None, None, None
        self._cuda = bool(params) and params[0].is_cuda and torch.cuda.is_available()
        self._device, self._device_index = device, device.index
        self._last_sampled = max(1, self._windows()[2] + self.config.compare_steps)
        self._update_sampling()
        if not self.active:
            return
        if self._cuda:
            self._bind_cuda()
        if self._cuda and self._anchor is None and not torch.cuda.is_current_stream_capturing():
            # once, at construction (not during training): the GPU ran the anchor between record() and the end
            # of the sync; taking the later bound never shows a step on the device before the host launched it
            for _ in range(2):  # the first round pays for lazy event/stream set-up
                anchor = torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                anchor.record()
                torch.cuda.synchronize()
                anchor_us = (_clock() - self._origin_ns) / 1e3
            self._anchor = (anchor, anchor_us)
        self._plan_nvml(params[0].device.index if self._cuda else None)

    def _bind_cuda(self) -> None:
        """The C functions a CUDA step calls: ``torch.cuda.current_stream()`` costs microseconds of Python, and
        ``Event.record``/``elapsed_time`` a Python call each on top of the C method they wrap."""
        current = getattr(torch._C, "_cuda_getCurrentStream", None)  # -> (stream id, device index, device type)
        if current is None:  # private: a torch without it takes the public call, a few microseconds more a step
            current = _current_stream_key
        self._current_stream = current
        base = torch.cuda.Event.__base__  # torch._C._CudaEventBase: its C methods, if this torch has them
        self._record = getattr(base, "record", torch.cuda.Event.record)
        self._elapsed = getattr(base, "elapsed_time", torch.cuda.Event.elapsed_time)

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
        self._sampler = NvmlSampler(
            device_index, interval_s=interval, max_samples=self.config.nvml_max_samples, origin_ns=self._origin_ns
        )
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

    def _update_sampling(self) -> None:
        self.sampling = self._index < self._last_sampled

    def wants_baseline(self, comparable: bool, reason: str | None = None) -> bool:
        """Asked by the orchestrator before each step: should the wrapped optimizer's own step run this one?

        ``comparable``: whether kitsune executes any update itself (otherwise both sides would be the same step)
        and the wrapped optimizer's step could run instead; ``reason``: why it cannot, when that is the cause.
        """
        if not self.sampling:
            return False  # past the windows
        phase = self._phase(self._index + 1)
        if phase in ("reference", "baseline"):
            self._comparable = comparable if self._comparable is None else self._comparable and comparable
            if not comparable and reason:
                self._incomparable = reason
        return phase == "baseline" and bool(self._comparable)

    # -- the step ------------------------------------------------------------------------------------------------
    def start(self, s: StepState) -> None:
        """The step begins: first of all (the whole step, fallbacks included, is timed)."""
        if not self.active:
            return
        if self._plain:  # most steps past the windows: the clock alone, the record made in a batch (`_flush_marks`)
            self._plain -= 1
            self._quick = True
            self._t0 = _clock()
            return
        self._quick = False
        self._settle()
        self._index += 1
        self._update_sampling()
        if self._index > self._last_sampled:  # past the windows: no window, the clocks and maybe the events
            self._mode, self._window, self._span, self._warming = "kitsune", None, None, False
            every = self.config.device_time_every
            timed = self._index % every == 0
            # the steps until the next one timed, at most `_QUICK_MAX`: the marks wait for a step seen whole
            self._plain = self._granted = min(every - 1 - self._index % every, _QUICK_MAX)
        else:
            self._start_sampled(s)
            timed = True
        if self._cuda and timed:
            key = self._current_stream(self._device_index)  # (stream id, device index, device type): one C call
            if key != self._stream_key:  # the user switched streams (or the first step): time the one it runs on
                self._mixed_streams = bool(self._pending)
                self._stream_key = key
                self._stream = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
            event = self._free_events.pop() if self._free_events else torch.cuda.Event(enable_timing=True)
            self._record(event, self._stream)
            self._start_event = event
        self._t0 = _clock()

    def _settle(self) -> None:
        """Count the quick steps taken since the last step seen whole into the windows' clock; grant no more."""
        self._index += self._granted - self._plain
        self._plain = self._granted = 0

    def _flush_marks(self) -> None:
        """Make the quick steps' records (in step order: before a step seen whole keeps its own, and before any
        report reads them)."""
        marks = self._marks
        if not marks:
            return
        self._marks = []
        origin, cuda = self._origin_ns, self._cuda
        rows = []
        for i in range(0, len(marks), 3):
            host_ms = (marks[i + 2] - marks[i + 1]) / 1e6
            rows.append((marks[i], None if cuda else host_ms, host_ms, (marks[i + 1] - origin) / 1e3, None, "kitsune"))
        self._records.extend(rows)
        self._timed += len(rows)
        self._run_t1 = marks[-1]

    def _start_sampled(self, s: StepState) -> None:
        """A step up to the end of the sampled windows: which window, and the probe's set-up."""
        now = _clock()
        if self._index == 1:
            self._run_t0 = now
        phase = self._phase(self._index)
        self._warming = self._index <= self._windows()[0]
        self._mode = "baseline" if s.baseline else ("probe" if phase == "probe" else "kitsune")
        compared = phase in ("reference", "baseline") and bool(self._comparable)
        self._window = phase if compared else None
        self._span = "probe" if phase == "probe" else ("comparison" if compared else None)
        self._span_t0 = now
        if self._mode == "probe":
            self._probe.begin(self._device)
            s.phases = self._probe.timer  # the stages mark the phase boundaries

    def stop(self, s: StepState) -> None:
        """The step is done: last of all. Its record is kept now, in step order; a step timed on the device gets its
        device time when its events are read, in a batch."""
        if not self.active:
            return
        t1 = _clock()
        if self._quick:
            self._quick = False
            self._marks += (s.step, self._t0, t1)
            return
        row: tuple | list
        if self._start_event is not None:  # CUDA: the device time is filled in when the events are read
            end = self._free_events.pop() if self._free_events else torch.cuda.Event(enable_timing=True)
            self._record(end, self._stream)  # the stream the step ran on; before any work of the profiler's own
        self._flush_marks()  # the quick steps' records go first: they ran before this step
        self._timed += 1
        self._run_t1 = t1
        t0 = self._t0
        host_ms = (t1 - t0) / 1e6
        if self._start_event is not None:
            row = [s.step, None, host_ms, (t0 - self._origin_ns) / 1e3, None, self._mode]
            self._pending.append((row, self._start_event, end))
            self._start_event = None
            if len(self._pending) > _COLLECT_AFTER:
                self._collect(block=False)
        else:  # final: a tuple, which the garbage collector stops tracking (a list it would walk in every full pass)
            row = (s.step, None if self._cuda else host_ms, host_ms, (t0 - self._origin_ns) / 1e3, None, self._mode)
        self._records.append(row)
        if self._warming:
            self._warm_kept += 1
        if self._span is not None:
            if self._window is not None:
                self._compared[self._window].append(row)
            self._stop_sampled()

    def _stop_sampled(self) -> None:
        if self._mode == "probe":
            self._probe.complete()
        end = self._run_t1 = _clock()  # the probe's counting is the window's time too
        span = self._spans.setdefault(self._span, [0, self._span_t0, end])  # type: ignore[arg-type]
        span[0] += 1
        span[2] = end

    def abandon_step(self) -> None:
        """The step raised between [`start`][kitsune.profiler.Profiler.start] and
        [`stop`][kitsune.profiler.Profiler.stop]: undo what the probe changed."""
        if not self.active:
            return
        if self._quick:  # not a step: the quick path's count back
            self._plain += 1
        else:  # nor one of the windows' steps: a failed call does not use up a window's slot
            self._index -= 1
            self._plain = self._granted = 0
            self._update_sampling()
        self._quick = False
        if self._start_event is not None:
            self._free_events.append(self._start_event)
            self._start_event = None
        if self._mode == "probe":
            self._probe.abandon()

    def clock(self) -> int:
        """The windows' clock: the steps begun since the profiler started or was reset (what a copy continues)."""
        self._settle()
        return self._index

    def continue_from(self, clock: int) -> None:
        """A copy's profiler (`clock` of the original): its windows go on where the original's stood, so the copy
        runs the same steps the same way (a comparison's baseline steps round differently), not the windows again.
        Its records start empty: the original's stay with the original."""
        self._index = clock
        self._run_t0 = self._run_t1 = _clock()  # the copy's run starts now (the original's stays with it)
        self._update_sampling()

    def _finished(self) -> int:
        """How many pending steps, oldest first, can be read: those before the oldest whose events the GPU has not
        finished."""
        pending = self._pending
        if self._mixed_streams:  # events on several streams finish in any order: stop at the oldest unfinished
            done = 0
            while done < len(pending) and pending[done][2].query():
                done += 1
            return done
        lo, hi = 0, len(pending)  # on one stream the finished steps are a prefix: bisect for its end
        while lo < hi:
            mid = (lo + hi) // 2
            if pending[mid][2].query():
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _collect(self, block: bool) -> None:
        """Fill in the device times of finished CUDA event pairs; with block=True wait for all of them. The quick
        steps' records are made first."""
        self._flush_marks()
        pending, elapsed, free = self._pending, self._elapsed, self._free_events
        for _ in range(len(pending) if block else self._finished()):
            row, start, end = pending.popleft()
            if block:
                end.synchronize()
            row[_STEP_MS] = elapsed(start, end)
            if self._anchor is not None:
                anchor, anchor_us = self._anchor
                row[_DEVICE_START_US] = anchor_us + elapsed(anchor, start) * 1e3
            free += (start, end)
        if not pending:
            self._mixed_streams = False

    @property
    def records(self) -> list[StepRecord]:
        """The kept per-step records (waits for outstanding CUDA events)."""
        self._collect(block=True)
        return [StepRecord.model_construct(**dict(zip(_ROW, row, strict=True))) for row in self._records]

    def comparison(self) -> Comparison:
        """The live comparison as far as it has run (waits for outstanding CUDA events)."""
        n = self.config.compare_steps
        if n == 0:
            return Comparison(status="off", reason="compare_steps=0")
        _, probe, reference = self._windows()
        if self._comparable is False:
            return Comparison(status="not_applicable", reason=self._incomparable)
        self._collect(block=True)
        ref, base = (self._compared[w][1:] for w in ("reference", "baseline"))  # the first step of each settles
        if self._index < reference + n or not ref or not base:
            return Comparison(
                status="pending",
                reason=f"the comparison runs at steps {probe + 1}-{reference + n} after the profiler starts "
                f"(sample_after={self.config.sample_after}); {self._index} step(s) so far",
                baseline=self._baseline_name,
            )
        k, b = TimeStats.of([r[1] for r in ref if r[1] is not None]), TimeStats.of([r[1] for r in base])
        kh, bh = TimeStats.of([r[2] for r in ref]), TimeStats.of([r[2] for r in base])
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

    def _run_ms(self) -> float | None:
        self._flush_marks()
        return None if self._run_t0 is None else (self._run_t1 - self._run_t0) / 1e6

    def window_shares(self) -> list[WindowShare]:
        """The steps and host time each sampled window that ran took, as shares of the run."""
        self._flush_marks()
        run_ms, out = self._run_ms(), []
        for name, (steps, t0, t1) in self._spans.items():
            ms = (t1 - t0) / 1e6
            out.append(
                WindowShare(
                    window=name,  # type: ignore[arg-type]
                    steps=steps,
                    ms=ms,
                    pct_of_steps=100 * steps / max(self._timed, 1),
                    pct_of_time=100 * ms / run_ms if run_ms else None,
                )
            )
        return out

    def get_metrics(self) -> ProfilerMetrics:
        """Statistics of the steps timed so far (probe and baseline steps excluded), the probe, the comparison and
        the share of the run the sampled windows took."""
        self._collect(block=True)
        rows, warm = self._steady_rows()
        step_time = TimeStats.of([r[1] for r in rows if r[1] is not None])
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
            host_time=TimeStats.of([r[2] for r in rows]),
            warmup_left_out=warm,
            probe=probe,
            comparison=self.comparison(),
            bytes_per_step=nbytes,
            floor_ms=floor_ms,
            pct_of_floor=pct,
            run_ms=self._run_ms(),
            windows=self.window_shares(),
        )

    def _steady_rows(self) -> tuple[list[tuple | list], int]:
        """The kept records the statistics come from: kitsune's steps (probe and baseline steps left out), without
        the warm-up's once a later step has been timed (its first steps compile kernels and capture graphs: one
        in ``device_time_every`` timed past the windows would leave them most of a short run's sample); and how
        many warm-up records that left out."""
        kept = list(self._records)
        warm = max(0, self._warm_kept - (self._timed - len(kept)))  # the warm-up's rows max_step_records left
        steady = [r for r in kept[warm:] if r[5] == "kitsune"]
        if any(r[1] is not None for r in steady):
            return steady, warm
        return [r for r in kept if r[5] == "kitsune"], 0

    def reset(self) -> None:
        """Forget every record and NVML sample (e.g. after warm-up); the sampled windows run again."""
        self._collect(block=True)  # the quick steps' records too
        self._records.clear()
        self._timed = 0
        self._reset_windows()
        if self._sampler is not None:
            self._sampler.clear()

    def report(self) -> dict[str, object]:
        self._flush_marks()
        return {"steps_timed": self._timed, "timing": "cuda_events" if self._cuda else "host_clock"}


def describe_step(opt: torch.optim.Optimizer) -> str:
    """``torch.optim.adamw.AdamW.step (foreach=None, fused=None)``: the step the comparison's baseline runs."""
    cls = type(opt)
    flags = ", ".join(f"{k}={opt.defaults[k]}" for k in ("foreach", "fused", "capturable") if k in opt.defaults)
    return f"{cls.__module__}.{cls.__qualname__}.step" + (f" ({flags})" if flags else "")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
