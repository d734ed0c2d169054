"""GPU telemetry through NVML (``pynvml``, from nvidia-ml-py): a daemon thread samples one GPU at an interval.

The CUDA device is matched to its NVML handle by UUID, so ``CUDA_VISIBLE_DEVICES`` (which renumbers devices
for CUDA but not for NVML) is respected. Without NVML (library missing, no GPU, init error) the sampler is
unavailable with a reason and never raises.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from array import array
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, TypeAdapter, model_serializer

FIELDS: dict[str, tuple[str, str]] = {
    "util_pct": ("GPU utilisation", "%"),
    "mem_used_mib": ("memory used", "MiB"),
    "power_w": ("power", "W"),
    "temp_c": ("temperature", "C"),
    "sm_clock_mhz": ("SM clock", "MHz"),
}
"""Sampled fields: name -> (label, unit)."""


class NvmlSample(BaseModel):
    """One reading of the GPU; a field the device does not report is None."""

    t_us: float
    """When it was taken, in microseconds since the profiler started (the trace's time axis)."""
    util_pct: float | None = None
    mem_used_mib: float | None = None
    power_w: float | None = None
    temp_c: float | None = None
    sm_clock_mhz: float | None = None


class FieldStats(BaseModel):
    mean: float
    max: float


class NvmlReport(BaseModel):
    """The profile's ``nvml`` section: samples and per-field stats, or ``{"available": false, "reason": ...}``."""

    available: bool
    reason: str | None = None
    """Why there is no telemetry (None when available)."""
    device: str | None = None
    """GPU name as NVML reports it."""
    uuid: str | None = None
    interval_s: float | None = None
    dropped: int = 0
    """Samples taken but no longer kept (the oldest go first)."""
    samples: list[NvmlSample] = []
    stats: dict[str, FieldStats] = {}
    """Mean and max of every field that has at least one reading."""

    @model_serializer(mode="wrap")
    def _short_when_unavailable(self, handler: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        return handler(self) if self.available else {"available": False, "reason": self.reason}

    @classmethod
    def unavailable(cls, reason: str) -> NvmlReport:
        return cls(available=False, reason=reason)


def field_stats(samples: list[NvmlSample]) -> dict[str, FieldStats]:
    stats = {}
    for name in FIELDS:
        values = [v for s in samples if (v := getattr(s, name)) is not None]
        if values:
            stats[name] = FieldStats(mean=sum(values) / len(values), max=max(values))
    return stats


def normalize_uuid(uuid: Any) -> str:
    """``b"GPU-6ea3..."``, ``"GPU-6EA3..."`` and torch's ``6ea3...`` all become ``6ea3...``."""
    text = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    text = text.strip().lower()
    for prefix in ("gpu-", "mig-"):
        text = text.removeprefix(prefix)
    return text


def cuda_uuid(index: int) -> str:
    """UUID of CUDA device ``index`` as CUDA numbers it (after ``CUDA_VISIBLE_DEVICES``)."""
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def _import_nvml() -> Any:
    import pynvml

    return pynvml


def _reader(nvml: Any, handle: Any, origin_ns: int) -> Callable[[], tuple[float, ...]]:
    """A function that takes one sample: its time, then each of `FIELDS` (NaN where not read). Each field is read on
    its own, so one unsupported query costs only it."""
    queries: dict[str, Callable[[], float]] = {
        "util_pct": lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu,
        "mem_used_mib": lambda: nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20,
        "power_w": lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,  # milliwatts
        "temp_c": lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
        "sm_clock_mhz": lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
    }
    not_supported = getattr(nvml, "NVMLError_NotSupported", ())
    unsupported: set[str] = set()  # asked once, refused: not asked again

    def read() -> tuple[float, ...]:
        values = [(time.perf_counter_ns() - origin_ns) / 1e3]
        for name, query in queries.items():
            value = math.nan
            if name not in unsupported:
                try:
                    value = float(query())
                except Exception as exc:  # any NVMLError: the field stays absent from this sample
                    if isinstance(exc, not_supported):
                        unsupported.add(name)
            values.append(value)
        return tuple(values)

    return read


def _sample_loop(
    read: Callable[[], Sequence[float]],
    store: Callable[[Sequence[float]], None],
    stop: threading.Event,
    interval_s: float,
) -> None:
    # module-level on purpose: the thread holds no reference to the sampler, so the sampler can be collected
    while True:
        store(read())
        if stop.wait(interval_s):
            return


def _halt(stop: threading.Event, thread: threading.Thread, nvml: Any) -> None:
    stop.set()
    if thread is not threading.current_thread():
        thread.join(timeout=5.0)
    try:
        nvml.nvmlShutdown()
    except Exception:  # already shut down, or the driver went away: nothing left to release
        pass


_SAMPLES = TypeAdapter(list[NvmlSample])
"""Many samples made at once, in pydantic's core (a third of the time a model a sample takes in Python)."""


class _Buffer:
    """The kept samples behind a lock (the thread appends while readers copy), the oldest dropped past
    ``max_samples``: each one as its time and fields in one flat array of doubles (NaN for a field not read), 48
    bytes a sample where a model object took 1.1 KB (100,000 samples, 14 hours at the default interval: under 5 MB
    against 106 MiB). Readers get `NvmlSample` objects, made when they ask."""

    WIDTH = 1 + len(FIELDS)

    def __init__(self, max_samples: int) -> None:
        if max_samples < 1:
            raise ValueError(f"max_samples must be at least 1, got {max_samples}")
        self._max = max_samples
        self._values = array("d")  # grows to max_samples rows, then each new row overwrites the oldest
        self._taken = 0
        self._lock = threading.Lock()

    def add(self, row: Sequence[float]) -> None:
        width = self.WIDTH
        with self._lock:
            if self._taken < self._max:
                self._values.extend(row)
            else:
                at = (self._taken % self._max) * width
                self._values[at : at + width] = array("d", row)
            self._taken += 1

    def snapshot(self) -> tuple[list[NvmlSample], int]:
        """(kept samples, oldest first; how many were dropped)."""
        with self._lock:
            values, taken = self._values[:], self._taken
        width = self.WIDTH
        kept = len(values) // width
        first = taken % self._max if taken > self._max else 0  # the oldest row kept
        columns = []
        for j in range(width):  # each field's values, oldest first, None where not read (NaN)
            column = values[j::width].tolist()
            columns.append([v if v == v else None for v in column[first:] + column[:first]])
        names = ("t_us", *FIELDS)
        samples = _SAMPLES.validate_python([dict(zip(names, row, strict=True)) for row in zip(*columns, strict=True)])
        return samples, taken - kept

    def clear(self) -> None:
        with self._lock:
            self._values = array("d")
            self._taken = 0


class NvmlSampler:
    """Samples CUDA device ``device_index`` every ``interval_s`` seconds on a daemon thread.

    ``start()`` returns False (and sets ``reason``) when NVML cannot be used; ``stop()`` joins the thread. The
    thread is also stopped when the sampler is garbage-collected and at interpreter exit.
    """

    def __init__(
        self, device_index: int = 0, interval_s: float = 0.5, max_samples: int = 100_000, origin_ns: int | None = None
    ) -> None:
        if not 0 < interval_s < float("inf"):  # NaN too: the thread would wait forever, or not at all
            raise ValueError(f"interval_s must be a finite number of seconds greater than 0, got {interval_s}")
        self.device_index = device_index
        self.interval_s = interval_s
        self.origin_ns = time.perf_counter_ns() if origin_ns is None else origin_ns
        self.reason: str | None = "not started"
        self.device_name: str | None = None
        self.uuid: str | None = None
        self._buffer = _Buffer(max_samples)
        self._thread: threading.Thread | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def available(self) -> bool:
        return self.reason is None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _open(self) -> tuple[Any, Any]:
        """Init NVML and find the handle whose UUID is the CUDA device's; raise with a readable message."""
        try:
            nvml = _import_nvml()
        except ImportError as exc:
            raise RuntimeError(f"nvidia-ml-py is not installed ({exc})") from exc
        try:
            nvml.nvmlInit()
        except Exception as exc:
            raise RuntimeError(f"NVML init failed: {exc}") from exc
        try:
            wanted = normalize_uuid(cuda_uuid(self.device_index))
            for i in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                if normalize_uuid(nvml.nvmlDeviceGetUUID(handle)) == wanted:
                    name = nvml.nvmlDeviceGetName(handle)
                    self.device_name = name.decode() if isinstance(name, bytes) else str(name)
                    self.uuid = wanted
                    return nvml, handle
            raise RuntimeError(f"no NVML device has the UUID of cuda:{self.device_index} ({wanted})")
        except Exception as exc:
            try:
                nvml.nvmlShutdown()
            except Exception:
                pass
            if isinstance(exc, RuntimeError):
                raise
            raise RuntimeError(f"NVML device lookup failed: {exc}") from exc

    def start(self) -> bool:
        """Start sampling (a no-op when already running). False, with ``reason`` set, when NVML is unavailable."""
        if self.running:
            return True
        try:
            nvml, handle = self._open()
        except RuntimeError as exc:
            self.reason = str(exc)
            return False
        self.reason = None
        stop = threading.Event()
        # the thread gets the buffer, not the sampler, so the sampler stays collectable while it runs
        self._thread = threading.Thread(
            target=_sample_loop,
            args=(_reader(nvml, handle, self.origin_ns), self._buffer.add, stop, self.interval_s),
            name=f"kitsune-nvml-cuda:{self.device_index}",
            daemon=True,
        )
        self._finalizer = weakref.finalize(self, _halt, stop, self._thread, nvml)  # also runs at exit
        self._thread.start()
        return True

    def stop(self) -> None:
        """Stop sampling and join the thread; the samples stay readable."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None

    @property
    def samples(self) -> list[NvmlSample]:
        return self._buffer.snapshot()[0]

    def clear(self) -> None:
        self._buffer.clear()

    def stats(self) -> dict[str, FieldStats]:
        """Mean and max per field; empty when unavailable or before the first sample."""
        return field_stats(self.samples)

    def report(self) -> NvmlReport:
        if not self.available:
            return NvmlReport.unavailable(self.reason or "unknown")
        samples, dropped = self._buffer.snapshot()
        return NvmlReport(
            available=True,
            device=self.device_name,
            uuid=self.uuid,
            interval_s=self.interval_s,
            dropped=dropped,
            samples=samples,
            stats=field_stats(samples),
        )
