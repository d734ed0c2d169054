"""bf16 params trained without fp32 master weights: ``FusionConfig(param_rounding="stochastic")``.

The update is computed in fp32 as always; only the store into the bf16 param rounds up or down at random, with the
probabilities that make its expectation the fp32 result. Checked here: that expectation (on many elements whose
update is a fraction of a bf16 step, where rounding to nearest would never move them), reproducibility from the
seed, the plan, and a small model trained with bf16 params against fp32 params.
"""

from __future__ import annotations

import math

import pytest
import torch

from kitsune import FusionConfig, KitsuneOptimizer
from kitsune.fusion import Route
from kitsune.optim import Lion


def _opt(params, make=None, rounding="stochastic", seed=0, **kwargs):
    make = make or (lambda ps: torch.optim.SGD(ps, lr=1.0))
    config = FusionConfig(param_rounding=rounding, rounding_seed=seed)
    return KitsuneOptimizer(make(params), enable_fusion=True, fusion_config=config, **kwargs)


@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.5, 0.9])
def test_expected_value_of_the_stored_param_is_the_fp32_result(fraction, device):
    """SGD, lr 1: p - g with g a fraction of p's bf16 step. Nearest rounding never moves p (fraction < 0.5); the
    stochastic store moves each element down one step with probability ``fraction``: the mean over 2**16 elements is
    within 5 standard deviations of the fp32 result."""
    n = 1 << 16
    base = torch.full((n,), 1.0, dtype=torch.bfloat16, device=device)
    ulp = 2.0**-7  # bf16's step just below 1.0 is 2**-8, above it 2**-7: p = 1.0 moves down into [0.5, 1)
    step_down = 2.0**-8
    g = torch.full((n,), fraction * step_down, dtype=torch.float32)
    for rounding, want in (("nearest", 1.0 - (step_down if fraction > 0.5 else 0.0)), ("stochastic", None)):
        p = torch.nn.Parameter(base.clone())
        opt = _opt([p], rounding=rounding)
        p.grad = g.to(torch.bfloat16).to(device)  # fractions of 2**-8 are exact in bf16
        opt.step()
        assert opt.plan.buckets[0].route is Route.TRITON
        values = p.detach().float().cpu()
        assert set(values.unique().tolist()) <= {1.0, 1.0 - step_down}, values.unique()
        if want is not None:
            assert (values == want).all()
            continue
        moved = (values < 1.0).double().mean().item()
        sigma = math.sqrt(fraction * (1 - fraction) / n)
        assert abs(moved - fraction) < 5 * sigma, (moved, fraction)
        assert "stochastic rounding" in opt.plan.buckets[0].options
    assert ulp > step_down


def test_the_same_seed_gives_the_same_bits_and_another_seed_others(device):
    def run(seed):
        gen = torch.Generator().manual_seed(0)
        p = torch.nn.Parameter(torch.randn(5000, generator=gen).to(torch.bfloat16).to(device))
        opt = _opt([p], make=lambda ps: torch.optim.AdamW(ps, lr=1e-3), seed=seed)
        for _ in range(5):
            p.grad = (torch.randn(5000, generator=gen) * 0.1).to(torch.bfloat16).to(device)
            opt.step()
        return p.detach().clone()

    a, b, c = run(0), run(0), run(1)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert (a.float() - c.float()).abs().max().item() <= 2 * 2.0**-7 * a.float().abs().max().item()


@pytest.mark.parametrize(
    ("make", "replan"),
    [
        (lambda ps: torch.optim.SGD(ps, lr=1.0), "state_read"),
        (lambda ps: torch.optim.SGD(ps, lr=1.0), "group_added"),
        (lambda ps: Lion(ps, lr=1e-3), "group_added"),
    ],
    ids=["sgd_state_read", "sgd_group_added", "lion_group_added"],
)
def test_a_plan_made_again_mid_run_keeps_the_rounding_stream(make, replan, device):
    """SGD and Lion keep no step in torch's state: the fused unit counts each param's steps privately, and the
    stochastic rounding takes that count as its stream. A plan made again mid-run (``optimizer.state[p]`` read for a
    param without state adds an empty entry to torch's defaultdict; a group added) built new units whose counts
    started again, so the run drew the same bits again and parted from the run without it. The new units go on
    counting where the old ones stood: bit for bit as the run without it."""

    def run(with_replan):
        gen = torch.Generator().manual_seed(1)
        p = torch.nn.Parameter((1 + torch.rand(4096, generator=gen)).to(torch.bfloat16).to(device))
        opt = _opt([p], make=make)
        version = opt.plan
        for step in range(6):
            p.grad = (torch.randn(4096, generator=gen) * 2**-9).to(torch.bfloat16).to(device)
            opt.step()
            if with_replan and step == 2:
                if replan == "state_read":
                    opt.state[p]  # noqa: B018 (the read is the point)
                else:
                    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3, device=device))]})
        assert opt.plan.buckets[0].route is Route.TRITON and "stochastic rounding" in opt.plan.buckets[0].options
        replanned = opt.plan is not version
        return p.detach().clone(), replanned

    kept, replanned = run(False)
    moved, replanned_too = run(True)
    assert not replanned and replanned_too  # the scenario did plan again
    assert torch.equal(kept, moved)


