"""``kitsune bench --e2e``: whole training steps of a GPT-2 124M-shaped model, torch's careful loop against kitsune.

Both sides train the same model from the same initial weights on the same token batches, with bf16 autocast and
AdamW, clipping the grads to a global norm of 1.0:

* ``torch``: ``torch.optim.AdamW(fused=True)``; ``loss.backward()``; ``torch.nn.utils.clip_grad_norm_``;
  ``step()``; ``zero_grad()``.
* ``kitsune``: ``KitsuneOptimizer(AdamW, enable_fusion=True, enable_amp=True (bf16), max_grad_norm=1.0)`` with
  ``optimizer.autocast()``, ``optimizer.backward(loss)`` and ``zero_grad()``: the clip happens inside the step,
  whose device work is replayed from a CUDA graph after warm-up.
* ``kitsune_zero``: the same with ``GradConfig(zero_in_step=True)``: the update zeroes the grads, which then stay
  allocated through the next forward (more peak memory, like ``zero_grad(set_to_none=False)``).

Reported per side: tokens per second over the timed steps (CUDA events around blocks of ``BLOCK`` whole steps:
forward, backward and optimizer; the sides take turns block by block, the GPU idle at each block's start, see
``_in_turns``), the peak allocated memory of its build and warm-up (each side's own, above what the others hold:
the warm-up's steps allocate what the timed ones do, plus, for kitsune, its graph's capture; with ``--compile`` the
first side built also holds the compile's memory), and the last loss (both sides should agree closely).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from pydantic import BaseModel
from torch import nn

from kitsune.bench.info import KitsuneInfo, kitsune_info, step_mark
from kitsune.bench.timing import Stats, synchronize


class GPTConfig(BaseModel):
    vocab: int = 50257
    block: int = 1024
    layers: int = 12
    heads: int = 12
    dim: int = 768


GPT2_SMALL = GPTConfig()
"""GPT-2 124M: 12 layers, 12 heads, 768 wide, 50257 tokens, embeddings tied to the head."""
CPU_TINY = GPTConfig(vocab=256, block=64, layers=2, heads=2, dim=32)
"""The same model, tiny, for a CPU dry run."""
BLOCK = 5
"""Steps a side runs in one turn (see ``_in_turns``)."""


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.out = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """A GPT-2-shaped decoder (pre-norm blocks, learned positions, head tied to the token embedding)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.block, cfg.dim)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


class E2ESide(BaseModel):
    name: str
    label: str
    step_ms: Stats
    tokens_per_s: float
    peak_memory_bytes: int
    """The side's peak allocated bytes over its build and warm-up, above what the sides before it hold."""
    last_loss: float
    losses: list[float]
    """Every step's loss, warm-up included (read after the timing)."""
    kitsune: KitsuneInfo | None = None
    """A kitsune side's route, subsystems and graph replays after warm-up (None: a torch side)."""


class E2EResult(BaseModel):
    model: GPTConfig
    n_params: int
    batch: int
    seq: int
    steps: int
    warmup: int
    block: int = 1
    """Steps a side ran in one turn, the GPU synchronised before each turn (1 in results from before the field)."""
    max_grad_norm: float
    compile_backend: str | None = None
    """The ``torch.compile`` backend every side's model ran through; None: eager."""
    sides: list[E2ESide]
    ratio: float
    """kitsune's tokens/s over torch's (above 1: kitsune trains faster)."""
    ratio_noclip: float
    """Without clipping: kitsune with the updates inside backward (on a side stream, the default) over torch's fused
    AdamW."""
    ratio_noclip_current: float
    """Without clipping: kitsune with the updates inside backward, queued on backward's own stream, over torch's."""
    ratio_noclip_step: float
    """Without clipping: kitsune's graph-replayed step after backward over torch's."""
    max_loss_diff_first_10: float
    """Largest difference of the two sides' losses over the first 10 steps: they train the same model alike."""


ADAMW = {"lr": 3e-4, "weight_decay": 0.1, "betas": (0.9, 0.95)}
SIDES = {
    "torch": ("torch: fused AdamW, clip_grad_norm_, zero_grad", "torch: AdamW, clip_grad_norm_, zero_grad"),
    "kitsune": ("kitsune: clip in the step, graph", "kitsune: max_grad_norm=1.0"),
    "kitsune_zero": ("kitsune: clip and zero in the step, graph", "kitsune: max_grad_norm=1.0, zero_in_step=True"),
    "torch_noclip": ("torch, no clip: fused AdamW, zero_grad", "torch, no clip: AdamW, zero_grad"),
    "kitsune_backward": (
        "kitsune, no clip: updates inside backward",
        "kitsune, no clip: step_in_backward=True",
    ),
    "kitsune_backward_flat": (
        "kitsune, no clip: updates inside backward, flat grads",
        "kitsune, no clip: step_in_backward=True, flat_grads=True",
    ),
    "kitsune_backward_current": (
        "kitsune, no clip: updates inside backward, on backward's stream",
        "kitsune, no clip: step_in_backward=True, backward_stream='current'",
    ),
    "kitsune_noclip": ("kitsune, no clip: step after backward, graph", "kitsune, no clip"),
}
"""Each side's name and its labels, on a GPU and on a CPU, in the order they are built and reported. The GPU's say
what runs there (a fused step, a CUDA graph, updates inside backward); a CPU runs none of it (torch's AdamW is not
fused there, and every kitsune side runs AdamW's own step in ``step()``), so its labels name the settings each side
asked for."""


