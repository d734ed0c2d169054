"""FSDP2 on GPUs: kitsune's fused step on the local shards against torch's fused AdamW, and against one GPU.

torchrun --nproc_per_node=2 benchmarks/fsdp-check.py --out fsdp-check
torchrun --nproc_per_node=2 benchmarks/fsdp-check.py --out /tmp/fsdp --device cpu --steps 2 --warmup 1   # gloo dry run

Each rank builds the same small GPT-style model twice, shards both with ``fully_shard`` over a 1-D mesh (NCCL), and
trains one with ``torch.optim.AdamW(fused=True)`` + ``torch.nn.utils.clip_grad_norm_`` and the other with
``KitsuneOptimizer(AdamW, enable_fusion=True, max_grad_norm=...)`` on the same batches. It records per rank:

- the largest difference of the full params and of the global grad norms between the two runs;
- the median optimizer step time (CUDA events; torch: clip + step, kitsune: step, which clips inside), host time,
  every rank starting each timed step together; kitsune with its CUDA graph (the default: the grad norm's
  all-reduce captured with the kernels) and with ``capture_graph=False``, side by side;
- peak memory and the bytes of optimizer state this rank holds;
- on rank 0 afterwards, the kitsune step on one GPU over plain tensors of rank 0's shard shapes (no collective):
  the sharded step's overhead over the same amount of work on one GPU.

Everything goes to ``OUT/fsdp-check.json``; rank 0 prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from kitsune import KitsuneOptimizer, _native


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, ctx: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(ctx, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def build(args: argparse.Namespace, device: torch.device, mesh) -> GPT:
    torch.manual_seed(0)
    model = GPT(args.vocab, args.dim, args.layers, args.heads, args.ctx).to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def state_bytes(opt: torch.optim.Optimizer) -> int:
    total = 0
    for s in opt.state.values():
        for v in s.values():
            if isinstance(v, torch.Tensor):
                t = v.to_local() if hasattr(v, "to_local") else v
                total += t.numel() * t.element_size()
    return total


def timed(fn, together: bool = False) -> tuple[float, float]:
    """(device ms, host ms) of one call of ``fn`` (on CPU, a smoke test: both host ms). ``together``: every rank
    starts it at once (a barrier with the GPU idle), so a collective inside ``fn`` does not wait for a rank still in
    backward: the time is the step's, not the ranks' skew."""
    if together:
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        dist.barrier()
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
    if not torch.cuda.is_initialized():
        host = time.perf_counter()
        fn()
        host = (time.perf_counter() - host) * 1e3
        return host, host
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = time.perf_counter()
    start.record()
    fn()
    end.record()
    host = (time.perf_counter() - host) * 1e3
    torch.cuda.synchronize()
    return start.elapsed_time(end), host


def train_grads(args: argparse.Namespace, model: nn.Module, gen: torch.Generator, device: torch.device) -> None:
    """One forward and backward: fresh grads for the next step."""
    idx = torch.randint(args.vocab, (args.batch, args.ctx + 1), generator=gen).to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        logits = model(idx[:, :-1])
    nn.functional.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten()).backward()


def trace(args: argparse.Namespace, name: str, grads, opt, together: bool) -> None:
    """``--trace``: where kitsune's step spends its time. 5 more steps under torch.profiler (the kernels' and ops'
    table to ``OUT/trace-NAME.txt``, the timeline to ``OUT/trace-NAME.json``), then 20 under cProfile (the host's
    Python, ``OUT/cprofile-NAME.txt``), then 20 timing the address check alone (the end of that file);
    ``grads()`` makes each step's fresh grads, outside what is profiled; ``together``: as `timed`'s."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            grads()
            timed(opt.step, together=together)
            opt.zero_grad()
    args.out.mkdir(parents=True, exist_ok=True)
    table = prof.key_averages().table(sort_by="device_time_total", row_limit=40, max_name_column_width=70)
    (args.out / f"trace-{name}.txt").write_text(table)
    prof.export_chrome_trace(str(args.out / f"trace-{name}.json"))
    host = cProfile.Profile()
    for _ in range(20):
        grads()
        timed(lambda: host.runcall(opt.step), together=together)
        opt.zero_grad()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(35)
    # the address check alone, right after the grads are made (as a step meets it) and once more at once: cold
    # against warm caches, in us (the native check of each fused unit)
    units = opt._subsystem("fusion").launch_units
    cold, warm = [], []
    for _ in range(20):
        grads()
        for out in (cold, warm):
            t0 = time.perf_counter()
            for unit in units:
                unit._native_check(grads=True)
            out.append((time.perf_counter() - t0) * 1e6)
        opt.step()
        opt.zero_grad()
    cold_us, warm_us = statistics.median(cold), statistics.median(warm)
    text.write(f"\naddress check after the grads: {cold_us:.1f} us, again: {warm_us:.1f} us\n")
    (args.out / f"cprofile-{name}.txt").write_text(text.getvalue())


