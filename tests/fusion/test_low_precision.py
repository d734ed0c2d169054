"""Low-precision optimizer state (``FusionConfig.state_precision``): 8-bit and bf16 state in the fused kernels.

The reference is torch's own optimizer on float64 copies of the params, its state rounded to the format after every
step (bf16: to the nearest bf16; 8 bits: `state_format.quantize` then `dequantize`, the definition in plain torch).
That is the fused kernels' contract: math in fp32 on the decoded state, the update from the fresh values, the state
stored in the format. The kernels compute in fp32, the reference in float64, so a value within an fp32 rounding of
a boundary between two codes may land on the other code; the tolerances allow that, and only that (a one-code slip
moves a state element by at most the table's largest gap times its block's absmax).
"""

from __future__ import annotations

import copy
import math
import threading

import pytest
import torch

import kitsune
from kitsune import FusionConfig, KitsuneOptimizer
from kitsune.fusion import Route
from kitsune.fusion import state_format as sf
from kitsune.kernels.codes import CODES_ALIGN, MIN_SCALE, QUANT_BLOCK, dynamic_map
from kitsune.optim import Lion

SIZES = [(24, 40), 700, 300, 5]  # several quantization blocks, a partial one, and one under any min size
CASES = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adam_amsgrad_l2_maximize": lambda ps: torch.optim.Adam(
        [{"params": ps[:2], "amsgrad": True, "weight_decay": 0.1}, {"params": ps[2:], "maximize": True}], lr=1e-2
    ),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, initial_accumulator_value=0.1),
    "rmsprop_momentum": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, weight_decay=1e-2),
    "nadam_decoupled": lambda ps: torch.optim.NAdam(ps, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0),
    "lion": lambda ps: Lion(ps, lr=1e-3, weight_decay=0.1),
}
STEPS = 20
STATE_STEPS = 3
"""Steps of a run whose point is the state it leaves (a state dict to load, convert or corrupt, or two layouts to
compare bit for bit), not its trajectory: enough for every state slot to hold values of its own."""


def _params(seed: int = 0, sizes=SIZES) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in sizes]


def _grads(step: int, sizes=SIZES) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    # a spread of magnitudes, so blocks hold values across several decades of the code
    return [torch.randn(s, generator=gen) * torch.rand(s, generator=gen).pow(3) * 2.0 for s in sizes]


def _round(t: torch.Tensor, key: str, precision: str) -> torch.Tensor:
    if precision == "bf16":
        return t.to(torch.bfloat16).to(t.dtype)
    return sf.dequantize(*sf.quantize(t.float(), sf.SIGNED[key]), sf.SIGNED[key]).to(t.dtype)


def _reference(make, precision: str, min_size: int, device, sizes=SIZES):
    params = [torch.nn.Parameter(p.detach().double().to(device)) for p in _params(sizes=sizes)]
    opt = make(params)

    def round_state():
        with torch.no_grad():
            for p in params:
                for key, t in opt.state.get(p, {}).items():
                    if key in sf.SIGNED and t.numel() >= min_size:
                        t.copy_(_round(t, key, precision))

    round_state()  # Adagrad builds its state in __init__: kitsune converts it as it binds
    for step in range(STEPS):
        for p, g in zip(params, _grads(step, sizes), strict=True):
            p.grad = g.double().to(device)
        opt.step()
        round_state()
    return params, opt


def _fused(make, precision: str, min_size: int, device, sizes=SIZES, params=None, steps=STEPS, **kwargs):
    if params is None:
        params = [torch.nn.Parameter(p.detach().to(device)) for p in _params(sizes=sizes)]
    config = FusionConfig(state_precision=precision, min_8bit_size=min_size)
    opt = KitsuneOptimizer(make(params), enable_fusion=True, fusion_config=config, **kwargs)
    for step in range(steps):
        for p, g in zip(params, _grads(step, sizes), strict=True):
            p.grad = g.to(device)
        opt.step()
    return params, opt


def _assert_same_bits(one, opt_one, two, opt_two) -> None:
    """Two runs' params and every state tensor (the same keys) are the same bits."""
    for p, q in zip(one, two, strict=True):
        assert torch.equal(p, q)
        assert sorted(opt_one.state[p]) == sorted(opt_two.state[q])
        for key, t in opt_one.state[p].items():
            assert torch.equal(t, opt_two.state[q][key]), key


@pytest.mark.parametrize("name", ["adamw", "nadam_decoupled"])
def test_8bit_programs_of_any_size_step_the_same_bits(name, device, monkeypatch):
    """An 8-bit program quantizes its blocks one at a time in a loop over the tiles that hold elements
    (`planner.Q8_PROGRAM` elements a program). With programs of two blocks, so that a tensor spans several programs
    and a program's last tile or whole second tile may be empty, the params, codes, scales and step counts are the
    same bits as with one program a tensor; NAdam's per-tensor mu_product, written by a tensor's last program, too."""
    from kitsune.fusion import planner

    runs = []
    for block in (planner.Q8_PROGRAM, 2 * QUANT_BLOCK):
        monkeypatch.setattr(planner, "Q8_PROGRAM", block)
        params, opt = _fused(CASES[name], "8bit", 64, device, steps=10)
        assert all(b.route is Route.TRITON for b in opt.plan.buckets), opt.plan.to_dict()
        assert "8-bit" in {b.state for b in opt.plan.buckets}
        runs.append((params, opt))
    _assert_same_bits(*runs[0], *runs[1])


@pytest.mark.parametrize(("name", "precision"), [("adamw", "param"), ("nadam_decoupled", "bf16"), ("lion", "param")])
@pytest.mark.parametrize("vector", [True, False])
def test_float_programs_of_any_size_step_the_same_bits(name, precision, vector, device, monkeypatch):
    """A float-state program loops over tiles of `update.FLOAT_TILE` elements (`planner.FP32_PROGRAM` elements a
    program for fp32 state, `planner.FLOAT_PROGRAM` for 2-byte state). Programs of one tile (512 elements), and
    programs of four tiles (of 128) that tensors span several of (a program's last tiles partial or empty), step the
    same bits as the default's programs (of several tiles; the 4104-element tensor spans more than one): params,
    state and step counts, NAdam's per-tensor mu_product (computed in the loop, written by a tensor's last program)
    too, an empty tensor's included; with vector reads and without (`_exact_arithmetic`)."""
    from kitsune.fusion import planner
    from kitsune.kernels import update

    monkeypatch.setattr(update, "FLOAT_VECTOR", vector)
    _exact_arithmetic(monkeypatch)
    runs = []
    default = planner.FP32_PROGRAM if precision == "param" else planner.FLOAT_PROGRAM  # fp32 params here
    for program, tile in ((default, update.FLOAT_TILE), (512, 128), (512, 512)):
        monkeypatch.setattr(planner, "FLOAT_PROGRAM", program)
        monkeypatch.setattr(planner, "FP32_PROGRAM", program)
        monkeypatch.setattr(update, "FLOAT_TILE", tile)
        seen = _float_layouts(monkeypatch)
        params, opt = _fused(CASES[name], precision, 64, device, [0, *FLOAT_VECTOR_SIZES], steps=4)
        assert all(b.route is Route.TRITON for b in opt.plan.buckets), opt.plan.to_dict()
        assert seen and all(seen) == vector, seen
        assert {u.tables.block for u in opt._subsystem("fusion").units} == {program}
        runs.append((params, opt))
    for other in runs[1:]:
        _assert_same_bits(*runs[0], *other)


