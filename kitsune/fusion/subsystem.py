"""FusionSubsystem: plans buckets of params onto the fused kernel or a fallback, and runs them each step.

Bucketing: params are grouped by (device, dtype, the kernel's compile-time switches); param groups that differ
only in hyperparameter values share a bucket (each tensor reads its own group's row of the device-resident
hyperparameter buffer). A bucket takes the first route that can run it:

1. the fused Triton kernel (one launch per ``max_fusion_size`` tensors);
2. torch's ``fused=True`` implementation, then ``foreach=True``: for buckets Triton cannot or should not take
   (no Triton, float64, a non-contiguous param, a predicted speedup under ``min_fusion_benefit``);
3. the wrapped optimizer's own step: for everything kitsune must not touch (unknown optimizer class,
   ``differentiable=True``, complex or sparse grads, fusion disabled) and for every CPU param unless
   ``TRITON_INTERPRET=1``, so that on a CPU-only machine results stay bit-identical to the unwrapped optimizer.

Each reason is logged once (logger ``kitsune.fusion``) and shown in :attr:`FusionSubsystem.current_plan`.
"""

from __future__ import annotations

import logging
import math
import os
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch

from kitsune.config import FusionConfig
from kitsune.fusion.algos import ALGOS, AlgoInfo
from kitsune.fusion.context import DeviceContext
from kitsune.fusion.plan import BucketPlan, CostModel, Plan, Route
from kitsune.fusion.units import FusedUnit, TorchShadow
from kitsune.kernels.multi_tensor import DEFAULT_BLOCK
from kitsune.kernels.spec import UpdateSpec
from kitsune.subsystem import StepContext, Subsystem

if TYPE_CHECKING:
    from kitsune.optimizer import KitsuneOptimizer

logger = logging.getLogger("kitsune.fusion")

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TORCH_DTYPES = (*_KERNEL_DTYPES, torch.float64)
_TORCH = Route.TORCH_FUSED
"""A reason's level "some torch route": the bucket then takes torch fused, else foreach (see _torch_route)."""


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


