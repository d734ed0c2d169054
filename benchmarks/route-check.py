"""Does the planner pick the faster route? For every optimizer kitsune has a kernel for, on a small and a large
parameter set, the one-line default's plan against the same optimizer forced onto its fallback, measured.

python benchmarks/route-check.py                          # on a GPU: every optimizer, sets small and gpt2
python benchmarks/route-check.py --sets small,many --only Lion,NAdam
python benchmarks/route-check.py --device cpu             # a dry run (TRITON_INTERPRET=1 is set for you)

For each (optimizer, set) two KitsuneOptimizers wrap the same optimizer over copies of the same params: the
default (``enable_fusion=True`` and nothing else) and one whose ``FusionConfig(min_fusion_benefit=1e9)`` sends
every bucket to the route the cost model weighed the fused kernel against (torch's fused or foreach path, or the
optimizer's own step). Both step back to back with host time included (CUDA events around blocks of
``--steps`` steps, the grads left in place), in alternating blocks, ``--blocks`` blocks each; the table shows the
route each chose, the medians and p10-p90 per step, the model's prediction, and whether the default's route was
the faster one measured. ``--json PATH`` writes the rows. Exit status 1 when a default route was measured slower
than its fallback by more than ``--tolerance`` (a benchmark's verdict: it is never a timed assertion in tests).

Sets: ``small`` (4 vectors of 256 and 4 matrices of 64 x 64), and the ``kitsune bench`` sets (gpt2, many, llama1b).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any


def optimizers() -> dict[str, Callable[[list[Any]], Any]]:
    """Name -> a factory over a params list, for every optimizer class the planner fuses."""
    import torch

    from kitsune.fusion.algos import ALGOS
    from kitsune.optim import LAMB, LARS, Lion, Muon

    known: dict[Any, Callable[[list[Any]], Any]] = {
        torch.optim.Adam: lambda ps: torch.optim.Adam(ps, lr=1e-3),
        torch.optim.AdamW: lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01),
        torch.optim.SGD: lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
        torch.optim.Adagrad: lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
        torch.optim.RMSprop: lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
        Lion: lambda ps: Lion(ps, lr=1e-4, weight_decay=0.01),
        LARS: lambda ps: LARS(ps, lr=1e-2, momentum=0.9),
        LAMB: lambda ps: LAMB(ps, lr=1e-3, weight_decay=0.01),
        Muon: lambda ps: Muon(ps, lr=0.02),
    }
    if hasattr(torch.optim, "Muon"):
        known[torch.optim.Muon] = lambda ps: torch.optim.Muon(ps, lr=0.02)
    # any other fused class (NAdam, RAdam, ...) with its defaults
    return {cls.__name__ if cls.__module__.startswith("torch") else f"kitsune.{cls.__name__}": known.get(cls, cls)
            for cls in ALGOS}  # fmt: skip


def shapes(name: str, scale: float) -> list[tuple[int, ...]]:
    from kitsune.bench.params import get_param_set

    if name == "small":
        return [(256,)] * 4 + [(64, 64)] * 4
    return [shape for _, shape in get_param_set(name, scale).shapes]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sets", default="small,gpt2")
    parser.add_argument("--only", default=None, help="comma-separated optimizer names (default: every fused one)")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed block")
    parser.add_argument("--blocks", type=int, default=5, help="timed blocks per side")
    parser.add_argument("--tolerance", type=float, default=0.05, help="slower than the fallback by more: a miss")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
        args.steps, args.blocks = 1, 1
    import torch

    from kitsune import FusionConfig, KitsuneOptimizer
    from kitsune.bench.timing import native_check_ready

    device = torch.device(args.device)
    print(native_check_ready(device))  # the steps as a run past its first minute takes them
    scale = 0.001 if device.type == "cpu" else 1.0
    factories = optimizers()
    names = args.only.split(",") if args.only else list(factories)
    unknown = [n for n in names if n not in factories]
    if unknown:
        parser.error(f"unknown optimizer {', '.join(unknown)}: choose from {', '.join(factories)}")
    rows, misses = [], 0
    for set_name in args.sets.split(","):
        for name in names:
            make = factories[name]
            wanted = shapes(set_name, scale)
            if "Muon" in name:  # Muon orthogonalises matrices: the set's 2-D params only
                wanted = [s for s in wanted if len(s) == 2]
            gen = torch.Generator(device=device).manual_seed(0)
            base = [torch.randn(s, device=device, generator=gen) * 0.02 for s in wanted]
            sides = {}
            for side, config in (("default", None), ("fallback", FusionConfig(min_fusion_benefit=1e9))):
                params = [torch.nn.Parameter(t.clone()) for t in base]
                for p in params:
                    p.grad = torch.randn(p.shape, device=device, generator=gen)
                kwargs = {"fusion_config": config} if config is not None else {}
                with warnings.catch_warnings():
                    if config is not None:  # the fallback asks for fusion and forbids every fused route, on purpose
                        warnings.filterwarnings("ignore", "kitsune: fusion was asked for but is inactive", UserWarning)
                    opt = KitsuneOptimizer(make(params), enable_fusion=True, **kwargs)
                sides[side] = (opt, params)
            row = measure(sides, args.steps, args.blocks, device)
            row.update(set=set_name, optimizer=name)
            row["faster"] = row["default_ms"] <= row["fallback_ms"] * (1 + args.tolerance)
            misses += not row["faster"]
            rows.append(row)
            print(
                f"{set_name:6} {name:22} default {row['default_route']:14} {row['default_ms']:8.3f} ms "
                f"({row['default_p10']:.3f}-{row['default_p90']:.3f})  fallback {row['fallback_route']:14} "
                f"{row['fallback_ms']:8.3f} ms  model {row['model_speedup']}x  measured "
                f"{row['fallback_ms'] / row['default_ms']:.2f}x  {'ok' if row['faster'] else 'MISS'}",
                flush=True,
            )
            del sides
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"device": str(device), "rows": rows}, indent=2))
    print(f"{len(rows) - misses} of {len(rows)} default routes measured faster or within {args.tolerance:.0%}")
    return 1 if misses else 0


def measure(sides: dict[str, Any], steps: int, blocks: int, device: Any) -> dict[str, Any]:
    import torch

    from kitsune.bench.timing import percentile

    cuda = device.type == "cuda"
    times: dict[str, list[float]] = {side: [] for side in sides}
    for opt, _ in sides.values():
        for _ in range(3 if cuda else 1):  # warm-up: lazy state, compilation, graph capture
            opt.step()
    for _ in range(blocks):
        for side, (opt, _) in sides.items():
            if cuda:
                torch.cuda.synchronize(device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(steps):
                    opt.step()
                end.record()
                end.synchronize()
                times[side].append(start.elapsed_time(end) / steps)
            else:
                import time

                t0 = time.perf_counter()
                for _ in range(steps):
                    opt.step()
                times[side].append((time.perf_counter() - t0) * 1e3 / steps)
    row: dict[str, Any] = {}
    for side, (opt, _) in sides.items():
        buckets = opt.plan.buckets
        row[f"{side}_route"] = "+".join(sorted({b.route.value for b in buckets}))
        for key, q in (("ms", 50), ("p10", 10), ("p90", 90)):
            row[f"{side}_{key}"] = percentile(times[side], q)
    speedups = [b.predicted_speedup for b in sides["default"][0].plan.buckets if b.predicted_speedup]
    row["model_speedup"] = round(min(speedups), 2) if speedups else None
    return row


if __name__ == "__main__":
    sys.exit(main())
