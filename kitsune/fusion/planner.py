"""The fusion planner: every param of the wrapped optimizer onto the fused kernel or a fallback, with the reason.

Bucketing: params are grouped by (device, dtype, the kernel's compile-time switches); param groups that differ only
in hyperparameter values share a bucket (each tensor reads its own group's row of the device-resident
hyperparameter buffer). A bucket takes the first route that can run it:

1. the fused Triton kernel (one launch per ``max_fusion_size`` tensors);
2. torch's ``fused=True`` implementation, then ``foreach=True``: for buckets Triton cannot or should not take
   (no Triton, float64, a non-contiguous param, a predicted speedup under ``min_fusion_benefit``);
3. the wrapped optimizer's own step: for everything kitsune must not touch (unknown optimizer class, SparseAdam and
   LBFGS, ``differentiable=True``, complex or sparse grads, state of another dtype than its param for torch's fused
   and foreach paths, float state wider than its param where the optimizer's own step keeps it so, fusion
   disabled) and for every CPU param unless ``TRITON_INTERPRET=1``, so that on a CPU-only machine results stay
   bit-identical to the unwrapped optimizer.

`Planner.plan` only decides and builds the executors' units; it changes no param, grad or state.
"""

from __future__ import annotations

import math
import os
from collections import Counter, defaultdict
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

from kitsune import _native
from kitsune.config import FusionConfig, GradConfig, StreamConfig
from kitsune.distributed import fsdp
from kitsune.fusion import muon_unit, state_format
from kitsune.fusion.algos import ALGOS, OWN_STEP, AlgoInfo, group_specs, missing_key, unit_info
from kitsune.fusion.plan import BucketPlan, CostModel, Plan, Route
from kitsune.fusion.torch_route import TorchShadow
from kitsune.fusion.units import FusedUnit
from kitsune.kernels.codes import QUANT_BLOCK
from kitsune.kernels.multi_tensor import DEFAULT_BLOCK
from kitsune.kernels.spec import MuonSpec, StateFormat, UpdateSpec
from kitsune.optim.base import float_state, widens

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TORCH_DTYPES = (*_KERNEL_DTYPES, torch.float64)
_TORCH = Route.TORCH_FUSED
"""A reason's level "some torch route": the bucket then takes torch fused, else foreach (see torch_route)."""
Q8_PROGRAM = 64 * QUANT_BLOCK
"""Elements per program of an 8-bit update: it quantizes a tile of blocks at a time in a loop, so the per-program work
(hyperparameters, the bias corrections in fp64, the step count's atomic) is paid once per 64 blocks (H200, GPT-2
set, the vector layout with 2 warps: 0.752 ms with 32, 0.746 with 64, 0.769 with 128; `benchmarks/program-sweep.py`)."""
FLOAT_PROGRAM = 4 * DEFAULT_BLOCK
"""Elements per program of a float-state update with 2-byte state (bf16, or the param's dtype for 16-bit params),
without a trust ratio: it loops over tiles of `kitsune.kernels.update.FLOAT_TILE` elements, so the per-program work
is paid once per four tiles (H200, 4 warps, vector reads, `benchmarks/program-sweep.py`: `llama1b`'s bf16-state
AdamW step 6.29 ms with programs of 1024 elements, 5.71 with 4096, 5.80 with 8192, 5.87 with 16384; with 2048,
5.96 ms, and the GPT-2 set's 0.626 against 0.606 ms with 4096)."""
FP32_PROGRAM = 2 * DEFAULT_BLOCK
"""The same for fp32 state: two tiles a program. H200, 2026-12-02, torch 2.11, Triton 3.6 (`program-sweep.py
--state fp32`, two turns each): `llama1b`'s AdamW step 8.064-8.069 ms against 8.173-8.178 with programs of 4096
(101% and 100% of its floor; `torch.compile`'s foreach step 8.042 ms on the same machine), the GPT-2 set's 0.849-0.850
against 0.853-0.854; with 1024 (inductor's block) 8.365, with 8192 8.209. Neither the step counter's atomic nor the
tiles' masks weighed on it (dropped in turn, within 0.1%). LAMB's programs in either stay at the planner's block:
its partial norms are per program."""
_REPEATED = (
    Route.BASE_STEP,
    "a param listed more than once in the param groups: torch's step updates it once per listing (and warns), "
    "so the optimizer's own step keeps that; list each param once to fuse it",
)
_SHARED = (
    Route.BASE_STEP,
    "a param whose memory overlaps another param's (two Parameters over one tensor): one fused launch would update "
    "both at once, a race, so the optimizer's own step updates them as without kitsune (one after the other "
    "with foreach=False; torch's foreach and fused kernels race on a GPU as well)",
)
_SHARED_STATE = (
    Route.BASE_STEP,
    "optimizer state whose memory is shared with another param's state or a param (one tensor in two params' "
    "state, set by hand or loaded so): the fused kernels keep each param's state apart, so the optimizer's own "
    "step updates it as without kitsune; give each param state of its own to fuse it",
)


