"""The memory pool: optimizer state (and optionally grads) of the fused params in flat per-(device, dtype) arenas.

Every pooled param's state tensor is a view of its arena, so ``optimizer.state[p]["exp_avg"]`` keeps torch's key,
shape and dtype and a state dict moves between kitsune and plain torch as before. What the arenas change is where
the bytes live: one allocation per (device, dtype) instead of one per tensor, at addresses that never move, so the
kernels' address tables are built once and a captured CUDA graph keeps reading the right memory.

``memory_pool_size`` caps the arena bytes per device. The fused units are pooled whole, in plan order, while they
fit; a unit that does not fit keeps torch's per-tensor allocations, and the report says how many params and bytes
stayed outside. An arena is allocated when the first of its states is created (the first step that has grads, as
torch's lazy init), or at once when the wrapped optimizer already holds state (a loaded checkpoint, Adagrad).

With ``MemoryConfig(flat_grads=True)`` the grads of pooled params live in a flat arena too: the first time a grad
appears it is copied into its slot and ``p.grad`` becomes that view; backward passes then accumulate into it in
place, and ``zero_grad()`` zeroes each arena in one fill instead of freeing the grads. That is torch's
``zero_grad(set_to_none=False)`` behaviour: a param that gets no grad in a later step is updated with a zero grad.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kitsune._native import MEMORY_FORMATS
from kitsune.config import MemoryConfig
from kitsune.subsystem import Subsystem

if TYPE_CHECKING:
    from kitsune.fusion.units import FusedUnit

ALIGN_BYTES = 256
"""Every slot starts on a 256-byte boundary, as the CUDA caching allocator aligns its blocks."""


_NO_ROOM = -1
"""The offset of a slot given no room in its arena (a frozen param's)."""


class Arena:
    """One flat buffer of one dtype on one device; slots are reserved first, the buffer allocated on first use."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        self.numel = 0
        self.buffer: torch.Tensor | None = None
        self.element_size = torch.empty((), dtype=dtype).element_size()
        self._align = max(1, ALIGN_BYTES // self.element_size)

    def reserve(self, numel: int) -> int:
        """Room for ``numel`` elements; returns the slot's offset (aligned)."""
        offset = self.numel
        self.numel += -(-max(numel, 1) // self._align) * self._align
        return offset

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size

    def view(self, offset: int, shape: torch.Size, layout: int = 0) -> torch.Tensor:
        """The slot at ``offset`` as a tensor of ``shape`` whose elements lie in the order of layout code ``layout``
        (`kitsune._native.layout_code`: row-major, or channels_last as its param's)."""
        if self.buffer is None:  # zero-filled so unused padding never holds nan
            self.buffer = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        if not shape:
            return self.buffer[offset]
        if layout:
            return self.buffer.as_strided(shape, _strides(shape, layout), offset)
        return self.buffer[offset : offset + shape.numel()].view(shape)

    def holds(self, t: torch.Tensor, offset: int) -> bool:
        """Whether ``t`` still lies at the slot at ``offset``: a view of the arena whose storage nobody swapped
        (``t.data = ...``, which ``model.to(...)`` does to grads, leaves the same tensor object elsewhere)."""
        buffer = self.buffer
        return (
            buffer is not None
            and t.dtype == self.dtype
            and t.data_ptr() == buffer.data_ptr() + offset * self.element_size
            and t.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        )


class UnitSlots:
    """Where one fused unit's tensors live: an arena and offset per (state entry, param), per (per-tensor scalar,
    param): the step count and the others (`AlgoInfo.scalar_keys`) in the float32 step arena, and per grad.

    A state entry is what ``optimizer.state[p]`` holds for a state key in the unit's format
    (`kitsune.fusion.state_format.entries`): the key itself in the param's dtype, in bf16 or fp32, or for 8-bit
    state ``{key}_codes`` (uint8) and ``{key}_absmax`` (fp32); ``arena_for(dtype)`` gives each its dtype's arena."""

    def __init__(
        self,
        unit: FusedUnit,
        arena_for: Callable[[torch.dtype], Arena],
        step_arena: Arena | None,
        grad_arena: Arena | None,
    ):
        from kitsune.fusion.algos import extra_keys
        from kitsune.fusion.state_format import entries
        from kitsune.kernels.spec import StateFormat

        self.params = unit.params
        self.keys = [k for k in unit.info.state_keys(unit.spec) if k]
        self.step_arena, self.grad_arena = step_arena, grad_arena
        self.offsets: dict[str, list[tuple[Arena, int, torch.Size, torch.dtype, int]]] = defaultdict(list)
        """Per state entry name: each param's (arena, offset, shape, dtype, layout code); offset `_NO_ROOM` for a
        frozen param."""
        extra = extra_keys(unit.spec)  # the Kahan compensation, in the param's dtype whatever the state's format
        # a frozen param (requires_grad=False) gets no state while it stays frozen, as in torch: no room for it (a
        # frozen backbone would fill the arena, and every saved state dict, with zeros); unfrozen, its state gets
        # tensors of its own until a plan lays it out
        trainable = [p.requires_grad for p in unit.params]
        self.layouts = unit.layouts
        for p, room, layout in zip(unit.params, trainable, self.layouts, strict=True):
            for key, fmt in [(k, unit.spec.state) for k in self.keys] + [(k, StateFormat.PARAM) for k in extra]:
                for name, dtype, shape in entries(key, fmt, p):
                    arena = arena_for(dtype)
                    offset = arena.reserve(shape.numel()) if room else _NO_ROOM
                    # a state entry of the param's shape lies in its order (the kernels walk both as flat memory)
                    self.offsets[name].append((arena, offset, shape, dtype, layout if shape == p.shape else 0))
        numels = [p.numel() for p in unit.params]
        self.scalar_offsets = (
            {k: [step_arena.reserve(1) if t else _NO_ROOM for t in trainable] for k in unit.info.scalars}
            if step_arena is not None
            else {}
        )
        self.grad_offsets = (  # a frozen param's grad, should one be set by hand, keeps its own memory
            [grad_arena.reserve(n) if t else _NO_ROOM for n, t in zip(numels, trainable, strict=True)]
            if grad_arena is not None
            else []
        )
        self._views: dict[tuple[str, int], weakref.ref] = {}
        """Weak, like the grads': a state view the user replaced in ``optimizer.state`` is freed, which the unit
        watching its state sees (`kitsune.fusion.units.FusedUnit.bind`)."""
        self._grad_refs: dict[int, weakref.ref] = {}
        self.adoptions = 0
        """Grads copied into the grad arena (counted by the unit)."""

    def view(self, key: str, i: int, claim: bool = False) -> torch.Tensor:
        """The arena view that holds ``state[params[i]][key]`` (``"step"`` and the other scalars: a 0-dim float32
        view). ``claim``: the caller writes new state there (lazy init, a load). A view still alive then is not the
        state's any more (the state was cleared, deleted or loaded over) but is held elsewhere (a ``state_dict()``
        taken before holds the very tensors, as torch's would): writing there would change what they hold, so the
        new state gets a tensor of its own, as torch's lazy init and load give it."""
        ref = self._views.get((key, i))
        v = ref() if ref is not None else None
        if v is not None and claim:
            return self._own(key, i)
        if v is None:
            if key in self.scalar_offsets:
                assert self.step_arena is not None
                offset = self.scalar_offsets[key][i]
                v = self.step_arena.view(offset, torch.Size()) if offset != _NO_ROOM else self._own(key, i)
            else:
                arena, offset, shape, _, layout = self.offsets[key][i]
                v = arena.view(offset, shape, layout) if offset != _NO_ROOM else self._own(key, i)
            self._views[(key, i)] = weakref.ref(v)
        return v

    def _own(self, key: str, i: int) -> torch.Tensor:
        """A zeroed tensor of its own for ``state[params[i]][key]``, in the slot's dtype, shape, order and device."""
        if key in self.scalar_offsets:
            assert self.step_arena is not None
            return torch.zeros((), dtype=torch.float32, device=self.step_arena.device)
        arena, _, shape, dtype, layout = self.offsets[key][i]
        return torch.empty(shape, dtype=dtype, device=arena.device, memory_format=MEMORY_FORMATS[layout]).zero_()

    def grad_view(self, i: int) -> torch.Tensor:
        """The arena view for ``params[i]``'s grad: the one ``p.grad`` holds, or a new one. The slots keep only a
        weak reference, so a grad set to None is freed (a static-address unit watches for that)."""
        v = self._held_grad(i)
        if v is None:
            assert self.grad_arena is not None
            v = self.grad_arena.view(self.grad_offsets[i], self.params[i].shape, self.layouts[i])
            self._grad_refs[i] = weakref.ref(v)
        return v

    def has_grad_room(self, i: int) -> bool:
        """Whether ``params[i]``'s grad has a slot (flat grads; not a param frozen when the pool laid it out)."""
        return bool(self.grad_offsets) and self.grad_offsets[i] != _NO_ROOM

    def _held_grad(self, i: int) -> torch.Tensor | None:
        """The live view of ``params[i]``'s grad slot, if one is; a view whose storage was swapped since
        (``grad.data = ...``) lies elsewhere now, with its own memory, and is forgotten."""
        ref = self._grad_refs.get(i)
        v = ref() if ref is not None else None
        if v is not None and not self.grad_arena.holds(v, self.grad_offsets[i]):  # type: ignore[union-attr]
            del self._grad_refs[i]
            return None
        return v

    def release_grad(self, i: int) -> None:
        """Where the view of ``params[i]``'s grad slot is still held elsewhere while ``p.grad`` is another tensor
        (``p.grad`` set to None or replaced by hand, the old grad kept by the user): give that view memory of its
        own, with its values, before the slot takes the next grad or the arena is zeroed, so the kept tensor stays
        as torch leaves a grad it no longer holds."""
        v = self._held_grad(i)
        if v is not None and self.params[i].grad is not v:
            v.data = v.detach().clone()
            del self._grad_refs[i]

    def holds_grad(self, i: int, grad: torch.Tensor) -> bool:
        """Whether ``grad`` is the arena view of ``params[i]``'s grad (and still lies in its slot)."""
        return self._held_grad(i) is grad

    def alloc(self, i: int) -> Any:
        """An allocator for `kitsune.fusion.algos.init_state`: state key -> this param's arena view."""
        return lambda key: self.view(key, i, claim=True)

    def adopt(self, state: dict, i: int, key: str) -> torch.Tensor:
        """Make ``state[key]`` the arena view, copying in whatever tensor stands there (a loaded checkpoint's, already
        in the view's format: `kitsune.fusion.state_format.conform` converts it first)."""
        t = state[key]
        ref = self._views.get((key, i))
        if ref is not None and ref() is t:
            return t
        v = self.view(key, i, claim=True)  # never ``t``: a new view, or a tensor of its own
        with torch.no_grad():
            v.copy_(t.reshape(v.shape) if key in self.scalar_offsets else t)
        state[key] = v
        return v

    def adopt_grad(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        """Put this param's grad into its arena slot; returns the view that is now ``p.grad``. Its values only: a
        grad that carries a graph (``backward(create_graph=True)``) leaves the graph behind, so the arena never
        joins one (as ``zero_grad()`` detaches such a grad)."""
        self.release_grad(i)
        v = self.grad_view(i)
        if grad is not v:
            with torch.no_grad():
                v.copy_(grad)
            self.params[i].grad = v
        return v


class _Reservations:
    """The arenas one unit reserves room in (taken from ``arenas`` or new), and their sizes before it."""

    def __init__(self, arenas: dict[tuple, Arena], device: torch.device) -> None:
        self._known, self.device = arenas, device
        self._before: dict[tuple, tuple[Arena, int]] = {}

    def arena(self, key: tuple, dtype: torch.dtype) -> Arena:
        if key not in self._before:
            a = self._known.get(key) or Arena(self.device, dtype)
            self._before[key] = (a, a.numel)
        return self._before[key][0]

    def state(self, dtype: torch.dtype) -> Arena:
        """The state arena of ``dtype`` on this device."""
        return self.arena((self.device, dtype), dtype)

    def slots(self, unit: FusedUnit, flat_grads: bool) -> UnitSlots:
        """Reserve ``unit``'s state, step counts and (with ``flat_grads``) grads in these arenas."""
        dev = self.device
        step = self.arena((dev, torch.float32, "step"), torch.float32) if unit.info.scalars else None
        grad = self.arena((dev, unit.dtype, "grad"), unit.dtype) if flat_grads else None
        return UnitSlots(unit, self.state, step, grad)

    @property
    def arenas(self) -> dict[tuple, Arena]:
        return {key: a for key, (a, _) in self._before.items()}

    @property
    def nbytes(self) -> int:
        """Bytes reserved since the arenas were taken."""
        return sum((a.numel - before) * a.element_size for a, before in self._before.values())

    def undo(self) -> None:
        """Give the room back (the arenas are still unallocated)."""
        for a, before in self._before.values():
            a.numel = before


class MemoryPool(Subsystem):
    """Flat arenas for the state (and optionally the grads) of the params the fused kernel updates: an allocator the
    fused executor is handed, which lays out its units in `assign` at every plan."""

    name = "memory"

    def __init__(self, config: MemoryConfig) -> None:
        super().__init__()
        self.config = config
        self._arenas: dict[tuple, Arena] = {}
        self._layout: tuple = ()
        self._units: list[FusedUnit] = []
        self._outside: list[FusedUnit] = []
        self.deactivate("fusion is off: optimizer state stays in the wrapped optimizer's own tensors")

    def assign(self, units: list[FusedUnit]) -> None:
        """Lay out the arenas for ``units`` (fusion's plan calls this); a layout equal to the last one keeps its
        arenas and views, so a re-plan that changed nothing copies nothing."""
        cfg = self.config
        for unit in units:
            unit.slots = None
        if cfg.pool_size == 0:
            self._units, self._outside = [], list(units)
            self.deactivate("memory_pool_size=0: optimizer state stays in per-tensor allocations")
            return
        if not units:  # the arenas go with the last units (state still in their views keeps its own storage alive)
            self._arenas, self._units, self._outside, self._layout, self._slots = {}, [], [], (), []
            self.deactivate("no param takes the fused kernel, so no state is kitsune's to place")
            return
        layout = tuple(
            (str(u.device), u.dtype, u.info.name, tuple(k for k in u.info.state_keys(u.spec) if k), u.spec.state,
             getattr(u.spec, "kahan", False), u.info.scalars, tuple(map(id, u.params)),
             tuple(p.shape for p in u.params), tuple(p.requires_grad for p in u.params), tuple(u.layouts))
            for u in units
        )  # fmt: skip
        if layout == self._layout:  # and so the same verdict: pooled as before, or nothing fit then either
            for unit, slots in zip(units, self._slots, strict=True):
                unit.slots = slots
            return
        budget: dict[torch.device, int] = defaultdict(lambda: cfg.pool_size)
        arenas: dict[tuple, Arena] = {}
        pooled, outside, slots_of = [], [], []
        for unit in units:
            dev = unit.device
            res = _Reservations(arenas, dev)
            slots = res.slots(unit, cfg.flat_grads)
            if res.nbytes > budget[dev]:  # does not fit: keep torch's allocations
                res.undo()
                outside.append(unit)
                slots_of.append(None)
                continue
            budget[dev] -= res.nbytes
            arenas.update(res.arenas)
            unit.slots = slots
            pooled.append(unit)
            slots_of.append(slots)
        self._arenas, self._units, self._outside = arenas, pooled, outside
        self._layout, self._slots = layout, slots_of
        if pooled:
            self.activate()
        else:
            need = min(_unit_bytes(u, cfg.flat_grads) for u in units)
            self.deactivate(
                f"memory_pool_size={cfg.pool_size} bytes is below the smallest fused unit's {need} bytes of state: "
                "raise memory_pool_size (or lower FusionConfig.max_fusion_size to make units smaller)"
            )

    # -- grads -----------------------------------------------------------------------------------------------------
    @property
    def flat_grads(self) -> bool:
        return self.active and self.config.flat_grads

    def zero_grads(self, already_zero: set[torch.Tensor] = frozenset()) -> set[torch.Tensor]:  # type: ignore[assignment]
        """Zero every grad arena in one fill (none when the step's kernel already zeroed every grad in them);
        returns the params whose grads that covers (those still arena views)."""
        covered: set[torch.Tensor] = set()
        if not self.flat_grads:
            return covered
        for unit in self._units:
            slots = unit.slots
            for i, p in enumerate(unit.params):
                g = p.grad
                if g is not None and slots.holds_grad(i, g):
                    covered.add(p)
                else:  # the arena's fill below must not zero an old grad the user kept
                    slots.release_grad(i)
        if covered <= already_zero:
            return covered
        for (_, _, *kind), arena in self._arenas.items():
            if kind == ["grad"] and arena.buffer is not None:
                with torch.no_grad():
                    arena.buffer.zero_()
        return covered

    def report(self) -> dict[str, Any]:
        pooled = sum(len(u.params) for u in self._units)
        outside = sum(len(u.params) for u in self._outside)
        per_device: dict[str, dict[str, int]] = defaultdict(lambda: {"reserved": 0, "allocated": 0})
        for (dev, *_), arena in self._arenas.items():
            entry = per_device[str(dev)]
            entry["reserved"] += arena.nbytes
            entry["allocated"] += arena.nbytes if arena.buffer is not None else 0
        return {
            "pool_size_bytes": self.config.pool_size,
            "arenas": len(self._arenas),
            "bytes_per_device": dict(per_device),
            "params_pooled": pooled,
            "params_outside_pool": outside,
            "bytes_outside_pool": sum(_unit_bytes(u, self.config.flat_grads) for u in self._outside),
            "flat_grads": self.config.flat_grads,
            "grad_adoptions": sum(u.slots.adoptions for u in self._units if u.slots is not None),
        }


def _unit_bytes(unit: FusedUnit, flat_grads: bool) -> int:
    """Bytes a unit's state (and grads) take, as the pool would lay them out."""
    res = _Reservations({}, unit.device)
    res.slots(unit, flat_grads)
    return res.nbytes


def _strides(shape: torch.Size, layout: int) -> tuple[int, ...]:
    """The strides of a dense tensor of ``shape`` whose elements lie in the order of layout code ``layout``."""
    return torch.empty(shape, device="meta", memory_format=MEMORY_FORMATS[layout]).stride()
