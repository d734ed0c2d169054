"""Multi-tensor norms and kitsune.clip_grad_norm_ against float64 references and torch.nn.utils.clip_grad_norm_."""

from __future__ import annotations

import math

import pytest
import torch
from twins import Uncompilable

import kitsune
from kitsune.kernels import norms
from kitsune.kernels.norms import MultiTensorNorm

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INF = math.inf
# bf16/fp16 values are exact in fp32, so every dtype only sees the error of the fp32 accumulation; the max is exact
RTOL = {2.0: 1e-6, INF: 0.0}


def _randn(sizes, device, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(device=device, dtype=dtype) for n in sizes]


def _ref(tensors, norm_type):
    """(per-tensor, total) in float64; an empty tensor's norm is 0 (torch's inf-norm refuses empty tensors)."""
    per = torch.stack(
        [
            torch.linalg.vector_norm(t.double(), norm_type) if t.numel() else t.new_zeros((), dtype=torch.float64)
            for t in tensors
        ]
    )
    return per, torch.linalg.vector_norm(per, norm_type)


def _check(result, tensors, norm_type):
    per, total = _ref(tensors, norm_type)
    rtol = RTOL[norm_type]
    torch.testing.assert_close(result.per_tensor.double().cpu(), per.cpu(), rtol=rtol, atol=0.0)
    torch.testing.assert_close(result.total.double().cpu(), total.cpu(), rtol=rtol, atol=0.0)
    assert result.found_inf.item() == 0.0


@pytest.mark.parametrize("tile", [64, 16], ids=["one-tile", "four-tiles"])
@pytest.mark.parametrize("norm_type", [2.0, INF])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norms_match_float64(dtype, norm_type, tile, device, monkeypatch):
    """Odd sizes, an empty tensor, and a tensor of 65 blocks reduced 16 partials at a time; blocks of 64 read in
    one tile or four (the last block of a tensor ending in any of its tiles)."""
    monkeypatch.setattr(norms, "REDUCE_BLOCK", 16)
    monkeypatch.setattr(norms, "NORM_TILE", tile)
    tensors = _randn([0, 1, 7, 4097, 300], device, dtype, seed=1)
    result = MultiTensorNorm([t.numel() for t in tensors], device, norm_type, block=64)(tensors)
    assert result.per_tensor.dtype == torch.float32 and result.per_tensor.shape == (5,)
    assert result.total.shape == () and result.found_inf.shape == (1,)
    _check(result, tensors, norm_type)


@pytest.mark.parametrize("norm_type", [2.0, INF])
def test_many_tensors_of_mixed_dtypes_in_one_launch(norm_type, device, monkeypatch):
    """300 tensors of three dtypes: the global reduction loops over 19 chunks of 16 per-tensor results."""
    monkeypatch.setattr(norms, "REDUCE_BLOCK", 16)
    gen = torch.Generator().manual_seed(2)
    sizes = torch.randint(0, 40, (300,), generator=gen).tolist()
    tensors = [t.to(DTYPES[i % 3]) for i, t in enumerate(_randn(sizes, device, seed=3))]
    result = MultiTensorNorm(sizes, device, norm_type)(tensors)
    _check(result, tensors, norm_type)


def test_bitwise_deterministic_and_relaunchable(device):
    """Repeated calls, new addresses and a second instance give the same bits; counters are back to zero."""
    tensors = _randn([0, 1, 7, 4097, 130], device, seed=4)
    norm = MultiTensorNorm([t.numel() for t in tensors], device, block=64)
    first = [x.clone() for x in norm(tensors)]
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(first, norm(tensors), strict=True))
    assert norm.tables.uploads == 2  # the address and dtype tables, once
    moved = [t.clone() for t in tensors]  # same values at new addresses
    assert all(torch.equal(a, b) for a, b in zip(first, norm(moved), strict=True))
    assert norm.tables.uploads == 3
    other = MultiTensorNorm([t.numel() for t in tensors], device, block=64)(tensors)
    assert all(torch.equal(a, b) for a, b in zip(first, other, strict=True))
    assert not norm.tables.counter.any() and not norm.sync.any()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, in the interpreter
