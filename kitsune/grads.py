"""The grad pass: what a step does to the grads besides using them, and the one place that decides how.

In step order: the shard reduce (ZeRO: the ranks' grads averaged, each rank keeping its own), the unscale and
inf/nan check (float16 loss scaling: kitsune's scaler, or a user's ``torch.amp.GradScaler`` handing its scale over),
the clip to ``max_grad_norm``. Where the fused executor owns every param and its kernels can take these passes
(``FusionSubsystem.grad_pass is None``), they run inside its norm and update kernels (``StepState.fused_grads``):
the grads are read twice in all. Otherwise they run here, in place, as passes of their own, before any update.

Everything that can make them fail is checked in `GradPass.begin`, before any grad changes. A step that raises
after the passes of their own ran (the wrapped optimizer's step refusing something) leaves the grads unscaled and
clipped, as torch's ``scaler.unscale_(opt); clip_grad_norm_(...); scaler.step(opt)`` does; a retry on the same grads
does not apply them again.

It also owns zeroing: ``GradConfig(zero_in_step=True)`` has the update kernel write zeros into the grads it used,
and `GradPass.zero_grad` then leaves those alone.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Sequence
from operator import attrgetter
from typing import Any

import torch

from kitsune.amp import AMPSubsystem, unscale_and_check
from kitsune.clip import clip_grad_norm_
from kitsune.config import GradConfig
from kitsune.distributed import fsdp
from kitsune.distributed.zero import ShardSubsystem, clip_sharded_grads_
from kitsune.memory import MemoryPool
from kitsune.subsystem import StepState, unique_params

_GRAD = attrgetter("grad")
_VERSION = attrgetter("_version")
_BASE_ZERO_GRAD = torch.optim.Optimizer.zero_grad


def _unscaled_tensors(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The dense tensors that unscaling ``params``' grads divides: each grad, or a sparse grad's values (params
    without a grad left out). As torch's GradScaler does, a float16 sparse grad is coalesced first (``p.grad``
    replaced), so that duplicate indices are summed and an overflow in that sum is found."""
    out = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        if g.is_sparse:
            if g.dtype == torch.float16:
                p.grad = g = g.coalesce()
            g = g._values()
        out.append(g)
    return out


def _unscale_handed_over(grads: list[torch.Tensor], scale: torch.Tensor, s: StepState) -> None:
    """Divide ``grads`` by the scale a user's GradScaler handed to the step. Its ``found_inf`` has checked every
    grad already, so the check here writes to a scratch flag."""
    assert s.found_inf is not None  # handed over with the scale
    unscale_and_check(grads, scale.double().reciprocal().float(), torch.zeros_like(s.found_inf))


