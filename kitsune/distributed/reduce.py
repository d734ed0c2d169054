"""ZeRO's grad reduction: each bucket's grads averaged across the ranks, started from backward as buckets complete.

Stage 1 all-reduces a bucket's flat buffer and every grad becomes a view of it, as DDP's; stage 2 reduce-scatters it
and each rank keeps its segment. One small all-reduce per backward counts, for every param, the ranks that had a grad
for it, so that a param no rank had a grad for is skipped as torch skips it. `ShardSubsystem` (``zero.py``) owns the
layout, the step and the checkpoints, and hands this its buckets.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from kitsune._untraced import never_traced
from kitsune.config import ShardConfig
from kitsune.distributed.layout import Bucket
from kitsune.subsystem import Accumulation

reduce_scatter = getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor", None)
all_gather = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)


class GradReduction:
    """The reduction of one layout's buckets (`bind`) over a process group; see the module docstring."""

    def __init__(self, config: ShardConfig, accumulating: Accumulation) -> None:
        self.config = config
        self._accumulating = accumulating
        """Set inside ``optimizer.accumulating()``: backward passes there leave their grads unreduced."""
        self.buckets: list[Bucket] = []
        self.group: Any = None
        self.world, self.rank = 1, 0
        self.device = torch.device("cpu")
        self.reduced = False
        """Reduced since the last step (by a backward, or by the step itself)."""
        self.stale = False
        """A bucket's param of another dtype than the bucket's was met (``model.half()`` after the layout was made):
        its reduction did not start, and the layout is made again before the next step goes on."""
        self.in_backward = self.in_step = 0
        """Buckets reduced from backward and by the step since the last step (the report's counts)."""
        self._counts: torch.Tensor | None = None
        """Per param (bucket order), the ranks that had a grad for it in the last reduction."""
        self._counts_work: Any = None
        self._ones: torch.Tensor | None = None
        self._next = 0
        self._queued = False

    def bind(self, buckets: list[Bucket], group: Any, world: int, rank: int, device: torch.device) -> None:
        """A new layout's buckets, over ``world`` ranks of ``group``; nothing reduced yet."""
        self.buckets, self.group, self.world, self.rank, self.device = buckets, group, world, rank, device
        self.reduced = self.stale = False
        self._counts = self._ones = None

    def reduce_all(self) -> None:
        """The step's own reduction of every bucket (no backward reduced them: ``overlap=False``,
        ``accumulating()``, or grads set by hand)."""
        for b in self.buckets:
            self.launch(b)
            self.in_step += 1
        if self.stale:  # (where no backward met the cast param first: the step's own pass meets it)
            for b in self.buckets:
                self.drain(b)
            raise RuntimeError(
                "kitsune: a param's dtype changed after ZeRO laid its grads out in buckets (model.half() or "
                "model.to(dtype) after the optimizer was built): this step changed nothing, and the next lays the "
                "buckets out again for the new dtypes. Convert the model before building the optimizer to avoid this"
            )
        self.count_grads()
        self.wait()

    def take_counts(self) -> dict[str, int]:
        """The report's counts of where the buckets were reduced since the last step, reset for the next."""
        counts = {"buckets_reduced_in_backward": self.in_backward, "buckets_reduced_in_step": self.in_step}
        self.in_backward = self.in_step = 0
        return counts

    def grad_ready(self, bi: int, k: int) -> None:
        """Param ``k`` of bucket ``bi`` has its grad of this backward (its post-accumulate-grad hook): note it, and
        with ``overlap`` start the buckets that are complete."""
        self.buckets[bi].present[k] = True
        if self._accumulating or not self.config.overlap:
            return
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._queued = True
        self.buckets[bi].ready += 1
        buckets = self.buckets
        while self._next < len(buckets) and buckets[self._next].ready == len(buckets[self._next].params):
            self.launch(buckets[self._next])  # in bucket order on every rank, whatever order grads arrive in
            self._next += 1
            self.in_backward += 1

    @never_traced  # autograd calls it when backward ends, inside a traced function's backward too
    def _end_of_backward(self) -> None:
        for b in self.buckets[self._next :]:  # params that got no grad in this backward leave buckets incomplete
            self.launch(b)
            self.in_backward += 1
        self._next, self._queued = 0, False
        for b in self.buckets:
            b.ready = 0
        self.count_grads()
        self.wait()

    @torch.no_grad()
    def launch(self, b: Bucket) -> None:
        """Copy the bucket's grads into its flat buffer, divide by the world size and start the reduction."""
        world, stage1 = self.world, self.config.stage == 1
        if any(p.dtype != b.dtype for p in b.params):
            self.stale = True  # nothing started or changed: the step lays the buckets out again (`ShardSubsystem.fits`)
            return
        for k, p in enumerate(b.params):  # a grad_dtype set to another: the averaged grad cannot be its grad
            if b.present[k] and not _takes(p, b.dtype):
                raise RuntimeError(_dtype_changed(p, b.dtype))
        if stage1:
            if b.pending:  # reduced once already and not waited for: the newer grads include the older ones
                self.wait()
            if b.flat is None:
                b.flat = torch.zeros(world * b.seg, dtype=b.dtype, device=b.device)
                b.bind(b.flat)
            flat = b.flat
        else:
            flat = torch.zeros(world * b.seg, dtype=b.dtype, device=b.device)
        # stage 1, a further backward before step(): every rank's views hold the average reduced so far, which each
        # rank's contribution carries on (a grad backward accumulated into its view already does; one made apart is
        # added; a param with no grad here keeps it), so the new reduction is that average plus the new grads'
        onto = stage1 and b.reduced
        dst, src, empty = [], [], []
        for k, p in enumerate(b.params):
            v, g = b.views[k] if stage1 else b.view(flat, k), p.grad
            if g is not None and not b.present[k] and g is not (v if stage1 else b.grads.get(k)):
                b.present[k] = True  # a grad set by hand (a backward's grads are noted by their hooks)
            if g is None or not b.present[k]:  # no grad here since the last step: zeros in the average
                if not onto:
                    empty.append(v)
                continue
            if g.data_ptr() != v.data_ptr():
                dst.append(v)
                src.append(g)
        if src:
            (torch._foreach_add_ if onto else torch._foreach_copy_)(dst, src)
        if empty and stage1:
            torch._foreach_zero_(empty)
        flat.div_(world)
        if stage1:  # the elements that hold params only: a bucket of whole params pads its short segments
            for lo, hi in b.spans:
                work = dist.all_reduce(flat[lo:hi], group=self.group, async_op=True)
                b.pending.append((work, None, None))
            return
        for p in b.params:  # stage 2: the grads are in the bucket now; each rank keeps only its own, reduced
            p.grad = None
        first = not b.reduced and not b.pending
        if first and b.shard is None:
            b.shard = torch.empty(b.seg, dtype=b.dtype, device=b.device)
            b.bind(b.shard, self.rank * b.seg)
        out = b.shard if first else torch.empty(b.seg, dtype=b.dtype, device=b.device)
        work = reduce_scatter(out, flat, group=self.group, async_op=True)
        b.pending.append((work, flat, None if first else out))

    def count_grads(self) -> None:
        """Start the all-reduce that counts, for every param, the ranks that had a grad for it (int32, in bucket
        order): a param no rank had a grad for is skipped, as torch skips it."""
        local = [x for b in self.buckets for x in b.present]
        if all(local):  # the common step: a copy on the device, no host-to-device transfer
            if self._ones is None or len(self._ones) != len(local):
                self._ones = torch.ones(len(local), dtype=torch.int32, device=self.device)
            counts = self._ones.clone()
        else:
            counts = torch.tensor(local, dtype=torch.int32, device=self.device)
        self._counts = counts
        self._counts_work = dist.all_reduce(counts, group=self.group, async_op=True)

    @torch.no_grad()
    def wait(self) -> None:
        """Wait for every reduction started (on GPUs: make the current stream wait) and put its result in place."""
        for b in self.buckets:
            for work, _, extra in b.pending:
                work.wait()
                if extra is not None:  # stage 2, a further backward before step(): its grads add to the shard
                    b.shard.add_(extra)
            if not b.pending:
                continue
            b.pending = []
            if self.config.stage == 1:  # the grads a backward made here: views of the averaged bucket, as DDP's
                changed = [p for k, p in enumerate(b.params) if b.present[k] and not _takes(p, b.dtype)]
                if changed:  # before the bucket counts as reduced: the next reduction starts afresh, not onto it
                    raise RuntimeError(_dtype_changed(changed[0], b.dtype))
                for k, p in enumerate(b.params):
                    if b.present[k] and p.grad is not b.views[k]:
                        p.grad = b.views[k]
            b.reduced = True
        if self._counts_work is not None:
            self._counts_work.wait()
            self._counts_work = None
        self.reduced = True

    def drain(self, b: Bucket) -> None:
        """Wait for ``b``'s reductions and drop their results (``optimizer.zero_grad()`` discards them)."""
        for work, _, _ in b.pending:
            work.wait()
        b.pending = []
        if self._counts_work is not None:
            self._counts_work.wait()
            self._counts_work = None

    @torch.no_grad()
    def restore_grads(self) -> None:
        """A re-partition between backward and step (``add_param_group``, a group's params changed): the grads the
        old layout reduced go back into the params, every rank holding the average of each param any rank had a grad
        for (stage 2 kept only this rank's segment: one all-gather per bucket), so the new layout reduces them again
        to the same average. A collective, run by every rank's re-plan alike."""
        if not any(b.reduced or b.pending for b in self.buckets):
            return
        self.wait()
        present = self.presence(every=True)
        at = 0
        for b in self.buckets:
            if not b.reduced:  # (a bucket a cast param kept from starting: its params hold their own grads still)
                at += len(b.params)
                continue
            full = b.flat
            if self.config.stage == 2:
                full = torch.empty(self.world * b.seg, dtype=b.dtype, device=b.device)
                all_gather(full, b.shard, group=self.group)
            for k, p in enumerate(b.params):
                if present[at + k]:
                    g = b.view(full, k)
                    p.grad = g if _takes(p, g.dtype) else g.to(_grad_dtype(p))  # (a param cast since: its dtype)
            at += len(b.params)

    def presence(self, every: bool = False) -> list[bool]:
        """Whether any rank had a grad for each param (bucket order), read back only where this rank's own grads do
        not settle it (a param it updates had no grad here, or ``every`` param has to be known: one sync)."""
        local = [x for b in self.buckets for x in b.present]
        if self._counts is None or all(local if every else (b.present[k] for b in self.buckets for k in b.targets)):
            return local
        return [here or n > 0 for here, n in zip(local, self._counts.tolist(), strict=True)]

    def forget(self) -> None:
        """After a step, or ``zero_grad()``: nothing reduced, no grad noted, for the next backward. A backward that
        raised midway (an out-of-memory error) never ran its end callback: its bucket order and counts go too, or the
        next backward would start at the bucket after its last launch and queue no end callback."""
        for b in self.buckets:
            b.reduced = False
            b.present = [False] * len(b.params)
            b.ready = 0
        self.reduced = False
        self._counts = None
        self._next, self._queued = 0, False