def _span(t: torch.Tensor) -> tuple[str, int, int] | None:
    """The device and the address span of ``t``'s elements, or None where it has none to read (empty, a lazy or
    tensor-subclass param, a DTensor, another device type)."""
    try:
        if fsdp.is_dtensor(t) or t.numel() == 0 or t.device.type not in ("cuda", "cpu"):
            return None
        extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True))
        start = t.data_ptr()
    except (RuntimeError, ValueError, NotImplementedError):
        return None
    return str(t.device), start, start + extent * t.element_size()


def _overlapping(items: list[tuple[torch.Tensor, int, bool]]) -> tuple[set[int], set[int]]:
    """For ``(tensor, owner id, is state)`` items, the owners whose memory overlaps another item's: those where
    only params overlap, and those where a state tensor is one of the two. A plan-time sweep over address spans."""
    spans = []
    for t, owner, is_state in items:
        span = _span(t)
        if span is not None:
            spans.append((*span, owner, is_state))
    spans.sort(key=lambda x: x[:3])
    params: set[int] = set()
    state: set[int] = set()
    reach: tuple[str, int, int, bool] | None = None  # the device, furthest end so far, its owner, whether state
    for device, start, end, owner, is_state in spans:
        if reach is not None and reach[0] == device and start < reach[1]:
            (state if is_state or reach[3] else params).update((owner, reach[2]))
        if reach is None or reach[0] != device or end > reach[1]:
            reach = (device, end, owner, is_state)
    return params, state


def _sharing_memory(params: list[torch.Tensor], state: Any) -> tuple[set[int], set[int]]:
    """The ids of the params whose memory overlaps another param's (different objects over one storage: views, or
    two Parameters made from one tensor), and of those whose optimizer state shares memory with another param's
    state, its own other state or a param (one ``step`` tensor for every param, ``state[q] = state[p]``)."""
    items = [(p, id(p), False) for p in params]
    for p in params:
        s = state.get(p)
        if isinstance(s, dict):
            items += [(t, id(p), True) for t in s.values() if isinstance(t, torch.Tensor)]
    return _overlapping(items)


Members = list[tuple[int, torch.Tensor]]  # (group index, param)


def triton_error() -> str | None:
    """Why the Triton kernels cannot be imported here, or None when they can."""
    try:
        import kitsune.kernels.update  # noqa: F401
    except ImportError as exc:
        return f"Triton is not importable ({exc})"
    return None


def interpreting() -> bool:
    """TRITON_INTERPRET=1: Triton runs kernels on CPU tensors (how CI tests them)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass
class Planned:
    """What one plan decided: the plan shown to users and the executors' units."""

    plan: Plan
    info: AlgoInfo | None
    specs: tuple[Any, ...]
    """Each group's compile-time switches (`AlgoInfo.spec`)."""
    switches: tuple[Any, ...] = ()
    """`group_switches` as this plan saw them: a change of any plans again."""
    switch_keys: frozenset[str] | None = None
    """The group keys `group_switches` read (`switch_keys`; None: every key): a change to any other key cannot change
    the switches."""
    units: list[FusedUnit] = field(default_factory=list)
    muon: list[muon_unit.MuonUnit] = field(default_factory=list)
    shadows: list[TorchShadow] = field(default_factory=list)
    own_step: set[torch.Tensor] = field(default_factory=set)
    """The params the wrapped optimizer's own step updates (route ``base_step``): their float state stays in the dtype
    it was made in where their own dtype narrowed since (`state_format.decode_others`), as that step keeps it."""
    narrowed: list[torch.Tensor] = field(default_factory=list)
    """The params of `own_step` whose state is so now: the executor watches their storages, so that a cast back
    (``model.float()``) plans again and brings them back to the fused kernel."""
    strict: dict[torch.Tensor, tuple[str, ...]] = field(default_factory=dict)
    """The params of `narrowed` whose optimizer's own step lerps the grad into the state (`AlgoInfo.one_dtype_for`:
    Adam's family, centered RMSprop, Muon), with the keys of their step counters: that step runs where each grad is
    in its state's dtype (``p.grad_dtype``) and raises halfway otherwise, so the executor checks that first."""


