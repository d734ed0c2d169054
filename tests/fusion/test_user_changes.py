"""What users do to an optimizer between steps, on the fused path, step by step against the plain torch optimizer:
state cleared, deleted or replaced by hand, params swapped into a group's list or moved between groups. torch reads
its state and groups every step; kitsune binds them at plan time and must notice each change before it launches."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
import torch
from twins import assert_refused, make_params, ptrs_equal_stand_in, random_grads, step_twins

from kitsune import FusionConfig, KitsuneConfig, KitsuneOptimizer, MemoryConfig, _native
from kitsune.optim import LAMB, LARS, Lion

# every structural change must be seen by either per-step address check (tests/conftest.py, check_path)
pytestmark = pytest.mark.usefixtures("check_path")

SIZES = [(7, 3), 16, 5]


def _fill(t: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(t.shape, generator=gen) * 0.2 + 0.05).to(t)  # positive: valid for exp_avg_sq too


def _clear(opt: Any, params: list) -> None:
    opt.state.clear()


def _delete(opt: Any, params: list) -> None:
    del opt.state[params[1]]


def _replace_moment(opt: Any, params: list) -> None:
    s = opt.state[params[0]]
    s["exp_avg_sq"] = _fill(s["exp_avg_sq"], 3)


def _replace_step(opt: Any, params: list) -> None:
    opt.state[params[2]]["step"] = torch.tensor(100.0)


def _new_state_object(opt: Any, params: list) -> None:
    opt.state = defaultdict(dict)


def _momentum_none(opt: Any, params: list) -> None:
    opt.state[params[0]]["momentum_buffer"] = None


def _momentum_replaced(opt: Any, params: list) -> None:
    s = opt.state[params[1]]
    s["momentum_buffer"] = _fill(s["momentum_buffer"], 4)


def _strided_moment(opt: Any, params: list) -> None:
    """The same values with transposed strides (a checkpoint converted between layouts): torch's ops read it as
    strided; flat reads would scramble it."""
    s = opt.state[params[0]]
    s["exp_avg"] = _fill(s["exp_avg"], 5).t().contiguous().t()


def _strided_momentum(opt: Any, params: list) -> None:
    s = opt.state[params[0]]
    s["momentum_buffer"] = _fill(s["momentum_buffer"], 6).t().contiguous().t()


ADAMW = (lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1), "adamw")
SGD = (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), "sgd")
CASES = [
    (ADAMW, _clear),
    (ADAMW, _delete),
    (ADAMW, _replace_moment),
    (ADAMW, _replace_step),
    (ADAMW, _new_state_object),
    (SGD, _clear),
    (SGD, _momentum_none),
    (SGD, _momentum_replaced),
    (ADAMW, _strided_moment),
    (SGD, _strided_momentum),
]


def _twins(make: Callable, pool: int | None, device: torch.device, native: bool = True) -> tuple[list, list, Any, Any]:
    params = make_params(SIZES, torch.float32, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    kw = {} if pool is None else {"memory_pool_size": pool}
    fusion = FusionConfig(native_checks=native)
    return params, twins, KitsuneOptimizer(make(params), enable_fusion=True, fusion_config=fusion, **kw), make(twins)


def _set_grads(params: list, twins: list, step: int) -> None:
    for p, t, g in zip(params, twins, random_grads(params, step), strict=True):
        p.grad, t.grad = g.clone(), g.clone()


def _assert_same(params: list, twins: list, opt: Any, ref: Any, step: int) -> None:
    for i, (p, t) in enumerate(zip(params, twins, strict=True)):
        torch.testing.assert_close(
            p, t, rtol=1e-5, atol=1e-6, msg=lambda m, i=i, step=step: f"step {step}, param {i}: {m}"
        )
    ours, theirs = opt.state_dict()["state"], ref.state_dict()["state"]
    assert ours.keys() == theirs.keys(), f"step {step}"
    for k in theirs:
        assert ours[k].keys() == theirs[k].keys()
        for key, v in theirs[k].items():
            torch.testing.assert_close(ours[k][key], v, rtol=1e-5, atol=1e-6, check_dtype=False, check_device=False)


@pytest.mark.parametrize("pool", [None, 0], ids=["pool", "no-pool"])
@pytest.mark.parametrize(("opt_case", "change"), CASES, ids=lambda c: getattr(c, "__name__", None) or c[1])
def test_state_changed_by_hand_is_read_as_torch_reads_it(opt_case, change, pool, device):
    """The change lands after step 3: torch starts the cleared state afresh and uses the replaced tensors; so must
    kitsune, and its state_dict must show what torch's shows (no stale moments, nothing written to freed memory)."""
    _changed_after_step_3(opt_case[0], change, pool, device)


def _changed_after_step_3(
    make: Callable,
    change: Callable,
    pool: int | None,
    device: torch.device,
    native: bool = True,
    before: Callable[[Any, Any], None] | None = None,
) -> Any:
    """Kitsune and torch side by side over 7 steps, ``change`` made to both after step 3 (``before(opt, ref)`` just
    ahead of it); the same params and state_dict after every step, and the fused path throughout, before and after
    the change. Returns the KitsuneOptimizer."""
    params, twins, opt, ref = _twins(make, pool, device, native)
    for step in range(7):
        _set_grads(params, twins, step)
        if step == 3:
            if before is not None:
                before(opt, ref)
            change(opt, params)
            change(ref, twins)
        opt.step()
        ref.step()
        _assert_same(params, twins, opt, ref, step)
    assert opt.plan.fused_tensors == len(params)
    return opt


def _assert_held_as_torchs(held: dict, ref_held: dict) -> None:
    """A state_dict() taken before the change keeps the values torch's taken then keeps."""
    for i, st in ref_held["state"].items():
        for key, v in st.items():
            torch.testing.assert_close(held["state"][i][key], v, rtol=1e-5, atol=1e-6, check_device=False)


def _moment_storage_swapped(opt: Any, params: list) -> None:
    s = opt.state[params[0]]
    s["exp_avg"].data = _fill(s["exp_avg"], 7)  # the tensor lives on, on new memory


