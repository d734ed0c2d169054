"""One generic multi-tensor optimizer update kernel; constexpr switches pick the algorithm and its options.

Adam, AdamW, SGD, Adagrad, RMSprop, Lion, NAdam, RAdam, Adamax, Adadelta, Rprop and ASGD share the skeleton (load
param and grad, maximize, weight decay, update the state, update the param); only the middle differs, so they are
one kernel, and Triton compiles one variant per switch combination. Hyperparameters are never Python constants:
each tensor's row of the device-resident buffer ``hyper`` (float64, ``(n_groups, NUM_FIELDS)``) is read through its
group index, so an LR scheduler changes values without a recompile and a captured graph stays valid.

Math runs in fp32 with per-tensor scalars (bias corrections) in fp64, as torch computes them on the host in
double; params and state are loaded once, updated in registers and rounded once when stored, in the param's
dtype like torch's state. For bf16/fp16 these are the semantics of torch's ``fused=True`` kernels, not of its
eager per-op path, which rounds after every op (and on CPU even rounds ``alpha`` to bf16).

Step counts: every block of a tensor reads ``step`` before it works and uses ``step + 1``; then it bumps the
tensor's block counter with an acq_rel atomic; the block that finishes last (all others have read ``step`` by
then) writes ``step + 1`` and resets the counter. So one launch both updates and counts, race-free. Per-tensor
scalars besides the step (NAdam's ``mu_product``, ASGD's ``eta`` and ``mu``: roles ``scalar1``, ``scalar2``) go the
same way: every block reads the old value, the last block writes the new one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kitsune.kernels import common as _common
from kitsune.kernels.codes import BUCKETS, CODE_SIZE, PACKED_START, QUANT_BLOCK, device_tables
from kitsune.kernels.common import (
    ADAPT,
    B1,
    B2,
    EPS,
    EXTRA,
    LR,
    TL_DTYPES,
    TRUST_A,
    VECTOR_ELEMS,
    WD,
    _cast,
    _hyper_row,
    _lerp,
    _live,
    _pow_step,
    _program_block,
    _ptr,
    _reduce,
    _tile_masks,
    _vptr,
    vectors_fit,
)
from kitsune.kernels.multi_tensor import TensorTables
from kitsune.kernels.quant import (
    _absmax_rows,
    _absmax_rows2,
    _dequantize_block,
    _quantize_rows,
    _stochastic_round_bf16,
)
from kitsune.kernels.spec import NUM_FIELDS, StateFormat, Trust, UpdateSpec

SUPPORTED_DTYPES = tuple(TL_DTYPES)


@triton.jit
def _add_wd(g, wd, p):
    """``g + wd * p``, skipped when ``wd`` is 0 as torch skips it (an inf param would otherwise make 0 * inf = nan)."""
    return tl.where(wd != 0.0, g + wd.to(tl.float32) * p, g)


_CODE_SIZE = tl.constexpr(CODE_SIZE)
_VECTOR_ELEMS = tl.constexpr(VECTOR_ELEMS)
_BUCKETS = tl.constexpr(BUCKETS)
_PACKED_START = tl.constexpr(PACKED_START)


@triton.jit
def _tile(start, n, live, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """`kitsune.kernels.common._tile_masks`; with VEC (the 8-bit vector layout, or FVEC) with ``mask`` as ``offs <
    n`` where ``live``, which keeps the alignment of ``n`` that Triton's vector reads need (``offs < where(live, n,
    0)`` hides it), and costs the other layouts instructions. (Not ``inside & live``: Triton's CPU interpreter cannot
    mask a load with that.)"""
    if VEC:
        offs = start + tl.arange(0, BLOCK).to(tl.int64)
        inside = offs < n
        return offs, tl.where(live, inside, False), inside
    return _tile_masks(start, n, live, BLOCK)


@triton.jit
def _q8_raw(addr, aaddr, offs, start, lim, BLOCK: tl.constexpr, QBLOCK: tl.constexpr, VEC: tl.constexpr):
    """``(word, absmax)``: what `_sload` reads of an 8-bit state slot (the codes at ``addr``, their absmax blocks at
    ``aaddr``) for the elements ``offs`` from ``start``: the 4-byte word that holds each element's code (the tensor's
    address is a multiple of CODES_ALIGN) and the block's absmax; with VEC the code bytes themselves, a thread's
    consecutive codes read as one vector. Without VEC not bytes: a masked 8-bit load goes through a 16-bit register,
    and ptxas may chain such loads through the halves of one register, each waiting for memory before the next is
    issued."""
    if VEC:
        word = tl.load(_vptr(addr, offs, tl.uint8, VEC), mask=offs < lim, other=0).to(tl.int32)
    else:
        word = tl.load(_ptr(addr, offs >> 2, tl.int32), mask=offs < lim, other=0)
    rows, row_mask = _q8_rows(aaddr, start, lim, BLOCK, QBLOCK)
    return word, tl.load(rows, mask=row_mask, other=0.0)


@triton.jit
def _q8_rows(aaddr, start, lim, BLOCK: tl.constexpr, QBLOCK: tl.constexpr):
    """``(pointers, mask)`` of the fp32 absmax of the BLOCK // QBLOCK quantization blocks from ``start`` at
    ``aaddr``, the mask covering the blocks that start below ``lim``."""
    rows = start // QBLOCK + tl.arange(0, BLOCK // QBLOCK).to(tl.int64)
    return _ptr(aaddr, rows, tl.float32), rows * QBLOCK < lim


@triton.jit
def _sload(addr, aaddr, offs, start, lim, qmap, word, absmax, SIGNED: tl.constexpr, SDTYPE: tl.constexpr,
           Q8: tl.constexpr, PREFETCH: tl.constexpr, BLOCK: tl.constexpr, QBLOCK: tl.constexpr,
           VEC: tl.constexpr):  # fmt: skip
    """A state slot (the tensor at ``addr``; with Q8, its absmax blocks at ``aaddr``) at ``offs``, as
    fp32: SDTYPE elements, or with Q8 uint8 codes into the signed (SIGNED) or unsigned half of ``qmap``; with
    PREFETCH, ``word`` and ``absmax`` hold what `_q8_raw` read for these elements, loaded ahead; with VEC (float
    state) as vectors."""
    if Q8:
        code, _ = _q8_tables(qmap, SIGNED)
        if not PREFETCH:
            word, absmax = _q8_raw(addr, aaddr, offs, start, lim, BLOCK, QBLOCK, Q8 == 2)
        q = word if Q8 == 2 else (word >> ((offs.to(tl.int32) & 3) << 3)) & 0xFF
        x = _dequantize_block(q, absmax, code, BLOCK, QBLOCK)
    else:
        x = tl.load(_vptr(addr, offs, SDTYPE, VEC), mask=offs < lim, other=0.0).to(tl.float32)
    return x


@triton.jit
def _q8_tables(qmap, SIGNED: tl.constexpr):
    """``(code, packed)``: the signed (SIGNED) or unsigned map's code table and `kitsune.kernels.codes.packed_table`
    in ``qmap`` (`kitsune.kernels.codes.device_tables`)."""
    packed = (qmap + _PACKED_START).to(tl.pointer_type(tl.int32), bitcast=True)
    if SIGNED:
        return qmap, packed
    return qmap + _CODE_SIZE, packed + _BUCKETS


@triton.jit
def _q8_store(addr, aaddr, offs, start, lim, x, bits, qmap, SIGNED: tl.constexpr, BLOCK: tl.constexpr,
              QBLOCK: tl.constexpr, VEC: tl.constexpr):  # fmt: skip
    """Quantize ``x`` (zero past ``lim``) with its blocks' absmax bits (`quant._absmax_rows`) and store codes and
    absmax."""
    code, packed = _q8_tables(qmap, SIGNED)
    q, absmax = _quantize_rows(x, bits, code, BLOCK, QBLOCK, packed, 1 if SIGNED else 2)
    tl.store(_vptr(addr, offs, tl.uint8, VEC), q, mask=offs < lim)
    rows, row_mask = _q8_rows(aaddr, start, lim, BLOCK, QBLOCK)
    tl.store(rows, absmax, mask=row_mask)


@triton.jit
def _sstore(addr, aaddr, offs, start, lim, x, qmap, SIGNED: tl.constexpr, SDTYPE: tl.constexpr, Q8: tl.constexpr,
            RNE_BF16: tl.constexpr, BLOCK: tl.constexpr, QBLOCK: tl.constexpr, VEC: tl.constexpr):  # fmt: skip
    """Store fp32 ``x`` into a state slot as `_sload` reads it: rounded to SDTYPE, or quantized per QBLOCK elements
    (lanes past ``lim`` count as 0 in a block's absmax). With Q8, ``qmap`` holds the code tables, then their bucket
    tables (`kitsune.kernels.codes.device_tables`)."""
    if Q8:
        x = tl.where(offs < lim, x, 0.0)
        bits = _absmax_rows(x, BLOCK, QBLOCK)
        _q8_store(addr, aaddr, offs, start, lim, x, bits, qmap, SIGNED, BLOCK, QBLOCK, Q8 == 2)
    else:
        tl.store(_vptr(addr, offs, SDTYPE, VEC), _cast(x, SDTYPE, RNE_BF16), mask=offs < lim)


@triton.jit
def _sstore2(addr, aaddr, x, SIGNED: tl.constexpr, addr2, aaddr2, y, SIGNED2: tl.constexpr, offs, start, lim, qmap,
             SDTYPE: tl.constexpr, Q8: tl.constexpr, RNE_BF16: tl.constexpr, BLOCK: tl.constexpr,
             QBLOCK: tl.constexpr, VEC: tl.constexpr):  # fmt: skip
    """`_sstore` of two slots (``x`` at ``addr``, ``y`` at ``addr2``): with Q8 their blocks' absmax come from one
    reduction (`quant._absmax_rows2`), so a program's warps exchange them in one round instead of two."""
    if Q8:
        x = tl.where(offs < lim, x, 0.0)
        y = tl.where(offs < lim, y, 0.0)
        bx, by = _absmax_rows2(x, y, BLOCK, QBLOCK)
        _q8_store(addr, aaddr, offs, start, lim, x, bx, qmap, SIGNED, BLOCK, QBLOCK, Q8 == 2)
        _q8_store(addr2, aaddr2, offs, start, lim, y, by, qmap, SIGNED2, BLOCK, QBLOCK, Q8 == 2)
    else:
        _sstore(addr, aaddr, offs, start, lim, x, qmap, SIGNED, SDTYPE, Q8, RNE_BF16, BLOCK, QBLOCK, VEC)
        _sstore(addr2, aaddr2, offs, start, lim, y, qmap, SIGNED2, SDTYPE, Q8, RNE_BF16, BLOCK, QBLOCK, VEC)


@triton.jit
def _update_kernel(
    block_tensor,  # (n_blocks,) int32
    block_start,  # (n_blocks,) int64
    numel_tab,  # (T,) int64
    group_tab,  # (T,) int32
    counter_tab,  # (T,) int32, zero between launches
    param_tab,  # (T,) int64 addresses, one table per role
    grad_tab,
    s1_tab,
    s2_tab,
    s3_tab,
    a1_tab,  # (T,) int64 addresses of each state slot's fp32 absmax blocks, read only with Q8
    a2_tab,
    a3_tab,
    qmap,  # fp32: kitsune.kernels.codes.device_tables (code and bucket tables), read only with Q8
    step_tab,
    sc1_tab,  # (T,) int64 addresses of float32 scalars, read only with SCALARS >= 1 (>= 2 for sc2_tab)
    sc2_tab,
    hyper,  # (n_groups, NUM_FIELDS) float64
    found_inf,  # float32 scalar: nonzero skips the whole update (AMP overflow), read only with HAS_FOUND_INF
    grad_scale,  # float32 scalar: the grads hold grad * grad_scale (a loss scale), read only with HAS_GRAD_SCALE
    total_norm,  # float32 scalar: the global grad norm (of the unscaled grads), read only with CLIP
    max_norm,  # fp32: clip to this global norm, used only with CLIP
    tensor_norms,  # fp32 (2 * n_norm,): per-tensor norms of the grads, then of the params (TRUST)
    norm_offset,  # this launch's first tensor in tensor_norms
    n_norm,  # where the params' norms start in tensor_norms
    partials,  # (n_blocks,) fp32 scratch (LAMB stage 1)
    update_norm,  # (T,) fp32: each tensor's ||update||, written by LAMB stage 1, read by stage 2
    seed,  # int: the stochastic rounding's Philox key, read only with SR
    comp_tab,  # (T,) int64 addresses of each param's compensation (its dtype), read only with KAHAN
    ALGO: tl.constexpr,
    DTYPE: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    DECOUPLED: tl.constexpr,
    AMSGRAD: tl.constexpr,
    MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    CENTERED: tl.constexpr,
    HAS_STEP: tl.constexpr,
    SCALARS: tl.constexpr,  # per-tensor scalars besides step: 0, 1 (NAdam) or 2 (ASGD)
    HAS_FOUND_INF: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    CLIP: tl.constexpr,
    GRAD_WRITE: tl.constexpr,  # 0: leave the grads, 1: store the unscaled/clipped grads used, 2: store zeros
    TRUST: tl.constexpr,  # 0: none, 1: LARS, 2: LAMB stage 1 (moments, ||update||), 3: LAMB stage 2 (params)
    RBLOCK: tl.constexpr,
    RNE_BF16: tl.constexpr,
    SDTYPE: tl.constexpr,  # the state tensors' dtype (without Q8)
    Q8: tl.constexpr,  # 8-bit block-wise state (uint8 codes, an fp32 absmax per QBLOCK elements): 0 none, 1, or 2 with
    # params and codes at 16-byte multiples (Q8_VECTOR): a warp per QBLOCK, consecutive elements a thread, vectors
    FVEC: tl.constexpr,  # float state (`FLOAT_VECTOR`): params, grads and state at 16-byte multiples, numels and
    # program starts multiples of VECTOR_ELEMS: vector reads and writes
    SIGNS: tl.constexpr,  # with Q8: bit i set when slot i + 1 takes the signed code table
    SLOTS: tl.constexpr,  # state slots the update reads (with PREFETCH)
    PREFETCH: tl.constexpr,  # Q8 with several tiles a program: load each tile's params, grads and codes a pass ahead
    QBLOCK: tl.constexpr,
    SR: tl.constexpr,  # bf16 params stored with stochastic rounding (needs HAS_STEP)
    KAHAN: tl.constexpr,  # params stored with Kahan compensation (comp_tab)
    BLOCK: tl.constexpr,  # elements per program
    TILE: tl.constexpr,  # elements per pass of its loop (BLOCK with a trust ratio: LAMB's partials are per program)
):
    pid, t, start, numel, g_addr = _program_block(block_tensor, block_start, numel_tab, grad_tab)
    VEC: tl.constexpr = (Q8 == 2) or FVEC
    if VEC:  # programs start at multiples of QBLOCK (8-bit) or VECTOR_ELEMS in a tensor and every numel is a multiple
        # of VECTOR_ELEMS, so a thread's elements are all in or all out and sit at 16-byte multiples. The hints go on
        # values made here: on the result of a call, tl.multiple_of marks every operation of the callee
        START_ALIGN: tl.constexpr = QBLOCK if Q8 == 2 else _VECTOR_ELEMS
        start = tl.multiple_of(tl.load(block_start + pid), START_ALIGN)
        numel = tl.multiple_of(tl.where(g_addr != -1, tl.load(numel_tab + t), 0), _VECTOR_ELEMS)
    live = _live(g_addr, found_inf, HAS_FOUND_INF)
    # the state slots' elements this block reads and writes: offs < lim (a product, not a select, which would hide
    # numel's alignment from Triton's vector loads)
    lim = numel * live.to(tl.int64)
    row = _hyper_row(hyper, group_tab, t)
    lr = tl.load(row + LR)
    b1 = tl.load(row + B1)
    b2 = tl.load(row + B2)
    eps = tl.load(row + EPS).to(tl.float32)
    wd = tl.load(row + WD)
    extra = tl.load(row + EXTRA)
    trust_a = tl.load(row + TRUST_A)
    adapt = tl.load(row + ADAPT) != 0.0

    step = 0.0
    if HAS_STEP:
        step_ptr = tl.load(step_tab + t).to(tl.pointer_type(tl.float32))
        step = tl.load(step_ptr, mask=live, other=0.0).to(tl.float64) + 1.0
    sc1 = 1.0
    sc2 = 1.0
    if SCALARS >= 1:
        sc1_ptr = tl.load(sc1_tab + t).to(tl.pointer_type(tl.float32))
        sc1 = tl.load(sc1_ptr, mask=live, other=1.0)
    if SCALARS >= 2:
        sc2_ptr = tl.load(sc2_tab + t).to(tl.pointer_type(tl.float32))
        sc2 = tl.load(sc2_ptr, mask=live, other=1.0)
    new1 = sc1  # what the tensor's last block writes back
    new2 = sc2
    # the tensor's addresses, read once: the loop's stores would keep the compiler from hoisting the reads
    p_at = tl.load(param_tab + t)
    s1_at = tl.load(s1_tab + t)
    s2_at = tl.load(s2_tab + t)
    s3_at = tl.load(s3_tab + t)
    a1_at = tl.load(a1_tab + t)
    a2_at = tl.load(a2_tab + t)
    a3_at = tl.load(a3_tab + t)
    c_at = tl.load(comp_tab + t)

    # the elementwise work, a tile at a time: 8-bit state quantizes per tile (TILE = QBLOCK), and a program of
    # several tiles pays the per-tensor work above (hyperparameters, the bias corrections in fp64) once
    if BLOCK == TILE:
        n_tiles = 1
    else:  # only the tiles that hold elements, and one (all masked) for an empty tensor or a grad that is None:
        # NAdam's and ASGD's per-tensor scalars are computed in the loop's body
        n_tiles = tl.maximum((tl.minimum(numel - start, BLOCK) + TILE - 1) // TILE, 1)
    if PREFETCH:  # the first tile's loads; each pass of the loop issues the next tile's before it works on its own
        offs, mask, gmask = _tile(start, numel, live, TILE, VEC)
        p_next = tl.load(_vptr(p_at, offs, DTYPE, VEC), mask=mask, other=0.0)
        g_next = tl.load(_ptr(g_addr, offs, DTYPE), mask=gmask if GRAD_WRITE != 0 else mask, other=0.0)
        w1_next, am1_next = _q8_raw(s1_at, a1_at, offs, start, lim, TILE, QBLOCK, VEC)
        if SLOTS >= 2:
            w2_next, am2_next = _q8_raw(s2_at, a2_at, offs, start, lim, TILE, QBLOCK, VEC)
        if SLOTS >= 3:
            w3_next, am3_next = _q8_raw(s3_at, a3_at, offs, start, lim, TILE, QBLOCK, VEC)
    for sub in tl.range(0, n_tiles):
        tstart = start + sub * TILE
        offs, mask, gmask = _tile(tstart, numel, live, TILE, VEC)
        p_ptr = _vptr(p_at, offs, DTYPE, VEC)
        g_ptr = _vptr(g_addr, offs, DTYPE, FVEC)
        s1_ptr = _ptr(s1_at, offs, DTYPE)  # LAMB's moments (always in the param's dtype); the others: _sload
        s2_ptr = _ptr(s2_at, offs, DTYPE)
        w1, am1, w2, am2, w3, am3 = 0, 0.0, 0, 0.0, 0, 0.0  # the 8-bit slots' words and absmax, when prefetched
        if PREFETCH:  # DRAM's latency overlaps this tile's work, which waits on nothing but the loads issued a pass ago
            p_raw, g_raw, w1, am1 = p_next, g_next, w1_next, am1_next
            noffs, nmask, ngmask = _tile(tstart + TILE, numel, live, TILE, VEC)  # past the tensor: nothing loads
            p_next = tl.load(_vptr(p_at, noffs, DTYPE, VEC), mask=nmask, other=0.0)
            g_next = tl.load(_ptr(g_addr, noffs, DTYPE), mask=ngmask if GRAD_WRITE != 0 else nmask, other=0.0)
            w1_next, am1_next = _q8_raw(s1_at, a1_at, noffs, tstart + TILE, lim, TILE, QBLOCK, VEC)
            if SLOTS >= 2:
                w2, am2 = w2_next, am2_next
                w2_next, am2_next = _q8_raw(s2_at, a2_at, noffs, tstart + TILE, lim, TILE, QBLOCK, VEC)
            if SLOTS >= 3:
                w3, am3 = w3_next, am3_next
                w3_next, am3_next = _q8_raw(s3_at, a3_at, noffs, tstart + TILE, lim, TILE, QBLOCK, VEC)
        else:
            p_raw = tl.load(p_ptr, mask=mask, other=0.0)
            g_raw = p_raw
            if TRUST != 3:  # LAMB's stage 2 reads no grad: stage 1 has stored the moments
                g_raw = tl.load(g_ptr, mask=gmask if GRAD_WRITE != 0 else mask, other=0.0)
        p = p_raw.to(tl.float32)
        p0 = p  # the stored param, for Kahan compensation
        coef = 1.0
        if TRUST != 3:
            g = g_raw.to(tl.float32)
            # torch's order, each product rounded to fp32 as torch stores it in fp32 grads: unscale (GradScaler's
            # unscale_ multiplies by the fp32 reciprocal of the scale, taken in double), then clip (clip_grad_norm_'s
            # coefficient)
            if HAS_GRAD_SCALE:
                g = g * (1.0 / tl.load(grad_scale).to(tl.float64)).to(tl.float32)
            if CLIP:
                coef = tl.math.div_rn(1.0, tl.load(total_norm) + 1e-6) * max_norm
                coef = tl.where(coef > 1.0, 1.0, coef)  # a nan coefficient stays nan, as with torch.clamp
                g = g * coef
            if GRAD_WRITE == 1:
                tl.store(g_ptr, _cast(g, DTYPE, RNE_BF16), mask=gmask)
            elif GRAD_WRITE == 2:
                tl.store(g_ptr, tl.zeros_like(g).to(DTYPE), mask=gmask)
            if MAXIMIZE:
                g = -g
        else:
            g = p

        if TRUST >= 2:  # LAMB (You et al. 2019): u = m_hat / (sqrt(v_hat) + eps) + wd * p, p -= lr * trust * u
            if TRUST == 2:
                m = _lerp(tl.load(s1_ptr, mask=mask, other=0.0).to(tl.float32), g, (1.0 - b1).to(tl.float32))
                v = tl.load(s2_ptr, mask=mask, other=0.0).to(tl.float32)
                v = v * b2.to(tl.float32) + (1.0 - b2).to(tl.float32) * g * g
                m = _cast(m, DTYPE, RNE_BF16)
                v = _cast(v, DTYPE, RNE_BF16)
                tl.store(s1_ptr, m, mask=mask)
                tl.store(s2_ptr, v, mask=mask)
                m = m.to(tl.float32)  # stage 2 reads the stored (rounded) moments: use the same values here
                v = v.to(tl.float32)
            else:
                m = tl.load(s1_ptr, mask=mask, other=0.0).to(tl.float32)
                v = tl.load(s2_ptr, mask=mask, other=0.0).to(tl.float32)
            bias1 = tl.where(extra != 0.0, 1.0 - _pow_step(b1, step), 1.0).to(tl.float32)
            bias2 = tl.where(extra != 0.0, 1.0 - _pow_step(b2, step), 1.0).to(tl.float32)
            u = _add_wd((m / bias1) / (tl.sqrt(v / bias2) + eps), wd, p)
            if TRUST == 2:
                tl.store(partials + pid, tl.sum(tl.where(mask, u * u, 0.0), 0))
            else:
                w_norm = tl.load(tensor_norms + n_norm + norm_offset + t)
                u_norm = tl.load(update_norm + t)
                trust = tl.where((w_norm > 0.0) & (u_norm > 0.0), w_norm / u_norm, 1.0)
                trust = tl.minimum(trust, trust_a.to(tl.float32))  # max_trust_ratio; inf when there is none
                trust = tl.where(adapt, trust, 1.0)
                p = p - u * (lr.to(tl.float32) * trust)
        elif ALGO == 0:  # Adam / AdamW: s1 exp_avg, s2 exp_avg_sq, s3 max_exp_avg_sq
            if DECOUPLED:
                p = p * (1.0 - lr * wd).to(tl.float32)
            else:
                g = _add_wd(g, wd, p)
            m = _sload(
                s1_at, a1_at, offs, tstart, lim, qmap, w1, am1, SIGNS & 1, SDTYPE, Q8, PREFETCH, TILE, QBLOCK, VEC
            )
            m = _lerp(m, g, (1.0 - b1).to(tl.float32))
            v = _sload(
                s2_at, a2_at, offs, tstart, lim, qmap, w2, am2, SIGNS & 2, SDTYPE, Q8, PREFETCH, TILE, QBLOCK, VEC
            )
            v = v * b2.to(tl.float32) + (1.0 - b2).to(tl.float32) * g * g
            _sstore2(s1_at, a1_at, m, SIGNS & 1, s2_at, a2_at, v, SIGNS & 2, offs, tstart, lim, qmap,
                     SDTYPE, Q8, RNE_BF16, TILE, QBLOCK, VEC)  # fmt: skip
            if AMSGRAD:
                v = tl.maximum(
                    _sload(
                        s3_at,
                        a3_at,
                        offs,
                        tstart,
                        lim,
                        qmap,
                        w3,
                        am3,
                        SIGNS & 4,
                        SDTYPE,
                        Q8,
                        PREFETCH,
                        TILE,
                        QBLOCK,
                        VEC,
                    ),
                    v,
                    propagate_nan=tl.PropagateNan.ALL,  # as torch.maximum: a nan grad makes max_exp_avg_sq nan
                )
                _sstore(s3_at, a3_at, offs, tstart, lim, v, qmap, SIGNS & 4, SDTYPE, Q8, RNE_BF16, TILE, QBLOCK, VEC)
            # 1 - beta**step in fp64: in fp32 the early steps (1 - 0.999) would lose four digits
            bias1 = 1.0 - _pow_step(b1, step)
            bias2_sqrt = tl.sqrt(1.0 - _pow_step(b2, step))
            step_size = (lr / bias1).to(tl.float32)
            denom = tl.sqrt(v) / bias2_sqrt.to(tl.float32) + eps
            p = p - step_size * (m / denom)
        elif ALGO == 1:  # SGD: s1 momentum_buffer
            if TRUST == 1:  # LARS (You et al. 2017): the trust ratio from the norms of the param and the grad used
                g_norm = tl.load(tensor_norms + norm_offset + t) * coef
                w_norm = tl.load(tensor_norms + n_norm + norm_offset + t)
                ratio = (trust_a.to(tl.float32) * w_norm) / ((g_norm + wd.to(tl.float32) * w_norm) + eps)
                trust = tl.where(adapt & (w_norm > 0.0) & (g_norm > 0.0), ratio, 1.0)
                g = _add_wd(g, wd, p) * trust
            else:
                g = _add_wd(g, wd, p)
            if MOMENTUM:
                buf = _sload(
                    s1_at, a1_at, offs, tstart, lim, qmap, w1, am1, SIGNS & 1, SDTYPE, Q8, PREFETCH, TILE, QBLOCK, VEC
                )
                # the first step copies the grad, as torch's lazily created buffer does
                buf = tl.where(step == 1.0, g, buf * b1.to(tl.float32) + (1.0 - extra).to(tl.float32) * g)
                _sstore(s1_at, a1_at, offs, tstart, lim, buf, qmap, SIGNS & 1, SDTYPE, Q8, RNE_BF16, TILE, QBLOCK, VEC)
                if NESTEROV:
                    g = g + b1.to(tl.float32) * buf
                else:
                    g = buf
            p = p - lr.to(tl.float32) * g
        elif ALGO == 2:  # Adagrad: s1 sum
            g = _add_wd(g, wd, p)
            clr = (lr / (1.0 + (step - 1.0) * extra)).to(tl.float32)
            acc = (
                _sload(
                    s1_at, a1_at, offs, tstart, lim, qmap, w1, am1, SIGNS & 1, SDTYPE, Q8, PREFETCH, TILE, QBLOCK, VEC
                )
                + g * g
            )
            _sstore(s1_at, a1_at, offs, tstart, lim, acc, qmap, SIGNS & 1, SDTYPE, Q8, RNE_BF16, TILE, QBLOCK, VEC)
            p = p - clr * (g / (tl.sqrt(acc) + eps))
        elif ALGO == 3:  # RMSprop: s1 square_avg, s2 momentum_buffer, s3 grad_avg
            g = _add_wd(g, wd, p)
            sq = _sload(
                s1_at, a1_at, offs, tstart, lim, qmap, w1, am1, SIGNS & 1, SDTYPE, Q8, PREFETCH, TILE, QBLOCK, VEC
            )
            sq = sq * b2.to(tl.float32) + (1.0 - b2).to(tl.float32) * g * g
            _sstore(s1_at, a1_at, offs, tstart, lim, sq, qmap, SIGNS & 1, SDTYPE, Q8, RNE_BF16, TILE, QBLOCK, VEC)
            if CENTERED:
                ga = _sload(
                    s3_at, a3_at, offs, tstart, lim, qmap, w3, am3, SIGNS & 4, SDTYPE, Q8, PREFETCH, TILE, QBLOCK, VEC
                )
                ga = _lerp(ga, g, (1.0 - b2).to(tl.float32))
                _sstore(s3_at, a3_at, offs, tstart, lim, ga, qmap, SIGNS & 4, SDTYPE, Q8, RNE_BF16, TILE, QBLOCK, VEC)
                avg = tl.sqrt(sq - ga * ga) + eps
            else:
                avg = tl.sqrt(sq) + eps
            if MOMENTUM:
                buf = _sload(
                    s2_at, a2_at, offs, tstart, lim, qmap, w2, am2, SIGNS & 2, SDTYPE, Q8, PREFETCH, TILE, QBLOCK, VEC
                )
                buf = buf * b1.to(tl.float32) + g / avg
                _sstore(s2_at, a2_at, offs, tstart, lim, buf, qmap, SIGNS & 2, SDTYPE, Q8, RNE_BF16, TILE, QBLOCK, VEC)
                p = p - lr.to(tl.float32) * buf
            else:
                p = p - lr.to(tl.float32) * (g / avg)
        elif ALGO == 4:  # Lion: s1 exp_avg
            p = p * (1.0 - lr * wd).to(tl.float32)
            m = _sload(
                s1_at, a1_at, offs, tstart, lim, qmap, w1, am1, SIGNS & 1, SDTYPE, Q8, PREFETCH, TILE, QBLOCK, VEC
            )
            c = _lerp(m, g, (1.0 - b1).to(tl.float32))
            sign = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))  # torch.sign: 0 for 0 and for nan
            p = p - lr.to(tl.float32) * sign
            m = _lerp(m, g, (1.0 - b2).to(tl.float32))
            _sstore(s1_at, a1_at, offs, tstart, lim, m, qmap, SIGNS & 1, SDTYPE, Q8, RNE_BF16, TILE, QBLOCK, VEC)
        elif ALGO == 10:  # ASGD: s1 ax; scalar1 eta, scalar2 mu; B1 lambd, B2 alpha, EXTRA t0
            g = _add_wd(g, wd, p)
            p = p * (1.0 - b1 * sc1.to(tl.float64)).to(tl.float32)
            p = p - sc1 * g
            ax = _sload(
                s1_at, a1_at, offs, tstart, lim, qmap, w1, am1, SIGNS & 1, SDTYPE, Q8, PREFETCH, TILE, QBLOCK, VEC
            )
            ax = tl.where(sc2 != 1.0, ax + (p - ax) * sc2, p)  # torch copies the param while mu is 1
            _sstore(s1_at, a1_at, offs, tstart, lim, ax, qmap, SIGNS & 1, SDTYPE, Q8, RNE_BF16, TILE, QBLOCK, VEC)
            # the next step's eta = lr / (1 + lambd lr t)^alpha and mu = 1 / max(1, t - t0), from this step's lr
            new1 = (lr / tl.exp2(b2 * tl.log2(1.0 + b1 * lr * step))).to(tl.float32)
            new2 = (1.0 / tl.maximum(step - extra, 1.0)).to(tl.float32)
        elif ALGO == 9:  # Rprop: s1 prev, s2 step_size; B1/B2 etaminus/etaplus, EXTRA/TRUST_A step_size min/max
            prev = _sload(
                s1_at, a1_at, offs, tstart, lim, qmap, w1, am1, SIGNS & 1, SDTYPE, Q8, PREFETCH, TILE, QBLOCK, VEC
            )
            prod = g * prev  # nan: torch's sign is 0 there, so the factor is 1 and the grad is kept
            size = _sload(
                s2_at, a2_at, offs, tstart, lim, qmap, w2, am2, SIGNS & 2, SDTYPE, Q8, PREFETCH, TILE, QBLOCK, VEC
            )
            size = size * tl.where(prod > 0.0, b2.to(tl.float32), tl.where(prod < 0.0, b1.to(tl.float32), 1.0))
            size = tl.maximum(size, extra.to(tl.float32), propagate_nan=tl.PropagateNan.ALL)  # torch.clamp keeps nan
            size = tl.minimum(size, trust_a.to(tl.float32), propagate_nan=tl.PropagateNan.ALL)
            g = tl.where(prod < 0.0, 0.0, g)  # a sign change: no step this time, and prev forgets the grad
            p = p - tl.where(g > 0, 1.0, tl.where(g < 0, -1.0, 0.0)) * size
            _sstore2(s1_at, a1_at, g, SIGNS & 1, s2_at, a2_at, size, SIGNS & 2, offs, tstart, lim, qmap,
                     SDTYPE, Q8, RNE_BF16, TILE, QBLOCK, VEC)  # fmt: skip
        elif ALGO == 8:  # Adadelta: s1 square_avg, s2 acc_delta; B2 rho
            g = _add_wd(g, wd, p)
            rho = b2.to(tl.float32)
            sq = (
                _sload(
                    s1_at, a1_at, offs, tstart, lim, qmap, w1, am1, SIGNS & 1, SDTYPE, Q8, PREFETCH, TILE, QBLOCK, VEC
                )
                * rho
                + (1.0 - b2).to(tl.float32) * g * g
            )
            acc = _sload(
                s2_at, a2_at, offs, tstart, lim, qmap, w2, am2, SIGNS & 2, SDTYPE, Q8, PREFETCH, TILE, QBLOCK, VEC
            )
            delta = tl.sqrt(acc + eps) / tl.sqrt(sq + eps) * g
            acc = acc * rho + (1.0 - b2).to(tl.float32) * delta * delta
            _sstore2(s1_at, a1_at, sq, SIGNS & 1, s2_at, a2_at, acc, SIGNS & 2, offs, tstart, lim, qmap,
                     SDTYPE, Q8, RNE_BF16, TILE, QBLOCK, VEC)  # fmt: skip
            p = p - lr.to(tl.float32) * delta
        else:  # NAdam (5), RAdam (6), Adamax (7): s1 exp_avg, s2 exp_avg_sq (Adamax: exp_inf)
            if DECOUPLED:
                p = p * (1.0 - lr * wd).to(tl.float32)
            else:
                g = _add_wd(g, wd, p)
            m = _sload(
                s1_at, a1_at, offs, tstart, lim, qmap, w1, am1, SIGNS & 1, SDTYPE, Q8, PREFETCH, TILE, QBLOCK, VEC
            )
            m = _lerp(m, g, (1.0 - b1).to(tl.float32))
            v = _sload(
                s2_at, a2_at, offs, tstart, lim, qmap, w2, am2, SIGNS & 2, SDTYPE, Q8, PREFETCH, TILE, QBLOCK, VEC
            ) * b2.to(tl.float32)
            if ALGO == 7:
                v = tl.maximum(v, tl.abs(g) + eps, propagate_nan=tl.PropagateNan.ALL)  # as torch.maximum
            else:
                v = v + (1.0 - b2).to(tl.float32) * g * g
            _sstore2(s1_at, a1_at, m, SIGNS & 1, s2_at, a2_at, v, SIGNS & 2, offs, tstart, lim, qmap,
                     SDTYPE, Q8, RNE_BF16, TILE, QBLOCK, VEC)  # fmt: skip
            bias1 = 1.0 - _pow_step(b1, step)
            beta2_t = _pow_step(b2, step)
            if ALGO == 5:  # NAdam: mu_t = beta1 (1 - 0.5 * 0.96^(t momentum_decay)); EXTRA = momentum_decay log2(0.96)
                mu = b1 * (1.0 - 0.5 * tl.exp2(step * extra))
                mu_next = b1 * (1.0 - 0.5 * tl.exp2((step + 1.0) * extra))
                new1 = sc1 * mu.to(tl.float32)  # torch multiplies the float32 mu_product by mu rounded to float32
                mu_product = new1.to(tl.float64)
                denom = tl.sqrt(v) / tl.sqrt(1.0 - beta2_t).to(tl.float32) + eps
                p = p - (lr * (1.0 - mu) / (1.0 - mu_product)).to(tl.float32) * (g / denom)
                p = p - (lr * mu_next / (1.0 - mu_product * mu_next)).to(tl.float32) * (m / denom)
            elif ALGO == 6:  # RAdam: rectify the adaptive step once the variance estimate is tractable (rho_t > 5)
                bias2 = 1.0 - beta2_t
                rho_inf = 2.0 / (1.0 - b2) - 1.0
                rho_t = rho_inf - 2.0 * step * beta2_t / bias2
                ratio = (rho_t - 4.0) * (rho_t - 2.0) * rho_inf / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho_t)
                rect = tl.sqrt(tl.where(rho_t > 5.0, ratio, 1.0))  # the other branch's ratio may be negative
                adaptive = (lr * rect * tl.sqrt(bias2) / bias1).to(tl.float32) * (m / (tl.sqrt(v) + eps))
                p = p - tl.where(rho_t > 5.0, adaptive, (lr / bias1).to(tl.float32) * m)
            else:  # Adamax
                p = p - (lr / bias1).to(tl.float32) * (m / v)

        if TRUST == 2:
            pass  # LAMB's stage 1 stores the moments and its partial norm; the params wait for stage 2
        elif KAHAN:  # the update plus what rounding dropped before, applied; what this rounding drops, kept for later
            c_ptr = _ptr(c_at, offs, DTYPE)
            c = tl.load(c_ptr, mask=mask, other=0.0).to(tl.float32) + (p - p0)
            stored = _cast(p0 + c, DTYPE, RNE_BF16)
            tl.store(p_ptr, stored, mask=mask)
            tl.store(c_ptr, _cast(c - (stored.to(tl.float32) - p0), DTYPE, RNE_BF16), mask=mask)
        elif SR:  # bf16 params, E[stored] = p: Philox bits keyed by seed, the step as the stream, a counter per element
            counter = offs + (t.to(tl.int64) << 40)  # tensors of up to 2**40 elements, each its own counters
            tl.store(p_ptr, _stochastic_round_bf16(p, seed, step.to(tl.uint32), counter), mask=mask)
        else:
            tl.store(p_ptr, _cast(p, DTYPE, RNE_BF16), mask=mask)

    if TRUST == 2:  # stage 1: the block that finishes a tensor reduces its ||update||; params wait for stage 2
        tl.debug_barrier()  # every thread's partial is stored before the release below
        if live:
            n_blocks = tl.maximum((numel + BLOCK - 1) // BLOCK, 1)
            if tl.atomic_add(counter_tab + t, 1) == n_blocks - 1:  # acq_rel: sees the other blocks' partials
                first = pid - (start // BLOCK).to(tl.int32)
                tl.store(update_norm + t, tl.sqrt_rn(_reduce(partials + first, n_blocks, False, RBLOCK)))
                tl.store(counter_tab + t, 0)

    if HAS_STEP and TRUST != 2:
        if live:
            done = tl.atomic_add(counter_tab + t, 1)  # acq_rel: this block's read of step happened before
            if done == tl.maximum((numel + BLOCK - 1) // BLOCK, 1) - 1:
                tl.store(step_ptr, step.to(tl.float32))
                if SCALARS >= 1:
                    tl.store(sc1_ptr, new1)
                if SCALARS >= 2:
                    tl.store(sc2_ptr, new2)
                tl.store(counter_tab + t, 0)


_INTERPRETED = type(_update_kernel).__name__ == "InterpretedFunction"

Q8_VECTOR = True
"""Whether an 8-bit update whose params and codes all sit at 16-byte multiples runs the vector layout (``Q8 == 2``
in `_update_kernel`): a warp per quantization block, each thread 8 consecutive elements read and written as vectors,
a block's absmax reduced within its warp. Compiled for Hopper it issues about a third fewer instructions per element
than the layout that interleaves a block over the program's warps (`benchmarks/update-sass.py`); on an H200 it took
the GPT-2 set's 8-bit step from 0.886 to 0.746 ms and Llama-1B's from 8.44 to 6.86 ms (`benchmarks/program-sweep.py`
switches it)."""
VECTOR_WARPS = 2
"""Warps a program of the vector layout when the caller leaves ``num_warps`` to the launcher: with the registers it
takes (`Q8_MAXNREG`), programs of 2 warps keep the most warps on an SM (H200, GPT-2 set, before the cap: 0.746 ms
with 2, 0.816 with 4, 0.805 with 1, 1.42 with 8; with it, 0.659 ms with 2, 0.665 with 4, 0.701 with 1)."""
Q8_MAXNREG: int | None = 72
"""Registers a thread the 8-bit vector layout is compiled with where its state has `Q8_CAPPED_SLOTS` or more
(Triton's ``maxnreg``; None: the compiler's choice). The layout is bound by latency with few warps an SM; left to
itself the compiler gives AdamW's program about 120 registers a thread, 16 warps an SM, and 72 let 28 warps in
(`benchmarks/update-sass.py --maxnreg`: 24 bytes a thread spill to local memory, cached in L1). With
`Q8_VECTOR_PREFETCH` off, so that the registers a prefetched tile held are free (H200, 2026-12-02, torch 2.11,
Triton 3.6, `benchmarks/program-sweep.py`, three calls): the GPT-2 set's 8-bit AdamW step 0.707-0.712 -> 0.655-0.662
ms, Llama-1B's 6.505-6.535 -> 5.869-6.067 ms (71-72% -> 77-80% of its floor); on the GPT-2 set Adam 0.718 -> 0.663,
RAdam 0.725 -> 0.675, NAdam 0.722 -> 0.711 ms. Capped at 112 with the prefetch: 0.696 and 6.447 ms; at 80-104 with
it, slower (spills in the prefetched tiles); at 56 without it, slower (0.780 and 7.053 ms)."""
Q8_CAPPED_SLOTS = 2
"""State slots from which an 8-bit vector launch takes `Q8_MAXNREG` and `Q8_VECTOR_PREFETCH`; one with fewer (SGD's
momentum, Lion's) keeps the compiler's registers and `Q8_PREFETCH`: SGD with momentum on the GPT-2 set ran 0.479 ms
capped without the prefetch against 0.466 ms as before (H200, the same call as Adam's figures)."""
Q8_PREFETCH = True
"""Whether an 8-bit update of several tiles a program loads each tile's params, grads and codes a pass ahead (the
kernel's PREFETCH) in the interleaved layout, and in the vector layout below `Q8_CAPPED_SLOTS`: on an H200 it took
the GPT-2 set's step from 1.165 to 0.930 ms in the interleaved layout."""
Q8_VECTOR_PREFETCH = False
"""The same for the vector layout where its state has `Q8_CAPPED_SLOTS` or more (with fewer, `Q8_PREFETCH`).
Uncapped (`Q8_MAXNREG` None) the prefetch took the GPT-2 set's AdamW step from 0.848 to 0.746 ms on an H200; capped
at 72 registers, going without it is faster (0.655-0.662 ms): the warps it lets onto an SM hide more latency than a
tile loaded a pass ahead."""


def _vector_layout(tables: TensorTables, spec: UpdateSpec, num_warps: int) -> bool:
    """Whether this 8-bit launch takes the vector layout: `Q8_VECTOR`, no trust ratio (LAMB's partial norms
    are a program's), programs of whole tiles of a warp per quantization block, every numel a multiple of
    `VECTOR_ELEMS` and every param and code tensor at a `VECTOR_ALIGN` multiple (the grads need not be: their reads
    stay scalar). Params move only by a re-plan and codes are always placed at such multiples (CODES_ALIGN), so a
    captured graph keeps its layout's promise."""
    if not Q8_VECTOR or spec.trust or tables.block % (QUANT_BLOCK * num_warps):
        return False
    return _vectors_fit(tables, spec)


def _vectors_fit(tables: TensorTables, spec: UpdateSpec, *roles: str) -> bool:
    """What a vector path promises Triton of a launch's tensors: every numel a multiple of `VECTOR_ELEMS`, and the
    params, the state tensors (codes, for 8 bits) and ``roles`` at `VECTOR_ALIGN` multiples."""
    return vectors_fit(tables, ["param", *roles] + [f"state{i}" for i in range(1, spec.state_slots + 1)])


FLOAT_VECTOR = True
"""Whether an update with float state (fp32, bf16 or the param's dtype) whose params, grads and state tensors all sit
at 16-byte multiples promises Triton so (the kernel's FVEC): each thread's consecutive elements are then read and
written as 16-byte vectors. Compiled for Hopper (`benchmarks/update-sass.py --state fp32`, Triton 3.9) the fp32
AdamW program takes 64 registers instead of 127 and 776 instructions instead of 960, with 8 vector loads and 6
vector stores a thread where it issued 35 and 26 scalar ones; the same bits. On an H200 (Triton 3.6), with
`FLOAT_TILE` tiles in programs of 8192 elements, it took `llama1b`'s fp32 AdamW step from 8.61 to 8.22 ms (99% of
the copy-rate floor) and its bf16-state step from 6.99 to 5.79 ms; the GPT-2 set's from 0.902 to 0.858 and 0.733 to
0.607 ms; programs of 4096 (`kitsune.fusion.planner.FLOAT_PROGRAM`) then measured a little faster still
(docs/benchmarks.md)."""
FLOAT_TILE = 1024
"""Elements per pass of a float-state program's loop, when the program's block is a multiple of it (LAMB's trust
ratio keeps one pass a program: its partial norms are a program's). A program of several tiles pays its per-tensor
work (the table reads, the hyperparameters, the bias corrections in fp64, the step count's atomic) once."""


def _float_vector(tables: TensorTables, spec: UpdateSpec) -> bool:
    """Whether this float-state launch takes vector reads and writes (`FLOAT_VECTOR`): no trust ratio, programs
    starting at multiples of `VECTOR_ELEMS` in their tensor, every numel a multiple of it, and the params, grads and
    state tensors at `VECTOR_ALIGN` multiples (a grad that moves re-sets its role, so the answer follows it)."""
    if not FLOAT_VECTOR or spec.trust or tables.block % VECTOR_ELEMS:
        return False
    return _vectors_fit(tables, spec, "grad")


def grad_vector(tables: TensorTables, spec: UpdateSpec) -> bool:
    """The one variant an update launch picks from its grads' addresses, which move between steps without a
    re-plan: whether a float-state launch reads and writes in vectors (`FLOAT_VECTOR`). A captured launch keeps
    the variant it was captured with, so a graph is keyed on this (a vector read of a misaligned grad is a CUDA
    error). Kept with the tables until a role moves: a launch, and a step's compile ahead, ask every step."""
    kept = tables.layout
    if kept is not None and kept[0] is spec and kept[1] is FLOAT_VECTOR:
        return kept[2]
    ok = spec.state != StateFormat.Q8 and _float_vector(tables, spec)
    tables.layout = (spec, FLOAT_VECTOR, ok)
    return ok


_STATE_DTYPES = {StateFormat.FP32: tl.float32, StateFormat.BF16: tl.bfloat16}


def multi_tensor_update(
    tables: TensorTables,
    hyper: torch.Tensor,
    spec: UpdateSpec,
    dtype: torch.dtype,
    found_inf: torch.Tensor | None = None,
    num_warps: int | None = None,
    *,
    grad_scale: torch.Tensor | None = None,
    total_norm: torch.Tensor | None = None,
    max_norm: float | None = None,
    grad_write: int = 0,
    tensor_norms: torch.Tensor | None = None,
    norm_offset: int = 0,
    n_norm: int | None = None,
    seed: int = 0,
    compile_only: bool = False,
) -> None:
    """Launch one update over every tensor of ``tables`` (with ``compile_only``, compile what that launch runs and
    run nothing: `kitsune.kernels.common.compile_launch`).

    ``tables`` needs the roles ``param`` and ``grad`` (``-1`` marks a tensor to skip this step), ``state1`` ..
    ``state{spec.state_slots}`` (in ``spec.state``'s format; with 8-bit state, ``absmax1`` .. as well: each
    slot's fp32 absmax per `QUANT_BLOCK` elements, and ``tables.block`` a multiple of it), when ``spec.has_step``,
    ``step`` and ``scalar1`` .. ``scalar{spec.scalar_slots}`` (addresses of float32 scalars). ``hyper`` is the
    float64 ``(n_groups, NUM_FIELDS)`` buffer on the tables' device; ``dtype`` that of params and grads (and of the
    state in the param's format).
    ``found_inf``, a float32 scalar on the device (AMP's overflow flag), skips the whole update when nonzero,
    decided on the device: no host sync. ``num_warps`` (warps a program) is the launcher's choice when None: 4, or
    `VECTOR_WARPS` where an 8-bit update takes the vector layout.

    Pass two of a step that unscales and clips: ``grad_scale`` (a float32 scalar: the grads hold grad times it)
    divides every grad first; with ``max_norm``, ``total_norm`` (the float32 global norm of the unscaled grads,
    from `MultiTensorNorm`) gives the clip coefficient ``min(max_norm / (total_norm
    + 1e-6), 1)``, read on the device. ``grad_write`` 1 stores the unscaled, clipped grads back (what torch's
    unscale_ and clip_grad_norm_ leave in them), 2 stores zeros (the grads are about to be zeroed); either happens
    on a skipped step too, as it would in torch's loop.

    With ``spec.kahan`` the updated params are stored with Kahan compensation: role ``comp`` holds, per param, a
    tensor of its dtype with what earlier roundings dropped; each element stores ``p0 + c`` rounded (``p0`` the stored
    param, ``c`` the compensation plus this step's update, in fp32) and keeps ``c`` minus what the store applied.

    With ``spec.stochastic`` (bf16 params) the updated params are stored with stochastic rounding: Philox bits keyed
    by ``seed`` (``0 <= seed < 2**63``), the tensor's step count as the stream and the element's position in its
    tensor (and the tensor's index) as the counter, so a run is reproducible from the seed and the step counts.

    Trust ratios (``spec.trust``: LARS, LAMB) read per-tensor norms from ``tensor_norms``, the ``per_tensor`` output
    of a norm pass over ``n_norm`` grads followed by the ``n_norm`` params in the same order; this launch's tensors
    start at ``norm_offset``. LAMB runs two launches (see `Trust`).
    """
    if dtype not in TL_DTYPES:
        raise ValueError(f"multi_tensor_update supports {SUPPORTED_DTYPES}, got {dtype}")
    if hyper.dtype != torch.float64 or hyper.dim() != 2 or hyper.shape[1] != NUM_FIELDS:
        raise ValueError(
            f"hyper must be a float64 (n_groups, {NUM_FIELDS}) tensor, got {hyper.dtype} {tuple(hyper.shape)}"
        )
    if tables.num_blocks == 0:
        return
    for name, t in (("found_inf", found_inf), ("grad_scale", grad_scale), ("total_norm", total_norm)):
        if t is not None and (t.dtype != torch.float32 or t.numel() != 1):
            raise ValueError(f"{name} must be a float32 scalar, got {t.dtype} of {t.numel()} elements")
    if (max_norm is None) != (total_norm is None):
        raise ValueError("max_norm and total_norm go together: the clip coefficient needs both")
    if spec.stochastic and (dtype != torch.bfloat16 or not spec.has_step):
        raise ValueError("stochastic rounding writes bf16 params and needs the step count: spec.stochastic with bf16")
    if spec.kahan and (spec.stochastic or spec.trust):
        raise ValueError("Kahan compensation takes neither stochastic rounding nor a trust ratio's two stages")
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    if grad_write not in (0, 1, 2):
        raise ValueError(f"grad_write must be 0 (leave), 1 (store the grads used) or 2 (zero), got {grad_write}")
    partials = update_norm = hyper
    if spec.trust:
        if tensor_norms is None or n_norm is None or tensor_norms.numel() < 2 * n_norm:
            raise ValueError("a trust-ratio update needs tensor_norms: a norm pass over n_norm grads, then the params")
        if not 0 <= norm_offset <= n_norm - tables.num_tensors:
            raise ValueError(f"norm_offset={norm_offset} leaves no room for {tables.num_tensors} tensors in {n_norm}")
        if spec.trust == Trust.LAMB:
            partials = tables.scratch("partials", tables.num_blocks)
            update_norm = tables.scratch("update_norm", tables.num_tensors)
    q8 = spec.state == StateFormat.Q8
    if q8 and tables.block % QUANT_BLOCK:
        raise ValueError(f"8-bit state needs a block of a multiple of {QUANT_BLOCK} elements, got {tables.block}")
    param = tables.role("param")
    roles = [tables.role(f"state{i}") if i <= spec.state_slots else param for i in (1, 2, 3)]
    roles += [tables.role(f"absmax{i}") if q8 and i <= spec.state_slots else param for i in (1, 2, 3)]
    step = tables.role("step") if spec.has_step else param
    scalars = [tables.role(f"scalar{i}") if i <= spec.scalar_slots else param for i in (1, 2)]
    comp = tables.role("comp") if spec.kahan else param
    stages = (2, 3) if spec.trust == Trust.LAMB else (int(spec.trust),)
    for stage in stages:
        _launch(tables, hyper, spec, dtype, num_warps, param, roles, step, scalars, found_inf, grad_scale, total_norm,
                max_norm, grad_write if stage != 3 else 0, tensor_norms, norm_offset, n_norm, partials, update_norm,
                stage, seed, comp, compile_only)  # fmt: skip


def _launch(
    tables: TensorTables,
    hyper: torch.Tensor,
    spec: UpdateSpec,
    dtype: torch.dtype,
    num_warps: int | None,
    param: torch.Tensor,
    roles: list[torch.Tensor],
    step: torch.Tensor,
    scalars: list[torch.Tensor],
    found_inf: torch.Tensor | None,
    grad_scale: torch.Tensor | None,
    total_norm: torch.Tensor | None,
    max_norm: float | None,
    grad_write: int,
    tensor_norms: torch.Tensor | None,
    norm_offset: int,
    n_norm: int | None,
    partials: torch.Tensor,
    update_norm: torch.Tensor,
    stage: int,
    seed: int,
    comp: torch.Tensor,
    compile_only: bool,
) -> None:
    tile = FLOAT_TILE if not spec.trust and tables.block % FLOAT_TILE == 0 else tables.block
    q8, prefetch, warps, maxnreg = 0, False, num_warps or 4, None
    if spec.state == StateFormat.Q8:  # 8-bit state quantizes a tile at a time: a block, or a warp's block each
        several = tables.block != QUANT_BLOCK and not spec.trust  # tiles a program: a next one to prefetch
        q8, tile, prefetch = 1, QUANT_BLOCK, Q8_PREFETCH and several
        vector_warps = num_warps or VECTOR_WARPS
        if _vector_layout(tables, spec, vector_warps):
            q8, tile, warps = 2, QUANT_BLOCK * vector_warps, vector_warps
            if spec.state_slots >= Q8_CAPPED_SLOTS:
                maxnreg, prefetch = Q8_MAXNREG, Q8_VECTOR_PREFETCH and several
    grid = (tables.num_blocks,)
    _common.launcher(_update_kernel, grid, compile_only)(
        tables.block_tensor,
        tables.block_start,
        tables.numel,
        tables.group,
        tables.counter,
        param,
        tables.role("grad"),
        *roles,
        device_tables(tables.device) if spec.state == StateFormat.Q8 else hyper,
        step,
        *scalars,
        hyper,
        found_inf if found_inf is not None else hyper,
        grad_scale if grad_scale is not None else hyper,
        total_norm if total_norm is not None else hyper,
        float(max_norm) if max_norm is not None else 0.0,
        tensor_norms if tensor_norms is not None else hyper,
        norm_offset,
        n_norm or 0,
        partials,
        update_norm,
        seed,
        comp,
        ALGO=int(spec.algo),
        DTYPE=TL_DTYPES[dtype],
        MAXIMIZE=spec.maximize,
        DECOUPLED=spec.decoupled_wd,
        AMSGRAD=spec.amsgrad,
        MOMENTUM=spec.momentum,
        NESTEROV=spec.nesterov,
        CENTERED=spec.centered,
        HAS_STEP=spec.has_step,
        SCALARS=spec.scalar_slots,
        HAS_FOUND_INF=found_inf is not None,
        HAS_GRAD_SCALE=grad_scale is not None,
        CLIP=max_norm is not None,
        GRAD_WRITE=grad_write,
        TRUST=stage,
        RBLOCK=1024,
        RNE_BF16=_INTERPRETED,
        SDTYPE=_STATE_DTYPES.get(spec.state, TL_DTYPES[dtype]),
        Q8=q8,
        FVEC=grad_vector(tables, spec),
        SIGNS=spec.signed if q8 else 0,
        SLOTS=spec.state_slots,
        PREFETCH=prefetch,
        QBLOCK=QUANT_BLOCK,
        SR=spec.stochastic,
        KAHAN=spec.kahan,
        BLOCK=tables.block,
        TILE=tile,
        num_warps=warps,
        enable_fp_fusion=_common.FP_FUSION,
        **({"maxnreg": maxnreg} if maxnreg else {}),  # passed only where capped: the rest compile as before
    )
