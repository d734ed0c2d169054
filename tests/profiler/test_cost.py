"""What ``profile=True`` costs a step, checked by counting, never by timing.

Outside the sampled windows a profiled step takes the graphed executor's steady replay, as an unprofiled one does; the
windows' probe and baseline steps take the full path. The profiler's own per-step work is O(1): no pydantic model, no
``torch.cuda.current_stream()``, CUDA events from a pool, finished events read in batches. On the CPU the graph is
the recording stand-in of tests/graphs, the probe a stand-in that marks phases, and CUDA events are fakes on a fake
clock, so the bookkeeping of the CUDA path runs here too.
"""

from __future__ import annotations

import io
import itertools

import pytest
import torch
from pydantic import BaseModel
from rich.console import Console
from twins import assert_close_params, grads_in_place, make_params, ptrs_equal_stand_in, record_graphs

from kitsune import FusionConfig, KitsuneConfig, KitsuneOptimizer, ProfilerConfig
from kitsune.fusion import units
from kitsune.profiler import Profiler
from kitsune.profiler.core import _COLLECT_AFTER, _QUICK_MAX
from kitsune.profiler.probe import Probe
from kitsune.profiler.schema import Profile
from kitsune.subsystem import StepState

SIZES = [(7, 3), 16, (4, 5), 9]
WARM, PROBE, COMPARE = 3, 2, 3  # steps 1-3 warm-up, 4-5 probe, 6-8 reference, 9-11 baseline


class _FakeTimer:
    def __init__(self) -> None:
        self.marks: list[str] = []

    def mark(self, name: str) -> None:
        self.marks.append(name)


@pytest.fixture
def probe_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The probe window on CPU params: its steps carry a phase timer (the real probe needs CUDA). Returns each
    probe step's marks."""
    timers: list[list[str]] = []

    def windows(self: Profiler) -> tuple[int, int, int]:
        warm = self.config.sample_after
        return warm, warm + self.config.probe_steps, warm + self.config.probe_steps + self.config.compare_steps

    def begin(self: Probe, device: torch.device) -> None:
        self.timer = _FakeTimer()
        timers.append(self.timer.marks)

    def complete(self: Probe) -> None:
        self.timer = None
        self._done += 1

    monkeypatch.setattr(Profiler, "_windows", windows)
    monkeypatch.setattr(Probe, "begin", begin)
    monkeypatch.setattr(Probe, "complete", complete)
    return timers


@pytest.fixture
def fused_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU params take the fused kernels (Triton's interpreter, see tests/conftest.py) with the C++ address check's
    stand-in, as in tests/graphs."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(units, "_PTRS_EQUAL", units._PTRS_EQUAL or ptrs_equal_stand_in)


def _profiled(params: list[torch.nn.Parameter], **profiler: int) -> KitsuneOptimizer:
    config = KitsuneConfig(
        fusion=FusionConfig(enabled=True), profiler=ProfilerConfig(enabled=True, nvml_interval_s=0, **profiler)
    )
    return KitsuneOptimizer(torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1), config=config)


def _steady_replays(opt: KitsuneOptimizer) -> int:
    return opt._subsystem("graphs").steady_replays


