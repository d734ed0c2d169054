"""Params whose elements lie in channels_last order (a vision model's conv weights after
``model.to(memory_format=torch.channels_last)``) on the fused kernel: it walks a param, its grad and its state as flat
memory, so their state lies in the same order (as torch's lazy init makes it) and a grad of another order is read
through a copy in its param's. Every trajectory is torch's own optimizer's on a twin, step for step."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import routes
from twins import record_graphs

from kitsune import FusionConfig, GraphConfig, KitsuneConfig, KitsuneOptimizer, MemoryConfig, StreamConfig, _native
from kitsune.optim import LAMB, LARS, Lion

CL, CL3 = torch.channels_last, torch.channels_last_3d


@pytest.fixture(autouse=True)
def _same_convolutions():
    """On a GPU the twins' convolutions give the same grads: cuDNN's deterministic algorithms, without TF32 (what
    is compared is the optimizers, not the convolution algorithms cuDNN picks for each model)."""
    cudnn = torch.backends.cudnn
    saved = cudnn.deterministic, cudnn.benchmark, cudnn.allow_tf32
    cudnn.deterministic, cudnn.benchmark, cudnn.allow_tf32 = True, False, False
    yield
    cudnn.deterministic, cudnn.benchmark, cudnn.allow_tf32 = saved


def _model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3),
        torch.nn.GELU(),
        torch.nn.Conv2d(8, 6, 3, bias=False),
        torch.nn.Flatten(),
        torch.nn.Linear(6 * 4 * 4, 5),
    )
    return net.to(device=device, memory_format=CL)


def _batch(step: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(4, 3, 8, 8, generator=gen).to(device=device, memory_format=CL)


def _train(nets, opts, steps: int, device: torch.device, set_to_none: bool = True, start: int = 0) -> None:
    """A training loop's steps on every (model, optimizer) pair; the params compared after each step."""
    for step in range(start, start + steps):
        for net, opt in zip(nets, opts, strict=True):
            opt.zero_grad(set_to_none=set_to_none)
            net(_batch(step, device)).square().mean().backward()
            opt.step()
        for a, b in zip(nets[0].parameters(), nets[1].parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


OPTIMIZERS = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "Adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=1e-3),
    "SGD-nesterov": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "RMSprop-centered": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, centered=True),
    "NAdam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_channels_last_params_are_fused_and_follow_torch(device, check_path, name):
    """Conv weights in channels_last order are fused (no param left to torch's foreach path), with clipping in the
    step; 30 steps of a training loop (grads freed and made anew by backward, in the params' order) follow torch, and
    the state torch's optimizer would hold lies in the same order with the same values."""
    make = OPTIMIZERS[name]
    net, twin = _model(device), _model(device)
    assert net[0].weight.is_contiguous(memory_format=CL) and not net[0].weight.is_contiguous()
    opt = KitsuneOptimizer(make(net.parameters()), enable_fusion=True, max_grad_norm=0.5)
    ref = make(twin.parameters())
    assert routes(opt) == {"triton"}, opt.plan
    clipping = torch.nn.utils.clip_grad_norm_

    class Clipped:  # torch's loop: clip, then step
        def zero_grad(self, set_to_none: bool = True) -> None:
            ref.zero_grad(set_to_none=set_to_none)

        def step(self) -> None:
            clipping(twin.parameters(), 0.5)
            ref.step()

    _train([net, twin], [opt, Clipped()], 30, device)
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):
        for key, value in ref.state[q].items():
            mine = opt.state[p][key]
            if value.dim() == 4:
                assert mine.is_contiguous(memory_format=CL) == value.is_contiguous(memory_format=CL), key
            # the fused step keeps its step count on the device, torch's foreach step on the CPU
            torch.testing.assert_close(mine.to(value), value, rtol=1e-4, atol=1e-5)


