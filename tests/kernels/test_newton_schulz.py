"""Newton-Schulz in Triton against the same iteration in float64 and against torch.optim.Muon's own bf16 function.

Error bands: the iteration amplifies rounding (its polynomial has slope a = 3.4 near 0), so a bf16 run lands about 1%
(relative Frobenius error) away from the float64 one, torch's bf16 run as much as ours. We check ours against
float64 with a band per dtype and against torch's bf16 function with a band of twice torch's own error. fp32 runs
(``dtype=torch.float32``, true fp32 products) land within 1e-5.
"""

from __future__ import annotations

import functools

import pytest
import torch

from kitsune.kernels import coefficients
from kitsune.kernels import newton_schulz as ns
from kitsune.kernels.newton_schulz import MUON_COEFFICIENTS, POLAR_EXPRESS_COEFFICIENTS, newton_schulz

torch_muon = pytest.importorskip("torch.optim._muon")  # torch >= 2.9

REL_ERR = {torch.bfloat16: 2.5e-2, torch.float32: 1e-5}
"""Relative Frobenius error against float64 that a run in this operand dtype stays within."""


def reference(g: torch.Tensor, steps: int = 5, coefficients=MUON_COEFFICIENTS, eps: float = 1e-7) -> torch.Tensor:
    """The iteration in float64: tall matrices transposed, each matrix normalised by its own Frobenius norm."""
    x = g.double()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for a, b, c in ns.schedule(coefficients, steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _randn(shape, seed, device, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


@functools.cache
def _run(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int = 0):
    """(input, our result) once per case: the interpreter is slow, several tests check the same run."""
    g = _randn(shape, seed, device)
    return g, newton_schulz(g, dtype=dtype)


SHAPES = [(32, 64), (64, 32), (3, 48, 96), (40, 72)]
"""Wide, tall, a batch, and sizes that are no multiple of the interpreter's 16-wide tiles or 64-deep k loop."""


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_float64_reference(shape, dtype, device):
    g, out = _run(shape, dtype, device.type)
    assert out.shape == g.shape and out.dtype == dtype and out.device == g.device
    assert rel_err(out, reference(g)) < REL_ERR[dtype]


@pytest.mark.parametrize("shape", [(32, 64), (64, 32), (40, 72)], ids=str)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_torch_muon_function(shape, in_dtype, device):
    """torch.optim.Muon's _zeropower_via_newtonschulz: bf16 results, about as far from float64 as ours."""
    g = _randn(shape, 1, device, in_dtype)
    want = torch_muon._zeropower_via_newtonschulz(g, MUON_COEFFICIENTS, 5, 1e-7)
    got = newton_schulz(g)
    exact = reference(g)
    assert rel_err(got, want) < 2 * max(rel_err(want, exact), 5e-3)
    fp32 = newton_schulz(g, dtype=torch.float32)  # fp32 products: torch's bf16 error is all that is left
    assert rel_err(fp32, exact) < REL_ERR[torch.float32]
    assert abs(rel_err(want, fp32) - rel_err(want, exact)) < 1e-4


def test_polar_express_schedule(device):
    """The published Algorithm 1 (normalise by 1.01 ||X||, safety-scaled triples) equals our folded schedule (eps 0:
    the paper adds its 1e-7 after the 1.01, a 1e-9 relative difference that five iterations amplify to 1e-5)."""
    g = _randn((32, 64), 2, device)
    x = g.double() / (g.double().norm() * 1.01)
    for a, b, c in coefficients._PE_SAFE[:5]:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    torch.testing.assert_close(reference(g, 5, POLAR_EXPRESS_COEFFICIENTS, eps=0.0), x, rtol=1e-12, atol=1e-12)
    assert len(POLAR_EXPRESS_COEFFICIENTS) == 8 and POLAR_EXPRESS_COEFFICIENTS[-1] == (1.875, -1.25, 0.375)
    # per-iteration coefficients reach the kernels (with more steps than triples, the last repeats)
    got = newton_schulz(g, steps=9, coefficients=POLAR_EXPRESS_COEFFICIENTS, dtype=torch.float32)
    assert rel_err(got, reference(g, 9, POLAR_EXPRESS_COEFFICIENTS)) < REL_ERR[torch.float32]
    sv = torch.linalg.svdvals(got.double())  # Polar Express converges: singular values all but 1
    assert (sv - 1).abs().max() < 0.01


def test_schedule_forms():
    assert ns.schedule((1, 2, 3), 2) == [(1.0, 2.0, 3.0)] * 2
    assert ns.schedule([(1, 2, 3), (4, 5, 6)], 3) == [(1.0, 2.0, 3.0), (4.0, 5.0, 6.0), (4.0, 5.0, 6.0)]
    assert ns.schedule([(1, 2, 3)] * 3, 1) == [(1.0, 2.0, 3.0)]  # three triples are a schedule, not a triple
    for bad in [(), (1, 2), [(1, 2, 3), (4, 5)]]:
        with pytest.raises(ValueError, match="coefficients"):
            ns.schedule(bad, 1)


def test_inputs_of_every_dtype_and_layout(device):
    """fp16 and bf16 inputs, a transposed view, and ``out=``: all the same iteration."""
    g = _randn((48, 32), 3, device)
    want = reference(g.bfloat16())
    assert rel_err(newton_schulz(g.bfloat16()), want) < REL_ERR[torch.bfloat16]
    assert rel_err(newton_schulz(g.half(), dtype=torch.float32), reference(g.half())) < REL_ERR[torch.float32]
    view = _randn((32, 48), 3, device).T  # not contiguous
    out = torch.empty(view.shape, dtype=torch.float32, device=device)
    assert newton_schulz(view, dtype=torch.float32, out=out) is out
    assert rel_err(out, reference(view)) < REL_ERR[torch.float32]


def test_zero_steps_zero_matrix_and_empty(device):
    g = _randn((2, 16, 24), 4, device)
    norm = g.norm(dim=(-2, -1), keepdim=True)
    torch.testing.assert_close(newton_schulz(g, steps=0, dtype=torch.float32), g / norm)
    zero = newton_schulz(torch.zeros(16, 32, device=device), steps=2, dtype=torch.float32)
    assert zero.abs().max().item() == 0.0  # clamped norm: no nan
    assert newton_schulz(torch.zeros(0, 16, 32, device=device)).shape == (0, 16, 32)


def test_inputs_are_checked(device):
    g = torch.ones(4, 4, device=device)
    for kwargs, match in [
        ({"X": torch.ones(4, device=device)}, "batch, m, n"),
        ({"X": g.double()}, "inputs of"),
        ({"X": g, "dtype": torch.float16}, "computes in"),
        ({"X": g, "steps": -1}, "steps"),
        ({"X": g, "eps": -1.0}, "eps"),
        ({"X": g, "out": torch.empty(4, 4, device=device)}, "out must be"),
        ({"X": g, "coefficients": (1.0, 2.0)}, "coefficients"),
    ]:
        with pytest.raises(ValueError, match=match):
            newton_schulz(**kwargs)


def _launch_picked(shape, seed: int, device):
    """A fresh random problem as ``(batch, m, n)``, the 3-iteration plan, the configs picked for it, and the result
    of launching with them."""
    g = _randn(shape, seed, device)
    x = g.unsqueeze(0) if g.dim() == 2 else g
    plan = ns.schedule(MUON_COEFFICIENTS, 3)
    m, n = sorted(x.shape[1:])
    configs = ns.pick_configs(m, n, x.shape[0], torch.bfloat16, x.device)
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=device)
    ns.newton_schulz_launch(x, out, plan, 1e-7, torch.bfloat16, configs)
    return x, plan, configs, out


VARIANTS = {
    "tma": ({"tma": True}, {"tma": True}),
    "tma+persistent": ({"tma": True, "persistent": True}, {"tma": True, "persistent": True}),
    "persistent+flatten": ({"persistent": True, "flatten": True}, {"persistent": True, "flatten": True}),
}


@pytest.mark.parametrize("shape", [(64, 80), (3, 48, 96), (96, 64), (2, 20, 36)], ids=str)
def test_tma_and_persistent_variants_compute_the_same_bits(shape, device, monkeypatch):
    """The TMA loads and the persistent grid change how tiles are fetched and scheduled, not what is summed in which
    order: each variant gives the same bits as the pointer loads. (64, 80) and (96, 64) have a Gram side that is a
    multiple of the k block, so the product ``B' X`` takes descriptors too; (96, 64) is tall, so its first iteration
    reads X through transposed strides, where TMA cannot: pointer loads there, descriptors after. (2, 20, 36) has rows
    of 72 and 40 bytes, no multiple of 16: its copies in the operand dtype have rows padded to 16 elements, so
    descriptors there too."""
    x, plan, (syrk, syrk_c, poly), base = _launch_picked(shape, 7, device)  # the pointer loads' bits, once a shape
    assert rel_err(base, reference(x, 3)) < REL_ERR[torch.bfloat16]
    made = []
    descriptor = ns._descriptor
    monkeypatch.setattr(ns, "_descriptor", lambda *a: made.append(descriptor(*a)) or made[-1])
    for variant, (s_kw, p_kw) in VARIANTS.items():
        made.clear()
        got = torch.empty_like(base)
        variant_configs = (syrk._replace(**s_kw), syrk_c._replace(**s_kw), poly._replace(**p_kw))
        ns.newton_schulz_launch(x, got, plan, 1e-7, torch.bfloat16, variant_configs)
        assert torch.equal(got, base), variant
        if "tma" in variant:  # descriptors were made where the layout allows, and only there
            assert any(d is not None for d in made), variant
            assert any(d is None for d in made) == (shape == (96, 64)), variant


class _Spy:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kwargs)`` launches the real one and records
    ``(grid, args, kwargs)``."""

    def __init__(self, kernel, calls: list):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.kernel[grid](*args, **kwargs)
            self.calls.append((grid, args, kwargs))

        return launch


@pytest.mark.parametrize("shape", [(64, 80), (3, 48, 96), (2, 20, 36)], ids=str)
def test_b_prime_takes_its_own_tiles(shape, device, monkeypatch):
    """The ``B'`` launch may take other tiles than ``X X^T``'s (`pick_configs` gives each its own): square tiles one
    block wide there, over their own tile table and grid, loaded through descriptors or pointers, sum each element
    in the same order, so the result is the same bits as one config for both; and a two-config tuple still means the
    ``X X^T`` config for ``B'`` too."""
    x, plan, (syrk, syrk_c, poly), base = _launch_picked(shape, 5, device)
    assert syrk_c == syrk  # one Gram config for both in the table picked from
    launched = []  # (grid, args, kwargs) of each Gram launch
    monkeypatch.setattr(ns, "_syrk_kernel", _Spy(ns._syrk_kernel, launched))
    for b_prime in (ns.SyrkConfig(16, 16, 64, 1, 1), ns.SyrkConfig(16, 16, 64, 1, 1, True, True, True)):
        got = torch.empty_like(base)
        launched.clear()
        ns.newton_schulz_launch(x, got, plan, 1e-7, torch.bfloat16, (syrk, b_prime, poly))
        assert torch.equal(got, base)
        assert [kw["BLOCK_N"] for _, _, kw in launched] == [syrk.block_n, 16] * len(plan)  # X X^T's, then B''s
        blocks = -(-min(x.shape[1:]) // 16)
        square_tiles = blocks * (blocks + 1) // 2  # every block of the upper triangle, one a program
        want = (
            (min(square_tiles * x.shape[0], ns._num_sms(x.device)),)
            if b_prime.persistent
            else (square_tiles, x.shape[0], 1)
        )
        assert launched[1][0] == want
    two = torch.empty_like(base)
    ns.newton_schulz_launch(x, two, plan, 1e-7, torch.bfloat16, (syrk, poly))
    assert torch.equal(two, base)
    assert rel_err(base, reference(x, 3)) < REL_ERR[torch.bfloat16]


@pytest.mark.parametrize("shape", [(40, 300), (2, 132, 36), (2, 24, 200)], ids=str)
def test_split_gram_sums_the_same_products(shape, device, monkeypatch):
    """A Gram launch split along k (``split_k``, for few tiles over a long k: a tall embedding) runs each part in its
    own program and adds the parts' fp32 sums in order before the epilogue: the unsplit result within fp32
    rounding of its sums (the bf16 results here come out the same bits), as close to float64; a reduce launch per
    split Gram, over every tile, with the parts a k of that depth makes (never an empty one)."""
    x, plan, (syrk, syrk_c, poly), base = _launch_picked(shape, 13, device)
    reduces = []  # (grid, args, kwargs) of each reduce launch
    monkeypatch.setattr(ns, "_gram_reduce_kernel", _Spy(ns._gram_reduce_kernel, reduces))
    m, n = sorted(x.shape[1:])
    for split_x, split_c in ((3, 1), (1, 2), (4, 5)):  # B''s k (m) is short: 16-deep blocks so that it splits
        reduces.clear()
        got = torch.empty_like(base)
        configs = (syrk._replace(split_k=split_x), syrk_c._replace(block_k=16, split_k=split_c), poly)
        ns.newton_schulz_launch(x, got, plan, 1e-7, torch.bfloat16, configs)
        assert rel_err(got, base) < 1e-3
        assert rel_err(got, reference(x, 3)) < REL_ERR[torch.bfloat16]
        parts = [s for s, _ in ns.gram_splits(configs[0], configs[1], m, n)]
        tiles = len(ns._upper_tiles(-(-m // syrk.block_m), syrk.block_n // syrk.block_m, x.device))
        want = [((tiles, x.shape[0]), p) for p in parts if p > 1] * len(plan)
        assert [(grid, args[5]) for grid, args, _ in reduces] == want and want  # args[5]: the splits
    assert ns._splits(syrk._replace(split_k=4), 65) == (2, 64)  # 4 parts of 64-deep blocks would leave two empty
    with pytest.raises(ValueError, match="persistent=False"):
        ns.newton_schulz_launch(x, base, plan, 1e-7, torch.bfloat16, (syrk._replace(split_k=2, persistent=True), poly))


def test_split_gram_parts_fill_waves():
    """`_split_k` on a GPU's 132 SMs: the part count whose waves take the fewest tile times, a larger one only where
    it saves a tenth; parts at least `SPLIT_MIN_K` deep where the tiles fill at most half the SMs, `SPLIT_DEEP_K`
    where they fill more (there a split only evens out the last wave)."""
    square, narrow = ns.SyrkConfig(128, 128, 64, 4, 3), ns.SyrkConfig(64, 128, 64, 4, 4)
    cases = [  # (config, m, k, batch, parts): the tile count in the comment
        (narrow, 768, 50257, 1, 3),  # 42 tiles: 126 programs, a wave (4 parts: 168, two waves)
        (square, 768, 50257, 1, 6),  # 21 tiles: 126
        (square, 1024, 16384, 1, 7),  # 36 tiles: 3 parts a wave of 1/3 the depth, 7 parts two of 1/7
        (square, 768, 6000, 1, 2),  # 21 tiles, but only two parts 2048 deep
        (square, 768, 2000, 1, 1),  # too short to split
        (narrow, 1024, 16384, 1, 1),  # 72 tiles: more than half the SMs, k too short for parts of 8192
        (square, 2048, 32000, 1, 3),  # 136 tiles: 2 tile times unsplit, 1.5 in 2 parts, 4/3 in 3
        (square, 2048, 8192, 1, 1),  # 136 tiles, one part of 8192
        (square, 4096, 4096, 1, 1),  # 528 tiles: four whole waves
        (square, 2048, 65536, 1, 6),  # 3 parts: 4/3, 6 parts: 7/6 (4 and 5: less than a tenth better than 3)
    ]
    assert [ns._split_k(cfg, m, k, b, 132) for cfg, m, k, b, _ in cases] == [c[-1] for c in cases]


def test_gram_tiles_by_modelled_time(monkeypatch):
    """On a GPU's 132 SMs, a Gram of few 128 x 128 tiles takes 64 x 128 ones, twice as many, unless its k loop is
    long enough to split into parts that fill the SMs with the square ones (`_gram_time` a tenth shorter); the
    ``B'`` launch (k = m, never split) keeps the narrow tiles there."""
    monkeypatch.setattr(ns, "_num_sms", lambda device: 132)
    cuda = torch.device("cuda")  # pick_configs only reads the SM count from it

    def picked(batch, m, n):
        gram, b_prime, _ = ns.pick_configs(m, n, batch, torch.bfloat16, cuda)
        return (gram.block_m, gram.block_n, gram.split_k), (b_prime.block_m, b_prime.block_n, b_prime.split_k)

    narrow = (64, 128, 1)
    assert picked(1, 1024, 16384) == ((128, 128, 7), narrow)  # 36 tiles x 7 parts against 72 tiles 16384 deep
    assert picked(1, 768, 50257) == ((128, 128, 6), narrow)  # GPT-2's wte: 21 x 6 against 42 x 3
    assert picked(1, 1024, 4096) == (narrow, narrow)  # 2 parts of 2048: no shorter than 72 narrow tiles
    assert picked(1, 512, 8192) == ((64, 128, 4), narrow)  # 10 square tiles: 4 parts leave most SMs idle
    assert picked(2, 1024, 16384) == ((64, 128, 2), narrow)  # 72 square tiles: no part count fills a wave better
    assert picked(1, 768, 3072) == (narrow, narrow)  # GPT-2's hidden matrices: too short to split
    assert picked(1, 4096, 4096) == ((128, 128, 1), (128, 128, 1))
    t = ns._gram_time
    square = ns.SyrkConfig(128, 128, 64, 4, 3)
    assert t(square._replace(split_k=2), 1024, 4096, 1, 132) == 2048 * ns.SQUARE_GRAM_COST + ns.SPLIT_COST_K
    assert t(square._replace(split_k=7), 1024, 16384, 1, 132) == 2 * 2368 * ns.SQUARE_GRAM_COST + ns.SPLIT_COST_K


@pytest.mark.parametrize("shape", [(20, 37), (37, 20), (2, 9, 51)], ids=str)
def test_rows_of_any_length_run_on_aligned_copies(shape, device, monkeypatch):
    """A bf16 input whose rows are no multiple of 16 elements is copied (rounded, as any input) into a buffer with rows
    padded to 16 elements, as are the iteration's own buffers: every row the kernels read starts aligned (vector loads,
    TMA descriptors), and the result is the iteration's, written into the caller's unpadded layout."""
    g = _randn(shape, 17, device, torch.bfloat16)
    strides = []
    descriptor = ns._descriptor
    monkeypatch.setattr(ns, "_descriptor", lambda t, st, *a: strides.append(tuple(st)) or descriptor(t, st, *a))
    x = g.unsqueeze(0) if g.dim() == 2 else g
    m, n = sorted(x.shape[1:])
    syrk, syrk_c, poly = ns.pick_configs(m, n, x.shape[0], torch.bfloat16, x.device)
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=device)
    tma = {"tma": True}
    plan = ns.schedule(MUON_COEFFICIENTS, 3)
    ns.newton_schulz_launch(x, out, plan, 1e-7, torch.bfloat16, (syrk._replace(**tma), syrk_c._replace(**tma), poly))
    assert rel_err(out, reference(x.float(), 3)) < REL_ERR[torch.bfloat16]
    assert out.is_contiguous() and strides
    assert all(st[1] % 16 == 0 for st in strides if st[2] == 1)  # every row-major operand: rows 16k elements apart
    assert ns._pitch(37) == 48 and ns._pitch(48) == 48
    assert rel_err(newton_schulz(g), reference(g)) < REL_ERR[torch.bfloat16]


def _nan_buffer(*args, _buffer=ns._buffer):
    return _buffer(*args).fill_(float("nan"))


@pytest.mark.parametrize(
    "shape, dtype",
    [((20, 37), torch.bfloat16), ((37, 20), torch.bfloat16), ((2, 9, 51), torch.bfloat16), ((24, 100), torch.float32),
     ((24, 80), torch.bfloat16), ((80, 24), torch.float32)],
    ids=str,
)  # fmt: skip
@pytest.mark.parametrize("split, block_n", [(1, None), (2, None), (1, 16)], ids=["unsplit", "split", "narrow"])
def test_iteration_buffers_run_to_a_whole_k_block_on_zero_columns(shape, dtype, split, block_n, device, monkeypatch):
    """The iterations run on buffers of `_extent` columns, zeros past ``n``; so does a wide input's copy (the prologue
    writes its zeros), while an input read in place (bf16, rows of 16k elements: (24, 80)) or a tall one keeps its
    ``n`` for the first iteration's read, and the result its ``n`` for the last write. Every Gram on a padded buffer
    runs without a k mask (EVEN_K), every product reads and writes whole blocks and keeps the padding zero, and the
    result is bit for bit the one of buffers exactly ``n`` wide (zero columns add nothing to a sum). Every buffer
    starts as NaN: a column left unwritten poisons the result. Narrow product tiles: an iteration buffer spans more
    of them than the result, each launch its own grid."""
    monkeypatch.setattr(ns, "_buffer", _nan_buffer)
    x = _randn(shape, 29, device, dtype)
    x = x.unsqueeze(0) if x.dim() == 2 else x
    m, n = sorted(x.shape[1:])
    n_x = ns._extent(n)
    assert n_x % ns.K_ALIGN == 0 and n_x > n
    tall = x.shape[1] > x.shape[2]
    n0 = n if tall or (dtype == torch.bfloat16 and n % 16 == 0) else n_x  # X0's columns
    syrk, syrk_c, poly = ns.pick_configs(m, n, x.shape[0], torch.bfloat16, x.device)
    configs = (syrk._replace(split_k=split), syrk_c, poly._replace(block_n=block_n or poly.block_n))
    steps = 3  # the first iteration (from X), one between the two buffers, the last (into the result)
    plan = ns.schedule(MUON_COEFFICIENTS, steps)
    grams, products, prologues = [], [], []
    monkeypatch.setattr(ns, "_syrk_kernel", _Spy(ns._syrk_kernel, grams))
    monkeypatch.setattr(ns, "_poly_kernel", _Spy(ns._poly_kernel, products))
    monkeypatch.setattr(ns, "_prologue_kernel", _Spy(ns._prologue_kernel, prologues))
    got = torch.empty(x.shape, dtype=torch.bfloat16, device=device)
    ns.newton_schulz_launch(x, got, plan, 1e-7, torch.bfloat16, configs)

    x_grams = [(args[14], kw["EVEN_K"]) for _, args, kw in grams if not kw["HAS_C"]]  # (K, EVEN_K) of each X X^T
    assert x_grams == [(n0, n0 % syrk.block_k == 0)] + [(n_x, True)] * (steps - 1)
    assert [(args[-2], args[-1], kw["PAD"]) for _, args, kw in products] == (
        [(n_x, n0, n0 < n_x)] + [(n_x, n_x, False)] * (steps - 2) + [(n, n_x, False)]
    )
    x0 = prologues[0][1][1]  # X0: the input, or its copy with its padding zeroed
    if x0.data_ptr() != x.data_ptr():
        assert x0.stride(1) == (ns._pitch(m) if tall else n_x)
        padding = x0.as_strided((x.shape[0], x.shape[1], x0.stride(1)), x0.stride())[..., x.shape[2] :]
        assert torch.equal(padding, torch.zeros_like(padding))
    for _, args, _ in products[:-1]:  # the iteration buffers: n_x columns, the last n_x - n of them zeros
        target = args[7]
        assert target.shape[-1] == n_x and target.stride(1) == n_x
        assert torch.equal(target[..., n:], torch.zeros_like(target[..., n:]))
    assert rel_err(got, reference(x.float(), steps)) < REL_ERR[torch.bfloat16]

    monkeypatch.setattr(ns, "K_ALIGN", 1)  # buffers of n columns (rows still 16-element aligned), k blocks masked
    unpadded = torch.empty_like(got)
    ns.newton_schulz_launch(x, unpadded, plan, 1e-7, torch.bfloat16, configs)
    assert torch.equal(got, unpadded)


@pytest.mark.parametrize("shape", [(96, 64), (64, 90)], ids=str)
def test_torch_bmm_product_keeps_the_padding_zero(shape, device, monkeypatch):
    """The cuBLAS product writes the columns the iteration buffer shares with its operand and zeroes the rest: the
    first iteration reads X0's ``n`` columns into an `_extent` buffer, the last reads one into the result's ``n``.
    Every buffer starts as NaN: padding left unzeroed poisons the result."""
    monkeypatch.setattr(ns, "_buffer", _nan_buffer)
    x = _randn(shape, 31, device, torch.bfloat16).unsqueeze(0)
    m, n = sorted(x.shape[1:])
    syrk, syrk_c, poly = ns.pick_configs(m, n, 1, torch.bfloat16, x.device)
    plan = ns.schedule(MUON_COEFFICIENTS, 3)
    got = torch.empty(x.shape, dtype=torch.bfloat16, device=device)
    ns.newton_schulz_launch(x, got, plan, 1e-7, torch.bfloat16, (syrk, syrk_c, poly._replace(cublas=True)))
    assert rel_err(got, reference(x.float(), 3)) < REL_ERR[torch.bfloat16]


@pytest.mark.parametrize("shape", [(64, 80), (96, 64), (3, 48, 96)], ids=str)
def test_product_handed_to_torch_bmm_matches_float64(shape, device, monkeypatch):
    """With ``cublas`` the product ``B' X`` runs as ``torch.bmm`` (cuBLAS on a GPU), through the same strides: the
    tall (96, 64) reads X transposed in its first iteration and writes the result transposed back. Other sums than
    the Triton product, so close to it rather than equal; and no Triton product kernel is launched."""
    x, plan, (syrk, syrk_c, poly), triton_out = _launch_picked(shape, 11, device)
    launched = []

    class Recorder:  # stands in for the Triton product kernel: ``_poly_kernel[grid](...)`` records the launch
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(grid)

    monkeypatch.setattr(ns, "_poly_kernel", Recorder())
    got = torch.empty_like(triton_out)
    ns.newton_schulz_launch(x, got, plan, 1e-7, torch.bfloat16, (syrk, syrk_c, poly._replace(cublas=True)))
    assert launched == []
    assert rel_err(got, reference(x, 3)) < REL_ERR[torch.bfloat16]
    assert rel_err(got, triton_out) < REL_ERR[torch.bfloat16]
    assert not torch.equal(got, x.to(got.dtype))  # a result, not the input passed through


def test_graph_cache_keeps_graphs_in_use_and_drops_stale_ones():
    """The cache of direct calls' graphs: a hit replays what was captured; a graph that does not fit beside graphs
    still in use launches directly (None) rather than evicting them, so two shapes never capture in turns; a graph
    unused for more than `GRAPH_STALE_CALLS` calls makes room, least recently used first; one over the budget never
    captures."""
    cache = ns._GraphCache()
    captured: list[str] = []

    def get(key: str, size: int) -> object | None:
        return cache.get((key,), lambda: size, 100, lambda: captured.append(key) or f"graph {key}")

    assert get("a", 60) == "graph a" and get("a", 60) == "graph a"
    for _ in range(ns.GRAPH_STALE_CALLS - 1):  # "a" still in use: "b" does not fit beside it, and is never captured
        assert get("b", 50) is None
    assert get("a", 60) == "graph a"
    assert get("c", 30) == "graph c"  # fits beside "a"
    assert captured == ["a", "c"]
    for _ in range(ns.GRAPH_STALE_CALLS):
        assert get("c", 30) == "graph c"
    assert get("b", 50) == "graph b"  # "a" went stale: dropped for "b"; "c" stays
    assert sorted(k for (k,) in cache.entries) == ["b", "c"] and captured == ["a", "c", "b"]
    assert get("huge", 101) is None and len(cache) == 2
    for _ in range(ns.GRAPH_STALE_CALLS + 1):
        get("b", 50)
    assert get("d", 50) == "graph d"  # "c" stale, "b" in use: "c" alone goes
    assert sorted(k for (k,) in cache.entries) == ["b", "d"]


# ---- GPU ----

GPU_REL_ERR = 1.5e-2
"""At 1024 and above, a bf16 run is about 1% from float64 (H100: 0.8-0.9%, as torch's own bf16 run)."""


@pytest.mark.cuda
@pytest.mark.parametrize(
    "shape",
    [(1024, 1024), (4096, 4096), (4096, 1024), (1024, 4096), (8, 2048, 2048), (1000, 1500)]
    + [(16384, 1024), (768, 50257)],  # Grams of few square tiles, split 7 and 6 ways
    ids=str,
)
def test_gpu_matches_float64(shape):
    g = torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    got = newton_schulz(g)
    exact = reference(g)
    err = rel_err(got, exact)
    assert err < GPU_REL_ERR
    if g.dim() == 2:  # no worse than torch.optim.Muon's bf16 iteration
        want = torch_muon._zeropower_via_newtonschulz(g, MUON_COEFFICIENTS, 5, 1e-7)
        assert err < 1.25 * rel_err(want, exact)
    fp32 = newton_schulz(g[..., :512, :512], dtype=torch.float32)
    assert rel_err(fp32, reference(g[..., :512, :512])) < 1e-5


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(3, 256, 384), (2048, 4096)], ids=str)
def test_gpu_graph_replay_is_bitwise_the_direct_launches(shape):
    """Calls replay a captured CUDA graph where it fits in the cache (1/64 of the GPU's memory: a 2048 x 4096 call
    holds 144 MB): the same kernels, the same bits, fresh inputs each call."""
    ns.clear_graph_cache()
    for seed in range(2):
        g = torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        got = newton_schulz(g)
        direct = torch.empty_like(got)
        x = g.unsqueeze(0) if g.dim() == 2 else g
        ns.newton_schulz_launch(x, direct.view(x.shape), ns.schedule(MUON_COEFFICIENTS, 5), 1e-7, torch.bfloat16)
        assert torch.equal(got, direct)
    assert len(ns._graphs[g.device]) == 1
    ns.clear_graph_cache()
    assert not ns._graphs


@pytest.mark.cuda
def test_gpu_graphs_per_stream_and_graph_false():
    """Calls of one shape on two streams at once each replay their own graph (a shared graph's buffers would be
    written by both); ``graph=False`` launches directly and keeps nothing. Every result is the direct launches'."""
    ns.clear_graph_cache()
    gen = torch.Generator("cuda").manual_seed(3)
    xs = [torch.randn(2, 512, 768, device="cuda", generator=gen) for _ in range(4)]
    plan = ns.schedule(MUON_COEFFICIENTS, 5)
    want = []
    for x in xs:
        want.append(torch.empty(x.shape, dtype=torch.bfloat16, device="cuda"))
        ns.newton_schulz_launch(x, want[-1], plan, 1e-7, torch.bfloat16)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for _ in range(3):
        outs = []
        for i, x in enumerate(xs):
            with torch.cuda.stream(streams[i % 2]):
                outs.append(newton_schulz(x))
        for s in streams:
            torch.cuda.current_stream().wait_stream(s)
        assert all(torch.equal(o, w) for o, w in zip(outs, want, strict=True))
    assert len(ns._graphs[xs[0].device]) == 2
    ns.clear_graph_cache()
    assert torch.equal(newton_schulz(xs[0], graph=False), want[0]) and not len(ns._graphs[xs[0].device])


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(4, 1024, 1536), (1536, 1000)], ids=str)
def test_gpu_tma_and_persistent_variants(shape):
    """On the GPU the variants use other instructions (TMA, a looped grid, cuBLAS for ``B' X``) for the same sums:
    as close to float64 as the pointer-load kernels. (1536, 1000) is tall with rows of 2000 bytes: no descriptor for
    its first read."""
    g = torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    x = g.unsqueeze(0) if g.dim() == 2 else g
    plan = ns.schedule(MUON_COEFFICIENTS, 5)
    m, n = sorted(x.shape[1:])
    syrk, syrk_c, poly = ns.pick_configs(m, n, x.shape[0], torch.bfloat16, x.device)
    exact = reference(x)
    tma, looped = {"tma": True}, {"tma": True, "persistent": True, "flatten": True}
    for s_kw, p_kw in ((tma, tma), (looped, looped), ({}, {"cublas": True})):
        out = torch.empty(x.shape, dtype=torch.bfloat16, device="cuda")
        configs = (syrk._replace(**s_kw), syrk_c._replace(**s_kw), poly._replace(**p_kw))
        ns.newton_schulz_launch(x, out, plan, 1e-7, torch.bfloat16, configs)
        assert rel_err(out, exact) < GPU_REL_ERR