@pytest.mark.parametrize(
    ("dtype", "precision", "fp32_state"),
    [(torch.float32, "param", True), (torch.float32, "fp32", True), (torch.float32, "bf16", False),
     (torch.bfloat16, "param", False), (torch.bfloat16, "fp32", True)],
)  # fmt: skip
def test_float_programs_follow_the_state_width(dtype, precision, fp32_state, device):
    """fp32 state runs programs of `planner.FP32_PROGRAM` elements, 2-byte state `planner.FLOAT_PROGRAM`."""
    from kitsune.fusion import planner

    params = [torch.nn.Parameter(torch.randn(5000, device=device, dtype=dtype)) for _ in range(2)]
    for p in params:
        p.grad = torch.randn_like(p)
    config = FusionConfig(state_precision=precision)
    opt = KitsuneOptimizer(torch.optim.AdamW(params, lr=1e-3), enable_fusion=True, fusion_config=config)
    opt.step()
    assert all(b.route is Route.TRITON for b in opt.plan.buckets), opt.plan.to_dict()
    want = planner.FP32_PROGRAM if fp32_state else planner.FLOAT_PROGRAM
    assert planner.FP32_PROGRAM != planner.FLOAT_PROGRAM
    assert {u.tables.block for u in opt._subsystem("fusion").units} == {want}


def _decoded(s: dict, key: str) -> torch.Tensor:
    if sf.quantized(s, key):
        return sf.dequantize(s[key + sf.CODES], s[key + sf.ABSMAX], sf.SIGNED[key])
    return s[key].float()


# bf16 state stores every slot through one rounding, whatever the algorithm: its trajectories for the optimizers whose
# slots differ (three with amsgrad, Adagrad's made in __init__, NAdam's per-tensor scalar beside two, Adadelta's two,
# one with momentum); 8-bit state's codes are signed or not per slot, so every optimizer runs it
BF16_CASES = ["adam_amsgrad_l2_maximize", "sgd_nesterov", "adagrad", "rmsprop_momentum", "nadam_decoupled", "adadelta"]


@pytest.mark.parametrize(
    ("name", "precision"), [(name, "8bit") for name in CASES] + [(name, "bf16") for name in BF16_CASES]
)
def test_trajectory_matches_torch_with_the_state_rounded_to_the_format(name, precision, device):
    min_size = 64 if precision == "8bit" else 0  # 8 bits: the 5-element param keeps fp32 state, in the same run
    ref_params, ref = _reference(CASES[name], precision, min_size, device)
    params, opt = _fused(CASES[name], precision, min_size, device)
    buckets = opt.plan.buckets
    assert all(b.route is Route.TRITON for b in buckets), opt.plan.to_dict()
    if precision == "8bit":  # (groups with other switches are buckets of their own)
        assert {b.state for b in buckets} == {"8-bit", "float32"}, opt.plan.to_dict()
        (small,) = (b for b in buckets if b.state == "float32")
        assert small.tensors == 1 and any("min_8bit_size=64" in n for n in small.notes)
    else:
        assert {b.state for b in buckets} == {"bfloat16"}, opt.plan.to_dict()
    for i, (p, r) in enumerate(zip(params, ref_params, strict=True)):
        s, rs = opt.state[p], ref.state[r]
        for key in (k for k in rs if k in sf.SIGNED):
            if p.numel() >= min_size and precision == "8bit":
                assert key not in s and s[key + sf.CODES].dtype == torch.uint8, sorted(s)
                assert s[key + sf.ABSMAX].numel() == math.ceil(p.numel() / QUANT_BLOCK)
            elif p.numel() >= min_size:
                assert s[key].dtype == torch.bfloat16
            else:
                assert s[key].dtype == torch.float32
            ours, theirs = _decoded(s, key).cpu().double(), rs[key].cpu().double().view(p.shape)
            # one code (or one bf16 ulp) of slack per element, relative to its block's absmax
            scale = theirs.abs().max().clamp_min(1e-30)
            slack = 0.02 if precision == "8bit" else 2**-7
            torch.testing.assert_close(ours, theirs, atol=float(scale) * slack, rtol=0, msg=f"param {i} {key}")
        lr = ref.param_groups[0]["lr"]
        torch.testing.assert_close(p.detach().cpu().double(), r.detach().cpu(), atol=lr * 0.5, rtol=1e-4)


@pytest.mark.parametrize("name", ["adamw", "lion", "sgd_nesterov"])
def test_eight_bit_state_is_the_quantized_reference_not_the_fp32_one(name, device):
    """The comparison above can tell the formats apart: the fp32 trajectory is measurably farther from the 8-bit
    reference than kitsune's 8-bit run is (so a kernel that kept fp32 state would fail it)."""
    ref_params, _ = _reference(CASES[name], "8bit", 64, device)
    params, _ = _fused(CASES[name], "8bit", 64, device)
    fp32_params, _ = _fused(CASES[name], "param", 64, device)
    ours = _farthest(params, ref_params)
    fp32 = _farthest(fp32_params, ref_params)
    assert ours * 4 < fp32, (ours, fp32)


def _farthest(params, ref_params) -> float:
    pairs = zip(params, ref_params, strict=True)
    return max((p.detach().cpu().double() - r.detach().cpu()).abs().max().item() for p, r in pairs)


def _special_blocks() -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9 * QUANT_BLOCK + 77, generator=gen)
    x[QUANT_BLOCK : 2 * QUANT_BLOCK] = 0.0  # an all-zero block
    x[2 * QUANT_BLOCK + 5] = 1e4  # an outlier
    x[3 * QUANT_BLOCK + 9] = math.inf
    x[4 * QUANT_BLOCK + 1] = math.nan
    x[5 * QUANT_BLOCK : 6 * QUANT_BLOCK] *= 1e-30  # tiny values
    x[6 * QUANT_BLOCK + 3] = -x[6 * QUANT_BLOCK : 7 * QUANT_BLOCK].abs().max() * 2  # negative absmax
    x[7 * QUANT_BLOCK : 8 * QUANT_BLOCK] *= 1e-39  # subnormals: the block's scale is fp32's smallest normal
    x[8 * QUANT_BLOCK : 9 * QUANT_BLOCK] *= 1e-41  # below 2**-128, where 1 / absmax would overflow
    return x


