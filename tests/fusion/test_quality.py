"""Low-precision state trains as well as fp32 state: a tiny GPT for 120 steps in Triton's interpreter (the GPU run
in docs/benchmarks.md trains GPT-2 small), from the same init on the same batches for each precision."""

from __future__ import annotations

import torch

from kitsune.bench.e2e import GPTConfig
from kitsune.bench.quality import run_quality


def test_8bit_and_bf16_state_reach_the_fp32_loss_within_one_percent(device):
    """The quality bar: no low-precision run ends more than 1% above fp32's loss. Below it is no loss of quality;
    a tiny model's runs spread by about that much either way (on an H200 the 8-bit run ended 1.006% below fp32's),
    so the other side only has to stay within 3%: the runs are comparable."""
    model = GPTConfig(vocab=32, block=16, layers=1, heads=2, dim=16)
    result = run_quality(device, model, steps=120, batch=8, seq=16, lr=3e-3, min_8bit_size=0)
    runs = {r.precision: r for r in result.runs}
    assert runs["param"].state_formats == ["float32"]
    assert runs["bf16"].state_formats == ["bfloat16"] and runs["8bit"].state_formats == ["8-bit"]
    fp32 = runs["param"]
    assert fp32.final_loss < 0.5 * fp32.first_loss, fp32.losses[::10]  # it learned: the comparison means something
    for precision in ("bf16", "8bit"):
        relative = result.relative(precision)
        assert -0.03 < relative < 0.01, (precision, runs[precision].final_loss, fp32.final_loss)
    assert runs["8bit"].state_bytes < 0.3 * fp32.state_bytes and runs["bf16"].state_bytes < 0.51 * fp32.state_bytes
    assert torch.isfinite(torch.tensor(runs["8bit"].losses)).all()
