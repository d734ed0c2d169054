"""``kitsune.clip_grad_norm_``: torch.nn.utils.clip_grad_norm_ in two launches, with no host sync.

Launch 1 is `MultiTensorNorm` (every grad's norm and the global norm, deterministic);
launch 2 multiplies every grad by ``min(max_norm / (total + 1e-6), 1)``, reading the global norm on the device.
One launch for both would need every program to wait for the global norm, a grid-wide barrier: it deadlocks when
the grid has more programs than the GPU runs at once, and cannot run in Triton's CPU interpreter, which runs
programs one after the other. (torch runs a foreach norm and a foreach multiply per (device, dtype) group, with
small kernels in between that stack the norms, reduce them and compute the coefficient.)

Anything the kernels do not cover goes to torch.nn.utils.clip_grad_norm_ unchanged (logged once per reason).
"""

from __future__ import annotations

import logging
import math
import os
import types
import warnings
from collections import OrderedDict
from collections.abc import Iterable
from functools import cache, reduce
from operator import attrgetter
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kitsune.kernels.norms import MultiTensorNorm

logger = logging.getLogger("kitsune.clip")

_DEVICE = attrgetter("device")
_DTYPE = attrgetter("dtype")
_LAYOUT = attrgetter("layout")
_REQUIRES_GRAD = attrgetter("requires_grad")
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_NUMEL = torch.Tensor.numel

CACHE_SIZE = 8
"""Tables kept for this many distinct (device, norm_type, grad sizes and dtypes) combinations."""
_cache: OrderedDict[tuple, MultiTensorNorm] = OrderedDict()
_logged: set[str] = set()
_refused: OrderedDict[tuple, str] = OrderedDict()
"""Combinations (cache keys) whose kernels failed to compile on their device: torch's function clips them."""


@cache
def _norms_module() -> types.ModuleType | None:  # imported on first use: `import kitsune` does not need Triton
    try:
        from kitsune.kernels import norms
    except ImportError:
        return None
    return norms


def _route(grads: list[torch.Tensor], norm_type: float) -> tuple[tuple | None, str]:
    """``(cache key, "")`` when the kernels handle these grads, else ``(None, why not)``."""
    norms = _norms_module()
    if norms is None:
        return None, "Triton is not installed"
    if not grads:
        return None, ""
    if norm_type not in (2.0, math.inf):
        return None, f"norm_type {norm_type}: the kernels compute the 2-norm and the inf-norm"
    if set(map(type, grads)) != {torch.Tensor} or set(map(_LAYOUT, grads)) != {torch.strided}:
        return None, "tensor subclass or sparse grads"
    devices = set(map(_DEVICE, grads))
    if len(devices) > 1:
        return None, "grads on several devices"
    (device,) = devices
    if device.type == "cpu":
        if not (norms.INTERPRETED and os.environ.get("TRITON_INTERPRET") == "1"):
            return None, "CPU grads: the kernels need CUDA"
    elif device.type != "cuda":
        return None, f"{device.type} grads: the kernels need CUDA"
    dtypes = tuple(map(_DTYPE, grads))
    if not set(norms.SUPPORTED_DTYPES) >= set(dtypes):
        return None, f"{sorted(map(str, set(dtypes) - set(norms.SUPPORTED_DTYPES)))} grads"
    if any(map(_REQUIRES_GRAD, grads)):
        return None, "grads that require grad (create_graph=True): torch keeps the autograd record"
    if not all(map(_IS_CONTIGUOUS, grads)) and not all(map(norms.is_dense, grads)):
        return None, "grads with gaps or overlaps in memory"
    numels = tuple(map(_NUMEL, grads))
    if norm_type == math.inf and 0 in numels:
        return None, "the inf-norm of an empty grad (torch raises)"
    return (device, norm_type, numels, dtypes), ""


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the gradient norm of ``parameters`` in place; a drop-in for torch.nn.utils.clip_grad_norm_.

    Same arguments, return value (the total norm of the grads viewed as one vector, a tensor on their device, in
    their promoted dtype) and errors. Grads that are None are skipped. On one CUDA device (or on CPU under
    ``TRITON_INTERPRET=1``), with dense fp32/bf16/fp16 grads and ``norm_type`` 2 or inf, it runs two Triton
    launches and does not wait for the GPU (except with ``error_if_nonfinite=True``, which must read the norm, as
    torch does); otherwise it calls torch's function, which also gets ``foreach``.

    For fp32 grads the coefficient is torch's, computed in the same fp32 steps; the norm itself may differ from
    torch's in the last bits (another summation order), and is bitwise reproducible. For bf16/fp16 grads torch
    rounds every per-tensor norm and the coefficient to the grads' dtype; here the norm and the coefficient stay
    fp32 and each grad value is rounded once, so the result is closer to exact; the returned norm is rounded to
    the grads' dtype as torch's is. ``error_if_nonfinite`` looks at the fp32 norm: fp16 grads whose norm exceeds
    65504 (inf in torch's fp16 arithmetic) are clipped, not refused.

    Inside a function that ``torch.compile`` traces it is torch's function, which the compiler traces with the rest.
    """
    if torch.compiler.is_compiling():  # traced by torch.compile: torch's function, which it traces and fuses
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    else:
        is_generator = isinstance(parameters, types.GeneratorType)
        parameters = list(parameters)
        if is_generator and not parameters:
            warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=3)
    grads = [p.grad for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    key, reason = _route(grads, norm_type)
    if _refused and key is not None and key in _refused:  # (a key of many sizes costs its hash: asked only then)
        key, reason = None, _refused[key]
    if key is None:
        if reason and reason not in _logged:
            _logged.add(reason)
            logger.info("kitsune clip_grad_norm_: torch's implementation: %s", reason)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, foreach)

    norm = _cache.get(key)
    if norm is None:
        norm = _norms_module().MultiTensorNorm(key[2], key[0], norm_type)
        _cache[key] = norm
        if len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    else:
        _cache.move_to_end(key)
    from kitsune.kernels.common import CompileError  # (Triton is importable: the norms module is)

    norm.bind(grads, checked=True)
    out_dtype = reduce(torch.promote_types, set(key[3]))
    try:
        norm.compile_clip(out_dtype)  # before any grad changes
    except CompileError as exc:
        _refused[key] = why = f"its kernels failed to compile on {key[0]} ({exc})"
        if len(_refused) > CACHE_SIZE:
            _refused.popitem(last=False)
        logger.warning("kitsune clip_grad_norm_: torch's implementation: %s", why)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    total = norm.launch().total
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from "
            "`parameters` is non-finite, so it cannot be clipped. To disable "
            "this error and scale the gradients by the non-finite norm anyway, "
            "set `error_if_nonfinite=False`"
        )
    out = torch.empty((), dtype=out_dtype, device=key[0])
    norm.clip_(max_norm, out)
    torch.autograd.graph.increment_version(grads)  # written in place, as torch's mul_ marks them
    return out