def test_channels_last_3d_params_are_fused(device):
    """A Conv3d weight in channels_last_3d order: fused, torch's trajectory."""

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Conv3d(2, 4, 3).to(device=device, memory_format=CL3)

    net, twin = model(), model()
    assert net.weight.is_contiguous(memory_format=CL3) and not net.weight.is_contiguous()
    opt = KitsuneOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2), enable_fusion=True)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    assert routes(opt) == {"triton"}
    gen = torch.Generator().manual_seed(3)
    for _ in range(10):
        x = torch.randn(2, 2, 5, 5, 5, generator=gen).to(device=device, memory_format=CL3)
        for m, o in ((net, opt), (twin, ref)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
        torch.testing.assert_close(net.weight, twin.weight, rtol=1e-5, atol=1e-5)
    assert opt.state[net.weight]["exp_avg"].is_contiguous(memory_format=CL3)


def test_a_grad_of_another_order_is_read_through_a_copy(device, check_path):
    """A grad set by hand in row-major order on a channels_last param (the kernel would read its elements in the
    wrong order as flat memory): read through a copy in its param's order, the step is still torch's."""
    net, twin = _model(device), _model(device)
    opt = KitsuneOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2), enable_fusion=True)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(5)
    for _ in range(6):
        for p, q in zip(net.parameters(), twin.parameters(), strict=True):
            g = torch.randn(p.shape, generator=gen).to(device)  # row-major, whatever the param's order
            p.grad, q.grad = g, g.clone()
        opt.step()
        ref.step()
        for a, b in zip(net.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert routes(opt) == {"triton"}


def test_the_graph_steady_replay_follows_channels_last_grads(device, check_path):
    """Through the graph's warm-up, capture and steady replays (the recording backend on a CPU): grads kept in place
    and grads made anew every step, both in the params' order, follow torch; with the native check the steps after
    the capture replay steady."""
    net, twin = _model(device), _model(device)
    opt = KitsuneOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1), enable_fusion=True)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1)
    backend = record_graphs(opt)
    _train([net, twin], [opt, ref], 10, device, set_to_none=False)
    _train([net, twin], [opt, ref], 10, device, set_to_none=True, start=10)
    assert backend.captured == 1
    if check_path == "native":
        assert opt._subsystem("graphs").steady_replays >= 15


@pytest.mark.parametrize("pool", [True, False], ids=["pool", "no-pool"])
def test_a_param_that_changes_order_is_planned_again(device, check_path, pool):
    """``p.data = p.data.contiguous()`` between steps (the same values, now row-major, its state still channels_last):
    seen by the step's check, which plans again; the state follows the param's new order and torch's trajectory
    holds."""
    net, twin = _model(device), _model(device)
    size = {} if pool else {"memory_pool_size": 0}  # the state in the pool's views, or in tensors of its own
    opt = KitsuneOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2), enable_fusion=True, **size)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    record_graphs(opt)
    _train([net, twin], [opt, ref], 6, device)
    weight = net[2].weight
    weight.data = weight.data.contiguous()
    assert weight.is_contiguous() and not weight.is_contiguous(memory_format=CL)
    _train([net, twin], [opt, ref], 6, device, start=6)
    assert opt.state[weight]["exp_avg"].is_contiguous()
    assert routes(opt) == {"triton"}


@pytest.mark.parametrize("pool", [True, False], ids=["pool", "no-pool"])
def test_a_checkpoint_goes_to_torch_and_back(device, pool):
    """The wrapper's state dict loads into torch's own optimizer, which goes on as the wrapper does; torch's state
    dict, saved row-major, loads into a new wrapper, which lays it out in its params' order and goes on as torch's
    optimizer loaded from the same checkpoint."""
    net = _model(device)
    opt = KitsuneOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2), enable_fusion=True)
    ref_net = copy.deepcopy(net)
    ref = torch.optim.AdamW(ref_net.parameters(), lr=1e-2)
    _train([net, ref_net], [opt, ref], 5, device)

    plain_net = copy.deepcopy(net)
    plain = torch.optim.AdamW(plain_net.parameters(), lr=1e-2)
    plain.load_state_dict(copy.deepcopy(opt.state_dict()))  # its own tensors (a loaded dict shares them)
    saved = copy.deepcopy(plain.state_dict())
    for s in saved["state"].values():  # a checkpoint whose state was saved row-major
        for key in ("exp_avg", "exp_avg_sq"):
            s[key] = s[key].contiguous()
    back_net, torch_net = copy.deepcopy(net), copy.deepcopy(net)
    size = {} if pool else {"memory_pool_size": 0}
    back = KitsuneOptimizer(torch.optim.AdamW(back_net.parameters(), lr=1e-2), enable_fusion=True, **size)
    back.load_state_dict(copy.deepcopy(saved))
    torch_opt = torch.optim.AdamW(torch_net.parameters(), lr=1e-2)
    torch_opt.load_state_dict(saved)
    _train([net, plain_net], [opt, plain], 5, device, start=5)
    _train([back_net, torch_net], [back, torch_opt], 5, device, start=5)
    assert back.state[back_net[0].weight]["exp_avg"].is_contiguous(memory_format=CL)
    assert routes(back) == {"triton"}


