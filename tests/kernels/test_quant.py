"""Block-wise dynamic 8-bit quantization and bf16 stochastic rounding against float64 references.

The quantization reference is the definition, written the slow way: per block ``absmax = max |x|`` (at least fp32's
smallest normal unless the block is all zero), ``r = 1 / absmax`` rounded to fp32 (torch's fp32 division on the CPU,
IEEE), ``v = x * r`` rounded to fp32 (the product of two fp32 numbers is exact in float64, then rounded once), then
the code at the smallest ``|v - code|`` over all 256 entries, a tie to the smaller ``|code|``. Codes must match it
exactly, not within a tolerance. Stochastic rounding is checked against the rule it implements (round up exactly
when the 16 dropped bits plus 16 random bits carry), for unbiasedness with a bound from the binomial variance, and
for reproducibility.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
from fractions import Fraction

import pytest
import torch
import triton
import triton.language as tl

CPU_ONLY = not torch.cuda.is_available()


@contextlib.contextmanager
def _interpreter():
    """TRITON_INTERPRET=1 while kernels are decorated (Triton decides then), as conftest does for the others."""
    saved = os.environ.get("TRITON_INTERPRET")
    if CPU_ONLY:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


with _interpreter():
    quant = importlib.import_module("kitsune.kernels.quant")
    if CPU_ONLY and not quant._INTERPRETED:  # imported earlier without the switch
        quant = importlib.reload(quant)

    @triton.jit
    def _accumulate_kernel(q_ptr, absmax_ptr, code, g_ptr, n, BLOCK: tl.constexpr, QBLOCK: tl.constexpr):
        """The fused update's pattern: dequantize a state tile, update it in registers, requantize it in place."""
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        mask = offs < n
        rows = pid * (BLOCK // QBLOCK) + tl.arange(0, BLOCK // QBLOCK).to(tl.int64)
        rmask = rows * QBLOCK < n
        q = tl.load(q_ptr + offs, mask=mask, other=0)
        s = quant._dequantize_block(q, tl.load(absmax_ptr + rows, mask=rmask, other=0.0), code, BLOCK, QBLOCK)
        s = s + tl.load(g_ptr + offs, mask=mask, other=0.0)  # padding lanes stay 0
        q, absmax = quant._quantize_block(s, code, BLOCK, QBLOCK)
        tl.store(q_ptr + offs, q, mask=mask)
        tl.store(absmax_ptr + rows, absmax, mask=rmask)

    @triton.jit
    def _absmax_pair_kernel(x_ptr, y_ptr, out_ptr, BLOCK: tl.constexpr, QBLOCK: tl.constexpr, PAIRED: tl.constexpr):
        """`_absmax_rows2` of one tile of two tensors, as the pair of int32 rows (BLOCK // QBLOCK each)."""
        offs = tl.arange(0, BLOCK)
        a, b = quant._absmax_rows2(tl.load(x_ptr + offs), tl.load(y_ptr + offs), BLOCK, QBLOCK, PAIRED)
        rows = tl.arange(0, BLOCK // QBLOCK)
        tl.store(out_ptr + rows, a)
        tl.store(out_ptr + BLOCK // QBLOCK + rows, b)

    @triton.jit
    def _random16_kernel(out_ptr, n, seed, offset, BLOCK: tl.constexpr):
        """The 16 random bits stochastic rounding adds at stream 0: the top half of ``tl.randint``."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        r = tl.randint(seed, offset + offs) >> 16
        tl.store(out_ptr + offs, r.to(tl.int32), mask=offs < n)


SIGNED = quant.dynamic_map(signed=True)
UNSIGNED = quant.dynamic_map(signed=False)
MAPS = {"signed": SIGNED, "unsigned": UNSIGNED}
INF, NAN = math.inf, math.nan


# -- the code -------------------------------------------------------------------------------------------------------


def _decode_byte(byte: int, signed: bool) -> Fraction:
    """The value of an 8-bit pattern by the bit layout: [sign], e zeros (decade 10**-e), a 1, then the fraction
    bits; the patterns with no room for the indicator bit are 0 and (the spare one) 1.0."""
    bits = 7 if signed else 8
    body = byte & ((1 << bits) - 1)
    e = bits - body.bit_length()  # leading zeros
    if e > 6:  # signed: 0000000 (+0 -> 0, -0 -> 1.0); unsigned: 00000000 -> 0, 00000001 -> 1.0
        return Fraction(1) if (byte >> 7 if signed else body) else Fraction(0)
    frac_bits = bits - 1 - e
    f = body & ((1 << frac_bits) - 1)
    v = (Fraction(1, 10) + Fraction(9, 10) * Fraction(2 * f + 1, 2 ** (frac_bits + 1))) / 10**e
    return -v if signed and byte >> 7 else v


def _fp32_neighbours(c: float) -> tuple[float, float]:
    bits = torch.tensor([c], dtype=torch.float32).view(torch.int32)
    down = (bits - 1).view(torch.float32).item() if c > 0 else (bits + 1).view(torch.float32).item()
    up = (bits + 1).view(torch.float32).item() if c > 0 else (bits - 1).view(torch.float32).item()
    return down, up


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_dynamic_map_is_the_bit_layout_rounded_to_fp32(signed):
    """Every byte decoded by the published layout, sorted: the table's entries are those 256 values, each the
    nearest fp32 (checked against both fp32 neighbours with exact fractions)."""
    code = quant.dynamic_map(signed)
    assert code.dtype == torch.float32 and code.shape == (256,)
    assert bool((code[1:] > code[:-1]).all())
    exact = sorted(_decode_byte(b, signed) for b in range(256))
    assert len(set(exact)) == 256
    for c, v in zip(code.tolist(), exact, strict=True):
        if v == 0:
            assert c == 0.0
            continue
        err = abs(Fraction(c) - v)
        assert all(err <= abs(Fraction(nb) - v) for nb in _fp32_neighbours(c))
    assert code[-1] == 1.0 and math.isclose(code[0].item(), -0.99296875 if signed else 0.0, rel_tol=1e-7)
    assert int((code < 0).sum()) == (127 if signed else 0)
    small = 0.55e-6 if signed else 0.325e-6  # the finest value: decade 10**-6, one (signed) or two fraction values
    assert math.isclose(code[code > 0].min().item(), small, rel_tol=1e-6)


# -- quantization: reference --------------------------------------------------------------------------------------


def ref_quantize(x: torch.Tensor, code: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int64, absmax float64) by the definition, in float64 on the CPU."""
    flat = x.detach().reshape(-1).cpu().double()
    code = code.cpu().double()
    n = flat.numel()
    codes, absmax = torch.empty(n, dtype=torch.int64), []
    for start in range(0, n, block):
        blk = flat[start : start + block]
        if not bool(blk.isfinite().all()):
            a, v = NAN, torch.zeros_like(blk)
        else:
            a = blk.abs().max().item()
            if a > 0:
                a = max(a, 2.0**-126)
                r = (torch.tensor(1.0) / torch.tensor(a, dtype=torch.float32)).item()  # IEEE fp32
                v = (blk * r).float().double()
            else:
                v = torch.zeros_like(blk)
        d = (v[:, None] - code[None, :]).abs()  # exact for the two neighbours that can tie
        nearest = d == d.min(1, keepdim=True).values
        codes[start : start + blk.numel()] = torch.where(nearest, code.abs(), INF).argmin(1)
        absmax.append(a)
    return codes, torch.tensor(absmax, dtype=torch.float64)


def ref_dequantize(codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, block: int) -> torch.Tensor:
    """fp32 ``code[codes] * absmax``: the product of two fp32 values is exact in float64, then rounded once."""
    flat = codes.reshape(-1).cpu().long()
    scale = absmax.cpu().double().repeat_interleave(block)[: flat.numel()]
    return (code.cpu().double()[flat] * scale).float()


def _blocks(kind: str, n: int, block: int, seed: int) -> torch.Tensor:
    """fp32 test data of ``n`` elements (the last block partial): fresh random values, never only zeros."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen)
    if kind == "outliers":  # one value 1e4 times the others in each block: the rest lands in the small decades
        idx = torch.arange(0, n, block) + torch.randint(0, min(block, n), (math.ceil(n / block),), generator=gen)
        idx = idx.clamp(max=n - 1)
        x[idx] *= 1e4
    elif kind == "decades":  # magnitudes spread over 10 decades inside each block and 40 between blocks
        x = x.sign() * 10 ** (torch.rand(n, generator=gen) * -10)
        x *= (10 ** (torch.rand(math.ceil(n / block), generator=gen) * 40 - 20)).repeat_interleave(block)[:n]
    elif kind == "subnormal":  # blocks of subnormals, above and below 2**-128 (where 1 / absmax would overflow)
        tiny = torch.tensor([1e-39, 1e-41, 1.0]).repeat(math.ceil(n / block))[: math.ceil(n / block)]
        x *= tiny.repeat_interleave(block)[:n]
    elif kind == "zero_blocks":  # a zero block in the middle and a zero tail; the others random
        x[block : 2 * block] = 0.0
        x[-(n % block or block) :] = 0.0
    return x


def _check_against_reference(x, code, block, codes, absmax):
    want_codes, want_absmax = ref_quantize(x, code, block)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert absmax.dtype == torch.float32 and absmax.shape == (math.ceil(x.numel() / block),)
    torch.testing.assert_close(absmax.cpu().double(), want_absmax, rtol=0, atol=0, equal_nan=True)
    mismatch = (codes.reshape(-1).cpu().long() != want_codes).nonzero()
    assert mismatch.numel() == 0, f"{mismatch.numel()} codes differ from the nearest, first at {mismatch[:5].tolist()}"


def _max_gap(code: torch.Tensor) -> float:
    return (code[1:].double() - code[:-1].double()).max().item()


# -- quantization: tests ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("signed", [True, False])
def test_tables_do_not_depend_on_torchs_default_dtype(signed):
    """Built while torch's default dtype was float64, the packed table read float64 thresholds as int32 words (307
    of 4096 codes one off, for the rest of the process: the tables are built once). Every table is the same fp32."""
    from kitsune.kernels import codes

    want = codes.packed_table(signed), codes.bucket_table(signed)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = codes.packed_table(signed), codes.bucket_table(signed)
    finally:
        torch.set_default_dtype(saved)
    assert torch.equal(got[0], want[0])
    assert got[1][1].dtype == torch.float32 and torch.equal(got[1][1], want[1][1])


@pytest.mark.parametrize("block", [256, 64, 2048])
@pytest.mark.parametrize("kind", ["normal", "outliers", "decades", "zero_blocks", "subnormal"])
@pytest.mark.parametrize("map_name", ["signed", "unsigned"])
def test_quantize_matches_float64_reference(map_name, kind, block, device):
    """Exact codes and absmax on 3 full blocks and a partial one; the round trip is the reference's decoded value
    and within half the table's largest gap of each element: ``|x - deq| <= absmax * (gap / 2 + 2**-22)`` (the
    2**-22: fp32 rounding of ``1 / absmax``, of ``x * (1 / absmax)`` and of ``code * absmax``, half an ulp each)."""
    code = MAPS[map_name].to(device)
    x = _blocks(kind, 3 * block + 37, block, seed=block + len(kind))
    if map_name == "unsigned":
        x = x.abs()
    x = x.to(device)
    codes, absmax = quant.quantize_blockwise(x, code, block)
    _check_against_reference(x, code, block, codes, absmax)
    deq = quant.dequantize_blockwise(codes, absmax, code, block)
    assert deq.dtype == torch.float32 and deq.shape == x.shape
    assert torch.equal(deq.cpu(), ref_dequantize(codes, absmax, code, block))
    scale = absmax.cpu().double().repeat_interleave(block)[: x.numel()]
    err = (x.cpu().double() - deq.cpu().double()).abs()
    assert bool((err <= scale * (_max_gap(code) / 2 + 2**-22) + 2**-150).all())  # 2**-150: a subnormal's half ulp
    if kind == "subnormal":  # a block of subnormals is scaled by fp32's smallest normal, and decodes finite
        assert absmax[1].item() == 2.0**-126 and bool(deq.isfinite().all())
    if kind == "zero_blocks":
        assert absmax[1].item() == 0.0 and absmax[-1].item() == 0.0
        assert bool((deq[block : 2 * block] == 0).all()) and not bool(deq.isnan().any())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_quantize_half_precision_input(dtype, device):
    x = _blocks("outliers", 700, 256, seed=3).clamp(-6e4, 6e4).to(device=device, dtype=dtype)
    codes, absmax = quant.quantize_blockwise(x, SIGNED.to(device))
    _check_against_reference(x, SIGNED, 256, codes, absmax)


@pytest.mark.parametrize("map_name", ["signed", "unsigned"])
def test_every_code_decodes_to_itself(map_name, device):
    """The table itself, in a block whose absmax is 1.0: code ``i`` quantizes to ``i`` and decodes to itself."""
    code = MAPS[map_name].to(device)
    codes, absmax = quant.quantize_blockwise(code, code)
    assert absmax.tolist() == [1.0]
    assert torch.equal(codes.cpu().long(), torch.arange(256))
    assert torch.equal(quant.dequantize_blockwise(codes, absmax, code), code)


@pytest.mark.parametrize("map_name", ["signed", "unsigned"])
def test_ties_go_toward_zero_and_one_ulp_decides(map_name, device):
    """Values exactly halfway between neighbouring codes (where that midpoint is an fp32 number) go to the code of
    smaller magnitude; one ulp either side goes to the nearer code."""
    code = MAPS[map_name]
    lo, hi = code[:-1].double(), code[1:].double()
    mid = (lo + hi) / 2
    exact = mid.float().double() == mid
    lo_i = torch.arange(255)[exact]
    mid = mid[exact].float()
    assert mid.numel() > 100
    toward_zero = torch.where(mid < 0, lo_i + 1, lo_i)
    below = torch.nextafter(mid, torch.tensor(-INF))
    above = torch.nextafter(mid, torch.tensor(INF))
    # each block of 256 starts with 1.0, so absmax is 1 and v = x exactly
    for values, want in ((mid, toward_zero), (below, lo_i), (above, lo_i + 1)):
        x = torch.cat([torch.cat([torch.ones(1), c]) for c in values.split(255)]).to(device)
        codes, absmax = quant.quantize_blockwise(x, code.to(device))
        assert bool((absmax == 1.0).all())
        keep = torch.ones(x.numel(), dtype=torch.bool)
        keep[::256] = False
        assert torch.equal(codes.cpu().long()[keep], want)
        _check_against_reference(x, code, 256, codes, absmax)


def test_nearest_is_exact_where_fp32_differences_round(device):
    """Around the smallest decades ``v - lo`` and ``hi - v`` may round in fp32 and pick the farther code. A table
    with ``±5.5000004e-07`` and ``±3.2500002e-06`` (bitsandbytes computes those entries in fp32 steps and lands one
    ulp above ours) and ``v = ±1.9000001e-06`` (5.7e-14 past the midpoint: fp32 differences call it the other way)
    still gets the nearest code."""
    small, large, v = torch.tensor([890479543, 911874708, 905905026], dtype=torch.int32).view(torch.float32)
    code = SIGNED.clone()
    code[128], code[129], code[126], code[125] = small, large, -small, -large
    x = torch.stack([torch.tensor(1.0), v, -v]).to(device)
    codes, absmax = quant.quantize_blockwise(x, code.to(device))
    assert codes.tolist() == [255, 129, 125]
    _check_against_reference(x, code, 256, codes, absmax)


def test_non_finite_blocks_decode_to_nan(device):
    """A block holding inf, -inf or nan: absmax nan, the zero code everywhere, every element decodes to nan; the
    other blocks (the partial last one included) are untouched by it."""
    x = _blocks("normal", 5 * 256 + 10, 256, seed=7)
    x[300], x[600], x[3 * 256 + 1] = INF, NAN, -INF
    x[-2] = NAN  # the partial last block
    x = x.to(device)
    code = SIGNED.to(device)
    codes, absmax = quant.quantize_blockwise(x, code)
    _check_against_reference(x, code, 256, codes, absmax)
    bad = torch.tensor([False, True, True, True, False, True])
    assert torch.equal(absmax.isnan().cpu(), bad)
    zero_code = int((SIGNED == 0).nonzero())
    deq = quant.dequantize_blockwise(codes, absmax, code).cpu()
    for b in range(6):
        blk, cblk = deq[b * 256 : (b + 1) * 256], codes[b * 256 : (b + 1) * 256].cpu()
        assert bool(blk.isnan().all()) == bool(bad[b]) and bool(blk.isnan().any()) == bool(bad[b])
        if bad[b]:
            assert bool((cblk == zero_code).all())


def test_unsigned_map_sends_negative_values_to_zero(device):
    x = _blocks("normal", 300, 256, seed=8).to(device)  # both signs
    codes, absmax = quant.quantize_blockwise(x, UNSIGNED.to(device))
    _check_against_reference(x, UNSIGNED, 256, codes, absmax)
    deq = quant.dequantize_blockwise(codes, absmax, UNSIGNED.to(device))
    assert bool((deq[x < 0] == 0).all())


def test_shapes_views_out_dtypes_and_empty(device):
    """Blocks run over the row-major elements of any shape (a non-contiguous view as its copy); ``out`` in bf16/fp16
    is the fp32 result rounded to nearest; empty tensors give empty results without a launch."""
    code = SIGNED.to(device)
    x = _blocks("outliers", 3 * 100, 64, seed=9).reshape(3, 100).to(device)
    codes, absmax = quant.quantize_blockwise(x, code, 64)
    assert codes.shape == (3, 100) and absmax.shape == (5,)
    _check_against_reference(x, code, 64, codes, absmax)
    view = x.t()
    got, want = quant.quantize_blockwise(view, code, 64), quant.quantize_blockwise(view.contiguous(), code, 64)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    deq = quant.dequantize_blockwise(codes, absmax, code, 64)
    for dtype in (torch.bfloat16, torch.float16):
        out = torch.empty(3, 100, dtype=dtype, device=device)
        assert quant.dequantize_blockwise(codes, absmax, code, 64, out=out) is out
        assert torch.equal(out.cpu(), deq.cpu().to(dtype))
    for shape in ((0,), (0, 5)):
        empty = torch.empty(shape, device=device)
        codes, absmax = quant.quantize_blockwise(empty, code)
        assert codes.shape == shape and codes.dtype == torch.uint8 and absmax.shape == (0,)
        assert quant.dequantize_blockwise(codes, absmax, code).shape == shape


def test_helpers_compose_in_registers(device):
    """A kernel that dequantizes a state tile (4 blocks of 256), adds to it and requantizes in place gives what
    the launch functions give around the same fp32 add, including the partial last block."""
    code = SIGNED.to(device)
    n = 2 * 1024 + 300
    state = _blocks("decades", n, 256, seed=10).to(device)
    g = (_blocks("normal", n, 256, seed=11) * 1e-3).to(device)
    codes, absmax = quant.quantize_blockwise(state, code)
    want = quant.dequantize_blockwise(codes, absmax, code) + g
    _accumulate_kernel[(triton.cdiv(n, 1024),)](codes, absmax, code, g, n, BLOCK=1024, QBLOCK=256)
    _check_against_reference(want, code, 256, codes, absmax)


def test_invalid_arguments_are_rejected(device):
    x = torch.randn(10, device=device)
    signed = SIGNED.to(device)
    with pytest.raises(ValueError, match="float32 \\(256,\\) table"):
        quant.quantize_blockwise(x, signed[:128])
    with pytest.raises(ValueError, match="float32 \\(256,\\) table"):
        quant.quantize_blockwise(x, signed.double())
    with pytest.raises(ValueError, match="strictly increasing"):
        quant.quantize_blockwise(x, signed.flip(0))
    with pytest.raises(ValueError, match="power of two"):
        quant.quantize_blockwise(x, signed, 100)
    with pytest.raises(ValueError, match="supports"):
        quant.quantize_blockwise(x.double(), signed)
    codes, absmax = quant.quantize_blockwise(x, signed, 16)
    with pytest.raises(ValueError, match="uint8"):
        quant.dequantize_blockwise(codes.int(), absmax, signed, 16)
    with pytest.raises(ValueError, match="ceil"):
        quant.dequantize_blockwise(codes, torch.zeros(2, device=device), signed, 16)
    with pytest.raises(ValueError, match="out must be"):
        quant.dequantize_blockwise(codes, absmax, signed, 16, out=torch.empty(11, device=device))
    with pytest.raises(ValueError, match="float32"):
        quant.stochastic_round_bf16(x.bfloat16(), seed=0)
    with pytest.raises(ValueError, match="seed"):
        quant.stochastic_round_bf16(x, seed=-1)
    with pytest.raises(ValueError, match="stream"):
        quant.stochastic_round_bf16(x, seed=0, stream=2**32)


# -- bf16 stochastic rounding -------------------------------------------------------------------------------------


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The fp32 (or bf16, widened) bit patterns as non-negative int64."""
    return x.cpu().float().view(torch.int32).long() & 0xFFFFFFFF


def _random16(n: int, seed: int, offset: int, device) -> torch.Tensor:
    out = torch.empty(n, dtype=torch.int32, device=device)
    _random16_kernel[(triton.cdiv(n, 1024),)](out, n, seed, offset, BLOCK=1024)
    return out.cpu().long()


def _mixed_values(n: int, seed: int) -> torch.Tensor:
    """fp32 values of both signs over the whole range: normal, subnormal, exact bf16 values, zeros, near the bf16
    max (where rounding up gives inf)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * 10 ** torch.randint(-30, 30, (n,), generator=gen).float()
    x[:8] = torch.tensor([0.0, -0.0, 1.0, -2.5, 1e-40, -3e-39, 3.3961e38, -3.3962e38])
    x[8:16] = x[8:16].bfloat16().float()
    return x


def test_stochastic_round_follows_the_carry_rule(device):
    """Given its 16 random bits r (the top half of ``tl.randint(seed, offset + i)``), an element rounds away from
    zero exactly when its dropped 16 bits plus r reach 2**16: so the result is one of the two bf16 neighbours, an
    exact bf16 value never moves, and the chance of rounding up is (dropped bits) / 2**16."""
    x = _mixed_values(3000, seed=12).to(device)
    seed, offset = 1234, 77
    got = _bits(quant.stochastic_round_bf16(x, seed, offset))
    bits = _bits(x)
    low, down = bits & 0xFFFF, bits & 0xFFFF0000
    carry = (low + _random16(x.numel(), seed, offset, device)) >> 16
    expected = down + (carry << 16)
    # a carry into inf from a value nearest rounding keeps finite: the nearest bf16 instead (the top of the range)
    over = ((expected & 0x7F800000) == 0x7F800000) & torch.isfinite(x.cpu())
    expected = torch.where(over, _bits(x.bfloat16()), expected)
    assert torch.equal(got, expected)
    assert bool((got[low == 0] == bits[low == 0]).all())
    assert got[6] == 0x7F800000 or got[6] == 0x7F7F0000  # the bf16 max or +inf
    ups = carry.sum().item()
    p = low.double() / 2**16
    assert abs(ups - p.sum().item()) <= 6 * math.sqrt((p * (1 - p)).sum().item())


def test_stochastic_round_special_values(device):
    x = torch.tensor([NAN, INF, -INF, 0.0, -0.0, -NAN], device=device)
    for seed in range(5):
        y = quant.stochastic_round_bf16(x, seed).float().cpu()
        assert bool(y[0].isnan()) and bool(y[5].isnan())
        assert y[1:5].tolist() == [INF, -INF, 0.0, 0.0]
        assert torch.equal(y[3:5].signbit(), torch.tensor([False, True]))


def test_stochastic_round_at_the_top_of_bf16s_range_rounds_as_nearest(device):
    """Where rounding away from zero would carry past bf16's largest finite value into inf, the nearest bf16 is the
    result: that value below half an ulp above it (a finite param stays finite), inf beyond (as nearest gives)."""
    top = torch.finfo(torch.bfloat16).max
    ulp = 2.0 ** (127 - 7)
    below_half = torch.full((4096,), top + 0.45 * ulp, device=device)
    for x in (below_half, -below_half):
        y = quant.stochastic_round_bf16(x, seed=3).float()
        assert torch.equal(y, x.bfloat16().float()), (x[0].item(), y.unique().tolist())  # never inf
    beyond_half = torch.full((4096,), top + 0.55 * ulp, device=device)  # nearest is inf: away from zero stays so
    assert set(quant.stochastic_round_bf16(beyond_half, seed=3).float().unique().tolist()) == {top, math.inf}
    inside = torch.full((4096,), top - 0.25 * ulp, device=device)  # both neighbours finite: unbiased as anywhere
    y = quant.stochastic_round_bf16(inside, seed=3).float()
    assert set(y.unique().tolist()) == {top - ulp, top}


# x = a + p * (b - a) between bf16 neighbours a, b (here a = 1, b = 1 + 2**-7, or their negatives and others)
FRACTIONS = [0.5, 19661 / 2**16, 2**-16, 1 - 2**-16, 8061 / 2**16]


@pytest.mark.parametrize("base", [1.0, -1.0, 3.0e-38, -7.5e30])
def test_stochastic_round_is_unbiased(base, device):
    """The mean of N = 2**14 rounds of the same value is the value: ``|mean - x| <= 6 sigma``, sigma = ulp *
    sqrt(p (1 - p) / N), the standard deviation of the mean of N Bernoulli(p) steps of one ulp. The seeds are fixed,
    so the check is deterministic; rounding to nearest would miss by min(p, 1 - p) ulp: 8x (p = 8061 / 2**16) to 21x
    (p = 1/2) the bound."""
    n = 2**14
    a = torch.tensor(base).bfloat16().float()
    ulp = 2.0 ** (math.frexp(a.item())[1] - 8)  # bf16: 8 significant bits
    for i, p in enumerate(FRACTIONS):
        x = torch.tensor(abs(a.item()) + p * ulp, dtype=torch.float32).copysign(a)
        assert (_bits(x) & 0xFFFF).item() == round(p * 2**16)  # p is exactly the dropped fraction
        y = quant.stochastic_round_bf16(x.expand(n).to(device), seed=100 + i, offset=i * n).cpu().double()
        assert set(y.abs().unique().tolist()) <= {abs(a.item()), abs(a.item()) + ulp}
        sigma = ulp * math.sqrt(p * (1 - p) / n)
        assert abs(y.mean().item() - x.item()) <= 6 * sigma + 1e-12 * ulp, (p, y.mean().item(), x.item())


def test_stochastic_round_reproducible_and_counter_based(device):
    """Same (seed, offset, stream): same bits; another seed or stream: other bits; element i at offset k draws what
    element i + k draws at offset 0 (one counter per element, whatever the grid)."""
    x = torch.full((4096,), 1.0 + 2**-8, device=device)  # p = 1/2: any two streams agree on about half
    first = quant.stochastic_round_bf16(x, seed=5, offset=0)
    assert torch.equal(first, quant.stochastic_round_bf16(x, seed=5, offset=0))
    for other in (
        quant.stochastic_round_bf16(x, seed=6),
        quant.stochastic_round_bf16(x, seed=5, stream=1),
        quant.stochastic_round_bf16(x, seed=5, stream=2**32 - 1),
        quant.stochastic_round_bf16(x, seed=2**40 + 5),
    ):
        agree = (other == first).double().mean().item()
        assert 0.45 < agree < 0.55, agree
    shifted = quant.stochastic_round_bf16(x[:1000], seed=5, offset=3000)
    assert torch.equal(shifted, first[3000:4000])
    high = quant.stochastic_round_bf16(x[:100], seed=5, offset=2**32)  # the counter's high word counts
    assert not torch.equal(high, first[:100])


def test_bf16_accumulation_of_small_updates(device):
    """Adding 1e-3 fifty times to 1.0 in bf16 (ulp 2**-7): rounding to nearest loses every update; stochastic
    rounding (stream = step) ends within 6 sigma of 1.05 on average over 512 elements; the Kahan pair (bf16 value +
    bf16 compensation) loses at most the rounding of the compensation, half its ulp (<= 2**-17: the remainder is
    below half an ulp of 1, 2**-8), plus fp32 rounding, per step."""
    n, steps, u = 512, 50, 1e-3
    nearest = torch.ones(n, dtype=torch.bfloat16, device=device)
    sr = nearest.clone()
    hi, lo = nearest.clone(), torch.zeros_like(nearest)
    for step in range(steps):
        nearest = (nearest.float() + u).bfloat16()
        sr = quant.stochastic_round_bf16(sr.float() + u, seed=9, stream=step)
        hi, lo = quant.split_bf16(hi.float() + lo.float() + u)
    exact = 1.0 + steps * u
    assert bool((nearest == 1.0).all())
    # each step adds an independent rounding error of variance <= ulp**2 / 4
    assert abs(sr.double().mean().item() - exact) <= 6 * 2**-7 / 2 * math.sqrt(steps / n)
    assert ((hi.double() + lo.double()) - exact).abs().max().item() <= steps * (2**-17 + 2**-22)


def test_split_bf16(device):
    """hi is the nearest bf16 (torch's CPU conversion rounds to nearest even), lo the nearest bf16 to the exact
    remainder; inf and nan get a zero remainder."""
    x = _mixed_values(2000, seed=13)
    x = x[x.abs() < 3.38e38]  # not where rounding to bf16 overflows
    x = torch.cat([x, torch.tensor([INF, -INF, NAN])])
    hi, lo = quant.split_bf16(x.to(device))
    hi, lo = hi.cpu(), lo.cpu()
    finite = x.isfinite()
    assert torch.equal(hi[:-1], x[:-1].bfloat16()) and bool(hi[-1].isnan())  # torch's nan has other bits
    assert torch.equal(lo[finite], (x[finite] - hi[finite].float()).bfloat16())
    assert lo[~finite].tolist() == [0.0, 0.0, 0.0]
    err = (x[finite].double() - hi[finite].double() - lo[finite].double()).abs()
    assert bool((err <= x[finite].double().abs() * 2**-16 + 2**-134).all())  # 2**-134: half a subnormal bf16 ulp
    assert quant.split_bf16(torch.empty(0, device=device))[0].shape == (0,)
    assert quant.stochastic_round_bf16(torch.empty(0, 3, device=device), 0).shape == (0, 3)


# -- GPU only -----------------------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_one_tensor_over_2_31_elements():
    """int64 offsets end to end: 2**31 + 300 fp32 elements (~20 GB with codes and the decoded copy); the blocks past
    2**31 match the reference, and stochastic rounding there draws the counters its offset says."""
    n = 2**31 + 300
    if torch.cuda.mem_get_info()[0] < 11 * n + 2**30:
        pytest.skip("needs ~25 GB of free GPU memory")
    device = torch.device("cuda")
    code = SIGNED.to(device)
    x = torch.ones(n, device=device)
    tail = _blocks("outliers", 3 * 256 + 44, 256, seed=14)  # the last 3 full blocks and the partial one
    x[-tail.numel() :] = tail.to(device)
    codes, absmax = quant.quantize_blockwise(x, code)
    assert absmax.numel() == 2**31 // 256 + 2
    assert torch.equal(absmax[:4].cpu(), torch.ones(4)) and bool((codes[:1024] == 255).all())
    start = n - tail.numel()
    _check_against_reference(tail, SIGNED, 256, codes[start:], absmax[start // 256 :])
    deq = quant.dequantize_blockwise(codes, absmax, code)
    assert torch.equal(deq[start:].cpu(), ref_dequantize(codes[start:], absmax[start // 256 :], SIGNED, 256))
    del deq
    y = quant.stochastic_round_bf16(x, seed=1)[start:]
    assert torch.equal(y, quant.stochastic_round_bf16(x[start:], seed=1, offset=start))
    down = _bits(tail) & 0xFFFF0000
    assert bool(((_bits(y) == down) | (_bits(y) == down + 0x10000)).all())


def _hard_values(signed: bool) -> torch.Tensor:
    """Every code, every midpoint between two neighbours, powers of 2 and of 10 (bucket and decade edges), each
    nudged by 0-3 fp32 ulps either way, 0, +-1, and random values spread over 30 binades."""
    table = quant.dynamic_map(signed)
    mids = ((table[1:].double() + table[:-1].double()) / 2).float()
    bounds = torch.tensor([2.0**-k for k in range(40)] + [10.0**-k for k in range(1, 9)] + [0.0])
    base = torch.cat([table, mids, bounds, -bounds, -mids] if signed else [table, mids, bounds])
    values = [base]
    for k in (1, 2, 3):
        up, down = base.clone(), base.clone()
        for _ in range(k):
            up, down = torch.nextafter(up, torch.tensor(2.0)), torch.nextafter(down, torch.tensor(-2.0))
        values += [up, down]
    gen = torch.Generator().manual_seed(11)
    spread = torch.rand(8192, generator=gen) ** torch.randint(1, 30, (8192,), generator=gen).float()
    values.append(spread * torch.where(torch.rand(8192, generator=gen) < 0.5, -1.0, 1.0) if signed else spread)
    return torch.cat(values).clamp(-1.0 if signed else 0.0, 1.0)


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_the_bucket_tables_find_the_codes_the_binary_search_finds(signed, device):
    """The fused update's nearest code for bitsandbytes' maps (`_nearest_bucketed`: one table read) is exactly the
    binary search's, ties included, on the values where a bucket could slip; and the tables hold their premise (at
    most one boundary between codes in a bucket: `bucket_table` checks it as it builds them)."""
    values = _hard_values(signed).to(device)
    per = quant.QUANT_BLOCK - 1  # every block: 1.0 first, so its absmax is 1.0 and v is the value itself
    rows = -(-values.numel() // per)
    body = torch.zeros(rows * per, device=device)
    body[: values.numel()] = values
    x = torch.cat((torch.ones(rows, 1, device=device), body.view(rows, per)), dim=1)
    code = quant.dynamic_map(signed).to(device)
    fast, _ = quant.quantize_blockwise(x, code)
    slow, _ = quant.quantize_blockwise(x, code, search=True)
    assert torch.equal(fast, slow), x[fast != slow][:8]
    ref, _ = ref_quantize(x.view(-1).cpu(), code.cpu(), quant.QUANT_BLOCK)
    assert torch.equal(slow.view(-1).cpu(), ref)


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_the_packed_table_decides_as_the_bucket_and_threshold_tables(signed):
    """`packed_table` holds each bucket's candidate code and, as 16 low bits, the threshold to the next code: within a
    bucket both the packed comparison and ``a >= thresholds[c]`` are monotone in ``a``, so they agree everywhere when
    they agree at every bucket's edges and on both sides of every threshold; below the first bucket (clamped into
    it) the packed word never moves to the next code."""
    from kitsune.kernels import codes

    buckets, thresholds = codes.bucket_table(signed)
    packed = codes.packed_table(signed).long()
    cand = buckets.long()
    t = thresholds.view(torch.int32).long()[cand]
    edge = (torch.arange(codes.BUCKETS) + (codes.BUCKET_EXP_MIN << codes.BUCKET_BITS)) << (23 - codes.BUCKET_BITS)
    probes = [edge, edge + 0xFFFF]  # each bucket's lowest and highest fp32
    inside = (t >> 16) == (edge >> 16)
    boundaries = thresholds[(127 if signed else 0) : -1].view(torch.int32).long()  # between codes >= 0
    on_edge = torch.isin(boundaries, edge)  # the next bucket's candidate is already past it
    assert int(inside.sum()) + int(on_edge.sum()) == len(boundaries)  # every boundary is in one bucket or on an edge
    for d in (-1, 0, 1):
        probes.append(torch.where(inside, t + d, edge).clamp(edge, edge + 0xFFFF))
    bits = torch.cat(probes)
    b = ((bits >> 16) - (codes.BUCKET_EXP_MIN << codes.BUCKET_BITS)).clamp(0, codes.BUCKETS - 1)
    a = bits.to(torch.int32).view(torch.float32)
    want = cand[b] + (a >= thresholds[cand[b]]).long()
    word = packed[b]
    got = ((word >> 24) & 0xFF) + ((bits & 0xFFFF) >= (word & 0x1FFFF)).long()
    assert torch.equal(got, want)
    tiny = torch.tensor([2.0**-40, 2.0**-33, 1e-12]).view(torch.int32).long()  # clamped into bucket 0
    word = packed[0]
    assert bool((((word >> 24) & 0xFF) + ((tiny & 0xFFFF) >= (word & 0x1FFFF)).long() == cand[0]).all())
    assert int(cand[0]) == (127 if signed else 0)  # the zero code


def test_a_pair_of_absmax_reductions_is_the_two_single_ones(device):
    """`_absmax_rows2` reduces two tiles' blocks in one reduction (`PAIRED`, as on a GPU) or in two (the CPU
    interpreter's default): both give each block's largest |x| as int32 bits, a nan above every inf, a zero block 0,
    the sign ignored, on four blocks of fresh random data with those cases planted."""
    gen = torch.Generator().manual_seed(5)
    block, qblock = 1024, 256
    x = torch.randn(block, generator=gen) * torch.rand(block, generator=gen).pow(4) * 1e3
    y = -torch.rand(block, generator=gen) * 1e-20
    x[qblock : 2 * qblock] = 0.0
    x[2 * qblock + 7] = -INF
    y[3 * qblock + 9] = NAN
    y[2 * qblock : 3 * qblock] = -0.0
    bits = [torch.stack([t.abs().view(4, qblock).view(torch.int32).max(1).values for t in (x, y)]).view(-1)]
    for paired in (True, False):
        out = torch.empty(8, dtype=torch.int32, device=device)
        _absmax_pair_kernel[(1,)](x.to(device), y.to(device), out, BLOCK=block, QBLOCK=qblock, PAIRED=paired)
        bits.append(out.cpu())
    want = bits[0]
    assert want[1] == 0 and want[2] == 0x7F800000 and want[6] == 0 and want[7] >= 0x7F800000
    for got in bits[1:]:
        assert torch.equal(got, want), (got, want)
