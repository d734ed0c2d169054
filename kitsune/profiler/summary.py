"""The summary: rich tables of the subsystems, the plan, the step timings, GPU telemetry and memory.

A live optimizer and a saved profile render through the same code: ``print_summary(opt)`` builds the
[`Profile`][kitsune.profiler.schema.Profile] that ``save_profile`` would write and renders that. It reads at any width:
long text (reasons, notes) wraps in full-width rows or in a numbered list under its table, each reason is printed
once and referred to after that, and byte counts and nested reports are written out for people.
"""

from __future__ import annotations

import textwrap
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from kitsune.fusion.plan import bucket_label, speedup_text
from kitsune.profiler.core import Comparison, ProfilerMetrics, TimeStats
from kitsune.profiler.nvml import FIELDS, NvmlReport
from kitsune.profiler.schema import MemoryInfo, Profile, SubsystemStatus, build_profile

if TYPE_CHECKING:
    from kitsune.profiler.schema import Profiled


def count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: "1 step", "20 steps"."""
    return f"{n} {noun}{'s' * (n != 1)}"


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _counts_bytes(key: str) -> bool:
    return "bytes" in key or key == "pool_size"  # pool_size: MemoryConfig's, in bytes


def readable_value(key: str, value: Any, in_bytes: bool = False) -> str:
    """One report or config value for people: byte counts (keys naming bytes, and what is nested under them) in
    KiB/MiB/GiB, floats to 4 digits unless whole, nested dicts as ``name (key: value, ...)``, lists comma-separated."""
    in_bytes = in_bytes or _counts_bytes(key)
    if isinstance(value, Mapping):
        items = [
            f"{k} ({text})" if isinstance(v, Mapping) else f"{k}: {text}"
            for k, v, text in ((k, v, readable_value(k, v, in_bytes)) for k, v in value.items())
        ]
        return ", ".join(items) or "none"
    if isinstance(value, (list, tuple)):
        return ", ".join(readable_value(key, v, in_bytes) for v in value) or "none"
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int) and in_bytes:
        return format_bytes(value)
    if isinstance(value, float):  # a whole number in full (a loss scale of 65536), others to 4 digits
        return f"{value:.0f}" if value.is_integer() and abs(value) < 1e15 else f"{value:.4g}"
    return str(value)


def readable(report: Mapping[str, Any]) -> str:
    """A subsystem's report as ``key: value; key: value`` text (None values left out)."""
    return "; ".join(f"{k}: {readable_value(k, v)}" for k, v in report.items() if v is not None)


def wrap(text: str, width: int, indent: str = "") -> list[str]:
    """``text`` in lines of at most ``width``, continuation lines indented, and never one word alone on the last line
    when the line above can give it a neighbour."""
    lines = textwrap.wrap(text, max(width, 1), subsequent_indent=indent, break_on_hyphens=False) or [""]
    if len(lines) > 1 and len(lines[-1].split()) == 1 and len(lines[-2].split()) > 2:
        head, _, word = lines[-2].rpartition(" ")
        last = f"{indent}{word} {lines[-1].strip()}"
        if len(last) <= width:
            lines[-2:] = [head, last]
    return lines


class Prose:
    """Plain text (no markup) that wraps at words with `wrap`: in a table cell or as a full-width row."""

    def __init__(self, text: str, indent: str = "", style: str = "") -> None:
        self.text, self.indent, self.style = text, indent, style

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield Text("\n".join(wrap(self.text, options.max_width, self.indent)), style=self.style, no_wrap=True)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        longest = max((len(w) for w in self.text.split()), default=0) + len(self.indent)
        return Measurement(min(longest, options.max_width), min(len(self.text), options.max_width))


# -- what the summary says in words ------------------------------------------------------------------------------
CPU_FALLBACK = "CPU tensors:"
"""How the planner's reason for CPU params begins (they go to the wrapped optimizer's own step)."""
CPU_REASON = (
    "CPU params: kitsune's fused kernels need CUDA, so the wrapped optimizer's own step updates these, "
    "bit-identical to the optimizer without kitsune"
)


