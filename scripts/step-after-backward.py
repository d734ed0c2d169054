"""Where the host time of ``step()`` and ``zero_grad()`` goes right after a backward pass, part by part.

python scripts/step-after-backward.py                       # on a GPU: the e2e GPT-2 124M, bf16 autocast, batch 4 x 512
python scripts/step-after-backward.py --device cpu --steps 3   # a dry run on the tiny model

``kitsune bench`` times ``step()`` with the GPU idle and the grads left as the last step found them; in training it
runs right after a backward pass that made new grad tensors (``zero_grad()`` set the old ones to None). Each side
trains its own copy of the model, the sides taking turns step by step, and every ``--probe``-th step reads every
``p.grad`` twice before ``step()`` (the first read after backward against the second) instead of timing the parts.
Per side it prints the median host time of ``step()``, ``zero_grad()`` and, for kitsune's steady replay, of its
parts: the group checks, the address checks of the grads and params (``unchanged``) and the graph launch.
``--cover-ms`` queues a GPU sleep of that length before each ``step()``, so the GPU is still busy when the step is
issued, as when training is GPU-bound (``scripts/e2e-anatomy.py`` times the optimizer phase that way).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from operator import attrgetter
from pathlib import Path
from typing import Any

import torch

import kitsune.optimizer as kopt
from kitsune import AMPConfig, FusionConfig, GradConfig, KitsuneConfig, KitsuneOptimizer, MemoryConfig
from kitsune.bench.e2e import ADAMW, FLAT_POOL, GPT, Side, e2e_inputs, forward_backward
from kitsune.bench.timing import GcClock

_GRAD = attrgetter("grad")
SIDES = {
    "torch": "torch fused AdamW, zero_grad()",
    "kitsune": "kitsune graph, zero_grad()",
    "kitsune_keep": "kitsune graph, zero_grad(set_to_none=False)",
    "kitsune_zero": "kitsune graph, zero_in_step",
    "kitsune_flat": "kitsune graph, flat grads",
}


def build(name: str, cfg: Any, init: dict, device: torch.device) -> Side:
    model = GPT(cfg).to(device)
    model.load_state_dict(init)
    if name == "torch":
        return Side(name, model, model, torch.optim.AdamW(model.parameters(), **ADAMW, fused=device.type == "cuda"))
    config = KitsuneConfig(
        fusion=FusionConfig(enabled=True),
        amp=AMPConfig(enabled=True, dtype=torch.bfloat16),
        grads=GradConfig(zero_in_step=name == "kitsune_zero"),
        memory=MemoryConfig(flat_grads=True, pool_size=FLAT_POOL) if name == "kitsune_flat" else MemoryConfig(),
    )
    return Side(name, model, model, KitsuneOptimizer(torch.optim.AdamW(model.parameters(), **ADAMW), config=config))


class Clocks:
    """Host ms of named calls in the current step, summed."""

    def __init__(self) -> None:
        self.now: dict[str, float] = {}

    def wrap(self, name: str, fn: Any) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.now[name] = self.now.get(name, 0.0) + (time.perf_counter() - t) * 1e3

        return timed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--probe", type=int, default=3, help="every N-th step reads the grads before step()")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--cover-ms", type=float, default=0.0, help="GPU sleep queued before each step() (CUDA)")
    parser.add_argument(
        "--plain-zero", action="store_true", help="every side sets its grads to None in one Python loop, no zero_grad()"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cfg, data, init = e2e_inputs(device, n_batches=4)
    names = args.sides.split(",")
    cover = 0
    if args.cover_ms > 0 and device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        cover = int(args.cover_ms * 10_000_000 / start.elapsed_time(end))  # sleep cycles
    sides = {name: build(name, cfg, init, device) for name in names}
    c = Clocks()  # the sides run one after another: one set of clocks, reset before each step
    for name, side in sides.items():
        for i in range(10):  # warm-up: compilation, capture
            forward_backward(side, data[i % len(data)])
            side.opt.step()
            side.opt.zero_grad(set_to_none=name != "kitsune_keep")
        if isinstance(side.opt, KitsuneOptimizer):
            steady = side.opt._steady
            if steady is None:  # no graph (a CPU): the full step every time, timed as a whole
                print(f"  {name}: no steady replay armed after the warm-up")
                continue
            steady.fusion.unchanged = c.wrap("unchanged", steady.fusion.unchanged)
            steady.graphs.replay_again = c.wrap("replay", steady.graphs.replay_again)
            side.opt._structure_key = c.wrap("structure", side.opt._structure_key)
    kopt._group_values = c.wrap("values", kopt._group_values)
    rows: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    with GcClock() as gc_clock:
        for i in range(args.steps):
            for name in names:
                side = sides[name]
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                forward_backward(side, data[i % len(data)])
                row = rows[name]
                params = [p for g in side.opt.param_groups for p in g["params"]]
                if i % args.probe == args.probe - 1:
                    for part in ("first_read", "second_read"):
                        t = time.perf_counter()
                        grads = list(map(_GRAD, params))
                        row.setdefault(part, []).append((time.perf_counter() - t) * 1e3)
                    del grads
                if cover:
                    torch.cuda._sleep(cover)
                c.now = {}
                gc_clock.ms = 0.0
                t0 = time.perf_counter()
                side.opt.step()
                t1 = time.perf_counter()
                if args.plain_zero and name != "kitsune_keep":
                    for p in params:  # the same loop on every side: what freeing this side's grads costs
                        p.grad = None
                else:
                    side.opt.zero_grad(set_to_none=name != "kitsune_keep")
                t2 = time.perf_counter()
                kind = "probed" if i % args.probe == args.probe - 1 else "plain"
                row.setdefault(f"step[{kind}]", []).append((t1 - t0) * 1e3)
                row.setdefault(f"zero_grad[{kind}]", []).append((t2 - t1) * 1e3)
                row.setdefault("gc", []).append(gc_clock.ms)
                if kind == "plain":
                    for part, ms in c.now.items():
                        row.setdefault(part, []).append(ms)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    out["torch"] = torch.__version__
    out["cover_ms"] = args.cover_ms if cover else 0.0
    print(
        f"== {out['device']}, torch {torch.__version__}, {args.steps} steps a side (median host ms), "
        f"GPU sleep before step() {out['cover_ms']} ms"
    )
    for name in names:
        med = {part: statistics.median(v) for part, v in rows[name].items()}
        opt = sides[name].opt
        if isinstance(opt, KitsuneOptimizer):
            med["steady_replays"] = opt._subsystem("graphs").report()["steady_replays"]
            pool = opt._subsystem("memory").report()
            med["params_pooled"] = pool.get("params_pooled", 0)
            med["params_outside_pool"] = pool.get("params_outside_pool", 0)
        out[name] = med
        print(f"  {SIDES[name]}: " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()))
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
