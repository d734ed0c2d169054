"""KitsuneOptimizer: a ``torch.optim.Optimizer`` that wraps another one and owns no math.

It shares the wrapped optimizer's ``param_groups``, ``state`` and ``defaults`` objects (they are properties that
read and write the wrapped optimizer's attributes), so an LR scheduler built on either drives both, checkpoints
have torch's layout, and ``isinstance(opt, torch.optim.Optimizer)`` holds for Lightning, Accelerate and torch's
schedulers. ``step()`` is one pipeline over narrow roles (`kitsune.subsystem` lists them): nothing is written
before everything that can fail has been checked, and hooks run where torch runs them.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks as _global_post
from torch.optim.optimizer import _global_optimizer_pre_hooks as _global_pre

from kitsune import checkpoint
from kitsune._untraced import never_traced
from kitsune.amp import AMPSubsystem
from kitsune.config import (
    AMPConfig,
    FusionConfig,
    GradConfig,
    KitsuneConfig,
    ShardConfig,
    StreamConfig,
    resolve_config,
    setting_hint,
)
from kitsune.distributed.zero import ShardSubsystem
from kitsune.fusion import algos, state_format
from kitsune.fusion.algos import trust_ratios
from kitsune.fusion.executor import Rerouted
from kitsune.grads import GradPass
from kitsune.graphs import GraphSubsystem
from kitsune.memory import MemoryPool
from kitsune.profiler import Profiler
from kitsune.profiler.core import describe_step
from kitsune.profiler.schema import save_profile
from kitsune.profiler.summary import print_summary
from kitsune.profiler.trace import export_chrome_trace
from kitsune.streams import StreamScheduler
from kitsune.subsystem import Accumulation, PlannedGroups, StepState, Subsystem, make_fusion, unique_params
from kitsune.wrapped import WrappedStep, refuse_per_evaluation_passes, run_hooked, step_closure

_Closure = Callable[[], Any]


F = TypeVar("F", bound=Callable[..., Any])


class _Shared:
    """An attribute of the wrapped optimizer, read and written through the wrapper: one object under two names."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj._optimizer, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj._optimizer, self.name, value)


class _SharedState(_Shared):
    """The wrapped optimizer's ``state``, read after the lazy state of steps AMP skipped on the device is gone
    (`kitsune.fusion.FusionSubsystem.settle_skips`): what a reader sees is what torch's skipped step leaves."""

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is not None and "_fusion" in obj.__dict__:
            obj._fusion.settle_skips()
        return super().__get__(obj, owner)


_TRIES = 4
"""Tries of a step whose fused kernels fail to compile (each sends every bucket whose kernel failed to torch's route,
so a second is rare) before the last one's error reaches the caller."""


def _evaluated(loss: Any) -> _Closure:
    """A closure returning ``loss``: the user's, which this step evaluated (`KitsuneOptimizer._rerouting`)."""
    return lambda: loss


def _proxied(self: Any) -> KitsuneOptimizer | None:
    """The wrapper where ``self`` is a framework's proxy of it, else None. Lightning's ``LightningOptimizer``
    (``self.optimizers()``) and Fabric's optimizer are instances of a class made from their own and the wrapper's,
    whose ``_optimizer`` is the wrapper and which read every other attribute from it: the wrapper's method run on
    such a proxy would take the wrapper for the torch optimizer it wraps (``add_param_group`` re-planned the wrapper
    as an optimizer it cannot fuse: a step was lost) and keep its bookkeeping on the proxy."""
    inner = getattr(self, "_optimizer", None)
    return inner if isinstance(inner, KitsuneOptimizer) else None  # the wrapper's own is a torch optimizer


def _on_the_wrapper(method: F) -> F:
    """``method`` run on the wrapper itself where it is called on a framework's proxy of it (`_proxied`). Both
    proxies define their own ``step``, which calls the wrapper's: ``step`` is left as it is."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        inner = _proxied(self)
        return method(self, *args, **kwargs) if inner is None else getattr(inner, method.__name__)(*args, **kwargs)

    return cast(F, run)


def _untraced_on_the_wrapper(method: F) -> F:
    """`_on_the_wrapper` for a method torch.compile does not trace: this wrapper's code is marked as ``method``'s
    (`never_traced`), so a traced function's call of it is a graph break, as before."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        inner = _proxied(self)
        return method(self, *args, **kwargs) if inner is None else getattr(inner, method.__name__)(*args, **kwargs)

    return never_traced(cast(F, run))