@dataclass
class Explained:
    """The summary's words, each reason once: the pass-through line, each subsystem's detail and the plan's notes.
    The terminal summary and the HTML report both show these."""

    pass_through: str | None = None
    """Set when kitsune updated no param itself: what that means for the results and for speed."""
    details: dict[str, str] = field(default_factory=dict)
    """Subsystem name -> what it reported (active) or why it is inactive, a reason printed before referred to."""
    notes: list[str] = field(default_factory=list)
    """The plan's distinct reasons, numbered from 1 in the summary."""
    bucket_notes: list[int] = field(default_factory=list)
    """Each bucket's note number."""


def pass_through_line(profile: Profile) -> str | None:
    """What a run in which kitsune updated no param itself means, or None when kitsune did update params or before
    the first step (no step has updated any: `summary_renderables` says so instead)."""
    if profile.step_count == 0:
        return None
    active = {s.name for s in profile.subsystems if s.active}
    if active & {"fusion", "shard", "amp"} or (profile.config.get("grads") or {}).get("max_norm") is not None:
        return None
    if any(b.get("route") != "base_step" for b in (profile.plan or {}).get("buckets") or []):
        return None
    name = profile.optimizer
    line = (
        f"pass-through: {name}'s own step updated every param, so the results are bit-identical to {name} without "
        "kitsune."
    )
    if profile.environment.device == "cpu":
        return f"{line} kitsune's fused kernels need CUDA params: on CPU it has no faster step to offer."
    return f"{line} kitsune's kernels did not run (the fusion row below says why), so there is no speed-up to measure."


def _refer(text: str, said: list[tuple[str, str]]) -> str:
    """``text`` with every reason printed before replaced by how to find it (longest first: reasons nest)."""
    for before, ref in sorted(said, key=lambda s: -len(s[0])):
        if before and before in text:
            text = text.replace(before, ref)
    return text


def subsystem_details(
    statuses: Sequence[SubsystemStatus | dict[str, Any]], said: list[tuple[str, str]] | None = None
) -> dict[str, str]:
    """Subsystem name -> what it reported (active) or why it is inactive; a reason another row (or ``said``) has
    given already is referred to, not repeated."""
    said = [] if said is None else said
    out = {}
    for s in statuses:
        status = s if isinstance(s, SubsystemStatus) else SubsystemStatus(**s)
        if status.active:
            out[status.name] = readable({k: v for k, v in status.report.items() if k != "plan"})
            continue
        out[status.name] = _refer(status.reason or "", said)
        if status.reason and len(status.reason) >= 20:
            said.append((status.reason, f"see {status.name}"))
    return out


def explain(profile: Profile) -> Explained:
    """The words of the summary of ``profile``: the plan's reasons first (the subsystems' reasons quote them)."""
    out = Explained(pass_through=pass_through_line(profile))
    said: list[tuple[str, str]] = []  # (a reason as its source wrote it, how later text refers to it)
    for b in (profile.plan or {}).get("buckets") or []:
        reason = str(b.get("reason", ""))
        cpu = b.get("device") == "cpu" and b.get("route") == "base_step" and reason.startswith(CPU_FALLBACK)
        if cpu and out.pass_through:
            shown = ref = "CPU params (see pass-through above)"
        else:
            # the planner's CPU reason names Triton's interpreter, a test mode far slower than torch: not advice
            shown = "; ".join([CPU_REASON if cpu else reason, *b.get("notes", [])])
            ref = ""
        if shown not in out.notes:
            out.notes.append(shown)
        n = out.notes.index(shown) + 1
        out.bucket_notes.append(n)
        if len(reason) >= 20:
            said.append((reason, ref or f"see the plan's note [{n}]"))
    out.details = subsystem_details(profile.subsystems, said)
    return out


# -- the tables ---------------------------------------------------------------------------------------------------
def subsystem_table(
    statuses: Sequence[SubsystemStatus | dict[str, Any]], details: Mapping[str, str] | None = None
) -> Table:
    details = subsystem_details(statuses) if details is None else details
    table = Table(title="subsystems", title_justify="left")
    table.add_column("subsystem")
    table.add_column("state")
    table.add_column("detail")
    for s in statuses:
        status = s if isinstance(s, SubsystemStatus) else SubsystemStatus(**s)
        state = "[green]active[/]" if status.active else "[yellow]inactive[/]"
        table.add_row(status.name, state, Prose(details.get(status.name, "")))
    return table


