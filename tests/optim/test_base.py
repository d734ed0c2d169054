"""The step kitsune.optim's optimizers share: everything that can raise does so before any param or state changes."""

from __future__ import annotations

import copy

import pytest
import torch

from kitsune.optim import LAMB, LARS, Lion, Muon

SHAPES = ((4, 5), (6, 3), (5, 4))  # matrices, so that Muon takes every one

OPTIMIZERS = {
    "Lion": lambda groups: Lion(groups, lr=0.01, weight_decay=0.1),
    "LAMB": lambda groups: LAMB(groups, lr=0.01, weight_decay=0.1),
    "LARS": lambda groups: LARS(groups, lr=1.0, weight_decay=0.1, trust_coefficient=0.02),
    "Muon": lambda groups: Muon(groups, lr=0.02),
    "Muon+AdamW": lambda groups: Muon([groups[0], {**groups[1], "use_muon": False}], lr=0.02),
}


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in SHAPES]


def _set_grads(params: list[torch.nn.Parameter], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _stepped(name: str, warmup: int) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    """``OPTIMIZERS[name]`` over two groups of fresh params after ``warmup`` steps, with the next step's grads set."""
    params = _params(seed=0)
    opt = OPTIMIZERS[name]([{"params": params[:2]}, {"params": params[2:]}])
    for step in range(warmup):
        _set_grads(params, seed=1 + step)
        opt.step()
    _set_grads(params, seed=100)
    return params, opt


def _assert_same_state(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for index, state in want.items():
        assert got[index].keys() == state.keys()
        for key, value in state.items():
            assert torch.equal(got[index][key], value), (index, key)


@pytest.mark.parametrize("warmup", [0, 3])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_sparse_grad_in_a_later_group_changes_nothing(name, warmup):
    params, opt = _stepped(name, warmup)
    params[2].grad = params[2].grad.to_sparse()
    before = [p.detach().clone() for p in params]
    state = copy.deepcopy(opt.state_dict()["state"])
    algorithm = "AdamW" if name == "Muon+AdamW" else type(opt).__name__  # Muon names the group's algorithm
    with pytest.raises(RuntimeError, match=f"^{algorithm} does not support sparse gradients$"):
        opt.step()
    for p, want in zip(params, before, strict=True):
        assert torch.equal(p, want)
    _assert_same_state(opt.state_dict()["state"], state)
    assert len(opt.state) == (len(params) if warmup else 0)


BAD_VALUES = {  # a group option set to what the math cannot read, per optimizer
    "Lion": [("weight_decay", None), ("betas", (0.9,)), ("lr", None), ("betas", None)],
    "LAMB": [("eps", None), ("betas", (0.9, 0.99, 0.5)), ("weight_decay", "0.1")],
    "LARS": [("momentum", None), ("trust_coefficient", None), ("eps", "tiny")],
    "Muon": [("momentum", None), ("weight_decay", None), ("lr", "1e-3")],
    "Muon+AdamW": [("eps", None), ("betas", (0.9,))],
}


@pytest.mark.parametrize("warmup", [0, 3])
@pytest.mark.parametrize(("name", "key", "value"), [(n, k, v) for n, kv in BAD_VALUES.items() for k, v in kv])
def test_a_group_option_the_math_cannot_read_changes_nothing(name, key, value, warmup):
    """``weight_decay=None``, ``betas=(0.9,)``, a deleted key in the last group: the step read each group's options
    inside its update, so the groups before it were updated (and their step counts bumped) when it raised. Every
    group is read before the first update now, as the fused route does."""
    for change in ("set", "delete"):
        params, opt = _stepped(name, warmup)
        group = opt.param_groups[1]
        if change == "set":
            group[key] = value
        else:
            del group[key]
        before = [p.detach().clone() for p in params]
        state = copy.deepcopy(opt.state_dict()["state"])
        with pytest.raises((TypeError, ValueError, KeyError), match=key):
            opt.step()
        for p, want in zip(params, before, strict=True):
            assert torch.equal(p, want)
        _assert_same_state(opt.state_dict()["state"], state)


@pytest.mark.parametrize("name", ["Lion", "LAMB", "Muon", "LARS", "Muon+AdamW"])
def test_complex_params_refused_before_anything_changes_where_the_math_is_real(name):
    """Lion's sign and LAMB's second moment (the square of a complex grad, not its magnitude) are not defined on
    complex params: Lion raised torch's error halfway through the step, LAMB ran math that is not LAMB. Both refuse
    the step before anything changes now, as Muon does; LARS and Muon's AdamW groups take complex params as real
    pairs, as torch's SGD and AdamW do."""
    params, opt = _stepped(name, 2)
    z = torch.nn.Parameter(torch.randn(5, 4, dtype=torch.complex64))
    opt.add_param_group({"params": [z], **({"use_muon": False} if name == "Muon+AdamW" else {})})
    z.grad = torch.randn(5, 4, dtype=torch.complex64)
    before = [p.detach().clone() for p in (*params, z)]
    if name in ("LARS", "Muon+AdamW"):
        opt.step()
        assert not torch.equal(z, before[-1])
        return
    with pytest.raises(RuntimeError, match=f"^{name} does not support complex parameters$"):
        opt.step()
    for p, want in zip((*params, z), before, strict=True):
        assert torch.equal(p, want)
    assert z not in opt.state


def test_a_muon_group_refused_by_add_param_group_is_not_kept():
    """A 1-D param, a bad ``adjust_lr_fn`` or a negative lr in a new Muon group raised, but the group stayed in
    ``param_groups``: the next step ran Muon on it, and adding the param again (as an AdamW group) was refused as a
    duplicate."""
    params, opt = _stepped("Muon", 1)
    bias = torch.nn.Parameter(torch.randn(4))
    for bad in ({"params": [bias]}, {"params": [bias], "adjust_lr_fn": "bogus"}, {"params": [bias], "lr": -1.0}):
        with pytest.raises(ValueError):
            opt.add_param_group(bad)
        assert len(opt.param_groups) == 2
    opt.add_param_group({"params": [bias], "use_muon": False})
    bias.grad = torch.randn(4)
    opt.step()
    assert set(opt.state[bias]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize(("cls", "key"), [(Lion, "exp_avg"), (LAMB, "step"), (LAMB, "exp_avg"), (LAMB, "exp_avg_sq")])
def test_state_missing_a_key_raises_key_error_before_any_update(cls, key):
    """As torch.optim.Adam: a param's non-empty state is read, not completed; the step raises and moves nothing."""
    params = _params(seed=1)
    groups = [{"params": params[:2]}, {"params": params[2:]}]
    opt = cls(groups, lr=0.01)
    for step in range(3):
        _set_grads(params, seed=10 + step)
        opt.step()
    checkpoint = copy.deepcopy(opt.state_dict())
    last = checkpoint["state"][2]  # the last param, in the last group: its state is not empty, but lacks the key
    last["momentum_buffer"] = last.pop(key)
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = cls([{"params": resumed[:2]}, {"params": resumed[2:]}], lr=0.01)
    opt.load_state_dict(checkpoint)
    _set_grads(resumed, seed=100)
    before = [p.detach().clone() for p in resumed]
    with pytest.raises(KeyError, match=key):
        opt.step()
    for p, want in zip(resumed, before, strict=True):
        assert torch.equal(p, want)


@pytest.mark.parametrize("warmup", [0, 3])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_grad_of_another_dtype_is_refused_before_anything_changes_or_taken_as_it_is(name, warmup):
    """A float64 grad of a float32 param (``p.grad_dtype``) in the last group: the math that lerps it into state
    made like the param (Lion, LAMB, Muon's AdamW groups, as torch.optim.AdamW) is refused with nothing changed;
    the math that makes its state like the grad takes it, as torch.optim.SGD does: LARS always, Muon until its
    momentum buffer exists (made like the first grad, it then needs that dtype)."""
    params, opt = _stepped(name, warmup)
    params[2].grad = None
    params[2].grad_dtype = torch.float64
    params[2].grad = torch.randn(params[2].shape, dtype=torch.float64)
    before = [p.detach().clone() for p in params]
    state = copy.deepcopy(opt.state_dict()["state"])
    if name == "LARS" or (name == "Muon" and not warmup):
        opt.step()
        assert all(not torch.equal(p, want) for p, want in zip(params, before, strict=True))
        return
    algorithm = "AdamW" if name == "Muon+AdamW" else name
    needs = "its momentum buffer's dtype" if name == "Muon" else "its param's dtype"  # a buffer made like the grad
    with pytest.raises(ValueError, match=rf"^{algorithm} needs each grad in {needs}.*p.grad_dtype"):
        opt.step()
    for p, want in zip(params, before, strict=True):
        assert torch.equal(p, want)
    _assert_same_state(opt.state_dict()["state"], state)


@pytest.mark.parametrize("name", ["Lion", "LAMB", "LARS", "Muon"])
@pytest.mark.parametrize(
    ("lr", "exc", "match"),
    [
        ("1e-3", TypeError, r"Invalid learning rate( in defaults)?: '1e-3' \(a number or a one-element tensor"),
        (True, TypeError, "Invalid learning rate( in defaults)?: True"),
        (-0.1, ValueError, "Invalid learning rate( in defaults)?: -0.1"),
        (torch.tensor([1e-3, 2e-3]), ValueError, "a tensor lr must have one element"),
    ],
    ids=["string", "bool", "negative", "two-element-tensor"],
)
def test_an_lr_torch_would_refuse_is_refused_at_build(name, lr, exc, match):
    """As torch.optim's optimizers: a string lr is not converted (it would reach an LR scheduler's arithmetic)."""
    optimizer = {"Lion": Lion, "LAMB": LAMB, "LARS": LARS, "Muon": Muon}[name]
    with pytest.raises(exc, match=match):
        optimizer(_params(seed=0), lr=lr)


@pytest.mark.parametrize("lr", [1e-3, 0, torch.tensor(1e-3), torch.tensor([1e-3])])
def test_numbers_and_one_element_tensors_are_taken_as_lr(lr):
    for optimizer in (Lion, LAMB, LARS, Muon):
        assert optimizer(_params(seed=0), lr=lr).param_groups[0]["lr"] is lr


@pytest.mark.parametrize("name", ["LAMB", "Muon+AdamW"])
def test_a_step_count_saved_as_a_number_counts_on_after_loading(name):
    """An older checkpoint's (or a hand-written) step count as a Python number: loaded, it becomes a tensor as
    torch.optim's optimizers make theirs, and the run continues as from the tensor checkpoint (bias correction moving
    with it, not frozen at the loaded count)."""
    params, opt = _stepped(name, warmup=3)
    numbers = copy.deepcopy(opt.state_dict())
    counted = [s for s in numbers["state"].values() if "step" in s]
    assert counted
    for s in counted:
        s["step"] = float(s["step"])
    runs = []
    for checkpoint in (numbers, opt.state_dict()):
        mine = [torch.nn.Parameter(p.detach().clone()) for p in params]
        other = OPTIMIZERS[name]([{"params": mine[:2]}, {"params": mine[2:]}])
        other.load_state_dict(checkpoint)
        for step in range(4):
            _set_grads(mine, seed=200 + step)
            other.step()
        runs.append((mine, other.state_dict()["state"]))
    (got, got_state), (want, want_state) = runs
    for p, q in zip(got, want, strict=True):
        assert torch.equal(p, q)
    _assert_same_state(got_state, want_state)
    assert all(float(s["step"]) == 7.0 for s in got_state.values() if "step" in s)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_compiled_training_step_trains_as_the_eager_one(name):
    """``opt.step()`` inside a function torch.compile traces, as torch.optim's are: torch.compile handles a method
    named ``_init_group`` on any torch.optim.Optimizer as torch's own (run outside the trace, its result taken as a
    constant), which the shared step's gathering is not."""
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        params = _params(seed=3)
        opt = OPTIMIZERS[name]([{"params": params[:2]}, {"params": params[2:]}])

        def train_step(seed: int, params=params, opt=opt) -> None:
            _set_grads(params, seed)
            opt.step()

        step = torch.compile(train_step, backend="eager") if compiled else train_step
        for seed in range(5):
            step(seed)
        runs.append(params)
    # Muon's Newton-Schulz runs in bfloat16: traced, torch's iteration (no Triton kernel for CPU params outside
    # the interpreter) may round a product differently, by about a bfloat16 ulp of the update
    tol = 1e-4 if name.startswith("Muon") else 1e-6
    for p, q in zip(*runs, strict=True):
        torch.testing.assert_close(p, q, atol=tol, rtol=tol)
