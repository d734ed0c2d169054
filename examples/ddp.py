"""DistributedDataParallel with a KitsuneOptimizer on every rank; at the end, every rank holds the same params.

torchrun --nproc_per_node=2 examples/ddp.py --steps 5
python -m torch.distributed.run --standalone --nproc_per_node=2 examples/ddp.py --steps 5

Each rank builds the same model (same seed), wraps it in ``torch.nn.parallel.DistributedDataParallel``, and wraps
its own ``torch.optim.AdamW`` over the DDP module's params in a ``KitsuneOptimizer``: nothing about the optimizer
is distributed. Every rank trains on its own batches; DDP all-reduces (averages) the grads during
``loss.backward()``, so every rank's ``optimizer.step()`` sees the same grads and makes the same update. The
backend is gloo on CPU and nccl on CUDA (one GPU per rank, ``cuda:LOCAL_RANK``), where fusion runs the update in
kitsune's Triton kernels; the fused kernel is deterministic, so the ranks still agree bit for bit.

At the end every rank gathers all ranks' params and compares them with rank 0's: the example exits with an error
unless they are identical, and unless the params moved from their initial values.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from kitsune import KitsuneOptimizer
from kitsune.cli import add_device_argument, positive_int


def say(line: str) -> None:
    sys.stdout.write(line + "\n")  # one write per line (also unbuffered): the ranks share torchrun's stdout
    sys.stdout.flush()


def flat_params(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def train(args: argparse.Namespace, device: torch.device, local_rank: int) -> int:
    """Train on this rank; 0 when every rank ends with the same params (and they moved), else 1."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial params on every rank (DDP also broadcasts rank 0's at wrap time)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 1)).to(device)
    target = nn.Linear(32, 1).to(device).requires_grad_(False)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    initial = flat_params(model).clone()

    optimizer = KitsuneOptimizer(
        torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.01),
        enable_fusion=device.type == "cuda",
    )
    active = ", ".join(s.name for s in optimizer.subsystems if s.active) or "none (the wrapped AdamW's own step)"
    say(f"rank {rank}/{world}: backend {dist.get_backend()}, device {device}, kitsune subsystems active: {active}")

    gen = torch.Generator().manual_seed(1000 + rank)  # every rank draws its own batches
    losses = []
    for step in range(args.steps):
        x = torch.randn(64, 32, generator=gen).to(device)
        loss = nn.functional.mse_loss(ddp(x), target(x))
        loss.backward()  # DDP averages the grads over the ranks here
        optimizer.step()
        optimizer.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / world)
        if rank == 0 and (step % max(1, args.steps // 5) == 0 or step == args.steps - 1):
            say(f"step {step:4d}  loss (mean over ranks) {losses[-1]:.4f}")

    mine = flat_params(model)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    diff = max((g - gathered[0]).abs().max().item() for g in gathered)
    moved = (mine - initial).abs().max().item()
    say(f"rank {rank}: {optimizer.step_count} steps, max |param diff| vs rank 0: {diff:.3e}, moved {moved:.3e}")
    dist.barrier()
    if rank == 0:
        k = max(1, min(5, args.steps // 4))
        first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
        say(f"loss (mean of {k} step{'s' * (k != 1)}): first {first:.4f} -> last {last:.4f}")
        verdict = "identical" if diff == 0 else "DIFFERENT"
        say(f"params on all {world} ranks after {args.steps} steps: {verdict} ({mine.numel()} values)")
    return 1 if diff != 0 or moved == 0 else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=100)
    add_device_argument(parser, gpu_index=False)
    args = parser.parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        parser.error("run it with torchrun: torchrun --nproc_per_node=2 examples/ddp.py --steps 5")

    local_rank = int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if device.type == "cuda":
        dist.init_process_group(backend="nccl", device_id=device)
    else:
        dist.init_process_group(backend="gloo")
    try:
        return train(args, device, local_rank)
    finally:
        # the DDP module (its reducer) must be gone before the process group: torch 2.13 with gloo otherwise
        # aborts at exit now and then ("terminate called without an active exception")
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
