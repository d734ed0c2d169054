"""KitsuneOptimizer on CPU: a real torch Optimizer whose results are bit-identical to the one it wraps."""

from __future__ import annotations

import copy
import pickle
import sys

import pytest
import torch
from helpers import assert_identical, batches, small_model, train, twin_runs
from torch import nn

from kitsune import KitsuneOptimizer

OPTIMIZERS = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.05),
    "sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3),
    "sgd_nesterov": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, weight_decay=1e-3),
    "adam_amsgrad": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, amsgrad=True, maximize=False),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
    "rmsprop": lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-2, momentum=0.5, centered=True),
    "adagrad": lambda m: torch.optim.Adagrad(m.parameters(), lr=0.1, lr_decay=1e-3),
}


class SignSGD(torch.optim.Optimizer):
    """A user-defined optimizer kitsune knows nothing about."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["n"] = state.get("n", 0) + 1
                p.add_(p.grad.sign(), alpha=-group["lr"])
        return loss


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_trajectory_identical_to_unwrapped(name):
    ref, ours = twin_runs(OPTIMIZERS[name], steps=50)
    assert_identical(ref, ours)


def test_custom_optimizer_subclass_identical():
    ref, ours = twin_runs(lambda m: SignSGD(m.parameters(), lr=0.01), steps=50)
    assert_identical(ref, ours)


def test_is_a_torch_optimizer_sharing_the_wrapped_objects():
    m = small_model()
    base = torch.optim.AdamW(m.parameters())
    opt = KitsuneOptimizer(base)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.base_optimizer is base
    assert opt.param_groups is base.param_groups
    assert opt.state is base.state
    assert opt.defaults is base.defaults
    opt.param_groups[0]["lr"] = 0.123
    assert base.param_groups[0]["lr"] == 0.123


def test_rejects_non_optimizers_and_double_wrapping():
    fix = r"build it first, e.g. KitsuneOptimizer\(torch.optim.AdamW\(model.parameters\(\)"
    with pytest.raises(TypeError, match="wraps a torch optimizer built over the params, got list: " + fix):
        KitsuneOptimizer([torch.zeros(1)])
    with pytest.raises(TypeError, match="got generator: " + fix):
        KitsuneOptimizer(small_model().parameters())
    with pytest.raises(TypeError, match="got the class AdamW: " + fix):
        KitsuneOptimizer(torch.optim.AdamW)
    opt = KitsuneOptimizer(torch.optim.SGD(small_model().parameters(), lr=0.1))
    with pytest.raises(ValueError, match="already a KitsuneOptimizer"):
        KitsuneOptimizer(opt)


SCHEDULERS = {
    "steplr": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=7, gamma=0.5),
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=40),
    "lambdalr": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
}


@pytest.mark.parametrize("sched", list(SCHEDULERS))
@pytest.mark.parametrize("built_on", ["wrapper", "base"])
def test_lr_schedulers_drive_the_wrapper(sched, built_on, recwarn):
    data = batches(40)
    m1 = small_model()
    o1 = torch.optim.AdamW(m1.parameters(), lr=0.01)
    ref = train(m1, o1, data, SCHEDULERS[sched](o1))
    ref_lrs = [g["lr"] for g in o1.param_groups]

    m2 = small_model()
    base = torch.optim.AdamW(m2.parameters(), lr=0.01)
    opt = KitsuneOptimizer(base)
    s2 = SCHEDULERS[sched](opt if built_on == "wrapper" else base)
    ours = train(m2, opt, data, s2)
    assert_identical(ref, ours)
    assert [g["lr"] for g in opt.param_groups] == ref_lrs
    if sched == "onecycle":  # OneCycleLR also cycles beta1; the shared groups must carry it
        assert opt.param_groups[0]["betas"] == o1.param_groups[0]["betas"]
    # torch warns when it thinks scheduler.step() ran before optimizer.step(); it must not here
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]


@pytest.mark.parametrize("direction", ["kitsune_to_torch", "torch_to_kitsune"])
def test_state_dict_round_trip_mid_run(direction, tmp_path):
    data = batches(40)
    make = OPTIMIZERS["adamw"]
    m_ref = small_model()
    ref = train(m_ref, make(m_ref), data)

    m = small_model()
    first = KitsuneOptimizer(make(m)) if direction == "kitsune_to_torch" else make(m)
    head = train(m, first, data[:20])
    path = tmp_path / "ckpt.pt"
    torch.save({"model": m.state_dict(), "opt": first.state_dict()}, path)
    ckpt = torch.load(path, weights_only=True)

    m2 = small_model(seed=99)
    m2.load_state_dict(ckpt["model"])
    second = make(m2) if direction == "kitsune_to_torch" else KitsuneOptimizer(make(m2))
    second.load_state_dict(ckpt["opt"])
    tail = train(m2, second, data[20:])
    assert_identical(ref, head + tail)


def test_state_dict_has_torch_layout_plus_one_key():
    m = small_model()
    opt = KitsuneOptimizer(torch.optim.Adam(m.parameters()))
    train(m, opt, batches(3))
    sd = opt.state_dict()
    plain = opt.base_optimizer.state_dict()
    assert set(sd) == set(plain) | {"kitsune"}
    assert sd["param_groups"] == plain["param_groups"]
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert sd["kitsune"]["step_count"] == 3


def test_kitsune_counters_survive_checkpoint():
    m = small_model()
    opt = KitsuneOptimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    train(m, opt, batches(5))
    other = KitsuneOptimizer(torch.optim.SGD(small_model().parameters(), lr=0.1))
    other.load_state_dict(opt.state_dict())
    assert other.step_count == 5


def test_newer_kitsune_state_is_refused_without_touching_state():
    m = small_model()
    opt = KitsuneOptimizer(torch.optim.Adam(m.parameters()))
    train(m, opt, batches(2))
    before = copy.deepcopy(opt.base_optimizer.state_dict())
    sd = opt.state_dict()
    sd["kitsune"]["version"] = 99
    with pytest.raises(ValueError, match="newer than this kitsune understands .*: install a newer kitsune to load it"):
        opt.load_state_dict(sd)
    after = opt.base_optimizer.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for k in before["state"]:
        for key, value in before["state"][k].items():
            assert torch.equal(after["state"][k][key], value)


def test_closure_is_called_and_loss_returned():
    m = small_model()
    x, y = batches(1)[0]
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = nn.functional.mse_loss(m(x), y)
        loss.backward()
        return loss

    opt = KitsuneOptimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    loss = opt.step(closure)
    assert calls == [1] and isinstance(loss, torch.Tensor)


def test_lbfgs_closure_passes_through():
    """LBFGS calls its closure several times per step; the wrapper must hand it over, not call it once."""
    data = batches(1)
    results = []
    for wrap in (False, True):
        m = small_model()
        base = torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=5)
        opt = KitsuneOptimizer(base) if wrap else base
        x, y = data[0]

        def closure(m=m, opt=opt, x=x, y=y):
            opt.zero_grad()
            loss = nn.functional.mse_loss(m(x), y)
            loss.backward()
            return loss

        for _ in range(3):
            opt.step(closure)
        results.append([p.detach().clone() for p in m.parameters()])
    assert_identical([results[0]], [results[1]])


def test_add_param_group():
    m = small_model()
    extra = nn.Linear(3, 3)
    ref_m, ref_extra = copy.deepcopy(m), copy.deepcopy(extra)
    opt = KitsuneOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    ref = torch.optim.SGD(ref_m.parameters(), lr=0.1, momentum=0.9)
    opt.add_param_group({"params": extra.parameters(), "lr": 0.01})
    ref.add_param_group({"params": ref_extra.parameters(), "lr": 0.01})
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["momentum"] == 0.9
    x = torch.randn(4, 3)
    for model, layer, o in ((m, extra, opt), (ref_m, ref_extra, ref)):
        for _ in range(5):
            (
                model(torch.randn(2, 7, generator=torch.Generator().manual_seed(0))).sum() + layer(x).pow(2).sum()
            ).backward()
            o.step()
            o.zero_grad()
    assert torch.equal(extra.weight, ref_extra.weight)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), ref_m.parameters(), strict=True))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_modes(set_to_none):
    m = small_model()
    opt = KitsuneOptimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    m(torch.randn(2, 7)).sum().backward()
    opt.zero_grad(set_to_none=set_to_none)
    for p in m.parameters():
        if set_to_none:
            assert p.grad is None
        else:
            assert p.grad is not None and torch.count_nonzero(p.grad) == 0
    ref, ours = twin_runs(OPTIMIZERS["sgd_momentum"], steps=10)
    assert_identical(ref, ours)


@pytest.mark.filterwarnings(r"ignore:Using backward\(\) with create_graph")
def test_zero_grad_in_place_one_launch_per_dtype(monkeypatch):
    """zero_grad(set_to_none=False) leaves what torch's does (the same grad tensors, zero, detached, a sparse grad
    zeroed too) with one _foreach_zero_ per (device, dtype), whichever optimizer is wrapped: a plain AdamW would
    zero grad by grad, a launch each."""
    torch.manual_seed(0)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(
            nn.ModuleDict(
                {
                    "f32": nn.Linear(5, 4),
                    "f64": nn.Linear(5, 3).double(),
                    "bf16": nn.Linear(5, 2).to(torch.bfloat16),
                    "emb": nn.Embedding(10, 4, sparse=True),
                }
            )
        )
    x = torch.randn(3, 5)

    def backward(m):
        loss = m["f32"](x).pow(2).sum() + m["f64"](x.double()).pow(2).sum().float()
        loss = loss + m["bf16"](x.bfloat16()).float().pow(2).sum() + m["emb"](torch.tensor([1, 7])).pow(2).sum()
        loss.backward(create_graph=True)  # grads with a grad_fn: zero_grad must detach them

    ref_opt = torch.optim.SGD(models[0].parameters(), lr=0.1)  # sparse grads: SGD takes them
    opt = KitsuneOptimizer(torch.optim.SGD(models[1].parameters(), lr=0.1))
    calls = []
    real = torch._foreach_zero_
    monkeypatch.setattr(torch, "_foreach_zero_", lambda ts: (calls.append([t.dtype for t in ts]), real(ts)))
    for model, o in zip(models, (ref_opt, opt), strict=True):
        backward(model)
        assert all(p.grad.abs().sum() > 0 for p in model.parameters())
        grads = [p.grad for p in model.parameters()]
        calls.clear()
        o.zero_grad(set_to_none=False)
        for p, g in zip(model.parameters(), grads, strict=True):
            assert p.grad is g and p.grad.grad_fn is None and not p.grad.requires_grad
            assert torch.count_nonzero(p.grad.to_dense()) == 0
    assert sorted(map(str, (d for ds in calls for d in ds))) == sorted(
        str(p.dtype) for p in models[1].parameters() if p.grad is not None and not p.grad.is_sparse
    )
    assert sorted(len(set(ds)) for ds in calls) == [1, 1, 1]  # one launch per dtype


def test_zero_grad_is_labelled_in_a_torch_profile_and_sets_every_grad_to_none():
    m = small_model()
    opt = KitsuneOptimizer(torch.optim.AdamW(m.parameters(), lr=0.1))
    m(torch.randn(2, 7)).sum().backward()
    m[0].bias.grad = None  # one grad already None: left so
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.zero_grad()
    assert "Optimizer.zero_grad#KitsuneOptimizer.zero_grad" in {e.key for e in prof.key_averages()}
    assert all(p.grad is None for p in m.parameters())


def test_zero_grad_of_the_wrapped_optimizer_is_kept():
    class Counting(torch.optim.SGD):
        zero_grads = 0

        def zero_grad(self, set_to_none=True):
            Counting.zero_grads += 1
            super().zero_grad(set_to_none)

    m = small_model()
    opt = KitsuneOptimizer(Counting(m.parameters(), lr=0.1))
    m(torch.randn(2, 7)).sum().backward()
    opt.zero_grad(set_to_none=False)
    assert Counting.zero_grads == 1
    assert all(p.grad is not None and torch.count_nonzero(p.grad) == 0 for p in m.parameters())


def test_params_without_grad_are_skipped():
    m = small_model()
    frozen = m[2].weight
    before = frozen.detach().clone()
    opt = KitsuneOptimizer(torch.optim.AdamW(m.parameters(), lr=0.1))
    for _ in range(3):
        m(torch.randn(2, 7)).sum().backward()
        frozen.grad = None
        opt.step()
        opt.zero_grad()
    assert torch.equal(frozen, before)
    assert frozen not in opt.state


def test_step_hooks_on_wrapper_and_base_each_run_once():
    m = small_model()
    base = torch.optim.SGD(m.parameters(), lr=0.1)
    opt = KitsuneOptimizer(base)
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(("wrapper-pre", o is opt)))
    opt.register_step_post_hook(lambda o, a, k: seen.append(("wrapper-post", o is opt)))
    base.register_step_pre_hook(lambda o, a, k: seen.append(("base-pre", o is base)))
    base.register_step_post_hook(lambda o, a, k: seen.append(("base-post", o is base)))
    m(torch.randn(2, 7)).sum().backward()
    opt.step()
    assert seen == [("wrapper-pre", True), ("base-pre", True), ("base-post", True), ("wrapper-post", True)]


def test_state_dict_hooks_on_wrapper():
    m = small_model()
    opt = KitsuneOptimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "tag": 1})
    loaded = []
    opt.register_load_state_dict_post_hook(lambda o: loaded.append(o is opt))
    sd = opt.state_dict()
    assert sd["tag"] == 1
    opt.load_state_dict(sd)
    assert loaded == [True]


def test_pickle_and_deepcopy():
    m = small_model()
    opt = KitsuneOptimizer(torch.optim.Adam(m.parameters()), profile=True)
    train(m, opt, batches(2))
    for clone in (pickle.loads(pickle.dumps(opt)), copy.deepcopy(opt)):
        assert isinstance(clone, KitsuneOptimizer)
        assert clone.step_count == 2
        assert clone.config == opt.config


def test_copies_do_not_repeat_the_warning_their_original_gave():
    """torch's copies warn nothing; the original's warning at construction (fusion inactive on the CPU) is enough."""
    import warnings

    m = small_model()
    with pytest.warns(UserWarning, match="fusion was asked for but is inactive"):
        opt = KitsuneOptimizer(torch.optim.Adam(m.parameters()), enable_fusion=True)
    train(m, opt, batches(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copies = [pickle.loads(pickle.dumps(opt)), copy.deepcopy(opt), copy.copy(opt)]
    assert all(c.step_count == 1 for c in copies)


def test_load_state_dict_replans_and_keeps_sharing():
    m = small_model()
    base = torch.optim.Adam(m.parameters())
    opt = KitsuneOptimizer(base)
    train(m, opt, batches(2))
    opt.load_state_dict(opt.state_dict())
    assert opt.param_groups is base.param_groups and opt.state is base.state


def test_global_step_hooks_run_once_and_pre_hook_may_replace_args():
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    m = small_model()
    x, y = batches(1)[0]
    opt = KitsuneOptimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    seen = []

    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(m(x), y)
        loss.backward()
        return loss

    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: seen.append(("global-pre", type(o).__name__))),
        register_optimizer_step_post_hook(lambda o, a, k: seen.append(("global-post", type(o).__name__))),
    ]
    # a pre-hook that supplies the closure: step() gets it through the returned (args, kwargs)
    opt.register_step_pre_hook(lambda o, a, k: ((o, closure), {}))
    try:
        loss = opt.step()
    finally:
        for h in handles:
            h.remove()
    assert isinstance(loss, torch.Tensor)
    assert seen == [("global-pre", "KitsuneOptimizer"), ("global-post", "KitsuneOptimizer")]


@pytest.mark.parametrize("enable_fusion", [False, True], ids=["fusion off", "fusion on, nothing fused"])
@pytest.mark.parametrize("name", ["AdamW", "SGD", "Rprop"])
def test_a_state_dict_of_another_model_is_refused_where_no_param_is_fused(name, enable_fusion):
    """Without a fused param (fusion off, or CPU params outside the interpreter) the wrapped optimizer's own step
    updates every param, and torch's load takes state of another shape silently, to raise at the next step. kitsune
    refuses it at load, changing nothing, and the optimizer steps on as before."""
    kwargs = {"momentum": 0.9} if name == "SGD" else {}

    def trained(model):
        opt = getattr(torch.optim, name)(model.parameters(), lr=0.01, **kwargs)
        model(torch.randn(2, model.in_features)).sum().backward()
        opt.step()
        return opt

    torch.manual_seed(0)
    mine, other = nn.Linear(8, 8), nn.Linear(4, 16)
    opt = KitsuneOptimizer(trained(mine), enable_fusion=enable_fusion)
    assert not any(b.route.fused for b in opt.plan.buckets) if opt.plan else True
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="saved for another model"):
        opt.load_state_dict(trained(other).state_dict())
    after = opt.state_dict()
    for pid, st in before["state"].items():
        for key, t in st.items():
            assert torch.equal(t, after["state"][pid][key]) if torch.is_tensor(t) else t == after["state"][pid][key]
    mine(torch.randn(2, 8)).sum().backward()
    opt.step()


def test_the_inactive_subsystem_warning_points_at_the_users_line():
    """Fusion asked for on CPU params (no Triton interpreter): the warning names the line that built the optimizer,
    not one inside kitsune or the interpreter's ``sys:1``."""
    import warnings

    params = [torch.nn.Parameter(torch.randn(3))]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        KitsuneOptimizer(torch.optim.SGD(params, lr=0.1), enable_fusion=True)
    inactive = [w for w in caught if "was asked for but is inactive" in str(w.message)]
    assert inactive and inactive[0].filename == __file__ and inactive[0].lineno == line


