"""Sharded optimizer state on several GPUs: step time and memory per rank against one GPU.

torchrun --nproc_per_node=2 benchmarks/dist-bench.py --out dist-bench.json
torchrun --nproc_per_node=2 benchmarks/dist-bench.py --out /tmp/d.json --device cpu --scale 0.001 --steps 3  # dry run

Two measurements, each on kitsune's parameter sets (``--sets``, default GPT-2 124M and the 1.2B Llama-style set):

* optimizer phase: fused AdamW (with ``max_grad_norm=1``) on params whose grads are filled in place, so every
  collective runs in ``step()``: ``one_gpu`` is rank 0 alone over the whole set; ``same_shard`` each rank alone over
  plain tensors shaped as what it updates under ZeRO-2 (its whole params and its pieces of the split ones: the update
  a sharded step runs); ``ddp`` an all-reduce of the grads then the
  whole fused step (what a DDP model's optimizer does); ``zero1``/``zero2`` the sharded step (reduction, update,
  all-gather). Per rank: median ms per step, peak memory, optimizer state bytes.
* training step (``--train``): an MLP stack of the set's hidden size trained with forward, backward and step, DDP
  against ZeRO stages 1 and 2 (reductions overlapping backward), with the params' all-gather in the step and left
  to the next forward (``zero1_fwd``, ``zero2_fwd``: ``ShardConfig(gather_in_forward=True)``); ms per step over
  steps run back to back; each run's final params compared with DDP's.

Rank 0 writes every rank's numbers as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from kitsune import KitsuneOptimizer, ShardConfig
from kitsune.bench.params import ParamSet, get_param_set, make_params
from kitsune.distributed import state_numel


def timed(fn: Callable[[], None], steps: int, warmup: int, device: torch.device) -> float:
    """Median ms of ``fn`` over ``steps`` calls after ``warmup``; every rank starts each call together."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def timed_back_to_back(fn: Callable[[], None], steps: int, warmup: int, device: torch.device) -> float:
    """ms per call of ``fn`` over ``steps`` calls made back to back (no sync between them, as a training loop runs:
    work a call leaves on a side stream overlaps the next call), every rank starting together."""
    for _ in range(warmup):
        fn()
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3 / steps


def reset_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def adamw(params: list[torch.Tensor], device: torch.device, **kwargs: Any) -> KitsuneOptimizer:
    base = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
    return KitsuneOptimizer(base, enable_fusion=device.type == "cuda", max_grad_norm=1.0, **kwargs)


def optimizer_phase(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    rank = dist.get_rank()
    pset = get_param_set(name, args.scale)
    out: dict[str, Any] = {"set": pset.description, "elements": pset.n_elements, "tensors": pset.n_tensors}

    def run(label: str, params: list[torch.Tensor], opt: KitsuneOptimizer | None, pre: Callable[[], None]) -> None:
        grads = [p.grad for p in params]

        def step() -> None:
            for p, g in zip(params, grads, strict=True):
                p.grad = g  # a sharded step frees or swaps grads; every step starts from the same grads
            pre()
            if opt is not None:
                opt.step()

        ms = timed(step, args.steps, args.warmup, device)
        out[label] = {"ms": ms, "peak_bytes": peak_memory(device), "state_numel": state_numel(opt) if opt else 0}

    for label, stage in (("zero1", 1), ("zero2", 2)):
        reset_memory(device)
        params = make_params(pset, device)
        opt = adamw(params, device, zero_stage=stage)
        run(label, params, opt, lambda: None)
        if stage == 2:  # the same update alone, on plain tensors of what this rank updates (whole params, pieces)
            shard = next(s for s in opt.subsystems if s.name == "shard")
            shapes = tuple(
                (f"t{i}", tuple(t.shape)) for i, t in enumerate(t for b in shard.buckets for t in b.targets.values())
            )
            out[label]["elements_owned"] = shard.report()["elements_owned"]
            out[label]["report"] = shard.report()
            del opt
            reset_memory(device)
            mine = make_params(ParamSet("same_shard", "this rank's share", shapes, 0), device)
            run("same_shard", mine, adamw(mine, device), lambda: None)
        del params

    reset_memory(device)
    params = make_params(pset, device)
    grads = [p.grad for p in params]
    world = dist.get_world_size()

    def all_reduce() -> None:  # DDP's work: the grads averaged through one flat buffer
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(world)
        dist.all_reduce(flat)
        torch._foreach_copy_(
            grads, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]), grads, strict=True)]
        )

    run("ddp", params, adamw(params, device), all_reduce)
    del params
    if rank == 0:
        reset_memory(device)
        params = make_params(pset, device)
        single = adamw(params, device)
        grads = [p.grad for p in params]

        def step() -> None:
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            single.step()

        for _ in range(args.warmup):
            step()
        times = []
        for _ in range(args.steps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - start) * 1e3)
        out["one_gpu"] = {
            "ms": statistics.median(times),
            "peak_bytes": peak_memory(device),
            "state_numel": state_numel(single),
        }
        del params, single
    dist.barrier()
    return out


