"""The results of ``kitsune bench`` as rich tables: a section per set, a row per variant, then the notes."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from kitsune.bench.e2e import E2EResult
from kitsune.bench.info import route_line
from kitsune.bench.results import BenchResult, PeerStatus, SetResult, VariantResult

ADAMW_STATE_BYTES_PER_PARAM = 8
"""fp32 AdamW's state: exp_avg and exp_avg_sq, 4 bytes each (the step counts are a few bytes per tensor)."""

_GRADS = {
    "kept": "",
    "refilled": "; its step zeroes or overwrites the grads: refilled before each step, outside the timers",
    "reattached": "; its step frees the grads: put back and refilled before each step, outside the timers",
}


def default_console() -> Console:
    """The terminal, or 120 columns where the output goes to a log file (rich's 80 would wrap the table)."""
    console = Console()
    return console if console.is_terminal else Console(width=max(console.width, 120))


def _note(v: VariantResult) -> str | None:
    if v.status == "not_timed":
        return v.reason
    if v.status != "ok":
        return f"{v.status}: {v.reason}"
    route = route_line(v.kitsune)
    if v.peer is not None:  # kitsune's own reference rows (its fused Lion) are run as peers: their route too
        p = v.peer
        paged = "; state paged" if p.state_paged else ""
        note = (
            f"{p.pip} {p.version or '(version unknown)'}: {p.settings}{paged}{_GRADS[p.grads]}; "
            f"params moved on each of {p.checked_steps} checks"
            + (
                f"; {p.short_steps} steps a timed pass (a step took {p.warm_step_ms / 1e3:.2f} s)"
                if p.short_steps
                else ""
            )
        )
        return note if route is None else f"{note}; {route}"
    return route


def _pct(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:.0f}%" if value >= 10 else f"{value:.1f}%" if value >= 1 else f"{value:.2f}%"


def _state(v: VariantResult, entry: SetResult) -> str:
    if v.state_bytes is None:
        return ""
    fp32 = ADAMW_STATE_BYTES_PER_PARAM * entry.n_elements
    paged = "paged " if v.peer is not None and v.peer.state_paged else ""
    return f"{paged}{v.state_bytes / 2**20:,.1f} ({v.state_bytes / fp32:.2f}x)"


def sections(result: BenchResult) -> list[SetResult]:
    """Each set, its Lion section after it (``--peers``), then the phase."""
    lion = {entry.name: entry for entry in result.lion}
    entries = [e for entry in result.sets for e in (entry, lion.pop(entry.name, None)) if e is not None]
    return [*entries, *lion.values(), *([result.phase] if result.phase is not None else [])]


CPU_SMOKE = (
    "a CPU run is a smoke test of the command, not a comparison: on a CPU kitsune's rows run torch's own step (its "
    "fused kernels and CUDA graphs need CUDA; with TRITON_INTERPRET=1 the kernels run in Triton's interpreter, a "
    "test harness far slower than either), so a ratio would only measure noise or the interpreter; the tables leave "
    "the ratios out. Compare on a GPU."
)
"""The line a CPU run (``BenchResult.cpu_smoke``) ends with."""
NOT_SHOWN = "-"
"""A cell a CPU run leaves out: a ratio, or the peak memory it does not measure."""

SECTION_HEADS = {"adamw_step": "{}", "amp_clip_phase": "{} phase", "lion_step": "{} Lion"}
_STATUS = {"not_available": "n/a", "not_timed": "not timed"}


def profiler_cost_line(entry: SetResult) -> str:
    """The set's profiler cost measured in pairs (`kitsune.bench.results.ProfilerCost`), or why it was not."""
    c = entry.profiler_cost
    if c is None:
        return f"profile=True, in pairs: not measured ({entry.profiler_cost_reason})"
    return (
        f"profile=True, in pairs ({c.rounds} alternating rounds of {c.steps} steps a side, on two pairs built in "
        "either order): "
        f"{c.device_pct.median:+.2f}% of the step (p10-p90 {c.device_pct.p10:+.2f}% to {c.device_pct.p90:+.2f}%), "
        f"host {c.host_ms.median:+.4f} ms a step ({c.host_ms.p10:+.4f} to {c.host_ms.p90:+.4f})"
    )


