"""CUDA graph capture of the optimizer phase: capture the device work of a step once, replay it every step.

What a step does splits cleanly in two (see `kitsune.fusion.FusionSubsystem.prepare` and ``launch``):

* host work, every step, outside the graph: checking the grads' and params' addresses and copying changed ones
  into the device-side address tables, creating state for params that got their first grad, copying changed
  hyperparameters into the device buffer;
* device work, captured: the norm pass (with FSDP2 its all-reduce over the mesh, on NCCL), every update launch,
  the loss-scale update. The kernels read addresses, hyperparameters, the scale and ``found_inf`` from device
  buffers whose own addresses never change, so a new LR from a scheduler, a re-allocated grad or a grad that is
  None this step need no recapture.

The first ``GraphConfig.warmup_steps`` steps after a (re)plan run eagerly on a side stream (they compile the
Triton kernels and create the lazily made buffers); the next step is captured and replayed. Anything that replaces
a buffer the graph holds re-plans (``add_param_group``, ``load_state_dict``, a param's storage replaced, a kernel
switch changed, a dtype or device move) and starts the warm-up again. A step that cannot replay (the profiler's
baseline steps, a user's GradScaler handing a new ``found_inf`` each step, non-contiguous grads that need copies)
runs eagerly without dropping the graph. A capture that fails falls back to eager for good, with the reason in
the summary.

The steady replay: once a step has replayed the graph, the next steps replay it after a few checks only (the same
groups with the same values, every param where the last step found it, every grad there too or moved as the
kernels take it, the tables then pointed at it, a scaled loss) without the step's full host path; anything else
sends the step through the full path, which checks everything again.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from kitsune._native import MOVED, OTHER
from kitsune.config import GraphConfig
from kitsune.fusion.context import changes_in_place
from kitsune.graphs.backend import CudaGraphBackend
from kitsune.subsystem import PlannedGroups, StepState, Subsystem

__all__ = ["CudaGraphBackend", "GraphSubsystem"]


class GraphSubsystem(Subsystem):
    """The graphed executor: wraps the fused executor (``fusion``) and owns capture, replay and the steady replay;
    with float16 AMP the loss scaler's (``scaler``) scale update joins the captured work. See the module docstring."""

    name = "graphs"

    def __init__(self, config: GraphConfig, backend: Any = None, *, fusion: Any = None, scaler: Any = None) -> None:
        super().__init__()
        self.config = config
        self.backend = backend or CudaGraphBackend()
        self._fusion = fusion
        self._scaler = scaler
        self._graph: Any = None
        self._key: _Key | None = None
        self._saved: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        """What the captured work leaves for the steps that replay it: the overflow flag and the grad-norm buffer."""
        self._warm = 0
        self._device = torch.device("cpu")
        self._broken: str | None = None
        self._version = -1
        self._steady: _Steady | None = None
        self._may_steady = False
        self._collectives = False
        """Whether the captured work holds collectives (FSDP2's norm all-reduce)."""
        self._cuda_work = False
        """Whether the plan launches fused kernels on a CUDA device (graphed or not): a step then refuses to run
        inside a capture of the caller's (`refuse_caller_capture`)."""
        self.captures = 0
        self.replays = 0
        self.steady_replays = 0
        """Replays that skipped the step's full host path (nothing had changed since the last replay)."""
        self.eager_steps = 0
        self.recaptures: deque[str] = deque(maxlen=10)
        """Why each of the last 10 graphs dropped was captured again (the structural change that re-planned): a run
        that reloads its checkpoint every few steps for days keeps no more."""
        self.last_eager_reason: str | None = None
        self._capture_ms = 0.0
        self.deactivate("not planned yet")

    # -- planning -----------------------------------------------------------------------------------------------
    def plan(self, *, leftover: bool, grad_passes: bool, in_backward: bool, sharded: bool) -> None:
        """Decide whether the steps go through a graph, after the fused executor planned: ``leftover``, some params
        are the wrapped optimizer's; ``grad_passes``, the step clips or scales the grads; ``in_backward``, updates
        run inside backward; ``sharded``, ZeRO."""
        self.invalidate("re-planned (param groups, state or storage changed)")
        self._steady = None
        fusion = self._fusion
        self._cuda_work = (
            fusion is not None and fusion.active and any(u.device.type == "cuda" for u in fusion.launch_units)
        )
        self._version = fusion.plan_version if fusion is not None and fusion.active else -1
        reason = self._why_not(in_backward)
        if reason is None and (leftover or (fusion.grad_pass is not None and grad_passes)):
            reason = f"the grads' passes are not fused: {fusion.grad_pass or 'see the plan'}"
        if reason is None and sharded:
            reason = "sharded optimizer state: the step's collectives are not captured"
        if reason:
            self.deactivate(reason)
        else:
            self.activate()
        self._may_steady = self.active and self.config.steady_replay

    def _why_not(self, in_backward: bool) -> str | None:
        if not self.config.enabled:
            return "capture_graph=False"
        if self._broken:
            return f"capture failed, running eagerly: {self._broken}"
        fusion = self._fusion
        if fusion is None or not fusion.active:
            return "nothing to capture: fusion is inactive" + (f" ({fusion.reason})" if fusion is not None else "")
        if in_backward:
            return "step_in_backward: the updates run inside backward, bucket by bucket"
        why = fusion.graphable
        if why:
            return f"the phase is not all fused kernels: {why}"
        self._device = fusion.launch_units[0].device
        why = self.backend.supports(self._device)
        groups = fusion.collective_groups  # FSDP2: the grad norm's all-reduce joins the capture
        if why is None and groups:
            why = self.backend.collectives(groups)
            why = f"FSDP2 params: the grad norm's all-reduce cannot join the graph: {why}" if why else None
        self._collectives = bool(groups)
        return why

    def invalidate(self, reason: str) -> None:
        """Drop the graph (its buffers may be gone); the next steps warm up and capture again."""
        if self._graph is not None:
            self.recaptures.append(reason)
        self._graph = None
        self._key = None
        self._warm = 0

    # -- the step -----------------------------------------------------------------------------------------------
    def refuse_caller_capture(self) -> None:
        """Raise where this step's fused kernels run on a CUDA device while the current stream captures a graph of
        the caller's (``torch.cuda.graph`` around ``optimizer.step()``): kitsune's own capture cannot run inside it
        (it synchronizes first) nor its graph be launched into it; without a graph of kitsune's (``capture_graph=
        False``) the step's uploads would be captured reading host slots that later steps write again; and the
        host work would not run on the caller's replays. The full path asks before anything changes; the steady
        replay where its launch fails."""
        if self._cuda_work and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(CALLER_CAPTURE)

    def execute(self, s: StepState, live: list[Any]) -> None:
        """The fused step's device work (prepared by the fused executor): warmed up, captured or replayed; eagerly,
        without dropping the graph, where this step cannot replay it."""
        fusion = self._fusion
        why = None
        if fusion.plan_version != self._version:  # the optimizer plans this subsystem again after the step
            self.invalidate("the fused executor re-planned inside the step")
            why = "the fused executor re-planned inside the step"
        elif not live:
            why = "no param has a grad this step"
        elif s.phases is not None:
            why = "the profiler's probe times each phase"
        elif s.baseline:
            why = "the profiler's baseline step"
        elif s.external_scaler:
            why = "a user's GradScaler hands a new found_inf every step"
        elif s.unscaled:
            why = "an unscaled step at lr 0 (torch.distributed.checkpoint's state init) runs without the scaler"
        elif any(unit.copies_grads for unit in live):
            why = "non-contiguous grads are copied every step"
        if why is not None:
            self.note_eager(why)
            fusion.execute(s, live)
            return
        scaler = self._scaler
        units = fusion.launch_units
        s.graphed = True  # warm-up, capture and replay make the same launches, the scale update included

        def device_work() -> None:
            fusion.launch(s, units)
            if scaler is not None:
                scaler.update_scale(s.found_inf)

        norm = fusion.needs_norm(s)
        key = _Key(
            fusion.plan_version,
            id(s.grad_scale),
            s.check_inf,
            scaler is not None,
            norm,
            fusion.grad_layout(units, norm),
        )
        how = self._run(s, key, device_work)
        fusion.finish(s, units, launches=1 if how == "replay" else None)
        if how == "replay" and self._may_steady and not s.unhandled:
            self._arm(fusion.param_groups, s.zeroed)

    def _run(self, s: StepState, key: _Key, device_work: Callable[[], None]) -> str:
        """Do this step's device work: eagerly while warming up, by capturing it once, then by replaying.

        ``key`` names everything the captured work depends on beyond the device buffers' contents (the plan's
        version, the identity of the scale tensor, the step's switches, the variants the grads' addresses pick); a
        new key means capture again. Returns
        how the work ran: ``"warmup"``, ``"capture"``, ``"replay"`` or ``"failed"``.
        """
        if self._graph is not None and key != self._key:
            self.invalidate(
                "the step's inputs changed (loss scaler, clipping or AMP switches, or the grads' alignment)"
            )
        if self._graph is None and self._warm < self.config.warmup_steps:
            self.backend.eager(device_work, self._device)
            self._warm += 1
            self.eager_steps += 1
            return "warmup"
        if self._graph is None:
            start = time.perf_counter()
            try:
                self._graph = self.backend.capture(device_work, self._device, collectives=self._collectives)
            except Exception as exc:  # a capture that fails must not take training down: run eagerly from now on
                self._broken = f"{type(exc).__name__}: {exc}"
                self.deactivate(f"capture failed, running eagerly: {self._broken}")
                torch.cuda.synchronize(self._device) if self._device.type == "cuda" else None
                device_work()
                return "failed"
            self._capture_ms = (time.perf_counter() - start) * 1e3
            self._key = key
            self.captures += 1
            self.backend.replay(self._graph)
            self._saved = (s.found_inf, s.grad_norm)  # the buffers the captured work writes, for the replays to come
        else:
            s.found_inf, s.grad_norm = self._saved
            self.backend.replay(self._graph)
        self.replays += 1
        return "replay"

    def note_eager(self, reason: str) -> None:
        """This step ran without the graph (which stays valid), for ``reason``."""
        self.eager_steps += 1
        self.last_eager_reason = reason

    # -- the steady replay --------------------------------------------------------------------------------------
    def _arm(self, groups: list[dict[str, Any]], zeroed: Sequence[torch.Tensor]) -> None:
        """After a replayed step: let the next steps replay straight away while nothing they depend on changed."""
        nested = _nested(groups)
        values = _group_values(groups, nested)
        if not _changes_in_place(values):  # tensors and arrays: the full step compares their values
            self._steady = _Steady(groups, values, nested, _keys(groups), self._fusion.plan_version, tuple(zeroed))

    def disarm(self) -> None:
        """A step through the full path: the steady replay waits for that path to replay the graph again."""
        self._steady = None

    def replay_steady(self, s: StepState, groups: list[dict[str, Any]], state: Any, planned: PlannedGroups) -> bool:
        """The steady step: the same groups (holding the params ``planned`` was made for, over the same ``state``),
        every param where the last step found it and every grad there too or moved (`FusionSubsystem.follow`
        points the tables at it; a move to addresses that pick other kernel variants than the captured ones is
        left to the full path), a scaled loss: refresh the hyperparameters if a value changed (an LR scheduler's
        new LR), replay the graph and fill ``s``. False (nothing launched) sends the step through the full path,
        which checks and refreshes everything and arms this again."""
        steady, self._steady = self._steady, None
        fusion = self._fusion
        if s.phases is not None or s.baseline:
            return False  # the profiler's probe and baseline steps take the full path (``execute`` says why)
        if steady is None or groups is not steady.groups or fusion.plan_version != steady.plan_version:
            return False
        if not planned.fits(groups, state):
            return False  # a group's params list replaced or grown: re-plan (and the values below compare safely)
        if _keys(groups) != steady.keys:
            return False  # a key added, removed or moved (the values below are compared by their place)
        values = _group_values(groups, steady.nested)
        try:
            changed = values != steady.values
        except (RuntimeError, ValueError, TypeError):  # a value became a tensor or an array: no single truth value
            return False
        if changed:
            # an LR scheduler's new lr: one value to look at, not every one, and one key for the switches to ask about
            fresh, keys = _fresh(values, steady.values, steady.keys)
            if _changes_in_place((fresh,)):
                return False  # a hyperparameter became a tensor or an array: the full step handles it
            if not fusion.refresh_values(groups, keys):
                return False  # a switch changed (amsgrad, nesterov, ...): new kernels, through the full path
            if any(map(_holds_list, fresh)):  # a list where none was
                steady.nested = _nested(groups)  # copied from now on
                values = _group_values(groups, steady.nested)
            steady.values = values
        found = fusion.follow()
        if found == OTHER:
            return False
        key = self._key
        if found == MOVED and (key is None or fusion.grad_layout(fusion.launch_units, key.norm) != key.layout):
            return False  # the grads moved to addresses that pick other kernel variants: captured again, in full
        scaler = self._scaler
        if scaler is not None and not scaler.take_scaled_loss():
            return False  # a loss not scaled by optimizer.backward: the full path says so
        try:
            self.backend.replay(self._graph)  # with float16 AMP, the scale update too
        except RuntimeError:
            self.refuse_caller_capture()  # launched into the caller's capture: say so
            raise
        self.replays += 1
        self.steady_replays += 1
        fusion.count_replay()
        self._steady = steady
        s.graphed, (s.found_inf, s.grad_norm), s.zeroed = True, self._saved, steady.zeroed
        return True

    def report(self) -> dict[str, Any]:
        return {
            "captures": self.captures,
            "replays": self.replays,
            "steady_replays": self.steady_replays,
            "eager_steps": self.eager_steps,
            "warmup_steps": self.config.warmup_steps,
            "recaptures": list(self.recaptures),
            "last_eager_reason": self.last_eager_reason,
            "capture_ms": round(self._capture_ms, 3),
        }


