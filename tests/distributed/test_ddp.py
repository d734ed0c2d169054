"""DistributedDataParallel with kitsune: 2 CPU processes on gloo (spawned, with a timeout) against one process.

Each rank trains on its half of every batch; DDP averages the grads in backward, so after each step both ranks
must hold the params a single process gets from the whole batch. The fused kernels run in Triton's interpreter
inside the ranks (TRITON_INTERPRET=1), so the fused path is what is checked, not the wrapped optimizer's.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
import torch
from ranks import run_ranks

STEPS = 6
FEATURES = {
    "fused": {"enable_fusion": True},
    "fused_clip_zero": {"enable_fusion": True, "max_grad_norm": 0.5, "zero_in_step": True},
    "fused_bf16_profile": {"enable_fusion": True, "amp": "bf16", "profile": True, "max_grad_norm": 1.0},
    # updates inside backward would read each rank's own grads before DDP averages them: they run in step()
    "fused_step_in_backward": {"enable_fusion": True, "step_in_backward": True},
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 7, generator=gen), torch.randn(8, 5, generator=gen)) for _ in range(STEPS)]


def _optimizer(params, features: dict):
    from kitsune import AMPConfig, GradConfig, KitsuneOptimizer, StreamConfig

    kwargs = {k: v for k, v in features.items() if k in ("enable_fusion", "profile")}
    if features.get("step_in_backward"):
        kwargs["stream_config"] = StreamConfig(step_in_backward=True)
    if "amp" in features:
        kwargs.update(enable_amp=True, amp_config=AMPConfig(dtype=torch.bfloat16))
    grads = GradConfig(max_norm=features.get("max_grad_norm"), zero_in_step=features.get("zero_in_step", False))
    return KitsuneOptimizer(torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1), grad_config=grads, **kwargs)


def _train(model, opt, batches, rank: int, world: int) -> None:
    for x, y in batches:
        lo, hi = rank * len(x) // world, (rank + 1) * len(x) // world
        with opt.autocast():
            loss = torch.nn.functional.mse_loss(model(x[lo:hi]).float(), y[lo:hi])
        opt.backward(loss)
        opt.step()
        opt.zero_grad()


def _features(rank: int, world: int) -> dict:
    """Every feature set, trained on this rank's half of each batch under DDP."""
    out = {}
    for name, features in FEATURES.items():
        model = torch.nn.parallel.DistributedDataParallel(_model())
        opt = _optimizer(model.parameters(), features)
        _train(model, opt, _batches(), rank, world)
        status = {s["name"]: s for s in opt.subsystem_status()}
        params = [p.detach() for p in model.module.parameters()]
        out[name] = {
            "params": params,
            "fused": status["fusion"]["report"]["params_fused"],
            "streams": (status["streams"]["active"], status["streams"]["reason"]),
        }
    return out


@pytest.fixture(scope="module")
def trained() -> list[dict]:
    return run_ranks(_features, world=2, timeout_s=120)


@pytest.mark.parametrize("name", list(FEATURES))
def test_ddp_two_ranks_equal_one_process(name, trained, monkeypatch):
    features = FEATURES[name]
    ranks = [r[name] for r in trained]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from triton.runtime.interpreter import InterpretedFunction  # (not at import: the rank processes import this file)

    update = sys.modules.get("kitsune.kernels.update")
    if update is None or not isinstance(update._update_kernel, InterpretedFunction):
        # on a GPU machine the kernels are compiled for it, and the CPU params here cannot take them
        pytest.skip("the interpreted kernels are imported by tests/conftest.py on CPU-only machines")
    model = _model()
    opt = _optimizer(model.parameters(), features)
    _train(model, opt, _batches(), 0, 1)
    # bf16 autocast rounds the half-batch forward differently from the whole batch's
    tol = 5e-4 if "amp" in features else 2e-5
    for r in ranks:
        assert r["fused"] == 4  # the ranks ran kitsune's fused kernels, not the wrapped optimizer's step
        for got, want in zip(r["params"], model.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach(), atol=tol, rtol=tol)
    for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(a, b)  # DDP keeps the replicas identical


def test_ddp_turns_updates_inside_backward_off_with_the_reason(trained):
    """Each rank's hooks fire on its own grads, before DDP averages them (the ranks drifted apart by 0.1 in 5 steps):
    the updates run in step(), on the averaged grads, and the streams report says why."""
    for r in trained:
        active, reason = r["fused_step_in_backward"]["streams"]
        assert not active and "torch.distributed runs 2 ranks" in reason


