"""The probe: a few sampled steps that count what a step does on a CUDA device, measured rather than predicted.

During each probe step (``ProfilerConfig.probe_steps``, after ``sample_after`` warm-up steps):

* ``torch.profiler`` records the CUDA API calls made inside ``step()``: kernel launches (torch's, Triton's and
  kitsune's own) and memory copies and sets;
* torch.cuda's sync debug mode is set to ``"warn"``, and every synchronizing operation inside ``step()`` is
  counted with its message;
* once, the device's copy bandwidth is measured, the denominator of the bandwidth floor.

The probe leaves the run as it found it: it draws no random numbers and takes its copy buffers from the CUDA driver,
not from torch's caching allocator (see `measure_copy_bandwidth`).

Profiling, the debug mode and the copies slow those steps down, so their times stay out of the statistics.
"""

from __future__ import annotations

import ctypes
import sys
import warnings
from typing import Any, Literal

import torch
from pydantic import BaseModel, Field

SYNC_MESSAGE = "synchronizing CUDA operation"
"""What torch's sync debug mode says about every synchronizing operation it catches."""


class ProbeReport(BaseModel):
    """What the probe steps measured (absent fields: not measured, see ``reason``)."""

    status: Literal["measured", "pending", "off", "unavailable"]
    reason: str | None = None
    """Why nothing was measured (status other than "measured"), or a partial failure."""
    steps: int = 0
    """Probe steps measured."""
    launches_per_step: float | None = None
    """Kernel launches issued inside ``step()`` (CUDA runtime and driver launch calls, Triton's included)."""
    copies_per_step: float | None = None
    """Memory copies and sets issued inside ``step()`` (e.g. a host-to-device upload of changed hyperparameters)."""
    syncs_per_step: float | None = None
    """Synchronizing operations inside ``step()`` caught by torch.cuda's sync debug mode."""
    sync_sites: list[str] = Field(default_factory=list)
    """Where those syncs were called from, ``file:line`` (at most 5 distinct)."""
    copy_bandwidth_gbs: float | None = None
    """Measured device-to-device copy rate in GB/s, bytes read plus bytes written."""
    phases_ms: dict[str, float] | None = None
    """Median device time of each phase of the step over the probe steps, in step order (CUDA events at the phase
    boundaries): ``unscale`` (AMP's own unscaling pass), ``clip`` (clipping as its own pass), ``norm`` (the fused norm
    pass), ``update`` (the fused updates, zeroing included), ``fallback`` (torch's fused/foreach path and the wrapped
    optimizer's own step), ``scale_update`` (the loss-scale update); ``rerouted`` first where a probe step ran again on
    a new plan (a fused kernel failed to compile): the failed try. A phase a step does not have takes about 0 ms. Probe
    steps run eagerly even when the phase is replayed from a CUDA graph."""


def _from_probe(w: warnings.WarningMessage) -> bool:
    """Warnings the probe's own tools raise about themselves (the debug mode is a prototype, and so on)."""
    text = str(w.message)
    return "debug mode" in text or "Profiler" in text or "profiler" in w.filename


def _is_launch(name: str) -> bool:
    return "LaunchKernel" in name or name.startswith("cuLaunch") or name == "cudaLaunchCooperativeKernel"


def _is_copy(name: str) -> bool:
    return name.startswith(("cudaMemcpy", "cudaMemset", "cuMemcpy", "cuMemset"))