@pytest.mark.parametrize("signed", [True, False])
def test_torch_quantizer_gives_the_kernels_bits(signed, device):
    """`state_format.quantize` (plain torch: checkpoints on any device) and the Triton kernels agree exactly."""
    from kitsune.kernels import quant

    x = _special_blocks().to(device)
    if not signed:
        x = x.abs()
    code = dynamic_map(signed).to(device)
    codes, absmax = sf.quantize(x, signed)
    kcodes, kabsmax = quant.quantize_blockwise(x, code)
    assert torch.equal(codes, kcodes)
    assert torch.allclose(absmax, kabsmax, equal_nan=True, rtol=0, atol=0)
    assert torch.isnan(absmax[3]) and torch.isnan(absmax[4]) and absmax[1] == 0
    decoded = sf.dequantize(codes, absmax, signed)
    assert torch.equal(decoded.nan_to_num(7.0), quant.dequantize_blockwise(kcodes, kabsmax, code).nan_to_num(7.0))
    assert torch.equal(decoded[QUANT_BLOCK : 2 * QUANT_BLOCK], torch.zeros(QUANT_BLOCK, device=device))
    empty = sf.quantize(torch.empty(0, device=device), signed)
    assert empty[0].numel() == 0 and empty[1].numel() == 0


def test_a_positive_block_absmax_decodes_exactly_and_others_within_half_a_gap():
    x = _special_blocks()
    x = x[torch.isfinite(x)]
    codes, absmax = sf.quantize(x, True)
    decoded = sf.dequantize(codes, absmax, True)
    table = dynamic_map(True).double()
    half_gap = (table[1:] - table[:-1]).max().item() / 2
    scale = absmax.double().repeat_interleave(QUANT_BLOCK)[: x.numel()]
    err = (decoded.double() - x.double()).abs()
    assert (err <= scale * half_gap * (1 + 1e-6) + 1e-45).all()
    peaks = [(blk * QUANT_BLOCK + x[blk * QUANT_BLOCK : (blk + 1) * QUANT_BLOCK].abs().argmax()).item()
             for blk in range(absmax.numel())]  # fmt: skip
    # 1.0 is a code, -1.0 is not (bitsandbytes' signed map: 127 negative codes, 0, 128 positive)
    assert all(decoded[i] == x[i] for i in peaks if x[i] >= MIN_SCALE)  # a block of subnormals: scaled by MIN_SCALE
    assert absmax[7] == MIN_SCALE and bool(decoded.isfinite().all())
    assert any(x[i] < 0 for i in peaks)


