"""The memory pool: fused params' state (and, optionally, grads) as views of flat per-(device, dtype) arenas."""

from __future__ import annotations

import warnings

import pytest
import torch
from twins import TOL, make_params, random_grads, trajectory

from kitsune import KitsuneOptimizer
from kitsune.config import FusionConfig, KitsuneConfig, MemoryConfig

SIZES = [7, (5, 3), 1, 300, (4, 4, 2)]


def storages(opt: torch.optim.Optimizer, key: str) -> set[int]:
    return {opt.state[p][key].untyped_storage().data_ptr() for g in opt.param_groups for p in g["params"]}


def pooled(pool_size: int = 512 * 2**20, flat_grads: bool = False, max_fusion_size: int | None = None, **kw):
    return KitsuneConfig(
        fusion=FusionConfig(enabled=True, max_fusion_size=max_fusion_size),
        memory=MemoryConfig(pool_size=pool_size, flat_grads=flat_grads),
        **kw,
    )


def test_state_lives_in_one_arena_and_matches_torch(device):
    make = lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, amsgrad=True)  # noqa: E731
    ref, _ = trajectory(make, SIZES, torch.float32, device, steps=30)
    got, opt = trajectory(make, SIZES, torch.float32, device, steps=30, fused=True)
    for r, g in zip(ref, got, strict=True):
        torch.testing.assert_close(g, r, atol=TOL[torch.float32][0], rtol=TOL[torch.float32][1])
    memory = opt._subsystem("memory")
    assert memory.active, memory.reason
    # every state key of every param is a view of the same flat buffer; so are the step counts (float32)
    arenas = storages(opt, "exp_avg") | storages(opt, "exp_avg_sq") | storages(opt, "max_exp_avg_sq")
    assert len(arenas) == 1
    assert len(storages(opt, "step")) == 1
    # torch's keys, shapes and dtypes are unchanged
    for p in got:
        s = opt.state[p]
        assert set(s) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
        assert s["exp_avg"].shape == p.shape and s["step"].shape == () and s["step"].dtype == torch.float32
    report = memory.report()
    assert report["params_pooled"] == len(SIZES) and report["params_outside_pool"] == 0


