"""Lion (kitsune.optim.Lion) wrapped in KitsuneOptimizer with fusion on: the plan, then the training loss.

python examples/lion.py --steps 100

``kitsune.optim.Lion`` is a torch.optim-style optimizer (sign of an interpolated momentum, decoupled weight
decay; one state tensor per param). Wrapped with ``enable_fusion=True``, the fusion planner runs it on CUDA as one
multi-tensor Triton launch per bucket; ``optimizer.plan`` shows which params go where and why.

On CPU the fused kernels do not run (they need CUDA; CI runs them on CPU through TRITON_INTERPRET=1 only): the
plan shows every param on the wrapped Lion's own step with that reason, kitsune warns once that fusion was asked
for but is inactive, and the results are bit-identical to the unwrapped Lion (the example trains one alongside
and prints the largest param difference).
"""

from __future__ import annotations

import argparse
import copy

import rich
import torch
from torch import nn

from kitsune import KitsuneOptimizer
from kitsune.cli import add_device_argument, positive_int
from kitsune.optim import Lion


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=200)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    device = torch.device(args.device)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1)).to(device)
    target = nn.Linear(32, 1).to(device).requires_grad_(False)
    twin = copy.deepcopy(model)  # trained alongside with the plain, unwrapped Lion, for comparison

    # Lion's update has unit size per element: its lr is typically 3-10x smaller than AdamW's
    lr = 1e-3
    optimizer = KitsuneOptimizer(Lion(model.parameters(), lr=lr, weight_decay=0.1), enable_fusion=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    plain = Lion(twin.parameters(), lr=lr, weight_decay=0.1)
    plain_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(plain, T_max=args.steps)

    fusion = next(s for s in optimizer.subsystems if s.name == "fusion")
    print(f"fusion subsystem: {'active' if fusion.active else 'inactive'}; the plan:")
    plan = optimizer.plan
    rich.print(plan)
    for b in plan.buckets:  # the table wraps long reasons in a narrow terminal; here they are in full
        print(f"  {b.optimizer} {b.dtype} {b.device}: {b.tensors} tensors -> {b.route.value}: {b.reason}")
    print(
        f"fused tensors {plan.fused_tensors}, fallback tensors {plan.fallback_tensors}, launches/step {plan.launches}"
    )

    losses = []
    for step in range(args.steps):
        x = torch.randn(128, 32, device=device)
        loss = nn.functional.mse_loss(model(x), target(x))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        nn.functional.mse_loss(twin(x), target(x)).backward()
        plain.step()
        plain.zero_grad()
        plain_scheduler.step()
        losses.append(loss.item())
        if step % max(1, args.steps // 5) == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  lr {scheduler.get_last_lr()[0]:.2e}")

    k = max(1, min(5, args.steps // 4))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    print(f"loss (mean of {k} step{'s' * (k != 1)}): first {first:.4f} -> last {last:.4f}")
    diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), twin.parameters(), strict=True))
    # on CUDA the fused kernel rounds differently, and sign() turns a rounding difference near 0 into a whole step
    same = "bit-identical" if diff == 0 else f"fused vs eager rounding, turned by sign() into steps of lr={lr:g}"
    print(f"max |param diff| vs the unwrapped Lion: {diff:.3e} ({same})")
    print(optimizer)
    return last


if __name__ == "__main__":
    main()
