"""The fused executor: runs the plan's fused units (and torch's fused/foreach fallbacks) every step.

A step goes through it in stages (kitsune/optimizer.py calls them in this order):

1. `FusionSubsystem.check`: what can raise before anything changes (a checkpoint's state missing a key the
   optimizer reads, where torch raises ``KeyError``);
2. `FusionSubsystem.prepare`: host work: each unit's tables pointed at this step's grads, lazy state created
   (removed again by `FusionSubsystem.undo` when the step raises later), hyperparameters refreshed;
3. `FusionSubsystem.run_fallbacks`: torch's own fused/foreach steps for the buckets routed there (torch's
   checks can raise: they run before any fused launch);
4. `FusionSubsystem.launch`: device work only (the norm pass, then one update launch per unit), so a CUDA
   graph can capture it; `FusionSubsystem.finish` books what it did.

The plan itself comes from `kitsune.fusion.planner.Planner`; state lives in the wrapped optimizer's
``state`` (or the memory pool's arenas, when one is handed over).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any

import torch

from kitsune import _native
from kitsune._native import MOVED, OTHER, SAME
from kitsune.config import FusionConfig, GradConfig, StreamConfig
from kitsune.distributed import fsdp
from kitsune.fusion import state_format
from kitsune.fusion.algos import KAHAN_COMP, AlgoInfo
from kitsune.fusion.context import DeviceContext
from kitsune.fusion.muon_unit import MuonUnit
from kitsune.fusion.plan import CostModel, Plan, Route
from kitsune.fusion.planner import Planner, group_switches
from kitsune.fusion.state_watch import StateWatch
from kitsune.fusion.torch_route import TorchShadow, without
from kitsune.fusion.units import FusedUnit
from kitsune.kernels.multi_tensor import DEFAULT_BLOCK
from kitsune.kernels.spec import StateFormat
from kitsune.memory import MemoryPool
from kitsune.optim.base import EagerOptimizer, float_state
from kitsune.subsystem import StepState, Subsystem
from kitsune.wrapped import grads_hidden

logger = logging.getLogger("kitsune.fusion")


class Rerouted(Exception):
    """Raised by `FusionSubsystem.prepare` before anything changed: a fused kernel failed to compile on this device,
    the planner now routes its params to torch's step, and the step runs again on the new plan
    (``KitsuneOptimizer`` catches it). ``loss``: the closure's, where the step evaluated it before."""

    loss: Any = None