def _grad_dtype(p: torch.Tensor) -> torch.dtype | None:
    """The dtype ``p`` takes grads in: its ``grad_dtype``, its own dtype unless set (None: any)."""
    return p.grad_dtype if hasattr(p, "grad_dtype") else p.dtype


def _takes(p: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``p`` takes a grad of ``dtype``."""
    want = _grad_dtype(p)
    return want is None or want == dtype


def _dtype_changed(p: torch.Tensor, dtype: torch.dtype) -> str:
    if p.dtype == dtype:  # the param's grad_dtype was set to another
        return (
            f"kitsune: a {tuple(p.shape)} {p.dtype} param takes {_grad_dtype(p)} grads (p.grad_dtype), and ZeRO "
            f"reduces the grads in the params' dtype ({dtype} buckets): set p.grad_dtype = None under ZeRO, or keep "
            "the params in the grads' dtype. The grads of this backward are dropped; params and optimizer state are "
            "unchanged"
        )
    return (
        f"kitsune: a {tuple(p.shape)} param is {p.dtype} now, and ZeRO laid its grads out in {dtype} buckets when the "
        "optimizer was built (model.half() or model.to(dtype) after that?): its averaged grad cannot be its grad. "
        "Cast the model back (model.float()) and run the backward again, or convert the model before building the "
        "optimizer. The grads of this backward are dropped; params and optimizer state are unchanged"
    )