def test_pool_size_caps_the_arena_and_the_rest_keeps_torch_allocations(device):
    # 4 units of 2 params (max_fusion_size=2), 64 fp32 elements each, AdamW: 2 keys x 2 params x 256 B aligned
    # slots + 2 step slots of 256 B = 1536 B per unit; a 3200-byte pool holds exactly two units
    params = make_params([64] * 8, torch.float32, device)
    opt = KitsuneOptimizer(torch.optim.AdamW(params, lr=1e-2), config=pooled(pool_size=3200, max_fusion_size=2))
    for step in range(3):
        for p, g in zip(params, random_grads(params, step), strict=True):
            p.grad = g
        opt.step()
    report = opt._subsystem("memory").report()
    assert report["params_pooled"] == 4 and report["params_outside_pool"] == 4
    assert report["bytes_per_device"][str(params[0].device)]["allocated"] <= 3200
    first = {opt.state[p]["exp_avg"].untyped_storage().data_ptr() for p in params[:4]}
    rest = {opt.state[p]["exp_avg"].untyped_storage().data_ptr() for p in params[4:]}
    assert len(first) == 1 and len(rest) == 4  # pooled: one storage; outside: one per tensor

    # and the split changes nothing in the numbers
    ref = make_params([64] * 8, torch.float32, device)
    plain = torch.optim.AdamW(ref, lr=1e-2)
    for step in range(3):
        for p, g in zip(ref, random_grads(ref, step), strict=True):
            p.grad = g
        plain.step()
    for r, g in zip(ref, params, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


def test_pool_off_or_too_small_says_why(device):
    params = make_params([64, 64], torch.float32, device)
    off = KitsuneOptimizer(torch.optim.AdamW(params, lr=1e-2), config=pooled(pool_size=0))
    assert not off._subsystem("memory").active
    assert "memory_pool_size=0" in off._subsystem("memory").reason
    small = KitsuneOptimizer(torch.optim.AdamW(params, lr=1e-2), config=pooled(pool_size=100))
    reason = small._subsystem("memory").reason
    assert not small._subsystem("memory").active and "raise memory_pool_size" in reason
    # a re-plan to the same layout (a param's storage replaced) keeps the verdict: it said "active" with nothing
    # pooled, and flat grads then took the pooled path for grads no arena held
    for step in range(3):
        for p, g in zip(params, random_grads(params, step), strict=True):
            p.grad = g
        if step == 1:
            params[0].data = params[0].data.clone()
        small.step()
    memory = small._subsystem("memory")
    assert small.plan.fused_tensors == 2 and memory.report()["params_pooled"] == 0
    assert not memory.active and memory.reason == reason


def test_checkpoints_move_between_the_pool_and_plain_torch(device):
    """kitsune (pooled) -> plain AdamW -> kitsune (pooled): the run continues as one uninterrupted torch run."""
    make = lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05)  # noqa: E731
    ref = make_params(SIZES, torch.float32, device)
    ref_opt = make(ref)
    params = make_params(SIZES, torch.float32, device)
    opt = KitsuneOptimizer(make(params), config=pooled())

    def run(o, ps, steps):
        for step in steps:
            for p, g in zip(ps, random_grads(ps, step), strict=True):
                p.grad = g
            o.step()
            o.zero_grad()

    run(ref_opt, ref, range(0, 30))
    run(opt, params, range(0, 10))
    plain = make(params)
    plain.load_state_dict(opt.state_dict())
    run(plain, params, range(10, 20))
    back = KitsuneOptimizer(make(params), config=pooled())
    back.load_state_dict(plain.state_dict())
    # the loaded tensors were copied into the arena: one storage again
    assert len(storages(back, "exp_avg") | storages(back, "exp_avg_sq")) == 1
    run(back, params, range(20, 30))
    for r, g in zip(ref, params, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    for r, g in zip(ref, params, strict=True):
        torch.testing.assert_close(back.state[g]["exp_avg_sq"], ref_opt.state[r]["exp_avg_sq"], atol=1e-6, rtol=1e-5)
        assert back.state[g]["step"].item() == 30


def test_a_checkpoint_loaded_over_pooled_state_goes_into_the_arena(device):
    """``load_state_dict`` of a checkpoint read from disk (new tensors) into an optimizer whose state is pooled: the
    load held the replaced state until it could not fail, and the loaded tensors got memory of their own beside the
    arena, so the state took twice its memory for the rest of the run. They go into the arena now."""
    import io

    make = lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05)  # noqa: E731
    ref = make_params(SIZES, torch.float32, device)
    ref_opt = make(ref)
    params = make_params(SIZES, torch.float32, device)
    opt = KitsuneOptimizer(make(params), config=pooled())
    for o, ps in ((opt, params), (ref_opt, ref)):
        for step in range(4):
            for p, g in zip(ps, random_grads(ps, step), strict=True):
                p.grad = g
            o.step()
    arena = storages(opt, "exp_avg")
    assert len(arena) == 1 and arena == storages(opt, "exp_avg_sq")
    buffer = io.BytesIO()
    torch.save(ref_opt.state_dict(), buffer)
    buffer.seek(0)
    opt.load_state_dict(torch.load(buffer, weights_only=True))
    assert storages(opt, "exp_avg") | storages(opt, "exp_avg_sq") == arena
    for o, ps in ((opt, params), (ref_opt, ref)):
        for step in range(4, 9):
            for p, g in zip(ps, random_grads(ps, step), strict=True):
                p.grad = g
            o.step()
    assert storages(opt, "exp_avg") == arena and opt.plan.fused_tensors == len(params)
    for r, g in zip(ref, params, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


def test_a_param_reshaped_with_its_state_reset_trains_on(device):
    """``p.data = p.data.reshape(...)`` (same size) and its state dropped (``del opt.state[p]``): torch starts the
    state anew in the new shape. The pool kept the old layout (its key held sizes, not shapes) and refused the
    step with the old shape's slots."""
    make = lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05)  # noqa: E731
    sides = []
    for kitsune in (True, False):
        params = make_params([(4, 6), 5], torch.float32, device)
        opt = KitsuneOptimizer(make(params), config=pooled()) if kitsune else make(params)
        for step in range(7):
            if step == 3:
                params[0].data = params[0].data.reshape(6, 4)
                del opt.state[params[0]]
            for p, g in zip(params, random_grads(params, step), strict=True):
                p.grad = g
            opt.step()
        sides.append((params, opt))
    (ours, opt), (ref, _) = sides
    assert opt.plan.fused_tensors == 2 and opt.state[ours[0]]["exp_avg"].shape == (6, 4)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_load_leaves_the_state_dict_taken_before_it_as_it_was(device):
    """Try a checkpoint, then go back: ``current = opt.state_dict()``, load an older one, load ``current``. torch's
    load puts new tensors in the state, so ``current`` keeps its values; the pool must not copy the older values
    into the arena views ``current`` holds. The run then continues as torch's from ``current``."""
    import copy

    make = lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05)  # noqa: E731
    sides = []
    for kitsune in (True, False):
        params = make_params(SIZES, torch.float32, device)
        opt = KitsuneOptimizer(make(params), config=pooled()) if kitsune else make(params)

        def run(steps, o=opt, ps=params):
            for step in steps:
                for p, g in zip(ps, random_grads(ps, step), strict=True):
                    p.grad = g
                o.step()

        run(range(5))
        older = copy.deepcopy(opt.state_dict())
        run(range(5, 8))
        current = opt.state_dict()
        kept = copy.deepcopy(current)
        opt.load_state_dict(older)
        for i, st in kept["state"].items():  # the load changed nothing that `current` holds
            assert all(torch.equal(current["state"][i][k], v) for k, v in st.items()), i
        opt.load_state_dict(current)
        run(range(8, 12))
        sides.append((params, opt))
    (ours, opt), (ref, ref_opt) = sides
    assert opt.plan.fused_tensors == len(ours)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert all(opt.state[p]["step"].item() == 12 for p in ours)


