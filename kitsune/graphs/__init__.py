"""CUDA graph capture of the optimizer phase: capture the device work of a step once, replay it every step.

What a step does splits cleanly in two (see :meth:`kitsune.fusion.FusionSubsystem.prepare` and ``launch``):

* host work, every step, outside the graph: checking the grads' and params' addresses and copying changed ones
  into the device-side address tables, creating state for params that got their first grad, copying changed
  hyperparameters into the device buffer;
* device work, captured: the norm pass, every update launch, the loss-scale update. The kernels read addresses,
  hyperparameters, the scale and ``found_inf`` from device buffers whose own addresses never change, so a new LR
  from a scheduler, a re-allocated grad or a grad that is None this step need no recapture.

The first ``GraphConfig.warmup_steps`` steps after a (re)plan run eagerly on a side stream (they compile the
Triton kernels and create the lazily made buffers); the next step is captured and replayed. Anything that replaces
a buffer the graph holds re-plans (``add_param_group``, ``load_state_dict``, a param's storage replaced, a kernel
switch changed, a dtype or device move) and starts the warm-up again. A step that cannot replay (the profiler's
baseline steps, a user's GradScaler handing a new ``found_inf`` each step, non-contiguous grads that need copies)
runs eagerly without dropping the graph. A capture that fails falls back to eager for good, with the reason in
the summary.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kitsune.config import GraphConfig
from kitsune.subsystem import StepContext, Subsystem

if TYPE_CHECKING:
    from kitsune.optimizer import KitsuneOptimizer


class CudaGraphBackend:
    """torch.cuda.CUDAGraph: capture on torch's capture stream, eager warm-up on a side stream."""

    def supports(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "needs CUDA params"
        if not torch.cuda.is_available():
            return "CUDA is not available"
        return None

    def eager(self, fn: Callable[[], None], device: torch.device) -> None:
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            fn()
        current.wait_stream(side)

    def capture(self, fn: Callable[[], None], device: torch.device) -> Any:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(device), torch.cuda.graph(graph):
            fn()
        return graph

    def replay(self, graph: Any) -> None:
        graph.replay()


class GraphSubsystem(Subsystem):
    """Captures the fused phase in a CUDA graph after warm-up and replays it; see the module docstring."""

    name = "graphs"

    def __init__(self, config: GraphConfig, backend: Any = None) -> None:
        super().__init__()
        self.config = config
        self.backend = backend or CudaGraphBackend()
        self._graph: Any = None
        self._key: tuple | None = None
        self._saved: dict[str, Any] = {}
        self._warm = 0
        self._device = torch.device("cpu")
        self._broken: str | None = None
        self.captures = 0
        self.replays = 0
        self.steady_replays = 0
        """Replays that skipped the step's full host path (nothing had changed since the last replay)."""
        self.eager_steps = 0
        self.recaptures: list[str] = []
        """Why each graph after the first was captured again (the structural change that re-planned)."""
        self.last_eager_reason: str | None = None
        self._capture_ms = 0.0
        self.deactivate("not planned yet")

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def plan(self, opt: KitsuneOptimizer) -> None:
        self.invalidate("re-planned (param groups, state or storage changed)")
        reason = self._why_not(opt)
        if reason:
            self.deactivate(reason)
        else:
            self.activate()

    def _why_not(self, opt: KitsuneOptimizer) -> str | None:
        if not self.config.enabled:
            return "capture_graph=False"
        if self._broken:
            return f"capture failed, running eagerly: {self._broken}"
        fusion = next((s for s in opt.subsystems if s.name == "fusion"), None)
        if fusion is None or not fusion.active:
            return "nothing to capture: fusion is inactive" + (f" ({fusion.reason})" if fusion is not None else "")
        streams = next((s for s in opt.subsystems if s.name == "streams"), None)
        if streams is not None and getattr(streams, "in_backward", False):
            return "step_in_backward: the updates run inside backward, bucket by bucket"
        why = getattr(fusion, "graphable", "fusion cannot be captured")
        if why:
            return f"the phase is not all fused kernels: {why}"
        self._device = fusion.launch_units[0].device
        return self.backend.supports(self._device)

    def invalidate(self, reason: str) -> None:
        """Drop the graph (its buffers may be gone); the next steps warm up and capture again."""
        if self._graph is not None:
            self.recaptures.append(reason)
        self._graph = None
        self._key = None
        self._warm = 0

    # -- the step -----------------------------------------------------------------------------------------------
    def run(self, ctx: StepContext, key: tuple, device_work: Callable[[], None]) -> str:
        """Do this step's device work: eagerly while warming up, by capturing it once, then by replaying.

        ``key`` names everything the captured work depends on beyond the device buffers' contents (the plan's
        version, the identity of the scale tensor, the step's switches); a new key means capture again. Returns
        how the work ran: ``"warmup"``, ``"capture"`` or ``"replay"``.
        """
        if self._graph is not None and key != self._key:
            self.invalidate("the step's inputs changed (loss scaler, clipping or AMP switches)")
        ctx.extra["static_outputs"] = True  # outputs (the grad norm) go to buffers that outlive the step
        if self._graph is None and self._warm < self.config.warmup_steps:
            self.backend.eager(device_work, self._device)
            self._warm += 1
            self.eager_steps += 1
            self._mark_static_outputs(ctx)
            return "warmup"
        if self._graph is None:
            keys = set(ctx.extra)
            start = time.perf_counter()
            try:
                self._graph = self.backend.capture(device_work, self._device)
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
            # what the captured work left in ctx (the found_inf and grad-norm buffers), for the replays to come
            self._saved = {k: ctx.extra[k] for k in ctx.extra.keys() - keys}
        else:
            ctx.extra.update(self._saved)
            self.backend.replay(self._graph)
        self.replays += 1
        self._mark_static_outputs(ctx)
        return "replay"

    def replay_again(self) -> dict[str, Any]:
        """Replay the captured work for a step the orchestrator found unchanged since the last replay (see
        ``KitsuneOptimizer._replay_again``); returns what the capture left in the step context (the norm buffer)."""
        self.backend.replay(self._graph)
        self.replays += 1
        self.steady_replays += 1
        return self._saved

    @staticmethod
    def _mark_static_outputs(ctx: StepContext) -> None:
        norm = ctx.extra.get("grad_norm")
        if isinstance(norm, torch.Tensor):  # the static buffer is overwritten by the next replay: the optimizer
            ctx.extra["static_grad_norm"] = True  # copies it out only when someone reads last_grad_norm

    def note_eager(self, reason: str) -> None:
        """This step ran without the graph (which stays valid), for ``reason``."""
        self.eager_steps += 1
        self.last_eager_reason = reason

    def report(self) -> dict[str, Any]:
        return {
            "captures": self.captures,
            "replays": self.replays,
            "steady_replays": self.steady_replays,
            "eager_steps": self.eager_steps,
            "warmup_steps": self.config.warmup_steps,
            "recaptures": list(self.recaptures[-10:]),
            "last_eager_reason": self.last_eager_reason,
            "capture_ms": round(self._capture_ms, 3),
        }