def paired_line(entry: SetResult) -> str:
    """kitsune against torch's CUDA graph on this set, measured in pairs (`kitsune.bench.results.PairedRatio`), or
    why it was not."""
    p = entry.paired
    if p is None:
        return f"kitsune against torch's CUDA graph, in pairs: not measured ({entry.paired_reason})"
    return (
        f"kitsune against torch's CUDA graph, in pairs ({p.rounds} alternating rounds of {p.steps} steps a side, on "
        f"two pairs built in either order): {p.ratio.median:.2f}x (p10-p90 {p.ratio.p10:.2f}x to {p.ratio.p90:.2f}x), "
        f"host {p.host_ms.median:+.4f} ms a step for the graph"
    )


def peer_lines(peers: list[PeerStatus]) -> list[str]:
    """The peers that did not run, a line for those not installed (grouped by what ``pip install`` takes) and one
    per reason for those skipped."""
    lines = []
    by_pip: dict[str, list[str]] = {}
    for s in peers:
        if not s.installed:
            by_pip.setdefault(s.pip, []).append(s.label)
    if by_pip:
        lines.append("not installed: " + "; ".join(f"{', '.join(v)} (pip install {k})" for k, v in by_pip.items()))
    by_reason: dict[str, list[str]] = {}
    for s in peers:
        if s.skipped is not None:
            by_reason.setdefault(s.skipped, []).append(s.label)
    lines += [f"skipped: {', '.join(labels)}: {reason}" for reason, labels in by_reason.items()]
    return lines


def print_results(result: BenchResult, console: Console | None = None) -> None:
    """The results as one rich table (a section per set, a row per variant), then the notes it refers to.

    A ``--peers`` run adds a column of state memory, a Lion section per set, and the peers that are not installed.
    A CPU run (``cpu_smoke``) shows its times with ``-`` for the ratios (``% floor``, ``t / kitsune``), leaves out
    the profiler's cost in pairs and the end-to-end ratios, and ends with `CPU_SMOKE`.
    """
    console = console or default_console()
    smoke = result.cpu_smoke
    entries = sections(result)
    with_state = any(v.state_bytes is not None for entry in entries for v in entry.variants)
    title = f"AdamW fp32, {result.environment.device_name}, copy {result.copy_bandwidth_gbs:,.0f} GB/s"
    title += ", grads re-allocated every step" if result.grads == "fresh" else ""
    title += ", CPU smoke test" if smoke else ""
    table = Table(title=title + (" (Lion sections: fp32 Lion)" if result.lion else ""))
    names = ["set", "variant", "ms/step", "p10-p90", "host ms", "floor ms", "% floor", "t / kitsune"]
    for name in [*names, *(["state MiB"] if with_state else [])]:
        text = name in ("set", "variant")
        table.add_column(name, justify="left" if text else "right", no_wrap=not text, min_width=7 if text else None)
    notes: list[str] = []
    for entry in entries:
        head = SECTION_HEADS[entry.workload].format(entry.name)
        for i, v in enumerate(entry.variants):
            ok = v.status == "ok"
            ratio = entry.ratio_to_kitsune.get(v.variant)
            note = _note(v)
            if note is not None:
                notes.append(f"[{len(notes) + 1}] {head} / {v.label}: {note}")
            table.add_row(
                head if i == 0 else "",
                v.label + (f" [{len(notes)}]" if note is not None else ""),
                f"{v.device_ms.median:.3f}" if ok else _STATUS.get(v.status, v.status),
                f"{v.device_ms.p10:.3f}-{v.device_ms.p90:.3f}" if ok else "",
                f"{v.host_ms.median:.3f}" if ok else "",
                f"{entry.floor_ms:.3f}" if i == 0 else "",
                NOT_SHOWN if smoke and ok else _pct(v.pct_of_floor) if ok else "",
                NOT_SHOWN if smoke and ok else _ratio(ratio),
                *([_state(v, entry)] if with_state else []),
                end_section=i == len(entry.variants) - 1,
            )
    console.print(table)
    if with_state:
        console.print(
            f"state MiB: the optimizer's state tensors after warm-up (quantized codes and scales included); in "
            f"brackets, over fp32 AdamW's {ADAMW_STATE_BYTES_PER_PARAM} bytes/param. % floor: of fp32 AdamW's (fp32 "
            "Lion's in Lion sections) bytes at the copy rate, so a peer's 8-bit and 4-bit state can pass 100%; "
            "kitsune's 8bit and bf16state rows: of the bytes they move",
            highlight=False,
        )
    for line in notes:
        console.print(line, highlight=False)
    for entry in result.sets:
        if not smoke and (entry.profiler_cost is not None or entry.profiler_cost_reason is not None):
            console.print(f"{entry.name}: {profiler_cost_line(entry)}", highlight=False)
        if not smoke and (entry.paired is not None or entry.paired_reason is not None):
            console.print(f"{entry.name}: {paired_line(entry)}", highlight=False)
    for line in peer_lines(result.peers):
        console.print(line, highlight=False)
    if result.e2e is not None:
        print_e2e(result.e2e, console, cpu_smoke=smoke)
    if smoke:
        console.print(CPU_SMOKE, highlight=False)


