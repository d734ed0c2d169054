"""torch's promises at the seams of the step, on the fused path: a step that raises changes nothing, hooks run where
torch runs them, a rejected load keeps the old state, missing state keys raise as torch does, copies carry every
piece of state, a dropped optimizer is freed at once, state dicts have exactly torch's keys, and a param moved to
float64 mid-run keeps training as plain torch does."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from twins import make_params, random_grads, record_graphs

from kitsune import AMPConfig, FusionConfig, GradConfig, KitsuneConfig, KitsuneOptimizer, MemoryConfig, StreamConfig
from kitsune.fusion import Route
from kitsune.optim import LAMB, Lion, Muon


def _graphs_on(opt: KitsuneOptimizer, device: torch.device) -> None:
    """CUDA graphs for ``opt``'s step: real ones on a GPU, the recording stand-in on the CPU."""
    if device.type == "cuda":
        assert opt._subsystem("graphs").active, opt._subsystem("graphs").reason
    else:
        record_graphs(opt)


def _twins(make: Callable, sizes: list, device: torch.device) -> tuple[list, list, KitsuneOptimizer, Any]:
    """Two copies of the same params: ``KitsuneOptimizer(make(params), enable_fusion=True)`` and ``make(twins)``."""
    params = make_params(sizes, torch.float32, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    return params, twins, KitsuneOptimizer(make(params), enable_fusion=True), make(twins)


def _step(pairs: list[tuple[list, Any]], step: int, skip: int | None = None) -> None:
    """Fresh grads of ``step`` on each ``(params, optimizer)`` pair (param ``skip`` gets none), then each steps."""
    for ps, o in pairs:
        for i, (p, g) in enumerate(zip(ps, random_grads(ps, step), strict=True)):
            p.grad = None if i == skip else g.to(p.dtype)
        o.step()


def _snapshot(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Every param, grad and state value of ``opt`` (copies), and its step count."""
    params = [p for g in opt.param_groups for p in g["params"]]

    def grad(p: torch.Tensor) -> Any:
        g = p.grad
        return None if g is None else (id(g), g.to_dense().clone() if g.is_sparse else g.clone())

    state = {
        i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
        for i, p in enumerate(params)
        if p in opt.state
    }
    return {
        "params": [p.detach().clone() for p in params],
        "grads": [grad(p) for p in params],
        "state": state,
        "step_count": getattr(opt, "step_count", None),
    }


def _assert_unchanged(before: dict[str, Any], opt: torch.optim.Optimizer) -> None:
    after = _snapshot(opt)
    assert after["step_count"] == before["step_count"]
    for a, b in zip(after["params"], before["params"], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(after["grads"], before["grads"], strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a[0] == b[0] and torch.equal(a[1], b[1])  # the same grad tensor, the same values
    assert after["state"].keys() == before["state"].keys()
    for i, st in before["state"].items():
        assert after["state"][i].keys() == st.keys(), i
        for k, v in st.items():
            w = after["state"][i][k]
            assert torch.equal(w, v) if isinstance(v, torch.Tensor) else w == v, (i, k)


# -- 1. a step that raises changes no param, grad, state or step count --------------------------------------------
def _linear_and_sparse_embedding(device: torch.device) -> tuple[torch.nn.Module, torch.nn.Embedding]:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3).to(device), torch.nn.Embedding(6, 3, sparse=True).to(device)


def _fused(flat_grads: bool = False, **fusion: Any) -> KitsuneConfig:
    """The one line's settings; ``flat_grads``: the pool's flat grad arena too (the step moves new grads into it)."""
    return KitsuneConfig(fusion=FusionConfig(enabled=True, **fusion), memory=MemoryConfig(flat_grads=flat_grads))


@pytest.mark.parametrize("flat_grads", [False, True], ids=["grads", "flat_grads"])
@pytest.mark.parametrize("warm", [0, 3], ids=["first_step", "after_three_steps"])
def test_a_step_refused_by_the_wrapped_step_changes_nothing(warm, flat_grads, device):
    """AdamW over a Linear (fused) and a sparse Embedding (the wrapped AdamW's own step, which refuses sparse grads):
    the refusal leaves the Linear, every grad and all state as they were, and a retry after the fix steps once.
    With flat grads the Linear's new grads were moved into the arena before the refusal: they are the user's
    tensors again after it."""
    lin, emb = _linear_and_sparse_embedding(device)
    params = [*lin.parameters(), emb.weight]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params[:2]]
    opt = KitsuneOptimizer(torch.optim.AdamW(params, lr=0.1), config=_fused(flat_grads))
    ref = torch.optim.AdamW(twins, lr=0.1)
    for step in range(warm):  # the embedding gets no grad: it is skipped
        for p, t, g in zip(params[:2], twins, random_grads(params[:2], step), strict=True):
            p.grad, t.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for p, t, g in zip(params[:2], twins, random_grads(params[:2], 99), strict=True):
        p.grad, t.grad = g.clone(), g.clone()
    emb(torch.tensor([1, 2], device=device)).sum().backward()  # a sparse grad
    before = _snapshot(opt)
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()
    _assert_unchanged(before, opt)
    emb.weight.grad = None  # the fix: no sparse grad for AdamW; the retry updates the Linear once
    opt.step()
    ref.step()
    assert opt.step_count == warm + 1
    for p, t in zip(params[:2], twins, strict=True):
        torch.testing.assert_close(p, t, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("where", ["wrapper", "wrapped"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_a_step_whose_pre_hook_raises_changes_nothing(where, graphs, device):
    params = make_params([(4, 3), 5], torch.float32, device)
    opt = KitsuneOptimizer(torch.optim.AdamW(params, lr=0.1), enable_fusion=True, capture_graph=graphs)
    if graphs:
        _graphs_on(opt, device)
    fail = [False]

    def hook(*_: Any) -> None:
        if fail[0]:
            raise RuntimeError("refused by a hook")

    (opt if where == "wrapper" else opt.base_optimizer).register_step_pre_hook(hook)
    for step in range(8):  # past warm-up and capture: the steady replay on the graphs side
        for p, g in zip(params, random_grads(params, step), strict=True):
            p.grad = g
        opt.step()
    fail[0] = True
    before = _snapshot(opt)
    with pytest.raises(RuntimeError, match="refused by a hook"):
        opt.step()
    _assert_unchanged(before, opt)


def test_a_step_refusing_to_clip_sparse_grads_changes_nothing(device):
    """max_grad_norm over a sparse grad is refused before any grad, param or state changes."""
    lin, emb = _linear_and_sparse_embedding(device)
    params = [*lin.parameters(), emb.weight]
    opt = KitsuneOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9), enable_fusion=True, max_grad_norm=1.0)
    lin(torch.randn(2, 4, device=device)).sum().backward()
    emb(torch.tensor([1, 2], device=device)).sum().backward()
    before = _snapshot(opt)
    with pytest.raises(ValueError, match="sparse"):
        opt.step()
    _assert_unchanged(before, opt)


def _expanded_grads(params: list[torch.nn.Parameter], step: int) -> None:
    """Fresh grads of ``step``; the second param's (a vector) is one value expanded, its elements sharing memory."""
    for p, g in zip(params, random_grads(params, step), strict=True):
        p.grad = g
    params[1].grad = random_grads(params, step)[1][:1].expand(params[1].shape)


def test_a_clipped_step_refuses_a_grad_whose_elements_share_memory_and_changes_nothing(device):
    """The fused step writes clipped grads back; an expanded grad cannot take that (torch's clip_grad_norm_ refuses
    it too): refused before anything changes, and after the named fix the steps go on as torch's clip and step."""
    params = make_params([(4, 5), 7, (3, 3)], torch.float32, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = KitsuneOptimizer(torch.optim.Adam(params, lr=0.1), enable_fusion=True, max_grad_norm=1.0)
    ref = torch.optim.Adam(twins, lr=0.1)
    assert {b.route.value for b in opt.plan.buckets} == {"triton"}
    for step in range(4):
        _expanded_grads(params, step)
        _expanded_grads(twins, step)
        if step == 1:
            before = _snapshot(opt)
            with pytest.raises(ValueError, match=r"share memory .*p\.grad = p\.grad\.clone\(\)"):
                opt.step()
            _assert_unchanged(before, opt)
        for p in (*params, *twins):
            p.grad = p.grad.clone()  # the fix the error names
        opt.step()
        torch.nn.utils.clip_grad_norm_(twins, 1.0)
        ref.step()
        for p, t in zip(params, twins, strict=True):
            torch.testing.assert_close(p, t, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(p.grad, t.grad, rtol=1e-5, atol=1e-6)  # the clipped grads, written back
    assert opt.step_count == 4


def test_zero_in_step_zeroes_a_grad_whose_elements_share_memory(device):
    """With zero_in_step the grads end as zeros, which an expanded grad takes in place (as zero_grad does): the
    steps match torch's step then zero_grad(set_to_none=False)."""
    params = make_params([(4, 5), 7, (3, 3)], torch.float32, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    zero = GradConfig(zero_in_step=True)
    opt = KitsuneOptimizer(torch.optim.Adam(params, lr=0.1), enable_fusion=True, grad_config=zero)
    ref = torch.optim.Adam(twins, lr=0.1)
    assert {b.route.value for b in opt.plan.buckets} == {"triton"}
    for step in range(4):
        _expanded_grads(params, step)
        _expanded_grads(twins, step)
        opt.step()
        ref.step()
        ref.zero_grad(set_to_none=False)
        for p, t in zip(params, twins, strict=True):
            torch.testing.assert_close(p, t, rtol=1e-5, atol=1e-6)
            assert torch.equal(p.grad, t.grad) and not p.grad.any()


@pytest.mark.parametrize("leaf", [True, False], ids=["view_of_a_leaf", "view_of_a_product"])
def test_a_clipped_grad_that_is_a_view_of_a_tensor_requiring_grad_is_written_back(leaf, device):
    """A grad that is a transposed view of a tensor requiring grad: the clipped values are written back with
    autograd off, as torch's clip_grad_norm_ writes them (the write used to raise after the update)."""
    params = make_params([(4, 5), 7], torch.float32, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = KitsuneOptimizer(torch.optim.Adam(params, lr=0.1), enable_fusion=True, max_grad_norm=0.5)
    ref = torch.optim.Adam(twins, lr=0.1)
    for step in range(3):
        for ps in (params, twins):
            for p, g in zip(ps, random_grads(ps, step), strict=True):
                p.grad = g
            base = random_grads(ps, step + 100)[0].t().contiguous().requires_grad_(True)
            ps[0].grad = base.t() if leaf else (base * 1).t()
        opt.step()
        torch.nn.utils.clip_grad_norm_(twins, 0.5)
        ref.step()
        for p, t in zip(params, twins, strict=True):
            torch.testing.assert_close(p, t, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(p.grad, t.grad, rtol=1e-5, atol=1e-6)
    assert opt.step_count == 3


@pytest.mark.parametrize("where", ["new_tensor", "same_memory"])
@pytest.mark.parametrize("native", [True, False], ids=["native_check", "python_check"])
def test_a_grad_of_the_params_numel_but_another_shape_is_refused(where, native, device):
    """A (4, 5) param whose grad is (5, 4): torch's step raises on it; the fused one read it as flat memory and
    updated silently. Refused now before anything changes, whether the grad is a new tensor or the old memory
    reshaped where it sits, and by the native check as by the Python one."""
    params = make_params([(4, 5), 7], torch.float32, device)
    opt = KitsuneOptimizer(
        torch.optim.Adam(params, lr=0.1), enable_fusion=True, fusion_config=FusionConfig(native_checks=native)
    )
    for step in range(2):
        for p, g in zip(params, random_grads(params, step), strict=True):
            p.grad = g
        opt.step()
    g = params[0].grad
    params[0].grad.data = torch.randn(5, 4, device=device) if where == "new_tensor" else g.data.view(5, 4)
    before = _snapshot(opt)
    with pytest.raises(ValueError, match=r"has a grad of shape \(5, 4\)"):
        opt.step()
    _assert_unchanged(before, opt)


@pytest.mark.parametrize("flat_grads", [False, True], ids=["grads", "flat_grads"])
@pytest.mark.parametrize("bad", [0, 1], ids=["first_unit", "second_unit"])
def test_a_refusal_in_one_unit_undoes_what_the_others_prepared(bad, flat_grads, device):
    """Two fused units (one tensor a launch), first step: the one whose grad has another shape refuses the step.
    The other unit, prepared before it, had made its lazy state and (flat grads) moved its grad into the arena:
    both are undone, so no state stands, each param holds its own grad tensor, and the retry after the fix
    follows torch's AdamW."""
    params = make_params([(4, 5), (3, 6)], torch.float32, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = KitsuneOptimizer(torch.optim.AdamW(params, lr=0.1), config=_fused(flat_grads, max_fusion_size=1))
    ref = torch.optim.AdamW(twins, lr=0.1)
    assert [(b.route, b.tensors, b.launches) for b in opt.plan.buckets] == [(Route.TRITON, 2, 2)]
    grads = random_grads(params, 0)
    for p, t, g in zip(params, twins, grads, strict=True):
        p.grad, t.grad = g.clone(), g.clone()
    good = params[bad].grad
    params[bad].grad.data = good.data.view(tuple(reversed(good.shape)))
    before = _snapshot(opt)
    with pytest.raises(ValueError, match="has a grad of shape"):
        opt.step()
    _assert_unchanged(before, opt)
    assert not opt.state
    params[bad].grad.data = good.data.view(params[bad].shape)  # the fix
    for step in range(4):
        opt.step()
        ref.step()
        for p, t in zip(params, twins, strict=True):
            torch.testing.assert_close(p, t, rtol=1e-6, atol=1e-6)
        for p, t, g in zip(params, twins, random_grads(params, step + 1), strict=True):
            p.grad, t.grad = g.clone(), g.clone()


def _follow_torch(params: list, twins: list, opt: Any, ref: Any, steps: range) -> None:
    """Fresh grads for both, a step of each, and the params compared, for each of ``steps``."""
    for step in steps:
        _step([(params, opt), (twins, ref)], step)
        for p, t in zip(params, twins, strict=True):
            torch.testing.assert_close(p, t, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("flat_grads", [False, True], ids=["grads", "flat_grads"])
def test_a_first_step_that_raises_while_binding_new_state_binds_afresh_on_the_retry(flat_grads, device, monkeypatch):
    """The first step makes the state and binds the kernels' tables to it; an error there (the page-locked table's
    allocation out of memory) removes the new state. The retry makes the state again and binds it (it launched on
    tables that never pointed at any state: a crash, or writes through stale addresses)."""
    from kitsune.fusion.units import FusedUnit

    params = make_params([(4, 5), 7, (3, 6)], torch.float32, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = KitsuneOptimizer(torch.optim.AdamW(params, lr=0.1, weight_decay=0.1), config=_fused(flat_grads))
    ref = torch.optim.AdamW(twins, lr=0.1, weight_decay=0.1, foreach=False)
    assert [b.route for b in opt.plan.buckets] == [Route.TRITON]
    bind = FusedUnit.bind

    def failing_bind(unit: FusedUnit, state: Any) -> None:
        monkeypatch.setattr(FusedUnit, "bind", bind)  # once
        raise torch.OutOfMemoryError("out of memory (page-locked)")

    monkeypatch.setattr(FusedUnit, "bind", failing_bind)
    for p, g in zip(params, random_grads(params, 0), strict=True):
        p.grad = g.clone()
    before = _snapshot(opt)
    with pytest.raises(torch.OutOfMemoryError):
        opt.step()
    _assert_unchanged(before, opt)
    assert not opt.state
    _follow_torch(params, twins, opt, ref, range(5))
    assert [b.route for b in opt.plan.buckets] == [Route.TRITON]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("warm", [0, 2], ids=["first_step", "third_step"])
def test_a_step_that_raises_after_its_launch_keeps_what_the_kernels_wrote(warm, graphs, device, monkeypatch):
    """An error after the update was queued (a CUDA error surfacing in the step's bookkeeping, an interrupt): the
    params and state the kernels wrote stand, the first step's new state included (it was removed while the params
    kept the update made with it, and the next steps left torch's trajectory), and the steps after it follow
    torch's, which took that step in full."""
    from kitsune.fusion.executor import FusionSubsystem

    params = make_params([(4, 5), 7, (3, 6)], torch.float32, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = KitsuneOptimizer(torch.optim.AdamW(params, lr=0.1, weight_decay=0.1), config=_fused())
    ref = torch.optim.AdamW(twins, lr=0.1, weight_decay=0.1, foreach=False)
    if graphs:
        _graphs_on(opt, device)
    assert [b.route for b in opt.plan.buckets] == [Route.TRITON]
    _follow_torch(params, twins, opt, ref, range(warm))
    finish = FusionSubsystem.finish

    def failing_finish(self: FusionSubsystem, *args: Any, **kwargs: Any) -> None:
        monkeypatch.setattr(FusionSubsystem, "finish", finish)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(FusionSubsystem, "finish", failing_finish)
    for p, t, g in zip(params, twins, random_grads(params, warm), strict=True):
        p.grad, t.grad = g.clone(), g.clone()
    with pytest.raises(RuntimeError, match="CUDA error"):
        opt.step()
    ref.step()
    for p, t in zip(params, twins, strict=True):
        torch.testing.assert_close(p, t, rtol=1e-6, atol=1e-6)
        assert opt.state[p].keys() == ref.state[t].keys()
        for key, value in ref.state[t].items():  # (the step count on the device, as torch's fused step keeps it)
            torch.testing.assert_close(opt.state[p][key], value, rtol=1e-6, atol=1e-6, check_device=False)
    _follow_torch(params, twins, opt, ref, range(warm + 1, warm + 5))


@pytest.mark.parametrize("value", ["abc", "0.01", None, [0.1]], ids=["text", "numeric_text", "none", "list"])
def test_a_hyperparameter_that_is_no_number_is_refused_naming_the_group(value, device):
    """lr set by hand to something the step cannot read as a number: the error names the group and the value (it
    was float()'s bare message), nothing changes, and with the lr put back the steps go on as a twin's."""
    params, twins, opt, ref = _twins(lambda ps: torch.optim.AdamW(ps, lr=0.1), [(4, 3), 5], device)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3, device=device))], "lr": 0.05})
    ref.add_param_group({"params": [torch.nn.Parameter(opt.param_groups[1]["params"][0].detach().clone())], "lr": 0.05})
    pairs = [(params + opt.param_groups[1]["params"], opt), (twins + ref.param_groups[1]["params"], ref)]
    _step(pairs, 0)
    opt.param_groups[1]["lr"] = value
    for p, g in zip(pairs[0][0], random_grads(pairs[0][0], 1), strict=True):
        p.grad = g
    before = _snapshot(opt)
    with pytest.raises(TypeError, match=r"param group 1 holds .* where its step reads a number"):
        opt.step()
    _assert_unchanged(before, opt)
    opt.param_groups[1]["lr"] = 0.05
    for step in range(1, 4):
        _step(pairs, step)
    for p, t in zip(*(ps for ps, _ in pairs), strict=True):
        torch.testing.assert_close(p, t, rtol=1e-5, atol=1e-6)


def test_add_param_group_the_plan_cannot_read_is_taken_back(device):
    """A group whose switch has the wrong type (momentum="0.9"): the plan raises, and the group is removed again
    (it was left in place, with a plan of the old groups); the optimizer then steps as its twin that never tried."""
    params, twins, opt, ref = _twins(lambda ps: torch.optim.RMSprop(ps[:2], lr=0.01), [(4, 3), 5, 6], device)
    _step([(params, opt), (twins, ref)], 0)
    with pytest.raises(TypeError, match="param group 1 of RMSprop holds a switch of a type"):
        opt.add_param_group({"params": [params[2]], "momentum": "0.9"})
    assert len(opt.param_groups) == 1 and sum(b.tensors for b in opt.plan.buckets) == 2
    opt.add_param_group({"params": [params[2]], "momentum": 0.9})
    ref.add_param_group({"params": [twins[2]], "momentum": 0.9})
    for step in range(1, 4):
        _step([(params, opt), (twins, ref)], step)
    for p, t in zip(params, twins, strict=True):
        torch.testing.assert_close(p, t, rtol=1e-5, atol=1e-6)


def test_a_checkpoint_whose_group_the_plan_cannot_read_loads_nothing(device):
    """A loaded group with momentum="0.9" (torch's load takes it; its step would raise): the plan raises inside the
    load, which puts the old state and groups back."""
    params = make_params([(4, 3), 5], torch.float32, device)
    opt = KitsuneOptimizer(torch.optim.RMSprop(params, lr=0.1), enable_fusion=True)
    _step([(params, opt)], 0)
    sd = opt.state_dict()
    sd["param_groups"][0]["momentum"] = "0.9"
    _refused_load(opt, sd, TypeError, "param group 0 of RMSprop holds a switch of a type")
    assert {b.route.value for b in opt.plan.buckets} == {"triton"}
    _step([(params, opt)], 1)  # and it still steps
    assert opt.step_count == 2


# -- 2. hooks run where torch runs them ---------------------------------------------------------------------------
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_a_wrapped_optimizers_pre_hook_runs_before_the_update(graphs, device):
    """SGD with lr 1 from p = 0 with grad 1 and a pre-hook (on the wrapped optimizer) halving the grads: p is -0.5,
    as torch gives, step after step (the steady replay included)."""
    p = torch.nn.Parameter(torch.zeros(4, device=device))
    opt = KitsuneOptimizer(torch.optim.SGD([p], lr=1.0), enable_fusion=True, capture_graph=graphs)
    if graphs:
        _graphs_on(opt, device)

    def halve(
        o: torch.optim.Optimizer, *_: Any
    ) -> None:  # (a hook returning anything but None or (args, kwargs) raises)
        for q in o.param_groups[0]["params"]:
            q.grad.mul_(0.5)

    opt.base_optimizer.register_step_pre_hook(halve)
    for step in range(8):
        p.grad = torch.ones_like(p)
        with torch.no_grad():
            p.zero_()
        opt.step()
        assert torch.equal(p.detach(), torch.full_like(p, -0.5)), step


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_hooks_run_in_torchs_order_around_the_update(graphs, device):
    params = make_params([3, (2, 2)], torch.float32, device)
    opt = KitsuneOptimizer(torch.optim.AdamW(params, lr=0.1), enable_fusion=True, capture_graph=graphs)
    if graphs:
        _graphs_on(opt, device)
    seen: list[tuple[str, bool]] = []
    start: list[torch.Tensor] = []

    def note(name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:  # whether the params moved since the step began
            seen.append((name, not all(torch.equal(p, s) for p, s in zip(params, start, strict=True))))

        return hook

    handles = [
        register_optimizer_step_pre_hook(note("global pre")),
        opt.register_step_pre_hook(note("pre")),
        opt.base_optimizer.register_step_pre_hook(note("wrapped pre")),
        opt.base_optimizer.register_step_post_hook(note("wrapped post")),
        opt.register_step_post_hook(note("post")),
        register_optimizer_step_post_hook(note("global post")),
    ]
    try:
        for step in range(8):
            for p, g in zip(params, random_grads(params, step), strict=True):
                p.grad = g
            start[:] = [p.detach().clone() for p in params]
            seen.clear()
            opt.step()
            assert seen == [
                ("global pre", False),
                ("pre", False),
                ("wrapped pre", False),
                ("wrapped post", True),
                ("post", True),
                ("global post", True),
            ], step
    finally:
        for h in handles:
            h.remove()


# -- 3. a rejected load_state_dict leaves the old state working ---------------------------------------------------
@pytest.mark.parametrize("pool", [True, False], ids=["pool", "no_pool"])
def test_a_rejected_load_keeps_the_old_state(pool, device):
    params = make_params([(4, 3), 5], torch.float32, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    kw = {"enable_fusion": True, "memory_pool_size": 512 * 2**20 if pool else 0}
    opt = KitsuneOptimizer(torch.optim.AdamW(params, lr=0.1), **kw)
    ref = KitsuneOptimizer(torch.optim.AdamW(twins, lr=0.1), **kw)
    other = make_params([(3, 4), 7], torch.float32, device)  # another model: as many params, other shapes
    other_opt = torch.optim.AdamW(other, lr=0.1)
    for step in range(3):
        _step([(params, opt), (twins, ref), (other, other_opt)], step)
    before = _snapshot(opt)
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict(other_opt.state_dict())
    _assert_unchanged(before, opt)
    for step in range(3, 8):  # and it goes on as its twin that never tried
        _step([(params, opt), (twins, ref)], step)
    for p, t in zip(params, twins, strict=True):
        assert torch.equal(p, t)


def test_load_of_a_file_path_names_the_fix(device):
    opt = KitsuneOptimizer(torch.optim.AdamW(make_params([3], torch.float32, device)), enable_fusion=True)
    with pytest.raises(TypeError, match="torch.load"):
        opt.load_state_dict("ckpt.pt")  # type: ignore[arg-type]


def _refused_load(opt: KitsuneOptimizer, sd: dict[str, Any], error: type[Exception], match: str) -> None:
    """Loading ``sd`` (its lr changed to 0.5, from 0.1) raises ``error`` and changes nothing, the lr included."""
    sd["param_groups"][0]["lr"] = 0.5
    before = _snapshot(opt)
    with pytest.raises(error, match=match):
        opt.load_state_dict(sd)
    _assert_unchanged(before, opt)
    assert opt.param_groups[0]["lr"] == 0.1


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ([1, 2], "'kitsune' entry must be a dict"),
        ({"subsystems": {"amp": {"scale": "x"}}}, "loss scaler"),
        ({"foo": 1}, "keys kitsune does not write"),
        ({"version": 1, "step_count": -5}, "step_count=-5"),
        ({"version": "abc", "step_count": 3}, "version='abc'"),
        ({"version": 1, "step_count": 3, "subsystems": [1]}, "subsystems of type list"),
        ({"subsystems": {"amp": {"scale": 1024.0, "growth_tracker": 7, "skipped_steps": "x"}}}, "skipped_steps"),
        ({"subsystems": {"amp": {"scale": 1024.0, "growth_tracker": 2**40}}}, "growth_tracker=1099511627776"),
        ({"subsystems": {"amp": {"scale": 1024.0, "growth_tracker": 3, "skipped_steps": -5}}}, "skipped_steps=-5"),
        (
            {"subsystems": {"ampp": {"scale": 1024.0, "growth_tracker": 3}}},
            "subsystems kitsune does not have \\(ampp\\)",
        ),
        ({"subsystems": {"fusion": ["rounding_steps"]}}, "fusion entry of type list"),
    ],
    ids=[
        "list",
        "bad_scaler",
        "unknown_key",
        "negative_count",
        "text_version",
        "subsystems_list",
        "text_skipped",
        "huge_tracker",
        "negative_skipped",
        "unknown_subsystem",
        "fusion_list",
    ],
)
def test_a_malformed_kitsune_entry_names_the_problem_and_loads_nothing(entry, match, device):
    params = make_params([(4, 3), 5], torch.float32, device)
    opt = KitsuneOptimizer(torch.optim.AdamW(params, lr=0.1), enable_fusion=True, enable_amp=True)
    opt.backward(sum(p.sum() for p in params))
    opt.step()
    sd = opt.state_dict()
    sd["kitsune"] = entry
    _refused_load(opt, sd, ValueError, match)


@pytest.mark.parametrize(
    ("spoil", "error", "match"),
    [
        (lambda st: st.__setitem__("exp_avg", [0.5] * 12), ValueError, "'exp_avg' .* is a list"),
        (lambda st: st.__setitem__("exp_avg", torch.ones(4, 3).to_sparse()), ValueError, "sparse_coo tensor"),
        (lambda st: st.__setitem__("step", torch.ones(2)), ValueError, "'step' .* one-element tensor"),
        (lambda st: st.pop("step"), KeyError, "step"),  # torch's AdamW raises in its __setstate__, state in place
    ],
    ids=["list", "sparse", "step_shape", "no_step"],
)
def test_a_checkpoint_of_values_the_step_cannot_read_loads_nothing(spoil, error, match, device):
    """Values a step could not read fail the load, not a later step, and leave the optimizer as it was: the old
    state bound and working (a step after the failed load goes on as a twin that never tried)."""
    params = make_params([(4, 3), 5], torch.float32, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = KitsuneOptimizer(torch.optim.AdamW(params, lr=0.1), enable_fusion=True)
    ref = KitsuneOptimizer(torch.optim.AdamW(twins, lr=0.1), enable_fusion=True)
    for step in range(2):
        _step([(params, opt), (twins, ref)], step)
    sd = copy.deepcopy(opt.state_dict())
    spoil(sd["state"][0])
    _refused_load(opt, sd, error, match)
    for step in range(2, 5):
        _step([(params, opt), (twins, ref)], step)
    for p, t in zip(params, twins, strict=True):
        assert torch.equal(p, t)
    assert opt.plan.fused_tensors == 2


@pytest.mark.parametrize(
    ("make", "key"),
    [
        (lambda ps: torch.optim.AdamW(ps, lr=0.1), "step"),
        (lambda ps: torch.optim.NAdam(ps, lr=0.1), "mu_product"),
    ],
    ids=["adamw_step", "nadam_mu_product"],
)
def test_an_8bit_checkpoint_missing_a_step_count_loads_nothing(make, key, device):
    """An 8-bit checkpoint whose second param's state lacks a scalar torch keeps in every state (torch's load raises
    ``KeyError`` on such state): refused at the load, changing nothing. It loaded, and the next step raised."""
    params = make_params([(16, 16), (8, 40)], torch.float32, device)
    config = FusionConfig(state_precision="8bit", min_8bit_size=0)
    opt = KitsuneOptimizer(make(params), enable_fusion=True, fusion_config=config)
    assert [b.state for b in opt.plan.buckets] == ["8-bit"]
    for step in range(2):
        _step([(params, opt)], step)
    sd = copy.deepcopy(opt.state_dict())
    del sd["state"][1][key]
    _refused_load(opt, sd, KeyError, key)
    _step([(params, opt)], 2)
    assert opt.step_count == 3


@pytest.mark.parametrize("refused", [False, True], ids=["loaded", "refused"])
def test_the_wrapped_optimizers_load_post_hooks_run_only_for_a_load_that_holds(refused, device):
    """A load post-hook registered on the wrapped optimizer ran inside its load, before kitsune's own checks, so it
    saw a checkpoint kitsune then refused and rolled back; torch runs none for a failed load. It runs now once the
    load holds, before the wrapper's own post-hooks (the wrapped optimizer's load ends first), seeing what loaded."""
    params = make_params([(4, 3), 5], torch.float32, device)
    opt = KitsuneOptimizer(torch.optim.AdamW(params, lr=0.1), enable_fusion=True)
    for step in range(2):
        _step([(params, opt)], step)
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["lr"] = 0.5
    if refused:
        sd["state"][0]["exp_avg"] = torch.ones(3, 4, device=device)  # another model's shape
    seen: list[tuple[str, Any]] = []
    opt.base_optimizer.register_load_state_dict_post_hook(lambda o: seen.append(("wrapped", o.param_groups[0]["lr"])))
    opt.register_load_state_dict_post_hook(lambda o: seen.append(("wrapper", o.param_groups[0]["lr"])))
    if refused:
        with pytest.raises(ValueError, match="shape"):
            opt.load_state_dict(sd)
        assert seen == [] and opt.param_groups[0]["lr"] == 0.1
    else:
        opt.load_state_dict(sd)
        assert seen == [("wrapped", 0.5), ("wrapper", 0.5)]
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # the hook stays registered
    assert seen[-2:] == [("wrapped", opt.param_groups[0]["lr"]), ("wrapper", opt.param_groups[0]["lr"])]


# -- 4. missing state keys raise as torch does --------------------------------------------------------------------
def _both_raise_key_error(ref: torch.optim.Optimizer, opt: KitsuneOptimizer, key: str) -> None:
    """torch's step raises ``KeyError(key)``, and so does kitsune's, changing nothing."""
    before = _snapshot(opt)
    with pytest.raises(KeyError, match=key):
        ref.step()
    with pytest.raises(KeyError, match=key):
        opt.step()
    _assert_unchanged(before, opt)


def _drop(sd: dict[str, Any], key: str) -> dict[str, Any]:
    sd = copy.deepcopy(sd)
    for st in sd["state"].values():
        st.pop(key, None)
    return sd


@pytest.mark.parametrize(
    ("make", "key"),
    [
        (lambda ps: torch.optim.AdamW(ps, lr=0.1), "exp_avg"),
        (lambda ps: torch.optim.Adam(ps, lr=0.1), "exp_avg_sq"),
        (lambda ps: torch.optim.RMSprop(ps, lr=0.01), "square_avg"),
        (lambda ps: torch.optim.Adagrad(ps, lr=0.1), "sum"),
        (lambda ps: LAMB(ps, lr=0.01), "exp_avg"),
    ],
    ids=["adamw", "adam", "rmsprop", "adagrad", "lamb"],
)
def test_a_checkpoint_missing_a_key_raises_as_torch(make, key, device):
    params, twins, opt, ref = _twins(make, [(4, 3), 5], device)
    assert opt.plan.fused_tensors == 2
    _step([(params, opt), (twins, ref)], 0)
    sd = _drop(ref.state_dict(), key)
    ref.load_state_dict(sd)
    opt.load_state_dict(sd)
    _both_raise_key_error(ref, opt, key)


@pytest.mark.parametrize(
    ("make", "switch", "key"),
    [
        (lambda ps: torch.optim.RMSprop(ps, lr=0.01), ("momentum", 0.9), "momentum_buffer"),
        (lambda ps: torch.optim.RMSprop(ps, lr=0.01), ("centered", True), "grad_avg"),
        (lambda ps: torch.optim.Adam(ps, lr=0.01), ("amsgrad", True), "max_exp_avg_sq"),
    ],
    ids=["rmsprop_momentum", "rmsprop_centered", "adam_amsgrad"],
)
def test_a_switch_turned_on_mid_run_raises_as_torch(make, switch, key, device):
    params, twins, opt, ref = _twins(make, [(4, 3), 5], device)
    for step in range(2):
        _step([(params, opt), (twins, ref)], step)
    for o in (opt, ref):
        o.param_groups[0][switch[0]] = switch[1]
    _both_raise_key_error(ref, opt, key)


def test_sgd_momentum_switched_on_mid_run_starts_from_the_grad_as_torch(device):
    params, twins, opt, ref = _twins(lambda ps: torch.optim.SGD(ps, lr=0.1), [(4, 3), 5], device)
    for step in range(6):
        if step == 3:
            for o in (opt, ref):
                o.param_groups[0]["momentum"] = 0.9
        _step([(params, opt), (twins, ref)], step)
        for p, t in zip(params, twins, strict=True):
            torch.testing.assert_close(p, t, rtol=1e-6, atol=1e-6)


def test_muon_groups_flipping_use_muon_follow_the_eager_muon(device):
    """kitsune.optim.Muon starts the other algorithm's state from zero when a group's use_muon flips; the fused
    path does the same (the eager step is its reference, run on twins)."""

    def make(ps: list[torch.nn.Parameter]) -> Muon:
        return Muon([{"params": ps[:2]}, {"params": ps[2:], "use_muon": False}], lr=0.02)

    params, twins, opt, ref = _twins(make, [(8, 6), (6, 8), 6], device)
    assert opt.plan.fused_tensors == 3
    for step in range(8):
        if step == 3:
            for o in (opt, ref):
                o.param_groups[0]["use_muon"] = False
        if step == 5:
            for o in (opt, ref):
                o.param_groups[0]["use_muon"] = True
        _step([(params, opt), (twins, ref)], step)
        for p, t in zip(params, twins, strict=True):
            torch.testing.assert_close(p, t, rtol=2e-2, atol=2e-3)  # Newton-Schulz in bf16: kernels vs torch
    assert sorted(opt.state[params[0]]) == sorted(ref.state[twins[0]])


# -- 5. copies and pickles carry every piece of state --------------------------------------------------------------
def _fp16_run(device: torch.device) -> tuple[torch.nn.Module, KitsuneOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).to(device)
    opt = KitsuneOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.01),
        enable_fusion=True,
        enable_amp=True,
        amp_config=AMPConfig(dtype=torch.float16, growth_interval=1000),
        max_grad_norm=1.0,
    )
    x = torch.randn(3, 5, device=device)
    for step in range(5):  # three overflows back the scale off from 65536 to 8192
        scale = float("inf") if step in (1, 2, 4) else 1.0
        opt.backward(model(x).sum() * scale)
        opt.step()
        opt.zero_grad()
    assert opt.loss_scale == 8192 and opt.skipped_steps == 3
    return model, opt


def _train(model: torch.nn.Module, opt: KitsuneOptimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x = torch.randn(3, 5, generator=gen).to(next(model.parameters()).device)
        opt.backward(model(x).square().sum())
        opt.step()
        opt.zero_grad()


def _torch_save_round_trip(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize(
    "copier",
    [copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o)), _torch_save_round_trip],
    ids=["deepcopy", "pickle", "torch_save"],
)
def test_a_copy_carries_the_loss_scaler_and_continues_bit_identically(copier, device):
    model, opt = _fp16_run(device)
    twin = copier({"model": model, "opt": opt})
    assert twin["opt"].loss_scale == 8192 and twin["opt"].skipped_steps == 3
    assert twin["opt"].step_count == opt.step_count
    _train(model, opt, 6)
    _train(twin["model"], twin["opt"], 6)
    for p, q in zip(model.parameters(), twin["model"].parameters(), strict=True):
        assert torch.equal(p, q)
    assert twin["opt"].loss_scale == opt.loss_scale


def test_a_copy_between_the_scaled_backward_and_the_step_steps_on(device):
    """A deep copy taken after ``optimizer.backward(loss)`` and before ``step()`` carries the grads of plain tensor
    params, as torch's does (``nn.Parameter``'s own deepcopy drops them, in torch too), and where the step stands:
    it steps as the original (it refused, asking for ``optimizer.backward``)."""
    gen = torch.Generator().manual_seed(2)
    params = [torch.randn(4, 5, generator=gen).to(device).requires_grad_() for _ in range(2)]
    opt = KitsuneOptimizer(
        torch.optim.AdamW(params, lr=0.01),
        enable_fusion=True,
        enable_amp=True,
        amp_config=AMPConfig(dtype=torch.float16, growth_interval=1000),
    )
    x = torch.randn(3, 5, generator=gen).to(device)
    opt.backward((x @ params[0].T @ params[1]).square().sum())
    twin = copy.deepcopy({"params": params, "opt": opt})
    before = [p.detach().clone() for p in params]
    opt.step()
    twin["opt"].step()
    for p, q, b in zip(params, twin["params"], before, strict=True):
        assert torch.equal(p, q) and not torch.equal(p, b)
    assert twin["opt"].loss_scale == opt.loss_scale and twin["opt"].step_count == opt.step_count


@pytest.mark.parametrize(
    "copier",
    [copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o)), _torch_save_round_trip],
    ids=["deepcopy", "pickle", "torch_save"],
)
def test_a_copy_between_a_backward_that_updated_and_its_step_is_refused(copier, device):
    """With updates inside backward the params and state already hold this step's updates when backward returns: a
    copy's step() would apply them a second time (its params 1e-2 off the original's). Copying there is refused,
    naming when to copy; the original steps on, and a copy after its step trains as it does."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).to(device)
    opt = KitsuneOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.01),
        enable_fusion=True,
        stream_config=StreamConfig(step_in_backward=True, bucket_bytes=64),
    )
    x = torch.randn(3, 5, device=device)
    model(x).square().sum().backward()
    assert opt.scheduler.updated_since_step
    with pytest.raises(TypeError, match="between a backward that ran updates inside it.*after step"):
        copier({"model": model, "opt": opt})
    opt.step()
    opt.zero_grad()
    twin = copier({"model": model, "opt": opt})
    for m, o in ((model, opt), (twin["model"], twin["opt"])):
        m(x).square().sum().backward()
        o.step()
        o.zero_grad()
    for p, q in zip(model.parameters(), twin["model"].parameters(), strict=True):
        assert torch.equal(p, q)


# -- 6. a dropped optimizer is freed at once ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"max_grad_norm": 1.0, "enable_amp": True},
        {"profile": True},
        {"stream_config": StreamConfig(step_in_backward=True)},
        {"grad_config": GradConfig(zero_in_step=True)},
    ],
    ids=["fused", "amp_clip", "profile", "in_backward", "zero_in_step"],
)
def test_del_frees_the_optimizer_and_its_state_without_the_cycle_collector(kw, device):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4).to(device)
    opt = KitsuneOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1), enable_fusion=True, **kw)
    for _ in range(3):
        opt.backward(model(torch.randn(2, 6, device=device)).sum())
        opt.step()
        opt.zero_grad()
    refs = [weakref.ref(opt), weakref.ref(opt.base_optimizer)]
    refs += [weakref.ref(t) for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    assert len(refs) > 2
    enabled = gc.isenabled()
    gc.disable()
    try:
        del opt
        assert all(r() is None for r in refs)
    finally:
        if enabled:
            gc.enable()


@pytest.mark.cuda
def test_del_gives_the_gpu_memory_back():
    """The optimizer's state, its arena, its CUDA graph and its buffers go when the last reference does."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024).cuda()
    opt = KitsuneOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1), enable_fusion=True, max_grad_norm=1.0)
    for _ in range(8):  # past warm-up: the step is a captured graph replayed
        model(torch.randn(4, 1024, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
    assert opt._subsystem("graphs").report()["replays"] > 0
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    state_bytes = sum(p.numel() * p.element_size() * 2 for p in model.parameters())  # exp_avg, exp_avg_sq
    enabled = gc.isenabled()
    gc.disable()
    try:
        del opt
        torch.cuda.synchronize()
        assert held - torch.cuda.memory_allocated() >= state_bytes
    finally:
        if enabled:
            gc.enable()


# -- 7. state dicts have exactly torch's keys ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.AdamW(ps, lr=0.1),
        lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True),
        lambda ps: torch.optim.Adagrad(ps, lr=0.1),
        lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.9, centered=True),
        lambda ps: Lion(ps, lr=0.01),
    ],
    ids=["sgd", "sgd_momentum", "adamw", "adam_amsgrad", "adagrad", "rmsprop", "lion"],
)
def test_fused_state_dicts_have_exactly_torchs_keys(make, device):
    params, twins, opt, ref = _twins(make, [(4, 3), 5, 2], device)
    assert opt.plan.fused_tensors == 3
    for step in range(3):
        _step([(params, opt), (twins, ref)], step, skip=2)  # the last param never gets a grad
    ours, theirs = opt.state_dict(), ref.state_dict()
    assert ours.keys() - {"kitsune"} == theirs.keys()
    assert ours["state"].keys() == theirs["state"].keys()
    for k, st in theirs["state"].items():
        assert ours["state"][k].keys() == st.keys(), k
    assert [g.keys() for g in ours["param_groups"]] == [g.keys() for g in theirs["param_groups"]]


