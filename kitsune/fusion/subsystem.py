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
from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Any

import torch

from kitsune.config import FusionConfig
from kitsune.distributed import fsdp
from kitsune.fusion import muon_unit
from kitsune.fusion.algos import ALGOS, AlgoInfo
from kitsune.fusion.context import DeviceContext
from kitsune.fusion.plan import BucketPlan, CostModel, Plan, Route
from kitsune.fusion.units import FusedUnit, TorchShadow
from kitsune.kernels.multi_tensor import DEFAULT_BLOCK
from kitsune.kernels.spec import MuonSpec, UpdateSpec
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


_REPEATED = (
    Route.BASE_STEP,
    "a param listed more than once in the param groups: torch's step updates it once per listing (and warns), "
    "so the optimizer's own step keeps that; list each param once to fuse it",
)


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
        self._muon: list[muon_unit.MuonUnit] = []
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
        self._norm_groups: list[Any] = []
        """FSDP2: the process groups the norm pass's results are all-reduced over (empty without DTensor params)."""
        self._mesh: Any = None
        self.pool: Any = None
        self._backward_bytes: int | None = None
        """The memory pool (:class:`kitsune.memory.MemoryPool`) the orchestrator hands over, if any."""

    # -- planning ------------------------------------------------------------------------------------------------
    def plan(self, opt: KitsuneOptimizer) -> None:
        self._plan_version += 1
        self._opt = opt
        base = opt.base_optimizer
        groups = opt.param_groups
        self._info = info = ALGOS.get(type(base))
        self._specs = tuple(info.spec(g) for g in groups) if info else ()
        whole = self._optimizer_reason(base, info)
        from kitsune.streams import why_not_in_backward

        trust = any(getattr(spec, "trust", False) for spec in self._specs)
        self._backward_bytes = opt.config.streams.bucket_bytes if why_not_in_backward(opt, trust) is None else None

        self._mesh: Any = None  # the device mesh of the FSDP2 params the fused kernel takes (only one)
        # classify every param: (device, dtype, spec, route-or-None, reason) -> params
        buckets: dict[tuple, list[tuple[int, torch.Tensor]]] = defaultdict(list)
        notes: dict[tuple, set[str]] = defaultdict(set)
        shard = next((s for s in opt.subsystems if s.name == "shard" and s.active), None)
        remote = shard.remote if shard is not None else frozenset()  # sharded state: other ranks update these
        listed = Counter(id(p) for g in groups for p in g["params"])
        for gi, g in enumerate(groups):
            spec = self._specs[gi] if info else None
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
                else:
                    route, reason = self._param_reason(p, info)
                if route is None and fsdp.is_dtensor(p):
                    route, reason = self._shard_route(p, spec)
                key = (str(p.device), p.dtype, spec if route is not Route.BASE_STEP else None, route, reason)
                buckets[key].append((gi, p))
                notes[key] |= _group_notes(g)

        plan = Plan()
        self._units, self._shadows, self._muon = [], [], []
        self._stream_config = opt.config.streams
        for key, members in buckets.items():
            device, dtype, spec, route, reason = key
            bp = self._plan_bucket(base, info, device, dtype, spec, route, reason, members)
            bp.notes = sorted(notes[key]) if bp.route.fused else []
            plan.buckets.append(bp)
            self._build(base, info, bp, spec, members, opt.state)
        self.current_plan = plan
        if self.pool is not None:  # the memory pool places the units' state in its arenas
            pooled = [u for u in self._units if not u.sharded]
            self.pool.assign(pooled)
            if self._units and not pooled:
                self.pool.deactivate("FSDP2 (DTensor) params: their state stays per-shard DTensors, as torch keeps it")
            for unit in self._units:
                if unit.slots is not None:
                    unit.bind(opt.state)

        self._contexts = {}
        for unit in (*self._units, *self._muon):
            unit.static = opt.config.graphs.static_addresses
            unit.defaults = opt.defaults
            self._contexts.setdefault(unit.device, DeviceContext(unit.device, info.row))  # type: ignore[union-attr]
        self.executes = bool(self._units or self._shadows or self._muon)
        self._grads_cfg = opt.config.grads
        # FSDP2: the norm pass covers this rank's shards; an all-reduce over the mesh makes it global
        self._norm_groups = fsdp.mesh_groups(p for u in self._units if u.sharded for p in u.params[:1])
        self._norm = None
        self._norm_out: torch.Tensor | None = None
        self._trust = any(u.spec.trust for u in self._units)
        self._offsets = [sum(len(u.params) for u in self._units[:i]) for i in range(len(self._units))]
        self._norm_dtypes = [u.dtype for u in self._units for _ in u.params]
        if self._trust:  # trust ratios need each param's norm too: the norm pass reads grads, then params
            self._norm_dtypes += self._norm_dtypes
        if self._muon:
            self.grad_pass = "Muon's momentum kernel reads the grads outside the norm pass: torch ops unscale and clip"
        elif not self._units:
            self.grad_pass = "no param takes the fused kernel"
        elif self._shadows or any(b.route is not Route.TRITON for b in plan.buckets):
            self.grad_pass = "some params fall back (see the plan), so the grads are unscaled and clipped by torch ops"
        elif len({u.device for u in self._units}) > 1:
            self.grad_pass = "params on several devices: the global norm is computed per device by torch ops"
        elif len({u.sharded for u in self._units}) > 1:
            self.grad_pass = "FSDP2 (DTensor) and plain params mixed: the global norm is computed by torch ops"
        elif not self.config.enable_reduction:
            self.grad_pass = "enable_reduction=False: the grads are unscaled and clipped by torch ops"
        elif self._trust and self._grads_cfg.max_norm is not None and self._grads_cfg.norm_type != 2.0:
            self.grad_pass = "inf-norm clipping with trust ratios (2-norms): the clip runs as its own pass"
        else:
            self.grad_pass = None
        for b in plan.buckets:
            if not b.route.fused and b.reason not in self._logged:
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
        if getattr(base, "process_group", None) is not None:
            return Route.BASE_STEP, (
                "distributed Muon (process_group=...): its own step shares the Newton-Schulz work across the ranks"
            )
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
            return Route.TORCH_FOREACH, (
                "non-contiguous param: the fused kernel addresses flat memory (torch's foreach path takes it: "
                "torch's fused kernels need each grad laid out as its param)"
            )
        return None, "fused Triton multi-tensor kernel"

    def _shard_route(self, p: torch.Tensor, spec: Any) -> tuple[Route | None, str]:
        """For a DTensor param the fused kernel could otherwise take: (None, reason) when it runs on the local
        shard (FSDP2); else the wrapped optimizer's own step and why (see :mod:`kitsune.distributed.fsdp`)."""
        why = fsdp.shard_reason(p)
        if why is None and isinstance(spec, MuonSpec):
            why = "Muon orthogonalises whole matrices, not FSDP2 shards: the wrapped optimizer's own step updates it"
        elif why is None and getattr(spec, "trust", None):
            why = "LAMB/LARS trust ratios need whole-tensor norms, not a shard's: the optimizer's own step updates it"
        elif why is None and self._mesh is not None and p.device_mesh != self._mesh:
            why = "DTensor on a second device mesh: the global grad norm is all-reduced over one FSDP2 mesh"
        if why is not None:
            return Route.BASE_STEP, why
        self._mesh = p.device_mesh
        return None, "fused Triton multi-tensor kernel on the local FSDP2 shards"

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
        elements = sum(fsdp.local(p).numel() for _, p in members)  # per rank, for FSDP2 shards
        aux = _unit_info(info, spec)
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
        if info is not None and self._specs:  # a known algorithm moves known bytes, whichever route runs it
            bp.bytes_per_step = sum(
                fsdp.local(p).numel() * p.element_size() * info.bytes_per_element(self._specs[gi]) for gi, p in members
            )
        if route is Route.BASE_STEP:
            return bp
        assert info is not None and spec is not None
        fallback = _torch_route(info, torch.device(device), dtype)
        if route is Route.TORCH_FOREACH and fallback is Route.TORCH_FUSED:
            fallback = Route.TORCH_FOREACH  # a non-contiguous param: torch's fused path misreads other grad layouts
        if route is None and isinstance(spec, MuonSpec):
            muon_unit.plan_bucket(bp, members, spec, self.config, self.cost_model)
            return bp
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
            unit_info = _unit_info(info, spec)
            for chunk in self._chunks(members):
                self._units.append(
                    FusedUnit([p for _, p in chunk], [gi for gi, _ in chunk], unit_info, spec, state, self.block)
                )
        elif bp.route is Route.TRITON_MATMUL:
            assert info is not None and isinstance(spec, MuonSpec)
            for chunk in muon_unit.chunks(members, self.config.max_fusion_size):
                params, gis = [p for _, p in chunk], [gi for gi, _ in chunk]
                self._muon.append(muon_unit.MuonUnit(params, gis, info, spec, state, self._stream_config, self.block))
        elif bp.route in (Route.TORCH_FUSED, Route.TORCH_FOREACH):
            by_group: dict[int, list[torch.Tensor]] = defaultdict(list)
            for gi, p in members:
                by_group[gi].append(p)
            try:
                self._shadows.append(TorchShadow(base, bp.route, dict(by_group)))
            except Exception as exc:  # torch refused the flags: the optimizer's own step still works
                bp.reason += f"; torch {bp.route.value} unavailable ({exc})"
                bp.route = Route.BASE_STEP

    def _chunks(self, members: list[tuple[int, torch.Tensor]]) -> list[list[tuple[int, torch.Tensor]]]:
        """A bucket's launch units: at most ``max_fusion_size`` tensors each; with updates in backward, also at most
        about ``bucket_bytes`` of params each, in reverse registration order (the order backward finishes grads)."""
        size = self.config.max_fusion_size or max(len(members), 1)
        if self._backward_bytes is None:
            return [members[start : start + size] for start in range(0, len(members), size)]
        chunks: list[list[tuple[int, torch.Tensor]]] = [[]]
        nbytes = 0
        for gi, p in reversed(members):
            if chunks[-1] and (nbytes >= self._backward_bytes or len(chunks[-1]) >= size):
                chunks.append([])
                nbytes = 0
            chunks[-1].append((gi, p))
            nbytes += p.numel() * p.element_size()
        return chunks

    def refresh_contexts(self) -> None:
        """Copy changed hyperparameters into each device's buffer (host work; at most one copy per device)."""
        for context in self._contexts.values():
            context.refresh(self._opt.param_groups)

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
        if not ctx.extra.get("structure_checked") and self._switches_changed(groups):
            self.plan(opt)  # a switch changed (e.g. momentum set to 0, amsgrad turned on): new kernel variants
        state = opt.state
        done = ctx.extra.get("updated_in_backward") or ()  # units the stream scheduler updated inside backward
        todo = [unit for i, unit in enumerate(self._units) if i not in done] if done else self._units
        live = [unit for unit in todo if unit.prepare(state, groups)]
        if any(unit.stale for unit in todo):
            self.plan(opt)  # a param's storage moved; rebind everything and scan again
            live = [unit for unit in self._units if unit.prepare(state, groups)]
        if self._muon:
            live += [unit for unit in self._muon if unit.prepare(state, groups)]
            if any(unit.stale for unit in self._muon):
                self.plan(opt)
                live = [unit for unit in (*self._units, *self._muon) if unit.prepare(state, groups)]
        self.forget_checks()
        if ctx.extra.get("fused_grads") and (self._needs_norm(ctx) or ctx.extra.get("grad_scale") is not None):
            odd = [p for unit in (*self._units, *self._muon) for p in unit.unhandled]
            if odd:
                for unit in (*self._units, *self._muon):  # undo this step's lazy state: a failed step creates none
                    for p in unit.created:
                        state.pop(p, None)
                g = odd[0].grad
                fix = (
                    "give that layer dense grads (nn.Embedding(sparse=False)), or build the optimizer with "
                    "enable_fusion=False (float16 scaling then unscales sparse grads as GradScaler does; clipping "
                    "needs dense grads)"
                    if g.is_sparse
                    else "keep the grads in the params' dtype (p.grad_dtype = None)"
                )
                raise ValueError(
                    f"kitsune: {len(odd)} param(s) got grads the fused kernels cannot read (the first: a "
                    f"{tuple(odd[0].shape)} {odd[0].dtype} param with a {g.layout} {g.dtype} grad). With float16 loss "
                    "scaling or max_grad_norm, kitsune unscales and clips inside those kernels, so every grad must "
                    f"be dense and of its param's dtype: {fix}, or turn off max_grad_norm and float16 scaling. "
                    "Nothing was updated."
                )
        if live:
            self.refresh_contexts()
            if self._needs_norm(ctx):
                self._bind_norm()
        return live

    def needs_replan(self, groups: list[dict[str, Any]]) -> bool:
        """Before a step decides how the grads are clipped and unscaled: whether a switch changed or a param's
        storage moved, either of which re-plans (and may send params to another route, which changes that). Every
        unit is asked, so that each one's :meth:`FusedUnit.prepare` skips the param check this step."""
        if self._switches_changed(groups):
            return True
        return any([unit.moved() for units in (self._units, self._muon) for unit in units])  # a list: ask them all

    def forget_checks(self) -> None:
        """:meth:`needs_replan`'s finding holds for one step: after its prepare, or a step that raised."""
        for unit in (*self._units, *self._muon):
            unit.params_checked = False

    def unchanged(self) -> bool:
        """Whether every unit's grads and params sit where the last step found them, with no copies, lazy state or
        sparse grads pending: then the last step's tables, norm binding and launches hold for this one as well (the
        caller has checked that the groups' values are those the last step used). C++ checks (or, with static
        addresses, the units' watches) only, no uploads."""
        return all(u.still() for units in (self._units, self._muon) for u in units)

    def refresh_values(self, groups: list[dict[str, Any]]) -> bool:
        """A group's values changed between two steady replays: refresh the hyperparameter buffers, or return False
        when a switch changed (the kernels must be planned again, through :meth:`prepare`)."""
        if self._switches_changed(groups):
            return False
        self.refresh_contexts()
        return True

    def _switches_changed(self, groups: list[dict[str, Any]]) -> bool:
        """Whether a group's kernel switches differ from the plan's (another compiled variant is needed)."""
        return self._info is not None and tuple(self._info.spec(g) for g in groups) != self._specs

    def count_replay(self) -> None:
        """Book a step that replayed the captured launches without coming through :meth:`prepare`."""
        self._count_step(1)

    def _count_step(self, launches: int) -> None:
        self._steps += 1
        self._launches_last_step = launches
        self._launches_total += launches

    def _needs_norm(self, ctx: StepContext) -> bool:
        fused = ctx.extra.get("fused_grads", False)
        return self._trust or (fused and (self._grads_cfg.max_norm is not None or bool(ctx.extra.get("check_inf"))))

    def _bind_norm(self) -> None:
        """Point the norm pass at this step's grads (and the params, for trust ratios): host work, before launch."""
        if self._norm is None:
            from kitsune.kernels.norms import MultiTensorNorm

            numels = [n for u in self._units for n in u.numels]
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
        muon = [unit for unit in self._muon if unit in units]
        for unit in muon:  # momentum, Newton-Schulz by shape, update
            finf = found_inf if found_inf is None or found_inf.device == unit.device else found_inf.to(unit.device)
            unit.launch(
                self._contexts[unit.device].buffer, finf, grad_write == 2, graphed=bool(ctx.extra.get("graphed_work"))
            )
        if timer is not None:
            timer.mark("update")
        muon_launches = sum(unit.launches for unit in muon)
        self._launches_last_launch = len(units) - len(muon) + muon_launches + self._launches_last_norm
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
        for unit in (*self._units, *self._muon):
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
            self._note_once(
                f"{len(unhandled)} param(s) got sparse grads, or grads of another dtype than the param's: left to "
                "the optimizer's own step"
            )
        if launches is None:
            launches, self._launches_last_launch = (self._launches_last_launch if live else 0), 0
        self._count_step(launches)

    @property
    def units(self) -> list[FusedUnit]:
        """The fused launch units of the current plan."""
        return list(self._units)

    @property
    def plan_version(self) -> int:
        """Bumped by every :meth:`plan`: device buffers a captured graph holds may have been replaced."""
        return self._plan_version

    @property
    def launch_units(self) -> list[FusedUnit]:
        """Every unit a step launches: the multi-tensor units, then the Muon units."""
        return [*self._units, *self._muon]

    @property
    def graphable(self) -> str | None:
        """Why this plan cannot be captured in a CUDA graph, or None when it can: every param in a fused unit (the
        multi-tensor kernels or Muon's, whose Newton-Schulz calls join the capture)."""
        if not self._units and not self._muon:
            return "no param takes the fused kernel"
        fused = (Route.TRITON, Route.TRITON_MATMUL)
        if self._shadows or any(b.route not in fused for b in self.current_plan.buckets):
            return "some params fall back to torch or the optimizer's own step (see the plan)"
        if len({u.device for u in self.launch_units}) > 1:
            return "params on several devices"
        if self._norm_groups:
            return "FSDP2 params: the grad norm's all-reduce runs outside a CUDA graph"
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
        if fused and self._norm_groups:  # FSDP2: this rank's shards only; reduce over the mesh, on the device
            check = ctx.extra.get("check_inf") and ctx.extra.get("found_inf") is None
            fsdp.all_reduce_norm_(out, result.found_inf if check else None, norm.norm_type, self._norm_groups)
        reduce = ctx.extra.get("reduce_norm")  # sharded grads: combine every rank's norm and overflow flag
        if fused and reduce is not None:
            reduce(out, result.found_inf if ctx.extra.get("check_inf") else None)
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
        for unit in (*self._units, *self._muon):
            unit.bind(self._opt.state)

    # -- what the orchestrator and the summary read ----------------------------------------------------------------
    def owned_params(self) -> list[torch.Tensor]:
        """Params this subsystem updates (the orchestrator skips the wrapped step when it owns them all)."""
        units = (*self._units, *self._muon)
        return [p for u in units for p in u.params] + [p for s in self._shadows for p in s.params]

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
        tables = sum(u.tables.uploads for u in (*self._units, *self._muon))
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
            "static_addresses": self._static_report(),
        }

    def _static_report(self) -> dict[str, Any] | None:
        """With ``GraphConfig(static_addresses=True)``: how many units watch their addresses, the steps that
        checked them again (a watched grad or storage freed) and why a unit stopped watching."""
        units = [*self._units, *self._muon]
        if not any(u.static for u in units):
            return None
        off = sorted({u.static_off for u in units if u.static_off})
        return {
            "units_watching": sum(u.watching for u in units),
            "units": len(units),
            "rechecks": sum(u.rechecks for u in units),
            "stopped": off,
        }


def _torch_route(info: AlgoInfo, device: torch.device, dtype: torch.dtype) -> Route:
    if device.type in info.torch_fused_devices and dtype in _TORCH_DTYPES:
        return Route.TORCH_FUSED
    return Route.TORCH_FOREACH if info.torch_foreach else Route.BASE_STEP


def _unit_info(info: AlgoInfo | None, spec: Any) -> AlgoInfo | None:
    """The algorithm a bucket's units run: the optimizer's, or its auxiliary one (kitsune.optim.Muon's AdamW)."""
    return info.aux if info is not None and info.aux is not None and isinstance(spec, UpdateSpec) else info


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
