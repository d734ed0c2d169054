"""The 8-bit state's code tables and block size, importable without Triton (see `kitsune.kernels.quant`)."""

from __future__ import annotations

import math
from fractions import Fraction

import torch

QUANT_BLOCK = 256
"""Elements per absmax: bitsandbytes' block size for 8-bit optimizer state (8.125 bits per element)."""
CODE_SIZE = 256
"""Entries of a code table: one per 8-bit code."""


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