def test_profiled_steps_take_the_steady_replay_outside_the_windows(device, fused_on_cpu, probe_on_cpu):
    ref, ours = make_params(SIZES, torch.float32, device), make_params(SIZES, torch.float32, device)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    # every step timed on the device on a GPU, as every step is on the host clock on the CPU
    opt = _profiled(ours, sample_after=WARM, probe_steps=PROBE, compare_steps=COMPARE, device_time_every=1)
    backend = record_graphs(opt)
    steady = []
    for step in range(1, 21):
        before = _steady_replays(opt)
        for params, o in ((ref, ref_opt), (ours, opt)):
            grads_in_place(params, step)
            o.step()
        if _steady_replays(opt) > before:
            steady.append(step)
        assert_close_params(ours, ref, torch.float32)
    # warm-up 1-3; the probe (4-5) runs eagerly, marking its phases; the reference half (6-8) is kitsune's own step:
    # 6 captures (and replays), 7-8 replay steady; the baseline half (9-11) runs AdamW's own step; 12 goes through the
    # full path (the steady replay re-arms after a full replay), 13-20 replay steady
    assert steady == [7, 8, *range(13, 21)]
    assert backend.captured == 1 and backend.replayed == 1 + len(steady) + 1
    assert len(probe_on_cpu) == PROBE and all("update" in marks for marks in probe_on_cpu)  # the full pipeline's
    records = opt.profiler.records
    modes = ["kitsune"] * 3 + ["probe"] * 2 + ["kitsune"] * 3 + ["baseline"] * 3 + ["kitsune"] * 9
    assert [r.step for r in records] == list(range(1, 21)) and [r.mode for r in records] == modes
    assert all(r.step_ms > 0 and r.host_ms > 0 and r.host_start_us >= 0 for r in records)
    if device.type == "cpu":  # the host clock times the step
        assert all(r.step_ms == r.host_ms and r.device_start_us is None for r in records)
    for a, b in zip(records, records[1:], strict=False):
        assert b.host_start_us >= a.host_start_us + a.host_ms * 1e3
    metrics = opt.profiler.get_metrics()
    # the warm-up (3 steps), the probe and the baseline left out
    assert metrics.step_time.count == 20 - WARM - PROBE - COMPARE and opt.base_steps == COMPARE
    assert metrics.warmup_left_out == WARM
    assert metrics.comparison.status == "measured" and metrics.comparison.kitsune.count == COMPARE - 1


def test_windows_report_their_share_of_the_run(device, fused_on_cpu, probe_on_cpu, tmp_path):
    params = make_params(SIZES, torch.float32, device)
    opt = _profiled(params, sample_after=WARM, probe_steps=PROBE, compare_steps=COMPARE)
    record_graphs(opt)
    assert opt.profiler.get_metrics().windows == [] and opt.profiler.get_metrics().run_ms is None
    for step in range(40):
        grads_in_place(params, step)
        opt.step()
    metrics = opt.profiler.get_metrics()
    shares = {w.window: w for w in metrics.windows}
    assert list(shares) == ["probe", "comparison"]
    assert shares["probe"].steps == PROBE and shares["comparison"].steps == 2 * COMPARE
    assert shares["probe"].pct_of_steps == pytest.approx(100 * PROBE / 40)
    assert shares["comparison"].pct_of_steps == pytest.approx(100 * 2 * COMPARE / 40)
    for w in shares.values():  # a window's span lies inside the run's
        assert 0 < w.ms <= metrics.run_ms and w.pct_of_time == pytest.approx(100 * w.ms / metrics.run_ms)
    buf = io.StringIO()
    opt.print_summary(console=Console(file=buf, width=200, color_system=None))
    text = " ".join(buf.getvalue().split())
    assert "sampled windows" in text and "probe 2 of 40 steps (5.0%)" in text
    assert "live comparison 6 of 40 steps (15.0%)" in text
    again = Profile.model_validate_json(opt.save_profile(tmp_path / "p.json").read_text())
    assert again.metrics.windows == metrics.windows
    opt.profiler.reset()  # the windows run again, and their shares start over
    assert opt.profiler.get_metrics().windows == []


# -- the CUDA path's bookkeeping, on fake events ------------------------------------------------------------------
class _FakeClock:
    """A fake GPU: every recorded event gets the next tick (0.25 ms apart); ``done`` ticks have finished."""

    def __init__(self) -> None:
        self.ticks = itertools.count()
        self.done = float("inf")
        self.created = self.queries = self.streams = 0


class _FakeEventBase:
    """torch._C._CudaEventBase's stand-in: the methods the profiler calls without Event's Python wrappers."""

    clock: _FakeClock
    tick: int | None
    stream: object

    def record(self, stream: object = None) -> None:
        assert stream is not None, "Event.record() without a stream calls torch.cuda.current_stream()"
        self.tick, self.stream = next(self.clock.ticks), stream

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert max(self.tick, end.tick) < self.clock.done, "elapsed_time of an unfinished event raises on a GPU"
        return (end.tick - self.tick) * 0.25


