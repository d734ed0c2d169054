"""Muon's quintic Newton-Schulz orthogonalisation for a batch of same-shape matrices, with the symmetric-Gram trick.

One iteration is ``X <- a X + (b A + c A A) X`` with ``A = X X^T``, on ``X`` of shape ``(m, n)``, ``m <= n`` (a tall
input is transposed first, through strides, so the Gram matrices are the small side). Three launches per iteration
cover the whole batch, grid (tiles, batch):

1. ``A = X X^T`` (`_syrk_kernel`): only the tiles ``(i, j)`` with ``i <= j`` are computed, each stored at
   ``(i, j)`` and, transposed, at ``(j, i)``. Half the FLOPs of a plain matmul.
2. ``B' = b A + c A A + a I``, the same kernel: ``A`` is symmetric, so ``A A = A A^T`` is a Gram matrix too; the
   ``b A + a I`` is its epilogue (the ``(i, j)`` tile of ``A`` read once more, ``a`` added on the diagonal). Half
   the FLOPs again.
3. ``X <- B' X`` (`_poly_kernel`), which is ``a X + B X``: a plain tiled matmul with nothing left in its
   epilogue (the ``a X`` term used to be added there, reading ``X`` once more: 0.211 against 0.177 ms at 4096^2
   on an H100); the last iteration writes the caller's output directly, transposed back through its strides.

So an iteration costs ``m^2 n + m^3 + 2 m^2 n`` FLOPs instead of ``4 m^2 n + 2 m^3``: two thirds for a square matrix.
Operands are bf16 (or fp32 on request) and every product accumulates in fp32; ``A``, ``B'`` and ``X`` are rounded
to the operand dtype when stored, as torch's bf16 matmuls round them (``B'``'s diagonal carries ``a`` through that
rounding: the relative error against float64 stays within the same band as torch's own bf16 iteration).

The Frobenius normalisation ``X / max(||X||_F, eps)`` (torch.optim.Muon's clamp; Keller Jordan's original adds
``eps`` instead, which differs only for norms near ``eps``) is folded into the first iteration's epilogues. One
prologue launch (`_prologue_kernel`) rounds the input to the operand dtype (skipped when it already is) and
sums its squares per matrix into a few partials; the first ``A = X X^T`` runs on that unnormalised ``X`` and scales
its fp32 accumulator by ``s^2``, ``s = 1 / max(sqrt(sum), eps)``, before rounding; the first ``B'`` is scaled by
``s``, so its product with the unnormalised ``X`` is the normalised iteration. So the normalised ``X`` is never
stored, the first iteration runs at the speed of the others, and ``A`` is normalised before ``A A``, where tiny
gradients would otherwise leave fp32's range. (Scaling each tile as the first Gram loaded it cost 4x that launch
on an H100.)
"""

from __future__ import annotations

import contextlib
import functools
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kitsune.kernels import common as _common
from kitsune.kernels.coefficients import (
    MUON_COEFFICIENTS,
    POLAR_EXPRESS_COEFFICIENTS,
    Coefficients,
    schedule,
)
from kitsune.kernels.common import TL_DTYPES, _cast

try:  # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer loads only
    _TensorDescriptor = None

__all__ = [
    "MUON_COEFFICIENTS",
    "POLAR_EXPRESS_COEFFICIENTS",
    "clear_graph_cache",
    "launch_count",
    "newton_schulz",
    "newton_schulz_launch",
    "schedule",
]

SUPPORTED_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
COMPUTE_DTYPES = (torch.bfloat16, torch.float32)
"""Operand dtypes of the products (and of the result); fp32 multiplies in true fp32 (``input_precision="ieee"``)."""

