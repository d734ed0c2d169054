"""How long the end-to-end GPT-2 step keeps the host and the GPU busy, part by part, eager and compiled.

python benchmarks/e2e-anatomy.py                      # on a GPU: GPT-2 124M, bf16 autocast, batch 4 x 512
python benchmarks/e2e-anatomy.py --device cpu --steps 2 --compile eager  # dry run: tiny model, host times only

For forward + backward and for each side's optimizer phase it measures two things in one process:

* host: the time to issue the work (perf_counter around the calls, no synchronisation inside);
* GPU: the time the GPU takes to run it when it never waits for the host: the work is queued behind a
  ``torch.cuda._sleep`` long enough to cover its issue, and CUDA events recorded after the sleep time it. A call
  whose host time reaches the sleep's waited for the GPU (a synchronisation inside it): it is counted.

A step is host-bound when its host time exceeds its GPU time: then the GPU idles, and a faster optimizer phase on
the GPU shows in tokens/s only as far as it also takes less host time. The last lines give each ratio's ceiling
when the step is GPU-bound: (fwd+bwd GPU + torch phase GPU) / (fwd+bwd GPU + kitsune phase GPU). Each side trains
its own copy of the model (kitsune's in-backward side updates inside its own backward, on a side stream: the CUDA
events on the current stream count those updates only as far as that stream waits for them, so its GPU times are
not comparable with the other sides').
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kitsune import KitsuneOptimizer
from kitsune.bench.e2e import CPU_TINY, GPT, GPT2_SMALL, build_side, forward_backward
from kitsune.bench.timing import native_check_ready


def _sleep_cycles_per_ms() -> float:
    """The GPU's ``_sleep`` cycles per millisecond (the clock it spins on, measured)."""
    torch.cuda._sleep(1_000_000)  # warm
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / start.elapsed_time(end)


def _time(fn: Any, device: torch.device, cycles_per_ms: float | None, cover_ms: float) -> tuple[float, float]:
    """(host ms, GPU ms) of one call of ``fn``; GPU ms is nan on a CPU."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3, float("nan")
    torch.cuda.synchronize()
    torch.cuda._sleep(int(cover_ms * cycles_per_ms))  # the GPU is busy while the host issues fn's work
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    fn()
    host = (time.perf_counter() - t0) * 1e3
    end.record()
    end.synchronize()
    return host, start.elapsed_time(end)


SIDES = ("torch", "torch_noclip", "kitsune", "kitsune_noclip", "kitsune_backward")
"""The sides of ``kitsune bench --e2e`` measured here (``kitsune.bench.e2e.SIDES``)."""


def _measure(
    mode: str, cfg: Any, device: torch.device, tokens: torch.Tensor, steps: int, cycles: float | None, cover_ms: float
) -> dict[str, dict[str, float]]:
    """Median host and GPU ms of forward + backward and of the optimizer phase, per side, in turns."""
    torch.manual_seed(0)
    init = GPT(cfg).state_dict()
    # a model each: the in-backward side's hooks must fire in its own backward only
    sides = {name: build_side(name, cfg, init, device, None if mode == "eager" else mode) for name in SIDES}

    def fwd_bwd(name: str) -> None:
        forward_backward(sides[name], tokens)

    split: dict[str, list[tuple[float, float]]] = {name: [] for name in SIDES}

    def phase(name: str) -> None:
        """``optimizer_phase``, with ``step()`` and ``zero_grad()`` timed apart."""
        side = sides[name]
        if name == "torch":
            torch.nn.utils.clip_grad_norm_(side.model.parameters(), 1.0)
        t0 = time.perf_counter()
        side.opt.step()
        t1 = time.perf_counter()
        side.opt.zero_grad()
        split[name].append(((t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3))

    for name in SIDES:  # warm-up: compilation, kitsune's graph capture
        for _ in range(10):
            fwd_bwd(name)
            phase(name)
        split[name].clear()
    parts: dict[str, list[tuple[float, float]]] = {}
    for _ in range(steps):
        for name in SIDES:
            for part, fn in (("fwd_bwd", fwd_bwd), ("phase", phase)):
                parts.setdefault(f"{part}[{name}]", []).append(_time(partial(fn, name), device, cycles, cover_ms))
    for name, side in sides.items():
        graphs = side.opt._subsystem("graphs").report() if isinstance(side.opt, KitsuneOptimizer) else None
        print(
            f"  {name}: step() host {statistics.median(a for a, _ in split[name]):.3f} ms, zero_grad() host "
            f"{statistics.median(b for _, b in split[name]):.3f} ms" + (f"; graphs {graphs}" if graphs else "")
        )
    return {
        key: {
            "host_ms": statistics.median(h for h, _ in v),
            "gpu_ms": statistics.median(g for _, g in v),
            # a call whose host time reaches the sleep's waited for the GPU: a synchronisation inside it
            "waited": sum(h > 0.9 * cover_ms for h, _ in v),
        }
        for key, v in parts.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=30, help="timed calls of each part (after 10 warm-up steps)")
    parser.add_argument("--compile", default="eager,inductor", help="comma-separated: eager and/or compile backends")
    parser.add_argument("--cover-ms", type=float, default=150.0, help="GPU sleep queued before each timed call")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    print(native_check_ready(device))  # the steps as a run past its first minute takes them
    cfg = GPT2_SMALL if device.type == "cuda" else CPU_TINY
    cycles = _sleep_cycles_per_ms() if device.type == "cuda" else None
    gen = torch.Generator().manual_seed(1)
    seq = min(512, cfg.block)
    data = [torch.randint(cfg.vocab, (4, seq + 1), generator=gen).to(device) for _ in range(4)]
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    results["torch"] = torch.__version__
    for mode in [m for m in args.compile.split(",") if m]:
        out = _measure(mode, cfg, device, data[0], args.steps, cycles, args.cover_ms)
        results[mode] = out
        print(f"== {mode} ({results['device']}, torch {torch.__version__})")
        for key, v in out.items():
            waited = f"   {v['waited']} call(s) waited for the GPU" if v["waited"] else ""
            print(f"  {key:28s} host {v['host_ms']:7.3f} ms   GPU {v['gpu_ms']:7.3f} ms{waited}")
        if device.type == "cuda":
            fb_gpu = out["fwd_bwd[torch]"]["gpu_ms"]
            for name, base in (("kitsune", "torch"), ("kitsune_noclip", "torch_noclip")):
                base_ms, ms = out[f"phase[{base}]"]["gpu_ms"], out[f"phase[{name}]"]["gpu_ms"]
                print(f"  GPU-bound ceiling, {name} over {base}: {(fb_gpu + base_ms) / (fb_gpu + ms):.3f}x")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