CALLER_CAPTURE = (
    "kitsune: optimizer.step() was called while the current CUDA stream is capturing a CUDA graph (torch.cuda.graph). "
    "kitsune's step runs host work every step (it checks the grads' addresses and uploads what changed) and, with "
    "capture_graph=True, replays a CUDA graph of its own: neither can happen inside your capture. Call "
    "optimizer.step() outside the captured region, after each replay of your graph (capture the forward and backward "
    "alone). Nothing was changed."
)


class _Key(NamedTuple):
    """What captured work depends on beyond the device buffers' contents: a new key means capture again."""

    plan_version: int
    scale: int
    """The identity of the loss scale's tensor."""
    check_inf: bool
    scaler: bool
    """Whether the loss scaler's update joins the captured work."""
    norm: bool
    """Whether the norm pass does (`FusionSubsystem.needs_norm`)."""
    layout: tuple[bool, ...]
    """The kernel variants the grads' addresses picked (`FusionSubsystem.grad_layout`)."""


class _Steady:
    """What the steady replay compares a step against (the groups object and the values the last step used, with
    where those hold lists) and what it books afterwards (the params whose grads the captured work zeroed)."""

    __slots__ = ("groups", "keys", "nested", "plan_version", "values", "zeroed")

    def __init__(
        self,
        groups: list,
        values: tuple,
        nested: tuple | None,
        keys: tuple[tuple[str, ...], ...],
        plan_version: int,
        zeroed: tuple[torch.Tensor, ...],
    ) -> None:
        self.groups, self.values, self.nested, self.keys = groups, values, nested, keys
        self.plan_version, self.zeroed = plan_version, zeroed


