"""Sharded optimizer state for a replicated model: ZeRO stages 1 and 2 on torch.distributed's collectives.

Every rank holds the whole model, not wrapped in DDP: this subsystem averages the grads itself. The trainable params
are cut into buckets (below); a bucket is one flat buffer of ``world`` equal segments, and rank r keeps the optimizer
state of the elements in segment r, updates them, and hands them to the other ranks. The partition is by elements,
so each rank holds ``1/world`` of the state to within a few 128-byte slots per bucket, however large the largest
param (GPT-2's embedding is 31% of the model); a param may span two or more segments.

A rank's share goes through the normal step:

* a param that lies wholly in this rank's segment is updated as itself;
* a param this rank holds part of is replaced, in the wrapped optimizer's param groups, by a *shard param*: a 1-D
  ``nn.Parameter`` viewing this rank's elements of the model param (the same memory: the update writes the model
  param in place) whose grad is the matching slice of the reduced grads. The fused kernels, or the wrapped
  optimizer's own step, update it as any param, and its state is created at its size;
* a param with none of its elements here stays in the groups with no grad during the step, so nothing updates it
  or creates its state.

Math that needs the whole tensor (LAMB's and LARS's trust ratios, Muon's orthogonalisation, an optimizer kitsune
does not know to be elementwise) cannot be cut by elements: `whole_reason`, the one place that decides, keeps those
params whole, as it does a non-contiguous param. They go into buckets of their own, whose params are dealt whole to
the ranks: largest first, each to the rank with the fewest elements in the bucket (ties: the fewest overall), each
segment padded to the longest. The report counts them under ``whole_params``, by reason. ZeRO over
``kitsune.optim.Muon`` is distributed Muon with sharded momentum: each rank orthogonalises the matrices it owns,
and the ``use_muon=False`` (AdamW) groups are cut by elements.

Buckets. Trainable params are cut, in reverse registration order (the order backward finishes grads), into buckets
of one (device, dtype, whole or not) and about ``bucket_bytes``. Every param's slot and every segment start on a
128-byte boundary (vectorised loads in the fused kernels), so shard params are aligned as well::

    stage 1: grads -> flat, / world, all_reduce       every param's grad becomes a view of the flat buffer
             (the elements that hold params: not the padding of short segments)
    stage 2: grads -> flat, / world, reduce_scatter   this rank's segment of the reduced grads (a flat shard);
                                                      every local grad is freed as soon as it is in the bucket
    step():  the grads of what this rank updates point into the flat buffer (stage 1) or the shard (stage 2),
             every other grad is None
    after the update: this rank's elements -> its segment, all_gather -> copied into the others' elements

Grads that are None. A param with no grad on a rank counts as zeros in the average (as DDP's
``find_unused_parameters`` does). It is updated where any rank had a grad for it, and skipped, as torch skips it,
where none had: one small all-reduce per backward counts the ranks with a grad for each param, read back to the
host (a sync) only on a rank that had no grad for a param it updates.

Overlap. A post-accumulate-grad hook counts each bucket's grads; when a bucket is complete (and every bucket
before it has started: all ranks must issue collectives in one order) its collective starts asynchronously while
backward goes on. A callback at the end of backward starts the rest and waits for all of them, so after
``loss.backward()`` stage 1's grads are averaged, as DDP's are; stage 2's are None until ``step()`` points them at
the shard. With ``overlap=False``, or for backward passes inside ``optimizer.accumulating()``, the grads are
reduced at the start of ``step()`` instead.

The global grad norm (``max_grad_norm``) and AMP's inf/nan flag are computed over this rank's grads (its elements,
each counted once) and combined with one on-device all-reduce (``StepState.reduce``), so no rank reads a value back
to the host.

Checkpoints. A rank's ``state_dict()`` is torch's layout holding this rank's state (a shard param's state tensors
are its flat pieces); its ``"kitsune"`` entry records this rank's element range of every param, and it loads back
into the same rank of the same layout only. [`consolidated_state_dict`][kitsune.distributed.consolidated_state_dict]
joins the pieces into whole-param tensors: torch's layout, which the plain torch optimizer loads, and so does a
sharded run on any number of ranks (each rank keeps its own elements, `ShardSubsystem.filter_load`).
"""

