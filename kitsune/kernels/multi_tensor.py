"""Multi-tensor apply through device-side tables: one launch covers any number of tensors.

A launch over T tensors needs, on the device:

* per role (param, grad, each state tensor, the step count) an ``(T,)`` int64 table of base addresses; the kernel
  loads an address and casts it with ``.to(tl.pointer_type(...))``, so there is no 4 KB kernel-argument limit and
  no chunked relaunch;
* a block map: program ``b`` works on tensor ``block_tensor[b]`` from element ``block_start[b]`` (int64, so one
  tensor may hold more than 2**31 elements); every tensor, even an empty one, gets at least one block so that its
  per-tensor bookkeeping (the step count) still runs;
* per tensor: ``numel`` (int64), ``group`` (int32, the row of the hyperparameter buffer) and a zeroed int32
  ``counter`` the kernel uses to find the last block of a tensor.

Everything but the grad table is built once per plan. Grads may be re-allocated every step
(``zero_grad(set_to_none=True)``), so `TensorTables.set_role` compares the new address list with the cached
one (a C-speed list compare) and uploads one small table only when it changed; a caller that reads the new
addresses in C++ writes them straight into the role's page-locked staging tensor (`TensorTables.staging`), which the
upload copies from with no host copy, list or driver query.
"""

from __future__ import annotations

import ctypes
import math
from array import array
from collections.abc import Sequence
from typing import Any

import torch

DEFAULT_BLOCK = 1024
"""Elements per program: 4 KB of fp32 per role, large enough to stream at full bandwidth with 4 warps."""

DEAD = -1
"""Grad address of a tensor whose grad is None this step: its blocks do nothing (0 is a valid empty-tensor address)."""


def int64_tensor(values: Sequence[int]) -> torch.Tensor:
    """``values`` as a CPU int64 tensor: array('q') and frombuffer avoid torch.tensor's per-element Python conversion
    (about 10x faster on 2000 ints)."""
    return array_tensor(array("q", values), torch.int64)


def array_tensor(values: array, dtype: torch.dtype) -> torch.Tensor:
    """A 1-d CPU tensor over a Python array's own memory (its items ``dtype``'s), with no copy; an empty one for an
    empty array, which ``torch.frombuffer`` refuses."""
    return torch.frombuffer(values, dtype=dtype) if values else torch.empty(0, dtype=dtype)