def test_checkpoint_round_trip_through_plain_torch(device):
    """kitsune 8-bit -> torch fp32 (convert_state_dict) -> plain AdamW steps -> kitsune 8-bit, and an 8-bit state
    dict into kitsune 8-bit continues exactly as the uninterrupted run."""
    make = CASES["adamw"]
    params, opt = _fused(make, "8bit", 64, device, steps=STATE_STEPS)
    sd = copy.deepcopy(opt.state_dict())
    first = next(iter(sd["state"].values()))
    assert "exp_avg" not in first and first["exp_avg_codes"].dtype == torch.uint8

    # into plain torch: it refuses the 8-bit dict at its first step (no silent reinterpretation) ...
    plain = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2, weight_decay=0.1)
    plain.load_state_dict(copy.deepcopy(sd))
    for p in (q for g in plain.param_groups for q in g["params"]):
        p.grad = torch.ones_like(p)
    with pytest.raises(KeyError, match="exp_avg"):
        plain.step()
    # ... and takes the converted one, whose state decodes the codes
    plain = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2, weight_decay=0.1)
    converted = kitsune.convert_state_dict(sd, "fp32")
    plain.load_state_dict(converted)
    ps = [q for g in plain.param_groups for q in g["params"]]
    for p, q in zip(params, ps, strict=True):
        s = opt.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(plain.state[q][key], _decoded(s, key).view(p.shape))
    for p, g in zip(ps, _grads(99), strict=True):
        p.grad = g.to(device)
    plain.step()

    # back into kitsune 8-bit from the plain optimizer's fp32 state: quantized as it binds
    again = [torch.nn.Parameter(q.detach().clone()) for q in ps]
    config = FusionConfig(state_precision="8bit", min_8bit_size=64)
    kopt = KitsuneOptimizer(make(again), enable_fusion=True, fusion_config=config)
    kopt.load_state_dict(plain.state_dict())
    for p, q in zip(again, ps, strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            if p.numel() >= 64:
                want = sf.quantize(plain.state[q][key], sf.SIGNED[key], exact_extremes=True)
                assert torch.equal(kopt.state[p][key + sf.CODES], want[0]) and key not in kopt.state[p]
    for p, g in zip(again, _grads(100), strict=True):
        p.grad = g.to(device)
    kopt.step()

    # an 8-bit state dict into an 8-bit optimizer: the next step is the uninterrupted run's, bit for bit
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ropt = KitsuneOptimizer(make(resumed), enable_fusion=True, fusion_config=config)
    ropt.load_state_dict(sd)
    for ps_, o in ((params, opt), (resumed, ropt)):
        for p, g in zip(ps_, _grads(101), strict=True):
            p.grad = g.to(device)
        o.step()
    for p, q in zip(params, resumed, strict=True):
        assert torch.equal(p, q)
        for key, t in opt.state[p].items():
            assert torch.equal(t, ropt.state[q][key]), key


def test_eight_bit_checkpoint_into_the_param_precision_decodes(device):
    """A kitsune optimizer without low-precision state (or with fusion off) decodes a loaded 8-bit state dict into
    torch's keys as it plans, so its step (the fused one or torch's own) reads fp32 state."""
    params, opt = _fused(CASES["adamw"], "8bit", 64, device, steps=STATE_STEPS)
    sd = opt.state_dict()
    for enable in (True, False):
        fresh = [torch.nn.Parameter(p.detach().clone()) for p in params]
        other = KitsuneOptimizer(CASES["adamw"](fresh), enable_fusion=enable)
        other.load_state_dict(copy.deepcopy(sd))
        for p, q in zip(params, fresh, strict=True):
            s = other.state[q]
            assert not any(k.endswith(sf.CODES) for k in s)
            assert torch.equal(s["exp_avg"], _decoded(opt.state[p], "exp_avg").view(p.shape))
        for q, g in zip(fresh, _grads(7), strict=True):
            q.grad = g.to(device)
        other.step()


def test_bf16_params_keep_the_absmax_in_fp32_through_a_checkpoint(device):
    """torch's load_state_dict casts a float param's state to the param's dtype: the 8-bit entries go around it."""
    params = [torch.nn.Parameter(torch.randn(600, device=device, dtype=torch.bfloat16))]
    config = FusionConfig(state_precision="8bit", min_8bit_size=0)
    opt = KitsuneOptimizer(torch.optim.AdamW(params, lr=1e-2), enable_fusion=True, fusion_config=config)
    params[0].grad = torch.randn(600, device=device, dtype=torch.bfloat16) * 1e-3
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    fresh = [torch.nn.Parameter(params[0].detach().clone())]
    other = KitsuneOptimizer(torch.optim.AdamW(fresh, lr=1e-2), enable_fusion=True, fusion_config=config)
    other.load_state_dict(sd)
    for key, t in opt.state[params[0]].items():
        assert t.dtype == other.state[fresh[0]][key].dtype and torch.equal(t, other.state[fresh[0]][key]), key
    assert other.state[fresh[0]]["exp_avg_absmax"].dtype == torch.float32


def test_codes_or_absmax_of_the_wrong_size_are_refused_and_nothing_changes(device):
    params, opt = _fused(CASES["adamw"], "8bit", 64, device, steps=STATE_STEPS)
    sd = copy.deepcopy(opt.state_dict())
    before = copy.deepcopy(opt.state_dict())
    sd["state"][0]["exp_avg_codes"] = sd["state"][0]["exp_avg_codes"].reshape(-1)[:10]
    with pytest.raises(ValueError, match="exp_avg_codes"):
        opt.load_state_dict(sd)
    sd = copy.deepcopy(before)
    sd["state"][1]["exp_avg_sq_absmax"] = sd["state"][1]["exp_avg_sq_absmax"][:1]
    with pytest.raises(ValueError, match="exp_avg_sq_absmax"):
        opt.load_state_dict(sd)
    after = opt.state_dict()
    for pid, s in before["state"].items():
        for key, t in s.items():
            assert torch.equal(t, after["state"][pid][key]), key


def _bad_8bit_state_dicts(sd: dict) -> list[tuple[str, dict]]:
    """Copies of an 8-bit state dict, each with one entry that does not decode: ``(what the error names, copy)``."""
    cases = []

    def case(match, key, change):
        bad = copy.deepcopy(sd)
        changed = change(bad["state"][0][key])
        if changed is None:  # the entry dropped
            del bad["state"][0][key]
        else:
            bad["state"][0][key] = changed
        cases.append((match, bad))

    case("exp_avg_codes' has shape", "exp_avg_codes", lambda t: t.reshape(-1)[:10])
    case("exp_avg_absmax' has 1 elements", "exp_avg_absmax", lambda t: t[:1])
    case("one-dimensional", "exp_avg_absmax", lambda t: t.view(1, -1))
    case("no 8-bit codes", "exp_avg_codes", lambda t: t.long() + 300)  # would wrap around as uint8
    case("no 8-bit codes", "exp_avg_codes", lambda t: t.float() + 0.5)
    case("dense tensor", "exp_avg_codes", lambda t: t.tolist())
    case("'exp_avg_codes' without 'exp_avg_absmax': 8-bit state is a pair", "exp_avg_absmax", lambda t: None)
    case("'exp_avg_sq_absmax' without 'exp_avg_sq_codes'", "exp_avg_sq_codes", lambda t: None)
    case("'exp_avg_sq_absmax' holds a negative or infinite block scale", "exp_avg_sq_absmax", lambda t: -t)
    case("'exp_avg_absmax' holds a negative or infinite block scale", "exp_avg_absmax", lambda t: t + math.inf)
    return cases


@pytest.mark.parametrize("where", ["fusion off", "a param the fused kernel does not take"])
def test_8bit_state_that_does_not_decode_is_refused_for_params_not_fused_too(where, device):
    """The wrapped optimizer's own step decodes 8-bit state into torch's keys; codes or scales that do not fit are
    refused before anything changes, as for the fused units, and the optimizer steps on afterwards."""
    params, src = _fused(CASES["adamw"], "8bit", 64, device, steps=STATE_STEPS)
    sd = copy.deepcopy(src.state_dict())
    mine = [torch.nn.Parameter(p.detach().clone()) for p in params]
    if where == "fusion off":
        opt = KitsuneOptimizer(torch.optim.AdamW(mine, lr=0.01), enable_fusion=False)
    else:  # a non-contiguous param goes to torch's foreach path
        mine[0] = torch.nn.Parameter(torch.randn(mine[0].shape[::-1], device=device).t())
        opt = KitsuneOptimizer(
            torch.optim.AdamW(mine, lr=0.01),
            enable_fusion=True,
            fusion_config=FusionConfig(state_precision="8bit", min_8bit_size=64),
        )
    for p in mine:
        p.grad = torch.randn_like(p)
    opt.step()
    if where != "fusion off":  # the others are fused, the transposed one is not
        assert {b.route for b in opt.plan.buckets} == {Route.TRITON, Route.TORCH_FOREACH}
    before = copy.deepcopy(opt.state_dict())
    for match, bad in _bad_8bit_state_dicts(sd):
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(bad)
        after = opt.state_dict()
        assert sorted(after["state"][0]) == sorted(before["state"][0]), match
        for pid, st in before["state"].items():
            for key, t in st.items():
                assert torch.equal(t, after["state"][pid][key]), (match, key)
    opt.step()  # still steps
    assert opt.step_count == 2


def test_8bit_codes_of_another_integer_or_float_dtype_load_when_they_are_codes(device):
    params, opt = _fused(CASES["adamw"], "8bit", 64, device, steps=STATE_STEPS)
    sd = copy.deepcopy(opt.state_dict())
    codes = sd["state"][0]["exp_avg_codes"].clone()
    for cast in (torch.int64, torch.float32):
        bad = copy.deepcopy(sd)
        bad["state"][0]["exp_avg_codes"] = codes.to(cast)
        opt.load_state_dict(bad)
        assert torch.equal(opt.state[params[0]]["exp_avg_codes"], codes)
    for match, bad in _bad_8bit_state_dicts(sd):  # and the fused units refuse the others, changing nothing
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(bad)
        assert torch.equal(opt.state[params[0]]["exp_avg_codes"], codes)


def test_convert_state_dict_shares_no_tensor_with_its_input():
    params, opt = _fused(CASES["adamw"], "8bit", 64, torch.device("cpu"), steps=STATE_STEPS)
    opt.param_groups[0]["lr"] = torch.tensor(0.01)
    sd = opt.state_dict()
    mine = {id(t) for t in _tensors(sd)}
    for precision in ("fp32", "bf16", "8bit", "param"):
        out = kitsune.convert_state_dict(sd, precision, min_8bit_size=64)
        assert not mine & {id(t) for t in _tensors(out)}, precision
        assert out["param_groups"] is not sd["param_groups"]


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def test_convert_state_dict_both_ways_and_its_errors():
    params, opt = _fused(CASES["adamw"], "param", 64, torch.device("cpu"), steps=STATE_STEPS)
    sd = opt.state_dict()
    q = kitsune.convert_state_dict(sd, "8bit", min_8bit_size=64)
    big, small = q["state"][0], q["state"][3]
    assert {"exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax", "step"} == set(big)
    assert small["exp_avg"].dtype == torch.float32  # 5 elements: under min_8bit_size
    back = kitsune.convert_state_dict(q, "fp32")
    for pid, s in sd["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(back["state"][pid][key], s[key], atol=float(s[key].abs().max()) / 50, rtol=0)
    half = kitsune.convert_state_dict(sd, "bf16")
    assert half["state"][0]["exp_avg"].dtype == torch.bfloat16 and sd["state"][0]["exp_avg"].dtype == torch.float32
    with pytest.raises(ValueError, match="precision must be one of"):
        kitsune.convert_state_dict(sd, "int4")
    with pytest.raises(TypeError, match="optimizer state dict"):
        kitsune.convert_state_dict({"exp_avg": 1}, "fp32")
    orphan = copy.deepcopy(q)
    del orphan["state"][0]["exp_avg_absmax"]  # codes alone decode to nothing: not passed on as "fp32" state
    with pytest.raises(ValueError, match="'exp_avg_codes' without 'exp_avg_absmax'"):
        kitsune.convert_state_dict(orphan, "fp32")
    own = copy.deepcopy(sd)
    own["state"][0]["grad_absmax"] = torch.ones(3)  # another optimizer's own key: not 8-bit state of kitsune's
    assert torch.equal(kitsune.convert_state_dict(own, "fp32")["state"][0]["grad_absmax"], torch.ones(3))
    opt.load_state_dict(own)
    assert torch.equal(opt.state[params[0]]["grad_absmax"], torch.ones(3))


def test_the_plan_and_report_say_where_low_precision_does_not_apply(device):
    params = [torch.nn.Parameter(p.detach().to(device)) for p in _params()]
    config = FusionConfig(state_precision="8bit", min_8bit_size=0)
    opt = KitsuneOptimizer(torch.optim.Rprop(params), enable_fusion=True, fusion_config=config)
    (bucket,) = opt.plan.buckets
    assert bucket.state == "float32" and any(
        "does not apply to Rprop (its step sizes grow and shrink by factors" in n for n in bucket.notes
    )
    sgd = KitsuneOptimizer(torch.optim.SGD(params, lr=0.1), enable_fusion=True, fusion_config=config)
    assert sgd.plan.buckets[0].state == "-" and not sgd.plan.buckets[0].notes  # no state to keep
    kitsune.KitsuneConfig(fusion=config, shard={"stage": 1})  # sharded low-precision state: tests/distributed


def test_profiler_comparison_is_not_applicable_with_8bit_state(device):
    from kitsune import KitsuneConfig, ProfilerConfig

    params = [torch.nn.Parameter(p.detach().to(device)) for p in _params()]
    config = KitsuneConfig(
        fusion=FusionConfig(state_precision="8bit", min_8bit_size=64),
        profiler=ProfilerConfig(enabled=True, sample_after=0, probe_steps=0, compare_steps=2),
    )
    opt = KitsuneOptimizer(torch.optim.AdamW(params, lr=1e-3), config=config)
    for step in range(8):
        for p, g in zip(params, _grads(step), strict=True):
            p.grad = g.to(device)
        opt.step()
    comparison = opt.profiler.get_metrics().comparison
    assert comparison.status == "not_applicable" and "8bit" in comparison.reason, comparison


def test_centered_rmsprop_keeps_its_state_in_the_param_dtype(device):
    """square_avg - grad_avg**2 is a small difference of two rounded values: in 8 bits it goes negative (nan)."""
    params = [torch.nn.Parameter(p.detach().to(device)) for p in _params()]
    config = FusionConfig(state_precision="8bit", min_8bit_size=0)
    opt = KitsuneOptimizer(torch.optim.RMSprop(params, centered=True), enable_fusion=True, fusion_config=config)
    (bucket,) = opt.plan.buckets
    assert bucket.route is Route.TRITON and bucket.state == "float32"
    assert any("centered RMSprop" in n for n in bucket.notes)


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["8bit", "bf16"])
def test_captured_steps_equal_the_eager_ones_on_cuda(precision):
    """The phase captured in a CUDA graph and replayed writes the bits the eager launches write, with AMP's
    overflow skip and clipping fused into the same passes."""
    shapes = [(3072, 768), (768,), (2304, 768), (50, 768)]
    finals = []
    for graph in (True, False):
        gen = torch.Generator(device="cuda").manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen)) for s in shapes]
        opt = KitsuneOptimizer(
            torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1),
            enable_fusion=True,
            capture_graph=graph,
            max_grad_norm=1.0,
            fusion_config=FusionConfig(state_precision=precision),
        )
        for _ in range(12):
            for p in params:
                p.grad = torch.randn(p.shape, device="cuda", generator=gen) * 0.01
            opt.step()
        graphs = next(s for s in opt.subsystem_status() if s["name"] == "graphs")
        assert graphs["active"] == graph, graphs
        finals.append(([p.detach().clone() for p in params], {k: t.clone() for k, t in opt.state[params[0]].items()}))
    (pa, sa), (pb, sb) = finals
    for x, y in zip(pa, pb, strict=True):
        assert torch.equal(x, y)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("precision", ["8bit", "bf16"])
