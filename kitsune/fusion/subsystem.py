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
        self._launches_last_norm = 0
        self._launches_last_launch = 0
        self._plan_version = 0
        self._handed_over: list[tuple[dict[str, Any], torch.device]] = []
        self.grad_pass: str | None = None
        """Why the grads' own passes (unscale, inf check, clip) cannot fuse into the norm and update kernels, or
        None when they can: every param on one device, updated by the fused kernel."""
        self._grads_cfg: Any = None
        self._norm: Any = None
        self._norm_out: torch.Tensor | None = None
        self._norm_dtypes: list[torch.dtype] = []

    # -- planning ------------------------------------------------------------------------------------------------
    def plan(self, opt: KitsuneOptimizer) -> None:
        self._plan_version += 1
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
        self._grads_cfg = opt.config.grads
        self._norm = None
        self._norm_out: torch.Tensor | None = None
        self._trust = any(u.spec.trust for u in self._units)
        self._offsets = [sum(len(u.params) for u in self._units[:i]) for i in range(len(self._units))]
        self._norm_dtypes = [u.dtype for u in self._units for _ in u.params]
        if self._trust:  # trust ratios need each param's norm too: the norm pass reads grads, then params
            self._norm_dtypes += self._norm_dtypes
        if not self._units:
            self.grad_pass = "no param takes the fused kernel"
        elif self._shadows or any(b.route is not Route.TRITON for b in plan.buckets):
            self.grad_pass = "some params fall back (see the plan), so the grads are unscaled and clipped by torch ops"
        elif len({u.device for u in self._units}) > 1:
            self.grad_pass = "params on several devices: the global norm is computed per device by torch ops"
        elif not self.config.enable_reduction:
            self.grad_pass = "enable_reduction=False: the grads are unscaled and clipped by torch ops"
        elif self._trust and self._grads_cfg.max_norm is not None and self._grads_cfg.norm_type != 2.0:
            self.grad_pass = "inf-norm clipping with trust ratios (2-norms): the clip runs as its own pass"
        else:
            self.grad_pass = None
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
        live = self.prepare(ctx)
        self.launch(ctx, live)
        self.finish(ctx, live)

    def prepare(self, ctx: StepContext) -> list[FusedUnit]:
        """The host half of a step: re-plan if a switch or a param's storage changed, point the tables at this
        step's grads, create missing state, refresh the hyperparameter buffer. Returns the units with a live grad."""
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
            for context in self._contexts.values():
                context.refresh(groups)
            if self._needs_norm(ctx):
                self._bind_norm()
        return live

    def _needs_norm(self, ctx: StepContext) -> bool:
        fused = ctx.extra.get("fused_grads", False)
        return self._trust or (fused and (self._grads_cfg.max_norm is not None or bool(ctx.extra.get("check_inf"))))

    def _bind_norm(self) -> None:
        """Point the norm pass at this step's grads (and the params, for trust ratios): host work, before launch."""
        if self._norm is None:
            from kitsune.kernels.norms import MultiTensorNorm

            numels = [p.numel() for u in self._units for p in u.params]
            norm_type = 2.0 if self._trust else self._grads_cfg.norm_type
            self._norm = MultiTensorNorm(numels * (2 if self._trust else 1), self._units[0].device, norm_type)
        addresses = [a for u in self._units for a in u.grad_addresses]
        if self._trust:
            addresses += [a for u in self._units for a in u.param_addresses]
        self._norm.bind_addresses(addresses, self._norm_dtypes)

    def launch(self, ctx: StepContext, units: list[FusedUnit]) -> None:
        """The device half of a step: the norm pass when the step needs one, then one update launch per unit in
        ``units``. Only device work, so a CUDA graph can capture it (then over every unit: a unit whose grads
        are all None this step does nothing, as its grad table says)."""
        if not units:
            return
        from kitsune.kernels.update import multi_tensor_update

        fused = ctx.extra.get("fused_grads", False)
        grad_scale = ctx.extra.get("grad_scale") if fused else None
        max_norm = self._grads_cfg.max_norm if fused else None
        total = norms = None
        timer = ctx.extra.get("phases")
        if self._needs_norm(ctx):
            total, norms = self._norm_pass(ctx, grad_scale, fused)
            if timer is not None:
                timer.mark("norm")
        found_inf = ctx.extra.get("found_inf")  # AMP's overflow flag: the kernel skips on the device
        n_norm = len(self._norm_dtypes) // 2 if self._trust else None
        grad_write = self._grad_write(ctx)
        for unit, offset in zip(self._units, self._offsets, strict=True):
            if unit not in units:
                continue
            finf = found_inf if found_inf is None or found_inf.device == unit.device else found_inf.to(unit.device)
            multi_tensor_update(
                unit.tables,
                self._contexts[unit.device].buffer,
                unit.spec,
                unit.dtype,
                finf,
                grad_scale=grad_scale,
                total_norm=total if max_norm is not None else None,
                max_norm=max_norm,
                grad_write=grad_write,
                tensor_norms=norms if unit.spec.trust else None,
                norm_offset=offset,
                n_norm=n_norm,
            )
        if timer is not None:
            timer.mark("update")
        self._launches_last_launch = len(units) + self._launches_last_norm
        self._launches_last_norm = 0

    def _grad_write(self, ctx: StepContext) -> int:
        if self._grads_cfg.zero_in_step:
            return 2
        fused = ctx.extra.get("fused_grads", False)
        scaled = fused and ctx.extra.get("grad_scale") is not None
        return 1 if scaled or (fused and self._grads_cfg.max_norm is not None) else 0

    def finish(self, ctx: StepContext, live: list[FusedUnit], launches: int | None = None) -> None:
        """After the launches: write back grads that stood in as contiguous copies, run the torch fallbacks, and
        tell the orchestrator which params were handled and which grads were zeroed."""
        groups = self._opt.param_groups
        zeroed: list[torch.Tensor] = []
        grad_write = self._grad_write(ctx) if live else 0
        for unit in live:
            if grad_write:
                unit.copy_back()
            if grad_write == 2:
                zeroed += unit.params
        ctx.extra["zeroed"] = zeroed
        handled = ctx.handled
        unhandled: list[torch.Tensor] = []
        for unit in self._units:
            handled.update(unit.param_set)  # a param whose grad is None is skipped by every route anyway
            unhandled += unit.unhandled
        for shadow in self._shadows:
            shadow.step(groups, ctx.extra.get("found_inf"))
            handled.update(shadow.param_set)
        if self._shadows and ctx.extra.get("phases") is not None:
            ctx.extra["phases"].mark("fallback")
        if unhandled:  # sparse grads met at step time: the wrapped optimizer's own step must take them
            handled.difference_update(unhandled)
            ctx.unhandled += unhandled
            self._note_once(f"{len(unhandled)} param(s) got sparse grads: left to the optimizer's own step")
        if launches is None:
            launches, self._launches_last_launch = (self._launches_last_launch if live else 0), 0
        self._steps += 1
        self._launches_last_step = launches
        self._launches_total += launches

    @property
    def units(self) -> list[FusedUnit]:
        """The fused launch units of the current plan."""
        return list(self._units)

    @property
    def plan_version(self) -> int:
        """Bumped by every :meth:`plan`: device buffers a captured graph holds may have been replaced."""
        return self._plan_version

    @property
    def graphable(self) -> str | None:
        """Why this plan cannot be captured in a CUDA graph, or None when it can: every param in a fused unit."""
        if not self._units:
            return "no param takes the fused kernel"
        if self._shadows or any(b.route is not Route.TRITON for b in self.current_plan.buckets):
            return "some params fall back to torch or the optimizer's own step (see the plan)"
        if len({u.device for u in self._units}) > 1:
            return "params on several devices"
        return None

    def _norm_pass(
        self, ctx: StepContext, grad_scale: torch.Tensor | None, fused: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pass one: every fused grad's norm (divided by ``grad_scale``) in one launch, then each param's when trust
        ratios need them; returns the global grad norm, in a fresh device scalar, and the per-tensor norms.

        ``fused`` (the grads' passes are fused into this step): the global norm is kept as ``ctx.extra["grad_norm"]``
        when clipping, and the inf/nan flag becomes ``found_inf`` for AMP."""
        norm = self._norm  # bound to this step's addresses by prepare()
        n_grads = len(self._norm_dtypes) // 2 if self._trust else len(self._norm_dtypes)
        if ctx.extra.get("static_outputs"):  # a CUDA graph writes the norm into the same buffer every replay
            if self._norm_out is None:
                self._norm_out = torch.zeros((), dtype=torch.float32, device=norm.device)
            out = self._norm_out
        else:
            out = torch.empty((), dtype=torch.float32, device=norm.device)
        result = norm.launch(grad_scale if fused else None, invert_scale=True, num_global=n_grads, out=out)
        if fused and ctx.extra.get("check_inf") and ctx.extra.get("found_inf") is None:
            ctx.extra["found_inf"] = result.found_inf
        if fused and self._grads_cfg.max_norm is not None:
            ctx.extra["grad_norm"] = out
        self._launches_last_norm = 1
        return out, result.per_tensor

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
            "grad_pass": "fused into the norm and update kernels" if self.grad_pass is None else self.grad_pass,
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