def _noting_settings_given(init: Callable[..., None]) -> Callable[..., None]:
    """``KitsuneOptimizer.__init__``, noting which settings the caller passed by name, so that a
    setting passed beside ``config=`` is refused where its value is its default too (``profile=False`` against a
    config that profiles)."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def noting(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            self._settings_given = frozenset(signature.bind(self, *args, **kwargs).arguments)
        except TypeError:  # missing or unknown arguments: the one line that names the fix, else Python's own error
            _refuse_arguments(signature, args, kwargs)
        init(self, *args, **kwargs)

    return noting


def _refuse_arguments(signature: inspect.Signature, args: tuple, kwargs: dict[str, Any]) -> None:
    """A TypeError naming the fix for settings passed by position (``KitsuneOptimizer(opt, True)``) or misspelt
    (``enable_fusions=True``); returns where neither is the trouble (Python's own error follows)."""
    if len(args) > 1:
        raise TypeError(
            f"KitsuneOptimizer takes the optimizer as its only positional argument, got {len(args)}: name each "
            "setting, e.g. KitsuneOptimizer(optimizer, enable_fusion=True)"
        )
    names = [n for n in signature.parameters if n not in ("self", "optimizer")]
    for key in kwargs:
        if key not in signature.parameters:
            hint = setting_hint(key, names, "the settings")
            raise TypeError(f"KitsuneOptimizer got an unknown setting {key!r}: {hint}")


class KitsuneOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` and run its step through kitsune's subsystems.

    Args:
        optimizer: the torch optimizer to wrap (any ``torch.optim.Optimizer``).
        enable_amp: mixed precision with a device-resident loss scaler (see [`AMPConfig`][kitsune.AMPConfig]).
        enable_fusion: fused Triton multi-tensor kernels where the planner can use them.
        num_streams: CUDA side streams the scheduler may use.
        profile: record per-step timings for [`print_summary`][kitsune.KitsuneOptimizer.print_summary] and
            [`save_profile`][kitsune.KitsuneOptimizer.save_profile].
        amp_config: AMP settings; needs ``enable_amp=True``.
        fusion_config: fusion settings; needs ``enable_fusion=True``.
        stream_config: stream settings; its ``num_streams`` must agree with ``num_streams`` if both are set.
        memory_pool_size: most bytes per device of flat arena for the fused params' optimizer state (0: off).
        capture_graph: capture the optimizer phase in a CUDA graph (CUDA only).
        max_grad_norm: clip the grads to this global norm inside the step (a 2-norm unless
            [`GradConfig`][kitsune.GradConfig]'s ``norm_type`` says otherwise).
        grad_config: clipping (norm type) and zeroing of the grads in the step.
        zero_stage: shard the optimizer state over torch.distributed's ranks: 1 or 2 (ZeRO), 0 off (see
            [`ShardConfig`][kitsune.ShardConfig]).
        shard_config: sharding settings (process group, bucket size, overlap); its ``stage`` must agree with
            ``zero_stage`` if both are set.
        config: all of the above in one [`KitsuneConfig`][kitsune.KitsuneConfig]; exclusive with the other settings.
    """

    _step_supports_amp_scaling = True
    """``torch.amp.GradScaler.step`` hands us ``grad_scale``/``found_inf`` instead of syncing itself."""

    @_noting_settings_given
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        enable_amp: bool = False,
        enable_fusion: bool = False,
        num_streams: int = 4,
        profile: bool = False,
        amp_config: AMPConfig | None = None,
        fusion_config: FusionConfig | None = None,
        stream_config: StreamConfig | None = None,
        memory_pool_size: int = 512 * 1024 * 1024,
        capture_graph: bool = True,
        max_grad_norm: float | None = None,
        grad_config: GradConfig | None = None,
        zero_stage: int = 0,
        shard_config: ShardConfig | None = None,
        config: KitsuneConfig | None = None,
    ) -> None:
        given = self.__dict__.pop("_settings_given", None)
        if not isinstance(optimizer, torch.optim.Optimizer):
            if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
                got = f"the class {optimizer.__name__}"
            else:
                got = type(optimizer).__name__
            raise TypeError(
                f"KitsuneOptimizer wraps a torch optimizer built over the params, got {got}: build it first, "
                "e.g. KitsuneOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4), enable_fusion=True)"
            )
        if isinstance(optimizer, KitsuneOptimizer):
            raise ValueError("this optimizer is already a KitsuneOptimizer: wrap the torch optimizer only once")
        sections = {"amp_config": amp_config, "fusion_config": fusion_config, "stream_config": stream_config}
        sections |= {"grad_config": grad_config, "shard_config": shard_config}
        kwargs = {"enable_amp": enable_amp, "enable_fusion": enable_fusion, "num_streams": num_streams}
        kwargs |= {"profile": profile, "memory_pool_size": memory_pool_size, "capture_graph": capture_graph}
        kwargs |= {"max_grad_norm": max_grad_norm, "zero_stage": zero_stage}
        self.config: KitsuneConfig = resolve_config(config, sections, kwargs, given)
        refuse_per_evaluation_passes(optimizer, self.config.grads.max_norm is not None, self.config.amp.scales_loss)
        self._optimizer = optimizer
        # torch.optim.Optimizer.__init__ would rebuild param_groups; set up only its hook bookkeeping.
        for kind in ("step_pre", "step_post", "state_dict_pre", "state_dict_post", "load_state_dict_pre"):
            setattr(self, f"_optimizer_{kind}_hooks", OrderedDict())
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._zero_grad_profile_name = f"Optimizer.zero_grad#{type(self).__name__}.zero_grad"
        self._warned_capturable_if_run_uncaptured = True
        self._step_count = 0
        self._handed_over = False
        self._build(optimizer)
        self._replan()
        self._warn_requested_but_inactive()

    def _build(self, base: torch.optim.Optimizer) -> None:
        """The roles of the pipeline, each handed its own config and what it works with (never this object)."""
        cfg = self.config
        self._profiler = Profiler(cfg.profiler)
        self._accumulation = accumulation = Accumulation()
        self._shard = ShardSubsystem(cfg.shard, accumulation)
        self._amp = amp = AMPSubsystem(cfg.amp)
        scaler = amp if cfg.amp.scales_loss else None
        self._pool = pool = MemoryPool(cfg.memory)
        self._fusion = fusion = make_fusion(cfg, pool)
        kernels = cfg.fusion.enabled and cfg.fusion.enable_reduction
        self._grads = GradPass(cfg.grads, self._shard, pool, scaler, kernels)
        fits = weakref.WeakMethod(self._plan_fits)  # weakly: the optimizer goes without the cycle collector
        self._streams = StreamScheduler(
            cfg.streams, cfg.graphs, fusion=fusion, clip=cfg.grads.max_norm is not None,
            scaling=scaler is not None, step_state=self._grads.backward_state, accumulation=accumulation,
            plan_fits=lambda: (check := fits()) is None or check(),
        )  # fmt: skip
        self._graphs = GraphSubsystem(cfg.graphs, fusion=fusion, scaler=scaler)
        self._wrapped = WrappedStep(base)
        self._own_step_guard: Any = None
        """The wrapped optimizer's step pre-hook that refuses its own ``step()`` where it would go wrong
        (`_guard_own_step`)."""
        self._subsystems: list[Subsystem] = [
            self._profiler, self._shard, amp, pool, fusion, self._streams, self._graphs,
        ]  # fmt: skip

    # the wrapped optimizer's own objects, read and written through the wrapper
    param_groups: list[dict[str, Any]] = _Shared()  # type: ignore[assignment]
    state: Any = _SharedState()
    defaults: dict[str, Any] = _Shared()  # type: ignore[assignment]

    # -- public properties --------------------------------------------------------------------------------------
    @property
    def base_optimizer(self) -> torch.optim.Optimizer:
        """The wrapped torch optimizer."""
        inner = _proxied(self)
        return self._optimizer if inner is None else inner.base_optimizer

    @property
    def profiler(self) -> Profiler | None:
        """The profiler when ``profile=True``, else ``None``."""
        return self._profiler if self._profiler.active else None

    @property
    def scheduler(self) -> StreamScheduler:
        """The stream scheduler (``scheduler.num_streams``)."""
        return self._streams

    @property
    def plan(self) -> Any:
        """Which params go to which kernel and which fall back, with reasons (a rich-printable object)."""
        return self._fusion.current_plan

    @property
    def subsystems(self) -> list[Subsystem]:
        """Every subsystem, active or not, in lifecycle order."""
        return list(self._subsystems)

    def _subsystem(self, name: str) -> Subsystem:
        return next(s for s in self._subsystems if s.name == name)

    @property
    def step_count(self) -> int:
        """Calls of [`step`][kitsune.KitsuneOptimizer.step] that completed (restored from checkpoints)."""
        return self._step_count

    @property
    def last_grad_norm(self) -> torch.Tensor | None:
        """The global norm of the (unscaled) grads that the last step clipped, a float32 device tensor (reading
        its value syncs); ``None`` without ``max_grad_norm`` or before the first step; 0 after a step in which no param
        had a grad (as torch's ``clip_grad_norm_`` of no grads). Inf or nan on a step that AMP skipped for inf/nan
        grads."""
        return self._grads.last_norm

    @property
    def loss_scale(self) -> float:
        """The current dynamic loss scale (1.0 without float16 AMP). Reading it syncs once."""
        return self._amp.loss_scale

    @property
    def skipped_steps(self) -> int:
        """Steps whose update was skipped for inf/nan grads. Reading it syncs once."""
        return self._amp.skipped_steps

    @property
    def base_steps(self) -> int:
        """Steps in which the wrapped optimizer's own step ran (for params kitsune left to it, or as the
        profiler's live-comparison baseline)."""
        return self._wrapped.steps

    @property
    def host_syncs(self) -> int:
        """Host syncs kitsune itself made inside ``step()`` so far (reading found_inf for a fallback step)."""
        return self._grads.host_syncs

    # -- planning -----------------------------------------------------------------------------------------------
    def _plan_fits(self) -> bool:
        """Whether the plan still fits the groups (see `kitsune.subsystem.PlannedGroups`)."""
        groups, state = self._optimizer.param_groups, self._optimizer.state
        return self._planned.fits(groups, state) and self._shard.fits() and self._streams.fits()

    def _replan(self) -> None:
        base, groups = self._optimizer, self.param_groups
        params = unique_params(groups)
        grads, clips = self.config.grads, self.config.grads.max_norm is not None
        self._shard.plan(groups, base, grads.norm_type, clips, self.config.amp.scales_loss)  # first: what others update
        self._amp.plan(params)
        self._fusion.plan(base, self._shard.remote, self._streams.unit_bytes(groups, trust_ratios(base)))
        self._planned = PlannedGroups(groups, base.state)
        self._follow_fusion()
        plan = self._fusion.current_plan
        self._profiler.plan(params, describe_step(base), plan.bytes_per_step if plan is not None else None)

    def _leftover_now(self) -> bool:
        """Whether the wrapped optimizer's own step has params to update under the fused executor's plan as it is."""
        owned = {id(p) for p in (*self._fusion.owned_params(), *self._shard.remote)}
        return any(id(p) not in owned for g in self.param_groups for p in g["params"])

    def _fit_plan(self) -> None:
        """Plan again inside the step where the groups no longer fit the plan; refused where updates already ran
        inside backward (their plan is the one that knows which params they updated: a new one would update them a
        second time, or miss a param added since)."""
        if self._plan_fits():
            return
        if self._streams.updated_since_step:
            raise RuntimeError(
                "kitsune: the param groups changed after updates ran inside backward (StreamConfig("
                "step_in_backward=True)): a param added, removed or moved between backward() and step(), or in the "
                "closure after its backward. Those updates used the groups as they were, so this step would update "
                "some params a second time or miss others. Change the groups before the forward pass (or after "
                "step()), or turn step_in_backward off. This step changed nothing more."
            )
        self._replan_in_step()

    def _replan_in_step(self) -> None:
        """`_replan` inside a step: the state as it was goes in the fused executor's journal first, so that a step
        that raises leaves it as it found it, whatever the new plan converted (not with sharded state, whose plan
        moves state between ranks)."""
        if not self._shard.active:
            self._fusion.journal()
        self._replan()

    def _follow_fusion(self) -> None:
        """Plan what follows from the fused executor's plan: who updates the rest, and how the step runs."""
        fusion, groups = self._fusion, self.param_groups
        self._leftover = self._leftover_now()
        self._executes = fusion.executes or self._shard.executes
        self._grads.plan(groups, fusable=fusion.active and fusion.grad_pass is None and not self._leftover)
        self._streams.plan(groups)
        in_backward, sharded = self._streams.in_backward, self._shard.active
        self._graphs.plan(
            leftover=self._leftover, grad_passes=self._grads.passes, in_backward=in_backward, sharded=sharded
        )  # fmt: skip
        self._plan_version = fusion.plan_version
        # a step asks the fused executor for moved storages, freed state and changed switches before it decides
        # how to clip and unscale (a re-plan may change that), except: with ZeRO one rank alone may see a move, and
        # a full re-plan there runs collectives the other ranks do not; with updates inside backward the units
        # updated there must not be updated again. Those re-plan the fused executor alone inside its prepare.
        self._precheck = fusion.watches and not in_backward and not sharded
        self._device_side = not self._leftover and not sharded and fusion.consumes_found_inf
        self._guard_own_step()

    def _guard_own_step(self) -> None:
        """Hook the wrapped optimizer's own ``step()`` while the plan makes it go wrong when called in place of this
        one's (`_own_step_refusal`), and only then: the hook costs a call on every step."""
        needed = self._streams.in_backward or self._fusion.low_precision is not None
        guard = self._own_step_guard
        if needed and guard is None:
            guard = self._own_step_guard = self._optimizer.register_step_pre_hook(_own_step_guard(weakref.ref(self)))
            weakref.finalize(self, guard.remove)
        elif not needed and guard is not None:
            guard.remove()
            self._own_step_guard = None

    def _refuse_after_updates_in_backward(self, what: str) -> None:
        """Raise before ``what`` (a call that plans again) changes anything where updates ran inside the last
        backward and its step() has not run yet: a new plan would forget which params they updated, so step() would
        update them a second time (and a loaded state would not be the one they started from)."""
        if self._streams.updated_since_step:
            raise RuntimeError(
                f"kitsune: {what} was called between a backward that ran updates inside it (StreamConfig("
                "step_in_backward=True)) and step(): the params and state already hold those updates, which a new "
                f"plan would apply a second time. Call {what} after step() (or before the forward pass), or turn "
                "step_in_backward off. Nothing was changed."
            )

    def _own_step_refusal(self, name: str) -> str | None:
        """Why the wrapped optimizer's own ``step()`` (``name``), called in place of this optimizer's, must not run, or
        None where it may."""
        if self._streams.updated_since_step:
            return (
                f"kitsune: {name}.step() ran on the optimizer a KitsuneOptimizer wraps, after a backward that updated "
                "its params inside it (StreamConfig(step_in_backward=True)): that step would update them a second "
                "time. Call the step() of the newest KitsuneOptimizer over it (not the wrapped optimizer's own, nor "
                "an older KitsuneOptimizer's or a copy.copy's over the same optimizer). Nothing was changed."
            )
        low = self._fusion.low_precision
        if low is not None:
            return (
                f"kitsune: {name}.step() ran on the optimizer a KitsuneOptimizer wraps, which holds {low} (it would "
                "count the step and then raise). Call the KitsuneOptimizer's step(); docs/low-precision.md says how "
                "to move the state to a plain optimizer. Nothing was changed."
            )
        return None

    def _warn_requested_but_inactive(self) -> None:
        """Warn at the line that built the optimizer (past this method, __init__ and the wrapper noting settings)."""
        cfg = self.config
        asked = {"amp": cfg.amp.enabled, "fusion": cfg.fusion.enabled, "shard": cfg.shard.stage}
        for s in self._subsystems:
            if asked.get(s.name) and not s.active and not (s is self._fusion and self._fusion.waits):
                warnings.warn(f"kitsune: {s.name} was asked for but is inactive: {s.reason}", UserWarning, stacklevel=4)

    # -- the step -----------------------------------------------------------------------------------------------
    @never_traced  # inside a function torch.compile traces: a graph break, and the step runs as it is
    def step(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """One optimizer step, ``step(closure=None)`` as torch's; torch's hook order around it: global and then this
        optimizer's pre-hooks, the wrapped optimizer's pre-hooks, the update, its post-hooks, this optimizer's and
        then the global post-hooks. Hooks get the arguments as the caller passed them (a closure by keyword stays a
        keyword) and may return new ones, as with torch's optimizers."""
        pre, post = self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks
        stepping = _STEPPING.bases
        # the wrapped optimizer's pre-hooks run from this step (in this thread): its guard lets them be
        stepping.append(id(self._optimizer))
        try:
            if not (pre or post or _global_pre or _global_post or torch.autograd._profiler_enabled()):
                return self._step(*args, **kwargs)  # torch's hook runner costs a profiler label (~50 us of host time)
            return run_hooked(self, self._step, (self, *args), kwargs, pre, post)
        finally:
            stepping.pop()

    step.hooked = True  # type: ignore[attr-defined]  # torch's hook runner leaves it alone: it runs them itself
    step.__signature__ = inspect.signature(torch.optim.Optimizer.step)  # type: ignore[attr-defined]

    def _step(self, *args: Any, **kwargs: Any) -> Any:
        self._streams.note_step()  # (a zero_grad() after a refused step is no backward left without a step)
        self._fusion.settle_skips()  # a skipped step's lazy state goes before hooks or a plan see it
        profiler = self._profiler
        profiling = profiler.active
        # past the windows, with the fused executor's steps taken back from a baseline stretch, nothing to ask
        asks = profiling and (profiler.sampling or self._handed_over)
        s = StepState(self._step_count + 1, asks and self._baseline_now())
        if profiling:
            profiler.start(s)  # the whole step is timed, the wrapped optimizer's hooks included
        try:
            # before anything changes, as the wrapped optimizer's own step runs them; they may change the arguments
            args, kwargs = self._wrapped.pre_hooks(args, kwargs)
            closure = step_closure(*args, **kwargs)
            steady = closure is None and "found_inf" not in self.__dict__ and self._graphs.active
            loss = None
            base = self._optimizer
            if not (steady and self._graphs.replay_steady(s, base.param_groups, base.state, self._planned)):
                loss, s = self._rerouting(s, closure)
        except BaseException:
            self._fusion.restore_journal()  # what a re-plan inside the step converted goes back
            self._profiler.abandon_step()
            # a GradScaler's hand-over: its step deletes these once this step returns, not when it raises, and a
            # loop that drops the GradScaler after the refusal would find them still here
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            raise
        self._fusion.drop_journal()
        self._step_count = s.step
        try:  # the step is applied: its record is kept even where a post-hook raises (and a probe step's set-up undone)
            self._grads.finish(s, self.param_groups)
            self._wrapped.post_hooks(args, kwargs)
        finally:
            if profiling:
                profiler.stop(s)
        return loss

    def _rerouting(self, s: StepState, closure: _Closure | None) -> tuple[Any, StepState]:
        """`_pipeline`, again on a new plan where a fused kernel failed to compile (`Rerouted`: raised before anything
        changed, its params now routed to torch's step); the closure runs once (the first try evaluated it).
        Returns the loss and the step's state as the try that ran left it."""
        for attempt in range(_TRIES):
            try:
                return self._pipeline(s, closure), s
            except Rerouted as exc:
                self._fusion.restore_journal()  # what a re-plan inside the failed try converted
                if attempt == _TRIES - 1:
                    raise RuntimeError(
                        f"kitsune: fused kernels failed to compile on {_TRIES} plans in a row ({exc}). This step "
                        "updated nothing (updates inside backward stand); enable_fusion=False runs the optimizer's "
                        "own step"
                    ) from exc
                if closure is not None:
                    closure = _evaluated(exc.loss)
                if s.phases is not None:  # a probe step: the failed try (and the compile that failed) is one phase
                    s.phases.restart("rerouted")
                # (a user's GradScaler's unscale that ran stays run: `handoff_unscaled`)
                s = StepState(s.step, s.baseline, s.phases, updated_before=tuple(self._fusion.updated),
                              handoff_unscaled=s.handoff_unscaled)  # fmt: skip
        raise AssertionError("unreachable")

    def _pipeline(self, s: StepState, closure: _Closure | None) -> Any:
        """plan current? -> prepare and check -> grad pass -> execute -> finish. Raises before the first param or
        state tensor changes (a pass of the grads' own may have run: see kitsune.grads)."""
        self._graphs.refuse_caller_capture()
        self._graphs.disarm()
        self._fit_plan()
        loss = None
        if closure is not None and (self._executes or self._grads.passes or self._fusion.checks_grads):
            with torch.enable_grad():  # the updates, the grads' passes and their checks need the grads first
                loss = closure()
            closure = None
            self._fit_plan()  # the closure may have changed the groups: torch's step reads them after it
        fusion, groups = self._fusion, self.param_groups
        # the fused executor stands aside on the comparison's baseline steps (its step counts handed over to the host)
        s.structure_checked = self._precheck and not s.baseline
        if s.structure_checked and fusion.needs_replan():
            self._replan_in_step()  # a switch changed or a storage moved: the new plan may route params differently
        fusion.refuse_unmatched()  # narrowed state the wrapped step lerps grads of another dtype into
        found_inf = self.__dict__.get("found_inf")  # a user's GradScaler hands these over (see torch.amp)
        handoff = None if found_inf is None else (self.__dict__.get("grad_scale"), found_inf)
        executes = fusion.executes and not s.baseline  # baseline: the wrapped optimizer's step updates everything
        try:
            self._grads.begin(s, groups, handoff)  # shard reduce, and the checks of the grads' passes
            self._streams.begin(s)  # updates inside backward: their checks, then the step waits for them
            if executes:
                fusion.check(s)  # a state missing a key the optimizer reads raises here, as torch's step does
            self._grads.apply(s, groups, handoff[0] if handoff and not s.fused_grads else None)
            if not self._grads.skip_on_host(s, self._device_side):
                live = fusion.prepare(s) if executes else []
                leftover = self._leftover
                if fusion.plan_version != self._plan_version:  # re-planned in its prepare (updates inside backward)
                    leftover = self._leftover_now()  # params the new plan leaves to the wrapped step: updated below
                    fusion.refuse_unmatched()  # ... and those the new plan found narrowed
                self._grads.unscale_left(s)  # a user's GradScaler: the grads the wrapped step takes, unscaled
                # params met with grads the fused kernels cannot take (sparse, another dtype) go to the wrapped step,
                # which cannot skip on the device: an overflow is read on the host for it, as GradScaler.step does
                skip_wrapped = bool(s.unhandled) and self._device_side and self._grads.skip_on_host(s, False)
                if (leftover or closure is not None or s.unhandled or s.baseline) and not skip_wrapped:
                    out = self._wrapped.run(s.handled, closure)  # the wrapped step's own checks raise here
                    loss = out if closure is not None else loss
                    if s.phases is not None:
                        s.phases.mark("fallback")
                if executes:
                    fusion.run_fallbacks(s)
                    (self._graphs if self._graphs.active else fusion).execute(s, live)
        except BaseException as exc:
            if executes:
                fusion.undo()
            if isinstance(exc, Rerouted):
                exc.loss = loss  # the closure's, for the try on the new plan
            self._grads.abandon(s, groups)
            if fusion.plan_version != self._plan_version:  # re-planned inside the step: what follows from it too
                self._follow_fusion()
            raise
        self._finish(s)
        return loss

    def _finish(self, s: StepState) -> None:
        if s.baseline and s.grad_write == 2 and self._fusion.executes:
            self._fusion.zero_as_kernels(s)  # the comparison's step of the wrapped optimizer zeroes as kitsune's does
        if self.config.amp.scales_loss and not s.unscaled:
            self._amp.finish(s.found_inf, scale_updated=s.graphed)
        if self._shard.active:
            self._shard.finish()
        self._streams.finish()
        if self._fusion.plan_version != self._plan_version:
            self._follow_fusion()  # the fused executor re-planned inside the step (ZeRO, updates inside backward)

    def _baseline_now(self) -> bool:
        """Whether the profiler's live comparison wants the wrapped optimizer's own step for this one; moves the
        fused executor's step counts to where that step keeps them when a baseline stretch begins or ends."""
        baseline = False
        if self._profiler.sampling:  # past the sampled windows (most steps) there is nothing to ask
            # with updates inside backward there is no step of kitsune's to time against the wrapped optimizer's
            low = self._fusion.low_precision  # state only kitsune's kernels read: the wrapped step cannot run on it
            baseline = self._profiler.wants_baseline(self._executes and not self._streams.in_backward and not low, low)
        if baseline != self._handed_over and self._fusion.executes:
            self._fusion.hand_over() if baseline else self._fusion.take_back()
        self._handed_over = baseline
        return baseline

    # -- mixed precision and the training loop ------------------------------------------------------------------
    @_on_the_wrapper
    def autocast(self) -> Any:
        """Autocast context for the forward pass in the AMP dtype (a disabled autocast when AMP is off)."""
        return self._amp.autocast()

    @_on_the_wrapper
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, with the loss scaled first when AMP runs in float16."""
        self.scale_loss(loss).backward(**kwargs)

    @_on_the_wrapper
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale (float16 AMP; otherwise ``loss`` itself), for a loop that runs its
        own backward (``accelerator.backward(optimizer.scale_loss(loss))``);
        [`backward`][kitsune.KitsuneOptimizer.backward] calls it."""
        return self._amp.scale_loss(loss)

    @_on_the_wrapper
    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Context for the backward passes of gradient accumulation's micro-steps that do not step: with
        ``StreamConfig(step_in_backward=True)`` they launch no updates (the grads just add up); the backward of the
        micro-step that steps runs outside it. Without step_in_backward it changes nothing, so loops can always use it.
        With sharded state (``zero_stage``) the grads of those micro-steps are not reduced across ranks either.
        """
        with self._accumulation:
            yield

    @_untraced_on_the_wrapper
    @never_traced
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the grads of every param as ``torch.optim.Optimizer.zero_grad`` does (see
        `kitsune.grads.GradPass.zero_grad` for ``GradConfig(zero_in_step=True)`` and flat grads); with updates inside
        backward, a backward that did not reach ``step()`` is forgotten (see `StreamScheduler.discard_backward`)."""
        dropped = self._streams.discard_backward()
        self._grads.zero_grad(self._optimizer, set_to_none, self._zero_grad_profile_name)
        if dropped is not None:
            raise dropped

    @_untraced_on_the_wrapper
    @never_traced  # as torch.optim's: not traced by torch.compile
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group to the wrapped optimizer (its defaults fill the gaps) and re-plan; a group the plan
        cannot take (a switch of the wrong type, ``momentum="0.9"``) is removed again before the error is raised."""
        if not hasattr(self, "_optimizer"):  # called by torch internals before __init__ finished
            raise RuntimeError("KitsuneOptimizer is not initialised yet")
        self._refuse_after_updates_in_backward("add_param_group()")
        groups = self._optimizer.param_groups
        count = len(groups)
        if self._shard.active and isinstance(param_group, dict):  # the groups hold shards: torch's check misses those
            new = param_group["params"]
            new = param_group["params"] = [new] if isinstance(new, torch.Tensor) else list(new)
            held = {id(p) for p in self._shard.params}
            if any(id(p) in held for p in new):
                raise ValueError("some parameters appear in more than one parameter group")  # torch's words
        self._optimizer.add_param_group(param_group)
        try:
            self._replan()
        except BaseException:
            del groups[count:]
            self._replan()  # the plan of the groups as they were
            raise

    # -- checkpoints and copies ---------------------------------------------------------------------------------
    @_untraced_on_the_wrapper
    @never_traced  # as torch.optim's: not traced by torch.compile
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's state dict (torch's keys and layout) plus kitsune's own under ``"kitsune"``. 8-bit
        state of FSDP2 params is decoded into torch's keys as fp32 DTensors, as torch keeps FSDP2 state (see
        `kitsune.fusion.state_format.for_checkpoint`)."""
        self._shard.wait_params()  # a checkpoint saves the model's params next to it
        self._fusion.settle_skips()
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        sd = self._optimizer.state_dict()
        sd["state"] = state_format.for_checkpoint(sd["state"])
        sd[checkpoint.KEY] = checkpoint.own_state(self._subsystems, self._step_count)
        for hook in self._optimizer_state_dict_post_hooks.values():
            out = hook(self, sd)
            if out is not None:
                sd = out
        return sd

    @_on_the_wrapper
    def wait_params(self) -> None:
        """ZeRO with ``ShardConfig(gather_in_forward=True)``: complete the params' all-gather now, so every param
        holds the last step's update before it is read outside a module's forward (an EMA, ``model.state_dict()``).
        Does nothing otherwise."""
        self._shard.wait_params()

    @_untraced_on_the_wrapper
    @never_traced  # as torch.optim's: not traced by torch.compile
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a state dict saved by kitsune or by the plain torch optimizer: all of it, or (raising) none of it."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"load_state_dict takes the dict state_dict() returned, got {type(state_dict).__name__}: for a file, "
                "load it first (optimizer.load_state_dict(torch.load(path)['optimizer']), say)"
            )
        if "param_groups" not in state_dict:
            keys = ", ".join(repr(k) for k in list(state_dict)[:6]) or "none"
            inner = next(
                (k for k in state_dict if isinstance(state_dict[k], Mapping) and "param_groups" in state_dict[k]), None
            )
            fix = (
                f"it holds one under {inner!r}: optimizer.load_state_dict(checkpoint[{inner!r}])"
                if inner is not None
                else "pass the dict optimizer.state_dict() returned (its keys: 'state', 'param_groups')"
            )
            raise KeyError(
                f"load_state_dict takes an optimizer's state dict, which has 'param_groups' (keys here: {keys}): {fix}"
            )
        self._refuse_after_updates_in_backward("load_state_dict()")
        self._fusion.settle_skips()  # before the state is replaced: a later settle would drop loaded state
        sd = self._shard.filter_load(dict(state_dict))  # a sharded run keeps its own share
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            out = hook(self, sd)
            if out is not None:
                sd = out
        sd = dict(sd)
        ours = checkpoint.check_own_state(sd.pop(checkpoint.KEY, None), self._subsystems)
        base = self._optimizer
        before = base.state, base.param_groups
        sd, low = state_format.split_low(sd)  # 8-bit state goes around torch's cast to the params' dtype
        # the wrapped optimizer's own post-hooks run once the load can no longer fail, as torch runs none for a failed
        # load (its load ends with them; kitsune's checks come after it)
        base_post_hooks = base.__dict__.get("_optimizer_load_state_dict_post_hooks")
        if base_post_hooks:
            base._optimizer_load_state_dict_post_hooks = OrderedDict()
        try:
            # torch checks the groups before it changes anything, but its optimizers' __setstate__ read the loaded
            # state after it is in place (a missing 'step' raises there): what raises puts the old state back
            base.load_state_dict(sd)
            state_format.restore_low(base, sd["param_groups"], low, self._fusion.wide_state())
            # kitsune checks what torch's load does not, for every param, before anything binds or decodes it
            state_format.check_loaded(base.state)  # 8-bit state
            algos.check_loaded(base)  # the algorithm's state: tensors of the params' shapes, numeric step counts
            self._replan()  # a loaded group the planner cannot read (momentum="0.9") raises here
        except BaseException:
            base.state, base.param_groups = before
            self._replan()  # the plan of the state as it was
            raise
        finally:
            if base_post_hooks:
                base._optimizer_load_state_dict_post_hooks = base_post_hooks
        del before  # the replaced state's arena views, held until the load could no longer fail, are free now
        self._fusion.bind_pooled()
        self._load_own_state(ours)
        for hook in (base_post_hooks or {}).values():
            hook(base)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _load_own_state(self, ours: dict[str, Any]) -> None:
        step_count = checkpoint.load_own_state(ours, self._subsystems)
        if step_count is not None:
            self._step_count = step_count

    def __getstate__(self) -> dict[str, Any]:
        if self._shard.active:  # its groups hold this rank's shards of the params, which a copy would plan as params
            raise TypeError(
                "a KitsuneOptimizer with ZeRO-sharded state (zero_stage>0 over several ranks) cannot be copied or "
                "pickled: each rank holds a shard of the state and its groups hold shards of the params. Save "
                "kitsune.distributed.consolidated_state_dict(optimizer) (every rank calls it), and load it into a new "
                "KitsuneOptimizer (or the plain torch optimizer) built over the model's params"
            )
        if self._streams.updated_since_step:
            raise TypeError(
                "a KitsuneOptimizer cannot be copied or pickled between a backward that ran updates inside it "
                "(StreamConfig(step_in_backward=True)) and its step(): the params and state already hold those "
                "updates, and the copy's step() would apply them again. Copy it after step() (or before backward)"
            )
        self._shard.wait_params()  # a copy holds the params as they are
        self._fusion.settle_skips()
        ours = checkpoint.own_state(self._subsystems, self._step_count)
        clock = self._profiler.clock() if self._profiler.active else 0
        return {
            "optimizer": self._optimizer,
            "config": self.config,
            "kitsune": ours,
            "profiler_clock": clock,
            "amp_pending": self._amp.pending,  # a copy between optimizer.backward(loss) and step() steps on
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        # on a live optimizer torch's __setstate__ updates its __dict__: the hooks registered on it stay; a state
        # that cannot be restored leaves the optimizer as it was
        before = dict(self.__dict__)
        try:
            # KitsuneOptimizer's own __init__, not a subclass's (whose signature may differ), as torch's
            # __setstate__ restores an optimizer without calling its class's __init__
            with warnings.catch_warnings():  # the original warned when it was built; its copies do not again
                warnings.filterwarnings("ignore", message=r"kitsune: \w+ was asked for but is inactive")
                KitsuneOptimizer.__init__(self, state["optimizer"], config=state["config"])
            self._load_own_state(checkpoint.check_own_state(state["kitsune"], self._subsystems))
            if self._profiler.active:  # the copy's windows go on where the original's stood
                self._profiler.continue_from(state.get("profiler_clock", 0))
            self._amp.resume(state.get("amp_pending", (False, False)))
        except BaseException:
            built = self.__dict__.get("_profiler")
            self.__dict__.clear()
            self.__dict__.update(before)
            if built is not None and built is not before.get("_profiler"):
                built.close()  # the NVML sampler's thread of the profiler built for the state
            raise
        self.__dict__.update({k: v for k, v in before.items() if k.startswith("_optimizer_") and k.endswith("_hooks")})
        old_profiler = before.get("_profiler")
        if old_profiler is not None:
            old_profiler.close()  # its NVML sampler's thread, now that nothing reads it

    @_on_the_wrapper
    def __repr__(self) -> str:
        active = ", ".join(s.name for s in self._subsystems if s.active) or "none"
        return f"KitsuneOptimizer(active=[{active}]) wrapping {self._optimizer!r}"

    # -- reports ------------------------------------------------------------------------------------------------
    @_on_the_wrapper
    def subsystem_status(self) -> list[dict[str, Any]]:
        """For each subsystem: name, active, the reason when inactive, and what it reports."""
        return [s.status() for s in self._subsystems]

    @_on_the_wrapper
    def print_summary(self, console: Any = None) -> None:
        """Print the plan, the subsystems and the profiler's numbers as rich tables."""
        print_summary(self, console=console)

    @_on_the_wrapper
    def save_profile(self, filepath: str | Path = "profile.json") -> Path:
        """Write the profile (environment, config, subsystems, per-step timings, statistics) as JSON. With profiling
        off it holds no step timings (and a warning says so): ``kitsune report --html`` and ``--trace`` need them."""
        path = save_profile(self, filepath)
        if not self._profiler.active:
            warnings.warn(
                f"kitsune: {path} holds the environment, config and plan but no step timings: profiling is off "
                "(pass profile=True to record them)",
                UserWarning,
                stacklevel=3,
            )
        return path

    @_on_the_wrapper
    def export_chrome_trace(self, filepath: str | Path = "trace.json") -> Path:
        """Write the timed steps (and NVML samples) as a Chrome trace that Perfetto and chrome://tracing open."""
        return export_chrome_trace(self, filepath)


class _Stepping(threading.local):
    """The torch optimizers (ids) a KitsuneOptimizer's step is running over in this thread: a step runs the wrapped
    optimizer's pre-hooks itself, and `_own_step_guard` lets them be (a second KitsuneOptimizer over the same torch
    optimizer is refused by its streams' check instead). Another optimizer's step, or a step in another thread, lets
    no direct call of the wrapped step through."""

    def __init__(self) -> None:
        self.bases: list[int] = []


_STEPPING = _Stepping()


def _own_step_guard(ref: weakref.ref) -> Callable[..., None]:
    """A step pre-hook on the wrapped optimizer: its own ``step()``, called by other code than a KitsuneOptimizer's
    step, raises where `_own_step_refusal` says it must not run. Holds the optimizer weakly."""

    def guard(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        owner = ref()
        if owner is None or id(opt) in _STEPPING.bases:
            return
        why = owner._own_step_refusal(type(opt).__name__)
        if why is not None:
            raise RuntimeError(why)

    return guard
