"""A self-contained HTML report of a profile: tables and inline SVG plots drawn here, nothing fetched."""

from __future__ import annotations

import math
from html import escape
from pathlib import Path
from typing import Any

from kitsune._paths import write_output
from kitsune.profiler.core import TimeStats, quantile
from kitsune.profiler.nvml import FIELDS
from kitsune.profiler.schema import Profile, Profiled, build_profile
from kitsune.profiler.summary import (
    Explained,
    bucket_label,
    comparison_text,
    explain,
    format_bytes,
    headline,
    left_out,
    plan_rows,
    predicted_speedup,
    probe_lines,
    readable_value,
    times,
)

STEP_COLOR, HOST_COLOR, P50_COLOR, P90_COLOR, GPU_COLOR = "#d9480f", "#1971c2", "#2b8a3e", "#e67700", "#6741d9"

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #212529; background: #fff;
       max-width: 1100px; margin: 24px auto; padding: 0 16px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #dee2e6; }
.sub { color: #6c757d; margin-top: 0; }
table { border-collapse: collapse; margin: 8px 0 12px; max-width: 100%; }
th, td { border: 1px solid #dee2e6; padding: 3px 10px; text-align: left; vertical-align: top; }
td { overflow-wrap: break-word; } p { overflow-wrap: anywhere; }
th { background: #f1f3f5; } tr:nth-child(even) td { background: #f8f9fa; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.active { color: #2b8a3e; font-weight: 600; } .inactive { color: #e67700; font-weight: 600; }
.grid { display: flex; gap: 24px; flex-wrap: wrap; } .grid > div { flex: 1 1 320px; min-width: 0; }
.note { color: #6c757d; } .lead { font-weight: 600; }
svg.plot { display: block; width: 100%; height: auto; margin: 8px 0 16px; }
svg.plot text { font: 12px system-ui, sans-serif; fill: #495057; }
"""


def nice_ticks(lo: float, hi: float, target: int = 5, min_step: float = 0.0) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten, at least ``min_step`` apart) covering [lo, hi]."""
    if hi <= lo:
        hi = lo + 1.0
    raw = max((hi - lo) / target, min_step)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def _thin(xs: list[float], ys: list[float], buckets: int) -> tuple[list[float], list[float]]:
    """At most ~2 points per pixel column: each bucket keeps its min and max, so spikes stay visible."""
    if len(xs) <= 2 * buckets:
        return xs, ys
    out_x: list[float] = []
    out_y: list[float] = []
    size = len(xs) / buckets
    for b in range(buckets):
        lo, hi = int(b * size), max(int((b + 1) * size), int(b * size) + 1)
        chunk = range(lo, min(hi, len(xs)))
        i_min = min(chunk, key=ys.__getitem__)
        i_max = max(chunk, key=ys.__getitem__)
        for i in sorted({i_min, i_max}):
            out_x.append(xs[i])
            out_y.append(ys[i])
    return out_x, out_y


def line_plot(
    svg_id: str,
    title: str,
    xs: list[float],
    ys: list[float],
    *,
    color: str,
    x_label: str,
    y_label: str,
    integer_x: bool = False,
    hlines: tuple[tuple[float, str, str], ...] = (),
    y_cap: float | None = None,
    width: int = 1040,
    height: int = 240,
) -> str:
    """An inline SVG line plot of ys over xs, with optional labelled horizontal lines (value, label, color).

    Values above ``y_cap`` are drawn at the top edge and counted in a note, so one slow warm-up step does not
    flatten every other step into the axis.
    """
    left, right, top, bottom = 64, 110, 26, 40
    pw, ph = width - left - right, height - top - bottom
    x_lo, x_hi = (min(xs), max(xs)) if xs else (0.0, 1.0)
    if x_hi <= x_lo:
        x_hi = x_lo + 1.0
    clipped = [y for y in ys if y_cap is not None and y > y_cap]
    if clipped:
        ys = [min(y, y_cap) for y in ys]  # type: ignore[type-var]
    y_hi = max([*ys, *(v for v, _, _ in hlines), 0.0]) * 1.08 or 1.0
    y_ticks = nice_ticks(0.0, y_hi)
    y_hi = max(y_hi, y_ticks[-1])
    sx = lambda x: left + (x - x_lo) / (x_hi - x_lo) * pw
    sy = lambda y: top + ph - y / y_hi * ph
    parts = [
        f'<svg class="plot" id="{escape(svg_id)}" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{escape(title)}">',
        f"<title>{escape(title)}</title>",
        f'<text x="{left}" y="16" style="font-weight:600">{escape(title)}</text>',
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fcfcfd" stroke="#ced4da"/>',
    ]
    if clipped:
        note = f"{len(clipped)} point(s) above the axis, up to {_fmt(max(clipped))}"
        parts.append(f'<text class="clipped" x="{left + pw}" y="16" text-anchor="end">{escape(note)}</text>')
    for t in y_ticks:
        y = sy(t)
        parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e9ecef"/>')
        parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    for t in nice_ticks(x_lo, x_hi, 8, min_step=1.0 if integer_x else 0.0):
        x = sx(t)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top + ph}" y2="{top + ph + 4}" stroke="#868e96"/>')
        parts.append(f'<text x="{x:.1f}" y="{top + ph + 17}" text-anchor="middle">{_fmt(t)}</text>')
    parts.append(f'<text x="{left + pw / 2}" y="{height - 4}" text-anchor="middle">{escape(x_label)}</text>')
    parts.append(
        f'<text transform="translate(14 {top + ph / 2}) rotate(-90)" text-anchor="middle">{escape(y_label)}</text>'
    )
    px, py = _thin(xs, ys, pw)
    if len(px) == 1:
        parts.append(f'<circle cx="{sx(px[0]):.1f}" cy="{sy(py[0]):.1f}" r="3" fill="{color}"/>')
    elif px:
        points = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(px, py, strict=True))
        parts.append(f'<polyline class="series" points="{points}" fill="none" stroke="{color}" stroke-width="1.5"/>')
    label_ys: list[float] = []
    for value, label, line_color in sorted(hlines, key=lambda h: -h[0]):
        y = sy(value)
        parts.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="{line_color}" '
            f'stroke-width="1.5" stroke-dasharray="6 4"/>'
        )
        text_y = y + 4
        while any(abs(text_y - other) < 13 for other in label_ys):  # close values: stack their labels
            text_y += 13
        label_ys.append(text_y)
        parts.append(f'<text x="{left + pw + 6}" y="{text_y:.1f}" style="fill:{line_color}">{escape(label)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _table(header: list[str] | None, rows: list[list[Any]], numeric: frozenset[int] | set[int] = frozenset()) -> str:
    out = ["<table>"]
    if header:
        out.append("<tr>" + "".join(f"<th>{escape(h)}</th>" for h in header) + "</tr>")
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            raw = cell if isinstance(cell, _Raw) else escape(str(cell))
            cells.append(f'<td class="num">{raw}</td>' if i in numeric else f"<td>{raw}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


class _Raw(str):
    """Markup already escaped."""


def _flatten(d: dict[str, Any], prefix: str = "", in_bytes: bool = False) -> list[list[Any]]:
    """Nested dicts as ``a.b.c`` rows, each value for people (byte counts in KiB/MiB/GiB)."""
    rows = []
    for key, value in d.items():
        if isinstance(value, dict) and value:
            rows.extend(_flatten(value, f"{prefix}{key}.", in_bytes or "bytes" in key))
        else:
            rows.append([f"{prefix}{key}", readable_value(key, value, in_bytes)])
    return rows


def _stats_rows(label: str, stats: TimeStats | None) -> list[list[Any]]:
    if stats is None:
        return []
    values = (stats.p50_ms, stats.p90_ms, stats.mean_ms, stats.min_ms, stats.max_ms)
    return [[label, stats.count, *(f"{v:.4f}" for v in values)]]


def _counts(profile: Profile) -> str:
    """How many steps were timed and how many the statistics use, with what they leave out
    (`kitsune.profiler.summary.left_out`)."""
    metrics = profile.metrics
    assert metrics is not None and metrics.step_time is not None
    out = left_out(profile)
    text = f"{metrics.steps_timed} steps timed; {metrics.step_time.count} in the statistics below"
    return text + (f" (left out: {', '.join(out)})" if out else "")


def _timing_section(profile: Profile) -> list[str]:
    metrics = profile.metrics
    out = ["<h2>Step time</h2>"]
    if metrics is None:
        return [*out, '<p class="note">Profiling was off (pass profile=True to record step timings).</p>']
    if metrics.step_time is None or not profile.steps:
        return [*out, '<p class="note">No step was timed.</p>']
    source = "CUDA events" if metrics.timing == "cuda_events" else "host clock"
    out.append(f'<p class="sub" id="step-counts">{escape(_counts(profile))}; timed with {source}.</p>')
    header = ["ms/step", "steps", "p50", "p90", "mean", "min", "max"]
    rows = _stats_rows("step", metrics.step_time) + _stats_rows("host", metrics.host_time)
    out.append(_table(header, rows, numeric={1, 2, 3, 4, 5, 6}))
    kept = [r for r in profile.steps if r.mode == "kitsune"]  # probe and baseline steps are not kitsune's times
    timed = [r for r in kept if r.step_ms is not None]  # CUDA: the steps timed on the device (device_time_every)
    for svg_id, title, rows, values, stats, color in (
        ("plot-step-time", f"step time per step ({source})", timed, [r.step_ms for r in timed], metrics.step_time,
         STEP_COLOR),
        ("plot-host-time", "host time per step", kept, [r.host_ms for r in kept], metrics.host_time, HOST_COLOR),
    ):  # fmt: skip
        if not values:
            continue
        steps = [float(r.step) for r in rows]
        hlines = ()
        if stats is not None:
            hlines = (
                (stats.p50_ms, f"p50 {stats.p50_ms:.3g} ms", P50_COLOR),
                (stats.p90_ms, f"p90 {stats.p90_ms:.3g} ms", P90_COLOR),
            )
        cap = 5 * quantile(sorted(values), 0.9)  # clips rare outliers only: a slow mode over 10% sets p90
        plot = line_plot(
            svg_id, title, steps, values, color=color, x_label="step", y_label="ms", hlines=hlines, integer_x=True,
            y_cap=cap,
        )  # fmt: skip
        out.append(plot)
    return out


def _comparison_section(profile: Profile, explained: Explained) -> list[str]:
    metrics = profile.metrics
    if metrics is None:
        return []
    out = ['<h2 id="comparison">Live comparison and probe</h2>']
    cmp = metrics.comparison
    if cmp is not None and cmp.figures:
        assert cmp.kitsune and cmp.baseline_time and cmp.kitsune_host and cmp.baseline_host  # (what `figures` checked)
        out.append(
            f'<p class="sub">Against {escape(cmp.baseline or "?")}: kitsune\'s step {times(cmp.speedup)} as fast '
            f"(spread {times(cmp.speedup_low)}-{times(cmp.speedup_high)}; host time {times(cmp.host_speedup)}), "
            "measured on this run.</p>"
        )
        rows = [
            [label, dev.count, f"{dev.p50_ms:.4f}", f"{dev.p10_ms or 0:.4f}-{dev.p90_ms:.4f}", f"{host.p50_ms:.4f}"]
            for label, dev, host in (
                ("kitsune", cmp.kitsune, cmp.kitsune_host),
                ("baseline", cmp.baseline_time, cmp.baseline_host),
            )
        ]
        out.append(_table(["step", "steps", "p50 ms", "p10-p90 ms", "host p50 ms"], rows, numeric={1, 2, 3, 4}))
    elif cmp is not None and not (explained.pass_through and cmp.status == "not_applicable"):  # said at the top
        out.append(f'<p class="note">{escape(comparison_text(cmp))}</p>')
    out.extend(f'<p class="note">{escape(line.strip())}</p>' for line in probe_lines(metrics))
    return out


def _nvml_section(profile: Profile) -> list[str]:
    report = profile.nvml
    if report is None:
        return []
    out = ['<h2 id="nvml">GPU telemetry (NVML)</h2>']
    if not report.available:
        return [*out, f'<p class="note">Unavailable: {escape(report.reason or "unknown")}</p>']
    note = f"{report.device}, {len(report.samples)} samples every {report.interval_s} s"
    if report.dropped:
        note += f" ({report.dropped} older samples dropped)"
    out.append(f'<p class="sub">{escape(note)}</p>')
    rows = [
        [label, unit, f"{s.mean:.1f}", f"{s.max:.1f}"]
        for name, (label, unit) in FIELDS.items()
        if (s := report.stats.get(name)) is not None
    ]
    out.append(_table(["field", "unit", "mean", "max"], rows, numeric={2, 3}))
    for name, svg_id in (
        ("util_pct", "plot-nvml-util"),
        ("mem_used_mib", "plot-nvml-memory"),
        ("power_w", "plot-nvml-power"),
    ):
        pairs = [(s.t_us / 1e6, v) for s in report.samples if (v := getattr(s, name)) is not None]
        if not pairs:
            continue
        label, unit = FIELDS[name]
        xs, ys = [p[0] for p in pairs], [p[1] for p in pairs]
        title = f"{label} ({unit})"
        if name == "mem_used_mib" and profile.memory is not None:
            title += f" of {profile.memory.total_bytes / 2**20:.0f} MiB"
        out.append(
            line_plot(
                svg_id, title, xs, ys, color=GPU_COLOR, x_label="seconds since the profiler started", y_label=unit
            )
        )
    return out


def _memory_section(profile: Profile) -> list[str]:
    subsystem = next((s for s in profile.subsystems if s.name == "memory" and s.active and s.report), None)
    if profile.memory is None and subsystem is None:
        return []
    out = ['<h2 id="memory">Memory</h2>']
    if profile.memory is not None:
        m = profile.memory
        rows = [
            ["allocated", format_bytes(m.allocated_bytes), format_bytes(m.peak_allocated_bytes)],
            ["reserved", format_bytes(m.reserved_bytes), format_bytes(m.peak_reserved_bytes)],
            ["device total", format_bytes(m.total_bytes), ""],
        ]
        out.append(_table(["CUDA allocator", "now", "peak"], rows, numeric={1, 2}))
    if subsystem is not None:
        out.append(_table(["memory pool", "value"], _flatten(subsystem.report)))
    return out


def _plan_section(plan: dict[str, Any], explained: Explained) -> list[str]:
    facts, tables = plan_rows(plan)
    out = ['<h2 id="plan">Plan</h2>']
    if facts:
        out.append(_table(None, [list(f) for f in facts]))
    for name, rows in tables.items():
        out.append(f"<h3>{escape(name)}</h3>")
        if name == "buckets":
            out.append('<p class="note">speedup: the cost model\'s prediction, not a measurement.</p>')
            header = ["bucket", "route", "tensors", "elements", "launches", "speedup", "reason"]
            cells = [
                [bucket_label(b), b.get("route", ""), b.get("tensors", ""), f"{b.get('elements', 0):,}"]
                + [b.get("launches", ""), predicted_speedup(b), explained.notes[n - 1]]
                for b, n in zip(rows, explained.bucket_notes, strict=False)
            ]
            out.append(_table(header, cells, numeric={2, 3, 4, 5}))
            continue
        columns = list(dict.fromkeys(k for row in rows for k in row))
        out.append(_table(columns, [[readable_value(c, row.get(c, "")) for c in columns] for row in rows]))
    return out


def render_html(profile: Profile) -> str:
    """The report page as one string."""
    env = profile.environment
    explained = explain(profile)
    title = f"kitsune profile: {headline(profile)}"
    body = [
        f"<h1>{escape(title)}</h1>",
        f'<p class="sub">recorded {escape(profile.created.strftime("%Y-%m-%d %H:%M:%S %Z"))}, '
        f"schema {escape(profile.schema_version)}</p>",
    ]
    if explained.pass_through:
        body.append(f'<p class="lead" id="pass-through">{escape(explained.pass_through)}</p>')
    body += [
        '<div class="grid"><div><h2>Environment</h2>',
        _table(None, [[k, "" if v is None else v] for k, v in env.model_dump().items()]),
        "</div><div><h2>Config</h2>",
        _table(["setting", "value"], _flatten(profile.config)),
        "</div></div>",
        "<h2>Subsystems</h2>",
        _table(
            ["subsystem", "state", "detail"],
            [
                [
                    s.name,
                    _Raw(
                        f'<span class="{"active" if s.active else "inactive"}">'
                        f"{'active' if s.active else 'inactive'}</span>"
                    ),
                    explained.details.get(s.name, ""),
                ]
                for s in profile.subsystems
            ],
        ),
    ]
    if profile.plan:
        body += _plan_section(profile.plan, explained)
    body += _timing_section(profile) + _comparison_section(profile, explained)
    body += _nvml_section(profile) + _memory_section(profile)
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            f"<title>{escape(title)}</title>",
            f"<style>{CSS}</style>",
            "</head><body>",
            *body,
            "</body></html>",
            "",
        ]
    )


def write_html(profile: Profile | Profiled, path: str | Path) -> Path:
    """Write the report page for ``profile`` (a loaded profile, or a KitsuneOptimizer: its profile as
    ``save_profile`` would write it); returns the path. A path nothing can be written at (as ``kitsune report
    --html`` checks it) is a ValueError of one line, and nothing is written."""
    if not isinstance(profile, Profile):
        if not hasattr(profile, "profiler"):
            raise TypeError(
                f"write_html needs a Profile (kitsune.profiler.schema.load_profile(path)) or a KitsuneOptimizer, "
                f"got {type(profile).__name__}"
            )
        profile = build_profile(profile)
    return write_output(path, render_html(profile))