def check_compile_backend(name: str) -> None:
    """Raise a ValueError of one line unless ``torch.compile`` knows the backend ``name``: checked before anything
    runs, since ``torch.compile`` itself fails only at the first forward, after the other timings."""
    from torch._dynamo import list_backends

    if name not in list_backends(exclude_tags=()):  # every registered one, the debug ones (aot_eager) included
        raise ValueError(
            f"torch {torch.__version__} has no torch.compile backend {name!r}: choose one of "
            f"{', '.join(list_backends())}, or a debug one such as aot_eager (torch._dynamo.list_backends())"
        )


FLAT_POOL = 16 << 30
"""The memory pool's cap on the flat-grads sides: above any model this bench builds, so every param is pooled."""


class Side(NamedTuple):
    name: str
    model: nn.Module
    loss_of: Any
    """What computes the loss: the model itself or its compiled forward."""
    opt: Any


def build_side(
    name: str, cfg: GPTConfig, init: dict[str, torch.Tensor], device: torch.device, compile_backend: str | None = None
) -> Side:
    """The side ``name`` of ``SIDES``: its copy of the model (weights ``init``, compiled with ``compile_backend``
    when given) and its optimizer."""
    from kitsune.config import AMPConfig, FusionConfig, GradConfig, KitsuneConfig, MemoryConfig, StreamConfig
    from kitsune.optimizer import KitsuneOptimizer

    if name not in SIDES:
        raise ValueError(f"unknown side {name!r}: choose from {', '.join(SIDES)}")
    model = GPT(cfg).to(device)
    model.load_state_dict(init)
    loss_of = torch.compile(model, backend=compile_backend) if compile_backend else model
    if name.startswith("torch"):
        return Side(name, model, loss_of, torch.optim.AdamW(model.parameters(), **ADAMW, fused=device.type == "cuda"))
    opt = KitsuneOptimizer(
        torch.optim.AdamW(model.parameters(), **ADAMW),
        config=KitsuneConfig(
            fusion=FusionConfig(enabled=True),
            amp=AMPConfig(enabled=True, dtype=torch.bfloat16),
            grads=GradConfig(
                max_norm=1.0 if name in ("kitsune", "kitsune_zero") else None, zero_in_step=name == "kitsune_zero"
            ),
            # inside backward the updates launch bucket by bucket as backward finishes their grads
            streams=StreamConfig(
                step_in_backward=name.startswith("kitsune_backward"),
                backward_stream="current" if name.endswith("_current") else "side",
            ),
            # flat grads stay at their arena addresses, so no address table is uploaded inside backward; the pool's
            # cap is raised so that every grad is flat (GPT-2's state and grads take 1.5 GB, the default cap 512 MiB)
            memory=MemoryConfig(flat_grads=True, pool_size=FLAT_POOL) if name.endswith("_flat") else MemoryConfig(),
        ),
    )
    return Side(name, model, loss_of, opt)