def test_8bit_state_keeps_channels_last_params_in_their_dtype(device):
    """``state_precision="8bit"`` quantizes runs of a param's rows: a channels_last param keeps its state in its own
    dtype, with a note in the plan, and is still fused."""
    net = _model(device)
    config = FusionConfig(enabled=True, state_precision="8bit", min_8bit_size=0)
    opt = KitsuneOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2), enable_fusion=True, fusion_config=config)
    assert routes(opt) == {"triton"}
    notes = " ".join(n for b in opt.plan.buckets for n in b.notes)
    assert "channels_last param keeps its state in its own dtype" in notes
    opt.zero_grad()
    net(_batch(0, device)).square().mean().backward()
    opt.step()
    assert opt.state[net[0].weight]["exp_avg"].dtype == torch.float32
    assert "exp_avg_codes" in opt.state[net[4].weight]  # the row-major Linear weight: 8 bits


def test_the_native_check_reads_the_order_in_the_shape_key():
    """The native check's shape key holds the order a tensor's elements lie in: a channels_last tensor matches the
    key made for it and not the row-major one of its shape, and a param of either order moved to the other is a
    change; a tensor row-major and channels_last alike (one channel) counts as row-major, in Python and in C++."""
    checks = _native.wait(timeout=600)
    assert checks is not None, _native.reason()
    f32 = torch.float32
    shape = (4, 3, 2, 2)
    p = torch.nn.Parameter(torch.randn(shape).contiguous(memory_format=CL))
    p.grad = torch.randn(shape).contiguous(memory_format=CL)
    cl_key, rm_key = _native.shape_key(shape, 1), _native.shape_key(shape)
    assert cl_key != rm_key and _native.layout_code(p) == 1
    table = torch.tensor([p.data_ptr(), p.grad.data_ptr(), p.numel(), cl_key])
    assert checks.unchanged([p], table, 1, f32)
    assert not checks.unchanged([p], torch.tensor([p.data_ptr(), p.grad.data_ptr(), p.numel(), rm_key]), 1, f32)
    grad = p.grad
    p.grad = grad.contiguous()  # row-major grad: another order
    assert not checks.unchanged([p], table, 2, f32) and checks.unchanged([p], table, 0, f32)
    p.grad = grad
    p.data = p.data.contiguous()  # the param row-major, where the table says
    table[0] = p.data_ptr()
    assert not checks.unchanged([p], table, 0, f32) and checks.unchanged([p], table, 2, f32)
    one = torch.nn.Parameter(torch.randn(4, 1, 2, 2).contiguous(memory_format=CL))
    assert one.is_contiguous() and _native.layout_code(one) == 0
    assert checks.unchanged([one], torch.tensor([one.data_ptr(), 0, 16, _native.shape_key((4, 1, 2, 2))]), 0, f32)
    t = torch.randn(4, 3, 2, 2).transpose(0, 1)  # dense, but in no order the kernels walk
    assert _native.layout_code(t) == _native.NOT_DENSE


