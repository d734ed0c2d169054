"""The profile JSON: a versioned pydantic model (its JSON Schema is ``Profile.model_json_schema()``).

Version "1.1": a step record's ``step_ms`` may be null (a CUDA step not timed on the device, see
``ProfilerConfig.device_time_every``), which a reader of "1.0" would refuse; "1.0" files still load. Fields added
since 1.0 (``nvml``, ``memory``, ``param_groups``, ``num_params``, the step records' ``host_start_us``/
``device_start_us``, the metrics' ``run_ms``/``windows``) are optional, so files written before them still load and
older readers ignore them; the version changes only when a required field does.
"""

from __future__ import annotations

import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args

import torch
from pydantic import BaseModel, Field, ValidationError

from kitsune._paths import as_path, write_output
from kitsune.profiler.core import ProfilerMetrics, StepRecord
from kitsune.profiler.nvml import NvmlReport

if TYPE_CHECKING:
    from kitsune.profiler.core import Profiler


class Profiled(Protocol):
    """What a profile is built from (``KitsuneOptimizer`` is one): its groups, profiler, plan, config and
    subsystems' status."""

    param_groups: list[dict[str, Any]]
    config: Any

    @property
    def profiler(self) -> Profiler | None: ...

    @property
    def plan(self) -> Any: ...

    @property
    def base_optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def step_count(self) -> int: ...

    def subsystem_status(self) -> list[dict[str, Any]]: ...


SCHEMA_VERSION = "1.1"


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


class MemoryInfo(BaseModel):
    """torch's CUDA caching allocator on the optimizer's device when the profile was saved."""

    allocated_bytes: int
    peak_allocated_bytes: int
    reserved_bytes: int
    peak_reserved_bytes: int
    total_bytes: int
    """The device's memory."""


class Profile(BaseModel):
    """Everything ``KitsuneOptimizer.save_profile`` writes."""

    schema_version: Literal["1.0", "1.1"] = SCHEMA_VERSION
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
    param_groups: int | None = None
    num_params: int | None = None
    """Parameter tensors across all groups."""
    nvml: NvmlReport | None = None
    """GPU telemetry, or ``{"available": false, "reason": ...}``; None when profile=False."""
    memory: MemoryInfo | None = None
    """CUDA allocator figures; None on CPU."""


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


def _device_of(opt: Profiled) -> torch.device:
    for group in opt.param_groups:
        for p in group["params"]:
            return p.device
    return torch.device("cpu")


def collect_memory(device: torch.device) -> MemoryInfo | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return MemoryInfo(
        allocated_bytes=torch.cuda.memory_allocated(device),
        peak_allocated_bytes=torch.cuda.max_memory_allocated(device),
        reserved_bytes=torch.cuda.memory_reserved(device),
        peak_reserved_bytes=torch.cuda.max_memory_reserved(device),
        total_bytes=torch.cuda.get_device_properties(device).total_memory,
    )


def build_profile(opt: Profiled) -> Profile:
    """A snapshot of ``opt``: what ``save_profile`` writes and what ``print_summary`` renders."""
    prof = opt.profiler
    plan = opt.plan
    device = _device_of(opt)
    return Profile(
        created=datetime.now(timezone.utc),
        environment=collect_environment(device),
        optimizer=type(opt.base_optimizer).__name__,
        step_count=opt.step_count,
        config=opt.config.model_dump(mode="json"),
        subsystems=[SubsystemStatus(**s) for s in opt.subsystem_status()],
        plan=plan.to_dict() if plan is not None and hasattr(plan, "to_dict") else None,
        metrics=prof.get_metrics() if prof is not None else None,
        steps=prof.records if prof is not None else [],
        param_groups=len(opt.param_groups),
        num_params=sum(len(g["params"]) for g in opt.param_groups),
        nvml=prof.nvml if prof is not None else None,
        memory=collect_memory(device),
    )


def save_profile(opt: Profiled, path: str | Path) -> Path:
    """Write `build_profile` of ``opt`` to ``path`` (``~`` expanded) as JSON (UTF-8), creating its folder; returns
    the path written. Atomic: a failed write (a full disk) leaves an older file at ``path`` as it was.

    Raises:
        ValueError: nothing can be written at ``path`` (a directory, ``""``, a path ending in "/", under a regular
            file, a folder this user may not write, a full disk); the one line names the path, what happened and
            the fix, and nothing is written.
    """
    return write_output(path, build_profile(opt).model_dump_json(indent=2))


