"""Where a Newton-Schulz call's time goes on a GPU: each kernel of a 5-iteration call (torch.profiler, averaged per
position in the iteration), next to cuBLAS doing the same products (``torch.bmm``/``torch.baddbmm``, the latter
without the ``a I``), with TFLOP/s of the work each product does (the Gram products count their symmetric half).
With ``--syrk``/``--xgram``/``--bprime``/``--poly``, other kernel configs are timed against the picked ones in rotating
turns.

python benchmarks/ns-breakdown.py --json $OUT/ns-breakdown.json     # 8 x 2048^2 and 4096^2
python benchmarks/ns-breakdown.py --shapes 1x4096x4096 --poly 'cublas;triton'  # B' X: cuBLAS against Triton, in turns
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from kitsune.kernels import newton_schulz as ns

KERNELS = ("_prologue_kernel", "_syrk_kernel", "_gram_reduce_kernel", "_poly_kernel")
"""The Triton kernels of a call (any other kernel in the profile is not the call's)."""


def kernel_times(fn, calls: int) -> list[tuple[str, float]]:
    """(name, ms) of every GPU kernel of ``calls`` calls of ``fn``, in launch order."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.name in KERNELS]
    events.sort(key=lambda e: e.time_range.start)
    return [(e.name, e.time_range.elapsed_us() / 1e3) for e in events]


def cublas_times(batch: int, m: int, n: int, a: float, b: float, c: float) -> dict[str, float]:
    """The iteration's products through cuBLAS, on fresh random operands of the iteration's shapes."""
    big = torch.randn(batch, m, m, device="cuda", dtype=torch.bfloat16) / m**0.5
    sym = big + big.transpose(1, 2)
    xs = torch.randn(batch, m, n, device="cuda", dtype=torch.bfloat16)
    o_mm = torch.empty(batch, m, m, device="cuda", dtype=torch.bfloat16)
    o_mn = torch.empty(batch, m, n, device="cuda", dtype=torch.bfloat16)
    return {
        "gram X X^T": do_bench(lambda: torch.bmm(xs, xs.transpose(1, 2), out=o_mm), rep=300),
        "B' = b A + c A A + a I": do_bench(lambda: torch.baddbmm(sym, sym, sym, beta=b, alpha=c, out=o_mm), rep=300),
        "B' X": do_bench(lambda: torch.bmm(sym, xs, out=o_mn), rep=300),
    }


def split_times(x: torch.Tensor, plan: list) -> dict[str, float]:
    """The batch cut into 1, 2 or 4 parts, each part's call on its own stream (one part's tail of tiles overlaps the
    next part's kernels), launched directly and replayed from a CUDA graph."""
    times: dict[str, float] = {}
    out = torch.empty_like(x)
    for parts in (1, 2, 4):
        if x.shape[0] % parts:
            continue
        streams = [torch.cuda.Stream() for _ in range(parts)]
        xs, outs = x.chunk(parts), out.chunk(parts)

        def call(streams=streams, xs=xs, outs=outs) -> None:
            main = torch.cuda.current_stream()  # the capture's own stream inside a graph capture
            for s in streams:
                s.wait_stream(main)
            for s, xi, oi in zip(streams, xs, outs, strict=True):
                with torch.cuda.stream(s):
                    ns.newton_schulz_launch(xi, oi, plan, 1e-7, torch.bfloat16)
            for s in streams:
                main.wait_stream(s)

        times[f"{parts} part(s), launched"] = do_bench(call, rep=300)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        times[f"{parts} part(s), graph"] = do_bench(graph.replay, rep=300)
    return times


def _timed_call(x: torch.Tensor, out: torch.Tensor, plan: list, cfg: tuple, graph: bool = True) -> object:
    """The call with these configs replayed from a CUDA graph, as ``newton_schulz`` makes it where the graph fits in
    its cache (and as a captured optimizer step runs it); without ``graph``, launched directly."""
    call = lambda: ns.newton_schulz_launch(x, out, plan, 1e-7, torch.bfloat16, cfg)  # noqa: E731
    if not graph:
        return call
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph.replay


def config_variants(
    x: torch.Tensor,
    plan: list,
    syrks: list[ns.SyrkConfig],
    polys: list[ns.PolyConfig],
    bprimes: list[ns.SyrkConfig] = (),
    xgrams: list[ns.SyrkConfig] = (),
    rounds: int = 2,
    graph: bool = True,
) -> dict[str, float]:
    """The whole call with each Gram config (for both Gram launches; with ``bprimes`` for the ``B'`` launch only,
    with ``xgrams`` for the ``X X^T`` launch only) or product config, the others picked, timed in turns against the
    picked ones: median ms per config, each replayed from a CUDA graph (without ``graph``: launched directly). The
    picked configs are also timed the other way, to see what the host's launches cost."""
    batch, m, n = x.shape
    picked = ns.pick_configs(m, n, batch, torch.bfloat16, x.device)
    configs = {
        "picked": picked,
        **{f"gram {tuple(v)!r}": (v, v, picked[2]) for v in syrks},
        **{f"b' {tuple(v)!r}": (picked[0], v, picked[2]) for v in bprimes},
        **{f"x x^t {tuple(v)!r}": (v, picked[1], picked[2]) for v in xgrams},
        **{f"product {tuple(v)!r}": (picked[0], picked[1], v) for v in polys},
    }
    out = torch.empty_like(x)
    calls = {key: _timed_call(x, out, plan, cfg, graph) for key, cfg in configs.items()}
    other = "picked, launched directly" if graph else "picked, replayed from a graph"
    calls[other] = _timed_call(x, out, plan, picked, graph=not graph)
    times: dict[str, list[float]] = {k: [] for k in calls}
    keys = list(calls)
    for r in range(rounds * len(keys)):  # each config in each place of the order alike (the clocks follow the load)
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            times[key].append(do_bench(calls[key]))
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def parse_syrk(spec: str) -> list[ns.SyrkConfig]:
    """``bm,bn,bk,warps,stages[,tma,persistent,flatten[,split_k]];...`` as Gram kernel configs."""
    out = []
    for item in filter(None, spec.split(";")):
        v = [int(f) for f in item.split(",")]
        out.append(ns.SyrkConfig(*v[:5], *(bool(f) for f in v[5:8]), *v[8:]))
    return out


def parse_poly(spec: str, picked: ns.PolyConfig) -> list[ns.PolyConfig]:
    """``bm,bn,bk,group,warps,stages[,tma,persistent,flatten,cublas];...`` as product configs; ``cublas`` alone is
    the picked config with the product handed to cuBLAS, ``triton`` the picked one in Triton."""
    out = []
    for item in filter(None, spec.split(";")):
        if item in ("cublas", "triton"):
            out.append(picked._replace(cublas=item == "cublas"))
            continue
        v = [int(f) for f in item.split(",")]
        out.append(ns.PolyConfig(*v[:6], *(bool(f) for f in v[6:])))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8x2048x2048,1x4096x4096")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--syrk", default="", help="Gram configs to time against the picked one, see parse_syrk")
    parser.add_argument("--bprime", default="", help="the same for the B' launch only (X X^T's config picked)")
    parser.add_argument("--xgram", default="", help="the same for the X X^T launch only (B' picked)")
    parser.add_argument("--poly", default="", help="product configs to time against the picked one, see parse_poly")
    parser.add_argument(
        "--launched", action="store_true", help="time the variants launched directly, not replayed from CUDA graphs"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    plan = ns.schedule(ns.MUON_COEFFICIENTS, 5)
    results: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    for spec in args.shapes.split(","):
        batch, m, n = (int(v) for v in spec.split("x"))
        x = torch.randn(batch, m, n, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)
        row: dict = {}

        def call(x=x, out=out) -> None:
            ns.newton_schulz_launch(x, out, plan, 1e-7, torch.bfloat16)

        row["kitsune_ms"] = do_bench(lambda x=x, out=out: ns.newton_schulz(x, len(plan), out=out), rep=300)
        # a split Gram's reduce launch counts with its Gram
        x_split, c_split = ns.gram_splits(*ns.pick_configs(m, n, batch, torch.bfloat16, x.device)[:2], m, n)
        gram, b_prime = "gram X X^T", "B' = b A + c A A + a I"
        iteration = [gram] * (1 + (x_split[0] > 1)) + [b_prime] * (1 + (c_split[0] > 1)) + ["B' X"]
        names = ["prologue"] + iteration * len(plan)
        # the first iteration reads the input (through strides, or in place at its own width), the last writes
        # the result: each can run slower than the ones between, on buffers of whole k blocks
        place = ["first"] + [
            "first" if i == 0 else "last" if i == len(plan) - 1 else "middle"
            for i in range(len(plan))
            for _ in iteration
        ]
        per: dict[str, list[float]] = defaultdict(list)
        per_place: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        times = kernel_times(call, args.calls)
        if len(times) == args.calls * len(names):
            for i, (_, ms) in enumerate(times):
                per[names[i % len(names)]].append(ms)
                per_place[names[i % len(names)]][place[i % len(names)]].append(ms)
        else:
            print(f"  {len(times)} kernels in {args.calls} calls, expected {args.calls * len(names)}", flush=True)
        row["kernels_ms"] = {k: sum(v) / (args.calls * (1 if k == "prologue" else len(plan))) for k, v in per.items()}
        row["kernels_by_iteration_ms"] = {  # a launch's time summed per iteration, averaged over the calls
            k: {p: sum(v) / (args.calls * (1 if p != "middle" else len(plan) - 2)) for p, v in d.items()}
            for k, d in per_place.items()
            if k != "prologue"
        }

        row["cublas_ms"] = cublas_times(batch, m, n, *plan[0])
        flops = {
            "gram X X^T": batch * m * m * n,  # the symmetric half: m^2 n multiply-adds
            "B' = b A + c A A + a I": batch * m**3,
            "B' X": 2 * batch * m * m * n,
        }
        print(f"== {spec}: newton_schulz {row['kitsune_ms']:.4f} ms per 5-iteration call", flush=True)
        print(f"  {'product':<18} {'kitsune ms':>10} {'TFLOP/s':>8} {'cuBLAS ms':>10} {'TFLOP/s':>8}")
        for key in flops:
            k_ms = row["kernels_ms"].get(key)
            c_ms = row["cublas_ms"][key]
            full = flops[key] * (2 if key.startswith(("gram", "B' =")) else 1)  # cuBLAS computes both halves
            k_txt = f"{k_ms:10.4f} {flops[key] / k_ms / 1e9:8.0f}" if k_ms else f"{'':>10} {'':>8}"
            print(f"  {key:<18} {k_txt} {c_ms:10.4f} {full / c_ms / 1e9:8.0f}", flush=True)
        print(f"  prologue {row['kernels_ms'].get('prologue', float('nan')):.4f} ms", flush=True)
        for key, by in row["kernels_by_iteration_ms"].items():
            print(f"  {key:<26} " + "  ".join(f"{p} {ms:.4f}" for p, ms in by.items()) + " ms", flush=True)
        syrks = parse_syrk(args.syrk)
        polys = parse_poly(args.poly, ns.pick_configs(m, n, batch, torch.bfloat16, x.device)[2])
        bprimes = parse_syrk(args.bprime)
        xgrams = parse_syrk(args.xgram)
        if syrks or polys or bprimes or xgrams:
            row["variants_ms"] = config_variants(x, plan, syrks, polys, bprimes, xgrams, graph=not args.launched)
            for key, ms in row["variants_ms"].items():
                print(f"  {key:<72} {ms:8.4f} ms", flush=True)
        if batch > 1:
            row["split_ms"] = split_times(x, plan)
            for key, ms in row["split_ms"].items():
                print(f"  {key:<34} {ms:8.4f} ms", flush=True)
        results["shapes"][spec] = row
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