def run(args: argparse.Namespace, device: torch.device, kitsune: bool, mesh, graph: bool = True) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(args, device, mesh)
    base = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=not kitsune)
    if kitsune:
        opt = KitsuneOptimizer(base, enable_fusion=True, max_grad_norm=args.clip, capture_graph=graph)
    else:
        opt = base
    gen = torch.Generator().manual_seed(1000 + rank)
    params, clipped = list(model.parameters()), []
    norms, ms, host = [], [], []
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.steps):
        train_grads(args, model, gen, device)
        if kitsune:
            t = timed(opt.step, together=True)
            norms.append(float(opt.last_grad_norm))
        else:
            t = timed(lambda: (clipped.append(torch.nn.utils.clip_grad_norm_(params, args.clip)), opt.step()), True)
            n = clipped.pop()
            norms.append(float(n.full_tensor() if hasattr(n, "full_tensor") else n))
        opt.zero_grad()
        if step >= args.warmup:
            ms.append(t[0])
            host.append(t[1])
    if kitsune and graph and args.trace:
        trace(args, f"fsdp-rank{rank}", lambda: train_grads(args, model, gen, device), opt, together=True)
    out = {
        "step_ms_median": statistics.median(ms),
        "host_ms_median": statistics.median(host),
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if cuda else 0,
        "state_bytes": state_bytes(opt),
        "norms": norms,
        "params": [p.full_tensor().detach().float().cpu() for p in model.parameters()],
        "local_shapes": [tuple(p.to_local().shape) for p in model.parameters()],
        "world": world,
    }
    if kitsune:
        out["plan"] = sorted({f"{b.route.value}: {b.reason}" for b in opt.plan.buckets})
        out["fused_tensors"] = sum(b.tensors for b in opt.plan.buckets if b.route.fused)
        out["grad_pass"] = opt._subsystem("fusion").grad_pass
        out["address_checks"] = opt._subsystem("fusion").report()["address_checks"]
        graphs = opt._subsystem("graphs")
        report = graphs.report()
        out["graphs"] = {k: report[k] for k in ("captures", "replays", "steady_replays", "eager_steps")}
        out["graphs"]["inactive_reason"] = graphs.reason
    if cuda:
        torch.cuda.empty_cache()
    return out