def plan_rows(plan: dict[str, Any]) -> tuple[list[tuple[str, str]], dict[str, list[dict[str, Any]]]]:
    """Split a plan dict into (scalar facts, tables): every list of dicts is a table, the rest are facts."""
    facts: list[tuple[str, str]] = []
    tables: dict[str, list[dict[str, Any]]] = {}
    for key, value in plan.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            tables[key] = value
        else:
            facts.append((key, readable_value(key, value)))
    return facts, tables


def predicted_speedup(b: Mapping[str, Any]) -> str:
    return speedup_text(dict(b))


class WideOrStacked:
    """A table where its columns fit the console at their narrowest (every column legible, the wrapped ones at
    their longest word), else each row as a block of ``column  value`` lines under the title: at 80 columns a
    plan's seven columns do not fit, and rich would squeeze the bucket label away."""

    def __init__(self, title: str, columns: list[str], rows: list[list[Any]], right: Sequence[str] = ()) -> None:
        self.title, self.columns, self.rows = title, columns, rows
        self.table = Table(title=title, title_justify="left")
        for col in columns:
            wraps = col == columns[0]
            self.table.add_column(col, justify="right" if col in right else "left", no_wrap=not wraps)
        for row in rows:
            self.table.add_row(*row)

    def needed(self) -> int:
        """The table's narrowest width that shows every column whole: the no-wrap columns at their longest cell,
        the first at its longest word, each with its padding and rule (rich's own measure allows less)."""

        def text(cell: Any) -> str:
            return cell.text if isinstance(cell, Prose) else str(cell)

        widths = []
        for j, col in enumerate(self.columns):
            cells = [text(row[j]) for row in self.rows]
            words = [w for c in cells for w in c.split()] if j == 0 else cells
            widths.append(max([len(col), *map(len, words)]))
        return sum(widths) + 3 * len(widths) + 1

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if self.needed() <= options.max_width:
            yield self.table
            return
        yield Prose(self.title)
        for row in self.rows:
            block = Table(show_header=False, box=None, padding=(0, 1, 0, 2))
            block.add_column("column", style="dim", no_wrap=True)
            block.add_column("value")
            for col, value in zip(self.columns, row, strict=True):
                block.add_row(col, value)
            yield block


def bucket_table(rows: list[dict[str, Any]], explained: Explained) -> Group:
    """The plan's buckets, one row each (the columns of ``rich.print(opt.plan)``), stacked where the console is
    too narrow for them; the reasons, each once, numbered in a list under the table, where they wrap at the full
    width."""
    title = "plan: buckets (speedup: the cost model's prediction, fused vs fallback ms, not a measurement)"
    columns = ["bucket", "route", "tensors", "elements", "launches", "speedup", "note"]
    cells = [
        [
            Prose(bucket_label(b)),
            str(b.get("route", "")),
            str(b.get("tensors", "")),
            f"{b['elements']:,}" if isinstance(b.get("elements"), int) else "",
            str(b.get("launches", "")),
            predicted_speedup(b),
            f"[{n}]",
        ]
        for b, n in zip(rows, explained.bucket_notes, strict=False)
    ]
    table = WideOrStacked(title, columns, cells, right=columns[2:])
    notes = [Prose(f"[{i}] {text}", indent="    ") for i, text in enumerate(explained.notes, 1)]
    return Group(table, *notes)


def plan_tables(plan: dict[str, Any], explained: Explained) -> list[RenderableType]:
    facts, tables = plan_rows(plan)
    out: list[RenderableType] = []
    if facts:
        table = Table(title="plan", title_justify="left", show_header=False)
        table.add_column("key")
        table.add_column("value")
        for key, value in facts:
            table.add_row(key, Prose(value))
        out.append(table)
    for name, rows in tables.items():
        if name == "buckets":
            out.append(bucket_table(rows, explained))
            continue
        columns = list(dict.fromkeys(k for row in rows for k in row))
        table = Table(title=f"plan: {name}", title_justify="left")
        for col in columns:
            table.add_column(col)
        for row in rows:
            table.add_row(*(Prose(readable_value(col, row.get(col, ""))) for col in columns))
        out.append(table)
    return out


