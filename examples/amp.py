"""Mixed precision with kitsune: ``optimizer.autocast()`` for the forward, ``optimizer.backward(loss)`` for the rest.

python examples/amp.py --steps 100 --dtype float16
python examples/amp.py --steps 100 --dtype bfloat16
python examples/amp.py --steps 100 --dtype float16 --overflow-at 50   # watch one step being skipped

The loop is the one documented in docs/amp.md and works unchanged for both dtypes:

    with optimizer.autocast():
        loss = loss_fn(model(x), y)
    optimizer.backward(loss)    # float16: multiplies the loss by the current loss scale first
    optimizer.step()            # float16: unscales, checks inf/nan, skips the update on overflow, updates the scale
    optimizer.zero_grad()

float16 gets a dynamic loss scaler held on the params' device (the same scale trajectory as torch.amp.GradScaler);
bfloat16 has float32's range, so it gets autocast only. ``--overflow-at N`` multiplies the loss by inf at step N
(a stand-in for a real float16 overflow) to show the step being skipped and the scale backing off.

On CPU, AMP is active too: autocast runs through ``torch.autocast("cpu", dtype)`` and the loss scaler's tensors
live on the CPU. The update itself runs through the wrapped AdamW's own step (fused kernels need CUDA); with
float16 that step can only be skipped from the host, so kitsune reads the inf/nan flag once per step, counted in
``optimizer.host_syncs`` (as GradScaler.step does). Low-precision matmuls on a CPU are rarely faster than float32,
so there the example shows the mechanics, not a speedup.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from kitsune import AMPConfig, KitsuneOptimizer
from kitsune.cli import add_device_argument, positive_int


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=200)
    add_device_argument(parser)
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    parser.add_argument("--overflow-at", type=int, default=None, metavar="STEP", help="inject an inf loss (float16)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.overflow_at is not None and dtype != torch.float16:
        parser.error("--overflow-at needs --dtype float16: bfloat16 has no loss scaler to skip the step")
    if args.overflow_at is not None and not 0 <= args.overflow_at < args.steps:
        parser.error(
            f"argument --overflow-at: {args.overflow_at} is not a step of this run: take one from 0 to {args.steps - 1}"
        )

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1)).to(device)
    target = nn.Linear(32, 1).to(device).requires_grad_(False)

    optimizer = KitsuneOptimizer(
        torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01),
        enable_amp=True,
        amp_config=AMPConfig(dtype=dtype),
        enable_fusion=device.type == "cuda",
        profile=True,
    )

    print(f"device {device}, autocast dtype {args.dtype}")
    if dtype == torch.float16:
        print(f"float16: dynamic loss scaling on {device}, initial scale {optimizer.loss_scale:g}")
    else:
        print("bfloat16: autocast only (float32's range, no loss scaler; loss scale stays 1)")
    if device.type == "cpu":
        print(
            "on CPU: autocast runs via torch.autocast('cpu'), the scaler's tensors live on the CPU, and every update "
            "goes through the wrapped AdamW's own step (fused kernels need CUDA)"
            + (", so kitsune reads the inf/nan flag on the host once per step" if dtype == torch.float16 else "")
        )

    losses = []
    for step in range(args.steps):
        x = torch.randn(128, 32, device=device)
        y = target(x)
        with optimizer.autocast():
            pred = model(x)  # the linear layers run in the AMP dtype
            loss = nn.functional.mse_loss(pred.float(), y)
        if step == 0:
            print(f"forward output dtype {pred.dtype}, loss dtype {loss.dtype}")
        if step == args.overflow_at:
            before = [p.detach().clone() for p in model.parameters()]
            scale_before = optimizer.loss_scale
            optimizer.backward(loss * float("inf"))  # every grad becomes inf/nan
        else:
            optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step == args.overflow_at:
            untouched = all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
            print(
                f"step {step:4d}  inf/nan grads: update skipped (params unchanged: {untouched}), "
                f"loss scale {scale_before:g} -> {optimizer.loss_scale:g}"
            )
        elif step % max(1, args.steps // 5) == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  loss scale {optimizer.loss_scale:g}")

    k = max(1, min(5, args.steps // 4))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    print(f"loss (mean of {k} step{'s' * (k != 1)}): first {first:.4f} -> last {last:.4f}")
    print(
        f"loss scale {optimizer.loss_scale:g}, skipped steps {optimizer.skipped_steps}, "
        f"host syncs in step() {optimizer.host_syncs}"
    )
    if optimizer.host_syncs:
        print(
            f"  kitsune read the inf/nan flag on the host in {optimizer.host_syncs} of {args.steps} steps: their "
            "updates ran where a device-side skip is not possible (docs/amp.md, 'Host syncs')"
        )
    optimizer.print_summary()
    return last


if __name__ == "__main__":
    main()