def test_the_memory_pool_holds_low_precision_state_and_changes_no_bit(precision, device):
    """Pooled (the default) and per-tensor (memory_pool_size=0) runs end bit for bit alike; pooled, every state
    entry is a view of its dtype's arena (codes in a uint8 arena, absmax and fp32 state in the fp32 one)."""
    runs = []
    for pool in (512 * 2**20, 0):
        params, opt = _fused(CASES["adamw"], precision, 64, device, memory_pool_size=pool, steps=STATE_STEPS)
        runs.append((params, opt))
    (pa, oa), (pb, ob) = runs
    memory = next(s for s in oa.subsystem_status() if s["name"] == "memory")
    assert memory["active"] and memory["report"]["params_pooled"] == len(SIZES), memory
    assert not next(s for s in ob.subsystem_status() if s["name"] == "memory")["active"]
    for p, q in zip(pa, pb, strict=True):
        assert torch.equal(p, q)
        sa, sb = oa.state[p], ob.state[q]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
        for key, t in sa.items():
            if key != "step":  # each a view into an arena: its storage holds more than the tensor
                assert t.untyped_storage().nbytes() > t.numel() * t.element_size(), key
    arenas = {t.untyped_storage().data_ptr() for s in (oa.state[p] for p in pa) for t in s.values()}
    # 8 bits: the uint8 codes, the fp32 absmax with the small param's fp32 state, the steps; bf16: the state, the steps
    assert len(arenas) == (3 if precision == "8bit" else 2)


@pytest.mark.parametrize("fmt", [sf.StateFormat.Q8, sf.StateFormat.BF16, sf.StateFormat.PARAM])
def test_a_float_state_set_by_hand_over_8bit_state_wins_in_every_format(fmt):
    """State holding ``exp_avg`` both in 8 bits and as a float tensor set by hand: the float tensor is what every
    format takes (quantized for 8 bits, cast for the float formats), and the old codes are gone."""
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(3 * QUANT_BLOCK + 7, generator=gen)
    old, by_hand = torch.randn(p.shape, generator=gen), torch.randn(p.shape, generator=gen)
    codes, absmax = sf.quantize(old, signed=True)
    s = {"exp_avg": by_hand.clone(), "exp_avg_codes": codes, "exp_avg_absmax": absmax}
    got = sf.conform(s, "exp_avg", p, fmt)
    if fmt == sf.StateFormat.Q8:
        want = sf.quantize(by_hand, signed=True)
        assert set(s) == {"exp_avg_codes", "exp_avg_absmax"}
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    else:
        assert set(s) == {"exp_avg"}
        assert torch.equal(got[0], by_hand.to(sf.dtype_of(fmt, p.dtype)))


