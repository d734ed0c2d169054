"""``kitsune demo``: train a tiny GPT with plain torch and with kitsune, and say what the comparison shows.

Both sides train the same model from the same seed on the same batches. Their steps are interleaved in blocks
(torch then kitsune, then kitsune then torch, ...) with the profiler off on both, and both are timed the same way,
so a ratio compares like with like and drifts of the machine (clocks, other work) hit both sides alike; the spread
across blocks says how far to trust it. A third run, kitsune with ``profile=True``, gives the summary and the saved
profile. Where kitsune is a pass-through (it updates no param itself, as on a CPU) both sides run the same step:
the demo says so and shows no ratio, since any difference would be noise.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table
from torch import nn

from kitsune._paths import check_output_path
from kitsune.fusion import Route
from kitsune.optimizer import KitsuneOptimizer
from kitsune.profiler.core import quantile
from kitsune.profiler.summary import Prose, count, times


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


class SyntheticBatches:
    """Token streams from a fixed sparse Markov chain, so there is something to learn: ``batches[i]`` is step ``i``'s
    ``(inputs, targets)`` on ``device``, the same on every read.

    Made a chunk of steps at a time when first read (each chunk from its own seeded generator, the chain's 64
    transitions drawn for all of the chunk's sequences at once) and kept for the sides that read it next, so a long
    run starts at once and holds a few chunks, not every batch of the run."""

    CHUNK = 50
    """Steps made together."""
    KEEP = 4
    """Chunks kept: the timed sides read at most two blocks apart, the profiled run reads from the start again."""

    def __init__(self, steps: int, batch: int, block: int, vocab: int, device: torch.device, seed: int) -> None:
        self.steps, self.batch, self.block, self.device, self.seed = steps, batch, block, device, seed
        gen = torch.Generator().manual_seed(seed)
        probs = torch.softmax(torch.randn(vocab, vocab, generator=gen) * 4.0, dim=-1)
        self.cdf = probs.double().cumsum(dim=-1)
        """Row ``a``: the chance that the token after ``a`` is at most each token (a draw is a search in it)."""
        self._chunks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.steps:
            raise IndexError(f"step {i} of {self.steps}")
        c, j = divmod(i, self.CHUNK)
        if c not in self._chunks:
            if len(self._chunks) >= self.KEEP:
                del self._chunks[next(iter(self._chunks))]  # the oldest made
            self._chunks[c] = self._make(c)
        x, y = self._chunks[c]
        return x[j], y[j]

    def _make(self, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = min(self.CHUNK, self.steps - c * self.CHUNK)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + c)
        seq = torch.empty(n * self.batch, self.block + 1, dtype=torch.long)
        vocab = self.cdf.shape[0]
        seq[:, 0] = torch.randint(vocab, (n * self.batch,), generator=gen)
        draws = torch.rand(n * self.batch, self.block, 1, dtype=torch.float64, generator=gen)
        for t in range(self.block):
            nxt = torch.searchsorted(self.cdf[seq[:, t]], draws[:, t] * self.cdf[seq[:, t], -1:])
            seq[:, t + 1] = nxt.squeeze(1).clamp_(max=vocab - 1)
        seq = seq.view(n, self.batch, self.block + 1).to(self.device)
        return seq[:, :, :-1], seq[:, :, 1:]


@dataclass
class RunResult:
    name: str
    losses: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    """Time of each ``optimizer.step()`` (CUDA events on GPU, wall clock on CPU)."""
    iter_ms: list[float] = field(default_factory=list)
    """Time of each whole training iteration (forward, backward, step, zero_grad and reading the loss)."""


@dataclass
class Spread:
    """A median with its 10th and 90th percentiles."""

    p50: float
    p10: float
    p90: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        ordered = sorted(values)
        return cls(quantile(ordered, 0.5), quantile(ordered, 0.1), quantile(ordered, 0.9))


@dataclass
class Timing:
    """torch against kitsune over the timed blocks (the first block of each side warms up and is left out)."""

    block: int
    """Steps per block."""
    blocks: int
    """Timed blocks per side."""
    step: dict[str, Spread]
    """``optimizer.step()`` ms per side ("torch", "kitsune"), over every step of the timed blocks."""
    iteration: dict[str, Spread]
    """Whole-iteration ms per side."""
    step_speedup: Spread
    """torch's median step / kitsune's, one ratio per block: above 1, kitsune's step is faster."""
    iteration_speedup: Spread


@dataclass
class DemoResult:
    baseline: RunResult
    kitsune: RunResult
    optimizer: KitsuneOptimizer
    """The optimizer whose profile was saved (kitsune with ``profile=True``)."""
    profile_path: Path
    device: torch.device
    pass_through: bool = False
    """kitsune updated no param itself: both sides ran the wrapped optimizer's own step, and nothing was timed."""
    timing: Timing | None = None
    """The comparison, when there was one and enough blocks to give a spread."""

    @property
    def max_loss_diff(self) -> float:
        return max(abs(a - b) for a, b in zip(self.baseline.losses, self.kitsune.losses, strict=True))


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
    return {"enable_fusion": cuda, "capture_graph": cuda}


@dataclass
class _Side:
    """One optimizer training its own copy of the model through the shared batches."""

    result: RunResult
    model: nn.Module
    opt: torch.optim.Optimizer
    task: TaskID
    done: int = 0

    def train(self, batches: SyntheticBatches, n: int, device: torch.device, progress: Progress) -> None:
        timed = _timer(device)
        for i in range(self.done, min(self.done + n, len(batches))):
            x, y = batches[i]
            t0 = time.perf_counter()
            logits = self.model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
            self.result.step_ms.append(timed(self.opt.step))
            self.opt.zero_grad(set_to_none=True)
            self.result.losses.append(loss.item())
            self.result.iter_ms.append((time.perf_counter() - t0) * 1e3)
            progress.advance(self.task)
        self.done = min(self.done + n, len(batches))


def block_size(steps: int) -> int:
    """Steps per block: 10, or fewer so that a short run still has several blocks."""
    return max(1, min(10, steps // 5))


def _timing(torch_run: RunResult, kitsune_run: RunResult, block: int) -> Timing | None:
    """Per-side spreads and per-block ratios, the first block left out; None with fewer than 3 timed blocks."""
    steps = len(torch_run.step_ms)
    blocks = [(lo, min(lo + block, steps)) for lo in range(block, steps, block)]
    if len(blocks) < 3:
        return None

    def ratio(attr: str) -> Spread:
        per_block = []
        for lo, hi in blocks:
            t, k = (Spread.of(getattr(r, attr)[lo:hi]).p50 for r in (torch_run, kitsune_run))
            per_block.append(t / k)
        return Spread.of(per_block)

    def sides(attr: str) -> dict[str, Spread]:
        return {r.name: Spread.of(getattr(r, attr)[block:]) for r in (torch_run, kitsune_run)}

    return Timing(block, len(blocks), sides("step_ms"), sides("iter_ms"), ratio("step_ms"), ratio("iter_ms"))


def _updates_params(opt: KitsuneOptimizer) -> bool:
    """Whether kitsune's plan sends any param to a step of its own choosing (not the wrapped optimizer's)."""
    plan = opt.plan
    return plan is not None and any(b.route is not Route.BASE_STEP for b in plan.buckets)


def run_demo(
    steps: int = 100,
    device: str = "auto",
    profile_path: str | Path = "kitsune-profile.json",
    seed: int = 0,
    console: Console | None = None,
) -> DemoResult:
    """Train the tiny GPT with the plain torch AdamW and with KitsuneOptimizer; print what that shows and return it.

    Raises:
        ValueError: nothing can be written at ``profile_path`` (see `kitsune._paths.check_output_path`); checked
            before the training, which would otherwise run in full before the profile is saved.
    """
    profile_path = check_output_path(profile_path)  # "~" expanded
    console = console or Console()
    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    )
    size = {"dim": 256, "layers": 4, "heads": 8} if dev.type == "cuda" else {"dim": 96, "layers": 2, "heads": 4}
    batch = 16 if dev.type == "cuda" else 8
    block = 64
    batches = SyntheticBatches(steps, batch, block, 256, dev, seed)

    def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = TinyGPT(block=block, **size).to(dev)
        return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)

    settings = best_settings(dev)
    # without fusion kitsune is a pass-through: nothing to time, so the kitsune side itself can carry the profiler;
    # with it, the timed sides both run without the profiler and a third run carries it
    timed = settings["enable_fusion"]
    n_params = sum(p.numel() for p in fresh()[0].parameters())
    flags = ", ".join(f"{k}={v}" for k, v in settings.items())
    console.print(
        f"[bold]kitsune demo[/]: TinyGPT ({n_params / 1e6:.2f}M params) on {dev.type}, {count(steps, 'step')}, "
        f"AdamW(lr=3e-3, weight_decay=0.1), same seed and batches on every side"
    )
    if timed:
        console.print(
            Prose(
                f"kitsune: KitsuneOptimizer(AdamW, {flags}), timed against torch in alternating blocks with the "
                "profiler off on both sides; a third run with profile=True gives the summary and the profile"
            )
        )
    else:
        console.print(Prose(f"kitsune: KitsuneOptimizer(AdamW, {flags}, profile=True)"))
    columns = (TextColumn("{task.description:>8}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:

        def side(name: str, **kwargs: bool) -> _Side:
            model, opt = fresh()
            if kwargs:
                opt = KitsuneOptimizer(opt, **settings, **kwargs)
            return _Side(RunResult(name), model, opt, progress.add_task(name, total=steps))

        torch_side, kitsune_side = side("torch"), side("kitsune", profile=not timed)
        n = block_size(steps)
        for i in range((steps + n - 1) // n):  # torch first in even blocks, kitsune first in odd ones
            for s in (torch_side, kitsune_side) if i % 2 == 0 else (kitsune_side, torch_side):
                s.train(batches, n, dev, progress)
        profiled = side("profiled", profile=True) if timed else kitsune_side
        if timed:
            profiled.train(batches, steps, dev, progress)

    assert isinstance(kitsune_side.opt, KitsuneOptimizer) and isinstance(profiled.opt, KitsuneOptimizer)
    pass_through = not _updates_params(kitsune_side.opt)
    timing = None if pass_through else _timing(torch_side.result, kitsune_side.result, n)
    result = DemoResult(torch_side.result, kitsune_side.result, profiled.opt, profile_path, dev, pass_through, timing)
    _print_comparison(result, console)
    profiled.opt.print_summary(console=console)
    path = profiled.opt.save_profile(profile_path)
    console.print(f"profile written to [bold]{escape(str(path))}[/]", soft_wrap=True)
    report = f"{_command()} report {shlex.quote(str(path))} --html kitsune-report.html"
    console.print(f"read it again, or as an HTML report: [bold]{escape(report)}[/]", soft_wrap=True)
    return result


def _command() -> str:
    """How to call the ``kitsune`` command from here: ``kitsune`` where it is on PATH, else its path in this
    Python's environment (``.venv/bin/kitsune`` after ``make demo``), else ``python -m kitsune``."""
    here = Path(sys.executable).parent / "kitsune"
    found = shutil.which("kitsune")
    if found is not None and Path(found).resolve() == here.resolve():
        return "kitsune"
    if here.exists():
        near = os.path.relpath(here)
        return near if not near.startswith("..") else str(here)
    return f"{shlex.quote(sys.executable)} -m kitsune"


def _print_comparison(result: DemoResult, console: Console) -> None:
    torch_run, ours = result.baseline, result.kitsune
    steps = len(torch_run.losses)
    console.print(f"[bold]torch vs kitsune[/] ({count(steps, 'step')} each)")
    facts = Table.grid(padding=(0, 2))
    facts.add_column(no_wrap=True)
    facts.add_column()
    diff = result.max_loss_diff
    if diff == 0.0:
        loss = f"{torch_run.losses[0]:.4f} -> {torch_run.losses[-1]:.4f} on both sides: bit-identical at every step"
    else:
        loss = (
            f"torch {torch_run.losses[0]:.4f} -> {torch_run.losses[-1]:.4f}, kitsune {ours.losses[0]:.4f} -> "
            f"{ours.losses[-1]:.4f}; the largest difference at any step is {diff:.3e}"
        )
    facts.add_row("loss", Prose(loss))
    timing = result.timing
    if result.pass_through:
        speed = (
            "not compared: kitsune was a pass-through here (see the summary below), so both sides ran AdamW's own "
            "step and a ratio would only measure noise"
        )
        facts.add_row("speed", Prose(speed))
    elif timing is None:
        are = "is" if steps == 1 else "are"
        few = f"{count(steps, 'step')} {are} too few for 3 timed blocks after the warm-up (try --steps 40)"
        facts.add_row("speed", Prose(f"not compared: {few}"))
    else:
        source = "CUDA events" if result.device.type == "cuda" else "wall clock"
        how = (
            f"{timing.blocks} blocks of {count(timing.block, 'step')} a side, alternating, after one warm-up block "
            f"left out; the profiler off on both sides; optimizer.step() timed with {source}"
        )
        facts.add_row("timed", Prose(how))
    console.print(facts)
    if timing is None:
        return
    table = Table(title="median (p10-p90); speed-up: torch's time / kitsune's, per block", title_justify="left")
    table.add_column("")
    table.add_column("optimizer.step() ms", justify="right")
    table.add_column("whole iteration ms", justify="right")
    for side in ("torch", "kitsune"):
        table.add_row(
            side, *(f"{_ms(s.p50)} ({_ms(s.p10)}-{_ms(s.p90)})" for s in (timing.step[side], timing.iteration[side]))
        )
    ratios = (timing.step_speedup, timing.iteration_speedup)
    table.add_row("kitsune speed-up", *(f"{times(r.p50)} ({times(r.p10)}-{times(r.p90)})" for r in ratios))
    console.print(table)
    console.print(Prose(_verdict(timing)))


def _ms(value: float) -> str:
    return f"{value:.4g}"


def _verdict(timing: Timing) -> str:
    """The one-line reading of the table: only what the spread supports."""

    def reading(ratio: Spread) -> str:
        if ratio.p10 > 1.0:
            return f"kitsune {times(ratio.p50)} as fast"
        if ratio.p90 < 1.0:
            return f"kitsune slower ({times(ratio.p50)})"
        return f"no difference this run can tell apart ({times(ratio.p50)}, and the spread spans 1x)"

    share = timing.step["torch"].p50 / timing.iteration["torch"].p50
    return (
        f"optimizer.step(): {reading(timing.step_speedup)}; whole iteration: {reading(timing.iteration_speedup)}. "
        f"torch's step is {share:.0%} of its iteration here; forward and backward are the rest, and kitsune leaves "
        "them alone."
    )
