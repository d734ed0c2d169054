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
needs 16 (`kitsune.kernels.update.VECTOR_ALIGN`)."""


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
"""The smallest fp32 exponent (biased) the encode table resolves: magnitudes under 2**-32 all share its first
bucket, which is far below the smallest code's half (about 1.6e-7 of the absmax), so their nearest code is 0."""
BINADES = 127 - BUCKET_EXP_MIN + 1
"""Binades (fp32 exponents) the encode table covers: ``[2**-32, 2)``."""
MAX_BUCKET_BITS = 7
"""The most mantissa bits a binade's buckets span (the unsigned map's top binade needs 7)."""
ENCODE_WORDS = 576
"""int32 words reserved for one map's `encode_table`: BINADES binade words, then its buckets (203 signed, 401
unsigned)."""


def thresholds(signed: bool) -> torch.Tensor:
    """fp32 ``t[k]``: the smallest fp32 strictly above the exact midpoint of ``code[k]`` and ``code[k + 1]`` of
    `dynamic_map` (the sum of two fp32 neighbours is exact in float64 and halving it is exact), inf for the last
    code. A value ``v`` (not nan) is nearer ``code[k + 1]`` than ``code[k]`` exactly when ``v >= t[k]``; at the
    midpoint itself the tie goes to the smaller code."""
    code = dynamic_map(signed).double()
    half = (code[:-1] + code[1:]) / 2
    t = half.float()  # the nearest fp32; the threshold is the smallest fp32 strictly above the midpoint
    t = torch.where(t.double() > half, t, torch.nextafter(t, torch.tensor(math.inf)))
    return torch.cat([t, torch.tensor([math.inf])])


def bucket_bits(signed: bool) -> list[int]:
    """Per binade from BUCKET_EXP_MIN to 127, the fewest top mantissa bits (0..MAX_BUCKET_BITS) whose buckets each
    hold at most one threshold (`thresholds`) strictly inside: then the nearest code of any magnitude in a bucket is
    the candidate of its lower edge or the next. Fine buckets where codes are dense (7 bits in the unsigned map's top
    binade), one bucket a binade below the finest code, so the table is small and a warp's reads of it touch few
    cache lines (for GPT-2's state, 5 and 9 of 128 bytes a read instead of 16 and 22 with 7 bits everywhere)."""
    zero = 127 if signed else 0
    t = thresholds(signed)[zero:-1].view(torch.int32).long()  # between the codes >= 0, as ordered integers
    out = []
    for e in range(BUCKET_EXP_MIN, 128):
        for bits in range(MAX_BUCKET_BITS + 1):
            lo = (torch.arange(1 << bits) << (23 - bits)) + (e << 23)
            inside = torch.searchsorted(t, lo + (1 << (23 - bits)), right=False) - torch.searchsorted(t, lo, right=True)
            if int(inside.max()) <= 1:
                out.append(bits)
                break
        else:
            raise AssertionError(f"binade {e} of the {'signed' if signed else 'unsigned'} map needs more bits")
    if out[0]:
        raise AssertionError("the first binade must be one bucket: magnitudes below it are clamped into it")
    return out


def encode_table(signed: bool) -> torch.Tensor:
    """int32 ``(ENCODE_WORDS,)``: what the fused update reads to find the nearest code of `dynamic_map` without a
    search (`kitsune.kernels.quant._nearest_bucketed`). A magnitude ``a < 2`` with fp32 exponent ``e`` (at least
    BUCKET_EXP_MIN) and mantissa ``m`` reads the binade word ``w = table[e - BUCKET_EXP_MIN]``: the table index of
    the binade's first bucket in bits 0-15 and ``23 - bucket_bits[e]`` in bits 16-20, so its bucket word is
    ``table[(w & 0xFFFF) + (m >> (w >> 16))]``. A bucket word holds in bits 24-31 the candidate code ``c``, the code
    nearest the bucket's lower edge (a tie to the smaller magnitude), and in bits 0-23 the mantissa of the threshold
    to ``c + 1`` when it lies inside the bucket (hence in its binade), else ``2**23``, which no mantissa reaches; the
    code is ``c + (m >= bits 0-23)``, the binary search's, ties included (checked here on every bucket's edges and
    both sides of every threshold)."""
    zero = 127 if signed else 0
    thr = thresholds(signed)[zero:-1].view(torch.int32).long()
    bits = bucket_bits(signed)
    words, buckets = [], []
    for e, b in zip(range(BUCKET_EXP_MIN, 128), bits, strict=True):
        words.append((BINADES + len(buckets)) | ((23 - b) << 16))
        lo = (torch.arange(1 << b) << (23 - b)) + (e << 23)
        first = torch.searchsorted(thr, lo, right=True)  # thresholds <= lo: the candidate's rank above the zero code
        hi = lo + (1 << (23 - b))
        nxt = thr[first.clamp(max=len(thr) - 1)]
        inside = (first < len(thr)) & (nxt < hi)
        mant = torch.where(inside, nxt & 0x7FFFFF, torch.full_like(nxt, 1 << 23))
        buckets += (((zero + first) << 24) | mant).tolist()
    table = torch.zeros(ENCODE_WORDS, dtype=torch.int64)
    if BINADES + len(buckets) > ENCODE_WORDS:
        raise AssertionError(f"{BINADES + len(buckets)} words do not fit ENCODE_WORDS = {ENCODE_WORDS}")
    table[: BINADES + len(buckets)] = torch.tensor(words + buckets)
    _check_encode(table, signed)
    return table.to(torch.int32)  # codes >= 128 set the sign bit: the int32 wraps


