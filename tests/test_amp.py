"""AMP on CPU: the device-resident loss scaler against torch.amp.GradScaler, step for step."""

from __future__ import annotations

import pytest
import torch
from helpers import batches, no_grad_step, small_model
from torch import nn

from kitsune import AMPConfig, KitsuneOptimizer

INF_STEPS = {3, 4, 11, 25, 26, 27}


def _poison(model: nn.Module, step: int) -> None:
    if step in INF_STEPS:
        p = next(model.parameters())
        p.grad[0, 0] = float("nan") if step % 2 else float("inf")


def _torch_loop(steps: int, growth_interval: int) -> tuple[list, list[float]]:
    model = small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=growth_interval)
    params, scales = [], []
    for step, (x, y) in enumerate(batches(steps)):
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        _poison(model, step)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        params.append([p.detach().clone() for p in model.parameters()])
        scales.append(scaler.get_scale())
    return params, scales


def _kitsune_loop(steps: int, growth_interval: int) -> tuple[list, list[float], KitsuneOptimizer]:
    model = small_model()
    cfg = AMPConfig(dtype=torch.float16, init_scale=2.0**10, growth_interval=growth_interval)
    opt = KitsuneOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), enable_amp=True, amp_config=cfg)
    params, scales = [], []
    for step, (x, y) in enumerate(batches(steps)):
        opt.backward(nn.functional.mse_loss(model(x), y))
        _poison(model, step)
        opt.step()
        opt.zero_grad()
        params.append([p.detach().clone() for p in model.parameters()])
        scales.append(opt.loss_scale)
    return params, scales, opt


def test_fp16_scaling_matches_grad_scaler_with_overflows():
    ref_params, ref_scales = _torch_loop(60, growth_interval=5)
    params, scales, opt = _kitsune_loop(60, growth_interval=5)
    assert scales == ref_scales
    assert max(scales) > 2.0**10 and min(scales) < 2.0**10  # it grew and backed off
    for a, b in zip(ref_params, params, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert opt.skipped_steps == len(INF_STEPS)
    assert all(torch.isfinite(p).all() for p in params[-1])
    for state in opt.state.values():
        assert all(torch.isfinite(v).all() for v in state.values())


def test_skipped_step_leaves_params_and_state_untouched():
    model = small_model()
    opt = KitsuneOptimizer(torch.optim.Adam(model.parameters()), enable_amp=True)
    x, y = batches(1)[0]
    opt.backward(nn.functional.mse_loss(model(x), y))
    opt.step()
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    state_before = {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state.items()}
    opt.backward(nn.functional.mse_loss(model(x), y))
    next(model.parameters()).grad.view(-1)[0] = float("inf")
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    for p, s in opt.state.items():
        assert all(torch.equal(s[n], state_before[p][n]) for n in s)
    assert opt.skipped_steps == 1 and opt.loss_scale == 2.0**15


def test_plain_backward_with_fp16_scaling_is_refused_and_loses_nothing():
    model = small_model()
    opt = KitsuneOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), enable_amp=True)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batches(1)[0]
    nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(RuntimeError, match=r"call optimizer.backward\(loss\)"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


class _FlakySGD(torch.optim.SGD):
    """An SGD whose step raises on the calls listed (a transient failure: an interrupted I/O, a cancelled job)."""

    def __init__(self, params, fail_on: set[int], **kw) -> None:
        super().__init__(params, **kw)
        self.fail_on, self.calls = fail_on, 0

    def step(self, closure=None):
        self.calls += 1
        if self.calls in self.fail_on:
            raise OSError("transient")
        return super().step(closure)


@pytest.mark.parametrize("max_norm", [None, 0.5])
def test_a_step_that_raised_can_be_retried(max_norm):
    """The wrapped step raises after kitsune unscaled (and clipped) the grads; the retry must not unscale them
    again, and the step count must count steps taken: the run ends where a run without failures ends."""
    from kitsune import GradConfig

    runs = []
    for fail_on in (set(), {3, 8}):
        model = small_model()
        opt = KitsuneOptimizer(
            _FlakySGD(model.parameters(), fail_on, lr=0.1, momentum=0.9),
            enable_amp=True,
            amp_config=AMPConfig(dtype=torch.float16, init_scale=2.0**12),
            grad_config=GradConfig(max_norm=max_norm),
        )
        for x, y in batches(10):
            opt.backward(nn.functional.mse_loss(model(x), y))
            try:
                opt.step()
            except OSError:
                opt.step()  # the same grads, again
            opt.zero_grad()
        runs.append((opt, [p.detach().clone() for p in model.parameters()]))
    (ref, want), (opt, got) = runs
    assert opt.base_optimizer.calls == 12 and ref.base_optimizer.calls == 10
    assert opt.step_count == ref.step_count == 10
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def test_bf16_autocast_without_scaler():
    model = small_model()
    opt = KitsuneOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), enable_amp=True, amp_config=AMPConfig(dtype="bf16")
    )
    x, y = batches(1)[0]
    with opt.autocast():
        out = model(x)
    assert out.dtype == torch.bfloat16
    nn.functional.mse_loss(out.float(), y).backward()  # no scaling needed: plain backward is fine
    opt.step()
    assert opt.loss_scale == 1.0 and opt.skipped_steps == 0