@pytest.mark.parametrize("tile", [32, 8], ids=["one-tile", "four-tiles"])
@pytest.mark.parametrize("norm_type", [2.0, INF])
def test_inf_and_nan_are_found_and_the_flag_resets(norm_type, tile, device, monkeypatch):
    """An inf at element 40 (block 1's second tile of four) and a nan at element 3 are both seen."""
    monkeypatch.setattr(norms, "NORM_TILE", tile)
    tensors = _randn([5, 70, 9], device, seed=5)
    norm = MultiTensorNorm([t.numel() for t in tensors], device, norm_type, block=32)
    tensors[1][40] = -math.inf
    result = norm(tensors)
    assert result.found_inf.item() == 1.0 and math.isinf(result.total.item())
    assert math.isinf(result.per_tensor[1].item()) and math.isfinite(result.per_tensor[[0, 2]].sum().item())
    tensors[1][40] = 0.0
    tensors[2][3] = math.nan
    result = norm(tensors)
    assert result.found_inf.item() == 1.0 and math.isnan(result.total.item())
    assert math.isnan(result.per_tensor[2].item()) and not result.per_tensor[:2].isnan().any()
    tensors[2][3] = 1.0
    _check(norm(tensors), tensors, norm_type)  # nothing left over from the bad launches


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_overflowing_sum_of_squares_is_not_an_inf_value(device):
    """found_inf means an inf or nan value; a finite 1e30 makes the fp32 2-norm inf but sets no flag."""
    tensors = _randn([3, 4], device, seed=6)
    tensors[0][1] = 1e30
    result = MultiTensorNorm([3, 4], device)(tensors)
    assert math.isinf(result.total.item()) and result.found_inf.item() == 0.0


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_the_flag_tells_an_overflow_from_an_inf_in_another_tile(device, monkeypatch):
    """A block whose squares overflow in one tile is looked at value by value: no flag, unless another of its
    tiles holds an inf (and the flag follows the scaled values: a finite value that the scale makes inf counts)."""
    monkeypatch.setattr(norms, "NORM_TILE", 8)
    tensors = _randn([40, 5], device, seed=11)
    norm = MultiTensorNorm([40, 5], device, block=32)
    tensors[0][2] = 1e30  # block 0, tile 0: the sum of squares overflows
    assert norm(tensors).found_inf.item() == 0.0
    tensors[0][27] = math.inf  # block 0, tile 3
    assert norm(tensors).found_inf.item() == 1.0
    tensors[0][27] = 0.5
    assert norm(tensors).found_inf.item() == 0.0
    tensors[0][2] = 3e38  # finite, but inf once multiplied by 4
    result = norm(tensors, scale=torch.tensor(4.0, device=device))
    assert result.found_inf.item() == 1.0


@pytest.mark.parametrize("norm_type", [2.0, INF])
def test_skipped_tensors_and_scale(norm_type, device):
    """None skips a tensor (norm 0); scale multiplies every value first, e.g. an inverse loss scale."""
    tensors = _randn([7, 4097, 33], device, seed=7)
    norm = MultiTensorNorm([t.numel() for t in tensors], device, norm_type)
    result = norm([tensors[0], None, tensors[2]], scale=torch.tensor(0.25, device=device))
    scaled = [tensors[0] * 0.25, torch.zeros(0, device=device), tensors[2] * 0.25]
    _check(result, scaled, norm_type)
    assert norm.tables.role("x")[1].item() == norms.DEAD


def test_inputs_are_checked():
    norm = MultiTensorNorm([3, 4], torch.device("cpu"))
    with pytest.raises(ValueError, match="expected 2 tensors"):
        norm([torch.ones(3)])
    with pytest.raises(ValueError, match="tensor 1"):
        norm([torch.ones(3), torch.ones(5)])
    with pytest.raises(ValueError, match="tensor 0"):
        norm([torch.ones(3, dtype=torch.float64), torch.ones(4)])
    with pytest.raises(ValueError, match="tensor 0"):
        norm([torch.ones(6)[::2], torch.ones(4)])
    with pytest.raises(ValueError, match="scale"):
        norm([torch.ones(3), torch.ones(4)], scale=torch.ones(2))
    with pytest.raises(ValueError, match="norm_type"):
        MultiTensorNorm([3], torch.device("cpu"), 1.0)