def _every_storage_swapped(opt: Any, params: list) -> None:
    """The ``optimizer_to(device)`` snippets' way (here to the same device): every state tensor's ``.data``."""
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                v.data = v.data.clone()


@pytest.mark.parametrize(
    ("opt_case", "change"),
    [(ADAMW, _moment_storage_swapped), (ADAMW, _every_storage_swapped), (SGD, _every_storage_swapped)],
    ids=lambda c: getattr(c, "__name__", None) or c[1],
)
def test_a_state_tensors_storage_swapped_is_read_as_torch_reads_it(opt_case, change, device):
    """``t.data = ...`` on a state tensor: the tensor object lives on, so the weak references to the tensors saw
    nothing, and the kernels went on writing through the old storage's address, freed memory, while the state the
    user sees stayed as it was. The units hold weak references to the storages too: the next step plans again from
    the state as it is. (Pooled state is a view of the pool's arena, which the pool holds: a swap there is not
    seen, and the kernels write into the arena; docs/memory.md says so.)"""
    _changed_after_step_3(opt_case[0], change, 0, device)


@pytest.mark.parametrize("pool", [None, 0], ids=["pool", "no-pool"])
@pytest.mark.parametrize(
    ("opt_case", "change"),
    [(ADAMW, _clear), (ADAMW, _delete), (ADAMW, _new_state_object), (SGD, _clear)],
    ids=lambda c: getattr(c, "__name__", None) or c[1],
)
def test_state_dropped_while_a_state_dict_taken_before_holds_it(opt_case, change, pool, device):
    """A state_dict() taken before the change holds the very per-param dicts torch's state held, so the dropped
    tensors stay alive (no weak reference dies): the step must still start that state afresh, as torch's does, and
    leave the held checkpoint as torch's is (the dropped params' entries as they were)."""
    held: dict[str, Any] = {}

    def hold(opt: Any, ref: Any) -> None:
        held.update(ours=opt.state_dict(), torchs=ref.state_dict())

    _changed_after_step_3(opt_case[0], change, pool, device, before=hold)
    _assert_held_as_torchs(held["ours"], held["torchs"])


def _replace_param_dict(opt: Any, params: list) -> None:
    """A param's whole dict, new tensors of other values (the old dict kept by whoever held it)."""
    opt.state[params[1]] = {k: _fill(v, 8) if k != "step" else v.clone() for k, v in opt.state[params[1]].items()}


def _set_to_itself(opt: Any, params: list) -> None:
    """Every entry set to the tensor it holds: the dicts change, the state does not (the plan holds)."""
    for st in opt.state.values():
        for key in list(st):
            st[key] = st[key]


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
@pytest.mark.parametrize("pool", [None, 0], ids=["pool", "no-pool"])
@pytest.mark.parametrize(
    ("opt_case", "change"),
    [
        (ADAMW, _replace_moment),
        (ADAMW, _replace_step),
        (ADAMW, _replace_param_dict),
        (SGD, _momentum_replaced),
        (ADAMW, _set_to_itself),
        (SGD, _set_to_itself),
    ],
    ids=lambda c: getattr(c, "__name__", None) or c[1],
)
def test_state_replaced_while_other_code_holds_the_old_is_read_as_torch_reads_it(
    opt_case, change, pool, native, device
):
    """A tensor, or a param's whole dict, replaced while a state_dict() taken before (and a list, as a logger keeps)
    holds the old ones: no weak reference dies and the state dict keeps its size, so only the dicts show it (the
    native watch, or the Python comparison). The step must use the new tensors, as torch does; the held ones keep
    their values. A value set to itself leaves the plan as it was."""
    noted: dict[str, Any] = {}

    def hold(opt: Any, ref: Any) -> None:
        fusion = next(s for s in opt.subsystems if s.name == "fusion")
        noted.update(ours=opt.state_dict(), torchs=ref.state_dict(), version=fusion.plan_version)
        noted.update(kept=[t for st in opt.state.values() for t in st.values()])
        noted.update(compares=fusion.report()["state_compares"])

    opt = _changed_after_step_3(opt_case[0], change, pool, device, native=native, before=hold)
    fusion = next(s for s in opt.subsystems if s.name == "fusion")
    held, ref_held, kept, compares = noted["ours"], noted["torchs"], noted["kept"], noted["compares"]
    assert fusion.plan_version == noted["version"] + (change is not _set_to_itself)
    if (
        native and _native.CHECKS is not None
    ):  # a step compares the entries only where a dict changed: the step after the change (a value set to
        # itself may not count as a change at all, as CPython's dicts see it)
        now = fusion.report()["state_compares"]
        assert now == compares + 1 if change is not _set_to_itself else now <= compares + 1
    else:
        assert fusion.report()["state_compares"] >= 7  # every step
    _assert_held_as_torchs(held, ref_held)
    assert all(isinstance(t, torch.Tensor) for t in kept)


def _swap(opt: Any, params: list, spare: torch.nn.Parameter) -> None:
    opt.param_groups[0]["params"][1] = spare


def _move(opt: Any, params: list, spare: torch.nn.Parameter) -> None:
    a, b = opt.param_groups
    a["params"][0], b["params"][0] = b["params"][0], a["params"][0]


def _slice(opt: Any, params: list, spare: torch.nn.Parameter) -> None:
    opt.param_groups[0]["params"][1:] = [spare]


def _pop_append(opt: Any, params: list, spare: torch.nn.Parameter) -> None:
    group = opt.param_groups[0]["params"]
    group.pop(0)
    group.append(spare)


def _new_list(opt: Any, params: list, spare: torch.nn.Parameter) -> None:
    group = opt.param_groups[0]
    group["params"] = [spare, group["params"][1]]


def _sorted(opt: Any, params: list, spare: torch.nn.Parameter) -> None:
    group = opt.param_groups[0]["params"]
    group[1] = spare
    group.sort(key=lambda p: -p.numel())  # keywords reach list.sort


