"""What the steady step's per-step checks cost per tensor on this host, each read timed alone.

python benchmarks/address-check-cost.py                # on a GPU: the 148- and 2000-tensor sizes of the bench
python benchmarks/address-check-cost.py --device cpu   # the same reads of CPU tensors (torch's C++ check: CUDA only)

Before it replays its graph (or launches its kernels), a checked step compares every param's and every grad's
address with the ones its tables hold (``FusedUnit._unchanged``): one call of kitsune's native check
(`kitsune._native`), or, while that builds or where it cannot, a read of every ``p.grad`` and two of torch's C++
comparisons. This times those reads on ``--sizes`` params of 64 elements (the cost does not depend on the size),
each over ``--number`` calls, the minimum of ``--repeat`` runs, and prints microseconds per call and nanoseconds per
tensor:

- kitsune's native check of params and grads (what a step runs), warm, and with the CPU's caches flushed before
  each call (a 64 MiB write, outside the timer), as a step finds them after backward;
- ``list(map(attrgetter("grad"), params))``: reading every ``p.grad``;
- ``torch._C._tensors_data_ptrs_at_indices_equal`` on the grads, then on the params (the fallback; CUDA builds only);
- ``list(map(Tensor.data_ptr, ...)) == addresses``, the Python-level alternative, on the grads and the params;
- the fallback's whole check as ``FusedUnit._unchanged`` makes it.

``--json PATH`` writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import time
import timeit
from collections.abc import Callable
from operator import attrgetter
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sizes", default="148,2000", help="param counts, comma-separated")
    parser.add_argument("--number", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    import torch

    from kitsune import _native

    device = torch.device(args.device)

    def per_call_us(fn: Callable[[], object]) -> float:
        return min(timeit.repeat(fn, number=args.number, repeat=args.repeat)) / args.number * 1e6

    flush = torch.empty(16 * 2**20)  # 64 MiB, more than a server CPU's last-level cache slice

    def flushed_us(fn: Callable[[], object]) -> float:
        best = []
        for _ in range(args.repeat):
            total = 0.0
            for _ in range(max(args.number // 10, 1)):
                flush.add_(1.0)
                t0 = time.perf_counter()
                fn()
                total += time.perf_counter() - t0
            best.append(total / max(args.number // 10, 1) * 1e6)
        return min(best)

    checks = _native.wait(timeout=600)
    if checks is None:
        print(f"kitsune's native check: {_native.reason()}")
    results: dict[str, dict[str, float]] = {}
    for n in map(int, args.sizes.split(",")):
        reads = _reads(torch, device, n)
        results[str(n)] = {}
        if checks is not None:
            params = [torch.nn.Parameter(torch.randn(64, device=device)) for _ in range(n)]
            for p in params:
                p.grad = torch.randn(64, device=device)
            # the params' addresses, the grads', the numels and the shapes' keys (the check compares layout, dtype,
            # size and shape too)
            addresses = [p.data_ptr() for p in params] + [p.grad.data_ptr() for p in params]
            table = torch.tensor(addresses + [64] * n + [_native.shape_key((64,))] * n)

            def native(params: list[Any] = params, table: Any = table) -> bool:
                return checks.unchanged(params, table, _native.PARAMS_AND_GRADS, torch.float32)

            if not native():
                raise RuntimeError("the native check answered False on unchanged params")
            results[str(n)]["kitsune's native check (warm)"] = per_call_us(native)
            results[str(n)]["kitsune's native check (caches flushed)"] = flushed_us(native)
        results[str(n)].update({name: per_call_us(fn) for name, fn in reads.items()})
        print(f"{n} params on {device}")
        for name, us in results[str(n)].items():
            print(f"  {name:<42} {us:9.1f} us  {us * 1e3 / n:6.0f} ns/tensor")
    if args.json is not None:
        args.json.write_text(json.dumps({"device": str(device), "torch": torch.__version__, "us": results}, indent=1))
    return 0


def _reads(torch: Any, device: Any, n: int) -> dict[str, Callable[[], object]]:
    """The reads to time, over ``n`` params with grads on ``device``."""
    ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
    grad_of, data_ptr = attrgetter("grad"), torch.Tensor.data_ptr
    params = [torch.nn.Parameter(torch.randn(64, device=device)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn(64, device=device)
    grads = list(map(grad_of, params))
    grad_ptrs, param_ptrs, every = list(map(data_ptr, grads)), list(map(data_ptr, params)), list(range(n))
    reads: dict[str, Callable[[], object]] = {"read every p.grad": lambda: list(map(grad_of, params))}
    if ptrs_equal is not None:
        reads["C++ address check, grads"] = lambda: ptrs_equal(grads, grad_ptrs, every)
        reads["C++ address check, params"] = lambda: ptrs_equal(params, param_ptrs, every)
        reads["the whole check (FusedUnit._unchanged)"] = lambda: (
            ptrs_equal(list(map(grad_of, params)), grad_ptrs, every) and ptrs_equal(params, param_ptrs, every)
        )
    reads["map(data_ptr) ==, grads"] = lambda: list(map(data_ptr, grads)) == grad_ptrs
    reads["map(data_ptr) ==, params"] = lambda: list(map(data_ptr, params)) == param_ptrs
    return reads


if __name__ == "__main__":
    raise SystemExit(main())
