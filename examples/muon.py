"""kitsune.optim.Muon on a small transformer, wrapped in KitsuneOptimizer with fusion on: the plan, training, summary.

python examples/muon.py --steps 100

Muon orthogonalises the update of each hidden weight matrix (attention and MLP weights); the embedding, the output
head, biases and norm weights go to a ``use_muon=False`` group that runs AdamW. Wrapped with ``enable_fusion=True``
on a GPU, the fusion planner runs the Muon groups on its ``triton_matmul`` route (momentum and weight decay in two
multi-tensor Triton launches, one batched Newton-Schulz call per matrix shape) and the AdamW group on its fused
AdamW kernel; ``optimizer.plan`` shows which params go where and why.

On CPU the fused kernels do not run (they need CUDA; CI runs them on CPU through TRITON_INTERPRET=1 only): the plan
shows every param on the wrapped Muon's own step with that reason, kitsune warns once that fusion was asked for but
is inactive, and the results are bit-identical to the unwrapped Muon (the example trains one alongside and prints
the largest param difference).
"""

from __future__ import annotations

import argparse
import copy

import rich
import torch
from torch import nn

from kitsune import KitsuneOptimizer
from kitsune.cli import add_device_argument, positive_int
from kitsune.optim import Muon

VOCAB, DIM, SEQ = 32, 64, 16


class TinyLM(nn.Module):
    """Token embedding, two pre-norm transformer layers, a linear head: next-token logits."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        layer = nn.TransformerEncoderLayer(DIM, 4, 2 * DIM, dropout=0.0, batch_first=True, norm_first=True)
        self.layers = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.layers(x, mask=self.mask, is_causal=True))


def param_groups(model: nn.Module, adamw_lr: float) -> list[dict]:
    """Hidden weight matrices to Muon; the embedding, the head and every vector to AdamW."""
    hidden = [p for n, p in model.named_parameters() if p.ndim >= 2 and n.startswith("layers.")]
    others = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and n.startswith("layers."))]
    return [
        {"params": hidden, "use_muon": True},
        {"params": others, "use_muon": False, "lr": adamw_lr, "betas": (0.9, 0.95), "weight_decay": 0.0},
    ]


def batch(device: torch.device, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences that count up from a random start (mod VOCAB), jumping by a random amount at one token in ten:
    the next token is predictable from the last except after a jump. The jumps keep the loss away from zero, where
    the grads would shrink into float32's denormal range, which CPUs compute many times slower."""
    start = torch.randint(0, VOCAB, (size, 1), device=device)
    jumps = torch.randint(0, VOCAB, (size, SEQ + 1), device=device) * (torch.rand(size, SEQ + 1, device=device) < 0.1)
    seq = (start + torch.arange(SEQ + 1, device=device) + jumps.cumsum(1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=100)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    device = torch.device(args.device)

    torch.manual_seed(0)
    model = TinyLM().to(device)
    twin = copy.deepcopy(model)  # trained alongside with the plain, unwrapped Muon, for comparison

    muon_kwargs = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01}
    optimizer = KitsuneOptimizer(Muon(param_groups(model, 3e-3), **muon_kwargs), enable_fusion=True, profile=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    plain = Muon(param_groups(twin, 3e-3), **muon_kwargs)
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
        tokens, targets = batch(device)
        for net, opt, sched in ((model, optimizer, scheduler), (twin, plain, plain_scheduler)):
            loss = nn.functional.cross_entropy(net(tokens).flatten(0, 1), targets.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            if net is model:
                losses.append(loss.item())
        if step % max(1, args.steps // 5) == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {losses[-1]:.4f}  lr {scheduler.get_last_lr()[0]:.2e}")

    k = max(1, min(5, args.steps // 4))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    print(f"loss (mean of {k} step{'s' * (k != 1)}): first {first:.4f} -> last {last:.4f}")
    diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), twin.parameters(), strict=True))
    # on CUDA the fused kernels round in another order; AdamW then turns rounding-level grads (the attention's key
    # biases get exactly zero in exact arithmetic) into steps of about its lr
    same = "bit-identical" if diff == 0 else "fused vs eager rounding, amplified by AdamW on noise-level grads"
    print(f"max |param diff| vs the unwrapped Muon: {diff:.3e} ({same})")
    optimizer.print_summary()
    return last


if __name__ == "__main__":
    main()
