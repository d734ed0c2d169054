"""``profile=True`` leaves the user's run as it found it: every random stream, the allocator's figures the user can
read, and the results. The probe and the windows run past ``sample_after``, so the runs here go past them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kitsune import FusionConfig, KitsuneConfig, KitsuneOptimizer, ProfilerConfig

STEPS = 12


def _mlp(device: torch.device | str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 4)).to(device)


def _train(device: torch.device | str, profile: bool, fusion: bool, compare_steps: int = 0):
    """STEPS steps of an MLP with dropout (its masks come from the global generator of ``device``); returns the
    optimizer, the params and the generator state after them."""
    model = _mlp(device)
    gen = torch.Generator().manual_seed(1)  # the data has its own generator: only dropout draws from the global one
    data = [(torch.randn(32, 16, generator=gen), torch.randn(32, 4, generator=gen)) for _ in range(STEPS)]
    profiler = ProfilerConfig(
        enabled=profile, sample_after=2, probe_steps=2, compare_steps=compare_steps, nvml_interval_s=0
    )
    config = KitsuneConfig(fusion=FusionConfig(enabled=fusion), profiler=profiler)
    opt = KitsuneOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), config=config)
    torch.manual_seed(2)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(2)
    for x, y in data:
        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
    rng = torch.cuda.get_rng_state(device) if torch.device(device).type == "cuda" else torch.get_rng_state()
    return opt, [p.detach().clone() for p in model.parameters()], rng


@pytest.mark.filterwarnings("ignore:kitsune. fusion was asked for")
@pytest.mark.parametrize(
    "fusion, compare_steps",
    [(False, 3), pytest.param(True, 3, marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only"))],
    ids=["pass-through", "fused-interpreted"],
)
def test_cpu_generator_after_profiled_steps_equals_unprofiled(fusion, compare_steps, monkeypatch):
    if fusion:  # the kernels were imported for Triton's interpreter (tests/conftest.py): CPU params take them
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    off, params_off, rng_off = _train("cpu", profile=False, fusion=fusion, compare_steps=compare_steps)
    on, params_on, rng_on = _train("cpu", profile=True, fusion=fusion, compare_steps=compare_steps)
    assert on.profiler.get_metrics().steps_timed == STEPS
    assert torch.equal(rng_on, rng_off), "the profiler drew from torch's global CPU generator"
    if not fusion:  # with fusion the comparison window runs AdamW's own step: rounding differs from the kernel's
        for a, b in zip(params_on, params_off, strict=True):
            assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("fusion", [True, False], ids=["fused", "pass-through"])
def test_probe_leaves_cuda_generator_allocator_and_results_alone(fusion):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    _, params_off, rng_off = _train("cuda", profile=False, fusion=fusion)
    peak_off = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    on, params_on, rng_on = _train("cuda", profile=True, fusion=fusion)
    peak_on = torch.cuda.max_memory_allocated()
    on.profiler.close()

    probe = on.profiler.get_metrics().probe
    assert probe.status == "measured" and probe.steps == 2 and probe.copy_bandwidth_gbs > 0, probe  # it ran
    assert torch.equal(rng_on, rng_off), "the profiler drew from torch's global CUDA generator"
    for a, b in zip(params_on, params_off, strict=True):
        assert torch.equal(a, b)
    # the copy test's 256 MiB come from the driver, not from torch's allocator: its peak does not see them
    assert peak_on - peak_off < 16 * 2**20, (peak_on, peak_off)