class _DriverMemory:
    """``nbytes`` of device memory straight from the CUDA driver (``cuMemAlloc``), outside torch's caching allocator,
    seen by torch as a float32 tensor through ``__cuda_array_interface__``. Freed by `free`, after the device
    is done with it."""

    def __init__(self, device: torch.device, nbytes: int) -> None:
        self._driver = ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
        self.device = device
        ptr = ctypes.c_uint64(0)
        with torch.cuda.device(device):  # makes the device's primary context, torch's, current for the driver call
            err = self._driver.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes))
        if err == 2:  # CUDA_ERROR_OUT_OF_MEMORY
            raise torch.OutOfMemoryError(f"cuMemAlloc of {nbytes} bytes: out of memory")
        if err:
            raise RuntimeError(f"cuMemAlloc of {nbytes} bytes failed (CUresult {err})")
        self._ptr = ptr.value
        self.__cuda_array_interface__ = {
            "shape": (nbytes // 4,),
            "typestr": "<f4",
            "data": (self._ptr, False),
            "version": 2,
            "strides": None,
        }

    def tensor(self) -> torch.Tensor:
        return torch.as_tensor(self, device=self.device)

    def free(self) -> None:
        torch.cuda.synchronize(self.device)
        self._driver.cuMemFree_v2(ctypes.c_uint64(self._ptr))


def measure_copy_bandwidth(device: torch.device, nbytes: int = 128 * 1024 * 1024, repeats: int = 5) -> float:
    """Device copy rate in GB/s: the median of ``repeats`` copies of ``nbytes``, counting reads and writes.

    The profiler must leave the user's run as it found it, so the two buffers come from the CUDA driver, not from
    torch's caching allocator (whose peak statistics, cached segments and tensor addresses the user can see), and
    are not filled: a copy moves the same bytes whatever they hold, and random numbers would be drawn from the
    global CUDA generator, changing the user's dropout masks and every later random draw.
    """
    memory: list[_DriverMemory] = []
    try:
        memory += [_DriverMemory(device, nbytes), _DriverMemory(device, nbytes)]
        src, dst = (m.tensor() for m in memory)
        dst.copy_(src)  # warm
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        del src, dst
    finally:
        for m in memory:
            m.free()
    times.sort()
    return 2 * nbytes / (times[len(times) // 2] * 1e-3) / 1e9


class PhaseTimer:
    """CUDA events at the boundaries of a step's phases: ``mark(name)`` ends phase ``name`` (begun at the previous
    mark, or at construction)."""

    def __init__(self) -> None:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        self._marks: list[tuple[str, torch.cuda.Event]] = [("", start)]

    def mark(self, name: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._marks.append((name, event))

    def restart(self, name: str) -> None:
        """The phases marked so far were a try that did not stand: from the start to now is one phase, ``name``
        (the next try's phases are then timed once each, not added to the failed try's)."""
        del self._marks[1:]
        self.mark(name)

    def durations(self) -> dict[str, float]:
        """Milliseconds per phase (a name marked twice adds up), waiting for the last event."""
        self._marks[-1][1].synchronize()
        out: dict[str, float] = {}
        for (_, before), (name, after) in zip(self._marks, self._marks[1:], strict=False):
            out[name] = out.get(name, 0.0) + before.elapsed_time(after)
        return out


class Probe:
    """Runs the probe over the steps the profiler schedules; ``begin``/``end`` bracket one step."""

    def __init__(self, steps: int) -> None:
        self.planned = steps
        self._done = 0
        self._launches = 0
        self._copies = 0
        self._syncs = 0
        self._sites: list[str] = []
        self._bandwidth: float | None = None
        self._errors: list[str] = []
        self._torch_profiler: Any = None
        self._timers: list[PhaseTimer] = []
        self.timer: PhaseTimer | None = None
        """The phase timer of the probe step under way (None between probe steps)."""
        self._warnings: Any = None
        self._caught: list[warnings.WarningMessage] = []
        self._previous_mode = 0

    def begin(self, device: torch.device) -> None:
        # catch first: starting torch.profiler and the debug mode warn about themselves, and those are ours
        self._warnings = warnings.catch_warnings(record=True)
        self._caught = self._warnings.__enter__()
        warnings.simplefilter("always")
        if self._bandwidth is None and not any("bandwidth" in e for e in self._errors):
            try:
                self._bandwidth = measure_copy_bandwidth(device)
            except torch.OutOfMemoryError:
                self._errors.append("copy bandwidth not measured: no free GPU memory for a 256 MiB copy test")
            except (OSError, RuntimeError) as exc:  # no CUDA driver library to load, or its call failed
                self._errors.append(f"copy bandwidth not measured: {exc}")
        try:
            from torch.profiler import ProfilerActivity, profile

            self._torch_profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self._torch_profiler.start()
        except Exception as exc:  # a build without kineto, or CUPTI missing: syncs are still counted
            self._torch_profiler = None
            if not any("torch.profiler" in e for e in self._errors):
                self._errors.append(f"launches not counted: torch.profiler failed ({exc})")
        self._previous_mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        self.timer = PhaseTimer()

    def _stop(self) -> tuple[list[warnings.WarningMessage], Any]:
        self.timer = None
        torch.cuda.set_sync_debug_mode(self._previous_mode)
        tp, self._torch_profiler = self._torch_profiler, None
        if tp is not None:
            tp.stop()
        if self._warnings is not None:
            self._warnings.__exit__(None, None, None)
            self._warnings = None
        caught, self._caught = self._caught, []
        return caught, tp

    def abandon(self) -> None:
        """The step raised: restore the debug mode and the warning filters, count nothing."""
        self._stop()

    def complete(self) -> None:
        """The step finished: count what it did."""
        if self.timer is not None:
            self.timer.mark("scale_update")  # the last phase: the loss scale was updated
            self._timers.append(self.timer)
        caught, tp = self._stop()
        syncs = [w for w in caught if SYNC_MESSAGE in str(w.message)]
        others = [w for w in caught if SYNC_MESSAGE not in str(w.message) and not _from_probe(w)]
        for w in others:  # the step's own warnings still reach the user
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
        self._syncs += len(syncs)
        for w in syncs:
            where = f"{w.filename}:{w.lineno}"
            if len(self._sites) < 5 and where not in self._sites:
                self._sites.append(where)
        if tp is not None:
            names = [e.name for e in tp.events() if e.device_type == torch.autograd.DeviceType.CPU]
            self._launches += sum(map(_is_launch, names))
            self._copies += sum(map(_is_copy, names))
        self._done += 1

    @property
    def finished(self) -> bool:
        return self._done >= self.planned

    def report(self) -> ProbeReport:
        if self._done == 0:
            return ProbeReport(status="pending", reason="the probe steps have not run yet")
        counted = not any("launches not counted" in e for e in self._errors)
        return ProbeReport(
            status="measured",
            reason="; ".join(self._errors) or None,
            steps=self._done,
            launches_per_step=self._launches / self._done if counted else None,
            copies_per_step=self._copies / self._done if counted else None,
            syncs_per_step=self._syncs / self._done,
            sync_sites=self._sites,
            copy_bandwidth_gbs=self._bandwidth,
            phases_ms=self._phases(),
        )

    def _phases(self) -> dict[str, float] | None:
        if not self._timers:
            return None
        per_step = [t.durations() for t in self._timers]
        names = list(dict.fromkeys(name for d in per_step for name in d))
        out = {}
        for name in names:
            values = sorted(d.get(name, 0.0) for d in per_step)
            out[name] = round(values[len(values) // 2], 5)
        return out
