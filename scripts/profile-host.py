"""Where the host time of kitsune's ``step()`` goes, on a parameter set of ``kitsune bench``.

python scripts/profile-host.py --sets gpt2,many            # on a GPU
python scripts/profile-host.py --device cpu --sets many     # a dry run (TRITON_INTERPRET=1 is set for you)

For each set and configuration (default: graph replay; ``--eager`` adds ``capture_graph=False``, ``--clip``
``max_grad_norm=1.0``, ``--static`` ``GraphConfig(static_addresses=True)``) it prints the
median host time of ``step()`` over ``--steps`` calls with the GPU idle before each (as ``kitsune bench`` measures
host time), the functions with the most own time under cProfile, and the CUDA runtime calls per step counted by
torch.profiler. ``--json PATH`` writes the numbers.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default="gpt2,many")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eager", action="store_true", help="also profile capture_graph=False")
    parser.add_argument("--clip", action="store_true", help="also profile max_grad_norm=1.0")
    parser.add_argument("--static", action="store_true", help="also profile GraphConfig(static_addresses=True)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from kitsune import KitsuneOptimizer
    from kitsune.bench.params import PARAM_SETS

    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    configs: list[tuple[str, dict[str, Any]]] = [("graph", {})]
    if args.eager:
        configs.append(("eager", {"capture_graph": False}))
    if args.clip:
        configs.append(("graph+clip", {"max_grad_norm": 1.0}))
    if args.static:
        from kitsune import GraphConfig, KitsuneConfig

        static = KitsuneConfig(fusion={"enabled": True}, graphs=GraphConfig(static_addresses=True))
        configs.append(("graph+static", {"config": static}))
    results: dict[str, Any] = {}
    for name in args.sets.split(","):
        pset = PARAM_SETS[name].scaled(0.001) if device.type == "cpu" else PARAM_SETS[name]
        shapes = [shape for _, shape in pset.shapes]
        for label, kwargs in configs:
            torch.manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(s, device=device) * 0.02) for s in shapes]
            for p in params:
                p.grad = torch.randn_like(p)
            fusion = {} if "config" in kwargs else {"enable_fusion": True}
            opt = KitsuneOptimizer(torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01), **fusion, **kwargs)
            for _ in range(10):
                opt.step()
            sync()
            host = []
            for _ in range(args.steps):
                sync()
                start = time.perf_counter()
                opt.step()
                host.append((time.perf_counter() - start) * 1e3)
            sync()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.steps):
                opt.step()
            prof.disable()
            sync()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as tp:
                for _ in range(5):
                    opt.step()
                sync()
            runtime = {e.key: e.count / 5 for e in tp.key_averages() if e.key.startswith("cuda")}
            graphs = opt._subsystem("graphs")
            row = {
                "host_ms_median": statistics.median(host),
                "host_ms_p10": sorted(host)[len(host) // 10],
                "runtime_calls_per_step": runtime,
                "graphs": graphs.report() if graphs.active else graphs.reason,
            }
            results[f"{name}/{label}"] = row
            print(
                f"== {name} ({len(shapes)} tensors) {label}: host {row['host_ms_median']:.3f} ms/step "
                f"(p10 {row['host_ms_p10']:.3f}); runtime calls/step {runtime}; graphs {row['graphs']}"
            )
            print("\n".join(text.getvalue().splitlines()[:30]))
            del opt, params
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