class GradPass:
    """Shard reduce -> unscale and inf check -> clip, fused into the kernels or run here; see the module docstring.

    ``scaler``: kitsune's AMP subsystem when it scales the loss (float16), else None; ``kernels``: the separate
    clip may use kitsune's two-launch ``clip_grad_norm_`` (fusion with reductions on), else torch's.
    """

    def __init__(
        self,
        config: GradConfig,
        shard: ShardSubsystem,
        pool: MemoryPool,
        scaler: AMPSubsystem | None = None,
        kernels: bool = False,
    ) -> None:
        self.config = config
        self._shard, self._pool, self._scaler = shard, pool, scaler
        self._kernels = kernels
        self._fusable = False
        self._repeated = False
        self._clipped_before: tuple[tuple[list[Any], list[int]], torch.Tensor] | None = None
        """After a step that raised once it had clipped the grads: their versions and the norm, for the retry."""
        self._last_norm: torch.Tensor | None = None
        self._norm_is_static = False
        """Whether ``_last_norm`` is a CUDA graph's static buffer, which the next replay overwrites."""
        self._zeroed: tuple[list[torch.Tensor], list[int], list[Any]] | None = None
        self.host_syncs = 0
        """Host syncs made inside ``step()`` so far (reading found_inf for a step the device cannot skip)."""

    @property
    def passes(self) -> bool:
        """Whether a step has passes to run over the grads before the update (clip or loss scaling), so that a
        closure must run first."""
        return self.config.max_norm is not None or self._scaler is not None

    def plan(self, groups: list[dict[str, Any]], fusable: bool) -> None:
        """``fusable``: the fused executor updates every param and its kernels can take the passes."""
        listed = [id(p) for g in groups for p in g["params"]]
        self._repeated = len(set(listed)) != len(listed)
        self._fusable = fusable

    # -- the step ----------------------------------------------------------------------------------------------
    def begin(
        self, s: StepState, groups: list[dict[str, Any]], handoff: tuple[torch.Tensor | None, torch.Tensor] | None
    ) -> None:
        """Reduce sharded grads, decide how this step treats the grads and check everything that could make the
        passes fail, changing no grad. ``handoff``: a user's GradScaler's ``(grad_scale, found_inf)``, where it
        hands them to the step (``grad_scale`` None once it unscaled the grads itself)."""
        self._zeroed = None
        if self._shard.active:
            self._shard.begin(s)
        fused = s.fused_grads = self._fusable and not s.baseline
        scaler = self._scaler
        if scaler is not None and not scaler.loss_scaled and _every_lr_zero(groups):
            s.unscaled, scaler = True, None  # torch.distributed.checkpoint's state init: no loss, nothing to unscale
        if scaler is not None:
            scaler.check_scaled(grad_scaler=handoff is not None)
        clip = self.config.max_norm
        if clip is not None and not fused:
            _refuse_sparse(self._params(groups))
        if handoff is not None:
            s.external_scaler = True
            s.found_inf = handoff[1]
        if fused:
            s.max_norm = clip
            if scaler is not None:
                s.grad_scale, s.check_inf = scaler.scale, True
            elif handoff is not None:
                s.grad_scale = handoff[0]
        s.grad_write = 2 if self.config.zero_in_step else int(fused and (s.grad_scale is not None or clip is not None))

    def backward_state(self) -> StepState:
        """The step state of an update launched inside backward (no clip, no loss scaling there)."""
        return StepState(0, fused_grads=True, grad_write=2 if self.config.zero_in_step else 0)

    def apply(self, s: StepState, groups: list[dict[str, Any]], handoff_scale: torch.Tensor | None) -> None:
        """The passes of their own (the grads are not fused): unscale and check, combine across ranks, clip; in
        place, before any update."""
        if s.fused_grads:
            if s.phases is not None:
                s.phases.mark("unscale")
            return
        if handoff_scale is not None and not s.handoff_unscaled:  # a user's GradScaler: its found_inf has checked
            _unscale_handed_over(self._dense_grads(groups), handoff_scale, s)
            s.handoff_unscaled = True
        if self._scaler is not None and not s.unscaled:
            grads = self._shard.owned_grads() if self._shard.active else self._dense_grads(groups)
            s.found_inf = self._scaler.unscale(grads, collective=s.reduce is not None)
        if s.reduce is not None and s.found_inf is not None:  # an overflow on any rank skips the step on all
            s.reduce(None, s.found_inf)
        if s.phases is not None:
            s.phases.mark("unscale")
        if self.config.max_norm is None:
            return
        retry = self._clipped_before
        if retry is not None and self._marks_hold(retry[0], groups):
            s.grad_norm = retry[1]  # a retry of a step that raised after clipping these grads
        else:
            s.grad_norm = self._clip(self._params(groups), s.reduce)
        if s.phases is not None:
            s.phases.mark("clip")

    def skip_on_host(self, s: StepState, device_side: bool) -> bool:
        """Whether this step found inf/nan grads, read on the host only where a device-side skip is impossible
        (``device_side``: every update of this step reads ``found_inf`` on the device; the wrapped optimizer's own
        step cannot, so when it has params to update this costs one sync, as ``GradScaler.step`` does)."""
        if s.found_inf is None or (device_side and not s.baseline):
            return False
        self.host_syncs += 1
        return bool(s.found_inf.item())

    def unscale_left(self, s: StepState) -> None:
        """A user's GradScaler handed its scale to a step whose fused kernels unscale in place, and the step met
        grads those kernels cannot read (sparse, another dtype: ``s.unhandled``, which go to the wrapped optimizer's
        own step): unscale those here, as ``GradScaler.unscale_`` does (a float16 sparse grad coalesced first, its
        values unscaled). GradScaler's ``found_inf`` has checked them already, and the wrapped step skips on it."""
        if s.unhandled and s.fused_grads and s.external_scaler and s.grad_scale is not None:
            _unscale_handed_over(_unscaled_tensors(s.unhandled), s.grad_scale, s)

    def abandon(self, s: StepState, groups: list[dict[str, Any]]) -> None:
        """The step raised: the clip remembered for a retry on the same grads (the grads as the step pointed them:
        a retry points them there again), then the grads the shard pointed at this rank's share back as they were."""
        norm = s.grad_norm
        self._clipped_before = None if norm is None or s.fused_grads else (self._grad_marks(groups), norm)
        if self._shard.active:
            self._shard.abandon()

    def finish(self, s: StepState, groups: list[dict[str, Any]]) -> None:
        """After a step (full or steady): keep its norm and which grads the kernel zeroed."""
        self._clipped_before = None
        norm = s.grad_norm
        if norm is None and self.config.max_norm is not None:  # no pass ran: no param had a grad
            params = self._params(groups)
            if params and all(p.grad is None for p in params):  # torch's clip_grad_norm_ of no grads: 0
                norm = torch.zeros((), dtype=torch.float32, device=params[0].device)
        self._last_norm = norm
        self._norm_is_static = s.graphed and s.grad_norm is not None
        if s.zeroed:
            grads = list(map(_GRAD, s.zeroed))
            self._zeroed = (s.zeroed, _versions(grads), _refs(grads))
        else:
            self._zeroed = None

    @property
    def last_norm(self) -> torch.Tensor | None:
        """The global norm the last step clipped (see ``KitsuneOptimizer.last_grad_norm``)."""
        norm = self._last_norm
        if self._norm_is_static and norm is not None:
            # copied out on first read (a clone queued behind the step that wrote it), not every step: the copy
            # costs a launch and tens of microseconds of host time that most steps never need
            norm = self._last_norm = norm.clone()
            self._norm_is_static = False
        return norm

    # -- helpers -----------------------------------------------------------------------------------------------
    def _params(self, groups: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Every param once, in the groups' order (a param listed twice is unscaled and clipped once, as for
        model.parameters())."""
        return unique_params(groups) if self._repeated else [p for g in groups for p in g["params"]]

    def _grad_marks(self, groups: list[dict[str, Any]]) -> tuple[list[Any], list[int]]:
        return grad_marks(self._params(groups))

    def _marks_hold(self, marks: tuple[list[Any], list[int]], groups: list[dict[str, Any]]) -> bool:
        return marks_changed(marks, self._params(groups)) == 0

    def _dense_grads(self, groups: list[dict[str, Any]]) -> list[torch.Tensor]:
        """`_unscaled_tensors` of every param of ``groups``."""
        return _unscaled_tensors(self._params(groups))

    def _clip(self, params: list[torch.Tensor], reduce: Any) -> torch.Tensor:
        """Clipping as a pass of its own: kitsune's two-launch clip_grad_norm_ when reductions are enabled, else
        torch's; with sharded grads (``reduce``) torch ops and a norm all-reduced."""
        cfg = self.config
        if reduce is not None:
            return clip_sharded_grads_(params, cfg.max_norm, cfg.norm_type, reduce)  # type: ignore[arg-type]
        clip = clip_grad_norm_ if self._kernels else torch.nn.utils.clip_grad_norm_
        norm = clip(params, cfg.max_norm, cfg.norm_type)  # type: ignore[arg-type]
        # FSDP2 grads: torch returns a DTensor, replicated for a p-norm but Partial(max) for the inf-norm (each rank's
        # own max): the global norm either way
        return norm.full_tensor() if fsdp.is_dtensor(norm) else norm

    # -- zeroing -------------------------------------------------------------------------------------------------
    def zero_grad(self, base: torch.optim.Optimizer, set_to_none: bool, label: str) -> None:
        """``base``'s grads reset as ``torch.optim.Optimizer.zero_grad`` does: set to None, or with
        ``set_to_none=False`` detached and zeroed in place, one ``_foreach_zero_`` per (device, dtype) as torch's
        foreach and fused optimizers do, whatever the wrapped optimizer (one that defines its own ``zero_grad`` is
        left to it).
        ``label``: the name torch's zero_grad gives a profiler trace.

        With ``GradConfig(zero_in_step=True)`` the fused update has already written zeros into the grads it used:
        those are left as they are (allocated, ``set_to_none`` notwithstanding) unless something changed them
        since (a backward pass bumps a grad's version counter), so the step's zeroing is the only pass over them.
        With ``MemoryConfig(flat_grads=True)`` the pool's grad arenas are zeroed in one fill each."""
        if torch.autograd._profiler_enabled():  # the label torch's zero_grad gives a trace, whatever runs under it
            with torch.autograd.profiler.record_function(label):
                self._zero_grad(base, set_to_none)
        else:
            self._zero_grad(base, set_to_none)

    def _zero_grad(self, base: torch.optim.Optimizer, set_to_none: bool) -> None:
        groups = base.param_groups
        self._shard.zero_grad()  # sharded grads already reduced are discarded too
        zeroed, self._zeroed = self._zeroed, None
        skip: set[torch.Tensor] = set()
        pool = self._pool
        flat = pool.flat_grads
        n_params = sum(len(g["params"]) for g in groups)
        if zeroed is not None:
            # the very tensors the step zeroed (compared through weak references: a grad replaced after the step and
            # freed may hand its id to the new one, whose version counter can match), at the same versions
            params, versions, refs = zeroed
            grads = list(map(_GRAD, params))
            same = _alive_ids(refs) == list(map(id, grads))
            if not flat and len(params) == n_params and same and _versions(grads) == versions:
                return  # the step zeroed every param's grad, and nothing wrote to them since: nothing to do
            skip = {
                p
                for p, g, v, r in zip(params, grads, versions, refs, strict=True)
                if g is not None and r is not None and r() is g and g._version == v
            }
        if flat:  # grads in the pool's arena: zeroed in place, kept (not set to None)
            skip |= pool.zero_grads(already_zero=skip)
            if len(skip) == n_params:
                return  # every grad is an arena view: the fill zeroed them all
        elif zeroed is None and type(base).zero_grad is not _BASE_ZERO_GRAD:
            base.zero_grad(set_to_none=set_to_none)  # an optimizer's own zero_grad is kept
            return
        _zero_grads(groups, skip, set_to_none)


