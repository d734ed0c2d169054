"""The variants, the run over parameter sets, the results (pydantic models, JSON) and their table."""

from __future__ import annotations

import gc
import json
import shlex
import sys
import warnings
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kitsune._device import parse_device
from kitsune.bench.e2e import E2EResult, run_e2e
from kitsune.bench.params import ParamSet, get_param_set, make_params, refill_grads
from kitsune.bench.timing import Stats, StepTimes, copy_bandwidth, time_steps
from kitsune.profiler.schema import Environment, collect_environment

ADAMW = {"lr": 1e-3, "weight_decay": 0.01, "betas": (0.9, 0.999), "eps": 1e-8}
"""The AdamW hyperparameters every variant uses (betas and eps are torch's defaults)."""

VARIANTS: dict[str, str] = {
    "foreach": "torch foreach",
    "fused": "torch fused",
    "graph": "torch graph",
    "kitsune": "kitsune",
    "eager": "kitsune, capture_graph=False",
    "static": "kitsune, static_addresses=True",
    "profiled": "kitsune, profile=True",
}
"""Variant name (what ``--variants`` takes) -> label in the table. ``graph`` is fused + capturable AdamW replayed
from a CUDA graph; ``kitsune`` is kitsune as it comes (on CUDA its phase is captured in a CUDA graph after
warm-up), ``eager`` the same with ``capture_graph=False``, ``static`` the same with
``GraphConfig(static_addresses=True)`` (the grads stay in place, as in every variant here, so the per-step address
checks are skipped); ``profiled`` is kitsune with the profiler on outside its sampled windows (probe and live
comparison off), which measures the profiler's own cost per step."""

FP32_BYTES = 4
# An fp32 AdamW step touches each parameter's four tensors once: it reads param, grad, exp_avg and exp_avg_sq,
# and writes param, exp_avg and exp_avg_sq back. Nothing less can do the update.
ADAMW_BYTES_PER_PARAM = FP32_BYTES * (4 + 3)  # 28
# The AMP + clipping phase as kitsune's two passes do it: pass 1 reads the grad (norms, inf check); pass 2 is
# the AdamW update above plus writing the grad back as zero (zero_grad(set_to_none=False)).
PHASE_BYTES_PER_PARAM = FP32_BYTES * (1 + 4 + 3 + 1)  # 36


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


class VariantResult(BaseModel):
    variant: str
    label: str
    status: Literal["ok", "skipped", "failed", "not_available"]
    reason: str | None = None
    """Why the variant was skipped, failed or is not available."""
    device_ms: Stats | None = None
    """Device time per step (CUDA events; wall time on a CPU)."""
    host_ms: Stats | None = None
    """Host time of the ``step()`` call alone, started with the device idle, no synchronize inside."""
    pct_of_floor: float | None = None
    """100 * floor_ms / median device ms: how close the step comes to the memory's copy rate."""
    device_ms_steps: list[float] = []
    host_ms_steps: list[float] = []
    kitsune: KitsuneInfo | None = None


class SetResult(BaseModel):
    name: str
    workload: Literal["adamw_step", "amp_clip_phase"]
    description: str
    n_tensors: int
    n_elements: int
    scale: float
    bytes_per_param: int
    bytes_per_step: int
    floor_ms: float
    """bytes_per_step / measured copy bandwidth."""
    steps: int
    warmup: int
    variants: list[VariantResult]
    ratio_to_kitsune: dict[str, float]
    """Per torch variant: its median device ms / kitsune's (above 1: kitsune is faster)."""


