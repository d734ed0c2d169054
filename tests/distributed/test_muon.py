"""Distributed Muon: 2 CPU processes on gloo (spawned once, with a timeout) against one process.

Every rank feeds the whole batch through DDP (so the averaged grads equal one process's bit for bit) and steps a
``kitsune.optim.Muon`` with ``process_group``: each rank orthogonalises its share of every shape's matrices, and
after the all-gather both ranks must hold exactly the params one process gets. Also: the same with the Triton
Newton-Schulz (Triton's interpreter), and ZeRO stage 1 around a plain Muon (whole matrices per rank, momentum
sharded).
"""

from __future__ import annotations

import os

import pytest
import torch
from ranks import run_ranks

STEPS = 3
MATRICES = {(16, 12): 1, (16, 16): 4, (4, 16): 1}  # per shape; padded to 2 matrices per rank
CASES = {
    "eager": {"triton": False},
    "triton": {"triton": True},
    "zero1": {"triton": False, "zero": True},
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 16),
        *(m for _ in range(4) for m in (torch.nn.Tanh(), torch.nn.Linear(16, 16))),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 4),
    )


def _muon(model: torch.nn.Module, process_group=None):
    from kitsune.optim import Muon

    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    groups = [{"params": matrices}, {"params": others, "use_muon": False, "lr": 1e-2}]
    # two Newton-Schulz iterations: the sharding is the point here (the iteration: tests/kernels/test_newton_schulz.py)
    return Muon(groups, lr=0.02, weight_decay=0.05, ns_steps=2, process_group=process_group)


def _train(model, opt) -> None:
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(200 + step)  # fresh random data every step, the same on every rank
        x, y = torch.randn(8, 12, generator=gen), torch.randn(8, 4, generator=gen)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _run_case(case: dict) -> dict:
    import torch.distributed as dist

    import kitsune.optim.muon as muon_module
    from kitsune import KitsuneOptimizer

    os.environ["TRITON_INTERPRET"] = "1" if case["triton"] else "0"
    calls = {"n": 0}
    eager = muon_module.zeropower_via_newtonschulz

    def counted(*args, **kwargs):
        calls["n"] += 1
        return eager(*args, **kwargs)

    muon_module.zeropower_via_newtonschulz = counted
    try:
        ref_model = _model()
        _train(ref_model, KitsuneOptimizer(_muon(ref_model)))
        ref_calls, calls["n"] = calls["n"], 0
        model = _model()
        if case.get("zero"):
            opt = KitsuneOptimizer(_muon(model), zero_stage=1)
        else:
            model = torch.nn.parallel.DistributedDataParallel(model)
            opt = KitsuneOptimizer(_muon(model.module, process_group=dist.group.WORLD), enable_fusion=True)
        _train(model, opt)
    finally:
        muon_module.zeropower_via_newtonschulz = eager
    module = getattr(model, "module", model)
    status = {s["name"]: s for s in opt.subsystem_status()}
    return {
        "params": [p.detach().clone() for p in module.parameters()],
        "ref_params": [p.detach().clone() for p in ref_model.parameters()],
        "calls": calls["n"],
        "ref_calls": ref_calls,
        "momentum_buffers": sum("momentum_buffer" in s for s in opt.state.values()),
        "fusion_reason": status["fusion"]["reason"] or "",
    }


def _cases(rank: int, world: int) -> dict:
    return {name: _run_case(case) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_cases, world=2, timeout_s=120)


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_equal_one_process(ranks, name):
    for r in ranks:
        for got, want in zip(r[name]["params"], r[name]["ref_params"], strict=True):
            assert torch.equal(got, want)  # the same grads, each matrix orthogonalised as in one process


def test_each_rank_orthogonalises_its_share(ranks):
    per_step = sum(MATRICES.values())
    assert ranks[0]["eager"]["ref_calls"] == STEPS * per_step
    shares = sum(-(-n // 2) for n in MATRICES.values())  # each shape padded to 2 ranks
    for r in ranks:
        assert r["eager"]["calls"] == STEPS * shares
        assert r["eager"]["momentum_buffers"] == per_step  # the momentum stays replicated
        assert "distributed Muon" in r["eager"]["fusion_reason"]  # the fused route leaves it to Muon's own step
    # ZeRO: each matrix on one rank, with its momentum
    assert sum(r["zero1"]["calls"] for r in ranks) == STEPS * per_step
    assert sum(r["zero1"]["momentum_buffers"] for r in ranks) == per_step


def test_orthogonalize_sharded_without_a_group_is_refused():
    from kitsune.distributed.muon import orthogonalize_sharded

    with pytest.raises((ValueError, RuntimeError)):
        orthogonalize_sharded(torch.zeros(3, 4, 4), lambda b: b)
