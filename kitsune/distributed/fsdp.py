"""FSDP2 (``fully_shard``) support: the fused kernels update DTensor params through their local shards.

An FSDP2 param is a DTensor sharded on dim 0 over a 1-D device mesh; its grad (after FSDP2's reduce-scatter) and
the optimizer state torch creates for it (``zeros_like(p)``) are DTensors with the same placements. The update is
elementwise, so each rank runs the fused kernel over the memory of its own shards (``p._local_tensor``) and the
state stays DTensors, as torch's optimizers keep it. The only values of a step that need every rank are the global
grad norm (clipping) and AMP's inf/nan flag: `all_reduce_norm_` and `all_reduce_found_inf_` reduce them
over the mesh with on-device collectives, so no rank reads a value back to the host.

Low-precision state (``FusionConfig.state_precision``) stays per shard too: bf16 or fp32 state as DTensors sharded as
the param, 8-bit state as codes DTensors (`wrap_local`) with plain per-rank scales over the local shard's blocks
(`kitsune.fusion.state_format`), decoded into fp32 DTensors in the state dict.

Anything else (a Replicate or Partial placement, a 2-D mesh for HSDP or tensor parallelism, DTensors on a second
mesh) is left to the wrapped optimizer's own step, with the reason from `shard_reason` in the plan.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from operator import attrgetter
from typing import Any

import torch

LOCAL = attrgetter("_local_tensor")
"""A DTensor's local shard (a plain tensor): what the kernels address."""


@cache
def _dtensor_type() -> type | None:  # imported on first use: `import kitsune` does not need torch.distributed
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (an FSDP2 param, its grad or its optimizer state)."""
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def local(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local shard when it is a DTensor, else ``t`` itself."""
    return t._local_tensor if is_dtensor(t) else t


def even_share(t: torch.Tensor) -> int:
    """The elements of ``t`` one rank holds on an even split: a DTensor's over its mesh (every rank computes the same
    number, whatever its own shard holds: uneven shards, an empty one), a plain tensor's all. What a decision every
    rank must make alike (the planner's route) is made on."""
    if not is_dtensor(t):
        return t.numel()
    return -(-t.numel() // t.device_mesh.size())


def shard_reason(p: torch.Tensor) -> str | None:
    """None when the fused kernel can update DTensor ``p`` through its local shard; else why it cannot."""
    from torch.distributed.tensor import Shard

    mesh = p.device_mesh
    if mesh.ndim != 1:
        return (
            f"DTensor on a {mesh.ndim}-D device mesh (HSDP or FSDP with tensor parallelism): the fused kernel takes "
            "FSDP2 shards on a 1-D mesh, so the wrapped optimizer's own step updates it"
        )
    if not all(isinstance(pl, Shard) for pl in p.placements):
        return (
            f"DTensor with placements {tuple(p.placements)}: the fused kernel takes sharded (Shard) FSDP2 params, "
            "so the wrapped optimizer's own step updates it"
        )
    if not local(p).is_contiguous():
        return "DTensor whose local shard is not contiguous: the fused kernel addresses flat memory"
    return None


def mesh_groups(params: Iterable[torch.Tensor]) -> list[Any]:
    """The process groups that together span every device mesh of the DTensors in ``params`` (one per mesh
    dimension, meshes in order of first appearance): all-reducing over each in turn reduces over every rank that
    holds a shard. Empty when no param is a DTensor."""
    meshes: list[Any] = []
    for p in params:
        if is_dtensor(p) and p.device_mesh not in meshes:
            meshes.append(p.device_mesh)
    return [mesh.get_group(dim) for mesh in meshes for dim in range(mesh.ndim)]


def all_reduce_norm_(total: torch.Tensor, found_inf: torch.Tensor | None, norm_type: float, groups: list[Any]) -> None:
    """Make a rank's grad norm and inf/nan flag (both computed over its local shards) global, in place and on the
    device: the sum of the squared 2-norms (the max for the inf-norm) and the max of the flags over ``groups``, in
    one all-reduce per group. DTensor's own Partial norm reduction (what torch's ``clip_grad_norm_`` runs on FSDP2
    grads) takes the same powers of the local norms."""
    import torch.distributed as dist

    inf_norm = norm_type == float("inf")
    # float64: the squares of fp32 norms are summed without a second rounding. Four small kernels around the
    # all-reduce (six with AMP's flag): inside a captured step each costs a launch slot
    buf = torch.zeros(2, dtype=torch.float64, device=total.device)
    value = buf[0]
    value.copy_(total)
    if not inf_norm:
        value.square_()
    if found_inf is not None:
        buf[1].copy_(found_inf.reshape(()))
    op = dist.ReduceOp.MAX if inf_norm else dist.ReduceOp.SUM
    for group in groups:
        dist.all_reduce(buf, op=op, group=group)
    if inf_norm:
        total.copy_(value)
    else:
        torch.sqrt(value, out=total)  # float64 -> the fp32 norm
    if found_inf is not None:
        found_inf.copy_(buf[1]).clamp_(max=1.0)  # a sum of 0/1 flags; found_inf stays 0 or 1


def all_reduce_found_inf_(found_inf: torch.Tensor, groups: list[Any]) -> None:
    """Max of AMP's inf/nan flag over ``groups``, in place on the device, so every rank skips the same steps."""
    import torch.distributed as dist

    for group in groups:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)


def wrap_local(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Local tensor ``t`` (of ``like``'s local shard's shape) as a DTensor with DTensor ``like``'s mesh, placements,
    global shape and stride, without communication: 8-bit codes of a shard, or its decoded values."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        t, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def like_param(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """State tensor ``t`` as a DTensor with DTensor param ``p``'s mesh and placements (a loaded checkpoint may hold
    a full plain tensor, or another sharding): a plain tensor is assumed equal on every rank, and each rank keeps
    its own shard of it without communication; another DTensor is redistributed (a collective on every rank)."""
    from torch.distributed.tensor import distribute_tensor

    if not is_dtensor(t):
        return distribute_tensor(t.to(local(p).device), p.device_mesh, p.placements, src_data_rank=None)
    if t.device_mesh != p.device_mesh or t.placements != p.placements:
        return t.redistribute(p.device_mesh, p.placements)
    return t
