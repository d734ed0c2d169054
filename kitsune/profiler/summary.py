"""The summary: rich tables of the subsystems, the plan, the step timings, GPU telemetry and memory.

A live optimizer and a saved profile render through the same code: ``print_summary(opt)`` builds the
:class:`~kitsune.profiler.schema.Profile` that ``save_profile`` would write and renders that.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from kitsune.profiler.core import Comparison, ProfilerMetrics, TimeStats
from kitsune.profiler.nvml import FIELDS, NvmlReport
from kitsune.profiler.schema import MemoryInfo, Profile, SubsystemStatus, build_profile

if TYPE_CHECKING:
    from kitsune.profiler.schema import Profiled


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def subsystem_detail(status: SubsystemStatus) -> str:
    """The reason when inactive, else what the subsystem reported (the plan has its own table)."""
    if not status.active:
        return status.reason or ""
    return ", ".join(f"{k}={v}" for k, v in status.report.items() if k != "plan")


def subsystem_table(statuses: Sequence[SubsystemStatus | dict[str, Any]]) -> Table:
    table = Table(title="subsystems", title_justify="left")
    table.add_column("subsystem")
    table.add_column("state")
    table.add_column("detail", overflow="fold")
    for s in statuses:
        status = s if isinstance(s, SubsystemStatus) else SubsystemStatus(**s)
        state = "[green]active[/]" if status.active else "[yellow]inactive[/]"
        table.add_row(status.name, state, subsystem_detail(status))
    return table


def plan_rows(plan: dict[str, Any]) -> tuple[list[tuple[str, str]], dict[str, list[dict[str, Any]]]]:
    """Split a plan dict into (scalar facts, tables): every list of dicts is a table, the rest are facts."""
    facts: list[tuple[str, str]] = []
    tables: dict[str, list[dict[str, Any]]] = {}
    for key, value in plan.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            tables[key] = value
        else:
            facts.append((key, str(value)))
    return facts, tables


def bucket_table(rows: list[dict[str, Any]]) -> Table:
    """The plan's buckets, one row each: what runs where and why (the columns of ``rich.print(opt.plan)``)."""
    table = Table(title="plan: buckets", title_justify="left")
    table.add_column("bucket", overflow="fold")
    table.add_column("route")
    for col in ("tensors", "elements", "launches", "speedup"):
        table.add_column(col, justify="right")
    table.add_column("reason", overflow="fold")
    for b in rows:
        options = "" if b.get("options") in (None, "-") else f" ({b['options']})"
        speedup = b.get("predicted_speedup")
        table.add_row(
            f"{b.get('optimizer', '?')}{options} {b.get('dtype', '')} {b.get('device', '')}",
            str(b.get("route", "")),
            str(b.get("tensors", "")),
            f"{b['elements']:,}" if isinstance(b.get("elements"), int) else "",
            str(b.get("launches", "")),
            "-" if speedup is None else f"{speedup:.1f}x (model)",
            "; ".join([str(b.get("reason", "")), *b.get("notes", [])]),
        )
    return table


def plan_tables(plan: dict[str, Any]) -> list[Table]:
    facts, tables = plan_rows(plan)
    out = []
    if facts:
        table = Table(title="plan", title_justify="left", show_header=False)
        table.add_column("key")
        table.add_column("value", overflow="fold")
        for key, value in facts:
            table.add_row(key, value)
        out.append(table)
    for name, rows in tables.items():
        if name == "buckets":
            out.append(bucket_table(rows))
            continue
        columns = list(dict.fromkeys(k for row in rows for k in row))
        table = Table(title=f"plan: {name}", title_justify="left")
        for col in columns:
            table.add_column(col, overflow="fold")
        for row in rows:
            table.add_row(*(str(row.get(col, "")) for col in columns))
        out.append(table)
    return out


def timing_table(metrics: ProfilerMetrics) -> Table:
    source = "CUDA events" if metrics.timing == "cuda_events" else "host clock"
    kept = metrics.step_time.count if metrics.step_time else 0
    title = f"step time ({metrics.steps_timed} steps timed, {source})"
    if metrics.step_time is not None and kept < metrics.steps_timed:
        left_out = "probe, baseline and dropped steps left out"
        title = f"step time ({kept} of {metrics.steps_timed} steps: {left_out}; {source})"
    table = Table(title=title, title_justify="left")
    table.add_column("ms/step")
    for col in ("p50", "p90", "mean", "min", "max"):
        table.add_column(col, justify="right")
    for label, stats in (("step", metrics.step_time), ("host", metrics.host_time)):
        if stats is not None:
            table.add_row(
                label, *(f"{v:.4f}" for v in (stats.p50_ms, stats.p90_ms, stats.mean_ms, stats.min_ms, stats.max_ms))
            )
    return table


def _spread(stats: TimeStats) -> str:
    return f"{stats.p10_ms:.4f}-{stats.p90_ms:.4f}" if stats.p10_ms is not None else f"-{stats.p90_ms:.4f}"