class Planner:
    """Routes buckets of params; see the module docstring. Holds only its settings between plans."""

    def __init__(
        self,
        config: FusionConfig,
        grads: GradConfig,
        streams: StreamConfig,
        cost_model: CostModel | None = None,
        block: int = DEFAULT_BLOCK,
    ) -> None:
        self.config = config
        self.grads = grads
        self.streams = streams
        self.cost_model = cost_model or CostModel()
        self.block = block
        self.refused: dict[tuple[str, torch.dtype, UpdateSpec | MuonSpec], str] = {}
        """Buckets (device, dtype, spec) whose fused kernel failed to compile here, with why: later plans route them
        to torch's step (`refuse`)."""

    def plan(
        self, base: torch.optim.Optimizer, remote: Collection[torch.Tensor], backward_bytes: int | None
    ) -> Planned:
        """Plan every param of ``base`` except ``remote`` (other ranks update those); ``backward_bytes``: the
        units' size in bytes of params when updates run inside backward, else None."""
        groups = base.param_groups
        info = ALGOS.get(type(base))
        specs = group_specs(info, groups) if info else ()
        buckets: dict[tuple, Members] = defaultdict(list)
        notes: dict[tuple, set[str]] = defaultdict(set)
        for gi, p, route, reason, pspec, note in self._assign(base, remote, info, specs):
            key = (str(p.device), p.dtype, pspec if route is not Route.BASE_STEP else None, route, reason)
            buckets[key].append((gi, p))
            notes[key] |= _group_notes(groups[gi]) | ({note} if note else set())

        out = Planned(Plan(), info, specs, group_switches(info, groups), switch_keys(info, groups))
        for key, members in buckets.items():
            device, dtype, spec, route, reason = key
            bp = self._plan_bucket(base, info, specs, device, dtype, spec, route, reason, members)
            bp.notes = sorted(notes[key]) if bp.route.fused else []
            out.plan.buckets.append(bp)
            self._build(out, base, info, bp, spec, members, backward_bytes)
            if bp.route is Route.BASE_STEP:  # (`_build` may have sent it there)
                for gi, p in members:
                    algo = (unit_info(info, specs[gi]) or info) if info is not None else None
                    scalars = algo.scalars if algo else ("step",)
                    out.own_step.add(p)
                    if _narrowed_state(base.state, p, scalars) is not None:
                        out.narrowed.append(p)
                        if algo is not None and algo.one_dtype_for(specs[gi]):
                            out.strict[p] = scalars
        return out

    def wide_state(self, base: torch.optim.Optimizer) -> set[torch.Tensor]:
        """The params of ``base`` whose state a plan of it now would ask in another format than their own dtype
        (``FusionConfig.state_precision``, where it applies: `_state_format`): a load keeps their checkpoint's
        wider moments for them, where torch's load casts every other param's to its dtype."""
        if self.config.state_precision == "param":
            return set()
        info = ALGOS.get(type(base))
        specs = group_specs(info, base.param_groups) if info else ()
        return {
            p
            for _, p, _, _, pspec, _ in self._assign(base, frozenset(), info, specs)
            if isinstance(pspec, UpdateSpec) and pspec.state != StateFormat.PARAM
        }

    def _assign(
        self, base: torch.optim.Optimizer, remote: Collection[torch.Tensor], info: AlgoInfo | None, specs: tuple
    ) -> Iterator[tuple[int, torch.Tensor, Route | None, str, Any, str | None]]:
        """Each param of ``base`` but ``remote``: ``(group index, param, route, reason, spec, note)``, the route
        None where the fused kernel may take it (`_plan_bucket` weighs that per bucket), the spec with the param's
        state format and rounding, and a note where a setting asked for does not apply to it."""
        groups = base.param_groups
        whole = self._optimizer_reason(base, info)
        mesh: list[Any] = []  # the one device mesh of the FSDP2 params the fused kernel takes
        listed = Counter(id(p) for g in groups for p in g["params"])
        shared, shared_state = _sharing_memory(
            [p for g in groups for p in g["params"] if listed[id(p)] == 1], base.state
        )
        for gi, g in enumerate(groups):
            spec = specs[gi] if info else None
            group_reason = whole or _group_reason(g)
            if not group_reason and isinstance(spec, MuonSpec):
                group_reason = muon_unit.group_reason(spec, self.config)
            for p in g["params"]:
                if p in remote:
                    continue
                if group_reason:
                    route, reason = group_reason
                elif listed[id(p)] > 1:
                    route, reason = _REPEATED
                elif id(p) in shared:
                    route, reason = _SHARED
                elif id(p) in shared_state:
                    route, reason = _SHARED_STATE
                else:
                    route, reason = _param_reason(p)
                if route is None and _sparse_state(base.state.get(p)):
                    route, reason = _SPARSE_STATE
                if route is None and fsdp.is_dtensor(p):
                    route, reason = _shard_route(p, spec, mesh)
                if route is None and isinstance(spec, MuonSpec) and _native.layout_code(p):
                    route, reason = _NOT_ROW_MAJOR
                if route is None and isinstance(spec, MuonSpec) and info is not None:
                    narrowed = _narrowed_state(base.state, p, info.scalars)
                    if narrowed is not None:  # (its momentum: where the grads are in its dtype, `Planned.strict`)
                        route, reason = Route.BASE_STEP, narrowed
                pspec, note = spec, None
                if route is None and isinstance(spec, UpdateSpec):
                    pspec, note = self._state_format(info, spec, p)  # type: ignore[arg-type]
                    pspec, rounding = self._rounding(pspec, p)
                    note = "; ".join(filter(None, (note, rounding))) or None
                    algo = unit_info(info, pspec)  # type: ignore[arg-type]
                    if pspec.state == StateFormat.PARAM and algo is not None:
                        narrowed = _narrowed_state(base.state, p, algo.scalars)
                        if narrowed is not None:  # (Adam's family: where the grads are in the state's dtype)
                            route, reason = Route.BASE_STEP, narrowed
                elif route is None and isinstance(spec, MuonSpec) and self.config.param_rounding == "stochastic":
                    if p.dtype == torch.bfloat16:
                        pspec = replace(spec, stochastic=True)
                elif route is None and self.config.param_rounding == "kahan" and p.dtype == torch.bfloat16:
                    note = "param_rounding='kahan' does not apply to Muon's update: bf16 params round to nearest"
                yield gi, p, route, reason, pspec, note

    def _state_format(self, info: AlgoInfo, spec: UpdateSpec, p: torch.Tensor) -> tuple[UpdateSpec, str | None]:
        """``spec`` with the state format ``FusionConfig.state_precision`` gives ``p`` on the fused kernel, and a
        note when ``p`` keeps its state in its own dtype although another precision was asked for."""
        precision = self.config.state_precision
        if precision == "param" or not spec.state_slots:
            return spec, None
        fmt = state_format.PRECISIONS[precision]
        algo = unit_info(info, spec)
        if algo is None or not algo.low_precision:
            name = algo.name if algo else "this optimizer"
            why = _FULL_PRECISION.get(name, "")
            return spec, f"state_precision={precision!r} does not apply to {name}{why}: state in the param's dtype"
        if spec.centered:
            return spec, (
                f"state_precision={precision!r} does not apply to centered RMSprop: square_avg - grad_avg**2 would "
                "go negative when the two are rounded apart; state in the param's dtype"
            )
        if fmt == StateFormat.Q8 and _native.layout_code(p):
            return spec, (
                f"state_precision={precision!r} takes row-major params (its blocks are runs of the param's rows); a "
                "channels_last param keeps its state in its own dtype"
            )
        if fmt == StateFormat.Q8 and p.numel() < self.config.min_8bit_size:
            return spec, f"under min_8bit_size={self.config.min_8bit_size} elements: state in the param's dtype"
        if fmt != StateFormat.Q8 and state_format.dtype_of(fmt, p.dtype) == p.dtype:
            return spec, None  # fp32 state of fp32 params (bf16 of bf16) is torch's layout
        return replace(spec, state=fmt, signed=state_format.signed_mask(algo.state_keys(spec))), None

    def _rounding(self, spec: UpdateSpec, p: torch.Tensor) -> tuple[UpdateSpec, str | None]:
        """``spec`` with ``FusionConfig.param_rounding``'s stochastic rounding (bf16 params) or Kahan compensation
        (bf16 and float16 params) where it applies, and a note where it was asked for and does not."""
        rounding = self.config.param_rounding
        if rounding == "kahan":
            if p.dtype not in (torch.bfloat16, torch.float16):
                return spec, None  # fp32 params: nothing to compensate
            if spec.trust:
                return spec, "param_rounding='kahan' does not apply to trust-ratio updates: params round to nearest"
            return replace(spec, kahan=True), None
        if rounding != "stochastic":
            return spec, None
        if p.dtype == torch.bfloat16:
            return replace(spec, stochastic=True), None
        if p.dtype == torch.float16:
            return spec, "param_rounding='stochastic' applies to bf16 params: float16 params round to nearest"
        return spec, None

    def _optimizer_reason(self, base: torch.optim.Optimizer, info: AlgoInfo | None) -> tuple[Route, str] | None:
        """A reason that sends every param to the wrapped optimizer's own step, or None."""
        if not self.config.enabled:
            return Route.BASE_STEP, "fusion disabled (enable_fusion=False)"
        if not self.config.enable_elementwise:
            return Route.BASE_STEP, "fusion disabled by enable_elementwise=False"
        if info is None and type(base) in OWN_STEP:
            return Route.BASE_STEP, OWN_STEP[type(base)]
        if info is None:
            names = ", ".join(i.name for i in ALGOS.values())
            return Route.BASE_STEP, (
                f"unknown optimizer class {type(base).__qualname__}: only exactly {names} are fused "
                "(a subclass may change the math), so it keeps its own step"
            )
        if torch.get_default_dtype() == torch.float64:
            return Route.BASE_STEP, "torch.set_default_dtype(torch.float64): torch keeps step counts in float64"
        if getattr(base, "process_group", None) is not None:
            return Route.BASE_STEP, (
                "distributed Muon (process_group=...): its own step shares the Newton-Schulz work across the ranks"
            )
        return None

    def refuse(self, device: torch.device, dtype: torch.dtype, spec: UpdateSpec | MuonSpec, why: str) -> None:
        """The fused kernel for ``dtype`` params of ``spec`` failed to compile on ``device``: from the next plan on,
        those params take torch's route (fused or foreach where torch has one, else the optimizer's own step)."""
        self.refused[(str(device), dtype, spec)] = f"the fused kernel failed to compile on {device} ({why})"

    def _plan_bucket(
        self,
        base: torch.optim.Optimizer,
        info: AlgoInfo | None,
        specs: tuple[Any, ...],
        device: str,
        dtype: torch.dtype,
        spec: UpdateSpec | MuonSpec | None,
        route: Route | None,
        reason: str,
        members: Members,
    ) -> BucketPlan:
        tensors = len(members)
        elements = sum(fsdp.local(p).numel() for _, p in members)  # per rank, for FSDP2 shards
        aux = unit_info(info, spec)
        bp = BucketPlan(
            device=device,
            dtype=str(dtype).removeprefix("torch."),
            optimizer=type(base).__name__ + (f"/{aux.name}" if aux is not info else ""),  # type: ignore[union-attr]
            options=spec.describe() if spec else "-",
            route=Route.BASE_STEP,
            reason=reason,
            tensors=tensors,
            elements=elements,
            launches=0,
            groups=sorted({gi for gi, _ in members}),
        )
        fusable = route is None and isinstance(spec, (UpdateSpec, MuonSpec))
        refused = self.refused.get((device, dtype, spec)) if fusable else None
        # 8-bit or 16-bit state only kitsune's kernels read (with those kernels refused, torch's state, as its step
        # keeps it)
        low = isinstance(spec, UpdateSpec) and spec.state != StateFormat.PARAM and refused is None
        if low:  # the format, and the bytes at the state's size
            bp.state = state_format.describe(spec.state, dtype)  # type: ignore[union-attr]
            per = state_format.update_bytes(spec, aux.bytes_per_element(spec), dtype)  # type: ignore[arg-type,union-attr]
            bp.bytes_per_step = round(elements * per)
        else:
            if isinstance(spec, (UpdateSpec, MuonSpec)) and spec.state_slots:
                bp.state = str(dtype).removeprefix("torch.")
            if info is not None and specs:  # a known algorithm moves known bytes, whichever route runs it
                bp.bytes_per_step = sum(
                    fsdp.local(p).numel() * p.element_size() * info.bytes_per_element(specs[gi]) for gi, p in members
                )
        if route is Route.BASE_STEP:
            return bp
        launches = math.ceil(tensors / self.config.max_fusion_size) if self.config.max_fusion_size else 1
        if isinstance(spec, UpdateSpec):
            launches *= spec.launches  # LAMB's two stages
        if low:  # only kitsune's kernels read this state: no route to weigh against
            bp.route, bp.launches = Route.TRITON, launches
            return bp
        assert info is not None and spec is not None
        fallback = torch_route(info, torch.device(device), dtype)
        if route is Route.TORCH_FOREACH and fallback is Route.TORCH_FUSED:
            fallback = Route.TORCH_FOREACH  # a non-contiguous param: torch's fused path misreads other grad layouts
        if fallback is Route.TORCH_FUSED and any(fsdp.is_dtensor(p) for _, p in members):
            fallback = Route.TORCH_FOREACH  # FSDP2: torch's fused SGD and Adagrad ops have no DTensor strategy
        loop = fallback is Route.TORCH_FOREACH and _foreach_off(base, members)
        if loop:  # the user's own per-param loop, which takes what torch's foreach path refuses (a tensor beta)
            fallback = Route.BASE_STEP
        if route is None and isinstance(spec, MuonSpec) and refused is None:
            muon_unit.plan_bucket(bp, members, spec, self.config, self.cost_model)
            return bp
        if refused is not None:
            bp.reason = refused
        elif route is None:  # fusable: does it pay? (FSDP2: weighed on an even share, so every rank decides alike)
            nbytes = sum(fsdp.even_share(p) for _, p in members) * dtype.itemsize * info.bytes_per_element(spec)
            fused, other = weigh(self.cost_model, info, fallback, tensors, nbytes, launches)
            bp.predicted_speedup = round(other / fused, 3)
            bp.predicted_ms = {Route.TRITON.value: _ms(fused), fallback.value: _ms(other)}
            if bp.predicted_speedup >= self.config.min_fusion_benefit:
                bp.route, bp.launches = Route.TRITON, launches
                return bp
            bp.reason = (
                f"predicted speedup {bp.predicted_speedup:.2f}x is below min_fusion_benefit="
                f"{self.config.min_fusion_benefit:g}"
            )
        bp.route = fallback
        if loop:
            bp.reason += (
                "; foreach=False in its param group: the optimizer's own step runs (torch's per-param loop, as asked, "
                "not its foreach path)"
            )
            return bp
        if fallback is Route.BASE_STEP:
            bp.reason += f"; {bp.optimizer} has no torch fused/foreach path on {device}"
            return bp
        foreign = _foreign_state(members, base.state)
        if foreign:  # torch's fused and foreach kernels take state only in their param's dtype and device
            bp.route = Route.BASE_STEP
            bp.reason += f"; {foreign}, which torch's {fallback.value} path refuses: the optimizer's own step runs"
        return bp

    def _build(
        self,
        out: Planned,
        base: torch.optim.Optimizer,
        info: AlgoInfo | None,
        bp: BucketPlan,
        spec: UpdateSpec | MuonSpec | None,
        members: Members,
        backward_bytes: int | None,
    ) -> None:
        """Create the executors' units for one planned bucket."""
        if bp.route is Route.TRITON:
            assert info is not None and isinstance(spec, UpdateSpec)
            algo = unit_info(info, spec)
            block = self._program(spec, members[0][1].dtype)
            for chunk in self._chunks(members, backward_bytes):
                params, gis = [p for _, p in chunk], [gi for gi, _ in chunk]
                out.units.append(FusedUnit(params, gis, algo, spec, base.state, block))  # type: ignore[arg-type]
        elif bp.route is Route.TRITON_MATMUL:
            assert info is not None and isinstance(spec, MuonSpec)
            for chunk in muon_unit.chunks(members, self.config.max_fusion_size):
                params, gis = [p for _, p in chunk], [gi for gi, _ in chunk]
                unit = muon_unit.MuonUnit(
                    params, gis, info, spec, base.state, self.streams, self.block, seed=self.config.rounding_seed
                )
                out.muon.append(unit)
        elif bp.route in (Route.TORCH_FUSED, Route.TORCH_FOREACH):
            by_group: dict[int, list[torch.Tensor]] = defaultdict(list)
            for gi, p in members:
                by_group[gi].append(p)
            try:
                algo = unit_info(info, spec)
                whole = algo is None or algo.per_key_init or not isinstance(spec, UpdateSpec)  # nothing can be missing
                missing = None if whole else partial(missing_key, algo, spec)
                out.shadows.append(TorchShadow(base, bp.route, dict(by_group), missing))
            except Exception as exc:  # torch refused the flags: the optimizer's own step still works
                bp.reason += f"; torch {bp.route.value} unavailable ({exc})"
                bp.route = Route.BASE_STEP

    def _program(self, spec: UpdateSpec, dtype: torch.dtype) -> int:
        """Elements per program of a fused update over params of ``dtype``: `Q8_PROGRAM` for 8-bit state, the
        planner's block with a trust ratio (LAMB's partial norms are a program's), `FP32_PROGRAM` for fp32 state,
        `FLOAT_PROGRAM` otherwise."""
        if spec.state == StateFormat.Q8:
            return Q8_PROGRAM
        if spec.trust:
            return self.block
        return FP32_PROGRAM if state_format.dtype_of(spec.state, dtype) == torch.float32 else FLOAT_PROGRAM

    def _chunks(self, members: Members, backward_bytes: int | None) -> list[Members]:
        """A bucket's launch units: at most ``max_fusion_size`` tensors each; with updates in backward, also at most
        about ``backward_bytes`` of params each, in reverse registration order (the order backward finishes grads)."""
        size = self.config.max_fusion_size or max(len(members), 1)
        if backward_bytes is None:
            return [members[start : start + size] for start in range(0, len(members), size)]
        chunks: list[Members] = [[]]
        nbytes = 0
        for gi, p in reversed(members):
            if chunks[-1] and (nbytes >= backward_bytes or len(chunks[-1]) >= size):
                chunks.append([])
                nbytes = 0
            chunks[-1].append((gi, p))
            nbytes += p.numel() * p.element_size()
        return chunks

    def grad_pass(self, planned: Planned) -> str | None:
        """Why the grads' own passes (unscale, inf check, clip) cannot fuse into the norm and update kernels of
        ``planned``, or None when they can: every param on one device, updated by the fused kernel."""
        units = planned.units
        trust = any(u.spec.trust for u in units)
        if planned.muon:
            return "Muon's momentum kernel reads the grads outside the norm pass: torch ops unscale and clip"
        if not units:
            return "no param takes the fused kernel"
        if planned.shadows or any(b.route is not Route.TRITON for b in planned.plan.buckets):
            return "some params fall back (see the plan), so the grads are unscaled and clipped by torch ops"
        if len({u.device for u in units}) > 1:
            return "params on several devices: the global norm is computed per device by torch ops"
        if len({u.sharded for u in units}) > 1:
            return "FSDP2 (DTensor) and plain params mixed: the global norm is computed by torch ops"
        if not self.config.enable_reduction:
            return "enable_reduction=False: the grads are unscaled and clipped by torch ops"
        if trust and self.grads.max_norm is not None and self.grads.norm_type != 2.0:
            return "inf-norm clipping with trust ratios (2-norms): the clip runs as its own pass"
        return None


