"""What a kitsune row of ``kitsune bench`` ran with: its subsystems, what its plan fused and what fell back, and how
many of its steps after warm-up replayed the captured graph, read from ``KitsuneOptimizer.subsystem_status()``."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from kitsune.fusion.plan import Route


class KitsuneInfo(BaseModel):
    """What the kitsune variant ran with, from ``opt.subsystem_status()`` after the timed steps."""

    active_subsystems: list[str]
    fusion_active: bool
    fusion_reason: str | None
    """Why fusion is inactive (None when active)."""
    fused_params: int | None
    """Params the fused Triton kernels update (the fusion report's ``params_fused``; None when it has none)."""
    total_params: int
    fused_all: bool | None
    """True when the fusion plan sends every param to the fused kernels (nothing falls back to torch)."""
    fallbacks: list[str]
    """Each plan bucket that is not fused: ``"<tensors> tensors -> <route>: <reason>"``."""
    launches_per_step: int | None
    """Fused kernel launches in the last step, as the fusion report counts them."""
    subsystems: list[dict[str, Any]]
    """``opt.subsystem_status()`` verbatim (the fusion plan is in the fusion entry's report)."""
    warnings: list[str]
    """Warnings kitsune raised while building the optimizer and during warm-up."""
    steps_after_warmup: int | None = None
    """Steps the optimizer completed after its warm-up (the timed and checked ones); None: not counted."""
    graph_replays: int | None = None
    """Of ``steps_after_warmup``, the steps that replayed a captured CUDA graph; None: graphs off or not counted."""
    last_eager_reason: str | None = None
    """Why the last step that did not replay ran eagerly (the graphs report's), where one after warm-up did not."""


_FUSED_ROUTES = {route.value for route in Route if route.fused}

StepMark = tuple[int, int | None]
"""A `KitsuneOptimizer`'s completed steps and its graph's replays (None: graphs off) at one moment (`step_mark`)."""


def _graphs_report(status: list[dict[str, Any]]) -> dict[str, Any] | None:
    graphs = next((s for s in status if s["name"] == "graphs"), None)
    return graphs.get("report") if graphs is not None and graphs["active"] else None


def step_mark(opt: Any) -> StepMark:
    """``opt``'s completed steps and graph replays now: taken after warm-up, `kitsune_info` counts the steps after
    it and how many of them replayed the graph (a row labelled with a graph whose steps ran eagerly shows so)."""
    report = _graphs_report(opt.subsystem_status())
    return opt.step_count, None if report is None else report["replays"]


def kitsune_info(
    opt: Any, n_params: int, caught: list[str] | None = None, since: StepMark | None = None
) -> KitsuneInfo:
    """What a `KitsuneOptimizer` over ``n_params`` params ran with (its subsystems, what it fused and what fell
    back), from ``opt.subsystem_status()`` after the timed steps; ``caught``: the warnings its steps raised;
    ``since``: the `step_mark` taken after warm-up, from which the steps and the graph's replays are counted."""
    status = json.loads(json.dumps(opt.subsystem_status(), default=str))  # reports must stay JSON-able
    fusion = next((s for s in status if s["name"] == "fusion"), {"active": False, "reason": "no fusion subsystem"})
    report = fusion.get("report") or {}
    fused = report.get("params_fused") if fusion["active"] else 0
    buckets = (report.get("plan") or {}).get("buckets") or []
    fallbacks = [
        f"{b.get('tensors')} tensors -> {b.get('route')}: {b.get('reason')}"
        for b in buckets
        if b.get("route") not in _FUSED_ROUTES  # Muon's triton_matmul is fused too
    ]
    steps = replays = eager = None
    if since is not None:
        steps = opt.step_count - since[0]
        graphs = _graphs_report(status)
        if graphs is not None and since[1] is not None:
            replays = graphs["replays"] - since[1]
            eager = graphs.get("last_eager_reason") if replays < steps else None
    return KitsuneInfo(
        active_subsystems=[s["name"] for s in status if s["active"]],
        fusion_active=fusion["active"],
        fusion_reason=fusion.get("reason"),
        fused_params=fused,
        total_params=n_params,
        fused_all=None if fused is None else fused == n_params,
        fallbacks=fallbacks,
        launches_per_step=report.get("fused_launches_per_step"),
        subsystems=status,
        warnings=list(caught or []),
        steps_after_warmup=steps,
        graph_replays=replays,
        last_eager_reason=eager,
    )


def route_line(k: KitsuneInfo | None) -> str | None:
    """What a kitsune row ran: fused or not, in how many launches, what fell back, the active subsystems."""
    if k is None:
        return None
    active = f"active subsystems: {', '.join(k.active_subsystems) or 'none'}"
    if not k.fusion_active:
        return f"fusion inactive: {k.fusion_reason}; {active}"
    fused = "?" if k.fused_params is None else str(k.fused_params)
    launches = "" if k.launches_per_step is None else f" in {k.launches_per_step} launch(es)/step"
    fallbacks = "".join(f"; fallback: {f}" for f in k.fallbacks)
    graph = ""
    if k.graph_replays is not None and k.steps_after_warmup is not None:
        graph = f"; graph replayed on {k.graph_replays} of the {k.steps_after_warmup} steps after warm-up"
        if k.last_eager_reason:
            graph += f" (the last eager one: {k.last_eager_reason})"
    return f"fused {fused}/{k.total_params} params{launches}{fallbacks}{graph}; {active}"
