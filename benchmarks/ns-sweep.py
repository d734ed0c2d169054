"""Sweep the Newton-Schulz tile configs on a GPU: each variant of the Gram (syrk) and ``a X + B X`` (poly) kernels
timed as a whole 5-iteration call, one kernel varied at a time around the current table's pick, then the best pair.

python benchmarks/ns-sweep.py --json $OUT/ns-sweep.json            # 4096^2 and 8 x 2048^2
python benchmarks/ns-sweep.py --shapes 1x4096x4096 --quick         # fewer variants
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

from kitsune.kernels import newton_schulz as ns

SYRK = [
    # block_m, block_n, block_k, warps, stages, tma, persistent[, flatten]
    (128, 128, 64, 4, 3, False, False),
    (128, 128, 64, 4, 3, True, False),
    (128, 128, 64, 4, 3, False, True),
    (128, 128, 64, 4, 3, True, True),
    (128, 128, 64, 4, 4, True, False),
    (128, 128, 64, 8, 3, True, False),
    (128, 128, 64, 8, 4, True, True),
    (128, 256, 64, 8, 3, True, False),
    (128, 256, 64, 8, 3, True, True),
    (128, 256, 64, 8, 4, True, True),
    (128, 128, 64, 4, 3, True, True, True),
    (128, 256, 64, 8, 3, True, True, True),
]
POLY = [
    # block_m, block_n, block_k, group_m, warps, stages, tma, persistent[, flatten]
    (128, 256, 64, 16, 8, 3, False, False),
    (128, 256, 64, 16, 8, 3, True, False),
    (128, 256, 64, 16, 8, 3, False, True),
    (128, 256, 64, 16, 8, 3, True, True),
    (128, 256, 64, 16, 8, 4, True, False),
    (128, 256, 64, 8, 8, 4, True, True),
    (128, 128, 64, 8, 4, 4, True, False),
    (256, 128, 64, 8, 8, 3, True, False),
    (128, 256, 64, 8, 8, 3, True, True, True),
    (128, 256, 64, 8, 8, 4, False, True, True),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x4096x4096,8x2048x2048")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quick", action="store_true", help="only the first four variants of each kernel")
    args = parser.parse_args(argv)
    plan = ns.schedule(ns.MUON_COEFFICIENTS, 5)
    results: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    syrks = SYRK[:4] if args.quick else SYRK
    polys = POLY[:4] if args.quick else POLY
    for spec in args.shapes.split(","):
        batch, m, n = (int(v) for v in spec.split("x"))
        x = torch.randn(batch, m, n, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)
        picked = ns.pick_configs(m, n, batch, torch.bfloat16, x.device)
        base_s, base_c, base_p = picked
        rows = []

        def time(cfg: tuple, rows: list = rows, x: torch.Tensor = x, out=out) -> float:
            """One call with ``(gram, b_prime, product)`` configs."""
            try:
                ms = do_bench(lambda: ns.newton_schulz_launch(x, out, plan, 1e-7, torch.bfloat16, cfg), rep=200)
            except Exception as exc:  # a config that does not compile or fit: recorded, not fatal
                print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                ms = float("inf")
            rows.append({"syrk": list(cfg[0]), "b_prime": list(cfg[1]), "poly": list(cfg[2]), "ms": ms})
            print(f"  {ms:8.4f} ms  syrk {tuple(cfg[0])}  b' {tuple(cfg[1])}  poly {tuple(cfg[2])}", flush=True)
            return ms

        print(f"== {spec} (table: {tuple(base_s)} {tuple(base_c)} {tuple(base_p)})", flush=True)
        # a Gram config serves both Gram launches in the sweep; the product's sweep keeps the table's Gram configs
        syrk_ms = {s: time((ns.SyrkConfig(*s), ns.SyrkConfig(*s), base_p)) for s in syrks}
        best_s = ns.SyrkConfig(*min(syrk_ms, key=syrk_ms.get))
        poly_ms = {p: time((base_s, base_c, ns.PolyConfig(*p))) for p in polys}
        best_p = ns.PolyConfig(*min(poly_ms, key=poly_ms.get))
        best = time((best_s, best_s, best_p))
        default = time(picked)
        print(f"   best {best:.4f} ms vs table {default:.4f} ms: {tuple(best_s)} {tuple(best_p)}", flush=True)
        results["shapes"][spec] = {"rows": rows, "best": [list(best_s), list(best_p), best], "table_ms": default}
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
