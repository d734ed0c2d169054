"""One generic multi-tensor optimizer update kernel; constexpr switches pick the algorithm and its options.

Adam, AdamW, SGD, Adagrad, RMSprop and Lion share the skeleton (load param and grad, maximize, weight decay,
update the state, update the param); only the middle differs, so they are one kernel, and Triton compiles one
variant per switch combination. Hyperparameters are never Python constants: each tensor's row of the
device-resident buffer ``hyper`` (float64, ``(n_groups, NUM_FIELDS)``) is read through its group index, so an LR
scheduler changes values without a recompile and a captured graph stays valid.

Math runs in fp32 with per-tensor scalars (bias corrections) in fp64, as torch computes them on the host in
double; params and state are loaded once, updated in registers and rounded once when stored, in the param's
dtype like torch's state. For bf16/fp16 these are the semantics of torch's ``fused=True`` kernels, not of its
eager per-op path, which rounds after every op (and on CPU even rounds ``alpha`` to bf16).

Step counts: every block of a tensor reads ``step`` before it works and uses ``step + 1``; then it bumps the
tensor's block counter with an acq_rel atomic; the block that finishes last (all others have read ``step`` by
then) writes ``step + 1`` and resets the counter. So one launch both updates and counts, race-free.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kitsune.kernels.multi_tensor import TensorTables
from kitsune.kernels.spec import NUM_FIELDS, UpdateSpec

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
SUPPORTED_DTYPES = tuple(_TL_DTYPES)


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
def _lerp(a, b, w):
    return a + w * (b - a)  # torch's lerp for weight < 0.5 (all the betas optimizers use)


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
    step_tab,
    hyper,  # (n_groups, NUM_FIELDS) float64
    found_inf,  # float32 scalar: nonzero skips the whole update (AMP overflow), read only with HAS_FOUND_INF
    ALGO: tl.constexpr,
    DTYPE: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    DECOUPLED: tl.constexpr,
    AMSGRAD: tl.constexpr,
    MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    CENTERED: tl.constexpr,
    HAS_STEP: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    RNE_BF16: tl.constexpr,
    NUM_FIELDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid)
    start = tl.load(block_start + pid)
    g_addr = tl.load(grad_tab + t)
    numel = tl.load(numel_tab + t)
    live = g_addr != -1  # -1: grad is None this step, skip like torch (no state change, no step)
    if HAS_FOUND_INF:  # inf/nan grads this step: nothing changes, not even the step count (GradScaler's skip)
        live = live & (tl.load(found_inf) == 0.0)
    offs = start + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < tl.where(live, numel, 0)

    row = hyper + tl.load(group_tab + t).to(tl.int64) * NUM_FIELDS
    lr = tl.load(row + 0)
    b1 = tl.load(row + 1)
    b2 = tl.load(row + 2)
    eps = tl.load(row + 3).to(tl.float32)
    wd = tl.load(row + 4)
    extra = tl.load(row + 5)

    step = 0.0
    if HAS_STEP:
        step_ptr = tl.load(step_tab + t).to(tl.pointer_type(tl.float32))
        step = tl.load(step_ptr, mask=live, other=0.0).to(tl.float64) + 1.0

    p_ptr = tl.load(param_tab + t).to(tl.pointer_type(DTYPE)) + offs
    g_ptr = g_addr.to(tl.pointer_type(DTYPE)) + offs
    s1_ptr = tl.load(s1_tab + t).to(tl.pointer_type(DTYPE)) + offs
    s2_ptr = tl.load(s2_tab + t).to(tl.pointer_type(DTYPE)) + offs
    s3_ptr = tl.load(s3_tab + t).to(tl.pointer_type(DTYPE)) + offs
    p = tl.load(p_ptr, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr, mask=mask, other=0.0).to(tl.float32)
    if MAXIMIZE:
        g = -g

    if ALGO == 0:  # Adam / AdamW: s1 exp_avg, s2 exp_avg_sq, s3 max_exp_avg_sq
        if DECOUPLED:
            p = p * (1.0 - lr * wd).to(tl.float32)
        else:
            g = g + wd.to(tl.float32) * p
        m = _lerp(tl.load(s1_ptr, mask=mask, other=0.0).to(tl.float32), g, (1.0 - b1).to(tl.float32))
        v = tl.load(s2_ptr, mask=mask, other=0.0).to(tl.float32)
        v = v * b2.to(tl.float32) + (1.0 - b2).to(tl.float32) * g * g
        tl.store(s1_ptr, _cast(m, DTYPE, RNE_BF16), mask=mask)
        tl.store(s2_ptr, _cast(v, DTYPE, RNE_BF16), mask=mask)
        if AMSGRAD:
            v = tl.maximum(tl.load(s3_ptr, mask=mask, other=0.0).to(tl.float32), v)
            tl.store(s3_ptr, _cast(v, DTYPE, RNE_BF16), mask=mask)
        # 1 - beta**step in fp64: in fp32 the early steps (1 - 0.999) would lose four digits
        bias1 = 1.0 - tl.exp2(step * tl.log2(b1))
        bias2_sqrt = tl.sqrt(1.0 - tl.exp2(step * tl.log2(b2)))
        step_size = (lr / bias1).to(tl.float32)
        denom = tl.sqrt(v) / bias2_sqrt.to(tl.float32) + eps
        p = p - step_size * (m / denom)
    elif ALGO == 1:  # SGD: s1 momentum_buffer
        g = g + wd.to(tl.float32) * p
        if MOMENTUM:
            buf = tl.load(s1_ptr, mask=mask, other=0.0).to(tl.float32)
            # the first step copies the grad, as torch's lazily created buffer does
            buf = tl.where(step == 1.0, g, buf * b1.to(tl.float32) + (1.0 - extra).to(tl.float32) * g)
            tl.store(s1_ptr, _cast(buf, DTYPE, RNE_BF16), mask=mask)
            if NESTEROV:
                g = g + b1.to(tl.float32) * buf
            else:
                g = buf
        p = p - lr.to(tl.float32) * g
    elif ALGO == 2:  # Adagrad: s1 sum
        g = g + wd.to(tl.float32) * p
        clr = (lr / (1.0 + (step - 1.0) * extra)).to(tl.float32)
        acc = tl.load(s1_ptr, mask=mask, other=0.0).to(tl.float32) + g * g
        tl.store(s1_ptr, _cast(acc, DTYPE, RNE_BF16), mask=mask)
        p = p - clr * (g / (tl.sqrt(acc) + eps))
    elif ALGO == 3:  # RMSprop: s1 square_avg, s2 momentum_buffer, s3 grad_avg
        g = g + wd.to(tl.float32) * p
        sq = tl.load(s1_ptr, mask=mask, other=0.0).to(tl.float32)
        sq = sq * b2.to(tl.float32) + (1.0 - b2).to(tl.float32) * g * g
        tl.store(s1_ptr, _cast(sq, DTYPE, RNE_BF16), mask=mask)
        if CENTERED:
            ga = _lerp(tl.load(s3_ptr, mask=mask, other=0.0).to(tl.float32), g, (1.0 - b2).to(tl.float32))
            tl.store(s3_ptr, _cast(ga, DTYPE, RNE_BF16), mask=mask)
            avg = tl.sqrt(sq - ga * ga) + eps
        else:
            avg = tl.sqrt(sq) + eps
        if MOMENTUM:
            buf = tl.load(s2_ptr, mask=mask, other=0.0).to(tl.float32)
            buf = buf * b1.to(tl.float32) + g / avg
            tl.store(s2_ptr, _cast(buf, DTYPE, RNE_BF16), mask=mask)
            p = p - lr.to(tl.float32) * buf
        else:
            p = p - lr.to(tl.float32) * (g / avg)
    else:  # Lion: s1 exp_avg
        p = p * (1.0 - lr * wd).to(tl.float32)
        m = tl.load(s1_ptr, mask=mask, other=0.0).to(tl.float32)
        c = _lerp(m, g, (1.0 - b1).to(tl.float32))
        sign = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, c))  # sign(0) = 0 and sign(nan) = nan, as torch.sign
        p = p - lr.to(tl.float32) * sign
        tl.store(s1_ptr, _cast(_lerp(m, g, (1.0 - b2).to(tl.float32)), DTYPE, RNE_BF16), mask=mask)

    tl.store(p_ptr, _cast(p, DTYPE, RNE_BF16), mask=mask)

    if HAS_STEP:
        if live:
            done = tl.atomic_add(counter_tab + t, 1)  # acq_rel: this block's read of step happened before
            if done == tl.maximum((numel + BLOCK - 1) // BLOCK, 1) - 1:
                tl.store(step_ptr, step.to(tl.float32))
                tl.store(counter_tab + t, 0)


_INTERPRETED = type(_update_kernel).__name__ == "InterpretedFunction"


def multi_tensor_update(
    tables: TensorTables,
    hyper: torch.Tensor,
    spec: UpdateSpec,
    dtype: torch.dtype,
    found_inf: torch.Tensor | None = None,
    num_warps: int = 4,
) -> None:
    """Launch one update over every tensor of ``tables``.

    ``tables`` needs the roles ``param`` and ``grad`` (``-1`` marks a tensor to skip this step), ``state1`` ..
    ``state{spec.state_slots}`` and, when ``spec.has_step``, ``step`` (addresses of float32 scalars). ``hyper`` is
    the float64 ``(n_groups, NUM_FIELDS)`` buffer on the tables' device; ``dtype`` that of params, grads and state.
    ``found_inf``, a float32 scalar on the device (AMP's overflow flag), skips the whole update when nonzero,
    decided on the device: no host sync.
    """
    if dtype not in _TL_DTYPES:
        raise ValueError(f"multi_tensor_update supports {SUPPORTED_DTYPES}, got {dtype}")
    if hyper.dtype != torch.float64 or hyper.dim() != 2 or hyper.shape[1] != NUM_FIELDS:
        raise ValueError(
            f"hyper must be a float64 (n_groups, {NUM_FIELDS}) tensor, got {hyper.dtype} {tuple(hyper.shape)}"
        )
    if tables.num_blocks == 0:
        return
    if found_inf is not None and (found_inf.dtype != torch.float32 or found_inf.numel() != 1):
        raise ValueError(f"found_inf must be a float32 scalar, got {found_inf.dtype} of {found_inf.numel()} elements")
    param = tables.role("param")
    roles = [tables.role(f"state{i}") if i <= spec.state_slots else param for i in (1, 2, 3)]
    step = tables.role("step") if spec.has_step else param
    _update_kernel[(tables.num_blocks,)](
        tables.block_tensor,
        tables.block_start,
        tables.numel,
        tables.group,
        tables.counter,
        param,
        tables.role("grad"),
        *roles,
        step,
        hyper,
        found_inf if found_inf is not None else hyper,
        ALGO=int(spec.algo),
        DTYPE=_TL_DTYPES[dtype],
        MAXIMIZE=spec.maximize,
        DECOUPLED=spec.decoupled_wd,
        AMSGRAD=spec.amsgrad,
        MOMENTUM=spec.momentum,
        NESTEROV=spec.nesterov,
        CENTERED=spec.centered,
        HAS_STEP=spec.has_step,
        HAS_FOUND_INF=found_inf is not None,
        RNE_BF16=_INTERPRETED,
        NUM_FIELDS=NUM_FIELDS,
        BLOCK=tables.block,
        num_warps=num_warps,
    )
