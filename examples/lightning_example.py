"""PyTorch Lightning: configure_optimizers returns a KitsuneOptimizer and an LR scheduler built on it.

python examples/lightning_example.py --steps 20
python examples/lightning_example.py --steps 200 --device cuda --precision 16-mixed --clip kitsune

The LightningModule's ``configure_optimizers`` wraps its AdamW in a ``KitsuneOptimizer`` (fusion on when the
module is on a GPU: Lightning moves the module to its device before it calls ``configure_optimizers``, so kitsune
plans on the right device) and returns it with a OneCycleLR stepped every batch. ``Trainer.fit`` then drives it
like any torch optimizer: Lightning's closure (forward and backward) runs inside ``optimizer.step(closure)``,
``gradient_clip_val`` clips the grads through the wrapper's ``param_groups``, and with ``--precision 16-mixed``
Lightning's own ``torch.amp.GradScaler`` drives the step (kitsune's ``enable_amp`` stays off: one scaler). On CPU,
where Lightning would turn 16-mixed into bf16-mixed, the example passes a float16 plugin with a CPU GradScaler, so
the GradScaler path runs there too.

``--clip`` picks who clips the grads to norm ``--clip-val`` (default: ``lightning`` with ``32-true``, ``kitsune``
under mixed precision): ``lightning`` (``Trainer(gradient_clip_val=...)``),
``hook`` (the module's ``configure_gradient_clipping``, after ``scaler.unscale_(optimizer)``; GradScaler then tells
kitsune's step that the grads are already unscaled) or ``kitsune`` (``KitsuneOptimizer(..., max_grad_norm=...)``,
inside the step, after kitsune unscales; use it with 16-mixed). Under mixed precision Lightning refuses its own
clipping for an optimizer that unscales inside its step (``_step_supports_amp_scaling``, set by KitsuneOptimizer
as by torch's ``fused=True`` optimizers): ``RuntimeError: The current optimizer, KitsuneOptimizer, does not allow
for gradient clipping ...``; ``hook`` and ``kitsune`` are the ways around it. The plain-AdamW run (see below) clips with
``hook`` when asked to, else with Lightning's ``gradient_clip_val``.

The example checks that kitsune made one step per batch (``optimizer.step_count == trainer.global_step``), that
Lightning's checkpoint holds the optimizer state in torch's layout (it loads into a plain AdamW), and it trains the
same module with the plain AdamW through Lightning alongside: on CPU every update goes through the wrapped AdamW's
own step, so the two runs' params are bit-identical (the example exits with an error if not); on CUDA with fusion
they agree to rounding.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from typing import Any

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from kitsune import KitsuneOptimizer
from kitsune.cli import add_device_argument, output_dir, positive_float, positive_int


class Regressor(L.LightningModule):
    def __init__(self, use_kitsune: bool, total_steps: int, clip: str, clip_val: float) -> None:
        super().__init__()
        self.use_kitsune = use_kitsune
        self.total_steps = total_steps
        self.clip, self.clip_val = clip, clip_val
        self.net = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)
        if self.use_kitsune:
            optimizer = KitsuneOptimizer(
                optimizer,
                enable_fusion=self.device.type == "cuda",
                profile=True,
                max_grad_norm=self.clip_val if self.clip == "kitsune" else None,
            )
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=self.total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        if self.clip != "hook":
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        # Lightning unscales only the grads of optimizers that do not unscale in their step; do it for the others
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
            scaler.unscale_(optimizer)
        if gradient_clip_val:
            torch.nn.utils.clip_grad_norm_(self.parameters(), gradient_clip_val)


def make_loader(n_batches: int) -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n_batches * 64, 32, generator=gen)
    y = torch.tanh(x @ torch.linspace(-0.5, 0.5, 32)).unsqueeze(1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64, shuffle=False)


def fit(use_kitsune: bool, args: argparse.Namespace) -> tuple[Regressor, L.Trainer]:
    L.seed_everything(0, verbose=False)
    module = Regressor(use_kitsune, total_steps=args.steps, clip=args.clip, clip_val=args.clip_val)
    kitsune_clips = use_kitsune and args.clip == "kitsune"
    precision: dict[str, Any] = {"precision": args.precision}
    if args.precision == "16-mixed" and args.device == "cpu":
        precision = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=1,
        gradient_clip_val=None if kitsune_clips else args.clip_val,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.out_dir,
        **precision,
    )
    trainer.fit(module, make_loader(args.steps))
    return module, trainer


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=200)
    add_device_argument(parser, gpu_index=False)
    parser.add_argument("--precision", choices=["32-true", "bf16-mixed", "16-mixed"], default="32-true")
    parser.add_argument(
        "--clip",
        choices=["lightning", "hook", "kitsune"],
        default=None,
        help="who clips (default: lightning with 32-true; kitsune under mixed precision, where Lightning refuses its "
        "own clipping for an optimizer that unscales in its step)",
    )
    parser.add_argument(
        "--clip-val", type=positive_float, default=1.0, help="the global 2-norm the grads are clipped to"
    )
    files = output_dir("lightning.ckpt")  # checked before the run
    parser.add_argument("--out-dir", type=files, default=".", help="where lightning.ckpt is written")
    args = parser.parse_args(argv)
    if args.clip is None:
        args.clip = "lightning" if args.precision == "32-true" else "kitsune"
    if args.clip == "lightning" and args.precision != "32-true":
        parser.error(
            f"--clip lightning works with --precision 32-true only: under {args.precision} Lightning refuses its own "
            "clipping for an optimizer that unscales in its step; use --clip kitsune or --clip hook"
        )
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no "GPU available: ..." banner
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")  # a tiny in-memory data set

    module, trainer = fit(use_kitsune=True, args=args)
    optimizer = trainer.optimizers[0]
    print(f"Lightning's optimizer: {type(optimizer).__name__} wrapping {type(optimizer.base_optimizer).__name__}")
    print(f"kitsune steps {optimizer.step_count}, trainer.global_step {trainer.global_step}")
    lr, loss = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0], trainer.callback_metrics["loss"]
    print(f"lr after {trainer.global_step} OneCycleLR steps: {lr:.3e}, final loss {loss:.4f}")
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None:
        print(f"Lightning's GradScaler drove the step: loss scale now {scaler.get_scale():g}")
    if optimizer.last_grad_norm is not None:
        print(f"kitsune clipped in the step: the last step's grad norm {optimizer.last_grad_norm.item():.4f}")
    if optimizer.step_count != trainer.global_step or trainer.global_step != args.steps:
        sys.exit("kitsune's step count does not match Lightning's")

    ckpt_path = args.out_dir / "lightning.ckpt"
    trainer.save_checkpoint(ckpt_path)
    saved = torch.load(ckpt_path, map_location="cpu", weights_only=False)["optimizer_states"][0]
    torch.optim.AdamW(module.parameters()).load_state_dict(saved)  # torch ignores kitsune's one extra key
    print(f"checkpoint {ckpt_path}: its optimizer state loads into a plain AdamW (kitsune key: {'kitsune' in saved})")

    twin, _ = fit(use_kitsune=False, args=args)
    diff = max((p - q).abs().max().item() for p, q in zip(module.parameters(), twin.parameters(), strict=True))
    same = "bit-identical" if diff == 0 else "fused kernel vs torch's AdamW: rounding"
    print(f"max |param diff| vs the same run with the plain AdamW: {diff:.3e} ({same})")
    if args.device == "cpu" and diff != 0:
        sys.exit("on CPU the wrapped AdamW's own step runs, so the runs must be bit-identical")
    optimizer.print_summary()
    if scaler is None:
        print("note: Lightning runs forward and backward inside optimizer.step(closure): the step times include them")
    return diff


if __name__ == "__main__":
    main()
