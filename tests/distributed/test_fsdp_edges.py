"""FSDP2 (DTensor) params at the edges of the plan: uneven shards, torch's fallback routes, the inf-norm's value,
kitsune.optim.Muon, and ZeRO on top. 2 gloo CPU processes, one spawn for every case, against one process.

Every rank must plan alike (the planner's decisions pick the collectives a step runs: a rank that fused its grad
pass while the other clipped with torch ops mismatched the all-reduces); torch's fused SGD and Adagrad ops have no
DTensor sharding strategy; the inf-norm of FSDP2 grads comes back from torch as each rank's own max (Partial);
Muon orthogonalises whole matrices, so a shard is not enough.
"""

from __future__ import annotations

import math

import pytest
import torch
from ranks import case_results, run_cases, run_ranks

WORLD = 2
TIMEOUT_S = 180

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")


def _params(mesh, shapes, seed: int, dtype=torch.float32) -> tuple[list, list]:
    """FSDP2-like params (Shard(0) DTensors, uneven where a dim 0 is odd) and one process's whole copies."""
    from torch.distributed.tensor import Shard, distribute_tensor

    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]
    sharded = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)], src_data_rank=None)) for t in full]
    return sharded, [torch.nn.Parameter(t.clone()) for t in full]


def _grads(params, whole, gen) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    for p, w in zip(params, whole, strict=True):
        g = torch.randn(w.shape, generator=gen, dtype=torch.float64).to(w.dtype)
        w.grad = g.clone()
        p.grad = distribute_tensor(g.clone(), p.device_mesh, [Shard(0)], src_data_rank=None)


def _diff(params, whole) -> float:
    """The largest difference between the FSDP2 params (gathered) and the one process's whole ones."""
    return max((p.full_tensor() - w).abs().max().item() for p, w in zip(params, whole, strict=True))


def _side_by_side(params, whole, opt, ref, seed: int) -> float:
    """4 steps of ``opt`` over the FSDP2 params and ``ref`` over the whole ones, on the same fresh grads: `_diff`."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(4):
        _grads(params, whole, gen)
        opt.step()
        ref.step()
    return _diff(params, whole)


def _uneven_routes(mesh) -> dict:
    """A (3, 4096) param: two rows on rank 0, one on rank 1 (and a one-row param all on rank 0). The planner
    weighed each rank's shard, so a bucket near ``min_fusion_benefit`` was fused on one rank and not the other."""
    from kitsune import FusionConfig, KitsuneOptimizer

    params, _ = _params(mesh, [(3, 4096), (1, 8)], seed=1)
    opt = KitsuneOptimizer(
        torch.optim.AdamW(params, lr=1e-2), enable_fusion=True, fusion_config=FusionConfig(min_fusion_benefit=0)
    )
    return {"plan": [(b.route.value, b.predicted_speedup, b.predicted_ms) for b in opt.plan.buckets]}


def _torch_fallback(mesh, name: str) -> dict:
    """float64 FSDP2 params (no fused kernel for them) of SGD and Adagrad: the torch route took ``fused=True``,
    whose ops have no DTensor strategy (NotImplementedError), where plain torch (foreach) trains."""
    from kitsune import KitsuneOptimizer

    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01),
        "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, weight_decay=0.01),
    }[name]
    params, whole = _params(mesh, [(5, 3), (7,)], seed=2, dtype=torch.float64)
    opt, ref = KitsuneOptimizer(make(params), enable_fusion=True), make(whole)
    diff = _side_by_side(params, whole, opt, ref, seed=3)
    return {"diff": diff, "routes": sorted({b.route.value for b in opt.plan.buckets})}