def _through_a_reference(opt: Any, params: list, spare: torch.nn.Parameter) -> None:
    held = opt.param_groups[0]["params"]  # as code that keeps the list it was given does
    del held[1]
    held += [spare]


CHANGES = [_swap, _move, _slice, _pop_append, _new_list, _sorted, _through_a_reference]


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__.strip("_"))
def test_params_changed_in_a_groups_list_re_plan(change, device):
    """A group's list keeps its length: a new param swapped in must be trained (with fresh state), and params that
    swap groups must take their new group's lr and weight decay."""

    def make(ps: list) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.003, "weight_decay": 0.5}], lr=0.02, weight_decay=0.01
        )

    sizes = [(7, 3), 16, 5, 16]
    params = make_params(sizes, torch.float32, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    spare = make_params([16], torch.float32, device, seed=9)[0]
    spare_twin = torch.nn.Parameter(spare.detach().clone())
    opt, ref = KitsuneOptimizer(make(params), enable_fusion=True), make(twins)
    everything, everything_twin = [*params, spare], [*twins, spare_twin]
    for step in range(10):
        for p, t, g in zip(everything, everything_twin, random_grads(everything, step), strict=True):
            p.grad, t.grad = g.clone(), g.clone()
        if step == 4:
            change(opt, params, spare)
            change(ref, twins, spare_twin)
        opt.step()
        ref.step()
        for i, (p, t) in enumerate(zip(everything, everything_twin, strict=True)):
            torch.testing.assert_close(
                p, t, rtol=1e-5, atol=1e-6, msg=lambda m, i=i, step=step: f"step {step}, param {i}: {m}"
            )
    assert opt.plan.fused_tensors == len(params)


@pytest.mark.parametrize("how", ["held_before_wrapping", "assigned_after_wrapping"])
def test_lists_the_user_holds_stay_the_groups_lists(how, device):
    """The groups keep the user's list objects (kitsune does not swap them for its own), so a list taken before
    wrapping, or assigned to ``group["params"]`` and kept, still changes the group when it is edited in place."""
    params = make_params([(4, 3), 16, 5], torch.float32, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    spare = make_params([16], torch.float32, device, seed=9)[0]
    spare_twin = torch.nn.Parameter(spare.detach().clone())
    inner, ref = (torch.optim.AdamW(ps[:2], lr=0.02, weight_decay=0.01) for ps in (params, twins))
    held, held_ref = inner.param_groups[0]["params"], ref.param_groups[0]["params"]
    opt = KitsuneOptimizer(inner, enable_fusion=True)
    if how == "assigned_after_wrapping":
        held = opt.param_groups[0]["params"] = list(held)
        held_ref = ref.param_groups[0]["params"] = list(held_ref)
    assert opt.param_groups[0]["params"] is held and type(held) is list
    everything, everything_twin = [*params, spare], [*twins, spare_twin]
    for step in range(8):
        for p, t, g in zip(everything, everything_twin, random_grads(everything, step), strict=True):
            p.grad, t.grad = g.clone(), g.clone()
        if step == 3:
            held.append(params[2])
            held_ref.append(twins[2])
        if step == 5:
            held[1], held_ref[1] = spare, spare_twin
        opt.step()
        ref.step()
        for i, (p, t) in enumerate(zip(everything, everything_twin, strict=True)):
            torch.testing.assert_close(p, t, rtol=1e-5, atol=1e-6, msg=lambda m, i=i, step=step: f"{step}/{i}: {m}")
    assert opt.plan.fused_tensors == 3


def test_two_wrappers_of_one_optimizer_each_see_a_change(device):
    """Each wrapper keeps its own record of the params it planned for: one re-planning does not hide the change
    from the other (two wrappers over one torch optimizer, as copy.copy of a KitsuneOptimizer makes)."""
    params = make_params([(4, 3), 16], torch.float32, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    inner, ref = (torch.optim.SGD(ps[:1], lr=0.1) for ps in (params, twins))
    first, second = (KitsuneOptimizer(inner, enable_fusion=True) for _ in range(2))
    for p, t, g in zip(params, twins, random_grads(params, 0), strict=True):
        p.grad, t.grad = g.clone(), g.clone()
    inner.param_groups[0]["params"].append(params[1])
    ref.param_groups[0]["params"].append(twins[1])
    for opt in (first, second):
        opt.step()
        ref.step()
    for p, t in zip(params, twins, strict=True):
        torch.testing.assert_close(p, t, rtol=1e-6, atol=1e-7)


def test_saved_param_groups_load_with_torchs_default_weights_only(device, tmp_path):
    """``torch.save(optimizer.param_groups)`` loads with ``torch.load``'s default (weights_only): the groups hold
    plain lists, nothing of kitsune's."""
    params = make_params(SIZES, torch.float32, device)
    opt = KitsuneOptimizer(torch.optim.AdamW(params, lr=0.01), enable_fusion=True)
    for p, g in zip(params, random_grads(params, 0), strict=True):
        p.grad = g
    opt.step()
    torch.save(opt.param_groups, tmp_path / "groups.pt")
    groups = torch.load(tmp_path / "groups.pt")
    assert type(groups[0]["params"]) is list and len(groups[0]["params"]) == len(params)


def test_grads_of_another_dtype_go_to_the_optimizers_own_step(device):
    """fp32 grads of bf16 params (p.grad_dtype): the kernel reads a grad as its param's dtype, so those params take
    the wrapped optimizer's step, exactly as without kitsune; the others stay fused."""
    params = make_params(SIZES, torch.bfloat16, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p in (params[0], twins[0]):
        p.grad_dtype = torch.float32
    opt, ref = KitsuneOptimizer(SGD[0](params), enable_fusion=True), SGD[0](twins)
    for step in range(8):
        for p, t, g in zip(params, twins, random_grads(params, step), strict=True):
            g = g.float() if p is params[0] else g
            p.grad, t.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        assert torch.equal(params[0], twins[0]), f"step {step}"  # the optimizer's own step: the same bits
        for p, t in zip(params[1:], twins[1:], strict=True):
            torch.testing.assert_close(p, t, rtol=1e-2, atol=1e-2)
    assert params[0].grad.dtype == torch.float32 and not params[0].isnan().any()


def _refused_unchanged(opt: Any, params: list, match: str) -> None:
    """The step raises ``ValueError`` (matching ``match``) and leaves every param and grad as they were."""
    before = [p.detach().clone() for p in params]
    grads = [p.grad.clone() for p in params]
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, params, strict=True))
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, params, strict=True))


