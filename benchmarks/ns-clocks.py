"""Why a Newton-Schulz call timed back to back runs longer than its kernels: per shape, the call timed alone (L2
flushed between calls, as ``kitsune bench --muon`` times it), ten calls back to back, the kernels' sum from a short
profiled burst, the host's time to issue one call, and the GPU's SM clock and power (NVML) sampled over 3 s of
back-to-back calls (the last 1.5 s counted: NVML averages power over a second). A GPU at its power cap lowers its
clock under sustained matmuls.

python benchmarks/ns-clocks.py --shapes 1x4096x4096,8x2048x2048
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pynvml
import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from kitsune.bench.timing import percentile
from kitsune.kernels import newton_schulz as ns
from kitsune.profiler.nvml import NvmlSampler, cuda_uuid, normalize_uuid

BURST_S = 3.0
"""How long the calls run back to back while NVML is sampled."""
SETTLE_S = 1.5
"""Samples taken this long into the burst and later count (NVML averages power over a second)."""


def measure(shape: tuple[int, ...]) -> dict[str, float]:
    """The timings and samples of one shape (ms, MHz, W)."""
    g = torch.randn(shape, device="cuda")  # fp32, as an optimizer's momentum buffer
    out = torch.empty(shape, device="cuda", dtype=torch.bfloat16)

    def call() -> None:
        ns.newton_schulz(g, 5, out=out)

    def ten() -> None:
        for _ in range(10):
            call()

    for _ in range(5):
        call()
    host = []
    for _ in range(30):
        torch.cuda.synchronize()
        t = time.perf_counter()
        call()
        host.append((time.perf_counter() - t) * 1e3)
    row = {
        "alone_ms": do_bench(call, warmup=25, rep=200, return_mode="median"),
        "back_to_back_ms": do_bench(ten, warmup=25, rep=200, return_mode="median") / 10,
        "host_ms": percentile(host, 50),
    }
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ten()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    row["kernels_ms"] = sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / 10
    sampler = NvmlSampler(torch.cuda.current_device(), interval_s=0.002)
    if not sampler.start():
        raise SystemExit(f"NVML: {sampler.reason}")
    start = time.perf_counter()
    while time.perf_counter() - start < BURST_S:
        ten()
        torch.cuda.synchronize()
    sampler.stop()
    # NVML's power on Ampere (not A100) and newer is the driver's average over the last second: the first second of
    # samples still holds what ran before the burst (the profiled calls, idle time)
    first = sampler.samples[0].t_us if sampler.samples else 0.0
    samples = [s for s in sampler.samples if s.t_us - first >= SETTLE_S * 1e6]
    clocks = [s.sm_clock_mhz for s in samples if s.sm_clock_mhz is not None]
    watts = [s.power_w for s in samples if s.power_w is not None]
    row.update(
        sm_clock_p10_mhz=percentile(clocks, 10),
        sm_clock_p50_mhz=percentile(clocks, 50),
        power_p50_w=percentile(watts, 50),
    )
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x4096x4096,8x2048x2048", help="batch x rows x cols, comma-separated")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    pynvml.nvmlInit()
    index = torch.cuda.current_device()
    uuid = normalize_uuid(cuda_uuid(index))  # NVML numbers devices its own way, not as CUDA_VISIBLE_DEVICES does
    handles = (pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount()))
    handle = next(h for h in handles if normalize_uuid(pynvml.nvmlDeviceGetUUID(h)) == uuid)
    limit = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3
    top = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)
    print(f"{torch.cuda.get_device_name(index)}: power cap {limit:.0f} W, SM clock up to {top} MHz", flush=True)
    rows = {}
    for spec in args.shapes.split(","):
        shape = tuple(int(v) for v in spec.split("x"))
        rows[spec] = r = measure(shape)
        print(
            f"{spec}: alone {r['alone_ms']:.3f} ms, back to back {r['back_to_back_ms']:.3f}, kernels of a burst "
            f"{r['kernels_ms']:.3f}, host {r['host_ms']:.3f} | SM clock p10/p50 {r['sm_clock_p10_mhz']}/"
            f"{r['sm_clock_p50_mhz']} MHz, power p50 {r['power_p50_w']:.0f} W",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps({"power_cap_w": limit, "max_sm_clock_mhz": top, "shapes": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