class _FakeEvent(_FakeEventBase):
    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.clock.created += 1
        self.tick: int | None = None
        self.stream: object = None

    def query(self) -> bool:
        self.clock.queries += 1
        return self.tick is not None and self.tick < self.clock.done

    def synchronize(self) -> None:
        self.clock.done = max(self.clock.done, self.tick + 1)


class _FakeStream:
    clock: _FakeClock

    def __init__(self, stream_id: int, device_index: int, device_type: int) -> None:
        self.clock.streams += 1
        self.key = (stream_id, device_index, device_type)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch):
    """``as_cuda(profiler)`` makes a planned profiler time its steps with fake CUDA events on a fake clock (on a GPU
    too: the fakes replace torch.cuda's from then on); the stream getter reads ``current[0]``. Returns (as_cuda,
    clock, current, stream_lookups)."""
    clock = _FakeClock()
    current = [(3, 0, 1)]
    lookups: list[object] = []

    def current_stream(device_index: object) -> tuple[int, int, int]:
        lookups.append(device_index)
        return current[0]

    def as_cuda(prof: Profiler) -> Profiler:
        monkeypatch.setattr(_FakeEventBase, "clock", clock, raising=False)
        monkeypatch.setattr(_FakeStream, "clock", clock, raising=False)
        monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
        monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
        monkeypatch.setattr(torch._C, "_cuda_getCurrentStream", current_stream, raising=False)
        prof._cuda = True
        prof._bind_cuda()
        prof._free_events.clear()
        anchor = _FakeEvent(enable_timing=True)
        anchor.record(object())
        prof._anchor = (anchor, 100.0)
        return prof

    return as_cuda, clock, current, lookups


