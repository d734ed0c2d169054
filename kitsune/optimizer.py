"""KitsuneOptimizer: a ``torch.optim.Optimizer`` that wraps another one and owns no math.

It shares the wrapped optimizer's ``param_groups``, ``state`` and ``defaults`` objects (they are properties that
read and write the wrapped optimizer's attributes), so an LR scheduler built on either drives both, checkpoints
have torch's layout, and ``isinstance(opt, torch.optim.Optimizer)`` holds for Lightning, Accelerate and torch's
schedulers. Each step walks the subsystems through the lifecycle in :mod:`kitsune.subsystem`; every param that
no subsystem updated goes through the wrapped optimizer's own ``step``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator
from operator import attrgetter, is_
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks as _global_post
from torch.optim.optimizer import _global_optimizer_pre_hooks as _global_pre

from kitsune.config import (
    AMPConfig,
    FusionConfig,
    GradConfig,
    KitsuneConfig,
    ShardConfig,
    StreamConfig,
    resolve_config,
)
from kitsune.profiler import Profiler
from kitsune.subsystem import PlaceholderSubsystem, StepContext, Subsystem

KITSUNE_STATE_KEY = "kitsune"
"""The one extra key kitsune adds to ``state_dict()``; torch's ``load_state_dict`` ignores it."""
STATE_VERSION = 1

_Closure = Callable[[], Any]
_GRAD = attrgetter("grad")
_VERSION = attrgetter("_version")
_BASE_ZERO_GRAD = torch.optim.Optimizer.zero_grad


def _refuse_per_evaluation_passes(optimizer: torch.optim.Optimizer, config: KitsuneConfig) -> None:
    """An optimizer whose step needs its closure (LBFGS) evaluates it several times inside one step: clipping and
    float16 unscaling, which kitsune runs once on the grads before the step, cannot run between those evaluations."""
    import inspect

    if not isinstance(optimizer, torch.optim.LBFGS):  # LBFGS and its subclasses, whatever their signature says
        try:
            closure = inspect.signature(optimizer.step).parameters.get("closure")
        except (TypeError, ValueError):
            return
        if closure is None or closure.default is not inspect.Parameter.empty:
            return
    passes = []
    if config.grads.max_norm is not None:
        passes.append("max_grad_norm")
    if config.amp.enabled and config.amp.dtype == torch.float16:
        passes.append("float16 loss scaling (enable_amp with AMPConfig(dtype=torch.float16))")
    if passes:
        raise ValueError(
            f"{type(optimizer).__name__} evaluates its closure several times inside one step, so kitsune cannot "
            f"clip or unscale the grads between those evaluations: {' and '.join(passes)} cannot wrap it. Clip "
            "inside the closure (torch.nn.utils.clip_grad_norm_) and use AMPConfig(dtype=torch.bfloat16), which "
            "needs no loss scaling."
        )


class KitsuneOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` and run its step through kitsune's subsystems.

    Args:
        optimizer: the torch optimizer to wrap (any ``torch.optim.Optimizer``).
        enable_amp: mixed precision with a device-resident loss scaler (see :class:`AMPConfig`).
        enable_fusion: fused Triton multi-tensor kernels where the planner can use them.
        num_streams: CUDA side streams the scheduler may use.
        profile: record per-step timings for :meth:`print_summary` and :meth:`save_profile`.
        amp_config: AMP settings; needs ``enable_amp=True``.
        fusion_config: fusion settings; needs ``enable_fusion=True``.
        stream_config: stream settings; its ``num_streams`` must agree with ``num_streams`` if both are set.
        memory_pool_size: most bytes per device of flat arena for the fused params' optimizer state (0: off).
        capture_graph: capture the optimizer phase in a CUDA graph (CUDA only).
        max_grad_norm: clip the grads to this global 2-norm inside the step (see :class:`GradConfig`).
        grad_config: clipping (norm type) and zeroing of the grads in the step.
        zero_stage: shard the optimizer state over torch.distributed's ranks: 1 or 2 (ZeRO), 0 off (see
            :class:`ShardConfig`).
        shard_config: sharding settings (process group, bucket size, overlap); its ``stage`` must agree with
            ``zero_stage`` if both are set.
        config: all of the above in one :class:`KitsuneConfig`; exclusive with the other settings.
    """

    _step_supports_amp_scaling = True
    """``torch.amp.GradScaler.step`` hands us ``grad_scale``/``found_inf`` instead of syncing itself."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        enable_amp: bool = False,
        enable_fusion: bool = False,
        num_streams: int = 4,
        profile: bool = False,
        amp_config: AMPConfig | None = None,
        fusion_config: FusionConfig | None = None,
        stream_config: StreamConfig | None = None,
        memory_pool_size: int = 512 * 1024 * 1024,
        capture_graph: bool = True,
        *,
        max_grad_norm: float | None = None,
        grad_config: GradConfig | None = None,
        zero_stage: int = 0,
        shard_config: ShardConfig | None = None,
        config: KitsuneConfig | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"KitsuneOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, KitsuneOptimizer):
            raise ValueError("this optimizer is already a KitsuneOptimizer: wrap the torch optimizer only once")
        self.config: KitsuneConfig = resolve_config(
            config,
            {
                "amp_config": amp_config,
                "fusion_config": fusion_config,
                "stream_config": stream_config,
                "grad_config": grad_config,
                "shard_config": shard_config,
            },
            {
                "enable_amp": enable_amp,
                "enable_fusion": enable_fusion,
                "num_streams": num_streams,
                "profile": profile,
                "memory_pool_size": memory_pool_size,
                "capture_graph": capture_graph,
                "max_grad_norm": max_grad_norm,
                "zero_stage": zero_stage,
            },
        )
        _refuse_per_evaluation_passes(optimizer, self.config)
        self._optimizer = optimizer
        # torch.optim.Optimizer.__init__ would rebuild param_groups; set up only its hook bookkeeping.
        self._optimizer_step_pre_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Callable] = OrderedDict()
        # torch wraps Optimizer.step in a hook runner with a record_function (~50 us a step); our step runs the
        # hooks itself (in step() below), so mark it hooked and torch leaves it alone
        self._zero_grad_profile_name = f"Optimizer.zero_grad#{type(self).__name__}.zero_grad"
        self._warned_capturable_if_run_uncaptured = True

        self._step_count = 0
        self._clipped_before: tuple[list[tuple[int, int]], torch.Tensor] | None = None
        """After a step that raised once it had clipped the grads: their versions and the norm, for the retry."""
        self._last_grad_norm: torch.Tensor | None = None
        self._norm_is_static = False
        """Whether ``_last_grad_norm`` is a CUDA graph's static buffer, which the next replay overwrites."""
        self._zeroed: tuple[list[torch.Tensor], list[int], list[int]] | None = None
        self._base_steps = 0
        self._host_syncs = 0
        self._handed_over = False
        self._structure: tuple[list, Any, list[list[torch.Tensor]]] | None = None
        """The groups list, the state dict and each group's params list that the plan was made for."""
        self._steady: _Steady | None = None
        """Set after a step that replayed the graph, for the next steps to replay it again after a few C++ checks."""
        self._may_steady = False
        self._precheck = False
        self._leftover = True
        self._repeated = False
        """Whether a param is listed twice in the groups (torch warns; each listing is a step's update)."""
        self._subsystems: list[Subsystem] = self._build_subsystems()
        self._fusion: Any = self._subsystem("fusion")
        self._replan()
        self._warn_requested_but_inactive()

    # -- the shared objects -------------------------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self._optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self._optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self._optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._optimizer.defaults = value

    # -- public properties --------------------------------------------------------------------------------------
    @property
    def base_optimizer(self) -> torch.optim.Optimizer:
        """The wrapped torch optimizer."""
        return self._optimizer

    @property
    def profiler(self) -> Profiler | None:
        """The profiler when ``profile=True``, else ``None``."""
        return self._profiler if self._profiler.active else None

    @property
    def scheduler(self) -> Subsystem:
        """The stream scheduler (``scheduler.num_streams``)."""
        return self._subsystem("streams")

    @property
    def plan(self) -> Any:
        """Which params go to which kernel and which fall back, with reasons (a rich-printable object)."""
        fusion = self._subsystem("fusion")
        plan = getattr(fusion, "current_plan", None)
        return None if callable(plan) else plan

    @property
    def subsystems(self) -> list[Subsystem]:
        """Every subsystem, active or not, in lifecycle order."""
        return list(self._subsystems)

    @property
    def step_count(self) -> int:
        """Calls of :meth:`step` so far (restored from checkpoints)."""
        return self._step_count

    # -- subsystems ---------------------------------------------------------------------------------------------
    def _build_subsystems(self) -> list[Subsystem]:
        cfg = self.config
        self._profiler = Profiler(cfg.profiler)
        subsystems: list[Subsystem] = [self._profiler]
        from kitsune.distributed.zero import ShardSubsystem

        subsystems.append(ShardSubsystem(cfg.shard))  # first: the grads are reduced before anything reads them
        if cfg.amp.enabled:
            from kitsune.amp import AMPSubsystem

            subsystems.append(AMPSubsystem(cfg.amp))
        else:
            subsystems.append(PlaceholderSubsystem("amp", requested=False, reason="enable_amp=False"))
        from kitsune.memory import MemoryPool

        pool = MemoryPool(cfg.memory)
        fusion = _make_fusion(cfg.fusion)
        if hasattr(fusion, "pool"):
            fusion.pool = pool
        subsystems += [pool, fusion]
        from kitsune.streams import StreamScheduler

        subsystems.append(StreamScheduler(cfg.streams, cfg.graphs))
        from kitsune.graphs import GraphSubsystem

        subsystems.append(GraphSubsystem(cfg.graphs))
        return subsystems

    def _subsystem(self, name: str) -> Subsystem:
        for s in self._subsystems:
            if s.name == name:
                return s
        raise KeyError(name)

    def _warn_requested_but_inactive(self) -> None:
        asked = {"amp": self.config.amp.enabled, "fusion": self.config.fusion.enabled, "shard": self.config.shard.stage}
        for s in self._subsystems:
            if asked.get(s.name) and not s.active:
                warnings.warn(f"kitsune: {s.name} was asked for but is inactive: {s.reason}", UserWarning, stacklevel=3)

    def _plan_fits(self) -> bool:
        """Whether the plan still fits the groups: the same groups list and state dict, and each group holding the
        same params in the same order (a param swapped into a list, moved between groups, added or removed
        re-plans). The params are compared by identity in C (``map(operator.is_, ...)``), tens of ns a param."""
        seen = self._structure
        groups = self.param_groups
        if seen is None or groups is not seen[0] or self._optimizer.state is not seen[1] or len(groups) != len(seen[2]):
            return False
        for group, planned in zip(groups, seen[2], strict=True):
            params = group["params"]
            if len(params) != len(planned) or not all(map(is_, params, planned)):
                return False
        return True

    def _replan(self) -> None:
        for s in self._subsystems:
            s.plan(self)
        self._structure = (self.param_groups, self._optimizer.state, [list(g["params"]) for g in self.param_groups])
        owned: set[int] = set()
        for s in self._subsystems:
            if s.active:
                owned.update(id(p) for p in getattr(s, "owned_params", lambda: ())())
        self._leftover = any(id(p) not in owned for g in self.param_groups for p in g["params"])
        listed = [id(p) for g in self.param_groups for p in g["params"]]
        self._repeated = len(set(listed)) != len(listed)
        self._active = [s for s in self._subsystems if s.active]
        self._executes = any(getattr(s, "executes", False) for s in self._active)
        self._needs_grads = any(s.name == "amp" and getattr(s, "scaling", False) for s in self._active)
        fusion = self._fusion
        self._fused_grads = fusion.active and getattr(fusion, "grad_pass", "") is None and not self._leftover
        self._pick_graphs(fusion)
        self._plan_version = getattr(fusion, "plan_version", 0)
        self._in_backward = getattr(self._subsystem("streams"), "in_backward", False)
        # a step asks the fusion subsystem for moved storages and changed switches before it decides how to clip
        # and unscale (a re-plan may change that), except: with ZeRO one rank alone may see a move (its units hold
        # only the params it owns), and a re-plan there runs collectives the other ranks do not; with updates
        # inside backward (never with clipping or float16 scaling) the units updated there must not be updated
        # again. Those re-plan inside the fused step, as the move is found.
        self._precheck = not self._in_backward and not self._subsystem("shard").active
        self._steady = None
        # the steady replay below skips the subsystems' step hooks: only where the active ones do nothing in them
        self._may_steady = (
            self._graphs is not None
            and self.config.graphs.steady_replay
            and all(s.name in ("fusion", "graphs", "amp") or not _has_step_hooks(s) for s in self._active)
        )

    # -- mixed precision ----------------------------------------------------------------------------------------
    def autocast(self) -> Any:
        """Autocast context for the forward pass in the AMP dtype (a disabled autocast when AMP is off)."""
        amp = self._subsystem("amp")
        if amp.active:
            return amp.autocast()
        params = [p for g in self.param_groups for p in g["params"]]
        return torch.autocast(device_type=params[0].device.type if params else "cpu", enabled=False)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, with the loss scaled first when AMP runs in float16."""
        self.scale_loss(loss).backward(**kwargs)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale (float16 AMP; otherwise ``loss`` itself), for a loop that runs its
        own backward (``accelerator.backward(optimizer.scale_loss(loss))``); :meth:`backward` calls it."""
        amp = self._subsystem("amp")
        return amp.scale_loss(loss) if amp.active else loss

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Context for the backward passes of gradient accumulation's micro-steps that do not step: with
        ``StreamConfig(step_in_backward=True)`` they launch no updates (the grads just add up); the backward of the
        micro-step that steps runs outside it. Without step_in_backward it changes nothing, so loops can always use it.
        With sharded state (``zero_stage``) the grads of those micro-steps are not reduced across ranks either.
        """
        with contextlib.ExitStack() as stack:
            for s in self._subsystems:
                if hasattr(s, "accumulating"):
                    stack.enter_context(s.accumulating())
            yield

    @property
    def loss_scale(self) -> float:
        """The current dynamic loss scale (1.0 without float16 AMP). Reading it syncs once."""
        amp = self._subsystem("amp")
        return amp.loss_scale if amp.active else 1.0

    @property
    def skipped_steps(self) -> int:
        """Steps whose update was skipped for inf/nan grads. Reading it syncs once."""
        amp = self._subsystem("amp")
        return amp.skipped_steps if amp.active else 0

    @property
    def base_steps(self) -> int:
        """Steps in which the wrapped optimizer's own step ran (for params kitsune left to it, or as the
        profiler's live-comparison baseline)."""
        return self._base_steps

    @property
    def host_syncs(self) -> int:
        """Host syncs kitsune itself made inside ``step()`` so far (reading found_inf for a fallback step)."""
        return self._host_syncs

    # -- torch.optim.Optimizer API ------------------------------------------------------------------------------
    def step(self, closure: _Closure | None = None) -> Any:  # type: ignore[override]
        """One optimizer step: subsystems first, then the wrapped optimizer's step for every param left over."""
        if not (self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks or _global_pre or _global_post):
            return self._step(closure)
        args, kwargs = (self,) if closure is None else (self, closure), {}
        for hook in (*_global_pre.values(), *self._optimizer_step_pre_hooks.values()):
            result = hook(self, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(f"a step pre-hook must return None or (args, kwargs), got {result!r}")
                args, kwargs = result
        with torch.autograd.profiler.record_function(f"Optimizer.step#{type(self).__name__}.step"):
            out = self._step(*args[1:], **kwargs)
        for hook in (*self._optimizer_step_post_hooks.values(), *_global_post.values()):
            hook(self, args, kwargs)
        return out

    step.hooked = True  # type: ignore[attr-defined]

    def _step(self, closure: _Closure | None = None) -> Any:
        if self._steady is not None and closure is None and self._replay_again():
            return None
        self._steady = None
        if not self._plan_fits():
            self._replan()
        loss = None
        if closure is not None and (self._executes or self.config.grads.max_norm is not None or self._needs_grads):
            # fused updates, clipping and unscaling need the grads before they run; the wrapped step then gets no
            # closure (optimizers that need one inside their step refuse these settings when wrapped)
            with torch.enable_grad():
                loss = closure()
            closure = None
        fusion = self._fusion
        checked = self._precheck and fusion.active
        if checked and fusion.needs_replan(self.param_groups):
            # a switch changed or a param's storage moved: the new plan may route params differently, which decides
            # below how the grads are clipped and unscaled
            self._replan()
        self._step_count += 1
        self._zeroed = None
        ctx = StepContext(step=self._step_count, baseline=self._baseline_now())
        if checked:
            ctx.extra["structure_checked"] = True  # the fusion subsystem's switches and param storages, just above
        fused = ctx.extra["fused_grads"] = self._fused_grads and not ctx.baseline
        if self._needs_grads and not fused:
            ctx.extra["grads"] = self._grads_to_unscale()
        self._take_grad_scaler_protocol(ctx, fused)
        try:
            for s in self._active:
                s.before_step(ctx)
            reduce = ctx.extra.get("reduce_norm")  # sharded grads: an overflow on any rank skips the step on all
            if reduce is not None and not fused and ctx.extra.get("found_inf") is not None:
                reduce(None, ctx.extra["found_inf"])
            timer = ctx.extra.get("phases")  # the profiler's probe steps time each phase
            if timer is not None:
                timer.mark("unscale")
            if self.config.grads.max_norm is not None and not fused:
                retry = self._clipped_before
                if retry is not None and retry[0] == self._grad_versions():
                    ctx.extra["grad_norm"] = retry[1]  # a retry of a step that raised after clipping these grads
                else:
                    ctx.extra["grad_norm"] = self._clip_grads(ctx.extra.get("reduce_norm"))
                if timer is not None:
                    timer.mark("clip")
            if self._overflow_on_host(ctx):
                ctx.skip_base_step = True  # inf/nan grads: nothing is updated this step
            else:
                for s in self._active:
                    if ctx.baseline and getattr(s, "executes", False):
                        continue
                    if s.name == "fusion" and self._graphs is not None:
                        self._graph_step(ctx, s)
                    else:
                        s.step(ctx)
            if not ctx.skip_base_step and (self._leftover or closure is not None or ctx.unhandled or ctx.baseline):
                out = self._base_step(ctx.handled, closure)
                loss = out if closure is not None else loss
                if timer is not None:
                    timer.mark("fallback")
            else:
                self._stepped_without_base()
        except BaseException:
            if checked:
                fusion.forget_checks()  # a retry checks the params' storages again
            self._step_count -= 1  # not a step: the count (saved in checkpoints) stays that of steps taken
            norm = ctx.extra.get("grad_norm")
            self._clipped_before = None if norm is None or fused else (self._grad_versions(), norm)
            if self._profiler.active:
                self._profiler.abandon_step()
            raise
        self._clipped_before = None
        for s in reversed(self._active):
            s.after_step(ctx)
        self._last_grad_norm = ctx.extra.get("grad_norm")
        self._norm_is_static = ctx.extra.get("static_grad_norm", False)
        zeroed = ctx.extra.get("zeroed")
        if zeroed:
            self._remember_zeroed(zeroed)
        return loss

    def _remember_zeroed(self, zeroed: list[torch.Tensor]) -> None:
        """Which grads the kernel zeroed, and their version counters, for :meth:`zero_grad` to leave them be."""
        grads = list(map(_GRAD, zeroed))
        self._zeroed = (zeroed, list(map(id, grads)), _versions(grads))

    def _pick_graphs(self, fusion: Any) -> None:
        """Whether steps go through the graph subsystem (``self._graphs``): where it is active, the grads' passes
        allow a captured step and the state is not sharded; otherwise the graph subsystem is switched off with the
        reason, so the summary never shows it active while the steps run eagerly."""
        graphs = self._subsystem("graphs")
        self._graphs = graphs if graphs.active and self._graph_ready(fusion) else None
        if graphs.active and self._graphs is None:
            why = getattr(fusion, "grad_pass", None) or "see the plan"
            graphs.deactivate(f"the grads' passes are not fused: {why}")
        if self._graphs is not None and self._subsystem("shard").active:
            graphs.deactivate("sharded optimizer state: the step's collectives are not captured")
            self._graphs = None

    def _graph_ready(self, fusion: Any) -> bool:
        """Whether the grads' passes allow a captured step: fused into the step's kernels, or none to run (no
        clipping, no loss scaling: Muon's momentum kernel reads the grads as backward left them)."""
        if not fusion.active or self._leftover:
            return False
        return fusion.grad_pass is None or (self.config.grads.max_norm is None and not self._needs_grads)

    def _graph_step(self, ctx: StepContext, fusion: Any) -> None:
        """The fused step through the graph subsystem: host preparation, then the device work warmed up, captured
        or replayed (norm pass, updates and, with float16 AMP, the scale update), then the bookkeeping."""
        graphs = self._graphs
        live = fusion.prepare(ctx)
        if fusion.plan_version != self._plan_version:
            # prepare re-planned (a param's storage moved, a kernel switch changed): the graph holds old buffers;
            # this step runs eagerly and the graph subsystem decides afresh whether the new plan can be captured
            self._plan_version = fusion.plan_version
            graphs.plan(self)
            self._pick_graphs(fusion)
            fusion.launch(ctx, live)
            fusion.finish(ctx, live)
            return
        why = None
        if not live:
            why = "no param has a grad this step"
        elif "phases" in ctx.extra:
            why = "the profiler's probe times each phase"
        elif ctx.baseline:
            why = "the profiler's baseline step"
        elif "found_inf" in self.__dict__:
            why = "a user's GradScaler hands a new found_inf every step"
        elif any(unit._copied for unit in live):
            why = "non-contiguous grads are copied every step"
        if why is not None:
            graphs.note_eager(why)
            fusion.launch(ctx, live)
            fusion.finish(ctx, live)
            return
        amp = self._subsystem("amp")
        scaling = amp.active and getattr(amp, "scaling", False)
        units = fusion.launch_units

        ctx.extra["graphed_work"] = True  # warm-up, capture and replay make the same launches

        def device_work() -> None:
            fusion.launch(ctx, units)
            if scaling:
                amp.update_scale(ctx)

        key = (fusion.plan_version, id(ctx.extra.get("grad_scale")), bool(ctx.extra.get("check_inf")), scaling)
        how = graphs.run(ctx, key, device_work)
        if scaling:
            ctx.extra["graphed"] = True  # device_work updated the scale, however it ran
        if how == "failed":
            self._graphs = None
        fusion.finish(ctx, units, launches=1 if how == "replay" else None)
        if how == "replay" and self._may_steady and not ctx.unhandled and not ctx.baseline:
            self._arm_steady(fusion, graphs, amp if scaling else None, ctx.extra.get("zeroed"))

    def _arm_steady(self, fusion: Any, graphs: Any, amp: Any, zeroed: list[torch.Tensor] | None) -> None:
        """After a replayed step: let the next steps replay straight away while nothing they depend on changed."""
        values = _group_values(self.param_groups)
        if not _has_tensor(values):  # tensor hyperparameters change in place: the full step compares their values
            self._steady = _Steady(self.param_groups, values, fusion, graphs, amp, zeroed)

    def _replay_again(self) -> bool:
        """The steady step: the same groups, every grad and param where the last step found them, no GradScaler
        handing in a ``found_inf``: refresh the hyperparameters if a value changed (an LR scheduler's new LR), replay
        the graph and book the step. False (nothing done) sends the step through the full path, which checks and
        refreshes everything and arms this again."""
        steady: _Steady = self._steady  # type: ignore[assignment]
        groups = self.param_groups
        fusion = steady.fusion
        if groups is not steady.groups or "found_inf" in self.__dict__ or fusion.plan_version != steady.plan_version:
            return False
        if not self._plan_fits():
            return False  # a group's params list replaced or grown: re-plan (and the values below compare safely)
        values = _group_values(groups)
        try:
            changed = values != steady.values
        except (RuntimeError, ValueError, TypeError):  # a value became a tensor or an array: no single truth value
            return False
        if changed:
            if _has_tensor(values):
                return False  # a hyperparameter became a tensor: the full step handles it
            if not fusion.refresh_values(groups):
                return False  # a switch changed (amsgrad, nesterov, ...): new kernels, through the full path
            steady.values = values
        if not fusion.unchanged():
            return False
        amp = steady.amp
        if amp is not None and not amp.take_scaled_loss():
            return False  # a loss not scaled by optimizer.backward: the full path says so
        self._step_count += 1
        self._zeroed = None
        norm = steady.graphs.replay_again().get("grad_norm")  # with float16 AMP, the scale update too
        fusion.count_replay()
        self._last_grad_norm = norm
        self._norm_is_static = norm is not None
        if steady.zeroed:
            self._remember_zeroed(steady.zeroed)
        self._stepped_without_base()
        return True

    def _clip_grads(self, reduce: Callable[..., None] | None = None) -> torch.Tensor:
        """Clipping as a pass of its own (the grads are not all fused): kitsune's two-launch clip_grad_norm_ when
        reductions are enabled, else torch's; with sharded grads (``reduce``) torch ops and a norm all-reduced."""
        params = self._params()
        sparse = next((i for i, p in enumerate(params) if p.grad is not None and p.grad.is_sparse), None)
        if sparse is not None:
            raise ValueError(
                f"max_grad_norm: param {sparse} (in the groups' order) has a sparse grad, and the global norm cannot "
                "be clipped over sparse grads (torch.nn.utils.clip_grad_norm_ cannot either): give that layer dense "
                "grads (nn.Embedding(sparse=False)) or leave max_grad_norm unset. Nothing was updated."
            )
        cfg = self.config
        if reduce is not None:
            from kitsune.distributed.zero import clip_sharded_grads_

            return clip_sharded_grads_(params, cfg.grads.max_norm, cfg.grads.norm_type, reduce)
        if cfg.fusion.enabled and cfg.fusion.enable_reduction:
            from kitsune.clip import clip_grad_norm_
        else:
            clip_grad_norm_ = torch.nn.utils.clip_grad_norm_
        norm = clip_grad_norm_(params, cfg.grads.max_norm, cfg.grads.norm_type)
        from kitsune.distributed.fsdp import local

        return local(norm)  # FSDP2 grads: torch returns a replicated DTensor; its local value is the global norm

    @property
    def last_grad_norm(self) -> torch.Tensor | None:
        """The global norm of the (unscaled) grads that the last step clipped, a float32 device tensor (reading
        its value syncs); ``None`` without ``max_grad_norm`` or before the first step. Inf or nan on a step that
        AMP skipped for inf/nan grads."""
        norm = self._last_grad_norm
        if self._norm_is_static and norm is not None:
            # copied out on first read (a clone queued behind the step that wrote it), not every step: the copy
            # costs a launch and tens of microseconds of host time that most steps never need
            norm = self._last_grad_norm = norm.clone()
            self._norm_is_static = False
        return norm

    def _baseline_now(self) -> bool:
        """Whether the profiler's live comparison wants the wrapped optimizer's own step for this one; moves
        state to where that step keeps it when a baseline stretch begins or ends (outside the timed steps)."""
        if not self._profiler.active:
            return False
        # with updates inside backward there is no step of kitsune's to time against the wrapped optimizer's
        baseline = self._profiler.wants_baseline(self._executes and not self._in_backward)
        if baseline != self._handed_over:
            for s in self._active:
                move = getattr(s, "hand_over" if baseline else "take_back", None)
                if move is not None:
                    move()
            self._handed_over = baseline
        return baseline

    def _take_grad_scaler_protocol(self, ctx: StepContext, fused: bool) -> None:
        """Honour a user's ``torch.amp.GradScaler``: it sets ``grad_scale``/``found_inf`` on us before ``step``.

        ``grad_scale`` is None when the user already called ``scaler.unscale_(optimizer)``. With ``fused`` the
        update kernel divides the grads by it; otherwise they are unscaled here first.
        """
        found_inf = self.__dict__.get("found_inf")
        if found_inf is None:
            return
        grad_scale = self.__dict__.get("grad_scale")
        if fused:
            ctx.extra["grad_scale"] = grad_scale
        elif grad_scale is not None:
            from kitsune.amp import unscale_and_check

            unscale_and_check(
                ctx.extra.get("grads") or self._grads_to_unscale(),
                grad_scale.double().reciprocal().float(),
                found_inf.clone(),
            )
        ctx.extra["found_inf"] = found_inf

    def _grad_versions(self) -> list[tuple[int, int]]:
        """Each grad's identity and version counter: equal only while no backward or in-place op touched them."""
        return [(id(g), g._version) for g in self._grads()]

    def _grads(self) -> list[torch.Tensor]:
        """Each param's grad once (a param listed twice is unscaled and clipped once, as for model.parameters())."""
        return [p.grad for p in self._params() if p.grad is not None]

    def _params(self) -> list[torch.Tensor]:
        """Every param once, in the groups' order (a param listed twice is counted once)."""
        params = [p for g in self.param_groups for p in g["params"]]
        return list({id(p): p for p in params}.values()) if self._repeated else params

    def _grads_to_unscale(self) -> list[torch.Tensor]:
        """The dense tensors that unscaling divides: each grad, or a sparse grad's values. As torch's GradScaler
        does, a float16 sparse grad is coalesced first (``p.grad`` replaced), so that duplicate indices are summed
        and an overflow in that sum is found."""
        out = []
        for p in self._params():
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                if g.dtype == torch.float16:
                    p.grad = g = g.coalesce()
                g = g._values()
            out.append(g)
        return out

    def _overflow_on_host(self, ctx: StepContext) -> bool:
        """Whether this step found inf/nan grads, read on the host only where a device-side skip is impossible.

        Executors that read ``found_inf`` on the device skip on their own; the wrapped optimizer's own step
        cannot, so when it has params to update this costs one sync (as ``GradScaler.step`` does).
        """
        found_inf = ctx.extra.get("found_inf")
        if found_inf is None:
            return False
        device_side = all(
            getattr(s, "consumes_found_inf", False) for s in self._active if getattr(s, "executes", False)
        )
        if device_side and not self._leftover and not ctx.baseline:
            return False
        self._host_syncs += 1
        return bool(found_inf.item())

    def _base_step(self, handled: set[torch.Tensor], closure: _Closure | None) -> Any:
        base = self._optimizer
        fn = type(base).step
        # torch wraps every Optimizer.step with its hook runner; call beneath it so hooks run once per step:
        # global hooks from this wrapper's own step, the wrapped optimizer's instance hooks from here.
        raw = fn.__wrapped__ if getattr(fn, "hooked", False) and hasattr(fn, "__wrapped__") else fn
        hidden = [(p, p.grad) for g in self.param_groups for p in g["params"] if p in handled] if handled else []
        for p, _ in hidden:
            p.grad = None
        try:
            self._run_base_hooks(pre=True)
            out = raw(base, closure) if closure is not None else raw(base)
            self._run_base_hooks(pre=False)
        finally:
            for p, grad in hidden:
                p.grad = grad
        base._opt_called = True
        self._base_steps += 1
        return out

    def _stepped_without_base(self) -> None:
        """Kitsune did the whole update: mark the wrapped optimizer as stepped and run its step hooks, as its own
        step() would have."""
        self._optimizer._opt_called = True  # LR schedulers built on the wrapped optimizer look for this
        self._run_base_hooks(pre=True)
        self._run_base_hooks(pre=False)

    def _run_base_hooks(self, pre: bool) -> None:
        base = self._optimizer
        hooks = base._optimizer_step_pre_hooks if pre else base._optimizer_step_post_hooks
        for hook in list(hooks.values()):
            hook(base, (base,), {})

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the grads of every param, as ``torch.optim.Optimizer.zero_grad`` does: set to None, or with
        ``set_to_none=False`` detached and zeroed in place, one ``_foreach_zero_`` per (device, dtype) as torch's
        foreach and fused optimizers do, whatever the wrapped optimizer (one that defines its own ``zero_grad`` is
        left to it).

        With ``GradConfig(zero_in_step=True)`` the fused update has already written zeros into the grads it used:
        those are left as they are (allocated, ``set_to_none`` notwithstanding) unless something changed them
        since (a backward pass bumps a grad's version counter), so the step's zeroing is the only pass over them.
        """
        self._subsystem("shard").zero_grad()  # sharded grads already reduced are discarded too
        zeroed, self._zeroed = self._zeroed, None
        skip: set[torch.Tensor] = set()
        pool = self._subsystem("memory")
        flat = getattr(pool, "flat_grads", False)
        n_params = sum(len(g["params"]) for g in self.param_groups)
        if zeroed is not None:
            params, ids, versions = zeroed
            grads = list(map(_GRAD, params))
            if not flat and len(params) == n_params and list(map(id, grads)) == ids and _versions(grads) == versions:
                return  # the step zeroed every param's grad, and nothing wrote to them since: nothing to do
            skip = {
                p
                for p, g, i, v in zip(params, grads, ids, versions, strict=True)
                if g is not None and id(g) == i and g._version == v
            }
        if flat:  # grads in the pool's arena: zeroed in place, kept (not set to None)
            skip |= pool.zero_grads(already_zero=skip)
            if len(skip) == n_params:
                return  # every grad is an arena view: the fill zeroed them all
        elif zeroed is None and type(self._optimizer).zero_grad is not _BASE_ZERO_GRAD:
            self._optimizer.zero_grad(set_to_none=set_to_none)  # an optimizer's own zero_grad is kept
            return
        if torch.autograd._profiler_enabled():  # the label torch's zero_grad gives a trace
            with torch.autograd.profiler.record_function(self._zero_grad_profile_name):
                self._zero_grads(skip, set_to_none)
        else:
            self._zero_grads(skip, set_to_none)

    def _zero_grads(self, skip: set[torch.Tensor], set_to_none: bool) -> None:
        """torch.optim's ``zero_grad`` for every param not in ``skip``, in plain loops: torch's own (a profiler
        label, the dynamo guard, two reads of each grad) took 0.43-0.49 ms of host time for GPT-2's 148 grads where
        setting them to None takes 0.29-0.32 ms (an H100 host; docs/benchmarks.md)."""
        params = [p for g in self.param_groups for p in g["params"]]
        if skip:  # (a tensor's hash is a Python call: only when something is skipped)
            params = [p for p in params if p not in skip]
        if set_to_none:
            for p in params:
                p.grad = None  # a no-op where it is None already
        else:
            _zero_in_place([g for g in map(_GRAD, params) if g is not None])

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group to the wrapped optimizer (its defaults fill the gaps) and re-plan."""
        if not hasattr(self, "_optimizer"):  # called by torch internals before __init__ finished
            raise RuntimeError("KitsuneOptimizer is not initialised yet")
        self._optimizer.add_param_group(param_group)
        self._replan()

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's state dict (torch's keys and layout) plus kitsune's own under ``"kitsune"``."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        sd = self._optimizer.state_dict()
        sd[KITSUNE_STATE_KEY] = {
            "version": STATE_VERSION,
            "step_count": self._step_count,
            "subsystems": {s.name: s.state_dict() for s in self._subsystems if s.state_dict()},
        }
        for hook in self._optimizer_state_dict_post_hooks.values():
            out = hook(self, sd)
            if out is not None:
                sd = out
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a state dict saved by kitsune or by the plain torch optimizer."""
        sd = dict(state_dict)
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            out = hook(self, sd)
            if out is not None:
                sd = out
        ours = sd.pop(KITSUNE_STATE_KEY, None)
        if ours is not None and ours.get("version", 0) > STATE_VERSION:
            raise ValueError(
                f"this checkpoint's kitsune state has version {ours['version']}, newer than this kitsune "
                f"understands ({STATE_VERSION}): upgrade kitsune-optim"
            )
        self._optimizer.load_state_dict(sd)
        if ours is not None:
            self._step_count = int(ours.get("step_count", 0))
            saved = ours.get("subsystems", {})
            for s in self._subsystems:
                if s.name in saved:
                    s.load_state_dict(saved[s.name])
        self._replan()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def __getstate__(self) -> dict[str, Any]:
        return {"optimizer": self._optimizer, "config": self.config, "kitsune": self.state_dict()[KITSUNE_STATE_KEY]}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["optimizer"], config=state["config"])  # type: ignore[misc]
        self._step_count = state["kitsune"]["step_count"]

    def __repr__(self) -> str:
        active = ", ".join(s.name for s in self._subsystems if s.active) or "none"
        return f"KitsuneOptimizer(active=[{active}]) wrapping {self._optimizer!r}"

    # -- reports ------------------------------------------------------------------------------------------------
    def subsystem_status(self) -> list[dict[str, Any]]:
        """For each subsystem: name, active, the reason when inactive, and what it reports."""
        return [s.status() for s in self._subsystems]

    def print_summary(self, console: Any = None) -> None:
        """Print the plan, the subsystems and the profiler's numbers as rich tables."""
        from kitsune.profiler.summary import print_summary

        print_summary(self, console=console)

    def save_profile(self, filepath: str | Path = "profile.json") -> Path:
        """Write the profile (environment, config, subsystems, per-step timings, statistics) as JSON."""
        from kitsune.profiler.schema import build_profile

        path = Path(filepath)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(build_profile(self).model_dump_json(indent=2), encoding="utf-8")
        return path

    def export_chrome_trace(self, filepath: str | Path = "trace.json") -> Path:
        """Write the timed steps (and NVML samples) as a Chrome trace that Perfetto and chrome://tracing open."""
        from kitsune.profiler.trace import export_chrome_trace

        return export_chrome_trace(self, filepath)


class _Steady:
    """What the steady replay compares a step against (the groups object and values the last step used) and what
    it books afterwards: float16 AMP's scaler (its graph updated the scale), the params whose grads it zeroed."""

    __slots__ = ("amp", "fusion", "graphs", "groups", "plan_version", "values", "zeroed")

    def __init__(
        self, groups: list, values: tuple, fusion: Any, graphs: Any, amp: Any, zeroed: list[torch.Tensor] | None
    ) -> None:
        self.groups, self.values, self.fusion, self.graphs = groups, values, fusion, graphs
        self.amp, self.zeroed = amp, zeroed
        self.plan_version: int = fusion.plan_version


def _group_values(groups: list[dict[str, Any]]) -> tuple:
    """Each group's values (its params list, the same object while the structure key holds, compares by identity)."""
    return tuple(tuple(g.values()) for g in groups)


def _zero_in_place(grads: list[torch.Tensor]) -> None:
    """Detach and zero ``grads`` as torch.optim's foreach ``zero_grad(set_to_none=False)`` does: one
    ``_foreach_zero_`` per (device, dtype) rather than a launch per grad (148 launches cost 1.5 ms of host time on
    GPT-2), sparse grads one by one."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        if g.requires_grad:  # a grad of backward(create_graph=True); the common grad needs no call here
            if g.grad_fn is not None:
                g.detach_()
            else:
                g.requires_grad_(False)
        if g.layout is torch.strided:
            groups[g.device, g.dtype].append(g)
        else:
            g.zero_()
    for tensors in groups.values():
        torch._foreach_zero_(tensors)


def _versions(grads: list[torch.Tensor | None]) -> list[int]:
    """Each grad's version counter (-1 for None): one C-level pass when every grad is there."""
    try:
        return list(map(_VERSION, grads))
    except AttributeError:  # a None grad
        return [-1 if g is None else g._version for g in grads]


def _has_tensor(values: tuple) -> bool:
    return any(isinstance(v, torch.Tensor) for row in values for v in row)


def _has_step_hooks(s: Subsystem) -> bool:
    """Whether ``s`` does anything in the per-step hooks (the steady replay books float16 AMP's itself)."""
    t = type(s)
    return any(getattr(t, m) is not getattr(Subsystem, m) for m in ("before_step", "step", "after_step"))


def _make_fusion(cfg: FusionConfig) -> Subsystem:
    if not cfg.enabled:
        return PlaceholderSubsystem("fusion", requested=False, reason="enable_fusion=False")
    try:
        from kitsune.fusion import FusionSubsystem
    except ImportError as exc:  # triton missing, or a platform without it
        return PlaceholderSubsystem("fusion", requested=True, reason=f"cannot import the fusion engine: {exc}")
    return FusionSubsystem(cfg)
