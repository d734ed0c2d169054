"""Does low-precision state train as well? The same GPT, data and init through AdamW with each state precision.

`run_quality` trains a GPT-2-shaped model (`kitsune.bench.e2e.GPT`) on a synthetic next-token task (a fixed random
permutation of 256 tokens, followed with probability 0.9: learnable, and cheap to make on the device) once per
``FusionConfig.state_precision``, from the same init and batches, and reports each run's final loss (the mean of the
last steps) against fp32 state's. ``benchmarks/lowp-quality.py`` runs it at GPT-2 small on a GPU; the test suite at
a tiny size in Triton's interpreter.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Literal

import torch
from pydantic import BaseModel

from kitsune.bench.e2e import GPT, GPTConfig
from kitsune.bench.peers import state_bytes
from kitsune.config import FusionConfig, KitsuneConfig
from kitsune.optimizer import KitsuneOptimizer

RUNS: dict[str, tuple[str, torch.dtype, str]] = {
    "param": ("param", torch.float32, "nearest"),
    "param-again": ("param", torch.float32, "nearest"),
    "bf16": ("bf16", torch.float32, "nearest"),
    "8bit": ("8bit", torch.float32, "nearest"),
    "bf16-params": ("param", torch.bfloat16, "stochastic"),
    "bf16-params-nearest": ("param", torch.bfloat16, "nearest"),
    "bf16-params-kahan": ("param", torch.bfloat16, "kahan"),
    "bf16-params-kahan-fp32-state": ("fp32", torch.bfloat16, "kahan"),
}
"""What each run of `run_quality` trains: ``(state_precision, the params' dtype, param_rounding)``. ``param`` is fp32
params with fp32 state (the reference); ``param-again`` the same run once more: its difference from ``param`` is the
run's own noise (none where the device's kernels are deterministic, as on the GPUs measured), so a precision's
difference is not mistaken for it; ``bf16-params`` trains bf16 params (and bf16 state) without fp32 master weights,
stored with stochastic rounding; ``bf16-params-nearest`` the same rounded to nearest, as torch; ``bf16-params-kahan``
the same with Kahan compensation, ``bf16-params-kahan-fp32-state`` with fp32 state."""


class QualityRun(BaseModel):
    precision: str
    final_loss: float
    """The mean loss of the last ``tail`` steps."""
    first_loss: float
    losses: list[float]
    state_bytes: int
    seconds: float
    state_formats: list[str]
    """The plan's state formats (``"8-bit"``, ``"bfloat16"``, ``"float32"``), so a run that fell back shows it."""


class QualityResult(BaseModel):
    device: str
    model: GPTConfig
    steps: int
    batch: int
    seq: int
    lr: float
    warmup: int = 0
    schedule: Literal["constant", "cosine"] = "constant"
    runs: list[QualityRun]

    def relative(self, precision: str, baseline: str = "param") -> float:
        """``final_loss(precision) / final_loss(baseline) - 1``."""
        runs = {r.precision: r for r in self.runs}
        return runs[precision].final_loss / runs[baseline].final_loss - 1.0


ACTIVE_TOKENS = 256
"""The task draws its tokens from the first this many of the vocabulary: a few hundred steps learn it to its plateau,
so the runs are compared where the loss has settled, not mid-descent where a step's head start shows as a gap."""


def batches(
    steps: int, batch: int, seq: int, vocab: int, device: torch.device, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token streams over the first `ACTIVE_TOKENS` tokens that follow a fixed random permutation with probability
    0.9 (else a uniform token)."""
    vocab = min(vocab, ACTIVE_TOKENS)
    gen = torch.Generator(device=device).manual_seed(seed)
    perm = torch.randperm(vocab, generator=gen, device=device)
    out = []
    for _ in range(steps):
        seqs = torch.empty(batch, seq + 1, dtype=torch.long, device=device)
        seqs[:, 0] = torch.randint(vocab, (batch,), generator=gen, device=device)
        noise = torch.randint(vocab, (batch, seq), generator=gen, device=device)
        keep = torch.rand(batch, seq, generator=gen, device=device) < 0.9
        for t in range(seq):
            seqs[:, t + 1] = torch.where(keep[:, t], perm[seqs[:, t]], noise[:, t])
        out.append((seqs[:, :-1], seqs[:, 1:]))
    return out


def run_quality(
    device: torch.device,
    model: GPTConfig,
    steps: int,
    batch: int,
    seq: int,
    precisions: Sequence[str] = ("param", "bf16", "8bit"),
    lr: float = 1e-3,
    tail: int = 50,
    seed: int = 0,
    min_8bit_size: int = 4096,
    warmup: int = 0,
    schedule: Literal["constant", "cosine"] = "constant",
) -> QualityResult:
    """Train once per entry of ``precisions`` (`RUNS`) from the same init on the same batches; bf16 autocast on CUDA,
    clipping at 1.0. The learning rate rises linearly over ``warmup`` steps, then stays (``constant``) or follows a
    cosine to a tenth of ``lr`` at the last step (``cosine``, GPT-2's recipe), set by a torch LR scheduler on the
    wrapped optimizer."""
    data = batches(steps, batch, seq, model.vocab, device, seed)
    torch.manual_seed(seed)
    init = GPT(model).to(device).state_dict()
    runs = []
    for precision in precisions:
        state, dtype, rounding = RUNS[precision]
        net = GPT(model).to(device)
        net.load_state_dict(init)
        net.to(dtype)
        fusion = FusionConfig(
            enabled=True, state_precision=state, min_8bit_size=min_8bit_size, param_rounding=rounding
        )  # fmt: skip
        config = KitsuneConfig(fusion=fusion, grads={"max_norm": 1.0})
        opt = KitsuneOptimizer(torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.1), config=config)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, steps, warmup, schedule))
        losses = []
        start = time.perf_counter()
        for idx, targets in data:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = net(idx, targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            losses.append(loss.detach())
        seconds = time.perf_counter() - start
        values = torch.stack(losses).float().cpu().tolist()
        runs.append(
            QualityRun(
                precision=precision,
                final_loss=sum(values[-tail:]) / len(values[-tail:]),
                first_loss=values[0],
                losses=values,
                state_bytes=state_bytes(opt.state)[0],
                seconds=seconds,
                state_formats=sorted({b.state for b in opt.plan.buckets}),
            )
        )
        del sched, opt, net
    return QualityResult(
        device=str(device), model=model, steps=steps, batch=batch, seq=seq, lr=lr, warmup=warmup, schedule=schedule,
        runs=runs,
    )  # fmt: skip


def lr_factor(step: int, steps: int, warmup: int, schedule: Literal["constant", "cosine"]) -> float:
    """The learning rate of step ``step`` (0-based) over the peak: linear from ``1 / warmup`` to 1 over the first
    ``warmup`` steps, then 1 (``constant``) or a cosine from 1 down to 0.1 at step ``steps - 1`` (``cosine``)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(steps - 1 - warmup, 1)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(step - warmup, span) / span))