# -- 8. a param moved to float64 mid-run keeps training as plain torch does ----------------------------------------
def test_sgd_momentum_with_a_layer_moved_to_float64_mid_run_matches_torch(device):
    make = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    params, twins, opt, ref = _twins(make, [(4, 3), 5, (2, 3)], device)
    for step in range(8):
        if step == 3:
            for p in (params[1], twins[1]):
                p.data = p.data.double()
        _step([(params, opt), (twins, ref)], step)
        for p, t in zip(params, twins, strict=True):
            torch.testing.assert_close(p, t, rtol=1e-6, atol=1e-6)
    assert params[1].dtype == torch.float64
    fallback = [b for b in opt.plan.buckets if b.dtype == "float64"]
    # its momentum buffer cast as the param (as the fused units cast theirs): torch's fused path takes it, as it
    # would have from the start
    assert len(fallback) == 1 and fallback[0].route.value == "torch_fused" and "float64 params" in fallback[0].reason
    assert opt.state[params[1]]["momentum_buffer"].dtype == torch.float64


def test_a_step_refused_before_its_prepare_keeps_the_state_the_last_step_made(device):
    """float16 AMP: after a good first step (its lazy state made), ``loss.backward()`` without the loss scale is
    refused by the grads' checks, before the fused executor prepares anything. The refusal changes nothing: the
    first step's state stays (it was taken back as if the refused step had made it), and the corrected retry steps
    as a twin that never erred (AdamW's step counts 2)."""
    from kitsune import AMPConfig

    def make(params):
        opt = KitsuneOptimizer(
            torch.optim.AdamW(params, lr=0.1), enable_fusion=True, enable_amp=True,
            amp_config=AMPConfig(dtype=torch.float16),
        )  # fmt: skip
        assert opt.plan.fused_tensors == len(params)
        return opt

    params, twins = make_params([(4, 3), 5], torch.float32, device), make_params([(4, 3), 5], torch.float32, device)
    opt, ref = make(params), make(twins)
    for step in range(2):
        for ps, o in ((params, opt), (twins, ref)):
            loss = sum((p * g).sum() for p, g in zip(ps, random_grads(ps, step), strict=True))
            if step == 1 and o is opt:
                loss.backward()  # the slip: without opt.backward(loss)'s scale
                before = _snapshot(opt)
                with pytest.raises(RuntimeError, match="optimizer.backward"):
                    opt.step()
                _assert_unchanged(before, opt)
                opt.zero_grad()
                loss = sum((p * g).sum() for p, g in zip(ps, random_grads(ps, step), strict=True))
            o.backward(loss)
            o.step()
            o.zero_grad()
    assert {float(opt.state[p]["step"]) for p in params} == {2.0}
    for p, t in zip(params, twins, strict=True):
        torch.testing.assert_close(p, t, rtol=0, atol=0)