def _encode(table: torch.Tensor, a_bits: torch.Tensor) -> torch.Tensor:
    """The code `encode_table` gives the magnitudes with fp32 bits ``a_bits`` (int64, < 2.0), as the kernel reads it."""
    e = (a_bits >> 23).clamp(min=BUCKET_EXP_MIN)
    mant = a_bits & 0x7FFFFF
    w = table[e - BUCKET_EXP_MIN]
    word = table[(w & 0xFFFF) + (mant >> (w >> 16))]
    return (word >> 24) + (mant >= (word & 0xFFFFFF)).long()


def _check_encode(table: torch.Tensor, signed: bool) -> None:
    """Every bucket's lowest and highest fp32, and each threshold and its two neighbours, encode to the nearest code
    (``zero + #thresholds <= a``); a magnitude is monotone in a bucket, so these decide all of them."""
    zero = 127 if signed else 0
    thr = thresholds(signed)[zero:-1].view(torch.int32).long()
    edges = []
    for e, b in zip(range(BUCKET_EXP_MIN, 128), bucket_bits(signed), strict=True):
        lo = (torch.arange(1 << b) << (23 - b)) + (e << 23)
        edges += [lo, lo + (1 << (23 - b)) - 1]
    probes = torch.cat(edges + [thr - 1, thr, thr + 1, torch.tensor([0, 1, 2**23, 94 << 23, (95 << 23) - 1])])
    probes = probes[(probes >= 0) & (probes < (128 << 23))]
    want = zero + torch.searchsorted(thr, probes, right=True)
    got = _encode(table, probes)
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[:4].view(-1)
        raise AssertionError(f"encode table of the {'signed' if signed else 'unsigned'} map: {probes[bad].tolist()}")


_TABLES: dict[torch.device, torch.Tensor] = {}

ENCODE_START = 2 * CODE_SIZE
"""Where `device_tables` holds the signed map's `encode_table` (in fp32 words); the unsigned map's follows it."""


def device_tables(device: torch.device) -> torch.Tensor:
    """Every table of 8-bit state on ``device``, built once per process in one fp32 buffer (a captured CUDA graph
    may hold its address): the signed `dynamic_map`, the unsigned one (CODE_SIZE fp32 each), then their
    `encode_table` (ENCODE_WORDS int32 each, as fp32 words). `code` and `encoder` read their parts."""
    device = torch.device(device)
    table = _TABLES.get(device)
    if table is None:
        parts = [dynamic_map(True), dynamic_map(False)]
        parts += [encode_table(True).view(torch.float32), encode_table(False).view(torch.float32)]
        table = _TABLES[device] = torch.cat(parts).to(device)
    return table


def code(signed: bool, device: torch.device) -> torch.Tensor:
    """`dynamic_map` on ``device``: a view of `device_tables`."""
    start = 0 if signed else CODE_SIZE
    return device_tables(device)[start : start + CODE_SIZE]


def encoder(signed: bool, device: torch.device) -> torch.Tensor:
    """`encode_table` on ``device``: an int32 view of `device_tables`."""
    start = ENCODE_START + (0 if signed else ENCODE_WORDS)
    return device_tables(device)[start : start + ENCODE_WORDS].view(torch.int32)
