"""Multi-tensor norms: one launch computes every tensor's norm, the global norm and a found-inf/nan flag.

The launch runs over the block map of `TensorTables` (any number of tensors,
int64 offsets, empty tensors, ``-1`` for a tensor to skip). Each program reduces its block, in fp32 whatever the
input dtype, to one partial (the sum of squares for the 2-norm, the largest ``|x|`` for the inf-norm) and stores it
in a per-block buffer. Then it bumps its tensor's counter with an acq_rel atomic; the block that finishes a tensor
reduces that tensor's partials, and the block that finishes the last tensor (a second counter) reduces the
per-tensor results into the global norm. Both reductions read their inputs in an order fixed by the block map
alone, and no float is ever accumulated atomically, so the same inputs give the same bits on every run, whatever
order the programs ran in. The finishing blocks reset the counters, so the same tables can be launched again (or
captured in a CUDA graph) with nothing zeroed in between.

The global 2-norm is ``sqrt`` of the sum of the per-tensor sums of squares (not of the rounded per-tensor norms),
so it is as accurate as the per-tensor norms. ``found_inf`` is set by any inf or nan value, independently of the
norm, so a 2-norm whose fp32 sum of squares overflows is inf without raising the flag.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from operator import attrgetter
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kitsune._native import NOT_DENSE, layout_code
from kitsune.kernels import common as _common
from kitsune.kernels.common import (
    TL_DTYPES,
    VECTOR_ELEMS,
    _cast,
    _max_keep_nan,
    _program_block,
    _reduce,
    _vptr,
    vectors_fit,
)
from kitsune.kernels.multi_tensor import DEAD, TensorTables

_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""Per-tensor dtype codes: one launch reads tensors of several dtypes."""
SUPPORTED_DTYPES = tuple(_CODES)
_DATA_PTR = torch.Tensor.data_ptr
_NUMEL = torch.Tensor.numel
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_DTYPE = attrgetter("dtype")
_DEVICE = attrgetter("device")
NORM_BLOCK = 16384
"""Elements per program, read ``NORM_TILE`` at a time: each program ends with a counter atomic (a memory fence), so
fewer, longer programs spend less of the launch there. On an H200 (``benchmarks/norm-sweep.py --scale``, GPT-2 124M
grads in fp32, Triton 3.6): 0.119 ms a launch (100% of the copy-rate floor of reading them once) against 0.126 ms
with 8192-element programs; with the read of an element at a time and int64 offsets of the kernels before the
vector reads, 0.150 ms."""
NORM_TILE = 2048
"""Elements a program holds in registers at a time; 4096-element tiles in 8192-element blocks ran slower."""
REDUCE_BLOCK = 1024
"""Partials a finishing block reads per loop iteration."""
_VECTOR_ELEMS = tl.constexpr(VECTOR_ELEMS)
NORM_VECTOR = True
"""Whether launches whose tensors all sit at 16-byte multiples, with numels of multiples of 8, read them in 16-byte
vectors (`MultiTensorNorm.vector`): Triton cannot know the alignment of an address read from a table, and
otherwise reads an element at a time. On an H200 (8192-element programs, the GPT-2 set) 0.126 ms a launch against
0.195 ms an element at a time."""


@triton.jit
def _local(start, n, BLOCK: tl.constexpr):
    """How many of a block's BLOCK elements from ``start`` exist in a tensor of ``n`` (int32; <= 0: none).

    The kernels address a block as one base (the tensor's address plus ``start``) and int32 offsets within it, its
    tiles masked by this count: int64 offsets per element (and the compares on them) cost the norm pass about a
    tenth of its speed on the GPT-2 set (benchmarks/norm-sweep.py)."""
    return tl.minimum(n - start, BLOCK).to(tl.int32)


