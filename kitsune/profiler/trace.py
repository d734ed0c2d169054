"""Chrome Trace Event Format export: open the file in chrome://tracing or https://ui.perfetto.dev.

Each step is an "X" (complete) event on two tracks of process "kitsune": "step (device)" (its device time,
placed where the GPU ran it when known) and "host" (the time ``step()`` spent on the host). NVML samples are
"C" (counter) events of a second process. Timestamps are microseconds since the profiler started.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kitsune._paths import write_output
from kitsune.profiler.core import Profiler, StepRecord
from kitsune.profiler.nvml import FIELDS, NvmlReport
from kitsune.profiler.schema import Profile

if TYPE_CHECKING:
    from kitsune.profiler.schema import Profiled

PID_STEPS, PID_GPU = 1, 2
TID_DEVICE, TID_HOST = 1, 2


def _meta(kind: str, pid: int, name: str, tid: int | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {"name": kind, "ph": "M", "pid": pid, "args": {"name": name}}
    if tid is not None:
        event["tid"] = tid
    return event


def _starts(steps: list[StepRecord]) -> list[float]:
    """Host start of each step; profiles from before ``host_start_us`` existed get steps laid end to end."""
    if all(r.host_start_us is not None for r in steps):
        return [r.host_start_us for r in steps]  # type: ignore[misc]
    starts, t = [], 0.0
    for r in steps:
        starts.append(t)
        t += r.host_ms * 1e3
    return starts


def trace_events(steps: list[StepRecord], timing: str, nvml: NvmlReport | None) -> list[dict[str, Any]]:
    events = [
        _meta("process_name", PID_STEPS, "kitsune"),
        _meta("thread_name", PID_STEPS, "step (device)", TID_DEVICE),
        _meta("thread_name", PID_STEPS, "host", TID_HOST),
        {"name": "thread_sort_index", "ph": "M", "pid": PID_STEPS, "tid": TID_DEVICE, "args": {"sort_index": 0}},
        {"name": "thread_sort_index", "ph": "M", "pid": PID_STEPS, "tid": TID_HOST, "args": {"sort_index": 1}},
    ]
    for r, host_start in zip(steps, _starts(steps), strict=True):
        device_start = r.device_start_us if r.device_start_us is not None else host_start
        name, args = f"step {r.step}", {"step": r.step, "timing": timing, "mode": r.mode}
        if r.mode != "kitsune":  # a probe step, or the wrapped optimizer's own step in the live comparison
            name += f" ({r.mode})"
        for tid, ts, dur_ms in ((TID_DEVICE, device_start, r.step_ms), (TID_HOST, host_start, r.host_ms)):
            if dur_ms is None:  # a step not timed on the device: its host slice only
                continue
            events.append(
                {
                    "name": name,
                    "cat": "step",
                    "ph": "X",
                    "ts": ts,
                    "dur": dur_ms * 1e3,
                    "pid": PID_STEPS,
                    "tid": tid,
                    "args": args,
                }
            )
    if nvml is not None and nvml.available and nvml.samples:
        events.append(_meta("process_name", PID_GPU, f"GPU (NVML): {nvml.device}"))
        for s in nvml.samples:
            for name, (label, unit) in FIELDS.items():
                value = getattr(s, name)
                if value is not None:
                    events.append(
                        {"name": f"{label} ({unit})", "ph": "C", "ts": s.t_us, "pid": PID_GPU, "args": {unit: value}}
                    )
    return events


def export_chrome_trace(source: Profile | Profiler | Profiled, path: str | Path) -> Path:
    """Write ``source``'s steps (and NVML samples) as a Chrome trace JSON file; returns the path.

    Raises:
        TypeError: ``source`` is none of those.
        ValueError: ``source`` is a KitsuneOptimizer built without ``profile=True`` (it records no step); or nothing
            can be written at ``path`` (see `kitsune._paths.write_output`): the one line names the path, what
            happened and the fix, and nothing is written.
    """
    if isinstance(source, Profile):
        steps, timing, nvml = source.steps, source.metrics.timing if source.metrics else "host_clock", source.nvml
    elif isinstance(source, Profiler):
        steps, timing, nvml = source.records, source.get_metrics().timing, source.nvml
    elif getattr(source, "profiler", None) is not None:
        return export_chrome_trace(source.profiler, path)  # type: ignore[union-attr]
    elif hasattr(source, "profiler"):  # a KitsuneOptimizer built without the profiler: it recorded no step
        raise ValueError(
            f"export_chrome_trace: this {type(source).__name__} records no steps: build it with profile=True "
            "(KitsuneOptimizer(optimizer, profile=True)) to trace its steps"
        )
    else:
        raise TypeError(
            f"export_chrome_trace needs a Profile, a Profiler or a KitsuneOptimizer with profile=True, "
            f"got {type(source).__name__}"
        )
    data = {"traceEvents": trace_events(steps, timing, nvml), "displayTimeUnit": "ms"}
    return write_output(path, json.dumps(data))