def _refuse_sparse(params: list[torch.Tensor]) -> None:
    sparse = next((i for i, p in enumerate(params) if p.grad is not None and p.grad.is_sparse), None)
    if sparse is not None:
        raise ValueError(
            f"max_grad_norm: param {sparse} (in the groups' order) has a sparse grad, and the global norm cannot "
            "be clipped over sparse grads (torch.nn.utils.clip_grad_norm_ cannot either): give that layer dense "
            "grads (nn.Embedding(sparse=False)) or leave max_grad_norm unset. Nothing was updated."
        )


def _zero_grads(groups: list[dict[str, Any]], skip: set[torch.Tensor], set_to_none: bool) -> None:
    """torch.optim's ``zero_grad`` for every param not in ``skip``, in plain loops: torch's own adds a profiler
    label, the dynamo guard and a second read of each grad (about half again the host time on GPT-2's 148 grads, on
    an H100 host)."""
    params = [p for g in groups for p in g["params"]]
    if skip:  # (a tensor's hash is a Python call: only when something is skipped)
        params = [p for p in params if p not in skip]
    if set_to_none:
        for p in params:
            p.grad = None  # a no-op where it is None already
    else:
        _zero_in_place([g for g in map(_GRAD, params) if g is not None])


def _zero_in_place(grads: list[torch.Tensor]) -> None:
    """Detach and zero ``grads`` as torch.optim's foreach ``zero_grad(set_to_none=False)`` does: one
    ``_foreach_zero_`` per (device, dtype) rather than a launch per grad (148 launches cost 1.5 ms of host time on
    GPT-2), sparse grads one by one."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        if g.requires_grad:  # a grad of backward(create_graph=True); the common grad needs no call here
            if g.grad_fn is not None:
                g.detach_()
            else:
                g.requires_grad_(False)
        if g.layout is torch.strided:
            by_kind[g.device, g.dtype].append(g)
        else:
            g.zero_()
    for tensors in by_kind.values():
        torch._foreach_zero_(tensors)


def grad_marks(params: Sequence[torch.Tensor]) -> tuple[list[Any], list[int]]:
    """Weak references to ``params``' grads and their version counters: they hold only while the very same tensors
    are the grads and no backward or in-place op touched them (an id alone can be a freed grad's, reused)."""
    grads = list(map(_GRAD, params))
    return _refs(grads), _versions(grads)


def marks_changed(
    marks: tuple[list[Any], list[int]], params: Sequence[torch.Tensor], versions_of_views: bool = True
) -> int:
    """How many of ``params`` hold another grad than `grad_marks` saw, or the same one written since (0: they
    hold). ``versions_of_views=False``: a grad that is a view (of a flat buffer, whose version counter its siblings'
    writes move) counts only when replaced."""
    grads = list(map(_GRAD, params))
    refs, versions = marks
    now = zip(_alive_ids(refs), map(id, grads), versions, _versions(grads), grads, strict=True)
    if versions_of_views:
        return sum(a != b or v != w for a, b, v, w, _ in now)
    return sum(a != b or (v != w and g._base is None) for a, b, v, w, g in now)


def _versions(grads: Sequence[torch.Tensor | None]) -> list[int]:
    """Each grad's version counter (-1 for None): one C-level pass when every grad is there."""
    try:
        return list(map(_VERSION, grads))
    except AttributeError:  # a None grad
        return [-1 if g is None else g._version for g in grads]


def _every_lr_zero(groups: list[dict[str, Any]]) -> bool:
    """Whether every group's lr is 0 (a tensor lr read on the host: only asked of a step whose loss was not
    scaled, which otherwise raises)."""
    try:
        lrs = [float(g["lr"]) for g in groups if "lr" in g]
    except (TypeError, ValueError, RuntimeError):
        return False
    return bool(lrs) and all(lr == 0.0 for lr in lrs)


def _refs(grads: Sequence[torch.Tensor | None]) -> list[Any]:
    """Weak references to ``grads`` (None for a None grad): whether each is still the same tensor, never held."""
    try:
        return list(map(weakref.ref, grads))
    except TypeError:  # a None grad
        return [None if g is None else weakref.ref(g) for g in grads]


def _alive_ids(refs: Sequence[Any]) -> list[int]:
    """The ids of what ``refs`` (from `_refs`) still refer to: ``id(None)`` for a freed tensor or a None grad."""
    try:
        return [id(r()) for r in refs]
    except TypeError:  # a None grad had no reference
        return [id(None if r is None else r()) for r in refs]