class FusionSubsystem(Subsystem):
    """Fused multi-tensor optimizer updates; see the module docstring for the stages."""

    name = "fusion"

    def __init__(
        self,
        config: FusionConfig,
        grads: GradConfig | None = None,
        streams: StreamConfig | None = None,
        static_addresses: bool = False,
        pool: MemoryPool | None = None,
        cost_model: CostModel | None = None,
        block: int = DEFAULT_BLOCK,
    ) -> None:
        super().__init__()
        self.config = config
        self._grads = grads or GradConfig()
        self._planner = Planner(config, self._grads, streams or StreamConfig(), cost_model, block)
        self._static = static_addresses
        self.pool = pool
        """The memory pool (`kitsune.memory.MemoryPool`): it places the fused units' state in its arenas."""
        self.current_plan: Plan | None = None
        """The plan of the last `plan` call (``KitsuneOptimizer.plan`` returns it)."""
        self.executes = False
        """Whether this subsystem updates any param itself (the orchestrator then evaluates closures first)."""
        self.grad_pass: str | None = None
        """Why the grads' own passes (unscale, inf check, clip) cannot fuse into the norm and update kernels, or
        None when they can: every param on one device, updated by the fused kernel."""
        self._base: Any = None
        self._plan_args: tuple[Collection[torch.Tensor], int | None] = (frozenset(), None)
        self._units: list[FusedUnit] = []
        self._shadows: list[TorchShadow] = []
        self._idle: list[torch.Tensor] = []
        """The params of a plan that fuses none (`needs_replan` watches their storages), else empty."""
        self._idle_ptrs: list[int] = []
        self._narrowed: list[torch.Tensor] = []
        """Params on the wrapped step for their state's wider dtype (`Planned.narrowed`): a storage of theirs that
        moves (cast back) plans again."""
        self._narrowed_ptrs: list[int] = []
        self._routed: list[torch.Tensor] = []
        """The params of torch's fused and foreach routes (`TorchShadow`): a dtype of theirs that changes
        (``model.float()`` after ``model.double()``) plans again, as their route and state may no longer hold."""
        self._routed_dtypes: list[torch.dtype] = []
        self._one_dtype_shadows: list[tuple[TorchShadow, bool]] = []
        """Each shadow and whether its groups' own step needs each grad in its param's dtype (`_refuse_mixed`)."""
        self._foreach_one_dtype = False
        """Whether a shadow on torch's foreach route needs that: it steps every param itself, so each step looks."""
        self._strict: dict[torch.Tensor, tuple[str, ...]] = {}
        """`Planned.strict`: narrowed params whose own step needs each grad in its state's dtype
        (`refuse_unmatched`)."""
        self._journal: list[tuple[dict[str, Any], dict[str, Any]]] | None = None
        """Each param's state entries as they were before a re-plan inside this step (`journal`), which converts
        state (a cast to the params' new dtype, 8-bit decoded, the pool's views): a step that raises puts them
        back (`restore_journal`), so a refused step leaves the state as it found it."""
        self._folded: list[tuple[torch.Tensor, torch.Tensor]] = []
        """Params that took their Kahan compensation in during this step's re-plan, each with its value before."""
        self._replan_next = False
        self._muon: list[MuonUnit] = []
        self._handled: frozenset[torch.Tensor] = frozenset()
        self._contexts: dict[torch.device, DeviceContext] = {}
        self._switches: tuple[Any, ...] = ()
        self._switch_keys: frozenset[str] | None = None  # the keys they were read from (None: every key)
        self._info: AlgoInfo | None = None
        self._logged: set[str] = set()
        self._steps = 0
        self._state_seen: tuple[Any, int] = (None, 0)
        """The wrapped optimizer's state dict and its size after the last plan or step (`_state_moved`)."""
        self._lazy: list[torch.Tensor] = []
        """Uninitialized params (lazy modules before their first forward), left out of the plan until they are made."""
        self._state_watch = StateWatch()
        """The bound params' state dicts and tensors: one replaced while other code holds the old (`_state_moved`)."""
        self._launches_last_step = 0
        self._launches_total = 0
        self._launches_last_norm = 0
        self._launches_last_launch = 0
        self._plan_version = 0
        self._handed_over: list[tuple[dict[str, Any], str, torch.device]] = []
        self._prepared: list[FusedUnit] = []
        """The units this step's `prepare` went through (whose lazy state `undo` removes); emptied when the step
        finishes, so a later step that raises before its own `prepare` takes back nothing."""
        self._launched: dict[int, FusedUnit] = {}
        """The units (by id) whose update was queued since the last step finished (in the step, or inside
        backward): what they wrote stands, so a step that raises after that keeps their state as their kernels left
        it (`undo`, `restore_journal`)."""
        self._compiled: set[tuple[Any, ...]] = set()
        """The launch variants (`prepare`'s key) whose kernels `_compile_ahead` compiled for this plan."""
        self._updated: list[torch.Tensor] = []
        """This step's params updated inside backward by the units of the plan before (`prepare`)."""
        self._kernels: Any = None  # kitsune.kernels.update, imported at the first plan with units
        self._pending_skips: list[tuple[list[torch.Tensor], torch.Tensor, Any]] = []
        """Steps that created lazy state and may have been skipped by AMP on the device: the params, a pinned copy
        of the overflow flag, the event after which it holds (`settle_skips`)."""
        self._trust = False
        self._offsets: list[int] = []
        self._norm: Any = None
        self._norm_out: torch.Tensor | None = None
        self._norm_dtypes: list[torch.dtype] = []
        self.low_precision: str | None = None
        """Why the wrapped optimizer's own step cannot run on this plan's state, when some of it is in a format only
        the fused kernels take (8-bit, or float state of another dtype than the param's), or None."""
        self._norm_groups: list[Any] = []
        """FSDP2: the process groups the norm pass's results are all-reduced over (empty without DTensor params)."""

    # -- planning ------------------------------------------------------------------------------------------------
    def plan(
        self,
        base: torch.optim.Optimizer,
        remote: Collection[torch.Tensor] = frozenset(),
        backward_bytes: int | None = None,
    ) -> None:
        """Plan ``base``'s params (all but ``remote``, which other ranks update) and build the units; with
        ``backward_bytes`` the units are cut for updates inside backward."""
        self._plan_version += 1
        self._base, self._plan_args = base, (remote, backward_bytes)
        self._replan_next = False
        # a lazy module's params before its first forward: nothing to plan for them yet (they hold no memory and
        # take no grad), and the step after the forward that makes them plans again (`_others_moved`)
        self._lazy = [p for g in base.param_groups for p in g["params"] if torch.nn.parameter.is_lazy(p)]
        if self._lazy:
            remote = frozenset(remote) | frozenset(self._lazy)
        planned = self._planner.plan(base, remote, backward_bytes)
        self._fold_compensation(base)
        low_params = {p for u in planned.units if u.spec.state != StateFormat.PARAM for p in u.params}
        # the others' 8-bit state, or float state of another dtype, now as their steps read it: route that
        if state_format.decode_others(base.state, low_params, planned.own_step):
            planned = self._planner.plan(base, remote, backward_bytes)
        counts = {p: c for u in self._units for p, c in u.private_steps()}
        for unit in planned.units:
            unit.carry_steps(counts)
        self._info, self._switches, self._switch_keys = planned.info, planned.switches, planned.switch_keys
        self._units, self._muon, self._shadows = planned.units, planned.muon, planned.shadows
        self._narrowed, self._narrowed_ptrs = planned.narrowed, _storages(planned.narrowed)
        self._strict = planned.strict
        self._routed = [p for shadow in planned.shadows for p in shadow.params]
        info, specs = planned.info, planned.specs
        self._one_dtype_shadows = [
            (shadow, info is not None and any(info.one_dtype_for(specs[i]) for i in shadow.group_index))
            for shadow in planned.shadows
        ]
        self._foreach_one_dtype = any(
            one for shadow, one in self._one_dtype_shadows if shadow.route is Route.TORCH_FOREACH
        )
        self._routed_dtypes = [p.dtype for p in self._routed]
        self._prepared = []  # the last step's units: the old plan's go with it (their slots hold the pool's arenas)
        self._compiled = set()
        if self._units and self._kernels is None:
            from kitsune.kernels import update

            self._kernels = update
        # the params a step updates itself, a set made once a plan (a step's `prepare` takes out the unhandled ones)
        self._handled = frozenset().union(*(x.param_set for x in (*self._units, *self._muon, *self._shadows)))
        self.current_plan = plan = planned.plan
        if self.pool is not None:  # the memory pool places the units' state in its arenas
            pooled = [u for u in self._units if not u.sharded]
            self.pool.assign(pooled)
            if self._units and not pooled:
                self.pool.deactivate("FSDP2 (DTensor) params: their state stays per-shard DTensors, as torch keeps it")
            for unit in self._units:
                if unit.slots is not None:
                    unit.bind(base.state)
        self._contexts = {}
        for unit in (*self._units, *self._muon):
            unit.static = self._static
            unit.native = self.config.native_checks
            unit.defaults = base.defaults
            if unit.device not in self._contexts:
                self._contexts[unit.device] = DeviceContext(unit.device, self._info.row, self._value_check(base))  # type: ignore[union-attr]
        self.executes = bool(self._units or self._shadows or self._muon)
        # nothing to run: the params' storages, for a move that may change their routes (model.cuda() after wrapping)
        self._idle = [] if self.executes else [p for g in base.param_groups for p in g["params"] if p not in remote]
        self._idle_ptrs = _storages(self._idle)
        # 8-bit state, and float state of another dtype than the params (the planner leaves fp32 state of fp32
        # params in PARAM): torch's foreach and fused steps (CUDA's default) take each state tensor in its param's
        # dtype, and Adam's family lerps the grads into it
        low = [u for u in self._units if u.spec.state != StateFormat.PARAM]
        names = ", ".join(sorted({state_format.NAMES[u.spec.state] for u in low}))
        self.low_precision = (
            f"optimizer state its own step cannot read ({names} state: FusionConfig.state_precision)" if low else None
        )
        if self.config.native_checks and any(u.checks_natively for u in (*self._units, *self._muon)):
            _native.start()  # in the background, once per process; the Python checks run until it is ready
        # FSDP2: the norm pass covers this rank's shards; an all-reduce over the mesh makes it global
        self._norm_groups = fsdp.mesh_groups(p for u in self._units if u.sharded for p in u.params[:1])
        self._norm = None
        self._norm_out = None
        self._trust = any(u.spec.trust for u in self._units)
        self._offsets = [sum(len(u.params) for u in self._units[:i]) for i in range(len(self._units))]
        self._norm_dtypes = [u.dtype for u in self._units for _ in u.params]
        if self._trust:  # trust ratios need each param's norm too: the norm pass reads grads, then params
            self._norm_dtypes += self._norm_dtypes
        self.grad_pass = self._planner.grad_pass(planned)
        for b in plan.buckets:
            if not b.route.fused:
                self._note_once(f"{b.tensors} {b.optimizer} tensor(s) on {b.route.value}: {b.reason}", b.reason)
        self._see_state()
        if self.executes:
            self.activate()
        else:
            reasons = sorted({b.reason for b in plan.buckets})
            if self._lazy:
                waiting = (
                    f"{len(self._lazy)} uninitialized param(s) of lazy modules, planned at the step after the forward "
                    "that makes them"
                )
                self.deactivate("nothing to fuse yet: " + "; ".join([waiting, *reasons]))
            else:
                self.deactivate(f"nothing to fuse: {'; '.join(reasons) or 'no params'}")

    # -- checkpoints ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The step counts kitsune keeps for params whose stochastic rounding reads them as its stream (SGD, Lion:
        torch's state holds none; `FusedUnit.private_steps`), by the param's position in the groups, as torch's state
        dict numbers params: a resumed run, or a copy, draws the bits the uninterrupted one would."""
        counted = [entries for u in self._units if u.spec.stochastic and (entries := u.private_steps())]
        if self._base is None or not counted:
            return {}
        position = {id(p): i for i, p in enumerate(p for g in self._base.param_groups for p in g["params"])}
        steps: dict[int, float] = {}
        for entries in counted:
            values = entries[0][1][0].tolist()  # the unit's counts, read once (a sync on a GPU: checkpoints only)
            steps |= {position[id(p)]: values[j] for p, (_, j) in entries if id(p) in position}
        return {"rounding_steps": steps}

    def check_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise ValueError(
                f"the state dict's kitsune entry has a fusion entry of type {type(state).__name__}: a dict (of "
                "rounding_steps) is expected. Nothing was loaded"
            )
        steps = state.get("rounding_steps", {})
        total = sum(len(g["params"]) for g in self._base.param_groups) if self._base is not None else 0
        if not isinstance(steps, dict) or not all(
            type(i) is int and 0 <= i < total and isinstance(c, (int, float)) and c >= 0 for i, c in steps.items()
        ):
            raise ValueError(
                "the state dict's kitsune entry has fusion rounding_steps that are no step counts of this optimizer's "
                f"params (a dict of param position -> count >= 0, positions below {total}). Nothing was loaded"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        steps = state.get("rounding_steps")
        if not steps or self._base is None:
            return
        params = [p for g in self._base.param_groups for p in g["params"]]
        saved = torch.tensor([float(c) for c in steps.values()], dtype=torch.float32)
        counts = {params[i]: (saved, j) for j, i in enumerate(steps)}
        for unit in self._units:
            if unit.spec.stochastic:
                unit.carry_steps(counts)

    def wide_state(self) -> set[torch.Tensor]:
        """The params whose state the plan keeps in another format than their dtype (`Planner.wide_state`): a load
        keeps their checkpoint's wider moments (`kitsune.fusion.state_format.restore_low`)."""
        return self._planner.wide_state(self._base) if self.active and self._base is not None else set()

    def bind_pooled(self) -> None:
        """Bind the pooled units to the wrapped optimizer's state again: after ``load_state_dict`` let go of the
        state it replaced, the loaded tensors that got memory of their own while the old arena views were still
        held move into the arenas (`kitsune.memory.UnitSlots.adopt`), so the pool's memory is not held twice."""
        if self.pool is None or not self.pool.active:
            return
        for unit in self._units:
            if unit.slots is not None:
                unit.bind(self._base.state)

    def _see_state(self) -> None:
        """Note the wrapped optimizer's state dict and its size as a plan or a step left them, and watch the dicts
        the units bound (`_state_moved`)."""
        state = self._base.state
        self._state_seen = (state, len(state))
        self._state_watch.native = self.config.native_checks
        self._state_watch.follow(state, (*self._units, *self._muon))

    def _state_moved(self) -> bool:
        """Whether the wrapped optimizer's state dict was replaced, or lost or gained params, since the last plan or
        step (``state.clear()``, ``del state[p]``, ``optimizer.state = ...``), or a bound param's dict or a tensor
        in it was replaced (`kitsune.fusion.state_watch`). The units' weak references see a bound tensor freed;
        these see what leaves the old tensors alive wherever something else holds them (a state_dict() taken
        before holds the very dicts), where the kernels would go on updating them."""
        return self._state_replaced() or self._state_watch.changed()

    def _state_replaced(self) -> bool:
        """Whether the state dict is another object, or holds another number of params, than the last plan or step
        left (no visit per param)."""
        state = self._base.state
        return state is not self._state_seen[0] or len(state) != self._state_seen[1]

    def _value_check(self, base: torch.optim.Optimizer) -> Callable[[dict[str, Any], str], None] | None:
        """What a group's values are checked with before they are uploaded: a kitsune.optim optimizer's own
        ``_check_values`` (the numbers its step refuses, its fused route refuses too), else the algorithm's
        `AlgoInfo.check`."""
        if isinstance(base, EagerOptimizer):
            return base._check_values
        return self._info.check if self._info is not None else None

    def _replan(self) -> None:
        self.plan(self._base, *self._plan_args)

    @property
    def base(self) -> torch.optim.Optimizer | None:
        """The wrapped optimizer the plan was made for (None before the first plan)."""
        return self._base

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's param groups, which the plan was made over."""
        return self._base.param_groups

    @property
    def trust(self) -> bool:
        """Whether a unit scales its update by a trust ratio (LAMB, LARS): one norm pass over every grad."""
        return self._trust

    # -- the step --------------------------------------------------------------------------------------------------
    def check(self, s: StepState) -> None:
        """What can make this step raise, checked before anything changes: a param about to get its first update
        (or, on torch's routes, any update) whose state misses a key the optimizer reads (torch raises ``KeyError``
        there too)."""
        self._prepared = []
        if not s.structure_checked and self._replan_pending():
            return  # `prepare` re-plans first and checks the new plan's units (this plan's may ask for a switch gone)
        state = self._base.state
        for unit in (*self._units, *self._muon):
            unit.check_state(state)
        for shadow in self._shadows:  # torch's routes run after the wrapped optimizer's own step
            shadow.check_state(state)

    def _replan_pending(self) -> bool:
        """Whether `prepare` re-plans before it binds (where the step did not check the structure before, as with
        updates inside backward or sharded state): a switch, the state, or a lazy module's params made since."""
        return (
            self._replan_next
            or self._switches_changed(self._base.param_groups)
            or self._state_moved()
            or self._lazy_made()
        )

    def prepare(self, s: StepState) -> list[FusedUnit]:
        """The host half of a step: re-plan if a switch or a param's storage changed (where the step did not check
        before), point the tables at this step's grads, create missing state, refresh the hyperparameter buffer.
        Fills ``s.handled`` and ``s.unhandled``; returns the units with a live grad."""
        groups, state = self._base.param_groups, self._base.state
        done = s.updated_in_backward  # units (of the plan as it stands) the stream scheduler updated inside backward
        # (a try of this step that a kernel failing to compile ended may have planned again since: its list)
        updated = [p for i in done for p in self._units[i].params] if done else list(s.updated_before)
        if not s.structure_checked and self._replan_pending():
            self.journal()  # the new plan converts state its units take: put back if the step raises
            self._replan()  # a switch changed (e.g. momentum set to 0, amsgrad turned on), or the state dict did
            self.check(s)  # the new plan's units: amsgrad turned on over a state without max_exp_avg_sq raises
            live = self._prepare_all(state, groups, updated)
            todo = self._units
        else:
            todo = [unit for i, unit in enumerate(self._units) if i not in done] if done else self._units
            live = self._prepare_units(todo, state, groups)
        if any(unit.stale for unit in todo):
            self._replan_within()  # a param's storage moved or a state tensor was freed; rebind everything, scan again
            todo = self._units
            live = self._prepare_all(state, groups, updated)
        if self._muon:
            live += self._prepare_units(self._muon, state, groups)
            if any(unit.stale for unit in self._muon):
                self._replan_within()
                live = self._prepare_units([*self._units, *self._muon], state, groups)
        self.forget_checks()
        if s.grad_write == 1:  # unscaled or clipped, left in the grads (zeroed ones are zeroed in place)
            self._refuse_overlapping()
        units = (*self._units, *self._muon)
        unhandled = [p for unit in units for p in unit.unhandled]
        for shadow in self._shadows:
            unhandled += shadow.find_unhandled()
        if unhandled or self._foreach_one_dtype:
            self._refuse_mixed(units)  # (torch's foreach route steps every param itself: each grad is looked at)
        # the global norm (clipping) and the overflow check need every grad; trust ratios are per tensor, and the
        # wrapped optimizer's own step computes those of the params it takes. A user's GradScaler has checked every
        # grad already: the grads the wrapped step takes are unscaled for it (`GradPass.unscale_left`)
        scaled = s.grad_scale is not None and not s.external_scaler
        if unhandled and s.fused_grads and (s.max_norm is not None or s.check_inf or scaled):
            self.undo()
            g = unhandled[0].grad
            fix = (
                "give that layer dense grads (nn.Embedding(sparse=False)), or build the optimizer with "
                "enable_fusion=False (float16 scaling then unscales sparse grads as GradScaler does; clipping "
                "needs dense grads)"
                if g.is_sparse
                else "keep the grads in the params' dtype (p.grad_dtype = None)"
            )
            raise ValueError(
                f"kitsune: {len(unhandled)} param(s) got grads the fused kernels cannot read (the first: a "
                f"{tuple(unhandled[0].shape)} {unhandled[0].dtype} param with a {g.layout} {g.dtype} grad). With "
                "float16 loss scaling or max_grad_norm, kitsune unscales and clips inside those kernels, so every "
                f"grad must be dense and of its param's dtype: {fix}, or turn off max_grad_norm and float16 scaling. "
                "Nothing was updated."
            )
        s.handled = self._handled  # a param whose grad is None is skipped by every route anyway
        self._updated = updated
        if updated:  # updated inside backward by the old plan's units: no route of a new plan takes them again
            s.handled = s.handled.union(updated)
        if unhandled:  # sparse grads met at step time: the wrapped optimizer's own step must take them
            s.handled = s.handled.difference(unhandled)
            s.unhandled = unhandled
            self._note_once(
                f"{len(unhandled)} param(s) got sparse grads, or grads of another dtype than the param's: left to "
                "the optimizer's own step"
            )
        if live:
            self.refresh_contexts()
            norm = self.needs_norm(s)
            if norm:
                self._bind_norm()
            variant = _variant(s, *self.grad_layout(self._units, norm))
            if variant not in self._compiled:
                self._compile_ahead(s, norm)
                self._compiled.add(variant)
        return live

    @property
    def updated(self) -> list[torch.Tensor]:
        """The params the last step's `prepare` found updated inside backward (a retry of the step carries them)."""
        return self._updated

    def _compile_ahead(self, s: StepState, norm: bool) -> None:
        """Compile the kernels `launch` runs this step, before anything changes (the wrapped optimizer's step, torch's
        routes, the first unit's update): where a kernel fails to compile on this device, every param is as it was,
        its params go to torch's route (`_compile`) and the step runs again on that plan (`Rerouted`). Once a plan and
        launch variant (`prepare` keys it); under Triton's interpreter a no-op (but Muon's, `MuonUnit.compile`)."""
        sharded = bool(self._plan_args[0]) or bool(self._norm_groups)  # ZeRO's remote params, FSDP2's mesh
        why = self._compile(s, norm, self._units, self._muon, refuse=not sharded)
        if why is None:
            return
        self.undo()
        if sharded:  # a rank alone on another route would run other collectives than its peers: they would wait
            raise RuntimeError(
                f"kitsune: a fused kernel failed to compile on this rank ({why}). With sharded state (zero_stage, "
                "FSDP2) every rank must take the same route, and this rank cannot move to torch's alone: nothing was "
                "updated. Build the optimizer with enable_fusion=False to run torch's step on every rank"
            )
        raise Rerouted(why)

    def compile_unit(self, s: StepState, unit: FusedUnit) -> bool:
        """An update inside backward: compile ``unit``'s launch before it runs (once a unit and launch variant). False
        where it failed: the unit does not update inside backward, and the step plans again (its params on torch's
        route) and updates them."""
        norm = self.needs_norm(s) and self._norm is not None
        vector = self._kernels.grad_vector(unit.tables, unit.spec)
        variant = (id(unit), *_variant(s, vector, norm and self._norm.vector()))
        if variant in self._compiled:
            return True
        if self._compile(s, norm, [unit]) is not None:
            return False
        self._compiled.add(variant)
        return True

    def _compile(
        self, s: StepState, norm: bool, units: list[FusedUnit], muon: Collection[MuonUnit] = (), refuse: bool = True
    ) -> str | None:
        """Compile the launches of step ``s`` over ``units`` and ``muon`` (and the norm pass's, with ``norm``) without
        running them (`MuonUnit.compile`). Every unit is tried; with ``refuse``, each that fails (every fused unit,
        where the norm pass failed) has its params routed to torch's step by the planner from the next plan on, and a
        warning says so. Returns the errors."""
        from kitsune.kernels.common import CompileError

        result = self._norm
        found_inf = s.found_inf
        if found_inf is None and norm and s.fused_grads and s.check_inf:
            found_inf = result.found_inf  # the norm pass's flag (what `_norm_pass` hands the update)
        total, norms = (result.total, result.per_tensor) if norm else (None, None)
        failed: list[tuple[list[Any], CompileError]] = []
        if norm:
            try:
                self._launch_norm(s, result.total, compile_only=True)
            except CompileError as exc:
                failed.append(([*self._units, *self._muon], exc))
        if not failed:
            for unit, offset in zip(self._units, self._offsets, strict=True):
                if unit in units:
                    try:
                        self._update(s, unit, offset, found_inf, total, norms, compile_only=True)
                    except CompileError as exc:
                        failed.append(([unit], exc))
            for m in muon:
                try:
                    m.compile(self._contexts[m.device].buffer, _on(found_inf, m.device), s.grad_write == 2)
                except CompileError as exc:
                    failed.append(([m], exc))
        if not failed:
            return None
        why = "; ".join(str(exc) for _, exc in failed)
        if not refuse:
            return why
        for bad, exc in failed:
            for unit in bad:
                self._planner.refuse(unit.device, unit.dtype, unit.spec, str(exc))
            logger.warning(
                "kitsune fusion: a fused kernel failed to compile on %s (%s); %d param(s) take torch's route from "
                "this step on (see optimizer.plan)",
                bad[0].device,
                exc,
                sum(len(u.params) for u in bad),
            )
        self._replan_next = True
        return why

    def _refuse_overlapping(self) -> None:
        """Raise before anything changes for a grad whose elements share memory (``.expand()``) on a step that
        leaves the grads unscaled or clipped (AMP, ``max_grad_norm``): the kernels read a contiguous copy, and what
        they write could not be copied back (torch's ``clip_grad_norm_`` and ``GradScaler.unscale_`` raise on such a
        grad too)."""
        for unit in self._units:
            g = unit.overlapping_grad
            if g is not None:
                self.undo()
                raise ValueError(
                    f"kitsune: a grad of shape {tuple(g.shape)} and strides {g.stride()} has elements that share "
                    "memory (made by .expand()?): with float16 loss scaling or max_grad_norm the step writes every "
                    "grad back unscaled or clipped, which such a grad cannot take (torch's clip_grad_norm_ and "
                    "GradScaler.unscale_ refuse it too). Give the param a grad of its own memory "
                    "(p.grad = p.grad.clone()). Nothing was updated."
                )

    def _refuse_mixed(self, units: tuple[FusedUnit, ...]) -> None:
        """Raise before anything changes for a grad of another dtype than its param (``p.grad_dtype``) that a unit
        or a shadow leaves to a wrapped optimizer whose own step needs one dtype (`AlgoInfo.one_dtype_for`): torch's
        would raise halfway."""
        left = [(unit.info.one_dtype_for(unit.spec), unit.unhandled) for unit in units]
        for shadow, one in self._one_dtype_shadows:
            # the foreach route steps every param itself (its `unhandled` is empty): each one's grad counts
            left.append((one, shadow.params if shadow.route is Route.TORCH_FOREACH else shadow.unhandled))
        for one_dtype, params in left:
            if not one_dtype:
                continue
            for p in params:
                g = p.grad
                if g is not None and g.layout == torch.strided and g.dtype != p.dtype:
                    self.undo()
                    raise ValueError(
                        f"kitsune: a {tuple(p.shape)} {p.dtype} param has a {g.dtype} grad (p.grad_dtype), which "
                        f"{type(self._base).__name__}'s step cannot take: it needs each grad in its param's dtype "
                        "and would raise halfway through the step. Keep the grads in the params' dtype "
                        "(p.grad_dtype = None), or the params in the grads' dtype. Nothing was updated."
                    )

    @property
    def checks_grads(self) -> bool:
        """Whether `refuse_unmatched` has params to look at: a step then evaluates its closure first."""
        return bool(self._strict)

    def refuse_unmatched(self) -> None:
        """Raise before anything changes where a narrowed param the wrapped step updates (`Planned.strict`: Adam's
        family after ``model.half()``) has a grad of another dtype than its state: that step lerps the grad into the
        state and would raise halfway. With the grads in the state's dtype it steps as torch's does. Asked by every
        step before its grads' passes, whoever updates the params (nothing to look at in most plans)."""
        if not self._strict:
            return
        state = self._base.state
        for p, scalars in self._strict.items():
            g = p.grad
            if g is None or g.layout != torch.strided:
                continue
            for key, t in float_state(state.get(p) or {}, scalars):
                if t.dtype == g.dtype:
                    continue
                self.undo()
                raise ValueError(
                    f"optimizer state {key!r} of a {tuple(p.shape)} {p.dtype} param is {t.dtype}: the param's dtype "
                    f"changed after its state was made (model.half() or model.to(dtype) after the optimizer was "
                    f"built?), and {type(self._base).__name__}'s step takes such state only with grads in its dtype "
                    f"(the grad is {g.dtype}): it would raise halfway through the step. Give the params "
                    f"{t.dtype} grads (p.grad_dtype = {t.dtype}), cast the params back, or, to round the state as "
                    "torch's load_state_dict does, reload it: optimizer.load_state_dict(optimizer.state_dict()). "
                    "Nothing was updated"
                )

    def _prepare_units(self, units: list[FusedUnit], state: Any, groups: list[dict[str, Any]]) -> list[FusedUnit]:
        """Prepare ``units``; those with a live grad. Each is in `_prepared` before it changes anything, so a step
        that raises later, in another unit's prepare too, undoes its state and grads (`undo`)."""
        self._prepared += units
        return [unit for unit in units if unit.prepare(state, groups)]

    def _replan_within(self) -> None:
        """`_replan` inside a step's `prepare`: the old plan's units prepared so far stay for `undo`."""
        prepared = self._prepared
        self.journal()
        self._replan()
        self._prepared = prepared

    def _prepare_all(self, state: Any, groups: list[dict[str, Any]], updated: list[torch.Tensor]) -> list[FusedUnit]:
        """Prepare every unit of a new plan; the params ``updated`` inside backward by the old plan's units are
        skipped this step, as params without a grad (their units of the new plan group them otherwise)."""
        if not updated:
            return self._prepare_units(self._units, state, groups)
        grads = [p.grad for p in updated]
        try:
            for p in updated:
                p.grad = None
            return self._prepare_units(self._units, state, groups)
        finally:
            for p, g in zip(updated, grads, strict=True):
                p.grad = g

    def begin_backward(self) -> bool:
        """Before a backward's first update: whether the plan holds for this step (no group's switch changed, the
        state dict is the plan's); then the hyperparameters' last change is uploaded. False: no update launches
        inside this backward, and step() re-plans and updates every param with the switches the groups hold now, as
        torch's step would."""
        if self._replan_pending():
            return False
        self.refresh_contexts()
        return True

    def hyper_changed(self) -> bool:
        """Whether a group's hyperparameters changed since the last upload: since the updates inside this backward,
        which used the uploaded values (a value set between ``backward()`` and ``step()``)."""
        groups = self._base.param_groups
        return any(context.differs(groups) for context in self._contexts.values())

    def prepare_unit(self, unit: FusedUnit) -> bool:
        """One unit's host work for an update inside backward: False when it has no grad, a param moved or the state
        dict was replaced or lost or gained params (the step re-plans). The state's entries were compared once for the
        whole backward (`begin_backward`), not again for each unit."""
        if self._state_replaced():
            return False
        binding = unit.binding
        ready = unit.prepare(self._base.state, self._base.param_groups) and not unit.stale
        unit.keep()  # an update inside backward is not undone: the grads it moved into the arena stay
        if unit.binding != binding:
            self._see_state()  # the state this unit's lazy init made (not a pass over every unit for each unit)
        return ready

    def undo(self) -> None:
        """A step that raised after `prepare`: remove the state it created (a failed step creates none), give the
        grads it moved into the pool's flat arena back to their params, and check the params' storages again on the
        retry (the units whose state went bind afresh: a plan at the next step). A unit whose update was queued
        before the step raised (an error after the launch: a CUDA error surfacing, an interrupt) keeps what its
        kernel wrote with. A step that raised before its `prepare` (a refusal of the grads' checks) finds nothing to
        undo: `finish` emptied the last step's list."""
        state = self._base.state
        launched = self._launched
        for unit in self._prepared:
            if id(unit) in launched:  # its kernel ran on this state and these grads: they stand
                unit.keep()
                continue
            unit.return_grads()
            for p in unit.created:
                state.pop(p, None)
            if unit.created:  # its tables may point at the state just removed: the next step binds it afresh
                self._replan_next = True
        self._prepared = []
        self.forget_checks()

    def _note_skip(self, s: StepState) -> None:
        """A step whose prepare created the lazy state of params on their first grad, with AMP's overflow flag on the
        device: if the flag skipped the update, that state must go again, as torch's skipped step never creates it
        (a checkpoint would hold zero moments, and an SGD ``momentum_buffer`` that torch's next step takes for one
        already started). The flag is copied to the host behind the launch, without a sync; `settle_skips` reads it
        before anything else looks at the state. On the CPU it is read at once."""
        found_inf = s.found_inf
        if found_inf is None:  # no AMP this step: nothing skips it
            return
        created = [p for unit in self._prepared for p in unit.created]
        if not created:
            return
        if not found_inf.is_cuda:
            if found_inf.item():
                self._drop_state(created)
            return
        if torch.cuda.is_current_stream_capturing():
            return
        flag = torch.empty((), dtype=found_inf.dtype, pin_memory=True)
        flag.copy_(found_inf.reshape(()), non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._pending_skips.append((created, flag, done))

    def settle_skips(self) -> None:
        """Remove the state that steps skipped by AMP's overflow flag created (`_note_skip`): at the next step, and
        before the state is read through the optimizer (``state``, ``state_dict``, a load, a copy). Waits only for
        those steps' own work, long done by the next step."""
        pending, self._pending_skips = self._pending_skips, []
        for created, flag, done in pending:
            done.synchronize()
            if flag.item():
                self._drop_state(created)

    def _drop_state(self, params: list[torch.Tensor]) -> None:
        """Remove ``params``' state (the units bound to it see it freed and plan again at the next step)."""
        state = self._base.state
        for p in params:
            state.pop(p, None)

    def run_fallbacks(self, s: StepState) -> None:
        """torch's fused/foreach steps for the buckets routed to them (``found_inf`` skips the fused route on the
        device)."""
        if not self._shadows:
            return
        groups = self._base.param_groups
        with grads_hidden(self._updated):  # (`prepare`: a new plan's torch route may hold params updated in backward)
            for shadow in self._shadows:
                shadow.step(groups, s.found_inf)
        if s.phases is not None:
            s.phases.mark("fallback")

    def execute(self, s: StepState, live: list[FusedUnit]) -> None:
        """This step's launches run eagerly, then booked."""
        self.launch(s, live)
        self.finish(s, live)

    def needs_replan(self) -> bool:
        """Before a step decides how the grads are clipped and unscaled: whether a switch changed, a param's storage
        moved or a state tensor the tables point at was freed, each of which re-plans (and may send params to
        another route, which changes that). Every unit is asked, so that each one's `FusedUnit.prepare` skips
        the param check this step (and, where the unit's native call read the grads in the same passes, the grads'
        too)."""
        if self._replan_next or self._switches_changed(self._base.param_groups):
            return True
        if not self.active:  # nothing fused or bound: a switch (differentiable=False) or a storage moved to another
            return self._lazy_made() or _storages(self._idle) != self._idle_ptrs  # device or dtype may change routes
        if self._state_moved() or self._others_moved():
            return True
        units = (*self._units, *self._muon)
        return any([unit.moved() for unit in units]) or any(unit.state_freed for unit in units)

    def journal(self) -> None:
        """Before a re-plan inside a step: note every param's state entries, once a step (a shallow copy of each
        param's dict, the tensors themselves unchanged), for `restore_journal`."""
        if self._journal is None and self._base is not None:
            self._journal = [(s, dict(s)) for s in self._base.state.values() if isinstance(s, dict)]

    def _fold_compensation(self, base: torch.optim.Optimizer) -> None:
        """``param_rounding='kahan'``, planned again inside a step because a 16-bit param became wider
        (``model.float()`` mid-run): the param takes its compensation into its value, and its state drops it, so
        the param holds ``p + comp``, the trajectory the compensation kept (left in the state, it would be added
        back after roundings it never saw, were the param made 16-bit again). A step that raises puts the param
        back (`restore_journal`, which restores the compensation too)."""
        if self.config.param_rounding != "kahan" or self._journal is None:
            return
        for g in base.param_groups:
            for p in g["params"]:
                s = base.state.get(p)
                comp = s.get(KAHAN_COMP) if isinstance(s, dict) else None
                if not isinstance(comp, torch.Tensor) or p.dtype in (torch.bfloat16, torch.float16):
                    continue
                if not p.is_floating_point() or comp.shape != p.shape or fsdp.is_dtensor(p):
                    continue
                self._folded.append((p, p.detach().clone()))
                with torch.no_grad():
                    p.add_(comp.to(device=p.device, dtype=p.dtype))
                del s[KAHAN_COMP]

    def restore_journal(self) -> None:
        """A step that raised: each param's state entries as `journal` noted them, where a re-plan inside the step
        converted them, and a re-plan at the next step (the plan of the step that raised was made for the converted
        state); a param that took its compensation in (`_fold_compensation`) as it was."""
        if self._launched:  # the kernels updated the converted state (and any folded param): it stands
            self.drop_journal()
            return
        journal, self._journal = self._journal, None
        folded, self._folded = self._folded, []
        with torch.no_grad():
            for p, before in folded:
                p.copy_(before)
        if not journal:
            return
        for s, before in journal:
            if s.keys() != before.keys() or any(s[k] is not v for k, v in before.items()):
                s.clear()
                s.update(before)
                self._replan_next = True

    def drop_journal(self) -> None:
        """A step that held, or raised after its kernels ran: its conversions stay."""
        self._journal = None
        self._folded = []
        self._launched = {}

    def _others_moved(self) -> bool:
        """Whether a param outside the units moved so that the plan may no longer hold: a narrowed one's storage
        (`_narrowed`) or a torch route's dtype (`_routed`). Nothing to compare in most plans."""
        if self._replan_next or (self._narrowed and _storages(self._narrowed) != self._narrowed_ptrs):
            return True
        if self._lazy_made():
            return True
        return bool(self._routed) and [p.dtype for p in self._routed] != self._routed_dtypes

    @property
    def waits(self) -> bool:
        """Whether nothing is fused only because every param the plan could take is a lazy module's, not made yet
        (the step after its first forward plans again): no reason to warn at construction."""
        return bool(self._lazy) and not self.active and not (self.current_plan and self.current_plan.buckets)

    def _lazy_made(self) -> bool:
        """Whether a lazy module's forward made params the plan left out while they were uninitialized."""
        return bool(self._lazy) and not all(map(torch.nn.parameter.is_lazy, self._lazy))

    @property
    def watches(self) -> bool:
        """Whether a step asks `needs_replan`: the plan is of an algorithm with switches, fused or not (a group
        whose ``differentiable`` is cleared, or params built on the CPU and moved to the GPU after wrapping, come
        to the fused kernel)."""
        return self._info is not None

    def forget_checks(self) -> None:
        """`needs_replan`'s finding holds for one step: after its prepare, or a step that raised."""
        for unit in (*self._units, *self._muon):
            unit.forget_checks()

    def follow(self) -> int:
        """Whether the last step's tables, norm binding and launches hold for this one (the caller has checked that
        the groups' values are those the last step used): `SAME` where every unit's grads and params sit where the
        last step found them, with no copies, lazy state or sparse grads pending; `MOVED` where only grads moved,
        each one dense, contiguous, of its param's dtype and shape, and the tables and the norm pass now point at
        them (uploads only); `OTHER` for anything else, which the full path sorts out. C++ checks (or, with static
        addresses, the units' watches) only."""
        self.forget_checks()  # what a full step's `needs_replan` found is for that step's `prepare` alone
        if self._state_moved() or self._others_moved() or self._strict:
            return OTHER  # (narrowed params with strict grads: the full path checks them, `refuse_unmatched`)
        found = SAME
        for unit in (*self._units, *self._muon):
            now = unit.follow()
            if now == OTHER:
                return OTHER  # the units re-pointed already hold for this step: the full path finds them SAME
            if now > found:
                found = now
        # (cut short before this, the step leaves the steady replay disarmed: the next one takes the full path,
        # which binds the norm pass whenever it runs)
        if found == MOVED and self._norm is not None:
            self._bind_norm(moved=True)
        return found

    def refresh_values(self, groups: list[dict[str, Any]], keys: Collection[str] | None = None) -> bool:
        """A group's values changed between two steady replays: refresh the hyperparameter buffers, or return False
        when a switch changed (the kernels must be planned again, through `prepare`). ``keys``: the keys whose
        values changed, where the caller knows them (None: any may have): the switches are compared only where one
        of them is a key they are read from (`kitsune.fusion.planner.switch_keys`), so an LR scheduler's new ``lr``
        costs no comparison."""
        read = self._switch_keys
        if (keys is None or read is None or not read.isdisjoint(keys)) and self._switches_changed(groups):
            return False
        self.refresh_contexts()
        return True

    def refresh_contexts(self) -> None:
        """Copy changed hyperparameters into each device's buffer (host work; at most one copy per device)."""
        for context in self._contexts.values():
            context.refresh(self._base.param_groups)

    def _switches_changed(self, groups: list[dict[str, Any]]) -> bool:
        """Whether a group's kernel switches differ from the plan's (another compiled variant is needed)."""
        return self._info is not None and group_switches(self._info, groups) != self._switches

    def count_replay(self) -> None:
        """Book a step that replayed the captured launches without coming through `prepare`."""
        self._steps += 1
        self._launches_last_step = 1
        self._launches_total += 1

    def _count_step(self, launches: int) -> None:
        self._see_state()  # after every route of the step made its lazy state
        self._steps += 1
        self._launches_last_step = launches
        self._launches_total += launches

    def needs_norm(self, s: StepState) -> bool:
        """Whether step ``s`` launches the norm pass: trust ratios, clipping, or AMP's overflow check fused in."""
        return self._trust or s.max_norm is not None or s.check_inf

    def _bind_norm(self, moved: bool = False) -> None:
        """Point the norm pass at this step's grads (and the params, for trust ratios): host work, before launch.
        ``moved``: the grads moved since the last binding (`follow` found them so), so the table is uploaded from the
        units' host tensors with no list made or compared."""
        if self._norm is None:
            from kitsune.kernels.norms import MultiTensorNorm

            numels = [n for u in self._units for n in u.numels]
            norm_type = 2.0 if self._trust else self._grads.norm_type
            self._norm = MultiTensorNorm(numels * (2 if self._trust else 1), self._units[0].device, norm_type)
        roles = ("grad", "param") if self._trust else ("grad",)
        # the units' tables hold these addresses as CPU tensors already (and, where the native check read moved
        # grads, their low bits): one concatenation, not a conversion of the list, straight into the norm table's
        # staging tensor (page-locked on a GPU), which the upload then copies from
        hosts = [u.tables.host(role) for role in roles for u in self._units]
        host = low = None
        if all(h is not None for h, _ in hosts):
            host = torch.cat([h for h, _ in hosts], out=self._norm.tables.staging("x"))
            if all(bits is not None for _, bits in hosts):
                low = 0
                for _, bits in hosts:
                    low |= bits
        addresses = None
        if host is None or not moved:
            addresses = [a for u in self._units for a in u.grad_addresses]
            if self._trust:
                addresses += [a for u in self._units for a in u.param_addresses]
        self._norm.bind_addresses(addresses, self._norm_dtypes, host, low)

    def grad_layout(self, units: list[FusedUnit], norm: bool) -> tuple[bool, ...]:
        """The variants `launch` picks from the grad addresses the tables hold (vector reads or not: the update's
        per unit in ``units``, then, with ``norm`` (`needs_norm`), the norm pass's). A captured launch keeps the
        variants it was captured with, so a graph of it is keyed on this: grads that move to addresses a vector read
        cannot take are then captured again, not replayed into a misaligned read."""
        mine = self._units
        if not mine:
            layout: tuple[bool, ...] = ()
        else:
            vector = self._kernels.grad_vector
            layout = tuple([vector(u.tables, u.spec) for u in mine if units is mine or u in units])
        if norm and self._norm is not None:
            layout += (self._norm.vector(),)
        return layout

    def launch(self, s: StepState, units: list[FusedUnit]) -> None:
        """The device half of a step: the norm pass when the step needs one, then one update launch per unit in
        ``units``. Only device work, so a CUDA graph can capture it (then over every unit: a unit whose grads
        are all None this step does nothing, as its grad table says)."""
        if not units:
            return
        total = norms = None
        if self.needs_norm(s):
            total, norms = self._norm_pass(s)
            if s.phases is not None:
                s.phases.mark("norm")
        found_inf = s.found_inf  # AMP's overflow flag: the kernel skips on the device
        for unit, offset in zip(self._units, self._offsets, strict=True):
            if unit not in units:
                continue
            self._update(s, unit, offset, found_inf, total, norms)
            self._launched[id(unit)] = unit  # queued: what it writes from here on stands
        muon = [unit for unit in self._muon if unit in units]
        for unit in muon:  # momentum, Newton-Schulz by shape, update
            hyper = self._contexts[unit.device].buffer
            unit.launch(hyper, _on(found_inf, unit.device), s.grad_write == 2, graphed=s.graphed)
            self._launched[id(unit)] = unit
        if s.phases is not None:
            s.phases.mark("update")
        muon_launches = sum(unit.launches for unit in muon)
        updates = sum(unit.spec.launches for unit in units if unit not in muon)
        self._launches_last_launch = updates + muon_launches + self._launches_last_norm
        self._launches_last_norm = 0

    def _update(
        self,
        s: StepState,
        unit: FusedUnit,
        offset: int,
        found_inf: torch.Tensor | None,
        total: torch.Tensor | None,
        norms: torch.Tensor | None,
        compile_only: bool = False,
    ) -> None:
        """One unit's update launch in step ``s`` (``compile_only``: its kernel compiled, nothing run), after the norm
        pass's ``total`` and per-tensor ``norms`` where the step has one."""
        self._kernels.multi_tensor_update(
            unit.tables,
            self._contexts[unit.device].buffer,
            unit.spec,
            unit.dtype,
            _on(found_inf, unit.device),
            grad_scale=s.grad_scale,
            total_norm=total if s.max_norm is not None else None,
            max_norm=s.max_norm,
            grad_write=s.grad_write,
            tensor_norms=norms if unit.spec.trust else None,
            norm_offset=offset,
            n_norm=len(self._norm_dtypes) // 2 if self._trust else None,
            seed=self.config.rounding_seed,
            compile_only=compile_only,
        )

    def finish(self, s: StepState, live: list[FusedUnit], launches: int | None = None) -> None:
        """After the launches: write back grads that stood in as contiguous copies and book the step (which grads
        were zeroed, how many launches ran)."""
        grad_write = s.grad_write if live else 0
        for unit in live:
            if grad_write:
                unit.copy_back(zeroed=grad_write == 2)
        if grad_write == 2:  # the grads the kernels zeroed: not those left to the wrapped step (sparse, other dtype)
            s.zeroed = [
                p for unit in live for p in (without(unit.params, unit.unhandled) if unit.unhandled else unit.params)
            ]
        self._note_skip(s)
        for unit in self._prepared:
            unit.keep()
        self._prepared = []  # the state this step created is kept from here on
        if launches is None:
            launches, self._launches_last_launch = (self._launches_last_launch if live else 0), 0
        self._count_step(launches)

    @property
    def units(self) -> list[FusedUnit]:
        """The fused launch units of the current plan."""
        return list(self._units)

    @property
    def orthogonalises(self) -> bool:
        """Whether the plan has Muon's units (orthogonalised updates of whole matrices, in `step()` only)."""
        return bool(self._muon)

    @property
    def plan_version(self) -> int:
        """Bumped by every `plan`: device buffers a captured graph holds may have been replaced."""
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
        if self._shadows or any(b.route not in fused for b in self.current_plan.buckets):  # type: ignore[union-attr]
            return "some params fall back to torch or the optimizer's own step (see the plan)"
        if len({u.device for u in self.launch_units}) > 1:
            return "params on several devices"
        return None

    @property
    def collective_groups(self) -> list[Any]:
        """The process groups a step's device work all-reduces over (FSDP2: the grad norm and the overflow flag over
        the mesh); a CUDA graph of the step captures those collectives too. Empty without DTensor params."""
        return list(self._norm_groups)

    def _norm_pass(self, s: StepState) -> tuple[torch.Tensor, torch.Tensor]:
        """Pass one: every fused grad's norm (divided by the loss scale) in one launch, then each param's when trust
        ratios need them; returns the global grad norm, in a fresh device scalar, and the per-tensor norms.

        With the grads' passes fused into this step the global norm becomes ``s.grad_norm`` when clipping, and the
        inf/nan flag ``s.found_inf`` for AMP."""
        norm = self._norm  # bound to this step's addresses by prepare()
        fused = s.fused_grads
        if s.graphed:  # a CUDA graph writes the norm into the same buffer every replay
            if self._norm_out is None:
                self._norm_out = torch.zeros((), dtype=torch.float32, device=norm.device)
            out = self._norm_out
        else:
            out = torch.empty((), dtype=torch.float32, device=norm.device)
        result = self._launch_norm(s, out)
        find_inf = fused and s.check_inf and s.found_inf is None
        if fused and self._norm_groups:  # FSDP2: this rank's shards only; reduce over the mesh, on the device
            fsdp.all_reduce_norm_(out, result.found_inf if find_inf else None, norm.norm_type, self._norm_groups)
        if fused and s.reduce is not None:  # sharded grads: combine every rank's norm and overflow flag
            s.reduce(out, result.found_inf if s.check_inf else None)
        if find_inf:
            s.found_inf = result.found_inf
        if fused and s.max_norm is not None:
            s.grad_norm = out
        self._launches_last_norm = 1
        return out, result.per_tensor

    def _launch_norm(self, s: StepState, out: torch.Tensor, compile_only: bool = False) -> Any:
        """The norm pass's launch into ``out`` (``compile_only``: its kernel compiled, nothing run)."""
        n_grads = len(self._norm_dtypes) // 2 if self._trust else len(self._norm_dtypes)
        scale = s.grad_scale if s.fused_grads else None
        return self._norm.launch(scale, invert_scale=True, num_global=n_grads, out=out, compile_only=compile_only)

    def _note_once(self, message: str, key: str | None = None) -> None:
        if (key or message) not in self._logged:
            self._logged.add(key or message)
            logger.info("kitsune fusion: %s", message)

    # -- the profiler's live comparison ---------------------------------------------------------------------------
    def hand_over(self) -> None:
        """Prepare for steps in which the wrapped optimizer's own step updates every param (the profiler's live
        comparison): put each ``state["step"]`` where that step keeps it.

        The fused path keeps step counts on the device, as torch's fused and capturable paths do; torch's other
        paths read them on the host, which on device tensors costs one sync per param and would time a step the
        user never runs. Moving them costs one sync here, before the timed steps begin.
        """
        state = self._base.state
        keys = self._info.host_scalars if self._info is not None else ("step",)  # NAdam's mu_product too
        moved = []
        for g in self._base.param_groups:
            if g.get("capturable") or g.get("fused"):
                continue  # torch keeps these on the device too
            for p in g["params"]:
                for key in keys:
                    t = state[p].get(key) if p in state else None
                    if isinstance(t, torch.Tensor) and t.device.type != "cpu":
                        moved.append((state[p], key, t.device, t))
        if moved:
            host = torch.stack([t for *_, t in moved]).cpu()
            for (st, key, _, _), value in zip(moved, host, strict=True):
                st[key] = value.clone()
        self._handed_over = [(st, key, device) for st, key, device, _ in moved]

    def take_back(self) -> None:
        """Undo `hand_over`: step counts back on the device and the kernels' tables rebound to them."""
        for st, key, device in self._handed_over:
            t = st.get(key)
            if isinstance(t, torch.Tensor):
                st[key] = t.to(device)
        self._handed_over = []
        for unit in (*self._units, *self._muon):
            unit.bind(self._base.state)
        self._see_state()

    # -- what the orchestrator and the summary read ----------------------------------------------------------------
    def zero_as_kernels(self, s: StepState) -> None:
        """A step the wrapped optimizer ran for the profiler's comparison, with ``GradConfig(zero_in_step=True)``:
        zero the grads the kernels zero (their units' dense grads of the params' dtype) and book them, so the loop
        that leaves zeroing to the step finds zeros after it either way."""
        params = [
            p
            for u in (*self._units, *self._muon)
            for p in u.params
            if (g := p.grad) is not None and g.layout == torch.strided and g.dtype == p.dtype
        ]
        if params:
            torch._foreach_zero_([p.grad for p in params])
        s.zeroed = params

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
            "address_checks": self._checks_report(),
            "state_compares": self._state_watch.compared,
        }

    def _checks_report(self) -> str | None:
        """How a step checks that its params and grads sit where the tables point (see `FusedUnit._unchanged`)."""
        units = [u for u in (*self._units, *self._muon) if not u.watching]
        if not units:
            return None if not self._units and not self._muon else "static addresses: watched, not checked"
        if not self.config.native_checks:
            return "Python (FusionConfig.native_checks=False)"
        if not any(u.checks_natively for u in units):
            return "Python (tensor subclasses: read through their own Python code)"
        why = _native.reason()
        return "native (one C++ call per unit)" if not why else f"Python: native check {why}"

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


def _variant(s: StepState, *layout: bool) -> tuple[bool | int, ...]:
    """What of step ``s`` picks the kernel variants a launch compiles (the update's flags, the norm pass's inputs),
    then the grads' ``layout`` (`FusionSubsystem.grad_layout`): the key of a compile ahead."""
    return (s.found_inf is not None, s.grad_scale is not None, s.max_norm is not None, s.check_inf, s.fused_grads,
            s.grad_write, *layout)  # fmt: skip


def _on(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """``t`` on ``device`` (None stays None)."""
    return t if t is None or t.device == device else t.to(device)


def _storages(params: list[torch.Tensor]) -> list[int]:
    """The data pointers of ``params`` (of their local shards for DTensors)."""
    return [fsdp.local(p).data_ptr() for p in params]
