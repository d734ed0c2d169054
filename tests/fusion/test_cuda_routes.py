"""On a real GPU: the one-line default fuses every optimizer kitsune has a kernel for, on a small parameter set and
on a quarter-scale GPT-2 124M set (what benchmarks/route-check.py then measures against the fallback, full size)."""

from __future__ import annotations

import pytest
import torch

from kitsune import KitsuneOptimizer
from kitsune.bench.params import get_param_set
from kitsune.fusion import Route
from kitsune.fusion.algos import ALGOS

pytestmark = pytest.mark.cuda

_SETS = {
    "small": [(256,)] * 4 + [(64, 64)] * 4,
    "gpt2": [shape for _, shape in get_param_set("gpt2", 0.25).shapes],  # a quarter of each tensor: 31M elements
}


@pytest.mark.parametrize("set_name", list(_SETS))
@pytest.mark.parametrize("cls", list(ALGOS), ids=lambda c: c.__qualname__)
def test_default_route_is_fused(cls, set_name):
    shapes = _SETS[set_name]
    if "Muon" in cls.__qualname__:
        shapes = [s for s in shapes if len(s) == 2]  # Muon orthogonalises matrices
    params = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = KitsuneOptimizer(cls(params, **_required(cls)), enable_fusion=True)
    before = [p.detach().clone() for p in params[:3]]
    opt.step()
    routes = {b.route for b in opt.plan.buckets}
    assert routes <= {Route.TRITON, Route.TRITON_MATMUL}, [(b.route, b.reason) for b in opt.plan.buckets]
    assert opt.plan.fused_tensors == len(params)
    assert all(not torch.equal(a, p) for a, p in zip(before, params, strict=False))


def _required(cls) -> dict:
    """Arguments a class has no default for (SGD's lr in old torch versions)."""
    return {"lr": 1e-2} if cls is torch.optim.SGD else {}
