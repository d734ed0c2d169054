"""Muon's elementwise stages as multi-tensor launches, before and after its Newton-Schulz calls.

One kernel, two stages (``STAGE`` constexpr), each one launch over every tensor of a unit, through the same device
tables as `kitsune.kernels.update` (roles ``param``, ``grad``, ``state1`` = ``momentum_buffer``, plus
``update`` and ``ortho``: each param's slot in its shape's Newton-Schulz input and output, bf16)::

    stage 0   buf = buf.lerp(g, 1 - momentum)                 # state["momentum_buffer"]
              update = g.lerp(buf, momentum) if nesterov else buf
              slot = bf16(update)                             # the Newton-Schulz input, batched by shape
    stage 1   p = p * (1 - lr * weight_decay)
              p = p - lr * ratio * ortho                      # ratio: the param's adjust_lr factor

torch.optim.Muon's order and roundings, per element: ``lerp`` with torch's two-sided formula, the buffer and the
nesterov update rounded to the param dtype as torch stores them, the update then rounded to bf16 (the first thing
torch's orthogonalisation does), the param rounded after the decay and after the add. lr, momentum and weight decay
are read from the device-resident hyperparameter buffer (columns of `kitsune.kernels.spec`); ``ratio`` is a
float64 per-tensor table, so ``lr * ratio`` is the double product torch forms on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kitsune.kernels import common as _common
from kitsune.kernels.common import (
    B1,
    LR,
    TL_DTYPES,
    WD,
    _cast,
    _hyper_row,
    _lerp,
    _program_block,
    _ptr,
    _role_ptr,
    _update_masks,
)
from kitsune.kernels.multi_tensor import TensorTables
from kitsune.kernels.quant import _stochastic_round_bf16
from kitsune.kernels.spec import NUM_FIELDS, MuonSpec

SUPPORTED_DTYPES = tuple(TL_DTYPES)


@triton.jit
def _muon_kernel(
    block_tensor,  # (n_blocks,) int32
    block_start,  # (n_blocks,) int64
    numel_tab,  # (T,) int64
    group_tab,  # (T,) int32
    param_tab,  # (T,) int64 addresses, one table per role
    grad_tab,  # -1: grad is None this step, skip the tensor
    buf_tab,
    update_tab,  # bf16 slots of the Newton-Schulz input
    ortho_tab,  # bf16 slots of the Newton-Schulz output
    ratio_tab,  # (T,) float64 adjust_lr factors
    hyper,  # (n_groups, NUM_FIELDS) float64
    found_inf,  # float32 scalar: nonzero skips every update (AMP overflow), read only with HAS_FOUND_INF
    seed,  # int: the stochastic rounding's Philox key, read only with SR
    count,  # int64 scalar: the unit's step count (the random stream), read only with SR
    STAGE: tl.constexpr,  # 0: momentum -> Newton-Schulz input, 1: decay and apply the orthogonalised update
    DTYPE: tl.constexpr,
    NESTEROV: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    ZERO_GRAD: tl.constexpr,  # stage 0 stores zeros into the grads it read (GradConfig.zero_in_step)
    RNE_BF16: tl.constexpr,
    SR: tl.constexpr,  # stage 1: bf16 params stored with stochastic rounding
    BLOCK: tl.constexpr,
):
    _, t, start, numel, g_addr = _program_block(block_tensor, block_start, numel_tab, grad_tab)
    _, offs, mask, gmask = _update_masks(start, numel, g_addr, found_inf, HAS_FOUND_INF, BLOCK)
    row = _hyper_row(hyper, group_tab, t)

    if STAGE == 0:
        g_ptr = _ptr(g_addr, offs, DTYPE)
        buf_ptr = _role_ptr(buf_tab, t, offs, DTYPE)
        u_ptr = _role_ptr(update_tab, t, offs, tl.bfloat16)
        g = tl.load(g_ptr, mask=gmask if ZERO_GRAD else mask, other=0.0).to(tl.float32)
        momentum = tl.load(row + B1)
        buf = tl.load(buf_ptr, mask=mask, other=0.0).to(tl.float32)
        buf = _cast(_lerp(buf, g, (1.0 - momentum).to(tl.float32)), DTYPE, RNE_BF16)
        tl.store(buf_ptr, buf, mask=mask)
        u = buf.to(tl.float32)
        if NESTEROV:
            u = _cast(_lerp(g, u, momentum.to(tl.float32)), DTYPE, RNE_BF16).to(tl.float32)
        tl.store(u_ptr, _cast(u, tl.bfloat16, RNE_BF16), mask=mask)
        if ZERO_GRAD:
            tl.store(g_ptr, tl.zeros_like(g).to(DTYPE), mask=gmask)
    else:
        p_ptr = _role_ptr(param_tab, t, offs, DTYPE)
        o_ptr = _role_ptr(ortho_tab, t, offs, tl.bfloat16)
        lr = tl.load(row + LR)
        wd = tl.load(row + WD)
        p = tl.load(p_ptr, mask=mask, other=0.0).to(tl.float32)
        p = p * (1.0 - lr * wd).to(tl.float32)
        if not SR:  # torch rounds the decayed param before the update: so does the nearest store
            p = _cast(p, DTYPE, RNE_BF16).to(tl.float32)
        o = tl.load(o_ptr, mask=mask, other=0.0).to(tl.float32)
        p = p - (lr * tl.load(ratio_tab + t)).to(tl.float32) * o
        if SR:  # E[stored] = p: Philox bits keyed by seed, the unit's step count as the stream, a counter per element
            stream = tl.load(count).to(tl.uint32)
            tl.store(p_ptr, _stochastic_round_bf16(p, seed, stream, offs + (t.to(tl.int64) << 40)), mask=mask)
        else:
            tl.store(p_ptr, _cast(p, DTYPE, RNE_BF16), mask=mask)


_INTERPRETED = type(_muon_kernel).__name__ == "InterpretedFunction"


def muon_update(
    tables: TensorTables,
    hyper: torch.Tensor,
    spec: MuonSpec,
    dtype: torch.dtype,
    stage: int,
    ratio: torch.Tensor,
    found_inf: torch.Tensor | None = None,
    zero_grad: bool = False,
    num_warps: int = 4,
    *,
    seed: int = 0,
    count: torch.Tensor | None = None,
    compile_only: bool = False,
) -> None:
    """Launch one stage (0: momentum into the Newton-Schulz input, 1: decay and apply its output) over every
    tensor of ``tables``.

    ``tables`` needs the roles ``param``, ``grad`` (``-1`` skips a tensor), ``state1`` (``momentum_buffer``, of
    ``dtype`` like the params and grads), ``update`` and ``ortho`` (addresses of contiguous bf16 slots of each
    tensor's size). ``hyper`` is the float64 ``(n_groups, NUM_FIELDS)`` buffer; ``ratio`` a float64 ``(T,)``
    tensor of the adjust_lr factors. ``found_inf`` (a float32 scalar) skips the whole update when nonzero, decided
    on the device; ``zero_grad`` makes stage 0 store zeros into the grads it read (on a skipped step too).
    ``compile_only``: compile what the launch runs, and run nothing (`kitsune.kernels.common.compile_launch`).
    With ``spec.stochastic`` (bf16 params) stage 1 stores the params with stochastic rounding: Philox bits keyed by
    ``seed``, the int64 scalar ``count`` (the unit's step count, which the caller advances) as the stream.
    """
    if dtype not in TL_DTYPES:
        raise ValueError(f"muon_update supports {SUPPORTED_DTYPES}, got {dtype}")
    if stage not in (0, 1):
        raise ValueError(f"stage must be 0 (momentum) or 1 (apply), got {stage}")
    if hyper.dtype != torch.float64 or hyper.dim() != 2 or hyper.shape[1] != NUM_FIELDS:
        raise ValueError(
            f"hyper must be a float64 (n_groups, {NUM_FIELDS}) tensor, got {hyper.dtype} {tuple(hyper.shape)}"
        )
    if ratio.dtype != torch.float64 or ratio.shape != (tables.num_tensors,):
        raise ValueError(
            f"ratio must be a float64 ({tables.num_tensors},) tensor, got {ratio.dtype} {tuple(ratio.shape)}"
        )
    if found_inf is not None and (found_inf.dtype != torch.float32 or found_inf.numel() != 1):
        raise ValueError(f"found_inf must be a float32 scalar, got {found_inf.dtype} of {found_inf.numel()} elements")
    sr = spec.stochastic and stage == 1
    if sr and (dtype != torch.bfloat16 or count is None or count.dtype != torch.int64):
        raise ValueError("stochastic rounding writes bf16 params and reads the step count: bf16 and an int64 count")
    if tables.num_blocks == 0:
        return
    _common.launcher(_muon_kernel, (tables.num_blocks,), compile_only)(
        tables.block_tensor,
        tables.block_start,
        tables.numel,
        tables.group,
        tables.role("param"),
        tables.role("grad"),
        tables.role("state1"),
        tables.role("update"),
        tables.role("ortho"),
        ratio,
        hyper,
        found_inf if found_inf is not None else hyper,
        seed,
        count if sr else hyper,
        STAGE=stage,
        DTYPE=TL_DTYPES[dtype],
        NESTEROV=spec.nesterov,
        HAS_FOUND_INF=found_inf is not None,
        ZERO_GRAD=zero_grad and stage == 0,
        RNE_BF16=_INTERPRETED,
        SR=sr,
        BLOCK=tables.block,
        num_warps=num_warps,
        enable_fp_fusion=_common.FP_FUSION,
    )