def test_grads_of_another_dtype_with_the_fused_grad_pass_are_refused_and_lose_nothing(device):
    from kitsune import GradConfig

    params = make_params(SIZES, torch.bfloat16, device)
    params[0].grad_dtype = torch.float32
    opt = KitsuneOptimizer(SGD[0](params), enable_fusion=True, grad_config=GradConfig(max_norm=1.0))
    for p, g in zip(params, random_grads(params, 0), strict=True):
        p.grad = g.float() if p is params[0] else g
    _refused_unchanged(opt, params, r"p.grad_dtype = None")
    assert opt.step_count == 0 and not any(opt.state.values())


ONE_DTYPE = [torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax]


def test_torchs_optimizers_that_need_one_dtype_are_the_ones_kitsune_names():
    """`AlgoInfo.one_dtype` against the installed torch: its step raises on a grad of another dtype than its param
    exactly for the optimizers kitsune refuses it for (a torch that starts taking one shows up here)."""
    from kitsune.fusion.algos import ALGOS

    torch_classes = [cls for cls in ALGOS if cls.__module__.startswith("torch.optim")]
    assert set(ONE_DTYPE) <= set(torch_classes) and len(torch_classes) >= 11
    for cls in torch_classes:
        p = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.bfloat16))  # 2-D: torch.optim.Muon takes only those
        p.grad_dtype = torch.float32
        p.grad = torch.randn(6, 4)
        try:
            cls([p], lr=0.01).step()
            raised = False
        except RuntimeError:
            raised = True
        assert raised == ALGOS[cls].one_dtype, cls.__name__


@pytest.mark.parametrize("cls", [*ONE_DTYPE, Lion, LAMB], ids=lambda c: c.__name__)
def test_a_grad_of_another_dtype_the_step_cannot_take_is_refused_and_loses_nothing(cls, device):
    """Adam's family lerps a grad into state made like the param: torch's step raises on a float32 grad of a
    bfloat16 param after bumping ``step`` (and, for AdamW, decaying the weights). kitsune refuses it before, and
    kitsune's Lion and LAMB, whose own step takes such a param off the fused path, refuse it there."""
    import copy

    params = make_params(SIZES, torch.bfloat16, device)
    opt = KitsuneOptimizer(cls(params, lr=0.01, weight_decay=0.1), enable_fusion=True)
    for step in range(3):
        for p, g in zip(params, random_grads(params, step), strict=True):
            p.grad = g
        opt.step()
    assert opt.plan.fused_tensors == len(params)
    params[1].grad = None
    params[1].grad_dtype = torch.float32
    for p, g in zip(params, random_grads(params, 3), strict=True):
        p.grad = g.float() if p is params[1] else g
    saved = copy.deepcopy(opt.state_dict())
    _refused_unchanged(opt, params, r"p.grad_dtype = None")
    assert opt.step_count == 3
    after = opt.state_dict()
    for i, entry in saved["state"].items():
        assert all(torch.equal(v, after["state"][i][k]) for k, v in entry.items()), i
    params[1].grad = None
    params[1].grad_dtype = None
    params[1].grad = random_grads(params, 3)[1]
    opt.step()  # with the grad in its param's dtype, the step runs
    assert opt.step_count == 4


def test_a_refused_step_keeps_the_state_earlier_steps_made(device, monkeypatch):
    """One unit per param: a unit whose state an earlier step created, and which this step finds unchanged, keeps
    that state when another unit's grad makes the step refuse (only this step's lazy state is undone)."""
    from kitsune import FusionConfig, GradConfig
    from kitsune.fusion import units

    monkeypatch.setattr(units, "_PTRS_EQUAL", units._PTRS_EQUAL or ptrs_equal_stand_in)  # the C++ check on CPU

    params = make_params(SIZES, torch.float32, device)
    opt = KitsuneOptimizer(
        SGD[0](params),
        enable_fusion=True,
        fusion_config=FusionConfig(max_fusion_size=1, min_fusion_benefit=0.0),
        grad_config=GradConfig(max_norm=1.0),
    )
    for step in range(2):  # the grads stay in place: the second step finds the units unchanged
        for p, g in zip(params, random_grads(params, step), strict=True):
            p.grad = g if p.grad is None else p.grad.copy_(g)
        opt.step()
    state = {p: opt.state[p]["momentum_buffer"].clone() for p in params}
    grad = params[1].grad.double()
    params[1].grad = None
    params[1].grad_dtype = torch.float64
    params[1].grad = grad
    with pytest.raises(ValueError, match=r"p.grad_dtype = None"):
        opt.step()
    assert opt.state.keys() == state.keys()
    assert all(torch.equal(opt.state[p]["momentum_buffer"], v) for p, v in state.items())


