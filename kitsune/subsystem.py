"""What every kitsune subsystem shares, and the typed state one step hands from stage to stage.

The orchestrator ([`kitsune.KitsuneOptimizer`][kitsune.KitsuneOptimizer]) owns no math; its ``step()`` is a short
pipeline (see kitsune/optimizer.py) over subsystems with narrow roles, each built with its own config and planned over
the wrapped optimizer's param groups and state, never over the orchestrator:

* the grad pass (`kitsune.grads`): shard reduce, unscale and inf check, clip; it alone decides whether those
  run inside the fused kernels or as passes of their own;
* the executors: the fused one (`kitsune.fusion`), the graphed one wrapping it (`kitsune.graphs`), the
  updates inside backward (`kitsune.streams`), and the wrapped optimizer's own step for whatever none owns;
* the allocator the fused executor is handed (`kitsune.memory`), and the profiler, an observer.

A subsystem that cannot run here (no CUDA, no Triton, switched off) stays in the list with ``active=False`` and a
``reason``; the summary and the profile show that reason. It never raises for being unavailable.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from operator import is_
from typing import Any, Protocol

import torch

from kitsune import _native
from kitsune.config import KitsuneConfig


class PhaseMarks(Protocol):
    """The profiler's probe steps time each phase of a step: ``mark(name)`` ends phase ``name``."""

    def mark(self, name: str) -> None: ...

    def restart(self, name: str) -> None:
        """The step's phases marked so far belong to a try that did not stand (a kernel failed to compile, and the
        step runs again on a new plan): their time becomes one phase, ``name``, which this call ends."""


@dataclass(eq=False, slots=True)
class StepState:
    """What one call of ``KitsuneOptimizer.step`` carries from stage to stage (one object per step)."""

    step: int
    """1-based index of this step on the wrapper (the count it will have once the step succeeds)."""
    baseline: bool = False
    """The profiler's live comparison: the wrapped optimizer's own step updates every param this step, and the
    executors stand aside."""
    phases: PhaseMarks | None = None
    """Set on the profiler's probe steps: each stage marks where its phase ends."""

    # -- the grad pass (kitsune.grads) decides and fills these ------------------------------------------------------
    fused_grads: bool = False
    """Unscaling, the inf/nan check and clipping run inside the fused norm and update kernels."""
    grad_scale: torch.Tensor | None = None
    """The fused kernels divide the grads by this loss scale (``fused_grads`` only)."""
    found_inf: torch.Tensor | None = None
    """AMP's overflow flag on the device: a nonzero value skips the update (the kernels read it there)."""
    check_inf: bool = False
    """The fused norm pass finds inf/nan grads and sets ``found_inf`` from them (float16 AMP, ``fused_grads``)."""
    max_norm: float | None = None
    """Clip inside the fused update kernels to this global norm (``fused_grads`` with ``max_grad_norm``)."""
    grad_norm: torch.Tensor | None = None
    """The global norm of the (unscaled) grads this step clipped, on the device."""
    grad_write: int = 0
    """What the fused update writes into the grads it read: 0 nothing, 1 the unscaled and clipped values it used,
    2 zeros (``GradConfig(zero_in_step=True)``)."""
    reduce: Any = None
    """Sharded grads (ZeRO): combines every rank's grad norm and overflow flag on the device,
    ``reduce(total_norm | None, found_inf | None)``."""

    # -- the executors fill these ---------------------------------------------------------------------------------
    structure_checked: bool = False
    """The fused executor's switches and param storages were checked before the grad pass (no re-plan inside)."""
    updated_in_backward: frozenset[int] = frozenset()
    """Fused units the stream scheduler already updated inside backward."""
    updated_before: Sequence[torch.Tensor] = ()
    """Params updated inside backward, as an earlier try of this step found them (a kernel that failed to compile
    ended it, and its plan, which the indices above refer to, may be gone)."""
    handled: Collection[torch.Tensor] = frozenset()
    """Params an executor updates this step; the wrapped optimizer's step skips them."""
    unhandled: Sequence[torch.Tensor] = ()
    """Params an executor planned to own but cannot update this step (a grad that turned sparse): the wrapped
    optimizer's step takes them."""
    graphed: bool = False
    """The fused device work runs as a CUDA graph's (its warm-up, capture or replay): outputs go to buffers that
    outlive the step, and the loss-scale update is part of that work."""
    zeroed: Sequence[torch.Tensor] = ()
    """Params whose grads the fused update zeroed (``zero_in_step``)."""
    external_scaler: bool = False
    """A user's ``torch.amp.GradScaler`` handed this step its ``grad_scale`` and ``found_inf``."""
    handoff_unscaled: bool = False
    """The grad pass divided the grads by that scale in place (passes of their own): a retry of the step after a
    kernel failed to compile (`updated_before`) does not divide them again."""
    unscaled: bool = False
    """float16 AMP, a step whose loss was not scaled while every group's lr is 0, as the step with zero grads that
    torch.distributed.checkpoint's state-dict helpers run to make an empty optimizer's state: it runs without the
    loss scaler (nothing unscaled, no scale update), as the plain optimizer takes it."""


