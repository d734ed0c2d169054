"""float16 loss scaling with the fused kernel: overflows are skipped on the device, with no host sync."""

from __future__ import annotations

import pytest
import torch
from helpers import batches, no_grad_step, small_model
from torch import nn

from kitsune import AMPConfig, KitsuneOptimizer

INF_STEPS = {3, 4, 11, 17, 18}


def _poison(model: nn.Module, step: int) -> None:
    if step in INF_STEPS:
        p = next(model.parameters())
        p.grad[0, 0] = float("nan") if step % 2 else float("inf")


def _torch_loop(make_opt, steps: int, device: torch.device) -> tuple[list[torch.Tensor], list[float]]:
    model = small_model(device=device)
    opt = make_opt(model.parameters())
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10, growth_interval=4)
    scales = []
    for step, (x, y) in enumerate(batches(steps, device=device)):
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        _poison(model, step)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return [p.detach() for p in model.parameters()], scales


def _kitsune_loop(model: nn.Module, opt: KitsuneOptimizer, steps: int, device: torch.device) -> list[float]:
    """The loop of `_torch_loop` through kitsune's own scaler; the loss scale after each step."""
    scales = []
    for step, (x, y) in enumerate(batches(steps, device=device)):
        opt.backward(nn.functional.mse_loss(model(x), y))
        _poison(model, step)
        opt.step()
        opt.zero_grad()
        scales.append(opt.loss_scale)
    return scales


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),  # its first-step detection counts privately
        lambda ps: torch.optim.Adagrad(ps, lr=0.05),
    ],
    ids=["adamw", "sgd_momentum", "adagrad"],
)
def test_fused_fp16_loop_equals_grad_scaler_without_host_syncs(make_opt, device):
    steps = 24
    ref_params, ref_scales = _torch_loop(make_opt, steps, device)

    model = small_model(device=device)
    cfg = AMPConfig(dtype=torch.float16, init_scale=2.0**10, growth_interval=4)
    opt = KitsuneOptimizer(make_opt(model.parameters()), enable_fusion=True, enable_amp=True, amp_config=cfg)
    scales = _kitsune_loop(model, opt, steps, device)

    assert opt.plan.fused_tensors == len(ref_params)
    assert opt.host_syncs == 0 and opt.base_steps == 0  # every skip was decided on the device
    assert scales == ref_scales and opt.skipped_steps == len(INF_STEPS)
    for ours, ref in zip(model.parameters(), ref_params, strict=True):
        torch.testing.assert_close(ours.detach(), ref, atol=1e-5, rtol=1e-5)
    for state in opt.state.values():
        assert all(torch.isfinite(v).all() for v in state.values())


