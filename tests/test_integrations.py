"""How the frameworks drive a KitsuneOptimizer: Lightning's closure step, Accelerate's GradScaler step (on CPU).

Lightning's automatic optimization calls ``optimizer.step(closure)`` with forward and backward inside the closure.
Accelerate makes fp16 loss scaling only on a GPU; here its ``AcceleratedOptimizer`` gets a CPU
``torch.amp.GradScaler`` directly, which is what ``Accelerator(mixed_precision="fp16")`` hands it on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kitsune import KitsuneOptimizer


def closure_steps(use_kitsune: bool, steps: int = 3) -> tuple[torch.Tensor, list[float]]:
    """SGD steps through ``step(closure)``, as Lightning makes them, clipped to norm 0.1 by kitsune or by torch."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    x, y = 10 * torch.randn(16, 8), torch.randn(16, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = KitsuneOptimizer(sgd, max_grad_norm=0.1) if use_kitsune else sgd
    norms = []

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if not use_kitsune:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1).item())
        return loss

    for _ in range(steps):
        optimizer.step(closure)
        if use_kitsune:
            norms.append(optimizer.last_grad_norm.item())
    return model.weight.detach().clone(), norms


def test_max_grad_norm_clips_the_grads_of_the_closure():
    kitsune_weight, kitsune_norms = closure_steps(use_kitsune=True)
    torch_weight, torch_norms = closure_steps(use_kitsune=False)
    assert kitsune_norms == pytest.approx(torch_norms)
    assert torch.equal(kitsune_weight, torch_weight)


# torch's scheduler notices that Accelerate swapped optimizer.step for its own wrapper during the GradScaler step
ACCELERATE_STEP_SWAP = pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")


@pytest.fixture
def accelerator():
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed")
    yield accelerate.Accelerator(cpu=True)
    # Accelerate keeps one process-wide state: leave none behind
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)


def overflowing_step(use_kitsune: bool, fused: bool = False) -> dict:
    """One fp16 step whose grads are all inf/nan, through Accelerate's optimizer and scheduler wrappers."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1.0, fused=fused or None)
    if use_kitsune:
        optimizer = KitsuneOptimizer(optimizer)
    scaler = torch.amp.GradScaler("cpu")
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.scheduler import AcceleratedScheduler

    prepared = AcceleratedOptimizer(optimizer, device_placement=False, scaler=scaler)
    scheduler = AcceleratedScheduler(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5), prepared)
    before = model.weight.detach().clone()
    scaler.scale(model(torch.randn(2, 4)).sum() * float("inf")).backward()
    prepared.step()
    scheduler.step()
    return {
        "params unchanged": torch.equal(before, model.weight),
        "scale": scaler.get_scale(),
        "step_was_skipped": prepared.step_was_skipped,
        "lr": optimizer.param_groups[0]["lr"],
    }


@ACCELERATE_STEP_SWAP
def test_overflow_skips_the_update_as_with_the_plain_optimizer(accelerator):
    for use_kitsune in (False, True):
        out = overflowing_step(use_kitsune)
        assert out["params unchanged"] and out["scale"] == 32768.0, out
    assert overflowing_step(use_kitsune=False) == {
        "params unchanged": True,
        "scale": 32768.0,
        "step_was_skipped": True,
        "lr": 1.0,  # the schedule waits for a step that happened
    }


@ACCELERATE_STEP_SWAP
def test_accelerate_reads_the_skipped_step_as_with_torch_fused(accelerator):
    # kitsune, like torch's fused=True optimizers, takes GradScaler's found_inf into its step and skips the update
    # there (no host sync), so Accelerate, which infers a skip from step() not being called, reads no skip
    torch_fused = overflowing_step(use_kitsune=False, fused=True)
    assert overflowing_step(use_kitsune=True) == torch_fused
    assert torch_fused["params unchanged"] and not torch_fused["step_was_skipped"], torch_fused


def _lightning_proxy(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    core = pytest.importorskip("lightning.pytorch.core.optimizer", reason="lightning is not installed")
    return core.LightningOptimizer(opt)  # what self.optimizers() returns in a LightningModule


def _fabric_proxy(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    wrappers = pytest.importorskip("lightning.fabric.wrappers", reason="lightning is not installed")
    return wrappers._FabricOptimizer(opt, strategy=None)  # what fabric.setup(model, optimizer) hands back


@pytest.mark.parametrize("action", ["add_param_group", "load_state_dict"])
@pytest.mark.parametrize("proxy", [_lightning_proxy, _fabric_proxy], ids=["lightning", "fabric"])
def test_a_frameworks_proxy_of_the_wrapper_acts_on_the_wrapper(proxy, action, device, monkeypatch):
    """Lightning's LightningOptimizer and Fabric's optimizer are instances of a class made from theirs and the
    wrapper's, whose ``_optimizer`` is the wrapper: the wrapper's methods called on them took the wrapper for the
    torch optimizer it wraps. ``add_param_group`` (or Lightning's ``load_state_dict``) through the proxy re-planned
    the wrapper as an optimizer it cannot fuse, and the next step updated nothing (one AdamW step fewer than torch).
    Called on the proxy, each runs on the wrapper now: the same steps as torch's AdamW behind the same proxy, the
    fused route kept, and the proxy reporting the wrapper's step count and the AdamW it wraps."""
    if device.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # the fused kernels in Triton's interpreter (tests/conftest.py)
    runs = []
    for kit in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(4, 2).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        opt = KitsuneOptimizer(opt, enable_fusion=True) if kit else opt
        wrapped = proxy(opt)
        loads: list[int] = []
        wrapped.register_load_state_dict_post_hook(lambda o, loads=loads: loads.append(1))
        gen = torch.Generator().manual_seed(1)
        for i in range(5):
            model(torch.randn(8, 4, generator=gen).to(device)).pow(2).mean().backward()
            opt.step()
            wrapped.zero_grad()
            if i == 1 and action == "add_param_group":
                wrapped.add_param_group({"params": [nn.Parameter(torch.zeros(3, device=device))]})
            elif i == 1:
                wrapped.load_state_dict(opt.state_dict())  # Fabric's load_state_dict calls the wrapper's itself
        runs.append((model.weight.detach().clone(), [s["step"].item() for s in opt.state.values()], loads))
        if kit:
            assert [b.route.value for b in opt.plan.buckets] == ["triton"]
            assert wrapped.step_count == opt.step_count == 5 and wrapped.plan is opt.plan
            assert type(wrapped.base_optimizer) is torch.optim.AdamW and repr(wrapped) == repr(opt)
    (ref, ref_steps, _), (ours, our_steps, our_loads) = runs
    assert our_steps == ref_steps == [5.0, 5.0]
    assert our_loads == ([1] if action == "load_state_dict" else [])  # the load's post-hook, once
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