def test_decoded_8bit_state_encodes_back_to_its_codes_and_scales():
    """Converting float state into 8 bits (``exact_extremes``) re-encodes decoded 8-bit state as it was, also in
    blocks whose largest magnitude is negative (the signed table ends at -0.99297); the kernels' own rule (the block's
    absmax) would shrink those blocks' scales and move codes."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(8 * QUANT_BLOCK + 5, generator=gen) * torch.rand(8 * QUANT_BLOCK + 5, generator=gen).pow(2)
    x[3] = -5.0  # block 0's extreme is negative
    x[QUANT_BLOCK + 7] = 5.0  # block 1's positive
    for exact in (False, True):
        codes, absmax = sf.quantize(x, signed=True, exact_extremes=exact)
        again = sf.quantize(sf.dequantize(codes, absmax, signed=True), signed=True, exact_extremes=True)
        assert torch.equal(again[0], codes)
        torch.testing.assert_close(again[1], absmax, rtol=2e-7, atol=0)
    codes, absmax = sf.quantize(x, signed=True)
    drift = sf.quantize(sf.dequantize(codes, absmax, signed=True), signed=True)
    assert drift[1][0] < 0.995 * absmax[0] and drift[1][1] == absmax[1]  # the kernels' rule shrinks block 0 only
    exact = sf.quantize(x, signed=True, exact_extremes=True)  # and holds the negative extreme exactly
    assert sf.dequantize(*exact, signed=True)[3] == pytest.approx(-5.0, rel=1e-6)


def test_fp32_state_of_bf16_params_survives_a_checkpoint(device):
    """``state_precision="fp32"`` with bf16 params: torch's load_state_dict casts a float param's state to the
    param's dtype; kitsune keeps the saved fp32 moments, so a resumed run steps bit for bit as the uninterrupted one.
    Where no fused unit keeps fp32 state (fusion off) the moments are the param's dtype, as torch would load them."""
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(torch.bfloat16).to(device)) for s in (700, 33)]
    config = FusionConfig(state_precision="fp32")

    def make(ps, fusion=True):
        opt = torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)
        return KitsuneOptimizer(opt, enable_fusion=fusion, fusion_config=config if fusion else None)

    def step(ps, opt, k):
        g = torch.Generator().manual_seed(50 + k)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16).to(device)
        opt.step()

    opt = make(params)
    for k in range(3):
        step(params, opt, k)
    sd = copy.deepcopy(opt.state_dict())
    assert all(s["exp_avg"].dtype == torch.float32 for s in sd["state"].values())
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ropt = make(resumed)
    ropt.load_state_dict(sd)
    for ps, o in ((params, opt), (resumed, ropt)):
        step(ps, o, 3)
    for p, q in zip(params, resumed, strict=True):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq"):
            assert ropt.state[q][key].dtype == torch.float32 and torch.equal(opt.state[p][key], ropt.state[q][key])
    plain = [torch.nn.Parameter(p.detach().clone()) for p in params]
    popt = make(plain, fusion=False)
    popt.load_state_dict(copy.deepcopy(sd))
    step(plain, popt, 3)  # the wrapped optimizer's own step, on moments in the params' dtype
    assert all(popt.state[p]["exp_avg"].dtype == torch.bfloat16 for p in plain)


@pytest.mark.parametrize("pool", [0, 512 << 20])
def test_codes_at_an_odd_address_step_as_the_aligned_ones(pool, device):
    """The update reads 8-bit codes in 4-byte words or 16-byte vectors (`kitsune.kernels.codes.CODES_ALIGN`): codes
    set by hand as a view at an odd byte offset of a larger buffer are copied to an aligned tensor as they bind, and
    the run goes on bit for bit as the one whose codes were never moved."""
    make = CASES["adamw"]
    params, opt = _fused(make, "8bit", 64, device, memory_pool_size=pool, steps=STATE_STEPS)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    config = FusionConfig(state_precision="8bit", min_8bit_size=64)
    topt = KitsuneOptimizer(make(twin), enable_fusion=True, fusion_config=config, memory_pool_size=pool)
    topt.load_state_dict(copy.deepcopy(opt.state_dict()))
    moved = 0
    for p in twin:
        s = topt.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            codes = s.get(key + sf.CODES)
            if codes is None:
                continue
            buf = torch.zeros(codes.numel() + 5, dtype=torch.uint8, device=device)
            view = buf[1 : 1 + codes.numel()].view(codes.shape)
            view.copy_(codes)
            assert view.data_ptr() % 4 and view.is_contiguous()
            s[key + sf.CODES] = view
            moved += 1
    assert moved >= 6
    for step in range(3):
        for ps, o in ((params, opt), (twin, topt)):
            for p, g in zip(ps, _grads(200 + step), strict=True):
                p.grad = g.to(device)
            o.step()
        assert all(b.route is Route.TRITON for b in topt.plan.buckets), topt.plan.to_dict()
    for p, q in zip(params, twin, strict=True):
        assert torch.equal(p, q)
        for key, t in opt.state[p].items():
            assert torch.equal(t, topt.state[q][key]), key
            if key.endswith(sf.CODES):
                assert topt.state[q][key].data_ptr() % CODES_ALIGN == 0


def _layouts(monkeypatch, decision: str = "_vector_layout") -> list[bool]:
    """Record what `update._vector_layout` (or another of `kitsune.kernels.update`'s layout decisions) decides for
    each launch it is asked about."""
    from kitsune.kernels import update

    seen: list[bool] = []
    decide = getattr(update, decision)

    def spy(*args):
        seen.append(decide(*args))
        return seen[-1]

    monkeypatch.setattr(update, decision, spy)
    return seen


def _exact_arithmetic(monkeypatch) -> None:
    """Compile the kernels without contracting a product and a sum into one fused multiply-add
    (`kitsune.kernels.common.FP_FUSION` off): where the compiler contracts depends on the code around the arithmetic,
    so on a GPU a program of one tile and one that loops over four, or vector and scalar reads, may round the same
    update apart in the last bit (H200: 7e-7 in a param after 6 AdamW steps). With contraction off, two layouts that
    give every element the same arithmetic give the same bits; the CPU interpreter never contracts. Accuracy with
    contraction on (what a run compiles) is what the trajectory tests measure against torch."""
    from kitsune.kernels import common

    monkeypatch.setattr(common, "FP_FUSION", False)


def _same_bits_both_ways(monkeypatch, switch: str, decision: str, run) -> None:
    """``run()`` (which returns params and their optimizer) with `kitsune.kernels.update`'s ``switch`` off, then on:
    every launch's ``decision`` follows the switch, every bucket is fused, and the params and every state tensor are
    the same bits both ways (`_exact_arithmetic`)."""
    from kitsune.kernels import update

    _exact_arithmetic(monkeypatch)
    runs = []
    for on in (False, True):
        monkeypatch.setattr(update, switch, on)
        seen = _layouts(monkeypatch, decision)
        params, opt = run()
        assert all(b.route is Route.TRITON for b in opt.plan.buckets), opt.plan.to_dict()
        assert seen and all(seen) == on and any(seen) == on, seen
        runs.append((params, opt))
    _assert_same_bits(*runs[0], *runs[1])


