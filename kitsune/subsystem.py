"""The one small interface every kitsune subsystem implements.

The orchestrator (:class:`kitsune.KitsuneOptimizer`) owns no math. Each step it walks its subsystems through a
fixed lifecycle:

1. ``plan(opt)``         after construction and after any structural change (new param group, loaded state,
                         a param's grad appearing or disappearing, a dtype/device move);
2. ``before_step(ctx)``  e.g. the profiler starts its clock, the AMP scaler unscales;
3. ``step(ctx)``         subsystems that execute updates (fusion) update the params they own and mark them
                         in ``ctx.handled``; the orchestrator then runs the wrapped optimizer's own step for
                         every param left over;
4. ``after_step(ctx)``   e.g. the scaler updates its scale, the profiler stops its clock;
5. ``state_dict()`` / ``load_state_dict()``  what the subsystem needs to survive a checkpoint, stored under
                         the ``"kitsune"`` key of the optimizer's state dict.

A subsystem that cannot run here (no CUDA, no Triton, not built yet) stays in the list with ``active=False``
and a ``reason``; the summary and the profile show that reason. It never raises for being unavailable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kitsune.optimizer import KitsuneOptimizer


@dataclass
class StepContext:
    """What one call of ``KitsuneOptimizer.step`` carries between subsystems."""

    step: int
    """1-based index of this step call on the wrapper."""
    handled: set[torch.Tensor] = field(default_factory=set)
    """Params already updated this step by a subsystem; the wrapped optimizer's step skips them."""
    unhandled: list[torch.Tensor] = field(default_factory=list)
    """Params an executor planned to own but could not update this step (e.g. a grad that turned sparse); the
    wrapped optimizer's step runs for them even when the plan had no leftover params."""
    baseline: bool = False
    """The profiler's live comparison: the wrapped optimizer's own step updates every param this step, and
    subsystems that execute updates stand aside."""
    skip_base_step: bool = False
    """Set by a subsystem that has taken over the whole update (e.g. a replayed CUDA graph)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form values one subsystem leaves for another (documented where they are written)."""


class Subsystem:
    """Base class: every hook is a no-op, so a subsystem overrides only what it does."""

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

    # lifecycle -------------------------------------------------------------------------------------------------
    def plan(self, opt: KitsuneOptimizer) -> None:
        """(Re)build whatever depends on the param groups. Called once at start and after structural changes."""

    def before_step(self, ctx: StepContext) -> None:
        """Runs before any update of this step."""

    def step(self, ctx: StepContext) -> None:
        """Update the params this subsystem owns and add them to ``ctx.handled``."""

    def after_step(self, ctx: StepContext) -> None:
        """Runs after every update of this step (also after the wrapped optimizer's own step)."""

    def state_dict(self) -> dict[str, Any]:
        """Subsystem state kept in checkpoints, under ``state_dict()["kitsune"]["subsystems"][name]``."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def report(self) -> dict[str, Any]:
        """JSON-able facts for the summary and the profile (what it did, not what it could do)."""
        return {}

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "active": self.active, "reason": self.reason, "report": self.report()}


class PlaceholderSubsystem(Subsystem):
    """A subsystem the project has not built yet: always inactive, with that reason, never pretending."""

    def __init__(self, name: str, requested: bool, reason: str) -> None:
        super().__init__()
        self.name = name
        self.requested = requested
        self.deactivate(reason)

    def plan(self, opt: KitsuneOptimizer) -> None:  # stays inactive
        pass