@pytest.mark.parametrize("how", ["checkpoint", "deepcopy", "pickle"])
@pytest.mark.parametrize(
    "make", [lambda ps: torch.optim.SGD(ps, lr=1.0), lambda ps: Lion(ps, lr=1e-3)], ids=["sgd", "lion"]
)
def test_a_resumed_or_copied_run_draws_the_uninterrupted_runs_bits(make, how, device):
    """The step counts kitsune keeps for SGD's and Lion's stochastic rounding (torch's state holds none) are in the
    checkpoint's kitsune entry (through ``torch.load``'s default ``weights_only``) and in copies: the resumed run,
    or the copy, goes on bit for bit as the run that never stopped. They were not, and such a run drew its first
    steps' bits again."""
    import copy
    import io
    import pickle

    gen = torch.Generator().manual_seed(1)
    p = torch.nn.Parameter((1 + torch.rand(4096, generator=gen)).to(torch.bfloat16).to(device))
    grads = [(torch.randn(4096, generator=gen) * 2**-9).to(torch.bfloat16).to(device) for _ in range(7)]
    opt = _opt([p], make=make, seed=3)
    for g in grads[:3]:
        p.grad = g.clone()
        opt.step()
    if how == "checkpoint":
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        buf.seek(0)
        q = torch.nn.Parameter(p.detach().clone())
        other = _opt([q], make=make, seed=3)
        other.load_state_dict(torch.load(buf))
    else:
        q, other = copy.deepcopy((p, opt)) if how == "deepcopy" else pickle.loads(pickle.dumps((p, opt)))
    assert opt.state_dict()["kitsune"]["subsystems"]["fusion"]["rounding_steps"]
    for g in grads[3:]:
        for param, o in ((p, opt), (q, other)):
            param.grad = g.clone()
            o.step()
    assert other.plan.buckets[0].route is Route.TRITON and "stochastic rounding" in other.plan.buckets[0].options
    assert torch.equal(p, q)


def test_rounding_steps_that_are_no_counts_load_nothing(device):
    """A kitsune entry whose rounding step counts name no param of the optimizer, or are no counts: refused before
    anything changes."""
    p = torch.nn.Parameter(torch.rand(64).to(torch.bfloat16).to(device))
    opt = _opt([p])
    p.grad = torch.rand_like(p)
    opt.step()
    for spoiled in ({5: 1.0}, {0: -1.0}, {0: "3"}, [1.0]):
        sd = opt.state_dict()
        sd["kitsune"]["subsystems"]["fusion"]["rounding_steps"] = spoiled
        sd["param_groups"][0]["lr"] = 0.5
        with pytest.raises(ValueError, match="rounding_steps"):
            opt.load_state_dict(sd)
        assert opt.param_groups[0]["lr"] == 1.0


def test_plan_and_dtypes(device):
    params = [
        torch.nn.Parameter(torch.randn(64, device=device, dtype=torch.bfloat16)),
        torch.nn.Parameter(torch.randn(64, device=device, dtype=torch.float16)),
        torch.nn.Parameter(torch.randn(64, device=device)),
    ]
    opt = _opt(params, make=lambda ps: Lion(ps, lr=1e-3))  # Lion keeps no step: kitsune counts privately
    by_dtype = {b.dtype: b for b in opt.plan.buckets}
    assert "stochastic rounding" in by_dtype["bfloat16"].options
    assert "stochastic rounding" not in by_dtype["float16"].options
    assert any("float16 params round to nearest" in n for n in by_dtype["float16"].notes)
    assert "stochastic rounding" not in by_dtype["float32"].options and not by_dtype["float32"].notes
    for p in params:
        p.grad = torch.randn_like(p)
    before = [p.detach().clone() for p in params]
    opt.step()
    opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(params, before, strict=True))