def test_autocast_is_disabled_without_amp():
    model = small_model()
    opt = KitsuneOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with opt.autocast():
        assert model(torch.randn(2, 7)).dtype == torch.float32


def test_scaler_state_in_checkpoint():
    _, _, opt = _kitsune_loop(30, growth_interval=5)
    sd = opt.state_dict()
    amp_state = sd["kitsune"]["subsystems"]["amp"]
    assert amp_state["scale"] == opt.loss_scale and amp_state["skipped_steps"] == opt.skipped_steps
    other = KitsuneOptimizer(torch.optim.AdamW(small_model().parameters(), lr=1e-2), enable_amp=True)
    other.load_state_dict(sd)
    assert other.loss_scale == opt.loss_scale and other.skipped_steps == opt.skipped_steps
    plain = torch.optim.AdamW(small_model().parameters(), lr=1e-2)
    plain.load_state_dict(sd)  # torch ignores the kitsune key


@pytest.mark.parametrize("unscale_first", [False, True])
def test_users_grad_scaler_drives_the_wrapper(unscale_first):
    results = []
    for wrap in (False, True):
        model = small_model()
        base = torch.optim.AdamW(model.parameters(), lr=1e-2)
        opt = KitsuneOptimizer(base) if wrap else base
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
        for step, (x, y) in enumerate(batches(20)):
            scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
            _poison(model, step)
            if unscale_first:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        results.append(([p.detach().clone() for p in model.parameters()], scaler.get_scale()))
    (ref, ref_scale), (ours, our_scale) = results
    assert ref_scale == our_scale
    assert all(torch.equal(a, b) for a, b in zip(ref, ours, strict=True))


def test_a_grad_scaler_beside_kitsunes_float16_scaling_is_refused_naming_both():
    """Two loss scalers: the GradScaler's step reaches kitsune's, which refuses before anything changes (not with the
    "call optimizer.backward(loss)" message: the user's backward did scale, by the other scaler)."""
    model = small_model()
    opt = KitsuneOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), enable_amp=True)
    scaler = torch.amp.GradScaler("cpu")
    x, y = batches(1)[0]
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):  # again: still refused
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        with pytest.raises(RuntimeError, match="two loss scalers: a torch.amp.GradScaler stepped this optimizer"):
            scaler.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert opt.step_count == 0 and not opt.state
    # the fix the refusal names: drop the GradScaler. Its hand-over (grad_scale, found_inf), which its step deletes
    # only when the step returns, is gone with the refusal: the next steps do not take a GradScaler to be at work
    opt.zero_grad()
    assert "found_inf" not in opt.__dict__ and "grad_scale" not in opt.__dict__
    for _ in range(2):
        opt.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    assert opt.step_count == 2


def test_a_step_with_no_grad_leaves_the_scale_and_names_a_second_step():
    """``optimizer.backward(loss)``, then ``zero_grad()`` (a batch dropped) and ``step()``: no grad was checked, so
    the scale neither grows nor counts a clean step (it doubled at growth_interval=1; GradScaler's step asserts
    there). A second ``step()`` without a new backward is refused naming that, not only ``loss.backward()``. The
    wrapped step's route here; the fused one: tests/fusion/test_amp_fused.py."""
    no_grad_step(torch.device("cpu"), fusion=False)


def test_a_retry_on_new_grads_clips_them_afresh():
    """A step raised after clipping; the grads are then replaced by new tensors (the old ones freed) with the same
    version counters, as a new backward into set-to-None grads may leave them. The retry must clip the new grads,
    not take the failed step's norm for them (a new grad often takes a freed one's id): over 30 rounds the params
    equal torch's clip and step on the new grads."""
    from kitsune import GradConfig

    for round_ in range(30):
        model = small_model()
        twin = small_model()
        twin.load_state_dict(model.state_dict())
        opt = KitsuneOptimizer(_FlakySGD(model.parameters(), {1}, lr=0.1), grad_config=GradConfig(max_norm=0.5))
        x, y = batches(1)[0]
        nn.functional.mse_loss(model(x), y).backward()
        with pytest.raises(OSError):
            opt.step()
        gen = torch.Generator().manual_seed(round_)
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            version, new = p.grad._version, torch.randn(p.shape, generator=gen) * 3
            p.grad = None  # the clipped grad freed: its id free for the next tensor
            g = torch.empty(p.shape)
            g.copy_(new)
            for _ in range(version - 1):
                g.mul_(1.0)
            p.grad, q.grad = g, new
        opt.step()
        torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.5)
        torch.optim.SGD(twin.parameters(), lr=0.1).step()
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=lambda m, r=round_: f"round {r}: {m}")
