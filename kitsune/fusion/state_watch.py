"""Seeing optimizer state replaced by hand while other code keeps the old tensors alive.

torch reads ``optimizer.state`` every step; the fused units bind the state tensors' addresses when they plan. A bound
tensor that is freed (``state[p]["exp_avg"] = t`` with nothing else holding the old one, ``state.clear()``) the
units see through weak references (`kitsune.fusion.units.FusedUnit.bind`), and the state dict replaced, or params
added to it or taken out, the executor sees by identity and length. What neither sees is a tensor, or a param's whole
dict, replaced while a list, a logger or a ``state_dict()`` taken before keeps the old one alive: the kernels would go
on updating the old tensor, and the step would leave torch's trajectory with no error.

`StateWatch` sees it without visiting every param in Python each step: `kitsune._native` watches the state dict and
each bound param's dict (a dict watcher from Python 3.12, so a step compares one number; on 3.11 each dict's version
tag, one read a dict). Where one of them changed, the entries are compared with what the units bound: a value set to
itself, or a change outside the bound params' tensors, holds the plan; anything else plans again from the state as
it is then. Until the native module is built, or with ``FusionConfig(native_checks=False)``, every step compares
the entries in Python (about 0.1 us an entry).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kitsune import _native


class StateWatch:
    """The fused units' state as their last bindings left it (`follow`), and whether it changed since (`changed`).

    It holds the state dict and the bound params (which the executor holds anyway) and only the ids of the values
    bound, never a state tensor or a param's dict: a bound tensor lives while its unit's weak reference to it does
    (`kitsune.fusion.units.FusedUnit.state_freed` sees it freed), so while it lives an equal id is the same tensor,
    and an old dict or tensor replaced is freed as it would be without kitsune."""

    def __init__(self, native: bool = True) -> None:
        self.native = native
        """``FusionConfig.native_checks``: watch through the native module once it is built."""
        self._state: Any = None
        self._bindings: tuple[int, ...] = ()
        self._held: list[tuple[torch.Tensor, int, list[tuple[str, int]]]] = []
        self._positions = torch.zeros(0, dtype=torch.int64)
        self._versions = torch.zeros(1, dtype=torch.int64)
        self._mark = -1
        self.compared = 0
        """Steps that compared the entries themselves (a dict changed, or no native watch)."""

    def follow(self, state: Any, units: Sequence[Any]) -> None:
        """After a plan or a step: watch the dicts of the units' bindings where any unit bound anew since (a plan, a
        load, lazy state made in the step); otherwise nothing changes (what changed meanwhile, `changed` sees)."""
        bindings = tuple(u.binding for u in units)
        if state is self._state and bindings == self._bindings:
            return
        before = [p for p, _, _ in self._held]
        self._state, self._bindings = state, bindings
        self._held = [h for u in units for h in u.held]
        held = {id(p) for p, _, _ in self._held}
        self._unwatch([p for p in before if id(p) not in held])
        self._watch()

    def changed(self) -> bool:
        """Whether a bound param's state dict, or a tensor in it, was replaced since `follow` (or since the last
        step that found every entry as bound)."""
        checks = _native.CHECKS if self.native else None
        state = self._state
        if checks is not None and self._mark >= 0:
            if checks.state_unchanged(state, self._positions, self._versions, self._mark):
                return False
        self.compared += 1
        for p, size, entries in self._held:
            d = state.get(p)
            if d is None or len(d) != size:
                return True
            for key, value in entries:
                if id(d.get(key)) != value:
                    return True
        self._watch()  # every entry as bound: a value set to itself, or a change elsewhere in the state
        return False

    def _unwatch(self, params: list[torch.Tensor]) -> None:
        """Watch the dicts of ``params`` no more (3.12+), where the state still holds them: a param the wrapped
        optimizer's own step updates now (SGD's sets its momentum buffer in its dict each step) would otherwise send
        every step to the comparison."""
        checks = _native.CHECKS
        if checks is not None and params and self._state is not None:
            dicts = [self._state.get(p) for p in params]
            checks.unmark_dicts([d for d in dicts if isinstance(d, dict)])

    def _watch(self) -> None:
        """Mark the state as it is now: the places of the bound params' dicts in it taken afresh (entries removed and
        put back, or an OrderedDict's ``move_to_end``, move them), in the order the native walk reads a dict's
        entries (``dict.__iter__``: an OrderedDict's own order may differ)."""
        checks = _native.CHECKS if self.native else None
        state = self._state
        if checks is None or state is None:
            self._mark = -1
            return
        held = {id(p) for p, _, _ in self._held}
        places = [i for i, p in enumerate(dict.__iter__(state)) if id(p) in held]
        self._positions = torch.tensor(places, dtype=torch.int64)
        self._versions = torch.zeros(1 + len(places), dtype=torch.int64)
        self._mark = checks.mark_state(state, self._positions, self._versions)