@pytest.mark.parametrize("tile", [32, 8], ids=["one-tile", "four-tiles"])
def test_clip_launch_scales_every_tile(tile, device, monkeypatch):
    """MultiTensorNorm.clip_ over blocks of 32 read in one tile or four: every value times torch's coefficient."""
    monkeypatch.setattr(norms, "NORM_TILE", tile)
    tensors = _randn([70, 9, 33], device, seed=12)
    want_total = torch.linalg.vector_norm(torch.cat(tensors))
    coef = (0.5 / (want_total + 1e-6)).clamp(max=1.0)
    want = [t * coef for t in tensors]
    norm = MultiTensorNorm([t.numel() for t in tensors], device, block=32)
    norm(tensors)
    out = torch.zeros((), device=device)
    norm.clip_(0.5, out)
    torch.testing.assert_close(out, want_total, rtol=1e-6, atol=0.0)
    for got, ref in zip(tensors, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)


def test_block_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="power of 2"):
        MultiTensorNorm([3], torch.device("cpu"), block=96)


def test_channels_last_grads_are_dense(device):
    t = torch.randn(2, 3, 4, 5, device=device).to(memory_format=torch.channels_last)
    assert not t.is_contiguous() and norms.is_dense(t) and not norms.is_dense(t[:, :, :2])
    result = MultiTensorNorm([t.numel()], device)([t])
    _check(result, [t], 2.0)


# ---- kitsune.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_ ----


def _twins(grads):
    """Two lists of params with equal copies of ``grads`` (None: no grad), for kitsune and for torch."""
    twins = []
    for _ in range(2):
        # expanded zeros: params of the grads' shapes and dtypes that take no memory
        params = [torch.nn.Parameter(torch.zeros(()) if g is None else g.new_zeros(()).expand_as(g)) for g in grads]
        for p, g in zip(params, grads, strict=True):
            p.grad = None if g is None else g.clone()
        twins.append(params)
    return twins


def _mlp(dtype, device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 5))
    return model.to(device=device, dtype=dtype)


@pytest.mark.parametrize("norm_type", [2.0, INF])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_clip_trajectory_matches_torch(dtype, norm_type, device):
    """20 SGD steps of a small MLP, grads clipped then stepped: kitsune's clip vs torch's, step by step."""
    ours, theirs = _mlp(dtype, device), _mlp(dtype, device)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(8)
    tol = {"rtol": 1e-6, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-3}
    max_norm = {2.0: 0.8, INF: 0.16}[norm_type]  # about the median norm: some steps are clipped, some not
    clipped = 0
    for _ in range(20):
        x = torch.randn(16, 12, generator=gen).to(device, dtype)
        y = torch.randn(16, 5, generator=gen).to(device, dtype)
        norms_now = []
        for model, opt, clip in (
            (ours, opt_ours, kitsune.clip_grad_norm_),
            (theirs, opt_theirs, torch.nn.utils.clip_grad_norm_),
        ):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            norms_now.append(clip(model.parameters(), max_norm, norm_type))
            opt.step()
        got, want = norms_now
        assert got.dtype == want.dtype == dtype and got.shape == ()
        torch.testing.assert_close(got, want, **tol)
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, **tol)
            torch.testing.assert_close(p, q, **tol)
        clipped += bool(want > max_norm)
    assert 0 < clipped < 20  # both branches of the clamp were taken


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_error_if_nonfinite_raises_like_torch_and_leaves_grads(device):
    grads = _randn([6, 6, 6], device, seed=10)
    grads[1][2] = math.inf
    params, copies = _twins(grads)
    with pytest.raises(RuntimeError) as theirs:
        torch.nn.utils.clip_grad_norm_(copies, 1.0, error_if_nonfinite=True)
    with pytest.raises(RuntimeError) as ours:
        kitsune.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    assert str(ours.value) == str(theirs.value)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads, strict=True))
    # without the error the grads are scaled by the non-finite norm, as torch does: inf -> nan, finite -> 0
    total = kitsune.clip_grad_norm_(params, 1.0)
    assert math.isinf(total.item()) and params[1].grad[2].isnan() and (params[0].grad == 0).all()