def _ratio(ratio: float | None) -> str:
    return "" if ratio is None else f"{ratio:.2f}x" if ratio >= 0.1 else f"{ratio:.2g}x"


def print_e2e(e2e: E2EResult, console: Console, cpu_smoke: bool = False) -> None:
    """The end-to-end table and the line of its ratios; ``cpu_smoke``: no peak memory (not measured on a CPU) and no
    ratios, only how far the clipped sides' losses differ."""
    m = e2e.model
    table = Table(
        title=f"end to end: GPT ({e2e.n_params / 1e6:.3g}M params, {m.layers} layers, {m.dim} wide"
        f"{f', torch.compile {e2e.compile_backend}' if e2e.compile_backend else ''}), bf16 autocast, "
        f"batch {e2e.batch} x {e2e.seq}, AdamW, clip {e2e.max_grad_norm:g}; {e2e.steps} steps a side in turns of "
        f"{e2e.block}"
    )
    for name in ("side", "ms/step", "p10-p90", "tokens/s", "peak memory (build, warm-up)", "last loss"):
        table.add_column(name, justify="left" if name == "side" else "right")
    for side in e2e.sides:
        table.add_row(
            side.label,
            f"{side.step_ms.median:.2f}",
            f"{side.step_ms.p10:.2f}-{side.step_ms.p90:.2f}",
            f"{side.tokens_per_s:,.0f}",
            NOT_SHOWN if cpu_smoke else f"{side.peak_memory_bytes / 2**30:.2f} GiB",
            f"{side.last_loss:.4f}",
        )
    console.print(table)
    for side in e2e.sides:  # what each kitsune side ran on the GPU: a fallback or an eager step shows here
        route = None if cpu_smoke else route_line(side.kitsune)
        if route is not None:
            console.print(f"{side.label}: {route}", highlight=False)
    compared = min(10, len(e2e.sides[0].losses)) if e2e.sides else 10  # a short run has fewer than 10
    losses = (
        f"the clipped sides' losses over the first {compared} steps differ by at most {e2e.max_loss_diff_first_10:.2g}"
    )
    if cpu_smoke:
        console.print(losses, highlight=False)
        return
    console.print(
        f"kitsune's tokens/s over torch's: {e2e.ratio:.3f}x with clipping; without, {e2e.ratio_noclip:.3f}x with the "
        f"updates inside backward ({e2e.ratio_noclip_current:.3f}x on backward's stream) and "
        f"{e2e.ratio_noclip_step:.3f}x with the step after backward; {losses}",
        highlight=False,
    )
