"""Checkpoints with an LR scheduler: save mid-run, resume into kitsune or plain torch, and get the same run.

python examples/checkpoint_resume.py --steps 60

A OneCycleLR schedule (warm-up, then cosine annealing of the LR and of AdamW's beta1) drives a KitsuneOptimizer.
The example trains ``--steps`` steps without a break (the reference), then trains the same model again, saves a
checkpoint (model, optimizer and scheduler state dicts) after ``--save-at`` steps, and finishes the run from
that file three ways:

  (a) a fresh KitsuneOptimizer loads kitsune's checkpoint;
  (b) a plain torch.optim.AdamW loads kitsune's checkpoint (torch ignores kitsune's one extra key, "kitsune");
  (c) a plain AdamW run is checkpointed instead, and a fresh KitsuneOptimizer loads torch's checkpoint.

It prints the largest absolute difference of every resumed run's params from the reference. On CPU every update
goes through the wrapped AdamW's own step, so all of them are bit-identical to the reference (and to an
uninterrupted plain-torch run); the example exits with an error if they are not. On CUDA with fusion, the fused
kernel and torch's AdamW round differently, so runs that switch between them agree to rounding instead; kitsune
resumed into kitsune is still bit-identical.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

from kitsune import KitsuneOptimizer
from kitsune.cli import add_device_argument, output_dir, positive_int


def make_batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``: the same on every run, whichever step a run starts from."""
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(64, 16, generator=gen)
    y = torch.tanh(x @ torch.linspace(-0.5, 0.5, 16)).unsqueeze(1)
    return x.to(device), y.to(device)


def build(device: torch.device, use_kitsune: bool, total_steps: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)).to(device)
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    if use_kitsune:
        optimizer = KitsuneOptimizer(optimizer, enable_fusion=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=total_steps, pct_start=0.25)
    return model, optimizer, scheduler


def train(model, optimizer, scheduler, start: int, stop: int, device: torch.device) -> list[float]:
    losses = []
    for step in range(start, stop):
        x, y = make_batch(step, device)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    return losses


def save(path: Path, model, optimizer, scheduler, step: int) -> None:
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    torch.save({**state, "step": step}, path)


def resume(path: Path, device: torch.device, use_kitsune: bool, total_steps: int):
    """Build everything fresh, then load the checkpoint into it: model, optimizer, scheduler, in that order."""
    model, optimizer, scheduler = build(device, use_kitsune, total_steps)
    ckpt = torch.load(path, map_location=device)  # weights_only: the state dicts hold tensors and plain data only
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    return model, optimizer, scheduler, ckpt["step"]


def max_abs_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=200, help="steps of the whole run")
    parser.add_argument("--save-at", type=int, default=None, help="checkpoint after this many steps (default: half)")
    add_device_argument(parser)
    files = output_dir("ckpt-kitsune.pt", "ckpt-torch.pt")  # checked before the run
    parser.add_argument("--out-dir", type=files, default=".", help="where the checkpoints are written")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    total = args.steps
    save_at = total // 2 if args.save_at is None else args.save_at
    if total < 2:
        parser.error(f"--steps must be at least 2 (a save and a resume in between), got {total}")
    if not 0 < save_at < total:
        parser.error(f"--save-at must be between 1 and --steps - 1, got {save_at}")
    args.out_dir.mkdir(parents=True, exist_ok=True)

    # the reference: kitsune, no interruption (and plain torch, for comparison)
    ref_model, ref_opt, ref_sched = build(device, True, total)
    ref_losses = train(ref_model, ref_opt, ref_sched, 0, total, device)
    torch_model, torch_opt, torch_sched = build(device, False, total)
    train(torch_model, torch_opt, torch_sched, 0, total, device)
    print(f"uninterrupted kitsune run, {total} steps: loss {ref_losses[0]:.4f} -> {ref_losses[-1]:.4f}")

    # the interrupted kitsune run: save_at steps, then a checkpoint
    model, optimizer, scheduler = build(device, True, total)
    train(model, optimizer, scheduler, 0, save_at, device)
    kitsune_ckpt = args.out_dir / "ckpt-kitsune.pt"
    save(kitsune_ckpt, model, optimizer, scheduler, save_at)
    print(
        f"saved {kitsune_ckpt} after {save_at} step{'s' * (save_at != 1)} (lr {scheduler.get_last_lr()[0]:.2e}, "
        f"optimizer keys {sorted(optimizer.state_dict())})"
    )

    # the interrupted plain-torch run, checkpointed the same way
    model, optimizer, scheduler = build(device, False, total)
    train(model, optimizer, scheduler, 0, save_at, device)
    torch_ckpt = args.out_dir / "ckpt-torch.pt"
    save(torch_ckpt, model, optimizer, scheduler, save_at)
    print(f"saved {torch_ckpt} after {save_at} step{'s' * (save_at != 1)} (a plain torch.optim.AdamW checkpoint)")

    diffs = {"plain torch, uninterrupted": max_abs_diff(torch_model, ref_model)}
    runs = [
        ("(a) kitsune ckpt -> KitsuneOptimizer", kitsune_ckpt, True),
        ("(b) kitsune ckpt -> torch.optim.AdamW", kitsune_ckpt, False),
        ("(c) torch ckpt -> KitsuneOptimizer", torch_ckpt, True),
    ]
    for name, path, use_kitsune in runs:
        model, optimizer, scheduler, step = resume(path, device, use_kitsune, total)
        if isinstance(optimizer, KitsuneOptimizer) and path == kitsune_ckpt:
            assert optimizer.step_count == save_at, "kitsune's step counter comes back from its checkpoint"
        train(model, optimizer, scheduler, step, total, device)
        assert scheduler.get_last_lr() == ref_sched.get_last_lr(), "the schedule resumed where it stopped"
        diffs[name] = max_abs_diff(model, ref_model)

    print(f"max |param - uninterrupted kitsune param| after {total} steps ({device}):")
    for name, diff in diffs.items():
        verdict = "bit-identical" if diff == 0 else "differs (rounding: kitsune's fused kernel vs torch's AdamW)"
        print(f"  {name:<40} {diff:.3e}  {verdict}")

    if device.type == "cpu" and any(diffs.values()):
        sys.exit("error: on CPU every resumed run must be bit-identical to the uninterrupted one")
    return diffs


if __name__ == "__main__":
    main()