def forward_backward(side: Side, tokens: torch.Tensor) -> torch.Tensor:
    """The side's forward under bf16 autocast and its backward; returns the loss."""
    if side.name.startswith("kitsune"):
        with side.opt.autocast():
            loss = side.loss_of(tokens[:, :-1], tokens[:, 1:])
        side.opt.backward(loss)
    else:
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
            loss = side.loss_of(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
    return loss


def optimizer_phase(side: Side) -> None:
    """The side's optimizer phase after backward: torch's clip (its clipped side), ``step()`` and ``zero_grad()``."""
    if side.name == "torch":
        torch.nn.utils.clip_grad_norm_(side.model.parameters(), 1.0)
    side.opt.step()
    side.opt.zero_grad()


def train_step(side: Side, tokens: torch.Tensor) -> torch.Tensor:
    """One whole training step of the side; returns the loss."""
    loss = forward_backward(side, tokens)
    optimizer_phase(side)
    return loss


def e2e_inputs(
    device: torch.device, batch: int = 4, seq: int = 512, n_batches: int = 8, seed: int = 0
) -> tuple[GPTConfig, list[torch.Tensor], dict[str, torch.Tensor]]:
    """The model's shape (GPT-2 124M on a GPU, the tiny one elsewhere), ``n_batches`` random token batches of
    ``batch`` x (``seq`` + 1) on ``device`` (``seq`` capped at the model's block) and the initial weights every side
    starts from; the same for the same ``seed``."""
    cfg = GPT2_SMALL if device.type == "cuda" else CPU_TINY
    seq = min(seq, cfg.block)
    gen = torch.Generator().manual_seed(seed + 1)
    data = [torch.randint(cfg.vocab, (batch, seq + 1), generator=gen).to(device) for _ in range(n_batches)]
    torch.manual_seed(seed)
    return cfg, data, GPT(cfg).state_dict()


def run_e2e(
    device: torch.device,
    steps: int = 30,
    warmup: int = 10,
    batch: int = 4,
    seq: int = 512,
    seed: int = 0,
    compile_backend: str | None = None,
) -> E2EResult:
    """Time ``steps`` whole training steps of each side after ``warmup`` untimed ones (see the module docstring).

    ``compile_backend``: run every side's model through ``torch.compile(model, backend=compile_backend)``
    (``"inductor"``, torch's default, or any backend name torch knows); the sides share the compiled code, which
    the first side's warm-up compiles; an unknown backend is a ValueError before anything runs. On a CPU the sides
    are labelled with their CPU labels (`SIDES`)."""
    if compile_backend is not None:
        check_compile_backend(compile_backend)
    cfg, data, init = e2e_inputs(device, batch, seq, seed=seed)
    labels = {name: gpu if device.type == "cuda" else cpu for name, (gpu, cpu) in SIDES.items()}
    seq = data[0].shape[1] - 1
    # build and warm up each side in turn, measuring its own peak memory (above what the others hold); then time
    # the sides in turns, block by block, so a busy host slows all of them alike
    built: list[tuple[Any, list[torch.Tensor], int]] = []
    n_params = 0
    for name in SIDES:
        base = _allocated(device)
        side = build_side(name, cfg, init, device, compile_backend)
        n_params = sum(p.numel() for p in side.model.parameters())
        step = partial(train_step, side)
        losses = [step(data[i % len(data)]).detach() for i in range(warmup)]
        peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0
        mark = step_mark(side.opt) if name.startswith("kitsune") else None
        built.append((side, step, losses, peak, mark))
    block = min(BLOCK, steps)
    times = _in_turns([b[1] for b in built], data, steps, device, first=warmup, block=block)
    sides = []
    for (name, label), (side, _, losses, peak, mark), (ms, timed_losses) in zip(
        labels.items(), built, times, strict=True
    ):
        all_losses = [float(x) for x in losses + timed_losses]
        n = sum(1 for _ in side.model.parameters())
        stats = Stats.of(ms)
        sides.append(
            E2ESide(
                name=name,
                label=label,
                step_ms=stats,
                tokens_per_s=batch * seq / (stats.median / 1e3),
                peak_memory_bytes=peak,
                last_loss=all_losses[-1],
                losses=all_losses,
                kitsune=None if mark is None else kitsune_info(side.opt, n, since=mark),
            )
        )
    tps = {side.name: side.tokens_per_s for side in sides}
    return E2EResult(
        model=cfg,
        n_params=n_params,
        batch=batch,
        seq=seq,
        steps=steps,
        warmup=warmup,
        block=block,
        max_grad_norm=1.0,
        compile_backend=compile_backend,
        sides=sides,
        ratio=tps["kitsune"] / tps["torch"],
        ratio_noclip=tps["kitsune_backward"] / tps["torch_noclip"],
        ratio_noclip_current=tps["kitsune_backward_current"] / tps["torch_noclip"],
        ratio_noclip_step=tps["kitsune_noclip"] / tps["torch_noclip"],
        max_loss_diff_first_10=max(abs(a - b) for a, b in zip(sides[0].losses[:10], sides[1].losses[:10], strict=True)),
    )


def _allocated(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _in_turns(
    steps_fns: list[Any], data: list[torch.Tensor], steps: int, device: torch.device, first: int, block: int
) -> list[tuple[list[float], list[torch.Tensor]]]:
    """Each side's milliseconds per step (one value per block: the block's time over its steps) and losses (left on
    the device).

    The sides take turns block by block, ``block`` steps each, the order rotating round by round and reversed every
    other round. The GPU is synchronised before each block, so no side's first step runs on, or waits behind, the GPU
    work the side before it left queued (taking turns step by step gave each side a head start as long as its
    predecessor's queued tail); within a block one step's GPU tail overlaps the next step's host work, as in
    training. Every side sees the same batches in the same order."""
    import time

    cuda = device.type == "cuda"
    out: list[tuple[list[float], list[torch.Tensor]]] = [([], []) for _ in steps_fns]
    n = len(steps_fns)
    for r in range(max(1, steps // block)):
        batches = [data[(first + r * block + j) % len(data)] for j in range(block)]
        # rotated round by round, and run backwards every other round: each side goes first as often, and follows
        # each of its neighbours as often (the GPU's clocks depend on the work just before)
        for k in [(r + o) % n if r % 2 == 0 else (r - o) % n for o in range(n)]:
            step = steps_fns[k]
            synchronize(device)
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            for batch in batches:
                out[k][1].append(step(batch).detach())
            if cuda:
                end.record()
                end.synchronize()
                out[k][0].append(start.elapsed_time(end) / block)
            else:
                out[k][0].append((time.perf_counter() - t0) * 1e3 / block)
    return out