from __future__ import annotations

import weakref
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.modules.module import register_module_forward_pre_hook

from kitsune._untraced import never_traced
from kitsune.config import ShardConfig
from kitsune.distributed import fsdp
from kitsune.distributed.layout import NOT_CONTIGUOUS, Bucket, partition, whole_reason
from kitsune.distributed.reduce import GradReduction, all_gather
from kitsune.distributed.shard_state import check_sizes, join_pieces, placed, slice_state, to_cpu, whole_format
from kitsune.subsystem import Accumulation, StepState, Subsystem

GATHERS_IN_FLIGHT = 2
"""Param all-gathers running at once after the update: each holds a bucket-sized buffer."""


class ShardSubsystem(Subsystem):
    """ZeRO stages 1 and 2 for a replicated model; see the module docstring."""

    name = "shard"

    def __init__(self, config: ShardConfig, accumulation: Accumulation | None = None) -> None:
        super().__init__()
        self.config = config
        self._accumulating = accumulation if accumulation is not None else Accumulation()
        """Set inside ``optimizer.accumulating()``: backward passes there leave their grads unreduced."""
        self.remote: frozenset[torch.Tensor] = frozenset()
        """Params in the groups none of whose elements this rank updates (the fusion planner leaves them out; the
        all-gather writes them)."""
        self.executes = False
        """Whether it changes params in the step (the all-gather): the orchestrator then runs closures first."""
        self.group: Any = None
        self.world = 1
        self.rank = 0
        self.buckets: list[Bucket] = []
        self._base: torch.optim.Optimizer | None = None
        self._params: list[torch.Tensor] = []
        """The model's params, in the groups' order: position k is torch's state dict index k."""
        self._ranges: list[tuple[int, int]] = []
        """This rank's elements ``[lo, hi)`` of each of ``_params`` (a frozen param: all of them)."""
        self._model_of: dict[int, torch.Tensor] = {}
        """id(shard param) -> the model param it views."""
        self._shards: list[tuple[torch.Tensor, torch.Tensor, int, int, int]] = []
        """(model param, shard param, lo, hi, the model param's data_ptr when viewed): followed when it moves."""
        self._mine: list[torch.Tensor] = []
        self._reasons: tuple[str | None, ...] = ()
        self._whole: Counter[str] = Counter()
        self._key: tuple | None = None
        self._hooks: list[Any] = []
        self._broadcast = False
        self._reduction = GradReduction(config, self._accumulating)
        """Averages the buckets' grads across the ranks (from backward, or at the step)."""
        self._norm_type = 2.0
        self._last = {"buckets_reduced_in_backward": 0, "buckets_reduced_in_step": 0}
        self._pending: dict[int, _Gather] = {}
        """``gather_in_forward``: id(model param) -> its bucket's all-gather, launched and not yet copied in."""
        self._forward_hook: Any = None
        self._frozen: list[torch.Tensor] = []
        """The params frozen (``requires_grad=False``) when the state was partitioned: kept whole, in no bucket. One
        that requires grad again needs a bucket, or each rank would update it with its own grad (`fits`)."""
        self._read_before_gather = False
        """A backward since the last ``zero_grad()`` gave a grad to a param whose all-gather was pending: its forward
        read the values from before the last update."""
        self._swapped: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        """The grads the step's `begin` replaced, each with the one it found: put back when the step raises."""
        self.deactivate("zero_stage=0")

    @property
    def params(self) -> list[torch.Tensor]:
        """The model's params in the groups' order, as planned: position k is torch's state dict index k."""
        return self._params

    # -- planning ------------------------------------------------------------------------------------------------
    def plan(
        self,
        groups: list[dict[str, Any]],
        base: torch.optim.Optimizer,
        norm_type: float,
        clips: bool = False,
        scales_loss: bool = False,
    ) -> None:
        """Partition the trainable params of ``groups`` (the wrapped optimizer ``base``'s) over the ranks, and put
        the shard params in the groups in place of the params this rank updates part of. ``clips`` and
        ``scales_loss``: whether the step clips (an all-reduce of the norm) and checks float16 overflows (an
        all-reduce of the flag), which every rank must agree on."""
        self.wait_params()  # a re-plan reads and re-cuts the params
        cfg = self.config
        if not cfg.stage:
            self._drop("zero_stage=0")  # as the other switches read: enable_amp=False, profile=False
            return
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                f"ShardConfig(stage={cfg.stage}) shards the optimizer state over torch.distributed's ranks, but no "
                "process group is initialised: call torch.distributed.init_process_group() before building the "
                "KitsuneOptimizer (or use zero_stage=0)"
            )
        if isinstance(base, torch.optim.LBFGS):
            raise ValueError(
                f"LBFGS under ShardConfig(stage={cfg.stage}): its line search evaluates the closure inside its own "
                "step, over whole params, and holds its history as one flat vector: there is no state to shard per "
                "element. Use zero_stage=0 (under DDP every rank runs the same LBFGS step)"
            )
        if getattr(base, "process_group", None) is not None:
            raise ValueError(
                "distributed Muon (process_group=...) under ShardConfig(stage>0): sharded state already gives each "
                "rank whole matrices to orthogonalise; drop Muon's process_group"
            )
        if any(fsdp.is_dtensor(p) for g in groups for p in g["params"]):
            raise ValueError(
                f"ShardConfig(stage={cfg.stage}) over FSDP2 (DTensor) params: FSDP2 already shards the params, the "
                "grads and so the optimizer state over the ranks (each rank's state covers its own shards). Use "
                "zero_stage=0 with fully_shard; ZeRO is for models that every rank holds whole (plain or DDP-free)"
            )
        self.group = cfg.process_group
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if self.world == 1:
            self._drop("world size 1: one rank holds all of the state, nothing to shard")
            return
        params = [self._model_of.get(id(p), p) for g in groups for p in g["params"]]
        signature = [(tuple(p.shape), str(p.dtype), p.device.type, p.requires_grad) for p in params]
        reasons = tuple(whole_reason(base, g) for g in groups)
        # what decides the buckets and the collectives: a rank that differs would run collectives of other sizes
        setup = {
            "stage": cfg.stage,
            "bucket_bytes": cfg.bucket_bytes,
            "overlap": cfg.overlap,
            "gather_in_forward": cfg.gather_in_forward,
            "norm_type": norm_type,
            "max_grad_norm set": clips,
            "float16 loss scaling": scales_loss,
            "whole params (per group)": reasons,
        }
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, (signature, setup), group=self.group)
        if any(s != signature for s, _ in everyone):
            bad = next(r for r, (s, _) in enumerate(everyone) if s != signature)
            raise ValueError(
                f"rank {bad}'s optimizer holds other params than rank {self.rank}'s (shapes, dtypes, requires_grad, "
                "in param group order): every rank must build the same model and param groups"
            )
        for r, (_, theirs) in enumerate(everyone):
            differ = [f"{k}={theirs[k]!r} on rank {r}, {v!r} here" for k, v in setup.items() if theirs[k] != v]
            if differ:
                raise ValueError(
                    f"rank {r}'s ShardConfig or optimizer differs from rank {self.rank}'s: {'; '.join(differ)}. Every "
                    "rank must build the KitsuneOptimizer with the same settings (they decide the buckets and the "
                    "collectives each rank runs)"
                )
        trainable = [p for p in params if p.requires_grad]
        frozen = [p for p in params if not p.requires_grad]
        if not trainable:
            self._drop("no param requires grad: nothing to update", base)
            self._frozen = frozen  # unfrozen later: partitioned then
            return
        self._frozen = frozen
        self._norm_type = norm_type
        key = (self.world, self.rank, cfg.bucket_bytes, tuple(map(id, params)), tuple(signature), reasons)
        # a re-plan that changed nothing keeps the buffers (and grads already reduced), unless a bucket met a param
        # cast since and left it unreduced (cast back before the step: the same key)
        if key != self._key or self._reduction.stale:
            whole_of: dict[int, str] = {}
            for g, why in zip(groups, reasons, strict=True):
                for p in g["params"]:
                    p = self._model_of.get(id(p), p)
                    if why or not p.is_contiguous():
                        whole_of[id(p)] = why or NOT_CONTIGUOUS
            self._repartition(base, params, trainable[::-1], whole_of)  # backward finishes the last layers first
            self._key, self._reasons = key, reasons
        self._base = base
        if not self._broadcast:  # every replica starts from rank 0's params, as DDP makes them
            self._broadcast_params(params)
            self._broadcast = True
        self._hook_params(trainable)
        self.executes = True
        self.activate()

    def _repartition(
        self,
        base: torch.optim.Optimizer,
        params: list[torch.Tensor],
        order: list[torch.Tensor],
        whole_of: dict[int, str],
    ) -> None:
        """Lay ``order`` out anew and move the state there: taken from the groups as torch keeps it on the first
        plan, gathered from every rank's pieces (a collective) when a layout existed already."""
        # the old layout's reduced grads back in the params first: taken out of the groups, the state would be lost
        # if that raised
        self._reduction.restore_grads()
        full = self._state_by_index(base, params, gather=self._key is not None)
        self._swap(base, self._model_of)  # the model params back in the groups, then the new shard params
        layouts = partition(order, self.world, self.config.bucket_bytes, [id(p) in whole_of for p in order])
        self.buckets = [Bucket([order[i] for i in L.indices], L, self.rank, self.world) for L in layouts]
        self._model_of, self._shards, self._mine = {}, [], []
        range_of: dict[int, tuple[int, int]] = {}
        remote = []
        for b in self.buckets:
            for k, p in enumerate(b.params):
                range_of[id(p)] = lo, hi = b.ranges[k]
                if not b.layout.updates(k, self.rank):
                    remote.append(p)
                elif lo == 0 and hi == p.numel():
                    b.targets[k] = p
                else:  # a view of this rank's elements: the update writes the model param
                    shard = torch.nn.Parameter(p.detach().view(-1)[lo:hi], requires_grad=True)
                    b.targets[k] = shard
                    self._model_of[id(shard)] = p
                    self._shards.append((p, shard, lo, hi, p.data_ptr()))
            self._mine += b.targets.values()
        self._params = params
        self._ranges = [range_of.get(id(p), (0, p.numel())) for p in params]
        self.remote = frozenset(remote)
        self._whole = Counter(whole_of[id(p)] for p in order if id(p) in whole_of)
        self._swap(base, {id(p): s for s in self._mine if (p := self._model_of.get(id(s))) is not None})
        self._place(base, full)
        self._reduction.bind(self.buckets, self.group, self.world, self.rank, order[0].device)

    def _state_by_index(
        self, base: torch.optim.Optimizer, params: list[torch.Tensor], gather: bool
    ) -> dict[int, dict[str, Any]]:
        """The state of every trainable param as whole tensors, by index in ``params``, taken out of ``base.state``
        (frozen params keep theirs). ``gather``: from every rank's pieces under the current layout (a collective);
        else each rank's own state, which must be whole (torch's, loaded before the first plan)."""
        index = {id(p): i for i, p in enumerate(params)}
        if not gather:
            out = {}
            for i, p in enumerate(params):
                if p.requires_grad and base.state.get(p):
                    check_sizes(base.state[p], i, p.numel(), p)
                    out[i] = whole_format(base.state[p])
            for i in out:
                del base.state[params[i]]
            return out
        local = {}
        for b in self.buckets:
            for k, t in b.targets.items():
                p = b.params[k]
                if id(p) in index and base.state.get(t):
                    local[index[id(p)]] = (*b.ranges[k], to_cpu(whole_format(base.state[t])))
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, local, group=self.group)
        full = join_pieces(parts, params)
        for b in self.buckets:
            for t in b.targets.values():
                base.state.pop(t, None)
        return full

    def _place(self, base: torch.optim.Optimizer, full: dict[int, dict[str, Any]]) -> None:
        """Give what this rank updates its part of ``full`` (whole states by index), as torch's load_state_dict
        places state: floating tensors in the param's dtype and device, ``step`` where the group keeps it."""
        target_of = {id(self._model_of.get(id(t), t)): t for t in self._mine}
        group_of = {id(p): g for g in base.param_groups for p in g["params"]}
        for i, st in full.items():
            t = target_of.get(id(self._params[i]))
            if t is None:
                continue  # another rank's
            lo, hi = self._ranges[i]
            piece = slice_state(st, lo, hi) if t is not self._params[i] else st
            base.state[t] = {name: placed(v, name, t, group_of[id(t)]) for name, v in piece.items()}

    @staticmethod
    def _swap(base: torch.optim.Optimizer, mapping: dict[int, torch.Tensor]) -> None:
        for g in base.param_groups:
            ps = g["params"]
            for j, p in enumerate(ps):
                q = mapping.get(id(p))
                if q is not None:
                    ps[j] = q

    def _drop(self, reason: str, base: torch.optim.Optimizer | None = None) -> None:
        self.wait_params()
        self._unhook()
        if base is not None and self._key is not None:  # every param whole again, on every rank
            full = self._state_by_index(base, self._params, gather=True)
            self._swap(base, dict(self._model_of))
            self._mine, self._model_of = list(self._params), {}
            self._ranges = [(0, p.numel()) for p in self._params]
            self._place(base, full)
        self.remote, self.buckets, self._mine, self._shards, self._key = frozenset(), [], [], [], None
        self._frozen = []
        self._reduction.bind([], self.group, self.world, self.rank, torch.device("cpu"))
        self._model_of = {}
        self.executes = False
        self.deactivate(reason)

    def _hook_params(self, params: list[torch.Tensor]) -> None:
        self._unhook()
        index = {id(p): (bi, k) for bi, b in enumerate(self.buckets) for k, p in enumerate(b.params)}
        ref = weakref.ref(self)  # the params must not keep a dropped optimizer alive
        for p in params:
            self._hooks.append(p.register_post_accumulate_grad_hook(_ready_hook(ref, *index[id(p)])))
        weakref.finalize(self, _remove, self._hooks)

    def _unhook(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    @torch.no_grad()
    def _broadcast_params(self, params: list[torch.Tensor]) -> None:
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        by_kind: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        for p in params:
            by_kind[(p.device, p.dtype)].append(p)
        for ps in by_kind.values():
            flat = torch.cat([p.detach().reshape(-1) for p in ps])
            dist.broadcast(flat, src=src, group=self.group)
            torch._foreach_copy_(
                [p.detach() for p in ps],
                [f.view(p.shape) for f, p in zip(flat.split([p.numel() for p in ps]), ps, strict=True)],
            )

    def fits(self) -> bool:
        """Whether the partition still holds for what requires grad and the params' dtypes: False once a param frozen
        when it was made requires grad again (every rank unfreezes it, and every rank then plans again at its step),
        or a bucket's params are of another dtype (``model.half()``: its first param, or any a reduction met)."""
        if self._reduction.stale or any(b.params[0].dtype != b.dtype for b in self.buckets):
            return False
        return not any(p.requires_grad for p in self._frozen)

    # -- inside backward -------------------------------------------------------------------------------------------
    def grad_ready(self, bi: int, k: int) -> None:
        """Param ``k`` of bucket ``bi`` has its grad of this backward (its post-accumulate-grad hook)."""
        if self._pending and id(self.buckets[bi].params[k]) in self._pending:
            self._read_before_gather = True
        self._reduction.grad_ready(bi, k)

    # -- the step --------------------------------------------------------------------------------------------------
    def begin(self, s: StepState) -> None:
        """The step's first stage: every grad reduced across the ranks (those a backward did not reduce yet), the
        grads of what this rank updates pointing at its share, the others None; ``s.reduce`` combines norms and
        flags. Raises before anything changes when a group's partition no longer holds."""
        self._accumulating.refuse_step()
        self.wait_params()  # params no forward reached since the last step (gather_in_forward)
        if self._read_before_gather:
            raise RuntimeError(
                "a forward read params whose all-gather from the last step was still pending, so their grads are of "
                "the values before that update: ShardConfig(gather_in_forward=True) completes a module's gathers in "
                "its forward pre-hook, which this forward did not run (a model under torch.compile, which does not "
                "call module hooks registered after it compiled, or a param read by a module that does not own it "
                "before its owner's forward). Nothing was updated; the params now hold every rank's update. Set "
                "gather_in_forward=False (the step then completes the gathers), or call optimizer.wait_params() "
                "before such a forward; then zero_grad() and run the forward and backward again"
            )
        self._check_groups()
        self._follow_storage()
        if not self._reduction.reduced:  # no backward reduced the grads
            self._reduction.reduce_all()
        present = self._reduction.presence()
        at, stage1 = 0, self.config.stage == 1
        swapped = self._swapped = []  # what a refused step gives back (`abandon`), each grad before it is set
        for b in self.buckets:
            for k, t in b.targets.items():
                g = b.grads[k] if present[at + k] else None
                if t.grad is not g:
                    swapped.append((t, t.grad))
                    t.grad = g
            if stage1:  # elements other ranks update: their grads must not reach this rank's update
                for k in b.others:
                    p = b.params[k]
                    if p.grad is not None:
                        swapped.append((p, p.grad))
                        p.grad = None
            at += len(b.params)
        s.reduce = self.reduce_norm

    def abandon(self) -> None:
        """The step raised: every grad `begin` pointed at this rank's share is the one it found again (the reduced
        grads stay reduced: a retry does not reduce them twice)."""
        swapped, self._swapped = self._swapped, []
        for t, g in reversed(swapped):
            t.grad = g

    def _check_groups(self) -> None:
        base = self._base
        if base is None:
            return
        reasons = tuple(whole_reason(base, g) for g in base.param_groups)
        if reasons != self._reasons:
            i = next(i for i, (a, b) in enumerate(zip(reasons, self._reasons, strict=False)) if a != b)
            was, now = self._reasons[i] or "cut by elements", reasons[i] or "cut by elements"
            raise ValueError(
                f"param group {i} changed since ZeRO partitioned it (planned: {was}; now: {now}; Muon's use_muon "
                "flipped?): the partition is fixed when the optimizer plans, so build the KitsuneOptimizer again "
                "after such a change. Nothing was updated."
            )

    def _follow_storage(self) -> None:
        """Re-view a shard param whose model param got new storage (``p.data = ...``): a local change (the fused
        executor re-plans its own units for it), no collective."""
        for j, (p, shard, lo, hi, ptr) in enumerate(self._shards):
            if p.data_ptr() != ptr:
                shard.data = p.detach().view(-1)[lo:hi]
                self._shards[j] = (p, shard, lo, hi, p.data_ptr())

    def owned_grads(self) -> list[torch.Tensor]:
        """The grads this rank updates with (and so unscales)."""
        return [t.grad for t in self._mine if t.grad is not None]

    def reduce_norm(self, total: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        """Combine the ranks' grad norms (each over its own elements' grads) and inf/nan flags, in place, on the
        device: one all-reduce (the sum of the squared 2-norms, or the max for the inf-norm; the max of the flags)."""
        if total is not None:
            fsdp.all_reduce_norm_(total, found_inf, self._norm_type, [self.group])
        elif found_inf is not None:
            fsdp.all_reduce_found_inf_(found_inf, [self.group])

    @torch.no_grad()
    def finish(self) -> None:
        """All-gather the params: each rank's segment of every bucket holds its updated elements. With
        ``gather_in_forward`` the gathers are launched in the order the next forward needs them and left pending
        (`wait_params`, or a module's forward, completes them)."""
        self._swapped = []
        if self.config.gather_in_forward:
            for b in reversed(self.buckets):  # buckets run in backward order: the forward needs the last one first
                flat, work = self._launch_gather(b)
                if b.others:
                    gather = _Gather(b, flat, work)
                    self._pending.update((id(b.params[k]), gather) for k in b.others)
            if self._pending and self._forward_hook is None:
                self._forward_hook = _forward_pre_hook(weakref.ref(self))
        else:
            inflight: deque[tuple[Bucket, torch.Tensor, Any]] = deque()
            for b in self.buckets:
                inflight.append((b, *self._launch_gather(b)))
                if len(inflight) >= GATHERS_IN_FLIGHT:
                    _scatter_back(*inflight.popleft())
            while inflight:
                _scatter_back(*inflight.popleft())
        self._reduction.forget()
        self._last = self._reduction.take_counts()

    def _launch_gather(self, b: Bucket) -> tuple[torch.Tensor, Any]:
        """Start ``b``'s all-gather of this rank's updated elements: the gathered buffer and the async work."""
        flat = torch.empty(self.world * b.seg, dtype=b.dtype, device=b.device)
        off = self.rank * b.seg
        mine = flat[off : off + b.seg]
        dst, src = [], []
        for k, t in b.targets.items():
            dst.append(b.view(mine, k, off) if t is b.params[k] else b.piece(mine, k, off))
            src.append(t)
        if src:
            torch._foreach_copy_(dst, src)
        return flat, all_gather(flat, mine, group=self.group, async_op=True)

    @torch.no_grad()
    def wait_params(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Complete the pending all-gathers (``gather_in_forward``) of the buckets holding ``params``, or of all:
        their params then hold every rank's update."""
        if not self._pending:
            return
        if params is None:
            gathers = list(dict.fromkeys(self._pending.values()))
        else:
            gathers = [g for p in params if (g := self._pending.get(id(p))) is not None]
        for gather in gathers:
            if gather.flat is not None:
                _scatter_back(gather.bucket, gather.flat, gather.work)
                gather.flat = gather.work = None
                for k in gather.bucket.others:
                    self._pending.pop(id(gather.bucket.params[k]), None)
        if not self._pending and self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None

    def zero_grad(self) -> None:
        """Forget grads reduced since the last step (``optimizer.zero_grad()`` discards them, as it does grads)."""
        for b in self.buckets:
            self._reduction.drain(b)
        for p, *_ in self._shards:  # not in the groups, so optimizer.zero_grad does not reach them
            p.grad = None
        self._reduction.forget()
        self._read_before_gather = False

    def filter_load(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The part of a consolidated (or plain torch) state dict this rank keeps: its own elements of each param's
        state; raises on another rank's shard, or on state that does not fit the params. Pure: ``state_dict`` is not
        changed, and every check runs before the load changes anything."""
        if not self.active:
            return state_dict
        saved = state_dict.get("kitsune", {}).get("subsystems", {}).get("shard")
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or sum(len(g.get("params", ())) for g in groups) != len(self._params):
            return state_dict  # torch's load_state_dict refuses it, with its own message
        if saved and not saved.get("consolidated"):
            layout = (saved.get("world_size"), saved.get("rank"), saved.get("ranges"))
            if layout != (self.world, self.rank, [list(r) for r in self._ranges]):
                raise ValueError(
                    f"this state dict is rank {saved.get('rank')}'s shard of a {saved.get('world_size')}-rank sharded "
                    f"run, not this rank's ({self.rank} of {self.world}) under this layout: load the consolidated "
                    "state dict (kitsune.distributed.consolidated_state_dict(optimizer)) instead"
                )
            for k, st in state_dict["state"].items():
                if isinstance(k, int) and 0 <= k < len(self._params):
                    check_sizes(st, k, self._ranges[k][1] - self._ranges[k][0], self._params[k])
            return state_dict
        keep = {}
        for k, st in state_dict["state"].items():
            if not (isinstance(k, int) and 0 <= k < len(self._params)):
                keep[k] = st
                continue
            p, (lo, hi) = self._params[k], self._ranges[k]
            check_sizes(st, k, p.numel(), p)
            st = whole_format(st)  # 8-bit blocks of the whole param do not cut into pieces
            if lo == 0 and hi == p.numel():
                keep[k] = st
            elif hi > lo:
                keep[k] = slice_state(st, lo, hi)
        out = dict(state_dict)
        out["state"] = keep
        return out

    # -- checkpoints and reports -------------------------------------------------------------------------------------
    def owned_params(self) -> list[torch.Tensor]:
        """The params the all-gather updates (the orchestrator counts them as taken care of)."""
        return list(self.remote)

    def pieces(self, state: dict[Any, dict[str, Any]]) -> dict[int, tuple[int, int, dict[str, Any]]]:
        """This rank's entries of a state dict's ``state``, each with the element range it holds: ``(lo, hi,
        state)`` by param index, tensors on the CPU, 8-bit state decoded (what `consolidated_state_dict` gathers)."""
        n = len(self._ranges)
        return {
            k: (*self._ranges[k], to_cpu(whole_format(st)))
            for k, st in state.items()
            if isinstance(k, int) and 0 <= k < n
        }

    def state_dict(self) -> dict[str, Any]:
        if not self.active:
            return {}
        return {
            "stage": self.config.stage,
            "world_size": self.world,
            "rank": self.rank,
            "ranges": [list(r) for r in self._ranges],
            "consolidated": False,
        }

    def report(self) -> dict[str, Any]:
        if not self.active:
            return {}
        total = sum(p.numel() for b in self.buckets for p in b.params)
        return {
            "stage": self.config.stage,
            "world_size": self.world,
            "rank": self.rank,
            "buckets": len(self.buckets),
            "params_owned": len(self._mine),
            "params_split": len(self._shards),
            "params_total": sum(len(b.params) for b in self.buckets),
            "elements_owned": sum(hi - lo for b in self.buckets for lo, hi in b.ranges),
            "elements_total": total,
            "padding_elements": sum(self.world * b.seg for b in self.buckets) - total,
            "whole_params": dict(self._whole),
            "overlap": self.config.overlap,
            **self._last,
        }


class _Gather:
    """A bucket's all-gather launched by ``finish`` and not yet copied into the params."""

    __slots__ = ("bucket", "flat", "work")

    def __init__(self, bucket: Bucket, flat: torch.Tensor, work: Any) -> None:
        self.bucket, self.flat, self.work = bucket, flat, work


def _forward_pre_hook(ref: weakref.ref) -> Any:
    """Registers every module's forward pre-hook while gathers are pending: the module's own params get their update
    first. Returns the handle. The hook holds the optimizer weakly and removes itself once the optimizer is gone."""
    handle: Any = None

    def hook(module: torch.nn.Module, _args: Any) -> None:
        shard = ref()
        if shard is None:
            handle.remove()
        elif module._parameters:
            shard.wait_params(p for p in module._parameters.values() if p is not None)

    handle = register_module_forward_pre_hook(never_traced(hook))
    return handle


def _ready_hook(ref: weakref.ref, bi: int, k: int) -> Callable[[torch.Tensor], None]:
    def ready(_: torch.Tensor) -> None:
        shard = ref()
        if shard is not None and shard.active:
            shard.grad_ready(bi, k)

    return never_traced(ready)  # autograd calls it, inside a traced function's backward too: see kitsune._untraced


@torch.no_grad()
def _scatter_back(b: Bucket, flat: torch.Tensor, work: Any) -> None:
    """The other ranks' elements of ``b``'s params, from the gathered ``flat``."""
    work.wait()
    dst, src = [], []
    for k in b.others:
        p, (lo, hi), s = b.params[k], b.ranges[k], b.layout.starts[k]
        if lo == hi:  # none of it here: as its own shape, whatever its strides
            dst.append(p)
            src.append(b.view(flat, k))
            continue
        elements = p.view(-1)  # cut by elements: contiguous
        if lo:
            dst.append(elements[:lo])
            src.append(flat[s : s + lo])
        if hi < p.numel():
            dst.append(elements[hi:])
            src.append(flat[s + hi : s + p.numel()])
    if dst:
        torch._foreach_copy_(dst, src)


def _remove(handles: list[Any]) -> None:
    for h in handles:
        h.remove()


@torch.no_grad()
def clip_sharded_grads_(
    params: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float,
    reduce: Callable[[torch.Tensor | None, torch.Tensor | None], None],
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over grads that the ranks hold between them: the local norm, made global by
    ``reduce`` (one on-device all-reduce), then torch's coefficient ``min(max_norm / (norm + 1e-6), 1)``. Returns the
    global norm (fp32, on the grads' device); nothing is read back to the host."""
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        groups[(g.device, g.dtype)].append(g)
    device = grads[0].device if grads else params[0].device
    norms = [n.float().to(device) for gs in groups.values() for n in torch._foreach_norm(gs, norm_type)]
    if norms:
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    else:
        total = torch.zeros((), dtype=torch.float32, device=device)
    reduce(total, None)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for (dev, _), gs in groups.items():
        torch._foreach_mul_(gs, coef.to(dev))
    return total


__all__ = ["GATHERS_IN_FLIGHT", "ShardSubsystem", "clip_sharded_grads_"]