@pytest.mark.slow  # a long run (minutes in the CPU interpreter): `make test-all` and the GPU check
def test_bf16_params_with_stochastic_rounding_train_like_fp32_params(device):
    """A least-squares fit with AdamW (lr 2e-2, 500 steps). With bf16 params rounded to nearest, updates under half
    a bf16 step are lost and the loss stalls far above fp32's; rounded stochastically, the run reaches the level
    fp32 params reach, up to the bf16 representation of the fitted weights (a few times the noise floor of 1e-4).
    The GPT-2 small comparison of final losses is in docs/benchmarks.md."""
    gen = torch.Generator().manual_seed(0)
    w_true = torch.randn(32, 8, generator=gen)
    x = torch.randn(512, 32, generator=gen)
    y = x @ w_true + 0.01 * torch.randn(512, 8, generator=gen)
    w0 = torch.randn(32, 8, generator=gen) * 0.1
    losses = {}
    for name, dtype, rounding in (
        ("fp32", torch.float32, "nearest"),
        ("bf16", torch.bfloat16, "nearest"),
        ("bf16_sr", torch.bfloat16, "stochastic"),
    ):
        w = torch.nn.Parameter(w0.clone().to(device=device, dtype=dtype))
        opt = _opt([w], make=lambda ps: torch.optim.AdamW(ps, lr=2e-2, weight_decay=0.0), rounding=rounding)
        xd, yd = x.to(device), y.to(device)
        for _ in range(500):
            loss = ((xd @ w.float() - yd) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses[name] = ((xd @ w.detach().float() - yd) ** 2).mean().item()
    assert losses["fp32"] < 2e-4, losses  # the noise floor: 0.01 ** 2
    assert losses["bf16_sr"] < 5 * losses["fp32"], losses
    assert losses["bf16"] > 100 * losses["fp32"], losses  # nearest rounding stalls: the test can tell them apart


def _muon_step(p0: torch.Tensor, grad: torch.Tensor, dtype: torch.dtype, rounding: str, seed: int = 0, steps: int = 1):
    p = torch.nn.Parameter(p0.to(dtype, copy=True))
    base = torch.optim.Muon([p], lr=0.005, weight_decay=0.0, momentum=0.0, nesterov=False)
    opt = KitsuneOptimizer(
        base, enable_fusion=True, fusion_config=FusionConfig(param_rounding=rounding, rounding_seed=seed)
    )
    for _ in range(steps):
        p.grad = grad.to(dtype)
        opt.step()
    return p.detach().float(), opt


def test_muon_stores_bf16_params_with_stochastic_rounding_unbiased(device):
    """Muon (no momentum, so the Newton-Schulz input is the bf16 grad whatever the param's dtype) on a 64 x 64 bf16
    matrix in [1, 2), whose update is about a tenth of a bf16 step: rounded to nearest nothing moves; stored with
    stochastic rounding, the elements' sum of (stored - fp32 result) is within 5 standard deviations of zero, the
    same seed gives the same bits and the next step draws new ones."""
    gen = torch.Generator().manual_seed(3)
    p0 = (1.0 + torch.rand(64, 64, generator=gen)).to(torch.bfloat16).float().to(device)
    grad = torch.randn(64, 64, generator=gen).to(torch.bfloat16).float().to(device)
    want, _ = _muon_step(p0, grad, torch.float32, "nearest")
    nearest, _ = _muon_step(p0, grad, torch.bfloat16, "nearest")
    assert torch.equal(nearest, p0)  # every update under half a bf16 step
    got, opt = _muon_step(p0, grad, torch.bfloat16, "stochastic")
    (bucket,) = opt.plan.buckets
    assert bucket.route is Route.TRITON_MATMUL and "stochastic rounding" in bucket.options
    ulp = 2.0**-7  # bf16's step in [1, 2): the elements whose result stays a step inside it
    inside = (want > 1.0 + ulp) & (want < 2.0 - ulp)
    exact, stored = want[inside], got[inside]
    down = torch.floor((exact - 1.0) / ulp) * ulp + 1.0
    q = (exact - down) / ulp  # the probability of rounding up
    assert inside.float().mean() > 0.9 and set(((stored - down) / ulp).round().unique().tolist()) <= {0.0, 1.0}
    assert 0.05 < float(q.mean()) < 0.95  # the updates are fractions of a step: a real test of the expectation
    z = float((stored - exact).sum()) / (ulp * math.sqrt(float((q * (1 - q)).sum())))
    assert abs(z) < 5, z
    again, _ = _muon_step(p0, grad, torch.bfloat16, "stochastic")
    other, _ = _muon_step(p0, grad, torch.bfloat16, "stochastic", seed=1)
    assert torch.equal(again, got) and not torch.equal(other, got)
    twice, opt2 = _muon_step(p0, grad, torch.bfloat16, "stochastic", steps=2)
    assert float(opt2._subsystem("fusion").launch_units[0]._count) == 2  # the stream advances every step