class _SGDWithItsOwnInit(KitsuneOptimizer):
    """A subclass whose constructor takes other arguments than KitsuneOptimizer's (module-level: pickle finds it)."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(torch.optim.SGD(params, lr=lr, momentum=0.9))


def test_a_subclass_with_its_own_init_copies_and_pickles_as_torchs_do():
    """Copies and pickles restored by calling the subclass's __init__ with KitsuneOptimizer's arguments (TypeError:
    unexpected keyword 'config'); torch restores an optimizer without its class's __init__, and so does kitsune."""
    p = nn.Parameter(torch.randn(5))
    opt = _SGDWithItsOwnInit([p], lr=0.1)
    p.grad = torch.randn(5)
    opt.step()
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt)), copy.copy(opt)):
        assert type(clone) is _SGDWithItsOwnInit
        q = clone.param_groups[0]["params"][0]
        assert torch.equal(clone.state[q]["momentum_buffer"], opt.state[p]["momentum_buffer"])


def test_the_memory_profiler_sees_the_optimizer_step(monkeypatch):
    """torch's step wrapper calls Optimizer._optimizer_step_code after each step under a profiler: torch's memory
    profiler hooks it to tell optimizer state from params (its OPTIMIZER_STATE category). kitsune's step calls it
    too, once a step."""
    calls: list[str] = []
    monkeypatch.setattr(torch.optim.Optimizer, "_optimizer_step_code", lambda self: calls.append(type(self).__name__))
    p = nn.Parameter(torch.randn(5))
    opt = KitsuneOptimizer(torch.optim.Adam([p], lr=0.1))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        for _ in range(3):
            p.grad = torch.randn(5)
            opt.step()
    assert calls.count("KitsuneOptimizer") == 3


