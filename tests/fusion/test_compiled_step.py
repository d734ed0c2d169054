"""kitsune called inside a function that torch.compile traces: a compiled training step (forward, backward, clip,
``optimizer.step()``, ``zero_grad()``) and torch's recipe of a compiled ``opt.step()``.

kitsune's step runs outside the trace (a graph break), as it runs without the compiler, and trains as torch.optim
does; with ``fullgraph=True`` torch.compile raises, naming the fix, before anything changes. ``kitsune.clip_grad_norm_``
is torch's function there, traced with the rest. The ``eager`` backend traces without compiling kernels (quick on a
CPU); ``aot_eager`` traces forward and backward as inductor does."""

from __future__ import annotations

import pytest
import torch
from helpers import recording_tracing, routes
from torch import nn

import kitsune
from kitsune import KitsuneOptimizer, checkpoint
from kitsune.config import FusionConfig, KitsuneConfig, StreamConfig
from kitsune.grads import GradPass
from kitsune.streams import StreamScheduler

STEPS = 12
MAX_NORM = 0.3


def _nets(device: torch.device) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(device)
    twin = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(device)
    twin.load_state_dict(net.state_dict())
    return net, twin


def _data(device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    return [
        (torch.randn(8, 6, generator=gen).to(device), torch.randn(8, 3, generator=gen).to(device)) for _ in range(STEPS)
    ]


def _adamw(net: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(net.parameters(), lr=2e-2, betas=(0.8, 0.95), weight_decay=0.1)


def _reference(twin: nn.Module, data: list) -> list[list[torch.Tensor]]:
    """torch's AdamW, eager, torch's clip: the params after each step."""
    opt = _adamw(twin)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 / (1 + i))
    snaps = []
    for x, y in data:
        nn.functional.mse_loss(twin(x), y).backward()
        torch.nn.utils.clip_grad_norm_(twin.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        sched.step()
        snaps.append([p.detach().clone() for p in twin.parameters()])
    return snaps


def _assert_close(got: list[list[torch.Tensor]], ref: list[list[torch.Tensor]]) -> None:
    assert len(got) == len(ref) == STEPS
    for step, (a, b) in enumerate(zip(got, ref, strict=True)):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, atol=2e-6, rtol=1e-5, msg=lambda m, s=step: f"step {s}: {m}")


def _spy(monkeypatch: pytest.MonkeyPatch, owner: type, name: str, seen: list[bool]) -> None:
    """Record, at each call of ``owner.name``, whether torch.compile is tracing it (a traced call records True)."""
    monkeypatch.setattr(owner, name, recording_tracing(getattr(owner, name), seen))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_compiled_training_step_trains_like_torch(backend, device, monkeypatch):
    torch._dynamo.reset()
    seen: dict[str, list[bool]] = {"step": [], "zero_grad": []}
    _spy(monkeypatch, KitsuneOptimizer, "_step", seen["step"])  # the step's work, past the hooks
    _spy(monkeypatch, GradPass, "zero_grad", seen["zero_grad"])  # zero_grad's
    net, twin = _nets(device)
    data = _data(device)
    opt = KitsuneOptimizer(_adamw(net), enable_fusion=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 / (1 + i))

    @torch.compile(backend=backend)
    def train_step(x, y):
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        kitsune.clip_grad_norm_(net.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        return loss

    snaps = []
    for x, y in data:
        train_step(x, y)
        sched.step()
        assert all(p.grad is None for p in net.parameters())  # zero_grad() ran, set_to_none as torch's
        snaps.append([p.detach().clone() for p in net.parameters()])
    assert routes(opt) == {"triton"}, opt.plan  # kitsune's fused step, not a fallback
    assert opt.step_count == STEPS
    assert seen == {"step": [False] * STEPS, "zero_grad": [False] * STEPS}  # run as they are, never traced
    _assert_close(snaps, _reference(twin, data))


def test_torchs_recipe_of_a_compiled_step(device):
    """torch's "compiling the optimizer" recipe: ``step()`` inside ``@torch.compile(fullgraph=False)``."""
    torch._dynamo.reset()
    net, twin = _nets(device)
    data = _data(device)
    opt = KitsuneOptimizer(_adamw(net), enable_fusion=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 / (1 + i))

    @torch.compile(fullgraph=False, backend="eager")
    def step():
        opt.step()

    snaps = []
    for x, y in data:
        nn.functional.mse_loss(net(x), y).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)
        step()
        opt.zero_grad()
        sched.step()
        snaps.append([p.detach().clone() for p in net.parameters()])
    assert routes(opt) == {"triton"}, opt.plan
    _assert_close(snaps, _reference(twin, data))


def test_fullgraph_raises_naming_the_fix_and_changes_nothing(device):
    torch._dynamo.reset()
    net, _ = _nets(device)
    opt = KitsuneOptimizer(_adamw(net), enable_fusion=True)
    x, y = _data(device)[0]
    for _ in range(2):  # state to keep
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    params = [p.detach().clone() for p in net.parameters()]
    grads = [p.grad.clone() for p in net.parameters()]
    state = {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state_dict()["state"].items()}

    @torch.compile(fullgraph=True, backend="eager")
    def step():
        opt.step()

    with pytest.raises(Exception, match="fullgraph=True") as info:
        step()
    assert "kitsune" in str(info.value) and "torch.compile(model)" in str(info.value)
    assert opt.step_count == 2
    for p, before, g in zip(net.parameters(), params, grads, strict=True):
        assert torch.equal(p, before) and torch.equal(p.grad, g)
    for k, s in opt.state_dict()["state"].items():
        for n, v in s.items():
            assert torch.equal(v, state[k][n]), (k, n)
    opt.step()  # and the step still runs as before
    assert opt.step_count == 3


def test_clip_is_torchs_inside_a_compiled_function(device):
    """No graph break for the clip: torch's function, traced (``fullgraph=True`` compiles)."""
    torch._dynamo.reset()
    net, twin = _nets(device)
    x, y = _data(device)[0]
    for model in (net, twin):
        nn.functional.mse_loss(model(x), y).backward()

    @torch.compile(fullgraph=True, backend="eager")
    def clip(params):
        return kitsune.clip_grad_norm_(params, MAX_NORM)

    norm = clip(list(net.parameters()))
    ref = torch.nn.utils.clip_grad_norm_(twin.parameters(), MAX_NORM)
    assert float(ref) > MAX_NORM  # the clip did something
    torch.testing.assert_close(norm, ref)
    for a, b in zip(net.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_checkpoints_and_param_groups_inside_a_compiled_function(device, monkeypatch):
    """As torch.optim's: state_dict, load_state_dict and add_param_group run outside the trace."""
    torch._dynamo.reset()
    seen: list[bool] = []
    _spy(monkeypatch, checkpoint, "own_state", seen)  # state_dict's
    _spy(monkeypatch, KitsuneOptimizer, "_replan", seen)  # load_state_dict's and add_param_group's
    net, _ = _nets(device)
    opt = KitsuneOptimizer(_adamw(net), enable_fusion=True)
    x, y = _data(device)[0]
    nn.functional.mse_loss(net(x), y).backward()
    opt.step()
    eager = opt.state_dict()
    traced = torch.compile(lambda: opt.state_dict(), backend="eager")()
    assert traced["param_groups"] == eager["param_groups"]
    for k, s in eager["state"].items():
        for n, v in s.items():
            assert torch.equal(traced["state"][k][n], v)
    torch.compile(lambda sd: opt.load_state_dict(sd), backend="eager")(eager)
    extra = nn.Parameter(torch.randn(4, device=device))
    torch.compile(lambda: opt.add_param_group({"params": [extra], "lr": 1e-3}), backend="eager")()
    assert opt.param_groups[-1]["params"] == [extra] and opt.param_groups[-1]["lr"] == 1e-3
    assert len(seen) >= 4 and not any(seen), seen  # run as they are, never traced


@pytest.mark.cuda
def test_a_model_compiled_with_reduce_overhead_trains_like_torch():
    """On a GPU: the model compiled by inductor (``reduce-overhead``: its forward and backward replay CUDA graphs of
    torch's, the grads outputs of them) and kitsune's default step, with its own graph, past its warm-up and
    capture; torch's AdamW on the twin model, compiled the same way."""
    torch._dynamo.reset()
    device = torch.device("cuda")
    net, twin = _nets(device)
    gen = torch.Generator().manual_seed(5)
    data = [(torch.randn(8, 6, generator=gen).cuda(), torch.randn(8, 3, generator=gen).cuda()) for _ in range(20)]
    runs = []
    for model, opt in ((net, KitsuneOptimizer(_adamw(net), enable_fusion=True)), (twin, _adamw(twin))):
        compiled = torch.compile(model, mode="reduce-overhead")
        for x, y in data:
            torch.compiler.cudagraph_mark_step_begin()
            nn.functional.mse_loss(compiled(x), y).backward()
            opt.step()
            opt.zero_grad()
        runs.append(opt)
    assert routes(runs[0]) == {"triton"}, runs[0].plan
    assert runs[0]._subsystem("graphs").report()["replays"] > 0  # kitsune's own graph replayed
    for a, b in zip(net.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_updates_inside_a_compiled_functions_backward(device, monkeypatch):
    """``StreamConfig(step_in_backward=True)`` with ``backward()`` inside the traced function: autograd calls the
    hooks from the traced function's thread (a CPU param's grads) and from its own (a CUDA param's); either way the
    hooks, their launches and the callback at backward's end run as they are, not traced, and every unit updates
    inside backward."""
    torch._dynamo.reset()
    seen: dict[str, list[bool]] = {"launch": [], "ended": []}
    _spy(monkeypatch, StreamScheduler, "_launch", seen["launch"])
    _spy(monkeypatch, StreamScheduler, "_backward_ended", seen["ended"])
    net, twin = _nets(device)
    data = _data(device)
    config = KitsuneConfig(fusion=FusionConfig(enabled=True), streams=StreamConfig(step_in_backward=True))
    opt = KitsuneOptimizer(_adamw(net), config=config)
    assert opt.scheduler.active, opt.scheduler.reason

    @torch.compile(backend="eager")
    def train_step(x, y):
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    ref = _adamw(twin)
    for step, (x, y) in enumerate(data):
        train_step(x, y)
        nn.functional.mse_loss(twin(x), y).backward()
        ref.step()
        ref.zero_grad()
        for a, b in zip(net.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5, msg=lambda m, s=step: f"step {s}: {m}")
    assert routes(opt) == {"triton"}, opt.plan
    report = opt.scheduler.report()
    assert report["units_updated_in_backward"] == STEPS * report["units"] > 0, report
    assert seen == {"launch": [False] * STEPS * report["units"], "ended": [False] * STEPS}  # never traced
