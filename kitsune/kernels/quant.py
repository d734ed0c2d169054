"""Low-precision optimizer state (issue #28): block-wise dynamic 8-bit quantization and bf16 stochastic rounding.

**The 8-bit code** is bitsandbytes' "dynamic tree" map (Dettmers et al. 2022, *8-bit Optimizers via Block-wise
Quantization*; Dettmers 2016 for the data type). A byte is a sign bit (signed map only), then ``e`` zeros that give
the decimal exponent ``10**-e`` (``e`` = 0..6), an indicator bit 1, and the remaining bits a linear fraction: the
``F`` fraction values of a decade are the midpoints of ``F`` equal intervals of ``[0.1, 1]``. Each leading zero
trades a fraction bit for range, so values near the block's absmax get 6 (signed) or 7 (unsigned) fraction bits and
the map still reaches ``5.5e-7`` (signed) or ``3.25e-7`` (unsigned) of it. The patterns that carry no fraction value
are 0 and 1.0. `dynamic_map` builds the 256 values (signed, for ``exp_avg``: 127 negative, 0, 127 positive below 1,
and 1.0; unsigned, for ``exp_avg_sq``: 0, 254 values in ``(0, 1)``, and 1.0) and sorts them, so a code is an index
into the sorted table, as bitsandbytes stores it. Each entry is the exact value rounded once to fp32; bitsandbytes
computes its table in fp32 steps, so an entry may differ from its ``qmap`` in the last bit: a bitsandbytes
checkpoint carries its table, and the helpers here take any sorted 256-entry fp32 table.

**Blocks.** Each block of ``QUANT_BLOCK = 256`` consecutive elements of a tensor (bitsandbytes' block size for
optimizer state) is stored as 256 codes and one fp32 absmax: 8.125 bits per element. The last block of a tensor may be
partial; its absmax covers only the tensor's elements.

**Quantize** (`_quantize_block`): ``absmax = max |x|`` per block (at least `MIN_SCALE` when the block is not all
zero), ``v = x * (1 / absmax)``: one IEEE reciprocal a block (``div_rn``) and one IEEE product an element, so the CPU
interpreter and the GPU give the same bits. bitsandbytes' kernel multiplies by the reciprocal too; a division an
element made the fused 8-bit AdamW step 4% slower on an H200. ``v`` is within an ulp of the quotient ``x / absmax``
(and ``|v|`` at most ``1 + 2**-23``). Then the index of the code nearest to ``v``: a binary search
over the sorted table finds the largest code ``<= v`` and one exact comparison (``2 v`` against the sum of the two
neighbours, in fp64 where both are exact) picks between it and the next. A tie goes to the code of smaller magnitude
(toward zero: a tie never inflates the state). For bitsandbytes' two maps the fused update finds the same code in one
read of a small table and no fp64 (`_nearest_bucketed`): the bucket of ``|v|``'s exponent and top mantissa bits names
a candidate and the smallest fp32 above the exact midpoint to its next code, and one comparison with it settles it.
The fused update quantizes one block at a time, in a loop over a program's blocks (`kitsune.fusion.planner.Q8_PROGRAM`),
so the program's per-tensor work is paid once for many blocks; the absmax of a slot pair (Adam's two moments) comes
from one reduction. Special cases, decided per block:

* an all-zero block (or a tail of padding) has absmax 0 and every code is the code nearest 0 (0 in both maps):
  it decodes to exact zeros, no ``0 / 0``;
* a block holding an inf or nan stores absmax nan and the zero code everywhere, so every element of that block
  decodes to nan: a signal, not a value. The fused update skips a step with inf/nan grads under AMP before it
  touches the state, so this only happens when the state itself has diverged.

**Dequantize** (`_dequantize_block`): ``table[code] * absmax`` in fp32. Per element, ``|x - deq(q(x))| <= absmax *
(largest gap of the table) / 2`` up to the fp32 roundings of ``v`` (two) and of the product.

**bf16 stochastic rounding** (`_stochastic_round_bf16`): an fp32 ``x`` between the bf16 neighbours ``a`` and ``b``
(``|a| <= |x| < |b|``) becomes ``b`` with probability ``(x - a) / (b - a)``, so ``E[round(x)] = x``: add 16 random
bits to the 16 bits bf16 drops and truncate. The bits come from Philox (``tl.philox``, Triton's counter-based
generator) keyed by ``seed``, with the element's 64-bit counter in the first two counter words and a 32-bit
``stream`` in the third: the same ``(seed, stream, counter)`` gives the same bits on every run, grid and device, and
with ``stream = 0`` they are ``tl.randint(seed, counter)``. The fused update will pass the step as the stream and the
element's offset in the flat state as the counter, so a step is reproducible from ``(seed, step)`` alone. nan stays
nan, infinities and zeros keep their sign; a value within one bf16 ulp of the largest finite bf16 may round to inf.
`_split_bf16` is the cheap alternative with no randomness: a bf16 value plus a bf16 compensation (Kahan summation,
the remainder carried to the next step in a second bf16 buffer).

The helpers take a block of fp32 values already in registers, as the fused update has them between its load and its
store; the launch functions below (checkpoint conversion, tests) wrap each in a one-tensor kernel with int64 offsets.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kitsune.kernels import codes as _tables
from kitsune.kernels import common as _common
from kitsune.kernels.codes import (  # noqa: F401  (CODE_SIZE, MIN_SCALE, QUANT_BLOCK, dynamic_map: re-exported)
    BUCKET_BITS,
    BUCKET_EXP_MIN,
    CODE_SIZE,
    MIN_SCALE,
    QUANT_BLOCK,
    dynamic_map,
)
from kitsune.kernels.common import TL_DTYPES, _cast

TILE = 1024
"""Elements a program of the launch functions works on (several quantization blocks when ``block`` is smaller)."""
_MAX_BLOCK = 4096


# -- the helpers the fused update calls --------------------------------------------------------------------------


@triton.jit
def _nearest_code(v, code):
    """Index (int32) of the entry of the sorted fp32 table ``code`` (256 entries) nearest to ``v``; a tie goes to
    the entry of smaller magnitude. ``v`` must not be nan (it would get index 0)."""
    idx = tl.zeros(v.shape, tl.int32)
    lo = tl.zeros(v.shape, tl.float32) + tl.load(code)
    for k in tl.static_range(7, -1, -1):  # 8 halvings: idx becomes the largest index with code[idx] <= v (or 0)
        probe = idx + (1 << k)
        c = tl.load(code + probe)
        take = c <= v
        idx = tl.where(take, probe, idx)
        lo = tl.where(take, c, lo)
    hi = tl.load(code + tl.minimum(idx + 1, 255))
    # v - lo and hi - v may round in fp32 near a decade boundary; 2 v and lo + hi are exact in fp64
    twice = 2.0 * v.to(tl.float64)
    mid2 = lo.to(tl.float64) + hi.to(tl.float64)
    up = (twice > mid2) | ((twice == mid2) & (v < 0.0))
    return tl.where(up & (idx < 255), idx + 1, idx)


_FIRST_BUCKET = tl.constexpr(BUCKET_EXP_MIN << BUCKET_BITS)
_FRAC_SHIFT = tl.constexpr(23 - BUCKET_BITS)
_MIN_SCALE = tl.constexpr(MIN_SCALE)


@triton.jit
def _nearest_bucketed(v, packed, SIGNED: tl.constexpr):
    """`_nearest_code` for ``code`` = `dynamic_map` (``SIGNED`` or not) and ``|v| < 2`` in one table read instead
    of nine: the bucket of ``|v|``'s exponent and top mantissa bits gives the nearest code ``c`` of its lower edge,
    and a comparison with the smallest fp32 above the exact midpoint of ``code[c]`` and ``code[c + 1]`` decides
    between ``c`` and ``c + 1`` (`kitsune.kernels.codes.bucket_table`); `kitsune.kernels.codes.packed_table` holds
    both in one word a bucket, the threshold as the low 16 bits it differs in. A negative ``v`` takes the mirrored
    code (the signed map's negative half is the positive half's mirror, less 1.0); the unsigned map sends it to 0,
    as the search does."""
    bits = tl.abs(v).to(tl.int32, bitcast=True)
    # the exponent and the top mantissa bits, side by side in the bits of |v|: (e << BUCKET_BITS) + frac, at least
    # the first bucket's; the table's first entry is its (BUCKET_EXP_MIN << BUCKET_BITS)-th word
    b = tl.maximum(bits >> _FRAC_SHIFT, _FIRST_BUCKET)
    word = tl.load(packed - _FIRST_BUCKET + b)
    c = (word.to(tl.uint32, bitcast=True) >> 24).to(tl.int32) + ((bits & 0xFFFF) >= (word & 0x1FFFF)).to(tl.int32)
    if SIGNED:
        c = tl.where(v < 0.0, tl.maximum(254 - c, 0), c)
    else:
        c = tl.where(v < 0.0, 0, c)
    return c


@triton.jit
def _max2(a, b, c, d):
    return tl.maximum(a, c), tl.maximum(b, d)


@triton.jit
def _magnitude_bits(x, BLOCK: tl.constexpr, QBLOCK: tl.constexpr):
    """The bits of ``|x|`` as int32, (BLOCK // QBLOCK, QBLOCK): for non-negative floats the integer order is the
    float order, and every nan sorts above inf."""
    return tl.reshape(x, (BLOCK // QBLOCK, QBLOCK)).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _absmax_rows(x, BLOCK: tl.constexpr, QBLOCK: tl.constexpr):
    """The bits of each quantization block's absmax, (BLOCK // QBLOCK,) int32 (`_magnitude_bits`): ``>= 0x7F800000``
    for a block holding inf or nan."""
    return tl.max(_magnitude_bits(x, BLOCK, QBLOCK), 1)


_INTERPRETED = type(_max2).__name__ == "InterpretedFunction"
"""Whether this module's kernels run in Triton's CPU interpreter (decided when they were decorated)."""
_PAIRED = tl.constexpr(not _INTERPRETED)
"""Whether `_absmax_rows2` reduces its pair in one reduction: not in Triton's CPU interpreter, which runs a reduction
with a combine function element by element in Python (about 4x the time of two `tl.max`, which it runs in numpy)."""


@triton.jit
def _absmax_rows2(x, y, BLOCK: tl.constexpr, QBLOCK: tl.constexpr, PAIRED: tl.constexpr = _PAIRED):
    """`_absmax_rows` of two blocks at once: one reduction, so the warps of a program exchange them in one round
    (with PAIRED; else two, the same bits)."""
    if PAIRED:
        return tl.reduce((_magnitude_bits(x, BLOCK, QBLOCK), _magnitude_bits(y, BLOCK, QBLOCK)), 1, _max2)
    return _absmax_rows(x, BLOCK, QBLOCK), _absmax_rows(y, BLOCK, QBLOCK)


@triton.jit
def _quantize_rows(
    x, bits, code, BLOCK: tl.constexpr, QBLOCK: tl.constexpr, packed=None, BUCKETED: tl.constexpr = 0
):  # fmt: skip
    """`_quantize_block` of ``x`` given its blocks' absmax bits (`_absmax_rows`)."""
    ROWS: tl.constexpr = BLOCK // QBLOCK
    bad = bits >= 0x7F800000  # inf or nan in the block
    # the block's scale: its absmax, at least fp32's smallest normal (so its reciprocal is finite); an all-zero or
    # non-finite block's 1, whose reciprocal is exact
    scale = tl.where((bits > 0) & ~bad, tl.maximum(bits.to(tl.float32, bitcast=True), _MIN_SCALE), 1.0)
    v = tl.reshape(x, (ROWS, QBLOCK)) * tl.math.div_rn(1.0, scale)[:, None]
    v = tl.where(bad[:, None], 0.0, v)  # a non-finite block: the zero code everywhere, absmax nan below
    v = tl.reshape(v, (BLOCK,))  # the table reads in the tile's own layout (a 2-D read may get another one)
    if BUCKETED:
        q = _nearest_bucketed(v, packed, BUCKETED == 1)
    else:
        q = _nearest_code(v, code)
    return q.to(tl.uint8), tl.where(bad, float("nan"), tl.where(bits > 0, scale, 0.0))


@triton.jit
def _quantize_block(
    x, code, BLOCK: tl.constexpr, QBLOCK: tl.constexpr, packed=None, BUCKETED: tl.constexpr = 0
):  # fmt: skip
    """``(codes, absmax)`` of the fp32 block ``x`` ((BLOCK,), BLOCK a multiple of QBLOCK, in quantization blocks of
    QBLOCK elements from its first element; padding lanes must hold 0): codes (BLOCK,) uint8, indices into the
    sorted 256-entry fp32 table at ``code``; absmax (BLOCK // QBLOCK,) fp32, nan for a block holding inf or nan.
    ``BUCKETED`` 1 (signed) or 2 (unsigned): ``code`` is that `dynamic_map` and ``packed`` its
    `kitsune.kernels.codes.packed_table` (`_nearest_bucketed`); 0: any table, a binary search. The codes are the
    same."""
    return _quantize_rows(x, _absmax_rows(x, BLOCK, QBLOCK), code, BLOCK, QBLOCK, packed, BUCKETED)


@triton.jit
def _dequantize_block(q, absmax, code, BLOCK: tl.constexpr, QBLOCK: tl.constexpr):
    """The fp32 block (BLOCK,) that the codes ``q`` (BLOCK,) and ``absmax`` (BLOCK // QBLOCK,) stand for (the
    layout of `_quantize_block`): ``code[q] * absmax`` of its quantization block."""
    ROWS: tl.constexpr = BLOCK // QBLOCK
    v = tl.reshape(tl.load(code + q.to(tl.int32)), (ROWS, QBLOCK))
    return tl.reshape(v * absmax[:, None], (BLOCK,))


@triton.jit
def _bf16_from_bits(bits):
    """The bf16 whose bits are the high half of the uint32 ``bits``: a bitcast, exact for subnormals too (Triton's
    CPU interpreter converts fp32 subnormals to bf16 wrongly)."""
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _rne_bits(x):
    """The bits (uint32, low half zero) of fp32 ``x`` rounded to the nearest bf16, ties to even; nan stays nan."""
    bits = x.to(tl.uint32, bitcast=True)
    return tl.where(x != x, 0x7FC00000, (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000)


@triton.jit
def _stochastic_round_bf16(x, seed, stream, counter):
    """fp32 ``x`` -> bf16, rounded away from zero with probability (dropped 16 bits) / 2**16, else toward zero, so
    ``E[result] = x`` (but at the top of bf16's range: where rounding away would give inf, the nearest bf16). The
    random bits: Philox keyed by ``seed`` (int, >= 0) at counter ``(counter, stream)``; ``counter`` is an int64 block
    like ``x`` (the element's position in its stream), ``stream`` a scalar in ``[0, 2**32)`` (the step)."""
    counter = counter.to(tl.int64)
    lo = counter.to(tl.uint32)
    zero = lo * 0
    words = (counter * 0 + stream).to(tl.uint32)  # the scalar as a block (tl.to_tensor is the interpreter's only)
    r, _, _, _ = tl.philox(seed, lo, (counter >> 32).to(tl.uint32), words, zero)
    bits = x.to(tl.uint32, bitcast=True) + (r >> 16)  # a carry out of the low half bumps the magnitude by one ulp
    # a carry past bf16's largest finite value: the nearest bf16 instead (that value, or inf where x is beyond half
    # an ulp above it, as rounding to nearest gives), never an inf out of a value nearest rounding keeps finite
    over = ((bits & 0x7F800000) == 0x7F800000) & (tl.abs(x) < float("inf"))
    bits = tl.where(over, _rne_bits(x), bits)
    return _bf16_from_bits(tl.where(x != x, 0x7FC00000, bits))


@triton.jit
def _split_bf16(x):
    """``(hi, lo)``: bf16 ``hi`` nearest to fp32 ``x`` and bf16 ``lo`` nearest to the remainder ``x - hi`` (exact in
    fp32), so ``hi + lo`` holds ~16 significant bits; ``lo`` is 0 when ``hi`` is inf or nan."""
    hi = _rne_bits(x)
    h = hi.to(tl.float32, bitcast=True)
    finite = tl.abs(h) < float("inf")
    rest = tl.where(finite, x - tl.where(finite, h, 0.0), 0.0)  # never inf - inf
    return _bf16_from_bits(hi), _bf16_from_bits(_rne_bits(rest))


# -- one-tensor kernels and their launch functions (checkpoint conversion, tests) ---------------------------------


@triton.jit
def _quantize_kernel(
    x_ptr, q_ptr, absmax_ptr, code, n, packed, BLOCK: tl.constexpr, QBLOCK: tl.constexpr, BUCKETED: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)  # int64: tensors over 2**31 elements
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q, absmax = _quantize_block(x, code, BLOCK, QBLOCK, packed, BUCKETED)
    tl.store(q_ptr + offs, q, mask=mask)
    rows = pid * (BLOCK // QBLOCK) + tl.arange(0, BLOCK // QBLOCK).to(tl.int64)
    tl.store(absmax_ptr + rows, absmax, mask=rows * QBLOCK < n)


@triton.jit
def _dequantize_kernel(
    q_ptr, absmax_ptr, code, out_ptr, n, DTYPE: tl.constexpr, RNE_BF16: tl.constexpr, BLOCK: tl.constexpr,
    QBLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < n
    q = tl.load(q_ptr + offs, mask=mask, other=0)
    rows = pid * (BLOCK // QBLOCK) + tl.arange(0, BLOCK // QBLOCK).to(tl.int64)
    absmax = tl.load(absmax_ptr + rows, mask=rows * QBLOCK < n, other=0.0)
    x = _dequantize_block(q, absmax, code, BLOCK, QBLOCK)
    tl.store(out_ptr + offs, _cast(x, DTYPE, RNE_BF16), mask=mask)


@triton.jit
def _round_bf16_kernel(x_ptr, hi_ptr, lo_ptr, n, seed, offset, stream, STOCHASTIC: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if STOCHASTIC:
        tl.store(hi_ptr + offs, _stochastic_round_bf16(x, seed, stream, offset + offs), mask=mask)
    else:
        hi, lo = _split_bf16(x)
        tl.store(hi_ptr + offs, hi, mask=mask)
        tl.store(lo_ptr + offs, lo, mask=mask)


def _check_code(code: torch.Tensor, device: torch.device) -> torch.Tensor:
    if code.dtype != torch.float32 or code.shape != (CODE_SIZE,):
        raise ValueError(f"code must be a float32 ({CODE_SIZE},) table, got {code.dtype} {tuple(code.shape)}")
    if code.device != device:
        raise ValueError(f"code is on {code.device}, the data on {device}: move the table with code.to(device)")
    if not bool((code[1:] > code[:-1]).all()):  # one host sync: a boundary check, not the training loop
        raise ValueError("code must be sorted in strictly increasing order (as dynamic_map returns it)")
    return code.contiguous()


def _check_block(block: int) -> None:
    if block < 16 or block > _MAX_BLOCK or block & (block - 1):
        raise ValueError(f"block must be a power of two from 16 to {_MAX_BLOCK}, got {block}")


def _grid(n: int, block: int) -> tuple[tuple[int], int]:
    tile = max(block, TILE)
    return (_common.cdiv(n, tile),), tile


def quantize_blockwise(
    x: torch.Tensor, code: torch.Tensor, block: int = QUANT_BLOCK, *, search: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, absmax)``: ``x`` (fp32, bf16 or fp16, any shape) in blocks of ``block`` consecutive elements,
    each an fp32 absmax and uint8 indices into ``code`` (sorted, 256 fp32 entries, on ``x``'s device; see
    `dynamic_map`). ``codes`` has ``x``'s shape, ``absmax`` is ``(ceil(numel / block),)``; blocks run over the
    elements in row-major order. A block holding inf or nan gets absmax nan (it decodes to nan); an all-zero block
    absmax 0. A value below the table's first entry gets code 0 (with the unsigned map: a negative value decodes
    to 0). For either `dynamic_map` the codes come from its bucket table (`_nearest_bucketed`), for any other
    table (or with ``search``) from a binary search: the same codes."""
    if x.dtype not in TL_DTYPES:
        raise ValueError(f"quantize_blockwise supports {tuple(TL_DTYPES)}, got {x.dtype}")
    _check_block(block)
    code = _check_code(code, x.device)
    n = x.numel()
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    absmax = torch.empty(_common.cdiv(n, block), dtype=torch.float32, device=x.device)
    if n:
        grid, tile = _grid(n, block)
        kind = 0 if search else next((k for k, signed in ((1, True), (2, False)) if _is_map(code, signed)), 0)
        signed = kind == 1
        packed = _tables.packed(signed, x.device) if kind else code
        _quantize_kernel[grid](
            x.contiguous().view(-1), codes, absmax, code, n, packed, BLOCK=tile, QBLOCK=block, BUCKETED=kind,
            enable_fp_fusion=_common.FP_FUSION,
        )  # fmt: skip
    return codes, absmax


def _is_map(code: torch.Tensor, signed: bool) -> bool:
    return torch.equal(code, _tables.code(signed, code.device))


def dequantize_blockwise(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    code: torch.Tensor,
    block: int = QUANT_BLOCK,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The values `quantize_blockwise` encoded: ``code[codes] * absmax`` of each element's block, in fp32 or in
    ``out``'s dtype (fp32, bf16, fp16; contiguous, ``codes``' shape), rounded to nearest."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    _check_block(block)
    code = _check_code(code, codes.device)
    n = codes.numel()
    if absmax.dtype != torch.float32 or absmax.numel() != _common.cdiv(n, block) or absmax.device != codes.device:
        raise ValueError(
            f"absmax must be float32 with ceil({n} / {block}) = {_common.cdiv(n, block)} elements on {codes.device}, "
            f"got {absmax.dtype} with {absmax.numel()} on {absmax.device}"
        )
    if out is None:
        out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    elif (
        out.shape != codes.shape or out.dtype not in TL_DTYPES or not out.is_contiguous() or out.device != codes.device
    ):
        raise ValueError(
            f"out must be a contiguous {tuple(TL_DTYPES)} tensor of shape {tuple(codes.shape)} on {codes.device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if n:
        grid, tile = _grid(n, block)
        _dequantize_kernel[grid](
            codes.contiguous().view(-1), absmax.contiguous().view(-1), code, out, n, DTYPE=TL_DTYPES[out.dtype],
            RNE_BF16=_INTERPRETED, BLOCK=tile, QBLOCK=block, enable_fp_fusion=_common.FP_FUSION,
        )  # fmt: skip
    return out


def _check_fp32(x: torch.Tensor, name: str) -> None:
    if x.dtype != torch.float32:
        raise ValueError(f"{name} rounds float32 values, got {x.dtype}")


def stochastic_round_bf16(x: torch.Tensor, seed: int, offset: int = 0, *, stream: int = 0) -> torch.Tensor:
    """fp32 ``x`` rounded to bf16 stochastically (``E[result] = x``), element ``i`` (row-major) drawing Philox's
    bits at counter ``offset + i`` of stream ``stream`` under key ``seed``: the same arguments give the same bits."""
    _check_fp32(x, "stochastic_round_bf16")
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    if not 0 <= stream < 2**32:
        raise ValueError(f"stream must be in [0, 2**32), got {stream}")
    if offset < 0 or offset + x.numel() > 2**63:
        raise ValueError(f"offset must be >= 0 with offset + numel <= 2**63, got {offset}")
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    if x.numel():
        _round_bf16_kernel[(_common.cdiv(x.numel(), TILE),)](
            x.contiguous().view(-1), out, out, x.numel(), seed, offset, stream, STOCHASTIC=True, BLOCK=TILE,
            enable_fp_fusion=_common.FP_FUSION,
        )  # fmt: skip
    return out


def split_bf16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hi, lo)``: fp32 ``x`` as bf16 ``hi`` (round to nearest even) plus the bf16 remainder ``lo`` (a Kahan
    compensation; 0 where ``hi`` is inf or nan)."""
    _check_fp32(x, "split_bf16")
    hi = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    lo = torch.empty_like(hi)
    if x.numel():
        _round_bf16_kernel[(_common.cdiv(x.numel(), TILE),)](
            x.contiguous().view(-1), hi, lo, x.numel(), 0, 0, 0, STOCHASTIC=False, BLOCK=TILE,
            enable_fp_fusion=_common.FP_FUSION,
        )  # fmt: skip
    return hi, lo