VECTOR_SIZES = [(24, 40), 3000, 4104, 520, 5]  # numels that are multiples of 8: whole tiles, partial ones, tails


@pytest.mark.parametrize(("name", "prefetch"), [("adam_amsgrad_l2_maximize", True), ("lion", False)])
def test_the_vector_layout_steps_the_same_bits_as_the_interleaved_one(name, prefetch, device, monkeypatch):
    """`update.Q8_VECTOR`: a warp per quantization block and consecutive elements a thread, read as vectors where
    the params and codes are 16-byte aligned. Over programs of four 512-element tiles (2 warps, `VECTOR_WARPS`:
    tensors across several programs, partial tiles, a program's empty tiles), params, codes, scales and step counts
    are the same bits as the interleaved layout's, for one, two and three state slots (Lion; Adam with amsgrad and
    L2 decay in one group, maximize in another), each tile loaded a pass ahead (`update.Q8_PREFETCH`,
    `Q8_VECTOR_PREFETCH`) or not; and the vector layout is the one that ran."""
    from kitsune.fusion import planner
    from kitsune.kernels import update

    monkeypatch.setattr(planner, "Q8_PROGRAM", 2048)
    monkeypatch.setattr(update, "Q8_PREFETCH", prefetch)
    monkeypatch.setattr(update, "Q8_VECTOR_PREFETCH", prefetch)
    _same_bits_both_ways(
        monkeypatch,
        "Q8_VECTOR",
        "_vector_layout",
        lambda: _fused(CASES[name], "8bit", 64, device, VECTOR_SIZES, steps=6),
    )


@pytest.mark.parametrize(("name", "capped"), [("adamw", True), ("nadam_decoupled", True), ("lion", False)])
def test_the_vector_layout_caps_registers_where_the_state_has_two_slots(name, capped, device, monkeypatch):
    """`update.Q8_MAXNREG` and `Q8_VECTOR_PREFETCH` apply to vector launches with `Q8_CAPPED_SLOTS` state slots or
    more (Adam's family: faster capped on an H200); one-slot launches (Lion, SGD: slower capped) keep the compiler's
    registers and `Q8_PREFETCH`. Read from the launches a real 8-bit step makes."""
    from kitsune.fusion import planner
    from kitsune.kernels import update

    monkeypatch.setattr(planner, "Q8_PROGRAM", 2048)  # several tiles a program: a next one to prefetch
    seen: list[dict] = []
    kernel = update._update_kernel

    class Spy:
        def warmup(self, *args, **kwargs):  # the compile ahead of the launch
            return kernel.warmup(*args, **kwargs)

        def __getitem__(self, grid):
            launch = kernel[grid]

            def run(*args, **kwargs):
                seen.append({k: kwargs.get(k) for k in ("Q8", "PREFETCH", "SLOTS", "maxnreg")})
                return launch(*args, **kwargs)

            return run

    monkeypatch.setattr(update, "_update_kernel", Spy())
    _, opt = _fused(CASES[name], "8bit", 64, device, VECTOR_SIZES, steps=2)
    assert all(b.route is Route.TRITON for b in opt.plan.buckets), opt.plan.to_dict()
    vector = [launch for launch in seen if launch["Q8"] == 2]
    assert vector, seen
    for launch in vector:
        assert (launch["SLOTS"] >= update.Q8_CAPPED_SLOTS) == capped, launch
        if capped:
            assert launch["maxnreg"] == update.Q8_MAXNREG and launch["PREFETCH"] == update.Q8_VECTOR_PREFETCH
        else:
            assert launch["maxnreg"] is None and launch["PREFETCH"] == update.Q8_PREFETCH


@pytest.mark.parametrize("case", ["odd numel", "unaligned param", "short program"])
def test_the_vector_layout_is_declined_where_its_promise_would_not_hold(case, device, monkeypatch):
    """The vector layout promises Triton 16-byte aligned params and codes, numels that are multiples of 8 and whole
    tiles a program; a launch where one of these fails takes the interleaved layout: it steps the same bits as a run
    with the vector layout switched off. (The memory pool would place the unaligned params at aligned addresses: it
    is off here.)"""
    from kitsune.fusion import planner
    from kitsune.kernels import update

    sizes = list(VECTOR_SIZES)
    if case == "odd numel":
        sizes[1] = 3001
    if case == "short program":
        monkeypatch.setattr(planner, "Q8_PROGRAM", 256)  # one quantization block: less than a vector tile

    def params():
        if case != "unaligned param":
            return None
        # each param a view 4 bytes past a 16-byte boundary of one storage
        storage = torch.zeros(sum(math.prod(s) if isinstance(s, tuple) else s for s in sizes) + 1, device=device)
        out, at = [], 1
        for p in _params(sizes=sizes):
            out.append(torch.nn.Parameter(storage[at : at + p.numel()].view(p.shape).copy_(p.detach())))
            at += p.numel()
        assert out[0].data_ptr() % 16
        return out

    runs = []
    for vector in (True, False):
        monkeypatch.setattr(update, "Q8_VECTOR", vector)
        seen = _layouts(monkeypatch)
        ps, opt = _fused(CASES["adamw"], "8bit", 64, device, sizes, params(), steps=3, memory_pool_size=0)
        assert all(b.route is Route.TRITON for b in opt.plan.buckets), opt.plan.to_dict()
        assert seen and not any(seen), seen
        runs.append((ps, opt))
    _assert_same_bits(*runs[0], *runs[1])


FLOAT_VECTOR_SIZES = [(24, 40), 3000, 4104, 520, 8]  # every numel a multiple of 8: whole tiles, partial ones, tails


def _float_layouts(monkeypatch) -> list[bool]:
    """Record what `update._float_vector` decides for each float-state launch."""
    return _layouts(monkeypatch, "_float_vector")