@triton.jit
def _vector_block(block_start, numel_tab, pid, t, addr):
    """`_program_block`'s ``start`` and ``n`` (0 for a skipped tensor) with the promise of a vector launch: both are
    multiples of `VECTOR_ELEMS` (made here, where the hint holds: the `_vptr` reads and their masks keep it)."""
    start = tl.multiple_of(tl.load(block_start + pid), _VECTOR_ELEMS)
    n = tl.multiple_of(tl.load(numel_tab + t), _VECTOR_ELEMS) * (addr != -1).to(tl.int64)
    return start, n


@triton.jit
def _load_f32(addr, start, loc, mask, code, VEC: tl.constexpr):
    """Elements ``start + loc`` of the tensor at ``addr`` (dtype code ``code``) as fp32, 0 where masked; VEC: in
    vectors (`_vptr`)."""
    if code == 0:
        x = tl.load(_vptr(addr, start, tl.float32, VEC) + loc, mask=mask, other=0.0)
    elif code == 1:
        x = tl.load(_vptr(addr, start, tl.bfloat16, VEC) + loc, mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.load(_vptr(addr, start, tl.float16, VEC) + loc, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _store_f32(addr, start, loc, mask, code, x, RNE_BF16: tl.constexpr, VEC: tl.constexpr):
    """Store fp32 ``x`` into elements ``start + loc`` of the tensor at ``addr``, rounded to its dtype."""
    if code == 0:
        tl.store(_vptr(addr, start, tl.float32, VEC) + loc, x, mask=mask)
    elif code == 1:
        tl.store(_vptr(addr, start, tl.bfloat16, VEC) + loc, _cast(x, tl.bfloat16, RNE_BF16), mask=mask)
    else:
        tl.store(_vptr(addr, start, tl.float16, VEC) + loc, x.to(tl.float16), mask=mask)


@triton.jit
def _load_scaled(addr, start, loc, mask, code, scale, HAS_SCALE: tl.constexpr, VEC: tl.constexpr):
    """Elements ``start + loc`` as fp32, times ``scale`` when HAS_SCALE, 0 where masked."""
    x = _load_f32(addr, start, loc, mask, code, VEC)
    if HAS_SCALE:
        x = tl.where(mask, x * scale, 0.0)
    return x


@triton.jit
def _norm_kernel(
    block_tensor,  # (n_blocks,) int32
    block_start,  # (n_blocks,) int64
    numel_tab,  # (T,) int64
    counter_tab,  # (T,) int32, zero between launches
    first_block,  # (T + 1,) int32: tensor t owns blocks first_block[t] .. first_block[t + 1] - 1
    addr_tab,  # (T,) int64 addresses, -1: skip the tensor
    code_tab,  # (T,) int64 dtype codes
    scale_ptr,  # () fp32, read when HAS_SCALE
    partials,  # (n_blocks,) fp32 scratch
    tensor_acc,  # (T,) fp32 scratch: per-tensor sum of squares (max |x| for the inf-norm)
    norms,  # (T,) fp32 out
    total,  # () fp32 out
    found_inf,  # (1,) fp32 out
    sync,  # (2,) int32: [tensors finished, inf/nan seen], zero between launches
    num_tensors,
    num_global,  # tensors 0 .. num_global - 1 make the global norm and the inf/nan flag; the rest get norms only
    INF_NORM: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    INVERT_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    TILE: tl.constexpr,
    RBLOCK: tl.constexpr,
    VEC: tl.constexpr,
):
    pid, t, start, n, addr = _program_block(block_tensor, block_start, numel_tab, addr_tab)
    if VEC:
        start, n = _vector_block(block_start, numel_tab, pid, t, addr)
    code = tl.load(code_tab + t)
    scale = 1.0
    if HAS_SCALE:
        scale = tl.load(scale_ptr)
        if INVERT_SCALE:  # a loss scale: multiply by its fp32 reciprocal taken in double, as GradScaler does
            scale = (1.0 / scale.to(tl.float64)).to(tl.float32)
        scale = tl.where(t < num_global, scale, 1.0)  # the tensors past num_global: as they are
    # the block in tiles: a program reads BLOCK elements, but holds TILE in registers at a time
    rem = _local(start, n, BLOCK)
    acc = tl.zeros((TILE,), tl.float32)
    for i in tl.static_range(BLOCK // TILE):
        if i * TILE < rem:  # a tensor's last block may need fewer tiles (small tensors: one)
            loc = i * TILE + tl.arange(0, TILE)
            x = _load_scaled(addr, start, loc, loc < rem, code, scale, HAS_SCALE, VEC)
            if INF_NORM:
                acc = tl.maximum(acc, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)
            else:
                acc += x * x
    if INF_NORM:
        part = _max_keep_nan(acc)
    else:
        part = tl.sum(acc, 0)
    # An inf or nan value makes the partial inf or nan; so can an fp32 overflow of the squares, which must not
    # raise the flag. Only then are the values looked at again, value by value (a rare path: the flag's test
    # per value costs a block-wide reduction that every program would otherwise pay).
    if t < num_global:
        if part - part != 0.0:
            bad = 0
            for i in tl.static_range(BLOCK // TILE):
                loc = i * TILE + tl.arange(0, TILE)
                x = _load_scaled(addr, start, loc, loc < rem, code, scale, HAS_SCALE, VEC)
                bad += tl.max(((x - x) != 0.0).to(tl.int32), 0)  # x - x is nan exactly for inf and nan
            if bad != 0:
                tl.atomic_or(sync + 1, 1)
    tl.store(partials + pid, part)

    first = tl.load(first_block + t)
    count = tl.load(first_block + t + 1) - first
    tl.debug_barrier()  # every thread's store is done before the release below
    if tl.atomic_add(counter_tab + t, 1) == count - 1:  # acq_rel: the last block of t sees all of t's partials
        red = _reduce(partials + first, count, INF_NORM, RBLOCK)
        tl.store(tensor_acc + t, red)
        if INF_NORM:
            tl.store(norms + t, red)
        else:
            tl.store(norms + t, tl.sqrt_rn(red))
        tl.store(counter_tab + t, 0)
        tl.debug_barrier()
        if tl.atomic_add(sync, 1) == num_tensors - 1:  # the last tensor of the launch: every tensor_acc is stored
            red = _reduce(tensor_acc, num_global, INF_NORM, RBLOCK)
            if INF_NORM:
                tl.store(total, red)
            else:
                tl.store(total, tl.sqrt_rn(red))
            tl.store(found_inf, tl.atomic_xchg(sync + 1, 0).to(tl.float32))
            tl.store(sync, 0)


@triton.jit
def _clip_kernel(
    block_tensor,  # (n_blocks,) int32
    block_start,  # (n_blocks,) int64
    numel_tab,  # (T,) int64
    addr_tab,  # (T,) int64 addresses, -1: skip the tensor
    code_tab,  # (T,) int64 dtype codes
    total,  # () fp32: the global norm
    out,  # () the global norm, in the dtype torch returns it in
    max_norm,  # fp32
    OUT_DTYPE: tl.constexpr,
    RNE_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
    TILE: tl.constexpr,
    VEC: tl.constexpr,
):
    pid, t, start, n, addr = _program_block(block_tensor, block_start, numel_tab, addr_tab)
    if VEC:
        start, n = _vector_block(block_start, numel_tab, pid, t, addr)
    code = tl.load(code_tab + t)
    norm = tl.load(total)
    if pid == 0:
        tl.store(out, _cast(norm, OUT_DTYPE, RNE_BF16))
    # torch: clamp(max_norm / (norm + 1e-6), max=1), where a float divided by a tensor is reciprocal() * max_norm
    coef = tl.math.div_rn(1.0, norm + 1e-6) * max_norm
    coef = tl.where(coef > 1.0, 1.0, coef)  # a nan coefficient stays nan, as with torch.clamp
    rem = _local(start, n, BLOCK)
    for i in tl.static_range(BLOCK // TILE):
        if i * TILE < rem:
            loc = i * TILE + tl.arange(0, TILE)
            mask = loc < rem
            x = _load_f32(addr, start, loc, mask, code, VEC)
            _store_f32(addr, start, loc, mask, code, x * coef, RNE_BF16, VEC)


INTERPRETED = type(_norm_kernel).__name__ == "InterpretedFunction"
"""Whether the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 when this module was imported)."""


class Norms(NamedTuple):
    """The results of one `MultiTensorNorm` launch, in buffers that the next launch overwrites."""

    per_tensor: torch.Tensor
    """(T,) fp32: each tensor's norm (0 for an empty or skipped tensor)."""
    total: torch.Tensor
    """() fp32: the norm of all tensors viewed as one vector."""
    found_inf: torch.Tensor
    """(1,) fp32: 1.0 if some value (times ``scale``) is inf or nan, else 0.0, like torch.amp's ``found_inf``."""


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers exactly ``numel`` elements from its data pointer, in any dim order (channels_last)."""
    if layout_code(t) != NOT_DENSE:
        return True  # row-major or channels_last, from flags torch keeps: no sort of the strides
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride(), strict=True) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    # Triton launches on the current CUDA device, not on the one the tensors live on
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class MultiTensorNorm:
    """Norms of a fixed list of tensor sizes, one launch per call; the tables are built once.

    ``norm_type`` is 2 or inf. Each call takes tensors of the sizes given here (any mix of fp32, bf16 and fp16,
    dense, on ``device``; ``None`` to skip one) and uploads the address table only when an address changed.
    """

    def __init__(
        self,
        numels: Sequence[int],
        device: torch.device,
        norm_type: float = 2.0,
        block: int = NORM_BLOCK,
        num_warps: int = 4,
    ) -> None:
        norm_type = float(norm_type)
        if norm_type not in (2.0, math.inf):
            raise ValueError(f"MultiTensorNorm supports norm_type 2 and inf, got {norm_type}")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # compared with tensors' devices, which have one
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.norm_type = norm_type
        self.num_warps = num_warps
        self.numels = list(numels)
        self.tile = min(NORM_TILE, block)
        if block <= 0 or block & (block - 1):
            raise ValueError(f"block must be a power of 2, got {block}")
        self.tables = TensorTables(self.device, self.numels, [0] * len(self.numels), block)
        tables = self.tables
        n = tables.num_tensors
        self.first_block = torch.searchsorted(  # block_tensor is sorted: the first block of each tensor
            tables.block_tensor, torch.arange(n + 1, dtype=torch.int32, device=self.device), out_int32=True
        )
        f32 = {"dtype": torch.float32, "device": self.device}
        self.partials = torch.empty(tables.num_blocks, **f32)
        self.tensor_acc = torch.empty(n, **f32)
        self.per_tensor = torch.zeros(n, **f32)
        self.total = torch.zeros((), **f32)
        self.found_inf = torch.zeros(1, **f32)
        self.sync = torch.zeros(2, dtype=torch.int32, device=self.device)
        self._dtypes: list[torch.dtype] | None = None  # of the last call, when it took the fast path
        self._compiled: set[tuple[bool, torch.dtype]] = set()  # the clip variants `compile_clip` compiled

    def __call__(
        self,
        tensors: Sequence[torch.Tensor | None],
        scale: torch.Tensor | None = None,
        *,
        checked: bool = False,
        invert_scale: bool = False,
        out: torch.Tensor | None = None,
    ) -> Norms:
        """Launch once over ``tensors``; ``scale`` (a () or (1,) fp32 tensor on the device) multiplies every value
        first, e.g. an inverse loss scale (``invert_scale=True``: divides by it, e.g. by the loss scale itself).
        The returned buffers are overwritten by the next call, except the total when ``out`` (a () fp32 tensor on
        the device) is given to receive it.

        ``checked=True``: the caller has already checked that ``tensors`` (no None) are dense, on this device, of
        supported dtypes and of this instance's sizes ([`kitsune.clip_grad_norm_`][kitsune.clip_grad_norm_] does, for
        its cache key).
        """
        self.bind(tensors, checked)
        return self.launch(scale, invert_scale=invert_scale, out=out)

    def compile_clip(self, out_dtype: torch.dtype) -> None:
        """Compile the two launches of a clip over the tensors bound now (`launch` with no scale, then `clip_` into
        an ``out_dtype`` total) without running them, once a variant: a kernel that cannot compile on this device
        raises `kitsune.kernels.common.CompileError` before any tensor changed."""
        variant = (self.vector(), out_dtype)
        if variant in self._compiled or self.tables.num_blocks == 0:
            return
        self.launch(compile_only=True)
        self.clip_(0.0, torch.empty((), dtype=out_dtype, device=self.device), compile_only=True)
        self._compiled.add(variant)

    def bind_addresses(
        self,
        addresses: list[int] | None,
        dtypes: list[torch.dtype],
        host: torch.Tensor | None = None,
        low_bits: int | None = None,
    ) -> None:
        """Point the tables at tensors by address (``-1``: skip), for callers that have already checked them
        (the fusion subsystem's units have); uploads only what changed. ``host`` and ``low_bits``: the addresses as
        a CPU int64 tensor and their low bits, where the caller has them; ``addresses`` None: ``host`` alone,
        known to differ from the last (`TensorTables.set_role`). Then `launch`."""
        if dtypes != self._dtypes:
            self.tables.set_role("dtype", [_CODES[d] for d in dtypes])
            self._dtypes = dtypes
        self.tables.set_role("x", addresses, host, low_bits)

    def launch(
        self,
        scale: torch.Tensor | None = None,
        *,
        invert_scale: bool = False,
        num_global: int | None = None,
        out: torch.Tensor | None = None,
        compile_only: bool = False,
    ) -> Norms:
        """Launch over the tensors last bound (see `__call__`); ``num_global``: only the first this many
        tensors are scaled and make the global norm and the inf/nan flag (the others, e.g. params, get their
        per-tensor norms only). ``compile_only``: compile what the launch runs, and run nothing
        (`kitsune.kernels.common.compile_launch`)."""
        if scale is not None and (scale.dtype != torch.float32 or scale.numel() != 1 or scale.device != self.device):
            raise ValueError(f"scale must be one fp32 value on {self.device}, got {scale.dtype} {tuple(scale.shape)}")
        if out is not None and (out.dtype != torch.float32 or out.numel() != 1 or out.device != self.device):
            raise ValueError(f"out must be one fp32 value on {self.device}, got {out.dtype} {tuple(out.shape)}")
        total = self.total if out is None else out
        tables = self.tables
        n_global = tables.num_tensors if num_global is None else num_global
        if not 0 <= n_global <= tables.num_tensors:
            raise ValueError(f"num_global={num_global} is outside 0..{tables.num_tensors}")
        if tables.num_blocks:
            grid = (tables.num_blocks,)
            with _device_guard(self.device):
                _common.launcher(_norm_kernel, grid, compile_only)(
                    tables.block_tensor,
                    tables.block_start,
                    tables.numel,
                    tables.counter,
                    self.first_block,
                    tables.role("x"),
                    tables.role("dtype"),
                    total if scale is None else scale,
                    self.partials,
                    self.tensor_acc,
                    self.per_tensor,
                    total,
                    self.found_inf,
                    self.sync,
                    tables.num_tensors,
                    n_global,
                    INF_NORM=self.norm_type == math.inf,
                    HAS_SCALE=scale is not None,
                    INVERT_SCALE=invert_scale,
                    BLOCK=tables.block,
                    TILE=self.tile,
                    RBLOCK=REDUCE_BLOCK,
                    VEC=self.vector(),
                    num_warps=self.num_warps,
                    enable_fp_fusion=_common.FP_FUSION,
                )
        elif out is not None and not compile_only:
            out.zero_()  # no tensors: the norm of nothing
        return Norms(self.per_tensor, total, self.found_inf)

    def bind(self, tensors: Sequence[torch.Tensor | None], checked: bool = False) -> None:
        """Check ``tensors`` against this instance and point the address and dtype tables at them.

        The common case (no None, all contiguous, nothing wrong) costs a few C-level ``map`` passes and list
        compares; anything else takes a per-tensor loop that also names the offending tensor.
        """
        if len(tensors) != len(self.numels):
            raise ValueError(f"expected {len(self.numels)} tensors, got {len(tensors)}")
        try:
            addresses = list(map(_DATA_PTR, tensors))
            dtypes = list(map(_DTYPE, tensors))
            fast = checked or (
                list(map(_NUMEL, tensors)) == self.numels
                and set(map(_DEVICE, tensors)) == {self.device}
                and all(map(_IS_CONTIGUOUS, tensors))
                and _CODES.keys() >= set(dtypes)
            )
        except TypeError:  # a None
            fast = False
        if fast:
            if dtypes != self._dtypes:
                self.tables.set_role("dtype", [_CODES[d] for d in dtypes])
                self._dtypes = dtypes
        else:
            addresses, codes = [], []
            for i, (t, numel) in enumerate(zip(tensors, self.numels, strict=True)):
                if t is None:
                    addresses.append(DEAD)
                    codes.append(0)
                    continue
                code = _CODES.get(t.dtype)
                if code is None or t.device != self.device or t.numel() != numel or not is_dense(t):
                    raise ValueError(
                        f"tensor {i}: expected a dense {numel}-element tensor of {SUPPORTED_DTYPES} on "
                        f"{self.device}, got {t.dtype} {tuple(t.shape)} stride {t.stride()} on {t.device}"
                    )
                addresses.append(t.data_ptr())
                codes.append(code)
            self.tables.set_role("dtype", codes)
            self._dtypes = None
        self.tables.set_role("x", addresses)

    def vector(self) -> bool:
        """Whether the launches over the tensors bound now read them in vectors (the kernels' VEC): every numel a
        multiple of `VECTOR_ELEMS` and every address of `VECTOR_ALIGN` (the answer is kept until an address
        moves). A captured launch keeps the answer it was captured with, so a graph of it is keyed on this."""
        tables = self.tables
        kept = tables.layout
        if kept is not None and kept[0] is NORM_VECTOR:
            return kept[1]
        ok = NORM_VECTOR and tables.block % VECTOR_ELEMS == 0 and vectors_fit(tables, ["x"])
        tables.layout = (NORM_VECTOR, ok)
        return ok

    def clip_(self, max_norm: float, out: torch.Tensor, compile_only: bool = False) -> None:
        """Multiply the tensors of the last call in place by ``min(max_norm / (total + 1e-6), 1)``, with ``total``
        read on the device (no host sync), and store ``total`` rounded to ``out``'s dtype in the () tensor ``out``
        (``compile_only``: compile that launch, run nothing).

        The coefficient is computed in fp32 as torch computes it for fp32 grads; each value is multiplied in fp32
        and rounded once to its tensor's dtype.
        """
        if out.dtype not in TL_DTYPES or out.numel() != 1 or out.device != self.device:
            raise ValueError(f"out must be one {SUPPORTED_DTYPES} value on {self.device}, got {out.dtype}")
        tables = self.tables
        if not tables.has_role("x"):
            raise RuntimeError("clip_ scales the tensors of the last call: call the MultiTensorNorm first")
        if tables.num_blocks == 0:  # no tensors: the total is 0
            if not compile_only:
                out.copy_(self.total)
            return
        grid = (tables.num_blocks,)
        with _device_guard(self.device):
            _common.launcher(_clip_kernel, grid, compile_only)(
                tables.block_tensor,
                tables.block_start,
                tables.numel,
                tables.role("x"),
                tables.role("dtype"),
                self.total,
                out,
                float(max_norm),
                OUT_DTYPE=TL_DTYPES[out.dtype],
                RNE_BF16=INTERPRETED,
                BLOCK=tables.block,
                TILE=self.tile,
                VEC=self.vector(),
                num_warps=self.num_warps,
                enable_fp_fusion=_common.FP_FUSION,
            )