def test_state_built_before_the_plan_is_adopted(device):
    # Adagrad creates its "sum" state in __init__: the pool copies it into the arena at plan time
    make = lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.3)  # noqa: E731
    ref, _ = trajectory(make, SIZES, torch.float32, device, steps=20)
    got, opt = trajectory(make, SIZES, torch.float32, device, steps=20, fused=True)
    assert len(storages(opt, "sum")) == 1
    for r, g in zip(ref, got, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


def test_one_arena_per_dtype_and_a_new_group_moves_state_over(device):
    fp32 = make_params([33, 65], torch.float32, device)
    bf16 = make_params([17, 9], torch.bfloat16, device, seed=3)
    ref32, ref16 = make_params([33, 65], torch.float32, device), make_params([17, 9], torch.bfloat16, device, seed=3)
    opt = KitsuneOptimizer(torch.optim.Adam(fp32, lr=1e-2), config=pooled())
    plain = torch.optim.Adam(ref32, lr=1e-2)
    for step in range(40):
        if step == 15:  # a structural change: re-plan, new arenas, the first group's state copied into them
            opt.add_param_group({"params": bf16, "lr": 5e-3})
            plain.add_param_group({"params": ref16, "lr": 5e-3})
        for o, ps in ((opt, fp32 + (bf16 if step >= 15 else [])), (plain, ref32 + (ref16 if step >= 15 else []))):
            for p, g in zip(ps, random_grads(ps, step), strict=True):
                p.grad = g
            o.step()
            o.zero_grad()
    assert len(storages(opt, "exp_avg")) == 2  # one arena per (device, dtype)
    for r, g in zip(ref32, fp32, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    for r, g in zip(ref16, bf16, strict=True):  # the fused kernel rounds once per step, torch's eager path per op
        torch.testing.assert_close(g.float(), r.float(), atol=3e-2, rtol=2e-2)


def test_flat_grads_are_arena_views_accumulated_and_zeroed_in_place(device):
    model, twin, opt, plain = _flat_grads_twins(device)
    gen = torch.Generator().manual_seed(5)
    first_ptrs = None
    for step in range(25):
        x, y = torch.randn(8, 6, generator=gen).to(device), torch.randn(8, 3, generator=gen).to(device)
        for m, o in ((model, opt), (twin, plain)):
            for _ in range(2):  # two micro-batches accumulate into the same grads
                torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
            if step == 12 and o is opt:
                model.zero_grad()  # sets the grads to None: the next backward allocates; the pool adopts again
            else:
                o.zero_grad(set_to_none=False)
        if step == 12:
            assert all(p.grad is None for p in model.parameters())
            continue
        ptrs = [p.grad.data_ptr() for p in model.parameters()]
        if first_ptrs is None:
            first_ptrs = ptrs
        assert ptrs == first_ptrs, f"step {step}: a grad left its arena slot"
        assert all(p.grad is not None and not p.grad.any() for p in model.parameters()), "zero_grad kept the grads"
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    memory = opt._subsystem("memory")
    grad_arena = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(grad_arena) == 1
    n = len(list(model.parameters()))
    assert memory.report()["grad_adoptions"] == 2 * n  # once at the start, once after model.zero_grad()


@pytest.mark.parametrize("how", ["set_to_none", "replaced"])
def test_flat_grads_leave_an_old_grad_the_user_kept_as_torch_does(how, device):
    """A grad kept by the user once ``p.grad`` no longer holds it (set to None by ``model.zero_grad()``, or replaced
    by hand): the pool's next grad went into the same slot, overwriting the kept tensor and making it ``p.grad``
    again, and the arena's zeroing zeroed it. It keeps its values and stays apart now, as with torch, and the
    training goes on as torch's."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).to(device)
    twin = torch.nn.Linear(4, 3).to(device)
    twin.load_state_dict(model.state_dict())
    opt = KitsuneOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), config=pooled(flat_grads=True))
    plain = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    kept = {}
    for step in range(6):
        x = torch.randn(5, 4, generator=gen).to(device)
        for m, o in ((model, opt), (twin, plain)):
            m(x).square().sum().backward()
            if step == 2:
                kept[o] = (m.weight.grad, m.weight.grad.clone())
                if how == "replaced":
                    m.weight.grad = m.weight.grad * 0.5
            o.step()
            if step == 2 and how == "set_to_none":
                m.zero_grad()  # p.grad = None: the next backward makes a new grad
            else:
                o.zero_grad(set_to_none=False)
    held, values = kept[opt]
    assert torch.equal(held, values) and held is not model.weight.grad
    assert held.untyped_storage().data_ptr() != model.weight.grad.untyped_storage().data_ptr()
    assert model.weight.grad.untyped_storage().data_ptr() == model.bias.grad.untyped_storage().data_ptr()  # arena
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _flat_grads_twins(device: torch.device):
    """An MLP and its twin; AdamW over the first with flat grads in the pool, plain AdamW over the twin."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3)).to(device)
    twin = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3)).to(device)
    twin.load_state_dict(model.state_dict())
    opt = KitsuneOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), config=pooled(flat_grads=True))
    return model, twin, opt, torch.optim.AdamW(twin.parameters(), lr=1e-2)