def _inf_norm_torch_route(mesh) -> dict:
    """The inf-norm clipped by torch's ops (the grad pass not fused): torch returns a Partial(max) DTensor, and
    ``last_grad_norm`` took its local value, each rank's own max."""
    from kitsune import FusionConfig, GradConfig, KitsuneOptimizer

    params, whole = _params(mesh, [(6, 3), (5,)], seed=4)
    opt = KitsuneOptimizer(
        torch.optim.AdamW(params, lr=1e-2),
        enable_fusion=True,
        fusion_config=FusionConfig(enable_reduction=False),
        grad_config=GradConfig(max_norm=0.3, norm_type=math.inf),
    )
    ref = torch.optim.AdamW(whole, lr=1e-2)
    gen = torch.Generator().manual_seed(5)
    norms, ref_norms = [], []
    for _ in range(3):
        _grads(params, whole, gen)
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(whole, 0.3, norm_type=math.inf)))
        ref.step()
        opt.step()
        norms.append(float(opt.last_grad_norm))
    diff = _diff(params, whole)
    return {"norms": norms, "ref_norms": ref_norms, "diff": diff, "grad_pass": opt._subsystem("fusion").grad_pass}


def _muon(mesh) -> dict:
    """kitsune.optim.Muon over FSDP2 matrices (rows 5 and 7: uneven shards): each rank gathers a matrix,
    orthogonalises it whole and keeps its share; equal to one process over the whole matrices. It raised (a plain
    batch buffer written from DTensors) after it had already moved the momentum."""
    from kitsune import KitsuneOptimizer
    from kitsune.optim import Muon

    params, whole = _params(mesh, [(5, 4), (7, 6)], seed=6)
    results = {}
    for wrapped in (False, True):
        ps = [torch.nn.Parameter(p.detach().clone()) for p in params]
        ws = [torch.nn.Parameter(w.detach().clone()) for w in whole]
        opt = Muon(ps, lr=0.02, weight_decay=0.01, nesterov=True)
        opt = KitsuneOptimizer(opt, enable_fusion=True) if wrapped else opt
        ref = Muon(ws, lr=0.02, weight_decay=0.01, nesterov=True)
        diff = _side_by_side(ps, ws, opt, ref, seed=7)
        moved = min((p.full_tensor() - w0).abs().max().item() for p, w0 in zip(ps, whole, strict=True))
        results["wrapped" if wrapped else "bare"] = {"diff": diff, "moved": moved}
    return results


def _zero_refused(mesh) -> dict:
    from kitsune import KitsuneOptimizer, ShardConfig

    params, _ = _params(mesh, [(6, 3)], seed=8)
    try:
        KitsuneOptimizer(torch.optim.AdamW(params), zero_stage=1, shard_config=ShardConfig(stage=1))
    except ValueError as e:
        return {"refused": str(e)}
    return {"refused": None}


def _scenarios(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    jobs = {
        "uneven_routes": lambda: _uneven_routes(mesh),
        "sgd": lambda: _torch_fallback(mesh, "sgd"),
        "adagrad": lambda: _torch_fallback(mesh, "adagrad"),
        "inf_norm": lambda: _inf_norm_torch_route(mesh),
        "muon": lambda: _muon(mesh),
        "zero": lambda: _zero_refused(mesh),
    }
    return run_cases(jobs)


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_scenarios, world=WORLD, timeout_s=TIMEOUT_S)


_results = case_results


def test_every_rank_weighs_an_uneven_shard_alike(ranks):
    a, b = _results(ranks, "uneven_routes")
    assert a["plan"] == b["plan"]
    assert all(route == "triton" and speedup is not None for route, speedup, _ in a["plan"])


@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_torch_route_on_fsdp2_params_takes_foreach(ranks, name):
    for r in _results(ranks, name):
        assert r["routes"] == ["torch_foreach"]
        assert r["diff"] < 1e-12


def test_inf_norm_of_fsdp2_grads_is_the_global_one(ranks):
    for r in _results(ranks, "inf_norm"):
        assert r["grad_pass"] is not None  # torch's ops clip: the case at hand
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-6)
        assert r["diff"] < 1e-5


def test_muon_over_fsdp2_orthogonalises_whole_matrices(ranks):
    for r in _results(ranks, "muon"):
        for route in ("bare", "wrapped"):
            assert r[route]["moved"] > 1e-3, route
            assert r[route]["diff"] < 1e-5, (route, r[route]["diff"])


def test_zero_over_fsdp2_is_refused_naming_the_fix(ranks):
    for r in _results(ranks, "zero"):
        assert r["refused"] is not None and "FSDP2 already shards" in r["refused"] and "zero_stage=0" in r["refused"]
