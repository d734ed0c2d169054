"""The tests' interpreter shortcuts (`interpreter_patch.skip_repeated_patching` and `remember_numpy_dtypes`) change
no bit: a fused 8-bit AdamW (the kernel with the most nested helpers) and a clipped fp32 AdamW step the same params
with and without them."""

from __future__ import annotations

import pytest
import torch
from triton.runtime import interpreter

from kitsune import FusionConfig, GradConfig, KitsuneOptimizer
from kitsune.fusion import Route

pytestmark = pytest.mark.skipif(
    not getattr(interpreter._patch_lang, "skips_repeats", False), reason="the shortcut is on only without a GPU"
)


def _run(precision: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    params = [torch.randn(n, generator=gen).requires_grad_() for n in (1000, 333, 4096)]
    first = [p.detach().clone() for p in params]
    opt = KitsuneOptimizer(
        torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
        enable_fusion=True,
        fusion_config=FusionConfig(state_precision=precision, min_8bit_size=0),
        grad_config=GradConfig(max_norm=1.0),
    )
    for _ in range(4):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    assert all(b.route is Route.TRITON for b in opt.plan.buckets), opt.plan.to_dict()
    assert not any(torch.equal(p, q) for p, q in zip(params, first, strict=True))  # the steps moved every param
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("precision", ["8bit", "param"])
def test_the_shortcut_steps_the_same_bits(precision, monkeypatch):
    shortcut = _run(precision)
    monkeypatch.setattr(interpreter, "_patch_lang", interpreter._patch_lang.original)
    cached = interpreter._get_np_dtype
    monkeypatch.setattr(interpreter, "_get_np_dtype", getattr(cached, "original", cached))
    full = _run(precision)
    for a, b in zip(shortcut, full, strict=True):
        assert torch.equal(a, b)
