"""The profile JSON: a versioned pydantic model (its JSON Schema is ``Profile.model_json_schema()``)."""

from __future__ import annotations

import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import BaseModel, Field

from kitsune.profiler.core import ProfilerMetrics, StepRecord

if TYPE_CHECKING:
    from kitsune.optimizer import KitsuneOptimizer

SCHEMA_VERSION = "1.0"


class Environment(BaseModel):
    """Where the profile was recorded."""

    python: str
    platform: str
    kitsune: str
    torch: str
    triton: str | None
    """None when Triton is not installed."""
    cuda: str | None
    """CUDA version torch was built with; None for CPU builds."""
    device: str
    """``cuda`` or ``cpu``: where the optimizer's params live."""
    device_name: str
    """GPU name, or the CPU's architecture."""


class SubsystemStatus(BaseModel):
    name: str
    active: bool
    reason: str | None
    """Why the subsystem is inactive (None when active)."""
    report: dict[str, Any] = Field(default_factory=dict)


class Profile(BaseModel):
    """Everything ``KitsuneOptimizer.save_profile`` writes."""

    schema_version: Literal["1.0"] = SCHEMA_VERSION
    created: datetime
    environment: Environment
    optimizer: str
    """Class of the wrapped optimizer."""
    step_count: int
    config: dict[str, Any]
    subsystems: list[SubsystemStatus]
    plan: dict[str, Any] | None
    """The fusion plan, when fusion is on."""
    metrics: ProfilerMetrics | None
    """Step-time statistics; None when profile=False."""
    steps: list[StepRecord]
    """Per-step timings (the most recent ``max_step_records``)."""


def collect_environment(device: torch.device | str | None = None) -> Environment:
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    from kitsune import __version__

    dev = torch.device(device) if device is not None else None
    on_cuda = dev is not None and dev.type == "cuda" and torch.cuda.is_available()
    return Environment(
        python=sys.version.split()[0],
        platform=platform.platform(),
        kitsune=__version__,
        torch=torch.__version__,
        triton=triton_version,
        cuda=torch.version.cuda,
        device="cuda" if on_cuda else "cpu",
        device_name=torch.cuda.get_device_name(dev) if on_cuda else (platform.processor() or platform.machine()),
    )


def _device_of(opt: KitsuneOptimizer) -> torch.device:
    for group in opt.param_groups:
        for p in group["params"]:
            return p.device
    return torch.device("cpu")


def build_profile(opt: KitsuneOptimizer) -> Profile:
    prof = opt.profiler
    plan = opt.plan
    return Profile(
        created=datetime.now(timezone.utc),
        environment=collect_environment(_device_of(opt)),
        optimizer=type(opt.base_optimizer).__name__,
        step_count=opt.step_count,
        config=opt.config.model_dump(mode="json"),
        subsystems=[SubsystemStatus(**s) for s in opt.subsystem_status()],
        plan=plan.to_dict() if plan is not None and hasattr(plan, "to_dict") else None,
        metrics=prof.get_metrics() if prof is not None else None,
        steps=prof.records if prof is not None else [],
    )


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile written by ``save_profile``."""
    return Profile.model_validate_json(Path(path).read_text())
