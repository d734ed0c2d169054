"""The one-line wrap on a small regression model, with a scheduler, a summary and a saved profile.

python examples/basic.py --steps 50
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from kitsune import KitsuneOptimizer
from kitsune.cli import output_file, positive_int


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=200)
    parser.add_argument("--profile-out", default="basic-profile.json", type=output_file)  # checked before the run
    args = parser.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 1)).to(device)
    target = nn.Linear(64, 1).to(device)

    optimizer = KitsuneOptimizer(
        torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01),
        enable_fusion=device == "cuda",
        profile=True,
    )
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)

    for step in range(args.steps):
        x = torch.randn(128, 64, device=device)
        loss = nn.functional.mse_loss(model(x), target(x).detach())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if step % max(1, args.steps // 5) == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}  lr {scheduler.get_last_lr()[0]:.2e}")

    optimizer.print_summary()
    print("profile:", optimizer.save_profile(args.profile_out))
    return loss.item()


if __name__ == "__main__":
    main()
