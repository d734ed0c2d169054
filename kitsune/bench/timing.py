"""Step timing (CUDA events for the device, ``perf_counter`` for the host) and the copy-bandwidth probe."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from pydantic import BaseModel


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between the closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


class Stats(BaseModel):
    """Milliseconds over the timed steps."""

    median: float
    p10: float
    p90: float
    mean: float

    @classmethod
    def of(cls, values: list[float]) -> Stats:
        return cls(
            median=percentile(values, 50),
            p10=percentile(values, 10),
            p90=percentile(values, 90),
            mean=sum(values) / len(values),
        )


class GcClock:
    """Milliseconds Python's garbage collector ran while the clock is installed (``with GcClock() as clock:``);
    ``clock.ms`` sums them and may be set back to 0 between steps."""

    def __init__(self) -> None:
        self.ms = 0.0
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.ms += (time.perf_counter() - self._start) * 1e3

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


@dataclass
class StepTimes:
    device_ms: list[float]
    """Per step, steps back to back: CUDA-event time on a GPU; wall time of the call on a CPU."""
    host_ms: list[float]
    """Per step: wall time of the ``step()`` call alone, started with the device idle, no synchronize inside."""
    busy_host_ms: list[float] = field(default_factory=list)
    """Per step of the device pass: wall time of the ``step()`` call with the steps back to back. Above
    ``host_ms``, the call waited on the GPU (a full launch queue, a blocking call) or the host ran slower there."""


def native_check_ready(device: torch.device, timeout: float = 600) -> str:
    """On CUDA, wait (at most ``timeout`` seconds) for kitsune's native address check, as a run past its first
    minute has it: it builds in the background the first time on a machine (20-30 s), and the steps taken before run
    the same checks in Python, a millisecond a step on 2000 params. Returns a line saying whether it is ready; on a
    CPU (where the fused path does not run) it neither waits nor builds."""
    if device.type != "cuda":
        return "native address check: not needed on a CPU"
    from kitsune import _native

    checks = _native.wait(timeout=timeout)
    return f"native address check: {'ready' if checks is not None else _native.reason()}"


def time_block(step: Callable[[], object], steps: int, device: torch.device) -> dict[str, float]:
    """Over ``steps`` back-to-back calls of ``step`` started after ``gc.collect()`` (which walks every object and
    leaves the CPU's caches cold, as a forward and backward pass do): ``ms`` per step (CUDA events around the block;
    the wall clock on a CPU), ``host_ms`` per step of the calls, the first call's host ms (``first_ms``, cold) and the
    median of the others (``later_ms``, warm)."""
    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    host: list[float] = []
    wall = time.perf_counter_ns()
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        step()
        host.append((time.perf_counter_ns() - t0) / 1e6)
    if cuda:
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end)
    else:
        ms = (time.perf_counter_ns() - wall) / 1e6
    later = percentile(host[1:], 50) if len(host) > 1 else host[0]
    return {"ms": ms / steps, "host_ms": sum(host) / steps, "first_ms": host[0], "later_ms": later}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(
    step: Callable[[], object],
    steps: int,
    device: torch.device,
    between: Callable[[], object] | None = None,
    check: Callable[[], object] | None = None,
) -> StepTimes:
    """Run ``step`` ``2 * steps`` times: ``steps`` for the device timer, then ``steps`` for the host timer.

    Device pass: steps run back to back, as in training, each between two CUDA events on the current stream; a
    step whose kernels wait for the host shows those gaps too. Host pass: a synchronize before each step (outside
    the timer) so a full launch queue never makes ``step()`` wait for the GPU; what remains is the CPU's cost of
    issuing the step. ``between`` runs before each step, outside both timers (e.g. refilling zeroed grads).

    ``check`` runs with the device idle, outside both timers, and never between timed steps: before and after the
    device pass (its steps stay back to back), then after each of ``steps`` more steps run as the timed ones are
    (``between``, then ``step``), untimed (``steps + 2`` calls): e.g. to snapshot the params and see that the
    device pass and every checked step moved them. So the host pass is the same with a check or without one.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    cuda = device.type == "cuda"
    if cuda:  # created up front: nothing but the step runs between an event pair
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
    wall_ms: list[float] = []
    synchronize(device)
    if check is not None:
        check()
    for i in range(steps):
        if between is not None:
            between()
        if cuda:
            starts[i].record()
        t0 = time.perf_counter()
        step()
        wall_ms.append((time.perf_counter() - t0) * 1e3)
        if cuda:
            ends[i].record()
    synchronize(device)
    device_ms = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)] if cuda else wall_ms
    if check is not None:
        check()

    host_ms: list[float] = []
    for _ in range(steps):
        if between is not None:
            between()
        synchronize(device)
        t0 = time.perf_counter()
        step()
        host_ms.append((time.perf_counter() - t0) * 1e3)
    synchronize(device)
    if check is not None:
        for _ in range(steps):  # the checked steps, as the timed ones ran, one snapshot after each
            if between is not None:
                between()
            step()
            synchronize(device)
            check()
    return StepTimes(device_ms=device_ms, host_ms=host_ms, busy_host_ms=wall_ms)


def paired_rounds(
    off: Callable[[], object], on: Callable[[], object], rounds: int, steps: int, device: torch.device
) -> tuple[list[float], list[float]]:
    """``(device_pct, host_ms)``, one of each a round: ``rounds`` rounds in which ``off`` and ``on`` each run
    `time_steps` of ``steps`` steps, ``off`` first in even rounds and ``on`` first in odd ones; ``device_pct`` is
    ``100 * (on / off - 1)`` of their median ms a step back to back, ``host_ms`` on's median host ms a step minus
    off's. Two steps measured moments apart share the host's state, so a round's difference is the sides' own."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    device_pct: list[float] = []
    host_ms: list[float] = []
    for r in range(rounds):
        timed = {}
        for name, step in (("off", off), ("on", on)) if r % 2 == 0 else (("on", on), ("off", off)):
            times = time_steps(step, steps, device)
            timed[name] = (percentile(times.device_ms, 50), percentile(times.host_ms, 50))
        device_pct.append(100 * (timed["on"][0] / timed["off"][0] - 1) if timed["off"][0] > 0 else 0.0)
        host_ms.append(timed["on"][1] - timed["off"][1])
    return device_pct, host_ms


def _copy_ms(nbytes: int, reps: int, device: torch.device) -> float:
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    return percentile(time_steps(lambda: dst.copy_(src), reps, device).device_ms, 50)


def copy_bandwidth(device: torch.device, nbytes: int | None = None, reps: int = 20) -> tuple[float, int]:
    """Device-to-device copy bandwidth in bytes/s, counting read + write, and the buffer size used.

    The median of ``reps`` copies of one buffer (512 MiB on a GPU, 64 MiB on a CPU: far larger than any cache)
    into another: the memory's sustained rate, the most a memory-bound optimizer step can hope for.
    """
    if nbytes is None:
        nbytes = (512 if device.type == "cuda" else 64) * 2**20
    nbytes -= nbytes % 4
    ms = _copy_ms(nbytes, reps, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes / (ms / 1e3), nbytes  # read src + write dst