READS: tuple[str, ...] = get_args(Profile.model_fields["schema_version"].annotation)
"""The versions `load_profile` reads (those ``Profile.schema_version`` takes)."""


def _newer(version: str, known: tuple[str, ...]) -> bool:
    """Whether ``version`` ("major.minor") is later than every one of ``known``; False for what does not parse."""

    def key(v: str) -> tuple[int, ...]:
        return tuple(int(part) for part in v.split("."))

    try:
        return key(version) > max(map(key, known))
    except ValueError:
        return False


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile written by ``save_profile``.

    Raises:
        FileNotFoundError: nothing at ``path``.
        ValueError: ``path`` is a directory, empty, not UTF-8 text, not JSON, a ``kitsune bench --json`` result, a
            profile of another ``schema_version``, or JSON that is not a profile; the message is one line naming the
            problem (``kitsune report`` prints it). A pydantic ``ValidationError``, when there is one, is its
            ``__cause__``.
    """
    path = as_path(path)  # (a ValueError for "", which Path reads as the current folder)
    what = "a profile JSON written by save_profile()"
    if path.is_dir():
        raise ValueError(f"{path} is a directory, not {what}")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{path} is not UTF-8 text (byte {exc.start} is 0x{data[exc.start]:02x}), so not {what}"
        ) from None
    if not text.strip():  # a save that never ran, or a truncated copy
        raise ValueError(f"{path}: the file is empty, so not {what}")
    try:
        return Profile.model_validate_json(text)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        if first["type"] == "json_invalid":
            reason = first.get("ctx", {}).get("error", first["msg"])
            cut = ": the file ends too soon, as a copy or a download cut short leaves it" if "EOF" in reason else ""
            raise ValueError(f"{path} is not JSON ({reason}){cut}, so not {what}") from exc
        if first["type"] == "model_type" and first["loc"] == ():  # a nested record's is named below, as any field's
            raise ValueError(f"{path} is JSON but its top level is not an object, so not {what}") from exc
        raw = json.loads(text)
        if {"sets", "copy_bandwidth_gbs"} <= raw.keys():  # before the version: a bench result has one of its own
            raise ValueError(
                f"{path} is a kitsune bench --json result, not a profile: chart it with python -m kitsune.bench.plot "
                f"{path} OUT.svg"
            ) from exc
        if "traceEvents" in raw:  # kitsune's own Chrome trace (export_chrome_trace, kitsune report --trace)
            raise ValueError(
                f"{path} is a Chrome trace, not a profile: open it in Perfetto (ui.perfetto.dev) or chrome://tracing; "
                "kitsune report reads the JSON that optimizer.save_profile() writes"
            ) from exc
        version = next((e for e in errors if e["loc"] == ("schema_version",)), None)
        if version is not None:
            from kitsune import __version__

            writer = raw.get("environment")
            writer = writer.get("kitsune") if isinstance(writer, dict) else None
            given = version["input"]
            if not isinstance(given, str):
                raise ValueError(
                    f"{path}: schema_version is {given!r} ({type(given).__name__}): a string such as "
                    f"{SCHEMA_VERSION!r} is expected; the file was changed after it was saved"
                ) from exc
            problem = f"{path}: schema_version {given!r} is not one this kitsune reads ({', '.join(READS)})"
            if writer == __version__:  # this very version wrote it: saving again would not change a thing
                raise ValueError(
                    f"{problem}, yet kitsune {writer}, this version, wrote it (it writes {SCHEMA_VERSION}): the file "
                    f"was changed after it was saved: save the profile again from the run, or restore the file"
                ) from exc
            if _newer(given, READS):
                raise ValueError(
                    f"{problem}: a newer kitsune wrote it"
                    + (f" ({writer})" if isinstance(writer, str) else "")
                    + ": install that kitsune or a newer one to read it (git pull in your clone, then pip install .)"
                ) from exc
            by = f"; written by kitsune {writer}" if isinstance(writer, str) else ""
            raise ValueError(
                f"{problem}{by}: re-save the profile with kitsune {__version__}, or read it with the version that "
                "wrote it"
            ) from exc
        where = ".".join(str(part) for part in first["loc"]) or "top level"
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ValueError(f"{path} is not a kitsune profile: {where}: {first['msg']}{more}") from exc
