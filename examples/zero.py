"""Sharded optimizer state (ZeRO stage 1 or 2): each rank keeps and updates the AdamW state of its own params only.

torchrun --nproc_per_node=2 examples/zero.py --steps 5 --device cpu
torchrun --nproc_per_node=2 examples/zero.py --steps 100 --stage 1

Every rank builds the same model (no DDP wrapper: the KitsuneOptimizer averages the grads itself) and wraps its
``torch.optim.AdamW`` with ``zero_stage=2`` (``--stage``): the grads are reduce-scattered during backward, each
rank updates the params it owns (its share is about half of the model's elements on 2 ranks), clipping to
``max_grad_norm`` with the norm of every rank's grads, and the new params are all-gathered at the end of the step.
The backend is gloo on CPU and nccl on CUDA (one GPU per rank), where fusion runs the update in kitsune's kernels.

At the end the example gathers every rank's params and compares them with rank 0's, prints each rank's share of
the optimizer state, and has rank 0 load the consolidated state dict into a plain ``torch.optim.AdamW`` over the
whole model. It exits with an error unless the params are identical on every rank and moved, each rank holds
less than the whole state, and the consolidated state covers every param.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from kitsune import KitsuneOptimizer
from kitsune.cli import add_device_argument, positive_int
from kitsune.distributed import consolidated_state_dict


def say(line: str) -> None:
    sys.stdout.write(line + "\n")  # one write per line (also unbuffered): the ranks share torchrun's stdout
    sys.stdout.flush()


def state_numel(optimizer: torch.optim.Optimizer) -> int:
    return sum(v.numel() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())


def train(args: argparse.Namespace, device: torch.device) -> int:
    """Train on this rank; 0 when every check passes, else 1."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial params on every rank (the optimizer also broadcasts rank 0's)
    # whole params are dealt to the ranks, so several layers of similar size split evenly
    sizes = [(32, 128), (128, 128), (128, 128), (128, 128), (128, 128), (128, 1)]
    model = nn.Sequential(*[m for s in sizes for m in (nn.Linear(*s), nn.GELU())][:-1]).to(device)
    target = nn.Linear(32, 1).to(device).requires_grad_(False)
    initial = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()

    optimizer = KitsuneOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01),
        enable_fusion=device.type == "cuda",
        zero_stage=args.stage,
        max_grad_norm=1.0,
    )
    active = ", ".join(s.name for s in optimizer.subsystems if s.active) or "none"
    say(f"rank {rank}/{world}: backend {dist.get_backend()}, device {device}, kitsune subsystems active: {active}")

    gen = torch.Generator().manual_seed(1000 + rank)  # every rank draws its own batches
    losses = []
    for step in range(args.steps):
        x = torch.randn(64, 32, generator=gen).to(device)
        loss = nn.functional.mse_loss(model(x), target(x))
        loss.backward()  # the grads are reduced across the ranks, bucket by bucket, during backward
        optimizer.step()  # this rank's params updated, then every param all-gathered
        optimizer.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / world)
        if rank == 0 and (step % max(1, args.steps // 5) == 0 or step == args.steps - 1):
            say(f"step {step:4d}  loss (mean over ranks) {losses[-1]:.4f}")

    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    diff = max((g - gathered[0]).abs().max().item() for g in gathered)
    moved = (mine - initial).abs().max().item()
    share = state_numel(optimizer)
    total = 2 * mine.numel()  # AdamW: exp_avg and exp_avg_sq per element
    say(
        f"rank {rank}: {optimizer.step_count} steps, max |param diff| vs rank 0: {diff:.3e}, moved {moved:.3e}, "
        f"optimizer state {share} of {total} elements ({share / total:.0%})"
    )
    full = consolidated_state_dict(optimizer, to=0)  # a collective: every rank calls it, rank 0 gets it
    ok = diff == 0 and moved > 0 and share < total
    if rank == 0:
        k = max(1, min(5, args.steps // 4))
        first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
        say(f"loss (mean of {k} step{'s' * (k != 1)}): first {first:.4f} -> last {last:.4f}")
        verdict = "identical" if diff == 0 else "DIFFERENT"
        say(f"params on all {world} ranks after {args.steps} steps: {verdict} ({mine.numel()} values)")
        plain = torch.optim.AdamW(nn.Sequential(*(nn.Linear(*s) for s in sizes)).parameters())
        plain.load_state_dict(full)
        covered = state_numel(plain)
        say(f"consolidated state dict: {len(full['state'])} params, {covered} elements, loaded into torch.optim.AdamW")
        ok = ok and covered == total
    dist.barrier()
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=100)
    parser.add_argument("--stage", type=int, choices=[1, 2], default=2)
    add_device_argument(parser, gpu_index=False)
    args = parser.parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        parser.error("run it with torchrun: torchrun --nproc_per_node=2 examples/zero.py --steps 5")
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:  # one rank holds the whole state: there is nothing to shard
        parser.error("ZeRO shards the state over 2 or more ranks: torchrun --nproc_per_node=2 examples/zero.py")

    local_rank = int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group(backend="gloo")
    try:
        return train(args, device)
    finally:
        # the model and the sharded optimizer (its buckets, hooks and collectives' work) must be gone before the
        # process group, as in ddp.py and fsdp2.py: torch 2.13 with gloo otherwise aborts at exit now and then
        # ("terminate called without an active exception"; seen once in the test suite)
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
