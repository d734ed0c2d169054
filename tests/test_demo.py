"""``kitsune demo`` says only what it measured: no ratio on a pass-through; elsewhere interleaved blocks, the same
profiler state on both timed sides, and the spread."""

from __future__ import annotations

import io
import re

import pytest
import torch
from rich.console import Console

from kitsune import demo
from kitsune.demo import RunResult, Spread, Timing, TinyGPT, _timing, _verdict, run_demo

RATIO = re.compile(r"\d\.\d+x\b")


def _run(tmp_path, steps: int, device: str = "cpu", width: int = 80) -> tuple[demo.DemoResult, str]:
    buf = io.StringIO()
    result = run_demo(steps, device, tmp_path / "p.json", 0, Console(file=buf, width=width, color_system=None))
    return result, buf.getvalue()


def test_cpu_demo_says_pass_through_and_prints_no_ratio(tmp_path):
    result, text = _run(tmp_path, 12)
    assert result.pass_through and result.timing is None and result.max_loss_diff == 0.0
    flat = " ".join(text.split())
    assert "bit-identical at every step" in flat and "kitsune was a pass-through here" in flat
    assert "pass-through: AdamW's own step updated every param" in flat  # the summary's own line
    assert not RATIO.search(text) and "speed-up" not in text and "as fast" not in text, text
    paths = ("profile written to", "read it again")  # a path each
    assert all(len(line) <= 80 for line in text.splitlines() if not line.startswith(paths))
    assert result.optimizer.profiler is not None and result.optimizer.step_count == 12  # the profile's run