def test_setstate_on_a_live_optimizer_keeps_its_hooks_as_torchs_does():
    """torch's ``__setstate__`` updates a live optimizer's ``__dict__``: hooks registered on it keep firing. A
    KitsuneOptimizer restored in place keeps them too, its state and step count those of the state it was given."""
    calls: dict[str, list[str]] = {"torch": [], "kitsune": []}
    m = small_model()
    opts = {"torch": torch.optim.Adam(m.parameters()), "kitsune": KitsuneOptimizer(torch.optim.Adam(m.parameters()))}
    for name, opt in opts.items():
        opt.register_step_pre_hook(lambda *_, name=name: calls[name].append("pre"))
        opt.register_step_post_hook(lambda *_, name=name: calls[name].append("post"))
        opt.register_state_dict_post_hook(lambda *_, name=name: calls[name].append("state_dict"))
        opt.register_load_state_dict_post_hook(lambda *_, name=name: calls[name].append("load"))
    train(m, opts["kitsune"], batches(2))
    saved = opts["kitsune"].__getstate__()
    for name, opt in opts.items():
        opt.__setstate__(saved if name == "kitsune" else opt.__getstate__())
        calls[name].clear()
        for p in m.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        opt.load_state_dict(opt.state_dict())
    assert calls["kitsune"] == calls["torch"] == ["pre", "post", "state_dict", "load"]
    assert opts["kitsune"].step_count == 3


def test_setstate_that_fails_leaves_a_live_optimizer_as_it_was():
    """A state whose kitsune part is refused raises, and the live optimizer keeps its hooks, its profiler, its state
    and its step count: it trains on as if nothing happened."""
    m = small_model()
    opt = KitsuneOptimizer(torch.optim.Adam(m.parameters()), profile=True)
    calls: list[str] = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    train(m, opt, batches(2))
    profiler, state = opt.profiler, copy.deepcopy(opt.state_dict())
    bad = opt.__getstate__()
    bad["kitsune"] = {"version": -1}
    with pytest.raises((ValueError, KeyError, TypeError)):
        opt.__setstate__(bad)
    assert opt.profiler is profiler and opt.step_count == 2
    torch.testing.assert_close(opt.state_dict(), state)
    calls.clear()
    train(m, opt, batches(1))
    assert calls == ["pre"] and opt.step_count == 3
