"""Host time of ``step()`` with the steady replay against the full path, measured in turns in one process.

python scripts/steady-ab.py --sets gpt2,many               # on a GPU
python scripts/steady-ab.py --device cpu --sets gpt2        # a dry run (no CUDA graph on a CPU: both run eagerly)

Host times move between processes on one machine by more than the difference measured here, so the two paths
run in one process, on two copies of the same param set, step by step in turns, the GPU idle before each timed call
(as ``kitsune bench`` measures host time). Configurations: ``adamw`` (AdamW), ``clip`` (``max_grad_norm=1.0``) and
``phase`` (float16 AMP, clipping and zeroing in the step: the bench's ``kitsune, all in the step``; its timed call is
``step()`` then ``zero_grad()``). Prints the medians and their ratio; ``--json PATH`` writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default="gpt2,many")
    parser.add_argument("--configs", default="adamw,clip,phase")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from kitsune import AMPConfig, FusionConfig, GradConfig, GraphConfig, KitsuneConfig, KitsuneOptimizer
    from kitsune.bench.params import PARAM_SETS

    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def build(shapes: list[Any], config: str, steady: bool) -> tuple[Any, Any]:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, device=device) * 0.02) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        cfg = KitsuneConfig(
            fusion=FusionConfig(enabled=True),
            graphs=GraphConfig(steady_replay=steady),
            amp=AMPConfig(enabled=config == "phase", dtype=torch.float16),
            grads=GradConfig(max_norm=None if config == "adamw" else 1.0, zero_in_step=config == "phase"),
        )
        opt = KitsuneOptimizer(torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01), config=cfg)
        one = torch.ones((), device=device)

        def before() -> None:  # outside the timer: what backward would do (scale the loss; the grads stay put)
            if config == "phase":
                opt.scale_loss(one)

        def call() -> None:
            opt.step()
            if config == "phase":
                opt.zero_grad()

        return opt, (before, call)

    results: dict[str, Any] = {}
    for name in args.sets.split(","):
        pset = PARAM_SETS[name].scaled(0.001) if device.type == "cpu" else PARAM_SETS[name]
        shapes = [shape for _, shape in pset.shapes]
        for config in args.configs.split(","):
            sides = {label: build(shapes, config, label == "steady") for label in ("steady", "full")}
            for _ in range(10):
                for _, (before, call) in sides.values():
                    before()
                    call()
            host: dict[str, list[float]] = {label: [] for label in sides}
            for _ in range(args.steps):
                for label, (_, (before, call)) in sides.items():
                    before()
                    sync()
                    start = time.perf_counter()
                    call()
                    host[label].append((time.perf_counter() - start) * 1e3)
            sync()
            graphs = {label: opt._subsystem("graphs").report() for label, (opt, _) in sides.items()}
            row = {
                "steady_ms": statistics.median(host["steady"]),
                "full_ms": statistics.median(host["full"]),
                "steady_p10_p90": _spread(host["steady"]),
                "full_p10_p90": _spread(host["full"]),
                "steady_replays": {label: g.get("steady_replays") for label, g in graphs.items()},
            }
            row["full_over_steady"] = row["full_ms"] / row["steady_ms"]
            results[f"{name}/{config}"] = row
            print(
                f"{name:5} ({len(shapes)} tensors) {config:6}: steady {row['steady_ms']:.3f} ms "
                f"(p10-p90 {row['steady_p10_p90'][0]:.3f}-{row['steady_p10_p90'][1]:.3f}), full path "
                f"{row['full_ms']:.3f} ms ({row['full_p10_p90'][0]:.3f}-{row['full_p10_p90'][1]:.3f}): "
                f"{row['full_over_steady']:.2f}x; steady replays {row['steady_replays']}"
            )
            del sides
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


def _spread(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return ordered[len(ordered) // 10], ordered[(len(ordered) * 9) // 10]


if __name__ == "__main__":
    sys.exit(main())
