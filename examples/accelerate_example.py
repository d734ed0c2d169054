"""Hugging Face Accelerate: accelerator.prepare(model, kitsune_optimizer, dataloader, scheduler), with accumulation.

python examples/accelerate_example.py --steps 12
python examples/accelerate_example.py --steps 200 --device cuda --mixed-precision fp16

The model goes to ``accelerator.device`` first and the ``KitsuneOptimizer`` is built on it afterwards: kitsune
plans (fusion buckets, the AMP scaler's device) on the params' device when it is built. ``accelerator.prepare``
then wraps it in Accelerate's ``AcceleratedOptimizer`` (``optimizer.optimizer`` is the KitsuneOptimizer) and the
OneCycleLR in an ``AcceleratedScheduler``. The loop is Accelerate's own: ``accelerator.accumulate(model)`` with
``--accum`` micro-batches per optimizer step, ``accelerator.backward(loss)``, ``accelerator.clip_grad_norm_`` on the
steps that sync, and ``optimizer.step()`` / ``scheduler.step()`` / ``optimizer.zero_grad()`` every micro-batch
(Accelerate makes them no-ops until the grads are accumulated). With ``--mixed-precision fp16`` (CUDA) Accelerate's
own ``torch.amp.GradScaler`` drives kitsune's step; kitsune's ``enable_amp`` stays off: one scaler.

The example checks that kitsune made one step per ``--accum`` micro-batches, that ``accelerator.save_state`` wrote
the optimizer state in torch's layout (it loads into a plain AdamW), and it runs the same loop with the plain AdamW
alongside: on CPU every update goes through the wrapped AdamW's own step, so the two runs' params are
bit-identical (the example exits with an error if not); on CUDA with fusion they agree to rounding.
"""

from __future__ import annotations

import argparse
import sys

import torch
from accelerate import Accelerator
from torch import nn

from kitsune import KitsuneOptimizer
from kitsune.cli import add_device_argument, output_dir, positive_int


def train(use_kitsune: bool, args: argparse.Namespace) -> tuple[Accelerator, nn.Module, object, list[float]]:
    accelerator = Accelerator(
        cpu=args.device == "cpu", gradient_accumulation_steps=args.accum, mixed_precision=args.mixed_precision
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1))
    model.to(accelerator.device)  # before the optimizer is built: kitsune plans on the params' device
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    if use_kitsune:
        optimizer = KitsuneOptimizer(optimizer, enable_fusion=accelerator.device.type == "cuda", profile=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=args.steps)

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.steps * args.accum * 32, 32, generator=gen)
    y = torch.tanh(x @ torch.linspace(-0.5, 0.5, 32)).unsqueeze(1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=False)

    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    losses = []
    for i, (xb, yb) in enumerate(loader):
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        if use_kitsune and (i % max(1, len(loader) // 5) == 0 or i == len(loader) - 1):
            print(f"micro-batch {i:4d}  loss {loss.item():.4f}  lr {scheduler.get_last_lr()[0]:.2e}")
    return accelerator, model, optimizer, losses


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=positive_int, default=200, help="optimizer steps (each of --accum micro-batches)"
    )
    parser.add_argument("--accum", type=positive_int, default=2, help="gradient accumulation steps")
    add_device_argument(parser, gpu_index=False)
    parser.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default="no")
    files = output_dir("accelerate-state/optimizer.bin")  # checked before the run
    parser.add_argument("--out-dir", type=files, default=".", help="where accelerate-state/ is written")
    args = parser.parse_args(argv)

    accelerator, model, optimizer, losses = train(use_kitsune=True, args=args)
    kitsune_opt = optimizer.optimizer
    print(f"prepared optimizer: {type(optimizer).__name__} around {type(kitsune_opt).__name__}")
    print(f"micro-batches {len(losses)}, accumulation {args.accum}, kitsune steps {kitsune_opt.step_count}")
    k = max(1, min(5, len(losses) // 4))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    print(f"loss (mean of {k} micro-batch{'es' * (k != 1)}): first {first:.4f} -> last {last:.4f}")
    if kitsune_opt.step_count != args.steps:
        sys.exit(f"kitsune made {kitsune_opt.step_count} steps, expected {args.steps}")

    state_dir = args.out_dir / "accelerate-state"
    accelerator.save_state(state_dir)
    saved = torch.load(state_dir / "optimizer.bin", map_location="cpu", weights_only=False)
    torch.optim.AdamW(model.parameters()).load_state_dict(saved)  # torch ignores kitsune's one extra key
    print(f"{state_dir}/optimizer.bin loads into a plain AdamW (kitsune key: {'kitsune' in saved})")

    _, twin, _, _ = train(use_kitsune=False, args=args)
    diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), twin.parameters(), strict=True))
    same = "bit-identical" if diff == 0 else "fused kernel vs torch's AdamW: rounding"
    print(f"max |param diff| vs the same loop with the plain AdamW: {diff:.3e} ({same})")
    if args.device == "cpu" and diff != 0:
        sys.exit("on CPU the wrapped AdamW's own step runs, so the runs must be bit-identical")
    kitsune_opt.print_summary()
    return diff


if __name__ == "__main__":
    main()