def host_tensor(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised CPU tensor for values bound for ``device``: page-locked where that is a GPU. A copy from
    pageable memory first waits for the stream to drain (CUDA stages it synchronously), which would stall a host
    that is queueing work ahead, e.g. inside backward; from page-locked memory it is queued, and torch's pinned-memory
    cache keeps the block until the copy has read it."""
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=device.type == "cuda")


class UploadRing:
    """Host slots for an upload of one shape repeated step after step (an LR scheduler's new hyperparameters, the
    grad table of grads that moved), used in turn: page-locked where the upload goes to a GPU. A new page-locked block
    per upload costs torch's pinned-memory cache its bookkeeping, a slot a copy of the values on the host.

    A slot is written again only once the copy that read it is done. The slots are taken in stretches: when a stretch
    is full, an event is recorded on each stream its copies were queued on, and the first write into a stretch waits
    for the events recorded when it was last filled: long done, unless the host ran a whole lap, less a stretch,
    ahead of the device, and then waiting is what keeps the values right. On a CPU the copies are done when `send`
    returns, and nothing waits.

    The slot sent last stays as it is until ``slots - 1`` more are sent: a caller may keep it as the record of what
    the device holds until its next upload."""

    BUDGET = 1 << 20
    """Bytes of host memory a ring on a GPU takes at most, where its shape allows eight slots (it has eight at
    least)."""
    MAX_SLOTS = 32
    """Slots a ring on a GPU has at most: the host waits only when it runs 28 uploads (steps) ahead of the device.
    Each slot is a tensor and a memoryview on the host (a few hundred bytes of objects whatever its size): 256 took
    0.2 MB a ring, 0.8 MB an optimizer, which an optimizer per param (torch's optimizer-in-backward recipe) made
    hundreds of megabytes. On a CPU a ring has two: the record of what the device holds and the next."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> None:
        self.shape = tuple(shape)
        self.dtype = dtype
        self.device = device
        self._count = math.prod(self.shape)
        self._nbytes = self._count * dtype.itemsize
        self._cuda = device.type == "cuda"
        slots = self.MAX_SLOTS if self._cuda else 2  # on a CPU each copy is done when `send` returns
        while slots > 8 and slots * self._nbytes > self.BUDGET:
            slots //= 2
        self.slots = slots
        self._fence = max(1, slots // 8)  # slots a stretch
        self._slots: list[torch.Tensor] = []  # made at the first use, as tensors (the copies' sources) ...
        self._bytes: list[memoryview] = []  # ... and as the host's bytes (an array's values' destination)
        self._next = 0
        self._fences: list[list[torch.cuda.Event]] = [[] for _ in range(8)]
        self._queued: set[int] = set()  # the streams this stretch's copies were queued on (raw handles)
        self._streams: dict[int, torch.cuda.Stream] = {}  # every stream seen, by raw handle: an event is recorded on it

    def slot(self) -> torch.Tensor:
        """The slot the next `send` copies from, for the caller to fill (a native read writes into it): the same until
        then, free of any copy still to read it."""
        if not self._slots:
            block = host_tensor((self.slots, *self.shape), self.dtype, self.device)
            self._slots = list(block.unbind(0))
            if self._nbytes:
                whole = (ctypes.c_char * (self.slots * self._nbytes)).from_address(block.data_ptr())
                flat = memoryview(whole).cast("B")  # keeps nothing alive: the slots' tensors keep the block
                self._bytes = [flat[k * self._nbytes : (k + 1) * self._nbytes] for k in range(self.slots)]
        k = self._next
        if self._cuda and k % self._fence == 0:  # a stretch's last lap: its copies must be done (asked again, none)
            stretch = self._fences[k // self._fence]
            for event in stretch:
                event.synchronize()
            stretch.clear()
        return self._slots[k]

    def send(self, out: torch.Tensor) -> torch.Tensor:
        """Copy the next slot (`slot`) into ``out`` (a tensor of the ring's shape and dtype on its device), queued
        behind the work on ``out``'s current stream; return the slot, which stays as it is until ``slots - 1`` more
        are sent."""
        host = self.slot()
        k = self._next
        if not self._cuda:
            out.copy_(host)
        else:
            index = out.get_device()
            raw = torch._C._cuda_getCurrentRawStream(index)  # the handle: current_stream's object costs ~5 us
            if raw not in self._streams:
                self._streams[raw] = torch.cuda.current_stream(index)
            self._queued.add(raw)
            out.copy_(host, non_blocking=True)
            if k % self._fence == self._fence - 1:
                for queued in self._queued:
                    event = torch.cuda.Event()
                    event.record(self._streams[queued])
                    self._fences[k // self._fence].append(event)
                self._queued = set()
        self._next = (k + 1) % self.slots
        return host

    def upload(self, values: array, out: torch.Tensor) -> torch.Tensor:
        """`send` ``values`` (a Python array of ``dtype``'s items, as many as ``shape`` holds) into ``out``; return
        the slot they were sent from."""
        if len(values) != self._count or values.itemsize != self.dtype.itemsize:
            size = f"{len(values)} values of {values.itemsize} bytes"
            raise ValueError(f"{size} for a {self.dtype} upload of {self.shape}")
        self.slot()
        if values:
            self._bytes[self._next][:] = memoryview(values).cast("B")
        return self.send(out)


def block_map(numels: Sequence[int], block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block_tensor, block_start)`` for tensors of the given sizes: (n_blocks,) int32 and (n_blocks,) int64."""
    n = torch.tensor(list(numels), dtype=torch.int64)
    blocks = torch.clamp((n + block - 1) // block, min=1)  # an empty tensor still gets one (all-masked) block
    tensor_idx = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int64), blocks)
    first = torch.cumsum(blocks, 0) - blocks  # index of each tensor's first block
    start = (torch.arange(tensor_idx.numel(), dtype=torch.int64) - first[tensor_idx]) * block
    return tensor_idx.to(torch.int32), start


class TensorTables:
    """The device-side tables of one multi-tensor launch (see the module docstring)."""

    def __init__(
        self, device: torch.device, numels: Sequence[int], groups: Sequence[int], block: int = DEFAULT_BLOCK
    ) -> None:
        if len(numels) != len(groups):
            raise ValueError(f"numels ({len(numels)}) and groups ({len(groups)}) must have one entry per tensor")
        self.device = device
        self.block = block
        self.num_tensors = len(numels)
        self.numel_gcd = math.gcd(*numels)
        """The largest integer that divides every tensor's element count (0 for no tensors)."""
        block_tensor, block_start = block_map(numels, block)
        self.num_blocks = block_tensor.numel()
        self.block_tensor = block_tensor.to(device)  # (n_blocks,) int32
        self.block_start = block_start.to(device)  # (n_blocks,) int64 element offsets
        self.numel = torch.tensor(list(numels), dtype=torch.int64).to(device)  # (T,) int64
        self.group = torch.tensor(list(groups), dtype=torch.int32).to(device)  # (T,) int32
        self.counter = torch.zeros(self.num_tensors, dtype=torch.int32, device=device)  # (T,) finished blocks
        self._roles: dict[str, torch.Tensor] = {}
        self._cached: dict[str, list[int]] = {}
        self._hosts: dict[str, torch.Tensor] = {}  # each role's addresses as last set, a CPU int64 tensor
        self._low: dict[str, int | None] = {}  # each role's low bits as last given to `set_role`
        self._aligned: dict[tuple[str, int], bool] = {}  # `aligned`'s answers per role until the role moves
        self.layout: tuple[Any, ...] | None = None
        """A launcher's last answer about its layout over these addresses (what it asked, ..., the answer), its to
        read and write; None again whenever a role moves (`kitsune.kernels.update.grad_vector`)."""
        self._scratch: dict[str, torch.Tensor] = {}
        self._rings: dict[str, UploadRing] = {}  # each role's host slots: its `staging` tensor, its uploads' sources
        self.uploads = 0
        """Address tables copied to the device so far (plan-time tables included)."""

    def set_role(
        self, role: str, addresses: list[int] | None, host: torch.Tensor | None = None, low_bits: int | None = None
    ) -> bool:
        """Point ``role`` at these (T,) addresses; upload only if they differ from the cached ones. ``host``: the same
        addresses as a CPU int64 tensor the caller has built already (kept; the caller must not change it); with
        ``addresses`` None, ``host`` alone, addresses the caller knows to differ from the last ones (a native read
        that found the grads moved): uploaded with no list made or compared. ``low_bits``: the OR of the addresses'
        low six bits, where the caller knows it (`kitsune._native.follow` does): `aligned` then answers from it.
        ``host`` may be the role's `staging` tensor: uploaded from where it is, with no copy on the host."""
        if addresses is None:
            if host is None:
                raise ValueError(f"role {role!r}: no addresses and no host tensor")
            count = host.numel()
        elif self._cached.get(role) == addresses:
            return False
        else:
            count = len(addresses)
        if count != self.num_tensors:
            raise ValueError(f"role {role!r}: {count} addresses for {self.num_tensors} tensors")
        table = self._roles.get(role)
        staged = host is not None and role in self._rings and host is self._rings[role].slot()  # `staging`'s
        if table is None and not staged:  # the role's first: a table kept from now on (a graph may hold its address)
            host = int64_tensor(addresses) if host is None else host  # type: ignore[arg-type]
            self._roles[role] = host.to(self.device, copy=True)
        else:  # a role set again (the grads that moved) has host slots of its own (`UploadRing`)
            if table is None:
                table = self._roles[role] = torch.empty((count,), dtype=torch.int64, device=self.device)
            ring = self._ring(role)
            if host is None:
                host = ring.upload(array("q", addresses), table)  # type: ignore[arg-type]
            elif staged:  # uploaded from where it is
                ring.send(table)
            else:  # the caller's tensor (another table's record) stays the record, as the caller keeps it unchanged
                ring.slot().copy_(host)
                ring.send(table)
        if addresses is None:
            self._cached.pop(role, None)  # made from ``host`` if asked (`addresses`)
        else:
            self._cached[role] = addresses
        self._hosts[role] = host
        self._aligned = {key: ok for key, ok in self._aligned.items() if key[0] != role}
        self.layout = None
        self._low[role] = low_bits
        self.uploads += 1
        return True

    def staging(self, role: str) -> torch.Tensor:
        """A CPU int64 tensor of one address per tensor, for a caller to write ``role``'s next addresses into (a
        native read) and hand to `set_role` as ``host``: page-locked where the tables live on a GPU, so the upload
        copies straight from it. The same tensor until `set_role` takes it (it is then the role's record, which an
        upload in flight may still read), another after: the next slot of the role's `UploadRing`."""
        return self._ring(role).slot()

    def _ring(self, role: str) -> UploadRing:
        ring = self._rings.get(role)
        if ring is None:
            ring = self._rings[role] = UploadRing((self.num_tensors,), torch.int64, self.device)
        return ring

    def addresses(self, role: str) -> list[int] | None:
        """``role``'s addresses as last set, as a list (None before the first): made from its host tensor, once,
        where `set_role` was given that alone."""
        cached = self._cached.get(role)
        if cached is None and (host := self._hosts.get(role)) is not None:
            cached = self._cached[role] = host.tolist()  # what the device table holds
        return cached

    def host(self, role: str) -> tuple[torch.Tensor | None, int | None]:
        """``role``'s addresses as last set, as a CPU int64 tensor (None before the first), and their low bits where
        `set_role` was given them (else None)."""
        return self._hosts.get(role), self._low.get(role)

    def aligned(self, roles: Sequence[str], nbytes: int) -> bool:
        """Whether every address of these roles, as last set, is a multiple of ``nbytes`` (a tensor skipped with
        `DEAD` counts as aligned). Kept until one of the roles is set to other addresses: a launch asks every step."""
        return all(self._role_aligned(role, nbytes) for role in roles)

    def _role_aligned(self, role: str, nbytes: int) -> bool:
        """`aligned` for one role, kept per role: a role that moves (the grads, every step they are re-allocated
        elsewhere) is answered again, from the low bits `set_role` was given or in three tensor operations over its
        addresses, and the others stand."""
        key = (role, nbytes)
        ok = self._aligned.get(key)
        if ok is None:
            host, low = self._hosts.get(role), self._low.get(role)
            if low is not None and nbytes <= 64 and nbytes & (nbytes - 1) == 0:  # OR of the low six bits
                ok = low % nbytes == 0
            else:
                ok = nbytes == 1 if host is None else bool(((host % nbytes == 0) | (host == DEAD)).all())
            self._aligned[key] = ok
        return ok

    def scratch(self, name: str, n: int) -> torch.Tensor:
        """A float32 device buffer of ``n`` elements that lives with these tables (created on first use)."""
        buf = self._scratch.get(name)
        if buf is None or buf.numel() != n:
            buf = self._scratch[name] = torch.zeros(n, dtype=torch.float32, device=self.device)
        return buf

    def role(self, role: str) -> torch.Tensor:
        """The (T,) int64 device table of ``role``."""
        return self._roles[role]

    def has_role(self, role: str) -> bool:
        return role in self._roles
