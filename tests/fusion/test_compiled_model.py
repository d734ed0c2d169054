"""A model compiled by torch.compile: kitsune's fused step, its clip and its updates inside backward train it as
torch.optim trains the eager model.

A compiled backward hands every grad over when it ends, so updates inside backward all launch then; the results must
not change. The ``aot_eager`` backend traces forward and backward as inductor does, without compiling kernels (quick
on a CPU)."""

from __future__ import annotations

import pytest
import torch
from streams.test_step_in_backward import run, twins

from kitsune import KitsuneOptimizer
from kitsune.config import FusionConfig, GradConfig, KitsuneConfig, StreamConfig

MAX_NORM = 0.5


def _config(mode: str) -> KitsuneConfig:
    if mode == "in_backward":
        return KitsuneConfig(
            fusion=FusionConfig(enabled=True), streams=StreamConfig(step_in_backward=True, bucket_bytes=700)
        )
    return KitsuneConfig(
        fusion=FusionConfig(enabled=True), grads=GradConfig(max_norm=MAX_NORM if mode == "clip" else None)
    )


@pytest.mark.parametrize(
    ("mode", "micro"),
    [("step", 1), ("clip", 1), ("in_backward", 1), ("in_backward", 3)],
    ids=["step", "clip", "in-backward", "in-backward-accumulate-3"],
)
def test_compiled_model_trains_like_torch_on_the_eager_model(mode, micro, device):
    torch._dynamo.reset()
    net, twin = twins(device, 4)
    opt = KitsuneOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1), config=_config(mode))
    assert opt._subsystem("fusion").active, opt._subsystem("fusion").reason
    assert opt.scheduler.active == (mode == "in_backward"), opt.scheduler.reason
    compiled = torch.compile(net, backend="aot_eager")
    ref_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1)
    got = run(compiled, opt, steps=25, micro=micro)
    ref = run(twin, ref_opt, steps=25, micro=micro, clip=MAX_NORM if mode == "clip" else None)
    assert got == pytest.approx(ref, rel=1e-5, abs=1e-6)
    for a, b in zip(net.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    if mode == "clip":
        assert opt.last_grad_norm is not None and float(opt.last_grad_norm) > MAX_NORM  # the clip did something
    if mode == "in_backward":
        report = opt.scheduler.report()
        assert report["units"] > 1 and report["units_updated_in_backward"] == 25 * report["units"]