_SPARSE_STATE = (
    Route.BASE_STEP,
    "sparse state (made by the optimizer's own step from sparse grads): only the optimizer's own step handles it",
)


def _sparse_state(s: Any) -> bool:
    """Whether a param's state holds a sparse tensor: SGD's momentum buffer cloned from a sparse grad (torch's own
    step keeps it sparse), which the fused kernels, reading dense memory, cannot take."""
    return isinstance(s, dict) and any(isinstance(v, torch.Tensor) and v.is_sparse for v in s.values())


def _param_reason(p: torch.Tensor) -> tuple[Route | None, str]:
    """(None, reason) when the fused kernel can take ``p``; else the fallback level and why."""
    if p.is_complex():
        return Route.BASE_STEP, "complex params: the fused kernels are real-only"
    if p.grad is not None and p.grad.layout != torch.strided:
        return Route.BASE_STEP, "sparse grads: only the optimizer's own step handles them"
    if p.device.type == "cpu" and not interpreting():
        return Route.BASE_STEP, (
            "CPU tensors: kitsune's fused kernels need CUDA; the wrapped optimizer's own step updates these, "
            "bit-identical to it without kitsune"
        )
    if p.device.type not in ("cuda", "cpu"):
        return Route.BASE_STEP, f"{p.device.type} tensors: the fused Triton kernels run on CUDA"
    err = triton_error()
    if err:
        return _TORCH, err
    if p.dtype not in _KERNEL_DTYPES:
        return (_TORCH if p.dtype in _TORCH_DTYPES else Route.BASE_STEP), (
            f"{str(p.dtype).removeprefix('torch.')} params: the fused kernel takes fp32/bf16/fp16 (math in fp32)"
        )
    layout = _native.layout_code(p)
    if layout == _native.NOT_DENSE or (layout and fsdp.is_dtensor(p)):
        return _NOT_DENSE
    return None, "fused Triton multi-tensor kernel"


