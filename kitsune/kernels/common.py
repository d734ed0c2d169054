"""Triton helpers the kernels share: the multi-tensor prologue, the dtype table, the hyperparameter columns, lerp,
rounding to a storage dtype and a fixed-order reduction."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from kitsune.kernels import spec

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
"""The storage dtypes the kernels read and write."""

FP_FUSION = True
"""Whether the compiler may contract a multiply and an add into one fused multiply-add in kitsune's kernels (Triton's
``enable_fp_fusion``, passed at every launch). On, as torch's CUDA kernels are compiled (nvcc's default): one rounding
instead of two, fewer instructions. Passed explicitly so that a Triton whose default differs (Triton 3.9 warns that
3.10 turns it off) changes neither kitsune's results nor its speed; ``TRITON_FORCE_DISABLE_FP_FUSION=1`` still turns
it off. Where the compiler contracts depends on the code around the arithmetic, so two layouts of the same update may
differ in the last bit with it on; the tests that compare layouts bit for bit on a GPU turn it off."""


DEVICE_ERRORS: tuple[type[BaseException], ...] = tuple(
    t for t in (getattr(torch, "AcceleratorError", None),) if isinstance(t, type)
)
"""torch's error for a fault the device reported (torch >= 2.9): a fault, not a kernel that cannot compile."""


class CompileError(RuntimeError):
    """A kernel Triton could not compile for a launch (`compile_launch`), raised before anything ran; Triton's own
    error is its ``__cause__``."""


def launcher(kernel: Any, grid: tuple[int, ...], compile_only: bool = False) -> Any:
    """``kernel[grid]``, or with ``compile_only`` a callable taking the same arguments that compiles that launch and
    runs nothing (`compile_launch`)."""
    return functools.partial(compile_launch, kernel, grid) if compile_only else kernel[grid]


@contextlib.contextmanager
def compiling(what: str) -> Iterator[None]:
    """Around work that compiles kernels (``what`` names it in the error): what it raises becomes a `CompileError`,
    but for running out of device memory and device faults (`DEVICE_ERRORS`), raised as they are."""
    try:
        yield
    except (torch.OutOfMemoryError, CompileError, *DEVICE_ERRORS):
        raise
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        raise CompileError(f"{what}: {type(exc).__name__}{': ' + first if first else ''}") from exc


def compile_launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """Compile ``kernel`` for the launch ``kernel[grid](*args, **kwargs)`` would make (the same arguments: the same
    specialization, cached for that launch) and load it on the device, without running it: Triton checks the shared
    memory and threads a program needs, and loads the binary, when a kernel is first launched, not when it compiles.
    A failure raises `CompileError` (`compiling`). Under Triton's interpreter nothing compiles, and nothing
    happens."""
    with compiling(getattr(kernel, "__name__", type(kernel).__name__)):
        compiled = kernel.warmup(*args, grid=grid, **kwargs)
        result = getattr(compiled, "result", None)  # Triton's asynchronous compile mode hands a future
        if callable(result):
            compiled = result()
        load = getattr(compiled, "_init_handles", None)  # what the first launch runs: the resource checks, the load
        if load is not None:
            load()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for launch code on the host. Since Triton 3.5 ``triton.cdiv`` and ``triton.next_power_of_2``
    are constexpr functions whose every host call goes through a wrapper (about 3 us on a server CPU against 0.04
    for the arithmetic); a Newton-Schulz call made some twenty of them."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two at least ``n`` (1 for ``n <= 1``), for launch code on the host (see `cdiv`)."""
    return 1 << max(0, n - 1).bit_length()


# The columns of spec's hyperparameter buffer: a @triton.jit function may read a global only if it is a constexpr
LR, B1, B2, EPS, WD, EXTRA, TRUST_A, ADAPT, NUM_FIELDS = map(
    tl.constexpr, (spec.LR, spec.B1, spec.B2, spec.EPS, spec.WD, spec.EXTRA, spec.TRUST_A, spec.ADAPT, spec.NUM_FIELDS)
)


@triton.jit
def _program_block(block_tensor, block_start, numel_tab, addr_tab):
    """``(pid, t, start, n, addr)``: this program works on tensor ``t`` from element ``start``, as the block map of a
    multi-tensor launch says; ``addr`` is the tensor's entry in ``addr_tab`` and ``n`` its numel, 0 when ``addr`` is
    -1 (skip the tensor), so masks built on ``n`` cover nothing."""
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid)
    addr = tl.load(addr_tab + t)
    return pid, t, tl.load(block_start + pid), tl.where(addr != -1, tl.load(numel_tab + t), 0), addr


