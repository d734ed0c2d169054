"""Sharded optimizer state for a replicated model: ZeRO stages 1 and 2 on torch.distributed's collectives.

Every rank holds the whole model, not wrapped in DDP: this subsystem averages the grads itself. Each trainable
param is owned by exactly one rank, which alone keeps its optimizer state and updates it; the other ranks receive
the new values. The partition is by whole params, so

* every optimizer works unchanged: per-param math (LAMB's trust ratio, Muon's orthogonalisation) sees whole
  tensors, and ZeRO with ``kitsune.optim.Muon`` is distributed Muon with sharded momentum;
* a rank's update goes through the normal step: the fused kernels on GPU, the wrapped optimizer's own step where
  they do not run; the params other ranks own have no grad during the step, so nothing updates them or creates
  their state;
* each rank's ``state_dict()`` is torch's layout holding the state of its own params, and the consolidated state
  dict ([`consolidated_state_dict`][kitsune.distributed.consolidated_state_dict]) is the union of the ranks' states: it
  loads into the plain torch optimizer.

Buckets. Trainable params are cut, in reverse registration order (the order backward finishes grads), into
buckets of one (device, dtype) and about ``bucket_bytes``. Within a bucket the params are dealt to the ranks
largest first, each to the rank with the fewest elements in this bucket (ties: the fewest overall), which balances
both each bucket and the whole model by numel. A bucket is one flat buffer of ``world`` equal segments; segment r
holds rank r's params back to back (slots aligned to 128 bytes, segments padded to the longest)::

    stage 1: grads -> flat, / world, all_reduce       every param's grad becomes a view of the flat buffer
             (one all_reduce per segment, of its params, not its padding)
    stage 2: grads -> flat, / world, reduce_scatter   this rank's segment: its own params' grads (a flat shard);
                                                      every local grad is freed as soon as it is in the bucket
    after the update: own params -> own segment, all_gather -> copied into the params of the other ranks

Overlap. A post-accumulate-grad hook counts each bucket's grads; when a bucket is complete (and every bucket
before it has started: all ranks must issue collectives in one order) its collective starts asynchronously while
backward goes on. A callback at the end of backward starts the rest and waits for all of them, so after
``loss.backward()`` stage 1's grads are averaged, as DDP's are; stage 2's are None until ``step()`` points the
owned params' grads at the shard. With ``overlap=False``, or for backward passes inside
``optimizer.accumulating()``, the grads are reduced at the start of ``step()`` instead.

The global grad norm (``max_grad_norm``) and AMP's inf/nan flag are computed over this rank's grads and combined
with one on-device all-reduce (``StepState.reduce``), so no rank reads a value back to the host.
"""

from __future__ import annotations

import weakref
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from kitsune.config import ShardConfig
from kitsune.distributed import fsdp
from kitsune.subsystem import Accumulation, StepState, Subsystem

ALIGN_BYTES = 128
"""Every param's slot in a bucket starts on a 128-byte boundary (vectorised loads in the fused kernels)."""
GATHERS_IN_FLIGHT = 2
"""Param all-gathers running at once after the update: each holds a bucket-sized buffer."""

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor", None)
_all_gather = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)


class Bucket:
    """One bucket's layout (which params, which rank owns each, where each sits in its segment) and its buffers."""

    def __init__(self, params: list[torch.Tensor], owners: list[int], offsets: list[int], seg: int, rank: int):
        self.params, self.owners, self.offsets, self.seg = params, owners, offsets, seg
        self.rank = rank
        self.device, self.dtype = params[0].device, params[0].dtype
        self.mine = [i for i, o in enumerate(owners) if o == rank]
        self.theirs = [i for i, o in enumerate(owners) if o != rank]
        self.used = [0] * (max(owners) + 1)
        """Per rank, the elements of its segment that hold params (the rest pads it to ``seg``)."""
        for i, (o, off) in enumerate(zip(owners, offsets, strict=True)):
            self.used[o] = max(self.used[o], off + params[i].numel())
        self.flat: torch.Tensor | None = None
        """Stage 1: the grads of every param in the bucket, ``world * seg`` elements, kept between steps."""
        self.shard: torch.Tensor | None = None
        """Stage 2: this rank's segment of the reduced grads, ``seg`` elements, kept between steps."""
        self.pending: list[tuple[Any, torch.Tensor | None, torch.Tensor | None]] = []
        self.ready = 0
        self.reduced = False
        """Reduced since the last step (stage 2 then adds a further reduction instead of overwriting it)."""

    def view(self, buf: torch.Tensor, i: int, base: int | None = None) -> torch.Tensor:
        """Param ``i``'s slot in ``buf``: a whole bucket (``base=None``: its owner's segment) or one segment."""
        p = self.params[i]
        start = (self.owners[i] * self.seg if base is None else base) + self.offsets[i]
        return buf[start : start + p.numel()].view(p.shape)


