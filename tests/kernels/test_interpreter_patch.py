"""The tests' interpreter shortcuts (`interpreter_patch.skip_repeated_patching`, `remember_numpy_dtypes`,
`fast_bfloat16_casts` and `share_tensor_shapes`) change no bit: a fused 8-bit AdamW (the kernel with the most nested
helpers), a bf16-state one (float32 <-> bfloat16 casts) and a clipped fp32 AdamW step the same params with and without
them; the casts answer as Triton's on every bfloat16 pattern and a million float32 ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from kitsune import FusionConfig, GradConfig, KitsuneOptimizer
from kitsune.fusion import Route

pytestmark = pytest.mark.skipif(
    not getattr(interpreter._patch_lang, "skips_repeats", False), reason="the shortcut is on only without a GPU"
)


def _run(precision: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    params = [torch.randn(n, generator=gen).requires_grad_() for n in (1000, 333, 4096)]
    first = [p.detach().clone() for p in params]
    opt = KitsuneOptimizer(
        torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
        enable_fusion=True,
        fusion_config=FusionConfig(state_precision=precision, min_8bit_size=0),
        grad_config=GradConfig(max_norm=1.0),
    )
    for _ in range(4):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    assert all(b.route is Route.TRITON for b in opt.plan.buckets), opt.plan.to_dict()
    assert not any(torch.equal(p, q) for p, q in zip(params, first, strict=True))  # the steps moved every param
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("precision", ["8bit", "bf16", "param"])
def test_the_shortcut_steps_the_same_bits(precision, monkeypatch):
    shortcut = _run(precision)
    monkeypatch.setattr(interpreter, "_patch_lang", interpreter._patch_lang.original)
    cached = interpreter._get_np_dtype
    monkeypatch.setattr(interpreter, "_get_np_dtype", getattr(cached, "original", cached))
    shifted = interpreter._convert_float
    monkeypatch.setattr(interpreter, "_convert_float", getattr(shifted, "original", shifted))
    shared = tl.core.tensor.__init__
    monkeypatch.setattr(tl.core.tensor, "__init__", getattr(shared, "original", shared))
    full = _run(precision)
    for a, b in zip(shortcut, full, strict=True):
        assert torch.equal(a, b)


def _bits32(gen: np.random.Generator, n: int, subnormals: bool) -> np.ndarray:
    """``n`` float32 bit patterns over every class: random words (NaN payloads, infinities, normals of every
    exponent), then the edges; subnormals (exponent 0, significand not 0) only where asked."""
    bits = gen.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    edges = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x00800000, 0x7F7FFFFF]
    edges += [0x3F800000 | m for m in (0x7FFF, 0x8000, 0x8001, 0x17FFF, 0x18000)]  # about the cut at bit 16
    bits[: len(edges)] = edges
    subnormal = ((bits & 0x7F800000) == 0) & ((bits & 0x007FFFFF) != 0)
    if subnormals:
        bits[len(edges) : len(edges) + 5] = [1, 0x007FFFFF, 0x80000001, 0x00400000, 0x0000FFFF]
    else:
        bits[subnormal] |= 0x00800000  # exponent 1
    return bits


def test_the_bfloat16_casts_answer_as_tritons_bit_for_bit(monkeypatch):
    """`interpreter_patch.fast_bfloat16_casts` shifts where Triton's ``_convert_float`` would give the same bits, and
    hands everything else (a subnormal among the inputs, a rounding mode) to it: every bfloat16 pattern and a million
    float32 ones, in several shapes and layouts, answer as Triton's; the shift is what answered where it can."""
    import interpreter_patch

    installed = interpreter._convert_float
    triton_s = getattr(installed, "original", installed)
    asked: list[int] = []

    def counted(*args):
        asked.append(1)
        return triton_s(*args)

    monkeypatch.setattr(interpreter, "_convert_float", counted)
    interpreter_patch.fast_bfloat16_casts()  # in front of the counting stand-in for Triton's
    shortcut = interpreter._convert_float
    assert shortcut.original is counted

    def same(x: np.ndarray, src, dst, fast: bool, rounding=None) -> None:
        asked.clear()
        got = shortcut(x, src, dst, rounding)
        assert bool(asked) is not fast  # the shift answered, or Triton's function did
        want = triton_s(x, src, dst, rounding)
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)

    gen = np.random.default_rng(7)
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16)  # every bfloat16 pattern, subnormals included
    subnormal = ((every & 0x7F80) == 0) & ((every & 0x007F) != 0)
    normal = every[~subnormal]
    same(every.reshape(256, 256), tl.bfloat16, tl.float32, fast=False)
    same(normal, tl.bfloat16, tl.float32, fast=True)
    same(normal[:4096].reshape(64, 64).T, tl.bfloat16, tl.float32, fast=True)  # not contiguous
    same(np.array(normal[1234]), tl.bfloat16, tl.float32, fast=True)  # 0-d
    for subnormals in (False, True):
        words = _bits32(gen, 1_000_000, subnormals).view(np.float32)
        same(words, tl.float32, tl.bfloat16, fast=not subnormals)
        same(words[:4096].reshape(64, 64).T, tl.float32, tl.bfloat16, fast=not subnormals)
        same(np.array(words[0]), tl.float32, tl.bfloat16, fast=True)  # 0-d: the first edge, +0
    rtne = interpreter._ir.ROUNDING_MODE.RTNE
    same(_bits32(gen, 4096, False).view(np.float32), tl.float32, tl.bfloat16, fast=False, rounding=rtne)