@pytest.mark.parametrize(
    ("name", "precision", "clip"),
    [
        ("adam_amsgrad_l2_maximize", "param", False),
        ("sgd_nesterov", "bf16", True),
        ("rmsprop_momentum", "param", True),
        ("adadelta", "bf16", False),
        ("lion", "param", False),
    ],
)
def test_float_state_vectors_step_the_same_bits(name, precision, clip, device, monkeypatch):
    """`update.FLOAT_VECTOR`: with params, grads and state at 16-byte multiples and numels that are multiples of 8,
    a float-state update promises Triton so and reads and writes vectors. Over one, two and three state slots, fp32
    or bf16 state, with clipping (which writes the grads back through the same pointers) or without, the params and
    state are the same bits as the scalar reads', and the vector path is the one that ran; a launch holding a numel
    that is no multiple of 8, or params or grads 4 bytes past a 16-byte boundary, takes the scalar reads."""
    from kitsune.kernels import update

    kwargs = {"max_grad_norm": 0.5} if clip else {}
    _same_bits_both_ways(
        monkeypatch,
        "FLOAT_VECTOR",
        "_float_vector",
        lambda: _fused(CASES[name], precision, 64, device, FLOAT_VECTOR_SIZES, steps=5, **kwargs),
    )
    # where the promise would not hold, the launch declines it
    monkeypatch.setattr(update, "FLOAT_VECTOR", True)
    odd = list(FLOAT_VECTOR_SIZES)
    odd[1] = 3001
    seen = _float_layouts(monkeypatch)
    _fused(CASES[name], precision, 64, device, odd, steps=1, **kwargs)
    assert False in seen, seen  # the launch holding it (another group's launch may still take vectors)
    storage = torch.zeros(
        sum(math.prod(s) if isinstance(s, tuple) else s for s in FLOAT_VECTOR_SIZES) + 1, device=device
    )
    shifted, at = [], 1
    for p in _params(sizes=FLOAT_VECTOR_SIZES):
        shifted.append(torch.nn.Parameter(storage[at : at + p.numel()].view(p.shape).copy_(p.detach())))
        at += p.numel()
    seen = _float_layouts(monkeypatch)
    _fused(CASES[name], precision, 64, device, FLOAT_VECTOR_SIZES, shifted, steps=1, memory_pool_size=0, **kwargs)
    assert seen and not any(seen), seen
    # aligned params whose grads are views 4 bytes past a 16-byte boundary (as in one flat buffer): declined too
    params = [torch.nn.Parameter(p.detach().to(device)) for p in _params(sizes=FLOAT_VECTOR_SIZES)]
    config = FusionConfig(state_precision=precision, min_8bit_size=64)
    opt = KitsuneOptimizer(CASES[name](params), enable_fusion=True, fusion_config=config, memory_pool_size=0, **kwargs)
    flat = torch.zeros(sum(p.numel() for p in params) + 1, device=device)
    seen = _float_layouts(monkeypatch)
    at = 1
    for p, g in zip(params, _grads(0, FLOAT_VECTOR_SIZES), strict=True):
        p.grad = flat[at : at + p.numel()].view(p.shape).copy_(g)
        at += p.numel()
    assert params[0].grad.data_ptr() % 16
    opt.step()
    assert seen and not any(seen), seen


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
def test_the_wrapped_optimizers_own_step_over_low_precision_state_is_refused(precision, device):
    """The wrapped optimizer's own ``step()`` called in place of the KitsuneOptimizer's cannot read kitsune's
    low-precision state (torch's AdamW counted the step, then raised on the dtype or the missing key): refused before
    anything changes, naming the fix; the KitsuneOptimizer steps on, and a plain optimizer's step is never hooked."""
    params = [torch.nn.Parameter(torch.randn(300, device=device)), torch.nn.Parameter(torch.randn(7, 5, device=device))]
    base = torch.optim.AdamW(params, lr=1e-2)
    config = FusionConfig(state_precision=precision, min_8bit_size=0)
    opt = KitsuneOptimizer(base, enable_fusion=True, fusion_config=config)
    assert "triton" in str(opt.plan)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(device)
        opt.step()
    before = [p.detach().clone() for p in params]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    with pytest.raises(
        RuntimeError, match=r"AdamW.step\(\) ran on the optimizer a KitsuneOptimizer wraps, which holds"
    ):
        base.step()
    for p, b, st in zip(params, before, state, strict=True):
        assert torch.equal(p, b) and all(torch.equal(opt.state[p][k], v) for k, v in st.items())
    opt.step()
    assert not all(torch.equal(p, b) for p, b in zip(params, before, strict=True))

    plain = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3, device=device))])
    KitsuneOptimizer(plain, enable_fusion=True)  # fp32 state: torch's own step reads it
    assert not plain._optimizer_step_pre_hooks


@pytest.mark.parametrize("where", ["this_thread", "another_thread"])
def test_the_wrapped_optimizers_own_step_is_refused_while_another_optimizer_steps(where, device):
    """The wrapped optimizer's own step called while another KitsuneOptimizer's step runs, from that step's pre-hook
    or in another thread: refused all the same (any KitsuneOptimizer's step, anywhere, let it through and it then
    raised halfway on the bf16 state). A KitsuneOptimizer's step over it goes on."""
    params = [torch.nn.Parameter(torch.randn(30, device=device)), torch.nn.Parameter(torch.randn(7, 5, device=device))]
    base = torch.optim.AdamW(params, lr=1e-2)
    opt = KitsuneOptimizer(base, enable_fusion=True, fusion_config=FusionConfig(state_precision="bf16"))
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    q = torch.nn.Parameter(torch.randn(4, device=device))
    other = KitsuneOptimizer(torch.optim.SGD([q], lr=0.1))
    q.grad = torch.randn_like(q)
    before = [p.detach().clone() for p in params]
    refusals: list[str] = []

    def direct_step() -> None:
        try:
            base.step()
        except RuntimeError as exc:
            refusals.append(str(exc))

    if where == "this_thread":
        other.register_step_pre_hook(lambda *_: direct_step())
        other.step()
    else:
        inside, done = threading.Event(), threading.Event()

        def wait(*_: object) -> None:
            inside.set()
            assert done.wait(10)

        other.register_step_pre_hook(wait)
        thread = threading.Thread(target=other.step)
        thread.start()
        assert inside.wait(10)
        direct_step()
        done.set()
        thread.join(10)
    assert len(refusals) == 1 and "ran on the optimizer a KitsuneOptimizer wraps, which holds" in refusals[0]
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    opt.step()
    assert not any(torch.equal(p, b) for p, b in zip(params, before, strict=True))


@pytest.mark.parametrize(
    ("make", "param_dtype", "precision"),
    [
        (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9), torch.bfloat16, "fp32"),
        (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9), torch.float32, "bf16"),
        (lambda ps: torch.optim.AdamW(ps, lr=1e-2), torch.bfloat16, "fp32"),
    ],
    ids=["sgd-fp32-state", "sgd-bf16-state", "adamw-fp32-state"],
)
def test_the_wrapped_step_over_float_state_of_another_dtype_is_refused_without_calling_it_low_precision(
    make, param_dtype, precision, device
):
    """Float state of another dtype than its params (state_precision="fp32" over bf16 params, "bf16" over fp32):
    torch's foreach and fused steps, a GPU's default, take each state tensor in its param's dtype and raise, and
    Adam's family lerps the grads into it, so the wrapped optimizer's own step is refused, naming the state as it is
    (fp32 state is no low-precision state), with nothing changed."""
    params = [torch.nn.Parameter(torch.randn(300, device=device).to(param_dtype))]
    base = make(params)
    opt = KitsuneOptimizer(base, enable_fusion=True, fusion_config=FusionConfig(state_precision=precision))
    params[0].grad = torch.randn(300, device=device).to(param_dtype)
    opt.step()
    assert "triton" in str(opt.plan)
    before = params[0].detach().clone()
    with pytest.raises(
        RuntimeError, match=rf"which holds optimizer state its own step cannot read \({precision} state"
    ):
        base.step()
    assert torch.equal(params[0], before)