class BenchResult(BaseModel):
    schema_version: Literal["1"] = "1"
    created: datetime
    command: str
    environment: Environment
    device: str
    timer: Literal["cuda_events", "perf_counter"]
    copy_bandwidth_gbs: float
    """Measured device-to-device copy rate, read + write bytes, in GB/s (1e9)."""
    copy_buffer_bytes: int
    adamw: dict[str, Any]
    sets: list[SetResult]
    phase: SetResult | None
    e2e: E2EResult | None = None
    """Whole training steps of a GPT-2 124M-shaped model (``--e2e``)."""
    complete: bool
    """False while the run is still going (the JSON is rewritten after every set)."""

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=2))
        return path

    @classmethod
    def load(cls, path: str | Path) -> BenchResult:
        return cls.model_validate_json(Path(path).read_text())


# -- variants ---------------------------------------------------------------------------------------------------
class _TorchVariant:
    """A torch AdamW; ``step`` is its bound ``step`` so the timers see nothing else."""

    def __init__(self, params: list[torch.nn.Parameter], **flags: bool) -> None:
        self.opt: torch.optim.Optimizer = torch.optim.AdamW(params, **ADAMW, **flags)
        self.step = self.opt.step

    def warmup(self, n: int) -> None:
        for _ in range(n):
            self.step()

    def info(self) -> KitsuneInfo | None:
        return None

    def close(self) -> None:
        del self.opt, self.step