@triton.jit
def _live(g_addr, found_inf, HAS_FOUND_INF: tl.constexpr):
    """Whether an update's tensor steps (``g_addr`` from `_program_block` over the grad table). A tensor whose grad
    is None (-1) is skipped as torch skips it (no state change, no step); with HAS_FOUND_INF, a nonzero
    ``found_inf`` (AMP's overflow flag) skips every tensor, step counts included."""
    live = g_addr != -1
    if HAS_FOUND_INF:
        live = live & (tl.load(found_inf) == 0.0)
    return live


@triton.jit
def _tile_masks(start, n, live, BLOCK: tl.constexpr):
    """``(offs, mask, gmask)`` of BLOCK elements of a tensor of ``n`` from ``start``: ``mask`` covers what a `_live`
    tensor updates, ``gmask`` the grads, which are unscaled or zeroed on a skipped step too."""
    offs = start + tl.arange(0, BLOCK).to(tl.int64)
    return offs, offs < tl.where(live, n, 0), offs < n


@triton.jit
def _update_masks(start, n, g_addr, found_inf, HAS_FOUND_INF: tl.constexpr, BLOCK: tl.constexpr):
    """``(live, offs, mask, gmask)`` of an update's block (``start``, ``n``, ``g_addr`` from `_program_block`):
    `_live`, then `_tile_masks`."""
    live = _live(g_addr, found_inf, HAS_FOUND_INF)
    offs, mask, gmask = _tile_masks(start, n, live, BLOCK)
    return live, offs, mask, gmask


@triton.jit
def _hyper_row(hyper, group_tab, t):
    """Tensor ``t``'s row of the (n_groups, NUM_FIELDS) float64 hyperparameter buffer: read it as ``row + LR``."""
    return hyper + tl.load(group_tab + t).to(tl.int64) * NUM_FIELDS


VECTOR_ELEMS = 8
"""Elements of a thread in a vector layout (the update's 8-bit ``Q8 == 2`` and float FVEC, the norms' VEC): every
numel of such a launch is a multiple of it, and every program starts at a multiple of it in its tensor."""
VECTOR_ALIGN = 16
"""Bytes every address of a vector layout's tensors must be a multiple of."""


def vectors_fit(tables: Any, roles: Sequence[str]) -> bool:
    """Whether a launch over ``tables`` (a `kitsune.kernels.multi_tensor.TensorTables`) may promise Triton a vector
    layout for the tensors of ``roles``: every numel a multiple of `VECTOR_ELEMS` and each of their addresses a
    multiple of `VECTOR_ALIGN` (the tables keep that answer until a role moves)."""
    return tables.numel_gcd % VECTOR_ELEMS == 0 and tables.aligned(roles, VECTOR_ALIGN)


@triton.jit
def _ptr(addr, offs, DTYPE: tl.constexpr):
    """Elements ``offs`` of the DTYPE tensor at the int64 address ``addr``."""
    return addr.to(tl.pointer_type(DTYPE)) + offs


@triton.jit
def _vptr(addr, offs, DTYPE: tl.constexpr, VEC: tl.constexpr):
    """`_ptr`, and with VEC (a vector layout) the promise that ``addr`` is a multiple of `VECTOR_ALIGN` bytes: with
    ``offs`` from a multiple of `VECTOR_ELEMS`, Triton then gives each thread consecutive elements and reads them in
    vectors."""
    base = addr.to(tl.pointer_type(DTYPE))
    if VEC:
        base = tl.multiple_of(base, 16)
    return base + offs


@triton.jit
def _role_ptr(tab, t, offs, DTYPE: tl.constexpr):
    """Elements ``offs`` of tensor ``t`` of a role, through the role's (T,) int64 address table."""
    return _ptr(tl.load(tab + t), offs, DTYPE)


@triton.jit
def _pow_step(b, step):
    """``b ** step`` for a whole-number ``step`` (a step count), as torch's ``beta ** step``: a negative ``b`` too,
    where ``exp2(step * log2(b))`` alone is nan (torch checks betas only when the optimizer is built)."""
    mag = tl.exp2(step * tl.log2(tl.abs(b)))
    odd = step - 2.0 * tl.floor(step * 0.5)
    return tl.where((b < 0.0) & (odd != 0.0), -mag, mag)


@triton.jit
def _lerp(a, b, w):
    """torch.lerp's formula: ``a + w (b - a)`` for ``|w| < 0.5``, else ``b - (b - a)(1 - w)`` (exact at w = 1), as one
    select of the end it starts from and one multiply-add (``b + (w - 1)(b - a)`` is the same number: ``w - 1`` is
    exact there), not both formulas for every element: on many small tensors that cost 3% of the step."""
    small = tl.abs(w) < 0.5
    return tl.where(small, a, b) + tl.where(small, w, w - 1.0) * (b - a)


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