_FULL_PRECISION = {
    "Rprop": " (its step sizes grow and shrink by factors, which rounding would compound)",
    "ASGD": " (its average is a copy of the params, which rounding would move off them)",
}
"""Why an optimizer's state stays in the param's dtype under ``state_precision``, where the plan's note says so."""

_NOT_DENSE = (
    Route.TORCH_FOREACH,
    "non-contiguous param: the fused kernel addresses flat memory, row-major or channels_last (torch's foreach path "
    "takes it: torch's fused kernels need each grad laid out as its param)",
)
"""Where a param's elements lie in no order the fused kernel walks them in (`kitsune._native.MEMORY_FORMATS`)."""

_NOT_ROW_MAJOR = (
    Route.BASE_STEP,
    "channels_last param: Muon's fused kernels orthogonalise the row-major matrix; the wrapped optimizer's own "
    "step updates it",
)
"""A Muon param whose elements lie in another order than the row-major matrix Newton-Schulz reads."""


def _shard_route(p: torch.Tensor, spec: Any, mesh: list[Any]) -> tuple[Route | None, str]:
    """For a DTensor param the fused kernel could otherwise take: (None, reason) when it runs on the local shard
    (FSDP2); else the wrapped optimizer's own step and why (see `kitsune.distributed.fsdp`). ``mesh`` holds
    the one device mesh the fused kernel takes (the first met)."""
    why = fsdp.shard_reason(p)
    if why is None and isinstance(spec, MuonSpec):
        why = "Muon orthogonalises whole matrices, not FSDP2 shards: the wrapped optimizer's own step updates it"
    elif why is None and getattr(spec, "trust", None):
        why = "LAMB/LARS trust ratios need whole-tensor norms, not a shard's: the optimizer's own step updates it"
    elif why is None and mesh and p.device_mesh != mesh[0]:
        why = "DTensor on a second device mesh: the global grad norm is all-reduced over one FSDP2 mesh"
    if why is not None:
        return Route.BASE_STEP, why
    if not mesh:
        mesh.append(p.device_mesh)
    return None, "fused Triton multi-tensor kernel on the local FSDP2 shards"