def test_clip_skips_none_grads_and_accepts_one_tensor(device):
    params, copies = _twins([torch.randn(5, device=device) * 3, None, torch.randn(3, device=device) * 3])
    total = kitsune.clip_grad_norm_(params, 1.0)
    torch.testing.assert_close(total, torch.nn.utils.clip_grad_norm_(copies, 1.0), rtol=1e-6, atol=0.0)
    assert params[1].grad is None
    torch.testing.assert_close(params[0].grad, copies[0].grad, rtol=1e-6, atol=0.0)
    single = kitsune.clip_grad_norm_(params[2], 0.1)
    torch.testing.assert_close(single, torch.nn.utils.clip_grad_norm_(copies[2], 0.1), rtol=1e-6, atol=0.0)
    torch.testing.assert_close(params[2].grad, copies[2].grad, rtol=1e-6, atol=0.0)


def test_clip_marks_the_grads_written_as_torch_does(device):
    """The kernel writes the grads through their addresses: their version counters move as torch's in-place mul_
    moves them, so code that watches a grad for changes (autograd, updates inside backward) sees the clip."""
    params, copies = _twins([torch.randn(5, device=device) * 3, torch.randn(3, device=device) * 3])
    before = [p.grad._version for p in params]
    kitsune.clip_grad_norm_(params, 1.0)
    torch.nn.utils.clip_grad_norm_(copies, 1.0)
    assert all(p.grad._version > v for p, v in zip(params, before, strict=True))
    assert all(q.grad._version > v for q, v in zip(copies, before, strict=True))  # torch's too


def test_clip_edge_cases_follow_torch(device, caplog, monkeypatch):
    from kitsune import clip

    monkeypatch.setattr(clip, "_logged", set())
    assert torch.equal(kitsune.clip_grad_norm_([], 1.0), torch.tensor(0.0))
    with pytest.warns(UserWarning, match="empty generator"):
        kitsune.clip_grad_norm_((p for p in []), 1.0)
    # norm_type 1 goes to torch's implementation: the very same bits
    params, copies = _twins(_randn([4, 6], device, seed=11))
    with caplog.at_level("INFO", logger="kitsune.clip"):
        total = kitsune.clip_grad_norm_(params, 0.5, norm_type=1)
    assert torch.equal(total, torch.nn.utils.clip_grad_norm_(copies, 0.5, norm_type=1))
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(params, copies, strict=True))
    assert "norm_type 1.0" in caplog.text
    # mixed dtypes: one launch, torch's promoted result dtype; torch rounds the bf16 grad's norm to bf16, we do not
    grads = [torch.randn(4, device=device).bfloat16(), torch.randn(6, device=device)]
    params, copies = _twins(grads)
    total = kitsune.clip_grad_norm_(params, 0.5)
    want = torch.nn.utils.clip_grad_norm_(copies, 0.5)
    assert total.dtype == want.dtype == torch.float32
    torch.testing.assert_close(total.double(), _ref(grads, 2.0)[1], rtol=1e-6, atol=0.0)
    torch.testing.assert_close(total, want, rtol=1.6e-2, atol=0.0)


