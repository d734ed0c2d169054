"""The stream scheduler: fused updates inside backward, per bucket, on a side stream.

With ``StreamConfig(step_in_backward=True)`` the fusion planner cuts each fused bucket into launch units of about
``bucket_bytes`` of params, in reverse registration order (the order backward produces grads in, roughly). A
post-accumulate-grad hook on every fused param counts the unit's grads as autograd finishes them; when the last
one is in, the unit's update is launched at once on a side stream that first waits for the backward stream, so
it overlaps the rest of backward. ``optimizer.step()`` then only makes the current stream wait for the side
stream, updates the units whose grads did not all arrive (a param unused in this forward pass), and runs the
wrapped optimizer's step for params the kernel does not take. The next forward pass is stream-ordered after
``step()``, so it reads the updated params.

With ``StreamConfig(backward_stream="current")`` the updates are queued on backward's own stream instead, between
its kernels: no stream switch or cross-stream wait per launch. Where backward is host-bound (the GPU idles between
its kernels while Python and autograd launch the next) that is as much overlap as a side stream gives, for less
host time; where backward keeps the GPU busy, the side stream lets the updates run alongside it. Autograd makes the
caller's stream wait for backward's streams when backward returns, so ``step()`` and the next forward are ordered
after the updates either way.

Gradient accumulation: backward passes inside ``with optimizer.accumulating():`` launch nothing; the backward of
the micro-step that steps (outside the block) launches the updates on the summed grads.

On CUDA, with ``GraphConfig(enabled=True)`` (the default), each unit's update is captured in a CUDA graph of its
own after ``GraphConfig.warmup_steps`` eager launches, and the hook replays it: a launch costs a graph replay
instead of Triton's Python launcher (tens of microseconds a unit, paid inside backward, which is usually
host-bound). The kernels read grads, state and hyperparameters through device-side tables, so re-allocated grads
and LR changes need no recapture; a re-plan drops the graphs. The updates' timing events (the overlap in the
report) are recorded on one step in ``TIMED_EVERY``.

It needs every update to be computable from its own bucket's grads, so it stays off (with the reason) under global
clipping (``max_grad_norm``), float16 loss scaling (the overflow check reads every grad first) and LAMB/LARS
trust ratios (one norm pass over every grad), and under torch.distributed with more than one rank (DDP averages the
grads after the per-param hooks). A grad or hyperparameter changed between backward and ``step()`` (a clip by hand,
an lr set late) is refused at ``step()``: the updates inside backward already read them. On CPU tensors (Triton's
interpreter) the same hooks run the updates synchronously: the logic is the same, there is just nothing to overlap.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from kitsune._untraced import never_traced
from kitsune.config import GraphConfig, StreamConfig
from kitsune.distributed.fsdp import is_dtensor
from kitsune.grads import grad_marks, marks_changed
from kitsune.graphs.backend import CudaGraphBackend
from kitsune.subsystem import Accumulation, StepState, Subsystem

TIMED_EVERY = 16
"""Steps between two whose launches inside backward are timed with CUDA events (the first step is timed)."""


class StreamScheduler(Subsystem):
    """Runs the fused updates of each bucket as soon as backward has produced its grads (see the module doc).

    Built with what decides whether updates may run inside backward: ``clip`` (a global ``max_grad_norm``) and
    ``scaling`` (float16 loss scaling) forbid it; ``fusion`` is the fused executor whose units it launches, and
    ``step_state`` makes the step state of those launches (the grad pass's: what the kernels write into the grads).
    """

    name = "streams"

    def __init__(
        self,
        config: StreamConfig,
        graphs: GraphConfig | None = None,
        backend: Any = None,
        *,
        fusion: Any = None,
        clip: bool = False,
        scaling: bool = False,
        step_state: Callable[[], StepState] = lambda: StepState(0, fused_grads=True),
        accumulation: Accumulation | None = None,
        plan_fits: Callable[[], bool] = lambda: True,
    ) -> None:
        super().__init__()
        self.config = config
        self.graph_config = graphs or GraphConfig()
        self.backend = backend or CudaGraphBackend()
        """Captures and replays the units' graphs (`kitsune.graphs.CudaGraphBackend`; tests swap it)."""
        self._fusion = fusion
        self._clip, self._scaling = clip, scaling
        self._step_state = step_state
        self._version = -1
        self._graphs: dict[int, tuple[Any, tuple[bool, ...]]] = {}  # a unit's graph and the variants it holds
        self._eager: dict[int, int] = {}
        self.captures = 0
        self.replays = 0
        self.graph_reason: str | None = None
        """Why the units' updates are not replayed from CUDA graphs, or None when they are (or will be)."""
        self._plan_fits = plan_fits
        """Whether the optimizer's plan still fits its param groups (a param added, removed or moved since): a
        backward launches no update where it does not, and step() plans again and updates every param."""
        self._handles: list[Any] = []
        self._finalizer: weakref.finalize | None = None
        """Removes this plan's hooks when the scheduler is collected (the params outlive it)."""
        self._handle_of: dict[int, Any] = {}
        """Each hooked param's hook handle, by id (`_disown`)."""
        self._owned: set[int] = set()
        """The ids of the params this scheduler is the newest over (in `_HOOKED`), forgotten there when it goes."""
        self._me = weakref.ref(self, functools.partial(_forget, self._owned))
        """This scheduler, weakly, as `_HOOKED` names it."""
        self._taken: dict[int, weakref.ref] = {}
        """The params a newer optimizer took the hooks of (`_disown`), by id: that one's scheduler, whose updates
        inside backward this optimizer's step must not apply a second time."""
        self._step_called = False
        """Whether ``step()`` was called since the last backward's updates (`note_step`)."""
        self._ended = False
        """Whether the backward that launched updates ended (its end callback ran) without raising."""
        self._seen: list[set[int]] = []
        """Per unit, the params whose grads this backward finished (a second backward before step() is refused)."""
        self._launched: dict[int, tuple[list[Any], list[int]]] = {}
        """The units updated inside this backward, each with its grads' marks (`kitsune.grads.grad_marks`): as the
        update left them until backward ends, then as backward left them."""
        self._late = 0
        """Grads changed inside this backward after their unit's update read them (a post-accumulate-grad hook
        registered after the optimizer's): counted when backward ends, refused by the step."""
        self._accumulating = accumulation if accumulation is not None else Accumulation()
        """Set inside ``optimizer.accumulating()``: backward passes there launch no updates."""
        self._refreshed = False
        self._ended_task: int | None = None
        """The autograd graph task whose end `_backward_ended` waits for (queued by the first launch inside it)."""
        self._open = True
        """Whether this backward's updates may launch: False when the plan no longer holds (`begin_backward`)."""
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._ready: dict[int, Any] = {}
        """Per unit, the event the side stream waits on (recorded on backward's stream): made once, reused."""
        self._event_device: torch.device | None = None
        """The device of the last timed launch: the end of backward is marked on its current stream."""
        self._events: list[tuple[Any, Any]] = []
        self._last_events: list[tuple[Any, Any]] = []
        self._backward_end: Any = None  # the end of this backward (an event on its stream), while updates are timed
        self._last_end: Any = None  # the last step's
        self.in_backward = False
        """Whether updates run inside backward (the graph subsystem and the profiler's comparison step aside)."""
        self._steps = 0
        self._units_in_backward = 0
        self._units_total = 0
        self._bytes_in_backward = 0
        self._bytes_total = 0
        self._counted = -1  # the step whose units the report counted (once a step: a try again after a refusal or a
        # kernel that failed to compile counts nothing more)
        self.deactivate("not planned yet")

    @property
    def num_streams(self) -> int:
        """Side streams the scheduler may use."""
        return self.config.num_streams

    @property
    def priority_streams(self) -> list[int]:
        return list(self.config.priority_streams)

    # -- planning ------------------------------------------------------------------------------------------------
    def why_not(self, groups: list[dict[str, Any]], trust: bool) -> str | None:
        """Why the fused updates of ``groups``' params cannot run inside backward (None when they can); ``trust``:
        the optimizer scales updates by trust ratios (LAMB, LARS)."""
        if not self.config.step_in_backward:
            return "step_in_backward=False: every update runs in step(), on the current stream"
        if self._clip:
            return "max_grad_norm: the global clip needs every grad before the first update"
        if self._scaling:
            return "float16 loss scaling: the overflow check needs every grad before the first update"
        if trust:
            return "LAMB/LARS trust ratios come from one norm pass over every grad"
        if any(is_dtensor(p) for g in groups for p in g["params"]):
            return "FSDP2 params: FSDP2 sets the sharded grads after its reduce-scatter, past the per-param grad hooks"
        world = _world_size()
        if world > 1:
            return (
                f"torch.distributed runs {world} ranks: DDP (or an all-reduce in the loop) averages the grads after "
                "backward's per-param hooks, so updates inside backward would use each rank's own grads"
            )
        return None

    def unit_bytes(self, groups: list[dict[str, Any]], trust: bool) -> int | None:
        """The fused units' size in bytes of params when their updates run inside backward, else None."""
        return self.config.bucket_bytes if self.why_not(groups, trust) is None else None

    def plan(self, groups: list[dict[str, Any]]) -> None:
        """Hook every param of the fused executor's units (planned over ``groups``), or say why not."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._finalizer is not None:  # the last plan's: its hooks are gone (one a plan would pile up)
            self._finalizer.detach()
            self._finalizer = None
        _forget(self._owned, self._me)  # the params of the last plan: this one takes over those it still holds
        self._owned.clear()
        self._taken.clear()  # (it takes its params back from a newer optimizer as it hooks them: `_take_over`)
        self._handle_of = {}
        self.in_backward = False
        fusion = self._fusion
        units = fusion.units if fusion is not None and fusion.active else []
        why = self.why_not(groups, trust=fusion is not None and fusion.trust)
        if why is None and not units:
            why = (
                "Muon's orthogonalised updates take whole matrices and run in step(), and no other param takes the "
                "fused elementwise kernel"
                if fusion is not None and fusion.active and fusion.orthogonalises
                else "no param takes the fused kernel, so every update runs in step()"
            )
        if why is not None:
            # the newest optimizer over a param owns its updates, inside backward or in its step: one still alive
            # from before (kept by an LR scheduler) must not update it inside backward any more
            for g in groups:
                for p in g["params"]:
                    self._take_over(p)
            self.deactivate(why)
            return
        self._version = fusion.plan_version
        self._seen = [set() for _ in units]
        self._launched = {}
        self._graphs, self._eager = {}, {}
        self._ready = {}
        self.graph_reason = self._why_no_graphs(units)
        for index, unit in enumerate(units):
            for p in unit.params:
                # a frozen param gets no grad and takes no hook (torch refuses one): its unit never has all its
                # grads in, so step() updates it, as it updates a unit with a param unused in the forward pass
                if p.requires_grad:
                    handle = p.register_post_accumulate_grad_hook(self._hook(index, len(unit.params)))
                    self._handles.append(handle)
                    self._handle_of[id(p)] = handle
                    # the newest optimizer over a param updates it inside backward: one still alive from before
                    # (kept by an LR scheduler after a resume built a new one) would update it a second time
                    self._take_over(p)
        self._finalizer = weakref.finalize(self, _remove, list(self._handles))
        self.in_backward = True
        self.activate()

    def fits(self) -> bool:
        """Whether the plan still holds: False where updates run inside backward and a process group of several ranks
        was started since (an optimizer built before ``init_process_group``): the optimizer plans again, and the
        updates move to ``step()``, as under DDP from the start."""
        return not (self.in_backward and _world_size() > 1)

    def _take_over(self, p: torch.Tensor) -> None:
        """This optimizer is the newest over ``p``: an older one's hook on it (updates inside backward) goes."""
        old = _HOOKED.get(id(p))
        me = self._me
        if old is not None and old() is not None and old() is not self:
            old()._disown(p, me)
        _HOOKED[id(p)] = me
        self._owned.add(id(p))
        self._taken.pop(id(p), None)  # planned again (load_state_dict, a re-plan): its updates are this one's again

    @property
    def updated_since_step(self) -> bool:
        """Whether updates ran inside the backward since the last step (``step()`` then updates only the rest)."""
        return bool(self._launched)

    def _disown(self, p: torch.Tensor, newer: weakref.ref) -> None:
        """Another optimizer (``newer``'s scheduler) hooked ``p`` since: this one's hook on it goes, so its unit never
        has all its grads in inside backward (its own step(), if ever called, updates it there, unless the newer one
        updated it inside this backward: `refuse_taken`)."""
        handle = self._handle_of.pop(id(p), None)
        if handle is not None:
            handle.remove()
        self._taken[id(p)] = newer

    def _whose(self) -> str:
        """Which optimizer this is, for a message where several may be at work: ``wrapping AdamW over 4 params``."""
        base = self._fusion.base if self._fusion is not None else None
        if base is None:
            return "with updates inside backward"
        count = sum(len(g["params"]) for g in base.param_groups)
        return f"wrapping {type(base).__name__} over {count} param(s)"

    def note_step(self) -> None:
        """``step()`` was called (before anything it checks): a ``zero_grad()`` after it is not a backward's updates
        left without a step."""
        self._step_called = True

    def refuse_taken(self) -> None:
        """Raise, before this step changes anything, where a newer optimizer over some of these params updated them
        inside the backward just run (this one's step would update them again): an older KitsuneOptimizer still alive,
        or a second one over the same torch optimizer, stepped in place of the newest."""
        taken = self._taken
        if not taken:
            return
        for ref in {id(r): r for r in taken.values()}.values():  # (a dead weak reference cannot be hashed)
            newer = ref()
            if newer is None:  # gone (a copy that failed to load, say): its params are this one's alone again
                self._taken = {k: r for k, r in self._taken.items() if r is not ref}
                continue
            if not newer._launched:
                continue
            units = newer._fusion.units
            base = self._fusion.base if self._fusion is not None else None
            mine = {id(q) for g in base.param_groups for q in g["params"]} if base is not None else set(taken)
            shared = sum(id(q) in taken and id(q) in mine for i in newer._launched for q in units[i].params)
            if shared:
                raise RuntimeError(
                    f"kitsune: {shared} param(s) of this optimizer were updated inside backward by a newer "
                    "KitsuneOptimizer built over them (StreamConfig(step_in_backward=True): the newest optimizer over "
                    "a param owns its updates inside backward), so this optimizer's step would update them a second "
                    "time. Step the newer optimizer, and drop this one (and what holds it: an LR scheduler, a second "
                    "KitsuneOptimizer over the same torch optimizer, copy.copy). Nothing was changed."
                )

    def _hook(self, index: int, need: int) -> Any:
        ref = weakref.ref(self)  # the params must not keep a dropped optimizer alive, nor let it update them
        seen = self._seen[index]  # replaced (not cleared) by each plan: a hook of an older plan counts into its own

        def ready(p: torch.Tensor) -> None:
            self = ref()
            if self is None or self._accumulating:
                return
            if id(p) in seen:
                failed = bool(self._launched) and not self._ended  # the last backward raised after its updates
                self._ended = False  # this backward raises here: zero_grad() then drops it as one that failed
                raise RuntimeError(
                    (
                        "the last backward raised after it had run updates inside it, and no optimizer.zero_grad() "
                        "followed (module.zero_grad() does not tell the optimizer): call optimizer.zero_grad() after "
                        "a backward that raised, which forgets it. "
                        if failed
                        else ""
                    )
                    + f"a second backward before optimizer.step() with StreamConfig(step_in_backward=True) (the "
                    f"KitsuneOptimizer {self._whose()}): the updates "
                    "inside backward already ran on the first backward's grads, so the grads added now would never be "
                    "used. For gradient accumulation, run the backward passes of the micro-steps that do not step "
                    "inside `with optimizer.accumulating():` (the grads just add up there; the last backward, outside "
                    "it, updates), or turn step_in_backward off. The first backward may also have been another "
                    "loss's that reached these params (a GAN's generator loss through the discriminator, whose grads "
                    "module.zero_grad() then dropped): these params were updated with its grads; run such a "
                    "backward inside this optimizer's accumulating() or with these params frozen. A param used in "
                    "several segments of reentrant activation checkpointing (checkpoint(..., use_reentrant=True)) gets "
                    "its grad in each segment's own backward, which looks the same: use use_reentrant=False there"
                )
            seen.add(id(p))
            if len(seen) == need:
                self._launch(index)
            elif self._launched and self._ended:  # a later backward (another loss) writing grads before step():
                self._queue_end()  # mark the grads at its end too (one C call a grad, only in such a backward)

        # autograd calls it, from the thread that runs backward: inside a function torch.compile traces, that is the
        # traced function's own (a CPU param's grad), and the hook and its launch run as they are, not traced
        return never_traced(ready)

    def _why_no_graphs(self, units: list[Any]) -> str | None:
        if not self.graph_config.enabled:
            return "capture_graph=False"
        for device in {u.device for u in units}:
            why = self.backend.supports(device)
            if why:
                return why
        return None

    # -- inside backward -----------------------------------------------------------------------------------------
    def _launch(self, index: int) -> None:
        fusion = self._fusion
        unit = fusion.units[index]
        if not self._refreshed:  # once per backward: the plan still holds, and the hyperparameters' last change
            self._refreshed = True
            # (a process group started since the plan: DDP averages the grads after these hooks, so step() updates
            # every param, on the averaged grads, and plans again without updates inside backward: `fits`)
            self._open = fusion.begin_backward() and _world_size() == 1 and self._plan_fits()
        self._queue_end()
        if not self._open:
            return  # a switch changed (maximize, amsgrad, ...) or the state dict did: step() re-plans, updates all
        if not fusion.prepare_unit(unit):
            return  # no grad after all, or a param's storage moved: step() re-plans and updates it
        ctx = self._step_state()
        if not fusion.compile_unit(ctx, unit):
            return  # its kernel failed to compile here: step() plans again, with its params on torch's route
        graph = self._graphs.get(index)
        if unit.device.type == "cuda":
            timed = self._steps % TIMED_EVERY == 0
            if timed:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            where: contextlib.AbstractContextManager = contextlib.nullcontext()  # "current": backward's stream
            if self.config.backward_stream == "side":
                side = self._stream(unit.device)
                ready = self._ready.get(index)
                if ready is None:
                    ready = self._ready[index] = torch.cuda.Event()
                ready.record()  # on backward's stream: this unit's grads are done
                side.wait_event(ready)
                where = torch.cuda.stream(side)
            with where:
                if timed:
                    start.record()
                self._run(index, unit, ctx, graph)
                if timed:
                    end.record()
            if timed:
                self._events.append((start, end))
                self._event_device = unit.device
        else:
            self._run(index, unit, ctx, graph)
        if ctx.grad_write:
            unit.copy_back(zeroed=ctx.grad_write == 2)
        # the grads as this update read them: a later hook on the same grads (registered after kitsune's) runs after
        # it, and `_backward_ended` finds what such a hook changed
        self._launched[index] = grad_marks(unit.params)

    def _run(self, index: int, unit: Any, ctx: StepState, graph: Any) -> None:
        """One unit's update: its graph's replay once captured, else the launch itself (counted towards warm-up)."""
        if graph is not None and graph[1] != self._fusion.grad_layout([unit], self._fusion.needs_norm(ctx)):
            # the grads moved to addresses that pick another kernel variant than the captured one (vector reads of
            # aligned grads): warm up and capture again
            del self._graphs[index]
            self._eager[index] = 0
            graph = None
        if graph is not None and not unit.copies_grads:  # non-contiguous grads are new copies every step: run eagerly
            self.backend.replay(graph[0])
            self.replays += 1
            return
        self._fusion.launch(ctx, [unit])
        self._eager[index] = self._eager.get(index, 0) + 1

    def _capture(self) -> None:
        """After a step: capture the update of every unit warmed up enough (capture runs nothing)."""
        fusion = self._fusion
        for index, count in list(self._eager.items()):
            if index in self._graphs or count < self.graph_config.warmup_steps:
                continue
            unit = fusion.units[index]
            if unit.copies_grads:
                continue
            ctx = self._step_state()
            try:
                graph = self.backend.capture(lambda u=unit, c=ctx: fusion.launch(c, [u]), unit.device)
                self._graphs[index] = (graph, fusion.grad_layout([unit], fusion.needs_norm(ctx)))
            except Exception as exc:  # a capture that fails must not stop training: launch eagerly from now on
                self.graph_reason = f"capture failed, launching eagerly: {type(exc).__name__}: {exc}"
                self._graphs = {}
                return
            self.captures += 1

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        s = self._streams.get(device)
        if s is None:
            priority = -1 if 0 in self.config.priority_streams else 0
            s = self._streams[device] = torch.cuda.Stream(device, priority=priority)
        return s

    # -- step ------------------------------------------------------------------------------------------------------
    def begin(self, s: StepState) -> None:
        """In the step's checks (it raises before anything changes): make the step wait for the updates launched
        inside backward and tell it which units those were (nothing while updates run in step())."""
        self.refuse_taken()
        if not self.active:
            return
        if self._events and self._backward_end is None:  # backward's end went unmarked (it raised past the callback)
            self._mark_backward_end()
        self._join_side_streams()  # before any refusal: what follows a refused step sees the updates done
        self._accumulating.refuse_step()
        if self._launched and s.grad_scale is not None:
            raise RuntimeError(
                "a GradScaler's scaled grads were used by updates inside backward (step_in_backward=True): the "
                "updates cannot wait for its overflow check. Use bfloat16 autocast, kitsune's own scaler with "
                "step_in_backward=False, or turn step_in_backward off"
            )
        if self._launched:
            self._refuse_changes_since_backward()
        s.updated_in_backward = frozenset(self._launched)
        if s.step == self._counted:
            return
        self._counted = s.step
        units = self._fusion.units
        self._units_total += len(units)
        self._units_in_backward += len(self._launched)
        sizes = [sum(p.numel() * p.element_size() for p in u.params) for u in units]
        self._bytes_total += sum(sizes)
        self._bytes_in_backward += sum(sizes[i] for i in self._launched)

    def _queue_end(self) -> None:
        """Have `_backward_ended` run when the backward running now ends: the grads as backward leaves them.
        Backward itself writes grads after a unit's launch (flat grads share one version counter, and later params'
        grads accumulate into the same arena), and so does a later backward before ``step()`` that updates nothing
        (another loss over other params of this optimizer). One callback for each graph task that launched or wrote
        grads after a launch (a reentrant checkpoint runs its segments' backward passes as tasks of their own, whose
        end comes before the outer one's)."""
        task = _graph_task()
        if task != self._ended_task:
            self._ended_task = task
            engine = torch.autograd.Variable._execution_engine
            engine.queue_callback(functools.partial(_backward_ended, weakref.ref(self)))

    def _backward_ended(self) -> None:
        """At the end of the backward that launched updates: count the grads changed since their unit's update read
        them (a hook registered after kitsune's), then mark each launched unit's grads as backward left them, which a
        later change (before ``step()``) moves."""
        if self._events:
            self._mark_backward_end()
        # what the caller runs after backward (a read of the params, a checkpoint, the next forward) sees the updates
        # done, as it would with the updates on backward's own stream
        self._join_side_streams()
        self._ended = True
        units = self._fusion.units
        for index, at_launch in self._launched.items():
            params = units[index].params
            # a grad replaced since its update read it, or written in place (views of one flat buffer share a version
            # counter, which later params' grads move: those are compared by identity alone)
            self._late += marks_changed(at_launch, params, versions_of_views=False)
            self._launched[index] = grad_marks(params)

    def _mark_backward_end(self) -> None:
        """Where backward's stream stands when backward ends (before it waits for the side streams): what the
        updates still ran after it is the part of their time backward did not hide."""
        self._backward_end = torch.cuda.Event(enable_timing=True)
        self._backward_end.record(torch.cuda.current_stream(self._event_device))

    def _join_side_streams(self) -> None:
        """The current stream of each device waits for the updates launched on its side stream (no host sync)."""
        for device, side in self._streams.items():
            torch.cuda.current_stream(device).wait_stream(side)

    def _refuse_changes_since_backward(self) -> None:
        """Raise, before this step changes anything, where the grads or hyperparameters that the updates inside
        backward read changed since (torch's step would use the values it finds): those updates cannot be redone."""
        units = self._fusion.units
        changed = self._late + sum(marks_changed(m, units[i].params) for i, m in self._launched.items())
        if changed:
            raise RuntimeError(
                f"kitsune: the grads of {changed} param(s) changed after their update ran inside backward "
                "(StreamConfig(step_in_backward=True)): torch.nn.utils.clip_grad_norm_, p.grad.mul_(...), "
                "p.grad = ..., or a grad hook registered after the optimizer was built. Those updates used the grads "
                "as backward left them, so the change is not applied. Clip with GradConfig(max_norm=...) (the "
                "updates then run in step()), change a param's grad in a hook on that param registered before the "
                "optimizer (a hook that changes other params' grads runs after their updates), or turn "
                "step_in_backward off. Writes through .data (p.grad.data.clamp_(...)) move no version counter and "
                "are not seen at all. This step changed nothing more."
            )
        if self._fusion.hyper_changed():
            raise RuntimeError(
                "kitsune: a param group's hyperparameters (lr, betas, weight_decay, ...) changed after the updates "
                "inside backward ran with the old ones (StreamConfig(step_in_backward=True)). Set them before the "
                "forward pass (an LR scheduler's step() after optimizer.step() already does), or turn "
                "step_in_backward off. This step changed nothing more."
            )

    def discard_backward(self) -> RuntimeError | None:
        """``zero_grad()``: the grads of a backward that did not reach ``step()`` (one that raised midway, an OOM) are
        dropped, so its counts go too and the next backward counts afresh. A unit whose grads were all in by then has
        already updated inside that backward: that update stays, and the caller's stream waits for it here (a
        backward that raised ran no end callback), before the grads it read are freed.

        Returns the error for the caller to raise once the grads are reset, where a backward that ended had updated
        params inside it and no ``step()`` was called since: those updates took grads that torch's loop would drop
        (another loss's backward through these params, a batch skipped after its backward)."""
        self._join_side_streams()
        units = self._fusion.units if self._fusion is not None else []
        dropped = 0
        if self._ended and self._launched and not self._step_called:
            dropped = sum(len(units[i].params) for i in self._launched)
        self._forget_backward()
        if not dropped:
            return None
        return RuntimeError(
            f"kitsune: zero_grad() of the KitsuneOptimizer {self._whose()} after a backward that updated {dropped} "
            "param(s) inside it "
            "(StreamConfig(step_in_backward=True)) with no optimizer.step() between: those updates used the grads "
            "zero_grad() now drops, and they stay applied. A backward of another loss that reaches these params (a "
            "GAN's generator loss through the discriminator) or a batch skipped after its backward must not update "
            "them: run such a backward inside `with optimizer.accumulating():` or with these params frozen, or turn "
            "step_in_backward off. The grads are reset."
        )

    def _forget_backward(self) -> None:
        """The counts and marks of the last backward, for the next one to start afresh."""
        for seen in self._seen:  # in place: the hooks hold these sets
            seen.clear()
        self._launched = {}
        self._late = 0
        self._ended = self._step_called = False
        self._refreshed = False
        self._ended_task = None
        self._events, self._backward_end = [], None  # a dropped backward's updates are not the next step's

    def finish(self) -> None:
        """After the step: count it, reset the units' grad counts and capture the units warmed up enough (the
        optimizer re-plans this scheduler when the fused executor re-planned inside the step)."""
        if not self.active:
            return
        self._steps += 1
        if self._events:
            self._last_events, self._events = self._events, []
            self._last_end, self._backward_end = self._backward_end, None
        self._forget_backward()  # (the step's `begin` made the caller's stream wait for the side streams already)
        if self.graph_reason is None and self._fusion.plan_version == self._version:
            self._capture()

    # -- what the summary reads --------------------------------------------------------------------------------------
    def overlap(self) -> dict[str, float] | None:
        """Of the last step's updates inside backward: their GPU time and how much of it finished before the
        step began (that is, hidden behind backward). Reads CUDA events: one sync, only when asked."""
        events, end = self._last_events, self._last_end
        if not events or end is None:
            return None
        end.synchronize()
        for _, e in events:  # (backward's end is marked before its stream waits for the side stream)
            e.synchronize()
        busy = sum(s.elapsed_time(e) for s, e in events)
        # an update that ends after backward ended delays the step by the difference
        exposed = max(0.0, max(end.elapsed_time(e) for _, e in events))
        return {"update_ms": busy, "exposed_ms": exposed, "overlapped": max(0.0, 1 - exposed / busy) if busy else 0.0}

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {"num_streams": self.num_streams, "step_in_backward": self.in_backward}
        if self.in_backward:
            out.update(
                graphs={"captures": self.captures, "replays": self.replays, "reason": self.graph_reason},
                steps=self._steps,
                units=len(self._seen),
                units_updated_in_backward=self._units_in_backward,
                units_updated_in_step=self._units_total - self._units_in_backward,
                bytes_fraction_in_backward=(self._bytes_in_backward / self._bytes_total) if self._bytes_total else 0.0,
            )
            overlap = self.overlap()
            if overlap is not None:
                out["last_step_overlap"] = overlap
        return out


def _world_size() -> int:
    """The default process group's size, 1 without one."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@never_traced  # autograd calls it when backward ends (see StreamScheduler._hook)
def _backward_ended(ref: weakref.ref) -> None:
    scheduler = ref()
    if scheduler is not None:
        scheduler._backward_ended()


_CURRENT_TASK = getattr(torch._C, "_current_graph_task_id", None)


def _graph_task() -> int:
    """The id of the autograd graph task running (a backward pass; a reentrant checkpoint's segment runs one of its
    own); 0 where torch does not say (one callback a backward, at the first task's end)."""
    return _CURRENT_TASK() if _CURRENT_TASK is not None else 0


_HOOKED: dict[int, weakref.ref] = {}
"""Each param's newest stream scheduler (the one whose hook updates it inside backward), by the param's id: a weak
key would put a weak reference on every param, and ``torch.utils.swap_tensors`` (``Module.to`` under
``torch.__future__.set_swap_module_params_on_conversion(True)``, which DTensor params take) refuses such tensors. An
entry lasts while its scheduler's plan stands (each plan forgets the last one's, and a collected scheduler its own:
`_forget`); a param taken out of the groups before the next plan may go and its id come back with another param,
so `refuse_taken` counts only the params the optimizer holds."""


def _forget(owned: set[int], me: weakref.ref) -> None:
    """A scheduler was collected, or plans again: the params its last plan was the newest over are nobody's (where no
    newer one took them) until a plan takes them."""
    for pid in owned:
        if _HOOKED.get(pid) is me:
            del _HOOKED[pid]


def _remove(handles: list[Any]) -> None:
    for h in handles:
        h.remove()
