"""ZeRO's edges: what changes after the partition was made, what every rank must agree on, and accumulation without
``accumulating()`` where only some ranks give a param a grad: 2 gloo CPU processes (one spawn for every case)
against one process.

A layer frozen when the state was partitioned sits in no bucket; unfrozen mid-run (on every rank) it needs one, or
each rank updates it with its own grad and the ranks drift apart. Clipping and float16 loss scaling each add an
all-reduce to the step: a rank built without them would leave the others waiting, so the plan refuses the mismatch.
Stage 1 re-reduces the running sum at each backward of an accumulation: a param that one rank has no grad for (yet)
must carry the average reduced so far, not zeros.
"""

from __future__ import annotations

import pytest
import torch
from ranks import run_ranks

STEPS = 5
UNFREEZE_AT = 2
ROWS = 8


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(300 + step)
    return torch.randn(ROWS, 6, generator=gen), torch.randn(ROWS, 3, generator=gen)


def _train(model, opt, rank: int, world: int) -> None:
    """``STEPS`` steps with the first layer frozen until step ``UNFREEZE_AT``, on this rank's share of each batch."""
    for step in range(STEPS):
        if step == UNFREEZE_AT:
            model[0].requires_grad_(True)
        x, y = _batch(step)
        lo, hi = rank * ROWS // world, (rank + 1) * ROWS // world
        torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]).backward()
        opt.step()
        opt.zero_grad()


def _unfrozen(rank: int, world: int, stage: int) -> list[torch.Tensor]:
    from kitsune import KitsuneOptimizer, ShardConfig

    model = _model()
    model[0].requires_grad_(False)
    base = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    opt = KitsuneOptimizer(base, enable_fusion=True, zero_stage=stage, shard_config=ShardConfig(stage=stage))
    _train(model, opt, rank, world)
    return [p.detach().clone() for p in model.parameters()]


def _train_full(model, opt, steps: int, clip: float | None = None) -> float | None:
    """``steps`` steps of one process on the whole of each batch, its grads clipped to ``clip`` (a 2-norm); the
    last step's norm before clipping."""
    norm = None
    for step in range(steps):
        x, y = _batch(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if clip is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        opt.zero_grad()
    return norm


def _mismatch(rank: int, kind: str) -> str | None:
    """Rank 0 alone clips (or scales the loss): the plan, at construction, refuses on every rank."""
    from kitsune import KitsuneOptimizer, ShardConfig

    extra = {}
    if rank == 0:
        extra = {"max_grad_norm": 1.0} if kind == "clip" else {"enable_amp": True}
    try:
        KitsuneOptimizer(
            torch.optim.AdamW(_model().parameters()), zero_stage=1, shard_config=ShardConfig(stage=1), **extra
        )
    except ValueError as e:
        return str(e)
    return None


class _Branchy(torch.nn.Module):
    """A body, and a side branch added on the rows a micro-step picks (none of a rank's rows: no grad there)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.body = torch.nn.Linear(6, 3)
        self.side = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        return torch.where(rows[:, None], out + self.side(x), out) if rows.any() else out


MICRO_ROWS = [  # micro-step -> the rows the side branch takes: the last rank's only, none, the first rank's only
    [ROWS - 1],
    [],
    [0, 1],
]


def _accumulate(model, opt, rank: int, world: int, steps: int = 2) -> None:
    for step in range(steps):
        for micro, picked in enumerate(MICRO_ROWS):
            x, y = _batch(10 * step + micro)
            rows = torch.zeros(ROWS, dtype=torch.bool)
            rows[picked] = True
            lo, hi = rank * ROWS // world, (rank + 1) * ROWS // world
            loss = torch.nn.functional.mse_loss(model(x[lo:hi], rows[lo:hi]), y[lo:hi]) / len(MICRO_ROWS)
            loss.backward()
        opt.step()
        opt.zero_grad()


def _accumulated(rank: int, world: int, stage: int) -> list[torch.Tensor]:
    from kitsune import KitsuneOptimizer, ShardConfig

    model = _Branchy()
    base = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    opt = KitsuneOptimizer(base, zero_stage=stage, shard_config=ShardConfig(stage=stage, bucket_bytes=64))
    _accumulate(model, opt, rank, world)
    return [p.detach().clone() for p in model.parameters()]


def _refusals(rank: int, world: int) -> dict:
    """What a sharded optimizer refuses, and that it still steps after: a copy or a pickle, a group repeating a param
    (torch's own check sees the groups' shards, not the params), LBFGS."""
    import copy
    import io

    from kitsune import KitsuneOptimizer, ShardConfig

    def error(fn) -> str | None:
        try:
            fn()
        except (TypeError, ValueError) as e:
            return f"{type(e).__name__}: {e}"
        return None

    model = _model()
    opt = KitsuneOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), zero_stage=1, shard_config=ShardConfig(stage=1)
    )
    _train(model, opt, rank, world)  # the first layer trains from step 2 on, as above
    out = {
        "deepcopy": error(lambda: copy.deepcopy(opt)),
        "pickle": error(lambda: torch.save(opt, io.BytesIO())),
        "duplicate": error(lambda: opt.add_param_group({"params": [model[2].bias], "lr": 1e-3})),
        "groups": len(opt.param_groups),
        "lbfgs": error(
            lambda: KitsuneOptimizer(
                torch.optim.LBFGS(_model().parameters()), zero_stage=1, shard_config=ShardConfig(stage=1)
            )
        ),
    }
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _batch(99)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    out["steps_after"] = all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    return out


def _cast_for_a_backward(model, opt, rank: int, world: int) -> list[torch.Tensor]:
    """Two steps, then ``model.half()`` for one backward, cast back (``model.float()``, which casts the grads too)
    before its step, then two more steps; this rank's share of each batch."""
    for step in range(5):
        if step == 2:
            model.half()
        x, y = _batch(step)
        lo, hi = rank * ROWS // world, (rank + 1) * ROWS // world
        x, y = x[lo:hi].to(model[0].weight.dtype), y[lo:hi].to(model[0].weight.dtype)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if step == 2:
            model.float()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _sharded_sgd(model: torch.nn.Module, stage: int):
    """SGD with momentum over ``model``, fused and sharded at ZeRO ``stage``."""
    from kitsune import KitsuneOptimizer, ShardConfig

    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return KitsuneOptimizer(base, enable_fusion=True, zero_stage=stage, shard_config=ShardConfig(stage=stage))


def _one_process(run) -> list[torch.Tensor]:
    """``run(model, optimizer, rank=0, world=1)`` with torch's SGD with momentum, as `_sharded_sgd` sets it."""
    model = _model()
    return run(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), 0, 1)


