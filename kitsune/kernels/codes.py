"""The 8-bit state's code tables and block size, importable without Triton (see `kitsune.kernels.quant`)."""

from __future__ import annotations

import math
from fractions import Fraction

import torch

QUANT_BLOCK = 256
"""Elements per absmax: bitsandbytes' block size for 8-bit optimizer state (8.125 bits per element)."""
CODE_SIZE = 256
"""Entries of a code table: one per 8-bit code."""
MIN_SCALE = 2.0**-126
"""The smallest absmax of a block that is not all zero: fp32's smallest normal. A block whose largest magnitude is
below it (every element subnormal) is scaled by it instead, so ``1 / absmax`` is finite and exact (2**126)."""
CODES_ALIGN = 16
"""Bytes the address of a tensor of 8-bit codes is a multiple of: the fused update reads codes a 4-byte word at a time
(`kitsune.kernels.update._q8_raw`), so a word never straddles two tensors' bytes in a way that breaks the byte order,
and a masked word read never leaves the allocation; its vector layout reads a thread's 8 codes as one vector, which
needs 16 (`kitsune.kernels.common.VECTOR_ALIGN`)."""


def dynamic_map(signed: bool = True) -> torch.Tensor:
    """bitsandbytes' dynamic tree map as a sorted ``(256,)`` fp32 CPU tensor: in ``[-1, 1]`` when ``signed`` (for
    state of either sign, Adam's ``exp_avg``), in ``[0, 1]`` otherwise (non-negative state, ``exp_avg_sq``).

    Decade ``10**-e`` (``e`` leading zeros after the sign bit, ``e = 0..6``) holds ``F = 2**(6 - e)`` values (signed)
    or ``2**(7 - e)`` (unsigned; one more fraction bit without a sign bit): the midpoints of ``F`` equal intervals of
    ``[0.1, 1]``, times ``10**-e``. Add 0 and 1.0 and there are 256. Each value is exact (a `Fraction`) until it is
    rounded to the nearest fp32.
    """
    values = [Fraction(0), Fraction(1)]
    for e in range(7):
        n = 2 ** ((6 if signed else 7) - e)
        for f in range(n):
            v = (Fraction(1, 10) + Fraction(9, 10) * Fraction(2 * f + 1, 2 * n)) / 10**e
            values += [v, -v] if signed else [v]
    return torch.tensor([_nearest_fp32(v) for v in sorted(values)], dtype=torch.float32)


def _nearest_fp32(v: Fraction) -> float:
    """``v`` rounded to the nearest fp32 (ties to even): ``float(v)`` first would round twice."""
    a = abs(v)
    if a == 0:
        return 0.0
    e = math.frexp(float(a))[1]  # 2**(e - 1) <= a < 2**e, unless float(a) rounded up to 2**e
    e -= Fraction(2) ** (e - 1) > a
    ulp = Fraction(2) ** (e - 24)
    q, r = divmod(a, ulp)
    q += (r > ulp / 2) or (r == ulp / 2 and q % 2 == 1)
    return math.copysign(float(q * ulp), v)  # exact: q * ulp has at most 25 significant bits, and fits a double


BUCKET_EXP_MIN = 95
"""The smallest fp32 exponent (biased) `bucket_table` resolves: magnitudes under 2**-32 all share its first bucket,
which is far below the smallest code's half (about 1.6e-7 of the absmax), so their nearest code is 0."""
BUCKET_BITS = 7
"""Mantissa bits a bucket spans: at 7, no bucket of either map holds more than one boundary between codes."""
BUCKETS = (127 - BUCKET_EXP_MIN + 1) << BUCKET_BITS
"""Buckets in one map's `bucket_table`."""