def test_the_numpy_dtypes_answer_as_tritons():
    """`interpreter_patch.remember_numpy_dtypes` gives Triton's ``_get_np_dtype`` answer for every scalar type, pointer
    and block of either, asked twice (the second answer from the cache)."""
    cached = interpreter._get_np_dtype
    assert getattr(cached, "remembers", False)
    scalars = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64]
    scalars += [tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.float8e5, tl.float8e4nv]
    types = [*scalars, *(tl.pointer_type(t) for t in scalars)]
    types += [tl.block_type(t, [4, 8]) for t in types]
    for t in types * 2:
        assert cached(t) == cached.original(t), t


def test_tensors_of_one_shape_share_what_triton_would_make_for_each():
    """`interpreter_patch.share_tensor_shapes` is in (Triton's constructor is the one it stands in for), and a tensor
    it makes carries what Triton's constructor gives it: handle, type, dtype, numel and shape, blocks and scalars."""
    init = tl.core.tensor.__init__
    if not getattr(init, "shares_shapes", False):  # another Triton: the suite runs slower, as it computes the same
        pytest.skip("this Triton's tl.tensor.__init__ is not the one share_tensor_shapes stands in for")
    types = (tl.block_type(tl.float32, [4, 8]), tl.block_type(tl.bfloat16, [128]), tl.int64, tl.pointer_type(tl.int8))
    for ty in types:
        first = None
        for _ in range(2):  # made, then shared
            ours, theirs = tl.core.tensor.__new__(tl.core.tensor), tl.core.tensor.__new__(tl.core.tensor)
            init(ours, "handle", ty)
            init.original(theirs, "handle", ty)
            assert vars(ours).keys() == vars(theirs).keys()
            assert ours.handle == theirs.handle and ours.type == theirs.type and ours.dtype == theirs.dtype
            assert ours.numel.value == theirs.numel.value
            assert [s.value for s in ours.shape] == [s.value for s in theirs.shape]
            assert ours.shape.type == theirs.shape.type
            assert first is None or ours.shape is first  # the second tensor of that shape shares the first's
            first = ours.shape


def _count_loop(table, out):
    t = tl.load(table)  # a loaded scalar: a one-element block in the interpreter
    n = tl.load(table + t + 1) - tl.load(table + t)
    acc = 0
    for _ in range(0, n, 1):
        acc += 1
    tl.store(out, acc)


def test_a_loop_bounded_by_a_loaded_count_runs():
    """The norm's reduction loops to a count read from a table; Triton 3.6's interpreter raised on that under numpy 2
    (`interpreter_patch.index_size_one_blocks`), later Triton's runs it."""
    kernel = triton.jit(_count_loop)  # here, where TRITON_INTERPRET=1 is set (Triton 3.6 reads it at decoration)
    table = torch.tensor([1, 4, 11], dtype=torch.int32)
    out = torch.zeros(1, dtype=torch.int32)
    kernel[(1,)](table, out)
    assert out.item() == 7