def _narrowed_state(state: Any, p: torch.Tensor, scalars: Collection[str]) -> str | None:
    """Why ``p`` goes to the wrapped optimizer's own step where its state holds a float tensor of a dtype its own does
    not widen (``model.half()`` after the state was made, or state set so by hand), or None; ``scalars``: the keys of
    counters kept in float32 whatever the param's dtype (``step``), a 0-d param's moments being 0-d too. SGD's,
    RMSprop's, Adagrad's and LARS's own steps carry on with such state in its dtype, Adam's and Muon's where the grads
    are in the state's dtype too (``p.grad_dtype``; `Planned.strict`); the fused kernel keeps state in the param's
    dtype, so it would round it, and the trajectory would leave torch's."""
    for _, t in float_state(state.get(p) or {}, scalars):
        if t.dtype != p.dtype and not widens(t.dtype, p.dtype):
            held, own = (str(d).removeprefix("torch.") for d in (t.dtype, p.dtype))
            return (
                f"{held} state of {own} params (their dtype changed after the state was made): "
                f"the wrapped optimizer's own step keeps the state in {held}, as torch does; the fused kernel "
                f"would round it to {own}"
            )
    return None


def _foreach_off(base: torch.optim.Optimizer, members: Members) -> bool:
    """Whether a param group of ``members`` says ``foreach=False``: where the fused kernel does not take them, they
    go to the optimizer's own step, torch's per-param loop the user chose, not to torch's foreach path (which
    refuses what the loop takes, Adam's tensor betas without ``capturable``, and rounds otherwise)."""
    return any(_asks_loop(base.param_groups[gi]) for gi in {gi for gi, _ in members})


