"""The device-resident step context: every param group's hyperparameters in one small float64 buffer.

Kernels read lr, betas, eps, ... from here through each tensor's group index, so an LR scheduler (which writes
``param_groups[i]['lr']``; OneCycleLR also writes betas/momentum) changes numbers, never compiled code. A step
refreshes the buffer with at most one host-to-device copy, and only when a host value changed: the group values
are compared with a cached tuple first (a few dict reads per group). Hyperparameters given as device tensors
(``lr=torch.tensor(1e-3, device='cuda')``) are copied device-to-device every step instead, as the host cannot
see their value without a sync.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kitsune.kernels.multi_tensor import UploadRing, array_tensor
from kitsune.kernels.spec import NUM_FIELDS


class DeviceContext:
    """The ``(n_groups, NUM_FIELDS)`` float64 hyperparameter buffer on one device."""

    def __init__(
        self,
        device: torch.device,
        row: Callable[[dict[str, Any]], tuple[Any, ...]],
        check: Callable[[dict[str, Any], str], None] | None = None,
    ) -> None:
        self.device = device
        self._row = row
        self._check = check
        """``check(group, " in param group i")``: raises for values the step must not take (`AlgoInfo.check`, or a
        kitsune.optim optimizer's own ``_check_values``); run over every group before new values are uploaded."""
        self._where: list[str] = []
        """The groups' ``where`` for ``check``, made once for their number."""
        self.buffer: torch.Tensor | None = None
        self._ring: UploadRing | None = None  # the buffer's uploads after its first (made with the buffer)
        self._cached: tuple | None = None
        self._device_values: list[tuple[int, int, torch.Tensor]] = []
        self.uploads = 0
        """Host-to-device refreshes so far."""

    def refresh(self, groups: Sequence[dict[str, Any]]) -> bool:
        """Bring the buffer up to date with ``groups``; return whether the host values changed."""
        rows = self._rows(groups)
        changed = rows != self._cached
        if changed:
            self._check_groups(groups)
            self._upload(rows)
        for i, j, value in self._device_values:
            self.buffer[i, j].copy_(value, non_blocking=True)  # type: ignore[index]
        return changed

    def differs(self, groups: Sequence[dict[str, Any]]) -> bool:
        """Whether ``groups``' host values differ from those last uploaded (nothing is uploaded)."""
        return self._cached is not None and self._rows(groups) != self._cached

    def _check_groups(self, groups: Sequence[dict[str, Any]]) -> None:
        check = self._check
        if check is not None:
            if len(self._where) != len(groups):  # what a message says where (made once: an LR scheduler checks often)
                self._where = [f" in param group {i}" for i in range(len(groups))]
            for g, where in zip(groups, self._where, strict=True):
                check(g, where)

    def _rows(self, groups: Sequence[dict[str, Any]]) -> tuple[tuple[Any, ...], ...]:
        try:
            rows = tuple(self._row(g) for g in groups)
            if any(type(v) not in _PLAIN and changes_in_place(v) for row in rows for v in row):
                rows = tuple(tuple(_key(v) for v in row) for row in rows)
        except (TypeError, ValueError, IndexError, ArithmeticError) as exc:  # (a key deleted: torch's KeyError)
            self._check_groups(groups)  # its message, where it knows the value
            raise _unreadable(groups, self._row, exc) from exc
        return rows

    def _upload(self, rows: tuple[tuple[Any, ...], ...]) -> None:
        # the values in a Python array, then copied into the page-locked slot the upload reads (`UploadRing`): a
        # tensor's item assignment costs about a microsecond each, and an LR scheduler has a step upload every time
        for row in rows:
            if len(row) > NUM_FIELDS:
                raise ValueError(f"kitsune: a hyperparameter row holds {len(row)} values, at most {NUM_FIELDS} fit")
        try:  # every value a number, as an LR scheduler's steps leave them: one conversion in C
            values = array("d", [v for row in rows for v in (*row, *_PAD[len(row) :])])
            device_values: list[tuple[int, int, torch.Tensor]] = []
        except (TypeError, ValueError):  # a device tensor's value, or one that is not a number: value by value
            values, device_values = _convert(rows)
        self._device_values = device_values
        shape = (len(rows), NUM_FIELDS)
        if self._ring is None or self._ring.shape != shape:  # a buffer of its own memory, on a CPU too
            self.buffer = array_tensor(values, torch.float64).view(shape).to(self.device, copy=True)
            self._ring = UploadRing(shape, torch.float64, self.device)  # its slots made at its first upload
        else:  # the buffer keeps its address (kernels and captured graphs hold it); the values go through host slots
            self._ring.upload(values, self.buffer)
        self._cached = rows
        self.uploads += 1


_PAD = (0.0,) * NUM_FIELDS


def _unreadable(groups: Sequence[dict[str, Any]], row: Callable[[dict[str, Any]], Any], exc: Exception) -> Exception:
    """The error for a group whose values the step cannot read (``momentum_decay="4e-3"``, ``betas=(0.9,)``, a
    two-element tensor lr): which group, what Python said, and the fix; nothing has changed."""
    where = next((i for i, g in enumerate(groups) if not _reads(row, g)), None)
    group = "a param group" if where is None else f"param group {where}"
    kind = TypeError if isinstance(exc, TypeError) else ValueError
    return kind(
        f"kitsune: the step cannot read {group}'s hyperparameters ({type(exc).__name__}: {exc}): give each a number "
        "or a one-element tensor, and betas (etas, step_sizes) a pair of them, as torch.optim takes them. Nothing "
        "was changed."
    )


def _reads(row: Callable[[dict[str, Any]], Any], g: dict[str, Any]) -> bool:
    try:
        for v in row(g):
            if type(v) not in _PLAIN and changes_in_place(v):
                _key(v)
    except (TypeError, ValueError, IndexError, ArithmeticError):
        return False
    return True


def _convert(rows: tuple[tuple[Any, ...], ...]) -> tuple[array, list[tuple[int, int, torch.Tensor]]]:
    """The rows' values in a float64 array of ``NUM_FIELDS`` a row, and where a device tensor's value goes instead
    (row, field, tensor); a value that is not a number raises, naming it, before anything changed."""
    values = array("d", bytes(8 * NUM_FIELDS * len(rows)))
    device_values = []
    for i, row in enumerate(rows):
        for j, value in enumerate(row):
            if isinstance(value, _DeviceValue):
                device_values.append((i, j, value.tensor))
                continue
            try:
                if isinstance(value, str | bytes):  # float() would parse it; torch's step raises TypeError
                    raise TypeError("text is not a number")
                values[i * NUM_FIELDS + j] = float(value)
            except (TypeError, ValueError) as exc:  # before anything changed: the buffer keeps its values
                raise TypeError(
                    f"kitsune: param group {i} holds {value!r} ({type(value).__name__}) where its step reads a "
                    f"number ({exc}): give the hyperparameter a number or a one-element tensor, as torch.optim "
                    "takes it. Nothing was changed."
                ) from exc
    return values, device_values


class _DeviceValue:
    """A hyperparameter held in a device tensor: equal while it is the same tensor (its value is copied each step)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _DeviceValue) and other.tensor is self.tensor

    def __hash__(self) -> int:
        return id(self.tensor)


_PLAIN = frozenset({float, int, bool, type(None)})
"""The types most hyperparameters have, none of which changes in place: `changes_in_place` is not asked about them."""


def changes_in_place(value: Any) -> bool:
    """Whether ``value`` may hold another number while it stays the same object, so that comparing it by identity
    (as a tuple of the groups' values does first) misses the change: a tensor (LRScheduler does ``lr.fill_()`` on a
    tensor lr) or a NumPy array (``lr[...] = x``)."""
    if isinstance(value, torch.Tensor):
        return True
    numpy = sys.modules.get("numpy")  # not imported: no array can exist
    return numpy is not None and isinstance(value, numpy.ndarray)


def _key(value: Any) -> Any:
    # a value that changes in place is compared by its value: a CPU tensor's or an array's read without a sync, a
    # device tensor's copied every step
    if isinstance(value, torch.Tensor):
        return float(value) if value.device.type == "cpu" else _DeviceValue(value)
    if changes_in_place(value):
        try:
            return float(value)
        except (TypeError, ValueError):  # not one number: the upload raises, naming it
            return value
    return value