PROLOGUE_BLOCK = 2048
"""Elements a prologue program loads per loop iteration."""
MAX_PARTIALS = 1024
"""Prologue programs per matrix at most: enough to stream one big matrix at full bandwidth, few enough for the first
iteration's programs to sum their partials."""


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` in fp32. UPCAST (interpreter only): Triton 3.9's interpreter multiplies bf16 operands as their
    uint16 bit patterns; the same values in fp32 give the products a bf16 tensor core gives, exact in fp32."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=tl.float32)


@triton.jit
def _prologue_kernel(
    x_ptr,  # (batch, numel) contiguous, fp32/bf16/fp16
    xc_ptr,  # (batch, rows, pitch) DTYPE: the input rounded to DTYPE, stored with STORE
    partials,  # (batch, P) fp32 out: sums of squares of the rounded values
    numel,
    chunk,  # elements per program, a multiple of BLOCK
    P,
    cols,  # with PADDED: the input's row length; its copy's rows start every pitch elements, zeros in between
    pitch,
    STORE: tl.constexpr,
    PADDED: tl.constexpr,
    DTYPE: tl.constexpr,
    RNE_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
    PAD_BLOCK: tl.constexpr,  # with PADDED: a power of two >= pitch - cols
):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    rows = numel // cols  # with PADDED: the rows of one matrix
    start = pid.to(tl.int64) * chunk
    end = tl.minimum(start + chunk, numel)
    acc = tl.zeros((BLOCK,), tl.float32)
    for off in range(0, chunk, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < end
        x = _cast(tl.load(x_ptr + b * numel + idx, mask=mask, other=0.0).to(tl.float32), DTYPE, RNE_BF16)
        if STORE:
            if PADDED:
                tl.store(xc_ptr + (b * rows + idx // cols) * pitch + idx % cols, x, mask=mask)
            else:
                tl.store(xc_ptr + b * numel + idx, x, mask=mask)
        x = x.to(tl.float32)  # the norm of the operand-dtype copy, as torch takes it
        acc += x * x
    tl.store(partials + b * P + pid, tl.sum(acc, 0))
    if PADDED:  # the copy's columns past `cols`: zeros, each program those of its share of the rows
        per = tl.cdiv(rows, P)
        pad = tl.arange(0, PAD_BLOCK)
        zeros = tl.zeros((PAD_BLOCK,), tl.float32).to(DTYPE)
        for r in range(pid * per, tl.minimum(pid * per + per, rows)):
            tl.store(xc_ptr + (b * rows + r) * pitch + cols + pad, zeros, mask=cols + pad < pitch)


@triton.jit
def _inv_norm(partials, b, P, eps, P_BLOCK: tl.constexpr):
    """``1 / max(||X_b||_F, eps)`` from matrix ``b``'s prologue partials, summed in a fixed order."""
    offs = tl.arange(0, P_BLOCK)
    sumsq = tl.sum(tl.load(partials + b * P + offs, mask=offs < P, other=0.0), 0)
    return 1.0 / tl.maximum(tl.sqrt_rn(sumsq), eps)


@triton.jit
def _syrk_kernel(
    x_ptr,  # (batch, M, K) through strides, DTYPE (FIRST: the unnormalised X, maybe a transposed view)
    xr_desc,  # with TMA: descriptors of X as (batch * M, K), blocks (BLOCK_M, BLOCK_K) and (BLOCK_N, BLOCK_K)
    xc_desc,
    stride_xb,
    stride_xm,
    stride_xk,
    c_ptr,  # (batch, M, pitch) DTYPE: read with HAS_C
    out_ptr,  # (batch, M, pitch) DTYPE: alpha X X^T (+ beta C + diag I), times s^NORM
    ws_ptr,  # with SPLIT: (splits, batch, M, M) fp32 out, each split's raw sums over its part of K
    tiles,  # (n_tiles, 2) int32: (i, j), j >= i: row block i, column blocks j .. j + BLOCK_N / BLOCK_M - 1
    n_tiles,
    batch,
    partials,  # (batch, P) fp32 sums of squares, read with NORM
    M,
    K,
    k_chunk,  # with SPLIT: the part of K one split sums, a multiple of BLOCK_K (K otherwise)
    pitch,
    P,
    eps,
    alpha,
    beta,
    diag,  # with HAS_C: added on the diagonal
    NORM: tl.constexpr,  # 0, 1 or 2: the result times s^NORM, s = 1 / max(||X||_F, eps)
    HAS_C: tl.constexpr,
    SPLIT: tl.constexpr,  # grid (tiles, batch, splits): raw partial sums to ws_ptr, `_gram_reduce_kernel` finishes
    DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    RNE_BF16: tl.constexpr,
    EVEN_K: tl.constexpr,
    TMA: tl.constexpr,
    PERSISTENT: tl.constexpr,  # a grid of about one program per SM, each looping over tiles (batch-major)
    FLATTEN: tl.constexpr,  # with PERSISTENT: one software pipeline across tiles (loads under the epilogue)
    P_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # a multiple of BLOCK_M: a program computes BLOCK_N / BLOCK_M square blocks of one row
    BLOCK_K: tl.constexpr,
):
    if PERSISTENT:
        for t in tl.range(tl.program_id(0), n_tiles * batch, tl.num_programs(0), flatten=FLATTEN):
            _syrk_tile(
                t % n_tiles, (t // n_tiles).to(tl.int64), 0, x_ptr, xr_desc, xc_desc, stride_xb, stride_xm,
                stride_xk, c_ptr, out_ptr, ws_ptr, tiles, batch, partials, M, K, k_chunk, pitch, P, eps, alpha, beta,
                diag, NORM, HAS_C, False, DTYPE, PRECISION, RNE_BF16, EVEN_K, TMA, P_BLOCK, BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
    else:
        _syrk_tile(
            tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2), x_ptr, xr_desc, xc_desc, stride_xb,
            stride_xm, stride_xk, c_ptr, out_ptr, ws_ptr, tiles, batch, partials, M, K, k_chunk, pitch, P, eps,
            alpha, beta, diag, NORM, HAS_C, SPLIT, DTYPE, PRECISION, RNE_BF16, EVEN_K, TMA, P_BLOCK, BLOCK_M,
            BLOCK_N, BLOCK_K,
        )  # fmt: skip


@triton.jit
def _syrk_tile(
    pid, b, split, x_ptr, xr_desc, xc_desc, stride_xb, stride_xm, stride_xk, c_ptr, out_ptr, ws_ptr, tiles, batch,
    partials, M, K, k_chunk, pitch, P, eps, alpha, beta, diag, NORM: tl.constexpr, HAS_C: tl.constexpr,
    SPLIT: tl.constexpr, DTYPE: tl.constexpr, PRECISION: tl.constexpr, RNE_BF16: tl.constexpr, EVEN_K: tl.constexpr,
    TMA: tl.constexpr, P_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One tile of `_syrk_kernel`: tile ``pid`` of the upper triangle of matrix ``b``, summed over the part
    ``split`` of K."""
    ti = tl.load(tiles + 2 * pid)
    tj = tl.load(tiles + 2 * pid + 1)
    rows = ti * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tj * BLOCK_M + tl.arange(0, BLOCK_N)
    if SPLIT:
        k_lo = split * k_chunk
        k_hi = tl.minimum(k_lo + k_chunk, K)
    else:
        k_lo = 0
        k_hi = K
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if TMA:
        # rows past M read the next matrix's rows (or zeros past the last): never stored; K's tail reads zeros
        row0 = (b * M + ti * BLOCK_M).to(tl.int32)
        col0 = (b * M + tj * BLOCK_M).to(tl.int32)
        for k in range(k_lo, k_hi, BLOCK_K):
            xr = xr_desc.load([row0, k])
            xc = xc_desc.load([col0, k])
            acc = _dot(xr, tl.trans(xc), acc, PRECISION, RNE_BF16)
    else:
        ks = tl.arange(0, BLOCK_K)
        # rows past M wrap around: every load is in bounds without a mask, the extra rows are never stored
        x_r = x_ptr + b * stride_xb + (rows % M)[:, None] * stride_xm + (k_lo + ks)[None, :] * stride_xk
        x_c = x_ptr + b * stride_xb + (cols % M)[:, None] * stride_xm + (k_lo + ks)[None, :] * stride_xk
        for k in range(k_lo, k_hi, BLOCK_K):
            if EVEN_K:
                xr = tl.load(x_r)
                xc = tl.load(x_c)
            else:
                xr = tl.load(x_r, mask=(k + ks)[None, :] < K, other=0.0)
                xc = tl.load(x_c, mask=(k + ks)[None, :] < K, other=0.0)
            acc = _dot(xr, tl.trans(xc), acc, PRECISION, RNE_BF16)
            x_r += BLOCK_K * stride_xk
            x_c += BLOCK_K * stride_xk
    if SPLIT:  # this split's sums, as they are: the reduce kernel adds the splits in order and finishes the tile
        mask = (rows[:, None] < M) & (cols[None, :] < M)
        tl.store(ws_ptr + ((split * batch + b) * M + rows[:, None]) * M + cols[None, :], acc, mask=mask)
    else:
        _syrk_epilogue(
            acc, ti, rows, cols, b, c_ptr, out_ptr, partials, M, pitch, P, eps, alpha, beta, diag, NORM, HAS_C,
            DTYPE, RNE_BF16, P_BLOCK, BLOCK_M,
        )  # fmt: skip


@triton.jit
def _syrk_epilogue(
    acc, ti, rows, cols, b, c_ptr, out_ptr, partials, M, pitch, P, eps, alpha, beta, diag, NORM: tl.constexpr,
    HAS_C: tl.constexpr, DTYPE: tl.constexpr, RNE_BF16: tl.constexpr, P_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """A Gram tile's sums ``acc`` (rows ``rows``, columns ``cols``, row block ``ti``) finished and stored, with its
    mirror: the norm's scale, ``B'``'s terms, the rounding to DTYPE."""
    if NORM == 2:  # the first Gram, normalised: A = (s X)(s X)^T
        s = _inv_norm(partials, b, P, eps, P_BLOCK)
        acc *= s * s
    base = b * M * pitch
    mask = (rows[:, None] < M) & (cols[None, :] < M)
    if HAS_C:  # B' = c A A + b A + a I: the tile of A, once, and a on the diagonal
        c = tl.load(c_ptr + base + rows[:, None] * pitch + cols[None, :], mask=mask, other=0.0)
        acc = alpha * acc + beta * c.to(tl.float32)
        acc += tl.where(rows[:, None] == cols[None, :], diag, 0.0)
    if NORM == 1:  # the first iteration's B' carries s, for the unnormalised X0 it multiplies
        acc *= _inv_norm(partials, b, P, eps, P_BLOCK)
    out = _cast(acc, DTYPE, RNE_BF16)
    tl.store(out_ptr + base + rows[:, None] * pitch + cols[None, :], out, mask=mask)
    # the mirror: blocks (j, i) get the transpose; the diagonal block is its own mirror, stored once (the masks
    # compare vectors with scalars, never two scalars: the interpreter builds no mask from a scalar)
    mirror = (cols[:, None] < M) & (rows[None, :] < M) & (cols // BLOCK_M != ti)[:, None]
    tl.store(out_ptr + base + cols[:, None] * pitch + rows[None, :], tl.trans(out), mask=mirror)


@triton.jit
def _gram_reduce_kernel(
    ws_ptr,  # (splits, batch, M, M) fp32: `_syrk_kernel`'s partial sums with SPLIT
    c_ptr,
    out_ptr,
    tiles,
    batch,
    splits,
    partials,
    M,
    pitch,
    P,
    eps,
    alpha,
    beta,
    diag,
    NORM: tl.constexpr,
    HAS_C: tl.constexpr,
    DTYPE: tl.constexpr,
    RNE_BF16: tl.constexpr,
    P_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """A split Gram's tiles, grid (tiles, batch): the splits' sums added in split order (the same bits every run),
    then the epilogue `_syrk_kernel` runs on an unsplit tile."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    ti = tl.load(tiles + 2 * pid)
    tj = tl.load(tiles + 2 * pid + 1)
    rows = ti * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tj * BLOCK_M + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for s in range(0, splits):
        acc += tl.load(ws_ptr + ((s * batch + b) * M + rows[:, None]) * M + cols[None, :], mask=mask, other=0.0)
    _syrk_epilogue(
        acc, ti, rows, cols, b, c_ptr, out_ptr, partials, M, pitch, P, eps, alpha, beta, diag, NORM, HAS_C, DTYPE,
        RNE_BF16, P_BLOCK, BLOCK_M,
    )  # fmt: skip


@triton.jit
def _poly_kernel(
    b_ptr,  # (batch, M, b_pitch) DTYPE: B' = b A + c A A + a I
    b_desc,  # with TMA: descriptors of B' as (batch * M, M), blocks (BLOCK_M, BLOCK_K), and of X as (batch * M, N),
    x_desc,  # blocks (BLOCK_K, BLOCK_N)
    x_ptr,  # (batch, M, N) through strides, DTYPE (the first iteration: the unnormalised X0, maybe a transposed view)
    stride_xb,
    stride_xm,
    stride_xn,
    out_ptr,  # (batch, M, N) through strides: B' X
    stride_ob,
    stride_om,
    stride_on,
    b_pitch,
    batch,
    M,
    N,  # columns computed and stored
    N_READ,  # columns of X that hold X (reads wrap around inside them)
    PAD: tl.constexpr,  # N > N_READ: columns N_READ .. N - 1 are stored as zeros (an iteration buffer's padding)
    DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    RNE_BF16: tl.constexpr,
    EVEN_K: tl.constexpr,
    TMA: tl.constexpr,  # only with EVEN_K: a k block past M would read the next matrix's rows of X
    PERSISTENT: tl.constexpr,
    FLATTEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    if PERSISTENT:
        n_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for t in tl.range(tl.program_id(0), n_tiles * batch, tl.num_programs(0), flatten=FLATTEN):
            _poly_tile(
                t % n_tiles, (t // n_tiles).to(tl.int64), b_ptr, b_desc, x_desc, x_ptr, stride_xb, stride_xm,
                stride_xn, out_ptr, stride_ob, stride_om, stride_on, b_pitch, M, N, N_READ, PAD, DTYPE, PRECISION,
                RNE_BF16, EVEN_K, TMA, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
            )  # fmt: skip
    else:
        _poly_tile(
            tl.program_id(0), tl.program_id(1).to(tl.int64), b_ptr, b_desc, x_desc, x_ptr, stride_xb, stride_xm,
            stride_xn, out_ptr, stride_ob, stride_om, stride_on, b_pitch, M, N, N_READ, PAD, DTYPE, PRECISION,
            RNE_BF16, EVEN_K, TMA, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
        )  # fmt: skip


@triton.jit
def _poly_tile(
    pid, b, b_ptr, b_desc, x_desc, x_ptr, stride_xb, stride_xm, stride_xn, out_ptr, stride_ob, stride_om, stride_on,
    b_pitch, M, N, N_READ, PAD: tl.constexpr, DTYPE: tl.constexpr, PRECISION: tl.constexpr, RNE_BF16: tl.constexpr,
    EVEN_K: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """One tile of `_poly_kernel`: tile ``pid`` of matrix ``b``."""
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    # groups of GROUP_M row blocks run together and share their columns of X in L2
    pid_m, pid_n = tl.swizzle2d(pid // grid_n, pid % grid_n, grid_m, grid_n, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x_ptr += b * stride_xb
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if TMA:
        row0 = (b * M + pid_m * BLOCK_M).to(tl.int32)
        k0 = (b * M).to(tl.int32)
        col0 = pid_n * BLOCK_N
        for k in range(0, M, BLOCK_K):
            lhs = b_desc.load([row0, k])
            rhs = x_desc.load([k0 + k, col0])
            acc = _dot(lhs, rhs, acc, PRECISION, RNE_BF16)
    else:
        ks = tl.arange(0, BLOCK_K)
        b_tile = b_ptr + b * M * b_pitch + (rows % M)[:, None] * b_pitch + ks[None, :]
        x_tile = x_ptr + ks[:, None] * stride_xm + (cols % N_READ)[None, :] * stride_xn
        for k in range(0, M, BLOCK_K):
            if EVEN_K:
                lhs = tl.load(b_tile)
                rhs = tl.load(x_tile)
            else:
                lhs = tl.load(b_tile, mask=(k + ks)[None, :] < M, other=0.0)
                rhs = tl.load(x_tile, mask=(k + ks)[:, None] < M, other=0.0)
            acc = _dot(lhs, rhs, acc, PRECISION, RNE_BF16)
            b_tile += BLOCK_K
            x_tile += BLOCK_K * stride_xm
    if PAD:
        acc = tl.where(cols[None, :] < N_READ, acc, 0.0)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    out = _cast(acc, DTYPE, RNE_BF16)
    tl.store(out_ptr + b * stride_ob + rows[:, None] * stride_om + cols[None, :] * stride_on, out, mask=mask)


INTERPRETED = type(_syrk_kernel).__name__ == "InterpretedFunction"
"""Whether the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 when this module was imported)."""


class SyrkConfig(NamedTuple):
    block_m: int
    """Side of the square blocks that are mirrored (a mirrored block must line up with its twin)."""
    block_n: int
    """Columns per program: ``block_n / block_m`` blocks of one row of the upper triangle."""
    block_k: int
    num_warps: int
    num_stages: int
    tma: bool = False
    """Load the operands through TMA tensor descriptors where the layout allows (rows contiguous, 16-byte aligned);
    pointer loads otherwise."""
    persistent: bool = False
    """About one program per SM, each looping over tiles, instead of one program per tile."""
    flatten: bool = False
    """With ``persistent``: flatten the tile and k loops into one software pipeline."""
    split_k: int = 1
    """Parts of the k loop run by separate programs (grid ``(tiles, batch, split_k)``, not persistent), their fp32
    sums added in order by `_gram_reduce_kernel`, which finishes the tiles: for a Gram of few tiles over a long k,
    as a tall embedding's ``768 x 50257`` (42 tiles of 64 x 128, 50257 deep), where the unsplit grid leaves most
    SMs idle."""


class PolyConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    tma: bool = False
    persistent: bool = False
    flatten: bool = False
    cublas: bool = False
    """Hand the product ``B' X`` to cuBLAS (``torch.bmm``) instead of `_poly_kernel`: it has no epilogue
    left to fuse (``a`` sits on ``B'``'s diagonal). bf16 only: fp32 would follow torch's TF32 switch."""


def pick_configs(
    m: int, n: int, batch: int, dtype: torch.dtype, device: torch.device
) -> tuple[SyrkConfig, SyrkConfig, PolyConfig]:
    """Tile sizes for an ``(m, n)``, ``m <= n``, problem, as ``(gram, b_prime, product)``: the ``X X^T`` launch's,
    the ``B'`` launch's and the ``B' X`` launch's. A fixed table, no autotuning (nothing to warm up).

    The interpreter takes the smallest tiles ``tl.dot`` allows there (16; Gram tiles two blocks wide), so small test
    matrices still span several tiles, partial ones included. On a GPU, the best of sweeps on an H100 (Triton 3.6,
    ``benchmarks/ns-sweep.py``) once a launch has about a wave of tiles: Gram 128 x 128 (4 warps, 3 stages),
    ``B' X`` 128 x 256 (8 warps, 3 stages, groups of 16 row blocks), 778 TFLOP/s at 4096^2 (cuBLAS: 747), where TMA
    loads and a persistent grid measured no faster. Where the k loops are short (m <= 2048) and there are several
    waves of tiles (a batch, as Muon's same-shape matrices are), the per-tile epilogue weighs more: TMA loads and a
    persistent grid with the tile and k loops pipelined as one, Gram tiles two blocks wide (8 x 2048^2: 2.59 ms
    against 2.74). There the ``B'`` launch, whose epilogue also reads a tile of ``A``, takes square 128-row tiles
    through TMA, one program a tile: with the wide persistent tiles its epilogue spilled registers (Nsight Compute
    on an H200: 255 registers, local memory traffic; 0.143 ms a launch against 0.123 for ``X X^T``); with square
    ones 0.127 ms, the whole call 2.53 against 2.56 ms in turns (``benchmarks/ns-breakdown.py --bprime``), the same
    bits.
    Below a wave (1024^2): 64-row tiles, Gram tiles two blocks wide; for ``X X^T`` over a long k the square tiles
    split into parts instead, where `_gram_time` models that a tenth faster.
    """
    if device.type != "cuda":
        syrk = SyrkConfig(16, 32, 64, 1, 1)
        return syrk, syrk, PolyConfig(16, 64, 64, 4, 1, 1)
    if dtype == torch.float32:  # ieee fp32 products run on CUDA cores: small tiles for registers and shared memory
        syrk = SyrkConfig(64, 64, 32, 4, 3)
        return syrk, syrk, PolyConfig(64, 64, 32, 8, 4, 3)
    return _bf16_configs(m, n, batch, _num_sms(device))


@functools.lru_cache(maxsize=256)
def _bf16_configs(m: int, n: int, batch: int, sms: int) -> tuple[SyrkConfig, SyrkConfig, PolyConfig]:
    """`pick_configs` for bf16 operands on a GPU of ``sms`` SMs; kept, as a direct call picks on every call
    (up to 20 us for a long split Gram's part counts)."""
    blocks = _common.cdiv(m, 128)
    upper = batch * blocks * (blocks + 1) // 2  # 128 x 128 tiles over the upper triangle
    if m <= 2048 and upper >= 512:
        return (
            SyrkConfig(128, 256, 64, 8, 3, True, True, True),
            SyrkConfig(128, 128, 64, 4, 3, True),
            PolyConfig(128, 256, 64, 8, 8, 3, True, True, True),
        )
    syrk = SyrkConfig(128, 128, 64, 4, 3)
    gram = syrk._replace(split_k=_split_k(syrk, m, n, batch, sms))
    if upper < 100:  # few square tiles: narrow ones fill more SMs, unless a split k loop fills them with square ones
        syrk = SyrkConfig(64, 128, 64, 4, 4)
        narrow = syrk._replace(split_k=_split_k(syrk, m, n, batch, sms))
        if _gram_time(gram, m, n, batch, sms) >= 0.9 * _gram_time(narrow, m, n, batch, sms):
            gram = narrow
    poly_tiles = batch * blocks * _common.cdiv(n, 256)
    poly = PolyConfig(128, 256, 64, 16, 8, 3) if poly_tiles >= 100 else PolyConfig(64, 128, 64, 8, 4, 4)
    return gram, syrk, poly


SPLIT_MIN_K = 2048
"""The depth a split Gram's part keeps at least: long enough for the k loop's pipeline, and the parts' fp32 sums
(one tile each) stay a small share of the operand bytes each part loads."""

SPLIT_DEEP_K = 8192
"""The depth a part keeps at least where the unsplit tiles already fill more than half the SMs: there a split only
evens out the last wave, which pays only on deep k loops (H200, replayed from CUDA graphs: 2048 x 32000, 136 tiles
on 132 SMs, 3 parts 3.66 ms a 5-iteration call against 4.02 unsplit; 2048 x 8192, 2-4 parts, within 1% of
unsplit)."""


def _programs(cfg: SyrkConfig, m: int, batch: int) -> int:
    """Programs of an unsplit ``X X^T`` launch on ``m`` rows: its tiles over the upper triangle, per matrix."""
    return batch * len(_tile_pairs(_common.cdiv(m, cfg.block_m), cfg.block_n // cfg.block_m))


def _split_k(cfg: SyrkConfig, m: int, k: int, batch: int, sms: int) -> int:
    """Parts to split ``X X^T``'s k loop into: the count whose waves take the fewest tile times
    (``ceil(tiles * parts / sms) / parts``), a larger count only where it saves a tenth over a smaller one; 1 where
    no split saves that much. Each part is at least `SPLIT_MIN_K` deep where the tiles fill at most half the SMs,
    `SPLIT_DEEP_K` where they fill more (there a split only evens out the last wave)."""
    programs = _programs(cfg, m, batch)
    depth = SPLIT_MIN_K if 2 * programs <= sms else SPLIT_DEEP_K

    def waves(parts: int) -> float:
        return _common.cdiv(programs * parts, sms) / parts

    best = 1
    for parts in range(2, k // depth + 1):
        if waves(parts) < 0.9 * waves(best):
            best = parts
    return best


SQUARE_GRAM_COST = 1.6
"""A 128 x 128 Gram tile's time per k step over a 64 x 128 tile's: twice the products for 4/3 the loads. Fit to
5-iteration calls replayed from CUDA graphs on an H200 (Triton 3.6), with `SPLIT_COST_K`: 1024 x 4096, 72 programs
a launch either way, 64 x 128 tiles unsplit 0.202 ms against 128 x 128 ones in 2 parts 0.214; 1024 x 16384, 0.687
against 0.654."""

SPLIT_COST_K = 1300
"""A split Gram's reduce launch (the parts' fp32 sums added in order, the tiles finished), in k steps of one
64 x 128 tile: about 5 us at 1024 rows on an H200, fit with `SQUARE_GRAM_COST`."""


def _gram_time(cfg: SyrkConfig, m: int, k: int, batch: int, sms: int) -> float:
    """A model of an ``X X^T`` launch's time, in k steps of one 64 x 128 tile: its waves of programs, each as deep as
    a part of the k loop, the tile's cost per step (`SQUARE_GRAM_COST` for 128 x 128), and a split's reduce launch.
    It decides where the few 128 x 128 tiles of a Gram over a long k, split, beat twice as many 64 x 128 ones (H200,
    5-iteration calls in turns: 1024 x 16384 0.726 -> 0.591 ms in 7 parts, 1024 x 8192 0.360 -> 0.334 in 3, GPT-2's
    768 x 50257 1.260 -> 1.174 in 6; a sweep of 1024 x 16384's part counts, replayed from graphs, had 7 the fastest:
    3 0.597, 4 0.612, 6 0.572, 7 0.570, 8 0.639 ms)."""
    parts, depth = _splits(cfg, k)
    waves = _common.cdiv(_programs(cfg, m, batch) * parts, sms)
    cost = SQUARE_GRAM_COST if cfg.block_m == cfg.block_n else 1.0
    return waves * depth * cost + (SPLIT_COST_K if parts > 1 else 0)


def _descriptor(t: torch.Tensor, strides: Sequence[int], rows: int, cols: int, block: list[int]) -> object | None:
    """A TMA descriptor of the ``(batch, rows, cols)`` operand ``t`` (read through ``strides``) as one
    ``(batch * rows, cols)`` matrix with rows ``strides[1]`` elements apart, or None where TMA cannot read it: rows
    not contiguous, matrices not ``rows`` rows apart, addresses or row pitch not 16-byte aligned, or no descriptor
    support in this Triton."""
    if _TensorDescriptor is None or t.device.type != "cuda" and not INTERPRETED:
        return None
    sb, sr, sc = strides
    if sc != 1 or sr < cols or sb != rows * sr or (sr * t.element_size()) % 16 or t.data_ptr() % 16:
        return None
    flat = t.as_strided((t.shape[0] * rows, cols), (sr, 1))
    return _TensorDescriptor.from_tensor(flat, block)


PITCH_ALIGN = 16
"""Elements a buffer's row pitch is a multiple of: Triton assumes an integer argument divisible by 16 where it is
(so a row pitch of 16k elements lets pointer loads vectorise), and TMA wants 16-byte rows."""


def _pitch(cols: int) -> int:
    """Elements from one row of a buffer to the next: ``cols`` rounded up to `PITCH_ALIGN` elements. Rows of an odd
    length (a vocabulary of 50257) would leave every row but the first misaligned: no vector loads, no TMA."""
    return _common.cdiv(cols, PITCH_ALIGN) * PITCH_ALIGN


K_ALIGN = 64
"""Columns an iteration buffer's extent is a multiple of (`_extent`): the k block of every Gram config, so the
Grams that read it run without a k mask."""


def _extent(n: int) -> int:
    """Columns of an iteration buffer for an ``(m, n)`` problem: ``n`` rounded up to `K_ALIGN`, the columns past
    ``n`` zeros (they add nothing to a Gram and B' X keeps them zero); a wide input's copy has them too. Only an
    input read in place (the first iteration) and the result (the last write) have ``n`` columns: a vocabulary of
    50257 columns otherwise masks every Gram's last k block and wraps every product's column index by an odd number,
    and neither load then vectorises."""
    return _common.cdiv(n, K_ALIGN) * K_ALIGN


def _copy_cols(rows: int, cols: int) -> int:
    """Columns of the copy of a ``(rows, cols)`` input (X0 in the operand dtype, rows aligned): a wide input's runs
    to the iteration buffers' `_extent`, zeros past ``cols``; a tall one's rows keep their length (its first
    iteration reads it transposed, along its rows)."""
    return cols if rows > cols else _extent(cols)


def _buffer(batch: int, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A ``(batch, rows, cols)`` view of a buffer whose rows are `_pitch` elements apart."""
    return torch.empty((batch, rows, _pitch(cols)), dtype=dtype, device=device)[..., :cols]


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, so each loops over several tiles
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=64)
def _upper_tiles(blocks: int, wide: int, device: torch.device) -> torch.Tensor:
    """(n_tiles, 2) int32: the tiles covering the upper triangle of ``blocks`` x ``blocks`` square blocks, ``wide``
    blocks of a row per tile, starting on the diagonal. Row by row: neighbouring programs share their row block.
    A row with a block count not a multiple of ``wide`` ends in a tile partly past the matrix (computed, not
    stored): at most one per row, 1 / (blocks + 1) of the work for ``wide`` = 2."""
    return torch.tensor(_tile_pairs(blocks, wide), dtype=torch.int32).to(device)


@functools.lru_cache(maxsize=64)
def _tile_pairs(blocks: int, wide: int) -> tuple[tuple[int, int], ...]:
    """The ``(i, j)`` pairs of `_upper_tiles`, in its order; kept, as `pick_configs` counts them on every call
    (2080 pairs for 8192 rows of 128: about 100 us to build)."""
    return tuple((i, j) for i in range(blocks) for j in range(i, blocks, wide))


def _device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    # Triton launches on the current CUDA device, not on the one the tensors live on
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class _GramLaunch:
    """How one Gram kernel config launches: its tile table, grid and constexprs, and its operands' descriptors."""

    def __init__(self, cfg: SyrkConfig, m: int, batch: int, parts: int, sms: int, device: torch.device, common: dict):
        self.cfg = cfg
        if cfg.split_k > 1 and cfg.persistent:
            raise ValueError(f"split_k={cfg.split_k} needs a grid of one program per tile: persistent=False")
        self.tiles = _upper_tiles(_common.cdiv(m, cfg.block_m), cfg.block_n // cfg.block_m, device)
        self.n_tiles = n_tiles = self.tiles.shape[0]
        self.grid = (min(n_tiles * batch, sms),) if cfg.persistent else (n_tiles, batch, 1)
        self.meta = {
            "P_BLOCK": _common.next_power_of_2(parts),
            "BLOCK_M": cfg.block_m,
            "BLOCK_N": cfg.block_n,
            "BLOCK_K": cfg.block_k,
            "num_warps": cfg.num_warps,
            "num_stages": cfg.num_stages,
            "PERSISTENT": cfg.persistent,
            "FLATTEN": cfg.flatten,
            **common,
        }

    def descs(self, t: torch.Tensor, strides: Sequence[int], rows: int, cols: int) -> tuple[object, object]:
        """The row and column block descriptors of operand ``t``; ``(None, None)`` for pointer loads."""
        if not self.cfg.tma:
            return None, None
        xr = _descriptor(t, strides, rows, cols, [self.cfg.block_m, self.cfg.block_k])
        xc = _descriptor(t, strides, rows, cols, [self.cfg.block_n, self.cfg.block_k])
        return (xr, xc) if xr is not None and xc is not None else (None, None)


def newton_schulz_launch(
    x: torch.Tensor,
    out: torch.Tensor,
    coefficients: list[Coefficients],
    eps: float,
    dtype: torch.dtype,
    configs: tuple[SyrkConfig, SyrkConfig, PolyConfig] | tuple[SyrkConfig, PolyConfig] | None = None,
) -> None:
    """Run ``len(coefficients)`` (>= 1) iterations on ``x`` (batch, m, n), contiguous, any float dtype, writing
    ``out`` (batch, m, n) of ``dtype``. Shapes, dtypes and devices are checked by
    [`newton_schulz`][kitsune.kernels.newton_schulz.newton_schulz]; this picks tiles (unless ``configs`` says:
    ``(gram, b_prime, product)`` as `pick_configs` gives them, or ``(gram, product)`` with the ``X X^T`` config for
    ``B'`` too) and launches ``1 + 3 * steps`` kernels, and one more per split Gram."""
    batch, m_in, n_in = x.shape
    tall = m_in > n_in
    m, n = (n_in, m_in) if tall else (m_in, n_in)  # the iteration runs on X = x^T for a tall x: A is (m, m)
    so = out.stride()
    out_strides = (so[0], so[2], so[1]) if tall else so
    syrk, *rest = configs or pick_configs(m, n, batch, dtype, x.device)
    syrk_c, poly = rest if len(rest) == 2 else (syrk, rest[0])
    tl_dtype = TL_DTYPES[dtype]
    precision = "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for bf16 operands

    numel = m * n
    parts = min(MAX_PARTIALS, _common.cdiv(numel, PROLOGUE_BLOCK))
    chunk = _common.cdiv(_common.cdiv(numel, parts), PROLOGUE_BLOCK) * PROLOGUE_BLOCK
    parts = _common.cdiv(numel, chunk)
    partials = torch.empty((batch, parts), dtype=torch.float32, device=x.device)
    # X0: the input rounded to the operand dtype, in the input's orientation (the first iteration reads it through
    # strides); the input itself when it already has that dtype and its rows are aligned. Every buffer below has
    # aligned rows (`_buffer`); a copy of a wide input runs to a whole k block as the iteration buffers do, the
    # prologue writing zeros past n
    aligned = _pitch(n_in) == n_in
    n_x = _extent(n)  # the iteration buffers' columns, zeros past n
    if x.dtype == dtype and aligned:
        x0 = x
    else:
        x0 = _buffer(batch, m_in, _copy_cols(m_in, n_in), dtype, x.device)
    gram = _buffer(batch, m, m, dtype, x.device)  # A
    poly_b = _buffer(batch, m, m, dtype, x.device)  # B'
    mm_pitch = gram.stride(1)
    xs = [_buffer(batch, m, n_x, dtype, x.device) for _ in range(min(2, len(coefficients) - 1))]
    common = {
        "DTYPE": tl_dtype,
        "PRECISION": precision,
        "RNE_BF16": INTERPRETED,
    }
    poly_meta = {
        "EVEN_K": m % poly.block_k == 0,
        "BLOCK_M": poly.block_m,
        "BLOCK_N": poly.block_n,
        "BLOCK_K": poly.block_k,
        "GROUP_M": poly.group_m,
        "num_warps": poly.num_warps,
        "num_stages": poly.num_stages,
        **common,
    }
    sms = _num_sms(x.device)

    def poly_grid(cols: int) -> tuple[int, ...]:
        """The product's grid for a target of ``cols`` columns (n_x for an iteration buffer, n for the result)."""
        tiles = _common.cdiv(m, poly.block_m) * _common.cdiv(cols, poly.block_n)
        return (min(tiles * batch, sms),) if poly.persistent else (tiles, batch)

    poly_meta.update(PERSISTENT=poly.persistent, FLATTEN=poly.flatten)

    grams = {cfg: _GramLaunch(cfg, m, batch, parts, sms, x.device, common) for cfg in (syrk, syrk_c)}
    g_x, g_c = grams[syrk], grams[syrk_c]  # A = X X^T's launch and B''s (the same when one config serves both)
    # split Grams: each split's fp32 sums, one workspace for both launches (they run one after the other)
    x_split, c_split = gram_splits(syrk, syrk_c, m, n)
    ws_splits = max(x_split[0], c_split[0])
    ws = torch.empty((ws_splits, batch, m, m), dtype=torch.float32, device=x.device) if ws_splits > 1 else partials

    def gram_launch(g: _GramLaunch, split, src, descs, strides, k, c, dst, alpha, beta, diag, norm, has_c) -> None:
        n_split, k_chunk = split
        grid = g.grid if n_split == 1 else (g.n_tiles, batch, n_split)
        _syrk_kernel[grid](
            src, *descs, *strides, c, dst, ws, g.tiles, g.n_tiles, batch, partials, m, k, k_chunk, mm_pitch, parts,
            eps, alpha, beta, diag, NORM=norm, HAS_C=has_c, SPLIT=n_split > 1, EVEN_K=k % g.cfg.block_k == 0,
            TMA=descs[0] is not None, **g.meta, enable_fp_fusion=_common.FP_FUSION,
        )  # fmt: skip
        if n_split > 1:
            _gram_reduce_kernel[(g.n_tiles, batch)](
                ws, c, dst, g.tiles, batch, n_split, partials, m, mm_pitch, parts, eps, alpha, beta, diag,
                NORM=norm, HAS_C=has_c, DTYPE=tl_dtype, RNE_BF16=INTERPRETED, P_BLOCK=g.meta["P_BLOCK"],
                BLOCK_M=g.cfg.block_m, BLOCK_N=g.cfg.block_n, num_warps=g.cfg.num_warps,
                enable_fp_fusion=_common.FP_FUSION,
            )  # fmt: skip

    # the descriptor of B' is the same every iteration; X's follow the buffer the iteration reads (none for cuBLAS)
    tma_product = poly.tma and not poly.cublas
    b_desc = _descriptor(poly_b, poly_b.stride(), m, m, [poly.block_m, poly.block_k]) if tma_product else None

    def poly_descs(x_now: torch.Tensor, strides: Sequence[int], cols: int) -> tuple[object, object]:
        if b_desc is None or m % poly.block_k:
            return None, None
        xd = _descriptor(x_now, strides, m, cols, [poly.block_k, poly.block_n])
        return (b_desc, xd) if xd is not None else (None, None)

    gram_descs = g_c.descs(gram, gram.stride(), m, m)
    # per X buffer (X0, then the two the iterations alternate between): its Gram and poly descriptors, made once
    x_descs: dict[int, tuple[tuple[object, object], tuple[object, object]]] = {}
    with _device_guard(x.device):
        _prologue_kernel[(parts, batch)](
            x, x0, partials, numel, chunk, parts, n_in, x0.stride(1), STORE=x0 is not x,
            PADDED=x0.stride(1) != n_in, DTYPE=tl_dtype, RNE_BF16=INTERPRETED, BLOCK=PROLOGUE_BLOCK,
            PAD_BLOCK=_common.next_power_of_2(max(1, x0.stride(1) - n_in)), num_warps=4,
            enable_fp_fusion=_common.FP_FUSION,
        )  # fmt: skip
        x0_strides = (x0.stride(0), x0.stride(2), x0.stride(1)) if tall else x0.stride()
        # the iterate's columns in X0: n, or n_x in a wide input's copy; in the iteration buffers n_x
        x_now, x_strides, n_now = x0, x0_strides, n if tall else x0.shape[-1]
        for it, (a, b, c) in enumerate(coefficients):
            first = it == 0
            if x_now.data_ptr() not in x_descs:
                x_descs[x_now.data_ptr()] = (
                    g_x.descs(x_now, x_strides, m, n_now),
                    poly_descs(x_now, x_strides, n_now),
                )
            descs, p_descs = x_descs[x_now.data_ptr()]
            # A = X X^T (the first: of the unnormalised X0, scaled by s^2); split as for n columns (past n: zeros)
            gram_launch(
                g_x, x_split, x_now, descs, x_strides, n_now, gram, gram, 1.0, 0.0, 0.0, 2 if first else 0, False
            )
            # B' = c A A + b A + a I, where A A = A A^T (the first: times s)
            gram_launch(
                g_c, c_split, gram, gram_descs, gram.stride(), m, gram, poly_b, c, b, a, 1 if first else 0, True
            )
            last = it == len(coefficients) - 1
            target, n_t = (out, n) if last else (xs[it % 2], n_x)
            t_strides = out_strides if last else target.stride()
            if poly.cublas:  # X = B' X, a plain product: cuBLAS, through strides both ways
                cols = min(n_now, n_t)  # the columns both hold; a target's padding is zeroed apart
                rhs = x_now.as_strided((batch, m, n_now), x_strides)[..., :cols]
                torch.bmm(poly_b, rhs, out=target.as_strided((batch, m, n_t), t_strides)[..., :cols])
                if n_t > cols:
                    target[..., cols:].zero_()
            else:
                _poly_kernel[poly_grid(n_t)](  # X = B' X, the last one straight into out, transposed back
                    poly_b, *p_descs, x_now, *x_strides, target, *t_strides, mm_pitch, batch, m, n_t, n_now,
                    PAD=n_t > n_now, TMA=p_descs[0] is not None, **poly_meta, enable_fp_fusion=_common.FP_FUSION,
                )  # fmt: skip
            x_now, x_strides, n_now = target, target.stride(), n_t


def _splits(cfg: SyrkConfig, k: int) -> tuple[int, int]:
    """``(splits, k_chunk)``: the parts of a k loop of ``k`` a split Gram runs (no empty part) and each one's depth,
    a multiple of the k block; ``(1, k)`` unsplit."""
    if cfg.split_k <= 1:
        return 1, k
    k_chunk = _common.cdiv(_common.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    n_split = _common.cdiv(k, k_chunk)
    return (n_split, k_chunk) if n_split > 1 else (1, k)


def gram_splits(syrk: SyrkConfig, syrk_c: SyrkConfig, m: int, n: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """`_splits` of a call's two Gram launches on an ``(m, n)``, ``m <= n``, problem: ``X X^T`` (k = n) with config
    ``syrk``, ``B'`` (k = m) with ``syrk_c``. A split launch adds one reduce launch and an fp32 workspace."""
    return _splits(syrk, n), _splits(syrk_c, m)


class _Graph:
    """One captured `newton_schulz_launch` with its own input and output buffers (and memory pool)."""

    def __init__(self, x: torch.Tensor, dtype: torch.dtype, plan: list[Coefficients], eps: float) -> None:
        # the input buffer holds X0 in the operand dtype: the copy in rounds it (to nearest even, as the prologue
        # would), so the graph's prologue only sums squares and an fp32 input is not moved twice
        self.x = torch.empty(x.shape, dtype=dtype, device=x.device)
        self.x.copy_(x)
        self.out = torch.empty(x.shape, dtype=dtype, device=x.device)
        side = torch.cuda.Stream(x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        try:
            with torch.cuda.stream(side):  # compile and cache the tile table outside the capture
                newton_schulz_launch(self.x, self.out, plan, eps, dtype)
        finally:  # (a launch that raised: what it queued is done before these buffers can be freed)
            torch.cuda.current_stream(x.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            newton_schulz_launch(self.x, self.out, plan, eps, dtype)

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        self.x.copy_(x)
        self.graph.replay()
        out.copy_(self.out)


def graph_bytes(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> int:
    """Memory a captured graph keeps: its input (X0) and output, the padded copy of X0 where its rows are no
    multiple of 16 elements (`_extent` columns for a wide matrix), two X (`_extent` columns), the Gram matrices A
    and B' (all in the operand dtype, rows padded to 16 elements), and a split Gram's fp32 sums."""
    batch, rows, cols = shape
    m, n = sorted((rows, cols))
    elements = 2 * batch * rows * cols + 2 * batch * m * _extent(n) + 2 * batch * m * _pitch(m)
    if _pitch(cols) != cols:
        elements += batch * rows * _pitch(_copy_cols(rows, cols))
    syrk, syrk_c, _ = pick_configs(m, n, batch, dtype, device)
    splits = max(s for s, _ in gram_splits(syrk, syrk_c, m, n))
    return elements * dtype.itemsize + (batch * m * m * 4 * splits if splits > 1 else 0)


def launch_count(shape: Sequence[int], steps: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> int:
    """Kernel launches of one call on a ``(batch, rows, cols)`` input: the prologue, three per iteration and one more
    per split Gram (0 iterations: none, the normalisation runs in torch ops)."""
    if not steps:
        return 0
    batch, rows, cols = shape
    m, n = sorted((rows, cols))
    syrk, syrk_c, _ = pick_configs(m, n, batch, dtype, device)
    return 1 + (3 + sum(s > 1 for s, _ in gram_splits(syrk, syrk_c, m, n))) * steps


GRAPH_CACHE_SHARE = 64
"""Calls replay a captured CUDA graph (`_Graph`) where it fits in the graph cache, 1 / `GRAPH_CACHE_SHARE` of the
device's memory (2.2 GB on an H200, 1.25 GB on an 80 GB H100, 384 MB on 24 GB). A call's ``1 + 3 * steps`` Triton
launches cost a host up to 40-90 us each, as much as the GPU needs to run the kernels of all but the largest
problems, while a graph's copies in and out cost a few percent of the call (the copy in rounds the input to the
operand dtype, which the prologue would do). H200s (torch 2.11, Triton 3.6, 2026-12-03), launched directly against
replayed, in turns: on a host that took 0.65-1.58 ms to launch one call, 1024 x 16384 0.99 -> 0.68 ms, 2048 x 8192
1.74 -> 1.10, 4 x 2048 x 4096 2.72 -> 2.23, 8 x 2048^2 2.58 -> 2.53, 4096^2 2.32 -> 2.33, 2048 x 32000 3.75 -> 3.73;
on a host whose launches hid behind the GPU the copies cost 0-4% (4096^2 2.21 -> 2.30, 12 x 768 x 3072 0.78 -> 0.81,
8 x 2048^2 2.55 -> 2.56), while kitsune.optim.Muon's step, host-bound there too, took 3.97 against 4.85 ms on GPT-2's
hidden matrices and the same time on 8 x 2048^2 (2.88)."""
GRAPH_STALE_CALLS = 64
"""A cached graph not replayed in the last this many calls may be dropped to make room for another. While every
cached graph is in use, a call whose graph does not fit launches directly: two shapes that do not fit together are
never captured again and again in turns."""


class _GraphCache:
    """One device's captured graphs of recent problems, at most ``budget`` bytes of them (their `graph_bytes`)."""

    def __init__(self) -> None:
        self.entries: OrderedDict[tuple, tuple[object, int, int]] = OrderedDict()  # key: (graph, bytes, last call)
        self.calls = 0

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: tuple, size: Callable[[], int], budget: int, capture: Callable[[], object]) -> object | None:
        """The graph for ``key``, from ``capture()`` on its first use where its ``size()`` bytes fit (dropping graphs
        unused for `GRAPH_STALE_CALLS` calls, least recently used first); None where they do not."""
        self.calls += 1
        if key in self.entries:
            graph, nbytes, _ = self.entries[key]
            self.entries[key] = (graph, nbytes, self.calls)
            self.entries.move_to_end(key)
            return graph
        nbytes = size()
        used = sum(n for _, n, _ in self.entries.values())
        stale = [k for k, (_, _, last) in self.entries.items() if self.calls - last > GRAPH_STALE_CALLS]
        while used + nbytes > budget and stale:
            used -= self.entries.pop(stale.pop(0))[1]
        if used + nbytes > budget:
            return None
        graph = capture()
        self.entries[key] = (graph, nbytes, self.calls)
        return graph


_graphs: defaultdict[torch.device, _GraphCache] = defaultdict(_GraphCache)
"""Each device's graph cache."""


@functools.cache
def _graph_budget(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).total_memory // GRAPH_CACHE_SHARE


def clear_graph_cache() -> None:
    """Drop the CUDA graphs that `newton_schulz` calls captured, and with them the memory they hold (at most
    1 / `GRAPH_CACHE_SHARE` of each device's): the next call of each shape captures its graph again."""
    _graphs.clear()


def _graph_for(x: torch.Tensor, dtype: torch.dtype, plan: list[Coefficients], eps: float) -> _Graph | None:
    """The captured graph for this problem on the current stream, capturing it on first use; None when launching
    directly: a CPU tensor, a graph that does not fit in the cache (`GRAPH_CACHE_SHARE`), or a caller that is itself
    capturing a graph (the launches join theirs). Each stream has its own graph: a graph's buffers are reused by
    every replay, which the stream's order keeps apart (two calls of one shape on two streams run at once)."""
    if x.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    stream = torch.cuda.current_stream(x.device).cuda_stream
    key = (tuple(x.shape), x.dtype, dtype, tuple(plan), eps, stream)
    size = lambda: graph_bytes(x.shape, dtype, x.device)  # noqa: E731
    return _graphs[x.device].get(key, size, _graph_budget(x.device), lambda: _Graph(x, dtype, plan, eps))


def newton_schulz(
    X: torch.Tensor,
    steps: int = 5,
    coefficients: Coefficients | Sequence[Coefficients] = MUON_COEFFICIENTS,
    eps: float = 1e-7,
    *,
    dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    graph: bool = True,
) -> torch.Tensor:
    """Orthogonalise each matrix of ``X``: ``steps`` quintic Newton-Schulz iterations of ``X / max(||X||_F, eps)``.

    On a GPU a call replays a CUDA graph captured on the first call of its shape (and dtypes, coefficients and eps)
    on the current stream, kept in a per-device cache of at most 1/64 of the device's memory; `clear_graph_cache`
    empties it. Inside a graph capture the kernels join the caller's graph.

    Args:
        X: ``(m, n)`` or ``(batch, m, n)``, fp32/bf16/fp16, on a CUDA device (or on the CPU under
            ``TRITON_INTERPRET=1``). Each matrix is normalised by its own Frobenius norm.
        steps: iterations (0 returns the normalised input).
        coefficients: ``(a, b, c)`` of ``X <- a X + b (X X^T) X + c (X X^T)^2 X``, or one triple per iteration
            (the last repeats), e.g. `POLAR_EXPRESS_COEFFICIENTS`.
        eps: the norm is clamped to at least ``eps`` (a zero matrix stays zero).
        dtype: the operand dtype of the products and of the result: bf16 (as torch.optim.Muon) or fp32.
        out: where to write the result (``X``'s shape, ``dtype``, contiguous); a new tensor when None.
        graph: False launches the kernels directly, and no graph is captured or kept for this call.

    Returns:
        ``out``, or a new tensor of ``X``'s shape in ``dtype``.
    """
    if X.dim() not in (2, 3):
        raise ValueError(f"newton_schulz takes (m, n) or (batch, m, n) matrices, got shape {tuple(X.shape)}")
    if X.dtype not in SUPPORTED_INPUT_DTYPES:
        raise ValueError(f"newton_schulz supports inputs of {SUPPORTED_INPUT_DTYPES}, got {X.dtype}")
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"newton_schulz computes in {COMPUTE_DTYPES}, got dtype={dtype}")
    if X.device.type != "cuda" and not INTERPRETED:
        raise ValueError(f"newton_schulz needs a CUDA tensor (or TRITON_INTERPRET=1 for CPU tensors), got {X.device}")
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be a non-negative int, got {steps!r}")
    if not eps >= 0.0:
        raise ValueError(f"eps must be non-negative, got {eps}")
    if out is None:
        out = torch.empty(X.shape, dtype=dtype, device=X.device)
    elif out.shape != X.shape or out.dtype != dtype or out.device != X.device or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {dtype} tensor of shape {tuple(X.shape)} on {X.device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    plan = schedule(coefficients, steps)
    x = X.unsqueeze(0) if X.dim() == 2 else X
    if x.shape[-2] * x.shape[-1] >= 2**31:
        raise ValueError(f"newton_schulz supports matrices of fewer than 2**31 elements, got {tuple(X.shape[-2:])}")
    out3 = out.view(x.shape)
    if out.numel() == 0:
        return out
    if steps == 0:
        x = x.to(dtype)
        out3.copy_(x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps))
        return out
    x = x.contiguous()
    captured = _graph_for(x, dtype, plan, eps) if graph else None
    if captured is not None:
        captured(x, out3)
    else:
        newton_schulz_launch(x, out3, plan, eps, dtype)
    return out
