"""The profiler: per-step timings (CUDA events on GPU, a monotonic clock on CPU) and host time."""

from kitsune.profiler.core import Profiler, ProfilerMetrics, StepRecord, TimeStats

__all__ = ["Profiler", "ProfilerMetrics", "StepRecord", "TimeStats"]
