"""FSDP2 (``fully_shard``) with a KitsuneOptimizer on every rank: each rank updates only its shards.

torchrun --nproc_per_node=2 examples/fsdp2.py --steps 5
python -m torch.distributed.run --standalone --nproc_per_node=2 examples/fsdp2.py --steps 5 --device cpu

Each rank builds the same model (same seed) and shards every block and the root with ``fully_shard`` over a 1-D
device mesh: each param becomes a DTensor of which this rank holds rows ``Shard(0)``. The optimizer is built over
those DTensor params as usual. On CUDA, kitsune's fused kernel updates each rank's local shards and clips with the
global grad norm (an on-device all-reduce of the ranks' squared sums); on CPU (gloo) the wrapped AdamW's own step
runs, and the plan says why. Either way the optimizer state is DTensors sharded like the params, as torch's own
AdamW keeps it under FSDP2.

At the end every rank gathers the full params (``full_tensor()``) and compares them with rank 0's: the example
exits with an error unless they are identical and moved from their initial values.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from kitsune import KitsuneOptimizer
from kitsune.cli import add_device_argument, positive_int


def say(line: str) -> None:
    sys.stdout.write(line + "\n")  # one write per line (also unbuffered): the ranks share torchrun's stdout
    sys.stdout.flush()


def full_params(model: nn.Module) -> torch.Tensor:
    """Every param gathered from its shards (a collective: every rank calls it)."""
    return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])


def train(args: argparse.Namespace, device: torch.device) -> int:
    """Train on this rank; 0 when every rank ends with the same full params (and they moved), else 1."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    torch.manual_seed(0)  # the same initial params on every rank before sharding
    blocks = [nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(3)]
    model = nn.Sequential(*blocks, nn.Linear(64, 1)).to(device)
    target = nn.Linear(64, 1).to(device).requires_grad_(False)
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    initial = full_params(model).clone()

    optimizer = KitsuneOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01), enable_fusion=True, max_grad_norm=1.0
    )
    fused = sum(b.tensors for b in optimizer.plan.buckets if b.route.fused)
    reasons = "; ".join(sorted({b.reason for b in optimizer.plan.buckets}))
    say(f"rank {rank}/{world}: backend {dist.get_backend()}, device {device}, {fused} shards fused ({reasons})")

    gen = torch.Generator().manual_seed(1000 + rank)  # every rank draws its own batches
    losses = []
    for step in range(args.steps):
        x = torch.randn(32, 64, generator=gen).to(device)
        loss = nn.functional.mse_loss(model(x), target(x))
        loss.backward()  # FSDP2 reduce-scatters the averaged grads: each rank gets its shards' grads
        optimizer.step()  # clips with the global norm over all ranks' shards, then updates this rank's shards
        optimizer.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / world)
        if rank == 0 and (step % max(1, args.steps // 5) == 0 or step == args.steps - 1):
            norm = float(optimizer.last_grad_norm)  # the same global value on every rank
            say(f"step {step:4d}  loss (mean over ranks) {losses[-1]:.4f}  grad norm {norm:.4f}")

    state = optimizer.state_dict()["state"][0]
    kinds = [f"{k} {type(v).__name__}{list(getattr(v, 'placements', []))}" for k, v in sorted(state.items())]
    mine = full_params(model)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    diff = max((g - gathered[0]).abs().max().item() for g in gathered)
    moved = (mine - initial).abs().max().item()
    say(f"rank {rank}: {optimizer.step_count} steps, max |param diff| vs rank 0: {diff:.3e}, moved {moved:.3e}")
    dist.barrier()
    if rank == 0:
        say(f"optimizer state of param 0: {', '.join(kinds)}")
        k = max(1, min(5, args.steps // 4))
        first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
        say(f"loss (mean of {k} step{'s' * (k != 1)}): first {first:.4f} -> last {last:.4f}")
        verdict = "identical" if diff == 0 else "DIFFERENT"
        say(f"full params on all {world} ranks after {args.steps} steps: {verdict} ({mine.numel()} values)")
    return 1 if diff != 0 or moved == 0 else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=100)
    add_device_argument(parser, gpu_index=False)
    args = parser.parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        parser.error("run it with torchrun: torchrun --nproc_per_node=2 examples/fsdp2.py --steps 5")

    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group(backend="gloo")
    try:
        return train(args, device)
    finally:
        # the FSDP2 modules must be gone before the process group: torch 2.13 with gloo otherwise aborts at exit
        # now and then ("terminate called without an active exception")
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
