"""Low-precision optimizer state: which format a bucket's state takes, how ``optimizer.state`` holds it, and the
conversions between the formats (``FusionConfig.state_precision``).

Formats (`StateFormat`): the param's dtype (torch's layout, the default), fp32, bf16, or 8 bits. Float formats keep
torch's keys and shapes, only the dtype differs, so a plain torch optimizer loads them (its ``load_state_dict`` casts
floating-point state to the param's dtype). 8-bit state replaces each state tensor ``key`` by two:

* ``f"{key}_codes"``: uint8, the param's shape: indices into the sorted 256-entry code table
  (`kitsune.kernels.quant.dynamic_map`: signed for state of either sign, ``exp_avg`` and momentum buffers; unsigned
  for non-negative state, ``exp_avg_sq`` and the other second moments, see `SIGNED`);
* ``f"{key}_absmax"``: fp32, ``ceil(numel / 256)`` elements: each block of 256 consecutive elements (row-major)
  decodes as ``table[code] * absmax``.

torch's key is absent, so a plain torch optimizer handed an 8-bit state dict stops with ``KeyError: 'exp_avg'`` at
its first step instead of reading codes as values (but torch.optim.SGD, which starts a missing ``momentum_buffer``
afresh); `convert_state_dict` turns one into the other. The quantizer here
is plain torch (CPU or GPU, no Triton) and gives the bits the fused kernels give.

FSDP2 params (DTensors sharded on dim 0, `kitsune.distributed.fsdp`): each rank quantizes its local shard. The codes
are a uint8 DTensor with the param's mesh and placements (its local tensor the codes of the local shard); the absmax
covers the blocks of 256 consecutive elements of the local shard, a plain tensor of ``ceil(local numel / 256)``
elements, as a shard's block scales are no DTensor of any global shape. A checkpoint holds that state decoded
(`for_checkpoint`): fp32 DTensors under torch's keys, as torch's own optimizers keep FSDP2 state.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Collection, Mapping
from typing import Any

import torch

from kitsune import _native
from kitsune.distributed import fsdp
from kitsune.kernels import codes as _tables
from kitsune.kernels.codes import CODE_SIZE, CODES_ALIGN, MIN_SCALE, QUANT_BLOCK
from kitsune.kernels.spec import StateFormat, UpdateSpec
from kitsune.optim.base import widens

PRECISIONS: dict[str, StateFormat] = {
    "param": StateFormat.PARAM,
    "fp32": StateFormat.FP32,
    "bf16": StateFormat.BF16,
    "8bit": StateFormat.Q8,
}
"""``FusionConfig.state_precision``'s values and the format each asks for."""

NAMES = {fmt: name for name, fmt in PRECISIONS.items()}

SIGNED: dict[str, bool] = {
    "exp_avg": True,
    "momentum_buffer": True,
    "grad_avg": True,
    "exp_avg_sq": False,
    "max_exp_avg_sq": False,
    "exp_inf": False,
    "square_avg": False,
    "sum": False,
    "acc_delta": False,
}
"""The state keys 8-bit state covers, and whether each takes the signed code table (False: the key's values are never
negative, so the unsigned table's extra fraction bit applies)."""

CODES, ABSMAX = "_codes", "_absmax"

_FLOAT = {StateFormat.FP32: torch.float32, StateFormat.BF16: torch.bfloat16}


def signed_mask(keys: tuple[str | None, ...]) -> int:
    """`UpdateSpec.signed` for a kernel's state slots: bit ``i`` set when slot ``i + 1`` holds a signed key."""
    return sum(1 << i for i, key in enumerate(keys) if key and SIGNED.get(key, True))


def dtype_of(fmt: StateFormat, param_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a float format's state tensors (8-bit state: the codes' uint8)."""
    return torch.uint8 if fmt == StateFormat.Q8 else _FLOAT.get(fmt, param_dtype)


def describe(fmt: StateFormat, param_dtype: torch.dtype) -> str:
    """A format as the plan shows it: ``"8-bit"`` or the state's dtype (``"bfloat16"``)."""
    return "8-bit" if fmt == StateFormat.Q8 else str(dtype_of(fmt, param_dtype)).removeprefix("torch.")