def _built_before_the_group(rank: int, world: int) -> dict:
    """Updates inside backward asked for by an optimizer built before ``init_process_group`` (one rank then, so the
    plan took them), then DDP over 2 ranks: each rank updated inside backward from its own grads, before DDP averaged
    them (the ranks 9e-2 apart after 5 steps with grads zeroed in place, no error). The group re-initialised here
    through a file store (the harness started it first)."""
    import os

    import torch.distributed as dist

    port = os.environ["MASTER_PORT"]
    dist.destroy_process_group()
    model = _model()
    opt = _optimizer(model.parameters(), {"enable_fusion": True, "step_in_backward": True})
    planned = opt._subsystem("streams").in_backward
    dist.init_process_group("gloo", init_method=f"file://{tempfile.gettempdir()}/kitsune-ddp-{port}", rank=rank,
                            world_size=world)  # fmt: skip
    ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    for x, y in _batches():
        lo, hi = rank * len(x) // world, (rank + 1) * len(x) // world
        torch.nn.functional.mse_loss(ddp(x[lo:hi]), y[lo:hi]).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    status = {s["name"]: s for s in opt.subsystem_status()}
    return {
        "planned": planned,
        "streams": (status["streams"]["active"], status["streams"]["reason"]),
        "params": [p.detach().clone() for p in model.parameters()],
    }


def test_updates_inside_backward_planned_before_the_process_group_move_to_the_step(monkeypatch):
    """The first backward after the group started launches no update inside it and the step plans again without
    them (the reason names the ranks): every step updates on DDP's averaged grads, as one process over whole
    batches."""
    try:
        ranks = run_ranks(_built_before_the_group, world=2, timeout_s=120)
    finally:
        for store in Path(tempfile.gettempdir()).glob("kitsune-ddp-*"):
            store.unlink(missing_ok=True)
    for r in ranks:
        assert r["planned"]
        active, reason = r["streams"]
        assert not active and "torch.distributed runs 2 ranks" in reason
    for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(a, b)
    model = _model()
    ref = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in _batches():
        torch.nn.functional.mse_loss(model(x), y).backward()
        ref.step()
        ref.zero_grad(set_to_none=False)
    for got, want in zip(ranks[0]["params"], model.parameters(), strict=True):
        torch.testing.assert_close(got, want.detach(), atol=2e-5, rtol=2e-5)


class _Branchy(torch.nn.Module):
    """A net whose ``c`` is left out of some forwards (its params unused on those steps)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(7, 16), torch.nn.Linear(16, 5), torch.nn.Linear(16, 5)

    def forward(self, x: torch.Tensor, branch: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h) + self.c(h) if branch else self.b(h)


def _bucket_views(rank: int, world: int) -> dict:
    """DDP with ``gradient_as_bucket_view=True`` (the grads are views of DDP's buckets) and unused params on every
    third step: torch's AdamW and kitsune's fused step under the same DDP, grads set to None and zeroed."""
    from kitsune import KitsuneOptimizer

    out = {}
    for kind in ("torch", "kitsune"):
        for set_to_none in (True, False):
            torch.manual_seed(0)
            net = _Branchy()
            model = torch.nn.parallel.DistributedDataParallel(
                net, gradient_as_bucket_view=True, find_unused_parameters=True
            )
            base = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
            opt = base if kind == "torch" else KitsuneOptimizer(base, enable_fusion=True)
            gen = torch.Generator().manual_seed(1)
            snaps = []
            for step in range(STEPS + 3):
                x, y = torch.randn(8, 7, generator=gen), torch.randn(8, 5, generator=gen)
                lo, hi = rank * len(x) // world, (rank + 1) * len(x) // world
                torch.nn.functional.mse_loss(model(x[lo:hi], step % 3 != 1), y[lo:hi]).backward()
                opt.step()
                opt.zero_grad(set_to_none=set_to_none)
                snaps.append([p.detach().clone() for p in net.parameters()])
            out[kind, set_to_none] = snaps
            if kind == "kitsune":
                out["routes", set_to_none] = {b.route.value for b in opt.plan.buckets}
    return out


@pytest.fixture(scope="module")
def bucket_views() -> list[dict]:
    return run_ranks(_bucket_views, world=2, timeout_s=120)


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set-to-none", "zeroed"])
def test_ddp_grads_as_bucket_views_with_unused_params_train_as_torch(set_to_none, bucket_views):
    for rank in bucket_views:
        assert rank["routes", set_to_none] == {"triton"}
        for step, (got, want) in enumerate(zip(rank["kitsune", set_to_none], rank["torch", set_to_none], strict=True)):
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=lambda m, s=step: f"step {s}: {m}")