@pytest.mark.parametrize("how", ["grad.data", "double-float"])
def test_flat_grads_follow_a_grad_whose_storage_was_swapped(how, device):
    """``p.grad.data = ...`` keeps the grad object and moves its memory out of the slot (``model.double()`` then
    ``model.float()`` between backward and step does it to every grad). The pool knew its views by object only: it
    never took such a grad back, and ``zero_grad()`` zeroed the arena, not it, so grads piled up step after step."""
    model, twin, opt, plain = _flat_grads_twins(device)
    gen = torch.Generator().manual_seed(1)
    for step in range(8):
        x, y = torch.randn(8, 6, generator=gen).to(device), torch.randn(8, 3, generator=gen).to(device)
        for m, o in ((model, opt), (twin, plain)):
            torch.nn.functional.mse_loss(m(x), y).backward()
            if step == 3 and how == "grad.data":
                for p in m.parameters():
                    p.grad.data = p.grad.data.clone()
            elif step == 3:
                m.double()
                m.float()
            o.step()
            o.zero_grad(set_to_none=False)
        assert all(not p.grad.any() for p in model.parameters()), step
    assert opt.plan.fused_tensors == 4
    assert len({p.grad.untyped_storage().data_ptr() for p in model.parameters()}) == 1  # back in the arena
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_flat_grads_take_a_grad_made_with_create_graph_without_its_graph(device):
    """``backward(create_graph=True)`` (a gradient penalty's loop): the pool copied such a grad into its slot with
    grad mode on, so the arena joined the graph (every step's graph kept alive through it) and
    ``model.zero_grad(set_to_none=False)`` raised (a view cannot be detached in place). The arena takes the values
    only; the run matches torch's."""
    model, twin, opt, plain = _flat_grads_twins(device)
    gen = torch.Generator().manual_seed(2)
    for _ in range(6):
        x, y = torch.randn(8, 6, generator=gen).to(device), torch.randn(8, 3, generator=gen).to(device)
        for m, o in ((model, opt), (twin, plain)):
            with warnings.catch_warnings():  # torch's warning (once a process) about the grad/param cycle
                warnings.simplefilter("ignore", UserWarning)
                torch.nn.functional.mse_loss(m(x), y).backward(create_graph=True)
            o.step()
            m.zero_grad(set_to_none=False)
    arena = model[0].weight.grad._base
    assert arena is not None and arena.grad_fn is None and not arena.requires_grad
    assert opt.plan.fused_tensors == 4
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_flat_grads_zero_grad_keeps_grads_even_with_set_to_none(device):
    params = make_params([10, 20], torch.float32, device)
    opt = KitsuneOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9), config=pooled(flat_grads=True))
    for p, g in zip(params, random_grads(params, 0), strict=True):
        p.grad = g
    opt.step()
    opt.zero_grad()  # set_to_none=True by default; flat grads are zeroed in place instead (documented)
    assert all(p.grad is not None and not p.grad.any() for p in params)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_flat_grads_of_a_partly_pooled_model_zero_grad_like_torch_outside_the_pool(device, set_to_none):
    """Grads in the arena are zeroed by its fill and kept; the grads of the units left outside the pool are set to
    None or zeroed in place as torch's zero_grad does."""
    # 4 units of 2 params, 64 fp32 elements each: 1536 B of state and step slots plus 512 B of grad slots per unit;
    # a 4200-byte pool holds two units
    params = make_params([64] * 8, torch.float32, device)
    opt = KitsuneOptimizer(
        torch.optim.AdamW(params, lr=0.1), config=pooled(pool_size=4200, flat_grads=True, max_fusion_size=2)
    )
    for step in range(3):
        for p, g in zip(params, random_grads(params, step), strict=True):
            if p.grad is None:
                p.grad = g
            else:
                p.grad.copy_(g)  # as backward accumulates into a zeroed grad
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        report = opt._subsystem("memory").report()
        assert report["params_pooled"] == 4 and report["params_outside_pool"] == 4
        assert all(p.grad is not None and not p.grad.any() for p in params[:4])  # arena views, zeroed
        for p in params[4:]:
            assert (p.grad is None) if set_to_none else (p.grad is not None and not p.grad.any())


