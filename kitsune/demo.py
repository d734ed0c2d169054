"""``kitsune demo``: train a tiny GPT twice, plain torch vs kitsune, and show both side by side."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from torch import nn

from kitsune.optimizer import KitsuneOptimizer


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A small decoder-only transformer; enough to give the optimizer a realistic mix of shapes."""

    def __init__(self, vocab: int = 256, dim: int = 128, layers: int = 2, heads: int = 4, block: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(block, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf"), device=idx.device), diagonal=1)
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x, mask)
        return self.head(self.ln(x))


def synthetic_batches(
    steps: int, batch: int, block: int, vocab: int, device: torch.device, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token streams from a fixed sparse Markov chain, so there is something to learn."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, vocab, generator=gen) * 4.0
    probs = torch.softmax(logits, dim=-1)
    out = []
    for _ in range(steps):
        seq = torch.empty(batch, block + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(vocab, (batch,), generator=gen)
        for t in range(block):
            seq[:, t + 1] = torch.multinomial(probs[seq[:, t]], 1, generator=gen).squeeze(1)
        out.append((seq[:, :-1].to(device), seq[:, 1:].to(device)))
    return out


@dataclass
class RunResult:
    name: str
    losses: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    """Time of each ``optimizer.step()`` (CUDA events on GPU, wall clock on CPU)."""
    iter_ms: list[float] = field(default_factory=list)
    """Time of each whole training iteration."""


@dataclass
class DemoResult:
    baseline: RunResult
    kitsune: RunResult
    optimizer: KitsuneOptimizer
    profile_path: Path
    device: torch.device

    @property
    def max_loss_diff(self) -> float:
        return max(abs(a - b) for a, b in zip(self.baseline.losses, self.kitsune.losses, strict=True))


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else math.nan


def _timer(device: torch.device) -> Callable[[Callable[[], None]], float]:
    def timed(fn: Callable[[], None]) -> float:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return timed


def best_settings(device: torch.device) -> dict[str, bool]:
    """The kitsune options this machine supports: GPU-only features only where there is a GPU."""
    cuda = device.type == "cuda"
    return {"enable_fusion": cuda, "capture_graph": cuda, "profile": True}


def _train(
    name: str,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    progress: Progress,
) -> RunResult:
    result = RunResult(name)
    timed = _timer(device)
    task = progress.add_task(name, total=len(batches))
    for x, y in batches:
        t0 = time.perf_counter()
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        result.step_ms.append(timed(opt.step))
        opt.zero_grad(set_to_none=True)
        result.losses.append(loss.item())
        result.iter_ms.append((time.perf_counter() - t0) * 1e3)
        progress.advance(task)
    return result


def run_demo(
    steps: int = 100,
    device: str = "auto",
    profile_path: str | Path = "kitsune-profile.json",
    seed: int = 0,
    console: Console | None = None,
) -> DemoResult:
    """Train the tiny GPT with the plain torch AdamW and with KitsuneOptimizer; print and return both."""
    console = console or Console()
    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    )
    size = {"dim": 256, "layers": 4, "heads": 8} if dev.type == "cuda" else {"dim": 96, "layers": 2, "heads": 4}
    batch = 16 if dev.type == "cuda" else 8
    block = 64
    batches = synthetic_batches(steps, batch, block, 256, dev, seed)

    def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = TinyGPT(block=block, **size).to(dev)
        return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)

    settings = best_settings(dev)
    n_params = sum(p.numel() for p in fresh()[0].parameters())
    console.print(
        f"[bold]kitsune demo[/]: TinyGPT ({n_params / 1e6:.2f}M params) on {dev.type}, {steps} steps, AdamW; "
        f"kitsune settings: {', '.join(f'{k}={v}' for k, v in settings.items())}"
    )
    columns = (TextColumn("{task.description:>8}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        model, opt = fresh()
        baseline = _train("torch", model, opt, batches, dev, progress)
        model, opt = fresh()
        kopt = KitsuneOptimizer(opt, **settings)
        ours = _train("kitsune", model, kopt, batches, dev, progress)

    result = DemoResult(baseline, ours, kopt, Path(profile_path), dev)
    _print_comparison(result, console)
    kopt.print_summary(console=console)
    path = kopt.save_profile(profile_path)
    console.print(f"profile written to [bold]{escape(str(path))}[/]", soft_wrap=True)
    return result


def _print_comparison(result: DemoResult, console: Console) -> None:
    table = Table(title="torch vs kitsune (medians)", title_justify="left")
    for col in ("run", "first loss", "final loss", "optimizer.step ms", "iteration ms"):
        table.add_column(col, justify="right" if col != "run" else "left")
    for run in (result.baseline, result.kitsune):
        table.add_row(
            run.name,
            f"{run.losses[0]:.4f}",
            f"{run.losses[-1]:.4f}",
            f"{_median(run.step_ms):.3f}",
            f"{_median(run.iter_ms):.2f}",
        )
    console.print(table)
    diff = result.max_loss_diff
    if diff == 0.0:
        console.print("loss curves: [green]bit-identical[/] at every step")
    else:
        console.print(f"loss curves: largest difference {diff:.3e} over {len(result.baseline.losses)} steps")
    ratio = _median(result.baseline.step_ms) / _median(result.kitsune.step_ms)
    console.print(f"optimizer.step: kitsune/torch speedup {ratio:.2f}x (medians of this run)")
