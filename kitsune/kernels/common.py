"""Triton helpers the update and norm kernels share: rounding to a storage dtype, and a fixed-order reduction."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _cast(x, DTYPE: tl.constexpr, RNE_BF16: tl.constexpr):
    """fp32 -> DTYPE. Triton's CPU interpreter truncates fp32 -> bf16; the GPU rounds to nearest even. With
    RNE_BF16 (interpreter only) round explicitly, so CI checks the bits the GPU produces."""
    if RNE_BF16 and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # keep NaN a NaN
    return x.to(DTYPE)


@triton.jit
def _max_keep_nan(v):
    # tl.max may drop NaN on the GPU; adding the sum of the NaN lanes (0.0 when there are none) keeps it
    return tl.max(v, 0) + tl.sum(tl.where(v != v, v, 0.0), 0)


@triton.jit
def _reduce(ptr, n, INF_NORM: tl.constexpr, RBLOCK: tl.constexpr):
    """Sum (inf-norm: NaN-propagating max) of the fp32 values ``ptr[0:n]``, in an order that depends on ``n`` only."""
    acc = tl.zeros((RBLOCK,), tl.float32)
    for i in range(0, n, RBLOCK):
        idx = i + tl.arange(0, RBLOCK)
        # .cg reads L2, where the other programs' stores are, never a stale L1 line
        v = tl.load(ptr + idx, mask=idx < n, other=0.0, cache_modifier=".cg")
        if INF_NORM:
            acc = tl.maximum(acc, v, propagate_nan=tl.PropagateNan.ALL)
        else:
            acc += v
    if INF_NORM:
        total = _max_keep_nan(acc)
    else:
        total = tl.sum(acc, 0)
    return total