CONFIGS = {
    "flat-grads": (lambda ps: torch.optim.AdamW(ps, lr=1e-2), torch.float32, {"memory": {"flat_grads": True}}),
    "static-addresses": (
        lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        torch.float32,
        {"graphs": {"static_addresses": True}},
    ),
    "bf16-state": (lambda ps: torch.optim.AdamW(ps, lr=1e-2), torch.float32, {"fusion": {"state_precision": "bf16"}}),
    "bf16-params-kahan": (
        lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        torch.bfloat16,
        {"fusion": {"param_rounding": "kahan"}},
    ),
    "bf16-params-stochastic": (
        lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        torch.bfloat16,
        {"fusion": {"param_rounding": "stochastic"}},
    ),
    "Lion": (lambda ps: Lion(ps, lr=1e-3, weight_decay=0.1), torch.float32, {}),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_elementwise_option_steps_the_same_in_either_order(device, name):
    """kitsune's own options over a channels_last net and over the same net row-major (the grads pooled in the
    arena, static addresses, bf16 state, bf16 params with Kahan compensation or stochastic rounding, Lion): the
    update is element for element, so both orders take bit for bit the same 12 steps (stochastic rounding within a
    few ulps: its random numbers go by place in memory), the channels_last one fused with its state in its order."""
    make, dtype, sections = CONFIGS[name]
    nets = []
    for fmt in (CL, torch.contiguous_format):
        net = _model(device).to(dtype=dtype, memory_format=fmt)
        parts = {"fusion": FusionConfig(enabled=True, **sections.get("fusion", {}))}
        if "memory" in sections:
            parts["memory"] = MemoryConfig(**sections["memory"])
        if "graphs" in sections:
            parts["graphs"] = GraphConfig(**sections["graphs"])
        opt = KitsuneOptimizer(make(net.parameters()), config=KitsuneConfig(**parts))
        assert routes(opt) == {"triton"}
        nets.append((net, opt))
    gen = torch.Generator().manual_seed(7)
    for _ in range(12):
        x = torch.randn(4, 3, 8, 8, generator=gen).to(device=device, dtype=dtype)
        grads = None
        for net, opt in nets:
            opt.zero_grad(set_to_none="static" not in name)
            net(x.contiguous(memory_format=CL)).float().square().mean().backward()
            if grads is None:  # the same grads for both orders (backward's own sums may round apart)
                grads = [p.grad.clone() for p in net.parameters()]
            else:
                for p, g in zip(net.parameters(), grads, strict=True):
                    p.grad.copy_(g)
            opt.step()
    (cl_net, cl_opt), (rm_net, _) = nets
    for a, b in zip(cl_net.parameters(), rm_net.parameters(), strict=True):
        if "stochastic" in name:  # each element's rounding draws the number of its place in memory: a few ulps apart
            torch.testing.assert_close(a, b, rtol=0, atol=2e-2)
        else:
            assert torch.equal(a, b)
    key = "exp_avg" if "exp_avg" in cl_opt.state[cl_net[0].weight] else next(iter(cl_opt.state[cl_net[0].weight]))
    assert cl_opt.state[cl_net[0].weight][key].is_contiguous(memory_format=CL)


def test_a_model_converted_after_the_wrapper_is_planned_again(device, check_path):
    """``model.to(memory_format=torch.channels_last)`` after the wrapper was built (and stepped): the step sees the
    params moved, plans again with their new order, and the state follows them; torch's trajectory throughout."""

    def row_major() -> torch.nn.Module:
        return _model(device).to(memory_format=torch.contiguous_format)

    net, twin = row_major(), row_major()
    assert all(p.is_contiguous() for p in net.parameters())
    opt = KitsuneOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1), enable_fusion=True)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1)
    _train([net, twin], [opt, ref], 4, device)
    for m in (net, twin):
        m.to(memory_format=CL)
    assert not net[0].weight.is_contiguous()
    _train([net, twin], [opt, ref], 6, device, start=4)
    assert routes(opt) == {"triton"}
    assert opt.state[net[0].weight]["exp_avg"].is_contiguous(memory_format=CL)


def test_updates_inside_backward_take_channels_last_params(device):
    """``StreamConfig(step_in_backward=True)``: each unit's update launches inside backward once its grads are in,
    channels_last ones as the rest; torch's trajectory, every update inside backward."""
    net, twin = _model(device), _model(device)
    config = StreamConfig(step_in_backward=True)
    opt = KitsuneOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2), enable_fusion=True, stream_config=config)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    _train([net, twin], [opt, ref], 8, device)
    report = opt._subsystem("streams").report()
    assert report["units_updated_in_backward"] == 8 * report["units"] and report["units_updated_in_step"] == 0
    assert routes(opt) == {"triton"}