@pytest.mark.cuda
def test_peak_memory_of_the_phase_is_no_higher_than_torch_fused():
    device = torch.device("cuda")
    sizes = [(768, 768)] * 12 + [(3072, 768)] * 8 + [768] * 24

    def peak(make_opt) -> int:
        torch.cuda.empty_cache()
        params = make_params(sizes, torch.float32, device)
        opt = make_opt(params)
        for step in range(3):
            for p, g in zip(params, random_grads(params, step), strict=True):
                p.grad = g
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            opt.step()
            opt.zero_grad(set_to_none=False)
            torch.cuda.synchronize()
        out = torch.cuda.max_memory_allocated() - base
        del opt, params
        return out

    torch_peak = peak(lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True))
    kitsune_peak = peak(lambda ps: KitsuneOptimizer(torch.optim.AdamW(ps, lr=1e-3), config=pooled()))
    assert kitsune_peak <= torch_peak, (kitsune_peak, torch_peak)


@pytest.mark.parametrize("flat_grads", [False, True], ids=["state", "flat_grads"])
def test_frozen_params_take_no_room_and_start_their_state_when_unfrozen(flat_grads, device):
    """A frozen backbone handed to the optimizer with the rest (``AdamW(model.parameters())``): torch gives it no
    state; the arena holds none for it (it would fill the arena, and every saved state dict, with zeros), and with
    flat grads no grad room either. Unfrozen mid-run, it trains as torch's, its state in tensors of its own."""
    make = lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05)  # noqa: E731
    sides = []
    for kitsune in (True, False):
        params = make_params([(60, 40), 40, (6, 5), 6], torch.float32, device)
        for p in params[:2]:
            p.requires_grad_(False)
        opt = KitsuneOptimizer(make(params), config=pooled(flat_grads=flat_grads)) if kitsune else make(params)
        for step in range(12):
            if step == 6:
                for p in params[:2]:
                    p.requires_grad_(True)
            for p, g in zip(params, random_grads(params, step), strict=True):
                p.grad = g if p.requires_grad else None
            opt.step()
            if kitsune and step == 5:
                assert len(opt.state) == 2
                reserved = opt._subsystem("memory").report()["bytes_per_device"][str(params[0].device)]["reserved"]
                assert reserved < 4 * 1024  # the trainable 36 elements' state, steps (grads); the frozen 2440 none
        sides.append((params, opt))
    (ours, opt), (ref, _) = sides
    assert opt.plan.fused_tensors == len(ours)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert [opt.state[p]["step"].item() for p in ours] == [6, 6, 12, 12]


def test_the_arenas_go_when_no_param_takes_the_fused_kernel(device):
    """``model.double()``: every param leaves the fused route (float64), its moments are converted into tensors of
    their own, and the old arenas are freed rather than held for the optimizer's lifetime."""
    import gc
    import weakref

    params = make_params(SIZES, torch.float32, device)
    opt = KitsuneOptimizer(torch.optim.AdamW(params, lr=1e-2), config=pooled())
    for step in range(3):
        for p, g in zip(params, random_grads(params, step), strict=True):
            p.grad = g
        opt.step()
    memory = opt._subsystem("memory")
    # the moments' arenas (the step counts stay float32 views, as torch keeps steps: their arena lives on in them)
    buffers = [weakref.ref(a.buffer) for key, a in memory._arenas.items() if "step" not in key and a.buffer is not None]
    assert buffers
    for p in params:
        p.data = p.data.double()
    for step in range(3, 6):
        for p, g in zip(params, random_grads(params, step), strict=True):
            p.grad = g.double()
        opt.step()
    gc.collect()
    assert opt.plan.fused_tensors == 0 and not memory.active
    assert memory.report()["bytes_per_device"] == {} and all(b() is None for b in buffers)