def bytes_per_element(fmt: StateFormat, param_dtype: torch.dtype) -> float:
    """Bytes one element of one state tensor takes (8-bit state: its code and its share of the absmax)."""
    if fmt == StateFormat.Q8:
        return 1 + 4 / QUANT_BLOCK
    return dtype_of(fmt, param_dtype).itemsize


def update_bytes(spec: UpdateSpec, tensor_reads_writes: int, param_dtype: torch.dtype) -> float:
    """Bytes a step moves per element: ``tensor_reads_writes`` (`AlgoInfo.bytes_per_element`: reads and writes in
    units of the param's size) with each state slot's read and write at the state format's size instead, and the
    Kahan compensation's read and write (the param's size) with ``spec.kahan``."""
    slots = 2 * spec.state_slots
    comp = 2 * param_dtype.itemsize if spec.kahan else 0
    return (
        (tensor_reads_writes - slots) * param_dtype.itemsize + slots * bytes_per_element(spec.state, param_dtype) + comp
    )


def quantize(x: torch.Tensor, signed: bool, exact_extremes: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, absmax)`` of ``x`` as the fused kernels store it (see `kitsune.kernels.quant`): per block of
    `QUANT_BLOCK` elements the absmax (at least `MIN_SCALE` unless the block is all zero), then the nearest code of
    ``x * (1 / absmax)`` (a tie to the smaller magnitude); a block holding inf or nan gets absmax nan and the zero
    code.

    ``exact_extremes`` (what converting float state into 8 bits uses, not the kernels): the signed table's smallest
    value is -0.99297 (bitsandbytes' map), so a block whose largest magnitude is negative decodes that element 0.7%
    short, and quantizing the decoded values again would shrink the block's scale and move its codes. With it, each
    block's scale is the smallest that holds both extremes (``max(largest value, -smallest value / 0.99297)``), so
    decoded 8-bit state (a consolidated ZeRO checkpoint, a round trip through torch's fp32 layout) encodes back to
    the same codes and scales, to a rounding."""
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    rows = max(math.ceil(n / QUANT_BLOCK), 0)
    blocks = torch.nn.functional.pad(flat, (0, rows * QUANT_BLOCK - n)).view(rows, QUANT_BLOCK)
    ax = blocks.abs()
    finite = ax < math.inf
    table = _tables.code(signed, x.device)
    if not rows:
        absmax = torch.zeros(0, dtype=torch.float32, device=x.device)
    elif exact_extremes and signed:
        kept = torch.where(finite, blocks, 0.0)
        absmax = torch.maximum(kept.amax(1), -kept.amin(1) / -table[0])
    else:
        absmax = torch.where(finite, ax, 0.0).amax(1)
    bad = ~finite.all(1)
    absmax = torch.where(absmax > 0, absmax.clamp(min=MIN_SCALE), 0.0)
    v = blocks * (1.0 / torch.where(absmax > 0, absmax, 1.0))[:, None]  # IEEE fp32, as the kernels
    v = torch.where(bad[:, None], 0.0, v)
    idx = (torch.searchsorted(table, v.contiguous(), right=True) - 1).clamp_(0, CODE_SIZE - 1)
    lo, hi = table[idx].double(), table[(idx + 1).clamp_(max=CODE_SIZE - 1)].double()
    twice, mid2 = 2 * v.double(), lo + hi
    up = ((twice > mid2) | ((twice == mid2) & (v < 0))) & (idx < CODE_SIZE - 1)
    codes = (idx + up.long()).to(torch.uint8).view(-1)[:n].view(x.shape)
    return codes, torch.where(bad, math.nan, absmax)


def dequantize(
    codes: torch.Tensor, absmax: torch.Tensor, signed: bool, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The values `quantize` encoded, in ``dtype`` (computed in fp32, as the kernels do). FSDP2 codes (a DTensor):
    each rank decodes its shard with its own blocks (``absmax``, local) into a DTensor sharded as the codes."""
    if fsdp.is_dtensor(codes):
        shard = fsdp.local(codes)
        return fsdp.wrap_local(dequantize(shard, absmax.to(shard.device), signed, dtype), codes)
    table = _tables.code(signed, codes.device)
    n = codes.numel()
    scale = absmax.float().repeat_interleave(QUANT_BLOCK)[:n]
    return (table[codes.reshape(-1).long()] * scale).view(codes.shape).to(dtype)


def quantized(s: Mapping[str, Any], key: str) -> bool:
    """Whether the state ``s`` holds ``key`` in 8 bits."""
    return key + CODES in s and key + ABSMAX in s


def quantized_keys(s: Mapping[Any, Any]) -> list[str]:
    """The keys ``s`` holds in 8 bits (both their codes and their absmax entries), in ``s``'s order."""
    return [
        k.removesuffix(CODES) for k in s if isinstance(k, str) and k.endswith(CODES) and quantized(s, k[: -len(CODES)])
    ]


def decoded(s: dict[str, Any]) -> dict[str, Any]:
    """``s`` with its 8-bit entries decoded into torch's keys in fp32 (a copy where there are any; ``s`` itself
    otherwise; FSDP2 state into DTensors sharded as the codes). A float tensor set next to the codes wins, as in
    `conform`."""
    keys = quantized_keys(s)
    if not keys:
        return s
    out = dict(s)
    for key in keys:
        codes, absmax = out.pop(key + CODES), out.pop(key + ABSMAX)
        if out.get(key) is None:
            out[key] = dequantize(codes, absmax, SIGNED.get(key, True))
    return out


def for_checkpoint(state: dict[Any, Any]) -> dict[Any, Any]:
    """A state dict's ``"state"`` as ``KitsuneOptimizer.state_dict`` returns it: the 8-bit state of FSDP2 params
    decoded (`decoded`) into torch's keys as fp32 DTensors sharded as their params, the layout torch's own optimizers
    give FSDP2 state. A rank's block scales cover its own shard, so they are no DTensor of any global shape, and
    torch.distributed.checkpoint would save a plain tensor as one every rank holds alike. Other 8-bit state stays
    codes and scales; ``state`` itself is not modified."""
    out = dict(state)
    for pid, s in state.items():
        if isinstance(s, dict) and any(fsdp.is_dtensor(s[key + CODES]) for key in quantized_keys(s)):
            out[pid] = decoded(s)
    return out


def present(s: Mapping[str, Any], key: str) -> bool:
    """Whether ``s`` holds ``key`` in any format."""
    return s.get(key) is not None or quantized(s, key)


def conform(s: dict[str, Any], key: str, p: torch.Tensor, fmt: StateFormat) -> list[torch.Tensor]:
    """Bring state ``key`` of param ``p`` into format ``fmt`` in place (a loaded checkpoint of another precision is
    converted, never reinterpreted) and return the tensors the kernel addresses: ``[tensor]`` for a float format,
    ``[codes, absmax]`` for 8 bits. Where ``s`` holds ``key`` both as a float tensor and in 8 bits (a tensor set by
    hand over 8-bit state), the float tensor wins in every format and the codes are dropped. Raises ``ValueError``
    for a tensor of another shape than its param.

    FSDP2 params (DTensors): float state becomes a DTensor sharded as the param (`kitsune.distributed.fsdp.like_param`:
    a whole plain tensor, one process's checkpoint, is cut without communication), and 8 bits quantize each rank's
    shard (codes a DTensor, absmax the local shard's blocks; see the module docstring). 8-bit state of whole tensors
    (one process's checkpoint) is decoded and cut first, as the shards' blocks are not the whole param's."""
    sharded = fsdp.is_dtensor(p)
    device = fsdp.local(p).device
    signed = SIGNED.get(key, True)
    if fmt == StateFormat.Q8:
        if sharded and s.get(key) is None and quantized(s, key) and not fsdp.is_dtensor(s[key + CODES]):
            check_codes(s, key, p)
            codes, absmax = s.pop(key + CODES), s.pop(key + ABSMAX)
            s[key] = dequantize(codes.to(device), absmax.to(device), signed)
        if s.get(key) is not None:  # float state (a torch checkpoint, or a tensor set by hand): quantize it
            t = s.pop(key)
            _check_shape(key, t, p)
            if sharded:
                t = fsdp.like_param(t, p)
            codes, s[key + ABSMAX] = quantize(fsdp.local(t).to(device), signed, exact_extremes=True)
            s[key + CODES] = fsdp.wrap_local(codes, p) if sharded else codes
        check_codes(s, key, p)
        codes, absmax = s[key + CODES], s[key + ABSMAX]
        shard = fsdp.local(codes)
        if shard.dtype != torch.uint8 or shard.device != device or not shard.is_contiguous():
            # torch's load_state_dict casts every state tensor of a float param to the param's dtype: codes are
            # integers from 0 to 255, exact in every float dtype, so the cast back loses nothing
            shard = shard.to(device=device, dtype=torch.uint8).contiguous()
        if shard.data_ptr() % CODES_ALIGN:  # a view at an odd offset: the kernel reads the codes in words or vectors
            shard = shard.clone()
        if shard is not fsdp.local(codes):
            codes = s[key + CODES] = fsdp.wrap_local(shard, p) if sharded else shard
        if absmax.dtype != torch.float32 or absmax.device != device or not absmax.is_contiguous():
            absmax = s[key + ABSMAX] = absmax.to(device=device, dtype=torch.float32).contiguous()
        return [codes, absmax]
    dtype = dtype_of(fmt, p.dtype)
    if quantized(s, key):  # an 8-bit checkpoint loaded with float state: decode it
        codes, absmax = s.pop(key + CODES), s.pop(key + ABSMAX)
        if s.get(key) is None:  # a float tensor set by hand next to the codes wins, as in 8 bits above
            s[key] = dequantize(codes.to(device), absmax.to(device), signed, dtype).view(p.shape)
    t = s[key]
    _check_shape(key, t, p)
    if sharded:  # FSDP2: a DTensor sharded as its param, as torch keeps the state
        t = s[key] = fsdp.like_param(t, p)
    s[key] = t = dense(t, p, device, dtype)
    return [t]


def dense(t: torch.Tensor, p: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """State tensor ``t`` (``p``'s shape) as the kernels address it: ``dtype`` on ``device``, its elements in the
    order ``p``'s lie in (`kitsune._native.layout_code`: row-major, or channels_last as a channels_last conv weight's;
    a shard contiguous); ``t`` itself where it is already. A copy is made with ``.contiguous()``:
    ``t.to(memory_format=...)`` returns a dense tensor of another order (a transposed one) as it is."""
    if t.dtype != dtype or fsdp.local(t).device != device:
        t = t.to(device=device, dtype=dtype)
    shard = fsdp.local(t)
    if fsdp.is_dtensor(t):
        if not shard.is_contiguous():
            t = fsdp.wrap_local(shard.contiguous(), p)
        return t
    code = _native.layout_code(p)
    code = 0 if code == _native.NOT_DENSE else code
    if not _native.lies_in(t, code):
        t = t.contiguous(memory_format=_native.MEMORY_FORMATS[code])
    return t


def check_codes(s: Mapping[str, Any], key: str, p: torch.Tensor) -> None:
    """Raise ``ValueError`` unless 8-bit state ``key`` fits param ``p``: codes of its shape, FSDP2 codes (a DTensor)
    sharded as the param, and one absmax per `QUANT_BLOCK` of the elements the codes hold (those of the local shard
    for a DTensor)."""
    codes = s[key + CODES]
    if not isinstance(codes, torch.Tensor) or fsdp.local(codes).layout != torch.strided:
        what = f"a {codes.layout} tensor" if isinstance(codes, torch.Tensor) else f"a {type(codes).__name__}"
        raise ValueError(f"optimizer state {key + CODES!r} is {what}: 8-bit codes are a dense tensor of the param's")
    _check_shape(key + CODES, codes, p)
    if fsdp.is_dtensor(codes):
        if not fsdp.is_dtensor(p) or (codes.device_mesh, codes.placements) != (p.device_mesh, p.placements):
            where = f"{tuple(p.placements)} on {p.device_mesh}" if fsdp.is_dtensor(p) else "a plain tensor"
            raise ValueError(
                f"optimizer state {key + CODES!r} is a DTensor with placements {tuple(codes.placements)} on "
                f"{codes.device_mesh}, its param {where}: a shard's 8-bit blocks decode on their own rank only "
                "(state_dict() holds them decoded)"
            )
    shard = fsdp.local(codes)
    if shard.dtype != torch.uint8 and shard.numel():  # a cast copy (torch's load casts float params' state): exact?
        bad = shard.is_complex() or shard.dtype == torch.bool
        if not bad:
            lo, hi = shard.min().item(), shard.max().item()
            bad = lo < 0 or hi >= CODE_SIZE or (shard.is_floating_point() and not torch.equal(shard, shard.round()))
        if bad:
            raise ValueError(
                f"optimizer state {key + CODES!r} ({str(shard.dtype).removeprefix('torch.')}) holds values that are "
                f"no 8-bit codes (integers 0 to {CODE_SIZE - 1}): codes are never reinterpreted"
            )
    check_blocks(s, key, shard.numel())


def check_loaded(state: Mapping[Any, Any]) -> None:
    """Raise ``ValueError`` unless every param's 8-bit state in ``state`` decodes (`check_codes`): run on a loaded
    state before anything binds, decodes or converts it, for every param alike (the fused units' and those the
    wrapped optimizer's own step updates, which decode it into torch's keys). Changes nothing."""
    for p, s in state.items():
        if not isinstance(p, torch.Tensor) or not isinstance(s, Mapping):
            continue
        try:
            check_pairs(s)
            for key in quantized_keys(s):
                check_codes(s, key, p)
                check_scales(s, key)
        except ValueError as exc:
            raise ValueError(f"{exc}. Nothing was loaded: the optimizer keeps its state") from None


def check_pairs(s: Mapping[Any, Any]) -> None:
    """Raise ``ValueError`` where ``s`` holds one half of 8-bit state (codes without their block scales, or scales
    without codes) of a key 8-bit state covers (`SIGNED`): it decodes to nothing, and a step would miss the key."""
    for name in s:
        if not isinstance(name, str):
            continue
        for mine, other in ((CODES, ABSMAX), (ABSMAX, CODES)):
            key = name.removesuffix(mine)
            # only the keys 8-bit state covers: another optimizer's own "..._codes" entry is its business
            if name.endswith(mine) and key in SIGNED and key + other not in s:
                raise ValueError(
                    f"optimizer state {name!r} without {key + other!r}: 8-bit state is a pair of codes and block "
                    f"scales; restore both, or drop both (and give {key!r} as a float tensor, or no {key!r} to start "
                    "it afresh)"
                )


def check_scales(s: Mapping[str, Any], key: str) -> None:
    """Raise ``ValueError`` where 8-bit state ``key`` has a block scale below zero or infinite: the kernels write
    none (each is a block's largest magnitude, or nan for a block that held inf or nan), and a step would decode
    them into non-finite state. Reads the scales on the host: a load's check, not a step's."""
    absmax = s[key + ABSMAX]
    local = fsdp.local(absmax)
    if local.numel() and bool(((local < 0) | (local == math.inf)).any()):
        raise ValueError(
            f"optimizer state {key + ABSMAX!r} holds a negative or infinite block scale: each is a block's largest "
            "magnitude (nan where the block held inf or nan); the checkpoint was changed after it was saved"
        )


def check_blocks(s: Mapping[str, Any], key: str, numel: int) -> None:
    """Raise ``ValueError`` unless 8-bit state ``key`` has one absmax per `QUANT_BLOCK` of the ``numel`` elements it
    holds (a param's, or a ZeRO piece's)."""
    absmax, blocks = s[key + ABSMAX], math.ceil(numel / QUANT_BLOCK)
    if not isinstance(absmax, torch.Tensor) or absmax.numel() != blocks:
        got = absmax.numel() if isinstance(absmax, torch.Tensor) else type(absmax).__name__
        raise ValueError(
            f"optimizer state {key + ABSMAX!r} has {got} elements where its {numel} elements need {blocks} "
            f"(one per {QUANT_BLOCK})"
        )
    if absmax.dim() != 1 or not absmax.is_floating_point():
        raise ValueError(
            f"optimizer state {key + ABSMAX!r} is a {str(absmax.dtype).removeprefix('torch.')} tensor of shape "
            f"{tuple(absmax.shape)}: the block scales are one-dimensional floats ({blocks} of them)"
        )


def _check_shape(key: str, t: torch.Tensor, p: torch.Tensor) -> None:
    if t.shape != p.shape:
        raise ValueError(f"optimizer state {key!r} has shape {tuple(t.shape)}, its param {tuple(p.shape)}")


def convert_state_dict(
    state_dict: Mapping[str, Any], precision: str = "fp32", *, min_8bit_size: int = 4096
) -> dict[str, Any]:
    """A copy of an optimizer state dict with its state in ``precision``, so a run moves between plain torch and
    kitsune's low-precision state at any checkpoint.

    ``"fp32"`` (or ``"bf16"``) decodes 8-bit state into torch's keys (``exp_avg``, ...) and casts float state: the
    result loads into the plain torch optimizer. ``"8bit"`` quantizes every state tensor of a key that 8-bit state
    covers (`SIGNED`) with at least ``min_8bit_size`` elements, as ``FusionConfig(state_precision="8bit")`` keeps
    it; the rest stays as it is. ``"param"`` keeps float state as it is and decodes 8-bit state to fp32 (a plain
    torch optimizer casts it to its params' dtype when it loads). Step counts and other entries are copied
    unchanged. The result shares no tensor with the input, which is not modified. A KitsuneOptimizer loads any
    of these and converts to its own ``state_precision`` as it binds the state, so this function is for the
    plain-torch side of a move.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))}, got {precision!r}")
    if not isinstance(state_dict, Mapping) or "state" not in state_dict:
        raise TypeError("convert_state_dict takes an optimizer state dict (a mapping with a 'state' entry)")
    fmt = PRECISIONS[precision]
    out = {k: copy.deepcopy(v) for k, v in state_dict.items() if k != "state"}  # param_groups (tensor lrs) too
    out["state"] = {pid: _convert(dict(s), fmt, min_8bit_size) for pid, s in state_dict["state"].items()}
    return out


def _convert(s: dict[str, Any], fmt: StateFormat, min_8bit_size: int) -> dict[str, Any]:
    check_pairs(s)
    for key in quantized_keys(s):
        codes, absmax = s.pop(key + CODES), s.pop(key + ABSMAX)
        dtype = torch.bfloat16 if fmt == StateFormat.BF16 else torch.float32
        s[key] = dequantize(codes, absmax, SIGNED.get(key, True), dtype)
    for key, t in list(s.items()):
        if not isinstance(t, torch.Tensor):
            continue
        if key not in SIGNED or not t.is_floating_point():
            s[key] = t.clone()  # the copy shares no tensor with the input: a step on one leaves the other alone
        elif fmt == StateFormat.Q8 and t.numel() >= min_8bit_size:
            del s[key]
            s[key + CODES], s[key + ABSMAX] = quantize(t, SIGNED[key], exact_extremes=True)
        elif fmt in _FLOAT and t.dtype != _FLOAT[fmt]:
            s[key] = t.to(_FLOAT[fmt])
        else:
            s[key] = t.clone()
    return s


def decode_others(
    state: Mapping[Any, dict[str, Any]],
    keep: set[torch.Tensor],
    own_step: Collection[torch.Tensor] = (),
    cast: bool = True,
) -> bool:
    """Decode the 8-bit state of every param not in ``keep`` (the params low-precision units update) into torch's
    keys, in the param's dtype, and cast its float state of another dtype (kept through a load by `restore_low`) to
    the param's: the step that updates those params (torch's, or a fused unit in the param's format) reads that. A
    checkpoint saved with any ``state_precision`` so loads into any optimizer that holds the params, and a param
    whose dtype changed after its state was made (``model.double()``) has its state converted, as the fused units
    convert theirs. The params in ``own_step`` (the wrapped optimizer's own step updates them) keep float state
    wider than their dtype as it is (``model.half()`` after SGD's momentum was made in float32): that step keeps it
    so, and rounding it would change its results. ``cast=False`` (fusion off: the optimizer's own step updates
    every param) decodes 8-bit state alone. Returns whether anything changed (the routes were chosen on the state as
    it was)."""
    changed = False
    for p, s in state.items():
        if p in keep or not isinstance(p, torch.Tensor) or not isinstance(s, dict):
            continue
        for key in quantized_keys(s):
            changed |= s.get(key) is None  # (a float tensor set next to the codes wins: nothing to decode)
            decode(s, key, p)
        for key in SIGNED if cast else ():
            t = s.get(key)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and p.is_floating_point() and t.dtype != p.dtype:
                if p in own_step and not widens(t.dtype, p.dtype):
                    continue
                s[key] = t.to(p.dtype)
                changed = True
    return changed


def decode(s: dict[str, Any], key: str, p: torch.Tensor) -> None:
    """State ``key`` in torch's layout (the param's dtype) where it is held in 8 bits (a checkpoint of an 8-bit run
    loaded where the params' own format runs); nothing otherwise."""
    if s.get(key) is None and quantized(s, key):
        conform(s, key, p, StateFormat.PARAM)


def split_low(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[Any, dict[str, torch.Tensor]]]:
    """``(state_dict without its 8-bit entries, those entries and the float moments by param id)``: torch's
    ``load_state_dict`` casts every tensor of a float param's state to the param's dtype, which would round an absmax
    or an fp32 moment of a bf16 param (``state_precision="fp32"``) to bf16; `restore_low` puts them back as saved.
    The float moments stay in the state dict too, so torch's own checks see every key."""
    stash: dict[Any, dict[str, torch.Tensor]] = {}
    state = state_dict.get("state")
    if not isinstance(state, Mapping):
        return state_dict, stash
    kept, changed = {}, False
    for pid, s in state.items():
        if not isinstance(s, Mapping):
            kept[pid] = s
            continue
        low = {key + suffix for key in quantized_keys(s) for suffix in (CODES, ABSMAX)}
        moments = {k for k in SIGNED if isinstance(s.get(k), torch.Tensor) and s[k].is_floating_point()}
        if low or moments:
            stash[pid] = {k: s[k] for k in low | moments}
        if low:
            s = {k: v for k, v in s.items() if k not in low}
            changed = True
        kept[pid] = s
    return ({**state_dict, "state": kept} if changed else state_dict), stash


def restore_low(
    optimizer: torch.optim.Optimizer, saved_groups: list[dict[str, Any]], stash: dict, wide: set[torch.Tensor]
) -> None:
    """Put `split_low`'s entries into ``optimizer.state`` after torch's ``load_state_dict`` (which mapped the saved
    param ids onto the params, group by group, in order), each on its param's device and in its own dtype. A float
    moment goes back only where torch's cast changed its dtype and the param is in ``wide`` (its state is kept in
    another format than its dtype: the units convert it as they bind); every other param keeps torch's cast, as
    torch's own load leaves it (an fp32 checkpoint loaded over bf16 params)."""
    if not stash:
        return
    saved = (pid for g in saved_groups for pid in g["params"])
    params = (p for g in optimizer.param_groups for p in g["params"])
    for pid, p in zip(saved, params, strict=False):
        entries = stash.get(pid)
        if not entries:
            continue
        st = optimizer.state[p]
        for k, t in entries.items():
            loaded = st.get(k)
            if k in SIGNED and isinstance(loaded, torch.Tensor) and (loaded.dtype == t.dtype or p not in wide):
                continue  # torch's cast kept it as it was, or its cast is what the param's step reads
            st[k] = t.to(p.device) if isinstance(t, torch.Tensor) else t  # (`check_loaded` refuses what is no tensor)


def entries(key: str, fmt: StateFormat, p: torch.Tensor) -> list[tuple[str, torch.dtype, torch.Size]]:
    """What ``optimizer.state[p]`` holds for state ``key`` in format ``fmt``: ``(name, dtype, shape)`` each (the
    memory pool lays these out), the shapes of the local shard's tensors for an FSDP2 param."""
    shape = fsdp.local(p).shape
    if fmt == StateFormat.Q8:
        blocks = torch.Size([math.ceil(shape.numel() / QUANT_BLOCK)])
        return [(key + CODES, torch.uint8, shape), (key + ABSMAX, torch.float32, blocks)]
    return [(key, dtype_of(fmt, p.dtype), shape)]
