"""The fused AdamW step across program sizes, tiles and warps a program, 8-bit or float state, torch's fused beside it.

    python benchmarks/program-sweep.py --json q8-sweep.json                      # 8-bit state, gpt2
    python benchmarks/program-sweep.py --state fp32 --set llama1b --configs default,defaulti,1024x4,8192x4t2048
    python benchmarks/program-sweep.py --kitsune /tmp/other --json other.json   # the package in /tmp/other/kitsune
    python benchmarks/program-sweep.py --configs default,defaulti,16384x4,16384x2n   # i: scalar layout, n: no prefetch

GPU only. Each config ``BLOCKxWARPS`` (or ``default``: the planner's and the launcher's choices) builds the one line
with ``FusionConfig(state_precision=...)`` on the same seeded params (a fresh optimizer, so fresh state), with
programs of BLOCK elements launched with WARPS warps. For 8-bit state BLOCK is `kitsune.fusion.planner.Q8_PROGRAM` (a
multiple of the 256-element quantization block); a trailing ``i`` switches `kitsune.kernels.update.Q8_VECTOR` off (the
layout that interleaves a quantization block over the program's warps), ``v`` on (a warp per block and 8 consecutive
elements a thread, the default), ``n`` switches the tiles' prefetch off in both layouts (``Q8_PREFETCH``,
``Q8_VECTOR_PREFETCH``) and ``p`` on, and an ``rREGS`` suffix before them caps the vector layout's registers a
thread (`kitsune.kernels.update.Q8_MAXNREG`; ``r0`` leaves them to the compiler). For float state (``--state fp32``
or ``bf16``) BLOCK is `kitsune.fusion.planner.FP32_PROGRAM` (fp32) or `FLOAT_PROGRAM` (bf16), a ``tTILE`` suffix sets
`kitsune.kernels.update.FLOAT_TILE` (the elements of a pass of the program's loop), and ``i``/``v`` switch
`kitsune.kernels.update.FLOAT_VECTOR` off/on. ``--optimizer`` steps another torch optimizer in the swept rows (the
floor stays AdamW's bytes). The row says whether every launch took the vector path. It times ``step()`` back to
back with `kitsune.bench.timing.time_steps` (CUDA events, host time included, the grads fixed): the median ms over
``--steps`` steps after a warm-up. The floor is the step's bytes as `kitsune bench` counts them
(`kitsune.bench.variants.BYTES_PER_PARAM`; 28 bytes a param for fp32 state) at the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from typing import Any

import torch

PRECISION = {"8bit": "8bit", "bf16": "bf16", "fp32": "param"}
"""``--state`` and the ``state_precision`` it runs."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", default="gpt2")
    parser.add_argument("--state", choices=list(PRECISION), default="8bit")
    parser.add_argument("--configs", help="comma-separated (default: a sweep around the state's defaults)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--optimizer", default="AdamW", help="torch.optim class of the swept rows (SGD: momentum 0.9)")
    parser.add_argument("--kitsune", help="import kitsune from this folder instead of the installed one")
    parser.add_argument("--only-swept", "--only-8bit", action="store_true", help="skip torch's and the fp32 rows")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.kitsune:
        sys.path.insert(0, args.kitsune)
    import kitsune
    import kitsune.fusion.planner as planner
    import kitsune.kernels.update as update
    from kitsune.bench.params import get_param_set, make_params
    from kitsune.bench.runner import ADAMW_BYTES_PER_PARAM
    from kitsune.bench.timing import copy_bandwidth, native_check_ready, percentile, time_steps
    from kitsune.bench.variants import BYTES_PER_PARAM

    print(native_check_ready(torch.device("cuda")))  # the steps as a run past its first minute takes them

    q8 = args.state == "8bit"
    if args.configs is None:
        args.configs = (
            "default,defaulti,defaultr0p,defaultr112p,8192x2,32768x2,16384x4,16384x1"
            if q8
            else "default,defaulti,1024x4,4096x4,8192x4,16384x4,8192x8,8192x4t2048,16384x8t2048"
        )
    program_name = "Q8_PROGRAM" if q8 else "FLOAT_PROGRAM"
    if args.state == "fp32" and hasattr(planner, "FP32_PROGRAM"):  # fp32 state's own program size
        program_name = "FP32_PROGRAM"
    decision = "_vector_layout" if q8 else "_float_vector"
    vector = "Q8_VECTOR" if q8 else "FLOAT_VECTOR"
    prefetch = ("Q8_PREFETCH", "Q8_VECTOR_PREFETCH")
    switches = {"v": ((vector,), True), "i": ((vector,), False), "n": (prefetch, False), "p": (prefetch, True)}

    device = torch.device("cuda")
    pset = get_param_set(args.set)
    params = make_params(pset, device)
    bandwidth, _ = copy_bandwidth(device)
    step_bytes = {"8bit": BYTES_PER_PARAM["8bit"], "bf16": BYTES_PER_PARAM["bf16state"], "fp32": ADAMW_BYTES_PER_PARAM}
    floor_ms = pset.n_elements * step_bytes[args.state] / bandwidth * 1e3

    def timed(opt: Any) -> float:
        for _ in range(5):
            opt.step()
        return percentile(time_steps(opt.step, args.steps, device).device_ms, 50)

    rows: list[dict[str, Any]] = []
    if not args.only_swept:
        rows.append({"config": "torch fused", "ms": timed(torch.optim.AdamW(params, lr=1e-3, fused=True))})
        if q8:
            fp32 = kitsune.KitsuneOptimizer(torch.optim.AdamW(params, lr=1e-3), enable_fusion=True)
            rows.append({"config": "kitsune fp32 state", "ms": timed(fp32)})
            del fp32
    original = update.multi_tensor_update
    names = ("FLOAT_TILE", "Q8_MAXNREG", vector, *prefetch)
    saved = {name: getattr(update, name) for name in names if hasattr(update, name)}
    block0 = getattr(planner, program_name, None)
    layouts: list[bool] = []
    if hasattr(update, decision):  # a tree without the decision runs without the column
        decide = getattr(update, decision)

        def spy(*a: Any) -> bool:
            layouts.append(decide(*a))
            return layouts[-1]

        setattr(update, decision, spy)
    for config in filter(None, args.configs.split(",")):
        match = re.fullmatch(r"(default|(\d+)x(\d+)(?:t(\d+))?)(?:r(\d+))?([vinp]*)", config)
        if match is None:
            raise SystemExit(f"config {config!r}: expected default or BLOCKxWARPS[tTILE][rREGS] and any of v, i, n, p")
        for flag in match[6]:  # a tree without a switch runs its own kernel
            flag_names, value = switches[flag]
            for name in flag_names:
                setattr(update, name, value)
        if match[2]:  # the planner's program size and the launcher's warps otherwise
            setattr(planner, program_name, int(match[2]))
            update.multi_tensor_update = functools.partial(original, num_warps=int(match[3]))
        if match[4]:
            update.FLOAT_TILE = int(match[4])
        if match[5]:
            update.Q8_MAXNREG = int(match[5]) or None  # r0: the compiler's choice
        layouts.clear()
        try:
            cfg = kitsune.KitsuneConfig(fusion=kitsune.FusionConfig(state_precision=PRECISION[args.state]))
            options = {"momentum": 0.9} if args.optimizer == "SGD" else {}
            inner = getattr(torch.optim, args.optimizer)(params, lr=1e-3, **options)
            opt = kitsune.KitsuneOptimizer(inner, config=cfg)
            ms = timed(opt)
            route = sorted({f"{b.route.value} {b.state}" for b in opt.plan.buckets})
            row = {"config": f"{args.state} {config}", "ms": ms, "floor_pct": 100 * floor_ms / ms, "route": route}
            rows.append(row | {"vector": bool(layouts) and all(layouts)})
            del opt
        finally:
            if block0 is not None:
                setattr(planner, program_name, block0)
            for name, value in saved.items():
                setattr(update, name, value)
            update.multi_tensor_update = original
        torch.cuda.empty_cache()
    head = f"set {args.set}  {args.optimizer}  {args.state}, AdamW's floor {floor_ms:.3f} ms"
    print(f"{torch.cuda.get_device_name()}  {head}  {kitsune.__file__}")
    for row in rows:
        pct = f"  {row['floor_pct']:.0f}% of floor" if "floor_pct" in row else ""
        vec = "  vector" if row.get("vector") else ""
        print(f"{row['config']:>26}  {row['ms']:.3f} ms{pct}{vec}")
    if args.json:
        with open(args.json, "w") as f:
            out = {"device": torch.cuda.get_device_name(), "set": args.set, "state": args.state, "floor_ms": floor_ms}
            json.dump(out | {"rows": rows}, f)


if __name__ == "__main__":
    main()
