"""A ``kitsune bench`` JSON as a self-contained SVG bar chart: each set's variants as a share of its bandwidth floor.

python -m kitsune.bench.plot bench.json bench.svg

A bar's length is ``% of floor`` (100% would be a step at the memory's copy rate), so sets of any size share one
axis; its label gives the median ms/step. Variants that did not run are listed with their status instead of a bar.
"""

from __future__ import annotations

import sys
from html import escape
from pathlib import Path

from kitsune.bench.results import BenchResult, SetResult
from kitsune.bench.table import SECTION_HEADS, sections

_ROW = 22  # px per variant row
_LABEL = 250  # px for the variant names
_BAR = 420  # px for 0-100% of the floor
_GAP = 30  # px between sets (the set's title)


def _rows(s: SetResult) -> list[tuple[str, float | None, str]]:
    """(label, % of floor or None, text after the bar) per variant."""
    rows = []
    for v in s.variants:
        if v.status == "ok" and v.device_ms is not None and v.pct_of_floor is not None:
            rows.append((v.label, min(v.pct_of_floor, 100.0), f"{v.device_ms.median:.3f} ms ({v.pct_of_floor:.0f}%)"))
        else:
            rows.append((v.label, None, v.status.replace("_", " ")))
    return rows


def bench_svg(result: BenchResult, title: str | None = None) -> str:
    """The SVG text (no scripts, fonts or external resources) for ``result``'s sets and phase."""
    sets = sections(result)
    env = result.environment
    title = title or f"AdamW step, {env.device_name or result.device}: % of the bandwidth floor (higher is faster)"
    if result.cpu_smoke:  # kitsune is a pass-through on a CPU: its bars and torch's time the same step
        title += "; a CPU smoke run, not a comparison"
    width = _LABEL + _BAR + 170
    y = 40
    parts: list[str] = []
    for s in sets:
        name = SECTION_HEADS[s.workload].format(s.name)
        parts.append(
            f'<text x="8" y="{y}" font-weight="bold">{escape(name)}: {s.n_tensors} tensors, '
            f"floor {s.floor_ms:.3f} ms</text>"
        )
        y += 8
        for label, pct, text in _rows(s):
            fill = "#e8590c" if label.startswith("kitsune") else "#868e96"
            parts.append(f'<text x="{_LABEL - 6}" y="{y + 15}" text-anchor="end">{escape(label)}</text>')
            end = _LABEL
            if pct is not None:
                w = max(_BAR * pct / 100, 1.0)
                parts.append(f'<rect x="{_LABEL}" y="{y + 3}" width="{w:.1f}" height="{_ROW - 6}" fill="{fill}"/>')
                end += w
            parts.append(f'<text x="{end + 6:.1f}" y="{y + 15}">{escape(text)}</text>')
            y += _ROW
        y += _GAP
    height = y
    axis = [
        f'<line x1="{_LABEL + _BAR * f}" y1="24" x2="{_LABEL + _BAR * f}" y2="{height - _GAP + 4}" stroke="#dee2e6"/>'
        f'<text x="{_LABEL + _BAR * f}" y="{height - _GAP + 18}" text-anchor="middle">{int(f * 100)}%</text>'
        for f in (0, 0.25, 0.5, 0.75, 1.0)
    ]
    foot = (
        f"torch {env.torch}, Triton {env.triton or '-'}; {result.created:%Y-%m-%d}; "
        f"copy {result.copy_bandwidth_gbs:,.0f} GB/s"
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height + 20}" '
        f'font-family="sans-serif" font-size="12">'
        f'<rect width="100%" height="100%" fill="white"/>'
        f'<text x="8" y="18" font-size="14">{escape(title)}</text>'
        + "".join(axis)
        + "".join(parts)
        + f'<text x="8" y="{height + 12}" fill="#495057">{escape(foot)}</text></svg>\n'
    )


def write_svg(json_path: str | Path, svg_path: str | Path) -> Path:
    """Read a ``--json`` result and write its chart."""
    out = Path(svg_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(bench_svg(BenchResult.load(json_path)))
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m kitsune.bench.plot BENCH.json OUT.svg", file=sys.stderr)
        return 2
    print(write_svg(args[0], args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