def _asks_loop(g: dict[str, Any]) -> bool:
    """Whether param group ``g`` says ``foreach=False`` (None leaves the choice to torch)."""
    return g.get("foreach") is False


def _foreign_state(members: Members, state: Any) -> str | None:
    """The first state tensor of ``members`` not in its param's dtype and device, described, or None."""
    for _, p in members:
        for key, t in (state.get(p) or {}).items():
            if isinstance(t, torch.Tensor) and t.dim() and (t.dtype != p.dtype or t.device != p.device):
                return (
                    f"state {key!r} is {str(t.dtype).removeprefix('torch.')} on {t.device} for a "
                    f"{str(p.dtype).removeprefix('torch.')} param on {p.device}"
                )
    return None


def weigh(
    cost: CostModel, info: AlgoInfo, fallback: Route, tensors: int, nbytes: int, launches: int
) -> tuple[float, float]:
    """The cost model's seconds a step for a bucket on the fused kernel and on ``fallback``: torch's fused path,
    its foreach path, or, where torch has neither, the optimizer's own loop (one launch per op and param)."""
    fused = cost.triton(tensors, nbytes, launches)
    if fallback is Route.TORCH_FUSED:
        return fused, cost.torch_fused(tensors, nbytes)
    if fallback is Route.TORCH_FOREACH:
        return fused, cost.torch_foreach(tensors, nbytes, max(info.foreach_launches, 1))
    return fused, cost.per_param_loop(tensors, nbytes, max(info.loop_launches, 1))


