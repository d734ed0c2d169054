"""Distributed Muon on GPUs: each rank orthogonalises its share of every shape's matrices, against one GPU.

torchrun --nproc_per_node=2 benchmarks/dist-muon-check.py --out dist-muon.json
torchrun --nproc_per_node=2 benchmarks/dist-muon-check.py --out /tmp/dm.json --device cpu --dim 32 --steps 3   # dry run

Every rank builds the same stack of ``--layers`` square linear layers (hidden matrices of ``--dim`` on a side, so one
Newton-Schulz batch per step) and trains it twice on the same batches: alone, with ``kitsune.optim.Muon`` as one
process would (the reference), and under DDP with ``Muon(process_group=WORLD)``, where each rank orthogonalises its
share of the matrices and the results are all-gathered (Muon's own step, in ``KitsuneOptimizer``), and once more
alone through the fusion planner (``enable_fusion=True``, for its step time). Per rank it records the largest
difference between the distributed and the one-process params, the median step time of each (CUDA events), and
peak memory. Rank 0 writes every rank's numbers as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from kitsune import KitsuneOptimizer
from kitsune.optim import Muon


def build(dim: int, layers: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    blocks = [m for _ in range(layers) for m in (nn.Linear(dim, dim), nn.Tanh())]
    return nn.Sequential(*blocks, nn.Linear(dim, 8)).to(device)


def muon(module: nn.Module, process_group: dist.ProcessGroup | None = None, fused: bool = False) -> KitsuneOptimizer:
    hidden = [p for p in module.parameters() if p.ndim == 2 and p.shape[0] == p.shape[1]]
    rest = [p for p in module.parameters() if not (p.ndim == 2 and p.shape[0] == p.shape[1])]
    groups = [{"params": hidden}, {"params": rest, "use_muon": False, "lr": 1e-3}]
    return KitsuneOptimizer(Muon(groups, lr=0.02, weight_decay=0.01, process_group=process_group), enable_fusion=fused)


def train(model: nn.Module, opt: KitsuneOptimizer, dim: int, steps: int, warmup: int, device: torch.device) -> float:
    """``warmup + steps`` steps on fresh batches (the same on every rank); median ms of ``opt.step()`` over the
    last ``steps``."""
    times = []
    for step in range(warmup + steps):
        gen = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(64, dim, generator=gen).to(device), torch.randn(64, 8, generator=gen).to(device)
        nn.functional.mse_loss(model(x), y).backward()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            opt.step()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            opt.step()
            ms = (time.perf_counter() - t0) * 1e3
        opt.zero_grad()
        if step >= warmup:
            times.append(ms)
    return statistics.median(times)


def first_grads(model: nn.Module, dim: int, device: torch.device) -> list[torch.Tensor]:
    """The grads of the first batch ``train`` feeds (through DDP's averaging when ``model`` is wrapped)."""
    gen = torch.Generator().manual_seed(1000)
    x, y = torch.randn(64, dim, generator=gen).to(device), torch.randn(64, 8, generator=gen).to(device)
    nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad()
    return grads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        parser.error("run it with torchrun: torchrun --nproc_per_node=2 benchmarks/dist-muon-check.py --out FILE")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        fused = build(args.dim, args.layers, device)
        fused_ms = train(fused, muon(fused, fused=True), args.dim, args.steps, args.warmup, device)
        ref = build(args.dim, args.layers, device)
        ref_ms = train(ref, muon(ref), args.dim, args.steps, args.warmup, device)
        model = build(args.dim, args.layers, device)
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = muon(model, dist.group.WORLD)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        ms = train(ddp, opt, args.dim, args.steps, args.warmup, device)
        diffs = [(a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters(), strict=True)]
        # whether DDP's average of the ranks' identical grads is the one process's grad bit for bit (a ring's sum
        # of 3 or more equal values can round): the difference the params start from
        grad_pairs = zip(first_grads(ddp, args.dim, device), first_grads(ref, args.dim, device), strict=True)
        grad_diff = max((a - b).abs().max().item() for a, b in grad_pairs)
        scales = [b.abs().max().item() for b in ref.parameters()]
        row = {
            "rank": rank,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "one_process_step_ms": ref_ms,
            "one_process_fused_step_ms": fused_ms,
            "distributed_step_ms": ms,
            "max_abs_diff": max(diffs),
            "max_abs_grad_diff_first_batch": grad_diff,
            "max_rel_diff": max(d / s for d, s in zip(diffs, scales, strict=True) if s > 0),
            "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0,
            "fusion": {s["name"]: s["reason"] for s in opt.subsystem_status() if s["name"] == "fusion"},
        }
        rows: list[dict | None] = [None] * world
        dist.all_gather_object(rows, row)
        if rank == 0:
            result = {"torch": torch.__version__, "world_size": world, "dim": args.dim, "layers": args.layers,
                      "steps": args.steps, "ranks": rows}  # fmt: skip
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
            for r in rows:
                assert r is not None
                print(
                    f"rank {r['rank']}: one process {r['one_process_step_ms']:.3f} ms/step "
                    f"({r['one_process_fused_step_ms']:.3f} fused), distributed "
                    f"{r['distributed_step_ms']:.3f} ms/step, max |diff| {r['max_abs_diff']:.3g} "
                    f"(relative {r['max_rel_diff']:.3g}), first batch's averaged grads within "
                    f"{r['max_abs_grad_diff_first_batch']:.3g} of one process's, "
                    f"peak {r['peak_bytes'] / 2**20:.0f} MiB",
                    flush=True,
                )
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