def _count_models_and_streams(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """From now on, count the pydantic models built (validated or not); ``torch.cuda.current_stream()`` raises."""
    counts = {"models": 0}
    init, construct = BaseModel.__init__, BaseModel.model_construct.__func__

    def counting_init(self: BaseModel, **data: object) -> None:
        counts["models"] += 1
        init(self, **data)

    def counting_construct(cls: type[BaseModel], *args: object, **values: object) -> BaseModel:
        counts["models"] += 1
        return construct(cls, *args, **values)

    def current_stream(*args: object) -> None:
        raise AssertionError("torch.cuda.current_stream() in a step")

    monkeypatch.setattr(BaseModel, "__init__", counting_init)
    monkeypatch.setattr(BaseModel, "model_construct", classmethod(counting_construct))
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    return counts


@pytest.mark.parametrize("every", [1, 8])
def test_a_steady_profiled_step_builds_no_model_and_asks_no_stream(device, fused_on_cpu, fake_cuda, monkeypatch, every):
    """200 steady steps with the profiler on: no pydantic model, no torch.cuda.current_stream(), one C stream lookup
    per step timed on the device (every step, or one in 8), events from the pool and their reads in batches; every
    step recorded with its host time."""
    as_cuda, clock, _, lookups = fake_cuda
    params = make_params(SIZES[:1], torch.float32, device)  # one param: 200 replays of one interpreted program each
    opt = _profiled(params, sample_after=0, probe_steps=0, compare_steps=0, device_time_every=every)
    record_graphs(opt)
    as_cuda(opt.profiler)
    for step in range(6):  # warm-up, capture, then the steady replay
        grads_in_place(params, step)
        opt.step()
    counted = _count_models_and_streams(monkeypatch)
    steady, queries, streams = _steady_replays(opt), clock.queries, clock.streams
    lookups.clear()
    for step in range(6, 206):
        grads_in_place(params, step)
        opt.step()
    assert _steady_replays(opt) - steady == 200
    assert counted["models"] == 0
    assert lookups == [params[0].device.index] * (200 // every) and clock.streams == streams  # no Stream built
    # the profiler's one, in warm-up (on a GPU torch.cuda.current_stream() builds Stream objects there too)
    assert streams == 1 or device.type == "cuda"
    assert clock.created <= 1 + 2 * (_COLLECT_AFTER + 1)  # the anchor and one batch of pairs, however many steps
    assert clock.queries - queries <= (200 // _COLLECT_AFTER + 1) * 8  # a bisection over ~65 pending events a batch
    records = opt.profiler.records
    assert [r.step for r in records] == list(range(1, 207)) and {r.mode for r in records} == {"kitsune"}
    timed = [r.step for r in records if r.step_ms is not None]  # step 1: within the (empty) windows, always timed
    assert timed == [1, *(n for n in range(2, 207) if n % every == 0)]
    assert all(r.host_ms > 0 for r in records) and all(r.device_start_us is None for r in records if r.step_ms is None)
    metrics = opt.profiler.get_metrics()
    assert metrics.step_time.count == len(timed) and metrics.host_time.count == 206


def _fake_steps(prof: Profiler, steps: range) -> None:
    for step in steps:
        s = StepState(step, prof.wants_baseline(True))
        prof.start(s)
        prof.stop(s)


def test_cuda_records_from_pooled_events_read_in_batches(fake_cuda):
    as_cuda, clock, _, _ = fake_cuda
    prof = Profiler(ProfilerConfig(enabled=True, nvml_interval_s=0, device_time_every=1))
    prof.plan([torch.zeros(3)], "step", None)
    as_cuda(prof)
    clock.done = 0  # the GPU has finished nothing yet
    _fake_steps(prof, range(1, _COLLECT_AFTER + 1))
    # every step is kept when it ends, its device time not read yet
    assert len(prof._pending) == _COLLECT_AFTER and len(prof._records) == _COLLECT_AFTER
    assert all(r[1] is None for r in prof._records)
    clock.done = 2 * 40  # ticks 0 (the anchor) .. 79: the first 39 steps are done, the 40th has its start only
    queries = clock.queries
    _fake_steps(prof, range(_COLLECT_AFTER + 1, _COLLECT_AFTER + 2))  # one over: a non-blocking batch read
    assert [r[0] for r in prof._records if r[1] is not None] == list(range(1, 40)) and clock.queries - queries <= 8
    assert len(prof._pending) == _COLLECT_AFTER + 1 - 39
    assert len(prof._free_events) == 78  # back in the pool
    created = clock.created
    clock.done = float("inf")
    _fake_steps(prof, range(_COLLECT_AFTER + 2, _COLLECT_AFTER + 40))
    assert clock.created == created  # the steps took events from the pool
    records = prof.records  # a blocking read of the rest
    assert [r.step for r in records] == list(range(1, _COLLECT_AFTER + 40))
    assert all(r.step_ms == 0.25 and r.mode == "kitsune" for r in records)  # start and end are one tick apart
    # the device clock: the anchor was tick 0 at 100 us; step n's start event is tick 2n - 1
    assert [r.device_start_us for r in records[:3]] == [100 + 250 * (2 * n - 1) for n in (1, 2, 3)]
    assert all(r.host_ms > 0 for r in records)


def test_steps_not_timed_on_the_device_wait_in_order_behind_the_timed_ones(fake_cuda):
    """One step in 4 timed on the device: every step is kept in step order when it ends, only the timed ones wait
    for their events (read as far as the GPU has finished them); the others carry their host time alone."""
    as_cuda, clock, _, _ = fake_cuda
    prof = Profiler(ProfilerConfig(enabled=True, nvml_interval_s=0, sample_after=0, probe_steps=0, device_time_every=4))
    prof.plan([torch.zeros(3)], "step", None)
    as_cuda(prof)
    clock.done = 0
    _fake_steps(prof, range(1, 4 * _COLLECT_AFTER))  # steps 1, 4, 8, ... timed: 64 pairs of events, ticks 1-128
    assert len(prof._pending) == _COLLECT_AFTER and clock.created == 1 + 2 * _COLLECT_AFTER
    # the quick steps' records are made before the next step seen whole keeps its own: up to step 252 by now, the
    # last three (253-255) as three marks each
    assert [r[0] for r in prof._records] == list(range(1, 4 * _COLLECT_AFTER - 3))
    assert prof._marks[::3] == [253, 254, 255]
    clock.done = 1 + 2 * 3  # the anchor and the first three pairs (steps 1, 4 and 8): step 12's end is not done
    _fake_steps(prof, range(4 * _COLLECT_AFTER, 4 * _COLLECT_AFTER + 1))  # the 65th pair: a non-blocking batch read
    assert [r[0] for r in prof._records if r[1] is not None] == [1, 4, 8]
    assert len(prof._pending) == _COLLECT_AFTER + 1 - 3
    clock.done = float("inf")
    records = prof.records
    n = 4 * _COLLECT_AFTER
    assert [r.step for r in records] == list(range(1, n + 1))
    assert [r.step for r in records if r.step_ms is not None] == [1, *range(4, n + 1, 4)]
    assert all(r.step_ms == 0.25 for r in records if r.step_ms is not None)
    assert all(r.device_start_us is None for r in records if r.step_ms is None)
    metrics = prof.get_metrics()
    assert metrics.steps_timed == n and metrics.step_time.count == _COLLECT_AFTER + 1
    assert metrics.host_time.count == n


def test_a_switched_stream_times_the_step_where_it_runs(fake_cuda):
    as_cuda, clock, current, _ = fake_cuda
    prof = Profiler(ProfilerConfig(enabled=True, nvml_interval_s=0))
    prof.plan([torch.zeros(3)], "step", None)
    as_cuda(prof)
    clock.done = 0
    _fake_steps(prof, range(1, 4))
    first = prof._pending[-1][2].stream
    current[0] = (7, 0, 1)  # `with torch.cuda.stream(side): opt.step()`
    _fake_steps(prof, range(4, 6))
    second = prof._pending[-1][2].stream
    assert first.key == (3, 0, 1) and second.key == (7, 0, 1) and clock.streams == 2
    assert all(start.stream is end.stream for _, start, end, *_ in prof._pending)
    assert prof._mixed_streams  # events on two streams finish in any order: no bisection until they drain
    clock.done = 2 * 2 + 1  # the first two steps
    assert prof._finished() == 2
    clock.done = float("inf")
    assert [r.step for r in prof.records] == [1, 2, 3, 4, 5] and not prof._mixed_streams


def test_a_raising_step_gives_its_event_back(fake_cuda):
    as_cuda, clock, _, _ = fake_cuda
    prof = Profiler(ProfilerConfig(enabled=True, nvml_interval_s=0))
    prof.plan([torch.zeros(3)], "step", None)
    as_cuda(prof)
    s = StepState(1)
    prof.start(s)
    prof.abandon_step()
    assert len(prof._free_events) == 1 and prof._start_event is None
    _fake_steps(prof, range(1, 3))
    assert [r.step for r in prof.records] == [1, 2] and prof.get_metrics().steps_timed == 2


@pytest.mark.parametrize(("steps", "every"), [(300, 32), (300, 8), (40, 32), (6, 32)])
def test_the_warm_up_steps_stay_out_of_the_statistics_once_a_later_step_is_timed(fake_cuda, monkeypatch, steps, every):
    """The warm-up (``sample_after`` steps, every one timed) compiles kernels and captures graphs: with one step in 32
    timed past the windows it was most of a short run's sample (p90 and the mean were compile times). Once a step
    past the warm-up is timed, the statistics leave the warm-up out; a run still inside it keeps what it has."""
    as_cuda, clock, _, _ = fake_cuda
    prof = Profiler(
        ProfilerConfig(enabled=True, nvml_interval_s=0, sample_after=10, probe_steps=0, device_time_every=every)
    )
    prof.plan([torch.zeros(3)], "step", None)
    as_cuda(prof)
    for n in range(1, steps + 1):
        s = StepState(n, prof.wants_baseline(True))
        prof.start(s)
        if n <= 3:  # a compile or capture step: 1000 ms on the device instead of 0.25
            for _ in range(3999):
                next(clock.ticks)
        prof.stop(s)
    metrics = prof.get_metrics()
    timed_after = [n for n in range(11, steps + 1) if n % every == 0]
    if timed_after:
        assert metrics.step_time.count == len(timed_after) and metrics.step_time.max_ms == 0.25
        assert metrics.host_time.count == steps - 10
    else:  # still in the warm-up: its own steps are all there is
        assert metrics.step_time.count == steps and metrics.step_time.max_ms == 1000.0
    assert metrics.steps_timed == steps and len(prof.records) == steps  # every record is kept


def test_the_warm_up_left_out_counts_what_max_step_records_dropped(fake_cuda):
    """With the oldest records dropped (``max_step_records``), only the warm-up's rows still kept are left out."""
    as_cuda, clock, _, _ = fake_cuda
    config = ProfilerConfig(
        enabled=True, nvml_interval_s=0, sample_after=10, probe_steps=0, device_time_every=1, max_step_records=15
    )
    prof = Profiler(config)
    prof.plan([torch.zeros(3)], "step", None)
    as_cuda(prof)
    _fake_steps(prof, range(1, 21))  # records 6-20 kept: 6-10 warm-up, 11-20 steady
    metrics = prof.get_metrics()
    assert [r.step for r in prof.records] == list(range(6, 21)) and metrics.step_time.count == 10


def test_quick_steps_are_counted_recorded_and_undone_like_whole_ones():
    """Past the windows most steps take the quick path (two clock reads, three numbers kept): reports see every step,
    a step that raises leaves no record, and the windows' clock counts the quick steps (reset runs them again)."""
    config = ProfilerConfig(enabled=True, nvml_interval_s=0, sample_after=2, compare_steps=2, device_time_every=4)
    prof = Profiler(config)
    prof.plan([torch.zeros(3)], "step", None)
    _fake_steps(prof, range(1, 12))  # warm-up 1-2, comparison 3-6, then quick steps but for 8 (one in 4)
    assert prof._marks[::3] == [9, 10, 11] and not prof.sampling
    assert prof.report()["steps_timed"] == 11  # a report makes the quick steps' records first
    s = StepState(12, prof.wants_baseline(True))
    prof.start(s)  # a quick step that raises: no record, and the next step takes its number
    prof.abandon_step()
    _fake_steps(prof, range(12, 15))
    records = prof.records
    assert [r.step for r in records] == list(range(1, 15))
    assert [r.mode for r in records] == ["kitsune"] * 4 + ["baseline"] * 2 + ["kitsune"] * 8
    assert all(r.step_ms == r.host_ms and r.host_ms > 0 for r in records)  # a CPU step's time is its host time
    assert [r.host_start_us for r in records] == sorted(r.host_start_us for r in records)
    prof._settle()
    assert prof._index == 14  # the one that raised is no step: not counted, whole or quick
    prof.reset()
    assert prof.sampling and not prof._marks and prof.records == []
    _fake_steps(prof, range(15, 19))
    assert [r.mode for r in prof.records] == ["kitsune"] * 4  # the windows again: warm-up, then the comparison
    assert prof.wants_baseline(True)  # step 19 is the first of the baseline's half


def test_quick_steps_stay_bounded_and_their_records_wait_until_the_step_timed_ends(fake_cuda):
    """However rare the steps timed on the device, at most `_QUICK_MAX` quick steps wait as marks; and a step timed on
    the device records its end event before it makes the waiting records, which would otherwise sit in its time."""
    as_cuda, _, _, _ = fake_cuda
    config = ProfilerConfig(enabled=True, nvml_interval_s=0, sample_after=0, probe_steps=0, device_time_every=10**9)
    prof = Profiler(config)
    prof.plan([torch.zeros(3)], "step", None)
    as_cuda(prof)
    longest = 0
    for step in range(1, 3 * _QUICK_MAX):
        _fake_steps(prof, range(step, step + 1))
        longest = max(longest, len(prof._marks) // 3)
    assert longest == _QUICK_MAX and [r.step for r in prof.records] == list(range(1, 3 * _QUICK_MAX))

    prof = Profiler(ProfilerConfig(enabled=True, nvml_interval_s=0, sample_after=0, probe_steps=0, device_time_every=4))
    prof.plan([torch.zeros(3)], "step", None)
    as_cuda(prof)
    order: list[str] = []
    record, flush = prof._record, prof._flush_marks
    prof._record = lambda *a: (order.append("record"), record(*a))[1]
    prof._flush_marks = lambda: (order.append("flush" if prof._marks else "nothing"), flush())[1]
    _fake_steps(prof, range(1, 5))  # step 1 within the windows, 2-3 quick, 4 timed
    assert order[-3:] == ["record", "record", "flush"]  # step 4: its start, its end, then the marks of 2 and 3
    assert [r.step for r in prof.records] == [1, 2, 3, 4]