def bucket_table(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(buckets, thresholds)`` for finding the nearest code of `dynamic_map` without a search: a magnitude ``a <
    2`` (the buckets reach 2: the quantizer's ``x * (1 / absmax)`` may round up to ``1 + 2**-23``) falls in bucket
    ``(exponent - BUCKET_EXP_MIN) * 2**BUCKET_BITS + (its top BUCKET_BITS mantissa bits)``;
    ``buckets[bucket]`` (uint8) is the index of the code nearest to the bucket's lower edge (among the codes ``>= 0``;
    a tie to the smaller), and since at most one boundary between two codes lies inside a bucket (checked here), the
    nearest code of ``a`` is that index ``c`` or ``c + 1``: ``c + 1`` exactly when ``a >= thresholds[c]``, the
    smallest fp32 ``t`` with ``2 t > code[c] + code[c + 1]`` (the sum exact in float64; inf for the last code), so
    one fp32 comparison decides what the exact midpoint comparison would. The result is the binary search's, ties
    included (`kitsune.kernels.quant._nearest_code`)."""
    code = dynamic_map(signed).double()
    zero = 127 if signed else 0
    pos = code[zero:]
    mids = (pos[1:] + pos[:-1]) / 2
    step = 1 << BUCKET_BITS
    out = []
    for b in range(BUCKETS):
        exp, frac = BUCKET_EXP_MIN + b // step, b % step
        lo = (1 + frac / step) * 2.0 ** (exp - 127)
        hi = (1 + (frac + 1) / step) * 2.0 ** (exp - 127)
        if int(((mids > lo) & (mids < hi)).sum()) > 1:
            raise AssertionError(f"bucket {b} of the {'signed' if signed else 'unsigned'} map spans two boundaries")
        d = (pos - lo).abs()
        out.append(zero + int((d == d.min()).nonzero().min()))  # the nearest; a tie to the smaller magnitude
    half = (code[:-1] + code[1:]) / 2  # exact: the sum of two fp32 neighbours fits a double, and halving is exact
    t = half.float()  # the nearest fp32; the threshold is the smallest fp32 strictly above the midpoint
    t = torch.where(t.double() > half, t, torch.nextafter(t, torch.tensor(math.inf, dtype=torch.float32)))
    inf = torch.tensor([math.inf], dtype=torch.float32)  # whatever torch's default dtype: the table is fp32 words
    return torch.tensor(out, dtype=torch.uint8), torch.cat([t, inf])


def packed_table(signed: bool) -> torch.Tensor:
    """`bucket_table` in one int32 word a bucket, so the nearest code takes one table read: the candidate code ``c``
    in bits 24-31 and, in bits 0-16, the low 16 mantissa bits of ``thresholds[c]`` when that threshold lies in the
    bucket (it then shares the bucket's exponent and top mantissa bits, so ``a >= thresholds[c]`` is the comparison of
    the low 16 bits of both), else ``2**16``, which no 16 bits reach (the threshold is at or past the bucket's upper
    edge, or ``a`` was clamped into the first bucket from below)."""
    buckets, thresholds = bucket_table(signed)
    code = buckets.long()
    t_bits = thresholds.view(torch.int32).long()[code]
    lo_bits = (torch.arange(BUCKETS) + (BUCKET_EXP_MIN << BUCKET_BITS)) << (23 - BUCKET_BITS)  # each lower edge's
    inside = (t_bits >> (23 - BUCKET_BITS)) == (lo_bits >> (23 - BUCKET_BITS))
    low = torch.where(inside, t_bits & 0xFFFF, torch.full_like(t_bits, 1 << 16))
    return ((code << 24) | low).to(torch.int64).to(torch.int32)  # codes >= 128 set the sign bit: the int32 wraps


_TABLES: dict[torch.device, torch.Tensor] = {}

PACKED_START = 2 * CODE_SIZE
"""Where `device_tables` holds the signed map's `packed_table` (in fp32 words); the unsigned map's follows it."""


def device_tables(device: torch.device) -> torch.Tensor:
    """Every table of 8-bit state on ``device``, built once per process in one fp32 buffer (a captured CUDA graph
    may hold its address): the signed `dynamic_map`, the unsigned one (CODE_SIZE fp32 each), then their
    `packed_table` (BUCKETS int32 each, as fp32 words). `code` and `packed` read their parts."""
    device = torch.device(device)
    table = _TABLES.get(device)
    if table is None:
        parts = [dynamic_map(True), dynamic_map(False)]
        parts += [packed_table(True).view(torch.float32), packed_table(False).view(torch.float32)]
        table = _TABLES[device] = torch.cat(parts).to(device)
    return table


def code(signed: bool, device: torch.device) -> torch.Tensor:
    """`dynamic_map` on ``device``: a view of `device_tables`."""
    start = 0 if signed else CODE_SIZE
    return device_tables(device)[start : start + CODE_SIZE]


def packed(signed: bool, device: torch.device) -> torch.Tensor:
    """`packed_table` on ``device``: an int32 view of `device_tables`."""
    start = PACKED_START + (0 if signed else BUCKETS)
    return device_tables(device)[start : start + BUCKETS].view(torch.int32)