class FusionSubsystem(Subsystem):
    """Fused multi-tensor optimizer updates; see the module docstring for the routes and reasons."""

    name = "fusion"

    def __init__(self, config: FusionConfig, cost_model: CostModel | None = None, block: int = DEFAULT_BLOCK) -> None:
        super().__init__()
        self.config = config
        self.cost_model = cost_model or CostModel()
        self.block = block
        self.current_plan: Plan | None = None
        """The plan of the last :meth:`plan` call (``KitsuneOptimizer.plan`` returns it)."""
        self.executes = False
        """Whether this subsystem updates any param itself (the orchestrator then evaluates closures first)."""
        self._opt: Any = None
        self._units: list[FusedUnit] = []
        self._shadows: list[TorchShadow] = []
        self._contexts: dict[torch.device, DeviceContext] = {}
        self._specs: tuple[UpdateSpec, ...] = ()
        self._info: AlgoInfo | None = None
        self._logged: set[str] = set()
        self._steps = 0
        self._launches_last_step = 0
        self._launches_total = 0
        self._handed_over: list[tuple[dict[str, Any], torch.device]] = []

    # -- planning ------------------------------------------------------------------------------------------------
    def plan(self, opt: KitsuneOptimizer) -> None:
        self._opt = opt
        base = opt.base_optimizer
        groups = opt.param_groups
        self._info = info = ALGOS.get(type(base))
        self._specs = tuple(info.spec(g) for g in groups) if info else ()
        whole = self._optimizer_reason(base, info)

        # classify every param: (device, dtype, spec, route-or-None, reason) -> params
        buckets: dict[tuple, list[tuple[int, torch.Tensor]]] = defaultdict(list)
        notes: dict[tuple, set[str]] = defaultdict(set)
        for gi, g in enumerate(groups):
            spec = self._specs[gi] if info else None
            group_reason = whole or _group_reason(g)
            for p in g["params"]:
                route, reason = group_reason if group_reason else self._param_reason(p, info)
                key = (str(p.device), p.dtype, spec if route is not Route.BASE_STEP else None, route, reason)
                buckets[key].append((gi, p))
                notes[key] |= _group_notes(g)

        plan = Plan()
        self._units, self._shadows = [], []
        for key, members in buckets.items():
            device, dtype, spec, route, reason = key
            bp = self._plan_bucket(base, info, device, dtype, spec, route, reason, members)
            bp.notes = sorted(notes[key]) if bp.route is Route.TRITON else []
            plan.buckets.append(bp)
            self._build(base, info, bp, spec, members, opt.state)
        self.current_plan = plan

        self._contexts = {}
        if self._units:
            for unit in self._units:
                self._contexts.setdefault(unit.device, DeviceContext(unit.device, info.row))  # type: ignore[union-attr]
        self.executes = bool(self._units or self._shadows)
        for b in plan.buckets:
            if b.route is not Route.TRITON and b.reason not in self._logged:
                self._logged.add(b.reason)
                logger.info(
                    "kitsune fusion: %d %s tensor(s) on %s: %s", b.tensors, b.optimizer, b.route.value, b.reason
                )
        if self.executes:
            self.activate()
        else:
            reasons = "; ".join(sorted({b.reason for b in plan.buckets})) or "no params"
            self.deactivate(f"nothing to fuse: {reasons}")

    def _optimizer_reason(self, base: torch.optim.Optimizer, info: AlgoInfo | None) -> tuple[Route, str] | None:
        """A reason that sends every param to the wrapped optimizer's own step, or None."""
        if not self.config.enabled:
            return Route.BASE_STEP, "fusion disabled (enable_fusion=False)"
        if not self.config.enable_elementwise:
            return Route.BASE_STEP, "fusion disabled by enable_elementwise=False"
        if info is None:
            names = ", ".join(i.name for i in ALGOS.values())
            return Route.BASE_STEP, (
                f"unknown optimizer class {type(base).__qualname__}: only exactly {names} are fused "
                "(a subclass may change the math), so it keeps its own step"
            )
        if torch.get_default_dtype() == torch.float64:
            return Route.BASE_STEP, "torch.set_default_dtype(torch.float64): torch keeps step counts in float64"
        return None

    def _param_reason(self, p: torch.Tensor, info: AlgoInfo | None) -> tuple[Route | None, str]:
        """(None, reason) when the fused kernel can take ``p``; else the fallback level and why."""
        if p.is_complex():
            return Route.BASE_STEP, "complex params: the fused kernels are real-only"
        if p.grad is not None and p.grad.layout != torch.strided:
            return Route.BASE_STEP, "sparse grads: only the optimizer's own step handles them"
        if p.device.type == "cpu" and not interpreting():
            return Route.BASE_STEP, (
                "CPU tensors: fused Triton kernels need CUDA (with TRITON_INTERPRET=1 they run on CPU, as in CI); "
                "the wrapped optimizer's own step keeps results bit-identical"
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
        if not p.is_contiguous():
            return _TORCH, "non-contiguous param: the fused kernel addresses flat memory"
        return None, "fused Triton multi-tensor kernel"

    def _plan_bucket(
        self,
        base: torch.optim.Optimizer,
        info: AlgoInfo | None,
        device: str,
        dtype: torch.dtype,
        spec: UpdateSpec | None,
        route: Route | None,
        reason: str,
        members: list[tuple[int, torch.Tensor]],
    ) -> BucketPlan:
        tensors = len(members)
        elements = sum(p.numel() for _, p in members)
        bp = BucketPlan(
            device=device,
            dtype=str(dtype).removeprefix("torch."),
            optimizer=type(base).__name__,
            options=spec.describe() if spec else "-",
            route=Route.BASE_STEP,
            reason=reason,
            tensors=tensors,
            elements=elements,
            launches=0,
            groups=sorted({gi for gi, _ in members}),
        )
        if info is not None and self._specs:  # a known algorithm moves known bytes, whichever route runs it
            bp.bytes_per_step = sum(
                p.numel() * p.element_size() * info.bytes_per_element(self._specs[gi]) for gi, p in members
            )
        if route is Route.BASE_STEP:
            return bp
        assert info is not None and spec is not None
        fallback = _torch_route(info, torch.device(device), dtype)
        if route is None:  # fusable: does it pay?
            nbytes = elements * dtype.itemsize * info.bytes_per_element(spec)
            launches = math.ceil(tensors / self.config.max_fusion_size) if self.config.max_fusion_size else 1
            fused = self.cost_model.triton(tensors, nbytes, launches)
            if fallback is Route.TORCH_FUSED:
                other = self.cost_model.torch_fused(tensors, nbytes)
            else:  # foreach, or the optimizer's own per-tensor loop, which is slower still
                other = self.cost_model.torch_foreach(tensors, nbytes, max(info.foreach_launches, 1))
            bp.predicted_speedup = round(other / fused, 3)
            if bp.predicted_speedup >= self.config.min_fusion_benefit:
                bp.route, bp.launches = Route.TRITON, launches
                return bp
            bp.reason = (
                f"predicted speedup {bp.predicted_speedup:.2f}x is below min_fusion_benefit="
                f"{self.config.min_fusion_benefit:g}"
            )
        bp.route = fallback
        if fallback is Route.BASE_STEP:
            bp.reason += f"; {bp.optimizer} has no torch fused/foreach path on {device}"
        return bp

    def _build(
        self,
        base: torch.optim.Optimizer,
        info: AlgoInfo | None,
        bp: BucketPlan,
        spec: UpdateSpec | None,
        members: list[tuple[int, torch.Tensor]],
        state: Any,
    ) -> None:
        """Create the executors of one planned bucket."""
        if bp.route is Route.TRITON:
            assert info is not None and spec is not None
            size = self.config.max_fusion_size or len(members)
            for start in range(0, len(members), size):
                chunk = members[start : start + size]
                self._units.append(
                    FusedUnit([p for _, p in chunk], [gi for gi, _ in chunk], info, spec, state, self.block)
                )
        elif bp.route in (Route.TORCH_FUSED, Route.TORCH_FOREACH):
            by_group: dict[int, list[torch.Tensor]] = defaultdict(list)
            for gi, p in members:
                by_group[gi].append(p)
            try:
                self._shadows.append(TorchShadow(base, bp.route, dict(by_group)))
            except Exception as exc:  # torch refused the flags: the optimizer's own step still works
                bp.reason += f"; torch {bp.route.value} unavailable ({exc})"
                bp.route = Route.BASE_STEP

    # -- the step --------------------------------------------------------------------------------------------------
    def step(self, ctx: StepContext) -> None:
        opt = self._opt
        groups = opt.param_groups
        if self._info is not None and tuple(self._info.spec(g) for g in groups) != self._specs:
            self.plan(opt)  # a switch changed (e.g. momentum set to 0, amsgrad turned on): new kernel variants
        state = opt.state
        live = [unit for unit in self._units if unit.prepare(state, groups)]
        if any(unit.stale for unit in self._units):
            self.plan(opt)  # a param's storage moved; rebind everything and scan again
            live = [unit for unit in self._units if unit.prepare(state, groups)]
        if live:
            from kitsune.kernels.update import multi_tensor_update

            for context in self._contexts.values():
                context.refresh(groups)
            found_inf = ctx.extra.get("found_inf")  # AMP's overflow flag: the kernel skips on the device
            for unit in live:
                finf = found_inf if found_inf is None or found_inf.device == unit.device else found_inf.to(unit.device)
                multi_tensor_update(unit.tables, self._contexts[unit.device].buffer, unit.spec, unit.dtype, finf)
        handled = ctx.handled
        unhandled: list[torch.Tensor] = []
        for unit in self._units:
            handled.update(unit.param_set)  # a param whose grad is None is skipped by every route anyway
            unhandled += unit.unhandled
        for shadow in self._shadows:
            shadow.step(groups, ctx.extra.get("found_inf"))
            handled.update(shadow.param_set)
        if unhandled:  # sparse grads met at step time: the wrapped optimizer's own step must take them
            handled.difference_update(unhandled)
            ctx.unhandled += unhandled
            self._note_once(f"{len(unhandled)} param(s) got sparse grads: left to the optimizer's own step")
        self._steps += 1
        self._launches_last_step = len(live)
        self._launches_total += len(live)

    def _note_once(self, reason: str) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            logger.info("kitsune fusion: %s", reason)

    # -- the profiler's live comparison ---------------------------------------------------------------------------
    def hand_over(self) -> None:
        """Prepare for steps in which the wrapped optimizer's own step updates every param (the profiler's live
        comparison): put each ``state["step"]`` where that step keeps it.

        The fused path keeps step counts on the device, as torch's fused and capturable paths do; torch's other
        paths read them on the host, which on device tensors costs one sync per param and would time a step the
        user never runs. Moving them costs one sync here, before the timed steps begin.
        """
        state = self._opt.state
        moved = []
        for g in self._opt.param_groups:
            if g.get("capturable") or g.get("fused"):
                continue  # torch keeps these on the device too
            for p in g["params"]:
                t = state[p].get("step") if p in state else None
                if isinstance(t, torch.Tensor) and t.device.type != "cpu":
                    moved.append((state[p], t.device, t))
        if moved:
            host = torch.stack([t for _, _, t in moved]).cpu()
            for (s, _, _), value in zip(moved, host, strict=True):
                s["step"] = value.clone()
        self._handed_over = [(s, device) for s, device, _ in moved]

    def take_back(self) -> None:
        """Undo :meth:`hand_over`: step counts back on the device and the kernels' tables rebound to them."""
        for s, device in self._handed_over:
            t = s.get("step")
            if isinstance(t, torch.Tensor):
                s["step"] = t.to(device)
        self._handed_over = []
        for unit in self._units:
            unit.bind(self._opt.state)

    # -- what the orchestrator and the summary read ----------------------------------------------------------------
    def owned_params(self) -> list[torch.Tensor]:
        """Params this subsystem updates (the orchestrator skips the wrapped step when it owns them all)."""
        return [p for u in self._units for p in u.params] + [p for s in self._shadows for p in s.params]

    @property
    def consumes_found_inf(self) -> bool:
        """Whether every update this subsystem runs skips an AMP overflow on the device (no host sync): the fused
        kernel and torch's fused path do; torch's foreach path cannot."""
        return all(s.route is Route.TORCH_FUSED for s in self._shadows)

    @property
    def launches_last_step(self) -> int:
        """Fused Triton launches of the last step (units whose grads were all None launch nothing)."""
        return self._launches_last_step

    def report(self) -> dict[str, Any]:
        plan = self.current_plan
        tables = sum(u.tables.uploads for u in self._units)
        contexts = sum(c.uploads for c in self._contexts.values())
        return {
            "plan": plan.to_dict() if plan else None,
            "fused_launches_per_step": self._launches_last_step,
            "fused_launches_total": self._launches_total,
            "params_fused": plan.fused_tensors if plan else 0,
            "params_fallen_back": plan.fallback_tensors if plan else 0,
            "table_uploads": tables,
            "context_uploads": contexts,
            "steps": self._steps,
        }


def _torch_route(info: AlgoInfo, device: torch.device, dtype: torch.dtype) -> Route:
    if device.type in info.torch_fused_devices and dtype in _TORCH_DTYPES:
        return Route.TORCH_FUSED
    return Route.TORCH_FOREACH if info.torch_foreach else Route.BASE_STEP


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
