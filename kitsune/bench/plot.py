"""A ``kitsune bench`` JSON as a self-contained SVG bar chart: each set's variants as a share of its bandwidth floor.

python -m kitsune.bench.plot bench.json bench.svg

A bar's length is ``% of floor`` (100% would be a step at the memory's copy rate), so sets of any size share one
axis; its label gives the median ms/step. Variants that did not run are listed with their status instead of a bar.
"""

from __future__ import annotations

import json
import sys
from html import escape
from pathlib import Path

from pydantic import ValidationError

from kitsune._paths import as_path, write_output
from kitsune.bench.results import BenchResult, SetResult
from kitsune.bench.table import SECTION_HEADS, sections
from kitsune.bench.variants import BYTES_PER_PARAM

_ROW = 22  # px per variant row
_LABEL = 250  # px for the variant names
_BAR = 420  # px for 0-100% of the floor
_GAP = 30  # px between sets (the set's title)


def _rows(s: SetResult) -> list[tuple[str, float | None, str]]:
    """(label, % of the set's floor or None, text after the bar) per variant. Every bar is against the set's floor
    (fp32 AdamW's bytes), so that a longer bar is a faster step: the low-precision state's rows, whose table column
    holds the share of their own smaller floor, run past 100% of it (the bar stops at 100%, the text says how far)."""
    rows = []
    for v in s.variants:
        if v.status == "ok" and v.device_ms is not None and v.pct_of_floor is not None:
            pct = 100 * s.floor_ms / v.device_ms.median
            text = f"{v.device_ms.median:.3f} ms ({pct:.0f}%"
            if v.variant in BYTES_PER_PARAM:
                text += f"; {v.pct_of_floor:.0f}% of its own floor, {BYTES_PER_PARAM[v.variant]:.4g} B/param"
            rows.append((v.label, min(pct, 100.0), text + ")"))
        else:
            rows.append((v.label, None, v.status.replace("_", " ")))
    return rows


def bench_svg(result: BenchResult, title: str | None = None) -> str:
    """The SVG text (no scripts, fonts or external resources) for ``result``'s sets and phase."""
    sets = sections(result)
    env = result.environment
    title = title or f"AdamW step, {env.device_name or result.device}: % of the bandwidth floor (higher is faster)"
    if result.cpu_smoke:  # on a CPU kitsune's rows run torch's step (or Triton's interpreter): no comparison
        title += "; a CPU smoke run, not a comparison"
    if not result.complete:  # saved after a set, then stopped (Ctrl-C) or still running
        title += "; a partial run (complete: false)"
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
    """Read a ``--json`` result and write its chart (atomically, ``~`` expanded); returns the path written.

    Raises:
        FileNotFoundError: nothing at ``json_path``.
        ValueError: ``json_path`` is not a bench result, or nothing can be written at ``svg_path``; one line.
    """
    return write_output(svg_path, bench_svg(load_result(json_path)))


def load_result(path: str | Path) -> BenchResult:
    """``BenchResult.load`` with a one-line ValueError for what is not a bench result (a profile, any other JSON)."""
    path = as_path(path)
    if path.is_dir():
        raise ValueError(f"{path}: is a directory, not a kitsune bench --json result")
    try:
        return BenchResult.load(path)
    except UnicodeDecodeError:
        raise ValueError(f"{path}: is not UTF-8 text, so not a kitsune bench --json result") from None
    except ValidationError as exc:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError:  # not UTF-8, not JSON
            raise ValueError(f"{path}: is not JSON, so not a kitsune bench --json result") from exc
        if isinstance(data, dict) and {"steps", "subsystems"} <= data.keys():
            raise ValueError(f"{path}: is a profile, not a bench result: read it with kitsune report {path}") from exc
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"]) or "top level"
        raise ValueError(
            f"{path}: is not a kitsune bench --json result ({where}: {first['msg']}): name a file that "
            "kitsune bench --json wrote"
        ) from exc


USAGE = "usage: python -m kitsune.bench.plot BENCH.json OUT.svg"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{__doc__.strip()}")
        return 0
    if len(args) != 2:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        result = load_result(args[0])
        out = write_output(args[1], bench_svg(result))
    except FileNotFoundError:
        print(f"python -m kitsune.bench.plot: {args[0]}: no such file", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"python -m kitsune.bench.plot: {args[0]}: cannot read it ({exc.strerror or exc})", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"python -m kitsune.bench.plot: {exc}", file=sys.stderr)
        return 2
    if not result.complete:
        done = ", ".join(s.name for s in result.sets) or "no set"
        print(
            f"note: {args[0]} is a partial run (complete: false; the run was stopped or is still going): the chart "
            f"shows what was done ({done})",
            file=sys.stderr,
        )
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