def _cast(rank: int, world: int, stage: int) -> list[torch.Tensor]:
    model = _model()
    return _cast_for_a_backward(model, _sharded_sgd(model, stage), rank, world)


def _state_through_a_cast(rank: int, world: int, stage: int) -> dict:
    """Three AdamW steps, ``model.half()``, a backward, then ``add_param_group`` (a re-partition between backward
    and step); cast back, and a step: the state each rank holds, and its step counts."""
    from kitsune import KitsuneOptimizer, ShardConfig

    model = _model()
    base = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    opt = KitsuneOptimizer(base, enable_fusion=True, zero_stage=stage, shard_config=ShardConfig(stage=stage))
    for step in range(3):
        x, y = _batch(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    before = len(opt.state)
    model.half()
    x, y = _batch(3)
    torch.nn.functional.mse_loss(model(x.half()), y.half()).backward()
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))], "lr": 0.0})
    kept = len(opt.state)
    model.float()
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    counts = sorted({float(st["step"]) for st in opt.state.values() if "step" in st and st["step"].numel() == 1})
    return {"before": before, "kept": kept, "counts": counts}


def _switch_back(rank: int, world: int, stage: int) -> dict:
    """AdamW: ``amsgrad`` turned on over state without ``max_exp_avg_sq`` (torch's step raises KeyError), then off
    again: torch's next steps run; the sharded step kept raising."""
    from kitsune import KitsuneOptimizer, ShardConfig

    model = _model()
    base = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = KitsuneOptimizer(base, enable_fusion=True, zero_stage=stage, shard_config=ShardConfig(stage=stage))
    errors = _amsgrad_on_and_off(model, opt, rank, world)
    return {"errors": errors, "params": [p.detach().clone() for p in model.parameters()]}


def _amsgrad_on_and_off(model, opt, rank: int, world: int) -> list[str | None]:
    errors: list[str | None] = []
    for step in range(5):
        opt.param_groups[0]["amsgrad"] = step == 2
        x, y = _batch(step)
        lo, hi = rank * ROWS // world, (rank + 1) * ROWS // world
        torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]).backward()
        try:
            opt.step()
            errors.append(None)
        except KeyError as e:
            errors.append(f"KeyError: {e}")
        opt.zero_grad()
    return errors