def comparison_renderable(cmp: Comparison) -> RenderableType:
    """The live-measured speedup, or why there is none (a figure appears only when it was measured)."""
    if cmp.status != "measured":
        return f"speedup over the wrapped optimizer's own step: {cmp.status}: {cmp.reason}"
    assert cmp.kitsune and cmp.baseline_time and cmp.kitsune_host and cmp.baseline_host
    title = (
        f"live comparison with {cmp.baseline}: kitsune's step {cmp.speedup:.2f}x as fast "
        f"(spread {cmp.speedup_low:.2f}x-{cmp.speedup_high:.2f}x; host time {cmp.host_speedup:.2f}x)"
    )
    table = Table(title=title, title_justify="left")
    table.add_column("step")
    for col in ("steps", "p50 ms", "p10-p90 ms", "host p50 ms"):
        table.add_column(col, justify="right")
    rows = (("kitsune", cmp.kitsune, cmp.kitsune_host), ("baseline", cmp.baseline_time, cmp.baseline_host))
    for label, dev, host in rows:
        table.add_row(label, str(dev.count), f"{dev.p50_ms:.4f}", _spread(dev), f"{host.p50_ms:.4f}")
    return table


def probe_lines(metrics: ProfilerMetrics) -> list[str]:
    """Launches, copies and syncs per step from the probe, and the bandwidth floor."""
    probe = metrics.probe
    if probe is None:
        return []
    if probe.status != "measured":
        return [f"probe (launches, syncs, bandwidth): {probe.status}: {probe.reason}"]
    counts = [f"{probe.syncs_per_step:g} host sync(s)"]
    if probe.launches_per_step is not None:
        counts = [f"{probe.launches_per_step:g} kernel launch(es)", f"{probe.copies_per_step:g} copy(ies)", *counts]
    lines = [f"per step, inside step() (probe of {probe.steps} step(s)): " + ", ".join(counts)]
    if probe.sync_sites:
        lines.append("  syncs called from: " + ", ".join(probe.sync_sites))
    if probe.phases_ms:
        phases = ", ".join(f"{name} {ms:.4f}" for name, ms in probe.phases_ms.items() if ms >= 0.00005)
        lines.append(f"  device ms per phase (median of the probe steps, run eagerly): {phases or 'all below 0.0001'}")
    if probe.reason:
        lines.append(f"  note: {probe.reason}")
    if metrics.floor_ms is not None and metrics.bytes_per_step is not None:
        pct = f", the median step is at {metrics.pct_of_floor:.0f}% of it" if metrics.pct_of_floor is not None else ""
        lines.append(
            f"bandwidth floor: the update moves {format_bytes(metrics.bytes_per_step)} per step; at the measured "
            f"{probe.copy_bandwidth_gbs:,.0f} GB/s that takes {metrics.floor_ms:.4f} ms{pct}"
        )
    return lines


def nvml_table(report: NvmlReport) -> Group:
    title = f"GPU telemetry (NVML): {report.device}, {len(report.samples)} samples every {report.interval_s} s"
    if report.dropped:
        title += f" ({report.dropped} older ones dropped)"
    table = Table()
    for col, justify in (("field", "left"), ("unit", "left"), ("mean", "right"), ("max", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for name, (label, unit) in FIELDS.items():
        stats = report.stats.get(name)
        if stats is not None:
            table.add_row(label, unit, f"{stats.mean:.1f}", f"{stats.max:.1f}")
    return Group(Text(title, style="italic"), table)


def memory_table(memory: MemoryInfo) -> Table:
    table = Table(title="CUDA memory (torch allocator)", title_justify="left")
    table.add_column("")
    table.add_column("now", justify="right")
    table.add_column("peak", justify="right")
    table.add_row("allocated", format_bytes(memory.allocated_bytes), format_bytes(memory.peak_allocated_bytes))
    table.add_row("reserved", format_bytes(memory.reserved_bytes), format_bytes(memory.peak_reserved_bytes))
    table.add_row("device total", format_bytes(memory.total_bytes), "")
    return table


def headline(profile: Profile) -> str:
    parts = [profile.optimizer]
    if profile.param_groups is not None:
        parts.append(f"{profile.param_groups} param group(s)")
    if profile.num_params is not None:
        parts.append(f"{profile.num_params} params")
    parts.append(f"{profile.step_count} steps")
    return ", ".join(parts)


def summary_renderables(profile: Profile) -> list[RenderableType]:
    env = profile.environment
    out: list[RenderableType] = [
        f"[bold]kitsune[/] summary: {headline(profile)}",
        f"[dim]{env.device} ({env.device_name}), torch {env.torch}, kitsune {env.kitsune}[/]",
        subsystem_table(profile.subsystems),
    ]
    if profile.plan:
        out.extend(plan_tables(profile.plan))
    metrics = profile.metrics
    if metrics is None:
        out.append("step timings: profiling is off (pass profile=True to record them)")
    elif metrics.step_time is None:
        out.append("step timings: no step has run yet")
    else:
        out.append(timing_table(metrics))
    if metrics is not None:
        if metrics.comparison is not None:
            out.append(comparison_renderable(metrics.comparison))
        out.extend(probe_lines(metrics))
    if profile.nvml is not None:
        if profile.nvml.available:
            out.append(nvml_table(profile.nvml))
        else:
            out.append(f"GPU telemetry (NVML): unavailable: {profile.nvml.reason}")
    if profile.memory is not None:
        out.append(memory_table(profile.memory))
    return out


def render_summary(profile: Profile, console: Console | None = None) -> None:
    """Print the summary of a profile (live or loaded with ``load_profile``)."""
    console = console or Console()
    for item in summary_renderables(profile):
        console.print(item)


def print_summary(opt: Profiled, console: Console | None = None) -> None:
    render_summary(build_profile(opt), console)