def single_gpu(args: argparse.Namespace, device: torch.device, shapes: list[tuple[int, ...]]) -> dict:
    """kitsune's fused step over plain tensors of one rank's shard shapes: the same work, no collective."""
    gen = torch.Generator().manual_seed(7)
    params = [nn.Parameter(torch.randn(s, generator=gen).to(device) * 0.02) for s in shapes]
    opt = KitsuneOptimizer(
        torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1), enable_fusion=True, max_grad_norm=args.clip
    )

    def grads() -> None:
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(device) * 1e-3

    ms, host = [], []
    for step in range(args.steps):
        grads()
        t = timed(opt.step)
        if step >= args.warmup:
            ms.append(t[0])
            host.append(t[1])
        opt.zero_grad()
    if args.trace:
        trace(args, "one-gpu", grads, opt, together=False)
    return {"step_ms_median": statistics.median(ms), "host_ms_median": statistics.median(host)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument(
        "--trace", action="store_true", help="profile more steps of kitsune's step (OUT/trace-*, OUT/cprofile-*)"
    )
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a gloo smoke test of the script"
    )
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:
        parser.error("run it with torchrun: torchrun --nproc_per_node=2 benchmarks/fsdp-check.py --out DIR")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        # time the steps as a run past its first minute has them: with the native address check built (once per
        # machine and torch version, in the background; until then every FSDP2 step takes the full address check)
        native = _native.wait(timeout=600) is not None
        ref = run(args, device, kitsune=False, mesh=mesh)
        ours = run(args, device, kitsune=True, mesh=mesh)
        eager = run(args, device, kitsune=True, mesh=mesh, graph=False)  # capture_graph=False, side by side
        diff = max((a - b).abs().max().item() for a, b in zip(ref["params"], ours["params"], strict=True))
        scale = max(a.abs().max().item() for a in ref["params"])
        norm_rel = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ref["norms"], ours["norms"], strict=True))
        result = {
            "rank": rank,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "native_check": native or _native.reason(),
            "max_abs_param_diff": diff,
            "max_abs_param": scale,
            "max_rel_grad_norm_diff": norm_rel,
            "torch_fused": {k: v for k, v in ref.items() if k not in ("params", "norms", "local_shapes")},
            "kitsune": {k: v for k, v in ours.items() if k not in ("params", "norms", "local_shapes")},
            "kitsune_eager": {k: v for k, v in eager.items() if k not in ("params", "norms", "local_shapes")},
        }
        dist.barrier()
        if rank == 0:
            result["single_gpu_same_shard_shapes"] = single_gpu(args, device, ours["local_shapes"])
            result["sharded_over_single_gpu"] = (
                ours["step_ms_median"] / result["single_gpu_same_shard_shapes"]["step_ms_median"]
            )
        dist.barrier()
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"rank{rank}.json").write_text(json.dumps(result, indent=2))
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        if rank == 0:
            (args.out / "fsdp-check.json").write_text(
                json.dumps({"args": vars(args) | {"out": str(args.out)}, "ranks": gathered}, indent=2)
            )
            for r in gathered:
                k, t = r["kitsune"], r["torch_fused"]
                print(
                    f"rank {r['rank']}: kitsune {k['step_ms_median']:.3f} ms (host {k['host_ms_median']:.3f}), "
                    f"torch fused+clip {t['step_ms_median']:.3f} ms (host {t['host_ms_median']:.3f}); state "
                    f"{k['state_bytes'] / 2**20:.1f} MiB vs {t['state_bytes'] / 2**20:.1f}; peak "
                    f"{k['peak_memory_bytes'] / 2**20:.0f} MiB vs {t['peak_memory_bytes'] / 2**20:.0f}; "
                    f"max |param diff| {r['max_abs_param_diff']:.2e}, grad norm rel diff "
                    f"{r['max_rel_grad_norm_diff']:.2e}; kitsune without the graph "
                    f"{r['kitsune_eager']['step_ms_median']:.3f} ms (host {r['kitsune_eager']['host_ms_median']:.3f})"
                )
            k0 = gathered[0]["kitsune"]
            print(f"graphs: {k0['graphs']}; address checks: {k0['address_checks']}")
            print(f"plan: {gathered[0]['kitsune']['plan']}; grad_pass: {gathered[0]['kitsune']['grad_pass']}")
            single = gathered[0]["single_gpu_same_shard_shapes"]
            print(
                f"one GPU, rank 0's shard shapes: {single['step_ms_median']:.3f} ms; sharded/single "
                f"{gathered[0]['sharded_over_single_gpu']:.2f}x"
            )
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