def _grads_through_a_refusal(rank: int, world: int, stage: int, clip: bool = False) -> dict:
    """Two AdamW steps; at the third, ``amsgrad`` turned on over state without ``max_exp_avg_sq``: the step raises
    (torch's KeyError) and leaves every param's grad as it found it (the same tensor, the same values, or None); with
    ``amsgrad`` off again the step runs on those grads. The refused step used to point the grads at this rank's share:
    stage 1 left the grads of what other ranks update None, stage 2 gave the params this rank updates its shard.
    ``clip``: clipped to 0.05 in the step, whose wrapped (unfused) step raises after the clip, which stays (a pass of
    the grads' own, as without ZeRO): the retry does not clip the clipped grads again."""
    from kitsune import KitsuneOptimizer, ShardConfig

    model = _model()
    base = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = KitsuneOptimizer(
        base,
        enable_fusion=not clip,
        max_grad_norm=0.05 if clip else None,
        zero_stage=stage,
        shard_config=ShardConfig(stage=stage),
    )
    out: dict = {}
    for step in range(3):
        x, y = _batch(step)
        lo, hi = rank * ROWS // world, (rank + 1) * ROWS // world
        torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]).backward()
        if step == 2:
            opt.param_groups[0]["amsgrad"] = True
            before = [(p.grad, None if p.grad is None else p.grad.clone()) for p in model.parameters()]
            try:
                opt.step()
            except KeyError as e:
                out["error"] = f"KeyError: {e}"
            out["same"] = [p.grad is g for p, (g, _) in zip(model.parameters(), before, strict=True)]
            out["values"] = [g is None or torch.equal(g, v) for g, v in before]
            out["had_grads"] = [g is not None for g, _ in before]
            opt.param_groups[0]["amsgrad"] = False
        opt.step()
        opt.zero_grad()
    out["norm"] = None if opt.last_grad_norm is None else float(opt.last_grad_norm)
    out["params"] = [p.detach().clone() for p in model.parameters()]
    return out


def _grad_dtype(rank: int, world: int, stage: int) -> str | None:
    """bfloat16 params given float32 grads (``p.grad_dtype``) under ZeRO: the bucket's reduction refuses, naming
    it (stage 2 rounded the grads into the bucket and then raised torch's bare assignment error)."""
    from kitsune import KitsuneOptimizer, ShardConfig

    model = _model().bfloat16()
    base = torch.optim.AdamW(model.parameters())
    opt = KitsuneOptimizer(base, zero_stage=stage, shard_config=ShardConfig(stage=stage))
    for p in model.parameters():
        p.grad_dtype = torch.float32
    x, y = _batch(0)
    try:
        torch.nn.functional.mse_loss(model(x.bfloat16()), y.bfloat16()).backward()
        opt.step()
    except RuntimeError as e:
        return str(e)
    return None


class _Fails(torch.autograd.Function):
    """Identity forward; its backward raises, as an out-of-memory error in an earlier layer's backward does."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("out of memory (simulated)")


def _skip_a_failed_backward(model, opt, rank: int, world: int) -> list[torch.Tensor]:
    """Five batches; the third one's backward raises after the last layer's grads came in, and the loop skips it
    (``zero_grad()``), as a loop that survives an out-of-memory error does; this rank's share of each batch."""
    for step in range(5):
        x, y = _batch(step)
        lo, hi = rank * ROWS // world, (rank + 1) * ROWS // world
        x, y = x[lo:hi], y[lo:hi]
        if step == 2:
            out = model[2](model[1](_Fails.apply(model[0](x))))
            try:
                torch.nn.functional.mse_loss(out, y).backward()
            except RuntimeError:
                pass
            opt.zero_grad()
            continue
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _failed_backward(rank: int, world: int, stage: int) -> list[torch.Tensor]:
    model = _model()
    return _skip_a_failed_backward(model, _sharded_sgd(model, stage), rank, world)


def _uncompilable(rank: int, world: int, stage: int) -> dict:
    """A fused kernel that fails to compile: a rank cannot move its params to torch's route alone (its peers would
    wait in collectives it no longer runs), so the step raises, with nothing changed, on every rank that met it."""
    from twins import Uncompilable

    from kitsune.kernels import update

    real = update._update_kernel

    update._update_kernel = Uncompilable(real)
    try:
        model = _model()
        opt = _sharded_sgd(model, stage)
        before = [p.detach().clone() for p in model.parameters()]
        x, y = _batch(0)
        lo, hi = rank * ROWS // world, (rank + 1) * ROWS // world
        torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]).backward()
        errors = []
        for _ in range(2):  # and again: no rank records a refusal of its own
            try:
                opt.step()
            except RuntimeError as exc:
                errors.append(str(exc))
        unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
        return {"errors": errors, "unchanged": unchanged, "routes": sorted({b.route.value for b in opt.plan.buckets})}
    finally:
        update._update_kernel = real