def test_skip_leaves_params_state_and_step_counts_untouched(device):
    model = small_model(device=device)
    opt = KitsuneOptimizer(torch.optim.Adam(model.parameters()), enable_fusion=True, enable_amp=True)
    x, y = batches(1, device=device)[0]
    opt.backward(nn.functional.mse_loss(model(x), y))
    opt.step()
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    state_before = {p: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    opt.backward(nn.functional.mse_loss(model(x), y))
    next(model.parameters()).grad.view(-1)[0] = float("inf")
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    for p, s in opt.state.items():
        assert all(torch.equal(v, state_before[p][k]) for k, v in s.items()), "state or step changed"
    assert opt.skipped_steps == 1 and opt.host_syncs == 0


def test_users_grad_scaler_with_fused_kernel_needs_no_sync_in_step(device):
    results = []
    for wrap in (False, True):
        model = small_model(device=device)
        base = torch.optim.AdamW(model.parameters(), lr=1e-2)
        opt = KitsuneOptimizer(base, enable_fusion=True) if wrap else base
        scaler = torch.amp.GradScaler(device.type, init_scale=2.0**8, growth_interval=3)
        for step, (x, y) in enumerate(batches(16, device=device)):
            scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
            _poison(model, step)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        results.append(([p.detach().clone() for p in model.parameters()], scaler.get_scale(), opt))
    (ref, ref_scale, _), (ours, our_scale, opt) = results
    assert ref_scale == our_scale and opt.host_syncs == 0
    for a, b in zip(ref, ours, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_fp16_loop_with_a_bucket_on_torchs_fused_route_equals_grad_scaler(device):
    """A bucket the planner leaves to torch's ``fused=True`` step reads kitsune's found_inf as torch's fused
    optimizers read GradScaler's (a 0-dim tensor they subtract from their step counts)."""
    from kitsune import FusionConfig

    make_opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)  # noqa: E731
    steps = 20
    ref_params, ref_scales = _torch_loop(make_opt, steps, device)
    model = small_model(device=device)
    cfg = AMPConfig(dtype=torch.float16, init_scale=2.0**10, growth_interval=4)
    opt = KitsuneOptimizer(
        make_opt(model.parameters()),
        enable_fusion=True,
        enable_amp=True,
        amp_config=cfg,
        fusion_config=FusionConfig(min_fusion_benefit=1e9),  # torch's fused step, whatever the model predicts
    )
    assert {b.route.value for b in opt.plan.buckets} == {"torch_fused"}
    scales = _kitsune_loop(model, opt, steps, device)
    assert scales == ref_scales and opt.skipped_steps == len(INF_STEPS) - sum(s >= steps for s in INF_STEPS)
    for ours, ref in zip(model.parameters(), ref_params, strict=True):
        torch.testing.assert_close(ours.detach(), ref, atol=1e-5, rtol=1e-5)
    want = steps - opt.skipped_steps
    assert all(s["step"].item() == want for s in opt.state.values())


@pytest.mark.parametrize("unscale", [True, False], ids=["unscale_first", "scale_handed_over"])
@pytest.mark.parametrize("momentum", [0.0, 0.9], ids=["sgd", "sgd_momentum"])
def test_users_grad_scaler_skips_an_overflow_for_sparse_grads_too(unscale, momentum, device):
    """``scaler.unscale_(opt)`` (to clip), then ``scaler.step(opt)``: a sparse grad goes to the wrapped step, which
    cannot skip on the device; on an overflowing step it must not run (torch skips the whole step). Without
    ``unscale_`` GradScaler hands its scale to the step (as Lightning's ``16-mixed`` does for optimizers that
    unscale in their step): the fused kernels unscale the dense grads, and the sparse ones, which they cannot
    read, are unscaled for the wrapped step (it raised, blaming kitsune's own float16 scaling)."""
    import copy

    torch.manual_seed(0)
    emb, lin = nn.Embedding(20, 6, sparse=True).to(device), nn.Linear(6, 1).to(device)
    sides = [(emb, lin), (copy.deepcopy(emb), copy.deepcopy(lin))]
    runs = []
    for wrap, (e, lin_) in zip((True, False), sides, strict=True):
        lr = 0.1 if momentum == 0 else 0.01  # unclipped with momentum at 0.1, the loss diverges within 8 steps
        base = torch.optim.SGD([*e.parameters(), *lin_.parameters()], lr=lr, momentum=momentum)
        opt = KitsuneOptimizer(base, enable_fusion=True) if wrap else base
        if wrap:
            assert opt.plan.fused_tensors == 3  # planned before any grad: the sparse ones go to SGD's own step
        scaler = torch.amp.GradScaler(device.type, init_scale=256.0)
        gen = torch.Generator().manual_seed(1)
        for step in range(8):
            idx = torch.randint(0, 20, (5,), generator=gen).to(device)
            y = torch.randn(5, 1, generator=gen).to(device)
            loss = ((lin_(e(idx)) - y) ** 2).sum() * (float("inf") if step in (2, 5) else 1.0)
            scaler.scale(loss).backward()
            if unscale:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(lin_.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        runs.append(([p.detach().clone() for p in (*e.parameters(), *lin_.parameters())], scaler.get_scale()))
        if wrap:
            assert opt.base_steps == 6  # the sparse grads' steps: none on the two overflowing ones
    (ours, our_scale), (ref, ref_scale) = runs
    assert our_scale == ref_scale
    for a, b in zip(ours, ref, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.5),
        lambda ps: torch.optim.Adam(ps, lr=1e-2),
    ],
    ids=["sgd_dampening", "adam"],
)
@pytest.mark.parametrize("scaler", ["grad_scaler", "kitsune_amp"])
def test_a_skipped_step_creates_no_state(make_opt, scaler, device):
    """An overflow on a param's first step: torch's skipped step never makes its state; the fused step made it
    before the device-side skip and kept it (zero moments in the checkpoint; an SGD momentum_buffer that torch's
    next step, after a load, took for one already started). The lazy state goes with the skip: the state and the
    checkpoint are torch's, and the plain optimizer resumed from the checkpoint steps as torch's own."""
    steps, overflow = 6, {0, 3}
    model = small_model(device=device)
    twin = small_model(device=device)
    late = list(model.parameters())[-1]  # gets its first grad at step 3, an overflowing step too
    cfg = AMPConfig(dtype=torch.float16, init_scale=2.0**10)
    kw = {"enable_amp": True, "amp_config": cfg} if scaler == "kitsune_amp" else {}
    opt = KitsuneOptimizer(make_opt(model.parameters()), enable_fusion=True, **kw)
    ref = make_opt(twin.parameters())
    assert {b.route.value for b in opt.plan.buckets} == {"triton"}
    scalers = [torch.amp.GradScaler(device.type, init_scale=2.0**10) for _ in range(2)]
    for step, (x, y) in enumerate(batches(steps, device=device)):
        for m, o, sc in ((model, opt, scalers[0]), (twin, ref, scalers[1])):
            loss = nn.functional.mse_loss(m(x), y)
            if o is opt and scaler == "kitsune_amp":
                opt.backward(loss)
            else:
                sc.scale(loss).backward()
            if step < 3:
                list(m.parameters())[-1].grad = None  # the last param's first grad comes at step 3
            if step in overflow:
                next(m.parameters()).grad.view(-1)[0] = float("inf")
            if o is opt and scaler == "kitsune_amp":
                opt.step()
            else:
                sc.step(o)
                sc.update()
            o.zero_grad()
        if step in overflow:  # what torch's skip leaves: no state for a param that has not stepped yet
            assert len(opt.state) == len(ref.state), step
            assert (late in opt.state) == (list(twin.parameters())[-1] in ref.state)
    sd = opt.state_dict()
    sd.pop("kitsune")
    assert sd["state"].keys() == ref.state_dict()["state"].keys()
    resumed = make_opt(model.parameters())  # the plain optimizer from kitsune's checkpoint, one more step each
    resumed.load_state_dict(sd)
    x, y = batches(steps + 1, device=device)[-1]
    for m, o in ((model, resumed), (twin, ref)):
        nn.functional.mse_loss(m(x), y).backward()
        o.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_dcp_state_dict_helpers_run_their_zero_lr_init_step_under_float16_amp(device):
    """torch.distributed.checkpoint's get/set_optimizer_state_dict make an empty optimizer's state with a step of zero
    grads at lr 0, without a scaled loss: float16 AMP refused it, and the helpers raised with every lr left at 0.
    The step runs without the scaler (no scale update), and a resume through the helpers goes on as one through
    load_state_dict."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    cfg = AMPConfig(dtype=torch.float16, init_scale=2.0**10, growth_interval=2)

    def fresh() -> tuple[nn.Module, KitsuneOptimizer]:
        model = small_model(device=device)
        opt = KitsuneOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2), enable_fusion=True, enable_amp=True, amp_config=cfg
        )
        return model, opt

    def train(model: nn.Module, opt: KitsuneOptimizer, data: list) -> None:
        for x, y in data:
            opt.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()

    data = batches(6, device=device)
    model, opt = fresh()
    assert {b.route.value for b in opt.plan.buckets} == {"triton"}
    train(model, opt, data[:3])
    sd = get_optimizer_state_dict(model, opt)
    plain = opt.state_dict()
    runs = []
    for how in ("dcp", "load_state_dict"):
        m2, o2 = fresh()
        m2.load_state_dict(model.state_dict())
        if how == "dcp":
            set_optimizer_state_dict(m2, o2, sd)
            assert o2.param_groups[0]["lr"] == 1e-2 and all(p.grad is None for p in m2.parameters())
            assert o2.loss_scale == 2.0**10 and o2.skipped_steps == 0  # the init step left the scaler alone
        else:
            o2.load_state_dict(plain)
        train(m2, o2, data[3:])
        runs.append([p.detach().clone() for p in m2.parameters()])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
    m3, o3 = fresh()  # and on a fresh optimizer, get runs the same init step
    assert get_optimizer_state_dict(m3, o3)["param_groups"][0]["lr"] == 1e-2
    assert o3.param_groups[0]["lr"] == 1e-2


def test_a_fused_step_with_no_grad_leaves_the_scale_and_names_a_second_step(device):
    """As tests/test_amp.py's on the fused route, where the kernels launched nothing (no grad) and the scale grew as
    after a clean step."""
    no_grad_step(device, fusion=True)
