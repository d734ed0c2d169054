"""The 8-bit AdamW step across program sizes and warps per program, with fp32 state and torch's fused AdamW beside it.

    python benchmarks/q8-sweep.py --json q8-sweep.json
    python benchmarks/q8-sweep.py --kitsune /tmp/other --json q8-other.json   # the package in /tmp/other/kitsune
    python benchmarks/q8-sweep.py --configs default,defaulti,16384x4,16384x2n   # i: interleaved layout, n: no prefetch

GPU only. Each config ``BLOCKxWARPS`` (or ``default``: the planner's choice) builds the one line with
``FusionConfig(state_precision="8bit")`` on the same seeded params (a fresh optimizer, so fresh state), with 8-bit
programs of BLOCK elements (a multiple of the 256-element quantization block; `kitsune.fusion.planner.Q8_PROGRAM`)
launched with WARPS warps (a trailing ``i``: with `kitsune.kernels.update.Q8_VECTOR` off, the layout that
interleaves a quantization block over the program's warps; ``v``: with it on, a warp per block and 8 consecutive
elements a thread, the default, and the row says whether every launch took it; ``n``: with ``Q8_PREFETCH`` off),
and times ``step()`` back to back with `kitsune.bench.timing.time_steps` (CUDA events, host
time included, the grads fixed): the median ms over ``--steps`` steps after a warm-up. The floor is the 8-bit
AdamW step's bytes as `kitsune bench` counts them (`kitsune.bench.variants.BYTES_PER_PARAM`) at the measured copy
bandwidth.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from typing import Any

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", default="gpt2")
    parser.add_argument("--configs", default="default,defaulti,8192x2,16384x2,32768x2,16384x4,16384x2n")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kitsune", help="import kitsune from this folder instead of the installed one")
    parser.add_argument("--only-8bit", action="store_true", help="skip torch's and the fp32-state rows (for ncu)")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.kitsune:
        sys.path.insert(0, args.kitsune)
    import kitsune
    import kitsune.fusion.planner as planner
    import kitsune.kernels.update as update
    from kitsune.bench.params import get_param_set, make_params
    from kitsune.bench.timing import copy_bandwidth, percentile, time_steps
    from kitsune.bench.variants import BYTES_PER_PARAM

    device = torch.device("cuda")
    pset = get_param_set(args.set)
    params = make_params(pset, device)
    bandwidth, _ = copy_bandwidth(device)
    floor_ms = pset.n_elements * BYTES_PER_PARAM["8bit"] / bandwidth * 1e3

    def timed(opt: Any) -> float:
        for _ in range(5):
            opt.step()
        return percentile(time_steps(opt.step, args.steps, device).device_ms, 50)

    rows: list[dict[str, Any]] = []
    if not args.only_8bit:
        rows.append({"config": "torch fused", "ms": timed(torch.optim.AdamW(params, lr=1e-3, fused=True))})
        fp32 = kitsune.KitsuneOptimizer(torch.optim.AdamW(params, lr=1e-3), enable_fusion=True)
        rows.append({"config": "kitsune fp32 state", "ms": timed(fp32)})
        del fp32
    original = update.multi_tensor_update
    block0 = getattr(planner, "Q8_PROGRAM", None)
    layouts: list[bool] = []
    if hasattr(update, "_vector_layout"):
        decide = update._vector_layout

        def spy(*a: Any) -> bool:
            layouts.append(decide(*a))
            return layouts[-1]

        update._vector_layout = spy
    switches = {"v": ("Q8_VECTOR", True), "i": ("Q8_VECTOR", False), "n": ("Q8_PREFETCH", False)}
    saved = {name: getattr(update, name) for name, _ in switches.values() if hasattr(update, name)}
    for config in filter(None, args.configs.split(",")):
        base = config.rstrip("".join(switches))
        for flag in config[len(base) :]:  # a tree without a switch runs its own kernel
            name, value = switches[flag]
            setattr(update, name, value)
        if base != "default":  # the planner's program size and the launcher's warps otherwise
            block, warps = (int(v) for v in base.split("x"))
            planner.Q8_PROGRAM = block
            update.multi_tensor_update = functools.partial(original, num_warps=warps)
        layouts.clear()
        try:
            cfg = kitsune.KitsuneConfig(fusion=kitsune.FusionConfig(state_precision="8bit"))
            opt = kitsune.KitsuneOptimizer(torch.optim.AdamW(params, lr=1e-3), config=cfg)
            ms = timed(opt)
            route = sorted({f"{b.route.value} {b.state}" for b in opt.plan.buckets})
            row = {"config": f"8bit {config}", "ms": ms, "floor_pct": 100 * floor_ms / ms, "route": route}
            rows.append(row | {"vector": bool(layouts) and all(layouts)})
            del opt
        finally:
            planner.Q8_PROGRAM = block0
            for name, value in saved.items():
                setattr(update, name, value)
            update.multi_tensor_update = original
        torch.cuda.empty_cache()
    print(f"{torch.cuda.get_device_name()}  set {args.set}  8-bit floor {floor_ms:.3f} ms  kitsune {kitsune.__file__}")
    for row in rows:
        pct = f"  {row['floor_pct']:.0f}% of floor" if "floor_pct" in row else ""
        vector = "  vector layout" if row.get("vector") else ""
        print(f"{row['config']:>22}  {row['ms']:.3f} ms{pct}{vector}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "set": args.set, "floor_ms": floor_ms, "rows": rows}, f)


if __name__ == "__main__":
    main()
