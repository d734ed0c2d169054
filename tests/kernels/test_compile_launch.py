"""`kitsune.kernels.common.compile_launch`: what a step compiles ahead must fail there, not at the launch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import triton
import triton.language as tl

from kitsune.kernels.common import CompileError, compile_launch


class _Compiled:
    """Triton's compiled kernel as `warmup` returns it: the shared memory and threads check, and the load onto the
    device, run at `_init_handles` (a first launch), not at the compile."""

    def __init__(self, error: Exception | None) -> None:
        self.error, self.loaded = error, False

    def _init_handles(self) -> None:
        if self.error is not None:
            raise self.error
        self.loaded = True


class _Future:
    """Triton's asynchronous compile mode hands a future."""

    def __init__(self, compiled: _Compiled) -> None:
        self.compiled = compiled

    def result(self) -> _Compiled:
        return self.compiled


class _Kernel:
    __name__ = "_some_kernel"

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled
        self.calls: list[tuple[tuple, dict]] = []

    def warmup(self, *args: Any, grid: Any, **kwargs: Any) -> Any:
        self.calls.append((args, {"grid": grid, **kwargs}))
        return self.compiled


@pytest.mark.parametrize("future", [False, True], ids=["compiled", "future"])
def test_a_kernel_that_compiles_but_cannot_load_fails_at_the_compile_ahead(future):
    error = RuntimeError("out of resource: shared memory, Required: 262144, Hardware limit: 232448")
    compiled = _Compiled(error)
    kernel = _Kernel(_Future(compiled) if future else compiled)
    with pytest.raises(CompileError, match="_some_kernel: RuntimeError: out of resource: shared memory") as info:
        compile_launch(kernel, (3,), 1, 2, BLOCK=16)
    assert info.value.__cause__ is error
    assert kernel.calls == [((1, 2), {"grid": (3,), "BLOCK": 16})]


def test_a_kernel_that_loads_is_left_loaded_and_out_of_memory_is_no_compile_failure():
    compiled = _Compiled(None)
    compile_launch(_Kernel(compiled), (1,))
    assert compiled.loaded
    oom = torch.OutOfMemoryError("CUDA out of memory")
    with pytest.raises(torch.OutOfMemoryError):
        compile_launch(_Kernel(_Compiled(oom)), (1,))
    compile_launch(_Kernel(None), (1,))  # Triton's interpreter: nothing compiled, nothing to load


@triton.jit
def _square_tile(x, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    ptrs = x + offs[:, None] * BLOCK + offs[None, :]
    a = tl.load(ptrs)
    tl.store(ptrs, tl.dot(a, a))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_real_kernel_too_large_for_the_gpu_fails_at_the_compile_ahead_not_only_at_its_launch():
    """A tile whose operands need more shared memory than an SM has: Triton's warmup compiles it without a word;
    the load that its first launch makes refuses it, and so does the compile ahead."""
    x = torch.zeros(256, 256, device="cuda")
    _square_tile.warmup(x, grid=(1,), BLOCK=256)  # compiles, no error
    with pytest.raises(CompileError, match="_square_tile"):
        compile_launch(_square_tile, (1,), x, BLOCK=256)
    with pytest.raises(Exception, match="(?i)out of resource"):
        _square_tile[(1,)](x, BLOCK=256)