def _cases(rank: int, world: int) -> dict:
    return {
        "refusals": _refusals(rank, world),
        "accumulated_1": _accumulated(rank, world, 1),
        "accumulated_2": _accumulated(rank, world, 2),
        "unfrozen_1": _unfrozen(rank, world, 1),
        "unfrozen_2": _unfrozen(rank, world, 2),
        "clip": _mismatch(rank, "clip"),
        "amp": _mismatch(rank, "amp"),
        **{f"cast_{stage}": _cast(rank, world, stage) for stage in (1, 2)},
        **{f"state_cast_{stage}": _state_through_a_cast(rank, world, stage) for stage in (1, 2)},
        **{f"switch_{stage}": _switch_back(rank, world, stage) for stage in (1, 2)},
        **{f"grad_dtype_{stage}": _grad_dtype(rank, world, stage) for stage in (1, 2)},
        **{f"refused_{stage}": _grads_through_a_refusal(rank, world, stage) for stage in (1, 2)},
        **{f"refused_clip_{stage}": _grads_through_a_refusal(rank, world, stage, clip=True) for stage in (1, 2)},
        **{f"failed_backward_{stage}": _failed_backward(rank, world, stage) for stage in (1, 2)},
        **{f"uncompilable_{stage}": _uncompilable(rank, world, stage) for stage in (1, 2)},
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_cases, world=2, timeout_s=180)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_layer_unfrozen_mid_run_is_partitioned_and_trains_as_one_process(ranks, stage):
    model = _model()
    model[0].requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _train(model, opt, 0, 1)
    assert not torch.equal(model[0].weight, _model()[0].weight)  # the unfrozen layer moved
    for rank in ranks:
        for got, want in zip(rank[f"unfrozen_{stage}"], model.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach(), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize(("kind", "setting"), [("clip", "max_grad_norm set"), ("amp", "float16 loss scaling")])
def test_ranks_that_differ_in_a_setting_that_adds_a_collective_are_refused(ranks, kind, setting):
    for rank, other in ((0, 1), (1, 0)):
        error = ranks[rank][kind]
        assert error is not None and f"rank {other}'s ShardConfig or optimizer differs" in error, error
        assert setting in error


@pytest.mark.parametrize("stage", [1, 2])
def test_a_kernel_that_fails_to_compile_under_sharding_raises_on_each_rank_with_nothing_changed(ranks, stage):
    for rank in ranks:
        got = rank[f"uncompilable_{stage}"]
        assert len(got["errors"]) == 2 and got["unchanged"], got
        for error in got["errors"]:
            assert "failed to compile on this rank" in error and "enable_fusion=False" in error
        assert got["routes"] == ["triton"]  # no rank moved to torch's route alone


@pytest.mark.parametrize("stage", [1, 2])
def test_accumulation_where_some_ranks_have_no_grad_averages_as_one_process(ranks, stage):
    """Micro-steps without ``accumulating()``: the side branch has a grad on the last rank only, then on none, then
    on the first only. Stage 1's re-reductions kept, before, zeros for a rank without a grad: half the side
    branch's update."""
    model = _Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    _accumulate(model, opt, 0, 1)
    assert not torch.equal(model.side.weight, _Branchy().side.weight)
    for rank in ranks:
        for got, want in zip(rank[f"accumulated_{stage}"], model.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach(), atol=2e-6, rtol=2e-5)


def test_a_sharded_optimizer_refuses_copies_duplicate_params_and_lbfgs_and_steps_on(ranks):
    for rank in ranks:
        got = rank["refusals"]
        for how in ("deepcopy", "pickle"):
            assert got[how] is not None and got[how].startswith("TypeError: a KitsuneOptimizer with ZeRO-sharded")
            assert "consolidated_state_dict(optimizer)" in got[how]
        assert got["duplicate"] == "ValueError: some parameters appear in more than one parameter group"
        assert got["groups"] == 1
        assert got["lbfgs"] is not None and got["lbfgs"].startswith("ValueError: LBFGS under ShardConfig(stage=1)")
        assert got["steps_after"]


@pytest.mark.parametrize("stage", [1, 2])
def test_a_model_cast_for_one_backward_and_back_trains_as_one_process(ranks, stage):
    """``model.half()`` for one backward, cast back before its step: the buckets, laid out in float32, met float16
    params. Stage 1's end of backward raised assigning the float32 averages to the float16 params and, asked again,
    added the grads twice; now a bucket that meets a cast param starts no reduction, and the step lays the buckets
    out again and reduces there: torch's SGD with momentum over the whole batch, step for step."""
    want = _one_process(_cast_for_a_backward)
    for rank in ranks:
        # (float16 grads of half a batch, averaged, round apart from the whole batch's: a grad added twice is off by
        # lr times the grad, some 1e-2)
        for got, w in zip(rank[f"cast_{stage}"], want, strict=True):
            torch.testing.assert_close(got, w, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_repartition_after_a_cast_keeps_the_state(ranks, stage):
    """A re-partition between backward and step after ``model.half()`` (``add_param_group`` here; an unfrozen layer
    or ``load_state_dict`` alike) took every rank's state out of the groups and then raised putting the float32
    averaged grads back into the float16 params: the state was lost, and the next step after a cast back started
    Adam over from step 1. The state stays: its step counts go on."""
    for rank in ranks:
        got = rank[f"state_cast_{stage}"]
        assert got["before"] > 0 or got["kept"] > 0  # (a rank's share moves with the new layout)
        assert got["counts"] == [4.0], got


@pytest.mark.parametrize("stage", [1, 2])
def test_a_switch_turned_back_off_after_its_step_raised_steps_on_as_torch(ranks, stage):
    """``amsgrad`` turned on over state without ``max_exp_avg_sq``: torch's step raises KeyError; turned off again,
    its next steps run. The sharded step checked the units of the plan made for amsgrad before planning again, and
    raised on every later step."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    errors = _amsgrad_on_and_off(model, opt, 0, 1)
    assert errors[2] is not None and errors.count(None) == 4
    for rank in ranks:
        got = rank[f"switch_{stage}"]
        assert got["errors"] == errors
        for a, b in zip(got["params"], model.parameters(), strict=True):
            torch.testing.assert_close(a, b.detach(), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("clip", [False, True], ids=["fused", "clipped"])
@pytest.mark.parametrize("stage", [1, 2])
def test_a_refused_step_leaves_every_grad_as_it_found_it(ranks, stage, clip):
    """A step refused after the grads were reduced (a state missing a key the optimizer reads) points no grad
    elsewhere: each param keeps the grad it had after backward (stage 1: the averaged view; stage 2: None, the bucket
    holds it), and the same step then runs as one process's (clipped once, where the step clips)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    norm = _train_full(model, opt, 3, clip=0.05 if clip else None)
    for rank in ranks:
        got = rank[f"refused_clip_{stage}" if clip else f"refused_{stage}"]
        if clip:  # the norm of the grads as backward left them, not of the grads the refused step clipped
            assert got["norm"] == pytest.approx(norm, rel=1e-5), (got["norm"], norm)
        assert got["error"] is not None and "max_exp_avg_sq" in got["error"], got["error"]
        assert all(got["same"]), got["same"]
        assert all(got["values"]) != (clip and stage == 1), got["values"]  # stage 2's clipped grads are in no param
        assert any(got["had_grads"]) == (stage == 1)
        for a, b in zip(got["params"], model.parameters(), strict=True):
            torch.testing.assert_close(a, b.detach(), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("stage", [1, 2])
def test_grads_of_another_dtype_than_the_params_are_refused_naming_grad_dtype(ranks, stage):
    """ZeRO reduces the grads in buckets of the params' dtype: float32 grads of bfloat16 params cannot be the grads
    the averaged bucket gives back, and the refusal names ``p.grad_dtype`` (it used to be torch's bare assignment
    error, and stage 2 rounded the grads into the bucket first)."""
    for rank in ranks:
        got = rank[f"grad_dtype_{stage}"]
        assert got is not None and "p.grad_dtype = None under ZeRO" in got, rank


@pytest.mark.parametrize("stage", [1, 2])
def test_a_backward_that_raised_midway_is_skipped_as_one_process_skips_it(ranks, stage):
    """A backward that raises after some buckets' reductions started (an out-of-memory error), then ``zero_grad()``
    and the next batch: the failed backward's end callback never ran, and stage 1's next backward began at the bucket
    after its last launch and queued no end callback (its params ended 2e-2 off). The run goes on as one process's
    that never saw that batch."""
    want = _one_process(_skip_a_failed_backward)
    for rank in ranks:
        for got, w in zip(rank[f"failed_backward_{stage}"], want, strict=True):
            torch.testing.assert_close(got, w, atol=2e-6, rtol=2e-5)
