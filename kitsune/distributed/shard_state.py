"""A sharded run's optimizer state in torch's layout: the helpers that cut whole-param state into a rank's pieces
and join the ranks' pieces back (`ShardSubsystem` places, loads and saves with them), and the public
`consolidated_state_dict` and `state_numel`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from kitsune.fusion import state_format


def per_element(v: Any) -> bool:
    """A state value with one entry per element of the param (moments, momentum), not a per-param scalar."""
    return torch.is_tensor(v) and v.dim() > 0


def to_cpu(st: dict[str, Any]) -> dict[str, Any]:
    return {n: v.detach().cpu() if torch.is_tensor(v) else v for n, v in st.items()}


def whole_format(st: Any) -> Any:
    """State ``st`` with its 8-bit entries decoded into torch's keys in fp32 (`kitsune.fusion.state_format.decoded`):
    the format pieces are joined and cut in, since the ranks' blocks of 256 elements do not line up with a whole
    param's. The fused units quantize again as they bind."""
    return state_format.decoded(st) if isinstance(st, dict) else st


def slice_state(st: dict[str, Any], lo: int, hi: int) -> dict[str, Any]:
    """Elements ``[lo, hi)`` of each per-element state tensor of a whole param's state, flat (copies)."""
    return {n: v.detach().reshape(-1)[lo:hi].clone() if per_element(v) else v for n, v in st.items()}


def check_sizes(st: Any, k: int, numel: int, p: torch.Tensor) -> None:
    if not isinstance(st, dict):
        raise ValueError(f"the state of param {k} must be a dict, got {type(st).__name__}. Nothing was loaded.")
    for name, v in st.items():
        key = name.removesuffix(state_format.ABSMAX)
        if name.endswith(state_format.ABSMAX) and state_format.quantized(st, key):
            try:
                state_format.check_blocks(st, key, numel)
            except ValueError as exc:
                raise ValueError(
                    f"param {k}: {exc}: this state dict is not for these params. Nothing was loaded."
                ) from None
            continue
        if per_element(v) and v.numel() != numel:
            raise ValueError(
                f"state {name!r} of param {k} has {v.numel()} elements where {numel} belong (the param's shape is "
                f"{tuple(p.shape)}): this state dict is not for these params. Nothing was loaded."
            )


def placed(v: Any, key: str, t: torch.Tensor, group: dict[str, Any]) -> Any:
    """State value ``v`` where torch's ``load_state_dict`` puts it for param ``t`` of ``group``."""
    if not torch.is_tensor(v):
        return v
    if key == "step":  # on the host unless fused or capturable, as torch keeps it
        return v.to(torch.float32, t.device) if group.get("fused") or group.get("capturable") else v
    return v.to(dtype=t.dtype, device=t.device) if t.is_floating_point() else v.to(t.device)


def join_pieces(
    parts: Iterable[dict[int, tuple[int, int, dict[str, Any]]]], params: list[torch.Tensor]
) -> dict[int, Any]:
    """Whole-param states by index from the ranks' `ShardSubsystem.pieces` (8-bit state already decoded, see
    `whole_format`): a whole entry as it is (the first, for a param every rank keeps), pieces joined in element order
    into tensors of the param's shape."""
    by_index: dict[int, list[tuple[int, int, dict[str, Any]]]] = defaultdict(list)
    for part in parts:
        for k, entry in part.items():
            by_index[k].append(entry)
    out: dict[int, Any] = {}
    for k in sorted(by_index):
        p, entries = params[k], sorted(by_index[k], key=lambda e: (e[0], e[1]))
        whole = next((st for lo, hi, st in entries if lo == 0 and hi == p.numel()), None)
        if whole is not None:
            out[k] = whole
            continue
        at, names = 0, set(entries[0][2])
        for lo, hi, st in entries:
            if lo != at or set(st) != names:
                raise RuntimeError(
                    f"param {k}'s state is held by the ranks in pieces that do not join (at element {at}: a piece "
                    f"[{lo}, {hi}) with keys {sorted(st)}): were the ranks' optimizers stepped alike?"
                )
            at = hi
        if at != p.numel():
            raise RuntimeError(f"param {k}'s state is missing elements [{at}, {p.numel()}) on every rank")
        out[k] = {
            name: torch.cat([st[name].reshape(-1) for _, _, st in entries]).view(p.shape) if per_element(v) else v
            for name, v in entries[0][2].items()
        }
    return out


def consolidated_state_dict(optimizer: Any, to: int | None = 0) -> dict[str, Any] | None:
    """The whole optimizer's state dict of a sharded run, gathered from every rank (a collective: call it on all).

    Returns torch's layout with every param's state as whole tensors of the param's shape (the ranks' pieces joined,
    moved to the CPU; state held in 8 bits decoded into torch's keys in fp32, bf16 state as it is), which the plain
    torch optimizer over the full model loads, and so does a sharded KitsuneOptimizer on any number of ranks (each
    keeps its own elements, in its own ``state_precision``).
    ``to``: the rank (of the shard's process group) that receives it, the others get None; ``to=None``: every rank.
    Without sharding it is ``optimizer.state_dict()``.
    """
    shard = next((s for s in optimizer.subsystems if s.name == "shard"), None)
    sd = optimizer.state_dict()
    if shard is None or not shard.active:
        return sd
    local = shard.pieces(sd["state"])
    parts: list[Any] | None = [None] * shard.world
    if to is None:
        dist.all_gather_object(parts, local, group=shard.group)
    else:
        if not 0 <= to < shard.world:
            raise ValueError(f"to={to} is not a rank of the shard's process group (0..{shard.world - 1})")
        dst = dist.get_global_rank(shard.group, to) if shard.group is not None else to
        parts = parts if shard.rank == to else None
        dist.gather_object(local, parts, dst=dst, group=shard.group)
        if parts is None:
            return None
    out = dict(sd)
    out["state"] = join_pieces(parts, shard.params)
    ours = dict(out["kitsune"])
    mine = {k: v for k, v in ours["subsystems"]["shard"].items() if k not in ("rank", "ranges")}
    ours["subsystems"] = {**ours["subsystems"], "shard": {**mine, "consolidated": True}}
    out["kitsune"] = ours
    return out


def state_numel(optimizer: torch.optim.Optimizer) -> int:
    """Elements of optimizer state this rank holds (tensors of more than one element: moments, momentum)."""
    return sum(v.numel() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
