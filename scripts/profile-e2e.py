"""Where the time of a whole training step goes: torch.profiler over the end-to-end GPT-2 model, per side.

python scripts/profile-e2e.py --out prof/            # on a GPU: GPT-2 124M, bf16 autocast, batch 4 x 512
python scripts/profile-e2e.py --out /tmp/prof --device cpu --steps 2   # a dry run on the tiny model

Sides: torch's fused AdamW without clipping; kitsune without clipping (fused step, graph); kitsune with the
updates inside backward (``step_in_backward``), with and without flat grads. For each side it prints the step time
(CUDA events), the host time of ``backward`` and of ``step``, the CUDA runtime calls that block the host
(synchronizations, pinned allocations, blocking copies) and the operators that cost the most host time, and writes
a Chrome trace of the profiled steps to ``OUT/<side>.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kitsune import KitsuneOptimizer
from kitsune.bench.e2e import ADAMW, FLAT_POOL, GPT, e2e_inputs
from kitsune.bench.timing import GcClock
from kitsune.config import AMPConfig, FusionConfig, GraphConfig, KitsuneConfig, MemoryConfig, StreamConfig

BLOCKING = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaHostAlloc",
    "cudaFreeHost",
    "cudaMemcpy",
    "cudaMalloc",
    "cudaFree",
)


def build(side: str, cfg: Any, init: dict, device: torch.device) -> tuple[torch.nn.Module, Any]:
    model = GPT(cfg).to(device)
    model.load_state_dict(init)
    if side == "torch_noclip":
        return model, torch.optim.AdamW(model.parameters(), **ADAMW, fused=device.type == "cuda")
    config = KitsuneConfig(
        fusion=FusionConfig(enabled=True),
        amp=AMPConfig(enabled=True, dtype=torch.bfloat16),
        streams=StreamConfig(
            step_in_backward=side.startswith("kitsune_backward"),
            backward_stream="current" if side.endswith("_current") else "side",
        ),
        memory=MemoryConfig(
            flat_grads=side.endswith("_flat"),
            pool_size=0 if side.endswith("_nopool") else FLAT_POOL if side.endswith("_flat") else 512 << 20,
        ),
        graphs=GraphConfig(enabled=not side.endswith("_nograph")),
    )
    return model, KitsuneOptimizer(torch.optim.AdamW(model.parameters(), **ADAMW), config=config)


def one_step(
    model: torch.nn.Module, opt: Any, tokens: torch.Tensor, device: torch.device, prof: Any = None
) -> tuple[float, float]:
    """Host ms of backward and of step (``prof``: a cProfile.Profile switched on around step and zero_grad)."""
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = model(tokens[:, :-1], tokens[:, 1:])
    t0 = time.perf_counter()
    loss.backward()
    t1 = time.perf_counter()
    if prof is not None:
        prof.enable()
    opt.step()
    opt.zero_grad()
    if prof is not None:
        prof.disable()
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3


def _time_scheduler(opt: Any) -> dict[str, float]:
    """Wrap the stream scheduler's launch, its parts and the per-param hooks with clocks (host ms, summed). Call it
    before the warm-up (re-registering the hooks drops the units' graphs) and zero the sums after it."""
    sched = opt.scheduler
    acc = {"hooks": 0.0, "launch": 0.0, "prepare": 0.0, "run": 0.0}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[name] += (time.perf_counter() - t) * 1e3

        return wrapper

    sched._launch = timed("launch", sched._launch)
    sched._run = timed("run", sched._run)
    for unit in sched._fusion.units:
        unit.prepare = timed("prepare", unit.prepare)
    hook = sched._hook

    def timed_hook(index: int) -> Any:
        return timed("hooks", hook(index))

    sched._hook = timed_hook
    sched.plan(opt)  # re-register the hooks through the timed factory (the units stay; each is wrapped once above)
    return acc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per side (3 more are profiled)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument(
        "--sides",
        default="torch_noclip,kitsune_noclip,kitsune_noclip_nograph,kitsune_noclip_nopool,kitsune_backward,"
        "kitsune_backward_current,kitsune_backward_flat,torch_noclip",
    )
    parser.add_argument("--traces", action="store_true", help="also write a Chrome trace per side")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cfg, data, init = e2e_inputs(device)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)
    for side in args.sides.split(","):
        model, opt = build(side, cfg, init, device)
        timers = _time_scheduler(opt) if side.startswith("kitsune_backward") and opt.scheduler.active else None
        for i in range(args.warmup):
            one_step(model, opt, data[i % len(data)], device)
        if timers is not None:
            timers.update(dict.fromkeys(timers, 0.0))  # only the timed steps count
        step_ms, backward_host, step_host = [], [], []
        with GcClock() as gc_clock:
            for i in range(args.steps):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                b, s = one_step(model, opt, data[i % len(data)], device)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                step_ms.append((time.perf_counter() - start) * 1e3)
                backward_host.append(b)
                step_host.append(s)
        if timers is not None:  # host ms per step inside the scheduler's hooks, by part
            timers = {k: round(v / args.steps, 3) for k, v in timers.items()}
        uploads = None
        if isinstance(opt, KitsuneOptimizer):  # address-table and hyperparameter uploads over 10 more steps, and
            fusion = opt._subsystem("fusion")  # where step() and zero_grad() spend their host time then
            before = fusion.report()
            cprof = cProfile.Profile()
            for i in range(10):
                one_step(model, opt, data[i % len(data)], device, cprof)
            after = fusion.report()
            uploads = {k: (after[k] - before[k]) / 10 for k in ("table_uploads", "context_uploads")}
            text = io.StringIO()
            pstats.Stats(cprof, stream=text).sort_stats("tottime").print_stats(12)
            print(f"   {side}: uploads per step {uploads}; step()+zero_grad() over 10 steps by own time:")
            print("\n".join("     " + line for line in text.getvalue().splitlines()[6:22] if line.strip()))
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for i in range(3):
                one_step(model, opt, data[i % len(data)], device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        if args.traces:
            prof.export_chrome_trace(str(args.out / f"{side}.json"))
        averages = prof.key_averages()
        blocking = {e.key: e.count for e in averages if e.key in BLOCKING}
        top = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:20]
        runtime = {e.key: e.count for e in averages if e.key.startswith("cuda")}
        row = {
            "gc_ms_per_step": gc_clock.ms / args.steps,
            "runtime_calls_in_3_steps": runtime,
            "step_ms": statistics.median(step_ms),
            "backward_host_ms": statistics.median(backward_host),
            "step_host_ms": statistics.median(step_host),
            "blocking_calls_in_3_steps": blocking,
            "top_self_cpu_us": {e.key: round(e.self_cpu_time_total, 1) for e in top},
        }
        if uploads is not None:
            row["uploads_per_step"] = uploads
        if timers is not None:
            row["scheduler_host_ms_per_step"] = timers
            row["scheduler_report"] = opt.scheduler.report()
        if isinstance(opt, KitsuneOptimizer):
            row["subsystems"] = {s["name"]: s.get("reason") or "active" for s in opt.subsystem_status()}
        results[side if side not in results else side + "_again"] = row
        if timers is not None:
            print(f"   scheduler host ms/step {timers}; graphs {row['scheduler_report'].get('graphs')}")
        print(
            f"== {side}: step {row['step_ms']:.2f} ms, host backward {row['backward_host_ms']:.2f} ms, "
            f"host step {row['step_host_ms']:.2f} ms, gc {row['gc_ms_per_step']:.2f} ms, blocking {blocking}"
        )
        del model, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    (args.out / "profile-e2e.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