def test_timed_sides_alternate_without_the_profiler_and_report_the_spread(tmp_path, monkeypatch):
    """Where kitsune's kernels run (CUDA, or Triton's interpreter on a CPU here), both timed sides run without the
    profiler, in alternating blocks; a third run carries it."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # the kernels were imported for the interpreter (tests/conftest.py); CPU params take them
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(demo, "best_settings", lambda dev: {"enable_fusion": True, "capture_graph": False})
        small = lambda block, **size: TinyGPT(dim=16, layers=1, heads=2, block=block)  # noqa: E731
        monkeypatch.setattr(demo, "TinyGPT", small)  # the interpreter runs each kernel program in Python
    order: list[tuple[str, int]] = []
    profiled: dict[str, bool] = {}
    train = demo._Side.train

    def recorded(side, batches, n, dev, progress):
        order.append((side.result.name, n))
        profiled[side.result.name] = getattr(side.opt, "profiler", None) is not None
        train(side, batches, n, dev, progress)

    monkeypatch.setattr(demo._Side, "train", recorded)
    result, text = _run(tmp_path, 20, device, width=160)

    assert [name for name, _ in order] == ["torch", "kitsune", "kitsune", "torch"] * 2 + ["torch", "kitsune"] + [
        "profiled"
    ]
    assert {n for name, n in order if name != "profiled"} == {4}  # blocks of 4 steps
    assert profiled == {"torch": False, "kitsune": False, "profiled": True}
    assert not result.pass_through and result.timing is not None and result.timing.blocks == 4
    assert result.optimizer.profiler is not None  # the third run
    assert len(result.kitsune.step_ms) == len(result.baseline.step_ms) == 20
    for ratio in (result.timing.step_speedup, result.timing.iteration_speedup):
        assert ratio.p10 <= ratio.p50 <= ratio.p90
    flat = " ".join(text.split())
    assert "the profiler off on both sides" in flat and "one warm-up block left out" in flat
    ours = " ".join(text[: text.index("kitsune summary")].split())  # the summary's plan has the model's predictions
    for ratio in RATIO.finditer(ours):  # every ratio the demo prints comes with its spread or its reading
        around = ours[max(0, ratio.start() - 40) : ratio.end() + 30]
        assert re.search(r"\(\S+x-\S+x\)|as fast|slower|tell apart", around), around
    assert "kitsune speed-up" in ours and "per block" in ours


def _runs(torch_ms: list[float], kitsune_ms: list[float]) -> tuple[RunResult, RunResult]:
    return (
        RunResult("torch", [1.0] * len(torch_ms), torch_ms, [10 + t for t in torch_ms]),
        RunResult("kitsune", [1.0] * len(kitsune_ms), kitsune_ms, [10 + k for k in kitsune_ms]),
    )


def test_timing_leaves_the_warm_up_block_out_and_takes_one_ratio_per_block():
    torch_ms = [50.0] * 5 + [2.0, 2.2, 1.8, 2.0, 2.1] * 4  # a slow first block: compiles, captures
    kitsune_ms = [90.0] * 5 + [1.0, 1.1, 0.9, 1.0, 1.05] * 4
    timing = _timing(*_runs(torch_ms, kitsune_ms), block=5)
    assert timing is not None and timing.blocks == 4
    assert timing.step_speedup.p50 == pytest.approx(2.0) and timing.step_speedup.p10 == pytest.approx(2.0)
    assert timing.step["torch"].p50 == pytest.approx(2.0) and timing.step["kitsune"].p50 == pytest.approx(1.0)
    assert _timing(*_runs(torch_ms[:12], kitsune_ms[:12]), block=5) is None  # 1 timed block: no spread


def test_verdict_says_only_what_the_spread_supports():
    def timing(step: Spread, iteration: Spread) -> Timing:
        sides = {"torch": Spread(2.0, 1.9, 2.1), "kitsune": Spread(1.0, 0.9, 1.1)}
        whole = {"torch": Spread(20.0, 19.0, 21.0), "kitsune": Spread(19.0, 18.0, 20.0)}
        return Timing(10, 9, sides, whole, step, iteration)

    text = _verdict(timing(Spread(2.0, 1.8, 2.2), Spread(1.04, 0.97, 1.1)))
    assert "optimizer.step(): kitsune 2.00x as fast" in text
    assert "whole iteration: no difference this run can tell apart (1.04x" in text
    assert "torch's step is 10% of its iteration" in text
    assert "kitsune slower (0.80x)" in _verdict(timing(Spread(0.8, 0.7, 0.9), Spread(1.0, 0.9, 1.1)))


def test_batches_are_made_as_read_and_the_same_on_every_read():
    """A long demo starts at once: batches are made a chunk at a time as the sides read them, a few chunks kept, and
    a batch read again after its chunk was dropped (the profiled run starts over) is the one read first."""
    steps = demo.SyntheticBatches.CHUNK * (demo.SyntheticBatches.KEEP + 2) + 7  # a short last chunk
    batches = demo.SyntheticBatches(steps, 4, 16, 32, torch.device("cpu"), seed=3)
    assert len(batches) == steps and not batches._chunks  # nothing made before the first read
    first = [tuple(t.clone() for t in batches[i]) for i in range(steps)]
    assert len(batches._chunks) == demo.SyntheticBatches.KEEP  # the oldest dropped
    again = demo.SyntheticBatches(steps, 4, 16, 32, torch.device("cpu"), seed=3)
    for i in (0, 1, steps // 2, steps - 1):  # chunk 0 dropped and made again
        x, y = batches[i]
        assert torch.equal(x, first[i][0]) and torch.equal(y, first[i][1])
        assert torch.equal(again[i][0], x)
        assert x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])  # targets: the inputs one token on
    assert not torch.equal(first[0][0], first[demo.SyntheticBatches.CHUNK][0])  # each chunk its own draws
    other = demo.SyntheticBatches(steps, 4, 16, 32, torch.device("cpu"), seed=4)
    assert not torch.equal(other[0][0], first[0][0])
    tokens = torch.cat([x.flatten() for x, _ in first])
    assert 0 <= tokens.min() and tokens.max() < 32 and tokens.unique().numel() > 16
    with pytest.raises(IndexError):
        batches[steps]