def _nested(groups: list[dict[str, Any]]) -> tuple[tuple[int, ...], ...] | None:
    """Per group, the positions of its values that hold a list (``betas=[0.9, 0.999]``, or a tuple with a list in it
    at any depth), its params list aside, or None where no group has one: `_group_values` copies those, which can
    change in place; every other value (a number, a string, a tuple of numbers) is compared as it is."""
    nested = tuple(
        tuple(i for i, v in enumerate(g.values()) if v is not g["params"] and _holds_list(v)) for g in groups
    )
    return nested if any(nested) else None


def _holds_list(value: Any) -> bool:
    return type(value) is list or (type(value) is tuple and any(_holds_list(v) for v in value))


def _fresh(values: tuple, before: tuple, keys: tuple[tuple[str, ...], ...]) -> tuple[list, set[str]]:
    """The values of ``values`` (`_group_values`'s, after a change) that are not the ones ``before`` kept at their
    place, and the keys they sit at (``keys``: each group's, the same for both): only those values need a look for a
    tensor or a list, and only those keys can have changed a kernel switch (`FusionSubsystem.refresh_values`).
    ``before`` holds neither a tensor nor a list (the steady replay is armed only then, and `_group_values` copies
    lists to tuples), so an LR scheduler's new ``lr`` each step costs a look at one number and one key."""
    fresh: list = []
    changed: set[str] = set()
    for row, kept, names in zip(values, before, keys, strict=True):
        for value, was, name in zip(row, kept, names, strict=True):
            if value is not was:
                fresh.append(value)
                changed.add(name)
    return fresh, changed