EVERY = {
    "Adam-maximize": lambda ps: torch.optim.Adam(ps, lr=1e-2, maximize=True, weight_decay=0.1),
    "SGD-dampening": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "SGD-plain": lambda ps: torch.optim.SGD(ps, lr=1e-2),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, lr_decay=0.01, weight_decay=0.01),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, weight_decay=0.01),
    "Adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0, weight_decay=0.01),
    "Adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2, weight_decay=0.01),
    "RAdam": lambda ps: torch.optim.RAdam(ps, lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1),
    "Rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2),
    "ASGD": lambda ps: torch.optim.ASGD(ps, lr=1e-2, t0=3),
    "LAMB": lambda ps: LAMB(ps, lr=1e-2, weight_decay=0.01),  # trust ratios: per-tensor norms over flat memory
    "LARS": lambda ps: LARS(ps, lr=1e-2, momentum=0.9),
}


@pytest.mark.parametrize("name", list(EVERY))
def test_every_fused_torch_optimizer_takes_channels_last_params(device, name):
    """The rest of torch's optimizers kitsune fuses, and kitsune's LAMB and LARS, over the channels_last net: fused,
    15 steps of the optimizer's own step's trajectory."""
    make = EVERY[name]
    net, twin = _model(device), _model(device)
    opt = KitsuneOptimizer(make(net.parameters()), enable_fusion=True)
    assert routes(opt) == {"triton"}
    _train([net, twin], [opt, make(twin.parameters())], 15, device)


TORCH_FUSED = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "Adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=1e-3),
    "SGD_nesterov": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, lr_decay=0.01, weight_decay=0.01),
}


@pytest.mark.parametrize("name", list(TORCH_FUSED))
def test_torch_fused_route_takes_grads_and_state_of_another_order(name, device):
    """float64 params go to torch's ``fused=True`` step, whose kernels walk a param, its grad and its state as flat
    memory in one order (on a CPU, a grad or state of another order, or an expanded grad, gave wrong params or
    nan; on a GPU torch raises after it has counted the step). Grads of another order or expanded are left to the
    wrapped optimizer's own step, and state made in another order (``model.to(channels_last)`` after the state was
    made, SGD's momentum cloned from such a grad) is put in its param's order: torch's results, step for step."""
    make = TORCH_FUSED[name]
    gen = torch.Generator().manual_seed(1)
    shapes = [((8, 6, 2, 2), None), ((5, 4, 3, 3), CL), ((6, 5), None)]
    full = [torch.randn(s, generator=gen, dtype=torch.float64) for s, _ in shapes]
    made = [[torch.nn.Parameter(t.clone().to(device)) for t in full] for _ in "ab"]
    for ps in made:
        for p, (_, fmt) in zip(ps, shapes, strict=True):
            if fmt is not None:
                p.data = p.data.contiguous(memory_format=fmt)
    params, twins = made
    opt, ref = KitsuneOptimizer(make(params), enable_fusion=True), make(twins)
    # torch's fused Adagrad runs on a CPU only: on a GPU the plan hands Adagrad to torch's foreach step
    fused = name != "Adagrad" or device.type == "cpu"
    assert routes(opt) == ({"torch_fused"} if fused else {"torch_foreach"}), opt.plan
    for step in range(8):
        if step == 4:  # the model converted after the state was made
            for ps in made:
                ps[0].data = ps[0].data.contiguous(memory_format=CL)
                ps[1].data = ps[1].data.contiguous()
        for p, t in zip(params, twins, strict=True):
            g = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(device)
            if step % 3 == 1 and p.dim() == 4:  # the other order than the param's
                g = g.contiguous(memory_format=CL) if p.is_contiguous() else g.contiguous()
            elif step % 3 == 2 and p.dim() == 4:  # expanded along dim 0
                g = g[:1].expand(p.shape)
            else:
                g = torch.empty_like(p).copy_(g)
            p.grad, t.grad = g, g.clone()
        opt.step()
        ref.step()
        for p, t in zip(params, twins, strict=True):
            torch.testing.assert_close(p, t, rtol=1e-12, atol=1e-12)
    for p, t in zip(params, twins, strict=True):
        for key, value in ref.state[t].items():
            # the fused step keeps its step count on the device
            torch.testing.assert_close(opt.state[p][key].cpu(), value.cpu(), rtol=1e-12, atol=1e-12)
