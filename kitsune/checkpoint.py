"""kitsune's own part of a checkpoint: the ``"kitsune"`` entry of ``KitsuneOptimizer.state_dict()``.

It holds the step count and what each subsystem must keep (the loss scaler's scale, ZeRO's layout); torch's
``load_state_dict`` ignores the key, so the state dict still loads into the plain torch optimizer. Copies and
pickles of the optimizer carry the same entry.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kitsune.subsystem import Subsystem

KEY = "kitsune"
"""The one extra key kitsune adds to ``state_dict()``."""
VERSION = 1


def own_state(subsystems: Sequence[Subsystem], step_count: int) -> dict[str, Any]:
    """The ``"kitsune"`` entry: the format version, the step count and each subsystem's state (where it has any)."""
    saved = {s.name: s.state_dict() for s in subsystems}
    return {"version": VERSION, "step_count": step_count, "subsystems": {n: st for n, st in saved.items() if st}}


def check_own_state(ours: Any, subsystems: Sequence[Subsystem]) -> dict[str, Any]:
    """Raise where ``ours`` (a ``"kitsune"`` entry, or None) cannot be loaded; changes nothing."""
    if ours is None:
        return {}
    if not isinstance(ours, Mapping):
        raise ValueError(f"the state dict's {KEY!r} entry must be a dict, got {type(ours).__name__}")
    unknown = sorted(map(str, set(ours) - {"version", "step_count", "subsystems"}))
    if unknown:
        raise ValueError(
            f"the state dict's {KEY!r} entry has keys kitsune does not write ({', '.join(unknown)}): it holds "
            "version, step_count and subsystems. Drop the entry to load the optimizer's state alone."
        )
    for key in ("version", "step_count"):
        value = ours.get(key, 0)
        if type(value) is not int or value < 0:  # bool is no count either
            raise ValueError(f"the state dict's {KEY!r} entry has {key}={value!r}: a whole number >= 0 is expected")
    if ours.get("version", 0) > VERSION:
        raise ValueError(
            f"this checkpoint's kitsune state has version {ours['version']}, newer than this kitsune "
            f"understands ({VERSION}): install a newer kitsune to load it (git pull in your clone, then pip install .)"
        )
    saved = ours.get("subsystems", {})
    if not isinstance(saved, Mapping):
        raise ValueError(f"the state dict's {KEY!r} entry has subsystems of type {type(saved).__name__}: a dict")
    names = {s.name for s in subsystems}
    unknown = sorted(map(str, set(saved) - names))
    if unknown:  # a typo or an edit: the state under it would be dropped without a word
        raise ValueError(
            f"the state dict's {KEY!r} entry has subsystems kitsune does not have ({', '.join(unknown)}); its "
            f"subsystems are {', '.join(sorted(names))}. Drop the entry to load the optimizer's state alone."
        )
    for s in subsystems:
        if s.name in saved:
            s.check_state_dict(saved[s.name])
    return dict(ours)


def load_own_state(ours: dict[str, Any], subsystems: Sequence[Subsystem]) -> int | None:
    """Load a checked entry into ``subsystems``; returns the saved step count (None where the entry has none)."""
    saved = ours.get("subsystems", {})
    for s in subsystems:
        if s.name in saved:
            s.load_state_dict(saved[s.name])
    return ours.get("step_count")