class Accumulation:
    """Whether backward passes now belong to gradient accumulation's micro-steps that do not step (inside
    ``KitsuneOptimizer.accumulating()``): one object, which the subsystems acting inside backward are handed."""

    __slots__ = ("depth",)

    def __init__(self) -> None:
        self.depth = 0

    def __bool__(self) -> bool:
        return self.depth > 0

    def __enter__(self) -> None:
        self.depth += 1

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1

    def refuse_step(self) -> None:
        """A step taken inside the block: its grads are one micro-step's, not the sum."""
        if self.depth:
            raise RuntimeError(
                "optimizer.step() inside `with optimizer.accumulating()`: step after the block, on the micro-step "
                "whose backward ran outside it"
            )


class Subsystem:
    """Name, whether it runs and why not, what it reports, and what it keeps in checkpoints."""

    name: str = "subsystem"

    def __init__(self) -> None:
        self.active: bool = False
        self.reason: str | None = "not planned yet"

    def deactivate(self, reason: str) -> None:
        self.active = False
        self.reason = reason

    def activate(self) -> None:
        self.active = True
        self.reason = None

    def state_dict(self) -> dict[str, Any]:
        """Subsystem state kept in checkpoints, under ``state_dict()["kitsune"]["subsystems"][name]``."""
        return {}

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """Raise if [`load_state_dict`][kitsune.subsystem.Subsystem.load_state_dict] cannot take ``state`` (nothing may
        change here)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what [`state_dict`][kitsune.subsystem.Subsystem.state_dict] returned (checked by
        [`check_state_dict`][kitsune.subsystem.Subsystem.check_state_dict] first)."""

    def report(self) -> dict[str, Any]:
        """JSON-able facts for the summary and the profile (what it did, not what it could do)."""
        return {}

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "active": self.active, "reason": self.reason, "report": self.report()}


class PlaceholderSubsystem(Subsystem):
    """A subsystem switched off or unavailable here: always inactive, with that reason, never pretending."""

    def __init__(self, name: str, requested: bool, reason: str) -> None:
        super().__init__()
        self.name = name
        self.requested = requested
        self.deactivate(reason)


class PlannedGroups:
    """What a plan was made for: the groups list, the state dict and each group's params, in order. A param swapped
    into a list, moved between groups, added or removed, or a groups list or state dict replaced, calls for a new
    plan; `fits` compares the params by identity in C (``map(operator.is_, ...)``), tens of ns a param."""

    def __init__(self, groups: list[dict[str, Any]], state: Any) -> None:
        self.groups, self.state = groups, state
        self.params = [list(g["params"]) for g in groups]

    def fits(self, groups: list[dict[str, Any]], state: Any) -> bool:
        if groups is not self.groups or state is not self.state or len(groups) != len(self.params):
            return False
        same = None if _native.CHECKS is None else _native.CHECKS.same  # one C loop, about 1 ns a param
        for group, planned in zip(groups, self.params, strict=True):
            params = group["params"]
            if same is not None and type(params) is list:
                if not same(params, planned):
                    return False
            elif len(params) != len(planned) or not all(map(is_, params, planned)):
                return False
        return True


def unique_params(groups: list[dict[str, Any]]) -> list[torch.Tensor]:
    """Every param once, in the groups' order (a param listed twice is counted once)."""
    return list({id(p): p for g in groups for p in g["params"]}.values())


class NoFusion(PlaceholderSubsystem):
    """The fused executor where fusion is off or cannot run here: it owns no param and runs nothing."""

    executes = False
    watches = False
    trust = False
    consumes_found_inf = True
    plan_version = 0
    current_plan = None
    waits = False
    units: tuple = ()
    launch_units: tuple = ()

    def __init__(self, requested: bool, reason: str) -> None:
        super().__init__("fusion", requested, reason)
        self.grad_pass: str | None = reason

    low_precision = None

    def plan(self, base: torch.optim.Optimizer, remote: Any = (), backward_bytes: int | None = None) -> None:
        from kitsune.fusion.state_format import decode_others

        # a checkpoint of 8-bit state: the optimizer's own step reads torch's keys; float state stays as it is, as
        # the optimizer without kitsune keeps it
        decode_others(base.state, set(), cast=False)

    def owned_params(self) -> list[torch.Tensor]:
        return []

    def journal(self) -> None:
        """Nothing fused: a plan converts no state."""

    checks_grads = False

    def refuse_unmatched(self) -> None:
        """Nothing fused: the optimizer's own step meets every grad, as without kitsune."""

    def restore_journal(self) -> None:
        """Nothing fused: nothing converted."""

    def drop_journal(self) -> None:
        """Nothing fused: nothing noted."""

    def settle_skips(self) -> None:
        """Nothing fused, no lazy state of a skipped step to remove."""

    def bind_pooled(self) -> None:
        """Nothing fused, no state in the pool's arenas."""

    def wide_state(self) -> set[torch.Tensor]:
        """Nothing fused: every param's state is its dtype, as torch's load casts it."""
        return set()

    def needs_replan(self) -> bool:
        return False


def make_fusion(cfg: KitsuneConfig, pool: Any) -> Any:
    """The fused executor for ``cfg`` (handed the memory ``pool``), or `NoFusion` with the reason."""
    if not cfg.fusion.enabled:
        return NoFusion(requested=False, reason="enable_fusion=False")
    try:
        from kitsune.fusion import FusionSubsystem
    except ImportError as exc:  # triton missing, or a platform without it
        return NoFusion(requested=True, reason=f"cannot import the fusion engine: {exc}")
    return FusionSubsystem(cfg.fusion, cfg.grads, cfg.streams, cfg.graphs.static_addresses, pool)
