"""How ZeRO lays the trainable params out over the ranks: buckets, each one flat buffer of ``world`` equal segments,
rank r owning segment r's elements (`partition`, `Layout`), and what one rank holds of a bucket (`Bucket`).

Cut by elements, a param may span two or more segments and every rank holds ``1/world`` of each bucket to within a
128-byte slot; params whose math needs the whole tensor (`whole_reason`) are dealt whole instead. The layout depends
only on shapes, dtypes and devices, so every rank computes the same one.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

ALIGN_BYTES = 128
"""Every param's slot in a bucket, and every segment, starts on a 128-byte boundary."""
ELEMENTWISE = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "Rprop", "ASGD")
)
"""torch's optimizers whose update of an element reads only that element (and per-param scalars such as ``step``):
cut by elements, each piece steps as the whole would. Exact classes only: a subclass may change the math."""


def whole_reason(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> str | None:
    """Why the params of ``group`` (of ``optimizer``) must stay whole on one rank, or None when a rank may update any
    range of their elements: the one place that decides (non-contiguous params are kept whole as well)."""
    from kitsune.optim import LAMB, LARS, Lion, Muon

    cls = type(optimizer)
    if cls is Muon:
        return "Muon orthogonalises whole matrices" if group.get("use_muon", True) else None
    if cls in (LAMB, LARS):
        return f"{cls.__name__}'s trust ratio needs the norms of whole params"
    if cls in ELEMENTWISE or cls is Lion:
        return None
    return (
        f"{cls.__name__} is not an optimizer kitsune knows to be elementwise (torch's SGD, Adam, AdamW, ... and "
        "kitsune's Lion are), so each of its params stays whole"
    )


NOT_CONTIGUOUS = "non-contiguous param: a rank's elements of it are not one flat view"


@dataclass(frozen=True)
class Layout:
    """One bucket's layout: its params (positions in the list partitioned), their sizes, where each starts in the
    bucket's flat buffer of ``world * seg`` elements, and whether they are dealt whole. Rank r owns the buffer's
    elements ``[r * seg, (r + 1) * seg)``."""

    indices: tuple[int, ...]
    numels: tuple[int, ...]
    starts: tuple[int, ...]
    seg: int
    whole: bool

    def range(self, k: int, rank: int) -> tuple[int, int]:
        """Rank ``rank``'s elements ``[lo, hi)`` of the bucket's ``k``-th param (``lo == hi``: none)."""
        start, n = self.starts[k], self.numels[k]
        return min(max(rank * self.seg - start, 0), n), min(max((rank + 1) * self.seg - start, 0), n)

    def updates(self, k: int, rank: int) -> bool:
        """Whether rank ``rank`` updates (some of) param ``k``: an empty param is updated by every rank."""
        lo, hi = self.range(k, rank)
        return hi > lo or self.numels[k] == 0


def partition(
    params: Sequence[torch.Tensor], world: int, bucket_bytes: int, whole: Sequence[bool] | None = None
) -> list[Layout]:
    """Cut ``params`` (in the order given) into buckets and lay each out over ``world`` ranks: by elements, or dealt
    whole where ``whole[i]``. Depends only on shapes, dtypes and devices (meta tensors do), so every rank computes
    the same partition."""
    keep = list(whole) if whole is not None else [False] * len(params)
    open_: dict[tuple, list[int]] = {}
    filled: dict[tuple, int] = defaultdict(int)
    cut: list[list[int]] = []
    for i, p in enumerate(params):
        key = (p.device, p.dtype, keep[i])
        if key not in open_:
            open_[key] = []
            cut.append(open_[key])
        open_[key].append(i)
        filled[key] += p.numel() * p.element_size()
        if filled[key] >= bucket_bytes:
            del open_[key]
            filled[key] = 0
    total = [0] * world  # elements per rank so far: the whole buckets break ties with it
    out = []
    for indices in cut:
        align = max(1, ALIGN_BYTES // params[indices[0]].element_size())
        numels = [params[i].numel() for i in indices]
        slots = [-(-max(n, 1) // align) * align for n in numels]
        if keep[indices[0]]:
            starts, seg = _deal(numels, slots, world, total)
        else:
            starts = list(accumulate(slots, initial=0))[:-1]
            seg = max(align, -(-(starts[-1] + numels[-1]) // (world * align)) * align)  # ceil(end / world), aligned
        layout = Layout(tuple(indices), tuple(numels), tuple(starts), seg, keep[indices[0]])
        if not layout.whole:
            total = [t + n for t, n in zip(total, elements_per_rank([layout], world), strict=True)]
        out.append(layout)
    return out


def _deal(numels: list[int], slots: list[int], world: int, total: list[int]) -> tuple[list[int], int]:
    """Whole params to ranks, largest first, each to the rank with the fewest elements in this bucket (ties: the
    fewest overall): each param's start in the bucket and the segment length (the longest rank's slots)."""
    load = [0] * world
    owner = [0] * len(numels)
    for k in sorted(range(len(numels)), key=lambda k: -numels[k]):
        r = min(range(world), key=lambda r: (load[r], total[r], r))
        owner[k] = r
        load[r] += slots[k]
        total[r] += numels[k]
    fill = [0] * world
    offsets = []
    for k, r in enumerate(owner):
        offsets.append(fill[r])
        fill[r] += slots[k]
    seg = max(fill)
    return [r * seg + off for r, off in zip(owner, offsets, strict=True)], seg


def elements_per_rank(layouts: Iterable[Layout], world: int) -> list[int]:
    """The elements each rank updates (and keeps state for) under ``layouts``."""
    out = [0] * world
    for layout in layouts:
        for r in range(world):
            out[r] += sum(hi - lo for lo, hi in (layout.range(k, r) for k in range(len(layout.numels))))
    return out


class Bucket:
    """One bucket on this rank: its params, their layout, what this rank updates of each, and the buffers."""

    def __init__(self, params: list[torch.Tensor], layout: Layout, rank: int, world: int):
        self.params, self.layout, self.rank, self.seg = params, layout, rank, layout.seg
        self.device, self.dtype = params[0].device, params[0].dtype
        self.ranges = [layout.range(k, rank) for k in range(len(params))]
        """This rank's elements ``[lo, hi)`` of each param."""
        self.steps = [k for k in range(len(params)) if layout.updates(k, rank)]
        """The params this rank updates (all or some of the elements of)."""
        self.others = [k for k, (lo, hi) in enumerate(self.ranges) if hi - lo < params[k].numel()]
        """The params with elements of other ranks: the all-gather writes those."""
        self.targets: dict[int, torch.Tensor] = {}
        """For each of ``steps``: what the step updates, the param itself or its shard param."""
        self.spans = _spans(layout, world)
        """Stage 1's all-reduces: the buffer's ranges that hold params, padding at the ends of segments left out."""
        self.flat: torch.Tensor | None = None
        """Stage 1: the grads of every param in the bucket, ``world * seg`` elements, kept between steps."""
        self.shard: torch.Tensor | None = None
        """Stage 2: this rank's segment of the reduced grads, ``seg`` elements, kept between steps."""
        self.views: list[torch.Tensor] = []
        """Stage 1: each param's grad in ``flat``, as the param's shape."""
        self.grads: dict[int, torch.Tensor] = {}
        """The grad of each of ``targets``: its slice of ``flat`` (stage 1) or of ``shard`` (stage 2)."""
        self.present = [False] * len(params)
        """Whether each param had a grad on this rank in a backward since the last step."""
        self.pending: list[tuple[Any, torch.Tensor | None, torch.Tensor | None]] = []
        self.ready = 0
        self.reduced = False
        """Reduced since the last step (stage 2 then adds a further reduction instead of overwriting it)."""

    def view(self, buf: torch.Tensor, k: int, offset: int = 0) -> torch.Tensor:
        """Param ``k``'s slot in ``buf`` as the param's shape; ``offset``: the bucket element ``buf`` starts at."""
        p, s = self.params[k], self.layout.starts[k] - offset
        return buf[s : s + p.numel()].view(p.shape)

    def piece(self, buf: torch.Tensor, k: int, offset: int = 0) -> torch.Tensor:
        """This rank's elements of param ``k`` in ``buf``, flat."""
        (lo, hi), s = self.ranges[k], self.layout.starts[k] - offset
        return buf[s + lo : s + hi]

    def bind(self, buf: torch.Tensor, offset: int | None = None) -> None:
        """Point the grads of ``targets`` into the stage's kept buffer once, when it is allocated: stage 1's whole
        ``flat`` (``offset`` None: every param gets its view), or stage 2's shard, which starts at bucket element
        ``offset``."""
        if offset is None:
            self.views = [self.view(buf, k) for k in range(len(self.params))]
        at = offset or 0
        self.grads = {
            k: (self.views[k] if offset is None else self.view(buf, k, at))
            if t is self.params[k]
            else self.piece(buf, k, at)
            for k, t in self.targets.items()
        }


def _spans(layout: Layout, world: int) -> list[tuple[int, int]]:
    seg = layout.seg
    used = [0] * world
    for s, n in zip(layout.starts, layout.numels, strict=True):
        for r in range(s // seg, (s + n - 1) // seg + 1) if n else ():
            used[r] = max(used[r], min(s + n, (r + 1) * seg) - r * seg)
    spans: list[tuple[int, int]] = []
    for r, u in enumerate(used):
        if not u:
            continue
        if spans and spans[-1][1] == r * seg:  # the segment before is full: one all-reduce for both
            spans[-1] = (spans[-1][0], r * seg + u)
        else:
            spans.append((r * seg, r * seg + u))
    return spans
