"""ZeRO under torch.compile: 2 gloo CPU processes (one spawn for every case) against one process.

A compiled training step (forward, backward, ``step()``, ``zero_grad()`` in one traced function) runs ``backward()``
where torch.compile broke its graph, in the traced function's thread: the grads' hooks that reduce the buckets inside
backward must run as they are, not traced. ``gather_in_forward`` completes the params' all-gathers in a forward
pre-hook that a compiled model does not call when the hook came after it compiled (the first forward, before any
step): the step after such a forward refuses, since its grads are of the params from before the last update, and
nothing is updated.
"""

from __future__ import annotations

import pytest
import torch
from helpers import recording_tracing
from ranks import run_ranks

STEPS = 5
ROWS = 8
LR = 1e-2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(7, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5)
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(200 + step)
    return torch.randn(ROWS, 7, generator=gen), torch.randn(ROWS, 5, generator=gen)


def _share(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _batch(step)
    lo, hi = rank * ROWS // world, (rank + 1) * ROWS // world
    return x[lo:hi], y[lo:hi]


def _optimizer(model: torch.nn.Module, stage: int, gather: bool):
    from kitsune import KitsuneOptimizer, ShardConfig

    shard = ShardConfig(stage=stage, bucket_bytes=1024, gather_in_forward=gather)
    base = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    return KitsuneOptimizer(base, enable_fusion=True, zero_stage=stage, shard_config=shard)


def _snap(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _compiled_step(rank: int, world: int) -> dict:
    """Stage 2, the buckets reduced inside backward, everything in one compiled function."""
    from kitsune.distributed.reduce import GradReduction

    torch._dynamo.reset()
    # at each bucket's reduction (from the grads' hooks) and at backward's end (autograd's callback): whether
    # torch.compile was tracing it
    traced: dict[str, list[bool]] = {"launch": [], "count_grads": []}
    real = {name: getattr(GradReduction, name) for name in traced}
    for name in traced:
        setattr(GradReduction, name, recording_tracing(real[name], traced[name]))
    model = _model()
    opt = _optimizer(model, stage=2, gather=False)

    @torch.compile(backend="eager")
    def train_step(x, y):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    snaps, reduced = [], []
    for step in range(STEPS):
        train_step(*_share(step, rank, world))
        snaps.append(_snap(model))
        report = {s["name"]: s for s in opt.subsystem_status()}["shard"]["report"]
        reduced.append((report["buckets_reduced_in_backward"], report["buckets"]))
    for name, fn in real.items():
        setattr(GradReduction, name, fn)
    status = {s["name"]: s for s in opt.subsystem_status()}
    fused = status["fusion"]["report"]["params_fused"]
    return {"snaps": snaps, "reduced": reduced, "fused": fused, "traced": traced}


def _gather_compiled_model(rank: int, world: int) -> dict:
    """``gather_in_forward`` with a model compiled before any step: the second step refuses; with
    ``optimizer.wait_params()`` before each forward from then on, it trains as one process does."""
    torch._dynamo.reset()
    model = _model()
    opt = _optimizer(model, stage=1, gather=True)
    compiled = torch.compile(model, backend="eager")
    x, y = _share(0, rank, world)
    torch.nn.functional.mse_loss(compiled(x), y).backward()  # compiled here, before the hook exists
    opt.step()
    opt.zero_grad()
    x, y = _share(1, rank, world)
    torch.nn.functional.mse_loss(compiled(x), y).backward()  # the all-gathers still pending: the old values
    state = {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state.items()}
    try:
        opt.step()
        error = None
    except RuntimeError as e:
        error = str(e)
    after_error = {"error": error, "params": _snap(model), "step_count": opt.step_count}
    after_error["state_kept"] = all(
        torch.equal(v, state[k][n]) for k, s in opt.state.items() for n, v in s.items() if torch.is_tensor(v)
    )
    try:
        opt.step()  # the same grads again: still refused
        after_error["second"] = None
    except RuntimeError as e:
        after_error["second"] = str(e)
    opt.zero_grad()
    snaps = []
    for step in range(1, STEPS):
        opt.wait_params()
        x, y = _share(step, rank, world)
        torch.nn.functional.mse_loss(compiled(x), y).backward()
        opt.step()
        opt.zero_grad()
        opt.wait_params()
        snaps.append(_snap(model))
    return {"after_error": after_error, "snaps": snaps}


def _gather_compiled_after_a_step(rank: int, world: int) -> dict:
    """``gather_in_forward`` with the model compiled while gathers are pending (the hook in place): the hook runs as
    it is at each module (a graph break), not traced, and the model trains as one process does."""
    from kitsune.distributed.zero import ShardSubsystem

    torch._dynamo.reset()
    traced: list[bool] = []  # at each module's wait for its params: whether torch.compile was tracing it
    real = ShardSubsystem.wait_params
    # the hook's calls pass the module's params (the step's and optimizer.wait_params()'s pass none)
    ShardSubsystem.wait_params = recording_tracing(real, traced, when=lambda self, params=None: params is not None)
    model = _model()
    opt = _optimizer(model, stage=1, gather=True)
    compiled = torch.compile(model, backend="eager")
    for step in range(STEPS):  # no wait_params() in the loop: each forward's hooks complete the gathers
        x, y = _share(step, rank, world)
        torch.nn.functional.mse_loss((model if step == 0 else compiled)(x), y).backward()
        opt.step()
        opt.zero_grad()
    opt.wait_params()  # the last step's
    ShardSubsystem.wait_params = real
    return {"params": _snap(model), "traced": traced}


def _cases(rank: int, world: int) -> dict:
    return {
        "compiled_step": _compiled_step(rank, world),
        "gather_compiled_model": _gather_compiled_model(rank, world),
        "gather_compiled_after_a_step": _gather_compiled_after_a_step(rank, world),
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_cases, world=2, timeout_s=240)


@pytest.fixture(scope="module")
def reference() -> list[list[torch.Tensor]]:
    """One process, torch's AdamW on every whole batch: the params after each step."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    snaps = []
    for step in range(STEPS):
        torch.nn.functional.mse_loss(model(_batch(step)[0]), _batch(step)[1]).backward()
        opt.step()
        opt.zero_grad()
        snaps.append(_snap(model))
    return snaps


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


def test_a_compiled_training_step_reduces_inside_backward(ranks, reference):
    for rank in ranks:
        got = rank["compiled_step"]
        assert got["fused"] > 0
        assert all(done == buckets > 1 for done, buckets in got["reduced"]), got["reduced"]  # the hooks ran
        launched = sum(done for done, _ in got["reduced"])
        assert got["traced"] == {"launch": [False] * launched, "count_grads": [False] * STEPS}  # never traced
        for snap, want in zip(got["snaps"], reference, strict=True):
            _close(snap, want)


def test_gather_in_forward_refuses_a_step_after_a_compiled_forward_read_old_params(ranks, reference):
    for rank in ranks:
        got = rank["gather_compiled_model"]["after_error"]
        assert got["error"] is not None and "gather_in_forward=False" in got["error"], got["error"]
        assert "wait_params()" in got["error"] and "torch.compile" in got["error"]
        assert got["second"] == got["error"]  # the same grads are refused again, until zero_grad()
        assert got["step_count"] == 1 and got["state_kept"]
        _close(got["params"], reference[0])  # the first step's update on every rank, nothing more


def test_gather_in_forward_with_a_compiled_model_and_wait_params(ranks, reference):
    """From the refused step on, ``wait_params()`` before each forward: batches 1.. as one process trains on them."""
    for rank in ranks:
        for snap, want in zip(rank["gather_compiled_model"]["snaps"], reference[1:], strict=True):
            _close(snap, want)


def test_gather_in_forward_with_a_model_compiled_while_gathers_pend(ranks, reference):
    for rank in ranks:
        got = rank["gather_compiled_after_a_step"]
        assert got["traced"] and not any(got["traced"])  # the modules' hooks waited, never traced
        _close(got["params"], reference[-1])
