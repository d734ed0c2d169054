"""The per-step executor of a plan's fused buckets: a Triton launch unit over its tables (torch's fused/foreach routes
are `kitsune.fusion.torch_route`)."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from operator import attrgetter
from typing import Any

import torch

from kitsune import _native
from kitsune._native import MEMORY_FORMATS, MOVED, OTHER, SAME, lies_in
from kitsune.distributed import fsdp
from kitsune.fusion import state_format
from kitsune.fusion.algos import AlgoInfo, extra_keys, init_state, missing_key
from kitsune.kernels.multi_tensor import DEAD, DEFAULT_BLOCK, TensorTables, int64_tensor
from kitsune.kernels.spec import StateFormat, UpdateSpec
from kitsune.optim.base import refuse_narrowing

_GRAD = attrgetter("grad")
_NO_TORCH_FUNCTION = torch._C._disabled_torch_function_impl


def _plain(t: torch.Tensor) -> bool:
    """A tensor whose ``grad`` and storage C++ reads exactly as Python does: a plain tensor or a Parameter (or a
    subclass of one that keeps torch functions off, as Parameter does), not a DTensor or another wrapper."""
    return type(t) is torch.Tensor or getattr(type(t), "__torch_function__", None) is _NO_TORCH_FUNCTION


_DTYPE = attrgetter("dtype")
_DATA_PTR = torch.Tensor.data_ptr
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_SHAPE = attrgetter("shape")
_PTRS_EQUAL = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
"""torch's C++ check that tensors still sit at known addresses (CUDA builds; torch.compile's CUDA graphs use it for
their static inputs): the check while `kitsune._native` builds or where it cannot. One call for a whole list, but
it converts its lists element by element (about 150 ns a tensor). Absent from CPU builds."""


class FusedUnit:
    """Up to ``max_fusion_size`` tensors of one bucket, updated by one launch of the generic kernel.

    Per step, one native call (`kitsune._native`) compares every param's and grad's address with the last step's,
    tens of ns a tensor with no per-tensor Python work (while it builds, or where it cannot: a read of each ``p.grad``
    and torch's `_PTRS_EQUAL`, or C-level ``map`` calls where torch lacks it). Everything else happens only when
    something changed: the grad addresses (one table upload; grad layouts are
    re-checked then), a param's storage (a re-plan), or a param's grad appearing for the first time (lazy state
    creation and one upload per state table).

    With ``static`` (``GraphConfig(static_addresses=True)``) a unit whose every grad was there at the last full
    check skips even those reads: it holds weak references to its grads and its params' storages, and a step
    checks everything again only after one of them was freed (see `_watch`).
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        group_index: list[int],
        info: AlgoInfo,
        spec: UpdateSpec,
        state: Any,
        block: int = DEFAULT_BLOCK,
    ) -> None:
        self.params = params
        self.param_set = set(params)  # the plan's union of these sets reuses their stored hashes
        self.group_index = group_index
        self.info = info
        self.spec = spec
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.sharded = fsdp.is_dtensor(params[0])
        """FSDP2 DTensor params (one bucket never mixes them with plain ones): the kernels address the local shards
        of the params, grads and state."""
        self.numels = [fsdp.local(p).numel() for p in params]
        self.shapes = [fsdp.local(p).shape for p in params]
        """The params' (local shards') shapes as planned: the state's, and for Muon the matrices'."""
        self.layouts = [_native.layout_code(fsdp.local(p)) for p in params]
        """The order each param's elements lie in as planned (`kitsune._native.layout_code`: row-major, channels_last):
        the kernels walk a param, its grad and its state as flat memory, so the grad and the state must lie in it."""
        self._row_major = not any(self.layouts)  # every param contiguous: the checks take C-level maps
        self.tables = TensorTables(self.device, self.numels, group_index, block)
        self._param_ptrs = self.param_addresses = self._addresses(params)
        self.tables.set_role("param", self._param_ptrs)
        self._grads_read = False
        """Whether the grad table holds where the last step found the grads (not before the first read, nor after a
        step that read them through copies)."""
        self._table = int64_tensor(
            self._param_ptrs * 2 + self.numels + list(map(_native.shape_key, self.shapes, self.layouts))
        )
        """The native check's int64 table: the params' addresses, the grads' as of `_grad_ptrs`, the numels, the
        params' shape keys."""
        self._table_grads = self._table[len(params) : 2 * len(params)]  # the grads' rows, as one view
        self._copied: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.unhandled: list[torch.Tensor] = []
        """Params skipped this step because their grad is one the kernel cannot take (sparse, another dtype)."""
        self.created: list[torch.Tensor] = []
        """Params whose state this step's `prepare` created (lazily, on their first grad)."""
        self.adopted: list[tuple[int, torch.Tensor]] = []
        """Flat grads: this step's grads moved into their arena slots, with the tensor each param held before."""
        self.stale = False
        """Set when a param's storage moved (``p.data = ...``): the subsystem re-plans before launching."""
        # SGD keeps no step in torch's state: count privately, only to spot each buffer's first step
        self._private_steps: torch.Tensor | None = None
        if spec.has_step and not info.step_in_state:
            done = [float(_has_state(state, p, info, spec, extra=False)) for p in params]
            self._private_steps = torch.tensor(done, dtype=torch.float32).to(self.device)
        self.uninit = [i for i, p in enumerate(params) if not _has_state(state, p, info, spec)]
        self._every = list(range(len(params)))
        self.plain_tensors = not self.sharded and all(map(_plain, params))
        """Whether a step may check the addresses in one native call (`kitsune._native`, or torch's `_PTRS_EQUAL`
        while it builds): plain tensors and Parameters, not FSDP2's DTensors or other subclasses, whose ``grad``
        and storage a C++ read could not see as Python does."""
        self.shards: list[torch.Tensor] | None = list(map(fsdp.LOCAL, params)) if self.sharded else None
        """FSDP2: each param's local shard, resolved once per plan. The native check (``unchanged_local``) compares
        every step that each param still holds it and where its grad's shard sits; a param given another shard, or
        no native check, sends the step through the full check."""
        self.native = True
        """``FusionConfig.native_checks``: use the native check once it is built."""
        self.slots: Any = None
        """The memory pool's arena slots for this unit's state (and grads), or None: torch's own allocations."""
        self.defaults: dict[str, Any] = {}
        """The wrapped optimizer's defaults (torch's lazy Adagrad init reads ``initial_accumulator_value`` there)."""
        self.static = False
        """``GraphConfig.static_addresses``: watch the grads and storages instead of checking them every step."""
        self.static_off: str | None = None
        """Why this unit stopped watching (its grads were freed before every step), or None."""
        self._intact: _Intact | None = None
        self._watched: list[weakref.ref] = []
        self._watched_steps = 0
        self._quick_breaks = 0
        self.rechecks = 0
        """Steps that checked every address again because a watched grad or storage had been freed."""
        self._state_intact = _Intact()
        self._state_refs: list[weakref.ref] = []
        self.held: list[tuple[torch.Tensor, int, list[tuple[str, int]]]] = []
        """Each bound param, its state dict's length and the ids of its tensors by key, as the last `bind` left them:
        what `kitsune.fusion.state_watch.StateWatch` compares where a dict changed."""
        self.binding = 0
        """The number of the last `bind` (new with each)."""
        self.params_checked = False
        """Set by `moved` when it found every param where planned: this step's `prepare` skips that
        check (the fusion subsystem clears it after each step's prepare, `forget_checks`)."""
        self._found: int | None = None
        """What `moved`'s native call found of the grads too (`SAME`, or `MOVED` plus their low bits with their
        addresses in `_out`), for this step's `prepare` to take instead of reading every grad again; None where it
        found nothing to give (`forget_checks` clears it with `params_checked`)."""
        self._grads_whole = False
        """Whether the last step found every grad as the kernels take it (present, dense, of the unit's dtype): only
        then does `moved` read the grads too (a grad that is None would send it on to a second call)."""
        self.bind(state)

    # -- per step ----------------------------------------------------------------------------------------------
    def check_state(self, state: Any) -> None:
        """Raise ``KeyError`` as the optimizer's own step would, before anything changes, when a param about to get
        its first fused update has a state that is not empty but misses a key the step reads (a checkpoint without
        ``exp_avg``; amsgrad, momentum or centered switched on mid-run). Optimizers that create each missing key on
        its own (SGD's momentum buffer, Muon) start it instead. Costs nothing once every param has its state."""
        if self.info.per_key_init:
            return
        for i in self.uninit:
            p = self.params[i]
            s = state.get(p)
            if s and p.grad is not None:
                key = missing_key(self.info, self.spec, s)
                if key is not None:
                    raise KeyError(key)

    @property
    def state_freed(self) -> bool:
        """Whether a state tensor the tables point at was freed (``state.clear()``, a tensor replaced by hand): the
        unit must be planned again before it launches."""
        return not self._state_intact.ok

    @property
    def overlapping_grad(self) -> torch.Tensor | None:
        """A grad the kernels read through a contiguous copy whose elements share memory (``.expand()``: a
        stride 0 over a size above 1), or None: a step that writes the grads unscaled or clipped could not copy them
        back into it, as torch's ``clip_grad_norm_`` and ``GradScaler.unscale_`` cannot write it."""
        for grad, _ in self._copied:
            if any(st == 0 and n > 1 for st, n in zip(grad.stride(), grad.shape, strict=True)):
                return grad
        return None

    @property
    def copies_grads(self) -> bool:
        """Whether this step's grads stand in as contiguous copies (non-contiguous grads): new every step, so the
        launch cannot be replayed from a CUDA graph."""
        return bool(self._copied)

    def prepare(self, state: Any, groups: Sequence[dict[str, Any]]) -> bool:
        """Point the tables at this step's grads and create missing state; False if no grad is live."""
        self.created = []  # this step's, whatever path it takes
        self.adopted = []
        if self.follow() != OTHER:
            return True
        return self._prepare(state, groups)

    @property
    def grad_addresses(self) -> list[int]:
        """The grad table as uploaded: what the kernels read this step (-1 for a grad that is None)."""
        uploaded = self.tables.addresses("grad")
        return [DEAD] * len(self.params) if uploaded is None else uploaded

    @property
    def _grad_ptrs(self) -> list[int] | None:
        """The grads' addresses as the last step found them, for the Python checks (None: not read yet)."""
        return self.tables.addresses("grad") if self._grads_read else None

    def moved(self) -> bool:
        """Whether a param's storage moved since the plan (``p.data = ...``, ``model.half()``, a device move). The
        optimizer asks before a step decides how the grads are clipped and unscaled, as the re-plan a move calls
        for can change that (a param that now falls back takes the grads' passes out of the kernels)."""
        self._found = None
        if self._intact is not None and self._intact.ok:
            moved = False  # static addresses: the watch holds the params' storages
        elif self._grads_read and self._grads_whole and (found := self._native_follow()) is not None:
            # the params and, in the same passes, the grads: where those are as the kernels take them (SAME or
            # MOVED), the params are where planned and `prepare` takes the grads' answer from here
            moved, self._found = False, found
        elif self._grads_read and (same := self._native_check(grads=False)) is not None:
            moved = not same  # a step `_unchanged` checks
        elif self.plain_tensors and self._grads_read and _PTRS_EQUAL is not None:
            try:
                same = _PTRS_EQUAL(self.params, self._param_ptrs, self._every)
                moved = not (same and self._layout_holds(self.params))
            except (TypeError, RuntimeError, ValueError):
                moved = True
        else:
            moved = self._addresses(self.params) != self._param_ptrs
            moved = moved or not self._layout_holds(self._locals(self.params))
        self.params_checked = not moved
        return moved

    def forget_checks(self) -> None:
        """`moved`'s findings hold for one step: after its prepare, or a step that raised."""
        self.params_checked, self._found = False, None

    def _native_follow(self) -> int | None:
        """`moved`'s one native call where the grads are read too: `SAME` or `MOVED` (plus the low bits) where every
        param sits where planned and every grad is as the kernels take it; None where the call cannot answer or
        found anything else (a grad that is None, a param moved: the params' own check then tells which)."""
        checks = self._follow_checks()
        if checks is None or self._pending:
            return None
        found = checks.follow(self.params, self._table, _native.PARAMS_AND_GRADS, self._out(), self.dtype)
        return None if found == OTHER else found

    def _follow_checks(self) -> Any:
        """The compiled checks where a step may follow moved grads through them (`_plain_checks`), except where the
        grads must move into the memory pool's arena, or where the full check would watch the new grads (static
        addresses): there a move is the full check's, and `_unchanged` answers only whether nothing moved."""
        checks = self._plain_checks()
        if checks is None or (self.slots is not None and self.slots.grad_arena is not None):
            return None
        return None if self.static and not self.static_off else checks

    def follow(self) -> int:
        """Whether the last step's tables hold for this one: `SAME` where the watch is intact (static addresses), or
        every grad and param sits where the last step found them with nothing pending (`_unchanged`); `MOVED` where
        only grads moved, each as the kernels take it, and the grad table now points at them (`_follow`); `OTHER`
        for anything else (`_prepare` sorts it out)."""
        if not self._state_intact.ok:
            return OTHER
        if self._intact is None:
            return self._follow() if self.checks_natively else OTHER
        if self._intact.ok:
            self._watched_steps += 1  # the watch was used: it did not break before its first step
            return SAME
        return OTHER

    @property
    def checks_natively(self) -> bool:
        """Whether a step may check this unit's addresses in one native call: plain tensors, or FSDP2 shards."""
        return self.plain_tensors or self.shards is not None

    @property
    def watching(self) -> bool:
        """Whether the unit watches its addresses (static addresses, armed by the last full check)."""
        return self._intact is not None

    def _watch(self) -> None:
        """Static addresses: after a full check that found every grad there, dense, contiguous, in place and every
        param's state made, hold weak references to the grads and to the grads' and params' storages. Freeing any of
        them (``p.grad = None``, ``model.zero_grad()``, a grad autograd replaced, ``p.grad.data = ...``, ``p.data =
        ...`` or ``model.half()`` dropping the old storage) breaks the watch, and the next step checks everything
        again. What it cannot see is a grad or storage replaced while something else still holds the old one
        (GraphConfig's docs)."""
        try:
            grads = list(map(_GRAD, self.params))
            # the grads' storages too: ``p.grad.data = ...`` or ``p.grad.set_(...)`` keep the grad object
            storages = [t.untyped_storage() for t in (*grads, *self.params)]
            tensors = [*grads, *storages]
            intact = _Intact()
            self._watched = [weakref.ref(t, intact) for t in tensors]
        except (TypeError, RuntimeError, NotImplementedError):  # a tensor without storage: check every step
            return
        self._intact = intact
        self._watched_steps = 0

    def _unwatch(self) -> None:
        if self._intact is None:
            return
        self.rechecks += 1
        self._quick_breaks = 0 if self._watched_steps else self._quick_breaks + 1
        self._intact, self._watched = None, []
        if self._quick_breaks >= _QUICK_BREAKS:
            self.static_off = (
                f"the grads were freed before each of {_QUICK_BREAKS} steps in a row (zero_grad(set_to_none=True)?): "
                "their addresses are checked every step"
            )

    def _follow(self) -> int:
        """`_unchanged`, and the common case of the rest: grads that moved (``zero_grad()`` freed them and backward
        allocated new ones elsewhere), every param where planned, every grad present, dense, contiguous, of the unit's
        dtype and of its param's shape. One native call reads them all; the grad table is then pointed at them (one
        upload) and the answer is `MOVED`. Where that call cannot answer (not built, switched off, tensor subclasses,
        FSDP2 shards), where the grads must move into the memory pool's arena, or where the full check would watch
        the new grads (static addresses), a move is `OTHER`."""
        if self._pending:
            return OTHER
        checks = self._follow_checks()
        if checks is None:
            return SAME if self._unchanged() else OTHER
        out = self._out()
        found, self._found = self._found, None  # what `moved` read this step, if it read the grads
        if found is None:
            found = checks.follow(self.params, self._table, self._grads_what, out, self.dtype)
        self._grads_whole = found != OTHER
        if found <= SAME:
            return found  # nothing moved, or something the full path sorts out
        low = _native.moved_low_bits(found)
        self._point_grads(None, out, low_bits=low)  # no list (a Python check that asks later makes one), no copy
        return MOVED

    @property
    def _pending(self) -> bool:
        """Whether the last step left something the per-step check cannot vouch for: no grads read yet, grads read
        through copies, lazy state or grads the kernels cannot take (the full check sorts those out)."""
        return not self._grads_read or bool(self._copied) or bool(self.uninit) or bool(self.unhandled)

    def _point_grads(
        self,
        ptrs: list[int] | None,
        host: torch.Tensor,
        upload: list[int] | None = None,
        copied: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        low_bits: int | None = None,
    ) -> None:
        """Point the grad table at this step's grads (``ptrs``, and ``host`` as a CPU int64 tensor; ``ptrs`` None:
        ``host`` alone, from a native read that found them moved; ``upload``: the addresses the kernels read
        instead, contiguous ``copied`` stand-ins'), then record them for the next step's check. The record comes
        last: cut short before it (an exception, a Ctrl-C), the step leaves it at the last grads, and the next one
        finds these moved and uploads again."""
        if upload is None or upload is ptrs:
            self.tables.set_role("grad", ptrs, host, low_bits=low_bits)
        else:
            self.tables.set_role("grad", upload, low_bits=low_bits)
        self._copied = copied or []
        self._grads_read = not copied  # the table holds ``ptrs`` (`_grad_ptrs` reads them there)
        self._table_grads.copy_(host)

    def _unchanged(self) -> bool:
        """The common step: every grad present and where it was last step, every param where it was planned, no
        copies or lazy state pending. One native call (or, while it builds, two of torch's C++ calls and one C-level
        read of the grads); False sends the step through the full check."""
        if self._pending:
            return False
        same = self._native_check(grads=True)
        if same is not None:
            return same
        if _PTRS_EQUAL is None or self.shards is not None:
            return False
        grads = list(map(_GRAD, self.params))
        try:  # a grad that is None (or sparse, or without storage) raises: the full check sorts it out
            return (
                _PTRS_EQUAL(grads, self._grad_ptrs, self._every)  # type: ignore[misc]
                and self._layout_holds(grads)
                and (
                    self.params_checked
                    or _PTRS_EQUAL(self.params, self._param_ptrs, self._every)  # type: ignore[misc]
                    and self._layout_holds(self.params)
                )
            )
        except (TypeError, RuntimeError, ValueError, AttributeError):
            return False

    def _native_check(self, grads: bool) -> bool | None:
        """The native check of the params (and, with ``grads``, the grads; only the grads where `moved` found the
        params in place this step) against `_table`: through the local shards for FSDP2, params included; None
        where it cannot answer (switched off, not built, tensor subclasses)."""
        checks = _native.CHECKS
        if not self.native or checks is None or not self.checks_natively:
            return None
        if self.shards is not None:
            return checks.unchanged_local(self.params, self.shards, self._table, grads, self.dtype)
        what = self._grads_what if grads else _native.PARAMS
        return checks.unchanged(self.params, self._table, what, self.dtype)

    @property
    def _grads_what(self) -> int:
        """What a native check of the grads compares: the grads alone where `moved` found the params in place this
        step, else the params and their grads."""
        return _native.GRADS if self.params_checked else _native.PARAMS_AND_GRADS

    def _plain_checks(self) -> Any:
        """The compiled checks where this unit may read its tensors through them directly (built, `native_checks`
        on, plain tensors: no subclasses, no FSDP2 shards), else None."""
        return _native.CHECKS if self.native and self.plain_tensors else None

    def _prepare(self, state: Any, groups: Sequence[dict[str, Any]]) -> bool:
        self._unwatch()
        if not self._state_intact.ok:
            # a state tensor the tables point at was freed (state.clear(), del state[p], a tensor replaced): plan
            # again from the state as it is now, before a launch could write through a freed address
            self.stale = True
            return False
        self.unhandled = []
        grads: list[torch.Tensor | None] | None = None
        dead = 0
        # every grad present, dense, contiguous, of the unit's dtype and its param's shape: their addresses in one
        # native call, and nothing about the grads left to check below
        ptrs = self._native_grad_addresses()
        checked = ptrs is not None
        if ptrs is None:
            try:  # one C-level pass with no list of grads: every grad present and dense
                ptrs = self._addresses(map(_GRAD, self.params))
            except (TypeError, RuntimeError, AttributeError):  # a None grad (of a DTensor: AttributeError), or sparse
                grads = self._grads()
                ptrs = self._slow_ptrs(grads)
                dead = ptrs.count(DEAD)
        if not self.params_checked and (
            self._addresses(self.params) != self._param_ptrs or not self._layout_holds(self._locals(self.params))
        ):
            # p.data was replaced (model.half(), an EMA swap, a device move), or re-strided or resized where it sat
            # (p.data = p.data.t()): the param table would point at freed memory, or the plan at the wrong route,
            # and the grads may well sit at their old addresses, so this is checked every step
            self.stale = True
            return False
        sorted_out = grads is not None  # `_slow_ptrs` has sorted out the grads of another dtype
        changed = ptrs != self._grad_ptrs
        if not changed and not checked:  # where they sat, but re-strided, re-typed or resized there: a change too
            grads = self._grads() if grads is None else grads
            changed = not self._grads_hold(grads, ptrs)
        if changed:
            adopt = self.slots is not None and self.slots.grad_arena is not None
            if grads is None and (adopt or not checked):
                grads = self._grads()
            if not (sorted_out or checked) and set(map(_DTYPE, grads)) != {self.dtype}:  # fp32 grads of bf16 params
                ptrs = self._slow_ptrs(grads)
                dead = ptrs.count(DEAD)
            if not checked:
                self._check_sizes(grads, ptrs)
            if adopt:
                grads, ptrs = self._adopt_grads(grads, ptrs)
            upload = ptrs
            host = self._out() if checked and not adopt else int64_tensor(ptrs)  # the native read's, handed over
            copied: list[tuple[torch.Tensor, torch.Tensor]] = []
            if not checked and not self._grads_lie_in_order(grads, ptrs, dead):
                # the kernel addresses flat memory: give it copies laid out as their params (freeing them after the
                # launch is queued is stream-ordered, so safe) and do not cache, as the copies are new every step
                self._copies = [
                    g if a == DEAD or lies_in(g, code) else g.contiguous(memory_format=MEMORY_FORMATS[code])
                    for g, a, code in zip(grads, ptrs, self.layouts, strict=True)
                ]
                copied = [(g, c) for g, c in zip(grads, self._copies, strict=True) if c is not g]
                upload = [a if a == DEAD else c.data_ptr() for c, a in zip(self._copies, ptrs, strict=True)]
            self._point_grads(ptrs, host, upload, copied)
        if self.uninit:
            self._init_new(ptrs, state, groups)
        if self.static and not dead and not (self.sharded or self.static_off or self._copied or self.uninit):
            self._watch()
        self._grads_whole = not dead and not self.unhandled
        return dead < len(ptrs)

    def _native_grad_addresses(self) -> list[int] | None:
        """Every grad's address where each is present, dense, contiguous, of the unit's dtype and of its param's
        planned shape, read in one native call (`kitsune._native.follow`, left in `_out`); None where one is not,
        or where the call cannot answer (not built, switched off, FSDP2 shards, tensor subclasses): the caller's
        Python reads sort it out."""
        checks = self._plain_checks()
        if checks is None:
            return None
        out = self._out()
        return (
            out.tolist() if checks.follow(self.params, self._table, _native.GRADS, out, self.dtype) != OTHER else None
        )

    def _out(self) -> torch.Tensor:
        """Where the native read writes the grads' addresses: the grad table's staging tensor (page-locked on a GPU),
        the same until a step hands it to the table as the grads' record (`TensorTables.staging`)."""
        return self.tables.staging("grad")

    def _adopt_grads(
        self, grads: list[torch.Tensor | None], ptrs: list[int]
    ) -> tuple[list[torch.Tensor | None], list[int]]:
        """Flat grads: move each new dense grad into its arena slot (``p.grad`` becomes the view)."""
        slots = self.slots
        for i, g in enumerate(grads):
            if g is None or ptrs[i] == DEAD or g.layout != torch.strided or not slots.has_grad_room(i):
                continue
            if g.data_ptr() != slots.grad_view(i).data_ptr() or g.shape != slots.grad_view(i).shape:
                self.adopted.append((i, self.params[i].grad))
                grads[i] = slots.adopt_grad(i, g)
                ptrs[i] = grads[i].data_ptr()
                slots.adoptions += 1
        return grads, ptrs

    def private_steps(self) -> list[tuple[torch.Tensor, tuple[torch.Tensor, int]]]:
        """``(param, (counts, index))`` for each param whose step this unit counts privately (none where torch's
        state holds the step): what `carry_steps` takes."""
        steps = self._private_steps
        return [] if steps is None else [(p, (steps, i)) for i, p in enumerate(self.params)]

    def carry_steps(self, old: dict[torch.Tensor, tuple[torch.Tensor, int]]) -> None:
        """A new plan's unit: the private step count (`_private_steps`) of each param that keeps its state, as the
        old plan's unit left it (``old``: param -> that unit's counts and the param's index there), so a plan made
        again mid-run (a group added, ``optimizer.state[p]`` read for a param without state) goes on counting where
        it stood: the count is the stochastic rounding's stream, which must not start again. A param whose state
        went starts from its first step, as its state does."""
        if self._private_steps is None or not old:
            return
        uninit = set(self.uninit)  # a set: a unit of thousands of params, none with state yet, is met here
        found = [(i, old[p]) for i, p in enumerate(self.params) if i not in uninit and p in old]
        if not found:
            return
        with torch.no_grad():
            index = torch.tensor([i for i, _ in found], device=self.device)
            counts = torch.stack([t[j].to(self.device) for _, (t, j) in found])
            # at least the 1 of state that exists: state loaded or made since (by the wrapped optimizer's step) over
            # a count of 0 is not at its first step
            self._private_steps.index_copy_(0, index, torch.maximum(counts, self._private_steps[index]))

    def keep(self) -> None:
        """The step went through: the grads it moved into the arena stay (the tensors they replaced are let go)."""
        self.adopted = []

    def return_grads(self) -> None:
        """A step that raised after `prepare`: each grad it moved into the arena goes back to its param (the tensor
        the param held, its values untouched), as a step of torch's that raises leaves ``p.grad``; the next step
        moves it again."""
        for i, g in self.adopted:
            self.params[i].grad = g
            self.slots.adoptions -= 1
        self.adopted = []

    def _layout_holds(self, tensors: list[torch.Tensor]) -> bool:
        """Whether ``tensors`` (plain tensors or local shards, one per param, none None) are what the kernels read
        besides their addresses: in the planned order (`layouts`), of the unit's dtype, of the planned shapes (a
        param reshaped where it sat, ``p.data = p.data.view(...)``, no longer fits its state). C-level maps."""
        return (
            (all(map(_IS_CONTIGUOUS, tensors)) if self._row_major else all(map(lies_in, tensors, self.layouts)))
            and set(map(_DTYPE, tensors)) == {self.dtype}
            and list(map(_SHAPE, tensors)) == self.shapes
        )

    def _grads_hold(self, grads: list[torch.Tensor | None], ptrs: list[int]) -> bool:
        """`_layout_holds` for the grads the kernels read (those not `DEAD` in ``ptrs``)."""
        if DEAD not in ptrs:
            return self._layout_holds(grads)  # type: ignore[arg-type]
        return all(
            lies_in(g, code) and g.dtype == self.dtype and g.shape == shape
            for g, a, shape, code in zip(grads, ptrs, self.shapes, self.layouts, strict=True)
            if a != DEAD and g is not None
        )

    def _grads_lie_in_order(self, grads: list[torch.Tensor | None], ptrs: list[int], dead: int) -> bool:
        """Whether every grad the kernels read (dense ones, where some are `DEAD`) lies in its param's order."""
        if self._row_major:
            return all(
                map(
                    _IS_CONTIGUOUS, [g for g in grads if g is not None and g.layout == torch.strided] if dead else grads
                )
            )
        return all(
            lies_in(g, code)
            for g, a, code in zip(grads, ptrs, self.layouts, strict=True)
            if not (dead and (a == DEAD or g is None or g.layout != torch.strided))
        )

    def _locals(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors``, or their local shards in a sharded unit."""
        return list(map(fsdp.LOCAL, tensors)) if self.sharded else tensors

    def _check_sizes(self, grads: list[torch.Tensor | None], ptrs: list[int]) -> None:
        """Raise, before anything changes, where a grad the kernels would read has another shape than its param (the
        kernels read and write a param's numel of it, element for element): ``p.data`` resized after backward, a
        grad set by hand (one of the same numel but another shape too: torch's step raises on it)."""
        if not ptrs.count(DEAD) and list(map(_SHAPE, grads)) == self.shapes:  # type: ignore[arg-type]
            return
        for i, (g, a) in enumerate(zip(grads, ptrs, strict=True)):
            if a != DEAD and g is not None and g.shape != self.shapes[i]:
                p = fsdp.local(self.params[i])
                raise ValueError(
                    f"kitsune: a param of shape {tuple(p.shape)} (in param group {self.group_index[i]}) has a grad "
                    f"of shape {tuple(g.shape)}: a grad must have its param's shape, as in torch.optim. Was "
                    "p.data resized after backward? Set p.grad = None (or to a grad of the param's shape) before "
                    "the step. Nothing was updated."
                )

    def _addresses(self, tensors: Any) -> list[int]:
        """The data pointers of ``tensors`` (an iterable), of their local shards in a sharded unit: C-level maps."""
        return list(map(_DATA_PTR, map(fsdp.LOCAL, tensors) if self.sharded else tensors))

    def _grads(self) -> list[torch.Tensor | None]:
        grads = list(map(_GRAD, self.params))
        return [None if g is None else g._local_tensor for g in grads] if self.sharded else grads

    def copy_back(self, zeroed: bool) -> None:
        """After a launch that wrote the grads (unscaled or clipped; ``zeroed``: zeroed): write what it wrote into
        contiguous stand-ins into the non-contiguous grads they stand for, with autograd off as an optimizer's step
        writes (a grad that is a view of a leaf that requires grad takes it). Zeroed grads are zeroed in place,
        which a grad whose elements share memory takes too (``zero_grad(set_to_none=False)`` does the same)."""
        with torch.no_grad():
            for grad, copy in self._copied:
                if zeroed:
                    grad.zero_()
                else:
                    grad.copy_(copy)

    def _slow_ptrs(self, grads: list[torch.Tensor | None]) -> list[int]:
        if {self.dtype, None} >= {None if g is None else g.dtype for g in grads}:
            try:  # grads that are None on this step (frozen for a while, or unused this step)
                return [DEAD if g is None else g.data_ptr() for g in grads]
            except RuntimeError:  # and some without storage
                pass
        ptrs = []
        for p, g in zip(self.params, grads, strict=True):
            if g is None:
                ptrs.append(DEAD)
            elif g.layout != torch.strided or g.dtype != self.dtype:
                # sparse, or of another dtype than its param (the kernel reads a grad as its param's dtype): the
                # wrapped optimizer's own step must take it, as it would without kitsune
                ptrs.append(DEAD)
                self.unhandled.append(p)
            else:
                ptrs.append(g.data_ptr())
        return ptrs

    def _init_new(self, ptrs: list[int], state: Any, groups: Sequence[dict[str, Any]]) -> None:
        fresh = [i for i in self.uninit if ptrs[i] != DEAD]
        if not fresh:
            self.created = []
            return
        # state made since the plan by another hand (the wrapped optimizer's own step for a grad the kernel could
        # not take, or a warm start set by hand) is kept, as torch's step keeps it; a private step count then says
        # its buffer is not new (the kernel starts a count of 0 from the grad)
        made = [i for i in fresh if _has_state(state, self.params[i], self.info, self.spec)]
        if self._private_steps is not None:
            # the optimizer's own state, made or loaded without what kitsune keeps beside it (its init adds that)
            carried = [i for i in fresh if _has_state(state, self.params[i], self.info, self.spec, extra=False)]
            if carried:
                self._private_steps[carried] = 1.0
        fresh = [i for i in fresh if i not in made]
        self.created = created = [self.params[i] for i in fresh]
        before = {id(p): dict(state[p]) for p in created if p in state}  # entries of its own a dict may hold
        try:
            for i in fresh:
                p = self.params[i]
                alloc = self.slots.alloc(i) if self.slots is not None else None
                group = groups[self.group_index[i]]
                init_state(self.info, self.spec, group, p, state.setdefault(p, {}), alloc, self.defaults)
            self.bind(state)
        except BaseException:  # (out of memory): the state goes as it came, and the params stay to be made
            for p in created:
                if id(p) in before:
                    state[p].clear()
                    state[p].update(before[id(p)])
                else:
                    state.pop(p, None)
            self.created = []
            raise
        self.uninit = [i for i in self.uninit if ptrs[i] == DEAD]

    # -- binding to torch's state tensors ------------------------------------------------------------------------
    def bind(self, state: Any) -> None:
        """(Re)build the state and step tables from ``state`` (after a plan, a load_state_dict, or lazy init).

        The unit then holds weak references to the state tensors it bound and to their storages: one freed
        (``optimizer.state.clear()``, ``del optimizer.state[p]``, ``state[p]["exp_avg"] = new``, ``t.data = new``)
        marks the unit stale, and the next step plans again from the state as it is then (as torch reads its state
        every step), instead of writing through the freed tensor's address."""
        keys = self.info.state_keys(self.spec)
        scalars = self.info.scalars
        fmt = self.spec.state
        low = fmt != StateFormat.PARAM
        tables: list[list[int]] = [[] for _ in keys]
        absmax: list[list[int]] = [[] for _ in keys]  # 8-bit state: each slot's absmax blocks
        scalar_tables: list[list[int]] = [[] for _ in scalars]  # step, then scalar1, scalar2
        bound: list[torch.Tensor] = []
        ready_dicts: list[tuple[torch.Tensor, dict]] = []
        slots = self.slots
        for i, p in enumerate(self.params):
            s = state.get(p)
            ready = s is not None and _has_state(state, p, self.info, self.spec)
            if ready:
                ready_dicts.append((p, s))
            for slot, key in enumerate(keys):
                if ready and key and low:  # converted in place from whatever format it was loaded in
                    held = state_format.conform(s, key, p, fmt)
                    if slots is not None:  # then into the pool's views
                        names = [name for name, _, _ in state_format.entries(key, fmt, p)]
                        held = [slots.adopt(s, i, name) for name in names]
                    bound += held
                    tables[slot].append(fsdp.local(held[0]).data_ptr())  # FSDP2: the local shard (of the codes)
                    absmax[slot].append(held[-1].data_ptr())
                elif ready and key and slots is not None:  # the pool's view, with a loaded tensor copied in
                    _conform(s, key, p, self.info.one_dtype_for(self.spec))
                    bound.append(slots.adopt(s, i, key))
                    tables[slot].append(bound[-1].data_ptr())
                elif ready and key:
                    bound.append(_conform(s, key, p, self.info.one_dtype_for(self.spec)))
                    tables[slot].append(fsdp.local(bound[-1]).data_ptr())
                else:
                    tables[slot].append(0)
                    absmax[slot].append(0)
            for slot, key in enumerate(scalars):
                if ready and slots is not None:
                    _conform_scalar(s, key, p)
                    bound.append(slots.adopt(s, i, key))
                    scalar_tables[slot].append(bound[-1].data_ptr())
                elif ready:
                    bound.append(_conform_scalar(s, key, p))
                    scalar_tables[slot].append(bound[-1].data_ptr())
                else:
                    scalar_tables[slot].append(0)
        for key in extra_keys(self.spec):  # the Kahan compensation: the param's dtype and shape
            comp = []
            for i, p in enumerate(self.params):
                s = state.get(p)
                if s is None or not _has_state(state, p, self.info, self.spec):
                    comp.append(0)
                    continue
                t = _conform(s, key, p)
                if slots is not None:
                    t = slots.adopt(s, i, key)
                bound.append(t)
                comp.append(fsdp.local(t).data_ptr())
            self.tables.set_role("comp", comp)
        intact = _Intact()
        # the tensors, and their storages: a storage swapped under a tensor that lives on (``t.data = ...``, as the
        # ``optimizer_to(device)`` snippets do) frees the storage the tables point at, where nothing else holds it
        # (a pooled view's storage is the arena, which the pool holds: the kernels write there, never freed memory)
        self._state_refs = [weakref.ref(t, intact) for t in bound]
        self._state_refs += [weakref.ref(fsdp.local(t).untyped_storage(), intact) for t in bound]
        self._state_intact = intact
        # and what the dicts hold, for a tensor or a dict replaced while other code keeps the old one alive: ids, as
        # nothing here may keep a tensor alive (a bound one lives while its weak reference does, so its id is its own)
        self.held = [
            (p, len(s), [(k, id(v)) for k, v in s.items() if isinstance(v, torch.Tensor)]) for p, s in ready_dicts
        ]
        self.binding = next(_BINDINGS)
        for slot, addrs in enumerate(tables, 1):
            self.tables.set_role(f"state{slot}", addrs)
        if fmt == StateFormat.Q8:
            for slot, addrs in enumerate(absmax, 1):
                self.tables.set_role(f"absmax{slot}", addrs)
        roles = ["step"] * self.info.step_in_state + [f"scalar{j}" for j in range(1, len(self.info.scalar_keys) + 1)]
        for role, addrs in zip(roles, scalar_tables, strict=True):
            self.tables.set_role(role, addrs)
        if self._private_steps is not None:
            base = self._private_steps.data_ptr()
            self.tables.set_role("step", [base + 4 * i for i in range(len(self.params))])


_BINDINGS = itertools.count(1)
"""Numbers each `FusedUnit.bind`, for `kitsune.fusion.state_watch.StateWatch` to see a new one."""

_QUICK_BREAKS = 3
"""A static unit whose watch breaks before its first use this many times in a row stops watching."""


class _Intact:
    """The weak references' callback: any watched tensor or storage freed clears ``ok``."""

    __slots__ = ("ok",)

    def __init__(self) -> None:
        self.ok = True

    def __call__(self, _ref: weakref.ref) -> None:
        self.ok = False


def _has_state(state: Any, p: torch.Tensor, info: AlgoInfo, spec: UpdateSpec, extra: bool = True) -> bool:
    """Whether ``p`` has all the state its step reads; ``extra=False``: the optimizer's own, whatever kitsune keeps
    beyond it (`extra_keys`). A buffer of the optimizer's own is not new where only the extra state is missing (a
    torch checkpoint has no Kahan compensation): SGD's private step count says so."""
    keys = extra_keys(spec) if extra else ()
    if not info.step_in_state and not any(info.state_keys(spec)) and not keys:
        return True  # nothing to keep (SGD without momentum: torch stores no state for it either)
    s = state.get(p)
    if not s:
        return False
    if info.step_in_state and "step" not in s:
        return False
    if any(k not in s for k in keys):
        return False  # a checkpoint without the compensation: created (as zeros) with the step's lazy init
    return all(state_format.present(s, k) for k in (*info.state_keys(spec), *info.scalar_keys) if k)


def _conform(s: dict, key: str, p: torch.Tensor, one_dtype: bool = False) -> torch.Tensor:
    """The state tensor the kernel can address: the param's dtype, device, shape and a dense layout.

    torch's own load_state_dict already casts to the param's dtype and device; a state tensor that still differs
    (set by hand, or a non-contiguous one) is replaced by a conforming copy, and one held in 8 bits (a checkpoint of
    an 8-bit run) is decoded first. ``one_dtype`` (an algorithm whose plain step lerps the grad into state made like
    the param, `AlgoInfo.one_dtype`): state of a wider float dtype than its param's (``model.half()`` after the
    state was made) is refused (`kitsune.optim.base.refuse_narrowing`), as that step refuses it, rather than rounded;
    SGD's, Adagrad's, RMSprop's and LARS's plain steps carry on with such state, so the planner leaves those params
    to the wrapped step (no unit casts it).
    """
    state_format.decode(s, key, p)
    t = s[key]
    if fsdp.is_dtensor(p):  # FSDP2: the state is a DTensor sharded as its param, as torch's optimizers keep it
        t = s[key] = fsdp.like_param(t, p)
    if t.shape != p.shape:
        raise ValueError(
            f"optimizer state {key!r} has shape {tuple(t.shape)}, its param {tuple(p.shape)}: the param was resized "
            "after its state was made (p.data = a tensor of another shape?), or state of another param was set for "
            "it. Give the param back its shape, or drop its state (del optimizer.state[p]) to start it afresh. "
            "Nothing was updated"
        )
    if one_dtype:
        refuse_narrowing(key, t, p)
    t = s[key] = state_format.dense(t, p, fsdp.local(p).device, p.dtype)
    return t


def _conform_scalar(s: dict, key: str, p: torch.Tensor) -> torch.Tensor:
    """``step`` (or another per-tensor scalar: NAdam's ``mu_product``, ASGD's ``eta``, ``mu``) as a float32 scalar on
    the param's device, as torch's fused and capturable paths keep it."""
    t = s[key]
    if not isinstance(t, torch.Tensor):  # checkpoints from torch < 1.12 stored a number
        t = s[key] = torch.tensor(float(t), device=p.device)
    if t.dtype != torch.float32 or t.device != p.device:
        t = s[key] = t.to(device=p.device, dtype=torch.float32)
    return t