def _ms(seconds: float) -> float:
    """Seconds as milliseconds, to three significant digits."""
    return float(f"{seconds * 1e3:.3g}")


def torch_route(info: AlgoInfo, device: torch.device, dtype: torch.dtype) -> Route:
    if device.type in info.torch_fused_devices and dtype in _TORCH_DTYPES:
        return Route.TORCH_FUSED
    return Route.TORCH_FOREACH if info.torch_foreach else Route.BASE_STEP


def group_switches(info: AlgoInfo | None, groups: list[dict[str, Any]]) -> tuple[Any, ...]:
    """What in each group's options decides its params' kernel variant or route: the algorithm's switches
    (`AlgoInfo.spec`), whether a group reason sends it to the optimizer's own step (``differentiable=True``), and
    whether ``foreach=False`` keeps what the fused kernel does not take off torch's foreach path. The fused executor
    compares them with the plan's every step."""
    if info is None:
        return ()
    specs = group_specs(info, groups)
    return tuple((spec, _group_reason(g) is not None, _asks_loop(g)) for spec, g in zip(specs, groups, strict=True))


def switch_keys(info: AlgoInfo | None, groups: list[dict[str, Any]]) -> frozenset[str] | None:
    """The keys `group_switches` reads from ``groups``, or None where it reads every key (or raises): a step whose
    groups changed only at other keys (an LR scheduler's ``lr``) has the switches of the last, and the steady replay
    skips their comparison. Found by running it on copies of the groups that note each key read, so no list of
    switch keys is kept beside the switches that could fall out of step with them; a read that depends on a value
    (a key read only while another is set) is seen again, as the key deciding it was read."""
    if info is None:
        return frozenset()
    copies = [_Reads(g) for g in groups]
    try:
        group_switches(info, copies)  # type: ignore[arg-type]
    except Exception:  # the switches' own errors are raised by `group_switches` itself, where it matters
        return None
    if any(c.every for c in copies):
        return None
    return frozenset().union(*(c.read for c in copies))


class _Reads(dict):
    """A param group's copy that notes the keys read from it (`switch_keys`); ``every`` once a read covers them all."""

    def __init__(self, group: dict[str, Any]) -> None:
        super().__init__(group)
        self.read: set[Any] = set()
        self.every = False

    def __getitem__(self, key: Any) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.read.add(key)
        return super().__contains__(key)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return super().setdefault(key, default)

    def pop(self, key: Any, *default: Any) -> Any:
        self.read.add(key)
        return super().pop(key, *default)

    def _all(self, name: str, *args: Any) -> Any:
        self.every = True
        return getattr(super(), name)(*args)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return self._all("__iter__")

    def __len__(self) -> int:
        return self._all("__len__")

    def __eq__(self, other: object) -> bool:
        return self._all("__eq__", other)

    __hash__ = None  # type: ignore[assignment]

    def keys(self):  # type: ignore[no-untyped-def]
        return self._all("keys")

    def values(self):  # type: ignore[no-untyped-def]
        return self._all("values")

    def items(self):  # type: ignore[no-untyped-def]
        return self._all("items")

    def copy(self) -> dict[str, Any]:
        return self._all("copy")

    def popitem(self) -> tuple[Any, Any]:
        return self._all("popitem")


def _group_reason(g: dict[str, Any]) -> tuple[Route, str] | None:
    if g.get("differentiable"):
        return Route.BASE_STEP, "differentiable=True: the update must stay in autograd, so torch's own step runs"
    return None


def _group_notes(g: dict[str, Any]) -> set[str]:
    notes = set()
    if g.get("foreach"):
        notes.add("foreach=True ignored: the fused kernel replaces it")
    if g.get("fused"):
        notes.add("fused=True ignored: kitsune's fused kernel replaces torch's")
    if g.get("capturable"):
        notes.add("capturable=True is fine: step counts and lr stay on the device")
    return notes