def test_clip_caches_tables(device, monkeypatch):
    from kitsune import clip

    monkeypatch.setattr(clip, "_cache", type(clip._cache)())
    monkeypatch.setattr(clip, "CACHE_SIZE", 2)
    params = [torch.nn.Parameter(torch.randn(n, device=device)) for n in (4, 6)]
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)  # new grads, maybe at new addresses, every step
        kitsune.clip_grad_norm_(params, 0.5)
    (norm,) = clip._cache.values()
    assert norm.tables.uploads <= 1 + 3  # the dtype table once, the address table at most once a step
    kitsune.clip_grad_norm_(params, 0.5, norm_type=INF)
    kitsune.clip_grad_norm_(params, 0.5)
    assert len(clip._cache) == 2 and clip._cache[next(reversed(clip._cache))] is norm  # reused, most recent
    kitsune.clip_grad_norm_(params[:1], 0.5)
    kitsune.clip_grad_norm_(params[1:], 0.5)
    assert len(clip._cache) == 2 and all(n is not norm for n in clip._cache.values())  # least recently used


@pytest.mark.parametrize("kernel", ["_norm_kernel", "_clip_kernel"])
def test_clip_takes_torchs_function_where_its_kernels_fail_to_compile(kernel, device, monkeypatch, caplog):
    """Checked before any grad changes: every grad clipped once, as torch's function clips it, and one warning."""
    import logging

    from kitsune import clip

    monkeypatch.setattr(clip, "_cache", type(clip._cache)())
    monkeypatch.setattr(clip, "_refused", type(clip._refused)())
    monkeypatch.setattr(norms, kernel, Uncompilable(getattr(norms, kernel)))
    gen = torch.Generator().manual_seed(4)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(device)) for n in (40, 7, 130)]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    with caplog.at_level(logging.WARNING, logger="kitsune.clip"):
        for _ in range(3):
            for p, q in zip(params, copies, strict=True):
                p.grad = torch.randn(p.shape, generator=gen).to(device) * 3
                q.grad = p.grad.clone()
            total = kitsune.clip_grad_norm_(params, 0.5)
            want = torch.nn.utils.clip_grad_norm_(copies, 0.5)
            torch.testing.assert_close(total, want, rtol=0, atol=0)
            for p, q in zip(params, copies, strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    warned = [r.getMessage() for r in caplog.records if "failed to compile" in r.getMessage()]
    assert len(warned) == 1 and kernel in warned[0]
    assert len(clip._refused) == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.bfloat16, torch.float32)], ids=["fp32", "mixed"])
def test_clip_compiles_ahead_exactly_what_it_launches(dtypes, monkeypatch):
    """`MultiTensorNorm.compile_clip` compiles the variants the clip's launches then find cached (a compile at the
    launch could fail after the norm ran)."""
    from kitsune import clip

    monkeypatch.setattr(clip, "_cache", type(clip._cache)())

    def cached() -> int:
        return sum(len(c[0]) for k in (norms._norm_kernel, norms._clip_kernel) for c in k.device_caches.values())

    seen: list[int] = []
    ahead = MultiTensorNorm.compile_clip

    def spy(self: MultiTensorNorm, out_dtype: torch.dtype) -> None:
        ahead(self, out_dtype)
        seen.append(cached())

    monkeypatch.setattr(MultiTensorNorm, "compile_clip", spy)
    params = [torch.nn.Parameter(torch.randn(n, device="cuda", dtype=dtypes[i % len(dtypes)])) for i, n in
              enumerate((4096, 77, 100_000))]  # fmt: skip
    for norm_type in (2.0, INF):
        for p in params:
            p.grad = torch.randn_like(p)
        kitsune.clip_grad_norm_(params, 0.5, norm_type=norm_type)
        assert seen and cached() == seen[-1]


# ---- GPU ----