class _GraphVariant(_TorchVariant):
    """Fused capturable AdamW captured once in a CUDA graph, then replayed."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        if params and params[0].device.type != "cuda":
            raise ValueError("the graph variant needs CUDA params")
        super().__init__(params, fused=True, capturable=True)
        self.graph: torch.cuda.CUDAGraph | None = None

    def warmup(self, n: int) -> None:
        # Eager steps on a side stream first (torch's recipe: state is allocated and kernels are loaded outside
        # the capture), then capture one step, then replay the rest: n steps in all, as the other variants run.
        eager = max(1, min(3, n))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), warnings.catch_warnings():
            # torch warns that capturable=True runs uncaptured: true, and intended, for these steps only
            warnings.filterwarnings("ignore", message=".*capturable=True.*")
            for _ in range(eager):
                self.opt.step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.opt.step()  # recorded, not run
        self.step = self.graph.replay
        for _ in range(n - eager):
            self.step()

    def close(self) -> None:
        if self.graph is not None:
            self.graph.reset()  # gives its private memory pool back
            self.graph = None
        super().close()


class _KitsuneVariant(_TorchVariant):
    def __init__(
        self, params: list[torch.nn.Parameter], profile: bool = False, graph: bool = True, static: bool = False
    ) -> None:
        from kitsune.config import FusionConfig, GraphConfig, KitsuneConfig, ProfilerConfig
        from kitsune.optimizer import KitsuneOptimizer

        self.params = params
        self.warnings: list[str] = []
        # profiled: the profiler's per-step cost only; its sampled windows would replace steps with other work
        profiler = ProfilerConfig(enabled=profile, probe_steps=0, compare_steps=0)
        config = KitsuneConfig(
            fusion=FusionConfig(enabled=True),
            profiler=profiler,
            graphs=GraphConfig(enabled=graph, static_addresses=static),
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.opt = KitsuneOptimizer(torch.optim.AdamW(params, **ADAMW), config=config)
        self._keep(caught)
        self.step = self.opt.step

    def _keep(self, caught: list[warnings.WarningMessage]) -> None:
        for w in caught:
            if str(w.message) not in self.warnings:
                self.warnings.append(str(w.message))

    def warmup(self, n: int) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            super().warmup(n)
        self._keep(caught)

    def info(self) -> KitsuneInfo:
        status = json.loads(json.dumps(self.opt.subsystem_status(), default=str))  # reports must stay JSON-able
        fusion = next((s for s in status if s["name"] == "fusion"), {"active": False, "reason": "no fusion subsystem"})
        report = fusion.get("report") or {}
        fused = report.get("params_fused") if fusion["active"] else 0
        buckets = (report.get("plan") or {}).get("buckets") or []
        fallbacks = [
            f"{b.get('tensors')} tensors -> {b.get('route')}: {b.get('reason')}"
            for b in buckets
            if b.get("route") != "triton"
        ]
        return KitsuneInfo(
            active_subsystems=[s["name"] for s in status if s["active"]],
            fusion_active=fusion["active"],
            fusion_reason=fusion.get("reason"),
            fused_params=fused,
            total_params=len(self.params),
            fused_all=None if fused is None else fused == len(self.params),
            fallbacks=fallbacks,
            launches_per_step=report.get("fused_launches_per_step"),
            subsystems=status,
            warnings=self.warnings,
        )

    def close(self) -> None:
        del self.params
        super().close()


def make_variant(name: str, params: list[torch.nn.Parameter]) -> _TorchVariant:
    """Build variant ``name`` over ``params``: call ``warmup(n)`` once, then ``step()``; ``close()`` at the end."""
    if name == "foreach":
        return _TorchVariant(params, foreach=True)
    if name == "fused":
        return _TorchVariant(params, fused=True)
    if name == "graph":
        return _GraphVariant(params)
    if name == "kitsune":
        return _KitsuneVariant(params)
    if name == "eager":
        return _KitsuneVariant(params, graph=False)
    if name == "static":
        return _KitsuneVariant(params, static=True)
    if name == "profiled":
        return _KitsuneVariant(params, profile=True)
    raise ValueError(f"unknown variant {name!r}: choose from {', '.join(VARIANTS)}")


# -- running ----------------------------------------------------------------------------------------------------
def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _memory_shortfall(pset: ParamSet, device: torch.device) -> str | None:
    """Why this set cannot fit on the GPU now (param, grad, exp_avg, exp_avg_sq: 16 bytes each), else None."""
    if device.type != "cuda":
        return None
    need = 4 * FP32_BYTES * pset.n_elements * 1.05 + 2**29
    free, _ = torch.cuda.mem_get_info(device)
    if need > free:
        return f"needs about {need / 2**30:.1f} GiB of GPU memory, {free / 2**30:.1f} GiB free"
    return None


_Body = Callable[[], tuple[StepTimes, KitsuneInfo | None]]


def _measure(result: VariantResult, body: _Body, device: torch.device, floor_ms: float) -> VariantResult:
    """Run ``body`` (which allocates, warms up and times) and fill ``result``; failures are recorded, not raised.

    Everything ``body`` allocated lives in its frame, so it is gone before the memory is handed back here.
    """
    try:
        times, result.kitsune = body()
        result.device_ms, result.host_ms = Stats.of(times.device_ms), Stats.of(times.host_ms)
        result.device_ms_steps, result.host_ms_steps = times.device_ms, times.host_ms
        median = result.device_ms.median
        result.pct_of_floor = 100 * floor_ms / median if median > 0 else None
    except Exception as exc:  # one broken variant must not cost the others their numbers
        result.status, result.reason = "failed", f"{type(exc).__name__}: {exc}"
    try:
        _free(device)
    except Exception as exc:  # e.g. a CUDA error left by the variant surfaces at the synchronize
        cleanup = f"freeing memory after it: {type(exc).__name__}: {exc}"
        result.status, result.reason = "failed", "; ".join(filter(None, [result.reason, cleanup]))
    return result


def run_variant(
    name: str, pset: ParamSet, device: torch.device, steps: int, warmup: int, floor_ms: float, seed: int = 0
) -> VariantResult:
    """Time one variant on fresh params (seeded: every variant starts from the same values)."""
    result = VariantResult(variant=name, label=VARIANTS[name], status="ok")
    if name == "graph" and device.type != "cuda":
        result.status, result.reason = "skipped", "CUDA only: a CUDA graph captures GPU work"
        return result
    shortfall = _memory_shortfall(pset, device)
    if shortfall is not None:
        result.status, result.reason = "skipped", shortfall
        return result

    def body() -> tuple[StepTimes, KitsuneInfo | None]:
        variant = make_variant(name, make_params(pset, device, seed))
        try:
            variant.warmup(warmup)
            times = time_steps(variant.step, steps, device)
            return times, variant.info()
        finally:
            variant.close()

    return _measure(result, body, device, floor_ms)


def run_phase(
    pset: ParamSet, device: torch.device, steps: int, warmup: int, floor_ms: float, seed: int = 0
) -> list[VariantResult]:
    """The careful AMP loop (unscale, clip 1.0, AdamW, scale update, zero the grads), torch's and kitsune's.

    ``fused``: GradScaler, ``torch.nn.utils.clip_grad_norm_`` and torch's fused AdamW. ``kitsune``: kitsune's own
    loss scaler with ``max_grad_norm=1.0`` and ``zero_in_step``: one norm launch (unscale, inf check, global norm)
    and one update launch (unscale, clip, skip, AdamW, zero). ``kitsune_scaler``: torch's GradScaler calls driving
    a fused ``KitsuneOptimizer`` with ``kitsune.clip_grad_norm_``, for a user who keeps their GradScaler loop.
    """
    from kitsune.clip import clip_grad_norm_ as kitsune_clip
    from kitsune.config import AMPConfig, GradConfig
    from kitsune.optimizer import KitsuneOptimizer

    def torch_opt(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, **ADAMW, fused=True)

    def kitsune_opt(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return KitsuneOptimizer(torch.optim.AdamW(params, **ADAMW), enable_fusion=True)

    def kitsune_in_step(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return KitsuneOptimizer(
            torch.optim.AdamW(params, **ADAMW),
            enable_fusion=True,
            enable_amp=True,
            amp_config=AMPConfig(dtype=torch.float16),
            grad_config=GradConfig(max_norm=1.0, zero_in_step=True),
        )

    sides = [
        (VariantResult(variant="fused", label="torch fused loop", status="ok"), torch_opt, _torch_clip),
        (VariantResult(variant="kitsune", label="kitsune, all in the step", status="ok"), kitsune_in_step, None),
        (
            VariantResult(variant="kitsune_scaler", label="kitsune under GradScaler", status="ok"),
            kitsune_opt,
            kitsune_clip,
        ),
    ]
    shortfall = _memory_shortfall(pset, device)
    if shortfall is not None:
        for result, _, _ in sides:
            result.status, result.reason = "skipped", shortfall
        return [result for result, _, _ in sides]

    def timed(make_opt: Any, clip: Any) -> Callable[[], tuple[StepTimes, None]]:
        def body() -> tuple[StepTimes, None]:
            params = make_params(pset, device, seed)
            opt = make_opt(params)
            scaler = torch.amp.GradScaler(device.type)
            scaler.scale(torch.ones((), device=device))  # creates the scale, as scaler.scale(loss) does each step
            gen = torch.Generator(device=device).manual_seed(seed + 1)

            def phase() -> None:
                scaler.unscale_(opt)
                clip(params, 1.0)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=False)

            def in_step() -> None:
                opt.step()  # unscale, inf check, clip, update, skip, zero: two launches, then the scale update
                opt.zero_grad(set_to_none=False)  # nothing left to do: the step zeroed the grads

            def refill() -> None:
                refill_grads(params, gen)
                if clip is None:
                    opt.scale_loss(one)  # what optimizer.backward(loss) does before the backward pass

            one = torch.ones((), device=device)
            if clip is None:
                phase = in_step
            # the grads are zeroed each step: every step gets fresh random grads, outside the timers
            for _ in range(warmup):
                refill()
                phase()
            return time_steps(phase, steps, device, between=refill), None

        return body

    return [_measure(result, timed(make_opt, clip), device, floor_ms) for result, make_opt, clip in sides]


def _torch_clip(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def _ratios(variants: list[VariantResult]) -> dict[str, float]:
    ours = next((v for v in variants if v.variant == "kitsune" and v.status == "ok"), None)
    if ours is None or not ours.device_ms.median > 0:
        return {}
    return {
        v.variant: v.device_ms.median / ours.device_ms.median
        for v in variants
        if v.variant != "kitsune" and v.status == "ok"
    }


def _resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` (None: ``auto``) through :func:`kitsune._device.parse_device`, a CUDA device with its index."""
    try:
        dev = parse_device("auto" if device is None else str(device))
    except ValueError as exc:
        raise ValueError(f"--device: {exc}") from None
    if dev.type == "cuda" and dev.index is None:  # torch.cuda.set_device and the allocator's counters need an index
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _console() -> Console:
    console = Console()
    # a log file gets rich's 80 columns unless told otherwise: too narrow for the table
    return console if console.is_terminal else Console(width=max(console.width, 120))