def left_out(profile: Profile) -> list[str]:
    """The timed steps the step-time statistics leave out, counted by kind: the warm-up's (once a later step was
    timed), the probe's, the comparison's baseline steps, those not timed on the device, and records beyond
    ``max_step_records``."""
    metrics = profile.metrics
    assert metrics is not None
    modes = Counter(r.mode for r in profile.steps)
    kinds = (("probe", "probe"), ("baseline", "comparison baseline"))
    out = [f"{modes[mode]} {what}" for mode, what in kinds if modes[mode]]
    if metrics.warmup_left_out:
        out.insert(0, f"{metrics.warmup_left_out} warm-up")
    untimed = sum(1 for r in profile.steps if r.mode == "kitsune" and r.step_ms is None)
    if untimed:  # CUDA: past the windows one step in device_time_every is timed on the device
        out.append(f"{untimed} not timed on the device")
    if metrics.steps_timed > len(profile.steps):
        out.append(f"{metrics.steps_timed - len(profile.steps)} older than the kept records")
    return out


def timing_table(profile: Profile) -> Table:
    metrics = profile.metrics
    assert metrics is not None
    source = "CUDA events" if metrics.timing == "cuda_events" else "host clock"
    kept = metrics.step_time.count if metrics.step_time else 0
    title = f"step time ({count(metrics.steps_timed, 'step')} timed, {source})"
    if metrics.step_time is not None and kept < metrics.steps_timed:
        title = (
            f"step time ({kept} of {count(metrics.steps_timed, 'step')}: {', '.join(left_out(profile))} left out; "
            f"{source})"
        )
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


def times(ratio: float | None) -> str:
    """A speed ratio: two decimals, or two significant digits below 0.1 (``0.0042x``, not ``0.00x``)."""
    if ratio is None:
        return "-"
    return f"{ratio:.2f}x" if ratio >= 0.1 else f"{ratio:.2g}x"


def _spread(stats: TimeStats) -> str:
    return f"{stats.p10_ms:.4f}-{stats.p90_ms:.4f}" if stats.p10_ms is not None else f"-{stats.p90_ms:.4f}"


COMPARISON_STATUS = {"off": "off", "pending": "not run yet", "not_applicable": "not applicable"}
"""The live comparison's status in words (the profile keeps the field's value)."""
PROBE_STATUS = {"off": "off", "pending": "not run yet", "unavailable": "not available"}


def comparison_text(cmp: Comparison) -> str:
    """Why there is no measured speedup, in one line."""
    status = COMPARISON_STATUS.get(cmp.status, cmp.status)
    return f"live comparison with the wrapped optimizer's own step: {status}: {cmp.reason}"