def test_adagrad_group_added_later_starts_from_the_defaults_accumulator(device):
    """torch's lazy Adagrad init reads initial_accumulator_value from the defaults, not from the added group."""

    def make(ps):
        return torch.optim.Adagrad(ps[:2], lr=0.05, initial_accumulator_value=0.1)

    params = make_params([*SIZES, 4], torch.float32, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ref = KitsuneOptimizer(make(params), enable_fusion=True), make(twins)
    for step in range(8):
        if step == 3:
            opt.add_param_group({"params": params[2:], "initial_accumulator_value": 2.0})
            ref.add_param_group({"params": twins[2:], "initial_accumulator_value": 2.0})
        for p, t, g in zip(params, twins, random_grads(params, step), strict=True):
            p.grad, t.grad = g.clone(), g.clone()
        try:
            ref.step()
        except KeyError:  # torch before 2.12: Adagrad creates state in __init__ only
            pytest.skip("this torch's Adagrad cannot step a param group added after construction")
        opt.step()
        for i, (p, t) in enumerate(zip(params, twins, strict=True)):
            torch.testing.assert_close(
                p, t, rtol=1e-5, atol=1e-6, msg=lambda m, i=i, step=step: f"step {step}, param {i}: {m}"
            )


@pytest.mark.parametrize("path", ["graph", "eager", "eager_cpp_check"])
def test_a_storage_that_sends_a_param_to_another_route_changes_how_the_grads_are_clipped(path, device, monkeypatch):
    """``p.data = `` a non-contiguous tensor mid-run, with max_grad_norm: the re-plan sends that param to torch's
    foreach path, so the grads must now be clipped by torch ops before the updates, not inside the kernel (the
    step used to find the move only after deciding that, and clipped the fused params alone from then on: off by
    0.1 after one step). Against torch's AdamW with clip_grad_norm_, 12 steps; the graph path (a recording stand-in
    for CUDA graphs) must say why it stopped capturing."""
    from twins import record_graphs

    from kitsune.fusion import units

    if path == "eager_cpp_check":  # the units' fast address check (torch's C++ one on CUDA builds)
        monkeypatch.setattr(units, "_PTRS_EQUAL", units._PTRS_EQUAL or ptrs_equal_stand_in)
    params = make_params([5, (4, 6), 3], torch.float32, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = KitsuneOptimizer(
        torch.optim.AdamW(params, lr=0.1), enable_fusion=True, max_grad_norm=0.5, capture_graph=path == "graph"
    )
    ref = torch.optim.AdamW(twins, lr=0.1, foreach=False)
    if path == "graph":
        record_graphs(opt)
    for step in range(12):
        if step == 4:
            for p in (params[1], twins[1]):
                p.data = p.data.t().contiguous().t()  # the same values, laid out transposed
        for p, t, g in zip(params, twins, random_grads(params, step), strict=True):
            p.grad, t.grad = g * 4, g * 4  # a norm well above 0.5: every step clips
        opt.step()
        torch.nn.utils.clip_grad_norm_(twins, 0.5)
        ref.step()
        for i, (p, t) in enumerate(zip(params, twins, strict=True)):
            torch.testing.assert_close(
                p, t, rtol=1e-5, atol=1e-6, msg=lambda m, i=i, step=step: f"step {step}, param {i}: {m}"
            )
    assert [b.route.value for b in opt.plan.buckets] == ["triton", "torch_foreach"]
    graphs = opt._subsystem("graphs")
    if path == "graph":
        assert not graphs.active and "not all fused" in graphs.reason, graphs.reason


# -- a tensor changed where it sat: the same address, another layout ------------------------------------------------
OPTS = [SGD, ADAMW]


def _in_place_grads(params: list, twins: list, step: int, bufs: list) -> None:
    """This step's grads written into ``bufs`` (the same tensors every step: the addresses stay, so only a check of
    more than the addresses sees what the tests change), the twins' as copies; where a buffer is None, only the
    twin's (the test sets the param's)."""
    for p, t, g, b in zip(params, twins, random_grads(params, step), bufs, strict=True):
        if b is not None:
            b.copy_(g)
            p.grad = b
        t.grad = g.to(t.grad_dtype or t.dtype, copy=True)


@pytest.mark.parametrize("make", OPTS, ids=lambda c: c[1])
def test_a_grad_re_strided_where_it_sat_is_read_as_torch_reads_it(make, device):
    """From step 2 the grad is a transposed view of the buffer the earlier grads lived in: the same address, the same
    values, another layout (the allocator hands blocks out again). Read as flat memory it would be the transpose."""
    params = make_params([(6, 6), 9], torch.float32, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ref = KitsuneOptimizer(make[0](params), enable_fusion=True), make[0](twins)
    bufs = [torch.empty_like(p) for p in params]
    for step in range(6):
        _in_place_grads(params, twins, step, bufs if step < 2 else [None, bufs[1]])
        if step >= 2:
            g = twins[0].grad
            bufs[0].copy_(g.t())
            params[0].grad = bufs[0].t()  # g's values, at the same address, transposed
            assert torch.equal(params[0].grad, g) and params[0].grad.data_ptr() == bufs[0].data_ptr()
        opt.step()
        ref.step()
        _assert_same(params, twins, opt, ref, step)
    assert opt.plan.fused_tensors == len(params)


def test_a_grad_re_typed_where_it_sat_goes_to_the_optimizers_own_step(device):
    """bf16 grads of a bf16 param, then (p.grad_dtype) fp32 grads in the same block: read as bf16 they would be
    garbage; the param takes the wrapped optimizer's step, as a grad of another dtype does anywhere else."""
    params = make_params([(4, 8), 16], torch.bfloat16, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ref = KitsuneOptimizer(SGD[0](params), enable_fusion=True), SGD[0](twins)
    wide = torch.empty(4, 8, device=device)  # fp32: room for the bf16 grads in its first half
    bufs = [wide.view(torch.bfloat16).view(-1)[:32].view(4, 8), torch.empty_like(params[1])]
    for step in range(6):
        if step == 2:
            for p in (params[0], twins[0]):
                p.grad = None
                p.grad_dtype = torch.float32
        _in_place_grads(params, twins, step, bufs if step < 2 else [None, bufs[1]])
        if step >= 2:
            wide.copy_(twins[0].grad)
            params[0].grad = wide
            assert params[0].grad.data_ptr() == bufs[0].data_ptr()
        opt.step()
        ref.step()
        for p, t in zip(params, twins, strict=True):  # bf16 rounding apart (read as bf16, fp32 grads are garbage)
            torch.testing.assert_close(p, t, rtol=1e-2, atol=1e-2)
    assert opt.plan.fused_tensors == len(params)  # planned fused; params[0] left to SGD's own step from step 2


@pytest.mark.parametrize("make", OPTS, ids=lambda c: c[1])
def test_a_param_re_strided_where_it_sat_is_planned_again(make, device):
    """``p.data = p.data.t()`` keeps the address: the step must still see a non-contiguous param (torch's foreach
    path takes it, as the planner routes any non-contiguous param)."""
    params = make_params([(5, 5), 7], torch.float32, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ref = KitsuneOptimizer(make[0](params), enable_fusion=True), make[0](twins)
    for step in range(6):
        if step == 2:
            for p in (params[0], twins[0]):
                p.data = p.data.t()
        _set_grads(params, twins, step)
        opt.step()
        ref.step()
        _assert_same(params, twins, opt, ref, step)
    assert sorted((b.route.value, b.tensors) for b in opt.plan.buckets) == [("torch_foreach", 1), ("triton", 1)]


def test_a_param_shrunk_where_it_sat_is_planned_again(device):
    """``p.data = p.data[:8]`` keeps the address and shrinks the param: the kernels must update 8 elements, not 16."""
    params = make_params([16, 7], torch.float32, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    make = lambda ps: torch.optim.SGD(ps, lr=0.05)  # noqa: E731 (no state: nothing of the old size is kept)
    opt, ref = KitsuneOptimizer(make(params), enable_fusion=True), make(twins)
    full = params[0].data
    bufs = [torch.empty_like(p) for p in params]
    for step in range(5):
        if step == 2:
            tail = full[8:].clone()
            for p in (params[0], twins[0]):
                p.grad = None
                p.data = p.data[:8]
            bufs[0] = bufs[0][:8]  # the grad shrinks where it sat too
        _in_place_grads(params, twins, step, bufs)
        opt.step()
        ref.step()
        _assert_same(params, twins, opt, ref, step)
    assert params[0].data_ptr() == full.data_ptr() and torch.equal(full[8:], tail)  # untouched since step 2
    assert opt.plan.fused_tensors == 2


@pytest.mark.parametrize("clip", [None, 1.0], ids=["plain", "clip"])
def test_a_grad_of_another_size_than_its_param_is_refused_and_loses_nothing(clip, device):
    """A param resized after backward keeps its old grad: torch's step raises on the size; the fused kernels would
    read and write a param's numel of the grad. Refused before anything changes."""
    from kitsune import GradConfig

    params = make_params([12, 7], torch.float32, device)
    opt = KitsuneOptimizer(torch.optim.SGD(params, lr=0.05), enable_fusion=True, grad_config=GradConfig(max_norm=clip))
    for step in range(2):
        for p, g in zip(params, random_grads(params, step), strict=True):
            p.grad = g
        opt.step()
    params[0].data = torch.randn(20, device=device)
    resized = params[0].detach().clone()
    _refused_unchanged(opt, params, r"has a grad of shape \(12,\).*Nothing was updated")
    assert opt.step_count == 2
    params[0].grad = torch.randn(20, device=device)  # the fix the message names: a grad of the param's shape
    opt.step()
    assert opt.step_count == 3 and not torch.equal(resized, params[0])


def test_a_grad_of_another_dtype_on_torchs_fused_route_is_refused_and_loses_nothing(device):
    """The same on a bucket the planner leaves to torch's ``fused=True`` AdamW: refused before anything changes."""
    from kitsune import FusionConfig

    params = make_params(SIZES, torch.bfloat16, device)
    fusion = FusionConfig(min_fusion_benefit=1e9)
    opt = KitsuneOptimizer(torch.optim.AdamW(params, lr=0.01), enable_fusion=True, fusion_config=fusion)
    assert {b.route.value for b in opt.plan.buckets} == {"torch_fused"}
    for step in range(2):
        for p, g in zip(params, random_grads(params, step), strict=True):
            p.grad = g
        opt.step()
    params[2].grad = None
    params[2].grad_dtype = torch.float32
    for p, g in zip(params, random_grads(params, 2), strict=True):
        p.grad = g.float() if p is params[2] else g
    steps = [opt.state[p]["step"].clone() for p in params]
    _refused_unchanged(opt, params, r"p.grad_dtype = None")
    assert opt.step_count == 2 and all(torch.equal(opt.state[p]["step"], s) for p, s in zip(params, steps, strict=True))


@pytest.mark.parametrize("momentum", ["nesterov", "dampening"])
@pytest.mark.parametrize("made_by", ["wrapped_step", "by_hand"])
def test_sgd_momentum_made_by_another_hand_is_kept(made_by, momentum, device):
    """SGD keeps no step count in its state, so the fused kernel counts privately to tell a new momentum buffer
    (started from the grad) from one under way. A buffer made after the plan by another hand, the wrapped step's
    (a param whose first grad had another dtype) or the user's (a warm start), is under way: 20 steps equal
    torch's, the fused route throughout after the first."""
    kw = {"nesterov": True} if momentum == "nesterov" else {"dampening": 0.3}
    sizes = [(5, 3), 16, 7]
    ref, ours = make_params(sizes, torch.float32, device), make_params(sizes, torch.float32, device)
    ref_opt = torch.optim.SGD(ref, lr=0.05, momentum=0.9, **kw)
    base = torch.optim.SGD(ours, lr=0.05, momentum=0.9, **kw)
    for o, params in ((ref_opt, ref), (base, ours)):
        for p in params:
            o.state[p]  # an empty entry, as any read of torch's state defaultdict makes
    opt = KitsuneOptimizer(base, enable_fusion=True)
    for step in range(20):
        grads = random_grads(ours, step)
        if step == 0 and made_by == "by_hand":
            for o, params in ((ref_opt, ref), (opt, ours)):
                for i, p in enumerate(params):
                    o.state[p]["momentum_buffer"] = _fill(torch.empty_like(p), 10 + i)
        for params in (ref, ours):
            for i, (p, g) in enumerate(zip(params, grads, strict=True)):
                wide = step == 0 and made_by == "wrapped_step" and i == 1
                if wide:
                    p.grad_dtype = torch.float64
                p.grad = g.double() if wide else g.clone()
        ref_opt.step()
        opt.step()
        ours[1].grad_dtype = ref[1].grad_dtype = None
        if step > 0:
            assert opt.plan.fused_tensors == len(ours)
    for p, q in zip(ref, ours, strict=True):
        torch.testing.assert_close(q.detach(), p.detach(), atol=1e-5, rtol=1e-5)
        # torch keeps the float64 buffer its step made from a float64 grad; kitsune's kernel holds the param's dtype
        got, want = opt.state[q]["momentum_buffer"], ref_opt.state[p]["momentum_buffer"]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, check_dtype=False)


# a value set by hand between steps that the step must not take: (optimizer, key, value, error, message)
BAD_VALUES: dict[str, tuple[Callable, str, Any, type[Exception], str]] = {
    # torch's step divides the lr by 1 - beta1**step (ZeroDivisionError); the kernel's division gave every param inf
    "adam_beta1_one": (lambda ps: torch.optim.Adam(ps, lr=1e-2), "betas", (1.0, 0.999), ZeroDivisionError, "=1.0"),
    "adamw_beta1_one": (lambda ps: torch.optim.AdamW(ps, lr=1e-2), "betas", (1.0, 0.9), ZeroDivisionError, "=1.0"),
    "adamax_beta1_one": (lambda ps: torch.optim.Adamax(ps, lr=1e-2), "betas", [1, 0.9], ZeroDivisionError, "=1.0"),
    # torch's step sets the factors by value among signs of 0 and 1: it took other branches than the kernel's
    "rprop_etaminus_one": (lambda ps: torch.optim.Rprop(ps, lr=1e-2), "etas", (1.0, 1.2), ValueError, "etaminus < 1"),
    "rprop_etaminus_zero": (lambda ps: torch.optim.Rprop(ps, lr=1e-2), "etas", (0.0, 1.2), ValueError, "0 < etaminus"),
    # Python's own errors (a string times a float, a tuple index, a tensor's float()) named the group and the fix
    "nadam_text": (lambda ps: torch.optim.NAdam(ps, lr=1e-2), "momentum_decay", "4e-3", TypeError, "param group 0's"),
    "adam_one_beta": (lambda ps: torch.optim.Adam(ps, lr=1e-2), "betas", (0.9,), ValueError, "two numbers"),
    "adam_lr_pair": (lambda ps: torch.optim.Adam(ps, lr=1e-2), "lr", torch.tensor([0.01, 0.02]), ValueError, "group 0"),
    # kitsune.optim's own step refuses these (its _check_group); the fused route ran them
    "lion_negative_lr": (lambda ps: Lion(ps, lr=1e-3), "lr", -1e-3, ValueError, "Invalid learning rate"),
    "lamb_bool_lr": (lambda ps: LAMB(ps, lr=1e-2), "lr", True, TypeError, "Invalid learning rate"),
    "lamb_three_betas": (lambda ps: LAMB(ps, lr=1e-2), "betas", (0.8, 0.9, 0.5), ValueError, "Invalid betas"),
    "lars_bool_momentum": (lambda ps: LARS(ps, lr=0.1), "momentum", True, TypeError, "Invalid momentum"),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_a_value_the_step_must_not_take_is_refused_before_anything_changes(case, device):
    """A hyperparameter set by hand between steps to a value the wrapped optimizer's own step refuses (or computes
    otherwise than the kernel) is refused on the fused route with a message that names it, before anything changes;
    set back, the run goes on as torch's twin, which never took the refused step."""
    make, key, value, error, match = BAD_VALUES[case]
    params, twins = make_params(SIZES, torch.float32, device), make_params(SIZES, torch.float32, device)
    opt, ref = KitsuneOptimizer(make(params), enable_fusion=True), make(twins)
    assert "triton" in str(opt.plan)
    for step in range(5):
        if step == 2:
            was = opt.param_groups[0][key]
            opt.param_groups[0][key] = value
            _set_grads(params, twins, step)
            assert_refused(opt, params, match, error=error)
            opt.param_groups[0][key] = was
        _set_grads(params, twins, step)
        opt.step()
        ref.step()
        for p, t in zip(params, twins, strict=True):
            torch.testing.assert_close(p, t)


CLOSURE_CHANGES = {
    "appended": lambda opt, ps: opt.param_groups[0]["params"].append(ps[2]),
    "replaced": lambda opt, ps: opt.param_groups[1]["params"].__setitem__(0, ps[2]),
    "removed": lambda opt, ps: opt.param_groups[1]["params"].pop(),
    "groups-reversed": lambda opt, ps: opt.param_groups.reverse(),
    "new-list": lambda opt, ps: opt.param_groups[0].__setitem__("params", [ps[0], ps[2]]),
}


@pytest.mark.parametrize("change", CLOSURE_CHANGES.values(), ids=CLOSURE_CHANGES.keys())
def test_groups_changed_inside_the_closure_are_read_as_torch_reads_them(change, device):
    """torch's step reads param_groups after it calls the closure: a param the closure adds, moves or takes out is
    updated (or not) in that very step, as torch updates it."""
    params = make_params([(6, 5), (9,), (7,)], torch.float32, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]

    def make(ps: list) -> torch.optim.SGD:
        return torch.optim.SGD([{"params": ps[:1]}, {"params": ps[1:2], "lr": 0.004}], lr=0.05, momentum=0.9)

    opt, ref = KitsuneOptimizer(make(params), enable_fusion=True), make(twins)
    for step in range(4):
        grads = random_grads(params, step)
        for o, ps in ((opt, params), (ref, twins)):

            def closure(o=o, ps=ps, step=step, grads=grads) -> torch.Tensor:
                if step == 2:
                    change(o, ps)
                for p, g in zip(ps, grads, strict=True):
                    p.grad = g.clone()
                return torch.tensor(1.0)

            assert o.step(closure).item() == 1.0
        for p, t in zip(params, twins, strict=True):
            torch.testing.assert_close(p, t, rtol=1e-5, atol=1e-6, msg=lambda m, step=step: f"step {step}: {m}")
    assert "triton" in str(opt.plan)


def _one_step_for_all(opt: Any, params: list) -> None:
    shared = opt.state[params[0]]["step"]
    for p in params:
        opt.state[p]["step"] = shared


def _one_dict_for_two(opt: Any, params: list) -> None:
    opt.state[params[1]] = opt.state[params[0]]


def _one_moment_for_two(opt: Any, params: list) -> None:
    opt.state[params[1]]["exp_avg"] = opt.state[params[0]]["exp_avg"]


def _a_checkpoint_with_one_step(opt: Any, params: list) -> None:
    saved = opt.state_dict()
    shared = torch.tensor(float(saved["state"][0]["step"]))
    for st in saved["state"].values():
        st["step"] = shared
    opt.load_state_dict(saved)


@pytest.mark.parametrize("pool", [None, 0], ids=["pool", "no-pool"])
@pytest.mark.parametrize(
    "change", [_one_step_for_all, _one_dict_for_two, _one_moment_for_two, _a_checkpoint_with_one_step]
)
def test_state_shared_between_params_steps_as_torch(change, pool, device):
    """One state tensor (or dict) for two params: torch's step updates it once for each; the fused kernels keep each
    param's state apart (and the pool copies it into slots of its own), so those params go to the wrapped step,
    with the reason, and the rest stay fused."""
    params = make_params([(6, 5), (6, 5), (9,)], torch.float32, device)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    memory = MemoryConfig() if pool is None else MemoryConfig(pool_size=pool)
    # torch's for-loop step: its foreach and fused kernels take a shared tensor twice in one launch (on a GPU, a race)
    opt = KitsuneOptimizer(
        torch.optim.AdamW(params, lr=0.01, foreach=False), config=KitsuneConfig(fusion=FusionConfig(), memory=memory)
    )
    ref = torch.optim.AdamW(twins, lr=0.01, foreach=False)
    for step in range(6):
        for p, t, g in zip(params, twins, random_grads(params, step), strict=True):
            p.grad, t.grad = g.clone(), g.clone()
        if step == 2:
            change(opt, params)
            change(ref, twins)
        opt.step()
        ref.step()
        for p, t in zip(params, twins, strict=True):
            torch.testing.assert_close(p, t, rtol=1e-5, atol=1e-6, msg=lambda m, step=step: f"step {step}: {m}")
    assert [float(opt.state[p]["step"]) for p in params] == [float(ref.state[t]["step"]) for t in twins]
    shared = [b for b in opt.plan.buckets if b.reason.startswith("optimizer state whose memory is shared")]
    assert shared and all(b.route.value == "base_step" for b in shared)
    assert sum(b.tensors for b in shared) == (3 if change in (_one_step_for_all, _a_checkpoint_with_one_step) else 2)


@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "in-backward"])
def test_params_swapped_on_conversion_train_as_torch(in_backward, device, monkeypatch):
    """Under torch.__future__.set_swap_module_params_on_conversion(True) (DTensor params take that path too),
    load_state_dict (and Module.to) swap each param's contents with torch.utils.swap_tensors, which refuses a tensor
    that has a weak reference: kitsune puts none on the params, and the step sees the params' new contents."""
    from kitsune.config import StreamConfig

    monkeypatch.setattr(torch.__future__, "_swap_module_params_on_conversion", True)
    torch.manual_seed(3)
    model, twin = torch.nn.Linear(5, 4).to(device), torch.nn.Linear(5, 4).to(device)
    twin.load_state_dict(model.state_dict())
    streams = StreamConfig(step_in_backward=in_backward, bucket_bytes=64)
    opt = KitsuneOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.01), config=KitsuneConfig(fusion=FusionConfig(), streams=streams)
    )
    ref = torch.optim.AdamW(twin.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(4)
    for step in range(5):
        if step == 2:
            for m in (model, twin):
                m.load_state_dict({k: v * 0.5 for k, v in m.state_dict().items()})
        step_twins(model, twin, opt, ref, torch.randn(3, 5, generator=gen).to(device))
    assert "triton" in str(opt.plan)


def _put_back_last(opt: Any, params: list) -> None:
    """A param's dict taken out and put back: the same dict, now the state's last entry."""
    d = opt.state[params[0]]
    del opt.state[params[0]]
    opt.state[params[0]] = d


def _ordered_moved(opt: Any, params: list) -> None:
    """An OrderedDict state whose own order (move_to_end) is not the order of its entries underneath."""
    from collections import OrderedDict

    opt.state = OrderedDict(opt.state)
    opt.state.move_to_end(params[0])


@pytest.mark.parametrize(("reorder", "victim"), [(_put_back_last, 0), (_ordered_moved, 2)], ids=["put-back", "ordered"])
def test_a_tensor_replaced_after_the_states_entries_moved_is_read_as_torch_reads_it(reorder, victim, device):
    """The state holds an entry the fused kernels do not bind (a complex param's, on the wrapped step); the entries
    move (nothing replaced: the plan holds), then a bound tensor is replaced while the old one is kept. The watch must
    read each bound param's dict where it now is, not where it was."""
    params = make_params([(6, 5), (9,), (7,)], torch.float32, device)
    params.append(torch.nn.Parameter(torch.randn(4, dtype=torch.complex64, generator=torch.Generator().manual_seed(9))))
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]

    def make(ps: list) -> torch.optim.AdamW:
        return torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)

    opt, ref = KitsuneOptimizer(make(params), enable_fusion=True), make(twins)
    kept = []
    for step in range(8):
        for p, t, g in zip(params, twins, random_grads(params, step), strict=True):
            p.grad, t.grad = g.to(p.dtype), g.to(p.dtype)
        for o, ps in ((opt, params), (ref, twins)):
            if step == 3:
                reorder(o, ps)
            elif step == 5:
                s = o.state[ps[victim]]
                kept.append(s["exp_avg"])
                s["exp_avg"] = torch.full_like(s["exp_avg"], 0.5)
        opt.step()
        ref.step()
        for p, t in zip(params, twins, strict=True):
            torch.testing.assert_close(p, t, rtol=1e-5, atol=1e-6, msg=lambda m, step=step: f"step {step}: {m}")
    assert opt.plan.fused_tensors == 3
