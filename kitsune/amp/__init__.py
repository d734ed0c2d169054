"""Mixed precision: autocast and a dynamic loss scaler whose state lives on the device.

The training loop has one obvious shape::

    with optimizer.autocast():
        loss = loss_fn(model(x), y)
    optimizer.backward(loss)   # scales the loss when the AMP dtype is float16
    optimizer.step()           # unscales, checks inf/nan, skips the update on overflow, updates the scale
    optimizer.zero_grad()

The scale, the growth tracker, ``found_inf`` and the skipped-step counter are device tensors updated by
device ops, so nothing here reads a value back to the host during a step. When every param takes the fused
kernel, unscaling and the inf/nan check happen inside the fusion subsystem's two passes (the norm pass finds
inf/nan in the unscaled grads; the update kernel divides by the scale and skips on ``found_inf``); otherwise
``torch._amp_foreach_non_finite_check_and_unscale_`` unscales first, as ``torch.amp.GradScaler`` does. The
scale is updated by ``torch._amp_update_scale_``, GradScaler's own op. Reading
``loss_scale`` or ``skipped_steps`` syncs once, when you read it.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any

import torch

from kitsune.config import AMPConfig
from kitsune.distributed.fsdp import all_reduce_found_inf_, local, mesh_groups
from kitsune.subsystem import Subsystem


def unscale_and_check(grads: list[torch.Tensor], inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
    """Multiply ``grads`` by ``inv_scale`` in place and set ``found_inf`` to 1 if any is inf/nan (on device).

    ``torch._amp_foreach_non_finite_check_and_unscale_`` needs one dtype per call and the scalars on the
    grads' device, so grads are grouped by (device, dtype) first.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        groups[(g.device, g.dtype)].append(g)
    for (device, _), group in groups.items():
        if device == found_inf.device:
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale)
        else:
            local = torch.zeros_like(found_inf, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, local, inv_scale.to(device))
            found_inf.add_(local.to(found_inf.device)).clamp_(max=1.0)


