"""The norm pass alone (kitsune.kernels.norms.MultiTensorNorm) on a parameter set of ``kitsune bench``: device time
per launch against the floor of reading every grad once, for a few block sizes, tiles and warp counts; with ``--clip``
also the clip launch (``MultiTensorNorm.clip_``, a read and a write of every grad) against its floor.

python benchmarks/norm-sweep.py --set gpt2                 # on a GPU
python benchmarks/norm-sweep.py --set gpt2 --device cpu    # a dry run (TRITON_INTERPRET=1 is set for you)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", default="gpt2")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--blocks", default="2048,4096,8192,16384")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--tiles", default=None, help="NORM_TILE values to try (default: the module's)")
    parser.add_argument("--reps", type=int, default=15, help="event pairs per timing (the median is reported)")
    parser.add_argument("--batch", type=int, default=50, help="launches back to back between two events")
    parser.add_argument("--scale", action="store_true", help="divide by a loss scale first, as the AMP step does")
    parser.add_argument("--reduce-blocks", default=None, help="REDUCE_BLOCK values to try (default: the module's)")
    parser.add_argument("--clip", action="store_true", help="also time the clip launch")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from kitsune.bench.params import PARAM_SETS
    from kitsune.bench.timing import copy_bandwidth
    from kitsune.kernels import norms as norms_module
    from kitsune.kernels.norms import MultiTensorNorm

    device = torch.device(args.device)
    pset = PARAM_SETS[args.set].scaled(0.001) if device.type == "cpu" else PARAM_SETS[args.set]
    shapes = [shape for _, shape in pset.shapes]
    gen = torch.Generator(device=device).manual_seed(0)
    grads = [torch.randn(s, device=device, generator=gen) for s in shapes]
    numels = [g.numel() for g in grads]
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    bandwidth = copy_bandwidth(device)[0] if device.type == "cuda" else None  # bytes/s
    floor_ms = sum(numels) * 4 / bandwidth * 1e3 if bandwidth else None
    print(f"{args.set}: {len(grads)} tensors, {sum(numels):,} fp32 elements; read floor {floor_ms} ms")
    reps = args.reps if device.type == "cuda" else 1

    def timed(fn: Any) -> float:
        """Median ms a launch over ``reps`` event pairs, each around ``batch`` launches back to back (one launch
        between a pair of events times the launch gap as much as the kernel: variants 10% apart did not sort)."""
        for _ in range(5):
            fn()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.batch):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / args.batch)
        return statistics.median(times)

    reduce_blocks = [norms_module.REDUCE_BLOCK]
    if args.reduce_blocks:
        reduce_blocks = [int(r) for r in args.reduce_blocks.split(",")]
    out = torch.zeros((), device=device)
    tiles = [norms_module.NORM_TILE] if not args.tiles else [int(t) for t in args.tiles.split(",")]
    configs = [
        (rblock, tile, block, warps)
        for rblock in reduce_blocks
        for tile in tiles
        for block in map(int, args.blocks.split(","))
        for warps in map(int, args.warps.split(","))
        if tile <= block
    ]
    for rblock, tile, block, warps in configs:
        norms_module.REDUCE_BLOCK = rblock
        norms_module.NORM_TILE = tile  # read when a MultiTensorNorm is made
        label = f"  block {block:6d} tile {tile:5d} warps {warps:2d} reduce {rblock:5d}:"
        norm = MultiTensorNorm(numels, device, block=block, num_warps=warps)
        got = norm(grads).total
        torch.testing.assert_close(got, want, rtol=1e-4, atol=0)
        if device.type != "cuda":
            print(label, "ok")
            continue
        scale = torch.full((), 65536.0, device=device) if args.scale else None
        ms = timed(lambda norm=norm, scale=scale: norm.launch(scale, invert_scale=True))
        line = f"{label} norm {ms:.4f} ms ({floor_ms / ms:.0%} of the floor)"
        if args.clip:
            clip_ms = timed(lambda norm=norm: norm.clip_(1e30, out))  # a coefficient of 1: grads unchanged
            line += f", clip {clip_ms:.4f} ms ({2 * floor_ms / clip_ms:.0%})"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
