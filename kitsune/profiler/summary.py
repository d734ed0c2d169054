"""``print_summary()``: rich tables of the subsystems, the plan and the step timings."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from kitsune.profiler.core import ProfilerMetrics

if TYPE_CHECKING:
    from kitsune.optimizer import KitsuneOptimizer


def subsystem_table(statuses: list[dict[str, Any]]) -> Table:
    table = Table(title="subsystems", title_justify="left")
    table.add_column("subsystem")
    table.add_column("state")
    table.add_column("detail", overflow="fold")
    for s in statuses:
        state = "[green]active[/]" if s["active"] else "[yellow]inactive[/]"
        detail = (
            s["reason"] if not s["active"] else ", ".join(f"{k}={v}" for k, v in s["report"].items() if k != "plan")
        )
        table.add_row(s["name"], state, detail or "")
    return table


def timing_table(metrics: ProfilerMetrics) -> Table:
    source = "CUDA events" if metrics.timing == "cuda_events" else "host clock"
    table = Table(title=f"step time ({metrics.steps_timed} steps timed, {source})", title_justify="left")
    table.add_column("ms/step")
    for col in ("p50", "p90", "mean", "min", "max"):
        table.add_column(col, justify="right")
    for label, stats in (("step", metrics.step_time), ("host", metrics.host_time)):
        if stats is not None:
            table.add_row(
                label, *(f"{v:.4f}" for v in (stats.p50_ms, stats.p90_ms, stats.mean_ms, stats.min_ms, stats.max_ms))
            )
    return table


def print_summary(opt: KitsuneOptimizer, console: Console | None = None) -> None:
    console = console or Console()
    base = type(opt.base_optimizer).__name__
    n_params = sum(len(g["params"]) for g in opt.param_groups)
    console.print(
        f"[bold]kitsune[/] summary: {base}, {len(opt.param_groups)} param group(s), {n_params} params, "
        f"{opt.step_count} steps"
    )
    console.print(subsystem_table(opt.subsystem_status()))
    if opt.plan is not None:
        console.print(opt.plan)
    prof = opt.profiler
    if prof is None:
        console.print("step timings: profiling is off (pass profile=True to record them)")
        return
    metrics = prof.get_metrics()
    if metrics.step_time is None:
        console.print("step timings: no step has run yet")
    else:
        console.print(timing_table(metrics))