class AMPSubsystem(Subsystem):
    """Autocast for both AMP dtypes; dynamic loss scaling (on the device) for float16."""

    name = "amp"

    def __init__(self, config: AMPConfig) -> None:
        super().__init__()
        self.config = config
        self.scaling = config.scales_loss
        self.device = torch.device("cpu")
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._found_inf: torch.Tensor | None = None
        self._skipped: torch.Tensor | None = None
        self._loss_scaled = False
        self._unscaled = False
        """The grads are unscaled already: a step raised after unscaling them (the wrapped step failed), and the
        retry must not divide them by the scale again (GradScaler keeps the same per-step record)."""
        self._groups: list[Any] = []
        """FSDP2: the process groups found_inf is all-reduced over, so every rank skips the same steps."""
        self.deactivate("not planned yet")

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def plan(self, params: list[torch.Tensor]) -> None:
        """Put the scaler's device state where the params are (it follows a move); with AMP off (``enabled=False``)
        only note the device, for a disabled [`autocast`][kitsune.amp.AMPSubsystem.autocast]."""
        device = params[0].device if params else torch.device("cpu")
        if not self.config.enabled:
            self.device = device
            self.deactivate("enable_amp=False")
            return
        self._groups = mesh_groups(params) if self.scaling else []
        if self._scale is None:
            self._scale = torch.full((1,), self.config.init_scale, dtype=torch.float32, device=device)
            self._growth_tracker = torch.zeros(1, dtype=torch.int32, device=device)
            self._found_inf = torch.zeros(1, dtype=torch.float32, device=device)
            self._skipped = torch.zeros(1, dtype=torch.int64, device=device)
        elif device != self.device:
            self._move(device)
        self.device = device
        self.activate()

    def _move(self, device: torch.device) -> None:
        for name in ("_scale", "_growth_tracker", "_found_inf", "_skipped"):
            setattr(self, name, getattr(self, name).to(device))

    # -- the step (float16 only; kitsune.grads calls these) ---------------------------------------------------------
    @property
    def loss_scaled(self) -> bool:
        """Whether the grads this step reads came from a loss scaled by ``optimizer.backward``."""
        return self._loss_scaled

    def check_scaled(self, grad_scaler: bool = False) -> None:
        """Raise, before the step changes anything, when this step's loss was not scaled, or when a
        ``torch.amp.GradScaler`` (``grad_scaler``: its ``step`` called this one) scaled it besides."""
        if grad_scaler:
            raise RuntimeError(
                "two loss scalers: a torch.amp.GradScaler stepped this optimizer, and kitsune's float16 AMP "
                "(enable_amp=True) scales the loss too. Use one: drop the GradScaler (optimizer.backward(loss) scales "
                "the loss and the step unscales, skips overflow steps and updates the scale), or leave enable_amp off "
                "and keep the GradScaler. Nothing was updated"
            )
        if not self._loss_scaled:
            raise RuntimeError(
                "kitsune AMP with float16 scales the loss: call optimizer.backward(loss) instead of loss.backward() "
                "(or use AMPConfig(dtype=torch.bfloat16), which needs no scaling). No loss was scaled by this "
                "optimizer since its last step: a loss.backward(), a second step() without a new backward, or a "
                "loss scaled by another optimizer's backward (one torch.amp.GradScaler drives two optimizers over "
                "one loss). Nothing was updated"
            )

    @property
    def scale(self) -> torch.Tensor:
        """The loss scale on the device, ``(1,)`` float32 (the fused kernels divide the grads by it)."""
        assert self._scale is not None
        return self._scale

    def unscale(self, grads: list[torch.Tensor], collective: bool = False) -> torch.Tensor | None:
        """Divide ``grads`` by the scale in place and return the device flag of inf/nan among them (as GradScaler's
        ``unscale_``); a retry of a step that raised after this returns the same flag without dividing again. None
        where there is no grad to check (the scaled grads dropped by ``zero_grad()``): the step then leaves the scale
        as it is, unless the flag takes part in a collective (``collective``, FSDP2's mesh), which every rank runs."""
        if self._unscaled:
            return self._found_inf
        if not grads and not collective and not self._groups:
            return None
        self._found_inf.zero_()
        if self._groups:  # FSDP2: check the local shards (torch's DTensor op would all-reduce per dtype), then reduce
            grads = [local(g) for g in grads]
        unscale_and_check(grads, self._scale.double().reciprocal().float(), self._found_inf)
        if self._groups:
            all_reduce_found_inf_(self._found_inf, self._groups)
        self._unscaled = True
        return self._found_inf

    def finish(self, found_inf: torch.Tensor | None, scale_updated: bool) -> None:
        """After the step: update the scale (unless a CUDA graph's work did) and expect a newly scaled loss."""
        if not scale_updated:
            self.update_scale(found_inf)
        self._loss_scaled = self._unscaled = False

    @property
    def pending(self) -> tuple[bool, bool]:
        """Where this step stands between ``optimizer.backward`` and ``step()`` (the loss scaled, the grads
        unscaled by a step that raised after): a copy of the optimizer goes on from there."""
        return self._loss_scaled, self._unscaled

    def resume(self, pending: tuple[bool, bool]) -> None:
        """A copy's: `pending` as the original stood."""
        self._loss_scaled, self._unscaled = pending

    def take_scaled_loss(self) -> bool:
        """For a step that skips [`check_scaled`][kitsune.amp.AMPSubsystem.check_scaled] and
        [`finish`][kitsune.amp.AMPSubsystem.finish] (the steady replay, whose graph updates the scale): whether this
        step's loss was scaled; if so, the next step needs a scaled loss again."""
        scaled, self._loss_scaled = self._loss_scaled, False
        return scaled

    def update_scale(self, found_inf: torch.Tensor | None) -> None:
        """Count a skipped step and update the scale, on the device (capturable in a CUDA graph)."""
        if found_inf is None:  # no grad at all this step (the fused path launched nothing): nothing was checked, so
            return  # the scale stays and the clean steps are not counted (GradScaler's step asserts there)
        self._skipped.add_(found_inf.to(torch.int64))
        torch._amp_update_scale_(
            self._scale,
            self._growth_tracker,
            found_inf,
            self.config.growth_factor,
            self.config.backoff_factor,
            self.config.growth_interval,
        )

    # -- the user's side ----------------------------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast in the AMP dtype on the params' device type (a disabled autocast with AMP off)."""
        return torch.autocast(device_type=self.device.type, dtype=self.config.dtype, enabled=self.config.enabled)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if not self.scaling:
            return loss
        self._loss_scaled, self._unscaled = True, False  # new grads: scaled
        return loss * self._scale.to(loss.device).squeeze()

    @property
    def loss_scale(self) -> float:
        """Current loss scale (reads the device value: one sync). 1.0 when not scaling."""
        return float(self._scale.item()) if self.scaling and self._scale is not None else 1.0

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because of inf/nan grads (reads the device counter: one sync)."""
        return int(self._skipped.item()) if self._skipped is not None else 0

    # -- checkpoints and reports --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if not self.scaling or self._scale is None:
            return {}
        return {
            "scale": self.loss_scale,
            "growth_tracker": int(self._growth_tracker.item()),
            "skipped_steps": self.skipped_steps,
        }

    def check_state_dict(self, state: dict[str, Any]) -> None:
        if not self.scaling or not state:
            return
        try:
            scale, tracker = float(state["scale"]), int(state["growth_tracker"])
            skipped = int(state.get("skipped_steps", 0))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"the loss scaler's saved state is unreadable ({type(exc).__name__}: {exc}): it needs a numeric "
                "'scale', 'growth_tracker' and 'skipped_steps', as state_dict() writes them"
            ) from None
        # the device holds the tracker as int32 and the skipped steps as int64
        if not 0 < scale < float("inf") or not 0 <= tracker < 2**31 or not 0 <= skipped < 2**63:
            raise ValueError(
                f"the loss scaler's saved state holds scale={scale}, growth_tracker={tracker}, "
                f"skipped_steps={skipped}: a scale must be positive and finite, the counts whole numbers from 0 "
                "(the growth tracker below 2**31)"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.scaling or not state:
            return
        device = self.device
        self._scale = torch.full((1,), float(state["scale"]), dtype=torch.float32, device=device)
        self._growth_tracker = torch.full((1,), int(state["growth_tracker"]), dtype=torch.int32, device=device)
        self._found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        self._skipped = torch.full((1,), int(state.get("skipped_steps", 0)), dtype=torch.int64, device=device)

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dtype": str(self.config.dtype).removeprefix("torch.")}
        if self.scaling and self._scale is not None:
            out.update(loss_scale=self.loss_scale, skipped_steps=self.skipped_steps)
        return out