def comparison_renderable(cmp: Comparison) -> RenderableType:
    """The live-measured speedup, or why there is none (a figure appears only when it was measured)."""
    if not cmp.figures:
        return Prose(comparison_text(cmp))
    assert cmp.kitsune and cmp.baseline_time and cmp.kitsune_host and cmp.baseline_host  # (what `figures` checked)
    title = (
        f"live comparison with {cmp.baseline}: kitsune's step {times(cmp.speedup)} as fast "
        f"(spread {times(cmp.speedup_low)}-{times(cmp.speedup_high)}; host time {times(cmp.host_speedup)})"
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
        return [f"probe (launches, syncs, bandwidth): {PROBE_STATUS.get(probe.status, probe.status)}: {probe.reason}"]
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
        pct = metrics.pct_of_floor
        pct = f"; the median step runs at {pct:.0f}% of that speed (floor / median)" if pct is not None else ""
        lines.append(
            f"bandwidth floor: the update moves {format_bytes(metrics.bytes_per_step)} per step; at the measured "
            f"{probe.copy_bandwidth_gbs:,.0f} GB/s that takes {metrics.floor_ms:.4f} ms{pct}"
        )
    return lines


def _duration(ms: float) -> str:
    return f"{ms:.1f} ms" if ms < 1000 else f"{ms / 1000:.1f} s"


def _pct(value: float) -> str:
    return f"{value:.1f}%" if value >= 0.1 else f"{value:.2g}%"


WINDOW_NAMES = {"probe": "probe", "comparison": "live comparison"}


def window_line(metrics: ProfilerMetrics) -> str | None:
    """What share of the run's steps and time the sampled windows took, or None when none ran."""
    if not metrics.windows:
        return None
    parts = []
    for w in metrics.windows:
        part = f"{WINDOW_NAMES[w.window]} {w.steps} of {count(metrics.steps_timed, 'step')} ({_pct(w.pct_of_steps)}), "
        part += _duration(w.ms)
        if w.pct_of_time is not None and metrics.run_ms is not None:
            part += f" of the run's {_duration(metrics.run_ms)} ({_pct(w.pct_of_time)})"
        parts.append(part)
    return "sampled windows (their time includes the training between their steps): " + "; ".join(parts)


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
    return Group(Prose(title, style="italic"), table)


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
        parts.append(count(profile.num_params, "param"))
    parts.append(count(profile.step_count, "step"))
    return ", ".join(parts)


def summary_renderables(profile: Profile) -> list[RenderableType]:
    env = profile.environment
    explained = explain(profile)
    out: list[RenderableType] = [
        f"[bold]kitsune[/] summary: {headline(profile)}",
        Prose(f"{env.device} ({env.device_name}), torch {env.torch}, kitsune {env.kitsune}", style="dim"),
    ]
    if profile.step_count == 0:
        said = f"which step updates the params ({profile.optimizer}'s own or kitsune's) is said after the first"
        out.append(Prose(f"no step has run yet: {said}"))
    elif explained.pass_through:
        out.append(Prose(explained.pass_through, style="bold"))
    out.append(subsystem_table(profile.subsystems, explained.details))
    if profile.plan:
        out.extend(plan_tables(profile.plan, explained))
    metrics = profile.metrics
    if metrics is None:
        out.append("step timings: profiling is off (pass profile=True to record them)")
    elif metrics.step_time is None and profile.step_count == 0:
        out.append("step timings: no step has run yet")
    elif metrics.step_time is None:  # steps ran, none recorded: a reset, a load, or only the windows' steps
        out.append(
            f"step timings: none recorded of the {profile.step_count} step(s) so far (the profiler was reset, the "
            "state loaded, or the steps were the probe's or the comparison's)"
        )
    else:
        out.append(timing_table(profile))
    if metrics is not None:
        cmp = metrics.comparison
        if cmp is not None and not (explained.pass_through and cmp.status == "not_applicable"):  # said above
            out.append(comparison_renderable(cmp))
        out.extend(Prose(line, indent="    ") for line in probe_lines(metrics))
        windows = window_line(metrics)
        if windows is not None:
            out.append(Prose(windows, indent="    "))
    if profile.nvml is not None:
        if profile.nvml.available:
            out.append(nvml_table(profile.nvml))
        else:
            out.append(Prose(f"GPU telemetry (NVML): unavailable: {profile.nvml.reason}"))
    if profile.memory is not None:
        out.append(memory_table(profile.memory))
    return out


def as_console(console: Console | TextIO | None) -> Console:
    """``console`` as a rich Console: None -> the terminal's; a text file (``sys.stdout``, an open file,
    ``io.StringIO``) -> a Console writing to it. Anything else is a TypeError naming what to pass."""
    if console is None or isinstance(console, Console):
        return console or Console()
    if callable(getattr(console, "write", None)):
        return Console(file=console)
    raise TypeError(f"console: expected a rich Console or a text file such as sys.stdout, got {type(console).__name__}")


def render_summary(profile: Profile, console: Console | TextIO | None = None) -> None:
    """Print the summary of a profile (live or loaded with ``load_profile``) to ``console``: a rich Console, a text
    file (``sys.stdout``, ``io.StringIO``) or None for the terminal."""
    console = as_console(console)
    for item in summary_renderables(profile):
        console.print(item)


def print_summary(opt: Profiled, console: Console | TextIO | None = None) -> None:
    render_summary(build_profile(opt), console)