def training_step(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    hidden = {"gpt2": 768, "llama1b": 2048, "many": 256}.get(name, 1024)
    hidden = max(8, int(hidden * args.scale**0.5))
    out: dict[str, Any] = {"hidden": hidden, "layers": args.layers, "batch": args.batch}
    gen = torch.Generator(device=device).manual_seed(dist.get_rank())
    x = torch.randn(args.batch, hidden, device=device, generator=gen)

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        layers = [
            m
            for _ in range(args.layers)
            for m in (torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden))
        ]
        return torch.nn.Sequential(*layers).to(device)

    runs = (("ddp", 0, False), ("zero1", 1, False), ("zero2", 2, False), ("zero1_fwd", 1, True), ("zero2_fwd", 2, True))
    for label, stage, in_forward in runs:
        reset_memory(device)
        net = model()
        if stage == 0:
            ids = [device.index] if device.type == "cuda" else None
            net = torch.nn.parallel.DistributedDataParallel(net, device_ids=ids)
        shard = {"shard_config": ShardConfig(stage=stage, gather_in_forward=in_forward)} if stage else {}
        opt = adamw(list(net.parameters()), device, **shard)

        def step(net: torch.nn.Module = net, opt: KitsuneOptimizer = opt) -> None:
            net(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

        ms = timed_back_to_back(step, args.steps, args.warmup, device)
        out[label] = {"ms": ms, "peak_bytes": peak_memory(device), "state_numel": state_numel(opt)}
        # every run starts from the same weights and takes the same steps on the same batches: the params must agree
        opt.wait_params()  # gather_in_forward: the last step's gathers, which no forward completed
        final = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        if stage == 0:
            ddp_params = final
        else:
            out[label]["max_abs_diff_vs_ddp"] = float((final - ddp_params).abs().max())
        shard = next(s for s in opt.subsystems if s.name == "shard")
        if shard.active:
            out[label]["report"] = shard.report()
        del net, opt, final
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes")
    parser.add_argument("--sets", default="gpt2,llama1b")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--scale", type=float, default=1.0, help="shrink every set (for a CPU dry run)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--train", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4096)
    args = parser.parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        parser.error("run it with torchrun: torchrun --nproc_per_node=2 benchmarks/dist-bench.py --out dist-bench.json")
    local_rank = int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        args.batch = min(args.batch, 64)
        dist.init_process_group("gloo")
    try:
        mine: dict[str, Any] = {"rank": dist.get_rank(), "device": str(device)}
        if device.type == "cuda":
            mine["gpu"] = torch.cuda.get_device_name(device)
        for name in args.sets.split(","):
            mine[f"optimizer_phase/{name}"] = optimizer_phase(name, args, device)
            if args.train:
                mine[f"training_step/{name}"] = training_step(name, args, device)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if dist.get_rank() == 0:
            result = {
                "world_size": dist.get_world_size(),
                "backend": dist.get_backend(),
                "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d", time.gmtime()),
                "args": vars(args),
                "ranks": everyone,
            }
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
            sys.stdout.write(json.dumps(result, indent=2) + "\n")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
