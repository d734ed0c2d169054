"""The results of ``kitsune bench`` as rich tables: a section per set, a row per variant, then the notes."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from kitsune.bench.e2e import E2EResult
from kitsune.bench.results import BenchResult, VariantResult


def default_console() -> Console:
    """The terminal, or 120 columns where the output goes to a log file (rich's 80 would wrap the table)."""
    console = Console()
    return console if console.is_terminal else Console(width=max(console.width, 120))


def _note(v: VariantResult) -> str | None:
    if v.status != "ok":
        return f"{v.status}: {v.reason}"
    k = v.kitsune
    if k is None:
        return None
    active = f"active subsystems: {', '.join(k.active_subsystems) or 'none'}"
    if not k.fusion_active:
        return f"fusion inactive: {k.fusion_reason}; {active}"
    fused = "?" if k.fused_params is None else str(k.fused_params)
    launches = "" if k.launches_per_step is None else f" in {k.launches_per_step} launch(es)/step"
    fallbacks = "".join(f"; fallback: {f}" for f in k.fallbacks)
    return f"fused {fused}/{k.total_params} params{launches}{fallbacks}; {active}"


def _pct(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:.0f}%" if value >= 10 else f"{value:.1f}%" if value >= 1 else f"{value:.2f}%"


def print_results(result: BenchResult, console: Console | None = None) -> None:
    """The results as one rich table (a section per set, a row per variant), then the notes it refers to."""
    console = console or default_console()
    table = Table(title=f"AdamW fp32, {result.environment.device_name}, copy {result.copy_bandwidth_gbs:,.0f} GB/s")
    for name in ("set", "variant", "ms/step", "p10-p90", "host ms", "floor ms", "% floor", "t / kitsune"):
        text = name in ("set", "variant")
        table.add_column(name, justify="left" if text else "right", no_wrap=not text, min_width=7 if text else None)
    notes: list[str] = []
    for entry in [*result.sets, *([result.phase] if result.phase is not None else [])]:
        head = entry.name if entry.workload == "adamw_step" else f"{entry.name} phase"
        for i, v in enumerate(entry.variants):
            ok = v.status == "ok"
            ratio = entry.ratio_to_kitsune.get(v.variant)
            note = _note(v)
            if note is not None:
                notes.append(f"[{len(notes) + 1}] {head} / {v.label}: {note}")
            table.add_row(
                head if i == 0 else "",
                v.label + (f" [{len(notes)}]" if note is not None else ""),
                f"{v.device_ms.median:.3f}" if ok else {"not_available": "n/a"}.get(v.status, v.status),
                f"{v.device_ms.p10:.3f}-{v.device_ms.p90:.3f}" if ok else "",
                f"{v.host_ms.median:.3f}" if ok else "",
                f"{entry.floor_ms:.3f}" if i == 0 else "",
                _pct(v.pct_of_floor) if ok else "",
                "" if ratio is None else f"{ratio:.2f}x" if ratio >= 0.1 else f"{ratio:.2g}x",
                end_section=i == len(entry.variants) - 1,
            )
    console.print(table)
    for line in notes:
        console.print(line, highlight=False)
    if result.e2e is not None:
        print_e2e(result.e2e, console)


def print_e2e(e2e: E2EResult, console: Console) -> None:
    m = e2e.model
    table = Table(
        title=f"end to end: GPT ({e2e.n_params / 1e6:.3g}M params, {m.layers} layers, {m.dim} wide"
        f"{f', torch.compile {e2e.compile_backend}' if e2e.compile_backend else ''}), bf16 autocast, "
        f"batch {e2e.batch} x {e2e.seq}, AdamW, clip {e2e.max_grad_norm:g}; {e2e.steps} steps a side in turns of "
        f"{e2e.block}"
    )
    for name in ("side", "ms/step", "p10-p90", "tokens/s", "peak memory", "last loss"):
        table.add_column(name, justify="left" if name == "side" else "right")
    for side in e2e.sides:
        table.add_row(
            side.label,
            f"{side.step_ms.median:.2f}",
            f"{side.step_ms.p10:.2f}-{side.step_ms.p90:.2f}",
            f"{side.tokens_per_s:,.0f}",
            f"{side.peak_memory_bytes / 2**30:.2f} GiB",
            f"{side.last_loss:.4f}",
        )
    console.print(table)
    console.print(
        f"kitsune's tokens/s over torch's: {e2e.ratio:.3f}x with clipping; without, {e2e.ratio_noclip:.3f}x with the "
        f"updates inside backward ({e2e.ratio_noclip_current:.3f}x on backward's stream) and "
        f"{e2e.ratio_noclip_step:.3f}x with the step after backward; the clipped sides' losses over the first 10 "
        f"steps differ by at most {e2e.max_loss_diff_first_10:.2g}",
        highlight=False,
    )