def partition(
    params: list[torch.Tensor], world: int, bucket_bytes: int
) -> list[tuple[list[int], list[int], list[int], int]]:
    """Cut ``params`` (in the order given) into buckets and deal each bucket's params to ``world`` ranks.

    Returns ``(indices, owners, offsets, seg)`` per bucket: positions in ``params``, the owning rank and the offset
    in its segment of each, and the segment length in elements. Depends only on shapes, dtypes and devices, so
    every rank computes the same partition.
    """
    open_: dict[tuple, list[int]] = {}
    filled: dict[tuple, int] = defaultdict(int)
    cut: list[list[int]] = []
    for i, p in enumerate(params):
        key = (p.device, p.dtype)
        if key not in open_:
            open_[key] = []
            cut.append(open_[key])
        open_[key].append(i)
        filled[key] += p.numel() * p.element_size()
        if filled[key] >= bucket_bytes:
            del open_[key]
            filled[key] = 0
    total = [0] * world
    out = []
    for indices in cut:
        p0 = params[indices[0]]
        align = max(1, ALIGN_BYTES // p0.element_size())
        load = [0] * world
        owner: dict[int, int] = {}
        for i in sorted(indices, key=lambda i: -params[i].numel()):
            r = min(range(world), key=lambda r: (load[r], total[r], r))
            owner[i] = r
            n = params[i].numel()
            load[r] += -(-max(n, 1) // align) * align
            total[r] += n
        fill = [0] * world
        offsets = []
        for i in indices:
            offsets.append(fill[owner[i]])
            fill[owner[i]] += -(-max(params[i].numel(), 1) // align) * align
        out.append((indices, [owner[i] for i in indices], offsets, max(fill)))
    return out


class ShardSubsystem(Subsystem):
    """ZeRO stages 1 and 2 for a replicated model; see the module docstring."""

    name = "shard"

    def __init__(self, config: ShardConfig, accumulation: Accumulation | None = None) -> None:
        super().__init__()
        self.config = config
        self._accumulating = accumulation if accumulation is not None else Accumulation()
        """Set inside ``optimizer.accumulating()``: backward passes there leave their grads unreduced."""
        self.remote: frozenset[torch.Tensor] = frozenset()
        """Params other ranks own and update (the fusion planner leaves them out; the all-gather writes them)."""
        self.executes = False
        """Whether it changes params in the step (the all-gather): the orchestrator then runs closures first."""
        self.group: Any = None
        self.world = 1
        self.rank = 0
        self.buckets: list[Bucket] = []
        self._mine: list[torch.Tensor] = []
        self._owners: list[int] = []
        self._key: tuple | None = None
        self._hooks: list[Any] = []
        self._broadcast = False
        self._next = 0
        self._queued = False
        self._reduced = False
        self._norm_type = 2.0
        self._device = torch.device("cpu")
        self._in_backward = self._in_step = 0
        self._last = {"buckets_reduced_in_backward": 0, "buckets_reduced_in_step": 0}
        self.deactivate("zero_stage=0")

    # -- planning ------------------------------------------------------------------------------------------------
    def plan(self, groups: list[dict[str, Any]], base: torch.optim.Optimizer, norm_type: float) -> None:
        """Partition the trainable params of ``groups`` (the wrapped optimizer ``base``'s) over the ranks."""
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
        if getattr(base, "process_group", None) is not None:
            raise ValueError(
                "distributed Muon (process_group=...) under ShardConfig(stage>0): sharded state already gives each "
                "rank whole matrices to orthogonalise; drop Muon's process_group"
            )
        self.group = cfg.process_group
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if self.world == 1:
            self._drop("world size 1: one rank holds all of the state, nothing to shard")
            return
        params = [p for g in groups for p in g["params"]]
        signature = [(tuple(p.shape), str(p.dtype), p.device.type, p.requires_grad) for p in params]
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, signature, group=self.group)
        if any(s != signature for s in everyone):
            bad = next(r for r, s in enumerate(everyone) if s != signature)
            raise ValueError(
                f"rank {bad}'s optimizer holds other params than rank {self.rank}'s (shapes, dtypes, requires_grad, "
                "in param group order): every rank must build the same model and param groups"
            )
        trainable = [p for p in params if p.requires_grad]
        if not trainable:
            self._drop("no param requires grad: nothing to update")
            return
        self._norm_type = norm_type
        self._device = trainable[0].device
        key = (self.world, self.rank, cfg.bucket_bytes, tuple(map(id, params)), tuple(signature))
        if key != self._key:  # a re-plan that changed nothing keeps the buffers (and grads already reduced)
            self._key = key
            order = trainable[::-1]  # backward finishes the last layers' grads first
            self.buckets = [
                Bucket([order[i] for i in indices], owners, offsets, seg, self.rank)
                for indices, owners, offsets, seg in partition(order, self.world, cfg.bucket_bytes)
            ]
            owner_of = {id(p): o for b in self.buckets for p, o in zip(b.params, b.owners, strict=True)}
            self._owners = [owner_of.get(id(p), -1) for p in params]  # -1: frozen, every rank keeps its own
            self._mine = [b.params[i] for b in self.buckets for i in b.mine]
            self.remote = frozenset(b.params[i] for b in self.buckets for i in b.theirs)
            self._reduced = False
        if not self._broadcast:  # every replica starts from rank 0's params, as DDP makes them
            self._broadcast_params(params)
            self._broadcast = True
        self._hook_params(trainable if cfg.overlap else [])
        self.executes = True
        self.activate()

    def _drop(self, reason: str) -> None:
        self._unhook()
        self.remote, self.buckets, self._mine, self._owners, self._key = frozenset(), [], [], [], None
        self.executes = False
        self.deactivate(reason)

    def _hook_params(self, params: list[torch.Tensor]) -> None:
        self._unhook()
        index = {id(p): bi for bi, b in enumerate(self.buckets) for p in b.params}
        ref = weakref.ref(self)  # the params must not keep a dropped optimizer alive
        for p in params:
            self._hooks.append(p.register_post_accumulate_grad_hook(_ready_hook(ref, index[id(p)])))
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

    # -- inside backward -------------------------------------------------------------------------------------------
    def grad_ready(self, bi: int) -> None:
        """A grad of bucket ``bi`` is complete (its post-accumulate-grad hook): start the buckets that are ready."""
        if self._accumulating:
            return
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._queued = True
        self.buckets[bi].ready += 1
        buckets = self.buckets
        while self._next < len(buckets) and buckets[self._next].ready == len(buckets[self._next].params):
            self._launch(buckets[self._next])  # in bucket order on every rank, whatever order grads arrive in
            self._next += 1
            self._in_backward += 1

    def _end_of_backward(self) -> None:
        for b in self.buckets[self._next :]:  # params that got no grad in this backward leave buckets incomplete
            self._launch(b)
            self._in_backward += 1
        self._next, self._queued = 0, False
        for b in self.buckets:
            b.ready = 0
        self._wait()

    @torch.no_grad()
    def _launch(self, b: Bucket) -> None:
        """Copy the bucket's grads into its flat buffer, divide by the world size and start the reduction."""
        world = self.world
        if self.config.stage == 1:
            if b.pending:  # reduced once already and not waited for: the newer grads include the older ones
                self._wait()
            if b.flat is None:
                b.flat = torch.zeros(world * b.seg, dtype=b.dtype, device=b.device)
            flat = b.flat
        else:
            flat = torch.zeros(world * b.seg, dtype=b.dtype, device=b.device)
        dst, src, empty = [], [], []
        for i, p in enumerate(b.params):
            v, g = b.view(flat, i), p.grad
            if g is None:
                empty.append(v)  # no grad here: counts as zeros in the average
            elif g.data_ptr() != v.data_ptr():
                dst.append(v)
                src.append(g)
        if src:
            torch._foreach_copy_(dst, src)
        if empty and self.config.stage == 1:
            torch._foreach_zero_(empty)
        flat.div_(world)
        if self.config.stage == 1:  # each segment's params only: a bucket of one large param is mostly padding
            for r, used in enumerate(b.used):
                if used:
                    work = dist.all_reduce(flat[r * b.seg : r * b.seg + used], group=self.group, async_op=True)
                    b.pending.append((work, None, None))
            return
        for p in b.params:  # stage 2: the grads are in the bucket now; each rank keeps only its own, reduced
            p.grad = None
        first = not b.reduced and not b.pending
        if first and b.shard is None:
            b.shard = torch.empty(b.seg, dtype=b.dtype, device=b.device)
        out = b.shard if first else torch.empty(b.seg, dtype=b.dtype, device=b.device)
        work = _reduce_scatter(out, flat, group=self.group, async_op=True)
        b.pending.append((work, flat, None if first else out))

    @torch.no_grad()
    def _wait(self) -> None:
        """Wait for every reduction started (on GPUs: make the current stream wait) and put its result in place."""
        for b in self.buckets:
            for work, _, extra in b.pending:
                work.wait()
                if extra is not None:  # stage 2, a further backward before step(): its grads add to the shard
                    b.shard.add_(extra)
            if not b.pending:
                continue
            b.pending = []
            b.reduced = True
            if self.config.stage == 1:  # every grad a view of the averaged bucket, as DDP's bucket views
                for i, p in enumerate(b.params):
                    v = b.view(b.flat, i)
                    if p.grad is None or p.grad.data_ptr() != v.data_ptr():
                        p.grad = v
        self._reduced = True

    @staticmethod
    def _drain(b: Bucket) -> None:
        for work, _, _ in b.pending:
            work.wait()
        b.pending = []

    # -- the step --------------------------------------------------------------------------------------------------
    def begin(self, s: StepState) -> None:
        """The step's first stage: every grad reduced across the ranks (those a backward did not reduce yet), the
        owned params' grads pointing at this rank's share, the others' None; ``s.reduce`` combines norms and flags."""
        self._accumulating.refuse_step()
        if not self._reduced:  # no backward reduced the grads: overlap=False, accumulating(), or grads set by hand
            for b in self.buckets:
                self._launch(b)
                self._in_step += 1
            self._wait()
        for b in self.buckets:
            if self.config.stage == 2:  # the owned params' grads are views of the shard, the rest stay None
                for i in b.mine:
                    b.params[i].grad = b.view(b.shard, i, base=0)
            else:  # the other ranks update their params: their grads must not reach this rank's update
                for i in b.theirs:
                    b.params[i].grad = None
        s.reduce = self.reduce_norm

    def owned_grads(self) -> list[torch.Tensor]:
        """The grads this rank updates (and so unscales)."""
        return [p.grad for p in self._mine if p.grad is not None]

    def reduce_norm(self, total: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        """Combine the ranks' grad norms (each over its own params' grads) and inf/nan flags, in place, on the
        device: one all-reduce (the sum of the squared 2-norms, or the max for the inf-norm; the max of the flags)."""
        if total is not None:
            fsdp.all_reduce_norm_(total, found_inf, self._norm_type, [self.group])
        elif found_inf is not None:
            fsdp.all_reduce_found_inf_(found_inf, [self.group])

    @torch.no_grad()
    def finish(self) -> None:
        """All-gather the params: each rank's segment of every bucket holds its updated params."""
        inflight: deque[tuple[Bucket, torch.Tensor, Any]] = deque()
        for b in self.buckets:
            flat = torch.empty(self.world * b.seg, dtype=b.dtype, device=b.device)
            mine = flat[self.rank * b.seg : (self.rank + 1) * b.seg]
            if b.mine:
                torch._foreach_copy_([b.view(mine, i, base=0) for i in b.mine], [b.params[i] for i in b.mine])
            inflight.append((b, flat, _all_gather(flat, mine, group=self.group, async_op=True)))
            if len(inflight) >= GATHERS_IN_FLIGHT:
                _scatter_back(*inflight.popleft())
        while inflight:
            _scatter_back(*inflight.popleft())
        for b in self.buckets:
            b.reduced = False
        self._reduced = False
        self._last = {"buckets_reduced_in_backward": self._in_backward, "buckets_reduced_in_step": self._in_step}
        self._in_backward = self._in_step = 0

    def zero_grad(self) -> None:
        """Forget grads reduced since the last step (``optimizer.zero_grad()`` discards them, as it does grads)."""
        for b in self.buckets:
            self._drain(b)
            b.reduced = False
        self._reduced = False

    def filter_load(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The part of a consolidated (or plain torch) state dict this rank keeps: its own params' state; raises on
        another rank's shard. Pure: ``state_dict`` is not changed."""
        if not self.active:
            return state_dict
        saved = state_dict.get("kitsune", {}).get("subsystems", {}).get("shard")
        if saved and not saved.get("consolidated"):
            layout = (saved.get("world_size"), saved.get("rank"), saved.get("owners"))
            if layout != (self.world, self.rank, self._owners):
                raise ValueError(
                    f"this state dict is rank {saved.get('rank')}'s shard of a {saved.get('world_size')}-rank sharded "
                    f"run, not this rank's ({self.rank} of {self.world}): load the consolidated state dict "
                    "(kitsune.distributed.consolidated_state_dict(optimizer)) instead"
                )
        keep = {i for i, o in enumerate(self._owners) if o in (self.rank, -1)}
        out = dict(state_dict)
        out["state"] = {k: v for k, v in state_dict["state"].items() if k in keep}
        return out

    # -- checkpoints and reports -------------------------------------------------------------------------------------
    def owned_params(self) -> list[torch.Tensor]:
        """The params the all-gather updates (the orchestrator counts them as taken care of)."""
        return list(self.remote)

    def state_dict(self) -> dict[str, Any]:
        if not self.active:
            return {}
        return {
            "stage": self.config.stage,
            "world_size": self.world,
            "rank": self.rank,
            "owners": list(self._owners),
            "consolidated": False,
        }

    def report(self) -> dict[str, Any]:
        if not self.active:
            return {}
        numel = [sum(b.params[i].numel() for i in b.mine) for b in self.buckets]
        total = sum(p.numel() for b in self.buckets for p in b.params)
        return {
            "stage": self.config.stage,
            "world_size": self.world,
            "rank": self.rank,
            "buckets": len(self.buckets),
            "params_owned": len(self._mine),
            "params_total": sum(len(b.params) for b in self.buckets),
            "elements_owned": sum(numel),
            "elements_total": total,
            "padding_elements": sum(self.world * b.seg for b in self.buckets) - total,
            "overlap": self.config.overlap,
            **self._last,
        }


def _ready_hook(ref: weakref.ref, bi: int) -> Callable[[torch.Tensor], None]:
    def ready(_: torch.Tensor) -> None:
        shard = ref()
        if shard is not None and shard.active:
            shard.grad_ready(bi)

    return ready


@torch.no_grad()
def _scatter_back(b: Bucket, flat: torch.Tensor, work: Any) -> None:
    work.wait()
    if b.theirs:
        torch._foreach_copy_([b.params[i] for i in b.theirs], [b.view(flat, i) for i in b.theirs])


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


def consolidated_state_dict(optimizer: Any, to: int | None = 0) -> dict[str, Any] | None:
    """The whole optimizer's state dict of a sharded run, gathered from every rank (a collective: call it on all).

    Returns torch's layout with every param's state (tensors moved to the CPU), which the plain torch optimizer over
    the full model loads, and so does a sharded KitsuneOptimizer on any number of ranks (each keeps its own share).
    ``to``: the rank (of the shard's process group) that receives it, the others get None; ``to=None``: every rank.
    Without sharding it is ``optimizer.state_dict()``.
    """
    shard = next((s for s in optimizer.subsystems if s.name == "shard"), None)
    sd = optimizer.state_dict()
    if shard is None or not shard.active:
        return sd
    local = {
        k: {n: v.detach().cpu() if torch.is_tensor(v) else v for n, v in s.items()} for k, s in sd["state"].items()
    }
    parts: list[Any] | None = [None] * shard.world
    if to is None:
        dist.all_gather_object(parts, local, group=shard.group)
    else:
        if not 0 <= to < shard.world:
            raise ValueError(f"to={to} is not a rank of the shard's process group (0..{shard.world - 1})")
        dst = dist.get_global_rank(shard.group, to) if shard.group is not None else to
        parts = parts if shard.rank == to else None
        dist.gather_object(local, parts, dst=dst, group=shard.group)
        if parts is None:
            return None
    merged: dict[Any, Any] = {}
    for part in parts:
        merged.update(part)
    out = dict(sd)
    out["state"] = {k: merged[k] for k in sorted(merged)}
    ours = dict(out["kitsune"])
    ours["subsystems"] = {**ours["subsystems"], "shard": {**ours["subsystems"]["shard"], "consolidated": True}}
    out["kitsune"] = ours
    return out


def state_numel(optimizer: torch.optim.Optimizer) -> int:
    """Elements of optimizer state this rank holds (tensors of more than one element: moments, momentum)."""
    return sum(v.numel() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)


__all__ = ["Bucket", "ShardSubsystem", "clip_sharded_grads_", "consolidated_state_dict", "partition", "state_numel"]
