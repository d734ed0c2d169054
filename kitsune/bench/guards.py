"""What every measurement of ``kitsune bench`` shares: whether the GPU has room for it, handing its memory back
after it, and the one-line reason a failed one reports."""

from __future__ import annotations

import gc

import torch

from kitsune.bench.params import ParamSet


def free_memory(device: torch.device) -> None:
    """Hand what a measurement left back: collect its objects, then return the CUDA cache to the driver."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def memory_shortfall(pset: ParamSet, device: torch.device, copies: int = 1, moving_grads: bool = False) -> str | None:
    """Why ``copies`` optimizers of this set cannot fit on the GPU now (param, grad, exp_avg, exp_avg_sq: 16 bytes
    each; with ``moving_grads``, a second set of grads while new ones are made beside the old, `fresh_grads`), else
    None."""
    if device.type != "cuda":
        return None
    need = copies * (5 if moving_grads else 4) * 4 * pset.n_elements * 1.05 + 2**29
    free, _ = torch.cuda.mem_get_info(device)
    if need > free:
        return f"needs about {need / 2**30:.1f} GiB of GPU memory, {free / 2**30:.1f} GiB free"
    return None


REASON_CHARS = 400
"""A failed row's reason at most: the exception's type and its message's first lines (an error raised inside
``torch.compile`` can carry the whole traced graph)."""


def failure_reason(exc: BaseException) -> str:
    """``Type: message``, the message's first three non-blank lines joined, cut to `REASON_CHARS`."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = " ".join([f"{type(exc).__name__}:", *lines[:3]])
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."