def _gpt2_shapes():
    d, vocab, ctx = 768, 50257, 1024
    layer = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return [(vocab, d), (ctx, d)] + layer * 12 + [(d,), (d,)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("norm_type", [2.0, INF])
def test_gpt2_shapes_on_gpu(dtype, norm_type):
    """GPT-2 124M grad shapes (148 tensors): norms vs float64, bitwise repeatable, clip vs torch."""
    device = torch.device("cuda")
    torch.manual_seed(9)
    grads = [torch.randn(s, device=device, dtype=dtype) * 1e-3 for s in _gpt2_shapes()]
    norm = MultiTensorNorm([g.numel() for g in grads], device, norm_type)
    first = [x.clone() for x in norm(grads)]
    per, total = _ref(grads, norm_type)
    rtol = {2.0: 1e-5, INF: 0.0}[norm_type]
    torch.testing.assert_close(first[0].double(), per, rtol=rtol, atol=0.0)
    torch.testing.assert_close(first[1].double(), total, rtol=rtol, atol=0.0)
    for _ in range(5):
        assert all(torch.equal(a, b) for a, b in zip(first, norm(grads), strict=True))

    params, copies = _twins(grads)
    got = kitsune.clip_grad_norm_(params, 0.1, norm_type)
    want = torch.nn.utils.clip_grad_norm_(copies, 0.1, norm_type)
    tol = {"rtol": 1e-5, "atol": 0.0} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-8}
    torch.testing.assert_close(got, want, **tol)
    for p, q in zip(params, copies, strict=True):
        torch.testing.assert_close(p.grad, q.grad, **tol)


@pytest.mark.cuda
def test_one_bf16_tensor_over_2_31_elements():
    """int64 offsets end to end: 2**31 + 5 bf16 elements (~4.3 GB), the largest values at the very end."""
    n = 2**31 + 5
    if torch.cuda.mem_get_info()[0] < 2 * n + 2**30:
        pytest.skip("needs ~5.3 GB of free GPU memory")
    device = torch.device("cuda")
    g = torch.ones(n, device=device, dtype=torch.bfloat16)
    g[-3:] = torch.tensor([2.0, 3.0, -4.0], device=device)
    small = torch.full((3,), 0.5, device=device)
    for norm_type, want, want_small in ((2.0, math.sqrt(n + 26.75), math.sqrt(0.75)), (INF, 4.0, 0.5)):
        result = MultiTensorNorm([n, 3], device, norm_type)([g, small])
        torch.testing.assert_close(result.total.item(), want, rtol=1e-6, atol=0.0)
        torch.testing.assert_close(result.per_tensor[1].item(), want_small, rtol=1e-7, atol=0.0)
    p = torch.nn.Parameter(g.new_zeros(()).expand(n))
    p.grad = g
    total = kitsune.clip_grad_norm_([p], 2.0, norm_type=INF)
    assert total.item() == 4.0 and total.dtype == torch.bfloat16
    assert g[-1].item() == -2.0 and g[0].item() == 0.5  # coefficient 2 / (4 + 1e-6), products rounded to bf16


@pytest.mark.parametrize("dtype", DTYPES)
def test_vector_reads_only_where_every_tensor_allows_them(dtype, device):
    """Tensors at 16-byte multiples with numels of multiples of 8 are read in vectors; one view at an odd offset of
    a buffer, or one numel that is not a multiple of 8, reads every tensor an element at a time. The norms and the
    clip are the same either way (float64 references)."""
    sizes = [64, 8 * 37, 8]
    norm = MultiTensorNorm(sizes, device, block=64)
    buffer = _randn([sum(sizes) + 1], device, dtype, seed=2)[0]
    aligned = _randn(sizes, device, dtype, seed=3)
    offset = [buffer[1 : 1 + sizes[0]], *aligned[1:]]  # 2 or 4 bytes past a 16-byte multiple
    for tensors, vector in [(aligned, True), (offset, False), (aligned, True)]:
        _check(norm(tensors), tensors, 2.0)
        assert norm.vector() is vector
    odd = MultiTensorNorm([64, 12], device, block=64)
    tensors = _randn([64, 12], device, dtype, seed=4)
    _check(odd(tensors), tensors, 2.0)
    assert odd.vector() is False
    total = _ref(offset, 2.0)[1]
    want = [(t.double() * min(0.5 / (total.item() + 1e-6), 1.0)).to(dtype) for t in offset]
    norm(offset)
    norm.clip_(0.5, torch.zeros((), device=device))
    for got, ref in zip(offset, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-2 if dtype != torch.float32 else 1e-6, atol=1e-6)
