"""Distributed Muon: the ranks of a replicated (DDP) model share the Newton-Schulz work by whole matrices.

After DDP's all-reduce every rank holds the same grads and, stepping the same ``kitsune.optim.Muon``, the same
momentum buffers, so every rank would orthogonalise every matrix. With ``Muon(..., process_group=group)`` the
matrices of one shape (a ``(n, rows, cols)`` batch, built as the single-process step builds it) are padded to a
multiple of the world size with zero matrices; rank r orthogonalises its contiguous ``n_padded / world`` of them,
through the same function the single-process step calls (kitsune's Triton Newton-Schulz where it runs, torch's bf16
iteration elsewhere); one ``all_gather`` per shape hands every rank every result, and each rank applies all of
them. A matrix is orthogonalised exactly as in one process, so the result equals single-process Muon.

The momentum stays replicated (each rank updates every buffer, a cheap elementwise pass) and ``state_dict()`` is
unchanged. For momentum sharded as well, use ``zero_stage=1`` or ``2`` on the KitsuneOptimizer instead: each rank
then owns whole matrices, keeps only their momentum and orthogonalises only them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)


def orthogonalize_sharded(
    updates: torch.Tensor, orthogonalize: Callable[[torch.Tensor], torch.Tensor], group: Any = None
) -> torch.Tensor:
    """``orthogonalize(updates)`` for a ``(n, rows, cols)`` batch, each rank of ``group`` computing its share.

    ``orthogonalize`` maps a ``(k, rows, cols)`` batch to its results (any dtype, the same on every rank); ``updates``
    must be equal on every rank. Returns the ``(n, rows, cols)`` results, on every rank.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = updates.shape[0]
    share = -(-n // world)  # matrices per rank, the batch padded with zero matrices to world * share
    mine = updates[rank * share : (rank + 1) * share]
    if len(mine) < share:
        pad = updates.new_zeros((share - len(mine), *updates.shape[1:]))
        mine = torch.cat([mine, pad]) if len(mine) else pad
    done = orthogonalize(mine).contiguous()
    out = done.new_empty((world * share, *done.shape[1:]))
    _all_gather(out, done, group=group)
    return out[:n]