def _command_line() -> str:
    return shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))


def run_bench(
    sets: list[str] | tuple[str, ...] = ("gpt2", "many", "llama1b"),
    variants: list[str] | tuple[str, ...] = tuple(VARIANTS),
    device: str | torch.device | None = None,
    steps: int | None = None,
    warmup: int | None = None,
    scale: float | None = None,
    phase: bool = False,
    json_path: str | Path | None = None,
    seed: int = 0,
    console: Console | None = None,
    command: str | None = None,
    e2e: bool = False,
    compile_backend: str | None = None,
    e2e_steps: int | None = None,
    e2e_batch: int | None = None,
) -> BenchResult:
    """Time every variant on every set, print the table, and write JSON when ``json_path`` is given.

    Args:
        sets: parameter set names (``PARAM_SETS``).
        variants: variant names (``VARIANTS``), run in this order on each set.
        device: ``cuda``, ``cpu`` or None for a GPU when there is one.
        steps: timed steps per variant; None: each set's default on a GPU (50, 50, 20), 3 on a CPU.
        warmup: untimed steps first (at least 1); None: 10 on a GPU, 1 on a CPU.
        scale: shrink each tensor to about this fraction of its elements; None: 1 on a GPU, 0.001 on a CPU.
        phase: also time the AMP + clipping phase on the gpt2 set.
        json_path: where to write the results (rewritten after every set, ``complete`` set at the end).
        seed: seed of the params and grads (the same for every variant).
        console: where the progress bar and table go.
        command: the command line to record; None: this process's.
        e2e: also time whole training steps of a GPT-2 124M-shaped model (a tiny one on a CPU).
        compile_backend: with ``e2e``, run the model through ``torch.compile`` with this backend on every side.
        e2e_steps: with ``e2e``, timed steps a side; None: 50 on a GPU, 2 on a CPU.
        e2e_batch: with ``e2e``, sequences a step; None: 4 (a larger batch gives the GPU more work per step of host
            time: on a fast GPU, batch 4 leaves the step bound by the host).
    """
    dev = _resolve_device(device)
    cuda = dev.type == "cuda"
    for name in sets:
        get_param_set(name)  # unknown names fail before anything runs
    for name in variants:
        if name not in VARIANTS:
            raise ValueError(f"unknown variant {name!r}: choose from {', '.join(VARIANTS)}")
    warmup = warmup if warmup is not None else (10 if cuda else 1)
    scale = scale if scale is not None else (1.0 if cuda else 0.001)
    if warmup < 1:
        raise ValueError(f"warmup must be at least 1 (the graph variant captures after it), got {warmup}")
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if (compile_backend is not None or e2e_steps is not None or e2e_batch is not None) and not e2e:
        raise ValueError(
            "--compile, --e2e-steps and --e2e-batch apply to the end-to-end run: add --e2e, or leave them out"
        )
    if e2e_steps is not None and e2e_steps < 1:
        raise ValueError(f"e2e_steps must be at least 1, got {e2e_steps}")
    if e2e_batch is not None and e2e_batch < 1:
        raise ValueError(f"e2e_batch must be at least 1, got {e2e_batch}")
    console = console or _console()
    if cuda:
        torch.cuda.set_device(dev)

    bandwidth, copy_bytes = copy_bandwidth(dev)
    result = BenchResult(
        created=datetime.now(timezone.utc),
        command=command or _command_line(),
        environment=collect_environment(dev),
        device=str(dev),
        timer="cuda_events" if cuda else "perf_counter",
        copy_bandwidth_gbs=bandwidth / 1e9,
        copy_buffer_bytes=copy_bytes,
        adamw={**ADAMW, "betas": list(ADAMW["betas"])},
        sets=[],
        phase=None,
        complete=False,
    )
    console.print(
        f"kitsune bench on {result.environment.device_name} ({dev}): copy bandwidth {bandwidth / 1e9:,.0f} GB/s, "
        f"AdamW fp32 moves {ADAMW_BYTES_PER_PARAM} bytes/param"
    )

    def set_steps(pset: ParamSet) -> int:
        return steps if steps is not None else (pset.default_steps if cuda else 3)

    def new_set(pset: ParamSet, workload: str, bytes_per_param: int) -> SetResult:
        nbytes = bytes_per_param * pset.n_elements
        return SetResult(
            name=pset.name,
            workload=workload,
            description=pset.description,
            n_tensors=pset.n_tensors,
            n_elements=pset.n_elements,
            scale=scale,
            bytes_per_param=bytes_per_param,
            bytes_per_step=nbytes,
            floor_ms=nbytes / bandwidth * 1e3,
            steps=set_steps(pset),
            warmup=warmup,
            variants=[],
            ratio_to_kitsune={},
        )

    def report(set_name: str, v: VariantResult) -> None:
        if v.status == "ok":
            line = f"{v.device_ms.median:.3f} ms/step, host {v.host_ms.median:.3f} ms"
        else:
            line = f"{v.status}: {v.reason}"
        console.print(f"  {set_name:8s} {v.label:16s} {line}", highlight=False)

    def save() -> None:
        if json_path is not None:
            result.save(json_path)

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    # no auto-refresh: a refresh thread would compete for the GIL with the host time being measured
    with Progress(*columns, console=console, auto_refresh=False) as progress:
        task = progress.add_task("bench", total=len(sets) * len(variants) + int(phase) + int(e2e))
        for name in sets:
            pset = get_param_set(name, scale)
            entry = new_set(pset, "adamw_step", ADAMW_BYTES_PER_PARAM)
            for variant in variants:
                progress.update(task, description=f"{name}: {VARIANTS[variant]}")
                progress.refresh()
                v = run_variant(variant, pset, dev, entry.steps, warmup, entry.floor_ms, seed)
                entry.variants.append(v)
                report(name, v)
                progress.advance(task)
            entry.ratio_to_kitsune = _ratios(entry.variants)
            result.sets.append(entry)
            save()
        if phase:
            pset = get_param_set("gpt2", scale)
            progress.update(task, description="gpt2: AMP + clipping phase")
            progress.refresh()
            result.phase = new_set(pset, "amp_clip_phase", PHASE_BYTES_PER_PARAM)
            result.phase.variants = run_phase(pset, dev, result.phase.steps, warmup, result.phase.floor_ms, seed)
            result.phase.ratio_to_kitsune = _ratios(result.phase.variants)
            for v in result.phase.variants:
                report("phase", v)
            progress.advance(task)
        if e2e:
            progress.update(task, description="end to end: GPT-2 124M training steps")
            progress.refresh()
            result.e2e = run_e2e(
                dev,
                steps=e2e_steps or (50 if cuda else 2),
                warmup=10 if cuda else 1,
                batch=e2e_batch or 4,
                seed=seed,
                compile_backend=compile_backend,
            )
            save()
            progress.advance(task)
        progress.update(task, description="done")
        progress.refresh()
    result.complete = True
    save()
    print_results(result, console)
    if json_path is not None:
        console.print(f"results written to {json_path}")
    return result


# -- the table --------------------------------------------------------------------------------------------------
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
    console = console or _console()
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