def _keys(groups: list[dict[str, Any]]) -> tuple[tuple[str, ...], ...]:
    """Each group's keys, in order: what the positions of `_group_values`'s rows are the values of."""
    return tuple(map(tuple, groups))


def _group_values(groups: list[dict[str, Any]], nested: tuple[tuple[int, ...], ...] | None) -> tuple:
    """Each group's values, in order: its params list as it is (the same object while the structure key holds,
    compared by identity), and at the positions ``nested`` names (`_nested`) the list copied to a tuple, nested
    ones too, so that ``group["betas"][0] = x`` or ``group["ns_coefficients"][0][0] = x`` on the same lists compares
    unequal (a container compares its own items by identity first). No value kept here is a list, so a list where
    ``nested`` names none (a value replaced by one) compares unequal to what was there before; the caller then takes
    ``nested`` again. Values are compared by their place: the caller compares the groups' keys first (`_keys`)."""
    if nested is None:
        return tuple([tuple(g.values()) for g in groups])
    rows = []
    for g, positions in zip(groups, nested, strict=True):
        row = tuple(g.values())
        if positions:
            items = list(row)
            for i in positions:
                if i < len(items):
                    items[i] = _copied(items[i])
            row = tuple(items)
        rows.append(row)
    return tuple(rows)


def _copied(value: Any) -> Any:
    """``value`` with every list and tuple in it copied to a tuple (other values as they are)."""
    if type(value) is list or type(value) is tuple:
        return tuple([_copied(v) for v in value])
    return value


def _changes_in_place(values: tuple) -> bool:
    """A value that changes in place among the values or in a tuple of them (a tensor or an array:
    `kitsune.fusion.context.changes_in_place`; ``betas=(torch.tensor(0.9), ...)``), which an identity comparison
    misses."""
    return any(
        changes_in_place(v) or (type(v) is tuple and any(changes_in_place(x) for x in v)) for row in values for v in row
    )
